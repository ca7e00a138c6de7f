//! An expert-parallel MoE layer on every GPU of the machine (or a simulated machine of 4, saying
//! so), its communication through a `MoePlan` built once for the layer's shape: router (top-k
//! over random logits, softmax weights), `moe_dispatch` (each token once per destination rank,
//! grouped there by local expert, per-expert counts and offsets on the device), each rank's
//! experts as a plain matmul on the grouped rows, `moe_combine` (the experts' outputs back to
//! their tokens' ranks, weighted and summed in top-k order in f32), checked bit for bit against
//! a single-device host reference that computes every token's experts and sums in the same
//! order.
//!
//! The router and the experts' matmuls run on the host here (the point is the dispatch and the
//! combine; an engine runs its grouped GEMM on the plan's expert-grouped rows directly).
//!
//! `cargo run --release --example moe` (`CUDA_MULTIMEM_DRIVER=sim:devices=N` picks a simulated
//! machine).

// `usize::is_multiple_of` needs Rust 1.87; the workspace keeps `%` for older toolchains. Ranks
// index their buffers: `for r in 0..n` reads as the protocol does.
#![allow(clippy::manual_is_multiple_of, clippy::needless_range_loop)]

use std::process::ExitCode;

use cuda_multimem::{DeviceBuffer, Stream};
use cuda_multimem_collectives::testing::next_random;
use cuda_multimem_collectives::{bf16, Communicator, DType, MoePlan, MoeShape, MulticastPolicy};
use cuda_multimem_examples::{pick_driver, Res};

/// Tokens per rank, hidden size, experts, experts per token.
const TOKENS: usize = 16;
const HIDDEN: usize = 64;
const EXPERTS: usize = 8;
const TOP_K: usize = 2;

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("moe: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The top-k experts of one token's logits (ties to the lower id) and their softmax weights.
fn route(logits: &[f32]) -> Vec<(usize, f32)> {
    let mut ids: Vec<usize> = (0..logits.len()).collect();
    ids.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    ids.truncate(TOP_K);
    let m = logits[ids[0]];
    let e: Vec<f32> = ids.iter().map(|&i| (logits[i] - m).exp()).collect();
    let z: f32 = e.iter().sum();
    ids.into_iter().zip(e).map(|(i, v)| (i, v / z)).collect()
}

/// Expert `e` on a token row: y = x · W_e (f32).
fn expert(w: &[f32], e: usize, x: &[f32]) -> Vec<f32> {
    (0..HIDDEN)
        .map(|j| {
            (0..HIDDEN)
                .map(|i| x[i] * w[(e * HIDDEN + i) * HIDDEN + j])
                .sum()
        })
        .collect()
}

fn run() -> Res<bool> {
    let (driver, what) = pick_driver(2, 4)?;
    let devices = driver.devices();
    let n = devices.len().min(8).min(EXPERTS);
    let devices = &devices[..n];
    if EXPERTS % n != 0 {
        return Err(format!("{EXPERTS} experts do not split over {n} ranks").into());
    }
    let per = EXPERTS / n;
    println!(
        "moe: {what}; {n} ranks, {TOKENS} tokens per rank, hidden {HIDDEN}, {EXPERTS} experts ({per} per rank), top-{TOP_K}"
    );
    let comm = Communicator::builder(devices)
        .multicast(MulticastPolicy::Never)
        .build()?;
    let streams: Vec<Stream> = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
    // the plan: bf16 payload, f32 expert outputs, contiguous placement
    let mut shape = MoeShape::new(TOKENS, HIDDEN, 2, TOP_K, EXPERTS);
    shape.expert_out = DType::F32;
    println!(
        "plan: {} bytes of symmetric memory and {} of device memory per rank, allocated once",
        shape.symmetric_bytes(n)?,
        shape.local_bytes(n)?
    );
    let plan = MoePlan::new(&comm, shape)?;
    let mut seed = 0x40e_u64;
    let mut rand = |scale: f32| next_random(&mut seed) * scale;
    let w: Vec<f32> = (0..EXPERTS * HIDDEN * HIDDEN)
        .map(|_| rand(1.0 / (HIDDEN as f32).sqrt()))
        .collect();
    // every rank's tokens in bf16 (as an engine holds them) and their routing
    let x: Vec<Vec<bf16>> = (0..n)
        .map(|_| {
            (0..TOKENS * HIDDEN)
                .map(|_| bf16::from_f32(rand(1.0)))
                .collect()
        })
        .collect();
    let picks: Vec<Vec<Vec<(usize, f32)>>> = (0..n)
        .map(|_| {
            (0..TOKENS)
                .map(|_| route(&(0..EXPERTS).map(|_| rand(2.0)).collect::<Vec<_>>()))
                .collect()
        })
        .collect();
    println!("router: top-{TOP_K} of random logits on every rank (host)");
    let dev = |r: usize| comm.device(r);
    let mut bufs = Vec::new();
    for r in 0..n {
        let ids: Vec<i32> = picks[r].iter().flatten().map(|&(e, _)| e as i32).collect();
        let g: Vec<f32> = picks[r].iter().flatten().map(|&(_, g)| g).collect();
        bufs.push((
            DeviceBuffer::from_host(dev(r)?, &x[r])?,
            DeviceBuffer::from_host(dev(r)?, &ids)?,
            DeviceBuffer::from_host(dev(r)?, &g)?,
        ));
    }
    let mut choice = None;
    for r in 0..n {
        let (t, i, g) = &bufs[r];
        let c = comm.rank(r)?.moe_dispatch(&plan, t, i, g, &streams[r])?;
        choice.get_or_insert(c);
    }
    for s in &streams {
        s.synchronize()?;
    }
    comm.check()?;
    println!(
        "dispatch: each token once per destination rank, grouped by local expert ({})",
        choice.expect("a call")
    );
    // every rank's experts on its grouped rows (host matmul on what the plan holds)
    let rows = plan.rows();
    let mut ys = Vec::new();
    for d in 0..n {
        let counts = plan.expert_counts(d)?.to_vec()?;
        let offsets = plan.expert_offsets(d)?.to_vec()?;
        let raw = plan.expert_tokens(d)?.to_vec()?;
        let mut y = vec![0f32; rows * HIDDEN];
        for e in 0..per {
            for i in offsets[e] as usize..(offsets[e] + counts[e]) as usize {
                let row: Vec<f32> = raw[i * 2 * HIDDEN..(i + 1) * 2 * HIDDEN]
                    .chunks(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect();
                let out = expert(&w, d * per + e, &row);
                y[i * HIDDEN..(i + 1) * HIDDEN].copy_from_slice(&out);
            }
        }
        ys.push(DeviceBuffer::from_host(dev(d)?, &y)?);
    }
    println!("experts: {per} per rank, x · W_e on each expert's grouped rows (host matmul)");
    let mut outs = Vec::new();
    for r in 0..n {
        let mut o = DeviceBuffer::<f32>::zeroed(dev(r)?, TOKENS * HIDDEN)?;
        comm.rank(r)?
            .moe_combine(&plan, &ys[r], &mut o, &streams[r])?;
        outs.push(o);
    }
    for s in &streams {
        s.synchronize()?;
    }
    comm.check()?;
    println!(
        "combine: every expert output back to its token's rank, weighted, summed in top-k order"
    );
    // the single-device reference: every token's experts, summed in top-k order in f32
    let mut bad = 0usize;
    for r in 0..n {
        let got = outs[r].to_vec()?;
        for t in 0..TOKENS {
            let xt: Vec<f32> = x[r][t * HIDDEN..(t + 1) * HIDDEN]
                .iter()
                .map(|v| v.to_f32())
                .collect();
            let mut want = vec![0f32; HIDDEN];
            for &(e, g) in &picks[r][t] {
                for (a, y) in want.iter_mut().zip(expert(&w, e, &xt)) {
                    *a += g * y;
                }
            }
            if got[t * HIDDEN..(t + 1) * HIDDEN]
                .iter()
                .zip(&want)
                .any(|(g, w)| g.to_bits() != w.to_bits())
            {
                bad += 1;
            }
        }
    }
    if bad == 0 {
        println!("ok: every token's output equals the single-device reference bit for bit");
        Ok(true)
    } else {
        println!("FAILED: {bad} token(s) differ from the single-device reference");
        Ok(false)
    }
}
