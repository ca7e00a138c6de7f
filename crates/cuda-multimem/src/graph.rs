//! Stream capture into a graph, and replay: [`StreamRef::begin_capture`],
//! [`StreamRef::end_capture`], [`Graph::instantiate`], [`GraphExec::launch`].

use cuda_multimem_sys::{CUgraph, CUgraphExec, CUstreamCaptureMode, CUstreamCaptureStatus};

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
pub struct Graph {
    device: Device,
    raw: Raw<CUgraph>,
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
    pub fn instantiate(&self) -> Result<GraphExec> {
        self.device.bind()?;
        let mut e: CUgraphExec = std::ptr::null_mut();
        // SAFETY: a live graph; one handle written through a valid pointer; flags 0.
        unsafe {
            cu!(
                self.device.driver(),
                cuGraphInstantiateWithFlags(&mut e, self.raw.0, 0)
            )
        }?;
        Ok(GraphExec {
            device: self.device.clone(),
            raw: Raw(e),
        })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: we own the graph; executable graphs made from it do not need it.
        let _ = unsafe { cu!(self.device.driver(), cuGraphDestroy(self.raw.0)) };
    }
}

/// An executable graph (`CUgraphExec`), destroyed on drop (launches already queued still run).
pub struct GraphExec {
    device: Device,
    raw: Raw<CUgraphExec>,
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
        // SAFETY: a live executable graph and a live stream of its device.
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
        // SAFETY: we own the executable graph.
        let _ = unsafe { cu!(self.device.driver(), cuGraphExecDestroy(self.raw.0)) };
    }
}
