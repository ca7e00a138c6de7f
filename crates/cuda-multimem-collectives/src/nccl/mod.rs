//! NCCL, loaded at run time: the few types and functions the collectives across NVLink domains
//! need, declared by hand against NCCL 2.28's `nccl.h`, and a communicator whose every blocking
//! step (initialisation, completion of a call, teardown) waits with a deadline.
//!
//! Nothing links against NCCL. [`Nccl::load`] opens the library named by `CUDA_MULTIMEM_NCCL`
//! ([`NCCL_ENV`]), else `libnccl.so.2`, then `libnccl.so`, and resolves every function it uses
//! at once: a missing library or a library without one of them (a path to something that is
//! not NCCL) is [`cuda_multimem::Error::NcclUnavailable`], naming the paths tried and the fix; never a panic.
//!
//! Communicators are nonblocking (`ncclConfig_t.blocking = 0`): NCCL returns `ncclInProgress`
//! and this module polls `ncclCommGetAsyncError` until the call is done or the deadline passes;
//! then, and on any NCCL error, the communicator is aborted (`ncclCommAbort`) and the error is
//! ours ([`cuda_multimem::Error::Timeout`], [`cuda_multimem::Error::Nccl`]). Collectives are enqueued on the caller's stream
//! and are captured by CUDA graphs like any other stream work.

mod comm;
mod ffi;
mod library;

pub use comm::NcclComm;
pub use ffi::NcclUniqueId;
pub use library::Nccl;

/// The environment variable naming an explicit NCCL library path.
pub const NCCL_ENV: &str = "CUDA_MULTIMEM_NCCL";

/// Library names tried, in order, when [`NCCL_ENV`] is unset.
pub const NCCL_CANDIDATES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// The oldest NCCL this module drives: nonblocking communicators, `ncclCommInitRankConfig` and
/// `ncclCommFinalize` appeared in 2.14.
pub const NCCL_MIN_VERSION: i32 = 21400;
