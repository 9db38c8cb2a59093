//! Plain device allocations (`cuMemAlloc`): what legacy IPC handles and simple buffers need.
use std::sync::Arc;

use crate::{
    context::Context,
    driver::log_drop_error,
    error::{CudaError, Result},
};

/// Device memory from `cuMemAlloc`, freed on drop. For memory that other processes or NICs
/// import, prefer [`crate::VmmAllocation`].
#[derive(Debug)]
pub struct DeviceBuffer {
    ctx: Arc<Context>,
    ptr: u64,
    len: usize,
}

impl DeviceBuffer {
    /// Allocates `len` bytes (uninitialized) on the context's device.
    pub fn new(ctx: &Arc<Context>, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(CudaError::InvalidArgument("zero-byte device allocation".into()));
        }
        let _cur = ctx.enter()?;
        let mut ptr = 0;
        // SAFETY: the context is current; `ptr` is a valid out pointer.
        unsafe { cu!(cuMemAlloc_v2(&mut ptr, len)) }?;
        Ok(DeviceBuffer { ctx: ctx.clone(), ptr, len })
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (zero-byte buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The owning context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let result = self.ctx.enter().and_then(|_cur| {
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once.
            unsafe { cu!(cuMemFree_v2(self.ptr)) }
        });
        log_drop_error("device buffer", result);
    }
}
