//! Unified memory: managed allocations, advice, prefetch, discard and the range-attribute
//! queries (`cuMemAllocManaged`, `cuMemAdvise`, `cuMemPrefetchAsync`, the batch calls,
//! `cuMemRangeGetAttribute(s)`).

use std::ffi::{c_uint, c_ulonglong, c_void};

use cuda_multimem_sys::*;

use super::gate::{out, sim_api};
use crate::model::context::current_device;
use crate::model::managed::{
    self, advice_location, advice_takes_location, apply_advice, batch, check_advice,
    check_stream_device, enqueue_ops, legacy_location, prefetch_location, request, Loc, RangeOp,
    RangeValue,
};
use crate::model::stream;
use crate::state::{SimResult, State};

/// Checks shared by the batch calls: every device has concurrent managed access, the stream is
/// not the legacy NULL stream, flags are zero, the arrays are present.
fn check_batch(
    st: &State,
    dptrs: *mut CUdeviceptr,
    sizes: *mut usize,
    count: usize,
    flags: c_ulonglong,
    stream: CUstream,
) -> SimResult<Vec<(CUdeviceptr, usize)>> {
    if dptrs.is_null() || sizes.is_null() || count == 0 || flags != 0 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // The legacy NULL stream: 0 or CU_STREAM_LEGACY (0x1).
    if (stream as usize) <= 1 {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    stream::stream(st, stream)?;
    if st
        .config
        .devices
        .iter()
        .any(|d| !d.concurrent_managed_access)
    {
        return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
    }
    // SAFETY: the caller passes `count` entries in each array (non-null, checked above).
    let (d, s) = unsafe {
        (
            std::slice::from_raw_parts(dptrs, count),
            std::slice::from_raw_parts(sizes, count),
        )
    };
    Ok(d.iter().copied().zip(s.iter().copied()).collect())
}

/// The per-operation locations of a batch from `prefetchLocs`/`prefetchLocIdxs`: the first index
/// is 0, indices strictly increase and stay below `count`, and there are at most `count` entries.
fn batch_locations(
    st: &State,
    locs: *mut CUmemLocation,
    idxs: *mut usize,
    n: usize,
    count: usize,
) -> SimResult<Vec<Loc>> {
    if locs.is_null() || idxs.is_null() || n == 0 || n > count {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller passes `n` entries in each array (non-null, checked above).
    let (locs, idxs) = unsafe {
        (
            std::slice::from_raw_parts(locs, n),
            std::slice::from_raw_parts(idxs, n),
        )
    };
    // Documented: "each entry must be greater than the previous entry". (A 13.0 driver was
    // measured to accept equal neighbours; the simulator holds callers to the documentation.)
    if idxs[0] != 0 || idxs.windows(2).any(|w| w[1] <= w[0]) || idxs[n - 1] >= count {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    let resolved = locs
        .iter()
        .map(|l| prefetch_location(st, l))
        .collect::<SimResult<Vec<_>>>()?;
    let mut per_op = Vec::with_capacity(count);
    for k in 0..n {
        let end = if k + 1 < n { idxs[k + 1] } else { count };
        per_op.extend(std::iter::repeat_n(resolved[k], end - idxs[k]));
    }
    Ok(per_op)
}

/// Write range attribute `attr` of `pages` into the caller's `size` bytes at `data`.
///
/// # Safety
/// `data` is null or valid for `size` bytes of writes.
// `usize::is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#[allow(clippy::manual_is_multiple_of)]
unsafe fn write_attribute(
    st: &State,
    attr: CUmem_range_attribute,
    pages: &[managed::Page],
    data: *mut c_void,
    size: usize,
) -> SimResult {
    if data.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    match managed::range_attribute(st, attr, pages)? {
        RangeValue::Int(v) => {
            if size != 4 {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            // SAFETY: non-null; the caller passes `size` (4) writable bytes.
            unsafe { (data as *mut i32).write_unaligned(v) };
        }
        RangeValue::Processors(ids) => {
            if size == 0 || size % 4 != 0 {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            for i in 0..size / 4 {
                let v = ids.get(i).copied().unwrap_or(managed::NO_DEVICE);
                // SAFETY: `i < size / 4`, inside the caller's buffer.
                unsafe { (data as *mut i32).add(i).write_unaligned(v) };
            }
        }
    }
    Ok(())
}

sim_api! {
    cuMemAllocManaged @ 6000 as PFN_cuMemAllocManaged_v6000 => fn mem_alloc_managed(st, dptr: *mut CUdeviceptr, size: usize, flags: c_uint) {
        if dptr.is_null() || size == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        if flags != CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL.0 && flags != CUmemAttach_flags::CU_MEM_ATTACH_HOST.0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        current_device(st)?;
        let a = managed::alloc(st, size)?;
        out(dptr, a as CUdeviceptr)
    }
    cuMemAdvise @ 8000 as PFN_cuMemAdvise_v8000 => fn mem_advise_v8000(st, ptr: CUdeviceptr, count: usize, advice: CUmem_advise, dev: CUdevice) {
        check_advice(advice)?;
        let loc = if advice_takes_location(advice) { Some(legacy_location(st, dev)?) } else { None };
        apply_advice(st, ptr, count, advice, loc)
    }
    cuMemAdvise @ 12020 as PFN_cuMemAdvise_v12020 => fn mem_advise_v12020(st, ptr: CUdeviceptr, count: usize, advice: CUmem_advise, location: CUmemLocation) {
        check_advice(advice)?;
        let loc = if advice_takes_location(advice) { Some(advice_location(st, advice, &location)?) } else { None };
        apply_advice(st, ptr, count, advice, loc)
    }
    cuMemPrefetchAsync @ 8000 as PFN_cuMemPrefetchAsync_v8000 => fn mem_prefetch_async_v8000(st, ptr: CUdeviceptr, count: usize, dev: CUdevice, stream: CUstream) {
        let loc = legacy_location(st, dev)?;
        if let Loc::Device(_) = loc {
            check_stream_device(st, stream)?;
        } else {
            stream::stream(st, stream)?;
        }
        let (s, p, n) = request(st, ptr, count, RangeOp::Prefetch(loc))?;
        enqueue_ops(st, stream, vec![(s, p, n, RangeOp::Prefetch(loc))])
    }
    cuMemPrefetchAsync @ 12020 as PFN_cuMemPrefetchAsync_v12020 => fn mem_prefetch_async_v12020(st, ptr: CUdeviceptr, count: usize, location: CUmemLocation, flags: c_uint, stream: CUstream) {
        if flags != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let loc = prefetch_location(st, &location)?;
        if let Loc::Device(_) = loc {
            check_stream_device(st, stream)?;
        } else {
            stream::stream(st, stream)?;
        }
        let (s, p, n) = request(st, ptr, count, RangeOp::Prefetch(loc))?;
        enqueue_ops(st, stream, vec![(s, p, n, RangeOp::Prefetch(loc))])
    }
    cuMemPrefetchBatchAsync @ 13000 as PFN_cuMemPrefetchBatchAsync_v13000 => fn mem_prefetch_batch_async(st, dptrs: *mut CUdeviceptr, sizes: *mut usize, count: usize, locs: *mut CUmemLocation, idxs: *mut usize, nlocs: usize, flags: c_ulonglong, stream: CUstream) {
        let ranges = check_batch(st, dptrs, sizes, count, flags, stream)?;
        let per_op = batch_locations(st, locs, idxs, nlocs, count)?;
        batch(st, ranges, per_op.into_iter().map(RangeOp::Prefetch).collect(), stream)
    }
    cuMemDiscardBatchAsync @ 13000 as PFN_cuMemDiscardBatchAsync_v13000 => fn mem_discard_batch_async(st, dptrs: *mut CUdeviceptr, sizes: *mut usize, count: usize, flags: c_ulonglong, stream: CUstream) {
        let ranges = check_batch(st, dptrs, sizes, count, flags, stream)?;
        let ops = vec![RangeOp::Discard; ranges.len()];
        batch(st, ranges, ops, stream)
    }
    cuMemDiscardAndPrefetchBatchAsync @ 13000 as PFN_cuMemDiscardAndPrefetchBatchAsync_v13000 => fn mem_discard_and_prefetch_batch_async(st, dptrs: *mut CUdeviceptr, sizes: *mut usize, count: usize, locs: *mut CUmemLocation, idxs: *mut usize, nlocs: usize, flags: c_ulonglong, stream: CUstream) {
        let ranges = check_batch(st, dptrs, sizes, count, flags, stream)?;
        let per_op = batch_locations(st, locs, idxs, nlocs, count)?;
        batch(st, ranges, per_op.into_iter().map(RangeOp::DiscardAndPrefetch).collect(), stream)
    }
    cuMemRangeGetAttribute @ 8000 as PFN_cuMemRangeGetAttribute_v8000 => fn mem_range_get_attribute(st, data: *mut c_void, size: usize, attr: CUmem_range_attribute, ptr: CUdeviceptr, count: usize) {
        let pages = managed::range_pages(st, ptr, count)?;
        write_attribute(st, attr, &pages, data, size)
    }
    cuMemRangeGetAttributes @ 8000 as PFN_cuMemRangeGetAttributes_v8000 => fn mem_range_get_attributes(st, data: *mut *mut c_void, sizes: *mut usize, attrs: *mut CUmem_range_attribute, n: usize, ptr: CUdeviceptr, count: usize) {
        if data.is_null() || sizes.is_null() || attrs.is_null() || n == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let pages = managed::range_pages(st, ptr, count)?;
        for i in 0..n {
            write_attribute(st, *attrs.add(i), &pages, *data.add(i), *sizes.add(i))?;
        }
        Ok(())
    }
}
