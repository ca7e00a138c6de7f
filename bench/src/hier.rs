//! Hierarchical allreduce benchmark: two processes, each one GPU and its own NVLink domain
//! (rank 0 starts this program again as rank 1; they meet through a Unix socket), bf16 sum, 1 KiB
//! to 1 GiB. Times our `HierCommunicator` allreduce (impl `cuda-multimem-hier`) against NCCL
//! alone (`ncclAllReduce` through our `Nccl` loader, impl `nccl-plain`) on the same buffers, in
//! place on the caller's own memory; every size is first checked against the host reference:
//! - **pipelined**: a CUDA graph of K calls, replayed (rank 0's events, per call, median of
//!   `--runs`), after a host barrier so both ranks start together;
//! - **single**: one call after a host barrier (the Unix socket: tens of µs of skew between the
//!   ranks land in the time), each rank's events, the slower rank, median of `--runs`.
//!
//! NCCL: `CUDA_MULTIMEM_NCCL`, else `libnccl.so.2`, else the `nvidia-nccl` wheel of `python3`.
//! Prints a table and `RESULT {json}` lines in bench-allreduce's schema (busbw = algbw × 2(n−1)/n).
//! With `CUDA_MULTIMEM_DRIVER=sim` it runs on the simulator with the host test double instead of
//! NCCL (single calls only, times meaningless: a smoke test).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use cuda_multimem::{CaptureMode, Device, DeviceBuffer, Driver, Event, Stream};
use cuda_multimem_collectives::testing::{random_input, reference};
use cuda_multimem_collectives::{
    Bootstrap, DType, Dst, HierCommunicator, MulticastPolicy, Nccl, NcclComm, NcclUniqueId,
    ReduceOp, UnixBootstrap,
};
use half::bf16;
use serde_json::json;

#[allow(dead_code)] // the spinning barrier: its ranks are processes
mod common;

use common::{median, result_line, Res};

const RANK_ENV: &str = "BENCH_HIER_RANK";
const PATH_ENV: &str = "BENCH_HIER_PATH";

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Mode {
    Pipelined,
    Single,
    Both,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Impls {
    Hier,
    Nccl,
    Both,
}

/// Hierarchical allreduce benchmark (two processes, one GPU and one domain each).
#[derive(Parser, Debug, Clone)]
#[command(name = "bench-hier")]
struct Args {
    /// Smallest message in bytes.
    #[arg(long, default_value_t = 1024)]
    min_bytes: usize,
    /// Largest message in bytes.
    #[arg(long, default_value_t = 1 << 30)]
    max_bytes: usize,
    /// Explicit sizes (bytes, comma-separated) instead of powers of two.
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<usize>,
    /// Timed repetitions per size (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Calls per captured graph (default: 4 GiB / size, clamped to 4..100).
    #[arg(long)]
    iters: Option<usize>,
    /// Which timing.
    #[arg(long, value_enum, default_value_t = Mode::Both)]
    mode: Mode,
    /// Which implementations.
    #[arg(long, value_enum, default_value_t = Impls::Both)]
    impls: Impls,
    /// Sizes above this are timed without the host-reference check.
    #[arg(long, default_value_t = usize::MAX)]
    check_max: usize,
}

impl Args {
    fn sizes(&self) -> Vec<usize> {
        common::doubling_sizes(&self.sizes, self.min_bytes, 2, self.max_bytes)
    }
}

fn main() -> ExitCode {
    common::exit_code("bench-hier", run())
}

/// NCCL: `CUDA_MULTIMEM_NCCL`, the default names, else the `nvidia-nccl` wheel of `python3`.
fn locate_nccl() -> Res<Arc<Nccl>> {
    let first = match Nccl::load() {
        Ok(n) => return Ok(n),
        Err(e) => e.to_string(),
    };
    if std::env::var_os(cuda_multimem_collectives::nccl::NCCL_ENV).is_some() {
        return Err(first.into());
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import nvidia.nccl,os; print(list(nvidia.nccl.__path__)[0])",
        ])
        .output()
        .map_err(|e| format!("{first}; python3: {e}"))?;
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || dir.is_empty() {
        return Err(format!("{first}; python3 has no nvidia.nccl wheel").into());
    }
    Ok(Nccl::load_from(&Path::new(&dir).join("lib/libnccl.so.2"))?)
}

fn run() -> Res<bool> {
    let args = Args::parse();
    cuda_multimem_collectives::sim::install();
    let driver = cuda_multimem_sim::driver_from_env()?;
    let child_rank = std::env::var(RANK_ENV).ok();
    let nccl = if driver.is_simulated() {
        None
    } else {
        Some(locate_nccl()?)
    };
    if let (Some(rank), Ok(path)) = (child_rank, std::env::var(PATH_ENV)) {
        return rank_main(&args, &driver, rank.parse()?, Path::new(&path), nccl);
    }
    if !driver.is_simulated() && driver.device_count() < 2 {
        return Err(format!("2 GPUs needed, the driver has {}", driver.device_count()).into());
    }
    let path = std::env::temp_dir().join(format!("cmm-bench-hier-{}", std::process::id()));
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(std::env::args_os().skip(1))
        .env(RANK_ENV, "1")
        .env(PATH_ENV, &path)
        .envs(nccl.as_ref().map(|n| {
            (
                cuda_multimem_collectives::nccl::NCCL_ENV,
                n.path().to_string(),
            )
        }))
        .stdout(std::process::Stdio::null())
        .spawn()?;
    let mine = rank_main(&args, &driver, 0, &path, nccl);
    let theirs = child.wait()?;
    let ok = mine?;
    if !theirs.success() {
        return Err(format!("rank 1 failed ({theirs})").into());
    }
    Ok(ok)
}

/// What is timed: the hierarchical communicator or NCCL alone, in place on `count` elements.
enum Imp<'a> {
    Hier(&'a HierCommunicator),
    Nccl(&'a NcclComm),
}

impl Imp<'_> {
    fn name(&self) -> &'static str {
        match self {
            Imp::Hier(_) => "cuda-multimem-hier",
            Imp::Nccl(_) => "nccl-plain",
        }
    }

    fn call(&self, buf: &DeviceBuffer<bf16>, count: usize, s: &Stream) -> Res<()> {
        let p = buf.device_ptr();
        match self {
            Imp::Hier(h) => {
                // SAFETY: the first `count` elements of this rank's buffer, alive and not
                // otherwise used until the stream is synchronised.
                let dst = unsafe { Dst::<bf16>::from_raw(p, count) };
                h.all_reduce_in_place(dst, ReduceOp::Sum, s)?;
            }
            // SAFETY: as above.
            Imp::Nccl(c) => unsafe {
                c.all_reduce_raw(DType::Bf16, ReduceOp::Sum, p, p, count, &s.as_stream_ref())?
            },
        }
        Ok(())
    }

    fn check(&self) -> Res<()> {
        match self {
            Imp::Hier(h) => h.check()?,
            Imp::Nccl(c) => c.check()?,
        }
        Ok(())
    }
}

fn barrier(b: &dyn Bootstrap) -> Res<()> {
    b.all_gather(&[])?;
    Ok(())
}

/// The slowest rank's value.
fn max_over_ranks(b: &dyn Bootstrap, t: f64) -> Res<f64> {
    let all = b.all_gather(&t.to_le_bytes())?;
    Ok(all
        .iter()
        .map(|v| f64::from_le_bytes(v[..8].try_into().unwrap_or([0; 8])))
        .fold(t, f64::max))
}

fn input(seed: u64, rank: usize, count: usize) -> Vec<bf16> {
    let mut state = (seed * 7919 + rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    random_input(count, &mut state)
}

struct Ctx<'a> {
    device: &'a Device,
    stream: &'a Stream,
    boot: &'a dyn Bootstrap,
    rank: usize,
    buf: &'a mut DeviceBuffer<bf16>,
}

impl Ctx<'_> {
    fn check(&mut self, imp: &Imp<'_>, count: usize, seed: u64) -> Res<bool> {
        let inputs: Vec<Vec<bf16>> = (0..2).map(|r| input(seed, r, count)).collect();
        self.buf.copy_from_host(0, &inputs[self.rank])?;
        imp.call(self.buf, count, self.stream)?;
        self.stream.synchronize()?;
        imp.check()?;
        let mut got = vec![bf16::ZERO; count];
        self.buf.copy_to_host(0, &mut got)?;
        let want = reference(ReduceOp::Sum, &[&inputs[0][..], &inputs[1][..]]);
        let ok = got
            .iter()
            .zip(&want)
            .all(|(g, w)| g.to_bits() == w.to_bits());
        // both ranks' verdicts
        let all = self.boot.all_gather(&[u8::from(ok)])?;
        Ok(all.iter().all(|v| v == &[1]))
    }

    fn pipelined(&mut self, imp: &Imp<'_>, count: usize, iters: usize, runs: usize) -> Res<f64> {
        let s = self.stream.as_stream_ref();
        s.begin_capture(CaptureMode::ThreadLocal)?;
        let mut failed = None;
        for _ in 0..iters {
            if let Err(e) = imp.call(self.buf, count, self.stream) {
                failed = Some(e);
                break;
            }
        }
        let g = s.end_capture()?;
        if let Some(e) = failed {
            return Err(e);
        }
        // SAFETY: the communicator, buffers and stream the capture used are borrowed by `self`
        // and outlive `exec`, dropped when this function returns.
        let exec = unsafe { g.instantiate() }?;
        barrier(self.boot)?;
        exec.launch(self.stream)?;
        self.stream.synchronize()?;
        let (a, z) = (
            Event::new(self.device, true)?,
            Event::new(self.device, true)?,
        );
        let mut times = Vec::new();
        for _ in 0..runs {
            barrier(self.boot)?;
            a.record(self.stream)?;
            exec.launch(self.stream)?;
            z.record(self.stream)?;
            self.stream.synchronize()?;
            times.push(z.elapsed_since(&a)?.as_secs_f64() / iters as f64);
        }
        imp.check()?;
        // rank 0's time, the same on both ranks' lines
        let all = self.boot.all_gather(&median(times).to_le_bytes())?;
        Ok(f64::from_le_bytes(all[0][..8].try_into().unwrap_or([0; 8])))
    }

    fn single(&mut self, imp: &Imp<'_>, count: usize, runs: usize) -> Res<f64> {
        let (a, z) = (
            Event::new(self.device, true)?,
            Event::new(self.device, true)?,
        );
        let mut times = Vec::new();
        for run in 0..=runs {
            barrier(self.boot)?;
            a.record(self.stream)?;
            imp.call(self.buf, count, self.stream)?;
            z.record(self.stream)?;
            self.stream.synchronize()?;
            let t = max_over_ranks(self.boot, z.elapsed_since(&a)?.as_secs_f64())?;
            if run > 0 {
                times.push(t); // run 0 warms up
            }
        }
        imp.check()?;
        Ok(median(times))
    }
}

fn rank_main(
    args: &Args,
    driver: &Driver,
    rank: usize,
    path: &Path,
    nccl: Option<Arc<Nccl>>,
) -> Res<bool> {
    let sim = driver.is_simulated();
    // On the simulator each process has its own simulated machine: device 0 in both.
    let device = driver.device(if sim { 0 } else { rank })?;
    let timeout = Duration::from_secs(120);
    let hb = UnixBootstrap::new(path, rank, 2, timeout)?;
    let mut aux_path = PathBuf::from(path);
    aux_path.set_extension("aux");
    let boot = UnixBootstrap::new(&aux_path, rank, 2, timeout)?;
    let builder = HierCommunicator::builder(&device, Box::new(hb))
        .domain_id(rank as u64)
        .multicast(MulticastPolicy::Never)
        .nccl_timeout(timeout);
    let hier = match &nccl {
        Some(n) => builder.nccl(n.clone()).build()?,
        None => builder.cross_domain_test_double().build()?,
    };
    // NCCL alone: a communicator of its own, its id through the second bootstrap.
    let plain = match &nccl {
        Some(n) if args.impls != Impls::Hier => {
            let id = if rank == 0 {
                n.unique_id()?.as_bytes().to_vec()
            } else {
                vec![0; NcclUniqueId::BYTES]
            };
            let all = boot.all_gather(&id)?;
            let uid = NcclUniqueId::from_bytes(&all[0])?;
            Some(NcclComm::init_rank(n, &device, &uid, rank, 2, timeout)?)
        }
        _ => None,
    };
    let stream = Stream::new(&device)?;
    let sizes = args.sizes();
    let max = sizes.iter().copied().max().unwrap_or(2);
    let mut buf = DeviceBuffer::<bf16>::zeroed(&device, max / 2)?;
    let mut imps = Vec::new();
    if args.impls != Impls::Nccl {
        imps.push(Imp::Hier(&hier));
    }
    if let Some(c) = &plain {
        imps.push(Imp::Nccl(c));
    }
    let mut ctx = Ctx {
        device: &device,
        stream: &stream,
        boot: &boot,
        rank,
        buf: &mut buf,
    };
    let say = rank == 0;
    if say {
        println!(
            "# hierarchical allreduce bf16 sum, in place, 2 processes x 1 GPU ({}), one domain each; across: {}; driver {}{}; median of {} runs",
            device.name()?,
            hier.cross_domain().map_or("none".into(), |c| c.name()),
            driver.version(),
            if sim { " (SIMULATED: times mean nothing)" } else { "" },
            args.runs
        );
        println!(
            "{:>20} {:>11} {:>10} {:>10} {:>9} {:>9} {:>10} {:>9} {:>9} {:>7}",
            "impl",
            "bytes",
            "count",
            "pipe(us)",
            "algbw",
            "busbw",
            "single(us)",
            "algbw",
            "busbw",
            "correct"
        );
    }
    let mut all_ok = true;
    let mut seed = 1u64;
    for &bytes in &sizes {
        let count = bytes / 2;
        for imp in &imps {
            seed += 1;
            let checked = bytes <= args.check_max;
            let ok = !checked || ctx.check(imp, count, seed)?;
            all_ok &= ok;
            let iters = args
                .iters
                .unwrap_or(((4usize << 30) / bytes.max(1)).clamp(4, 100));
            let runs = if sim { 1 } else { args.runs.max(1) };
            let capturable = !matches!(imp, Imp::Hier(h) if !h.graph_capturable());
            let pipe = if args.mode != Mode::Single && capturable {
                Some(ctx.pipelined(imp, count, if sim { 2 } else { iters }, runs)?)
            } else {
                None
            };
            let single = if args.mode != Mode::Pipelined {
                Some(ctx.single(imp, count, runs)?)
            } else {
                None
            };
            if !say {
                continue;
            }
            let bw = |t: f64| bytes as f64 / t / 1e9;
            let bus = |t: f64| bw(t) * 2.0 * (2.0 - 1.0) / 2.0;
            let cell = |t: Option<f64>, f: &dyn Fn(f64) -> f64| {
                t.map_or("-".to_string(), |t| format!("{:.2}", f(t)))
            };
            println!(
                "{:>20} {:>11} {:>10} {:>10} {:>9} {:>9} {:>10} {:>9} {:>9} {:>7}",
                imp.name(),
                bytes,
                count,
                cell(pipe, &|t| t * 1e6),
                cell(pipe, &bw),
                cell(pipe, &bus),
                cell(single, &|t| t * 1e6),
                cell(single, &bw),
                cell(single, &bus),
                match (checked, ok) {
                    (false, _) => "-",
                    (true, true) => "yes",
                    (true, false) => "NO",
                }
            );
            let (path, algorithm) = match imp {
                Imp::Hier(h) if h.layout().domain_size() == 1 => {
                    ("hierarchical", "cross-domain only (1 GPU per domain)")
                }
                Imp::Hier(_) => (
                    "hierarchical",
                    "domain reduce-scatter + cross-domain allreduce + domain all-gather",
                ),
                Imp::Nccl(_) => ("nccl", "ncclAllReduce"),
            };
            for (mode, t) in [("pipelined", pipe), ("single", single)] {
                let Some(t) = t else { continue };
                result_line(json!({
                    "bench": "allreduce",
                    "impl": imp.name(),
                    "operand": "local",
                    "dtype": "bf16",
                    "op": "sum",
                    "ranks": 2,
                    "bytes": bytes,
                    "mode": mode,
                    "time_us": t * 1e6,
                    "algbw_gbs": bw(t),
                    "busbw_gbs": bus(t),
                    "path": path,
                    "algorithm": algorithm,
                    "staged_chunks": 0,
                    "correct": if checked { json!(ok) } else { json!(null) },
                }))?;
            }
        }
    }
    Ok(all_ok)
}
