//! Module management: loading PTX, unloading, looking kernels up by name.

use std::ffi::{c_char, c_void, CStr};

use cuda_multimem_sys::*;

use super::gate::{out, sim_api};
use crate::model::context::current_device;
use crate::model::kernel;

sim_api! {
    cuModuleLoadData @ 2000 as PFN_cuModuleLoadData_v2000 => fn module_load_data(st, module: *mut CUmodule, image: *const c_void) {
        if module.is_null() || image.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let dev = current_device(st)?;
        let bytes = image as *const u8;
        // ELF images (cubin, fatbin) are real machine code: the simulator cannot run them.
        if std::slice::from_raw_parts(bytes, 4) == b"\x7fELF" {
            return Err(CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU);
        }
        // PTX is NUL-terminated text.
        let text = CStr::from_ptr(image as *const c_char).to_str().map_err(|_| CUresult::CUDA_ERROR_INVALID_PTX)?;
        let h = kernel::load_ptx(st, dev, text)?;
        out(module, h as CUmodule)
    }
    cuModuleUnload @ 2000 as PFN_cuModuleUnload_v2000 => fn module_unload(st, module: CUmodule) {
        kernel::unload(st, module)
    }
    cuModuleGetFunction @ 2000 as PFN_cuModuleGetFunction_v2000 => fn module_get_function(st, hfunc: *mut CUfunction, module: CUmodule, name: *const c_char) {
        if hfunc.is_null() || name.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let name = CStr::from_ptr(name).to_str().map_err(|_| CUresult::CUDA_ERROR_NOT_FOUND)?.to_string();
        let fh = kernel::get_function(st, module, name)?;
        out(hfunc, fh as CUfunction)
    }
}
