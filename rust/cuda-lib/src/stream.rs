//! Streams: asynchronous copies and stream memory operations (write/wait 64-bit values).
use std::sync::Arc;

use cudarc::driver::sys;

use crate::{context::Context, driver::log_drop_error, error::Result, event::Event};

/// The comparison of [`Stream::wait_value64`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitValue {
    /// Wait until `(int64)(*addr - value) >= 0` (a counter reached `value`, wrap-safe).
    Geq,
    /// Wait until `*addr == value`.
    Eq,
    /// Wait until `*addr & value != 0`.
    And,
    /// Wait until `!(*addr | value) != 0`.
    Nor,
}

/// A non-blocking stream (does not synchronize with the legacy default stream); destroyed on
/// drop (pending work still completes).
#[derive(Debug)]
pub struct Stream {
    ctx: Arc<Context>,
    raw: sys::CUstream,
}

// SAFETY: a CUstream is a driver handle usable from any thread; the driver serializes submission.
unsafe impl Send for Stream {}
// SAFETY: as above; all methods take &self.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a non-blocking stream in `ctx`.
    pub fn new(ctx: &Arc<Context>) -> Result<Self> {
        let _cur = ctx.enter()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the context is current; `raw` is a valid out pointer.
        unsafe { cu!(cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)) }?;
        Ok(Stream { ctx: ctx.clone(), raw })
    }

    /// The raw `CUstream` (e.g. to hand to torch as an external stream).
    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// The owning context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Blocks until all work on the stream completed.
    pub fn synchronize(&self) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: `raw` is a live stream.
        unsafe { cu!(cuStreamSynchronize(self.raw)) }
    }

    /// Whether all work on the stream completed (non-blocking).
    pub fn is_idle(&self) -> Result<bool> {
        let _cur = self.ctx.enter()?;
        // SAFETY: `raw` is a live stream.
        match unsafe { cu!(cuStreamQuery(self.raw)) } {
            Ok(()) => Ok(true),
            Err(e) if e.code() == Some(sys::CUresult::CUDA_ERROR_NOT_READY as i32) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Makes later work on this stream wait for `event` (recorded on any stream, any context).
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: both handles are live; flags must be 0.
        unsafe { cu!(cuStreamWaitEvent(self.raw, event.raw(), 0)) }
    }

    /// Copies `len` bytes between any two addresses CUDA knows (device, peer, pinned host):
    /// unified addressing picks the direction.
    ///
    /// # Safety
    /// `src..src+len` must be readable and `dst..dst+len` writable by the copy, and both must stay
    /// allocated and otherwise unaccessed (for `dst`) until the stream reaches this copy's end.
    pub unsafe fn memcpy_async(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: the caller guarantees both ranges; the stream is live.
        unsafe { cu!(cuMemcpyAsync(dst, src, len, self.raw)) }
    }

    /// Device-to-device copy (same device, or a peer the context can access).
    ///
    /// # Safety
    /// As for [`Stream::memcpy_async`].
    pub unsafe fn memcpy_dtod_async(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: the caller guarantees both ranges; the stream is live.
        unsafe { cu!(cuMemcpyDtoDAsync_v2(dst, src, len, self.raw)) }
    }

    /// Host-to-device copy (asynchronous only when `src` is pinned).
    ///
    /// # Safety
    /// As for [`Stream::memcpy_async`]; `src` must stay valid until the copy completed.
    pub unsafe fn memcpy_htod_async(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: the caller guarantees both ranges; the stream is live.
        unsafe { cu!(cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.raw)) }
    }

    /// Device-to-host copy (asynchronous only when `dst` is pinned).
    ///
    /// # Safety
    /// As for [`Stream::memcpy_async`]; `dst` must stay valid and untouched until completion.
    pub unsafe fn memcpy_dtoh_async(&self, dst: *mut u8, src: u64, len: usize) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: the caller guarantees both ranges; the stream is live.
        unsafe { cu!(cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.raw)) }
    }

    /// Copies between memory of two contexts (devices) without needing peer access enabled.
    ///
    /// # Safety
    /// As for [`Stream::memcpy_async`], `dst` in `dst_ctx` and `src` in `src_ctx`.
    pub unsafe fn memcpy_peer_async(
        &self,
        dst: u64,
        dst_ctx: &Context,
        src: u64,
        src_ctx: &Context,
        len: usize,
    ) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: the caller guarantees both ranges; contexts and stream are live.
        unsafe { cu!(cuMemcpyPeerAsync(dst, dst_ctx.raw(), src, src_ctx.raw(), len, self.raw)) }
    }

    /// Sets `len` bytes at `dst` to `value`.
    ///
    /// # Safety
    /// `dst..dst+len` must be device-writable memory not otherwise accessed until completion.
    pub unsafe fn memset_d8_async(&self, dst: u64, value: u8, len: usize) -> Result<()> {
        let _cur = self.ctx.enter()?;
        // SAFETY: the caller guarantees the range; the stream is live.
        unsafe { cu!(cuMemsetD8Async(dst, value, len, self.raw)) }
    }

    /// Writes `value` to the 8-byte word at `addr` once prior work on the stream completed
    /// (with a memory barrier: that work's writes are visible first).
    ///
    /// # Safety
    /// `addr` must be an 8-byte aligned device-visible word (device, peer or mapped host memory)
    /// that stays allocated until the write executed.
    pub unsafe fn write_value64(&self, addr: u64, value: u64) -> Result<()> {
        let _cur = self.ctx.enter()?;
        let flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
        // SAFETY: the caller guarantees the word; the stream is live.
        unsafe { cu!(cuStreamWriteValue64_v2(self.raw, addr, value, flags)) }
    }

    /// Makes later work on the stream wait until the word at `addr` satisfies `cond`.
    ///
    /// # Safety
    /// As for [`Stream::write_value64`]; someone must eventually satisfy the condition or the
    /// stream (and whoever synchronizes with it) hangs.
    pub unsafe fn wait_value64(&self, addr: u64, value: u64, cond: WaitValue) -> Result<()> {
        use sys::CUstreamWaitValue_flags as F;
        let flags = match cond {
            WaitValue::Geq => F::CU_STREAM_WAIT_VALUE_GEQ,
            WaitValue::Eq => F::CU_STREAM_WAIT_VALUE_EQ,
            WaitValue::And => F::CU_STREAM_WAIT_VALUE_AND,
            WaitValue::Nor => F::CU_STREAM_WAIT_VALUE_NOR,
        } as u32;
        let _cur = self.ctx.enter()?;
        // SAFETY: the caller guarantees the word; the stream is live.
        unsafe { cu!(cuStreamWaitValue64_v2(self.raw, addr, value, flags)) }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let result = self.ctx.enter().and_then(|_cur| {
            // SAFETY: `raw` came from cuStreamCreate and is destroyed once.
            unsafe { cu!(cuStreamDestroy_v2(self.raw)) }
        });
        log_drop_error("stream", result);
    }
}
