//! Stream capture into a graph, and replay: [`StreamRef::begin_capture`],
//! [`StreamRef::end_capture`], [`Graph::instantiate`], [`GraphExec::launch`].

use cuda_multimem_sys::{CUgraph, CUgraphExec, CUstreamCaptureMode, CUstreamCaptureStatus};
use parking_lot::Mutex;

use crate::driver::Raw;
use crate::error::{cu, Result};
use crate::{Device, StreamRef};

/// How a capture restricts potentially unsafe calls (`CUstreamCaptureMode`) made meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CaptureMode {
    /// Unsafe calls of any thread are refused while this capture is running (the driver's
    /// default and the safest).
    #[default]
    Global,
    /// Unsafe calls of this thread are refused.
    ThreadLocal,
    /// Nothing is refused.
    Relaxed,
}

impl CaptureMode {
    fn raw(self) -> CUstreamCaptureMode {
        match self {
            CaptureMode::Global => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            CaptureMode::Relaxed => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        }
    }
}

impl StreamRef<'_> {
    /// Start capturing the work queued on this stream (and on streams that join it by waiting
    /// on events recorded in it) into a graph instead of running it (`cuStreamBeginCapture`).
    /// The legacy default stream cannot be captured.
    pub fn begin_capture(&self, mode: CaptureMode) -> Result<()> {
        self.check_not_default("be captured")?;
        self.device().bind()?;
        // SAFETY: a live stream; the mode is a valid enumerator.
        unsafe {
            cu!(
                self.device().driver(),
                cuStreamBeginCapture_v10010(self.raw(), mode.raw())
            )
        }
    }

    /// End the capture begun on this stream and return its graph (`cuStreamEndCapture`). Fails
    /// (`CUDA_ERROR_STREAM_CAPTURE_UNJOINED`) when a stream that joined the capture was not
    /// joined back.
    pub fn end_capture(&self) -> Result<Graph> {
        self.check_not_default("be captured")?;
        self.device().bind()?;
        let mut g: CUgraph = std::ptr::null_mut();
        // SAFETY: a live stream; one handle written through a valid pointer.
        unsafe {
            cu!(
                self.device().driver(),
                cuStreamEndCapture(self.raw(), &mut g)
            )
        }?;
        Ok(Graph {
            device: self.device().clone(),
            raw: Raw(g),
            calls: Mutex::new(()),
        })
    }

    /// Whether this stream is capturing (also when its capture was invalidated and still has to
    /// be ended) (`cuStreamIsCapturing`).
    pub fn is_capturing(&self) -> Result<bool> {
        if self.raw().is_null() {
            return Ok(false);
        }
        let mut st = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream; one status written through a valid pointer.
        unsafe {
            cu!(
                self.device().driver(),
                cuStreamIsCapturing(self.raw(), &mut st)
            )
        }?;
        Ok(st != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }
}

/// A captured graph (`CUgraph`), destroyed on drop. Instantiate it to run it.
///
/// The driver's graph objects are not internally synchronised ("No API or pair of APIs is
/// guaranteed to be safe to call on the same graph object from two different threads without
/// serialization"): this value is shared across threads, so its calls take a lock.
pub struct Graph {
    device: Device,
    raw: Raw<CUgraph>,
    /// Serialises the driver calls on `raw`.
    calls: Mutex<()>,
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Graph(device {}, {:p})",
            self.device.ordinal(),
            self.raw.0
        )
    }
}

impl Graph {
    /// The raw handle (valid while `self` lives).
    pub fn raw(&self) -> CUgraph {
        self.raw.0
    }

    /// The device whose stream captured it.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// An executable graph of it (`cuGraphInstantiateWithFlags`, no flags); the graph itself
    /// may be dropped afterwards.
    ///
    /// # Safety
    ///
    /// A graph replays its captured work by address: kernel parameters, copy and memset ranges,
    /// events. Nothing ties the executable graph to the buffers, modules, communicators and
    /// events the captured calls used (safe calls included: a captured
    /// `DeviceBuffer::copy_from_async` or collective), so the caller guarantees that every one of
    /// them outlives every [`GraphExec::launch`] of the result, and stays where the capture saw it
    /// (a `VmmBuffer` that grew moved). A replay after one is freed writes to whatever memory took
    /// its place.
    pub unsafe fn instantiate(&self) -> Result<GraphExec> {
        self.device.bind()?;
        let mut e: CUgraphExec = std::ptr::null_mut();
        let _serialised = self.calls.lock();
        // SAFETY: a live graph, used by no other thread meanwhile (the lock); one handle written
        // through a valid pointer; flags 0.
        unsafe {
            cu!(
                self.device.driver(),
                cuGraphInstantiateWithFlags(&mut e, self.raw.0, 0)
            )
        }?;
        Ok(GraphExec {
            device: self.device.clone(),
            raw: Raw(e),
            calls: Mutex::new(()),
        })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let g = self.raw;
        self.device.driver().teardown(
            || format!("the graph {:p} (cuGraphDestroy)", g.0),
            // SAFETY: we own the graph; executable graphs made from it do not need it.
            move |d| {
                let g = g; // the whole Send wrapper, not its raw field
                unsafe { cu!(d, cuGraphDestroy(g.0)) }
            },
        );
    }
}

/// An executable graph (`CUgraphExec`), destroyed on drop (launches already queued still run).
/// Launches from several threads are serialised, as the driver requires (see [`Graph`]). Made by
/// [`Graph::instantiate`], whose caller promised that what the captured work uses outlives every
/// launch — so launching is safe.
pub struct GraphExec {
    device: Device,
    raw: Raw<CUgraphExec>,
    /// Serialises the driver calls on `raw`.
    calls: Mutex<()>,
}

impl std::fmt::Debug for GraphExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GraphExec(device {}, {:p})",
            self.device.ordinal(),
            self.raw.0
        )
    }
}

impl GraphExec {
    /// The raw handle (valid while `self` lives).
    pub fn raw(&self) -> CUgraphExec {
        self.raw.0
    }

    /// Queue one replay of the graph on `stream`, a stream of the graph's device and driver
    /// value (`cuGraphLaunch`).
    pub fn launch<'s>(&self, stream: impl Into<StreamRef<'s>>) -> Result<()> {
        let stream = stream.into();
        stream.check_device("stream", &self.device, "the graph was captured on")?;
        self.device.bind()?;
        let _serialised = self.calls.lock();
        // SAFETY: a live executable graph, used by no other thread meanwhile (the lock), and a
        // live stream of its device.
        unsafe {
            cu!(
                self.device.driver(),
                cuGraphLaunch(self.raw.0, stream.raw())
            )
        }
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        let g = self.raw;
        self.device.driver().teardown(
            || format!("the executable graph {:p} (cuGraphExecDestroy)", g.0),
            // SAFETY: we own the executable graph.
            move |d| {
                let g = g; // the whole Send wrapper, not its raw field
                unsafe { cu!(d, cuGraphExecDestroy(g.0)) }
            },
        );
    }
}
