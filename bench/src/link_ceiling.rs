//! What the link between two GPUs moves, one way and both ways at once, by the copy engines
//! and by kernels: the ceiling the large-message allreduce is measured against (a two-rank
//! allreduce moves the whole message each way). Tuning tool for the GPU machine:
//!
//! `CUDA_MULTIMEM_DRIVER=cuda link_ceiling [--bytes B] [--runs R]`
//!
//! Modes: `ce` (`cuMemcpyDtoDAsync` between the two devices' memory), `sm` (every thread copies
//! 16-byte vectors from local memory to the peer, block-contiguous ranges as the allreduce
//! kernels walk them), `sm4` (the same, four loads in flight per thread), `bulk` (thread 0 of
//! each block moves 32 KiB chunks with `cp.async.bulk` through shared memory). Each mode runs
//! one way (device 0 writes to device 1) and both ways (each device writes to the other), timed
//! with CUDA events on each device (the slower device counts), median of the runs. Then both
//! movers at once, both ways: a fraction of the bytes by the copy engines on a second stream,
//! the rest by `sm` beside it. Last (`ce-rs`), a two-rank reduce-scatter whose transfer is all
//! copy engines, in pieces with a flag copy each, the receiver adding each piece as it lands.

use std::ffi::c_void;
use std::process::ExitCode;

use cuda_multimem::sys as cuda_multimem_sys;
use cuda_multimem::{Device, DeviceBuffer, Driver, Event, Stream};
use cuda_multimem_collectives::{Communicator, SymmetricBuffer};
use cuda_multimem_sys::{CUfunction, CUmodule, CUresult};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const PTX: &str = r#"
.version 8.1
.target sm_90
.address_size 64

// dst[i] = src[i] for 16-byte units i of block b's range [b*per, min((b+1)*per, n)), per
// rounded up to 8 units (blocks start on 128-byte lines, as in the allreduce kernels)
.visible .entry sm_copy(.param .u64 p_dst, .param .u64 p_src, .param .u64 p_n)
{
	.reg .pred %p<4>;
	.reg .b32 %r<40>;
	.reg .b64 %rd<32>;
	ld.param.u64 %rd1, [p_dst];
	ld.param.u64 %rd2, [p_src];
	ld.param.u64 %rd3, [p_n];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, %ctaid.x;
	mov.u32 %r3, %ntid.x;
	mov.u32 %r4, %nctaid.x;
	cvt.u64.u32 %rd4, %r4;
	add.u64 %rd5, %rd3, %rd4;
	sub.u64 %rd5, %rd5, 1;
	div.u64 %rd5, %rd5, %rd4;
	add.u64 %rd5, %rd5, 7;
	and.b64 %rd5, %rd5, -8;
	cvt.u64.u32 %rd6, %r2;
	mul.lo.u64 %rd7, %rd6, %rd5;
	min.u64 %rd7, %rd7, %rd3;
	add.u64 %rd8, %rd7, %rd5;
	min.u64 %rd8, %rd8, %rd3;
	cvt.u64.u32 %rd9, %r1;
	add.u64 %rd10, %rd7, %rd9;
	cvt.u64.u32 %rd11, %r3;
L1:
	setp.ge.u64 %p1, %rd10, %rd8;
	@%p1 bra L1_END;
	shl.b64 %rd12, %rd10, 4;
	add.u64 %rd13, %rd2, %rd12;
	ld.global.v4.b32 {%r10, %r11, %r12, %r13}, [%rd13];
	add.u64 %rd14, %rd1, %rd12;
	st.global.v4.b32 [%rd14], {%r10, %r11, %r12, %r13};
	add.u64 %rd10, %rd10, %rd11;
	bra.uni L1;
L1_END:
	ret;
}

// as sm_copy, four units per thread in flight (units i, i+T, i+2T, i+3T)
.visible .entry sm_copy4(.param .u64 p_dst, .param .u64 p_src, .param .u64 p_n)
{
	.reg .pred %p<4>;
	.reg .b32 %r<40>;
	.reg .b64 %rd<32>;
	ld.param.u64 %rd1, [p_dst];
	ld.param.u64 %rd2, [p_src];
	ld.param.u64 %rd3, [p_n];
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, %ctaid.x;
	mov.u32 %r3, %ntid.x;
	mov.u32 %r4, %nctaid.x;
	cvt.u64.u32 %rd4, %r4;
	add.u64 %rd5, %rd3, %rd4;
	sub.u64 %rd5, %rd5, 1;
	div.u64 %rd5, %rd5, %rd4;
	add.u64 %rd5, %rd5, 7;
	and.b64 %rd5, %rd5, -8;
	cvt.u64.u32 %rd6, %r2;
	mul.lo.u64 %rd7, %rd6, %rd5;
	min.u64 %rd7, %rd7, %rd3;
	add.u64 %rd8, %rd7, %rd5;
	min.u64 %rd8, %rd8, %rd3;
	cvt.u64.u32 %rd9, %r1;
	add.u64 %rd10, %rd7, %rd9;
	cvt.u64.u32 %rd11, %r3;
	shl.b64 %rd15, %rd11, 4;
	shl.b64 %rd16, %rd11, 2;
L4:
	mad.lo.u64 %rd17, %rd11, 3, %rd10;
	setp.ge.u64 %p1, %rd17, %rd8;
	@%p1 bra L1;
	shl.b64 %rd12, %rd10, 4;
	add.u64 %rd13, %rd2, %rd12;
	ld.global.v4.b32 {%r10, %r11, %r12, %r13}, [%rd13];
	add.u64 %rd13, %rd13, %rd15;
	ld.global.v4.b32 {%r14, %r15, %r16, %r17}, [%rd13];
	add.u64 %rd13, %rd13, %rd15;
	ld.global.v4.b32 {%r18, %r19, %r20, %r21}, [%rd13];
	add.u64 %rd13, %rd13, %rd15;
	ld.global.v4.b32 {%r22, %r23, %r24, %r25}, [%rd13];
	add.u64 %rd14, %rd1, %rd12;
	st.global.v4.b32 [%rd14], {%r10, %r11, %r12, %r13};
	add.u64 %rd14, %rd14, %rd15;
	st.global.v4.b32 [%rd14], {%r14, %r15, %r16, %r17};
	add.u64 %rd14, %rd14, %rd15;
	st.global.v4.b32 [%rd14], {%r18, %r19, %r20, %r21};
	add.u64 %rd14, %rd14, %rd15;
	st.global.v4.b32 [%rd14], {%r22, %r23, %r24, %r25};
	add.u64 %rd10, %rd10, %rd16;
	bra.uni L4;
L1:
	setp.ge.u64 %p1, %rd10, %rd8;
	@%p1 bra L1_END;
	shl.b64 %rd12, %rd10, 4;
	add.u64 %rd13, %rd2, %rd12;
	ld.global.v4.b32 {%r10, %r11, %r12, %r13}, [%rd13];
	add.u64 %rd14, %rd1, %rd12;
	st.global.v4.b32 [%rd14], {%r10, %r11, %r12, %r13};
	add.u64 %rd10, %rd10, %rd11;
	bra.uni L1;
L1_END:
	ret;
}

// thread 0 of each block: chunks c = b, b+G, ... of 32 KiB: global -> shared (cp.async.bulk,
// mbarrier), shared -> peer (cp.async.bulk bulk_group), wait until shared is read again
.extern .shared .align 128 .b8 smem[];
.visible .entry bulk_copy(.param .u64 p_dst, .param .u64 p_src, .param .u64 p_n)
{
	.reg .pred %p<4>;
	.reg .b32 %r<16>;
	.reg .b64 %rd<32>;
	.shared .align 8 .b64 mbar;
	mov.u32 %r1, %tid.x;
	setp.ne.u32 %p1, %r1, 0;
	@%p1 bra DONE;
	ld.param.u64 %rd1, [p_dst];
	ld.param.u64 %rd2, [p_src];
	ld.param.u64 %rd3, [p_n];
	shl.b64 %rd3, %rd3, 4;
	mov.u32 %r2, %ctaid.x;
	mov.u32 %r4, %nctaid.x;
	mov.u32 %r5, smem;
	mov.u32 %r6, mbar;
	mbarrier.init.shared.b64 [%r6], 1;
	fence.mbarrier_init.release.cluster;
	fence.proxy.async.shared::cta;
	mov.u32 %r7, 0;
	cvt.u64.u32 %rd5, %r2;
	cvt.u64.u32 %rd6, %r4;
LOOP:
	shl.b64 %rd7, %rd5, 15;
	setp.ge.u64 %p2, %rd7, %rd3;
	@%p2 bra END;
	sub.u64 %rd8, %rd3, %rd7;
	min.u64 %rd8, %rd8, 32768;
	cvt.u32.u64 %r8, %rd8;
	add.u64 %rd9, %rd2, %rd7;
	add.u64 %rd10, %rd1, %rd7;
	mbarrier.arrive.expect_tx.shared.b64 %rd11, [%r6], %r8;
	cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r5], [%rd9], %r8, [%r6];
WAIT:
	mbarrier.try_wait.parity.shared.b64 %p3, [%r6], %r7;
	@!%p3 bra WAIT;
	xor.b32 %r7, %r7, 1;
	cp.async.bulk.global.shared::cta.bulk_group [%rd10], [%r5], %r8;
	cp.async.bulk.commit_group;
	cp.async.bulk.wait_group.read 0;
	add.u64 %rd5, %rd5, %rd6;
	bra.uni LOOP;
END:
	cp.async.bulk.wait_group 0;
DONE:
	ret;
}

// The receiving side of a reduce-scatter whose data arrive by copy engine in pieces, each
// followed by a 4-byte flag copy (value = epoch): for piece i in order, thread 0 of every
// block waits for flags[i] == epoch (at most 2^28 polls), then the grid adds the piece,
// out = mine + landing, as 4 x u32 per 16-byte unit
.visible .entry ce_rs_reduce(.param .u64 p_flags, .param .u64 p_n, .param .u64 p_epoch,
	.param .u64 p_land, .param .u64 p_mine, .param .u64 p_out, .param .u64 p_units)
{
	.reg .pred %p<8>;
	.reg .b32 %r<40>;
	.reg .b64 %rd<40>;
	ld.param.u64 %rd1, [p_flags];
	ld.param.u64 %rd2, [p_n];
	ld.param.u64 %rd3, [p_epoch];
	ld.param.u64 %rd4, [p_land];
	ld.param.u64 %rd5, [p_mine];
	ld.param.u64 %rd6, [p_out];
	ld.param.u64 %rd7, [p_units];
	cvt.u32.u64 %r5, %rd3;
	mov.u32 %r1, %tid.x;
	mov.u32 %r2, %ctaid.x;
	mov.u32 %r3, %ntid.x;
	mov.u32 %r4, %nctaid.x;
	mul.wide.u32 %rd8, %r2, %r3;
	cvt.u64.u32 %rd9, %r1;
	add.u64 %rd8, %rd8, %rd9;
	mul.wide.u32 %rd9, %r3, %r4;
	mov.u64 %rd10, 0;
PIECE:
	setp.ge.u64 %p1, %rd10, %rd2;
	@%p1 bra FIN;
	setp.ne.u32 %p2, %r1, 0;
	@%p2 bra SPUN;
	shl.b64 %rd11, %rd10, 2;
	add.u64 %rd11, %rd1, %rd11;
	mov.u32 %r10, 0;
SPIN:
	ld.acquire.sys.global.u32 %r11, [%rd11];
	setp.eq.u32 %p3, %r11, %r5;
	@%p3 bra SPUN;
	add.u32 %r10, %r10, 1;
	setp.lt.u32 %p4, %r10, 268435456;
	@%p4 bra SPIN;
SPUN:
	bar.sync 0;
	mul.lo.u64 %rd12, %rd10, %rd7;
	mov.u64 %rd13, %rd8;
UNITS:
	setp.ge.u64 %p5, %rd13, %rd7;
	@%p5 bra NEXT;
	add.u64 %rd15, %rd12, %rd13;
	shl.b64 %rd15, %rd15, 4;
	add.u64 %rd16, %rd4, %rd15;
	ld.global.cg.v4.u32 {%r20, %r21, %r22, %r23}, [%rd16];
	add.u64 %rd17, %rd5, %rd15;
	ld.global.v4.u32 {%r24, %r25, %r26, %r27}, [%rd17];
	add.u32 %r20, %r20, %r24;
	add.u32 %r21, %r21, %r25;
	add.u32 %r22, %r22, %r26;
	add.u32 %r23, %r23, %r27;
	add.u64 %rd18, %rd6, %rd15;
	st.global.v4.u32 [%rd18], {%r20, %r21, %r22, %r23};
	add.u64 %rd13, %rd13, %rd9;
	bra.uni UNITS;
NEXT:
	add.u64 %rd10, %rd10, 1;
	bra.uni PIECE;
FIN:
	ret;
}
"#;

struct Kernels {
    _module: CUmodule,
    sm: CUfunction,
    sm4: CUfunction,
    bulk: CUfunction,
    reduce: CUfunction,
}

fn load(driver: &Driver, d: &Device) -> Res<Kernels> {
    d.bind()?;
    let text = std::ffi::CString::new(PTX)?;
    let mut m: CUmodule = std::ptr::null_mut();
    // SAFETY: NUL-terminated PTX, valid out-pointer, context current.
    let rc = unsafe { driver.sys().cuModuleLoadData()?(&mut m, text.as_ptr() as *const c_void) };
    if rc != CUresult::CUDA_SUCCESS {
        return Err(format!("cuModuleLoadData: {rc}").into());
    }
    let f = |name: &str| -> Res<CUfunction> {
        let c = std::ffi::CString::new(name)?;
        let mut f: CUfunction = std::ptr::null_mut();
        // SAFETY: live module, NUL-terminated name, valid out-pointer.
        let rc = unsafe { driver.sys().cuModuleGetFunction()?(&mut f, m, c.as_ptr()) };
        if rc != CUresult::CUDA_SUCCESS {
            return Err(format!("cuModuleGetFunction({name}): {rc}").into());
        }
        Ok(f)
    };
    Ok(Kernels {
        _module: m,
        sm: f("sm_copy")?,
        sm4: f("sm_copy4")?,
        bulk: f("bulk_copy")?,
        reduce: f("ce_rs_reduce")?,
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Ce,
    Sm,
    Sm4,
    Bulk,
}

/// Queue one copy of `bytes` from `src` (local to `d`) to `dst` (the peer's memory) on `s`.
#[allow(clippy::too_many_arguments)]
fn copy(
    driver: &Driver,
    d: &Device,
    k: &Kernels,
    mode: Mode,
    s: &Stream,
    dst: u64,
    src: u64,
    bytes: usize,
    sms: u32,
) -> Res<()> {
    d.bind()?;
    let rc = if mode == Mode::Ce {
        // SAFETY: both ranges lie in live allocations mapped for this device; live stream.
        unsafe { driver.sys().cuMemcpyDtoDAsync()?(dst, src, bytes, s.raw()) }
    } else {
        let (f, blocks, threads, shmem) = match mode {
            Mode::Sm => (k.sm, 2 * sms, 512, 0),
            Mode::Sm4 => (k.sm4, 2 * sms, 512, 0),
            _ => (k.bulk, 6 * sms, 32, 32768),
        };
        let (mut a, mut b, mut n) = (dst, src, (bytes / 16) as u64);
        let mut p: [*mut c_void; 3] = [
            &mut a as *mut _ as *mut c_void,
            &mut b as *mut _ as *mut c_void,
            &mut n as *mut _ as *mut c_void,
        ];
        // SAFETY: a function of this device's module taking three u64 parameters, each pointing
        // at a live local; live stream.
        unsafe {
            driver.sys().cuLaunchKernel()?(
                f,
                blocks,
                1,
                1,
                threads,
                1,
                1,
                shmem,
                s.raw(),
                p.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
    };
    if rc != CUresult::CUDA_SUCCESS {
        return Err(format!("copy: {rc}").into());
    }
    Ok(())
}

/// The median over `runs` (after one warm-up) of the slower rank's time for what `queue(r)`
/// puts on rank r's stream, between two events on that stream.
fn median_time(
    runs: usize,
    ranks: &[usize],
    streams: &[Stream],
    ev: &[(Event, Event)],
    mut queue: impl FnMut(usize) -> Res<()>,
) -> Res<f64> {
    let mut times = Vec::new();
    for rep in 0..runs + 1 {
        for &r in ranks {
            ev[r].0.record(&streams[r])?;
            queue(r)?;
            ev[r].1.record(&streams[r])?;
        }
        let mut t = 0f64;
        for &r in ranks {
            streams[r].synchronize()?;
            t = t.max(ev[r].1.elapsed_since(&ev[r].0)?.as_secs_f64());
        }
        if rep > 0 {
            times.push(t);
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[times.len() / 2])
}

/// One line of the table and its RESULT line.
fn report(name: &str, dir: &str, bytes: usize, t: f64) {
    let gbps = bytes as f64 / t / 1e9;
    println!("{name:>6} {dir:>10} {gbps:>12.1}");
    println!(
        "RESULT {{\"mode\":\"{name}\",\"direction\":\"{dir}\",\"bytes\":{bytes},\"gbps\":{gbps:.2}}}"
    );
}

fn check(rc: CUresult, what: &str) -> Res<()> {
    if rc != CUresult::CUDA_SUCCESS {
        return Err(format!("{what}: {rc}").into());
    }
    Ok(())
}

/// A two-rank reduce-scatter of `bytes` per direction whose transfer is all copy engines: each
/// rank copies its part for the peer into the peer's landing area in pieces, alternating
/// between `lanes` streams, each piece followed by a 4-byte flag, written by a copy (`c`: a copy
/// engine starts it only once the piece completed) or by `cuStreamWriteValue32` (`w`); the
/// peer's `ce_rs_reduce` adds each piece as its flag arrives. Times the whole call (GB/s = busbw of a reduce-scatter of 2 x `bytes`), checks one
/// call's result on rank 0.
#[allow(clippy::too_many_arguments)]
fn ce_pieces(
    driver: &Driver,
    comm: &Communicator,
    devices: &[Device],
    ks: &[Kernels],
    streams: &[Stream],
    side: &[Stream],
    ev: &[(Event, Event)],
    bytes: usize,
    runs: usize,
    sms: u32,
) -> Res<()> {
    let max_pieces = 64usize;
    // each rank: [my part for the peer | landing | my own part]
    let buf: SymmetricBuffer<u8> = comm.alloc(3 * bytes)?;
    let flags: SymmetricBuffer<u32> = comm.alloc(max_pieces)?;
    let out: Vec<DeviceBuffer<u8>> = devices
        .iter()
        .map(|d| DeviceBuffer::zeroed(d, bytes))
        .collect::<Result<_, _>>()?;
    let flag_src: Vec<DeviceBuffer<u32>> = devices
        .iter()
        .map(|d| DeviceBuffer::zeroed(d, 1))
        .collect::<Result<_, _>>()?;
    let side2: Vec<Stream> = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
    let mk = |d: &Device| Ok((Event::new(d, false)?, Event::new(d, false)?));
    let fork: Vec<(Event, Event)> = devices.iter().map(mk).collect::<Res<_>>()?;
    let join2: Vec<(Event, Event)> = devices.iter().map(mk).collect::<Res<_>>()?;
    // data: words w of rank r's part for the peer = 3w + r, of its own part = 5w + 7r
    let words = 1usize << 18;
    for r in 0..2 {
        let a: Vec<u32> = (0..words as u32).map(|w| 3 * w + r as u32).collect();
        let m: Vec<u32> = (0..words as u32).map(|w| 5 * w + 7 * r as u32).collect();
        let ab: Vec<u8> = a.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mb: Vec<u8> = m.iter().flat_map(|x| x.to_le_bytes()).collect();
        buf.write(r, 0, &ab)?;
        buf.write(r, 2 * bytes, &mb)?;
    }
    let mut epoch = 0u32;
    for (by_write, lanes) in [(false, 1usize), (false, 2), (true, 1), (true, 2)] {
        for piece_mib in [4usize, 8, 16, 32] {
            let piece = piece_mib << 20;
            if piece > bytes || !bytes.is_multiple_of(piece) || bytes / piece > max_pieces {
                continue;
            }
            let n = bytes / piece;
            let mut times = Vec::new();
            for rep in 0..runs + 2 {
                epoch += 1;
                for r in 0..2 {
                    let d = &devices[r];
                    d.bind()?;
                    let base = buf.device_ptr(r)?;
                    let peer_land = buf.device_ptr(1 - r)? + bytes as u64;
                    let peer_flags = flags.device_ptr(1 - r)?;
                    let src_flag = flag_src[r].device_ptr();
                    // SAFETY: a live 4-byte allocation of this device; live stream.
                    check(
                        unsafe {
                            driver.sys().cuMemsetD32Async_v3020()?(
                                src_flag,
                                epoch,
                                1,
                                streams[r].raw(),
                            )
                        },
                        "cuMemsetD32Async",
                    )?;
                    ev[r].0.record(&streams[r])?;
                    fork[r].0.record(&streams[r])?;
                    let lane = |i: usize| {
                        if i.is_multiple_of(lanes) {
                            &side[r]
                        } else {
                            &side2[r]
                        }
                    };
                    side[r].wait(&fork[r].0)?;
                    side2[r].wait(&fork[r].0)?;
                    for i in 0..n {
                        let l = lane(i);
                        let off = (i * piece) as u64;
                        // SAFETY: ranges inside live allocations mapped for this device.
                        unsafe {
                            check(
                                driver.sys().cuMemcpyDtoDAsync()?(
                                    peer_land + off,
                                    base + off,
                                    piece,
                                    l.raw(),
                                ),
                                "piece copy",
                            )?;
                            if by_write {
                                check(
                                    driver.sys().cuStreamWriteValue32()?(
                                        l.raw(),
                                        peer_flags + 4 * i as u64,
                                        epoch,
                                        0,
                                    ),
                                    "flag write",
                                )?;
                            } else {
                                check(
                                    driver.sys().cuMemcpyDtoDAsync()?(
                                        peer_flags + 4 * i as u64,
                                        src_flag,
                                        4,
                                        l.raw(),
                                    ),
                                    "flag copy",
                                )?;
                            }
                        }
                    }
                    fork[r].1.record(&side[r])?;
                    join2[r].1.record(&side2[r])?;
                    let (mut fl, mut nn, mut ep) = (flags.device_ptr(r)?, n as u64, epoch as u64);
                    let (mut land, mut mine, mut o, mut units) = (
                        base + bytes as u64,
                        base + 2 * bytes as u64,
                        out[r].device_ptr(),
                        (piece / 16) as u64,
                    );
                    let mut p: [*mut c_void; 7] = [
                        &mut fl as *mut _ as *mut c_void,
                        &mut nn as *mut _ as *mut c_void,
                        &mut ep as *mut _ as *mut c_void,
                        &mut land as *mut _ as *mut c_void,
                        &mut mine as *mut _ as *mut c_void,
                        &mut o as *mut _ as *mut c_void,
                        &mut units as *mut _ as *mut c_void,
                    ];
                    // SAFETY: the module's ce_rs_reduce, seven u64 parameters pointing at live
                    // locals, every address inside live allocations of this device; live stream.
                    check(
                        unsafe {
                            driver.sys().cuLaunchKernel()?(
                                ks[r].reduce,
                                sms,
                                1,
                                1,
                                512,
                                1,
                                1,
                                0,
                                streams[r].raw(),
                                p.as_mut_ptr(),
                                std::ptr::null_mut(),
                            )
                        },
                        "ce_rs_reduce",
                    )?;
                    streams[r].wait(&fork[r].1)?;
                    streams[r].wait(&join2[r].1)?;
                    ev[r].1.record(&streams[r])?;
                }
                let mut t = 0f64;
                for r in 0..2 {
                    streams[r].synchronize()?;
                    t = t.max(ev[r].1.elapsed_since(&ev[r].0)?.as_secs_f64());
                }
                if rep == 0 {
                    // rank 0's output: the peer's part for it plus its own
                    let mut got = vec![0u8; 4 * words];
                    out[0].copy_to_host(0, &mut got[..])?;
                    let ok = got.chunks(4).enumerate().all(|(w, c)| {
                        let v = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                        let w = w as u32;
                        v == (3 * w + 1).wrapping_add(5 * w)
                    });
                    if !ok {
                        return Err(format!(
                            "ce pieces ({lanes} lanes, {piece_mib} MiB, flag by write: {by_write}): wrong result"
                        )
                        .into());
                    }
                }
                if rep > 1 {
                    times.push(t);
                }
            }
            times.sort_by(|a, b| a.total_cmp(b));
            let t = times[times.len() / 2];
            let flag = if by_write { "w" } else { "c" };
            report(
                &format!("ce-rs {lanes}x{piece_mib}M{flag}"),
                "both",
                bytes,
                t,
            );
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("link_ceiling: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    let mut bytes = 1usize << 30;
    let mut runs = 5usize;
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().ok_or(format!("{k} needs a value"))?;
        match k.as_str() {
            "--bytes" => bytes = v.parse()?,
            "--runs" => runs = v.parse()?,
            o => return Err(format!("unknown argument {o}").into()),
        }
    }
    bytes = bytes.next_multiple_of(1 << 16);
    // `CUDA_MULTIMEM_DRIVER=sim...` selects the simulator (the copies and kernels are then
    // host work: the numbers mean nothing).
    cuda_multimem_collectives::sim::install();
    let driver = cuda_multimem_sim::driver_from_env()?;
    let devices = driver.devices();
    if devices.len() < 2 {
        return Err("needs 2 devices".into());
    }
    let devices = &devices[..2];
    let comm = Communicator::new(devices)?;
    // each rank: [source | destination]
    let buf: SymmetricBuffer<u8> = comm.alloc(2 * bytes)?;
    let ks: Vec<Kernels> = devices
        .iter()
        .map(|d| load(&driver, d))
        .collect::<Res<_>>()?;
    let streams: Vec<Stream> = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
    let ev: Vec<(Event, Event)> = devices
        .iter()
        .map(|d| Ok((Event::new(d, true)?, Event::new(d, true)?)))
        .collect::<Res<_>>()?;
    let sms = devices[0].multiprocessor_count()? as u32;
    println!(
        "# link ceiling, 2 x {}, {} MiB per direction, median of {runs}{}",
        devices[0].name()?,
        bytes >> 20,
        if driver.is_simulated() {
            " (SIMULATED: times mean nothing)"
        } else {
            ""
        }
    );
    println!("{:>6} {:>10} {:>12}", "mode", "direction", "GB/s each");
    for mode in [Mode::Ce, Mode::Sm, Mode::Sm4, Mode::Bulk] {
        for both in [false, true] {
            let ranks: &[usize] = if both { &[0, 1] } else { &[0] };
            let t = median_time(runs, ranks, &streams, &ev, |r| {
                let src = buf.device_ptr(r)?;
                let dst = buf.device_ptr(1 - r)? + bytes as u64;
                copy(
                    &driver,
                    &devices[r],
                    &ks[r],
                    mode,
                    &streams[r],
                    dst,
                    src,
                    bytes,
                    sms,
                )
            })?;
            let name = match mode {
                Mode::Ce => "ce",
                Mode::Sm => "sm",
                Mode::Sm4 => "sm4",
                Mode::Bulk => "bulk",
            };
            report(name, if both { "both" } else { "one" }, bytes, t);
        }
    }
    // Copy engines and kernel stores at once, both ways: the first 1/8, 1/4, 3/8 or 1/2 of the
    // bytes by `cuMemcpyDtoDAsync` on a second stream, the rest by `sm` beside it (what a
    // transfer that splits its bytes between the two movers could reach).
    let side: Vec<Stream> = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
    let fork: Vec<(Event, Event)> = devices
        .iter()
        .map(|d| Ok((Event::new(d, false)?, Event::new(d, false)?)))
        .collect::<Res<_>>()?;
    for eighths in [1usize, 2, 3, 4] {
        let ce_bytes = (bytes / 8 * eighths) & !((1 << 16) - 1);
        let t = median_time(runs, &[0, 1], &streams, &ev, |r| {
            let src = buf.device_ptr(r)?;
            let dst = buf.device_ptr(1 - r)? + bytes as u64;
            fork[r].0.record(&streams[r])?;
            side[r].wait(&fork[r].0)?;
            copy(
                &driver,
                &devices[r],
                &ks[r],
                Mode::Ce,
                &side[r],
                dst,
                src,
                ce_bytes,
                sms,
            )?;
            fork[r].1.record(&side[r])?;
            copy(
                &driver,
                &devices[r],
                &ks[r],
                Mode::Sm,
                &streams[r],
                dst + ce_bytes as u64,
                src + ce_bytes as u64,
                bytes - ce_bytes,
                sms,
            )?;
            streams[r].wait(&fork[r].1)?;
            Ok(())
        })?;
        report(&format!("ce{eighths}/8+sm"), "both", bytes, t);
    }
    ce_pieces(
        &driver, &comm, devices, &ks, &streams, &side, &ev, bytes, runs, sms,
    )?;
    // every mode must move the bytes intact (a wrong kernel shows here, not as a speed)
    let pattern: Vec<u8> = (0..1usize << 20).map(|i| (i * 131 % 251) as u8).collect();
    buf.write(0, 0, &pattern)?;
    for mode in [Mode::Ce, Mode::Sm, Mode::Sm4, Mode::Bulk] {
        let dst = buf.device_ptr(1)? + bytes as u64;
        devices[1].bind()?;
        // SAFETY: the first MiB of rank 1's destination half, mapped for its device.
        let rc = unsafe { driver.sys().cuMemsetD8_v3020()?(dst, 0, 1 << 20) };
        if rc != CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemsetD8: {rc}").into());
        }
        copy(
            &driver,
            &devices[0],
            &ks[0],
            mode,
            &streams[0],
            dst,
            buf.device_ptr(0)?,
            1 << 20,
            sms,
        )?;
        streams[0].synchronize()?;
        let mut whole = vec![0u8; 2 * bytes];
        buf.read(1, 0, &mut whole)?;
        let ok = whole[bytes..bytes + (1 << 20)] == pattern[..];
        println!(
            "{} copy of 1 MiB arrived intact: {}",
            match mode {
                Mode::Ce => "ce",
                Mode::Sm => "sm",
                Mode::Sm4 => "sm4",
                Mode::Bulk => "bulk",
            },
            if ok { "yes" } else { "NO" }
        );
    }
    Ok(())
}
