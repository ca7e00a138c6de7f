//! Primary contexts, the current context, context synchronisation and peer access.

use std::ffi::{c_int, c_uint};

use cuda_multimem_sys::*;

use super::gate::{out, sim_api};
use crate::model::{context, stream};

sim_api! {
    cuDevicePrimaryCtxRetain @ 7000 as PFN_cuDevicePrimaryCtxRetain_v7000 => fn primary_ctx_retain(st, pctx: *mut CUcontext, dev: CUdevice) {
        st.device(dev)?;
        if pctx.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let h = context::retain_primary(st, dev);
        out(pctx, h as CUcontext)
    }
    cuDevicePrimaryCtxRelease @ 11000 as PFN_cuDevicePrimaryCtxRelease_v11000 => fn primary_ctx_release(st, dev: CUdevice) {
        st.device(dev)?;
        context::release_primary(st, dev)
    }
    cuDevicePrimaryCtxGetState @ 7000 as PFN_cuDevicePrimaryCtxGetState_v7000 => fn primary_ctx_get_state(st, dev: CUdevice, flags: *mut c_uint, active: *mut c_int) {
        st.device(dev)?;
        let n = context::primary_retains(st, dev);
        out(flags, 0)?;
        out(active, (n > 0) as c_int)
    }
    cuCtxSetCurrent @ 4000 as PFN_cuCtxSetCurrent_v4000 => fn ctx_set_current(st, ctx: CUcontext) {
        context::set_current(st, ctx as u64)
    }
    cuCtxGetCurrent @ 4000 as PFN_cuCtxGetCurrent_v4000 => fn ctx_get_current(st, ctx: *mut CUcontext) {
        out(ctx, context::current_handle() as CUcontext)
    }
    cuCtxGetDevice @ 2000 as PFN_cuCtxGetDevice_v2000 => fn ctx_get_device(st, dev: *mut CUdevice) {
        let d = context::current_device(st)?;
        out(dev, d)
    }
    cuCtxSynchronize @ 2000 as PFN_cuCtxSynchronize_v2000 => fn ctx_synchronize(st) {
        let d = context::current_device(st)?;
        stream::synchronize_device(st, d)
    }
    cuCtxEnablePeerAccess @ 4000 as PFN_cuCtxEnablePeerAccess_v4000 => fn ctx_enable_peer_access(st, peer: CUcontext, flags: c_uint) {
        if flags != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        context::enable_peer(st, peer)
    }
    cuCtxDisablePeerAccess @ 4000 as PFN_cuCtxDisablePeerAccess_v4000 => fn ctx_disable_peer_access(st, peer: CUcontext) {
        context::disable_peer(st, peer)
    }
}
