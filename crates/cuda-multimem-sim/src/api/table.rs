//! The simulated driver's function table: every area's exports, and `cuGetProcAddress` (with
//! `cuDriverGetVersion`, the loader's other entry) answering from it as the real driver would
//! for the configured version.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use cuda_multimem_sys::*;

use super::gate::{enter, out, sim_api, Export};
use crate::state::current;

/// Every simulated area's exports.
fn all_exports() -> Vec<Export> {
    [
        exports(),
        super::driver::exports(),
        super::device::exports(),
        super::context::exports(),
        super::stream::exports(),
        super::event::exports(),
        super::graph::exports(),
        super::memory::exports(),
        super::vmm::exports(),
        super::managed::exports(),
        super::module::exports(),
        super::launch::exports(),
        super::endpoint::exports(),
        super::multicast::exports(),
    ]
    .concat()
}

fn table() -> &'static HashMap<&'static str, Vec<Export>> {
    static TABLE: OnceLock<HashMap<&'static str, Vec<Export>>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t: HashMap<&'static str, Vec<Export>> = HashMap::new();
        for e in all_exports() {
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
    enter("cuGetProcAddress", |st| {
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

sim_api! {
    cuDriverGetVersion @ 2020 as PFN_cuDriverGetVersion_v2020 => fn driver_get_version(st, v: *mut c_int) {
        out(v, st.version())
    }
    cuGetProcAddress @ 12000 as PFN_cuGetProcAddress_v12000 => fn get_proc_address(st, symbol: *const c_char, pfn: *mut *mut c_void, v: c_int, flags: cuuint64_t, status: *mut CUdriverProcAddressQueryResult) {
        match cuGetProcAddress_v12000(symbol, pfn, v, flags, status) {
            CUresult::CUDA_SUCCESS => Ok(()),
            e => Err(e),
        }
    }
}
