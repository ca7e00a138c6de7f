//! CI only: cuda-multimem's `cudarc` features beside cudarc taken as candle-core takes it. This
//! compiles when cargo resolves one cudarc for candle's features and ours (`dynamic-linking`,
//! `cuda-version-from-build-system` and candle's libraries, where ours ask for the driver API
//! only) and when candle's slices and streams are what our collectives take. It is never run.

use cuda_multimem_collectives::{HierCommunicator, RankHandle, ReduceOp};
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;

/// What one rank of a candle-based engine does with its cudarc buffers: every collective, in
/// place and out of place, on cudarc slices, views and a cudarc stream.
pub fn every_collective(
    h: &RankHandle<'_>,
    x: &mut CudaSlice<bf16>,
    all: &mut CudaSlice<bf16>,
    residual: &mut CudaSlice<bf16>,
    weight: &CudaSlice<bf16>,
    stream: &std::sync::Arc<CudaStream>,
) -> cuda_multimem::Result<()> {
    let n = h.device().ordinal() as usize + 2;
    let chunk = x.len();
    h.all_reduce_in_place(&mut *x, ReduceOp::Sum, stream)?;
    h.all_reduce(&*x, all.slice_mut(0..chunk), ReduceOp::Max, stream)?;
    h.reduce_scatter(&*all, &mut *x, ReduceOp::Sum, stream)?;
    h.reduce_scatter_in_place(&mut *all, ReduceOp::Sum, stream)?;
    h.all_gather(x.slice(0..chunk), &mut *all, stream)?;
    h.all_gather_in_place(all.slice_mut(0..n * chunk), stream)?;
    h.broadcast(&*x, all.slice_mut(0..chunk), 0, stream)?;
    h.broadcast_in_place(&mut *x, 0, stream)?;
    let mut out = stream
        .alloc_zeros::<bf16>(chunk)
        .map_err(|e| cuda_multimem::Error::invalid("out", e.to_string()))?;
    h.all_reduce_add_rms_norm(&*x, &mut *residual, weight, &mut out, 64, 1e-6, stream)?;
    h.add_rms_norm(&*x, &mut *residual, weight, &mut out, 64, 1e-6, stream)?;
    let mut bytes = stream
        .alloc_zeros::<u8>(2 * chunk)
        .map_err(|e| cuda_multimem::Error::invalid("bytes", e.to_string()))?;
    h.all_reduce_dyn_in_place(
        cuda_multimem_collectives::DType::Bf16,
        &mut bytes,
        ReduceOp::Sum,
        stream,
    )?;
    Ok(())
}

/// The hierarchical communicator on the same cudarc types.
pub fn hierarchical(
    c: &HierCommunicator,
    x: &mut CudaSlice<bf16>,
    all: &mut CudaSlice<bf16>,
    stream: &CudaStream,
) -> cuda_multimem::Result<()> {
    c.all_reduce_in_place(&mut *x, ReduceOp::Sum, stream)?;
    c.reduce_scatter(&*all, &mut *x, ReduceOp::Sum, stream)?;
    c.all_gather(&*x, &mut *all, stream)?;
    Ok(())
}
