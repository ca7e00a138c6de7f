//! Launch shapes: how many blocks of how many threads each kernel family runs for a size, from
//! what every rank shares (the team's facts and the configuration), so that every rank
//! launches the same grid.

use crate::config::CommConfig;
use crate::kernels::gather::{ll_words, staged_max_blocks, Collective};
use crate::kernels::norm::{self as nk, NormKernel};
use crate::kernels::MAX_BLOCKS;
use crate::types::{Algorithm, Choice, Path};

use super::TeamFacts;

/// Blocks and threads of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    pub(crate) blocks: u32,
    pub(crate) threads: u32,
}

impl Shape {
    /// What a call reports for a launch of this shape.
    pub(crate) fn choice(self, path: Path, algorithm: Algorithm, staged_chunks: u32) -> Choice {
        Choice {
            path,
            algorithm,
            blocks: self.blocks,
            threads: self.threads,
            staged_chunks,
        }
    }
}

/// One block per multiprocessor, a power of two of them (block ranges of power-of-two messages
/// stay whole lines and the rounds even), or `config.max_blocks`; at most the team's block cap
/// (ranks sharing devices), rounded down to a power of two.
fn pow2_blocks(t: &TeamFacts, c: &CommConfig) -> u64 {
    let b = if c.max_blocks != 0 {
        c.max_blocks as u64
    } else {
        1u64 << t.multiprocessors.clamp(1, MAX_BLOCKS as u32).ilog2()
    };
    if b > t.block_cap as u64 {
        1u64 << t.block_cap.max(1).ilog2()
    } else {
        b
    }
}

/// Two blocks per multiprocessor (at most `MAX_BLOCKS`), or `config.max_blocks`; at most the
/// team's block cap (ranks sharing devices).
fn twice_blocks(t: &TeamFacts, c: &CommConfig) -> u64 {
    let b = if c.max_blocks != 0 {
        c.max_blocks as u64
    } else {
        (2 * t.multiprocessors).min(MAX_BLOCKS as u32) as u64
    };
    b.min(t.block_cap.max(1) as u64)
}

/// Blocks for `per_rank` units of at most `max_threads` per block, at most `max_blocks`; then
/// threads for the units of a block: a multiple of 32 from 64 to `max_threads`.
fn fit(per_rank: u64, max_threads: u64, max_blocks: u64, cap: Option<u64>) -> Shape {
    let mut blocks = per_rank.div_ceil(max_threads).clamp(1, max_blocks);
    if let Some(cap) = cap {
        blocks = blocks.min(cap).max(1);
    }
    // Small messages: fewer threads (cheaper block barriers), at least 64.
    let threads = per_rank
        .div_ceil(blocks)
        .next_multiple_of(32)
        .clamp(64, max_threads.max(64));
    Shape {
        blocks: blocks as u32,
        threads: threads as u32,
    }
}

/// A peer-to-peer allreduce kernel of `algorithm` over `bytes`.
pub(crate) fn all_reduce(
    t: &TeamFacts,
    c: &CommConfig,
    bytes: usize,
    algorithm: Algorithm,
) -> Shape {
    let n = t.n as u64;
    let push = matches!(algorithm, Algorithm::TwoShotPush | Algorithm::TwoShotCe);
    let max_blocks = if push {
        pow2_blocks(t, c)
    } else {
        twice_blocks(t, c)
    };
    let max_threads = if push { c.push_threads } else { c.threads } as u64;
    let units = bytes.div_ceil(16) as u64;
    let per_rank = match algorithm {
        Algorithm::OneShotLl => bytes.div_ceil(4) as u64,
        Algorithm::TwoShot | Algorithm::TwoShotPush | Algorithm::TwoShotCe => units.div_ceil(n),
        _ => units,
    };
    // every block of the write-only two-shot owns at least 8 vectors (128 bytes) of each
    // staging slot
    let cap = (algorithm == Algorithm::TwoShotPush).then_some(t.stage_half as u64 / 128);
    fit(per_rank, max_threads, max_blocks, cap)
}

/// A peer-to-peer reduce-scatter, all-gather or broadcast kernel of `algorithm` for
/// `chunk_bytes` per rank (reduce-scatter: the output; all-gather: the input; broadcast: the
/// message).
pub(crate) fn gather(
    t: &TeamFacts,
    c: &CommConfig,
    chunk_bytes: usize,
    algorithm: Algorithm,
) -> Shape {
    // the low-latency form: one 4-byte word per thread, up to `threads` per block (as the
    // low-latency allreduce); the others: 16-byte units, up to `push_threads`
    let (units, max_threads) = match algorithm {
        Algorithm::PushLl => (ll_words(chunk_bytes as u64), c.threads as u64),
        _ => (chunk_bytes.div_ceil(16) as u64, c.push_threads as u64),
    };
    // every block of the staged form owns at least 128 bytes of each staging sub-slot
    let cap = (algorithm == Algorithm::PushStaged).then(|| staged_max_blocks(t.stage_half as u64));
    fit(units, max_threads, pow2_blocks(t, c), cap)
}

/// An all-to-all kernel of `algorithm` whose largest part is `part_bytes`: the low-latency form
/// one 4-byte word per thread, up to `threads`; the direct form 16-byte units, up to
/// `push_threads`; blocks a power of two of the multiprocessors at most (and the team's cap).
pub(crate) fn all_to_all(
    t: &TeamFacts,
    c: &CommConfig,
    part_bytes: usize,
    algorithm: Algorithm,
) -> Shape {
    let (units, max_threads) = match algorithm {
        Algorithm::AllToAllLl => ((part_bytes as u64).div_ceil(4), c.threads as u64),
        _ => ((part_bytes as u64).div_ceil(16), c.push_threads as u64),
    };
    fit(units, max_threads, pow2_blocks(t, c), None)
}

/// The MoE kernels: blocks a power of two of the multiprocessors at most (and the team's cap),
/// `push_threads` threads (16-byte units of a row per thread).
pub(crate) fn moe(t: &TeamFacts, c: &CommConfig) -> Shape {
    fit(u64::MAX / 2, c.push_threads as u64, pow2_blocks(t, c), None)
}

/// The copy-engine form's one barrier block.
pub(crate) const COPY_ENGINE: Shape = Shape {
    blocks: 1,
    threads: 32,
};

/// The copy-engine form's local copy kernel (on the rank's second stream) for `bytes`.
pub(crate) fn copy_engine_local(t: &TeamFacts, bytes: usize) -> Shape {
    Shape {
        blocks: ((bytes as u64 / 16).div_ceil(512)).clamp(1, 2 * t.multiprocessors.max(1) as u64)
            as u32,
        threads: 512,
    }
}

/// The multimem allreduce's form and shape for one chunk of `bytes`.
pub(crate) fn mm_all_reduce(t: &TeamFacts, c: &CommConfig, bytes: usize) -> (Algorithm, Shape) {
    let one_shot_max = c.one_shot_max_bytes.unwrap_or(256 << 10);
    let algorithm = match c.algorithm {
        // the low-latency protocol is a peer-to-peer protocol; multimem runs one-shot
        Some(Algorithm::OneShotLl | Algorithm::OneShot) => Algorithm::OneShot,
        Some(_) => Algorithm::TwoShot,
        None if bytes <= one_shot_max => Algorithm::OneShot,
        None => Algorithm::TwoShot,
    };
    let units = bytes.div_ceil(16) as u64;
    let per_rank = match algorithm {
        Algorithm::OneShot => units,
        _ => units.div_ceil(t.n as u64),
    };
    (
        algorithm,
        fit(per_rank, c.threads as u64, twice_blocks(t, c), None),
    )
}

/// A multimem reduce-scatter, all-gather or broadcast kernel for one window of `bytes` per
/// rank: every rank moves (or reduces) all of its window, so the shape of the one-shot
/// allreduce over the same bytes. Reduce-scatter reduces its chunk through the multicast
/// address into its own output ([`Algorithm::LoadReduce`]); all-gather and broadcast store
/// into every rank's output through it ([`Algorithm::PushDirect`]).
pub(crate) fn mm_gather(
    t: &TeamFacts,
    c: &CommConfig,
    coll: Collective,
    bytes: usize,
) -> (Algorithm, Shape) {
    let units = bytes.div_ceil(16) as u64;
    let algorithm = match coll {
        Collective::ReduceScatter => Algorithm::LoadReduce,
        _ => Algorithm::PushDirect,
    };
    (
        algorithm,
        fit(units, c.threads as u64, twice_blocks(t, c), None),
    )
}

/// Threads per block of a norm row: one per unit of a row (16-byte vectors, or elements when a
/// row is not 16-byte aligned), a multiple of 32 from 64 to 1024.
pub(crate) fn norm_threads(row_bytes: usize, es: usize) -> u32 {
    let units = if row_bytes % 16 == 0 {
        row_bytes / 16
    } else {
        row_bytes / es
    };
    units.next_multiple_of(32).clamp(64, 1024) as u32
}

/// Most blocks of a norm launch: `config.max_blocks`, else two per multiprocessor (at most
/// `MAX_BLOCKS`).
pub(crate) fn norm_max_blocks(t: &TeamFacts, c: &CommConfig) -> usize {
    twice_blocks(t, c) as usize
}

/// A fused norm launch of form `k` over `rows` rows of `row_bytes` bytes of `es`-byte elements.
pub(crate) fn norm(
    t: &TeamFacts,
    c: &CommConfig,
    k: NormKernel,
    rows: usize,
    row_bytes: usize,
    es: usize,
) -> Shape {
    if matches!(k, NormKernel::OneShotLlSplit | NormKernel::OneShotSplit) {
        // a slice's units: 16-byte vectors, or its elements when rows are not 16-byte
        // multiples
        let per16 = nk::split_units(row_bytes.div_ceil(16) as u64) as usize;
        let slice = if row_bytes % 16 == 0 {
            per16
        } else {
            per16 * 16 / es
        };
        return Shape {
            blocks: (rows * nk::SPLIT) as u32,
            threads: slice.next_multiple_of(32).clamp(64, 1024) as u32,
        };
    }
    let per_block = match k {
        NormKernel::TwoShot => nk::part_rows(rows as u64, t.n as u64) as usize,
        _ => rows,
    };
    Shape {
        blocks: per_block.clamp(1, norm_max_blocks(t, c)) as u32,
        threads: norm_threads(row_bytes, es),
    }
}
