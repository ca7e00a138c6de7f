//! Allreduce benchmark: bf16 sum, in place, 1 KiB to 1 GiB, on the first N devices (default 2).
//! Each size is checked against a host reference first, then timed with CUDA events over a
//! graph-captured loop; the table gives the median of several runs, in the form nccl-tests
//! prints (busbw = algbw * 2(n-1)/n).
//!
//! `CUDA_MULTIMEM_DRIVER=cuda cargo run --release --example bench_allreduce -- [--ranks N]
//! [--min-bytes B] [--max-bytes B] [--runs R] [--algorithm one-shot-ll|one-shot|two-shot|two-shot-push|two-shot-ce] [--ll-max B] [--stage-bytes B] [--blocks B] [--threads T] [--push-threads T] [--ce-max B] [--check-max B]`
//! (`cargo xtask bench-hw allreduce` runs it on the GPU machine). With
//! `CUDA_MULTIMEM_DRIVER=sim` it runs on the simulator (times are meaningless there).

use std::process::ExitCode;

use cuda_multimem::{Driver, Event, Stream};
use cuda_multimem_collectives::{
    random_input, reference, Algorithm, AllReduceConfig, Communicator, DType, Op,
};
use cuda_multimem_sys::{CUgraphExec, CUresult, CUstreamCaptureMode};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

struct Args {
    ranks: usize,
    min_bytes: usize,
    max_bytes: usize,
    runs: usize,
    /// Sizes above this are timed without the host-reference check (tuning sweeps only; the
    /// table then says "unchecked").
    check_max: usize,
    config: AllReduceConfig,
}

fn parse() -> Res<Args> {
    let mut a = Args {
        ranks: 2,
        min_bytes: 1024,
        max_bytes: 1 << 30,
        runs: 5,
        check_max: usize::MAX,
        config: AllReduceConfig::default(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or(format!("{k} needs a value"));
        match k.as_str() {
            "--ranks" => a.ranks = v()?.parse()?,
            "--min-bytes" => a.min_bytes = v()?.parse()?,
            "--max-bytes" => a.max_bytes = v()?.parse()?,
            "--runs" => a.runs = v()?.parse()?,
            "--blocks" => a.config.max_blocks = v()?.parse()?,
            "--threads" => a.config.threads = v()?.parse()?,
            "--stage-bytes" => a.config.stage_bytes = Some(v()?.parse()?),
            "--push-threads" => a.config.push_threads = v()?.parse()?,
            "--ce-max" => a.config.ce_max_bytes = v()?.parse()?,
            "--check-max" => a.check_max = v()?.parse()?,
            "--ll-max" => a.config.ll_max_bytes = v()?.parse()?,
            "--one-shot-max" => a.config.one_shot_max_bytes = Some(v()?.parse()?),
            "--algorithm" => {
                a.config.algorithm = Some(match v()?.as_str() {
                    "one-shot" => Algorithm::OneShot,
                    "one-shot-ll" => Algorithm::OneShotLl,
                    "two-shot" => Algorithm::TwoShot,
                    "two-shot-push" => Algorithm::TwoShotPush,
                    "two-shot-ce" => Algorithm::TwoShotCe,
                    o => return Err(format!("unknown algorithm {o}").into()),
                })
            }
            o => return Err(format!("unknown argument {o}").into()),
        }
    }
    Ok(a)
}

fn check(
    comm: &Communicator,
    buf: &cuda_multimem_collectives::SymmetricBuffer,
    streams: &[Stream],
    count: usize,
    seed: u64,
) -> Res<bool> {
    let n = comm.size();
    let dtype = DType::Bf16;
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let inputs: Vec<Vec<u8>> = (0..n).map(|_| random_input(dtype, count, &mut x)).collect();
    for (r, d) in inputs.iter().enumerate() {
        buf.copy_from_host(r, d)?;
    }
    for (r, s) in streams.iter().enumerate() {
        comm.all_reduce(r, buf, 0, buf, 0, count, dtype, Op::Sum, s)?;
    }
    for s in streams {
        s.synchronize()?;
    }
    comm.check()?;
    let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
    let want = reference(dtype, Op::Sum, &refs);
    let mut got = vec![0u8; count * 2];
    for r in 0..n {
        buf.copy_to_host(r, &mut got)?;
        if got != want {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Capture `iters` allreduces per rank into one graph per rank.
fn capture(
    driver: &Driver,
    comm: &Communicator,
    buf: &cuda_multimem_collectives::SymmetricBuffer,
    streams: &[Stream],
    count: usize,
    iters: usize,
) -> Res<Vec<CUgraphExec>> {
    let mut execs = Vec::new();
    for (r, s) in streams.iter().enumerate() {
        comm.device(r).ok_or("rank")?.bind()?;
        // SAFETY: a live stream of the current device.
        let rc = unsafe {
            driver.sys().cuStreamBeginCapture_v10010()?(
                s.raw(),
                CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        };
        if rc != CUresult::CUDA_SUCCESS {
            return Err(format!("cuStreamBeginCapture: {rc}").into());
        }
        for _ in 0..iters {
            comm.all_reduce(r, buf, 0, buf, 0, count, DType::Bf16, Op::Sum, s)?;
        }
        let mut g = std::ptr::null_mut();
        let mut e = std::ptr::null_mut();
        // SAFETY: ends the capture begun above; instantiates and frees the graph.
        unsafe {
            let rc = driver.sys().cuStreamEndCapture()?(s.raw(), &mut g);
            if rc != CUresult::CUDA_SUCCESS {
                return Err(format!("cuStreamEndCapture: {rc}").into());
            }
            let rc = driver.sys().cuGraphInstantiateWithFlags()?(&mut e, g, 0);
            if rc != CUresult::CUDA_SUCCESS {
                return Err(format!("cuGraphInstantiateWithFlags: {rc}").into());
            }
            driver.sys().cuGraphDestroy()?(g);
        }
        execs.push(e);
    }
    Ok(execs)
}

fn launch(
    driver: &Driver,
    comm: &Communicator,
    execs: &[CUgraphExec],
    streams: &[Stream],
) -> Res<()> {
    // the last rank first, so rank 0 (which is timed) does not start long before the others
    for r in (0..streams.len()).rev() {
        comm.device(r).ok_or("rank")?.bind()?;
        // SAFETY: an executable graph of this device and a live stream of it.
        let rc = unsafe { driver.sys().cuGraphLaunch()?(execs[r], streams[r].raw()) };
        if rc != CUresult::CUDA_SUCCESS {
            return Err(format!("cuGraphLaunch: {rc}").into());
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("bench_allreduce: a result did not match the host reference");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("bench_allreduce: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<bool> {
    let args = parse()?;
    // With the `sim` feature (the default) `CUDA_MULTIMEM_DRIVER=sim...` selects the simulator.
    #[cfg(feature = "sim")]
    let driver = cuda_multimem_sim::driver_from_env()?;
    #[cfg(not(feature = "sim"))]
    let driver = Driver::from_env()?;
    let devices = driver.devices();
    if devices.len() < args.ranks {
        return Err(format!("{} ranks asked, {} devices", args.ranks, devices.len()).into());
    }
    let devices = &devices[..args.ranks];
    let comm = Communicator::with_config(devices, args.config.clone())?;
    let streams: Vec<Stream> = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
    let n = comm.size();
    let name = devices[0].name()?;
    println!(
        "# allreduce bf16 sum, in place, {n} x {name}, driver {}{}, graph-captured, median of {} runs",
        driver.version(),
        if driver.is_simulated() { " (SIMULATED: times mean nothing)" } else { "" },
        args.runs
    );
    let buf = comm.alloc(args.max_bytes.max(1024))?;
    let (start, stop) = (
        Event::new(&devices[0], true)?,
        Event::new(&devices[0], true)?,
    );
    println!(
        "{:>12} {:>12} {:>10} {:>10} {:>14} {:>10} {:>7} {:>8}",
        "bytes", "time(us)", "algbw", "busbw", "path", "algorithm", "blocks", "correct"
    );
    let mut all_ok = true;
    let mut bytes = args.min_bytes.max(2);
    while bytes <= args.max_bytes {
        let count = bytes / 2;
        let checked = bytes <= args.check_max;
        let ok = !checked || check(&comm, &buf, &streams, count, bytes as u64)?;
        all_ok &= ok;
        let choice = comm.choice(count, DType::Bf16);
        let iters = ((4usize << 30) / bytes).clamp(4, 100);
        let iters = if driver.is_simulated() { 2 } else { iters };
        let execs = capture(&driver, &comm, &buf, &streams, count, iters)?;
        launch(&driver, &comm, &execs, &streams)?;
        for s in &streams {
            s.synchronize()?;
        }
        let mut times = Vec::new();
        for _ in 0..args.runs {
            start.record(&streams[0])?;
            launch(&driver, &comm, &execs, &streams)?;
            stop.record(&streams[0])?;
            for s in &streams {
                s.synchronize()?;
            }
            times.push(stop.elapsed_since(&start)?.as_secs_f64() / iters as f64);
        }
        comm.check()?;
        for (r, e) in execs.into_iter().enumerate() {
            comm.device(r).ok_or("rank")?.bind()?;
            // SAFETY: an executable graph we made; its launches completed.
            unsafe { driver.sys().cuGraphExecDestroy()?(e) };
        }
        times.sort_by(|a, b| a.total_cmp(b));
        let t = times[times.len() / 2];
        let algbw = bytes as f64 / t / 1e9;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        println!(
            "{:>12} {:>12.2} {:>10.1} {:>10.1} {:>14} {:>10} {:>7} {:>8}",
            bytes,
            t * 1e6,
            algbw,
            busbw,
            choice.path.to_string(),
            choice.algorithm.to_string(),
            choice.blocks,
            match (checked, ok) {
                (false, _) => "unchecked",
                (true, true) => "yes",
                (true, false) => "NO",
            }
        );
        // The line `cargo xtask bench-hw allreduce` merges with the NCCL reference.
        println!(
            "RESULT {{\"impl\":\"cuda-multimem\",\"bytes\":{bytes},\"time_us\":{:.3},\"algbw\":{algbw:.2},\"busbw\":{busbw:.2},\"path\":\"{} {}\",\"correct\":{}}}",
            t * 1e6,
            choice.path,
            choice.algorithm,
            if checked { ok.to_string() } else { "null".to_string() }
        );
        bytes *= 2;
    }
    Ok(all_ok)
}
