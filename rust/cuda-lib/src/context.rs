//! Primary contexts: one per device, shared with the CUDA runtime (and so with torch).
use std::{marker::PhantomData, sync::Arc};

use cudarc::driver::sys;

use crate::{device::Device, driver::log_drop_error, error::Result};

/// A retained primary context of one device. Every object allocated through it holds an
/// `Arc<Context>`, so the context outlives them. Dropping the last handle releases the retain.
///
/// Operations make the context current only for their own duration (push, call, pop), so the
/// caller's current context (e.g. torch's current device) is left as it was. [`Context::bind`]
/// makes it current for the rest of the thread's life instead (worker threads).
#[derive(Debug)]
pub struct Context {
    device: Device,
    raw: sys::CUcontext,
}

// SAFETY: a CUcontext is a handle the driver lets any thread use (driver API calls are
// thread-safe); this type never hands out mutable access to driver state.
unsafe impl Send for Context {}
// SAFETY: as above; all methods take &self and the driver synchronizes internally.
unsafe impl Sync for Context {}

impl Context {
    /// Retains the primary context of `device`.
    pub fn primary(device: Device) -> Result<Arc<Self>> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: `device` exists only after the driver initialized; `raw` is a valid out pointer.
        unsafe { cu!(cuDevicePrimaryCtxRetain(&mut raw, device.raw())) }?;
        Ok(Arc::new(Context { device, raw }))
    }

    /// Retains the primary context of the device with this ordinal.
    pub fn new(ordinal: usize) -> Result<Arc<Self>> {
        Self::primary(Device::get(ordinal)?)
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The raw `CUcontext`.
    pub fn raw(&self) -> sys::CUcontext {
        self.raw
    }

    /// Makes this context current on the calling thread (and leaves it current).
    pub fn bind(&self) -> Result<()> {
        // SAFETY: `raw` is a retained, live context.
        unsafe { cu!(cuCtxSetCurrent(self.raw)) }
    }

    /// Whether this context is current on the calling thread.
    pub fn is_current(&self) -> Result<bool> {
        let mut current = std::ptr::null_mut();
        // SAFETY: `current` is a valid out pointer.
        unsafe { cu!(cuCtxGetCurrent(&mut current)) }?;
        Ok(current == self.raw)
    }

    /// Makes this context current until the guard drops, then restores the previous one.
    pub(crate) fn enter(&self) -> Result<Entered<'_>> {
        let mut current = std::ptr::null_mut();
        // SAFETY: `current` is a valid out pointer.
        unsafe { cu!(cuCtxGetCurrent(&mut current)) }?;
        if current == self.raw {
            return Ok(Entered { pushed: false, _ctx: PhantomData });
        }
        // SAFETY: `raw` is a retained, live context; the guard pops it again.
        unsafe { cu!(cuCtxPushCurrent_v2(self.raw)) }?;
        Ok(Entered { pushed: true, _ctx: PhantomData })
    }

    /// Waits for all work in this context.
    pub fn synchronize(&self) -> Result<()> {
        let _cur = self.enter()?;
        // SAFETY: the context is current on this thread.
        unsafe { cu!(cuCtxSynchronize()) }
    }

    /// Lets kernels and copies in this context access memory allocated by `cuMemAlloc` in
    /// `peer`'s context (VMM allocations use [`crate::VmmAllocation::grant_access`] instead).
    /// Already enabled counts as success.
    pub fn enable_peer_access(&self, peer: &Context) -> Result<()> {
        if peer.device == self.device {
            return Ok(());
        }
        if !self.device.can_access_peer(peer.device)? {
            return Err(crate::CudaError::Unsupported(format!(
                "device {} cannot access device {} (no peer-to-peer path)",
                self.device.ordinal(),
                peer.device.ordinal()
            )));
        }
        let _cur = self.enter()?;
        // SAFETY: this context is current; `peer.raw` is a live context; flags must be 0.
        match unsafe { cu!(cuCtxEnablePeerAccess(peer.raw, 0)) } {
            Err(e) if e.code() == Some(sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED as i32) => Ok(()),
            other => other,
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: this handle retained the primary context once; release it once.
        log_drop_error("primary context", unsafe { cu!(cuDevicePrimaryCtxRelease_v2(self.device.raw())) });
    }
}

/// Guard from [`Context::enter`].
pub(crate) struct Entered<'a> {
    pushed: bool,
    // Not Send: the pop must happen on the thread that pushed.
    _ctx: PhantomData<(&'a Context, *const ())>,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        if self.pushed {
            let mut popped = std::ptr::null_mut();
            // SAFETY: `enter` pushed exactly one context on this thread's stack.
            log_drop_error("context push", unsafe { cu!(cuCtxPopCurrent_v2(&mut popped)) });
        }
    }
}
