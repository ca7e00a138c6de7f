//! Does a device-to-device copy run while a kernel holds every SM? The staged allreduce on the
//! caller's own memory copies each chunk's result out of the scratch on a second stream while
//! the next chunk's kernel runs; on 2 x H200 it ran as if every copy waited for its kernel. This
//! probe asks the question directly, on device 0:
//!
//! `CUDA_MULTIMEM_DRIVER=cuda overlap-probe [--bytes B] [--spin-us U] [--runs R] [--blocks-per-sm 1,2]`
//!
//! Stream A runs a kernel that spins on `%globaltimer` for `--spin-us` (2000) microseconds in
//! every thread of `--blocks-per-sm` 1024-thread blocks per multiprocessor (1: the staged
//! allreduce's shape; 2: every thread slot of a 2048-thread SM) and then exits by itself. Once
//! it runs (the host waits a quarter of the spin), stream B copies `--bytes` (32 MiB) between two
//! buffers of device 0: with `copy_dtod_async` (`cuMemcpyDtoDAsync`) and with
//! `copy_dtod_async_overlapped` (`cuMemcpyBatchAsync`, `PREFER_OVERLAP_WITH_COMPUTE`). For each,
//! the copy's time (events around it on B, median of the runs), when it ended and when the kernel
//! ended (events, from the kernel's start), and in how many runs the copy was complete while the
//! kernel was not (`cuEventQuery` on the kernel's end event the moment the copy's end event
//! completes). A copy that waits for the SMs takes about the rest of the spin; one on the copy
//! engines takes its bandwidth's time. `alone` is the copy without a kernel, for scale.
//!
//! Output: one `RESULT {json}` line per shape and copy, then a table.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use cuda_multimem::{DeviceBuffer, Event, LaunchConfig, Module, Stream};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

// every thread spins until p_ns nanoseconds of %globaltimer have passed, then exits
.visible .entry overlap_spin(.param .u64 p_ns)
{
	.reg .pred %p;
	.reg .b64 %rd<5>;
	ld.param.u64 %rd1, [p_ns];
	mov.u64 %rd2, %globaltimer;
SPIN:
	mov.u64 %rd3, %globaltimer;
	sub.u64 %rd4, %rd3, %rd2;
	setp.lt.u64 %p, %rd4, %rd1;
	@%p bra SPIN;
	ret;
}
"#;

/// What one copy mode measured over the runs.
struct Row {
    shape: String,
    copy: &'static str,
    copy_us: f64,
    copy_end_us: f64,
    kernel_end_us: f64,
    done_first: usize,
    runs: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("overlap-probe: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    let mut bytes = 32usize << 20;
    let mut spin_us = 2000u64;
    let mut runs = 5usize;
    let mut shapes = vec![1u32, 2];
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().ok_or(format!("{k} needs a value"))?;
        match k.as_str() {
            "--bytes" => bytes = v.parse()?,
            "--spin-us" => spin_us = v.parse()?,
            "--runs" => runs = v.parse()?,
            "--blocks-per-sm" => {
                shapes = v
                    .split(',')
                    .map(|s| s.trim().parse())
                    .collect::<Result<_, _>>()?
            }
            o => return Err(format!("unknown argument {o}").into()),
        }
    }
    if bytes == 0 || runs == 0 || spin_us == 0 || shapes.iter().any(|&b| b == 0 || b > 2) {
        return Err(
            "--bytes, --runs and --spin-us must be positive, --blocks-per-sm 1 or 2".into(),
        );
    }
    // `CUDA_MULTIMEM_DRIVER=sim...` selects the simulator (kernels and copies are host work
    // there: the numbers mean nothing, the probe only runs through).
    let driver = cuda_multimem_sim::driver_from_env()?;
    let d = driver.device(0)?;
    if driver.is_simulated() {
        cuda_multimem_sim::register_kernel("overlap_spin", |a| {
            std::thread::sleep(Duration::from_nanos(a.u64(0)?));
            Ok(())
        });
    }
    let sms = d.multiprocessor_count()? as u32;
    let spin = Module::load_ptx(&d, PTX)?.function("overlap_spin")?;
    let overlapped_call = match driver.version() {
        v if v >= 13000 => "cuMemcpyBatchAsync_v13000",
        v if v >= 12080 => "cuMemcpyBatchAsync_v12080",
        _ => "cuMemcpyDtoDAsync (driver before 12.8: fallback)",
    };
    eprintln!(
        "device 0: {} ({sms} SMs), driver {}, {bytes} bytes, spin {spin_us} us, {runs} runs; overlapped copy = {overlapped_call}",
        d.name()?,
        driver.version()
    );
    let data: Vec<u8> = (0..bytes).map(|i| (i * 131 + 7) as u8).collect();
    let src = DeviceBuffer::from_host(&d, &data)?;
    let dst = DeviceBuffer::<u8>::zeroed(&d, bytes)?;
    let (a, b) = (Stream::new(&d)?, Stream::new(&d)?);
    let ev = || Event::new(&d, true);
    let (k_start, k_end, c_start, c_end) = (ev()?, ev()?, ev()?, ev()?);
    let copy = |overlapped: bool| -> Res<()> {
        // SAFETY: both ranges are `bytes` bytes of live buffers of device 0 that do not
        // overlap; every run is synchronised before the buffers go.
        unsafe {
            if overlapped {
                b.as_stream_ref().copy_dtod_async_overlapped(
                    dst.device_ptr(),
                    src.device_ptr(),
                    bytes,
                )?
            } else {
                b.as_stream_ref()
                    .copy_dtod_async(dst.device_ptr(), src.device_ptr(), bytes)?
            }
        }
        Ok(())
    };
    let mut rows = Vec::new();
    // the copy alone, for scale (and a warm-up of both paths)
    for (name, overlapped) in [("dtod", false), ("overlapped", true)] {
        let mut t = Vec::new();
        for _ in 0..=runs {
            c_start.record(&b)?;
            copy(overlapped)?;
            c_end.record(&b)?;
            b.synchronize()?;
            t.push(us(c_end.elapsed_since(&c_start)?));
        }
        t.remove(0);
        rows.push(Row {
            shape: "alone".into(),
            copy: name,
            copy_us: median(t),
            copy_end_us: f64::NAN,
            kernel_end_us: f64::NAN,
            done_first: 0,
            runs,
        });
    }
    for &per_sm in &shapes {
        let cfg = LaunchConfig::linear(per_sm * sms, 1024);
        for (name, overlapped) in [("dtod", false), ("overlapped", true)] {
            let (mut copy_t, mut copy_end, mut kernel_end, mut first) =
                (Vec::new(), Vec::new(), Vec::new(), 0);
            for _ in 0..runs {
                k_start.record(&a)?;
                // SAFETY: one .u64 parameter; the kernel touches no memory and exits by itself.
                unsafe { spin.launch_u64(&cfg, &a, &[spin_us * 1000]) }?;
                k_end.record(&a)?;
                // let the kernel take the SMs before the copy is queued
                std::thread::sleep(Duration::from_micros(spin_us / 4));
                c_start.record(&b)?;
                copy(overlapped)?;
                c_end.record(&b)?;
                let deadline = Instant::now() + Duration::from_secs(10);
                while !c_end.is_complete()? {
                    if Instant::now() > deadline {
                        return Err("the copy did not complete within 10 s".into());
                    }
                    std::hint::spin_loop();
                }
                if !k_end.is_complete()? {
                    first += 1;
                }
                a.synchronize()?;
                b.synchronize()?;
                copy_t.push(us(c_end.elapsed_since(&c_start)?));
                copy_end.push(us(c_end.elapsed_since(&k_start)?));
                kernel_end.push(us(k_end.elapsed_since(&k_start)?));
            }
            rows.push(Row {
                shape: format!("{per_sm}x1024/SM"),
                copy: name,
                copy_us: median(copy_t),
                copy_end_us: median(copy_end),
                kernel_end_us: median(kernel_end),
                done_first: first,
                runs,
            });
        }
    }
    let correct = dst.to_vec()? == data;
    for r in &rows {
        let num = |v: f64| {
            if v.is_finite() {
                format!("{v:.1}")
            } else {
                "null".into()
            }
        };
        println!(
            "RESULT {{\"probe\":\"overlap\",\"driver\":{},\"sms\":{sms},\"bytes\":{bytes},\"spin_us\":{spin_us},\"kernel\":\"{}\",\"copy\":\"{}\",\"call\":\"{}\",\"copy_us\":{},\"copy_gbps\":{},\"copy_end_us\":{},\"kernel_end_us\":{},\"copy_done_before_kernel\":{},\"runs\":{},\"correct\":{correct}}}",
            driver.version(),
            r.shape,
            r.copy,
            if r.copy == "dtod" { "cuMemcpyDtoDAsync" } else { overlapped_call },
            num(r.copy_us),
            num(bytes as f64 / r.copy_us / 1e3),
            num(r.copy_end_us),
            num(r.kernel_end_us),
            r.done_first,
            r.runs,
        );
    }
    println!();
    println!(
        "{:>12} {:>11} {:>10} {:>9} {:>12} {:>14} {:>17}",
        "kernel", "copy", "copy(us)", "GB/s", "copy end(us)", "kernel end(us)", "copy done first"
    );
    for r in &rows {
        let f = |v: f64| {
            if v.is_finite() {
                format!("{v:.1}")
            } else {
                "-".into()
            }
        };
        println!(
            "{:>12} {:>11} {:>10} {:>9} {:>12} {:>14} {:>17}",
            r.shape,
            r.copy,
            f(r.copy_us),
            f(bytes as f64 / r.copy_us / 1e3),
            f(r.copy_end_us),
            f(r.kernel_end_us),
            if r.shape == "alone" {
                "-".to_string()
            } else {
                format!("{}/{}", r.done_first, r.runs)
            }
        );
    }
    println!("copies correct: {correct}");
    if !correct {
        return Err("the copied bytes differ from the source".into());
    }
    Ok(())
}
