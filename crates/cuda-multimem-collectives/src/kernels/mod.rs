//! The PTX kernels and their layout contract with the host: the kernel families, their entry
//! and file names, the committed PTX text, the signal pad's layout, and the launch.
//!
//! The `.ptx` files beside this module are committed text, loaded with `cuModuleLoadData` (no
//! CUDA toolkit at build time) and assembled by `cargo xtask ptx-check` where `ptxas` exists.
//! They are written by the generator crate `cuda-multimem-ptxgen` (a build tool beside this
//! crate, never in a user's binary): `cargo xtask ptx` rewrites them, `cargo xtask ptx --check`
//! (run by CI) fails naming every file that differs from a fresh generation.
//!
//! # Signal pad layout (per rank, device memory, zeroed once at creation)
//! Every per-rank table and slot row has [`MAX_RANKS`] entries (72: one NVL72 domain), so the
//! pad is 384 KiB (the call headers, `2 × MAX_BLOCKS × MAX_RANKS` `u64`, are most of it).
//! What a team writes once (its size, the tables) comes before the counters; from the counters
//! on, the pad is protocol state, zeroed by `Communicator::recover`.
//!
//! | offset | content |
//! | --- | --- |
//! | 0 | `u32` rank |
//! | 4 | `u32` team size |
//! | 8 | `u32` error word (0 ok, else [`ERR_TIMEOUT`] or [`ERR_MISMATCH`] in bits 7..0 and the peer it concerns + 1 in bits 31..8, 0 where unknown: [`err_word`]) |
//! | 12 | `u32` bounds word (0 ok, [`ERR_BOUNDS`]) |
//! | 16 | `u64` bytes of one staging half |
//! | 24 | `u64` bytes of one low-latency slot |
//! | 32 | `u64` bytes of one landing slot (the copy-engine two-shot) |
//! | 40 | `u64` this rank's landing area, as mapped on this rank |
//! | 48 | `u64` this rank's error mirror: the device address of host-mapped memory into which every kernel error path copies the error word (0: none) |
//! | 64 | `u64[MAX_RANKS]` every rank's pad, as mapped on this rank |
//! | 640 | `u64[MAX_RANKS]` every rank's staging area, as mapped on this rank |
//! | 1216 | `u64[MAX_RANKS]` every rank's low-latency staging area, as mapped on this rank |
//! | 2048 | `u32[MAX_BLOCKS]` per-block barrier counters (kept in lockstep) |
//! | 4096 | `u32[MAX_BLOCKS][MAX_RANKS]` signal slots: block b, sender s |
//! | 77824 | `u64[2][MAX_BLOCKS][MAX_RANKS]` call headers: parity, block, sender |
//! | 372736 | end of the call headers ([`PAD_BYTES`] = 393216) |
//!
//! # Where the team size stops
//! [`MAX_RANKS`] is 72, one NVL72 domain. What grows with it: the pad (above, linear), the
//! barrier (warp 0's lanes t, t + 32, t + 64 each signal and wait for their peers, so three
//! rounds at most), the all-to-all's shared memory (the count matrix `u32[MAX_RANKS]
//! [MAX_RANKS]`, about 21 KiB of the 48 KiB a block may declare statically) and its table fill
//! (`1 + 4 × MAX_RANKS` parameters, 2312 bytes of the 4 KiB of kernel parameters). The next
//! limits past 72: the barrier loop (a fourth round per 32 ranks), the all-to-all's matrix
//! (quadratic: 96 ranks take 36 KiB) and the fill's parameters (127 ranks).

mod allreduce;
pub mod alltoall;
pub mod gather;
mod loader;
pub mod moe;
pub mod multimem;
pub mod norm;

pub use allreduce::{ce_part_units, Kernel};
pub use loader::ptx_text;
pub(crate) use loader::{check_device, load_module};

/// Environment variable naming a folder of replacement `.ptx` files (kernel tuning only; read
/// only with the non-default feature `ptx-override`).
#[cfg(feature = "ptx-override")]
pub const PTX_DIR_ENV: &str = "CUDA_MULTIMEM_PTX_DIR";
/// Largest team.
pub const MAX_RANKS: usize = 72;
/// Largest grid; the per-block counters are replicated this many times.
pub const MAX_BLOCKS: usize = 256;
/// Bytes of one signal pad.
pub const PAD_BYTES: usize = 384 << 10;
/// Offsets in the pad.
pub const OFF_RANK: usize = 0;
/// Team size.
pub const OFF_NRANKS: usize = 4;
/// Error word.
pub const OFF_ERR: usize = 8;
/// Bounds word (`u32`): 0, or [`ERR_BOUNDS`] once a count read on the device was out of range.
/// Apart from the error word, which ends every wait: a bounds error never shortens a call's
/// waits, so its peers are never left waiting for it.
pub const OFF_BOUNDS: usize = 12;
/// Staging half size.
pub const OFF_STAGE_HALF: usize = 16;
/// Peer pads.
pub const OFF_PADS: usize = 64;
/// Peer staging areas.
pub const OFF_STAGES: usize = 640;
/// Bytes of one low-latency slot (`u64`).
pub const OFF_LL_SLOT: usize = 24;
/// Peer low-latency staging areas.
pub const OFF_LL_STAGES: usize = 1216;
/// Bytes of one landing slot (`u64`).
pub const OFF_LAND_SLOT: usize = 32;
/// This rank's landing area (`u64`).
pub const OFF_LAND: usize = 40;
/// This rank's error mirror (`u64`): the device address of a `u32` in page-locked host memory
/// mapped for the rank's device. Whenever a kernel sets or finds the error word set, it stores
/// the word there too (system scope), so the host reads a failure with a plain load before its
/// next call, with no driver call and no synchronisation. 0: no mirror.
pub const OFF_MIRROR: usize = 48;
/// Block counters.
pub const OFF_CTR: usize = 2048;
/// Signal slots.
pub const OFF_SIG: usize = 4096;
/// Call headers.
pub const OFF_HDR: usize = 77824;
/// Byte offset of signal slot (block `b`, sender `s`) in a pad: one row of [`MAX_RANKS`] per
/// block (the PTX computes the same).
pub const fn sig_slot(b: usize, s: usize) -> usize {
    OFF_SIG + 4 * (b * MAX_RANKS + s)
}
/// Byte offset of call header (parity `p`, block `b`, sender `s`) from the start of the
/// headers (`OFF_HDR` in a pad, `MM_OFF_HDR` in a multimem member): rows of [`MAX_RANKS`].
pub const fn hdr_slot(p: usize, b: usize, s: usize) -> usize {
    8 * ((p * MAX_BLOCKS + b) * MAX_RANKS + s)
}

// The pad's regions in order, none overlapping another (the table above); 48..56 stays free.
const _: () = {
    assert!(OFF_LAND + 8 <= 48 && OFF_PADS >= 56);
    assert!(OFF_PADS + 8 * MAX_RANKS <= OFF_STAGES);
    assert!(OFF_STAGES + 8 * MAX_RANKS <= OFF_LL_STAGES);
    assert!(OFF_LL_STAGES + 8 * MAX_RANKS <= OFF_CTR);
    assert!(OFF_CTR + 4 * MAX_BLOCKS <= OFF_SIG);
    assert!(OFF_SIG + 4 * MAX_BLOCKS * MAX_RANKS <= OFF_HDR);
    assert!(OFF_HDR + 2 * MAX_BLOCKS * MAX_RANKS * 8 <= PAD_BYTES);
    assert!(OFF_HDR.is_multiple_of(8) && OFF_SIG.is_multiple_of(4));
    // the barrier's three rounds of warp 0 (lanes t, t + 32, t + 64)
    assert!(MAX_RANKS <= 3 * 32);
};

/// A barrier spun past its deadline.
pub const ERR_TIMEOUT: u32 = 1;
/// A peer called with another size, type, operation or algorithm.
pub const ERR_MISMATCH: u32 = 2;
/// The code of an error word (`ERR_TIMEOUT`, `ERR_MISMATCH`; 0: none) and the peer it concerns
/// (the rank a wait gave up on, the rank whose call header differs), where the kernel knew it:
/// the word is the code in bits 7..0 and the peer + 1 in bits 31..8.
pub fn err_word(w: u32) -> (u32, Option<usize>) {
    (w & 0xff, (w >> 8).checked_sub(1).map(|p| p as usize))
}

/// A count, offset or expert id read on the device was out of range (all-to-all and MoE
/// kernels: nothing of what it concerns was written).
pub const ERR_BOUNDS: u32 = 4;

/// The low-latency flag of call counter `c` with call header `header` (the high word of every
/// (flag, word) cell of the low-latency forms): bits 31..16 the counter, `0x8000 | ((c + 1) &
/// 0x7fff)` (never 0, the value of a cell nobody wrote; distinct from the slot's earlier uses),
/// bits 15..0 the header folded to 16 bits. The PTX computes the same (`ptxgen::ll_flag`).
#[cfg_attr(not(feature = "sim"), allow(dead_code))]
pub(crate) fn ll_flag(c: u32, header: u64) -> u32 {
    let counter = (c.wrapping_add(1) & 0x7fff) | 0x8000;
    let f = (header as u32) ^ ((header >> 32) as u32);
    counter << 16 | ((f ^ (f >> 16)) & 0xffff)
}

/// Nanoseconds a low-latency poll waits before it also looks for a peer that waits in a barrier
/// kernel of this call (a peer that called another collective or size): the check costs a load
/// per rank, so the fast path never pays it.
pub const LL_PEEK_NS: u64 = 50_000;

/// A polled cell's flag `cell` that is not this call's `flag` but carries its counter: the
/// sender called the same call with another shape (a disagreement, `ERR_MISMATCH`), not an
/// earlier call whose flag is still there.
#[cfg_attr(not(feature = "sim"), allow(dead_code))]
pub(crate) fn ll_disagrees(cell: u32, flag: u32) -> bool {
    cell != flag && cell >> 16 == flag >> 16
}

/// The call header the ranks compare at their first barrier: an FNV-1a-style fold of what
/// describes the call (count, type, op, kernel, offsets, grid), top bit set so it is never 0
/// (the value of a header slot nobody wrote).
pub(crate) fn call_header(fields: &[u64]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for x in fields {
        h = (h ^ x).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h | 1 << 63
}
