//! Host-side equivalents of the reduce-scatter, all-gather and broadcast kernels
//! (`kernels/p2p_{reduce_scatter,all_gather,broadcast}.ptx`), step by step: the same byte split
//! per block, the same rounds through the same staging slots, the same barrier (the parent
//! module's), header check at the first barrier only, the same final counters; and their
//! low-latency forms ([`run_ll`]): the same word split, flags, slots, presence words and
//! polls. Registered by [`super::install`].

use super::*;
use crate::kernels::gather::{
    ll_words, round_share, staged_rounds, sub_slot_bytes, Collective, COPY_ENTRY, MEET_ENTRY, RING,
};

/// Register every entry of the three collectives.
pub(super) fn register() {
    for c in Collective::ALL {
        for &d in c.dtypes() {
            for &o in c.ops() {
                register_kernel(&c.entry(d, o), move |a| run(c, d, o, a));
                if c.has_ll(d) {
                    register_kernel(&c.ll_entry(d, o), move |a| run_ll(c, d, o, a));
                }
            }
        }
    }
    register_kernel(MEET_ENTRY, run_meet);
    register_kernel(COPY_ENTRY, |a| {
        a.jitter();
        copy(
            a,
            a.u64(0)? as usize,
            a.u64(1)? as usize,
            a.u64(2)? as usize,
        )
    });
}

/// The copy-engine forms' barrier launch: block 0's barrier(c + 1) with the call header, then
/// every counter c + 2 (one block: its replicas are every slot).
fn run_meet(a: &LaunchArgs) -> Result<(), KernelError> {
    let pad = a.u64(0)? as usize;
    if a.grid.0 != 1 {
        return Err(KernelError::Failed(format!(
            "a grid of {} blocks",
            a.grid.0
        )));
    }
    let cx = Ctx::from_pad(a, pad, 1, 2)?;
    let cnt = u32_at(pad + OFF_CTR).load(Ordering::Relaxed);
    cx.barrier(a, 0, cnt.wrapping_add(1), Some((cnt >> 1) & 1));
    set_counters(pad, 0, 1, cnt.wrapping_add(2));
    Ok(())
}

/// Copy `len` bytes from `src` to `dst` (ranges checked first).
pub(super) fn copy(a: &LaunchArgs, src: usize, dst: usize, len: usize) -> Result<(), KernelError> {
    if len == 0 {
        return Ok(());
    }
    a.check(src, len, false)?;
    a.check(dst, len, true)?;
    for i in 0..len {
        // SAFETY: both ranges checked above; volatile, as `ld`/`st` (other devices' threads
        // write device memory concurrently, ordered by the barrier's acquire/release).
        unsafe {
            std::ptr::write_volatile(
                (dst + i) as *mut u8,
                std::ptr::read_volatile((src + i) as *const u8),
            )
        };
    }
    Ok(())
}

fn run(c: Collective, d: DType, op: Op, a: &LaunchArgs) -> Result<(), KernelError> {
    let pad = a.u64(0)? as usize;
    let (inp, out, count) = (a.u64(1)? as usize, a.u64(2)? as usize, a.u64(3)?);
    let (out_tab, root) = (a.u64(4)? as usize, a.u64(5)? as usize);
    let cx = Ctx::from_pad(a, pad, 6, 7)?;
    let (rank, n) = (cx.rank, cx.n);
    if root >= n {
        return Err(KernelError::Failed(format!("root {root} of {n}")));
    }
    let g = a.grid.0 as u64;
    if g as usize > MAX_BLOCKS {
        return Err(KernelError::Failed(format!("grid of {g} blocks")));
    }
    let es = d.size() as u64;
    let chunk = count * es;
    let units = chunk.div_ceil(16);
    let per = units.div_ceil(g).next_multiple_of(8);
    let b_ = chunk as usize;
    let own = match c {
        Collective::ReduceScatter => inp + rank * b_,
        _ => out + rank * b_,
    };
    let in_place = match c {
        Collective::ReduceScatter => false,
        Collective::AllGather => inp == own,
        Collective::Broadcast => inp == out,
    };
    let sends = c != Collective::Broadcast || rank == root;
    let direct = c != Collective::ReduceScatter && out_tab != 0;
    // the byte range of units [lo, hi) of a chunk
    let bytes = |lo: u64, hi: u64| -> (usize, usize) {
        let x0 = (lo * 16).min(chunk) as usize;
        (x0, ((hi * 16).min(chunk) as usize).max(x0))
    };
    for b in 0..g {
        let cnt = u32_at(pad + OFF_CTR + 4 * b as usize).load(Ordering::Relaxed);
        let parity = (cnt >> 1) & 1;
        let bs = (b * per).min(units);
        let be = (bs + per).min(units);
        let final_ctr;
        if direct {
            a.check(out_tab, 8 * n, false)?;
            let tab = |t: usize| u64_at(out_tab + 8 * t).load(Ordering::Relaxed) as usize;
            let mut delta = out.wrapping_sub(tab(rank));
            if c == Collective::AllGather {
                delta = delta.wrapping_add(rank * b_);
            }
            cx.barrier(a, b as usize, cnt.wrapping_add(1), Some(parity));
            let (x0, x1) = bytes(bs, be);
            if sends {
                for k in (0..n).filter(|&k| k != rank || !in_place) {
                    copy(a, inp + x0, tab(k).wrapping_add(delta) + x0, x1 - x0)?;
                }
            }
            cx.barrier(a, b as usize, cnt.wrapping_add(2), None);
            final_ctr = cnt.wrapping_add(2);
        } else {
            let slot = u64_at(pad + OFF_STAGE_HALF).load(Ordering::Relaxed) as usize;
            let stage =
                |t: usize| u64_at(pad + OFF_STAGES + 8 * t).load(Ordering::Relaxed) as usize;
            let share = round_share(slot as u64, g);
            let cap = share / 16;
            if cap == 0 {
                return Err(KernelError::Failed(format!(
                    "a {slot}-byte staging slot cannot be shared by {g} blocks"
                )));
            }
            let sub = sub_slot_bytes(slot as u64) as usize;
            let boff = (b * share) as usize;
            let rounds = staged_rounds(chunk, g, slot as u64);
            // round j: its sub-slot's offset in a staging area, less the sender's slot (q & 1
            // is the parity, q >> 1 the half; q = ((c >> 1) + j) & 3), and its byte range
            let round = |j: u64| {
                let q = (((cnt >> 1) as u64 + j) % RING) as usize;
                let lo = (bs + j * cap).min(be);
                let (x0, x1) = bytes(lo, (lo + cap).min(be));
                ((q & 1) * n * slot + (q >> 1) * sub + boff, x0, x1)
            };
            // software-pipelined as the kernel: step i runs phase A of round i (i < R), phase
            // B of round i - 1 (i > 0; from i = 2 after waiting for the peers' arrival at
            // round i - 1), then arrives at round i (i < R; at i = 0 the whole barrier)
            for i in 0..=rounds {
                if i < rounds && sends {
                    // phase A: my data for every other rank k into k's sub-slot [q][rank]
                    let (at, x0, x1) = round(i);
                    for k in (0..n).filter(|&k| k != rank) {
                        let src = match c {
                            Collective::ReduceScatter => inp + k * b_ + x0,
                            _ => inp + x0,
                        };
                        copy(a, src, stage(k) + at + rank * slot, x1 - x0)?;
                    }
                }
                if i > 0 {
                    if i >= 2 {
                        cx.wait(b as usize, cnt.wrapping_add(i as u32), None);
                    }
                    // phase B of round i - 1: from my own memory into my output (after a
                    // random delay where the tests ask for one: a peer may run ahead meanwhile,
                    // into its next round or its next call)
                    a.jitter();
                    let (at, x0, x1) = round(i - 1);
                    let len = x1 - x0;
                    let mine = |k: usize| stage(rank) + at + k * slot;
                    match c {
                        Collective::ReduceScatter => {
                            let (e0, e1) = ((x0 as u64) / es, (x1 as u64) / es);
                            let srcs: Vec<(usize, u64)> = (0..n)
                                .map(|k| if k == rank { (own, 0) } else { (mine(k), e0) })
                                .collect();
                            reduce_into(a, d, op, &srcs, &[out], e0, e1)?;
                        }
                        Collective::AllGather => {
                            for k in (0..n).filter(|&k| k != rank || !in_place) {
                                let src = if k == rank { inp + x0 } else { mine(k) };
                                copy(a, src, out + k * b_ + x0, len)?;
                            }
                        }
                        Collective::Broadcast => {
                            if !(rank == root && in_place) {
                                let src = if rank == root { inp + x0 } else { mine(root) };
                                copy(a, src, out + x0, len)?;
                            }
                        }
                    }
                }
                if i == 0 {
                    cx.barrier(a, b as usize, cnt.wrapping_add(1), Some(parity));
                } else if i < rounds {
                    cx.arrive(a, b as usize, cnt.wrapping_add(1 + i as u32), None);
                }
            }
            // c + 2R: the next call's first sub-slot has the other parity than my last round's
            final_ctr = cnt.wrapping_add(2 * rounds as u32);
        }
        set_counters(pad, b as usize, g as usize, final_ctr);
    }
    Ok(())
}

/// Words [lo, hi) of a chunk of `chunk` bytes at `base`, as the low-latency kernels address
/// them (4 bytes per word, the last one possibly half an element pair), checked.
fn check_words(
    a: &LaunchArgs,
    base: usize,
    (lo, hi): (u64, u64),
    chunk: u64,
    write: bool,
) -> Result<(), KernelError> {
    let x0 = (4 * lo).min(chunk);
    let x1 = (4 * hi).min(chunk).max(x0);
    if x1 > x0 {
        a.check(base + x0 as usize, (x1 - x0) as usize, write)?;
    }
    Ok(())
}

/// Word `w` of the chunk of `chunk` bytes at `base` (see the PTX `ll_load`): one 4-byte load
/// when the address is 4-byte aligned and the word whole (`w < whole`), else its 16-bit
/// elements, a missing second one read as 0 (1-byte types: its bytes in the chunk, the
/// missing ones 0).
fn load_word(d: DType, base: usize, w: u64, whole: u64, chunk: u64) -> u32 {
    let at = base + 4 * w as usize;
    // SAFETY: inside a range checked with `check_words`; volatile, as `ld` (other devices
    // write device memory concurrently).
    unsafe {
        if d.size() >= 4 || (at % 4 == 0 && w < whole) {
            std::ptr::read_volatile(at as *const u32)
        } else if d.size() == 1 {
            let left = (chunk - 4 * w).min(4) as usize;
            (0..left).fold(0u32, |x, i| {
                x | (std::ptr::read_volatile((at + i) as *const u8) as u32) << (8 * i)
            })
        } else {
            let lo = std::ptr::read_volatile(at as *const u16) as u32;
            let hi = if w < whole {
                std::ptr::read_volatile((at + 2) as *const u16) as u32
            } else {
                0
            };
            lo | hi << 16
        }
    }
}

/// Store `x` as word `w` of the chunk of `chunk` bytes at `base` (as [`load_word`]: the
/// second element of a word that is not whole is not stored, nor the bytes past the chunk).
fn store_word(d: DType, base: usize, w: u64, whole: u64, chunk: u64, x: u32) {
    let at = base + 4 * w as usize;
    // SAFETY: inside a range checked writable with `check_words`.
    unsafe {
        if d.size() >= 4 || (at % 4 == 0 && w < whole) {
            std::ptr::write_volatile(at as *mut u32, x);
        } else if d.size() == 1 {
            let left = (chunk - 4 * w).min(4) as usize;
            for i in 0..left {
                std::ptr::write_volatile((at + i) as *mut u8, (x >> (8 * i)) as u8);
            }
        } else {
            std::ptr::write_volatile(at as *mut u16, x as u16);
            if w < whole {
                std::ptr::write_volatile((at + 2) as *mut u16, (x >> 16) as u16);
            }
        }
    }
}

/// [`super::ll_poll`]: the word of the cell at `at` once its flag is `flag`'s (or the wait
/// ended).
fn poll(cx: &Ctx, at: usize, flag: u64, c: u32) -> u32 {
    super::ll_poll(cx, at, flag, c, None) as u32
}

/// The low-latency forms (see the PTX `ll_kernel`): per block, its words of the chunk; the
/// sends (8-byte (flag, word) stores into the receivers' slots `[parity][rank]`; broadcast's
/// non-roots a presence word), then the polls of the own slots, the reduction in rank order or
/// the copy into the output, the broadcast's presence polls; counters c + 2. No barrier.
fn run_ll(c: Collective, d: DType, op: Op, a: &LaunchArgs) -> Result<(), KernelError> {
    let pad = a.u64(0)? as usize;
    let (inp, out, count) = (a.u64(1)? as usize, a.u64(2)? as usize, a.u64(3)?);
    let root = a.u64(5)? as usize;
    a.check(pad, PAD_BYTES, true)?;
    let rank = u32_at(pad + OFF_RANK).load(Ordering::Relaxed) as usize;
    let n = u32_at(pad + OFF_NRANKS).load(Ordering::Relaxed) as usize;
    if n == 0 || n > MAX_RANKS || rank >= n || root >= n {
        return Err(KernelError::Failed(format!(
            "bad pad or root: rank {rank} of {n}, root {root}"
        )));
    }
    // every rank's pad, whose error word a disagreement sets (see `ll_poll`)
    let pads: Vec<usize> = (0..n)
        .map(|t| u64_at(pad + OFF_PADS + 8 * t).load(Ordering::Relaxed) as usize)
        .collect();
    for &p in &pads {
        a.check(p, PAD_BYTES, true)?;
    }
    let cx = Ctx {
        pad,
        rank,
        n,
        pads,
        timeout: Duration::from_nanos(a.u64(7)?),
        sig: a.u64(6)?,
        mirror: super::mirror_at(a, pad, OFF_MIRROR)?,
    };
    let g = a.grid.0 as u64;
    if g as usize > MAX_BLOCKS {
        return Err(KernelError::Failed(format!("grid of {g} blocks")));
    }
    let slot = u64_at(pad + OFF_LL_SLOT).load(Ordering::Relaxed) as usize;
    let stage = |t: usize| u64_at(pad + OFF_LL_STAGES + 8 * t).load(Ordering::Relaxed) as usize;
    let chunk = count * d.size() as u64;
    let b_ = chunk as usize;
    let (words, whole) = (ll_words(chunk), chunk / 4);
    if 8 * words > slot as u64 {
        return Err(KernelError::Failed(format!(
            "{words} words do not fit a {slot}-byte low-latency slot"
        )));
    }
    // 8-byte elements: whole pairs of words per block (a reduction needs both halves)
    let wpu = d.size().div_ceil(4) as u64;
    let per = words.div_ceil(g).next_multiple_of(wpu);
    // my own chunk: reduce-scatter's input chunk r, all-gather's output chunk r, broadcast's
    // output
    let own = match c {
        Collective::ReduceScatter => inp + rank * b_,
        Collective::AllGather => out + rank * b_,
        Collective::Broadcast => out,
    };
    let in_place = match c {
        Collective::ReduceScatter => false,
        Collective::AllGather => inp == own,
        Collective::Broadcast => inp == out,
    };
    let is_root = rank == root;
    let epu = (4 / d.size()).max(1);
    for b in 0..g {
        let cnt = u32_at(pad + OFF_CTR + 4 * b as usize).load(Ordering::Relaxed);
        let flag = (ll_flag(cnt, cx.sig) as u64) << 32;
        let parity = ((cnt >> 1) & 1) as usize;
        let push = |t: usize| stage(t) + (parity * n + rank) * slot;
        let mine = |k: usize| stage(rank) + (parity * n + k) * slot;
        let r = ((b * per).min(words), ((b + 1) * per).min(words));
        let (lo, hi) = r;
        let cells = |base: usize| -> Result<(), KernelError> {
            if hi > lo {
                a.check(base + 8 * lo as usize, 8 * (hi - lo) as usize, true)?;
            }
            Ok(())
        };
        // send: posted 8-byte stores only
        match c {
            Collective::ReduceScatter => {
                for k in (0..n).filter(|&k| k != rank) {
                    check_words(a, inp + k * b_, r, chunk, false)?;
                    cells(push(k))?;
                }
                for w in lo..hi {
                    for k in (0..n).filter(|&k| k != rank) {
                        let x = load_word(d, inp + k * b_, w, whole, chunk);
                        u64_at(push(k) + 8 * w as usize).store(flag | x as u64, Ordering::Relaxed);
                    }
                }
            }
            Collective::AllGather | Collective::Broadcast => {
                if c == Collective::AllGather || is_root {
                    check_words(a, inp, r, chunk, false)?;
                    check_words(a, own, r, chunk, true)?;
                    for k in (0..n).filter(|&k| k != rank) {
                        cells(push(k))?;
                    }
                    for w in lo..hi {
                        let x = load_word(d, inp, w, whole, chunk);
                        for k in (0..n).filter(|&k| k != rank) {
                            u64_at(push(k) + 8 * w as usize)
                                .store(flag | x as u64, Ordering::Relaxed);
                        }
                        if !in_place {
                            store_word(d, own, w, whole, chunk, x);
                        }
                    }
                }
                if c == Collective::Broadcast && !is_root && b == 0 {
                    // presence: the flag as word 0 of my slot on every peer
                    for t in (0..n).filter(|&t| t != rank) {
                        a.check(push(t), 8, true)?;
                        u64_at(push(t)).store(flag, Ordering::Relaxed);
                    }
                }
            }
        }
        a.jitter();
        // receive: local polls and stores only
        match c {
            Collective::ReduceScatter => {
                check_words(a, own, r, chunk, false)?;
                check_words(a, out, r, chunk, true)?;
                for k in (0..n).filter(|&k| k != rank) {
                    cells(mine(k))?;
                }
                for u in (lo..hi).step_by(wpu as usize) {
                    let mut acc = [None; 4];
                    for k in 0..n {
                        let mut word = 0u64;
                        for h in 0..wpu {
                            let x = if k == rank {
                                load_word(d, own, u + h, whole, chunk)
                            } else {
                                poll(&cx, mine(k) + 8 * (u + h) as usize, flag, cnt)
                            };
                            word |= (x as u64) << (32 * h);
                        }
                        super::combine_word(d, op, &mut acc[..epu], word);
                    }
                    let word = super::finish_word(d, op, &acc[..epu], n);
                    for h in 0..wpu {
                        store_word(d, out, u + h, whole, chunk, (word >> (32 * h)) as u32);
                    }
                }
            }
            Collective::AllGather => {
                for k in (0..n).filter(|&k| k != rank) {
                    cells(mine(k))?;
                    check_words(a, out + k * b_, r, chunk, true)?;
                }
                for w in lo..hi {
                    for k in (0..n).filter(|&k| k != rank) {
                        let x = poll(&cx, mine(k) + 8 * w as usize, flag, cnt);
                        store_word(d, out + k * b_, w, whole, chunk, x);
                    }
                }
            }
            Collective::Broadcast => {
                if !is_root {
                    cells(mine(root))?;
                    check_words(a, out, r, chunk, true)?;
                    for w in lo..hi {
                        let x = poll(&cx, mine(root) + 8 * w as usize, flag, cnt);
                        store_word(d, out, w, whole, chunk, x);
                    }
                }
                if b == 0 {
                    // presence of every non-root other than me: every rank hears from every
                    // peer in every call, as in the other two (the slot-reuse argument)
                    for t in (0..n).filter(|&t| t != rank && t != root) {
                        a.check(mine(t), 8, false)?;
                        poll(&cx, mine(t), flag, cnt);
                    }
                }
            }
        }
        set_counters(pad, b as usize, g as usize, cnt.wrapping_add(2));
    }
    Ok(())
}
