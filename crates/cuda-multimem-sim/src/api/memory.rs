//! Memory management: device and page-locked host allocations, memory info, synchronous,
//! asynchronous, peer and batched copies, memsets.

use std::ffi::{c_uint, c_void};
use std::sync::Arc;

use cuda_multimem_sys::*;

use super::gate::{out, sim_api};
use crate::model::context::context_device;
use crate::model::managed;
use crate::model::memory::{
    self, copy, copy_async, fill, htod_sync, is_device_memory, is_plain_device_memory, memset_sync,
    on_legacy_stream, sync_then, Memory,
};
use crate::model::stream;
use crate::state::{SimResult, State};

/// One copy of a batch: destination, source, length, and the source's bytes as they were
/// during the call when its access order says so.
type BatchCopy = (usize, usize, usize, Option<Arc<Vec<u8>>>);

/// `cuMemcpyBatchAsync` at either ABI (`fail_idx`: the 12080 form's out-parameter, null for
/// the 13000 form). Checks what cuda.h documents, at enqueue time: a non-empty batch with its
/// three arrays, a stream that is not the legacy default stream (null or `CU_STREAM_LEGACY`),
/// between 1 and `count` attribute sets whose indices start at 0, increase strictly and stay
/// below `count`, each with a valid `srcAccessOrder` and known flags (`CUDA_ERROR_INVALID_VALUE`
/// otherwise); each copy's device ranges as `cuMemcpyAsync` checks them (a refused copy's index
/// goes to `fail_idx`, `usize::MAX` for errors of the batch as a whole). The batch then runs as
/// one operation in stream order (captured like the other asynchronous copies); a source with
/// `CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL` is read before the call returns, as that
/// order promises the caller, and `PREFER_OVERLAP_WITH_COMPUTE` changes nothing here.
///
/// # Safety
/// Non-null arrays are valid for `count` (`dsts`, `srcs`, `sizes`) and `num_attrs` (`attrs`,
/// `attrs_idxs`) reads; `fail_idx` is null or valid for one write.
#[allow(clippy::too_many_arguments)]
unsafe fn memcpy_batch(
    st: &Arc<State>,
    dsts: *const CUdeviceptr,
    srcs: *const CUdeviceptr,
    sizes: *const usize,
    count: usize,
    attrs: *const CUmemcpyAttributes,
    attrs_idxs: *const usize,
    num_attrs: usize,
    fail_idx: *mut usize,
    h: CUstream,
) -> SimResult {
    let fail = |i: usize| {
        if !fail_idx.is_null() {
            // SAFETY: non-null, valid for one write (the caller's promise).
            unsafe { fail_idx.write(i) };
        }
    };
    fail(usize::MAX);
    let invalid = Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    if count == 0 || dsts.is_null() || srcs.is_null() || sizes.is_null() {
        return invalid;
    }
    if attrs.is_null() || attrs_idxs.is_null() || num_attrs == 0 || num_attrs > count {
        return invalid;
    }
    // `CU_STREAM_LEGACY` is handle 1; the per-thread default stream (2) is a real stream.
    if (h as u64) <= 1 {
        return invalid;
    }
    // SAFETY: non-null, and the caller promises `count` / `num_attrs` elements.
    let (dsts, srcs, sizes, attrs, idxs) = unsafe {
        (
            std::slice::from_raw_parts(dsts, count),
            std::slice::from_raw_parts(srcs, count),
            std::slice::from_raw_parts(sizes, count),
            std::slice::from_raw_parts(attrs, num_attrs),
            std::slice::from_raw_parts(attrs_idxs, num_attrs),
        )
    };
    if idxs[0] != 0 || idxs.windows(2).any(|w| w[0] >= w[1]) || idxs[num_attrs - 1] >= count {
        return invalid;
    }
    let known_flags = CUmemcpyFlags_enum::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE.0;
    type Order = CUmemcpySrcAccessOrder_enum;
    for a in attrs {
        let order_ok = matches!(
            a.srcAccessOrder,
            Order::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                | Order::CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL
                | Order::CU_MEMCPY_SRC_ACCESS_ORDER_ANY
        );
        if !order_ok || a.flags & !known_flags != 0 {
            return invalid;
        }
    }
    let s = stream::stream(st, h)?;
    let m = st.ext::<Memory>();
    let mut copies: Vec<BatchCopy> = Vec::with_capacity(count);
    for i in 0..count {
        let (d, src, n) = (dsts[i] as usize, srcs[i] as usize, sizes[i]);
        let attr = &attrs[idxs.partition_point(|&k| k <= i) - 1];
        let checked = (|| {
            if m.find(src).is_some() {
                m.check(src, n, false)?;
            }
            if m.find(d).is_some() {
                m.check(d, n, true)?;
            }
            if attr.srcAccessOrder != Order::CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL {
                return Ok(None);
            }
            let mut now = vec![0u8; n];
            copy(st, now.as_mut_ptr() as usize, src, n)?;
            Ok(Some(Arc::new(now)))
        })();
        match checked {
            Ok(now) => copies.push((d, src, n, now)),
            Err(e) => {
                fail(i);
                return Err(e);
            }
        }
    }
    let s2 = st.clone();
    stream::implicit_order(st, &s)?;
    s.enqueue(Arc::new(move || {
        for (d, src, n, now) in &copies {
            let from = now.as_ref().map_or(*src, |b| b.as_ptr() as usize);
            copy(&s2, *d, from, *n)?;
        }
        Ok(())
    }))
}

sim_api! {
    cuMemGetInfo @ 3020 as PFN_cuMemGetInfo_v3020 => fn mem_get_info(st, free: *mut usize, total: *mut usize) {
        let (f, t) = memory::info(st)?;
        out(free, f as usize)?;
        out(total, t as usize)
    }
    cuMemAlloc @ 3020 as PFN_cuMemAlloc_v3020 => fn mem_alloc(st, dptr: *mut CUdeviceptr, size: usize) {
        if dptr.is_null() || size == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let a = memory::alloc(st, size)?;
        out(dptr, a as CUdeviceptr)
    }
    cuMemFree @ 3020 as PFN_cuMemFree_v3020 => fn mem_free(st, dptr: CUdeviceptr) {
        match memory::free(st, dptr as usize) {
            Some(r) => r,
            // Not `cuMemAlloc`'s: managed memory is freed with the same call.
            None => managed::free(st, dptr as usize),
        }
    }
    cuMemAllocHost @ 3020 as PFN_cuMemAllocHost_v3020 => fn mem_alloc_host(st, pp: *mut *mut c_void, size: usize) {
        if pp.is_null() || size == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let a = memory::alloc_host(st, size)?;
        out(pp, a as *mut c_void)
    }
    cuMemHostAlloc @ 2020 as PFN_cuMemHostAlloc_v2020 => fn mem_host_alloc(st, pp: *mut *mut c_void, size: usize, flags: c_uint) {
        // like cuMemAllocHost, with flags: portable, mapped, write-combined (a simulated
        // device address is its host address, so every allocation is mapped)
        let known = CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED;
        if pp.is_null() || size == 0 || flags & !known != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        crate::model::context::current_device(st)?;
        let a = memory::alloc_host(st, size)?;
        out(pp, a as *mut c_void)
    }
    cuMemHostGetDevicePointer @ 3020 as PFN_cuMemHostGetDevicePointer_v3020 => fn mem_host_get_device_pointer(st, pdptr: *mut CUdeviceptr, p: *mut c_void, flags: c_uint) {
        // the device address of page-locked host memory is its host address (unified
        // addressing); flags must be 0
        if pdptr.is_null() || flags != 0 || !memory::is_host_memory(st, p as usize) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        out(pdptr, p as CUdeviceptr)
    }
    cuMemFreeHost @ 2000 as PFN_cuMemFreeHost_v2000 => fn mem_free_host(st, p: *mut c_void) {
        memory::free_host(st, p as usize)
    }
    cuMemcpy @ 4000 as PFN_cuMemcpy_v4000 => fn memcpy(st, dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
        let (d, s) = (dst as usize, src as usize);
        match (is_plain_device_memory(st, d), is_plain_device_memory(st, s)) {
            (true, true) => {
                let m = st.ext::<Memory>();
                m.check(s, n, false)?;
                m.check(d, n, true)?;
                on_legacy_stream(st, move |st| copy(st, d, s, n))
            }
            (true, false) => htod_sync(st, d, s, n),
            _ => sync_then(st, || copy(st, d, s, n)),
        }
    }
    cuMemcpyHtoD @ 3020 as PFN_cuMemcpyHtoD_v3020 => fn memcpy_htod(st, dst: CUdeviceptr, src: *const c_void, n: usize) {
        if n > 0 && (src.is_null() || !is_device_memory(st, dst as usize)) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        htod_sync(st, dst as usize, src as usize, n)
    }
    cuMemcpyDtoH @ 3020 as PFN_cuMemcpyDtoH_v3020 => fn memcpy_dtoh(st, dst: *mut c_void, src: CUdeviceptr, n: usize) {
        if n > 0 && (dst.is_null() || !is_device_memory(st, src as usize)) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        sync_then(st, || copy(st, dst as usize, src as usize, n))
    }
    cuMemcpyDtoD @ 3020 as PFN_cuMemcpyDtoD_v3020 => fn memcpy_dtod(st, dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
        if n > 0 && (!is_device_memory(st, src as usize) || !is_device_memory(st, dst as usize)) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let (d, s) = (dst as usize, src as usize);
        let m = st.ext::<Memory>();
        m.check(s, n, false)?;
        m.check(d, n, true)?;
        on_legacy_stream(st, move |st| copy(st, d, s, n))
    }
    cuMemcpyAsync @ 4000 as PFN_cuMemcpyAsync_v4000 => fn memcpy_async(st, dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) {
        copy_async(st, dst as usize, src as usize, n, s)
    }
    cuMemcpyHtoDAsync @ 3020 as PFN_cuMemcpyHtoDAsync_v3020 => fn memcpy_htod_async(st, dst: CUdeviceptr, src: *const c_void, n: usize, s: CUstream) {
        if n > 0 && (src.is_null() || !is_device_memory(st, dst as usize)) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        copy_async(st, dst as usize, src as usize, n, s)
    }
    cuMemcpyDtoHAsync @ 3020 as PFN_cuMemcpyDtoHAsync_v3020 => fn memcpy_dtoh_async(st, dst: *mut c_void, src: CUdeviceptr, n: usize, s: CUstream) {
        if n > 0 && (dst.is_null() || !is_device_memory(st, src as usize)) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        copy_async(st, dst as usize, src as usize, n, s)
    }
    cuMemcpyDtoDAsync @ 3020 as PFN_cuMemcpyDtoDAsync_v3020 => fn memcpy_dtod_async(st, dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) {
        copy_async(st, dst as usize, src as usize, n, s)
    }
    cuMemcpyBatchAsync @ 12080 as PFN_cuMemcpyBatchAsync_v12080 => fn memcpy_batch_async_v12080(st, dsts: *mut CUdeviceptr, srcs: *mut CUdeviceptr, sizes: *mut usize, count: usize, attrs: *mut CUmemcpyAttributes, attrs_idxs: *mut usize, num_attrs: usize, fail_idx: *mut usize, h: CUstream) {
        memcpy_batch(st, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, fail_idx, h)
    }
    cuMemcpyBatchAsync @ 13000 as PFN_cuMemcpyBatchAsync_v13000 => fn memcpy_batch_async_v13000(st, dsts: *mut CUdeviceptr, srcs: *mut CUdeviceptr, sizes: *mut usize, count: usize, attrs: *mut CUmemcpyAttributes, attrs_idxs: *mut usize, num_attrs: usize, h: CUstream) {
        memcpy_batch(st, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, std::ptr::null_mut(), h)
    }
    cuMemcpyPeer @ 4000 as PFN_cuMemcpyPeer_v4000 => fn memcpy_peer(st, dst: CUdeviceptr, dctx: CUcontext, src: CUdeviceptr, sctx: CUcontext, n: usize) {
        context_device(st, dctx)?;
        context_device(st, sctx)?;
        // device to device: no host-side synchronisation, in the legacy stream's order
        let (d, s) = (dst as usize, src as usize);
        let m = st.ext::<Memory>();
        m.check(s, n, false)?;
        m.check(d, n, true)?;
        on_legacy_stream(st, move |st| copy(st, d, s, n))
    }
    cuMemcpyPeerAsync @ 4000 as PFN_cuMemcpyPeerAsync_v4000 => fn memcpy_peer_async(st, dst: CUdeviceptr, dctx: CUcontext, src: CUdeviceptr, sctx: CUcontext, n: usize, s: CUstream) {
        context_device(st, dctx)?;
        context_device(st, sctx)?;
        copy_async(st, dst as usize, src as usize, n, s)
    }
    cuMemsetD8 @ 3020 as PFN_cuMemsetD8_v3020 => fn memset_d8(st, dst: CUdeviceptr, v: u8, n: usize) {
        memset_sync(st, dst as usize, v as u32, 1, n)
    }
    cuMemsetD32 @ 3020 as PFN_cuMemsetD32_v3020 => fn memset_d32(st, dst: CUdeviceptr, v: c_uint, n: usize) {
        memset_sync(st, dst as usize, v, 4, n)
    }
    cuMemsetD8Async @ 3020 as PFN_cuMemsetD8Async_v3020 => fn memset_d8_async(st, dst: CUdeviceptr, v: u8, n: usize, s: CUstream) {
        st.ext::<Memory>().check(dst as usize, n, true)?;
        let s2 = st.clone();
        stream::enqueue(st, s, Arc::new(move || fill(&s2, dst as usize, v as u32, 1, n)))
    }
    cuMemsetD32Async @ 3020 as PFN_cuMemsetD32Async_v3020 => fn memset_d32_async(st, dst: CUdeviceptr, v: c_uint, n: usize, s: CUstream) {
        st.ext::<Memory>().check(dst as usize, n.saturating_mul(4), true)?;
        let s2 = st.clone();
        stream::enqueue(st, s, Arc::new(move || fill(&s2, dst as usize, v, 4, n)))
    }
}
