//! Host-side equivalents of the MoE kernels (`kernels/p2p_moe.ptx`), step by step: the
//! dispatch's entry barrier, its pushes of every token once per destination rank (row, scales,
//! meta with the call's stamp), the ids validated (`ERR_BOUNDS`), the weights kept, the closing
//! barrier (per block); the group step's counts, offsets and map in (source rank, token, slot)
//! order, clipped to the plan's rows (`ERR_BOUNDS`); the gather into the expert-grouped layout;
//! the combine's pushes back into the token's rank's slot `[t][j]` between its two barriers;
//! the reduce step's weighted sum in top-k order in f32. Registered by [`super::install`].

use super::*;
use crate::kernels::moe::*;

/// Register the five entries.
pub(super) fn register() {
    register_kernel(DISPATCH_ENTRY, dispatch);
    register_kernel(GROUP_ENTRY, group);
    register_kernel(GATHER_ENTRY, gather_rows);
    register_kernel(COMBINE_ENTRY, combine);
    register_kernel(REDUCE_ENTRY, reduce);
}

/// The layout table at `at` (checked).
fn layout(a: &LaunchArgs, at: usize) -> Result<[u64; LAYOUT_WORDS], KernelError> {
    a.check(at, 8 * LAYOUT_WORDS, false)?;
    let mut l = [0u64; LAYOUT_WORDS];
    for (i, w) in l.iter_mut().enumerate() {
        *w = u64_at(at + 8 * i).load(Ordering::Relaxed);
    }
    Ok(l)
}

fn rd32(at: usize) -> u32 {
    // SAFETY: checked by the caller; volatile (other devices' threads write device memory).
    unsafe { std::ptr::read_volatile(at as *const u32) }
}

fn wr32(at: usize, v: u32) {
    // SAFETY: as `rd32`, checked writable.
    unsafe { std::ptr::write_volatile(at as *mut u32, v) }
}

/// The block-strided indices of block `b` of `g` below `hi`.
fn strided(b: u64, g: u64, hi: u64) -> impl Iterator<Item = u64> {
    (b..hi).step_by(g.max(1) as usize)
}

fn bounds(pad: usize) {
    let _ = u32_at(pad + OFF_BOUNDS).compare_exchange(
        0,
        ERR_BOUNDS,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
}

/// The team size in the pad at `pad` (checked).
fn team(a: &LaunchArgs, pad: usize) -> Result<usize, KernelError> {
    a.check(pad, PAD_BYTES, true)?;
    let n = u32_at(pad + OFF_NRANKS).load(Ordering::Relaxed) as usize;
    if n == 0 || n > MAX_RANKS {
        return Err(KernelError::Failed(format!("bad pad: {n} ranks")));
    }
    Ok(n)
}

fn grid(a: &LaunchArgs) -> Result<u64, KernelError> {
    let g = a.grid.0 as u64;
    if g == 0 || g as usize > MAX_BLOCKS {
        return Err(KernelError::Failed(format!("grid of {g} blocks")));
    }
    Ok(g)
}

fn dispatch(a: &LaunchArgs) -> Result<(), KernelError> {
    let pad = a.u64(0)? as usize;
    let l = layout(a, a.u64(1)? as usize)?;
    let (tokens, ids, wts, scales) = (
        a.u64(2)? as usize,
        a.u64(3)? as usize,
        a.u64(4)? as usize,
        a.u64(5)? as usize,
    );
    let t_n = a.u64(6)?;
    let cx = Ctx::from_pad(a, pad, 7, 8)?;
    let (rank, n) = (cx.rank, cx.n);
    let g = grid(a)?;
    let (tmax, k, e_all) = (l[L_TMAX], l[L_K] as usize, l[L_EXPERTS]);
    let (row, s_n, stride) = (l[L_ROW] as usize, l[L_SCALES] as usize, l[L_ROW_STRIDE]);
    let (place, wcopy, tab) = (l[L_PLACE] as usize, l[L_WCOPY] as usize, l[L_TAB] as usize);
    if t_n > tmax || k == 0 {
        return Err(KernelError::Failed(format!("{t_n} tokens, top-{k}")));
    }
    a.check(tab, 8 * n, false)?;
    a.check(place, 8 * e_all as usize, false)?;
    let peer = |j: usize| u64_at(tab + 8 * j).load(Ordering::Relaxed) as usize;
    for b in 0..g {
        let c = u32_at(pad + OFF_CTR + 4 * b as usize).load(Ordering::Relaxed);
        let stamp = c.wrapping_add(2);
        // every peer is done reading what this call overwrites (its previous MoE kernels)
        cx.barrier(a, b as usize, c.wrapping_add(1), Some((c >> 1) & 1));
        let mut bad = false;
        for t in strided(b, g, t_n) {
            let t = t as usize;
            a.check(ids + 4 * k * t, 4 * k, false)?;
            a.check(wts + 4 * k * t, 4 * k, false)?;
            a.check(wcopy + 4 * k * t, 4 * k, true)?;
            // per slot: its destination and local expert (none: -1)
            let mut dst = vec![u32::MAX; k];
            let mut loc = vec![u32::MAX; k];
            let mut mask = 0u32;
            for j in 0..k {
                let id = rd32(ids + 4 * (k * t + j)) as i32;
                wr32(wcopy + 4 * (k * t + j), rd32(wts + 4 * (k * t + j)));
                if id == -1 {
                    continue;
                }
                if id < 0 || id as u64 >= e_all {
                    bad = true;
                    continue;
                }
                dst[j] = rd32(place + 4 * id as usize);
                loc[j] = rd32(place + 4 * (e_all as usize + id as usize));
                mask |= 1 << dst[j];
            }
            for d in (0..n).filter(|d| mask >> d & 1 != 0) {
                let base = peer(d);
                let at = base + ((rank as u64 * tmax + t as u64) * stride) as usize;
                gather::copy(a, tokens + row * t, at, row)?;
                if s_n > 0 {
                    let so = round16(row as u64) as usize;
                    gather::copy(a, scales + 4 * s_n * t, at + so, 4 * s_n)?;
                }
                let meta = base
                    + (l[L_META_OFF] + (rank as u64 * tmax + t as u64) * 4 * (k as u64 + 1))
                        as usize;
                a.check(meta, 4 * (k + 1), true)?;
                wr32(meta, stamp);
                for j in 0..k {
                    let v = if dst[j] == d as u32 { loc[j] } else { u32::MAX };
                    wr32(meta + 4 * (1 + j), v);
                }
            }
        }
        if bad {
            bounds(pad);
        }
        cx.barrier(a, b as usize, stamp, None);
        set_counters(pad, b as usize, g as usize, c.wrapping_add(2));
    }
    Ok(())
}

/// Every (source, token, slot) entry of this rank's receive meta carrying `stamp`, in order:
/// `(entry, local expert)`.
fn entries(l: &[u64; LAYOUT_WORDS], n: usize, stamp: u32) -> Vec<(u32, u32)> {
    let (tmax, k) = (l[L_TMAX] as usize, l[L_K] as usize);
    let meta = (l[L_SYM] + l[L_META_OFF]) as usize;
    let mut v = Vec::new();
    for s in 0..n {
        for t in 0..tmax {
            let m = meta + 4 * (k + 1) * (s * tmax + t);
            if rd32(m) != stamp {
                continue;
            }
            for j in 0..k {
                let e = rd32(m + 4 * (1 + j));
                if e != u32::MAX {
                    v.push((((s * tmax + t) * k + j) as u32, e));
                }
            }
        }
    }
    v
}

fn group(a: &LaunchArgs) -> Result<(), KernelError> {
    let pad = a.u64(0)? as usize;
    let l = layout(a, a.u64(1)? as usize)?;
    let n = team(a, pad)?;
    let g = grid(a)?;
    let (tmax, k, local, rows) = (l[L_TMAX], l[L_K], l[L_LOCAL] as usize, l[L_ROWS]);
    let sym = l[L_SYM] as usize;
    a.check(
        sym + l[L_META_OFF] as usize,
        (n as u64 * tmax * 4 * (k + 1)) as usize,
        false,
    )?;
    let (counts, offsets, map) = (
        l[L_COUNTS] as usize,
        l[L_OFFSETS] as usize,
        l[L_MAP] as usize,
    );
    a.check(counts, 4 * local, true)?;
    a.check(offsets, 4 * (local + 1), true)?;
    a.check(map, 4 * rows as usize, true)?;
    for b in 0..g {
        let c = u32_at(pad + OFF_CTR + 4 * b as usize).load(Ordering::Relaxed);
        // the dispatch's stamp is the counter it left
        let stamp = c;
        let ent = entries(&l, n, stamp);
        let mut cnt = vec![0u64; local];
        for &(_, e) in &ent {
            if (e as usize) < local {
                cnt[e as usize] += 1;
            }
        }
        let mut start = vec![0u64; local + 1];
        for e in 0..local {
            start[e + 1] = start[e] + cnt[e];
        }
        if b == 0 {
            for e in 0..local {
                let (lo, hi) = (start[e].min(rows), start[e + 1].min(rows));
                wr32(offsets + 4 * e, lo as u32);
                wr32(counts + 4 * e, (hi - lo) as u32);
            }
            wr32(offsets + 4 * local, start[local].min(rows) as u32);
            if start[local] > rows || ent.iter().any(|&(_, e)| e as usize >= local) {
                bounds(pad);
            }
        }
        for e in strided(b, g, local as u64) {
            let mine = ent.iter().filter(|&&(_, f)| f as u64 == e);
            for (pos, &(x, _)) in (start[e as usize]..).zip(mine) {
                if pos < rows {
                    wr32(map + 4 * pos as usize, x);
                }
            }
        }
    }
    Ok(())
}

fn gather_rows(a: &LaunchArgs) -> Result<(), KernelError> {
    let pad = a.u64(0)? as usize;
    let l = layout(a, a.u64(1)? as usize)?;
    let g = grid(a)?;
    let (tmax, k, local) = (l[L_TMAX], l[L_K], l[L_LOCAL] as usize);
    let (row, s_n, stride) = (l[L_ROW] as usize, l[L_SCALES] as usize, l[L_ROW_STRIDE]);
    let (offsets, map, xout, sout) = (
        l[L_OFFSETS] as usize,
        l[L_MAP] as usize,
        l[L_XOUT] as usize,
        l[L_SOUT] as usize,
    );
    let n = team(a, pad)? as u64;
    a.check(offsets, 4 * (local + 1), false)?;
    let total = (rd32(offsets + 4 * local) as u64).min(l[L_ROWS]);
    a.check(map, 4 * total as usize, false)?;
    for b in 0..g {
        for i in strided(b, g, total) {
            let x = rd32(map + 4 * i as usize) as u64;
            let st = x / k; // s * tmax + t
            if st >= n * tmax {
                return Err(KernelError::Failed(format!("map entry {x}")));
            }
            let src = (l[L_SYM] + st * stride) as usize;
            gather::copy(a, src, xout + row * i as usize, row)?;
            if s_n > 0 {
                let so = round16(row as u64) as usize;
                gather::copy(a, src + so, sout + 4 * s_n * i as usize, 4 * s_n)?;
            }
        }
    }
    Ok(())
}

/// Element `h` of a row at `at` of code `code`, as f32.
fn load(code: u64, at: usize, h: usize) -> f32 {
    // SAFETY: checked by the caller.
    unsafe {
        match code {
            CODE_F32 => f32::from_bits(std::ptr::read_volatile((at + 4 * h) as *const u32)),
            CODE_BF16 => {
                half::bf16::from_bits(std::ptr::read_volatile((at + 2 * h) as *const u16)).to_f32()
            }
            _ => half::f16::from_bits(std::ptr::read_volatile((at + 2 * h) as *const u16)).to_f32(),
        }
    }
}

fn store(code: u64, at: usize, h: usize, v: f32) {
    // SAFETY: checked by the caller.
    unsafe {
        match code {
            CODE_F32 => std::ptr::write_volatile((at + 4 * h) as *mut u32, v.to_bits()),
            CODE_BF16 => std::ptr::write_volatile(
                (at + 2 * h) as *mut u16,
                half::bf16::from_f32(v).to_bits(),
            ),
            _ => {
                std::ptr::write_volatile((at + 2 * h) as *mut u16, half::f16::from_f32(v).to_bits())
            }
        }
    }
}

/// Bytes of an element of `code`.
fn size(code: u64) -> usize {
    if code == CODE_F32 {
        4
    } else {
        2
    }
}

fn combine(a: &LaunchArgs) -> Result<(), KernelError> {
    let pad = a.u64(0)? as usize;
    let l = layout(a, a.u64(1)? as usize)?;
    let y = a.u64(2)? as usize;
    let cx = Ctx::from_pad(a, pad, 3, 4)?;
    let n = cx.n;
    let g = grid(a)?;
    let (tmax, k, local) = (l[L_TMAX], l[L_K], l[L_LOCAL] as usize);
    let (yrow, ystride) = (l[L_YROW] as usize, l[L_YSTRIDE]);
    let (offsets, map, tab) = (l[L_OFFSETS] as usize, l[L_MAP] as usize, l[L_TAB] as usize);
    a.check(offsets, 4 * (local + 1), false)?;
    a.check(tab, 8 * n, false)?;
    let total = (rd32(offsets + 4 * local) as u64).min(l[L_ROWS]);
    a.check(map, 4 * total as usize, false)?;
    let peer = |j: usize| u64_at(tab + 8 * j).load(Ordering::Relaxed) as usize;
    for b in 0..g {
        let c = u32_at(pad + OFF_CTR + 4 * b as usize).load(Ordering::Relaxed);
        let stamp = c.wrapping_add(2);
        cx.barrier(a, b as usize, c.wrapping_add(1), Some((c >> 1) & 1));
        // every expert output row back to its token's rank, slot [t][j]
        for i in strided(b, g, total) {
            let x = rd32(map + 4 * i as usize) as u64;
            let (s, tj) = (x / (tmax * k), x % (tmax * k));
            if s >= n as u64 {
                return Err(KernelError::Failed(format!("map entry {x}")));
            }
            let base = peer(s as usize);
            let dst = base + (l[L_COMB_OFF] + tj * ystride) as usize;
            gather::copy(a, y + yrow * i as usize, dst, yrow)?;
            let st = base + (l[L_STAMP_OFF] + 4 * tj) as usize;
            a.check(st, 4, true)?;
            wr32(st, stamp);
        }
        cx.barrier(a, b as usize, stamp, None);
        set_counters(pad, b as usize, g as usize, c.wrapping_add(2));
    }
    Ok(())
}

fn reduce(a: &LaunchArgs) -> Result<(), KernelError> {
    let pad = a.u64(0)? as usize;
    let l = layout(a, a.u64(1)? as usize)?;
    let (out, t_n, mode) = (a.u64(2)? as usize, a.u64(3)?, a.u64(4)?);
    team(a, pad)?;
    let g = grid(a)?;
    let (yc, oc) = (mode & 255, (mode >> 8) & 255);
    let (tmax, k, hidden) = (l[L_TMAX], l[L_K], l[L_HIDDEN] as usize);
    let (yrow, ystride, wcopy) = (l[L_YROW] as usize, l[L_YSTRIDE], l[L_WCOPY] as usize);
    if t_n > tmax || yc > CODE_F16 || oc > CODE_F16 || yrow != hidden * size(yc) {
        return Err(KernelError::Failed(format!(
            "{t_n} tokens, codes {yc} {oc}, rows of {yrow} bytes"
        )));
    }
    let sym = l[L_SYM] as usize;
    for b in 0..g {
        // the combine's stamp is the counter it left
        let stamp = u32_at(pad + OFF_CTR + 4 * b as usize).load(Ordering::Relaxed);
        // every token of this block: the weighted sum in top-k order, f32
        for t in strided(b, g, t_n) {
            let o = out + size(oc) * hidden * t as usize;
            a.check(o, size(oc) * hidden, true)?;
            let stamps = sym + (l[L_STAMP_OFF] + 4 * k * t) as usize;
            a.check(stamps, 4 * k as usize, false)?;
            a.check(wcopy + (4 * k * t) as usize, 4 * k as usize, false)?;
            let rows = sym + (l[L_COMB_OFF] + k * t * ystride) as usize;
            a.check(rows, (k * ystride) as usize, false)?;
            for h in 0..hidden {
                let mut acc = 0f32;
                for j in 0..k as usize {
                    if rd32(stamps + 4 * j) != stamp {
                        continue;
                    }
                    let w = f32::from_bits(rd32(wcopy + 4 * (k as usize * t as usize + j)));
                    acc += w * load(yc, rows + j * ystride as usize, h);
                }
                store(oc, o, h, acc);
            }
        }
    }
    Ok(())
}
