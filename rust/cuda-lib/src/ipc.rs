//! Legacy CUDA IPC handles (cuIpcGetMemHandle / cuIpcOpenMemHandle): the fallback for memory we
//! did not allocate, e.g. tensors from torch's caching allocator (cudaMalloc'd blocks).
use std::sync::Arc;

use cudarc::driver::sys;

use crate::{
    context::Context,
    driver::log_drop_error,
    error::{CudaError, Result},
};

/// An opaque 64-byte IPC handle naming one whole `cuMemAlloc`/`cudaMalloc` allocation.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle(pub [u8; 64]);

impl std::fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hex: String = self.0.iter().map(|b| format!("{b:02x}")).collect();
        write!(f, "IpcMemHandle({hex})")
    }
}

/// What another process needs to reach `ptr`: the handle of its allocation, `ptr`'s offset
/// into that allocation, and the allocation's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcExport {
    /// Handle of the allocation containing the pointer.
    pub handle: IpcMemHandle,
    /// Offset of the exported pointer from the allocation's base.
    pub offset: u64,
    /// Size of the whole allocation.
    pub alloc_len: usize,
}

/// Exports the allocation containing `ptr` (device memory of `ctx`'s device, allocated with
/// cuMemAlloc/cudaMalloc: not VMM, not host memory).
pub fn ipc_export(ctx: &Context, ptr: u64) -> Result<IpcExport> {
    let _cur = ctx.enter()?;
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: out pointers are valid; the driver fails on pointers it does not know.
    unsafe { cu!(cuMemGetAddressRange_v2(&mut base, &mut size, ptr)) }?;
    let mut raw = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: `base` is the base of a live allocation; `raw` is a valid out pointer.
    unsafe { cu!(cuIpcGetMemHandle(&mut raw, base)) }?;
    Ok(IpcExport { handle: IpcMemHandle(raw.reserved.map(|c| c as u8)), offset: ptr - base, alloc_len: size })
}

/// Another process's allocation opened through its IPC handle; closed on drop. A process cannot
/// open handles it exported itself (the driver refuses).
#[derive(Debug)]
pub struct IpcMapping {
    ctx: Arc<Context>,
    ptr: u64,
    len: usize,
}

impl IpcMapping {
    /// Opens `handle` in `ctx` (the allocation may live on another device: peer access is
    /// enabled lazily).
    pub fn open(ctx: &Arc<Context>, handle: &IpcMemHandle) -> Result<Self> {
        let raw = sys::CUipcMemHandle { reserved: handle.0.map(|b| b as std::ffi::c_char) };
        let _cur = ctx.enter()?;
        let mut ptr = 0;
        // SAFETY: `raw` is a by-value handle; `ptr` is a valid out pointer.
        unsafe {
            cu!(cuIpcOpenMemHandle_v2(&mut ptr, raw, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32))
        }?;
        if ptr == 0 {
            return Err(CudaError::InvalidArgument("cuIpcOpenMemHandle returned a null pointer".into()));
        }
        // Owned from here on, so an error below still closes the handle.
        let mut mapping = IpcMapping { ctx: ctx.clone(), ptr, len: 0 };
        let mut base = 0u64;
        // SAFETY: out pointers are valid; `ptr` is the base of the allocation just opened.
        unsafe { cu!(cuMemGetAddressRange_v2(&mut base, &mut mapping.len, ptr)) }?;
        Ok(mapping)
    }

    /// The base address of the opened allocation in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The size of the opened allocation, as the driver knows it (not as a peer claims it).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the allocation is empty (never, for an opened handle).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The context it was opened in.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let result = self.ctx.enter().and_then(|_cur| {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle and is closed once.
            unsafe { cu!(cuIpcCloseMemHandle(self.ptr)) }
        });
        log_drop_error("IPC mapping", result);
    }
}
