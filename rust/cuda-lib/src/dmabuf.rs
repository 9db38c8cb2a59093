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
