//! The simulated driver's entry points: `cuGetProcAddress` answers from the export lists of the
//! simulated areas, as the real driver would for the configured version.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use cuda_multimem_sys::*;

use crate::state::{current, out};

/// One simulated entry point: symbol, ABI version, address.
#[derive(Clone, Copy)]
pub(crate) struct Export {
    pub name: &'static str,
    pub abi: i32,
    pub addr: usize,
}

/// Define simulated driver calls and the module's export list.
///
/// ```ignore
/// sim_api! {
///     cuMemGetInfo @ 3020 as PFN_cuMemGetInfo_v3020 => fn mem_get_info(st, free: *mut usize, total: *mut usize) {
///         ...; Ok(())
///     }
/// }
/// ```
/// Each block becomes an `unsafe extern "C"` function whose signature is checked against the
/// generated `PFN_` type at compile time; the body sees the session state as `st` and returns
/// `SimResult`. The macro also writes `pub(crate) fn exports() -> Vec<Export>` for the module:
/// adding a simulated call is adding one block.
macro_rules! sim_api {
    ($(
        $(#[$m:meta])*
        $sym:ident @ $abi:literal as $pfn:ident => fn $f:ident ( $st:ident $(, $arg:ident : $ty:ty)* $(,)? ) $body:block
    )*) => {
        $(
            $(#[$m])*
            #[allow(non_snake_case, unused_variables, clippy::missing_safety_doc)]
            pub(crate) unsafe extern "C" fn $f($($arg: $ty),*) -> ::cuda_multimem_sys::CUresult {
                $crate::state::enter(stringify!($sym), |$st| {
                    #[allow(unused_unsafe)]
                    // SAFETY: the caller of a driver entry point passes pointers that are valid as
                    // that call's documentation requires; each body checks for null.
                    unsafe { $body }
                })
            }
            const _: () = {
                let _signature_matches: ::cuda_multimem_sys::$pfn = Some($f);
            };
        )*
        /// This module's simulated entry points.
        pub(crate) fn exports() -> Vec<$crate::dispatch::Export> {
            vec![$($crate::dispatch::Export { name: stringify!($sym), abi: $abi, addr: $f as *const () as usize }),*]
        }
    };
}
pub(crate) use sim_api;

fn table() -> &'static HashMap<&'static str, Vec<Export>> {
    static TABLE: OnceLock<HashMap<&'static str, Vec<Export>>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t: HashMap<&'static str, Vec<Export>> = HashMap::new();
        for e in crate::all_exports() {
            t.entry(e.name).or_default().push(e);
        }
        for v in t.values_mut() {
            v.sort_by_key(|e| e.abi);
        }
        t
    })
}

/// The CUDA version in which `name` first appeared, by the pinned headers' oldest ABI of it.
fn introduced(name: &str) -> Option<i32> {
    SYMBOLS
        .iter()
        .filter(|s| s.name == name)
        .map(|s| s.abi)
        .min()
}

/// The simulated entry points, by symbol (for tests and `info`).
pub fn implemented() -> Vec<(&'static str, i32)> {
    let mut v: Vec<_> = table()
        .values()
        .flatten()
        .map(|e| (e.name, e.abi))
        .collect();
    v.sort();
    v
}

/// `cuGetProcAddress_v2` of the simulated driver. Follows the real driver's answers: a version
/// newer than the driver is `CUDA_ERROR_INVALID_VALUE`; a symbol the driver predates (or that the
/// simulator does not implement) is `CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND`; a known symbol asked
/// at a version older than its first ABI is `CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT`; both
/// with a null pointer and `CUDA_SUCCESS`, as the documentation says.
#[allow(non_snake_case)]
pub(crate) unsafe extern "C" fn cuGetProcAddress_v12000(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: cuuint64_t,
    status: *mut CUdriverProcAddressQueryResult,
) -> CUresult {
    crate::state::enter("cuGetProcAddress", |st| {
        st.proc_address_requests.fetch_add(1, Ordering::Relaxed);
        if symbol.is_null() || pfn.is_null() || flags > 2 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-null; the caller passes a NUL-terminated string.
        let name = unsafe { CStr::from_ptr(symbol) }
            .to_str()
            .map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: non-null, valid for one write.
        unsafe { pfn.write(std::ptr::null_mut()) };
        if cuda_version > st.version() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let set = |s: CUdriverProcAddressQueryResult| {
            if !status.is_null() {
                // SAFETY: non-null, valid for one write.
                unsafe { status.write(s) };
            }
        };
        let exports = table()
            .get(name)
            .filter(|_| introduced(name).is_some_and(|v| v <= st.version()));
        let Some(exports) = exports else {
            set(CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
            return Ok(());
        };
        match exports.iter().rev().find(|e| e.abi <= cuda_version) {
            Some(e) => {
                // SAFETY: non-null, valid for one write.
                unsafe { pfn.write(e.addr as *mut c_void) };
                set(CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS);
            }
            None => set(CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT),
        }
        Ok(())
    })
}

/// `cuDriverGetVersion` of the simulated driver.
#[allow(non_snake_case)]
pub(crate) unsafe extern "C" fn cuDriverGetVersion_v2020(v: *mut c_int) -> CUresult {
    match current() {
        // SAFETY: the caller passes a pointer valid for one write (or null, refused).
        Some(st) => match unsafe { out(v, st.version()) } {
            Ok(()) => CUresult::CUDA_SUCCESS,
            Err(e) => e,
        },
        None => CUresult::CUDA_ERROR_DEINITIALIZED,
    }
}

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
    cuDriverGetVersion @ 2020 as PFN_cuDriverGetVersion_v2020 => fn driver_get_version(st, v: *mut c_int) {
        out(v, st.version())
    }
    cuGetProcAddress @ 12000 as PFN_cuGetProcAddress_v12000 => fn get_proc_address(st, symbol: *const c_char, pfn: *mut *mut c_void, v: c_int, flags: cuuint64_t, status: *mut CUdriverProcAddressQueryResult) {
        match cuGetProcAddress_v12000(symbol, pfn, v, flags, status) {
            CUresult::CUDA_SUCCESS => Ok(()),
            e => Err(e),
        }
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
