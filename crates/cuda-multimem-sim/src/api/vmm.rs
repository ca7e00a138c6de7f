//! Virtual memory management: granularity, physical allocations, address reservations,
//! mappings, access, and shareable handles. Multicast handles go through the same calls
//! (`cuMemMap`, `cuMemUnmap`, `cuMemSetAccess`, `cuMemRelease`, export and import): each entry
//! point asks the multicast model first, by the handle's kind or the range.
// `usize::is_multiple_of` needs Rust 1.87; `%` keeps this building on older toolchains too.
#![allow(clippy::manual_is_multiple_of)]

use std::ffi::{c_int, c_ulonglong, c_void};
use std::os::fd::RawFd;

use cuda_multimem_sys::*;

use super::gate::{out, read, sim_api};
use crate::model::multicast;
use crate::model::vmm::{self, Shareable, HT_FABRIC, HT_POSIX, HT_WIN32, HT_WIN32_KMT};
use crate::state::{is_kind, Kind, SimResult};

/// Write a shareable handle where the caller asked for it: an int for a POSIX fd (the caller
/// owns it), 64 bytes for a fabric handle.
///
/// # Safety
/// `sh` is null or valid for one write of the handle type's out type.
unsafe fn out_shareable(sh: *mut c_void, h: Shareable) -> SimResult {
    // SAFETY: the caller's promise.
    unsafe {
        match h {
            Shareable::Fd(fd) => out(sh as *mut c_int, std::os::fd::IntoRawFd::into_raw_fd(fd)),
            Shareable::Fabric(data) => {
                out(sh as *mut CUmemFabricHandle, CUmemFabricHandle { data })
            }
        }
    }
}

sim_api! {
    cuMemGetAllocationGranularity @ 10020 as PFN_cuMemGetAllocationGranularity_v10020 => fn mem_get_allocation_granularity(st, g: *mut usize, prop: *const CUmemAllocationProp, option: CUmemAllocationGranularity_flags) {
        if g.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let p = read(prop)?;
        let (_, _, _, (min, rec)) = vmm::check_prop(st, &p)?;
        match option {
            CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM => out(g, min),
            CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED => out(g, rec),
            _ => Err(CUresult::CUDA_ERROR_INVALID_VALUE),
        }
    }
    cuMemCreate @ 10020 as PFN_cuMemCreate_v10020 => fn mem_create(st, handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: c_ulonglong) {
        if handle.is_null() || flags != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let p = read(prop)?;
        let h = vmm::create(st, size, &p)?;
        out(handle, h)
    }
    cuMemRelease @ 10020 as PFN_cuMemRelease_v10020 => fn mem_release(st, handle: CUmemGenericAllocationHandle) {
        if is_kind(handle, Kind::Multicast) {
            return multicast::release(st, handle);
        }
        vmm::release(st, handle)
    }
    cuMemGetAllocationPropertiesFromHandle @ 10020 as PFN_cuMemGetAllocationPropertiesFromHandle_v10020 => fn mem_get_allocation_properties_from_handle(st, prop: *mut CUmemAllocationProp, handle: CUmemGenericAllocationHandle) {
        // A multicast object's handle is not an allocation's: refused (the safe layer's imports
        // tell the two kinds of imported handle apart by this answer).
        if is_kind(handle, Kind::Multicast) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let p = vmm::properties(st, handle)?;
        out(prop, p)
    }
    cuMemRetainAllocationHandle @ 11000 as PFN_cuMemRetainAllocationHandle_v11000 => fn mem_retain_allocation_handle(st, handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) {
        if handle.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let h = vmm::retain_handle(st, addr as usize)?;
        out(handle, h)
    }
    cuMemAddressReserve @ 10020 as PFN_cuMemAddressReserve_v10020 => fn mem_address_reserve(st, ptr: *mut CUdeviceptr, size: usize, alignment: usize, addr: CUdeviceptr, flags: c_ulonglong) {
        let page = vmm::page_size();
        if ptr.is_null() || flags != 0 || size == 0 || size % page != 0 || (addr as usize) % page != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        if alignment != 0 && !alignment.is_power_of_two() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let start = vmm::reserve_range(st, size, alignment, addr as usize)?;
        out(ptr, start as CUdeviceptr)
    }
    cuMemAddressFree @ 10020 as PFN_cuMemAddressFree_v10020 => fn mem_address_free(st, ptr: CUdeviceptr, size: usize) {
        vmm::free_range(st, ptr as usize, size, || multicast::overlaps_mapping(st, ptr as usize, size))
    }
    cuMemMap @ 10020 as PFN_cuMemMap_v10020 => fn mem_map(st, ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: c_ulonglong) {
        if is_kind(handle, Kind::Multicast) {
            return multicast::mem_map(st, ptr as usize, size, offset, handle, flags);
        }
        vmm::map(st, ptr as usize, size, offset, handle, flags)
    }
    cuMemUnmap @ 10020 as PFN_cuMemUnmap_v10020 => fn mem_unmap(st, ptr: CUdeviceptr, size: usize) {
        if let Some(r) = multicast::mem_unmap(st, ptr as usize, size) {
            return r;
        }
        vmm::unmap(st, ptr as usize, size)
    }
    cuMemSetAccess @ 10020 as PFN_cuMemSetAccess_v10020 => fn mem_set_access(st, ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) {
        if desc.is_null() || count == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let descs = std::slice::from_raw_parts(desc, count);
        if let Some(r) = multicast::mem_set_access(st, ptr as usize, size, descs) {
            return r;
        }
        vmm::set_access(st, ptr as usize, size, descs)
    }
    cuMemGetAccess @ 10020 as PFN_cuMemGetAccess_v10020 => fn mem_get_access(st, flags: *mut c_ulonglong, location_: *const CUmemLocation, ptr: CUdeviceptr) {
        if flags.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let l = read(location_)?;
        let f = vmm::access(st, &l, ptr as usize)?;
        out(flags, f as c_ulonglong)
    }
    cuMemExportToShareableHandle @ 10020 as PFN_cuMemExportToShareableHandle_v10020 => fn mem_export_to_shareable_handle(st, sh: *mut c_void, handle: CUmemGenericAllocationHandle, ty: CUmemAllocationHandleType, flags: c_ulonglong) {
        if sh.is_null() || flags != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let h = if is_kind(handle, Kind::Multicast) {
            multicast::export(st, handle, ty)?
        } else {
            vmm::export(st, handle, ty.0)?
        };
        out_shareable(sh, h)
    }
    cuMemImportFromShareableHandle @ 10020 as PFN_cuMemImportFromShareableHandle_v10020 => fn mem_import_from_shareable_handle(st, handle: *mut CUmemGenericAllocationHandle, os: *mut c_void, ty: CUmemAllocationHandleType) {
        if handle.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let bad = CUresult::CUDA_ERROR_INVALID_VALUE;
        match ty.0 {
            HT_POSIX => {
                let raw = os as usize;
                if raw > i32::MAX as usize {
                    return Err(bad);
                }
                if let Some(r) = multicast::import_fd(st, raw as RawFd) {
                    return out(handle, r?);
                }
                let h = vmm::import_fd(st, raw as RawFd)?;
                out(handle, h)
            }
            HT_FABRIC => {
                let b = read(os as *const CUmemFabricHandle)?;
                if let Some(r) = multicast::import_fabric(st, &b.data) {
                    return out(handle, r?);
                }
                let h = vmm::import_fabric(st, &b.data)?;
                out(handle, h)
            }
            HT_WIN32 | HT_WIN32_KMT => Err(CUresult::CUDA_ERROR_NOT_SUPPORTED),
            _ => Err(bad),
        }
    }
}
