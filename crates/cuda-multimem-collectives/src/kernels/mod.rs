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
//! | offset | content |
//! | --- | --- |
//! | 0 | `u32` rank |
//! | 4 | `u32` team size |
//! | 8 | `u32` error word (0 ok, [`ERR_TIMEOUT`], [`ERR_MISMATCH`]) |
//! | 12 | `u32` bounds word (0 ok, [`ERR_BOUNDS`]) |
//! | 16 | `u64` bytes of one staging half |
//! | 64 | `u64[8]` every rank's pad, as mapped on this rank |
//! | 24 | `u64` bytes of one low-latency slot |
//! | 32 | `u64` bytes of one landing slot (the copy-engine two-shot) |
//! | 40 | `u64` this rank's landing area, as mapped on this rank |
//! | 128 | `u64[8]` every rank's staging area, as mapped on this rank |
//! | 192 | `u64[8]` every rank's low-latency staging area, as mapped on this rank |
//! | 256 | `u32[MAX_BLOCKS]` per-block barrier counters (kept in lockstep) |
//! | 2048 | `u32[MAX_BLOCKS][8]` signal slots: block b, sender s |
//! | 16384 | `u64[2][MAX_BLOCKS][8]` call headers: parity, block, sender |

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
pub const MAX_RANKS: usize = 8;
/// Largest grid; the per-block counters are replicated this many times.
pub const MAX_BLOCKS: usize = 256;
/// Bytes of one signal pad.
pub const PAD_BYTES: usize = 64 << 10;
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
pub const OFF_STAGES: usize = 128;
/// Bytes of one low-latency slot (`u64`).
pub const OFF_LL_SLOT: usize = 24;
/// Peer low-latency staging areas.
pub const OFF_LL_STAGES: usize = 192;
/// Bytes of one landing slot (`u64`).
pub const OFF_LAND_SLOT: usize = 32;
/// This rank's landing area (`u64`).
pub const OFF_LAND: usize = 40;
/// Block counters.
pub const OFF_CTR: usize = 256;
/// Signal slots.
pub const OFF_SIG: usize = 2048;
/// Call headers.
pub const OFF_HDR: usize = 16384;
/// A barrier spun past its deadline.
pub const ERR_TIMEOUT: u32 = 1;
/// A peer called with another size, type, operation or algorithm.
pub const ERR_MISMATCH: u32 = 2;
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
