//! Host-side equivalents of the reduce-scatter, all-gather and broadcast kernels
//! (`kernels/p2p_{reduce_scatter,all_gather,broadcast}.ptx`), step by step: the same byte split
//! per block, the same rounds through the same staging slots, the same barrier (the parent
//! module's), header check at the first barrier only, the same final counters. Registered by
//! [`super::install`].

use super::*;
use crate::kernels::gather::Collective;

/// Register every entry of the three collectives.
pub(super) fn register() {
    for c in Collective::ALL {
        for d in DType::ALL {
            for &o in c.ops() {
                register_kernel(&c.entry(d, o), move |a| run(c, d, o, a));
            }
        }
    }
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
    a.check(pad, PAD_BYTES, true)?;
    let rank = u32_at(pad + OFF_RANK).load(Ordering::Relaxed) as usize;
    let n = u32_at(pad + OFF_NRANKS).load(Ordering::Relaxed) as usize;
    if n == 0 || n > MAX_RANKS || rank >= n || root >= n {
        return Err(KernelError::Failed(format!(
            "bad pad or root: rank {rank} of {n}, root {root}"
        )));
    }
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
    };
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
            let share = (slot as u64 / g) & !127;
            let cap = share / 16;
            if cap == 0 {
                return Err(KernelError::Failed(format!(
                    "a {slot}-byte staging slot cannot be shared by {g} blocks"
                )));
            }
            let boff = (b * share) as usize;
            let rounds = per.div_ceil(cap).max(1);
            let mut lo_r = bs;
            for j in 0..rounds {
                let q = ((parity as u64 + j) & 1) as usize;
                let lo = lo_r.min(be);
                let hi = (lo + cap).min(be);
                let (x0, x1) = bytes(lo, hi);
                let len = x1 - x0;
                // phase A: my data for every other rank k into k's slot [q][rank]
                if sends {
                    for k in (0..n).filter(|&k| k != rank) {
                        let src = match c {
                            Collective::ReduceScatter => inp + k * b_ + x0,
                            _ => inp + x0,
                        };
                        copy(a, src, stage(k) + (q * n + rank) * slot + boff, len)?;
                    }
                }
                let hdr = (j == 0).then_some(parity);
                cx.barrier(a, b as usize, cnt.wrapping_add(1 + j as u32), hdr);
                // phase B: from my own memory into my output
                let mine = |k: usize| stage(rank) + (q * n + k) * slot + boff;
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
                lo_r = lo + cap;
            }
            // c + 2R: the next call's staging parity differs from my last round's
            final_ctr = cnt.wrapping_add(2 * rounds as u32);
        }
        let mut j = b as usize;
        while j < MAX_BLOCKS {
            u32_at(pad + OFF_CTR + 4 * j).store(final_ctr, Ordering::Relaxed);
            j += g as usize;
        }
    }
    Ok(())
}
