//! Stream management: creation, destruction, synchronisation, queries, event waits and graph
//! capture.

use std::ffi::c_uint;

use cuda_multimem_sys::*;

use super::gate::{out, sim_api};
use crate::model::context;
use crate::model::stream::{self, event};

sim_api! {
    cuStreamCreate @ 2000 as PFN_cuStreamCreate_v2000 => fn stream_create(st, ph: *mut CUstream, flags: c_uint) {
        if ph.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let h = stream::new_stream(st, flags)?;
        out(ph, h as CUstream)
    }
    cuStreamCreateWithPriority @ 5050 as PFN_cuStreamCreateWithPriority_v5050 => fn stream_create_with_priority(st, ph: *mut CUstream, flags: c_uint, priority: i32) {
        if ph.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let h = stream::new_stream(st, flags)?;
        out(ph, h as CUstream)
    }
    cuStreamDestroy @ 4000 as PFN_cuStreamDestroy_v4000 => fn stream_destroy(st, h: CUstream) {
        stream::destroy(st, h)
    }
    cuStreamSynchronize @ 2000 as PFN_cuStreamSynchronize_v2000 => fn stream_synchronize(st, h: CUstream) {
        let s = stream::stream(st, h)?;
        let r = s.synchronize();
        // A stream of a dead context reports the context's error, whichever context is current.
        match context::sticky_error(st, s.device) {
            Some(code) => Err(code),
            None => r,
        }
    }
    cuStreamQuery @ 2000 as PFN_cuStreamQuery_v2000 => fn stream_query(st, h: CUstream) {
        let s = stream::stream(st, h)?;
        if let Some(code) = context::sticky_error(st, s.device) {
            return Err(code);
        }
        if s.idle() { Ok(()) } else { Err(CUresult::CUDA_ERROR_NOT_READY) }
    }
    cuStreamWaitEvent @ 3020 as PFN_cuStreamWaitEvent_v3020 => fn stream_wait_event(st, h: CUstream, ev: CUevent, flags: c_uint) {
        let e = event(st, ev)?;
        let s = stream::stream(st, h)?;
        stream::wait_event(st, &s, e)
    }
    cuStreamBeginCapture @ 10010 as PFN_cuStreamBeginCapture_v10010 => fn stream_begin_capture(st, h: CUstream, mode: CUstreamCaptureMode) {
        // The legacy and per-thread default streams cannot capture.
        if (h as u64) <= 2 {
            return Err(CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        }
        let s = stream::stream(st, h)?;
        stream::begin_capture(&s)
    }
    cuStreamEndCapture @ 10000 as PFN_cuStreamEndCapture_v10000 => fn stream_end_capture(st, h: CUstream, graph: *mut CUgraph) {
        if graph.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let s = stream::stream(st, h)?;
        let g = stream::end_capture(st, &s)?;
        out(graph, g as CUgraph)
    }
    cuStreamIsCapturing @ 10000 as PFN_cuStreamIsCapturing_v10000 => fn stream_is_capturing(st, h: CUstream, status: *mut CUstreamCaptureStatus) {
        let c = stream::stream(st, h)?.capturing();
        out(status, if c { CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE } else { CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE })
    }
}
