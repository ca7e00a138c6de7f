//! Multicast objects (`cuMulticast*`, drivers from 12.1): granularity, creation, devices, binds
//! and unbinds. Mapping, access, release and sharing of their handles go through the VMM calls
//! (`vmm.rs`).

use std::ffi::c_ulonglong;

use cuda_multimem_sys::*;

use super::gate::{out, read, sim_api};
use crate::model::multicast::{self, bind, source_of_addr, source_of_handle};

sim_api! {
    cuMulticastGetGranularity @ 12010 as PFN_cuMulticastGetGranularity_v12010 => fn get_granularity(st, g: *mut usize, prop: *const CUmulticastObjectProp, option: CUmulticastGranularity_flags) {
        if g.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let p = read(prop)?;
        let (min, rec) = multicast::granularity(st, &p)?;
        match option {
            CUmulticastGranularity_flags::CU_MULTICAST_GRANULARITY_MINIMUM => out(g, min),
            CUmulticastGranularity_flags::CU_MULTICAST_GRANULARITY_RECOMMENDED => out(g, rec),
            _ => Err(CUresult::CUDA_ERROR_INVALID_VALUE),
        }
    }
    cuMulticastCreate @ 12010 as PFN_cuMulticastCreate_v12010 => fn create(st, h: *mut CUmemGenericAllocationHandle, prop: *const CUmulticastObjectProp) {
        if h.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let p = read(prop)?;
        let handle = multicast::create(st, &p)?;
        out(h, handle)
    }
    cuMulticastAddDevice @ 12010 as PFN_cuMulticastAddDevice_v12010 => fn add_device(st, h: CUmemGenericAllocationHandle, dev: CUdevice) {
        multicast::add_device(st, h, dev)
    }
    cuMulticastBindMem @ 12010 as PFN_cuMulticastBindMem_v12010 => fn bind_mem(st, h: CUmemGenericAllocationHandle, mc_offset: usize, mem: CUmemGenericAllocationHandle, mem_offset: usize, size: usize, flags: c_ulonglong) {
        let src = source_of_handle(st, mem, mem_offset, size)?;
        bind(st, h, None, mc_offset, src, size, flags)
    }
    cuMulticastBindMem @ 13010 as PFN_cuMulticastBindMem_v13010 => fn bind_mem_v2(st, h: CUmemGenericAllocationHandle, dev: CUdevice, mc_offset: usize, mem: CUmemGenericAllocationHandle, mem_offset: usize, size: usize, flags: c_ulonglong) {
        st.device(dev).map_err(|_| CUresult::CUDA_ERROR_INVALID_DEVICE)?;
        let src = source_of_handle(st, mem, mem_offset, size)?;
        bind(st, h, Some(dev), mc_offset, src, size, flags)
    }
    cuMulticastBindAddr @ 12010 as PFN_cuMulticastBindAddr_v12010 => fn bind_addr(st, h: CUmemGenericAllocationHandle, mc_offset: usize, ptr: CUdeviceptr, size: usize, flags: c_ulonglong) {
        let src = source_of_addr(st, ptr as usize, size)?;
        bind(st, h, None, mc_offset, src, size, flags)
    }
    cuMulticastBindAddr @ 13010 as PFN_cuMulticastBindAddr_v13010 => fn bind_addr_v2(st, h: CUmemGenericAllocationHandle, dev: CUdevice, mc_offset: usize, ptr: CUdeviceptr, size: usize, flags: c_ulonglong) {
        st.device(dev).map_err(|_| CUresult::CUDA_ERROR_INVALID_DEVICE)?;
        let src = source_of_addr(st, ptr as usize, size)?;
        bind(st, h, Some(dev), mc_offset, src, size, flags)
    }
    cuMulticastUnbind @ 12010 as PFN_cuMulticastUnbind_v12010 => fn unbind_(st, h: CUmemGenericAllocationHandle, dev: CUdevice, mc_offset: usize, size: usize) {
        multicast::unbind(st, h, dev, mc_offset, size)
    }
}
