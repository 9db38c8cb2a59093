//! Pinned host memory mapped into the device's address space (flags, counters, staging).
use std::sync::{
    atomic::{AtomicU32, AtomicU64},
    Arc,
};

use cudarc::driver::sys;

use crate::{
    context::Context,
    driver::log_drop_error,
    error::{CudaError, Result},
};

/// Page-locked host memory, portable (pinned for every context) and mapped into device memory
/// space, so kernels read and write it directly over PCIe/C2C. Zero-filled on allocation.
///
/// The CPU side is reached through atomics ([`PinnedHostBuffer::atomic_u64`]) while the device
/// may touch it, and through slices only when no device work uses it.
#[derive(Debug)]
pub struct PinnedHostBuffer {
    ctx: Arc<Context>,
    host: *mut u8,
    device: u64,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value; it is freed only in Drop, and
// every CPU access path is either atomic or requires exclusive access / an unsafe contract.
unsafe impl Send for PinnedHostBuffer {}
// SAFETY: as above; shared access only hands out atomics (or an unsafe slice).
unsafe impl Sync for PinnedHostBuffer {}

impl PinnedHostBuffer {
    /// Allocates `len` bytes (page-aligned, zero-filled).
    pub fn new(ctx: &Arc<Context>, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(CudaError::InvalidArgument("zero-byte pinned host allocation".into()));
        }
        let _cur = ctx.enter()?;
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: the context is current; `host` is a valid out pointer.
        unsafe { cu!(cuMemHostAlloc(&mut host, len, flags)) }?;
        let mut buf = PinnedHostBuffer { ctx: ctx.clone(), host: host.cast(), device: 0, len };
        let mut device = 0;
        // SAFETY: `host` was allocated with DEVICEMAP just above; flags must be 0.
        unsafe { cu!(cuMemHostGetDevicePointer_v2(&mut device, host, 0)) }?;
        buf.device = device;
        // SAFETY: `host` points to `len` writable bytes that nothing else references yet.
        unsafe { std::ptr::write_bytes(buf.host, 0, len) };
        Ok(buf)
    }

    /// The CPU address.
    pub fn host_ptr(&self) -> *mut u8 {
        self.host
    }

    /// The address kernels and copies use.
    pub fn device_ptr(&self) -> u64 {
        self.device
    }

    /// The size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (zero-byte buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The 64-bit word `index` as an atomic (the CPU side of GPU<->CPU flags).
    pub fn atomic_u64(&self, index: usize) -> &AtomicU64 {
        assert!((index + 1) * 8 <= self.len, "word {index} is outside the {}-byte buffer", self.len);
        // SAFETY: in bounds (checked), 8-byte aligned (page-aligned base), and the memory lives
        // as long as `self`; the device side uses system-scope accesses on the same word.
        unsafe { AtomicU64::from_ptr(self.host.cast::<u64>().add(index)) }
    }

    /// The 32-bit word `index` as an atomic.
    pub fn atomic_u32(&self, index: usize) -> &AtomicU32 {
        assert!((index + 1) * 4 <= self.len, "word {index} is outside the {}-byte buffer", self.len);
        // SAFETY: as for `atomic_u64`, with 4-byte words.
        unsafe { AtomicU32::from_ptr(self.host.cast::<u32>().add(index)) }
    }

    /// The bytes, for reading.
    ///
    /// # Safety
    /// No device work may write the buffer, and no atomic view may be used to write it, while
    /// the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: `host` points to `len` initialized bytes; the caller excludes writers.
        unsafe { std::slice::from_raw_parts(self.host, self.len) }
    }

    /// The bytes, for writing. Device work using this buffer must have completed (launching such
    /// work is `unsafe` and makes that the caller's promise).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `host` points to `len` initialized bytes and `&mut self` excludes other CPU views.
        unsafe { std::slice::from_raw_parts_mut(self.host, self.len) }
    }

    /// The owning context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for PinnedHostBuffer {
    fn drop(&mut self) {
        let result = self.ctx.enter().and_then(|_cur| {
            // SAFETY: `host` came from cuMemHostAlloc and is freed once.
            unsafe { cu!(cuMemFreeHost(self.host.cast())) }
        });
        log_drop_error("pinned host buffer", result);
    }
}
