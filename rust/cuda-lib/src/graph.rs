//! CUDA graphs captured from a stream (e.g. to check that kernels are capture-safe).
use std::sync::Arc;

use cudarc::driver::sys;

use crate::{context::Context, driver::log_drop_error, error::Result, stream::Stream};

impl Stream {
    /// Starts capturing the work submitted to this stream (by this thread) into a graph.
    pub fn begin_capture(&self) -> Result<()> {
        let _cur = self.context().enter()?;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: the stream is live.
        unsafe { cu!(cuStreamBeginCapture_v2(self.raw(), mode)) }
    }

    /// Ends the capture started by [`Stream::begin_capture`].
    pub fn end_capture(&self) -> Result<Graph> {
        let _cur = self.context().enter()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the stream is live; `raw` is a valid out pointer.
        unsafe { cu!(cuStreamEndCapture(self.raw(), &mut raw)) }?;
        Ok(Graph { ctx: self.context().clone(), raw })
    }
}

/// A captured graph; destroyed on drop.
#[derive(Debug)]
pub struct Graph {
    ctx: Arc<Context>,
    raw: sys::CUgraph,
}

// SAFETY: graph handles are driver objects usable from any thread; &self methods only read.
unsafe impl Send for Graph {}
// SAFETY: as above.
unsafe impl Sync for Graph {}

impl Graph {
    /// Instantiates the graph for launching.
    pub fn instantiate(&self) -> Result<GraphExec> {
        let _cur = self.ctx.enter()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `self.raw` is live; `raw` is a valid out pointer; flags 0.
        unsafe { cu!(cuGraphInstantiateWithFlags(&mut raw, self.raw, 0)) }?;
        Ok(GraphExec { ctx: self.ctx.clone(), raw })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let result = self.ctx.enter().and_then(|_cur| {
            // SAFETY: `raw` came from cuStreamEndCapture and is destroyed once.
            unsafe { cu!(cuGraphDestroy(self.raw)) }
        });
        log_drop_error("graph", result);
    }
}

/// An instantiated graph; destroyed on drop.
#[derive(Debug)]
pub struct GraphExec {
    ctx: Arc<Context>,
    raw: sys::CUgraphExec,
}

// SAFETY: executable graphs are driver handles usable from any thread.
unsafe impl Send for GraphExec {}
// SAFETY: as above.
unsafe impl Sync for GraphExec {}

impl GraphExec {
    /// Launches the graph on `stream`.
    ///
    /// # Safety
    /// Every address the captured work touches must still be valid (captures keep pointers, not
    /// ownership).
    pub unsafe fn launch(&self, stream: &Stream) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: both handles are live; the caller guarantees the captured addresses.
        unsafe { cu!(cuGraphLaunch(self.raw, stream.raw())) }
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        let result = self.ctx.enter().and_then(|_cur| {
            // SAFETY: `raw` came from cuGraphInstantiateWithFlags and is destroyed once.
            unsafe { cu!(cuGraphExecDestroy(self.raw)) }
        });
        log_drop_error("graph exec", result);
    }
}
