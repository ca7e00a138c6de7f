//! Streams and events: an owned [`Stream`], a borrowed [`StreamRef`] (what `BorrowedFd` is to
//! `OwnedFd`), and [`Event`]. Stream capture into graphs is in `graph.rs`.

use std::time::{Duration, Instant};

use cuda_multimem_sys::{
    CUdeviceptr, CUevent, CUevent_flags_enum, CUmemcpyAttributes, CUmemcpyFlags_enum,
    CUmemcpySrcAccessOrder_enum, CUresult, CUstream, CUstream_flags_enum,
};

use crate::driver::Raw;
use crate::error::{check, cu, Error, Result};
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

    /// This stream, borrowed: what launches, copies and captures take.
    pub fn as_stream_ref(&self) -> StreamRef<'_> {
        StreamRef {
            device: &self.device,
            raw: self.raw,
        }
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
        self.as_stream_ref().synchronize()
    }

    /// Whether all queued work has completed (`cuStreamQuery`).
    pub fn is_idle(&self) -> Result<bool> {
        self.as_stream_ref().is_idle()
    }

    /// Wait for all queued work, at most `timeout` (see [`StreamRef::wait_idle`]).
    pub fn wait_idle(&self, timeout: Duration) -> Result<()> {
        self.as_stream_ref().wait_idle(timeout)
    }

    /// Make later work on this stream wait for `event`.
    pub fn wait(&self, event: &Event) -> Result<()> {
        self.as_stream_ref().wait(event)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let s = self.raw;
        self.device.driver().teardown(
            || format!("the stream {:p} (cuStreamDestroy)", s.0),
            // SAFETY: we own the stream; nothing uses the handle after this (borrows have ended).
            move |d| {
                let s = s; // the whole Send wrapper, not its raw field
                unsafe { cu!(d, cuStreamDestroy_v4000(s.0)) }
            },
        );
    }
}

impl<'a> From<&'a Stream> for StreamRef<'a> {
    fn from(s: &'a Stream) -> StreamRef<'a> {
        s.as_stream_ref()
    }
}

/// A borrowed stream of one device: a [`Stream`] of ours, a stream of another library
/// ([`StreamRef::from_raw`], `StreamRef::from_cudarc` with the `cudarc` feature) or the legacy default stream (a null
/// handle). Copy; the lifetime keeps the stream's owner alive while it is used.
#[derive(Clone, Copy)]
pub struct StreamRef<'a> {
    device: &'a Device,
    raw: Raw<CUstream>,
}

impl std::fmt::Debug for StreamRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "StreamRef(device {}, {:p})",
            self.device.ordinal(),
            self.raw.0
        )
    }
}

impl<'a> StreamRef<'a> {
    /// Borrow a raw stream handle of `device`.
    ///
    /// # Safety
    /// `raw` is null (the legacy default stream of `device`'s primary context) or a live stream
    /// created in `device`'s primary context through the same driver library as
    /// `device.driver()`, and it stays live for `'a`.
    pub unsafe fn from_raw(device: &'a Device, raw: CUstream) -> StreamRef<'a> {
        StreamRef {
            device,
            raw: Raw(raw),
        }
    }

    /// Borrow a stream of the `cudarc` crate (feature `cudarc`). Refused for a simulated
    /// driver (cudarc cannot talk to the simulator), for a stream of another device, and for a
    /// stream whose context is not `device`'s primary context.
    #[cfg(feature = "cudarc")]
    pub fn from_cudarc(
        device: &'a Device,
        stream: &'a cudarc::driver::CudaStream,
    ) -> Result<StreamRef<'a>> {
        if device.driver().is_simulated() {
            return Err(Error::invalid(
                "stream",
                "a cudarc stream, but this device belongs to the simulated driver, which cudarc cannot use",
            ));
        }
        let ordinal = stream.context().ordinal();
        if ordinal != device.ordinal() as usize {
            return Err(Error::invalid(
                "stream",
                format!(
                    "a cudarc stream of device {ordinal}; expected device {}",
                    device.ordinal()
                ),
            ));
        }
        let ours = device.primary_context()?;
        let theirs = stream.context().cu_ctx();
        if !std::ptr::eq(theirs.cast::<std::ffi::c_void>(), ours.cast()) {
            return Err(Error::invalid(
                "stream",
                format!(
                    "a cudarc stream of context {theirs:p}; device {}'s primary context is {ours:p}",
                    device.ordinal()
                ),
            ));
        }
        // SAFETY: a live cudarc stream of `device`'s primary context in this process (checked
        // above), borrowed for 'a; cudarc's CUstream is the driver's opaque stream pointer.
        Ok(unsafe { StreamRef::from_raw(device, stream.cu_stream() as CUstream) })
    }

    /// The device.
    pub fn device(&self) -> &'a Device {
        self.device
    }

    /// The raw handle (valid for `'a`).
    pub fn raw(&self) -> CUstream {
        self.raw.0
    }

    /// The legacy default stream needs its context current; other streams carry theirs.
    fn bind_if_default(&self) -> Result<()> {
        if self.raw.0.is_null() {
            self.device.bind()?;
        }
        Ok(())
    }

    /// Refuse the legacy default stream (a null handle) where the driver does.
    pub(crate) fn check_not_default(&self, what: &str) -> Result<()> {
        if self.raw.0.is_null() {
            return Err(Error::invalid(
                "stream",
                format!("the legacy default stream (a null handle) cannot {what}; use a Stream"),
            ));
        }
        Ok(())
    }

    /// Refuse a stream of another device or another driver value, naming both.
    pub(crate) fn check_device(&self, arg: &'static str, want: &Device, what: &str) -> Result<()> {
        if !self.device.driver().same_as(want.driver()) {
            return Err(Error::invalid(
                arg,
                format!(
                    "a stream from another Driver value; {what} device {} of a different one",
                    want.ordinal()
                ),
            ));
        }
        if self.device.ordinal() != want.ordinal() {
            return Err(Error::invalid(
                arg,
                format!(
                    "a stream of device {}; {what} device {}",
                    self.device.ordinal(),
                    want.ordinal()
                ),
            ));
        }
        Ok(())
    }

    /// Wait for all queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.bind_if_default()?;
        // SAFETY: a live stream (or the legacy stream of the current context).
        unsafe { cu!(self.device.driver(), cuStreamSynchronize(self.raw.0)) }
    }

    /// Whether all queued work has completed (`cuStreamQuery`: `CUDA_ERROR_NOT_READY` is
    /// `false`).
    pub fn is_idle(&self) -> Result<bool> {
        self.bind_if_default()?;
        // SAFETY: a live stream (or the legacy stream of the current context).
        match unsafe { cu!(self.device.driver(), cuStreamQuery(self.raw.0)) } {
            Ok(()) => Ok(true),
            Err(Error::Driver { code, .. }) if code == CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Wait for all queued work, polling, at most `timeout`: [`Error::Timeout`] with the
    /// timeout when work is still queued then (a hung kernel does not hang the caller).
    pub fn wait_idle(&self, timeout: Duration) -> Result<()> {
        let what = || {
            format!(
                "the work queued on stream {:p} of device {}",
                self.raw.0,
                self.device.ordinal()
            )
        };
        poll_until(timeout, WAIT_PAUSES, what, || self.is_idle())
    }

    /// Make later work on this stream wait for `event` (of any device of the same driver
    /// value).
    pub fn wait(&self, event: &Event) -> Result<()> {
        if !self.device.driver().same_as(event.device.driver()) {
            return Err(Error::invalid(
                "event",
                "an event from another Driver value than the stream's",
            ));
        }
        self.bind_if_default()?;
        // SAFETY: live stream and event of the same driver value.
        unsafe {
            cu!(
                self.device.driver(),
                cuStreamWaitEvent(self.raw.0, event.raw.0, 0)
            )
        }
    }

    /// Queue a copy of `bytes` bytes from `src` to `dst`, both device memory (or mappings),
    /// on this stream (`cuMemcpyDtoDAsync`). Zero bytes is a no-op.
    ///
    /// # Safety
    /// `src .. src + bytes` is readable and `dst .. dst + bytes` writable by this stream's
    /// device when the copy runs, the ranges do not overlap, and both stay allocated until it
    /// has run.
    pub unsafe fn copy_dtod_async(
        &self,
        dst: CUdeviceptr,
        src: CUdeviceptr,
        bytes: usize,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.device.bind()?;
        // SAFETY: as the caller promises; a live stream of the current context.
        unsafe {
            cu!(
                self.device.driver(),
                cuMemcpyDtoDAsync_v3020(dst, src, bytes, self.raw.0)
            )
        }
    }

    /// Queue a copy of `bytes` bytes from `src` to `dst`, both device memory (or mappings), on
    /// this stream, asking the driver to run it beside compute work: `cuMemcpyBatchAsync` with
    /// one copy whose attributes say `CU_MEMCPY_SRC_ACCESS_ORDER_STREAM` (the source is read in
    /// stream order, like [`StreamRef::copy_dtod_async`]) and
    /// `CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`. The flag is a hint the driver may ignore
    /// "depending on the platform and other parameters of the copy" (cuda.h): whether the copy
    /// then overlaps a kernel that holds every SM is for a measurement to say
    /// (`bench/src/overlap_probe.rs`). Zero bytes is a no-op.
    ///
    /// Plain `cuMemcpyDtoDAsync` instead (the same copy, without the hint):
    /// - on drivers before 12.8, which lack `cuMemcpyBatchAsync` (12.8 and 12.9 get its ABI
    ///   12080 form, which has a `failIdx` out-parameter; 13.0 and later the ABI 13000 form);
    /// - on the legacy default stream (a null handle), which `cuMemcpyBatchAsync` refuses;
    /// - while this stream captures a graph (its own capture or one it joined): the
    ///   documentation of `cuMemcpyBatchAsync` does not say that it can be captured, and
    ///   cuda-python's `cuda.core` refuses capturing streams for it, so a capture gets an
    ///   ordinary memcpy node, which every driver captures.
    ///
    /// # Safety
    /// As [`StreamRef::copy_dtod_async`]: `src .. src + bytes` is readable and
    /// `dst .. dst + bytes` writable by this stream's device when the copy runs, the ranges do
    /// not overlap, and both stay allocated until it has run.
    pub unsafe fn copy_dtod_async_overlapped(
        &self,
        dst: CUdeviceptr,
        src: CUdeviceptr,
        bytes: usize,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        if self.raw.0.is_null() || self.is_capturing()? {
            // SAFETY: the same contract, promised by the caller.
            return unsafe { self.copy_dtod_async(dst, src, bytes) };
        }
        let sys = self.device.driver().sys();
        let batch = (
            sys.cuMemcpyBatchAsync_v13000().ok(),
            sys.cuMemcpyBatchAsync_v12080().ok(),
        );
        self.device.bind()?;
        let mut dsts = [dst];
        let mut srcs = [src];
        let mut sizes = [bytes];
        let mut attrs = [CUmemcpyAttributes {
            srcAccessOrder: CUmemcpySrcAccessOrder_enum::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            flags: CUmemcpyFlags_enum::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE.0,
            // location hints: ignored for device memory (cuda.h), left zero
            ..CUmemcpyAttributes::default()
        }];
        // one set of attributes for every copy, from copy 0 (the first index must be 0)
        let mut attrs_idxs = [0usize];
        match batch {
            (Some(f), _) => {
                // SAFETY: one copy: the three one-element arrays and the attributes live across
                // the call (the driver reads them before it returns); the ranges as the caller
                // promises; a live non-null stream of the current context.
                let rc = unsafe {
                    f(
                        dsts.as_mut_ptr(),
                        srcs.as_mut_ptr(),
                        sizes.as_mut_ptr(),
                        1,
                        attrs.as_mut_ptr(),
                        attrs_idxs.as_mut_ptr(),
                        1,
                        self.raw.0,
                    )
                };
                check("cuMemcpyBatchAsync_v13000", rc)
            }
            (None, Some(f)) => {
                let mut fail_idx = usize::MAX;
                // SAFETY: as above, and `fail_idx` is valid for one write.
                let rc = unsafe {
                    f(
                        dsts.as_mut_ptr(),
                        srcs.as_mut_ptr(),
                        sizes.as_mut_ptr(),
                        1,
                        attrs.as_mut_ptr(),
                        attrs_idxs.as_mut_ptr(),
                        1,
                        &mut fail_idx,
                        self.raw.0,
                    )
                };
                check("cuMemcpyBatchAsync_v12080", rc)
            }
            // SAFETY: the same contract, promised by the caller.
            (None, None) => unsafe { self.copy_dtod_async(dst, src, bytes) },
        }
    }

    /// Queue setting `bytes` bytes at `dst` to `value` on this stream (`cuMemsetD8Async`).
    /// Zero bytes is a no-op.
    ///
    /// # Safety
    /// `dst .. dst + bytes` is device memory (or a mapping) writable by this stream's device
    /// when the memset runs, and stays allocated until it has run.
    pub unsafe fn memset_d8_async(&self, dst: CUdeviceptr, value: u8, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.device.bind()?;
        // SAFETY: as the caller promises; a live stream of the current context.
        unsafe {
            cu!(
                self.device.driver(),
                cuMemsetD8Async_v3020(dst, value, bytes, self.raw.0)
            )
        }
    }
}

/// The stream a call queues its work on, as the call's operands see it: a [`StreamRef`], and
/// (feature `cudarc`) the cudarc stream it was made from, against which cudarc operands take
/// their device pointers (so that cudarc's event tracking records the call's use on the stream
/// it runs on). A call makes one from its stream argument ([`IntoStream::into_stream`]) and
/// hands it to each operand's conversion; the operands borrow it for `'a`.
#[derive(Clone, Copy, Debug)]
pub struct CallStream<'a> {
    stream: StreamRef<'a>,
    #[cfg(feature = "cudarc")]
    cudarc: Option<&'a cudarc::driver::CudaStream>,
}

impl<'a> CallStream<'a> {
    /// The stream.
    pub fn stream(&self) -> StreamRef<'a> {
        self.stream
    }

    /// Its device.
    pub fn device(&self) -> &'a Device {
        self.stream.device
    }

    /// The cudarc stream it was made from (feature `cudarc`); `None` for other streams.
    #[cfg(feature = "cudarc")]
    pub fn cudarc(&self) -> Option<&'a cudarc::driver::CudaStream> {
        self.cudarc
    }
}

impl<'a> From<StreamRef<'a>> for CallStream<'a> {
    fn from(stream: StreamRef<'a>) -> CallStream<'a> {
        CallStream {
            stream,
            #[cfg(feature = "cudarc")]
            cudarc: None,
        }
    }
}

/// What a call takes as its stream: anything that is a [`StreamRef`] (`&Stream`, a
/// `StreamRef`) and, with the feature `cudarc`, a cudarc stream (`&CudaStream` or
/// `&Arc<CudaStream>`, which must be a stream of the call's device in its primary context).
pub trait IntoStream<'x> {
    /// This stream for a call of `device`, borrowed for the call (`'g`). A stream that needs
    /// the device to become a [`StreamRef`] (a cudarc stream) is checked against it here;
    /// others are checked by the call.
    fn into_stream<'g>(self, device: &'g Device) -> Result<CallStream<'g>>
    where
        'x: 'g;
}

impl<'x, S: Into<StreamRef<'x>>> IntoStream<'x> for S {
    fn into_stream<'g>(self, _device: &'g Device) -> Result<CallStream<'g>>
    where
        'x: 'g,
    {
        Ok(CallStream::from(self.into()))
    }
}

#[cfg(feature = "cudarc")]
impl<'x> IntoStream<'x> for &'x cudarc::driver::CudaStream {
    fn into_stream<'g>(self, device: &'g Device) -> Result<CallStream<'g>>
    where
        'x: 'g,
    {
        Ok(CallStream {
            stream: StreamRef::from_cudarc(device, self)?,
            cudarc: Some(self),
        })
    }
}

#[cfg(feature = "cudarc")]
impl<'x> IntoStream<'x> for &'x std::sync::Arc<cudarc::driver::CudaStream> {
    fn into_stream<'g>(self, device: &'g Device) -> Result<CallStream<'g>>
    where
        'x: 'g,
    {
        (&**self).into_stream(device)
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

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The raw handle.
    pub fn raw(&self) -> CUevent {
        self.raw.0
    }

    /// Record on `stream` (a stream of this event's device and driver value).
    pub fn record<'s>(&self, stream: impl Into<StreamRef<'s>>) -> Result<()> {
        let stream = stream.into();
        stream.check_device("stream", &self.device, "the event belongs to")?;
        stream.bind_if_default()?;
        // SAFETY: live event and stream of the same device and driver value.
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

    /// Wait until the recorded work completed, polling, at most `timeout`: [`Error::Timeout`]
    /// with the timeout when it has not then (a hung kernel does not hang the caller;
    /// [`Event::synchronize`] waits without a bound).
    pub fn wait_complete(&self, timeout: Duration) -> Result<()> {
        let what = || {
            format!(
                "the work recorded by event {:p} of device {}",
                self.raw.0,
                self.device.ordinal()
            )
        };
        poll_until(timeout, WAIT_PAUSES, what, || self.is_complete())
    }

    /// Whether the recorded work completed.
    pub fn is_complete(&self) -> Result<bool> {
        // SAFETY: a live event.
        match unsafe { cu!(self.device.driver(), cuEventQuery(self.raw.0)) } {
            Ok(()) => Ok(true),
            Err(Error::Driver { code, .. }) if code == CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Time from `start` to this event (both recorded and complete).
    pub fn elapsed_since(&self, start: &Event) -> Result<Duration> {
        if !self.device.driver().same_as(start.device.driver()) {
            return Err(Error::invalid(
                "start",
                "an event from another Driver value",
            ));
        }
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
        let e = self.raw;
        self.device.driver().teardown(
            || format!("the event {:p} (cuEventDestroy)", e.0),
            // SAFETY: we own the event.
            move |d| {
                let e = e; // the whole Send wrapper, not its raw field
                unsafe { cu!(d, cuEventDestroy_v4000(e.0)) }
            },
        );
    }
}

/// Poll `done` until it answers true, at most `timeout`: then [`Error::Timeout`] naming `what`.
/// Between polls it sleeps `pauses.0`, doubling up to `pauses.1`.
pub(crate) fn poll_until(
    timeout: Duration,
    pauses: (Duration, Duration),
    what: impl FnOnce() -> String,
    mut done: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let start = Instant::now();
    let mut pause = pauses.0;
    loop {
        if done()? {
            return Ok(());
        }
        let spent = start.elapsed();
        if spent >= timeout {
            return Err(Error::Timeout {
                what: what(),
                after: timeout,
            });
        }
        std::thread::sleep(pause.min(timeout - spent));
        pause = (pause * 2).min(pauses.1);
    }
}

/// The pauses of the stream's and the event's bounded waits (kernels end in microseconds).
const WAIT_PAUSES: (Duration, Duration) = (Duration::from_micros(5), Duration::from_millis(1));
