//! `cargo xtask bench-hw memory`: the safe API against the same driver sequences in plain calls,
//! side by side, in one run.
//!
//! 1. The VMM cycle (create, reserve, map, set access, unmap, free VA, release) at 2 MiB, 64 MiB
//!    and 1 GiB: `cuda-multimem` against a C baseline calling the same driver entry points.
//! 2. Managed memory: prefetch of 4 GiB each way against a pinned `cuMemcpy`.
//! 3. Many ranges (4096 × 64 KiB, 2048 × 2 MiB): loop of prefetches, batch prefetch, batch discard,
//!    batch discard-and-prefetch — ours against raw driver calls — and what `Auto` picks.
//!
//! Timing: host clocks around synchronous driver sequences (VMM), CUDA events around stream work
//! (managed). Medians of `--reps` repetitions, native and ours interleaved so drift hits both.

// FFI structs with unions are filled field by field after `Default::default()`.
#![allow(clippy::field_reassign_with_default)]

use std::ffi::c_void;
use std::time::Instant;

use cuda_multimem::sys::*;
use cuda_multimem::vmm::{Access, Location, Mapping, PhysicalAllocation, Reservation};
use cuda_multimem::{Driver, Result};

#[repr(C)]
struct VmmFns {
    create: FnOf<PFN_cuMemCreate_v10020>,
    release: FnOf<PFN_cuMemRelease_v10020>,
    reserve: FnOf<PFN_cuMemAddressReserve_v10020>,
    free_va: FnOf<PFN_cuMemAddressFree_v10020>,
    map: FnOf<PFN_cuMemMap_v10020>,
    unmap: FnOf<PFN_cuMemUnmap_v10020>,
    set_access: FnOf<PFN_cuMemSetAccess_v10020>,
}

extern "C" {
    fn native_vmm_cycle(
        f: *const VmmFns,
        prop: *const c_void,
        desc: *const c_void,
        size: usize,
        out: *mut f64,
    ) -> i32;
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn vmm_cycle(driver: &Driver, reps: usize) -> Result<()> {
    let d = driver.device(0)?;
    d.bind()?;
    let sys = driver.sys();
    let fns = VmmFns {
        create: sys.cuMemCreate_v10020()?,
        release: sys.cuMemRelease_v10020()?,
        reserve: sys.cuMemAddressReserve_v10020()?,
        free_va: sys.cuMemAddressFree_v10020()?,
        map: sys.cuMemMap_v10020()?,
        unmap: sys.cuMemUnmap_v10020()?,
        set_access: sys.cuMemSetAccess_v10020()?,
    };
    let mut prop = CUmemAllocationProp::default();
    prop.type_ = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.__bindgen_anon_1.id = 0;
    let mut desc = CUmemAccessDesc::default();
    desc.location = prop.location;
    desc.flags = CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    println!("\nVMM cycle (create, reserve, map, set access, unmap, free VA, release), device 0, median of {reps}");
    println!("{:>8} {:>12} {:>12} {:>8}   native steps (µs): create reserve map access unmap free release", "size", "native_us", "ours_us", "ours/nat");
    for size in [2usize << 20, 64 << 20, 1 << 30] {
        let (mut nat, mut ours) = (Vec::new(), Vec::new());
        let mut steps = vec![Vec::new(); 8];
        for i in 0..reps + 2 {
            let mut out = [0f64; 8];
            // SAFETY: the function table holds this driver's entry points; prop and desc are
            // valid structs; out has 8 slots.
            let rc = unsafe {
                native_vmm_cycle(
                    &fns,
                    &prop as *const _ as *const c_void,
                    &desc as *const _ as *const c_void,
                    size,
                    out.as_mut_ptr(),
                )
            };
            if rc != 0 {
                return Err(cuda_multimem::Error::Driver {
                    call: "native_vmm_cycle",
                    code: CUresult(rc as u32),
                });
            }
            let t = Instant::now();
            {
                let a = PhysicalAllocation::builder(driver, Location::Device(0)).create(size)?;
                let r = Reservation::new(driver, size)?;
                let m = Mapping::new(&r, 0, &a, 0, size)?;
                m.set_access(&[(Location::Device(0), Access::ReadWrite)])?;
            }
            let ours_us = t.elapsed().as_secs_f64() * 1e6;
            if i >= 2 {
                nat.push(out[0]);
                ours.push(ours_us);
                for (k, s) in steps.iter_mut().enumerate() {
                    s.push(out[k]);
                }
            }
        }
        let (n, o) = (median(&mut nat), median(&mut ours));
        let st: Vec<String> = steps
            .iter_mut()
            .skip(1)
            .map(|s| format!("{:.0}", median(s)))
            .collect();
        println!(
            "{:>8} {:>12.1} {:>12.1} {:>7.1}%   {}",
            human(size),
            n,
            o,
            (o / n - 1.0) * 100.0,
            st.join(" ")
        );
        println!("RESULT {{\"bench\":\"vmm_cycle\",\"bytes\":{size},\"native_us\":{n:.2},\"ours_us\":{o:.2}}}");
    }
    Ok(())
}

fn human(b: usize) -> String {
    if b >= 1 << 30 {
        format!("{} GiB", b >> 30)
    } else if b >= 1 << 20 {
        format!("{} MiB", b >> 20)
    } else {
        format!("{} KiB", b >> 10)
    }
}

fn main() {
    let reps = arg("--reps", 21);
    let driver = match cuda_multimem_sim::driver_from_env() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("bench-memory: {e}");
            std::process::exit(2);
        }
    };
    println!(
        "bench-memory: driver {} ({}), {} device(s){}",
        driver.version(),
        driver.sys().origin(),
        driver.device_count(),
        if driver.is_simulated() {
            " [SIMULATED: timings mean nothing]"
        } else {
            ""
        }
    );
    let mut failed = false;
    for (name, r) in [
        ("vmm cycle", vmm_cycle(&driver, reps)),
        ("managed", managed::run(&driver, reps)),
    ] {
        if let Err(e) = r {
            eprintln!("bench-memory: {name}: {e}");
            failed = true;
        }
    }
    if failed {
        std::process::exit(1);
    }
}

mod managed {
    use super::*;
    use cuda_multimem::managed::{self, Location as ML, ManagedBuffer, PrefetchPolicy};
    use cuda_multimem::{Event, Stream};

    fn dev_loc(d: i32) -> CUmemLocation {
        let mut l = CUmemLocation::default();
        l.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        l.__bindgen_anon_1.id = d;
        l
    }

    fn host_loc() -> CUmemLocation {
        let mut l = CUmemLocation::default();
        l.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST;
        l
    }

    /// Time the stream work that `f` queues, in milliseconds (CUDA events).
    fn timed(stream: &Stream, a: &Event, b: &Event, f: impl FnOnce() -> Result<()>) -> Result<f64> {
        stream.synchronize()?;
        a.record(stream)?;
        f()?;
        b.record(stream)?;
        b.synchronize()?;
        Ok(b.elapsed_since(a)?.as_secs_f64() * 1e3)
    }

    fn check(call: &'static str, rc: CUresult) -> Result<()> {
        if rc == CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(cuda_multimem::Error::Driver { call, code: rc })
        }
    }

    /// The bytes of a location (it holds a union), to compare two of them.
    fn loc_bytes(l: &cuda_multimem::sys::CUmemLocation) -> [u8; 8] {
        const _: () = assert!(std::mem::size_of::<cuda_multimem::sys::CUmemLocation>() == 8);
        // SAFETY: an 8-byte plain-data struct (checked above), read as bytes.
        unsafe { std::mem::transmute_copy(l) }
    }

    fn touch_on_host(buf: &mut ManagedBuffer, v: u8) -> Result<()> {
        buf.host_slice_mut()?.fill(v);
        Ok(())
    }

    pub fn run(driver: &Driver, reps: usize) -> Result<()> {
        let dev = driver.device(0)?;
        dev.bind()?;
        let stream = Stream::new(&dev)?;
        let (a, b) = (Event::new(&dev, true)?, Event::new(&dev, true)?);
        let sys = driver.sys();
        let reps_big = reps.clamp(1, 3);

        // 1. Prefetch 4 GiB each way, against a pinned copy of the same size.
        let size: usize = 4 << 30;
        let gbs = |ms: f64| size as f64 / (ms * 1e-3) / 1e9;
        let mut buf = ManagedBuffer::new(&dev, size)?;
        let prefetch_raw = sys.cuMemPrefetchAsync_v12020()?;
        let (mut o_h2d, mut o_d2h, mut n_h2d, mut n_d2h) = (vec![], vec![], vec![], vec![]);
        for i in 0..reps_big + 1 {
            touch_on_host(&mut buf, i as u8)?;
            let t1 = timed(&stream, &a, &b, || buf.prefetch(ML::Device(0), &stream))?;
            let t2 = timed(&stream, &a, &b, || buf.prefetch(ML::Host, &stream))?;
            touch_on_host(&mut buf, i as u8 + 1)?;
            let p = buf.as_ptr();
            // SAFETY: a live managed range, a live stream, flags 0.
            let t3 = timed(&stream, &a, &b, || {
                check("cuMemPrefetchAsync", unsafe {
                    prefetch_raw(p, size, dev_loc(0), 0, stream.raw())
                })
            })?;
            // SAFETY: as above.
            let t4 = timed(&stream, &a, &b, || {
                check("cuMemPrefetchAsync", unsafe {
                    prefetch_raw(p, size, host_loc(), 0, stream.raw())
                })
            })?;
            if i > 0 {
                o_h2d.push(t1);
                o_d2h.push(t2);
                n_h2d.push(t3);
                n_d2h.push(t4);
            }
        }
        drop(buf);
        // Pinned copies.
        let (mut c_h2d, mut c_d2h) = (vec![], vec![]);
        {
            let mut host: *mut c_void = std::ptr::null_mut();
            let mut dptr: CUdeviceptr = 0;
            // SAFETY: out-pointers valid; a context is current.
            check("cuMemAllocHost", unsafe {
                sys.cuMemAllocHost_v3020()?(&mut host, size)
            })?;
            // SAFETY: as above.
            let alloc = unsafe { sys.cuMemAlloc_v3020()?(&mut dptr, size) };
            if alloc == CUresult::CUDA_SUCCESS {
                let h2d = sys.cuMemcpyHtoDAsync_v3020()?;
                let d2h = sys.cuMemcpyDtoHAsync_v3020()?;
                for i in 0..reps_big + 1 {
                    // SAFETY: both buffers hold `size` bytes and live until freed below.
                    let t1 = timed(&stream, &a, &b, || {
                        check("cuMemcpyHtoDAsync", unsafe {
                            h2d(dptr, host, size, stream.raw())
                        })
                    })?;
                    // SAFETY: as above.
                    let t2 = timed(&stream, &a, &b, || {
                        check("cuMemcpyDtoHAsync", unsafe {
                            d2h(host, dptr, size, stream.raw())
                        })
                    })?;
                    if i > 0 {
                        c_h2d.push(t1);
                        c_d2h.push(t2);
                    }
                }
                // SAFETY: allocated above, no work pending (timed synchronises).
                unsafe { sys.cuMemFree_v3020()?(dptr) };
            }
            // SAFETY: allocated above.
            unsafe { sys.cuMemFreeHost()?(host) };
            check("cuMemAlloc", alloc)?;
        }
        println!("\nManaged prefetch of 4 GiB (device 0), GB/s, median of {reps_big}");
        println!(
            "{:>16} {:>10} {:>10} {:>14}",
            "direction", "native", "ours", "pinned cuMemcpy"
        );
        for (dir, n, o, c) in [
            ("host -> device", &mut n_h2d, &mut o_h2d, &mut c_h2d),
            ("device -> host", &mut n_d2h, &mut o_d2h, &mut c_d2h),
        ] {
            let (n, o, c) = (gbs(median(n)), gbs(median(o)), gbs(median(c)));
            println!("{dir:>16} {n:>10.1} {o:>10.1} {c:>14.1}");
            println!("RESULT {{\"bench\":\"prefetch_4gib\",\"direction\":\"{dir}\",\"native_gbs\":{n:.2},\"ours_gbs\":{o:.2},\"pinned_gbs\":{c:.2}}}");
        }

        // 2. Many ranges: loop, batch, discard, discard-and-prefetch.
        let batch_raw = sys.cuMemPrefetchBatchAsync().ok();
        let discard_raw = sys.cuMemDiscardBatchAsync().ok();
        let dp_raw = sys.cuMemDiscardAndPrefetchBatchAsync().ok();
        println!("\nMany managed ranges, first touched on the host, moved to device 0; ms, median of {reps_big}");
        println!(
            "{:>14} {:>8} | {:>9} {:>9} | {:>9} {:>9} | {:>9} | {:>9} {:>9} | {:>9} {:>9}",
            "ranges",
            "",
            "loop nat",
            "loop ours",
            "batch nat",
            "batch our",
            "auto ours",
            "disc nat",
            "disc ours",
            "d+p nat",
            "d+p ours"
        );
        for (count, rsize) in [(4096usize, 64usize << 10), (2048, 2 << 20)] {
            let mut buf = ManagedBuffer::new(&dev, count * rsize)?;
            let base = buf.as_ptr();
            let mut ptrs: Vec<CUdeviceptr> =
                (0..count).map(|i| base + (i * rsize) as u64).collect();
            let mut sizes = vec![rsize; count];
            let mut locs = [dev_loc(0)];
            let mut idx = [0usize];
            let mut cols: Vec<Vec<f64>> = vec![Vec::new(); 9];
            for i in 0..reps_big + 1 {
                let mut t = [f64::NAN; 9];
                // Each measurement starts from the same page state: everything resident on
                // device 0, then touched on the host (so whatever the previous measurement did —
                // a discard, say — cannot favour the next one).
                // our side's ranges, built inside the timed call as a caller would
                macro_rules! subranges {
                    () => {
                        (0..count)
                            .map(|k| buf.subrange(k * rsize, rsize))
                            .collect::<Result<Vec<_>>>()?
                    };
                }
                macro_rules! measure {
                    ($k:expr, $body:expr) => {{
                        buf.prefetch(ML::Device(0), &stream)?;
                        stream.synchronize()?;
                        touch_on_host(&mut buf, (i + $k) as u8)?;
                        let host = std::time::Instant::now();
                        t[$k] = timed(&stream, &a, &b, || $body)?;
                        if std::env::var_os("BENCH_DIAG").is_some() {
                            println!(
                                "diag: {count} x {rsize} B, repetition {i}, measurement {}: events {:.2} ms, host (call and wait) {:.2} ms",
                                $k,
                                t[$k],
                                host.elapsed().as_secs_f64() * 1e3
                            );
                        }
                        // The batch calls take their arrays as mutable pointers: if the driver
                        // rewrote them, say so and restore them, so the next native call gets
                        // the same input as ours (which builds fresh arrays every call).
                        let changed = ptrs
                            .iter()
                            .zip(&sizes)
                            .enumerate()
                            .filter(|(j, (p, z))| **p != base + (j * rsize) as u64 || **z != rsize)
                            .count();
                        if changed > 0 {
                            println!(
                                "note: measurement {} ({count} x {rsize} B, repetition {i}): the driver rewrote {changed} of the {count} pointer/size entries; restored",
                                $k
                            );
                            for (j, (p, z)) in ptrs.iter_mut().zip(sizes.iter_mut()).enumerate() {
                                *p = base + (j * rsize) as u64;
                                *z = rsize;
                            }
                        }
                        if loc_bytes(&locs[0]) != loc_bytes(&dev_loc(0)) || idx[0] != 0 {
                            println!("note: measurement {}: the driver rewrote the location arrays; restored", $k);
                            locs[0] = dev_loc(0);
                            idx[0] = 0;
                        }
                    }};
                }
                // Native and ours alternate which goes first from one repetition to the next,
                // so an order effect the reset does not remove cannot favour one side.
                let order: [usize; 9] = if i % 2 == 0 {
                    [0, 1, 2, 3, 4, 5, 6, 7, 8]
                } else {
                    [1, 0, 3, 2, 4, 6, 5, 8, 7]
                };
                for k in order {
                    match k {
                        0 => measure!(0, {
                            for p in &ptrs {
                                // SAFETY: each range lies in the live managed buffer.
                                check("cuMemPrefetchAsync", unsafe {
                                    prefetch_raw(*p, rsize, dev_loc(0), 0, stream.raw())
                                })?;
                            }
                            Ok(())
                        }),
                        1 => measure!(1, {
                            let r = subranges!();
                            managed::prefetch_many_with(
                                &r,
                                &[ML::Device(0)],
                                &stream,
                                PrefetchPolicy::Loop,
                            )
                        }),
                        2 => {
                            if let Some(f) = batch_raw {
                                // SAFETY: arrays of `count` ranges inside the live buffer, one
                                // location.
                                measure!(
                                    2,
                                    check("cuMemPrefetchBatchAsync", unsafe {
                                        f(
                                            ptrs.as_mut_ptr(),
                                            sizes.as_mut_ptr(),
                                            count,
                                            locs.as_mut_ptr(),
                                            idx.as_mut_ptr(),
                                            1,
                                            0,
                                            stream.raw(),
                                        )
                                    })
                                );
                            }
                        }
                        3 => {
                            if batch_raw.is_some() {
                                measure!(3, {
                                    let r = subranges!();
                                    managed::prefetch_many_with(
                                        &r,
                                        &[ML::Device(0)],
                                        &stream,
                                        PrefetchPolicy::Batch,
                                    )
                                });
                            }
                        }
                        4 => measure!(4, {
                            let r = subranges!();
                            managed::prefetch_many(&r, &[ML::Device(0)], &stream)
                        }),
                        5 => {
                            if let Some(d) = discard_raw.filter(|_| dp_raw.is_some()) {
                                // SAFETY: as above.
                                measure!(
                                    5,
                                    check("cuMemDiscardBatchAsync", unsafe {
                                        d(
                                            ptrs.as_mut_ptr(),
                                            sizes.as_mut_ptr(),
                                            count,
                                            0,
                                            stream.raw(),
                                        )
                                    })
                                );
                            }
                        }
                        6 => {
                            if discard_raw.is_some() && dp_raw.is_some() {
                                measure!(6, {
                                    let r = subranges!();
                                    managed::discard_many(&r, &stream)
                                });
                            }
                        }
                        7 => {
                            if let Some(dp) = dp_raw.filter(|_| discard_raw.is_some()) {
                                // SAFETY: as above.
                                measure!(
                                    7,
                                    check("cuMemDiscardAndPrefetchBatchAsync", unsafe {
                                        dp(
                                            ptrs.as_mut_ptr(),
                                            sizes.as_mut_ptr(),
                                            count,
                                            locs.as_mut_ptr(),
                                            idx.as_mut_ptr(),
                                            1,
                                            0,
                                            stream.raw(),
                                        )
                                    })
                                );
                            }
                        }
                        _ => {
                            if discard_raw.is_some() && dp_raw.is_some() {
                                measure!(8, {
                                    let r = subranges!();
                                    managed::discard_and_prefetch_many(
                                        &r,
                                        &[ML::Device(0)],
                                        &stream,
                                    )
                                });
                            }
                        }
                    }
                }
                if i > 0 {
                    for (c, v) in cols.iter_mut().zip(t) {
                        c.push(v);
                    }
                }
            }
            let m: Vec<f64> = cols.iter_mut().map(|c| median(c)).collect();
            println!("{:>14} {:>8} | {:>9.1} {:>9.1} | {:>9.1} {:>9.1} | {:>9.1} | {:>9.1} {:>9.1} | {:>9.1} {:>9.1}",
                format!("{count} x {}", human(rsize)), "", m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7], m[8]);
            println!("RESULT {{\"bench\":\"ranges\",\"count\":{count},\"range_bytes\":{rsize},\"loop_native_ms\":{:.2},\"loop_ours_ms\":{:.2},\"batch_native_ms\":{:.2},\"batch_ours_ms\":{:.2},\"auto_ours_ms\":{:.2},\"discard_native_ms\":{:.2},\"discard_ours_ms\":{:.2},\"dp_native_ms\":{:.2},\"dp_ours_ms\":{:.2}}}",
                m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7], m[8]);
        }
        Ok(())
    }
}
