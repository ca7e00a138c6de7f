//! Host-side equivalents of the MoE kernels (`kernels/p2p_moe.ptx`), step by step: the form
//! (the low-latency form's region of the call sequence, or the bulk form's entry barrier), the
//! dispatch's routing (per expert its entries, per entry its position), its pushes of every
//! token once per destination rank (row, scales, meta with the call's stamp and the slots'
//! experts and positions), the ids validated (`ERR_BOUNDS`), the weights kept, the count cells
//! to every rank, then every sender's cells polled (bounded), their prefix sums, the counts and
//! offsets clipped to the plan's rows (`ERR_BOUNDS`) and every received row placed; the
//! combine's pushes back into the token's rank's slot `[t][j]`, its cells, and the weighted sum
//! in top-k order in f32. Registered by [`super::install`].

use super::*;
use crate::kernels::moe::*;

/// Register the two entries.
pub(super) fn register() {
    register_kernel(DISPATCH_ENTRY, dispatch);
    register_kernel(COMBINE_ENTRY, combine);
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

fn bounds(pad: usize) {
    let _ = u32_at(pad + OFF_BOUNDS).compare_exchange(
        0,
        ERR_BOUNDS,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
}

fn grid(a: &LaunchArgs) -> Result<u64, KernelError> {
    let g = a.grid.0 as u64;
    if g == 0 || g as usize > MAX_BLOCKS {
        return Err(KernelError::Failed(format!("grid of {g} blocks")));
    }
    Ok(g)
}

/// What both kernels start with: the call's counter c (every block's is the same), its flag
/// (high word), the stamp c + 2 and the region's offset — the low-latency form's region of the
/// call sequence, or region 0 after the bulk form's entry barrier at c + 1 (headers checked).
fn form(
    a: &LaunchArgs,
    cx: &Ctx,
    l: &[u64; LAYOUT_WORDS],
    g: u64,
) -> Result<(u32, u64, u32, usize), KernelError> {
    let c = u32_at(cx.pad + OFF_CTR).load(Ordering::Relaxed);
    let flag = (ll_flag(c, cx.sig) as u64) << 32;
    a.check(l[L_SYNC] as usize, 16, true)?;
    let region = if l[L_FORM] == 1 {
        (rd32(l[L_SYNC] as usize + 8) & 1) as usize * l[L_REGION] as usize
    } else {
        for b in 0..g as usize {
            cx.barrier(a, b, c.wrapping_add(1), Some((c >> 1) & 1));
        }
        0
    };
    Ok((c, flag, c.wrapping_add(2), region))
}

/// The end of a kernel's pushes: the low-latency form's call sequence advances.
fn advance(l: &[u64; LAYOUT_WORDS]) {
    if l[L_FORM] == 1 {
        let at = l[L_SYNC] as usize + 8;
        wr32(at, rd32(at).wrapping_add(1));
    }
}

/// The cell at `at` polled until it carries `flag` (bounded: [`ll_poll_with`], no look for a
/// peer in a barrier: the bulk form's peers passed one of this call); its value, or 0 where it
/// never came.
fn cell(cx: &Ctx, at: usize, flag: u64, c: u32, peer: usize) -> u32 {
    let v = ll_poll_with(cx, at, flag, c, Some(peer), false);
    if v >> 32 == flag >> 32 {
        v as u32
    } else {
        0
    }
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
    let (tmax, k, e_all) = (l[L_TMAX], l[L_K] as usize, l[L_EXPERTS] as usize);
    let (row, s_n, stride) = (l[L_ROW] as usize, l[L_SCALES] as usize, l[L_ROW_STRIDE]);
    let (place, wcopy, tab) = (l[L_PLACE] as usize, l[L_WCOPY] as usize, l[L_TAB] as usize);
    let (posv, ecnt) = (l[L_POS] as usize, l[L_ECNT] as usize);
    if t_n > tmax || k == 0 {
        return Err(KernelError::Failed(format!("{t_n} tokens, top-{k}")));
    }
    let t_n = t_n as usize;
    a.check(tab, 8 * n, false)?;
    a.check(place, 8 * e_all, false)?;
    a.check(ids, 4 * k * t_n, false)?;
    a.check(wts, 4 * k * t_n, false)?;
    a.check(wcopy, 4 * k * t_n, true)?;
    a.check(posv, 4 * k * t_n, true)?;
    a.check(ecnt, 4 * e_all, true)?;
    let peer = |j: usize| u64_at(tab + 8 * j).load(Ordering::Relaxed) as usize;
    let (c, flag, stamp, region) = form(a, &cx, &l, g)?;
    // routing: per expert its entries, per entry its position among them (token, slot order)
    let mut cnt = vec![0u32; e_all];
    for e in 0..t_n * k {
        let id = rd32(ids + 4 * e) as i32;
        if id >= 0 && (id as usize) < e_all {
            wr32(posv + 4 * e, cnt[id as usize]);
            cnt[id as usize] += 1;
        }
    }
    for (x, &v) in cnt.iter().enumerate() {
        wr32(ecnt + 4 * x, v);
    }
    // pushes: every token once to every rank hosting one of its experts
    let mut bad = false;
    for t in 0..t_n {
        let mut dst = vec![u32::MAX; k];
        let mut loc = vec![u32::MAX; k];
        let mut pos = vec![0u32; k];
        let mut mask = 0u32;
        for j in 0..k {
            let id = rd32(ids + 4 * (k * t + j)) as i32;
            wr32(wcopy + 4 * (k * t + j), rd32(wts + 4 * (k * t + j)));
            if id == -1 {
                continue;
            }
            if id < 0 || id as usize >= e_all {
                bad = true;
                continue;
            }
            dst[j] = rd32(place + 4 * id as usize);
            loc[j] = rd32(place + 4 * (e_all + id as usize));
            pos[j] = rd32(posv + 4 * (k * t + j));
            mask |= 1 << dst[j];
        }
        for d in (0..n).filter(|d| mask >> d & 1 != 0) {
            let base = peer(d) + region;
            let st = rank as u64 * tmax + t as u64;
            let at = base + (st * stride) as usize;
            gather::copy(a, tokens + row * t, at, row)?;
            if s_n > 0 {
                let so = round16(row as u64) as usize;
                gather::copy(a, scales + 4 * s_n * t, at + so, 4 * s_n)?;
            }
            let meta = base + (l[L_META_OFF] + st * 4 * (1 + 2 * k as u64)) as usize;
            a.check(meta, 4 * (1 + 2 * k), true)?;
            wr32(meta, stamp);
            for j in 0..k {
                let v = if dst[j] == d as u32 { loc[j] } else { u32::MAX };
                wr32(meta + 4 * (1 + 2 * j), v);
                wr32(meta + 4 * (2 + 2 * j), pos[j]);
            }
        }
    }
    if bad {
        bounds(pad);
    }
    advance(&l);
    // the count cells: expert x's entries into cell [local x][rank] of its rank's region
    for (x, &v) in cnt.iter().enumerate() {
        let (d, lx) = (
            rd32(place + 4 * x) as usize,
            rd32(place + 4 * (e_all + x)) as usize,
        );
        if d >= n {
            return Err(KernelError::Failed(format!("expert {x} on rank {d}")));
        }
        let at = peer(d) + region + (l[L_CELL_OFF] as usize) + 8 * (lx * n + rank);
        a.check(at, 8, true)?;
        u64_at(at).store(flag | v as u64, Ordering::Release);
    }
    // every sender's cells, their exclusive prefix sums (expert, then sender)
    let (local, rows) = (l[L_LOCAL] as usize, l[L_ROWS]);
    let sym = l[L_SYM] as usize + region;
    let cells = sym + l[L_CELL_OFF] as usize;
    a.check(cells, 8 * local * n, false)?;
    let mut start = vec![0u64; local * n + 1];
    for i in 0..local * n {
        start[i + 1] = start[i] + cell(&cx, cells + 8 * i, flag, c, i % n) as u64;
    }
    let total = start[local * n];
    let (counts, offsets, map) = (
        l[L_COUNTS] as usize,
        l[L_OFFSETS] as usize,
        l[L_MAP] as usize,
    );
    let (xout, sout) = (l[L_XOUT] as usize, l[L_SOUT] as usize);
    a.check(counts, 4 * local, true)?;
    a.check(offsets, 4 * (local + 1), true)?;
    a.check(map, 4 * rows as usize, true)?;
    for e in 0..local {
        let (lo, hi) = (start[e * n].min(rows), start[(e + 1) * n].min(rows));
        wr32(offsets + 4 * e, lo as u32);
        wr32(counts + 4 * e, (hi - lo) as u32);
    }
    wr32(offsets + 4 * local, total.min(rows) as u32);
    if total > rows {
        bounds(pad);
    }
    // every received row of this call into the expert-grouped rows of its slots
    let meta_b = 4 * (1 + 2 * k);
    for st in 0..n * tmax as usize {
        let m = sym + l[L_META_OFF] as usize + st * meta_b;
        a.check(m, meta_b, false)?;
        if rd32(m) != stamp {
            continue;
        }
        let s = st / tmax as usize;
        let src = sym + st * stride as usize;
        for j in 0..k {
            let (lx, p) = (rd32(m + 4 * (1 + 2 * j)), rd32(m + 4 * (2 + 2 * j)) as u64);
            if lx == u32::MAX {
                continue;
            }
            let i = lx as usize * n + s;
            if lx as usize >= local || p >= start[i + 1] - start[i] {
                bounds(pad);
                continue;
            }
            let dest = start[i] + p;
            if dest >= rows {
                continue;
            }
            gather::copy(a, src, xout + row * dest as usize, row)?;
            if s_n > 0 {
                let so = round16(row as u64) as usize;
                gather::copy(a, src + so, sout + 4 * s_n * dest as usize, 4 * s_n)?;
            }
            wr32(map + 4 * dest as usize, (st * k + j) as u32);
        }
    }
    for b in 0..g as usize {
        set_counters(pad, b, g as usize, c.wrapping_add(2));
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
    let (y, out, t_n, mode) = (a.u64(2)? as usize, a.u64(3)? as usize, a.u64(4)?, a.u64(5)?);
    let cx = Ctx::from_pad(a, pad, 6, 7)?;
    let (rank, n) = (cx.rank, cx.n);
    let g = grid(a)?;
    let (tmax, k, local, hidden) = (l[L_TMAX], l[L_K], l[L_LOCAL] as usize, l[L_HIDDEN] as usize);
    let (yrow, ystride, wcopy) = (l[L_YROW] as usize, l[L_YSTRIDE], l[L_WCOPY] as usize);
    let (yc, oc) = (mode & 255, (mode >> 8) & 255);
    if t_n > tmax || yc > CODE_F16 || oc > CODE_F16 || yrow != hidden * size(yc) {
        return Err(KernelError::Failed(format!(
            "{t_n} tokens, codes {yc} {oc}, rows of {yrow} bytes"
        )));
    }
    let (offsets, map, tab) = (l[L_OFFSETS] as usize, l[L_MAP] as usize, l[L_TAB] as usize);
    a.check(offsets, 4 * (local + 1), false)?;
    a.check(tab, 8 * n, false)?;
    let total = (rd32(offsets + 4 * local) as u64).min(l[L_ROWS]);
    a.check(map, 4 * total as usize, false)?;
    let peer = |j: usize| u64_at(tab + 8 * j).load(Ordering::Relaxed) as usize;
    let (c, flag, stamp, region) = form(a, &cx, &l, g)?;
    // every expert output row back to its token's rank, slot [t][j]
    for i in 0..total {
        let x = rd32(map + 4 * i as usize) as u64;
        if x >= n as u64 * tmax * k {
            bounds(pad);
            continue;
        }
        let (s, tj) = (x / (tmax * k), x % (tmax * k));
        let base = peer(s as usize) + region;
        let dst = base + (l[L_COMB_OFF] + tj * ystride) as usize;
        gather::copy(a, y + yrow * i as usize, dst, yrow)?;
        let st = base + (l[L_STAMP_OFF] + 4 * tj) as usize;
        a.check(st, 4, true)?;
        wr32(st, stamp);
    }
    advance(&l);
    for s in 0..n {
        let at = peer(s) + region + l[L_DONE_OFF] as usize + 8 * rank;
        a.check(at, 8, true)?;
        u64_at(at).store(flag, Ordering::Release);
    }
    let sym = l[L_SYM] as usize + region;
    let done = sym + l[L_DONE_OFF] as usize;
    a.check(done, 8 * n, false)?;
    for s in 0..n {
        cell(&cx, done + 8 * s, flag, c, s);
    }
    // every token: the weighted sum in top-k order, f32
    for t in 0..t_n {
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
    for b in 0..g as usize {
        set_counters(pad, b, g as usize, c.wrapping_add(2));
    }
    Ok(())
}
