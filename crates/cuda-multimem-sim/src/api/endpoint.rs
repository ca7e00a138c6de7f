//! CUDA 13.3 logical endpoints (`cuLogicalEndpoint*`) and the 13.5 fabric copy
//! (`cuFabricCpyBatchAsync`).

use std::ffi::{c_int, c_ulonglong, c_void};

use cuda_multimem_sys::*;

use super::gate::{out, read, sim_api};
use crate::model::endpoint;

fn invalid<T>() -> Result<T, CUresult> {
    Err(CUresult::CUDA_ERROR_INVALID_VALUE)
}

sim_api! {
    cuLogicalEndpointIdReserve @ 13030 as PFN_cuLogicalEndpointIdReserve_v13030 => fn id_reserve(st, base: *mut CUlogicalEndpointId, count: cuuint32_t) {
        if base.is_null() || count == 0 {
            return invalid();
        }
        let b = endpoint::reserve_ids(st, count)?;
        out(base, b)
    }
    cuLogicalEndpointIdRelease @ 13030 as PFN_cuLogicalEndpointIdRelease_v13030 => fn id_release(st, base: CUlogicalEndpointId, count: cuuint32_t) {
        endpoint::release_ids(st, base, count)
    }
    cuLogicalEndpointGetLimits @ 13030 as PFN_cuLogicalEndpointGetLimits_v13030 => fn get_limits(st, align: *mut cuuint64_t, max: *mut cuuint64_t, p: *const CUlogicalEndpointProp) {
        if align.is_null() || max.is_null() {
            return invalid();
        }
        let p = read(p)?;
        let (_, a, m) = endpoint::prop(st, &p)?;
        out(align, a)?;
        out(max, m)
    }
    cuLogicalEndpointCreate @ 13030 as PFN_cuLogicalEndpointCreate_v13030 => fn create(st, id: CUlogicalEndpointId, p: *const CUlogicalEndpointProp) {
        let p = read(p)?;
        endpoint::create(st, id, &p)
    }
    cuLogicalEndpointAddDevice @ 13030 as PFN_cuLogicalEndpointAddDevice_v13030 => fn add_device(st, id: CUlogicalEndpointId, dev: CUdevice) {
        endpoint::add_device(st, id, dev)
    }
    cuLogicalEndpointQuery @ 13030 as PFN_cuLogicalEndpointQuery_v13030 => fn query(st, id: CUlogicalEndpointId, count: cuuint32_t, status: *mut c_int) {
        if status.is_null() {
            return invalid();
        }
        let all = endpoint::query(st, id, count)?;
        out(status, all as c_int)
    }
    cuLogicalEndpointDestroy @ 13030 as PFN_cuLogicalEndpointDestroy_v13030 => fn destroy(st, id: CUlogicalEndpointId) {
        endpoint::destroy(st, id)
    }
    cuLogicalEndpointBindAddr @ 13030 as PFN_cuLogicalEndpointBindAddr_v13030 => fn bind_addr(st, id: CUlogicalEndpointId, dev: CUdevice, offset: cuuint64_t, ptr: *mut c_void, size: cuuint64_t, flags: c_ulonglong) {
        endpoint::bind_addr(st, id, dev, offset, ptr as usize, size, flags)
    }
    cuLogicalEndpointBindMem @ 13030 as PFN_cuLogicalEndpointBindMem_v13030 => fn bind_mem(st, id: CUlogicalEndpointId, dev: CUdevice, offset: cuuint64_t, mem: CUmemGenericAllocationHandle, mem_offset: cuuint64_t, size: cuuint64_t, flags: c_ulonglong) {
        endpoint::bind_mem(st, id, dev, offset, mem, mem_offset, size, flags)
    }
    cuLogicalEndpointUnbind @ 13030 as PFN_cuLogicalEndpointUnbind_v13030 => fn unbind(st, id: CUlogicalEndpointId, dev: CUdevice, offset: cuuint64_t, size: cuuint64_t) {
        endpoint::unbind(st, id, dev, offset, size)
    }
    cuLogicalEndpointExport @ 13030 as PFN_cuLogicalEndpointExport_v13030 => fn export(st, handle: *mut c_void, id: CUlogicalEndpointId, ty: CUlogicalEndpointIpcHandleType) {
        if handle.is_null() || ty != CUlogicalEndpointIpcHandleType::CU_LOGICAL_ENDPOINT_IPC_HANDLE_TYPE_FABRIC {
            return invalid();
        }
        let b = endpoint::export(st, id)?;
        std::ptr::copy_nonoverlapping(b.as_ptr(), handle as *mut u8, 64);
        Ok(())
    }
    cuLogicalEndpointImport @ 13030 as PFN_cuLogicalEndpointImport_v13030 => fn import(st, id: CUlogicalEndpointId, handle: *const c_void, ty: CUlogicalEndpointIpcHandleType) {
        if handle.is_null() || ty != CUlogicalEndpointIpcHandleType::CU_LOGICAL_ENDPOINT_IPC_HANDLE_TYPE_FABRIC {
            return invalid();
        }
        let mut b = [0u8; 64];
        std::ptr::copy_nonoverlapping(handle as *const u8, b.as_mut_ptr(), 64);
        endpoint::import(st, id, &b)
    }
    cuFabricCpyBatchAsync @ 13050 as PFN_cuFabricCpyBatchAsync_v13050 => fn fabric_cpy_batch_async(st, n: usize, ops: *mut CUDA_FABRIC_COPY_BATCH_OP, flags: c_ulonglong, stream: CUstream) {
        if flags != 0 || (n > 0 && ops.is_null()) || stream.is_null() {
            return invalid();
        }
        let ops: &[CUDA_FABRIC_COPY_BATCH_OP] = if n == 0 { &[] } else { std::slice::from_raw_parts(ops, n) };
        endpoint::fabric_copy(st, ops, stream)
    }
}
