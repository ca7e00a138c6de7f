//! Allreduce for teams of NVLink-connected GPUs: peer-to-peer one-shot and two-shot kernels on
//! symmetric memory (every rank's buffer mapped on every peer), graph-safe (barrier epochs that
//! only grow, nothing reset from the host), with timeouts instead of hangs.
//!
//! A [`Communicator`] is built over a team of devices driven by this process. It owns a signal
//! pad and a staging area per rank, and hands out [`SymmetricBuffer`]s: one allocation per rank,
//! mapped on every peer. An allreduce reads and writes such buffers (in place or out of place),
//! on the stream the caller gives, so it can be captured into a CUDA graph:
//!
//! ```
//! # #[cfg(feature = "sim")] {
//! use cuda_multimem::{Driver, Stream};
//! use cuda_multimem_collectives::{Communicator, DType, Op};
//! let driver = cuda_multimem_sim::simulated_driver(cuda_multimem_sim::SimConfig::new(2, 13000))?;
//! let devices = driver.devices();
//! let comm = Communicator::new(&devices)?;
//! let buf = comm.alloc(1024 * 4)?;
//! let streams: Vec<Stream> = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
//! for (rank, s) in streams.iter().enumerate() {
//!     let data: Vec<u8> = (0..1024u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
//!     buf.copy_from_host(rank, &data)?;
//!     comm.all_reduce(rank, &buf, 0, &buf, 0, 1024, DType::F32, Op::Sum, s)?;
//! }
//! for s in &streams { s.synchronize()?; }
//! comm.check()?;
//! let mut out = vec![0u8; 4096];
//! buf.copy_to_host(1, &mut out)?;
//! assert_eq!(f32::from_le_bytes(out[4..8].try_into().unwrap()), 2.0);
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The protocol and its memory-ordering argument: `docs/design/allreduce.md`.

#![deny(missing_docs)]
// `usize::is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#![allow(clippy::manual_is_multiple_of)]

pub mod bootstrap;
mod comm;
pub mod half;
pub mod kernels;
pub mod multimem;
#[cfg(feature = "sim")]
mod sim;

#[cfg(feature = "mpi")]
pub use bootstrap::MpiBootstrap;
pub use bootstrap::{Bootstrap, UnixBootstrap};
pub use comm::{AllReduceConfig, Choice, Communicator, SymmetricBuffer};
pub use multimem::{multimem_pays_off, MultimemAllReduce};

/// Element types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// IEEE half (accumulated in f32).
    F16,
    /// bfloat16 (accumulated in f32).
    Bf16,
}

impl DType {
    /// Every type.
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    /// Short name (`f32`, `f16`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        }
    }

    fn code(self) -> u64 {
        self as u64
    }
}

/// Reduction operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Sum (in rank order 0, 1, ..., so every rank gets bit-identical results).
    Sum,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
}

impl Op {
    /// Every operator.
    pub const ALL: [Op; 3] = [Op::Sum, Op::Min, Op::Max];

    /// Short name (`sum`, `min`, `max`).
    pub fn name(self) -> &'static str {
        match self {
            Op::Sum => "sum",
            Op::Min => "min",
            Op::Max => "max",
        }
    }

    /// Apply to two f32 values, exactly as the kernels do (`add.rn.f32`, `min.f32`, `max.f32`).
    pub fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            Op::Sum => a + b,
            Op::Min => {
                if a.is_nan() {
                    b
                } else if b.is_nan() || a < b || (a == b && a.is_sign_negative()) {
                    a
                } else {
                    b
                }
            }
            Op::Max => {
                if a.is_nan() {
                    b
                } else if b.is_nan() || a > b || (a == b && b.is_sign_negative()) {
                    a
                } else {
                    b
                }
            }
        }
    }

    fn code(self) -> u64 {
        self as u64
    }
}

/// How the data travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// Loads and stores through peer mappings (NVLink P2P).
    PeerToPeer,
    /// `multimem` loads, stores and reductions through a multicast address (NVLink SHARP).
    Multimem,
}

/// Which algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Each rank reduces the whole message (small messages; one barrier).
    OneShot,
    /// Each rank reduces 1/N of the message and stores it on every rank (medium and large).
    TwoShot,
    /// One-shot with the low-latency protocol (small messages): data travel with a flag in
    /// 8-byte stores, receivers poll the data, no barrier. Needs 4-byte aligned operands and a
    /// whole number of 4-byte words; otherwise the call runs [`Algorithm::OneShot`].
    OneShotLl,
    /// Two-shot whose remote traffic is only posted writes: each rank pushes the parts of its
    /// input to their owners' staging, owners reduce locally and push the results, in rounds
    /// through fixed-size staging slots ([`crate::AllReduceConfig::stage_bytes`]). The default
    /// above the one-shot limit. Needs 16-byte aligned operands; otherwise the call runs
    /// [`Algorithm::TwoShot`].
    TwoShotPush,
    /// Two-shot whose first half goes through the copy engines: each rank's part k of its
    /// input is copied (`cuMemcpyDtoDAsync`, on the caller's stream, before the kernel) into
    /// rank k's landing area; the kernel meets its peers, reduces its part there and pushes the
    /// result to every output. Chosen up to [`crate::AllReduceConfig::ce_max_bytes`] (off by
    /// default). Needs 16-byte aligned operands; otherwise the call runs
    /// [`Algorithm::TwoShot`].
    TwoShotCe,
}

impl std::fmt::Display for Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Path::PeerToPeer => "peer-to-peer",
            Path::Multimem => "multimem",
        })
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Algorithm::OneShot => "one-shot",
            Algorithm::TwoShot => "two-shot",
            Algorithm::OneShotLl => "one-shot-ll",
            Algorithm::TwoShotPush => "two-shot-push",
            Algorithm::TwoShotCe => "two-shot-ce",
        })
    }
}

/// `count` random elements of `dtype` in [-1, 1) (raw little-endian), drawn from the xorshift
/// generator whose state is `state` (non-zero; it advances): test data for the examples and
/// benchmarks, to check against [`reference()`].
pub fn random_input(dtype: DType, count: usize, state: &mut u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(count * dtype.size());
    for _ in 0..count {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        half::store(
            dtype,
            &mut v,
            ((*state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0,
        );
    }
    v
}

/// Reduce `inputs` (one slice of raw little-endian elements per rank) in rank order, as the
/// kernels do: the host reference for tests and examples.
pub fn reference(dtype: DType, op: Op, inputs: &[&[u8]]) -> Vec<u8> {
    let n = inputs.first().map_or(0, |i| i.len() / dtype.size());
    let mut out = Vec::with_capacity(n * dtype.size());
    for e in 0..n {
        let mut acc = half::load(dtype, inputs[0], e);
        for inp in &inputs[1..] {
            acc = op.apply(acc, half::load(dtype, inp, e));
        }
        half::store(dtype, &mut out, acc);
    }
    out
}
