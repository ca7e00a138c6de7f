//! The host test double of the cross-domain step (feature `sim`).

use cuda_multimem::sys::CUdeviceptr;
use cuda_multimem::{Device, Error, Result, StreamRef};

use super::cross::CrossDomain;
use crate::bootstrap::Bootstrap;
use crate::reference::reference_bytes;
use crate::types::{DType, ReduceOp};

/// A **test double** for the cross-domain step: it synchronises the stream, copies the operand
/// to the host, exchanges it with the rail through the bootstrap, reduces on the host (in rail
/// order, accumulating in f32 and rounding once, as [`crate::testing::reference_bytes`]) and copies the
/// result back. It makes the hierarchy testable where NCCL cannot run (the simulated driver);
/// it is slow and cannot be captured into a graph. Never use it for real work.
pub struct HostCrossDomainDouble {
    rail: Box<dyn Bootstrap>,
    device: Device,
}

impl std::fmt::Debug for HostCrossDomainDouble {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HostCrossDomainDouble(rail rank {} of {})",
            self.rail.rank(),
            self.rail.size()
        )
    }
}

impl HostCrossDomainDouble {
    /// Over the rail's bootstrap, for `device`.
    pub fn new(rail: Box<dyn Bootstrap>, device: &Device) -> HostCrossDomainDouble {
        HostCrossDomainDouble {
            rail,
            device: device.clone(),
        }
    }

    /// Every rail rank's `bytes` at `ptr` (after the stream's work).
    fn gather(
        &self,
        ptr: CUdeviceptr,
        bytes: usize,
        stream: &StreamRef<'_>,
    ) -> Result<Vec<Vec<u8>>> {
        stream.synchronize()?;
        let mut mine = vec![0u8; bytes];
        // SAFETY: the caller of the trait method promised `bytes` readable at `ptr`.
        unsafe { self.device.copy_to_host(ptr, &mut mine) }?;
        let all = self.rail.all_gather(&mine)?;
        if let Some((r, _)) = all.iter().enumerate().find(|(_, a)| a.len() != bytes) {
            return Err(Error::Peer {
                rank: r,
                reason: format!("sent a different length on the rail; expected {bytes} bytes"),
            });
        }
        Ok(all)
    }
}

impl CrossDomain for HostCrossDomainDouble {
    fn name(&self) -> String {
        "host test double".into()
    }
    fn rail_rank(&self) -> usize {
        self.rail.rank()
    }
    fn rail_size(&self) -> usize {
        self.rail.size()
    }
    fn graph_capturable(&self) -> bool {
        false
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
        let all = self.gather(send, count * dtype.size(), stream)?;
        let refs: Vec<&[u8]> = all.iter().map(|a| a.as_slice()).collect();
        let out = reference_bytes(dtype, op, &refs);
        // SAFETY: the caller promised `recv`.
        unsafe { self.device.copy_from_host_blocking(recv, &out) }
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
        let (es, m) = (dtype.size(), self.rail.size());
        let all = self.gather(send, m * recv_count * es, stream)?;
        let r = self.rail.rank();
        let refs: Vec<&[u8]> = all
            .iter()
            .map(|a| &a[r * recv_count * es..(r + 1) * recv_count * es])
            .collect();
        let out = reference_bytes(dtype, op, &refs);
        // SAFETY: the caller promised `recv`.
        unsafe { self.device.copy_from_host_blocking(recv, &out) }
    }
    unsafe fn all_gather(
        &self,
        dtype: DType,
        send: CUdeviceptr,
        recv: CUdeviceptr,
        send_count: usize,
        stream: &StreamRef<'_>,
    ) -> Result<()> {
        let all = self.gather(send, send_count * dtype.size(), stream)?;
        let out: Vec<u8> = all.concat();
        // SAFETY: the caller promised `recv`.
        unsafe { self.device.copy_from_host_blocking(recv, &out) }
    }
    fn check(&self) -> Result<()> {
        Ok(())
    }
}
