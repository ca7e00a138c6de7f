//! The gate every simulated call passes before its body runs: the session and `cuInit` checks,
//! the call count, failure injection and the current context's sticky error; then the body, with
//! a panic inside the simulator turned into `CUDA_ERROR_UNKNOWN`. Also the `sim_api!` macro that
//! writes an area's entry points through the gate, and the out- and in-pointer helpers.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use cuda_multimem_sys::CUresult;

use crate::model::context;
use crate::state::{current, SimResult, State};

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
/// adding a simulated call is adding one block (and, for a new area, one line in `table.rs`).
macro_rules! sim_api {
    ($(
        $(#[$m:meta])*
        $sym:ident @ $abi:literal as $pfn:ident => fn $f:ident ( $st:ident $(, $arg:ident : $ty:ty)* $(,)? ) $body:block
    )*) => {
        $(
            $(#[$m])*
            #[allow(non_snake_case, unused_variables, clippy::missing_safety_doc)]
            pub(crate) unsafe extern "C" fn $f($($arg: $ty),*) -> ::cuda_multimem_sys::CUresult {
                $crate::api::gate::enter(stringify!($sym), |$st| {
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
        pub(crate) fn exports() -> Vec<$crate::api::gate::Export> {
            vec![$($crate::api::gate::Export { name: stringify!($sym), abi: $abi, addr: $f as *const () as usize }),*]
        }
    };
}
pub(crate) use sim_api;

/// Calls that work before `cuInit`.
const BEFORE_INIT: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetProcAddress",
    "cuGetErrorName",
    "cuGetErrorString",
];

/// Run a simulated call's body: checks the session and `cuInit`, applies failure injection,
/// logs the call, refuses it with the current context's sticky error (unless it is one that a
/// dead context lets through) and turns a panic inside the simulator into `CUDA_ERROR_UNKNOWN`
/// (a panic must not cross the `extern "C"` boundary).
pub(crate) fn enter(name: &'static str, body: impl FnOnce(&Arc<State>) -> SimResult) -> CUresult {
    let Some(st) = current() else {
        return CUresult::CUDA_ERROR_DEINITIALIZED;
    };
    if !st.initialized.load(Ordering::Acquire) && !BEFORE_INIT.contains(&name) {
        return CUresult::CUDA_ERROR_NOT_INITIALIZED;
    }
    st.count_call(name);
    if let Some(code) = st.inject(name) {
        return code;
    }
    if !ignores_sticky(name) {
        if let Some(code) = context::current_sticky_error(&st) {
            return code;
        }
    }
    match catch_unwind(AssertUnwindSafe(|| body(&st))) {
        Ok(Ok(())) => CUresult::CUDA_SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => CUresult::CUDA_ERROR_UNKNOWN,
    }
}

/// Calls that a dead context does not refuse: those that need no context (device queries,
/// choosing and releasing contexts, error names) and the teardown calls (destroy, release, free,
/// unmap, unload, unbind), which the simulator lets through so that a program — and the
/// simulator's live-resource accounting — can still clean up. Every other call made while the
/// current context is dead returns its sticky error.
fn ignores_sticky(name: &str) -> bool {
    const CONTEXT_FREE: &[&str] = &[
        "cuInit",
        "cuDriverGetVersion",
        "cuGetProcAddress",
        "cuGetErrorName",
        "cuGetErrorString",
        "cuDeviceGet",
        "cuDeviceGetCount",
        "cuDeviceGetName",
        "cuDeviceGetAttribute",
        "cuDeviceTotalMem",
        "cuDeviceGetUuid",
        "cuDeviceCanAccessPeer",
        "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRelease",
        "cuDevicePrimaryCtxGetState",
        "cuCtxSetCurrent",
        "cuCtxGetCurrent",
        "cuCtxGetDevice",
        // Scoped by their stream's context, not the current one: they check it themselves.
        "cuStreamSynchronize",
        "cuStreamQuery",
    ];
    CONTEXT_FREE.contains(&name)
        || [
            "Destroy",
            "Release",
            "Free",
            "Unmap",
            "Unload",
            "Unbind",
            "Unregister",
        ]
        .iter()
        .any(|w| name.contains(w))
}

/// Write `v` through an out-pointer, rejecting null.
///
/// # Safety
/// `p` is null or valid for one write of `T`.
pub(crate) unsafe fn out<T>(p: *mut T, v: T) -> SimResult {
    if p.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and the caller promises validity.
    unsafe { p.write(v) };
    Ok(())
}

/// Read through an in-pointer, rejecting null.
///
/// # Safety
/// `p` is null or valid for one read of `T`.
pub(crate) unsafe fn read<T: Copy>(p: *const T) -> SimResult<T> {
    if p.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and the caller promises validity.
    Ok(unsafe { p.read() })
}
