//! Allreduce benchmark (`cargo xtask bench-hw allreduce` runs it on the GPU machine): bf16 sum
//! (or another type and operator), 1 KiB to 1 GiB, on the first N devices, on symmetric buffers
//! and on the caller's own memory (`DeviceBuffer`, what a cudarc slice is). Every size is first
//! checked against a host reference on random data, then timed two ways:
//! - **pipelined**: a CUDA graph of many calls per rank, replayed; time per call (rank 0's
//!   events), median of `--runs` replays;
//! - **single**: one call between host barriers (a thread per rank), each rank's time from its
//!   events around the call, the maximum over ranks; median of `--runs`.
//!
//! Prints an nccl-tests style table and one `RESULT {json}` line per measurement (serde_json;
//! a non-finite number is an error, never a dropped line). On the simulated driver the times
//! mean nothing.

use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use cuda_multimem::{DeviceBuffer, Stream};
use cuda_multimem_collectives::testing::{random_input, reference};
use cuda_multimem_collectives::{
    Algorithm, Choice, CommConfig, Communicator, Element, Path, ReduceOp,
};
use half::{bf16, f16};
use serde_json::json;

mod common;

use common::{pipelined_by_graph, result_line, single_by_graph, sync, RankCall, Res};

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Operands {
    Symmetric,
    Local,
    Both,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Mode {
    Pipelined,
    Single,
    Both,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Ty {
    Bf16,
    F16,
    F32,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Alg {
    OneShot,
    OneShotLl,
    TwoShot,
    TwoShotPush,
    TwoShotCe,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum OpArg {
    Sum,
    Min,
    Max,
}

/// Allreduce benchmark.
#[derive(Parser, Debug)]
#[command(name = "bench-allreduce")]
struct Args {
    /// Ranks (the first N devices).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
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
    /// Element type.
    #[arg(long, value_enum, default_value_t = Ty::Bf16)]
    dtype: Ty,
    /// Operator.
    #[arg(long, value_enum, default_value_t = OpArg::Sum)]
    op: OpArg,
    /// Which operands.
    #[arg(long, value_enum, default_value_t = Operands::Both)]
    operands: Operands,
    /// Which timing.
    #[arg(long, value_enum, default_value_t = Mode::Both)]
    mode: Mode,
    /// Sizes above this are timed without the host-reference check (tuning sweeps).
    #[arg(long, default_value_t = usize::MAX)]
    check_max: usize,
    /// Force an algorithm.
    #[arg(long, value_enum)]
    algorithm: Option<Alg>,
    /// CommConfig::max_blocks.
    #[arg(long)]
    blocks: Option<u32>,
    /// CommConfig::threads.
    #[arg(long)]
    threads: Option<u32>,
    /// CommConfig::push_threads.
    #[arg(long)]
    push_threads: Option<u32>,
    /// CommConfig::stage_bytes.
    #[arg(long)]
    stage_bytes: Option<usize>,
    /// CommConfig::ll_max_bytes.
    #[arg(long)]
    ll_max: Option<usize>,
    /// CommConfig::one_shot_max_bytes.
    #[arg(long)]
    one_shot_max: Option<usize>,
    /// CommConfig::ce_max_bytes.
    #[arg(long)]
    ce_max: Option<usize>,
    /// CommConfig::scratch_bytes.
    #[arg(long)]
    scratch_bytes: Option<usize>,
}

impl Args {
    fn config(&self) -> CommConfig {
        let mut c = CommConfig {
            algorithm: self.algorithm.map(|a| match a {
                Alg::OneShot => Algorithm::OneShot,
                Alg::OneShotLl => Algorithm::OneShotLl,
                Alg::TwoShot => Algorithm::TwoShot,
                Alg::TwoShotPush => Algorithm::TwoShotPush,
                Alg::TwoShotCe => Algorithm::TwoShotCe,
            }),
            ..Default::default()
        };
        if let Some(v) = self.blocks {
            c.max_blocks = v;
        }
        if let Some(v) = self.threads {
            c.threads = v;
        }
        if let Some(v) = self.push_threads {
            c.push_threads = v;
        }
        c.stage_bytes = self.stage_bytes.or(c.stage_bytes);
        if let Some(v) = self.ll_max {
            c.ll_max_bytes = v;
        }
        c.one_shot_max_bytes = self.one_shot_max.or(c.one_shot_max_bytes);
        if let Some(v) = self.ce_max {
            c.ce_max_bytes = v;
        }
        if let Some(v) = self.scratch_bytes {
            c.scratch_bytes = v;
        }
        c
    }

    fn op(&self) -> ReduceOp {
        match self.op {
            OpArg::Sum => ReduceOp::Sum,
            OpArg::Min => ReduceOp::Min,
            OpArg::Max => ReduceOp::Max,
        }
    }

    fn sizes(&self, elem: usize) -> Vec<usize> {
        common::doubling_sizes(&self.sizes, self.min_bytes, elem, self.max_bytes)
    }
}

fn main() -> ExitCode {
    common::exit_code("bench-allreduce", run())
}

fn run() -> Res<bool> {
    let args = Args::parse();
    match args.dtype {
        Ty::Bf16 => bench::<bf16>(&args),
        Ty::F16 => bench::<f16>(&args),
        Ty::F32 => bench::<f32>(&args),
    }
}

/// What one rank's operands are for a size.
enum Bufs<T: Element> {
    Symmetric(cuda_multimem_collectives::SymmetricBuffer<T>),
    Local(Vec<DeviceBuffer<T>>),
}

struct Bench<'a, T: Element> {
    comm: &'a Communicator,
    streams: &'a [Stream],
    bufs: Bufs<T>,
    op: ReduceOp,
}

impl<T: Element + Default> Bench<'_, T> {
    /// Rank `r`'s call, in place on its operand, on its stream.
    fn call(&mut self, r: usize, count: usize) -> Res<Choice> {
        let h = self.comm.rank(r)?;
        let s = &self.streams[r];
        Ok(match &mut self.bufs {
            Bufs::Symmetric(b) => h.all_reduce_in_place(b.slice_mut(..count)?, self.op, s)?,
            Bufs::Local(v) => {
                let p = v[r].device_ptr();
                // SAFETY: the first `count` elements of rank r's own buffer, of its device,
                // alive until the streams are synchronised (below, before any drop).
                let dst = unsafe { cuda_multimem_collectives::Dst::<T>::from_raw(p, count) };
                h.all_reduce_in_place(dst, self.op, s)?
            }
        })
    }

    fn sync(&self) -> Res<()> {
        sync(self.streams)
    }

    /// Random inputs, one call per rank, the results against the reference.
    fn check(&mut self, count: usize, seed: &mut u64) -> Res<bool> {
        let n = self.comm.size();
        let inputs: Vec<Vec<T>> = (0..n).map(|_| random_input(count, seed)).collect();
        for (r, d) in inputs.iter().enumerate() {
            match &mut self.bufs {
                Bufs::Symmetric(b) => b.write(r, 0, d)?,
                Bufs::Local(v) => v[r].copy_from_host(0, d)?,
            }
        }
        let mut choice = None;
        for r in 0..n {
            choice = Some(self.call(r, count)?);
        }
        self.sync()?;
        self.comm.check()?;
        let refs: Vec<&[T]> = inputs.iter().map(|v| &v[..]).collect();
        let want = reference(self.op, &refs);
        let exact = !(choice.is_some_and(|c| c.path == Path::Multimem) && self.op == ReduceOp::Sum);
        let mut got = vec![T::default(); count];
        for r in 0..n {
            match &self.bufs {
                Bufs::Symmetric(b) => b.read(r, 0, &mut got)?,
                Bufs::Local(v) => v[r].copy_to_host(0, &mut got)?,
            }
            let bad = got.iter().zip(&want).any(|(g, w)| {
                if exact {
                    g.to_f32().to_bits() != w.to_f32().to_bits()
                } else {
                    (g.to_f32() - w.to_f32()).abs() > 0.05 * n as f32
                }
            });
            if bad {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Time per call of a graph of `iters` calls per rank, replayed `runs` times (median).
    fn pipelined(&mut self, count: usize, iters: usize, runs: usize) -> Res<f64> {
        let streams = self.streams;
        let t = pipelined_by_graph(
            streams,
            (iters, runs),
            cuda_multimem::CaptureMode::Relaxed,
            &mut |r| self.call(r, count).map(drop),
        )?;
        self.comm.check()?;
        Ok(t)
    }

    /// One call between host barriers, by the graph method of [`common::single_by_graph`]:
    /// each rank's call captured once into a graph, launched after a spinning barrier between
    /// two events; the slowest rank's time, median over runs. The host's own submission cost is
    /// outside the events but the graph launch is inside (NCCL's reference puts its events
    /// inside the graph instead).
    fn single(&mut self, count: usize, runs: usize) -> Res<f64> {
        let (op, comm, streams) = (self.op, self.comm, self.streams);
        let calls: Vec<RankCall<'_>> = match &mut self.bufs {
            Bufs::Symmetric(b) => b
                .parts_mut()
                .into_iter()
                .map(|mut p| -> RankCall<'_> {
                    let r = p.rank();
                    let call = move |s: &Stream| -> Res<()> {
                        comm.rank(r)?
                            .all_reduce_in_place(p.slice_mut(..count)?, op, s)?;
                        Ok(())
                    };
                    (r, Box::new(call))
                })
                .collect(),
            Bufs::Local(v) => v
                .iter_mut()
                .enumerate()
                .map(|(r, b)| -> RankCall<'_> {
                    let p = b.device_ptr();
                    let call = move |s: &Stream| -> Res<()> {
                        // SAFETY: this rank's own buffer (`self.bufs`, exclusively borrowed for
                        // the measurement), alive until its stream is synchronised.
                        let dst =
                            unsafe { cuda_multimem_collectives::Dst::<T>::from_raw(p, count) };
                        comm.rank(r)?.all_reduce_in_place(dst, op, s)?;
                        Ok(())
                    };
                    (r, Box::new(call))
                })
                .collect(),
        };
        let t = single_by_graph(streams, runs, calls)?;
        comm.check()?;
        Ok(t)
    }
}

fn bench<T: Element + Default>(args: &Args) -> Res<bool> {
    cuda_multimem_collectives::sim::install();
    let driver = cuda_multimem_sim::driver_from_env()?;
    let devices = driver.devices();
    if devices.len() < args.ranks {
        return Err(format!("{} ranks asked, {} devices", args.ranks, devices.len()).into());
    }
    let devices = &devices[..args.ranks];
    let comm = Communicator::builder(devices)
        .config(args.config())
        .build()?;
    let streams: Vec<Stream> = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
    let n = comm.size();
    let es = std::mem::size_of::<T>();
    let sizes = args.sizes(es);
    let max = sizes.iter().copied().max().unwrap_or(es);
    let op = args.op();
    println!(
        "# allreduce {} {}, in place, {n} x {}, driver {}{}; median of {} runs",
        T::DTYPE,
        op,
        devices[0].name()?,
        driver.version(),
        if driver.is_simulated() {
            " (SIMULATED: times mean nothing)"
        } else {
            ""
        },
        args.runs
    );
    let mut all_ok = true;
    let kinds: &[&str] = match args.operands {
        Operands::Symmetric => &["symmetric"],
        Operands::Local => &["local"],
        Operands::Both => &["symmetric", "local"],
    };
    println!(
        "{:>10} {:>10} {:>9} {:>11} {:>9} {:>9} {:>10} {:>9} {:>9}  {:<36} {:>7}",
        "operands",
        "bytes",
        "count",
        "pipe(us)",
        "algbw",
        "busbw",
        "single(us)",
        "algbw",
        "busbw",
        "path / algorithm",
        "correct"
    );
    let mut seed = 0x5eed_1234_u64;
    for kind in kinds {
        let bufs = if *kind == "symmetric" {
            Bufs::Symmetric(comm.alloc::<T>(max / es)?)
        } else {
            Bufs::Local(
                devices
                    .iter()
                    .map(|d| DeviceBuffer::<T>::zeroed(d, max / es))
                    .collect::<Result<_, _>>()?,
            )
        };
        let mut b = Bench {
            comm: &comm,
            streams: &streams,
            bufs,
            op,
        };
        for &bytes in &sizes {
            let count = bytes / es;
            let checked = bytes <= args.check_max;
            let ok = !checked || b.check(count, &mut seed)?;
            all_ok &= ok;
            let choice = comm.choice(
                T::DTYPE,
                op,
                count,
                if *kind == "symmetric" {
                    cuda_multimem_collectives::Operands::Symmetric
                } else {
                    cuda_multimem_collectives::Operands::Local
                },
            )?;
            let iters = if driver.is_simulated() {
                2
            } else {
                ((4usize << 30) / bytes).clamp(4, 100)
            };
            let runs = if driver.is_simulated() { 1 } else { args.runs };
            let pipe = if args.mode != Mode::Single {
                Some(b.pipelined(count, iters, runs)?)
            } else {
                None
            };
            let single = if args.mode != Mode::Pipelined {
                Some(b.single(count, runs)?)
            } else {
                None
            };
            let bw = |t: f64| bytes as f64 / t / 1e9;
            let bus = |t: f64| bw(t) * 2.0 * (n as f64 - 1.0) / n as f64;
            let cell = |t: Option<f64>, f: &dyn Fn(f64) -> f64| {
                t.map_or("-".to_string(), |t| format!("{:.2}", f(t)))
            };
            println!(
                "{:>10} {:>10} {:>9} {:>11} {:>9} {:>9} {:>10} {:>9} {:>9}  {:<36} {:>7}",
                kind,
                bytes,
                count,
                cell(pipe, &|t| t * 1e6),
                cell(pipe, &bw),
                cell(pipe, &bus),
                cell(single, &|t| t * 1e6),
                cell(single, &bw),
                cell(single, &bus),
                choice.to_string(),
                match (checked, ok) {
                    (false, _) => "-",
                    (true, true) => "yes",
                    (true, false) => "NO",
                }
            );
            for (mode, t) in [("pipelined", pipe), ("single", single)] {
                let Some(t) = t else { continue };
                result_line(json!({
                    "bench": "allreduce",
                    "impl": "cuda-multimem",
                    "operand": kind,
                    "dtype": T::DTYPE.name(),
                    "op": op.name(),
                    "ranks": n,
                    "bytes": bytes,
                    "mode": mode,
                    "time_us": t * 1e6,
                    "algbw_gbs": bw(t),
                    "busbw_gbs": bus(t),
                    "path": choice.path.to_string(),
                    "algorithm": choice.algorithm.to_string(),
                    "staged_chunks": choice.staged_chunks,
                    "correct": if checked { json!(ok) } else { json!(null) },
                }))?;
            }
        }
    }
    Ok(all_ok)
}
