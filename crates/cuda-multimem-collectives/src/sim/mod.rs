//! Host-side equivalents of the PTX kernels, for the simulated driver (`cuda-multimem-sim`):
//! [`install`] registers them. They follow the kernels' protocol step by step — the same work
//! split per block and per rank, the same barrier (release stores to peers' signal slots,
//! acquire loads of one's own, a timeout that sets the error word), the same counters and header
//! parity — so a protocol bug shows on the simulator. The simulator runs one stream worker per
//! device: the blocks of one launch run one after the other on that thread, and every device's
//! thread runs concurrently.
//!
//! Nothing registers them behind the caller's back: a program (or test harness) that runs the
//! collectives on a simulated driver calls [`install`] once, before its first launch. A launch
//! of an entry without a registered equivalent fails, and the simulator names the entry.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Once;
use std::time::{Duration, Instant};

use cuda_multimem_sim::{register_kernel, KernelError, LaunchArgs};

use crate::kernels::*;
use crate::types::{Acc, DType, ReduceOp as Op};

mod norm;

fn decode(d: DType, bits: u32) -> f32 {
    d.decode(bits)
}

fn encode(d: DType, v: f32) -> u32 {
    d.encode(v)
}

/// Register the host-side equivalent of every kernel of this crate — the peer-to-peer families
/// and the multimem ones — with the simulated driver, under the PTX entry names. Process-wide
/// and idempotent: later calls do nothing. Call it before launching the collectives on a
/// simulated driver; on a real driver it is never consulted.
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for k in Kernel::ALL {
            for d in DType::REDUCED {
                for o in Op::ALL.into_iter().filter(|&o| k.has(o) && k.has_type(d)) {
                    register_kernel(&k.entry(d, o), move |a| run(k, d, o, a));
                }
            }
        }
        gather::register();
        alltoall::register();
        moe::register();
        multimem::register();
        norm::register();
    });
}

/// The MoE dispatch / combine equivalents (a child module: they share this module's barrier
/// and the gather module's byte copy).
mod moe;

/// The all-to-all equivalents (a child module: they share this module's barrier and the
/// gather module's byte copy).
mod alltoall;

/// The reduce-scatter, all-gather and broadcast equivalents (a child module: they share this
/// module's barrier, loads and stores).
mod gather;

/// The multimem equivalents: allreduce, reduce-scatter, all-gather, broadcast (a child module:
/// they share this module's loads and stores, and the gather module's byte copy).
mod multimem;

fn u32_at(addr: usize) -> &'static AtomicU32 {
    // SAFETY: callers pass 4-byte aligned addresses inside a pad checked with `LaunchArgs::check`;
    // device memory outlives the launch (freeing waits for the device's streams).
    unsafe { &*(addr as *const AtomicU32) }
}

fn u64_at(addr: usize) -> &'static AtomicU64 {
    // SAFETY: as `u32_at`, 8-byte aligned.
    unsafe { &*(addr as *const AtomicU64) }
}

/// Read element `i` at `base`, as f32 (the f32, f16 and bf16 kernels: multimem, norm).
fn ld(d: DType, base: usize, i: u64) -> f32 {
    decode(d, ld_bits(d, base, i) as u32)
}

/// Store `v` rounded to `d` as element `i` at `base` (f32, f16, bf16).
fn st(d: DType, base: usize, i: u64, v: f32) {
    st_bits(d, base, i, encode(d, v) as u64);
}

/// The bits of element `i` at `base` (any type).
fn ld_bits(d: DType, base: usize, i: u64) -> u64 {
    let a = base + i as usize * d.size();
    // SAFETY: the range was checked with `LaunchArgs::check`; volatile, because other devices'
    // threads write device memory concurrently (ordered by the protocol's acquire/release).
    unsafe {
        match d.size() {
            8 => std::ptr::read_volatile(a as *const u64),
            4 => std::ptr::read_volatile(a as *const u32) as u64,
            2 => std::ptr::read_volatile(a as *const u16) as u64,
            _ => std::ptr::read_volatile(a as *const u8) as u64,
        }
    }
}

/// Store the low bytes of `bits` as element `i` at `base` (any type).
fn st_bits(d: DType, base: usize, i: u64, bits: u64) {
    let a = base + i as usize * d.size();
    // SAFETY: as `ld_bits`, checked writable.
    unsafe {
        match d.size() {
            8 => std::ptr::write_volatile(a as *mut u64, bits),
            4 => std::ptr::write_volatile(a as *mut u32, bits as u32),
            2 => std::ptr::write_volatile(a as *mut u16, bits as u16),
            _ => std::ptr::write_volatile(a as *mut u8, bits as u8),
        }
    }
}

/// Element `i` at `base` in `d`'s accumulator.
fn ld_acc(d: DType, base: usize, i: u64) -> Acc {
    d.acc(ld_bits(d, base, i))
}

/// A reduction over the elements of `bits` (a word of packed elements of `d`, `per` of them,
/// or one 8-byte element) with the accumulators `acc` (first: rank 0's).
fn combine_word(d: DType, op: Op, acc: &mut [Option<Acc>], word: u64) {
    let es = d.size();
    for (e, a) in acc.iter_mut().enumerate() {
        let bits = if es == 8 {
            word
        } else {
            (word >> (8 * es * e)) & ((1u64 << (8 * es)) - 1)
        };
        let x = d.acc(bits);
        *a = Some(match *a {
            None => x,
            Some(a) => d.combine(op, a, x),
        });
    }
}

/// The finished accumulators of [`combine_word`] (a team of `n`) packed back into a word.
fn finish_word(d: DType, op: Op, acc: &[Option<Acc>], n: usize) -> u64 {
    let es = d.size();
    acc.iter().enumerate().fold(0u64, |w, (e, a)| {
        let r = a.map_or(0, |a| d.round(d.finish(op, a, n)));
        if es == 8 {
            r
        } else {
            w | r << (8 * es * e)
        }
    })
}

/// Elements [lo, hi): reduce every source in rank order — source (x, base) holds element i at
/// index i - base — and store the result to every output (at index i). Ranges checked first.
fn reduce_into(
    a: &LaunchArgs,
    d: DType,
    op: Op,
    srcs: &[(usize, u64)],
    outs: &[usize],
    lo: u64,
    hi: u64,
) -> Result<(), KernelError> {
    let es = d.size() as u64;
    let len = ((hi - lo) * es) as usize;
    for &(x, base) in srcs {
        a.check(x + ((lo - base) * es) as usize, len, false)?;
    }
    for o in outs {
        a.check(o + (lo * es) as usize, len, true)?;
    }
    for i in lo..hi {
        let mut acc = ld_acc(d, srcs[0].0, i - srcs[0].1);
        for &(x, base) in &srcs[1..] {
            acc = d.combine(op, acc, ld_acc(d, x, i - base));
        }
        let bits = d.round(d.finish(op, acc, srcs.len()));
        for o in outs {
            st_bits(d, *o, i, bits);
        }
    }
    Ok(())
}

/// The kernels' epilogue: block `b`'s barrier counter and its replicas `b`, `b + g`, `b + 2g`,
/// ... below `MAX_BLOCKS` in the pad at `pad` become `v` (every slot, for one block).
fn set_counters(pad: usize, b: usize, g: usize, v: u32) {
    for j in (b..MAX_BLOCKS).step_by(g.max(1)) {
        u32_at(pad + OFF_CTR + 4 * j).store(v, Ordering::Relaxed);
    }
}

/// Sources indexed like the message itself (base 0), for [`reduce_into`].
fn unbased(xs: &[usize]) -> Vec<(usize, u64)> {
    xs.iter().map(|&x| (x, 0)).collect()
}

struct Ctx {
    pad: usize,
    rank: usize,
    n: usize,
    pads: Vec<usize>,
    timeout: Duration,
    sig: u64,
    /// The rank's error mirror (host-mapped memory; 0: none).
    mirror: usize,
}

/// The error mirror whose address a pad (or multicast member) at `pad` holds at `off`
/// (`OFF_MIRROR`, `MM_OFF_MIRROR`), checked writable; 0 where there is none.
fn mirror_at(a: &LaunchArgs, pad: usize, off: usize) -> Result<usize, KernelError> {
    let m = u64_at(pad + off).load(Ordering::Relaxed) as usize;
    if m != 0 {
        a.check(m, 4, true)?;
    }
    Ok(m)
}

/// The PTX `err_set`: the error word `err` becomes `code` with `peer` + 1 in bits 31..8 where
/// known, unless set already; then [`mirror_word`].
fn fail(err: &AtomicU32, mirror: usize, code: u32, peer: Option<usize>) {
    let w = code | peer.map_or(0, |p| (p as u32 + 1) << 8);
    let _ = err.compare_exchange(0, w, Ordering::Relaxed, Ordering::Relaxed);
    mirror_word(err, mirror);
}

/// The PTX `err_mirror`: the error word, found set, into the host-mapped mirror (if any).
fn mirror_word(err: &AtomicU32, mirror: usize) {
    if mirror != 0 {
        u32_at(mirror).store(err.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

impl Ctx {
    /// The barrier context of the rank whose pad is at `pad` (checked: its rank, team size and
    /// every rank's pad), with the call header and the timeout in nanoseconds from the launch
    /// parameters `sig` and `timeout`.
    fn from_pad(
        a: &LaunchArgs,
        pad: usize,
        sig: usize,
        timeout: usize,
    ) -> Result<Ctx, KernelError> {
        a.check(pad, PAD_BYTES, true)?;
        let rank = u32_at(pad + OFF_RANK).load(Ordering::Relaxed) as usize;
        let n = u32_at(pad + OFF_NRANKS).load(Ordering::Relaxed) as usize;
        if n == 0 || n > MAX_RANKS || rank >= n {
            return Err(KernelError::Failed(format!("bad pad: rank {rank} of {n}")));
        }
        let pads: Vec<usize> = (0..n)
            .map(|t| u64_at(pad + OFF_PADS + 8 * t).load(Ordering::Relaxed) as usize)
            .collect();
        for &p in &pads {
            a.check(p, PAD_BYTES, true)?;
        }
        Ok(Ctx {
            pad,
            rank,
            n,
            pads,
            timeout: Duration::from_nanos(a.u64(timeout)?),
            sig: a.u64(sig)?,
            mirror: mirror_at(a, pad, OFF_MIRROR)?,
        })
    }

    fn err(&self) -> &AtomicU32 {
        u32_at(self.pad + OFF_ERR)
    }

    /// [`fail`] on this rank's error word.
    fn fail(&self, code: u32, peer: Option<usize>) {
        fail(self.err(), self.mirror, code, peer);
    }

    /// [`mirror_word`] of this rank's error word (a wait that found it set).
    fn seen(&self) {
        mirror_word(self.err(), self.mirror);
    }

    /// The barrier of block `b` at `val` (see the PTX `barrier`): signal every peer, then wait
    /// for every peer, bounded by the timeout; check the header when `parity` is given.
    fn barrier(&self, a: &LaunchArgs, b: usize, val: u32, parity: Option<u32>) {
        self.arrive(a, b, val, parity);
        self.wait(b, val, parity);
    }

    /// The signal half of [`Ctx::barrier`]: block `b` tells every peer it arrived at `val`
    /// (release), after writing its header when `parity` is given.
    fn arrive(&self, a: &LaunchArgs, b: usize, val: u32, parity: Option<u32>) {
        a.jitter();
        for t in (0..self.n).filter(|&t| t != self.rank) {
            if let Some(p) = parity {
                let slot = hdr_slot(p as usize, b, self.rank);
                u64_at(self.pads[t] + OFF_HDR + slot).store(self.sig, Ordering::Relaxed);
            }
            u32_at(self.pads[t] + sig_slot(b, self.rank)).store(val, Ordering::Release);
        }
    }

    /// The wait half of [`Ctx::barrier`]: until every peer's block `b` arrived at `val`
    /// (acquire), bounded by the timeout (then `ERR_TIMEOUT`) or until the error word is set;
    /// the headers checked when `parity` is given.
    fn wait(&self, b: usize, val: u32, parity: Option<u32>) {
        for t in (0..self.n).filter(|&t| t != self.rank) {
            let slot = u32_at(self.pad + sig_slot(b, t));
            let start = Instant::now();
            let mut spins = 0u32;
            let arrived = loop {
                if slot.load(Ordering::Acquire).wrapping_sub(val) as i32 >= 0 {
                    break true;
                }
                if self.err().load(Ordering::Relaxed) != 0 {
                    self.seen();
                    break false;
                }
                if start.elapsed() >= self.timeout {
                    self.fail(ERR_TIMEOUT, Some(t));
                    break false;
                }
                spins += 1;
                if spins < 64 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(20));
                }
            };
            if arrived {
                if let Some(p) = parity {
                    let h = u64_at(self.pad + OFF_HDR + hdr_slot(p as usize, b, t))
                        .load(Ordering::Relaxed);
                    if h != self.sig {
                        self.fail(ERR_MISMATCH, Some(t));
                    }
                }
            }
        }
    }
}

fn run(k: Kernel, d: DType, op: Op, a: &LaunchArgs) -> Result<(), KernelError> {
    let pad = a.u64(0)? as usize;
    let (inp, out, count) = (a.u64(1)? as usize, a.u64(2)? as usize, a.u64(3)?);
    let (in_tab, out_tab) = (a.u64(4)? as usize, a.u64(5)? as usize);
    let cx = Ctx::from_pad(a, pad, 6, 7)?;
    let (rank, n) = (cx.rank, cx.n);
    let g = a.grid.0 as u64;
    if g as usize > MAX_BLOCKS {
        return Err(KernelError::Failed(format!("grid of {g} blocks")));
    }
    if k == Kernel::P2pOneShotLl {
        return run_ll(d, op, a, &cx, inp, out, count, g);
    }
    let es = d.size() as u64;
    let v = 16 / es;
    let aligned = (inp | out) % 16 == 0;
    let units = if aligned { count / v } else { count };
    let ub = if aligned { v } else { 1 }; // elements per unit
    let per = units.div_ceil(g).next_multiple_of(8); // blocks start on 128-byte lines
    let tail_start = if aligned { units * v } else { count };
    for b in 0..g {
        let c = u32_at(pad + OFF_CTR + 4 * b as usize).load(Ordering::Relaxed);
        let parity = (c >> 1) & 1;
        let bs = (b * per).min(units);
        let be = (bs + per).min(units);
        let last_block = b == g - 1;
        let mut final_ctr = c.wrapping_add(2);
        match k {
            Kernel::P2pOneShot => {
                // staging: [parity][sender][half]; push into my slot of every rank's staging,
                // then reduce my own slots
                let half = u64_at(pad + OFF_STAGE_HALF).load(Ordering::Relaxed) as usize;
                let stage =
                    |t: usize| u64_at(pad + OFF_STAGES + 8 * t).load(Ordering::Relaxed) as usize;
                let push: Vec<usize> = (0..n)
                    .map(|t| stage(t) + (parity as usize * n + rank) * half)
                    .collect();
                let mine: Vec<usize> = (0..n)
                    .map(|k| stage(rank) + (parity as usize * n + k) * half)
                    .collect();
                let mut ranges = vec![(bs * ub, be * ub)];
                if last_block {
                    ranges.push((tail_start, count));
                }
                for &(lo, hi) in &ranges {
                    let len = ((hi - lo) * es) as usize;
                    let off = (lo * es) as usize;
                    a.check(inp + off, len, false)?;
                    for p in &push {
                        a.check(p + off, len, true)?;
                    }
                    for i in lo..hi {
                        let x = ld_bits(d, inp, i);
                        for p in &push {
                            st_bits(d, *p, i, x);
                        }
                    }
                }
                cx.barrier(a, b as usize, c.wrapping_add(1), Some(parity));
                for &(lo, hi) in &ranges {
                    reduce_into(a, d, op, &unbased(&mine), &[out], lo, hi)?;
                }
            }
            Kernel::P2pOneShotLl => unreachable!("handled by run_ll"),
            Kernel::P2pTwoShotPush => {
                // rounds through this block's share of the slots (see the PTX); vector units
                // only (the host checks the alignment); tail as in the two-shot
                if !aligned {
                    return Err(KernelError::Failed(
                        "two-shot-push with misaligned operands".into(),
                    ));
                }
                let slot = u64_at(pad + OFF_STAGE_HALF).load(Ordering::Relaxed) as usize;
                let stage =
                    |t: usize| u64_at(pad + OFF_STAGES + 8 * t).load(Ordering::Relaxed) as usize;
                a.check(in_tab, 8 * n, false)?;
                a.check(out_tab, 8 * n, false)?;
                let tab = |t: usize, at: usize| u64_at(at + 8 * t).load(Ordering::Relaxed) as usize;
                let din = inp.wrapping_sub(tab(rank, in_tab));
                let dout = out.wrapping_sub(tab(rank, out_tab));
                let ins: Vec<usize> = (0..n).map(|t| tab(t, in_tab).wrapping_add(din)).collect();
                let outs: Vec<usize> = (0..n).map(|t| tab(t, out_tab).wrapping_add(dout)).collect();
                let bsz = ((slot as u64 / 16) / g) & !7;
                if bsz == 0 {
                    return Err(KernelError::Failed(format!(
                        "a {slot}-byte staging slot cannot be shared by {g} blocks"
                    )));
                }
                let boff = (b * bsz * 16) as usize;
                let chunk = n as u64 * bsz;
                let rounds = per.div_ceil(chunk).max(1);
                // the prologue copy (see the PTX): this block's share of the 16-byte units,
                // cut like the message, in one slice per round, done during the round's first
                // barrier
                let (cp_src, cp_dst, cp_bytes) = (a.u64(8)?, a.u64(9)?, a.u64(10)?);
                if (cp_src | cp_dst | cp_bytes) % 16 != 0 {
                    return Err(KernelError::Failed(format!(
                        "two-shot-push prologue copy of {cp_bytes} bytes from {cp_src:#x} to {cp_dst:#x}: not 16-byte aligned"
                    )));
                }
                let cp_units = cp_bytes / 16;
                let cp_per = cp_units.div_ceil(g).next_multiple_of(8);
                let cp_lo = (b * cp_per).min(cp_units);
                let cp_hi = (cp_lo + cp_per).min(cp_units);
                let cp_slice = cp_per.div_ceil(rounds).next_multiple_of(8);
                let mut lo_r = bs;
                for j in 0..rounds {
                    let q = ((parity as u64 + j) & 1) as usize;
                    let lo_c = lo_r.min(be);
                    let hi_c = (lo_c + chunk).min(be);
                    let pp = (hi_c - lo_c).div_ceil(n as u64).next_multiple_of(8);
                    let part = |k: usize| {
                        let ps = (lo_c + k as u64 * pp).min(hi_c);
                        (ps, (ps + pp).min(hi_c))
                    };
                    for k in (0..n).filter(|&k| k != rank) {
                        let (ps, pe) = part(k);
                        let dst = stage(k) + (q * n + rank) * slot + boff;
                        let len = ((pe - ps) * 16) as usize;
                        a.check(inp + (ps * 16) as usize, len, false)?;
                        a.check(dst, len, true)?;
                        for i in ps * ub..pe * ub {
                            st_bits(d, dst, i - ps * ub, ld_bits(d, inp, i));
                        }
                    }
                    let lo = (cp_lo + j * cp_slice).min(cp_hi);
                    let hi = (lo + cp_slice).min(cp_hi);
                    let at = (lo * 16) as usize;
                    let len = ((hi - lo) * 16) as usize;
                    gather::copy(a, cp_src as usize + at, cp_dst as usize + at, len)?;
                    cx.barrier(a, b as usize, c.wrapping_add(1 + j as u32), Some(parity));
                    let (ps, pe) = part(rank);
                    // rank k's copy of my part: my input, or my slot k (indexed from ps)
                    let srcs: Vec<(usize, u64)> = (0..n)
                        .map(|k| {
                            if k == rank {
                                (inp, 0)
                            } else {
                                (stage(rank) + (q * n + k) * slot + boff, ps * ub)
                            }
                        })
                        .collect();
                    reduce_into(a, d, op, &srcs, &outs, ps * ub, pe * ub)?;
                    lo_r += chunk;
                }
                if last_block && rank == n - 1 {
                    reduce_into(a, d, op, &unbased(&ins), &outs, tail_start, count)?;
                }
                cx.barrier(a, b as usize, c.wrapping_add(rounds as u32 + 1), None);
                // c + 2M, M = ceil((R + 1) / 2) made odd: the header parity still flips
                final_ctr = c.wrapping_add(2 * (((rounds as u32 + 2) >> 1) | 1));
            }
            Kernel::P2pTwoShotCe => {
                // my part (rank-major) from my input and my landing slots, written there by
                // the peers' copy engines before their kernels started; tail as in the two-shot
                if !aligned {
                    return Err(KernelError::Failed(
                        "two-shot-ce with misaligned operands".into(),
                    ));
                }
                let slot = u64_at(pad + OFF_LAND_SLOT).load(Ordering::Relaxed) as usize;
                let land = u64_at(pad + OFF_LAND).load(Ordering::Relaxed) as usize;
                a.check(in_tab, 8 * n, false)?;
                a.check(out_tab, 8 * n, false)?;
                let tab = |t: usize, at: usize| u64_at(at + 8 * t).load(Ordering::Relaxed) as usize;
                let din = inp.wrapping_sub(tab(rank, in_tab));
                let dout = out.wrapping_sub(tab(rank, out_tab));
                let ins: Vec<usize> = (0..n).map(|t| tab(t, in_tab).wrapping_add(din)).collect();
                let outs: Vec<usize> = (0..n).map(|t| tab(t, out_tab).wrapping_add(dout)).collect();
                let p = crate::kernels::ce_part_units(units, n as u64);
                let ms = (rank as u64 * p).min(units);
                let me = (ms + p).min(units);
                let bper = (me - ms).div_ceil(g).next_multiple_of(8);
                let lo = (ms + b * bper).min(me);
                let hi = (lo + bper).min(me);
                cx.barrier(a, b as usize, c.wrapping_add(1), Some(parity));
                let srcs: Vec<(usize, u64)> = (0..n)
                    .map(|k| {
                        if k == rank {
                            (inp, 0)
                        } else {
                            (land + k * slot, ms * ub)
                        }
                    })
                    .collect();
                reduce_into(a, d, op, &srcs, &outs, lo * ub, hi * ub)?;
                if last_block && rank == n - 1 && count > tail_start {
                    reduce_into(a, d, op, &unbased(&ins), &outs, tail_start, count)?;
                }
                cx.barrier(a, b as usize, c.wrapping_add(2), None);
            }
            Kernel::P2pTwoShot => {
                a.check(in_tab, 8 * n, false)?;
                a.check(out_tab, 8 * n, false)?;
                let ins: Vec<usize> = (0..n)
                    .map(|t| u64_at(in_tab + 8 * t).load(Ordering::Relaxed) as usize)
                    .collect();
                let outs: Vec<usize> = (0..n)
                    .map(|t| u64_at(out_tab + 8 * t).load(Ordering::Relaxed) as usize)
                    .collect();
                let din = inp.wrapping_sub(ins[rank]);
                let dout = out.wrapping_sub(outs[rank]);
                let ins: Vec<usize> = ins.iter().map(|x| x.wrapping_add(din)).collect();
                let outs: Vec<usize> = outs.iter().map(|x| x.wrapping_add(dout)).collect();
                let pp = (be - bs).div_ceil(n as u64).next_multiple_of(8);
                let ps = (bs + rank as u64 * pp).min(be);
                let pe = (ps + pp).min(be);
                let mut ranges = vec![(ps * ub, pe * ub)];
                if last_block && rank == n - 1 {
                    ranges.push((tail_start, count));
                }
                cx.barrier(a, b as usize, c.wrapping_add(1), Some(parity));
                for &(lo, hi) in &ranges {
                    reduce_into(a, d, op, &unbased(&ins), &outs, lo, hi)?;
                }
                cx.barrier(a, b as usize, c.wrapping_add(2), None);
            }
        }
        set_counters(pad, b as usize, g as usize, final_ctr);
    }
    Ok(())
}

/// The PTX's poll of one low-latency (flag, word) cell at `at` of call counter `c`: until its
/// flag (high word) is `flag`'s, the error word is set, or the deadline passes (then
/// `ERR_TIMEOUT`); a disagreement — the cell carries this call's counter with another shape
/// ([`ll_disagrees`]), or, past [`LL_PEEK_NS`], a peer's block 0 waits at this call's first
/// barrier value in this rank's signal slots — sets `ERR_MISMATCH` in every rank's error word.
/// The cell as found.
fn ll_poll(cx: &Ctx, at: usize, flag: u64, c: u32, peer: Option<usize>) -> u64 {
    ll_poll_with(cx, at, flag, c, peer, true)
}

/// [`ll_poll`], looking for a peer in a barrier kernel only where `peek` (a poll whose legitimate
/// senders may have passed a barrier of this call, as the MoE bulk form's, does not).
fn ll_poll_with(
    cx: &Ctx,
    at: usize,
    flag: u64,
    c: u32,
    peer: Option<usize>,
    peek_barrier: bool,
) -> u64 {
    let cell = u64_at(at);
    let start = Instant::now();
    let peek = Duration::from_nanos(LL_PEEK_NS);
    loop {
        let v = cell.load(Ordering::Relaxed);
        if v >> 32 == flag >> 32 {
            return v;
        }
        if cx.err().load(Ordering::Relaxed) != 0 {
            cx.seen();
            return v;
        }
        let waited = start.elapsed();
        let in_barrier = || {
            (0..cx.n).any(|k| {
                u32_at(cx.pad + OFF_SIG + 4 * k).load(Ordering::Relaxed) == c.wrapping_add(1)
            })
        };
        if ll_disagrees((v >> 32) as u32, (flag >> 32) as u32)
            || (peek_barrier && waited >= peek && in_barrier())
        {
            ll_report(cx);
            return v;
        }
        if waited >= cx.timeout {
            cx.fail(ERR_TIMEOUT, peer);
            return v;
        }
        std::thread::yield_now();
    }
}

/// The PTX `ll_report`'s disagreement: `ERR_MISMATCH` into every rank's error word (where none
/// is set), and this rank's word into its mirror.
fn ll_report(cx: &Ctx) {
    for &p in &cx.pads {
        let _ = u32_at(p + OFF_ERR).compare_exchange(
            0,
            ERR_MISMATCH,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }
    cx.seen();
}

/// The low-latency one-shot (see the PTX): 8-byte (flag, word) stores into every rank's slot,
/// polling of the own slots until every word carries this call's flag. No barrier.
#[allow(clippy::too_many_arguments)]
fn run_ll(
    d: DType,
    op: Op,
    a: &LaunchArgs,
    cx: &Ctx,
    inp: usize,
    out: usize,
    count: u64,
    g: u64,
) -> Result<(), KernelError> {
    let (pad, rank, n) = (cx.pad, cx.rank, cx.n);
    let slot = u64_at(pad + OFF_LL_SLOT).load(Ordering::Relaxed) as usize;
    let stage = |t: usize| u64_at(pad + OFF_LL_STAGES + 8 * t).load(Ordering::Relaxed) as usize;
    // units of max(element, 4 bytes): one word of 4 / size elements, or two words of one
    // 8-byte element; the blocks split the units
    let es = d.size() as u64;
    let wpu = es.div_ceil(4);
    let units = count * es / (4 * wpu);
    let per = units.div_ceil(g);
    let epu = (4 / es).max(1) as usize;
    for b in 0..g {
        let c = u32_at(pad + OFF_CTR + 4 * b as usize).load(Ordering::Relaxed);
        let flag = (ll_flag(c, cx.sig) as u64) << 32;
        let parity = ((c >> 1) & 1) as usize;
        let (lo, hi) = ((b * per).min(units), ((b + 1) * per).min(units));
        let (lo, hi) = (lo * wpu, hi * wpu);
        if hi > lo {
            let len = ((hi - lo) * 8) as usize;
            a.check(inp + 4 * lo as usize, (hi - lo) as usize * 4, false)?;
            let push: Vec<usize> = (0..n)
                .map(|t| stage(t) + (parity * n + rank) * slot)
                .collect();
            for p in &push {
                a.check(p + 8 * lo as usize, len, true)?;
            }
            for w in lo..hi {
                // SAFETY: checked above; 4-byte aligned (the host checks the alignment).
                let x = unsafe { std::ptr::read_volatile((inp + 4 * w as usize) as *const u32) };
                for p in &push {
                    u64_at(p + 8 * w as usize).store(flag | x as u64, Ordering::Relaxed);
                }
            }
            a.jitter();
            let mine: Vec<usize> = (0..n)
                .map(|k| stage(rank) + (parity * n + k) * slot)
                .collect();
            for m in &mine {
                a.check(m + 8 * lo as usize, len, false)?;
            }
            a.check(out + 4 * lo as usize, (hi - lo) as usize * 4, true)?;
            for u in (lo..hi).step_by(wpu as usize) {
                let mut acc = [None; 4];
                for (k, m) in mine.iter().enumerate() {
                    let mut word = 0u64;
                    for h in 0..wpu {
                        let v = ll_poll(cx, m + 8 * (u + h) as usize, flag, c, Some(k));
                        word |= (v as u32 as u64) << (32 * h);
                    }
                    combine_word(d, op, &mut acc[..epu], word);
                }
                let word = finish_word(d, op, &acc[..epu], n);
                for h in 0..wpu {
                    // SAFETY: checked above.
                    unsafe {
                        std::ptr::write_volatile(
                            (out + 4 * (u + h) as usize) as *mut u32,
                            (word >> (32 * h)) as u32,
                        )
                    };
                }
            }
        }
        set_counters(pad, b as usize, g as usize, c.wrapping_add(2));
    }
    Ok(())
}
