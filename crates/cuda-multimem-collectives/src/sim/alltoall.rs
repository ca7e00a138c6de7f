//! Host-side equivalents of the all-to-all kernels (`kernels/p2p_alltoall.ptx`), step by step:
//! the same row of counts and offsets per rank, stored by block 0 as flagged cells into every
//! peer's low-latency slot and polled by every block (bounded), the same matrix rules (a part
//! moves only if valid, as expected and inside the receiver's output; else `ERR_BOUNDS`), the
//! same per-block split of every part, the low-latency form's data cells and polls, the direct
//! form's stores into every receiver's buffer, its barrier and copy out; counters c + 2.
//! Registered by [`super::install`].

use super::*;
use crate::kernels::alltoall::*;

/// Register the three entries.
pub(super) fn register() {
    register_kernel(LL_ENTRY, |a| run(a, false));
    register_kernel(DIRECT_ENTRY, |a| run(a, true));
    register_kernel(FILL_ENTRY, |a| {
        let dst = a.u64(0)? as usize;
        a.check(dst, 8 * TABLE_WORDS, true)?;
        for i in 0..TABLE_WORDS {
            u64_at(dst + 8 * i).store(a.u64(1 + i)?, Ordering::Relaxed);
        }
        Ok(())
    });
}

/// One part of the matrix as the kernels see it: whether it moves, its bytes, where it lands in
/// the receiver's buffer.
#[derive(Clone, Copy, Default)]
struct Part {
    ok: bool,
    len: u64,
    dst: u64,
}

/// Part `s → k` of the matrix `rows` (every rank's row), as both ends compute it.
fn part(
    rows: &[[u32; ROW_CELLS as usize]],
    s: usize,
    k: usize,
    device: bool,
    out_bytes: u64,
    cap: u64,
) -> Part {
    let m = MAX_RANKS;
    let c = rows[s][k];
    let (d, e) = if device {
        let d: u64 = (0..s)
            .map(|t| rows[t][k])
            .filter(|&x| x != INVALID)
            .map(u64::from)
            .sum();
        (d, ANY)
    } else {
        (rows[k][m + s] as u64, rows[k][2 * m + s])
    };
    let ok = c != INVALID
        && e != INVALID
        && (e == ANY || e == c)
        && d + c as u64 <= out_bytes
        && (s == k || c as u64 <= cap);
    Part {
        ok,
        len: c as u64,
        dst: d,
    }
}

/// Poll the cell at `at`, sent by `peer`, until its flag is `flag`'s (call counter `c`): its
/// value, or `None` on the timeout (then `ERR_TIMEOUT`), when the error word is set, or on a
/// disagreement (a cell of this counter with another header, [`ll_disagrees`]; with `row`, past
/// [`LL_PEEK_NS`], the sender's block 0 at this call's first barrier value in my slot while its
/// row is still not here: it is in a barrier kernel of this call) — then `ERR_MISMATCH` on
/// every rank, as the PTX `poll`.
fn poll(cx: &Ctx, at: usize, flag: u64, c: u32, peer: usize, row: bool) -> Option<u32> {
    let cell = u64_at(at);
    let start = Instant::now();
    let peek = Duration::from_nanos(LL_PEEK_NS);
    let mut spins = 0u32;
    loop {
        let v = cell.load(Ordering::Acquire);
        if v >> 32 == flag >> 32 {
            return Some(v as u32);
        }
        if ll_disagrees((v >> 32) as u32, (flag >> 32) as u32) {
            super::ll_report(cx);
            return None;
        }
        if cx.err().load(Ordering::Relaxed) != 0 {
            cx.seen();
            return None;
        }
        let waited = start.elapsed();
        if row
            && waited >= peek
            && u32_at(cx.pad + OFF_SIG + 4 * peer).load(Ordering::Acquire) == c.wrapping_add(1)
        {
            let v = cell.load(Ordering::Acquire);
            if v >> 32 == flag >> 32 {
                return Some(v as u32);
            }
            super::ll_report(cx);
            return None;
        }
        if waited >= cx.timeout {
            cx.fail(ERR_TIMEOUT, Some(peer));
            return None;
        }
        spins += 1;
        if spins < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

/// The `rem` (1 to 4) bytes at `at`, little-endian.
fn load_word(at: usize, rem: u64) -> u32 {
    let mut x = 0u32;
    for i in 0..rem as usize {
        // SAFETY: the caller checked the range.
        x |= (unsafe { std::ptr::read_volatile((at + i) as *const u8) } as u32) << (8 * i);
    }
    x
}

/// Store the low `rem` bytes of `x` at `at`.
fn store_word(at: usize, rem: u64, x: u32) {
    for i in 0..rem as usize {
        // SAFETY: the caller checked the range.
        unsafe { std::ptr::write_volatile((at + i) as *mut u8, (x >> (8 * i)) as u8) };
    }
}

/// A `u64` of a table in device memory (checked by the caller).
fn tab(at: usize, i: usize) -> u64 {
    u64_at(at + 8 * i).load(Ordering::Relaxed)
}

fn run(a: &LaunchArgs, direct: bool) -> Result<(), KernelError> {
    let pad = a.u64(0)? as usize;
    let (inp, out, out_tab) = (a.u64(1)?, a.u64(2)?, a.u64(3)? as usize);
    let count = a.u64(4)?;
    let (tab_a, tab_b, tab_c) = (a.u64(5)? as usize, a.u64(6)? as usize, a.u64(7)? as usize);
    let mode_w = a.u64(8)?;
    let (in_bytes, out_bytes, fin) = (a.u64(9)?, a.u64(10)?, a.u64(11)?);
    let cx = Ctx::from_pad(a, pad, 12, 13)?;
    let (rank, n) = (cx.rank, cx.n);
    let es = mode_w & 255;
    let mode = (mode_w >> 8) & 255;
    let g = a.grid.0 as u64;
    if g as usize > MAX_BLOCKS || !(1..=255).contains(&es) || mode > MODE_DEVICE {
        return Err(KernelError::Failed(format!(
            "grid of {g} blocks, element of {es} bytes, mode {mode}"
        )));
    }
    let device = mode == MODE_DEVICE;
    let slot = u64_at(pad + OFF_LL_SLOT).load(Ordering::Relaxed) as usize;
    let stage = |t: usize| u64_at(pad + OFF_LL_STAGES + 8 * t).load(Ordering::Relaxed) as usize;
    let cap = if direct {
        u64::MAX
    } else {
        ll_capacity(slot as u64)
    };
    let m = MAX_RANKS;
    // my row (thread 0 of every block computes the same): C, D, E cells, and my send offsets
    match mode {
        MODE_HOST => a.check(tab_a, 8 * TABLE_WORDS, false)?,
        MODE_DEVICE => {
            a.check(tab_a, 8 * n, false)?;
            a.check(tab_b, 8 * n, true)?;
            a.check(tab_c, 8 * n, true)?;
        }
        _ => {}
    }
    let mut row = [0u32; ROW_CELLS as usize];
    let mut so = [0u64; MAX_RANKS];
    let mut bad = false;
    let mut packed = 0u64;
    let fits = |cnt: u64, off: u64, lim: u64| {
        cnt <= lim && off <= lim && (cnt + off) as u128 * es as u128 <= lim as u128
    };
    for j in 0..n {
        let (cnt, off) = match mode {
            MODE_EQUAL => (count, j as u64 * count),
            MODE_HOST => (tab(tab_a, j), tab(tab_a, m + j)),
            _ => (tab(tab_a, j), packed),
        };
        if fits(cnt, off, in_bytes) {
            row[j] = (cnt * es) as u32;
            so[j] = off * es;
            packed += cnt;
        } else {
            row[j] = INVALID;
            bad = true;
        }
        let (rc, ro) = match mode {
            MODE_EQUAL => (count, j as u64 * count),
            MODE_HOST => (tab(tab_a, 2 * m + j), tab(tab_a, 3 * m + j)),
            _ => (0, 0),
        };
        if device {
            row[m + j] = ANY;
            row[2 * m + j] = ANY;
        } else if fits(rc, ro, out_bytes) {
            row[m + j] = (ro * es) as u32;
            row[2 * m + j] = (rc * es) as u32;
        } else {
            row[2 * m + j] = INVALID;
        }
    }
    let table = |t: usize| u64_at(out_tab + 8 * t).load(Ordering::Relaxed);
    if direct {
        a.check(out_tab, 8 * n, false)?;
    }
    for b in 0..g {
        let cnt = u32_at(pad + OFF_CTR + 4 * b as usize).load(Ordering::Relaxed);
        let flag = (ll_flag(cnt, cx.sig) as u64) << 32;
        let parity = ((cnt >> 1) & 1) as usize;
        let push = |t: usize| stage(t) + (parity * n + rank) * slot;
        let mine = |s: usize| stage(rank) + (parity * n + s) * slot;
        // block 0: my C cells and my D and E of peer t (cells m + t, 2m + t: the only cells
        // of my row besides C that t's parts use) into every peer t's slot [parity][rank]
        if b == 0 {
            for t in (0..n).filter(|&t| t != rank) {
                a.check(push(t), 8 * ROW_CELLS as usize, true)?;
                for i in (0..n).chain([m + t, 2 * m + t]) {
                    u64_at(push(t) + 8 * i).store(flag | row[i] as u64, Ordering::Release);
                }
            }
        }
        a.jitter();
        // every block: every peer's row (a cell not heard of is INVALID)
        let mut rows = vec![[INVALID; ROW_CELLS as usize]; n];
        rows[rank] = row;
        for s in (0..n).filter(|&s| s != rank) {
            a.check(mine(s), 8 * ROW_CELLS as usize, false)?;
            for i in (0..n).chain([m + rank, 2 * m + rank]) {
                rows[s][i] = poll(&cx, mine(s) + 8 * i, flag, cnt, s, true).unwrap_or(INVALID);
            }
        }
        let snd: Vec<Part> = (0..n)
            .map(|k| part(&rows, rank, k, device, out_bytes, cap))
            .collect();
        let rcv: Vec<Part> = (0..n)
            .map(|s| part(&rows, s, rank, device, out_bytes, cap))
            .collect();
        if b == 0 {
            if bad || rcv.iter().any(|p| !p.ok) {
                let _ = u32_at(pad + OFF_BOUNDS).compare_exchange(
                    0,
                    ERR_BOUNDS,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
            if device {
                for (s, p) in rcv.iter().enumerate() {
                    u64_at(tab_b + 8 * s)
                        .store(if p.ok { p.len / es } else { 0 }, Ordering::Relaxed);
                    u64_at(tab_c + 8 * s).store(p.dst / es, Ordering::Relaxed);
                }
            }
        }
        if direct {
            let delta = out.wrapping_sub(table(rank));
            for (k, p) in snd.iter().enumerate().filter(|(_, p)| p.ok) {
                let (lo, hi) = block_range(p.len, 16, g, b);
                let dst = table(k).wrapping_add(delta) + p.dst + lo;
                gather::copy(
                    a,
                    (inp + so[k] + lo) as usize,
                    dst as usize,
                    (hi - lo) as usize,
                )?;
            }
            cx.barrier(a, b as usize, cnt.wrapping_add(1), None);
            if fin != 0 {
                for p in rcv.iter().filter(|p| p.ok) {
                    let (lo, hi) = block_range(p.len, 16, g, b);
                    let at = p.dst + lo;
                    gather::copy(
                        a,
                        (out + at) as usize,
                        (fin + at) as usize,
                        (hi - lo) as usize,
                    )?;
                }
            }
        } else {
            // send: my parts as cells after the row (my own part straight into my output)
            for (k, p) in snd.iter().enumerate().filter(|(_, p)| p.ok) {
                let (lo, hi) = block_range(p.len, 4, g, b);
                let src = inp + so[k];
                a.check((src + lo) as usize, (hi - lo) as usize, false)?;
                if k == rank {
                    let dst = out + p.dst;
                    a.check((dst + lo) as usize, (hi - lo) as usize, true)?;
                    if src != dst {
                        gather::copy(
                            a,
                            (src + lo) as usize,
                            (dst + lo) as usize,
                            (hi - lo) as usize,
                        )?;
                    }
                    continue;
                }
                let cells = push(k) + 8 * ROW_CELLS as usize;
                a.check(
                    cells + 2 * lo as usize,
                    2 * (hi - lo).div_ceil(4) as usize * 4,
                    true,
                )?;
                for w in lo / 4..hi.div_ceil(4) {
                    let x = load_word((src + 4 * w) as usize, (p.len - 4 * w).min(4));
                    u64_at(cells + 8 * w as usize).store(flag | x as u64, Ordering::Release);
                }
            }
            a.jitter();
            // receive: my slots' cells into my output
            for (s, p) in rcv.iter().enumerate().filter(|(s, p)| p.ok && *s != rank) {
                let (lo, hi) = block_range(p.len, 4, g, b);
                let dst = out + p.dst;
                a.check((dst + lo) as usize, (hi - lo) as usize, true)?;
                let cells = mine(s) + 8 * ROW_CELLS as usize;
                for w in lo / 4..hi.div_ceil(4) {
                    if let Some(x) = poll(&cx, cells + 8 * w as usize, flag, cnt, s, false) {
                        store_word((dst + 4 * w) as usize, (p.len - 4 * w).min(4), x);
                    }
                }
            }
        }
        set_counters(pad, b as usize, g as usize, cnt.wrapping_add(2));
    }
    Ok(())
}
