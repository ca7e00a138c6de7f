//! All-to-all benchmark (`cargo xtask bench-hw alltoall` runs it beside NCCL's `ncclAlltoAll`
//! and torch's `all_to_all_single`): `RankHandle::all_to_all` of bf16 (or f32), 1 KiB to 1 GiB,
//! on symmetric buffers and on the caller's own memory (`DeviceBuffer`), out of place (or in
//! place with `--in-place`), in the form the planner chooses (the low-latency form for small
//! parts, the direct form above it: into a symmetric output, or through the communicator's
//! scratch for own memory) or a forced one (`--form ll|direct`). Every size is first checked
//! bit for bit against the host reference on random data, then timed as bench-allreduce does:
//! **pipelined** (a CUDA graph of many calls per rank, replayed; rank 0's time per call, median
//! of `--runs`) and **single** (a thread per rank, each rank's one call captured once into a
//! graph and launched between two events after a spinning host barrier; the slowest rank's
//! time, median of `--runs`).
//!
//! nccl-tests' columns: `bytes` is one rank's whole send buffer (N parts of bytes / N), `count`
//! its elements, algbw = bytes / time, busbw = algbw × (N−1)/N. An own-memory output above the
//! low-latency limit lands in the communicator's scratch: sizes whose output the scratch cannot
//! hold are skipped with a line saying so (raise `--scratch-bytes`). With fewer GPUs than
//! `--ranks`, ranks share a GPU (said on the first line: not a link benchmark). One
//! `RESULT {json}` line per measurement, the schema of bench-allreduce with `bench` =
//! "alltoall". On the simulated driver the times mean nothing.

use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use cuda_multimem::{DeviceBuffer, Stream};
use cuda_multimem_collectives::testing::random_input;
use cuda_multimem_collectives::{
    Choice, CommConfig, Communicator, Dst, Element, MulticastPolicy, Operands, Src, SymmetricBuffer,
};
use half::bf16;
use serde_json::json;

mod common;

use common::{
    pipelined_by_graph, result_line, single_by_graph, sync, team_devices, Prefix, RankCall, Res,
};

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Which {
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
    F32,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Form {
    /// The planner's choice.
    Auto,
    /// The low-latency form wherever a part fits its slot (`gather_ll_max_bytes` = usize::MAX).
    Ll,
    /// The direct form at every size (`gather_ll_max_bytes` = 0).
    Direct,
}

/// All-to-all benchmark.
#[derive(Parser, Debug)]
#[command(name = "bench-alltoall")]
struct Args {
    /// Ranks (the first N devices; with fewer devices, ranks share them).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Smallest message in bytes (one rank's whole send buffer).
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
    /// Which operands.
    #[arg(long, value_enum, default_value_t = Which::Both)]
    operands: Which,
    /// Which timing.
    #[arg(long, value_enum, default_value_t = Mode::Both)]
    mode: Mode,
    /// The form: the planner's, or forced.
    #[arg(long, value_enum, default_value_t = Form::Auto)]
    form: Form,
    /// Sizes above this are timed without the host-reference check.
    #[arg(long, default_value_t = usize::MAX)]
    check_max: usize,
    /// In place (`all_to_all_in_place` on the output buffer); timed only (no check).
    #[arg(long)]
    in_place: bool,
    /// CommConfig::max_blocks.
    #[arg(long)]
    blocks: Option<u32>,
    /// CommConfig::scratch_bytes (own-memory outputs above the low-latency limit land there).
    #[arg(long)]
    scratch_bytes: Option<usize>,
    /// CommConfig::gather_ll_max_bytes (inputs up to it run the low-latency form where a part
    /// fits a slot; overrides --form).
    #[arg(long)]
    ll_max: Option<usize>,
}

impl Args {
    fn config(&self) -> CommConfig {
        let mut c = CommConfig::default();
        match self.form {
            Form::Auto => {}
            Form::Ll => c.gather_ll_max_bytes = usize::MAX,
            Form::Direct => c.gather_ll_max_bytes = 0,
        }
        if let Some(v) = self.ll_max {
            c.gather_ll_max_bytes = v;
        }
        if let Some(v) = self.blocks {
            c.max_blocks = v;
        }
        if let Some(v) = self.scratch_bytes {
            c.scratch_bytes = v;
        }
        c
    }

    fn sizes(&self) -> Vec<usize> {
        common::doubling_sizes(&self.sizes, self.min_bytes, 1, self.max_bytes)
    }
}

fn main() -> ExitCode {
    common::exit_code("bench-alltoall", run())
}

fn run() -> Res<bool> {
    let args = Args::parse();
    match args.dtype {
        Ty::Bf16 => bench::<bf16>(&args),
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
    in_place: bool,
}

/// One out-of-place or in-place call on rank `r`'s handle.
fn call<T: Element>(
    comm: &Communicator,
    r: usize,
    i: Option<Src<'_, T>>,
    o: Dst<'_, T>,
    s: &Stream,
) -> Res<Choice> {
    let h = comm.rank(r)?;
    Ok(match i {
        Some(i) => h.all_to_all(i, o, s)?,
        None => h.all_to_all_in_place(o, s)?,
    })
}

/// What rank `k`'s output is for the inputs: part r = part k of rank r's input.
fn reference<T: Copy>(inputs: &[Vec<T>], k: usize) -> Vec<T> {
    let n = inputs.len();
    let part = inputs[0].len() / n;
    inputs
        .iter()
        .flat_map(|v| v[k * part..(k + 1) * part].iter().copied())
        .collect()
}

impl<T: Element + Default + Copy> Bench<'_, T> {
    fn call(&mut self, r: usize, count: usize) -> Res<Choice> {
        let s = &self.streams[r];
        let in_place = self.in_place;
        match &mut self.bufs {
            Bufs::Symmetric(i, o) => {
                let dst = o.slice_mut(..count)?.into();
                let src = if in_place {
                    None
                } else {
                    Some(i.slice(..count)?.into())
                };
                call(self.comm, r, src, dst, s)
            }
            Bufs::Local(v) => {
                let (i, o) = &mut v[r];
                let src = (!in_place).then(|| i.slice_src(count));
                call(self.comm, r, src, o.slice_dst(count), s)
            }
        }
    }

    fn check(&mut self, count: usize, seed: &mut u64) -> Res<bool> {
        let n = self.comm.size();
        let inputs: Vec<Vec<T>> = (0..n).map(|_| random_input(count, seed)).collect();
        for (r, d) in inputs.iter().enumerate() {
            match &mut self.bufs {
                Bufs::Symmetric(i, _) => i.write(r, 0, d)?,
                Bufs::Local(v) => v[r].0.copy_from_host(0, d)?,
            }
        }
        for r in 0..n {
            self.call(r, count)?;
        }
        sync(self.streams)?;
        self.comm.check()?;
        let mut got = vec![T::default(); count];
        for k in 0..n {
            match &self.bufs {
                Bufs::Symmetric(_, o) => o.read(k, 0, &mut got)?,
                Bufs::Local(v) => v[k].1.copy_to_host(0, &mut got)?,
            }
            let want = reference(&inputs, k);
            if got
                .iter()
                .zip(&want)
                .any(|(g, w)| g.to_f32().to_bits() != w.to_f32().to_bits())
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

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

    /// One call between host barriers ([`common::single_by_graph`]).
    fn single(&mut self, count: usize, runs: usize) -> Res<f64> {
        let (comm, streams, in_place) = (self.comm, self.streams, self.in_place);
        let calls: Vec<RankCall<'_>> = match &mut self.bufs {
            Bufs::Symmetric(i, o) => {
                let i = &*i;
                o.parts_mut()
                    .into_iter()
                    .map(|mut p| -> RankCall<'_> {
                        let r = p.rank();
                        let f = move |s: &Stream| -> Res<()> {
                            let src = if in_place {
                                None
                            } else {
                                Some(i.slice(..count)?.into())
                            };
                            call(comm, r, src, p.slice_mut(..count)?.into(), s)?;
                            Ok(())
                        };
                        (r, Box::new(f))
                    })
                    .collect()
            }
            Bufs::Local(v) => v
                .iter_mut()
                .enumerate()
                .map(|(r, (i, o))| -> RankCall<'_> {
                    let f = move |s: &Stream| -> Res<()> {
                        let src = (!in_place).then(|| i.slice_src(count));
                        call(comm, r, src, o.slice_dst(count), s)?;
                        Ok(())
                    };
                    (r, Box::new(f))
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
    let (devices, shared) = team_devices(&driver, args.ranks, "bench-alltoall")?;
    // unicast only: never a multicast object
    let comm = Communicator::builder(&devices)
        .config(args.config())
        .multicast(MulticastPolicy::Never)
        .allow_shared_devices(shared)
        .build()?;
    let streams: Vec<Stream> = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
    let n = comm.size();
    let es = std::mem::size_of::<T>();
    let sizes = args.sizes();
    let max = sizes.iter().copied().max().unwrap_or(es) / es;
    println!(
        "# alltoall {}, {}, {n} ranks on {} x {}{}, driver {}{}; median of {} runs",
        T::DTYPE,
        if args.in_place {
            "in place"
        } else {
            "out of place"
        },
        driver.device_count(),
        devices[0].name()?,
        if shared { " (ranks SHARE GPUs)" } else { "" },
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
    let kinds: &[&str] = match args.operands {
        Which::Symmetric => &["symmetric"],
        Which::Local => &["local"],
        Which::Both => &["symmetric", "local"],
    };
    let mut all_ok = true;
    let mut seed = 0x5eed_a2a0_u64;
    for kind in kinds {
        let bufs = if *kind == "symmetric" {
            Bufs::Symmetric(comm.alloc::<T>(max)?, comm.alloc::<T>(max)?)
        } else {
            Bufs::Local(
                devices
                    .iter()
                    .map(|d| -> Result<_, cuda_multimem::Error> {
                        Ok((
                            DeviceBuffer::<T>::zeroed(d, max)?,
                            DeviceBuffer::<T>::zeroed(d, max)?,
                        ))
                    })
                    .collect::<Result<_, _>>()?,
            )
        };
        let mut b = Bench {
            comm: &comm,
            streams: &streams,
            bufs,
            in_place: args.in_place,
        };
        let operands = if *kind == "symmetric" {
            Operands::Symmetric
        } else {
            Operands::Local
        };
        for &size in &sizes {
            // a whole number of parts
            let count = size / es / n * n;
            if count == 0 {
                println!(
                    "# {size} bytes: less than one {} per rank; skipped",
                    T::DTYPE
                );
                continue;
            }
            let bytes = count * es;
            let choice = match comm.all_to_all_choice(bytes, bytes, false, operands, args.in_place)
            {
                Ok(c) => c,
                Err(e) => {
                    println!("# {kind} {bytes} bytes: skipped ({e})");
                    continue;
                }
            };
            let checked = bytes <= args.check_max && !args.in_place;
            let ok = !checked || b.check(count, &mut seed)?;
            all_ok &= ok;
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
            let bus = |t: f64| bw(t) * (n as f64 - 1.0) / n as f64;
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
                    "bench": "alltoall",
                    "impl": "cuda-multimem",
                    "operand": kind,
                    "dtype": T::DTYPE.name(),
                    "op": "-",
                    "ranks": n,
                    "bytes": bytes,
                    "mode": mode,
                    "time_us": t * 1e6,
                    "algbw_gbs": bw(t),
                    "busbw_gbs": bus(t),
                    "path": choice.path.to_string(),
                    "algorithm": choice.algorithm.to_string(),
                    "staged_chunks": choice.staged_chunks,
                    "shared_gpus": shared,
                    "correct": if checked { json!(ok) } else { json!(null) },
                }))?;
            }
        }
    }
    Ok(all_ok)
}
