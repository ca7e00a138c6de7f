//! A tensor-parallel MLP block on every GPU of the machine (or a simulated machine of 4, saying
//! so): column-parallel matmul → SiLU → row-parallel matmul → fused allreduce + residual add +
//! RMSNorm (`RankHandle::all_reduce_add_rms_norm`), checked against a single-device reference.
//!
//! Rank r holds columns `[r·I/N, (r+1)·I/N)` of W1 (hidden × I) and the same rows of W2
//! (I × hidden), so its `silu(x · W1_r) · W2_r` is a partial sum of the layer's output; the
//! fused call reduces the partials, adds the residual (the layer's input) and normalises.
//! The matmuls run on the host here (the point is the collective), their results go to each
//! GPU as `DeviceBuffer`s, the caller's own memory. Two checks: residual_out bit for bit and out
//! within the sum-of-squares tolerance against `add_rms_norm_reference` of the same partials;
//! and out against the whole block computed in f32 on one device, within bf16 rounding.
//!
//! Then the FP8 form an FP8 engine runs (`RankHandle::all_reduce_add_rms_norm_fp8`, per-token
//! dynamic scales, with the bf16 rows beside them): its e4m3 rows are the host quantisation of
//! the bf16 output bit for bit (`fp8_quantise`), and they feed the next layer's column-parallel
//! matmul as an FP8 GEMM reads them (`q · scale` per token, times this rank's W1 columns),
//! within FP8 precision of the same matmul on the bf16 rows.
//!
//! `cargo run --release --example tp_mlp` (`CUDA_MULTIMEM_DRIVER=sim:devices=N` picks a
//! simulated machine).

// `usize::is_multiple_of` needs Rust 1.87; the workspace keeps `%` for older toolchains.
#![allow(clippy::manual_is_multiple_of)]

use std::process::ExitCode;

use cuda_multimem::{DeviceBuffer, Stream};
use cuda_multimem_collectives::testing::{
    add_rms_norm_reference, fp8_quantise, next_random, rms_norm_within_tolerance,
};
use cuda_multimem_collectives::{bf16, Communicator, Fp8Out, Fp8Scaling, MulticastPolicy, F8E4M3};
use cuda_multimem_examples::{pick_driver, Res};

const TOKENS: usize = 4;
const HIDDEN: usize = 1024;
/// Divisible by every team size from 1 to 8 (840 · 4).
const INTER: usize = 3360;
const EPS: f32 = 1e-5;

fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("tp_mlp: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<bool> {
    let (driver, what) = pick_driver(2, 4)?;
    let devices = driver.devices();
    let n = devices.len().min(8);
    let devices = &devices[..n];
    println!("tp_mlp: {what}; {n} ranks, {TOKENS} tokens, hidden {HIDDEN}, intermediate {INTER}");
    if INTER % n != 0 {
        return Err(format!("intermediate {INTER} does not split over {n} ranks").into());
    }
    let mut s = 0x7e57_u64;
    let mut rand = |scale: f32| next_random(&mut s) * scale;
    let x: Vec<f32> = (0..TOKENS * HIDDEN).map(|_| rand(1.0)).collect();
    let w1: Vec<f32> = (0..HIDDEN * INTER)
        .map(|_| rand(1.0 / (HIDDEN as f32).sqrt()))
        .collect();
    let w2: Vec<f32> = (0..INTER * HIDDEN)
        .map(|_| rand(1.0 / (INTER as f32).sqrt()))
        .collect();
    let gamma: Vec<f32> = (0..HIDDEN).map(|_| 1.0 + rand(0.1)).collect();
    // the model's tensors in bf16, as an engine holds them
    let to_bf = |v: &[f32]| v.iter().map(|&a| bf16::from_f32(a)).collect::<Vec<_>>();
    let (xb, gb) = (to_bf(&x), to_bf(&gamma));
    let xf: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
    // rank r's partial sums: silu(x · W1[:, cols_r]) · W2[rows_r, :]
    let cols = INTER / n;
    let partial = |r: usize| -> Vec<f32> {
        let mut y = vec![0f32; TOKENS * HIDDEN];
        for t in 0..TOKENS {
            for c in r * cols..(r + 1) * cols {
                let a: f32 = (0..HIDDEN)
                    .map(|k| xf[t * HIDDEN + k] * w1[k * INTER + c])
                    .sum();
                let a = silu(a);
                for j in 0..HIDDEN {
                    y[t * HIDDEN + j] += a * w2[c * HIDDEN + j];
                }
            }
        }
        y
    };
    let partials: Vec<Vec<f32>> = (0..n).map(partial).collect();
    let parts_bf: Vec<Vec<bf16>> = partials.iter().map(|p| to_bf(p)).collect();
    // the norm never uses multicast: no multicast object on any machine
    let comm = Communicator::builder(devices)
        .multicast(MulticastPolicy::Never)
        .build()?;
    let streams: Vec<Stream> = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
    let mut bufs = Vec::new();
    for (r, d) in devices.iter().enumerate() {
        bufs.push((
            DeviceBuffer::from_host(d, &parts_bf[r])?,
            DeviceBuffer::from_host(d, &xb)?,
            DeviceBuffer::from_host(d, &gb)?,
            DeviceBuffer::<bf16>::zeroed(d, TOKENS * HIDDEN)?,
        ));
    }
    for (r, (y, res, g, out)) in bufs.iter_mut().enumerate() {
        let c = comm.rank(r)?.all_reduce_add_rms_norm(
            &*y,
            &mut *res,
            &*g,
            &mut *out,
            HIDDEN,
            EPS,
            &streams[r],
        )?;
        if r == 0 {
            println!("rank 0 ran: {c}");
        }
    }
    for st in &streams {
        st.synchronize()?;
    }
    comm.check()?;
    let refs: Vec<&[bf16]> = parts_bf.iter().map(|v| v.as_slice()).collect();
    let (want_res, want_out) = add_rms_norm_reference(&refs, &xb, &gb, HIDDEN, EPS);
    // the whole block on one device in f32: y = Σ partials (unrounded), h = y + x, rmsnorm
    let mut single = vec![0f32; TOKENS * HIDDEN];
    for t in 0..TOKENS {
        let row: Vec<f32> = (0..HIDDEN)
            .map(|j| partials.iter().map(|p| p[t * HIDDEN + j]).sum::<f32>() + xf[t * HIDDEN + j])
            .collect();
        let ms = row.iter().map(|v| v * v).sum::<f32>() / HIDDEN as f32;
        let rstd = 1.0 / (ms + EPS).sqrt();
        for j in 0..HIDDEN {
            single[t * HIDDEN + j] = row[j] * rstd * gb[j].to_f32();
        }
    }
    let mut ok = true;
    for (r, (_, res, _, out)) in bufs.iter().enumerate() {
        let (res, out) = (res.to_vec()?, out.to_vec()?);
        let exact = res == want_res;
        let close = out
            .iter()
            .zip(&want_out)
            .all(|(a, b)| rms_norm_within_tolerance(*a, *b));
        // against the f32 single-device block: the partials' and the output's bf16 rounding
        let worst = out
            .iter()
            .zip(&single)
            .map(|(a, b)| (a.to_f32() - b).abs())
            .fold(0f32, f32::max);
        let single_ok = worst < 0.05;
        println!(
            "rank {r}: residual_out {} the reference, out {} (single-device f32 block: max |diff| {worst:.4})",
            if exact { "equals" } else { "DIFFERS from" },
            if close { "within tolerance" } else { "OUT OF tolerance" }
        );
        ok &= exact && close && single_ok;
    }
    ok &= fp8_step(&comm, &streams, devices, &parts_bf, &xb, &gb, &w1, n)?;
    println!("{}", if ok { "tp_mlp: ok" } else { "tp_mlp: MISMATCH" });
    Ok(ok)
}

/// The same fused step with an FP8 output (per-token scales, the bf16 rows beside them), whose
/// e4m3 rows and scales go into the next layer's first matmul (this rank's columns of W1).
#[allow(clippy::too_many_arguments)]
fn fp8_step(
    comm: &Communicator,
    streams: &[Stream],
    devices: &[cuda_multimem::Device],
    parts_bf: &[Vec<bf16>],
    xb: &[bf16],
    gb: &[bf16],
    w1: &[f32],
    n: usize,
) -> Res<bool> {
    let len = TOKENS * HIDDEN;
    let mut bufs = Vec::new();
    for (r, d) in devices.iter().enumerate() {
        bufs.push((
            DeviceBuffer::from_host(d, &parts_bf[r])?,
            DeviceBuffer::from_host(d, xb)?,
            DeviceBuffer::from_host(d, gb)?,
            DeviceBuffer::<F8E4M3>::zeroed(d, len)?,
            DeviceBuffer::<f32>::zeroed(d, TOKENS)?,
            DeviceBuffer::<bf16>::zeroed(d, len)?,
        ));
    }
    for (r, (y, res, g, q, sc, out)) in bufs.iter_mut().enumerate() {
        let spec = Fp8Out::per_token(&mut *q, &mut *sc).with_unquantised(&mut *out);
        let c = comm.rank(r)?.all_reduce_add_rms_norm_fp8(
            &*y,
            &mut *res,
            &*g,
            spec,
            HIDDEN,
            EPS,
            &streams[r],
        )?;
        if r == 0 {
            println!("rank 0 ran the FP8 form: {c}");
        }
    }
    for st in streams {
        st.synchronize()?;
    }
    comm.check()?;
    let cols = INTER / n;
    let mut ok = true;
    for (r, (_, _, _, q, sc, out)) in bufs.iter().enumerate() {
        let (q, sc, out) = (q.to_vec()?, sc.to_vec()?, out.to_vec()?);
        let (wq, ws) = fp8_quantise(&out, HIDDEN, Fp8Scaling::PerToken, 0.0);
        let exact = q.iter().zip(&wq).all(|(a, b)| a.to_bits() == b.to_bits()) && sc == ws;
        // the next matmul on rank r: its columns of W1, from the e4m3 rows (an FP8 GEMM's
        // view: q · scale) and from the bf16 rows
        let mut worst = 0f32;
        let mut big = 0f32;
        for t in 0..TOKENS {
            for c in r * cols..(r + 1) * cols {
                let (mut a8, mut a16) = (0f32, 0f32);
                for k in 0..HIDDEN {
                    let w = w1[k * INTER + c];
                    a8 += q[t * HIDDEN + k].to_f32() * sc[t] * w;
                    a16 += out[t * HIDDEN + k].to_f32() * w;
                }
                worst = worst.max((a8 - a16).abs());
                big = big.max(a16.abs());
            }
        }
        // e4m3 keeps 3 mantissa bits: each element within 2^-4 relative; the sums of
        // HIDDEN products with random signs stay well within 5 % of the largest output
        let close = worst <= 0.05 * big;
        println!(
            "rank {r}: e4m3 rows and scales {} the host quantisation; next matmul from FP8: max |diff| {worst:.4} of {big:.4}",
            if exact { "equal" } else { "DIFFER from" }
        );
        ok &= exact && close;
    }
    Ok(ok)
}
