//! MoE dispatch / combine benchmark (`bench-moe`): a `MoePlan` at the DeepSeek-V3 shape by
//! default (hidden 7168, top-8, 256 experts in contiguous blocks over the ranks) with 1, 8, 32,
//! 128, 512 and 4096 tokens per rank, bf16 and FP8 e4m3 payloads (FP8 with per-group-of-128
//! f32 scales), random routing (top-k distinct experts per token), on the first N devices (or N
//! ranks placed round-robin on fewer GPUs, sharing them). Each phase timed two ways, as
//! bench-norm does: **pipelined** (a graph of many dispatches, or many combines, per rank,
//! replayed; time per call from rank 0's events, median of `--runs`) and **single** (a thread
//! per rank, one call captured into a graph and launched between two events after a spinning
//! host barrier; the slowest rank, median of `--runs`). One dispatch and combine are first
//! checked against the host reference on every rank.
//!
//! Bandwidths, in DeepEP's convention: **logical** = (token, expert) selections × bytes of one
//! token (payload and scales; the combine: hidden × 2 bytes of bf16 expert outputs) / time,
//! summed over what rank 0 sends; **link** = what crosses rank 0's links (each token once per
//! destination rank other than its own; the combine: every row back). One `RESULT {json}` line
//! per measurement (`bench` = "moe_dispatch" or "moe_combine"; `algbw_gbs` the logical bandwidth,
//! `busbw_gbs` the link's). On the simulated driver the
//! times mean nothing.

// `usize::is_multiple_of` needs Rust 1.87; the workspace keeps `%` for older toolchains. Ranks
// index their buffers: `for r in 0..n` reads as the protocol does.
#![allow(clippy::manual_is_multiple_of, clippy::needless_range_loop)]

use std::process::ExitCode;

use clap::Parser;
use cuda_multimem::{CaptureMode, DeviceBuffer, Stream};
use cuda_multimem_collectives::testing::{
    moe_combine_reference, moe_dispatch_reference, random_input,
};
use cuda_multimem_collectives::{
    bf16, Communicator, DType, MoePlan, MoeScales, MoeShape, MulticastPolicy, Src,
};
use serde_json::json;

mod common;

use common::{pipelined_by_graph, result_line, single_by_graph, sync, RankCall, Res};

/// MoE dispatch / combine benchmark.
#[derive(Parser, Debug)]
#[command(name = "bench-moe")]
struct Args {
    /// Ranks (the first N devices, or N ranks round-robin on fewer).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Tokens per rank (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128,512,4096")]
    tokens: Vec<usize>,
    /// Elements per token.
    #[arg(long, default_value_t = 7168)]
    hidden: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 8)]
    top_k: usize,
    /// Experts in all.
    #[arg(long, default_value_t = 256)]
    experts: usize,
    /// Timed repetitions (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Calls per graph (pipelined).
    #[arg(long, default_value_t = 20)]
    iters: usize,
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("bench-moe: a result differed from the host reference");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("bench-moe: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One rank's operands.
struct Bufs {
    x: DeviceBuffer<u8>,
    ids: DeviceBuffer<i32>,
    w: DeviceBuffer<f32>,
    sc: DeviceBuffer<f32>,
    y: DeviceBuffer<bf16>,
    out: DeviceBuffer<bf16>,
    h_x: Vec<u8>,
    h_ids: Vec<i32>,
    h_w: Vec<f32>,
    h_sc: Vec<f32>,
    h_y: Vec<bf16>,
}

/// Rank `r`'s dispatch of `t` tokens.
fn dispatch(
    comm: &Communicator,
    plan: &MoePlan,
    r: usize,
    b: &Bufs,
    t: usize,
    s: &Stream,
) -> Res<()> {
    let sh = plan.shape();
    let (k, row) = (sh.top_k, sh.hidden * sh.payload_bytes);
    let h = comm.rank(r)?;
    // SAFETY: this rank's own buffers, alive until every stream is synchronised; no other work
    // uses them meanwhile.
    unsafe {
        let ids = Src::<i32>::from_raw(b.ids.device_ptr(), t * k);
        let w = Src::<f32>::from_raw(b.w.device_ptr(), t * k);
        if sh.payload_bytes == 2 {
            let x = Src::<u16>::from_raw(b.x.device_ptr(), t * row / 2);
            h.moe_dispatch(plan, x, ids, w, s)?;
        } else {
            let x = Src::<u8>::from_raw(b.x.device_ptr(), t * row);
            let sc = Src::<f32>::from_raw(b.sc.device_ptr(), t * sh.scales_per_token());
            h.moe_dispatch_scaled(plan, x, ids, w, sc, s)?;
        }
    }
    Ok(())
}

/// Rank `r`'s combine into `t` tokens.
fn combine(
    comm: &Communicator,
    plan: &MoePlan,
    r: usize,
    b: &Bufs,
    t: usize,
    s: &Stream,
) -> Res<()> {
    let h = plan.shape().hidden;
    // SAFETY: as `dispatch`.
    unsafe {
        let out = cuda_multimem_collectives::Dst::<bf16>::from_raw(b.out.device_ptr(), t * h);
        comm.rank(r)?.moe_combine(plan, &b.y, out, s)?;
    }
    Ok(())
}

fn run(args: &Args) -> Res<bool> {
    cuda_multimem_collectives::sim::install();
    let driver = cuda_multimem_sim::driver_from_env()?;
    let all = driver.devices();
    if all.is_empty() {
        return Err("no devices".into());
    }
    let devices: Vec<_> = (0..args.ranks)
        .map(|r| all[r % all.len()].clone())
        .collect();
    let shared = args.ranks > all.len();
    let comm = Communicator::builder(&devices)
        .multicast(MulticastPolicy::Never)
        .allow_shared_devices(shared)
        .build()?;
    let streams: Vec<Stream> = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
    let n = comm.size();
    let sim = driver.is_simulated();
    println!(
        "# MoE dispatch / combine, hidden {}, top-{}, {} experts, {n} ranks on {} x {}{}, driver {}{}; median of {} runs",
        args.hidden,
        args.top_k,
        args.experts,
        all.len().min(n),
        devices[0].name()?,
        if shared { " (ranks sharing GPUs)" } else { "" },
        driver.version(),
        if sim { " (SIMULATED: times mean nothing)" } else { "" },
        args.runs
    );
    println!(
        "{:>6} {:>6} {:>9} {:>10} {:>11} {:>13} {:>11}  {:>7}",
        "tokens",
        "type",
        "phase",
        "pipe(us)",
        "single(us)",
        "logical(GB/s)",
        "link(GB/s)",
        "correct"
    );
    let mut all_ok = true;
    let mut seed = 0x005e_ed0e_u64;
    for payload in [2usize, 1] {
        for &t in &args.tokens {
            // a plan per batch size, as an engine keeps one for decode and one for prefill:
            // its form follows (the low-latency form up to LL_MAX_TOKENS tokens per rank)
            let mut shape = MoeShape::new(t.max(1), args.hidden, payload, args.top_k, args.experts);
            shape.expert_out = DType::Bf16;
            if payload == 1 {
                shape.scales = if args.hidden % 128 == 0 {
                    MoeScales::PerGroup(128)
                } else {
                    MoeScales::PerToken
                };
            }
            let plan = MoePlan::new(&comm, shape.clone())?;
            let form = if shape.low_latency() {
                "moe-ll"
            } else {
                "moe-bulk"
            };
            let (h, k) = (args.hidden, args.top_k);
            let row = h * payload;
            let sp = shape.scales_per_token();
            let per = args.experts / n;
            let mut bufs = Vec::new();
            for (r, d) in devices.iter().enumerate() {
                let mut h_x = vec![0u8; t * row];
                for (i, b) in h_x.iter_mut().enumerate() {
                    *b = (i as u64).wrapping_mul(0x9e37_79b9).wrapping_add(seed) as u8 & 0x7f;
                }
                let mut h_ids = Vec::with_capacity(t * k);
                for _ in 0..t {
                    let mut picked = Vec::new();
                    while picked.len() < k.min(args.experts) {
                        seed = seed
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        let e = ((seed >> 33) % args.experts as u64) as i32;
                        if !picked.contains(&e) {
                            picked.push(e);
                        }
                    }
                    picked.resize(k, -1);
                    h_ids.extend(picked);
                }
                let h_w: Vec<f32> = random_input(t * k, &mut seed);
                let h_sc: Vec<f32> = random_input(t * sp, &mut seed);
                let h_y: Vec<bf16> = random_input(plan.rows() * h, &mut seed);
                let _ = r;
                bufs.push(Bufs {
                    x: DeviceBuffer::from_host(
                        d,
                        &h_x.iter().copied().chain([0]).collect::<Vec<_>>(),
                    )?,
                    ids: DeviceBuffer::from_host(
                        d,
                        &h_ids.iter().copied().chain([0]).collect::<Vec<_>>(),
                    )?,
                    w: DeviceBuffer::from_host(
                        d,
                        &h_w.iter().copied().chain([0.0]).collect::<Vec<_>>(),
                    )?,
                    sc: DeviceBuffer::from_host(
                        d,
                        &h_sc.iter().copied().chain([0.0]).collect::<Vec<_>>(),
                    )?,
                    y: DeviceBuffer::from_host(d, &h_y)?,
                    out: DeviceBuffer::zeroed(d, t * h + 1)?,
                    h_x,
                    h_ids,
                    h_w,
                    h_sc,
                    h_y,
                });
            }
            // correctness: one dispatch and combine on every rank against the host reference
            for (r, b) in bufs.iter().enumerate() {
                dispatch(&comm, &plan, r, b, t, &streams[r])?;
            }
            sync(&streams)?;
            comm.check()?;
            let xs: Vec<&[u8]> = bufs.iter().map(|b| &b.h_x[..]).collect();
            let is: Vec<&[i32]> = bufs.iter().map(|b| &b.h_ids[..]).collect();
            let ss: Vec<&[f32]> = bufs.iter().map(|b| &b.h_sc[..]).collect();
            let want = moe_dispatch_reference(&shape, n, &xs, &is, &ss)?;
            let mut ok = true;
            for r in 0..n {
                let l = plan.local_experts(r)?;
                let offsets = plan.expert_offsets(r)?.to_vec()?;
                let total = offsets[l] as usize;
                ok &= offsets == want[r].offsets
                    && plan.expert_tokens(r)?.to_vec()?[..total * row] == want[r].tokens[..];
            }
            for (r, b) in bufs.iter().enumerate() {
                combine(&comm, &plan, r, b, t, &streams[r])?;
            }
            sync(&streams)?;
            comm.check()?;
            let ys: Vec<&[bf16]> = bufs.iter().map(|b| &b.h_y[..]).collect();
            let ws: Vec<&[f32]> = bufs.iter().map(|b| &b.h_w[..]).collect();
            let expect = moe_combine_reference::<bf16, bf16>(&shape, &want, &ys, &ws);
            for r in 0..n {
                let got = bufs[r].out.to_vec()?;
                ok &= got[..t * h]
                    .iter()
                    .zip(&expect[r])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            }
            all_ok &= ok;
            // rank 0's traffic: selections (logical) and rows over its links
            let tok_bytes = (row + 4 * sp) as f64;
            let sel = bufs[0].h_ids.iter().filter(|&&e| e >= 0).count() as f64;
            let link_rows: f64 = (0..t)
                .map(|i| {
                    let ids = &bufs[0].h_ids[i * k..(i + 1) * k];
                    (1..n)
                        .filter(|&d| ids.iter().any(|&e| e >= 0 && e as usize / per == d))
                        .count() as f64
                })
                .sum();
            let back_rows = bufs[0]
                .h_ids
                .iter()
                .filter(|&&e| e >= 0 && e as usize / per != 0)
                .count() as f64;
            let iters = if sim { 2 } else { args.iters };
            let runs = if sim { 1 } else { args.runs };
            for phase in ["dispatch", "combine"] {
                let go = |r: usize, s: &Stream| -> Res<()> {
                    if phase == "dispatch" {
                        dispatch(&comm, &plan, r, &bufs[r], t, s)
                    } else {
                        combine(&comm, &plan, r, &bufs[r], t, s)
                    }
                };
                let pipe =
                    pipelined_by_graph(&streams, (iters, runs), CaptureMode::Global, &mut |r| {
                        go(r, &streams[r])
                    })?;
                comm.check()?;
                let calls: Vec<RankCall<'_>> = (0..n)
                    .map(|r| -> RankCall<'_> {
                        let go = &go;
                        (r, Box::new(move |s: &Stream| go(r, s)))
                    })
                    .collect();
                let single = single_by_graph(&streams, runs, calls)?;
                comm.check()?;
                let (logical, link) = if phase == "dispatch" {
                    (sel * tok_bytes, link_rows * tok_bytes)
                } else {
                    (sel * (2 * h) as f64, back_rows * (2 * h) as f64)
                };
                let ty = if payload == 2 { "bf16" } else { "fp8" };
                println!(
                    "{:>6} {:>6} {:>9} {:>10.2} {:>11.2} {:>13.1} {:>11.1}  {:>7}",
                    t,
                    ty,
                    phase,
                    pipe * 1e6,
                    single * 1e6,
                    logical / single / 1e9,
                    link / single / 1e9,
                    if ok { "yes" } else { "NO" }
                );
                for (mode, secs) in [("pipelined", pipe), ("single", single)] {
                    if !secs.is_finite() {
                        return Err(
                            format!("a non-finite time at {t} tokens ({phase}, {mode})").into()
                        );
                    }
                    result_line(json!({
                        "bench": format!("moe_{phase}"),
                        "impl": "cuda-multimem",
                        "dtype": ty,
                        "ranks": n,
                        "tokens": t,
                        "hidden": h,
                        "top_k": k,
                        "experts": args.experts,
                        "mode": mode,
                        "time_us": secs * 1e6,
                        "bytes": logical as u64,
                        "operand": "local",
                        "op": "none",
                        "path": "peer-to-peer",
                        "algorithm": form,
                        // the results schema's bandwidths: algbw the logical, busbw the link's
                        "algbw_gbs": logical / secs / 1e9,
                        "busbw_gbs": link / secs / 1e9,
                        "logical_gbs": logical / secs / 1e9,
                        "link_gbs": link / secs / 1e9,
                        "shared_gpus": shared,
                        "correct": ok,
                    }))?;
                }
            }
        }
    }
    Ok(all_ok)
}
