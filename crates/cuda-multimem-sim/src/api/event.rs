//! Event management: creation, records, queries, synchronisation and elapsed time.

use std::ffi::{c_float, c_uint};

use cuda_multimem_sys::*;

use super::gate::{out, sim_api};
use crate::model::context::current_device;
use crate::model::stream::{self, event};

sim_api! {
    cuEventCreate @ 2000 as PFN_cuEventCreate_v2000 => fn event_create(st, ph: *mut CUevent, flags: c_uint) {
        if ph.is_null() || flags & !0xf != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        current_device(st)?;
        let timing = flags & CUevent_flags_enum::CU_EVENT_DISABLE_TIMING.0 == 0;
        let h = stream::create_event(st, timing);
        out(ph, h as CUevent)
    }
    cuEventDestroy @ 4000 as PFN_cuEventDestroy_v4000 => fn event_destroy(st, ev: CUevent) {
        stream::destroy_event(st, ev)
    }
    cuEventRecord @ 2000 as PFN_cuEventRecord_v2000 => fn event_record(st, ev: CUevent, h: CUstream) {
        let e = event(st, ev)?;
        let s = stream::stream(st, h)?;
        stream::record_event(st, e, &s)
    }
    cuEventQuery @ 2000 as PFN_cuEventQuery_v2000 => fn event_query(st, ev: CUevent) {
        if event(st, ev)?.is_complete() { Ok(()) } else { Err(CUresult::CUDA_ERROR_NOT_READY) }
    }
    cuEventSynchronize @ 2000 as PFN_cuEventSynchronize_v2000 => fn event_synchronize(st, ev: CUevent) {
        event(st, ev)?.synchronize();
        Ok(())
    }
    cuEventElapsedTime @ 2000 as PFN_cuEventElapsedTime_v2000 => fn event_elapsed_time(st, ms: *mut c_float, start: CUevent, end: CUevent) {
        let (a, b) = (event(st, start)?, event(st, end)?);
        let d = stream::elapsed_ms(&a, &b)?;
        out(ms, d as c_float)
    }
}
