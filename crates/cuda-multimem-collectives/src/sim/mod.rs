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
use crate::types::{DType, ReduceOp as Op};

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
            for d in DType::ALL {
                for o in Op::ALL.into_iter().filter(|&o| k.has(o)) {
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

/// Read element `i` at `base`.
fn ld(d: DType, base: usize, i: u64) -> f32 {
    let a = base + i as usize * d.size();
    // SAFETY: the range was checked with `LaunchArgs::check`; volatile, because other devices'
    // threads write device memory concurrently (ordered by the protocol's acquire/release).
    let bits = unsafe {
        match d.size() {
            4 => std::ptr::read_volatile(a as *const u32),
            _ => std::ptr::read_volatile(a as *const u16) as u32,
        }
    };
    decode(d, bits)
}

fn st(d: DType, base: usize, i: u64, v: f32) {
    let a = base + i as usize * d.size();
    let bits = encode(d, v);
    // SAFETY: as `ld`, checked writable.
    unsafe {
        match d.size() {
            4 => std::ptr::write_volatile(a as *mut u32, bits),
            _ => std::ptr::write_volatile(a as *mut u16, bits as u16),
        }
    }
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
        let mut acc = ld(d, srcs[0].0, i - srcs[0].1);
        for &(x, base) in &srcs[1..] {
            acc = op.apply(acc, ld(d, x, i - base));
        }
        let acc = op.finish(acc, srcs.len());
        for o in outs {
            st(d, *o, i, acc);
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
        })
    }

    fn err(&self) -> &AtomicU32 {
        u32_at(self.pad + OFF_ERR)
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
                let slot = (p as usize * MAX_BLOCKS + b) * 8 + self.rank;
                u64_at(self.pads[t] + OFF_HDR + 8 * slot).store(self.sig, Ordering::Relaxed);
            }
            u32_at(self.pads[t] + OFF_SIG + 4 * (b * 8 + self.rank)).store(val, Ordering::Release);
        }
    }

    /// The wait half of [`Ctx::barrier`]: until every peer's block `b` arrived at `val`
    /// (acquire), bounded by the timeout (then `ERR_TIMEOUT`) or until the error word is set;
    /// the headers checked when `parity` is given.
    fn wait(&self, b: usize, val: u32, parity: Option<u32>) {
        for t in (0..self.n).filter(|&t| t != self.rank) {
            let slot = u32_at(self.pad + OFF_SIG + 4 * (b * 8 + t));
            let start = Instant::now();
            let mut spins = 0u32;
            let arrived = loop {
                if slot.load(Ordering::Acquire).wrapping_sub(val) as i32 >= 0 {
                    break true;
                }
                if self.err().load(Ordering::Relaxed) != 0 {
                    break false;
                }
                if start.elapsed() >= self.timeout {
                    let _ = self.err().compare_exchange(
                        0,
                        ERR_TIMEOUT,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    );
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
                    let slot = (p as usize * MAX_BLOCKS + b) * 8 + t;
                    let h = u64_at(self.pad + OFF_HDR + 8 * slot).load(Ordering::Relaxed);
                    if h != self.sig {
                        let _ = self.err().compare_exchange(
                            0,
                            ERR_MISMATCH,
                            Ordering::Relaxed,
                            Ordering::Relaxed,
                        );
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
                        let x = ld(d, inp, i);
                        for p in &push {
                            st(d, *p, i, x);
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
                            st(d, dst, i - ps * ub, ld(d, inp, i));
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
fn ll_poll(cx: &Ctx, at: usize, flag: u64, c: u32) -> u64 {
    let cell = u64_at(at);
    let start = Instant::now();
    let peek = Duration::from_nanos(LL_PEEK_NS);
    loop {
        let v = cell.load(Ordering::Relaxed);
        if v >> 32 == flag >> 32 || cx.err().load(Ordering::Relaxed) != 0 {
            return v;
        }
        let waited = start.elapsed();
        let in_barrier = || {
            (0..cx.n).any(|k| {
                u32_at(cx.pad + OFF_SIG + 4 * k).load(Ordering::Relaxed) == c.wrapping_add(1)
            })
        };
        if ll_disagrees((v >> 32) as u32, (flag >> 32) as u32) || (waited >= peek && in_barrier()) {
            for &p in &cx.pads {
                let _ = u32_at(p + OFF_ERR).compare_exchange(
                    0,
                    ERR_MISMATCH,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
            return v;
        }
        if waited >= cx.timeout {
            let _ = cx
                .err()
                .compare_exchange(0, ERR_TIMEOUT, Ordering::Relaxed, Ordering::Relaxed);
            return v;
        }
        std::thread::yield_now();
    }
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
    let words = count * d.size() as u64 / 4;
    let per = words.div_ceil(g);
    let per_word = if d.size() == 4 { 1 } else { 2 };
    for b in 0..g {
        let c = u32_at(pad + OFF_CTR + 4 * b as usize).load(Ordering::Relaxed);
        let flag = (ll_flag(c, cx.sig) as u64) << 32;
        let parity = ((c >> 1) & 1) as usize;
        let (lo, hi) = ((b * per).min(words), ((b + 1) * per).min(words));
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
            for w in lo..hi {
                let mut acc = [0f32; 2];
                for (k, m) in mine.iter().enumerate() {
                    let v = ll_poll(cx, m + 8 * w as usize, flag, c);
                    let word = v as u32;
                    for (h, acc) in acc.iter_mut().enumerate().take(per_word) {
                        let bits = if per_word == 1 {
                            word
                        } else {
                            (word >> (16 * h)) & 0xffff
                        };
                        let x = decode(d, bits);
                        *acc = if k == 0 { x } else { op.apply(*acc, x) };
                    }
                }
                let acc = acc.map(|x| op.finish(x, n));
                let word = if per_word == 1 {
                    encode(d, acc[0])
                } else {
                    encode(d, acc[0]) | (encode(d, acc[1]) << 16)
                };
                // SAFETY: checked above.
                unsafe { std::ptr::write_volatile((out + 4 * w as usize) as *mut u32, word) };
            }
        }
        set_counters(pad, b as usize, g as usize, c.wrapping_add(2));
    }
    Ok(())
}
