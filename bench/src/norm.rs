//! Fused allreduce + residual add + RMSNorm benchmark (`bench-norm`): hidden 8192 bf16 at 1, 8,
//! 16, 128 and 1024 tokens on the first N devices, the caller's own memory (`DeviceBuffer`s, as
//! an engine holds them), two implementations side by side:
//! - **fused**: `RankHandle::all_reduce_add_rms_norm`;
//! - **unfused**: our allreduce in place, then the separate residual add + RMSNorm kernel
//!   (`RankHandle::add_rms_norm`) — what an engine runs without the fusion;
//! - **fp8-static**, **fp8-token**, **fp8-group**, **fp8-ue8m0**, **fp8-token+bf16**:
//!   `RankHandle::all_reduce_add_rms_norm_fp8` with a static scale, per-token scales,
//!   per-group-of-128 f32 or UE8M0 scales, and per-token scales with the bf16 rows beside
//!   (the grouped ones only where hidden is a multiple of 128);
//! - **unfused-fp8-token**: our allreduce in place, then the local add + RMSNorm + per-token
//!   FP8 kernel (`RankHandle::add_rms_norm_fp8`) — the unfused pair of an engine whose norm
//!   kernel quantises;
//! - **fused+quant-static**, **-token**, **-group**, **-ue8m0**: our bf16 fused kernel, then our
//!   standalone quantisation kernel (`RankHandle::quantize_fp8`) of its output — the pair an
//!   engine runs without the FP8 fusion (the target: every fp8-* faster than its pair).
//!
//! Each timed two ways, as bench-allreduce does: **pipelined** (a graph of many calls per rank,
//! replayed; time per call from rank 0's events, median of `--runs`) and **single** (a thread
//! per rank, each rank's one call — the unfused pair: its two calls — captured once into a
//! graph and launched between two events after a spinning host barrier; the slowest rank's
//! time, median of `--runs`). The fused call is
//! first checked against the host reference. One `RESULT {json}` line per measurement, in
//! bench-allreduce's schema with `bench` = "allreduce_rmsnorm", `bytes` = tokens·hidden·2 and a
//! `tokens` field. On the simulated driver the times mean nothing.

use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use cuda_multimem::{CaptureMode, DeviceBuffer, Stream};
use cuda_multimem_collectives::testing::{
    add_rms_norm_reference, random_input, rms_norm_within_tolerance,
};
use cuda_multimem_collectives::{
    Algorithm, CommConfig, Communicator, Dst, Fp8Out, Fp8Scaling, MulticastPolicy, ReduceOp, Src,
    F8E4M3,
};
use half::bf16;
use serde_json::json;

mod common;

use common::{pipelined_by_graph, result_line, single_by_graph, sync, team_devices, RankCall, Res};

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Form {
    Auto,
    /// The low-latency one-shot where the call allows it (else the barrier one-shot).
    Ll,
    OneShot,
    TwoShot,
}

/// Fused allreduce + residual add + RMSNorm benchmark.
#[derive(Parser, Debug)]
#[command(name = "bench-norm")]
struct Args {
    /// Ranks (the first N devices).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Token counts (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8,16,128,1024")]
    tokens: Vec<usize>,
    /// Elements per row.
    #[arg(long, default_value_t = 8192)]
    hidden: usize,
    /// Timed repetitions (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Force the fused call's form (the allreduce of the unfused baseline chooses its own).
    #[arg(long, value_enum, default_value_t = Form::Auto)]
    form: Form,
    /// Calls per graph (pipelined).
    #[arg(long, default_value_t = 50)]
    iters: usize,
    /// Largest fused call (bytes) of the low-latency form (`CommConfig::norm_ll_max_bytes`;
    /// default: the library's).
    #[arg(long)]
    norm_ll_max_bytes: Option<usize>,
}

const EPS: f32 = 1e-6;

/// One rank's operands.
struct Bufs {
    x: DeviceBuffer<bf16>,
    res: DeviceBuffer<bf16>,
    g: DeviceBuffer<bf16>,
    out: DeviceBuffer<bf16>,
    q: DeviceBuffer<F8E4M3>,
    sc: DeviceBuffer<f32>,
    sc_u: DeviceBuffer<u32>,
}

/// The FP8 implementations: name, scaling, with the bf16 rows.
const FP8: [(&str, Fp8Scaling, bool); 5] = [
    ("fp8-static", Fp8Scaling::Static, false),
    ("fp8-token", Fp8Scaling::PerToken, false),
    ("fp8-group", Fp8Scaling::PerGroup, false),
    ("fp8-ue8m0", Fp8Scaling::PerGroupUe8m0, false),
    ("fp8-token+bf16", Fp8Scaling::PerToken, true),
];

/// Our bf16 fused kernel then the standalone quantisation: name, scaling.
const QUANT: [(&str, Fp8Scaling); 4] = [
    ("fused+quant-static", Fp8Scaling::Static),
    ("fused+quant-token", Fp8Scaling::PerToken),
    ("fused+quant-group", Fp8Scaling::PerGroup),
    ("fused+quant-ue8m0", Fp8Scaling::PerGroupUe8m0),
];

/// The FP8 output of `scaling` on rank buffers `b` (scales of exactly `sl` elements).
fn fp8_spec(b: &Bufs, scaling: Fp8Scaling, len: usize, sl: usize) -> Fp8Out<'static, bf16> {
    // SAFETY: this rank's own buffers (q of len bytes, the scales of at least `sl` elements:
    // sized for every scaling), alive until every stream is synchronised (the caller's loops
    // synchronise before dropping them); no other work uses them meanwhile.
    let (q, sc, su) = unsafe {
        (
            Dst::<F8E4M3>::from_raw(b.q.device_ptr(), len),
            Dst::<f32>::from_raw(b.sc.device_ptr(), sl),
            Dst::<u32>::from_raw(b.sc_u.device_ptr(), sl),
        )
    };
    match scaling {
        Fp8Scaling::Static => Fp8Out::static_scale(q, 0.01),
        Fp8Scaling::PerToken => Fp8Out::per_token(q, sc),
        Fp8Scaling::PerGroup => Fp8Out::per_group(q, sc),
        Fp8Scaling::PerGroupUe8m0 => Fp8Out::per_group_ue8m0(q, su),
    }
}

/// Queue one call of `imp` for rank `r` on `s`.
fn call(
    comm: &Communicator,
    r: usize,
    b: &Bufs,
    imp: &str,
    t: usize,
    h: usize,
    s: &Stream,
) -> Res<()> {
    let len = t * h;
    // SAFETY: this rank's own buffers, alive until every stream is synchronised (the caller's
    // loops synchronise before dropping them); no other work uses them meanwhile.
    let (x, xm, res, g, out) = unsafe {
        (
            Src::<bf16>::from_raw(b.x.device_ptr(), len),
            Dst::<bf16>::from_raw(b.x.device_ptr(), len),
            Dst::<bf16>::from_raw(b.res.device_ptr(), len),
            Src::<bf16>::from_raw(b.g.device_ptr(), h),
            Dst::<bf16>::from_raw(b.out.device_ptr(), len),
        )
    };
    let hr = comm.rank(r)?;
    if let Some(&(_, scaling)) = QUANT.iter().find(|f| f.0 == imp) {
        // SAFETY: as above.
        let o = unsafe { Src::<bf16>::from_raw(b.out.device_ptr(), len) };
        hr.all_reduce_add_rms_norm(x, res, g, out, h, EPS, s)?;
        hr.quantize_fp8(o, fp8_spec(b, scaling, len, scaling.scales_len(t, h)), h, s)?;
    } else if let Some(&(_, scaling, both)) = FP8.iter().find(|f| f.0 == imp) {
        let spec = fp8_spec(b, scaling, len, scaling.scales_len(t, h));
        let spec = if both {
            spec.with_unquantised(out)
        } else {
            spec
        };
        hr.all_reduce_add_rms_norm_fp8(x, res, g, spec, h, EPS, s)?;
    } else if imp == "unfused-fp8-token" {
        // SAFETY: as above.
        let (q, sc) = unsafe {
            (
                Dst::<F8E4M3>::from_raw(b.q.device_ptr(), len),
                Dst::<f32>::from_raw(b.sc.device_ptr(), t),
            )
        };
        hr.all_reduce_in_place(xm, ReduceOp::Sum, s)?;
        hr.add_rms_norm_fp8(x, res, g, Fp8Out::per_token(q, sc), h, EPS, s)?;
    } else if imp == "fused" {
        hr.all_reduce_add_rms_norm(x, res, g, out, h, EPS, s)?;
    } else {
        hr.all_reduce_in_place(xm, ReduceOp::Sum, s)?;
        hr.add_rms_norm(x, res, g, out, h, EPS, s)?;
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("bench-norm: a result differed from the host reference");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("bench-norm: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Res<bool> {
    cuda_multimem_collectives::sim::install();
    let driver = cuda_multimem_sim::driver_from_env()?;
    // with fewer GPUs than ranks, ranks share them (said loudly: not a link benchmark)
    let (devices, shared) = team_devices(&driver, args.ranks, "bench-norm")?;
    let devices = &devices[..];
    let config = CommConfig {
        algorithm: match args.form {
            Form::Auto => None,
            Form::Ll => Some(Algorithm::OneShotLl),
            Form::OneShot => Some(Algorithm::OneShot),
            Form::TwoShot => Some(Algorithm::TwoShot),
        },
        norm_ll_max_bytes: args
            .norm_ll_max_bytes
            .unwrap_or(CommConfig::default().norm_ll_max_bytes),
        ..Default::default()
    };
    // the norm never uses multicast; no multicast object is created on any machine
    let comm = Communicator::builder(devices)
        .config(config)
        .multicast(MulticastPolicy::Never)
        .allow_shared_devices(shared)
        .build()?;
    let streams: Vec<Stream> = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
    let n = comm.size();
    let h = args.hidden;
    let sim = driver.is_simulated();
    println!(
        "# allreduce + residual add + RMSNorm, bf16, hidden {h}, {n} x {}, driver {}{}; median of {} runs",
        devices[0].name()?,
        driver.version(),
        if sim { " (SIMULATED: times mean nothing)" } else { "" },
        args.runs
    );
    println!(
        "{:>7} {:>10} {:>17} {:>11} {:>11}  {:<40} {:>7}",
        "tokens", "bytes", "impl", "pipe(us)", "single(us)", "form", "correct"
    );
    let mut all_ok = true;
    let mut seed = 0x5eed_4321_u64;
    for &t in &args.tokens {
        let len = t * h;
        let bytes = len * 2;
        let mut bufs = Vec::new();
        let xs: Vec<Vec<bf16>> = (0..n).map(|_| random_input(len, &mut seed)).collect();
        let r0: Vec<bf16> = random_input(len, &mut seed);
        let g0: Vec<bf16> = random_input(h, &mut seed);
        for (r, d) in devices.iter().enumerate() {
            bufs.push(Bufs {
                x: DeviceBuffer::from_host(d, &xs[r])?,
                res: DeviceBuffer::from_host(d, &r0)?,
                g: DeviceBuffer::from_host(d, &g0)?,
                out: DeviceBuffer::zeroed(d, len)?,
                q: DeviceBuffer::zeroed(d, len)?,
                sc: DeviceBuffer::zeroed(
                    d,
                    Fp8Scaling::PerGroupUe8m0
                        .scales_len(t, h)
                        .max(t * h.div_ceil(128))
                        .max(1),
                )?,
                sc_u: DeviceBuffer::zeroed(d, Fp8Scaling::PerGroupUe8m0.scales_len(t, h).max(1))?,
            });
        }
        // correctness of the fused call on rank 0 (every rank is checked by the test suite)
        for (r, b) in bufs.iter().enumerate() {
            call(&comm, r, b, "fused", t, h, &streams[r])?;
        }
        sync(&streams)?;
        comm.check()?;
        let refs: Vec<&[bf16]> = xs.iter().map(|v| v.as_slice()).collect();
        let (wr, wo) = add_rms_norm_reference(&refs, &r0, &g0, h, EPS);
        let (gr, go) = (bufs[0].res.to_vec()?, bufs[0].out.to_vec()?);
        let ok = gr == wr
            && go
                .iter()
                .zip(&wo)
                .all(|(a, b)| rms_norm_within_tolerance(*a, *b));
        all_ok &= ok;
        // the per-token FP8 rows and scales of `kind` are the host quantisation of the bf16
        // rows beside them (rank 0)
        let quantised_ok = |kind: &str| -> Res<bool> {
            for (r, b) in bufs.iter().enumerate() {
                call(&comm, r, b, kind, t, h, &streams[r])?;
            }
            sync(&streams)?;
            comm.check()?;
            let out = bufs[0].out.to_vec()?;
            let (wq, ws) = cuda_multimem_collectives::testing::fp8_quantise(
                &out,
                h,
                Fp8Scaling::PerToken,
                0.0,
            );
            let q = bufs[0].q.to_vec()?;
            let sc = bufs[0].sc.to_vec()?;
            Ok(q.iter().zip(&wq).all(|(a, b)| a.to_bits() == b.to_bits())
                && sc[..t]
                    .iter()
                    .zip(&ws)
                    .all(|(a, b)| a.to_bits() == b.to_bits()))
        };
        // the FP8 call with the bf16 rows beside, and our fused kernel then the standalone
        // quantisation
        let fp8_ok = quantised_ok("fp8-token+bf16")?;
        let quant_ok = quantised_ok("fused+quant-token")?;
        all_ok &= fp8_ok && quant_ok;
        let choice = comm.add_rms_norm_choice(cuda_multimem_collectives::DType::Bf16, t, h)?;
        let iters = if sim { 2 } else { args.iters };
        let runs = if sim { 1 } else { args.runs };
        let imps: Vec<&str> = ["fused", "unfused", "unfused-fp8-token"]
            .into_iter()
            .chain(
                FP8.iter()
                    .filter(|f| !f.1.grouped() || h / 128 * 128 == h)
                    .map(|f| f.0),
            )
            .chain(
                QUANT
                    .iter()
                    .filter(|f| !f.1.grouped() || h / 128 * 128 == h)
                    .map(|f| f.0),
            )
            .collect();
        for imp in imps {
            let fp8 = FP8.iter().find(|f| f.0 == imp).map(|f| f.1);
            // pipelined: a graph of `iters` calls per rank
            let pipe =
                pipelined_by_graph(&streams, (iters, runs), CaptureMode::Global, &mut |r| {
                    call(&comm, r, &bufs[r], imp, t, h, &streams[r])
                })?;
            comm.check()?;
            // single: one call between host barriers, by bench-allreduce's graph method (the
            // unfused pair is one graph of its two calls)
            let calls: Vec<RankCall<'_>> = bufs
                .iter()
                .enumerate()
                .map(|(r, b)| -> RankCall<'_> {
                    let comm = &comm;
                    (
                        r,
                        Box::new(move |s: &Stream| call(comm, r, b, imp, t, h, s)),
                    )
                })
                .collect();
            let single = single_by_graph(&streams, runs, calls)?;
            comm.check()?;
            let form = if imp == "fused" {
                choice.to_string()
            } else if imp.starts_with("fused+quant") {
                format!("{choice} + quantize_fp8")
            } else if imp == "unfused-fp8-token" {
                format!(
                    "{} + add_rms_norm_fp8",
                    comm.choice(
                        cuda_multimem_collectives::DType::Bf16,
                        ReduceOp::Sum,
                        len,
                        cuda_multimem_collectives::Operands::Local
                    )?
                )
            } else if let Some(scaling) = fp8 {
                comm.add_rms_norm_fp8_choice(cuda_multimem_collectives::DType::Bf16, t, h, scaling)?
                    .to_string()
            } else {
                format!(
                    "{} + add_rms_norm",
                    comm.choice(
                        cuda_multimem_collectives::DType::Bf16,
                        ReduceOp::Sum,
                        len,
                        cuda_multimem_collectives::Operands::Local
                    )?
                )
            };
            println!(
                "{:>7} {:>10} {:>17} {:>11.2} {:>11.2}  {:<40} {:>7}",
                t,
                bytes,
                imp,
                pipe * 1e6,
                single * 1e6,
                form,
                match imp {
                    "fused" if ok => "yes",
                    "fp8-token+bf16" if fp8_ok => "yes",
                    "fused+quant-token" if quant_ok => "yes",
                    "fused" | "fp8-token+bf16" | "fused+quant-token" => "NO",
                    _ => "-",
                }
            );
            for (mode, secs) in [("pipelined", pipe), ("single", single)] {
                if !secs.is_finite() {
                    return Err(format!("a non-finite time at {t} tokens ({imp}, {mode})").into());
                }
                let bw = bytes as f64 / secs / 1e9;
                let fields = json!({
                    "bench": "allreduce_rmsnorm",
                    "impl": match imp {
                        "fused" => "cuda-multimem".to_string(),
                        "unfused" => "cuda-multimem-unfused".to_string(),
                        other => format!("cuda-multimem-{other}"),
                    },
                    "operand": "local",
                    "dtype": "bf16",
                    "op": "sum",
                    "ranks": n,
                    "bytes": bytes,
                    "tokens": t,
                    "hidden": h,
                    "mode": mode,
                    "time_us": secs * 1e6,
                    "algbw_gbs": bw,
                    "busbw_gbs": bw * 2.0 * (n as f64 - 1.0) / n as f64,
                    "path": choice.path.to_string(),
                    "algorithm": form,
                    "staged_chunks": 0,
                    "correct": match imp {
                        "fused" => json!(ok),
                        "fp8-token+bf16" => json!(fp8_ok),
                        "fused+quant-token" => json!(quant_ok),
                        _ => json!(null),
                    },
                });
                result_line(fields)?;
            }
        }
    }
    Ok(all_ok)
}
