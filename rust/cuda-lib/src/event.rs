//! Events: ordering between streams, completion queries, timing.
use std::sync::Arc;

use cudarc::driver::sys;

use crate::{context::Context, driver::log_drop_error, error::Result, stream::Stream};

/// A CUDA event; destroyed on drop.
#[derive(Debug)]
pub struct Event {
    ctx: Arc<Context>,
    raw: sys::CUevent,
}

// SAFETY: a CUevent is a driver handle usable from any thread.
unsafe impl Send for Event {}
// SAFETY: as above; all methods take &self.
unsafe impl Sync for Event {}

impl Event {
    /// Creates an event; `timing` enables [`Event::elapsed_ms`] (slightly slower to record).
    pub fn new(ctx: &Arc<Context>, timing: bool) -> Result<Self> {
        let flags =
            if timing { sys::CUevent_flags::CU_EVENT_DEFAULT } else { sys::CUevent_flags::CU_EVENT_DISABLE_TIMING };
        let _cur = ctx.enter()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the context is current; `raw` is a valid out pointer.
        unsafe { cu!(cuEventCreate(&mut raw, flags as u32)) }?;
        Ok(Event { ctx: ctx.clone(), raw })
    }

    /// The raw `CUevent`.
    pub fn raw(&self) -> sys::CUevent {
        self.raw
    }

    /// Records the event at the current end of `stream`.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: both handles are live.
        unsafe { cu!(cuEventRecord(self.raw, stream.raw())) }
    }

    /// Records the event at the current end of the context's legacy default stream (work a
    /// library queued there, e.g. libfabric's `shm` device copies).
    pub fn record_on_legacy_stream(&self) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: `raw` is live; CU_STREAM_LEGACY is the documented handle (0x1) of the
        // current context's legacy default stream.
        unsafe { cu!(cuEventRecord(self.raw, 0x1 as sys::CUstream)) }
    }

    /// Blocks until the recorded work completed.
    pub fn synchronize(&self) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: `raw` is live.
        unsafe { cu!(cuEventSynchronize(self.raw)) }
    }

    /// Whether the recorded work completed (non-blocking).
    pub fn is_complete(&self) -> Result<bool> {
        let _cur = self.ctx.enter()?;
        // SAFETY: `raw` is live.
        match unsafe { cu!(cuEventQuery(self.raw)) } {
            Ok(()) => Ok(true),
            Err(e) if e.code() == Some(sys::CUresult::CUDA_ERROR_NOT_READY as i32) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Milliseconds from `self` to `end` (both recorded, completed, created with timing).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        let _cur = self.ctx.enter()?;
        let mut ms = 0.0f32;
        // SAFETY: both handles are live; `ms` is a valid out pointer.
        unsafe { cu!(cuEventElapsedTime_v2(&mut ms, self.raw, end.raw)) }?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let result = self.ctx.enter().and_then(|_cur| {
            // SAFETY: `raw` came from cuEventCreate and is destroyed once.
            unsafe { cu!(cuEventDestroy_v2(self.raw)) }
        });
        log_drop_error("event", result);
    }
}
