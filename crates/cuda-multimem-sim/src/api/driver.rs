//! Initialisation and error names: `cuInit`, `cuGetErrorName`, `cuGetErrorString`.

use std::collections::HashMap;
use std::ffi::{c_char, CStr};
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use cuda_multimem_sys::*;

use super::gate::{out, sim_api};

fn error_string(code: CUresult) -> Option<&'static CStr> {
    static NAMES: OnceLock<HashMap<u32, std::ffi::CString>> = OnceLock::new();
    let names = NAMES.get_or_init(|| {
        (0..1000u32)
            .filter_map(|c| {
                result_name(CUresult(c)).map(|n| (c, std::ffi::CString::new(n).unwrap_or_default()))
            })
            .collect()
    });
    names.get(&code.0).map(|c| c.as_c_str())
}

sim_api! {
    cuInit @ 2000 as PFN_cuInit_v2000 => fn init(st, flags: u32) {
        if flags != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        st.initialized.store(true, Ordering::Release);
        Ok(())
    }
    cuGetErrorName @ 6000 as PFN_cuGetErrorName_v6000 => fn get_error_name(st, code: CUresult, s: *mut *const c_char) {
        let n = error_string(code).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        out(s, n.as_ptr())
    }
    cuGetErrorString @ 6000 as PFN_cuGetErrorString_v6000 => fn get_error_string(st, code: CUresult, s: *mut *const c_char) {
        let n = error_string(code).ok_or(CUresult::CUDA_ERROR_INVALID_VALUE)?;
        out(s, n.as_ptr())
    }
}
