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

use crate::{DType, ReduceOp as Op};

pub mod gather;
pub mod multimem;
pub mod norm;

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

/// The algorithm a kernel implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Peer-to-peer one-shot: copy in to staging, one barrier, every rank reduces everything.
    P2pOneShot,
    /// Peer-to-peer two-shot: barrier, each rank reduces its part and stores it on every rank,
    /// barrier.
    P2pTwoShot,
    /// Peer-to-peer one-shot, low-latency protocol: every 4 data bytes travel with a 4-byte flag
    /// (the call's counter) in one 8-byte store; receivers poll the data itself. No barrier, no
    /// fence.
    P2pOneShotLl,
    /// Peer-to-peer two-shot whose remote traffic is only posted writes: each rank pushes part k
    /// of its input into owner k's staging, barrier, the owner reduces locally and pushes the
    /// result to every rank's output, barrier — in rounds through fixed-size staging slots.
    /// Needs 16-byte aligned operands; the default above the one-shot limit. Three more
    /// parameters than the other families (`copy_src`, `copy_dst`, `copy_bytes`): a local copy
    /// of 16-byte vectors that warps 1.. do during each round's first barrier (0 bytes: none;
    /// staged calls carry the previous chunk's copy out of the scratch in it).
    P2pTwoShotPush,
    /// Two-shot whose first half is done by the copy engines before the kernel starts: each
    /// rank's part k of the input (rank-major: part k is the k-th N-th of the message) is copied
    /// by `cuMemcpyDtoDAsync` into rank k's landing slot of this rank, on the caller's stream;
    /// the kernel then meets its peers, reduces its part from its input and its landing slots
    /// and pushes the result into every output. 16-byte aligned operands only.
    P2pTwoShotCe,
}

impl Kernel {
    /// Every kernel family.
    pub const ALL: [Kernel; 5] = [
        Kernel::P2pOneShot,
        Kernel::P2pTwoShot,
        Kernel::P2pOneShotLl,
        Kernel::P2pTwoShotPush,
        Kernel::P2pTwoShotCe,
    ];

    /// File name of the family's PTX.
    pub fn file(self) -> &'static str {
        match self {
            Kernel::P2pOneShot => "p2p_oneshot.ptx",
            Kernel::P2pTwoShot => "p2p_twoshot.ptx",
            Kernel::P2pOneShotLl => "p2p_oneshot_ll.ptx",
            Kernel::P2pTwoShotPush => "p2p_twoshot_push.ptx",
            Kernel::P2pTwoShotCe => "p2p_twoshot_ce.ptx",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Kernel::P2pOneShot => "p2p_oneshot",
            Kernel::P2pTwoShot => "p2p_twoshot",
            Kernel::P2pOneShotLl => "p2p_oneshot_ll",
            Kernel::P2pTwoShotPush => "p2p_twoshot_push",
            Kernel::P2pTwoShotCe => "p2p_twoshot_ce",
        }
    }

    /// The committed PTX text of this family.
    pub fn ptx(self) -> &'static str {
        match self {
            Kernel::P2pOneShot => include_str!("p2p_oneshot.ptx"),
            Kernel::P2pTwoShot => include_str!("p2p_twoshot.ptx"),
            Kernel::P2pOneShotLl => include_str!("p2p_oneshot_ll.ptx"),
            Kernel::P2pTwoShotPush => include_str!("p2p_twoshot_push.ptx"),
            Kernel::P2pTwoShotCe => include_str!("p2p_twoshot_ce.ptx"),
        }
    }

    /// The PTX this process loads: the committed text. With the non-default feature
    /// `ptx-override` (kernel tuning on a GPU machine without rebuilding; the A/B scripts in
    /// `bench/`), the file of the same name in the folder named by `CUDA_MULTIMEM_PTX_DIR`
    /// instead, when that variable is set (it must declare the same entries and parameters).
    pub fn load_text(self) -> std::io::Result<std::borrow::Cow<'static, str>> {
        #[cfg(feature = "ptx-override")]
        if let Some(dir) = std::env::var_os(PTX_DIR_ENV) {
            return Ok(
                std::fs::read_to_string(std::path::Path::new(&dir).join(self.file()))?.into(),
            );
        }
        Ok(self.ptx().into())
    }

    /// The entry name of one variant.
    pub fn entry(self, dtype: DType, op: Op) -> String {
        format!("cmm_{}_{}_{}", self.tag(), dtype.name(), op.name())
    }
}

/// Vectors of one rank's part in the copy-engine two-shot: ceil(units / n) rounded up to 8 (the
/// host copies part k = [k * P, min((k + 1) * P, units)) of every input to rank k).
pub fn ce_part_units(units: u64, n: u64) -> u64 {
    units.div_ceil(n).next_multiple_of(8)
}
