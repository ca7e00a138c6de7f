//! Streams and events.

use std::time::Duration;

use cuda_multimem_sys::{CUevent, CUevent_flags_enum, CUstream, CUstream_flags_enum};

use crate::driver::Raw;
use crate::error::{cu, Error, Result};
use crate::Device;

/// A non-blocking stream of one device; destroyed on drop (queued work finishes first).
pub struct Stream {
    device: Device,
    raw: Raw<CUstream>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Stream(device {}, {:p})",
            self.device.ordinal(),
            self.raw.0
        )
    }
}

impl Stream {
    /// A new non-blocking stream on `device`.
    pub fn new(device: &Device) -> Result<Stream> {
        device.bind()?;
        let mut s: CUstream = std::ptr::null_mut();
        // SAFETY: out-pointer valid; the device's context is current.
        unsafe {
            cu!(
                device.driver(),
                cuStreamCreate(&mut s, CUstream_flags_enum::CU_STREAM_NON_BLOCKING.0)
            )
        }?;
        Ok(Stream {
            device: device.clone(),
            raw: Raw(s),
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The raw handle (valid while `self` lives).
    pub fn raw(&self) -> CUstream {
        self.raw.0
    }

    /// Wait for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live stream.
        unsafe { cu!(self.device.driver(), cuStreamSynchronize(self.raw.0)) }
    }

    /// Make later work on this stream wait for `event`.
    pub fn wait(&self, event: &Event) -> Result<()> {
        // SAFETY: live stream and event.
        unsafe {
            cu!(
                self.device.driver(),
                cuStreamWaitEvent(self.raw.0, event.raw.0, 0)
            )
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: we own the stream; nothing uses the handle after this.
        let _ = unsafe { cu!(self.device.driver(), cuStreamDestroy_v4000(self.raw.0)) };
    }
}

/// An event of one device.
pub struct Event {
    device: Device,
    raw: Raw<CUevent>,
}

impl Event {
    /// A new event; `timing` enables [`Event::elapsed_since`].
    pub fn new(device: &Device, timing: bool) -> Result<Event> {
        device.bind()?;
        let flags = if timing {
            0
        } else {
            CUevent_flags_enum::CU_EVENT_DISABLE_TIMING.0
        };
        let mut e: CUevent = std::ptr::null_mut();
        // SAFETY: out-pointer valid; a context is current.
        unsafe { cu!(device.driver(), cuEventCreate(&mut e, flags)) }?;
        Ok(Event {
            device: device.clone(),
            raw: Raw(e),
        })
    }

    /// The raw handle.
    pub fn raw(&self) -> CUevent {
        self.raw.0
    }

    /// Record on `stream`.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        if stream.device() != &self.device {
            return Err(Error::invalid(
                "stream",
                format!(
                    "stream of device {} cannot record an event of device {}",
                    stream.device().ordinal(),
                    self.device.ordinal()
                ),
            ));
        }
        // SAFETY: live event and stream of the same device.
        unsafe {
            cu!(
                self.device.driver(),
                cuEventRecord(self.raw.0, stream.raw())
            )
        }
    }

    /// Wait until the recorded work completed.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live event.
        unsafe { cu!(self.device.driver(), cuEventSynchronize(self.raw.0)) }
    }

    /// Whether the recorded work completed.
    pub fn is_complete(&self) -> Result<bool> {
        // SAFETY: a live event.
        match unsafe { cu!(self.device.driver(), cuEventQuery(self.raw.0)) } {
            Ok(()) => Ok(true),
            Err(Error::Driver { code, .. })
                if code == cuda_multimem_sys::CUresult::CUDA_ERROR_NOT_READY =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Time from `start` to this event (both recorded and complete).
    pub fn elapsed_since(&self, start: &Event) -> Result<Duration> {
        let mut ms = 0f32;
        // SAFETY: live events; one float written.
        unsafe {
            cu!(
                self.device.driver(),
                cuEventElapsedTime_v2000(&mut ms, start.raw.0, self.raw.0)
            )
        }?;
        Ok(Duration::from_secs_f64(ms.max(0.0) as f64 / 1e3))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: we own the event.
        let _ = unsafe { cu!(self.device.driver(), cuEventDestroy_v4000(self.raw.0)) };
    }
}
