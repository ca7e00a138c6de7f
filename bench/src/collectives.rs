//! Reduce-scatter, all-gather and broadcast benchmark (the lead runs it on the GPU machine;
//! `cargo xtask bench-hw` style): bf16 (or another type), 1 KiB to 1 GiB, on the first N
//! devices, on symmetric buffers and on the caller's own memory (`DeviceBuffer`), out of
//! place. Every size is first checked against the host reference on random data, then timed
//! as bench-allreduce does: **pipelined** (a CUDA graph of many calls per rank, replayed; rank
//! 0's time per call, median of `--runs`) and **single** (a thread per rank, each rank's one
//! call captured once into a graph and launched between two events after a spinning host
//! barrier; the slowest rank's time, median of `--runs`).
//!
//! `bytes` is the whole gathered / scattered buffer, as nccl-tests: reduce-scatter's input of N
//! chunks, all-gather's output of N chunks, broadcast's message. busbw = algbw × (N−1)/N for
//! reduce-scatter and all-gather, algbw for broadcast. Prints an nccl-tests style table and one
//! `RESULT {json}` line per measurement, with the schema of bench-allreduce (`bench` =
//! `reduce_scatter` | `all_gather` | `broadcast`). On the simulated driver times mean nothing.

use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use cuda_multimem::{DeviceBuffer, Stream};
use cuda_multimem_collectives::testing::{
    all_gather_reference, broadcast_reference, random_input, reduce_scatter_reference,
};
use cuda_multimem_collectives::{
    Choice, CommConfig, Communicator, Dst, Element, MulticastPolicy, ReduceOp, Src, SymmetricBuffer,
};
use half::{bf16, f16};
use serde_json::json;

mod common;

use common::{pipelined_by_graph, result_line, single_by_graph, sync, Prefix, RankCall, Res};

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
enum OpArg {
    Sum,
    Min,
    Max,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Coll {
    ReduceScatter,
    AllGather,
    Broadcast,
    All,
}

impl Coll {
    fn name(self) -> &'static str {
        match self {
            Coll::ReduceScatter => "reduce_scatter",
            Coll::AllGather => "all_gather",
            Coll::Broadcast => "broadcast",
            Coll::All => "all",
        }
    }
}

/// Reduce-scatter, all-gather and broadcast benchmark.
#[derive(Parser, Debug)]
#[command(name = "bench-collectives")]
struct Args {
    /// Which collective.
    #[arg(long, value_enum, default_value_t = Coll::All)]
    collective: Coll,
    /// Ranks (the first N devices).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Smallest message in bytes (the whole buffer).
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
    /// Reduce-scatter's operator.
    #[arg(long, value_enum, default_value_t = OpArg::Sum)]
    op: OpArg,
    /// Broadcast's root.
    #[arg(long, default_value_t = 0)]
    root: usize,
    /// Which operands.
    #[arg(long, value_enum, default_value_t = Operands::Both)]
    operands: Operands,
    /// Which timing.
    #[arg(long, value_enum, default_value_t = Mode::Both)]
    mode: Mode,
    /// Sizes above this are timed without the host-reference check.
    #[arg(long, default_value_t = usize::MAX)]
    check_max: usize,
    /// CommConfig::max_blocks.
    #[arg(long)]
    blocks: Option<u32>,
    /// CommConfig::push_threads.
    #[arg(long)]
    push_threads: Option<u32>,
    /// CommConfig::stage_bytes.
    #[arg(long)]
    stage_bytes: Option<usize>,
    /// CommConfig::one_shot_max_bytes (all-gather and broadcast store directly into symmetric
    /// outputs above it).
    #[arg(long)]
    one_shot_max: Option<usize>,
    /// CommConfig::gather_ll_max_bytes and broadcast_ll_max_bytes (whole buffers up to it run
    /// the low-latency forms; 0: never).
    #[arg(long)]
    ll_max: Option<usize>,
    /// CommConfig::gather_ce_min_bytes and broadcast_ce_min_bytes (whole buffers from it go
    /// through the copy engines where the operands allow; a value above every size: never).
    #[arg(long)]
    ce_min: Option<usize>,
    /// Symmetric operands only: call the in-place forms on the output (all-gather, broadcast)
    /// or the input (reduce-scatter); timed only (no check).
    #[arg(long)]
    in_place: bool,
}

impl Args {
    fn config(&self) -> CommConfig {
        let mut c = CommConfig::default();
        if let Some(v) = self.blocks {
            c.max_blocks = v;
        }
        if let Some(v) = self.push_threads {
            c.push_threads = v;
        }
        c.stage_bytes = self.stage_bytes.or(c.stage_bytes);
        c.one_shot_max_bytes = self.one_shot_max.or(c.one_shot_max_bytes);
        if let Some(v) = self.ll_max {
            c.gather_ll_max_bytes = v;
            c.broadcast_ll_max_bytes = v;
        }
        if let Some(v) = self.ce_min {
            c.gather_ce_min_bytes = v;
            c.broadcast_ce_min_bytes = v;
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

    fn sizes(&self) -> Vec<usize> {
        common::doubling_sizes(&self.sizes, self.min_bytes, 1, self.max_bytes)
    }
}

fn main() -> ExitCode {
    common::exit_code("bench-collectives", run())
}

fn run() -> Res<bool> {
    let args = Args::parse();
    match args.dtype {
        Ty::Bf16 => bench::<bf16>(&args),
        Ty::F16 => bench::<f16>(&args),
        Ty::F32 => bench::<f32>(&args),
    }
}

/// Every rank's input and output.
enum Bufs<T: Element> {
    Symmetric(SymmetricBuffer<T>, SymmetricBuffer<T>),
    Local(Vec<(DeviceBuffer<T>, DeviceBuffer<T>)>),
}

struct Bench<'a, T: Element> {
    comm: &'a Communicator,
    streams: &'a [Stream],
    bufs: Bufs<T>,
    coll: Coll,
    op: ReduceOp,
    root: usize,
    in_place: bool,
}

/// Lengths (input, output) per rank for `chunk` elements per rank.
fn lengths(coll: Coll, n: usize, chunk: usize) -> (usize, usize) {
    match coll {
        Coll::ReduceScatter => (n * chunk, chunk),
        Coll::AllGather => (chunk, n * chunk),
        _ => (chunk, chunk),
    }
}

/// One call of `coll` on rank `r`'s handle.
fn call<T: Element>(
    comm: &Communicator,
    r: usize,
    (coll, op, root): (Coll, ReduceOp, usize),
    i: Src<'_, T>,
    o: Dst<'_, T>,
    s: &Stream,
) -> Res<Choice> {
    let h = comm.rank(r)?;
    Ok(match coll {
        Coll::ReduceScatter => h.reduce_scatter(i, o, op, s)?,
        Coll::AllGather => h.all_gather(i, o, s)?,
        _ => h.broadcast(i, o, root, s)?,
    })
}

impl<T: Element + Default + Copy> Bench<'_, T> {
    fn what(&self) -> (Coll, ReduceOp, usize) {
        (self.coll, self.op, self.root)
    }

    fn call(&mut self, r: usize, chunk: usize) -> Res<Choice> {
        let n = self.comm.size();
        let (il, ol) = lengths(self.coll, n, chunk);
        let what = self.what();
        let s = &self.streams[r];
        match &mut self.bufs {
            Bufs::Symmetric(i, o) if self.in_place => {
                let h = self.comm.rank(r)?;
                Ok(match self.coll {
                    Coll::ReduceScatter => {
                        h.reduce_scatter_in_place(i.slice_mut(..il)?, self.op, s)?
                    }
                    Coll::AllGather => h.all_gather_in_place(o.slice_mut(..ol)?, s)?,
                    _ => h.broadcast_in_place(o.slice_mut(..ol)?, self.root, s)?,
                })
            }
            Bufs::Symmetric(i, o) => call(
                self.comm,
                r,
                what,
                i.slice(..il)?.into(),
                o.slice_mut(..ol)?.into(),
                s,
            ),
            Bufs::Local(v) => {
                let (i, o) = &mut v[r];
                call(self.comm, r, what, i.slice_src(il), o.slice_dst(ol), s)
            }
        }
    }

    fn sync(&self) -> Res<()> {
        sync(self.streams)
    }

    fn check(&mut self, chunk: usize, seed: &mut u64) -> Res<bool> {
        let n = self.comm.size();
        let (il, ol) = lengths(self.coll, n, chunk);
        let inputs: Vec<Vec<T>> = (0..n).map(|_| random_input(il, seed)).collect();
        for (r, d) in inputs.iter().enumerate() {
            match &mut self.bufs {
                Bufs::Symmetric(i, _) => i.write(r, 0, d)?,
                Bufs::Local(v) => v[r].0.copy_from_host(0, d)?,
            }
        }
        for r in 0..n {
            self.call(r, chunk)?;
        }
        self.sync()?;
        self.comm.check()?;
        let refs: Vec<&[T]> = inputs.iter().map(|v| &v[..]).collect();
        let want: Vec<Vec<T>> = match self.coll {
            Coll::ReduceScatter => reduce_scatter_reference(self.op, &refs),
            Coll::AllGather => vec![all_gather_reference(&refs); n],
            _ => vec![broadcast_reference(&refs, self.root); n],
        };
        let mut got = vec![T::default(); ol];
        for (r, w) in want.iter().enumerate() {
            match &self.bufs {
                Bufs::Symmetric(_, o) => o.read(r, 0, &mut got)?,
                Bufs::Local(v) => v[r].1.copy_to_host(0, &mut got)?,
            }
            if got
                .iter()
                .zip(w)
                .any(|(g, w)| g.to_f32().to_bits() != w.to_f32().to_bits())
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn pipelined(&mut self, chunk: usize, iters: usize, runs: usize) -> Res<f64> {
        let streams = self.streams;
        let t = pipelined_by_graph(
            streams,
            (iters, runs),
            cuda_multimem::CaptureMode::Relaxed,
            &mut |r| self.call(r, chunk).map(drop),
        )?;
        self.comm.check()?;
        Ok(t)
    }

    /// One call between host barriers, by bench-allreduce's graph method
    /// ([`common::single_by_graph`]).
    fn single(&mut self, chunk: usize, runs: usize) -> Res<f64> {
        let n = self.comm.size();
        let (il, ol) = lengths(self.coll, n, chunk);
        let (comm, streams, what) = (self.comm, self.streams, self.what());
        let calls: Vec<RankCall<'_>> = match &mut self.bufs {
            Bufs::Symmetric(i, o) => {
                let i = &*i;
                o.parts_mut()
                    .into_iter()
                    .map(|mut p| -> RankCall<'_> {
                        let r = p.rank();
                        let call = move |s: &Stream| -> Res<()> {
                            let (src, dst) = (i.slice(..il)?, p.slice_mut(..ol)?);
                            call(comm, r, what, src.into(), dst.into(), s)?;
                            Ok(())
                        };
                        (r, Box::new(call))
                    })
                    .collect()
            }
            Bufs::Local(v) => v
                .iter_mut()
                .enumerate()
                .map(|(r, (i, o))| -> RankCall<'_> {
                    let call = move |s: &Stream| -> Res<()> {
                        call(comm, r, what, i.slice_src(il), o.slice_dst(ol), s)?;
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

fn bench<T: Element + Default + Copy>(args: &Args) -> Res<bool> {
    cuda_multimem_collectives::sim::install();
    let driver = cuda_multimem_sim::driver_from_env()?;
    let devices = driver.devices();
    if devices.len() < args.ranks {
        return Err(format!("{} ranks asked, {} devices", args.ranks, devices.len()).into());
    }
    let devices = &devices[..args.ranks];
    // these collectives are peer-to-peer only: never build a multicast team for them
    let comm = Communicator::builder(devices)
        .config(args.config())
        .multicast(MulticastPolicy::Never)
        .build()?;
    let streams: Vec<Stream> = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
    let n = comm.size();
    if args.root >= n {
        return Err(format!("--root {}: the team has {n} ranks", args.root).into());
    }
    let es = std::mem::size_of::<T>();
    let sizes = args.sizes();
    let max = sizes.iter().copied().max().unwrap_or(es);
    let op = args.op();
    let colls: &[Coll] = match args.collective {
        Coll::All => &[Coll::ReduceScatter, Coll::AllGather, Coll::Broadcast],
        c => std::slice::from_ref(match c {
            Coll::ReduceScatter => &Coll::ReduceScatter,
            Coll::AllGather => &Coll::AllGather,
            _ => &Coll::Broadcast,
        }),
    };
    let kinds: &[&str] = match args.operands {
        Operands::Symmetric => &["symmetric"],
        Operands::Local => &["local"],
        Operands::Both => &["symmetric", "local"],
    };
    let mut all_ok = true;
    let mut seed = 0x5eed_4321_u64;
    for &coll in colls {
        println!(
            "# {} {}{}, out of place, {n} x {}, driver {}{}; median of {} runs",
            coll.name(),
            T::DTYPE,
            match coll {
                Coll::ReduceScatter => format!(" {op}"),
                Coll::Broadcast => format!(" root {}", args.root),
                _ => String::new(),
            },
            devices[0].name()?,
            driver.version(),
            if driver.is_simulated() {
                " (SIMULATED: times mean nothing)"
            } else {
                ""
            },
            args.runs
        );
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
        // per rank: the largest chunk
        let per_chunk = |bytes: usize| match coll {
            Coll::Broadcast => bytes / es,
            _ => bytes / (n * es),
        };
        let max_chunk = per_chunk(max).max(1);
        let (mil, mol) = lengths(coll, n, max_chunk);
        for kind in kinds {
            let bufs = if *kind == "symmetric" {
                Bufs::Symmetric(comm.alloc::<T>(mil)?, comm.alloc::<T>(mol)?)
            } else {
                Bufs::Local(
                    devices
                        .iter()
                        .map(|d| -> Result<_, cuda_multimem::Error> {
                            Ok((
                                DeviceBuffer::<T>::zeroed(d, mil)?,
                                DeviceBuffer::<T>::zeroed(d, mol)?,
                            ))
                        })
                        .collect::<Result<_, _>>()?,
                )
            };
            let mut b = Bench {
                comm: &comm,
                streams: &streams,
                bufs,
                coll,
                op,
                root: args.root,
                in_place: args.in_place,
            };
            for &size in &sizes {
                let chunk = per_chunk(size);
                if chunk == 0 {
                    continue;
                }
                // the whole buffer, as nccl-tests
                let bytes = match coll {
                    Coll::Broadcast => chunk * es,
                    _ => chunk * n * es,
                };
                // the host-reference check is of the out-of-place result: in-place runs are timed only
                let checked = bytes <= args.check_max && !args.in_place;
                let ok = !checked || b.check(chunk, &mut seed)?;
                all_ok &= ok;
                let iters = if driver.is_simulated() {
                    2
                } else {
                    ((4usize << 30) / bytes).clamp(4, 100)
                };
                let runs = if driver.is_simulated() { 1 } else { args.runs };
                // what ran (the check's calls report it; one more call records it here)
                let mut choice = None;
                let pipe = if args.mode != Mode::Single {
                    Some(b.pipelined(chunk, iters, runs)?)
                } else {
                    None
                };
                let single = if args.mode != Mode::Pipelined {
                    Some(b.single(chunk, runs)?)
                } else {
                    None
                };
                for r in 0..n {
                    choice = Some(b.call(r, chunk)?);
                }
                b.sync()?;
                comm.check()?;
                let choice = choice.ok_or("no call")?;
                let bw = |t: f64| bytes as f64 / t / 1e9;
                let bus = |t: f64| match coll {
                    Coll::Broadcast => bw(t),
                    _ => bw(t) * (n as f64 - 1.0) / n as f64,
                };
                let cell = |t: Option<f64>, f: &dyn Fn(f64) -> f64| {
                    t.map_or("-".to_string(), |t| format!("{:.2}", f(t)))
                };
                println!(
                    "{:>10} {:>10} {:>9} {:>11} {:>9} {:>9} {:>10} {:>9} {:>9}  {:<36} {:>7}",
                    kind,
                    bytes,
                    bytes / es,
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
                        "bench": coll.name(),
                        "impl": "cuda-multimem",
                        "operand": kind,
                        "dtype": T::DTYPE.name(),
                        "op": if coll == Coll::ReduceScatter { op.name() } else { "-" },
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
    }
    Ok(all_ok)
}
