//! The cross-domain step: the trait, NCCL's implementation, and the rail a factory receives.

use cuda_multimem::sys::CUdeviceptr;
use cuda_multimem::{Device, Result, StreamRef};

use crate::bootstrap::Bootstrap;
use crate::nccl::NcclComm;
use crate::types::{DType, ReduceOp};

/// The step across domains, on one rail (one rank of each domain): NCCL in production
/// ([`NcclCrossDomain`]), a host-side stand-in in tests (`HostCrossDomainDouble` (feature `sim`)), or an
/// engine's own. Calls are enqueued on `stream` where the implementation can (NCCL), and every
/// rank of the rail makes the same calls in the same order.
pub trait CrossDomain: Send + Sync {
    /// What it is, for messages (`"nccl 2.28.9"`).
    fn name(&self) -> String;
    /// This rank's position on the rail (its domain index).
    fn rail_rank(&self) -> usize;
    /// Ranks on the rail (the number of domains).
    fn rail_size(&self) -> usize;
    /// Whether its calls can be captured into a CUDA graph.
    fn graph_capturable(&self) -> bool;

    /// Allreduce `count` elements from `send` into `recv` (equal: in place).
    ///
    /// # Safety
    /// `send` and `recv` are device memory of the rank's device valid for `count` elements of
    /// `dtype` until the work queued on `stream` has run.
    unsafe fn all_reduce(
        &self,
        dtype: DType,
        op: ReduceOp,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()>;

    /// Reduce-scatter: `send` holds `rail_size · recv_count` elements, `recv` (which may be
    /// `send + rail_rank · recv_count`: in place) gets this rank's `recv_count`.
    ///
    /// # Safety
    /// As [`CrossDomain::all_reduce`], for those lengths.
    unsafe fn reduce_scatter(
        &self,
        dtype: DType,
        op: ReduceOp,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        recv_count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()>;

    /// All-gather: `send` holds `send_count` elements (it may be `recv + rail_rank ·
    /// send_count`: in place), `recv` gets `rail_size · send_count`.
    ///
    /// # Safety
    /// As [`CrossDomain::all_reduce`], for those lengths.
    unsafe fn all_gather(
        &self,
        dtype: DType,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        send_count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()>;

    /// Report an asynchronous failure of earlier calls (synchronise the stream first).
    fn check(&self) -> Result<()>;
}

/// The cross-domain step over an NCCL communicator of the rail.
#[derive(Debug)]
pub struct NcclCrossDomain {
    comm: NcclComm,
}

impl NcclCrossDomain {
    /// Over an existing rail communicator (its ranks are the rail's, by domain).
    pub fn new(comm: NcclComm) -> NcclCrossDomain {
        NcclCrossDomain { comm }
    }

    /// The NCCL communicator.
    pub fn comm(&self) -> &NcclComm {
        &self.comm
    }
}

impl CrossDomain for NcclCrossDomain {
    fn name(&self) -> String {
        format!("nccl {}", self.comm.nccl().version_string())
    }
    fn rail_rank(&self) -> usize {
        self.comm.rank()
    }
    fn rail_size(&self) -> usize {
        self.comm.size()
    }
    fn graph_capturable(&self) -> bool {
        true
    }
    unsafe fn all_reduce(
        &self,
        dtype: DType,
        op: ReduceOp,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.comm
                .all_reduce_raw(dtype, op, send, recv, count, stream)
        }
    }
    unsafe fn reduce_scatter(
        &self,
        dtype: DType,
        op: ReduceOp,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        recv_count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.comm
                .reduce_scatter_raw(dtype, op, send, recv, recv_count, stream)
        }
    }
    unsafe fn all_gather(
        &self,
        dtype: DType,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        send_count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.comm
                .all_gather_raw(dtype, send, recv, send_count, stream)
        }
    }
    fn check(&self) -> Result<()> {
        self.comm.check()
    }
}

/// A rail, as the builder hands it to a custom cross-domain factory
/// ([`crate::HierBuilder::cross_domain_with`]).
pub struct Rail {
    /// This rank's position on the rail (its domain index).
    pub rank: usize,
    /// Ranks on the rail (domains).
    pub size: usize,
    /// Index of the rail (the local index of its ranks in their domains).
    pub index: usize,
    /// A bootstrap over the rail's ranks (every exchange involves the whole team, see
    /// [`crate::HierCommunicator`]).
    pub bootstrap: Box<dyn Bootstrap>,
    /// This rank's device.
    pub device: Device,
}

impl std::fmt::Debug for Rail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Rail({} of {}, rail {})",
            self.rank, self.size, self.index
        )
    }
}
