//! Host equivalents of the fused allreduce + residual add + RMSNorm kernels and of the unfused
//! baseline (`kernels/norm.ptx`), registered by [`super::install`]. They follow the PTX step by
//! step: the same rows per block, the same staging slots and parities, the same barriers and
//! counters, and the same arithmetic in the same order — the sum of squares per thread (units
//! strided over the block's threads), a butterfly within each warp, then one over the warps — so
//! the simulator's `out` is what the GPU computes, bit for bit.

use std::sync::atomic::Ordering;

use cuda_multimem_sim::{register_kernel, KernelError, LaunchArgs};

use super::{ld, set_counters, st, u32_at, u64_at, Ctx};
use crate::kernels::norm::{
    fp8_quant_entry, fp8_unfused_entry, ll_row_bytes, part_rows, unfused_entry, NormKernel,
    FP8_KERNELS, SPLIT,
};
use crate::kernels::*;
use crate::types::{DType, Fp8Scaling, FP8_GROUP};

/// Register the norm kernels' equivalents (called by [`super::install`]).
pub(super) fn register() {
    for d in DType::ALL {
        for k in NormKernel::ALL {
            register_kernel(&k.entry(d), move |a| run(k, d, a, false));
        }
        for k in FP8_KERNELS {
            register_kernel(&k.fp8_entry(d), move |a| run(k, d, a, true));
        }
        register_kernel(&unfused_entry(d), move |a| run_unfused(d, a, false));
        register_kernel(&fp8_unfused_entry(d), move |a| run_unfused(d, a, true));
        register_kernel(&fp8_quant_entry(d), move |a| run_quant(d, a));
    }
}

/// The standalone FP8 quantisation (`kernels::norm::fp8_quant_entry`: the local FP8 entry's
/// parameters, the rows at the residual slot): rows j = b, b + G, ... of the launch, each row's
/// `T` values quantised by [`Fp8::write`] as the FP8 norms quantise theirs.
fn run_quant(d: DType, a: &LaunchArgs) -> Result<(), KernelError> {
    let x = a.u64(1)? as usize;
    let (rows, hidden) = (a.u64(4)? as usize, a.u64(5)? as usize);
    let fp8 = Fp8::from_args(a, 7)?;
    let rb = hidden * d.size();
    let g = a.grid.0 as usize;
    for b in 0..g {
        for j in (b..rows).step_by(g) {
            a.check(x + j * rb, rb, false)?;
            let y: Vec<f32> = (0..hidden).map(|e| ld(d, x + j * rb, e as u64)).collect();
            fp8.write(a, j, &y, hidden)?;
        }
    }
    Ok(())
}

fn copy(a: &LaunchArgs, dst: usize, src: usize, len: usize) -> Result<(), KernelError> {
    a.check(src, len, false)?;
    a.check(dst, len, true)?;
    for i in 0..len {
        // SAFETY: both ranges checked above; volatile, as other devices' threads write staging.
        unsafe {
            std::ptr::write_volatile(
                (dst + i) as *mut u8,
                std::ptr::read_volatile((src + i) as *const u8),
            )
        };
    }
    Ok(())
}

/// The launch's shape: threads per block and elements per unit (16-byte vectors when every
/// operand and the row length are 16-byte aligned, else elements), as the PTX decides.
struct Row {
    d: DType,
    hidden: usize,
    threads: usize,
    per_unit: usize,
    eps: f32,
    /// Bytes per slice of the split forms (each slice a block of the row's cluster, whose
    /// partial sums of squares add in slice order); the whole row otherwise.
    slice_bytes: usize,
    /// The FP8 output of an FP8 entry.
    fp8: Option<Fp8>,
}

/// An FP8 entry's output parameters (kernels::norm::FP8_PARAMS): e4m3 rows, scales, scaling,
/// static scale, UE8M0 stride in words.
#[derive(Clone, Copy)]
struct Fp8 {
    q: usize,
    sc: usize,
    scaling: Fp8Scaling,
    scale: f32,
    stride: usize,
}

impl Fp8 {
    /// The four FP8 parameters from `first` on.
    fn from_args(a: &LaunchArgs, first: usize) -> Result<Fp8, KernelError> {
        let mode = a.u64(first + 2)?;
        let scaling = Fp8Scaling::ALL
            .into_iter()
            .find(|s| s.code() == mode & 0xff)
            .ok_or_else(|| KernelError::Failed(format!("FP8 mode {mode:#x}")))?;
        Ok(Fp8 {
            q: a.u64(first)? as usize,
            sc: a.u64(first + 1)? as usize,
            scaling,
            scale: f32::from_bits((mode >> 32) as u32),
            stride: a.u64(first + 3)? as usize,
        })
    }

    /// Quantise row `j` (of this launch) `y` (the `T` values as f32) step by step as the PTX
    /// does (its own code, not the reference's): amax as the max of the `u32` bits with the
    /// sign cleared, per row (slot 0) or per group of 128; the scale `amax / 448`, 1 for 0,
    /// UE8M0 by exponent bits; each element `div` by its scale, then `cvt.rn.satfinite`.
    /// `slice`: elements per slice of the split entries (the row otherwise): each slice's amax
    /// slots hold its own elements' max, and only the slice's first and last slot take the
    /// cluster's exchanged partials (the PTX's packets); a slot's scale is the view of the
    /// slice the group starts in, an element's scale its own slice's view.
    fn write(&self, a: &LaunchArgs, j: usize, y: &[f32], slice: usize) -> Result<(), KernelError> {
        let h = y.len();
        let groups = h / FP8_GROUP;
        let ue = self.scaling == Fp8Scaling::PerGroupUe8m0;
        let slots = if self.scaling.grouped() { groups } else { 1 };
        let slot = |e: usize| {
            if self.scaling.grouped() {
                e / FP8_GROUP
            } else {
                0
            }
        };
        let slice = slice.max(1);
        let cut: Vec<(usize, usize)> = (0..h.div_ceil(slice))
            .map(|s| (s * slice, ((s + 1) * slice).min(h)))
            .collect();
        // each slice's own slots, then its packet (first slot, last slot and their partials)
        let own: Vec<Vec<u32>> = cut
            .iter()
            .map(|&(e0, e1)| {
                let mut m = vec![0u32; slots];
                for (e, v) in y.iter().enumerate().take(e1).skip(e0) {
                    m[slot(e)] = m[slot(e)].max(v.to_bits() & 0x7fff_ffff);
                }
                m
            })
            .collect();
        let packets: Vec<[(usize, u32); 2]> = cut
            .iter()
            .zip(&own)
            .map(|(&(e0, e1), m)| {
                let (f, l) = (slot(e0), slot(e1 - 1));
                [(f, m[f]), (l, m[l])]
            })
            .collect();
        // slice s's view of slot g: the merged packets at its edges, its own slot elsewhere
        let view = |s: usize, g: usize| -> u32 {
            let edges = [slot(cut[s].0), slot(cut[s].1 - 1)];
            if edges.contains(&g) {
                packets
                    .iter()
                    .flatten()
                    .filter(|p| p.0 == g)
                    .fold(0, |acc, p| acc.max(p.1))
            } else {
                own[s][g]
            }
        };
        let slice_of = |e: usize| e / slice;
        let amax: Vec<u32> = (0..slots)
            .map(|g| {
                view(
                    slice_of(g * if self.scaling.grouped() { FP8_GROUP } else { 0 }),
                    g,
                )
            })
            .collect();
        // (scale, UE8M0 byte) of a slot, as the PTX's fp8_scale
        let scale_of = |bits: u32| -> (f32, u32) {
            let mut s = f32::from_bits(bits) / 448.0;
            if s == 0.0 {
                s = 1.0;
            }
            if !ue {
                return (s, 0);
            }
            let b = s.to_bits();
            let byte = (((b >> 23) & 255) + ((b & 0x7f_ffff) != 0) as u32).min(255);
            let p = if byte == 255 {
                f32::from_bits(0x7fff_ffff)
            } else {
                f32::from_bits(byte << 23)
            };
            (p, byte)
        };
        let sc: Vec<(f32, u32)> = amax.iter().map(|&m| scale_of(m)).collect();
        let q: Vec<u8> = y
            .iter()
            .enumerate()
            .map(|(e, v)| {
                let s = match self.scaling {
                    Fp8Scaling::Static => self.scale,
                    _ => scale_of(view(slice_of(e), slot(e))).0,
                };
                float8::F8E4M3::from_f32(v / s).to_bits()
            })
            .collect();
        a.check(self.q + j * h, h, true)?;
        for (e, v) in q.iter().enumerate() {
            // SAFETY: checked above.
            unsafe { std::ptr::write_volatile((self.q + j * h + e) as *mut u8, *v) };
        }
        let put = |at: usize, bits: u32| -> Result<(), KernelError> {
            a.check(at, 4, true)?;
            // SAFETY: checked above; 4-byte aligned (checked by the call).
            unsafe { std::ptr::write_volatile(at as *mut u32, bits) };
            Ok(())
        };
        match self.scaling {
            Fp8Scaling::Static => {}
            Fp8Scaling::PerToken => put(self.sc + 4 * j, sc[0].0.to_bits())?,
            Fp8Scaling::PerGroup => {
                for (g, s) in sc.iter().enumerate() {
                    put(self.sc + 4 * (j * groups + g), s.0.to_bits())?;
                }
            }
            Fp8Scaling::PerGroupUe8m0 => {
                for p in 0..groups.div_ceil(4) {
                    let mut w = 0u32;
                    for i in 0..4 {
                        if let Some(s) = sc.get(4 * p + i) {
                            w |= s.1 << (8 * i);
                        }
                    }
                    put(self.sc + 4 * (p * self.stride + j), w)?;
                }
            }
        }
        Ok(())
    }
}

/// Where the reduced value of a row's elements comes from.
enum Sum<'a> {
    /// Every rank's copy of the row, reduced in rank order.
    Slots(&'a [usize]),
    /// An already reduced row.
    Reduced(usize),
    /// Every rank's copy of the row as 4-byte words (polled from the low-latency staging),
    /// reduced in rank order.
    Words(&'a [Vec<u32>]),
}

/// Element `e` of a row held as 4-byte words.
fn word_elem(d: DType, words: &[u32], e: usize) -> f32 {
    let bits = match d.size() {
        4 => words[e],
        _ => (words[e / 2] >> (16 * (e % 2))) & 0xffff,
    };
    super::decode(d, bits)
}

impl Row {
    fn new(
        a: &LaunchArgs,
        d: DType,
        ptrs: [usize; 4],
        hidden: usize,
        eps: f32,
        fp8: Option<Fp8>,
    ) -> Row {
        let rb = hidden * d.size();
        // the FP8 entries: the e4m3 rows 8-byte aligned too (their vector stores)
        let q = fp8.map_or(0, |f| f.q << 1);
        let vector = (ptrs.iter().fold(rb | q, |acc, p| acc | p)) % 16 == 0;
        let per_unit = if vector { 16 / d.size() } else { 1 };
        Row {
            d,
            hidden,
            threads: a.block.0 as usize,
            per_unit,
            eps,
            slice_bytes: (hidden * d.size()).max(1),
            fp8,
        }
    }

    /// The split forms' rows: SPLIT slices of `16 · split_units(ceil(row bytes / 16))` bytes.
    fn split(mut self) -> Row {
        let u16s = (self.hidden * self.d.size()).div_ceil(16) as u64;
        self.slice_bytes = 16 * crate::kernels::norm::split_units(u16s) as usize;
        self
    }

    /// One row: pass 1 (sum, + r, round, store residual_out, squares per thread), the block's
    /// sum of squares, pass 2 (out); `push`: every rank's staging address for the row's
    /// residual_out (its out follows one row later); `j`: the row's index in the launch (the
    /// FP8 output's row).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        a: &LaunchArgs,
        sum: Sum,
        res: usize,
        w: usize,
        out: usize,
        push: &[usize],
        j: usize,
    ) -> Result<(), KernelError> {
        let (d, h) = (self.d, self.hidden);
        let rb = h * d.size();
        match sum {
            Sum::Slots(s) => s.iter().try_for_each(|&x| a.check(x, rb, false))?,
            Sum::Reduced(x) => a.check(x, rb, false)?,
            Sum::Words(_) => {}
        }
        a.check(res, rb, true)?;
        // an FP8 entry's unquantised rows are optional (0: none)
        let out_on = self.fp8.is_none() || out != 0;
        if out_on {
            a.check(out, rb, true)?;
        }
        a.check(w, rb, false)?;
        for &p in push {
            a.check(p, 2 * rb, true)?;
        }
        let slices = rb.div_ceil(self.slice_bytes);
        let mut ss = vec![vec![0f32; self.threads]; slices.max(1)];
        for e in 0..h {
            let s = match sum {
                Sum::Slots(s) => s[1..]
                    .iter()
                    .fold(ld(d, s[0], e as u64), |acc, &x| acc + ld(d, x, e as u64)),
                Sum::Reduced(x) => ld(d, x, e as u64),
                Sum::Words(ws) => ws[1..]
                    .iter()
                    .fold(word_elem(d, &ws[0], e), |acc, w| acc + word_elem(d, w, e)),
            };
            let v = d.decode(d.encode(s + ld(d, res, e as u64)));
            st(d, res, e as u64, v);
            for &p in push {
                st(d, p, e as u64, v);
            }
            let (byte, ub) = (e * d.size(), self.per_unit * d.size());
            let sl = byte / self.slice_bytes;
            let t = ((byte - sl * self.slice_bytes) / ub) % self.threads;
            ss[sl][t] += v * v;
        }
        // each slice's block tree, then the slices in order (the cluster's sum)
        let total = ss[1..]
            .iter()
            .fold(block_sum(&ss[0]), |acc, s| acc + block_sum(s));
        let rstd = crate::reference::rms_scale(total, h, self.eps);
        let mut y = Vec::with_capacity(if self.fp8.is_some() { h } else { 0 });
        for e in 0..h {
            let v = ld(d, res, e as u64);
            let o = v * rstd * ld(d, w, e as u64);
            if out_on {
                st(d, out, e as u64, o);
            }
            for &p in push {
                st(d, p + rb, e as u64, o);
            }
            if self.fp8.is_some() {
                y.push(d.decode(d.encode(o)));
            }
        }
        if let Some(f) = &self.fp8 {
            f.write(a, j, &y, self.slice_bytes / d.size())?;
        }
        Ok(())
    }
}

/// The PTX's block reduction: `shfl.sync.bfly` 16, 8, 4, 2, 1 within each warp, then the
/// warps' partials (lane i holds warp i's, 0 past the last warp) by the same butterfly.
fn block_sum(per_thread: &[f32]) -> f32 {
    fn butterfly(mut v: Vec<f32>) -> f32 {
        v.resize(32, 0.0);
        for off in [16, 8, 4, 2, 1] {
            v = (0..32).map(|l| v[l] + v[l ^ off]).collect();
        }
        v[0]
    }
    butterfly(
        per_thread
            .chunks(32)
            .map(|w| butterfly(w.to_vec()))
            .collect(),
    )
}

fn run(k: NormKernel, d: DType, a: &LaunchArgs, fp8: bool) -> Result<(), KernelError> {
    let pad = a.u64(0)? as usize;
    let (x, res, w, out) = (
        a.u64(1)? as usize,
        a.u64(2)? as usize,
        a.u64(3)? as usize,
        a.u64(4)? as usize,
    );
    let (rows, hidden) = (a.u64(5)? as usize, a.u64(6)? as usize);
    let eps = f32::from_bits(a.u64(9)? as u32);
    let cx = Ctx::from_pad(a, pad, 7, 8)?;
    let (rank, n) = (cx.rank, cx.n);
    let g = a.grid.0 as usize;
    if g > MAX_BLOCKS {
        return Err(KernelError::Failed(format!("grid of {g} blocks")));
    }
    let fp8 = if fp8 {
        Some(Fp8::from_args(a, 10)?)
    } else {
        None
    };
    let mut row = Row::new(a, d, [x, res, w, out], hidden, eps, fp8);
    // the split form: a row per cluster of SPLIT blocks (the grid must be whole clusters, as
    // `.reqnctapercluster` makes the hardware refuse other grids); each cluster's rows are run
    // by its first block here, the others only advance their counters
    let split = matches!(k, NormKernel::OneShotLlSplit | NormKernel::OneShotSplit);
    let (g_rows, row_blocks) = if split {
        if g % SPLIT != 0 {
            return Err(KernelError::Failed(format!(
                "a grid of {g} blocks is not whole clusters of {SPLIT}"
            )));
        }
        row = row.split();
        (g / SPLIT, SPLIT)
    } else {
        (g, 1)
    };
    let rb = hidden * d.size();
    let half = u64_at(pad + OFF_STAGE_HALF).load(Ordering::Relaxed) as usize;
    let stage = |t: usize| u64_at(pad + OFF_STAGES + 8 * t).load(Ordering::Relaxed) as usize;
    let ll_half = u64_at(pad + OFF_LL_SLOT).load(Ordering::Relaxed) as usize;
    let ll_stage = |t: usize| u64_at(pad + OFF_LL_STAGES + 8 * t).load(Ordering::Relaxed) as usize;
    let pp = part_rows(rows as u64, n as u64) as usize;
    let part = |k: usize| {
        let f0 = (k * pp).min(rows);
        (f0, (rows - f0).min(pp))
    };
    for b in 0..g {
        let c = u32_at(pad + OFF_CTR + 4 * b).load(Ordering::Relaxed);
        let p = ((c >> 1) & 1) as usize;
        let slot = |t: usize, q: usize, s: usize| stage(t) + (q * n + s) * half;
        let ll_slot = |t: usize, q: usize, s: usize| ll_stage(t) + (q * n + s) * ll_half;
        match k {
            NormKernel::OneShotSplit if b % row_blocks != 0 => {
                // the cluster's other blocks: their barrier (each block meets its peers')
                cx.barrier(a, b, c.wrapping_add(1), Some(p as u32));
            }
            NormKernel::OneShot | NormKernel::OneShotSplit => {
                // block b's barrier; the cluster's rows run by its first block
                let bb = b;
                let (b, g) = (b / row_blocks, g_rows);
                for j in (b..rows).step_by(g) {
                    for t in 0..n {
                        copy(a, slot(t, p, rank) + j * rb, x + j * rb, rb)?;
                    }
                }
                cx.barrier(a, bb, c.wrapping_add(1), Some(p as u32));
                for j in (b..rows).step_by(g) {
                    let srcs: Vec<usize> = (0..n).map(|s| slot(rank, p, s) + j * rb).collect();
                    let o = if out == 0 { 0 } else { out + j * rb };
                    row.run(a, Sum::Slots(&srcs), res + j * rb, w, o, &[], j)?;
                }
            }
            NormKernel::TwoShot => {
                for t in 0..n {
                    let (f0, len) = part(t);
                    for j in (b..len).step_by(g) {
                        copy(a, slot(t, p, rank) + j * rb, x + (f0 + j) * rb, rb)?;
                    }
                }
                cx.barrier(a, b, c.wrapping_add(1), Some(p as u32));
                let (f0, len) = part(rank);
                for j in (b..len).step_by(g) {
                    let srcs: Vec<usize> = (0..n).map(|s| slot(rank, p, s) + j * rb).collect();
                    let push: Vec<usize> =
                        (0..n).map(|t| slot(t, 1 - p, rank) + j * 2 * rb).collect();
                    let at = (f0 + j) * rb;
                    row.run(a, Sum::Slots(&srcs), res + at, w, out + at, &push, f0 + j)?;
                }
                cx.barrier(a, b, c.wrapping_add(2), None);
                for t in (0..n).filter(|&t| t != rank) {
                    let (f0, len) = part(t);
                    for j in (b..len).step_by(g) {
                        let from = slot(rank, 1 - p, t) + j * 2 * rb;
                        copy(a, res + (f0 + j) * rb, from, rb)?;
                        copy(a, out + (f0 + j) * rb, from + rb, rb)?;
                    }
                }
                cx.barrier(a, b, c.wrapping_add(3), None);
            }
            NormKernel::OneShotLl | NormKernel::OneShotLlSplit if b % row_blocks != 0 => {}
            NormKernel::OneShotLl | NormKernel::OneShotLlSplit => {
                let (b, g) = (b / row_blocks, g_rows);
                // send every word of my rows as (flag, word) into my slot of every rank, then
                // poll my slots row by row: no barrier
                let flag = (ll_flag(c, cx.sig) as u64) << 32;
                let lrb = ll_row_bytes(rb as u64) as usize;
                let words = rb / 4;
                for j in (b..rows).step_by(g) {
                    a.check(x + j * rb, rb, false)?;
                    for t in 0..n {
                        let dst = ll_slot(t, p, rank) + j * lrb;
                        a.check(dst, lrb, true)?;
                        for i in 0..words {
                            // SAFETY: checked above; 4-byte aligned (the host checks).
                            let v = unsafe {
                                std::ptr::read_volatile((x + j * rb + 4 * i) as *const u32)
                            };
                            u64_at(dst + 8 * i).store(flag | v as u64, Ordering::Relaxed);
                        }
                    }
                }
                a.jitter();
                for j in (b..rows).step_by(g) {
                    let mut got = Vec::with_capacity(n);
                    for s in 0..n {
                        let src = ll_slot(rank, p, s) + j * lrb;
                        a.check(src, lrb, false)?;
                        got.push(
                            (0..words)
                                .map(|i| poll(&cx, src + 8 * i, flag, c))
                                .collect::<Vec<u32>>(),
                        );
                    }
                    let o = if out == 0 { 0 } else { out + j * rb };
                    row.run(a, Sum::Words(&got), res + j * rb, w, o, &[], j)?;
                }
            }
        }
        let fin = c.wrapping_add(k.counter_step());
        set_counters(pad, b, g, fin);
    }
    Ok(())
}

/// [`super::ll_poll`]: the word of the cell at `at` once its flag is `flag`'s (or the wait
/// ended).
fn poll(cx: &Ctx, at: usize, flag: u64, c: u32) -> u32 {
    super::ll_poll(cx, at, flag, c, None) as u32
}

fn run_unfused(d: DType, a: &LaunchArgs, fp8: bool) -> Result<(), KernelError> {
    let (x, res, w, out) = (
        a.u64(0)? as usize,
        a.u64(1)? as usize,
        a.u64(2)? as usize,
        a.u64(3)? as usize,
    );
    let (rows, hidden) = (a.u64(4)? as usize, a.u64(5)? as usize);
    let eps = f32::from_bits(a.u64(6)? as u32);
    let fp8 = if fp8 {
        Some(Fp8::from_args(a, 7)?)
    } else {
        None
    };
    let row = Row::new(a, d, [x, res, w, out], hidden, eps, fp8);
    let rb = hidden * d.size();
    let g = a.grid.0 as usize;
    for b in 0..g {
        for j in (b..rows).step_by(g) {
            let o = if out == 0 { 0 } else { out + j * rb };
            row.run(a, Sum::Reduced(x + j * rb), res + j * rb, w, o, &[], j)?;
        }
    }
    Ok(())
}
