//! Collectives for teams of NVLink-connected GPUs — allreduce, reduce-scatter, all-gather,
//! broadcast, all-to-all and allreduce fused with residual add + RMSNorm — through one typed
//! [`Communicator`] that chooses per call between peer-to-peer kernels (every rank's memory
//! mapped on every peer) and `multimem` kernels (NVLink multicast, where it is allowed and pays
//! off), on symmetric buffers or on the caller's own device memory; graph-safe (counters that
//! only grow, nothing reset from the host), with bounded waits instead of hangs. Every call goes
//! through one funnel — one description, one check, one planner, executors — so what
//! [`Communicator::choice`] reports is what a call runs (`docs/architecture.md`).
//!
//! ```
//! # #[cfg(feature = "sim")] {
//! use cuda_multimem::Stream;
//! use cuda_multimem_collectives::{Communicator, ReduceOp};
//! use cuda_multimem_collectives::testing::{reference};
//! use half::bf16;
//! cuda_multimem_collectives::sim::install();
//! let driver = cuda_multimem_sim::simulated_driver(cuda_multimem_sim::SimConfig::new(2, 13000))?;
//! let devices = driver.devices();
//! let comm = Communicator::new(&devices)?;
//! let mut buf = comm.alloc::<bf16>(1024)?;
//! let inputs: Vec<Vec<bf16>> = (0..2)
//!     .map(|r| (0..1024).map(|i| bf16::from_f32((i * (r + 1)) as f32 / 64.0)).collect())
//!     .collect();
//! let streams: Vec<Stream> = devices.iter().map(Stream::new).collect::<Result<_, _>>()?;
//! for (rank, s) in streams.iter().enumerate() {
//!     buf.write(rank, 0, &inputs[rank])?;
//!     let choice = comm.rank(rank)?.all_reduce_in_place(&mut buf, ReduceOp::Sum, s)?;
//!     println!("rank {rank}: {choice}");
//! }
//! for s in &streams { s.synchronize()?; }
//! comm.check()?;
//! let expected = reference(ReduceOp::Sum, &[&inputs[0], &inputs[1]]);
//! assert_eq!(buf.to_vec(1)?, expected);
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Operands are [`SymmetricBuffer`]s and their views ([`SymSlice`], [`SymSliceMut`]), which the
//! peer-to-peer kernels use in place (the multimem path copies through its team's regions), or
//! the caller's own memory: a [`cuda_multimem::DeviceBuffer`], cudarc's `CudaSlice`,
//! `CudaView` and `CudaViewMut` (feature `cudarc`), an engine's own tensor type, or a raw pointer
//! under `unsafe` ([`Src::from_raw`]). Every collective takes any [`IntoSrc`] / [`IntoDst`] and
//! any [`IntoStream`] (our streams; with `cudarc`, a `&CudaStream`): the conversion runs inside
//! the call once its stream is known, and what an operand keeps alive for the call — cudarc's
//! guard, which records the call's use for cudarc's event tracking — is dropped when the call
//! returns. An engine on cudarc implements the two traits for its tensor type (on a GPU with
//! [`Src::from_cudarc`], on the simulator with a `DeviceBuffer`), so that one generic code path
//! is tested without a GPU: `examples/cudarc_engine.rs`. cudarc's linkage and CUDA version are
//! the application's (only its driver API is used): the feature builds beside candle's
//! `dynamic-linking` and `cuda-version-from-build-system`. Engines with a run-time element type
//! use [`RankHandle::all_reduce_dyn`] on byte views. The protocol, what each operand kind costs,
//! and the memory-ordering argument: `docs/design/allreduce.md`.
//!
//! Reduce-scatter, all-gather and broadcast ([`RankHandle::reduce_scatter`],
//! [`RankHandle::all_gather`], [`RankHandle::broadcast`] and their in-place forms) take the same
//! operands: `docs/design/collectives.md`; the fused norm
//! ([`RankHandle::all_reduce_add_rms_norm`]): `docs/design/rmsnorm.md`; all-to-all of any
//! element type ([`RankHandle::all_to_all`], [`RankHandle::all_to_all_in_place`],
//! [`RankHandle::all_to_all_v`] with counts on the host, [`RankHandle::all_to_all_v_dev`] with
//! counts on the device): `docs/design/alltoall.md`; MoE dispatch / combine through a plan
//! built once per shape ([`MoeShape`], [`MoePlan`], [`RankHandle::moe_dispatch`],
//! [`RankHandle::moe_combine`]): the same page, "MoE dispatch and combine".
//!
//! Teams have 1 to [`kernels::MAX_RANKS`] = 72 ranks, one NVL72 domain (a team of one runs every
//! collective as a local copy; where the size stops and why: the [`kernels`] module); several ranks
//! may share a device ([`CommunicatorBuilder::allow_shared_devices`]); a rank's calls take any
//! stream of its device (a call on another stream than the previous one waits for it on the
//! GPU). A timeout or a disagreement is reported by the next call of the rank (its kernels
//! mirror the error word to the host; no `check` needed) and makes the team unusable until
//! every rank calls [`Communicator::recover`]; each rank's first call waits
//! [`Communicator::first_call_timeout`] (at least the bootstrap's timeout) for uneven starts. The devices must be of compute capability 9.0 or newer with a CUDA
//! 12.1 driver or newer (checked at build: [`cuda_multimem::Error::HardwareTooOld`]).

#![deny(missing_docs)]
// `usize::is_multiple_of` needs Rust 1.87; the code keeps `%` for older toolchains.
#![allow(clippy::manual_is_multiple_of)]

pub mod bootstrap;
mod buffer;
mod call;
mod comm;
mod config;
mod engine;
mod exec;
mod fp8;
pub mod hier;
pub mod kernels;
mod moe;
pub mod nccl;
mod operand;
mod reference;
mod reference_moe;
#[cfg(feature = "sim")]
pub mod sim;
mod team;
mod types;

#[cfg(feature = "mpi")]
pub use bootstrap::MpiBootstrap;
pub use bootstrap::{Bootstrap, UnixBootstrap};
pub use buffer::{SymPartMut, SymSlice, SymSliceMut, SymmetricBuffer};
pub use comm::{Communicator, CommunicatorBuilder, RankHandle};
pub use config::CommConfig;
/// The stream side of a call, re-exported from `cuda-multimem`: what every collective takes as
/// its stream ([`IntoStream`]) and what an operand's conversion sees of it ([`CallStream`]).
pub use cuda_multimem::{CallStream, IntoStream};
pub use fp8::{Fp8Out, Fp8Scales};
#[cfg(feature = "sim")]
pub use hier::HostCrossDomainDouble;
pub use hier::{
    CrossDomain, HierBuilder, HierCommunicator, HierLayout, NcclCrossDomain, Rail, RankOrder,
};
pub use kernels::multimem::supported as multimem_supports;
pub use moe::{MoePlan, MoeProtocol, MoeScales, MoeShape};
pub use nccl::{Nccl, NcclComm, NcclUniqueId};
pub use operand::{Dst, IntoDst, IntoSrc, Src};
/// Test helpers, apart from the library's API: the host references every collective is checked
/// against (bit for bit where the order of operations is the kernels'; the FP8 quantisation and
/// the MoE dispatch and combine included) and the random inputs the suite draws. For the tests
/// of your own code that calls the collectives (on the simulator: `docs/simulator.md`); the
/// library itself never calls them.
pub mod testing {
    pub use crate::reference::{
        add_rms_norm_fp8_reference, add_rms_norm_reference, all_gather_reference,
        broadcast_reference, fp8_amax, fp8_e4m3, fp8_quantise, fp8_quantise_row, fp8_scale,
        next_random, random_bytes, random_input, reduce_scatter_reference, reference,
        reference_bytes, rms_norm_within_tolerance, rms_scale, ue8m0_byte, ue8m0_pack,
        Fp8NormReference,
    };
    pub use crate::reference_moe::{
        moe_combine_reference, moe_dispatch_reference, moe_ids_out_of_range, MoeDispatched,
    };
}
pub use types::{
    multimem_pays_off, Acc, Algorithm, Choice, DType, Element, Fp8Scaling, MulticastPolicy,
    Operands, Path, ReduceOp, FP8_E4M3_MAX, FP8_GROUP,
};

/// The FP8 types (the `float8` crate, which candle uses): reduced (accumulated in f32) and
/// moved by every collective but the fused norm.
pub use float8;
/// The FP8 element type of the quantised norm outputs, re-exported from the `float8` crate.
pub use float8::F8E4M3;

/// The element types, re-exported from the `half` crate.
pub use half::{bf16, f16};
