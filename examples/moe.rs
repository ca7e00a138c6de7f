//! An expert-parallel MoE layer on every GPU of the machine (or a simulated machine of 4, saying
//! so), its communication through `RankHandle::all_to_all_v_dev` (send counts in device memory,
//! receive counts and offsets written there by the kernel): router (top-k over random logits,
//! softmax weights), dispatch (each token once per destination rank, not once per expert, with
//! its routing as a second all-to-all), each rank's experts as a plain matmul, combine (the
//! weighted partial sums back to each token's rank, summed there in rank order in f32), checked
//! bit for bit against a single-device host reference that sums in the same order.
//!
//! The router, the permutation into per-rank order and the experts' matmuls run on the host here
//! (the point is the all-to-all); the MoE dispatch/combine plan of issue 25, with its kernels
//! grouping by local expert on the device, is not built yet.
//!
//! `cargo run --release --example moe` (`CUDA_MULTIMEM_DRIVER=sim:devices=N` picks a simulated
//! machine).

// `usize::is_multiple_of` needs Rust 1.87; the workspace keeps `%` for older toolchains. Ranks
// index their buffers: `for r in 0..n` reads as the protocol does.
#![allow(clippy::manual_is_multiple_of, clippy::needless_range_loop)]

use std::process::ExitCode;

use cuda_multimem::{DeviceBuffer, Stream};
use cuda_multimem_collectives::{bf16, next_random, Communicator, MulticastPolicy};
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

/// What rank `d` adds for a token routed to `picks`: the weighted outputs of its experts, in
/// top-k order, in f32 (None: none of them is on `d`).
fn partial(w: &[f32], x: &[f32], picks: &[(usize, f32)], d: usize, per: usize) -> Vec<f32> {
    let mut acc = vec![0f32; HIDDEN];
    for &(e, g) in picks.iter().filter(|(e, _)| e / per == d) {
        for (a, y) in acc.iter_mut().zip(expert(w, e, x)) {
            *a += g * y;
        }
    }
    acc
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
    let xf = |r: usize, t: usize| -> Vec<f32> {
        x[r][t * HIDDEN..(t + 1) * HIDDEN]
            .iter()
            .map(|v| v.to_f32())
            .collect()
    };
    // dispatch: rank r sends token t once to every rank d hosting one of its experts, in rank
    // order, tokens in order; its routing (expert ids or -1, weight bits) travels beside it
    let cap = n * TOKENS; // rows a rank may send or receive
    let meta_row = 2 * TOP_K;
    let dev = |r: usize| comm.device(r);
    let mut tok_in = Vec::new();
    let mut tok_out = Vec::new();
    let mut meta_in = Vec::new();
    let mut meta_out = Vec::new();
    let mut sent: Vec<Vec<Vec<usize>>> = Vec::new(); // [r][d] = tokens sent
    let mut counts = Vec::new();
    let mut meta_counts = Vec::new();
    for r in 0..n {
        let mut rows = Vec::new();
        let mut meta = Vec::new();
        let mut per_d = vec![Vec::new(); n];
        for d in 0..n {
            for t in 0..TOKENS {
                if picks[r][t].iter().any(|(e, _)| e / per == d) {
                    per_d[d].push(t);
                    rows.extend_from_slice(&x[r][t * HIDDEN..(t + 1) * HIDDEN]);
                    for &(e, _) in &picks[r][t] {
                        meta.push(if e / per == d { e as u32 } else { u32::MAX });
                    }
                    for &(_, g) in &picks[r][t] {
                        meta.push(g.to_bits());
                    }
                }
            }
        }
        rows.resize(cap * HIDDEN, bf16::ZERO);
        meta.resize(cap * meta_row, 0);
        let c: Vec<u64> = per_d.iter().map(|v| (v.len() * HIDDEN) as u64).collect();
        let mc: Vec<u64> = per_d.iter().map(|v| (v.len() * meta_row) as u64).collect();
        tok_in.push(DeviceBuffer::from_host(dev(r)?, &rows)?);
        tok_out.push(DeviceBuffer::<bf16>::zeroed(dev(r)?, cap * HIDDEN)?);
        meta_in.push(DeviceBuffer::from_host(dev(r)?, &meta)?);
        meta_out.push(DeviceBuffer::<u32>::zeroed(dev(r)?, cap * meta_row)?);
        counts.push(DeviceBuffer::from_host(dev(r)?, &c)?);
        meta_counts.push(DeviceBuffer::from_host(dev(r)?, &mc)?);
        sent.push(per_d);
    }
    let zeros = |r: usize| DeviceBuffer::<u64>::zeroed(dev(r)?, n);
    let mut rcnt: Vec<_> = (0..n).map(zeros).collect::<Result<_, _>>()?;
    let mut roff: Vec<_> = (0..n).map(zeros).collect::<Result<_, _>>()?;
    let mut mrcnt: Vec<_> = (0..n).map(zeros).collect::<Result<_, _>>()?;
    let mut mroff: Vec<_> = (0..n).map(zeros).collect::<Result<_, _>>()?;
    let mut choice = None;
    for r in 0..n {
        let h = comm.rank(r)?;
        let c = h.all_to_all_v_dev(
            &tok_in[r],
            &mut tok_out[r],
            &counts[r],
            &mut rcnt[r],
            &mut roff[r],
            &streams[r],
        )?;
        h.all_to_all_v_dev(
            &meta_in[r],
            &mut meta_out[r],
            &meta_counts[r],
            &mut mrcnt[r],
            &mut mroff[r],
            &streams[r],
        )?;
        choice.get_or_insert(c);
    }
    for s in &streams {
        s.synchronize()?;
    }
    comm.check()?;
    println!(
        "dispatch: tokens and their routing, each token once per destination rank ({})",
        choice.expect("a call")
    );
    // the experts of every rank on what it received (host matmul), the weighted partial sums
    // of each received token into its reply, in the order received
    let mut reply_in = Vec::new();
    let mut reply_out = Vec::new();
    let mut reply_counts = Vec::new();
    for d in 0..n {
        let mut c = vec![0u64; n];
        rcnt[d].copy_to_host(0, &mut c)?;
        let rows_in = c.iter().sum::<u64>() as usize / HIDDEN;
        let mut got = vec![bf16::ZERO; cap * HIDDEN];
        tok_out[d].copy_to_host(0, &mut got)?;
        let mut meta = vec![0u32; cap * meta_row];
        meta_out[d].copy_to_host(0, &mut meta)?;
        let mut reply = vec![0f32; cap * HIDDEN];
        for i in 0..rows_in {
            let row: Vec<f32> = got[i * HIDDEN..(i + 1) * HIDDEN]
                .iter()
                .map(|v| v.to_f32())
                .collect();
            let m = &meta[i * meta_row..(i + 1) * meta_row];
            let mine: Vec<(usize, f32)> = (0..TOP_K)
                .filter(|&j| m[j] != u32::MAX)
                .map(|j| (m[j] as usize, f32::from_bits(m[TOP_K + j])))
                .collect();
            let p = partial(&w, &row, &mine, d, per);
            reply[i * HIDDEN..(i + 1) * HIDDEN].copy_from_slice(&p);
        }
        reply_in.push(DeviceBuffer::from_host(dev(d)?, &reply)?);
        reply_out.push(DeviceBuffer::<f32>::zeroed(dev(d)?, cap * HIDDEN)?);
        // the replies go back as they came: rank d returns c[s] elements to rank s
        reply_counts.push(DeviceBuffer::from_host(dev(d)?, &c)?);
    }
    println!("experts: {per} per rank, x · W_e on what each rank received (host matmul)");
    for r in 0..n {
        comm.rank(r)?.all_to_all_v_dev(
            &reply_in[r],
            &mut reply_out[r],
            &reply_counts[r],
            &mut rcnt[r],
            &mut roff[r],
            &streams[r],
        )?;
    }
    for s in &streams {
        s.synchronize()?;
    }
    comm.check()?;
    println!("combine: the weighted partial sums back to each token's rank");
    // each token's output: the partials of the ranks it went to, summed in rank order in f32;
    // against the single-device reference with the same order
    let mut bad = 0usize;
    for r in 0..n {
        let mut back = vec![0f32; cap * HIDDEN];
        reply_out[r].copy_to_host(0, &mut back)?;
        let mut o = vec![0u64; n];
        roff[r].copy_to_host(0, &mut o)?;
        let mut out = vec![0f32; TOKENS * HIDDEN];
        for d in 0..n {
            for (i, &t) in sent[r][d].iter().enumerate() {
                let at = o[d] as usize + i * HIDDEN;
                for j in 0..HIDDEN {
                    out[t * HIDDEN + j] += back[at + j];
                }
            }
        }
        for t in 0..TOKENS {
            let mut want = vec![0f32; HIDDEN];
            for d in 0..n {
                if picks[r][t].iter().any(|(e, _)| e / per == d) {
                    for (a, p) in want
                        .iter_mut()
                        .zip(partial(&w, &xf(r, t), &picks[r][t], d, per))
                    {
                        *a += p;
                    }
                }
            }
            let got = &out[t * HIDDEN..(t + 1) * HIDDEN];
            if got
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
