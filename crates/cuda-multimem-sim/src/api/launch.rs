//! Execution control and occupancy: function attributes, kernel launches, and the occupancy
//! queries (blocks per multiprocessor, clusters per device).

use std::ffi::{c_int, c_uint, c_void};

use cuda_multimem_sys::*;

use super::gate::{out, read, sim_api};
use crate::model::context::current_device;
use crate::model::kernel::{self, function};
use crate::model::stream;

sim_api! {
    cuFuncSetAttribute @ 9000 as PFN_cuFuncSetAttribute_v9000 => fn func_set_attribute(st, f: CUfunction, attrib: CUfunction_attribute, value: c_int) {
        let f = function(st, f)?;
        kernel::set_attribute(&f, attrib, value)
    }
    cuFuncGetAttribute @ 2020 as PFN_cuFuncGetAttribute_v2020 => fn func_get_attribute(st, pi: *mut c_int, attrib: CUfunction_attribute, f: CUfunction) {
        let f = function(st, f)?;
        let v = kernel::attribute(&f, attrib)?;
        out(pi, v)
    }
    cuLaunchKernel @ 4000 as PFN_cuLaunchKernel_v4000 => fn launch_kernel(st, f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) {
        let f = function(st, f)?;
        // Declared in the PTX, but the simulator runs it only with a host equivalent, looked up
        // at the launch (so it may be registered after the module was loaded).
        let k = kernel::registered_for_launch(&f.name)?;
        if gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0
            || gy > 65535 || gz > 65535
            || (bx as u64) * (by as u64) * (bz as u64) > 1024 || bz > 64
            || shared > 227 * 1024
        {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        if !extra.is_null() {
            // Packed parameter buffers (CU_LAUNCH_PARAM_BUFFER_POINTER) are not simulated.
            return Err(CUresult::CUDA_ERROR_NOT_SUPPORTED);
        }
        let s = stream::stream(st, stream)?;
        if s.device != f.device || current_device(st)? != f.device {
            return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
        }
        // The driver copies the parameter values at launch; the caller may reuse its memory.
        let sizes = f.param_sizes();
        let mut copied = Vec::with_capacity(sizes.len());
        if !sizes.is_empty() && params.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        for (i, size) in sizes.iter().enumerate() {
            let p = *params.add(i);
            if p.is_null() {
                return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
            }
            copied.push(std::slice::from_raw_parts(p as *const u8, *size).to_vec());
        }
        let shape = kernel::Shape {
            grid: (gx, gy, gz),
            block: (bx, by, bz),
            shared_mem: shared,
        };
        kernel::launch(st, &f, k, shape, &s, copied)
    }
    cuOccupancyMaxActiveBlocksPerMultiprocessor @ 6050 as PFN_cuOccupancyMaxActiveBlocksPerMultiprocessor_v6050 => fn occupancy_max_active_blocks(st, num: *mut c_int, func: CUfunction, block_size: c_int, dynamic_smem: usize) {
        let f = function(st, func)?;
        let n = kernel::max_active_blocks(&f, block_size, dynamic_smem)?;
        out(num, n)
    }
    cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags @ 7000 as PFN_cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags_v7000 => fn occupancy_max_active_blocks_with_flags(st, num: *mut c_int, func: CUfunction, block_size: c_int, dynamic_smem: usize, flags: c_uint) {
        // CU_OCCUPANCY_DEFAULT or CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE: the simulated
        // multiprocessor has no cache carve-out to override, so both answer the same.
        if flags > 1 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let f = function(st, func)?;
        let n = kernel::max_active_blocks(&f, block_size, dynamic_smem)?;
        out(num, n)
    }
    cuOccupancyMaxActiveClusters @ 11070 as PFN_cuOccupancyMaxActiveClusters_v11070 => fn occupancy_max_active_clusters(st, num: *mut c_int, func: CUfunction, config: *const CUlaunchConfig) {
        let f = function(st, func)?;
        let c = read(config)?;
        if c.numAttrs > 0 && c.attrs.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let attrs = if c.numAttrs == 0 { &[][..] } else { std::slice::from_raw_parts(c.attrs, c.numAttrs as usize) };
        // The last cluster-dimension attribute counts; the others do not change occupancy here.
        let cluster = attrs
            .iter()
            .filter(|a| a.id == CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
            .map(|a| (a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z))
            .next_back();
        let shape = kernel::Shape {
            grid: (c.gridDimX, c.gridDimY, c.gridDimZ),
            block: (c.blockDimX, c.blockDimY, c.blockDimZ),
            shared_mem: c.sharedMemBytes,
        };
        let n = kernel::max_active_clusters(st, &f, shape, cluster)?;
        out(num, n)
    }
}
