//! DMA-BUF export of device memory, for registering GPU memory with RDMA NICs (FI_HMEM).
use std::os::fd::{FromRawFd, OwnedFd};

use cudarc::driver::sys;

use crate::{
    context::Context,
    error::{CudaError, Result},
};

/// The alignment the driver requires of DMA-BUF ranges (host page size on x86-64).
pub const DMABUF_ALIGNMENT: u64 = 4096;

/// Exports `len` bytes of device memory at `ptr` (any allocation: VMM, cuMemAlloc, torch's) as a
/// DMA-BUF file descriptor. `ptr` and `len` must be multiples of [`DMABUF_ALIGNMENT`].
pub fn export_dmabuf(ctx: &Context, ptr: u64, len: usize) -> Result<OwnedFd> {
    if len == 0 || ptr % DMABUF_ALIGNMENT != 0 || len as u64 % DMABUF_ALIGNMENT != 0 {
        return Err(CudaError::InvalidArgument(format!(
            "DMA-BUF range {ptr:#x}+{len} must be non-empty and {DMABUF_ALIGNMENT}-byte aligned"
        )));
    }
    if !ctx.device().supports_dmabuf()? {
        return Err(CudaError::Unsupported(format!("device {} cannot export DMA-BUF", ctx.device().ordinal())));
    }
    let _cur = ctx.enter()?;
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: for DMA_BUF_FD the driver writes one `int` through the handle pointer; it checks
    // that the range is device memory it owns.
    unsafe {
        cu!(cuMemGetHandleForAddressRange(
            (&mut fd as *mut std::ffi::c_int).cast(),
            ptr,
            len,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0
        ))
    }?;
    if fd < 0 {
        return Err(CudaError::InvalidArgument("cuMemGetHandleForAddressRange returned no fd".into()));
    }
    // SAFETY: the driver created this fd for us; we are its only owner.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A DMA-BUF that covers a byte range of device memory: the exported span is the range widened to
/// whole pages (within its allocation), and `offset` is where the range starts in it.
#[derive(Debug)]
pub struct DmabufRange {
    /// The DMA-BUF file descriptor (closed on drop).
    pub fd: OwnedFd,
    /// Device address of the exported span's first byte (page-aligned).
    pub base: u64,
    /// Offset of the requested range in the span.
    pub offset: u64,
    /// Bytes exported (the whole span).
    pub span: usize,
}

/// Exports `[ptr, ptr + len)` of device memory as a DMA-BUF, widening the range to whole pages
/// of its allocation (DMA-BUF export works on pages; the widening never leaves the allocation).
/// Fails when `ptr` is not device memory, the range leaves its allocation, the allocation is not
/// page-aligned at the range's ends, or the device or driver cannot export DMA-BUF.
pub fn export_dmabuf_range(ctx: &Context, ptr: u64, len: usize) -> Result<DmabufRange> {
    let (mut alloc_base, mut alloc_len) = (0u64, 0usize);
    {
        let _cur = ctx.enter()?;
        // SAFETY: out pointers are valid; the driver fails on pointers it does not know.
        unsafe { cu!(cuMemGetAddressRange_v2(&mut alloc_base, &mut alloc_len, ptr)) }?;
    }
    let alloc_end = alloc_base + alloc_len as u64;
    let end = ptr.checked_add(len as u64).filter(|&e| len > 0 && e <= alloc_end).ok_or_else(|| {
        CudaError::InvalidArgument(format!(
            "range {ptr:#x}+{len} is empty or leaves its allocation [{alloc_base:#x}, {alloc_end:#x})"
        ))
    })?;
    let start = (ptr / DMABUF_ALIGNMENT * DMABUF_ALIGNMENT).max(alloc_base);
    let span_end = end.div_ceil(DMABUF_ALIGNMENT).saturating_mul(DMABUF_ALIGNMENT).min(alloc_end);
    if start % DMABUF_ALIGNMENT != 0 || span_end % DMABUF_ALIGNMENT != 0 {
        return Err(CudaError::Unsupported(format!(
            "range {ptr:#x}+{len} cannot be exported as DMA-BUF: its allocation [{alloc_base:#x}, {alloc_end:#x}) \
             does not cover whole {DMABUF_ALIGNMENT}-byte pages around it"
        )));
    }
    let span = (span_end - start) as usize;
    let fd = export_dmabuf(ctx, start, span)?;
    Ok(DmabufRange { fd, base: start, offset: ptr - start, span })
}
