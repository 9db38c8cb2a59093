//! Device memory through the VMM API (cuMemCreate + cuMemMap), shareable as a POSIX file
//! descriptor (another device or process maps it at its own address) and as DMA-BUF (NICs).
use std::{
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    sync::Arc,
};

use cudarc::driver::sys;

use crate::{
    context::Context,
    device::Device,
    driver::log_drop_error,
    error::{CudaError, Result},
};

const FD_HANDLE: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

fn allocation_prop(device: Device, gpu_direct_rdma: bool) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: FD_HANDLE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device.ordinal() as i32,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: sys::CUmemAllocationCompType::CU_MEM_ALLOCATION_COMP_NONE as u8,
            gpuDirectRDMACapable: u8::from(gpu_direct_rdma),
            usage: 0,
            reserved: [0; 4],
        },
    }
}

fn access_desc(device: Device) -> sys::CUmemAccessDesc {
    sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device.ordinal() as i32,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    }
}

/// The VMM granularity (allocation and mapping sizes are multiples of it) on `device`.
pub fn vmm_granularity(device: Device) -> Result<usize> {
    let prop = allocation_prop(device, false);
    let mut granularity = 0;
    // SAFETY: `prop` is a fully initialized property struct; `granularity` a valid out pointer.
    unsafe {
        cu!(cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM
        ))
    }?;
    Ok(granularity.max(1))
}

fn check_vmm(device: Device) -> Result<()> {
    if !device.supports_vmm()? || !device.supports_posix_fd_handles()? {
        return Err(CudaError::Unsupported(format!(
            "device {} lacks VMM allocations with POSIX file descriptor handles",
            device.ordinal()
        )));
    }
    Ok(())
}

/// A VMM allocation mapped into this process: physical memory (created here or imported from a
/// file descriptor), a reserved virtual range, the mapping, and read/write access for the
/// context's device (plus any granted peers). Drop unmaps, releases and frees, in that order;
/// physical memory lives on until every process that imported it released it too.
#[derive(Debug)]
pub struct VmmAllocation {
    ctx: Arc<Context>,
    handle: Option<sys::CUmemGenericAllocationHandle>,
    va: u64,
    len: usize,
    mapped: bool,
    gpu_direct_rdma: bool,
    imported: bool,
}

impl VmmAllocation {
    /// Allocates at least `len` bytes on the context's device (rounded up to the granularity),
    /// exportable as a POSIX file descriptor, GPUDirect RDMA capable where the device supports it.
    pub fn new(ctx: &Arc<Context>, len: usize) -> Result<Self> {
        Self::with_peers(ctx, len, &[])
    }

    /// Like [`VmmAllocation::new`], and also maps the memory read/write for `peers`.
    pub fn with_peers(ctx: &Arc<Context>, len: usize, peers: &[Device]) -> Result<Self> {
        if len == 0 {
            return Err(CudaError::InvalidArgument("zero-byte VMM allocation".into()));
        }
        let device = ctx.device();
        check_vmm(device)?;
        let rdma = device.supports_gpu_direct_rdma_vmm().unwrap_or(false);
        let granularity = vmm_granularity(device)?;
        let len = len.div_ceil(granularity) * granularity;
        let prop = allocation_prop(device, rdma);
        let _cur = ctx.enter()?;
        let mut handle = 0;
        // SAFETY: `prop` is fully initialized; `len` is a multiple of the granularity.
        unsafe { cu!(cuMemCreate(&mut handle, len, &prop, 0)) }?;
        let alloc = Self::mapped(ctx, handle, len, granularity, rdma, false)?;
        for peer in peers {
            alloc.grant_access(*peer)?;
        }
        Ok(alloc)
    }

    /// Imports an allocation exported by [`VmmAllocation::export_fd`] (this or another process;
    /// `len` is the exporter's [`VmmAllocation::len`]) and maps it at a new address, read/write
    /// for this context's device. The file descriptor stays the caller's (close it when done).
    pub fn import_fd(ctx: &Arc<Context>, fd: BorrowedFd<'_>, len: usize) -> Result<Self> {
        let device = ctx.device();
        check_vmm(device)?;
        let granularity = vmm_granularity(device)?;
        if len == 0 || len % granularity != 0 {
            return Err(CudaError::InvalidArgument(format!(
                "imported VMM length {len} is not a positive multiple of the granularity {granularity}"
            )));
        }
        let _cur = ctx.enter()?;
        let mut handle = 0;
        // SAFETY: for POSIX file descriptors the driver takes the fd value itself, cast to a
        // pointer; it does not take ownership of the fd.
        unsafe {
            cu!(cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                FD_HANDLE
            ))
        }?;
        Self::mapped(ctx, handle, len, granularity, false, true)
    }

    /// Takes ownership of `handle` (released on drop, also on error), maps it at a new address
    /// and grants this context's device read/write access.
    fn mapped(
        ctx: &Arc<Context>,
        handle: sys::CUmemGenericAllocationHandle,
        len: usize,
        granularity: usize,
        gpu_direct_rdma: bool,
        imported: bool,
    ) -> Result<Self> {
        let mut alloc = VmmAllocation {
            ctx: ctx.clone(),
            handle: Some(handle),
            va: 0,
            len,
            mapped: false,
            gpu_direct_rdma,
            imported,
        };
        alloc.map(granularity)?;
        alloc.grant_access(ctx.device())?;
        Ok(alloc)
    }

    fn map(&mut self, granularity: usize) -> Result<()> {
        let handle = self.handle.expect("map is called right after the handle is created");
        let mut va = 0;
        // SAFETY: reserves a fresh range of `len` bytes; no fixed address is requested.
        unsafe { cu!(cuMemAddressReserve(&mut va, self.len, granularity, 0, 0)) }?;
        self.va = va;
        // SAFETY: `va..va+len` was just reserved and `handle` has exactly `len` bytes.
        unsafe { cu!(cuMemMap(va, self.len, 0, handle, 0)) }?;
        self.mapped = true;
        Ok(())
    }

    /// Maps the whole range read/write for `device` (the owner, or a peer with a P2P path).
    pub fn grant_access(&self, device: Device) -> Result<()> {
        let desc = access_desc(device);
        let _cur = self.ctx.enter()?;
        // SAFETY: the range is mapped (construction succeeded); `desc` is one valid descriptor.
        unsafe { cu!(cuMemSetAccess(self.va, self.len, &desc, 1)) }
    }

    /// Exports the physical memory as a POSIX file descriptor (send it to another process with
    /// SCM_RIGHTS or `pidfd_getfd`; import it with [`VmmAllocation::import_fd`]).
    pub fn export_fd(&self) -> Result<OwnedFd> {
        let handle = self.handle.expect("a constructed VmmAllocation holds its handle");
        let _cur = self.ctx.enter()?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for POSIX fds the driver writes one `int` through the handle pointer.
        unsafe { cu!(cuMemExportToShareableHandle((&mut fd as *mut std::ffi::c_int).cast(), handle, FD_HANDLE, 0)) }?;
        if fd < 0 {
            return Err(CudaError::InvalidArgument("cuMemExportToShareableHandle returned no fd".into()));
        }
        // SAFETY: the driver created this fd for us; we are its only owner.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Exports `len` bytes from `offset` as a DMA-BUF file descriptor (for NIC registration).
    pub fn export_dmabuf(&self, offset: usize, len: usize) -> Result<OwnedFd> {
        if offset.checked_add(len).map_or(true, |end| end > self.len) {
            return Err(CudaError::InvalidArgument(format!(
                "DMA-BUF range {offset}+{len} exceeds the {}-byte allocation",
                self.len
            )));
        }
        crate::dmabuf::export_dmabuf(&self.ctx, self.va + offset as u64, len)
    }

    /// The device address (in this process).
    pub fn ptr(&self) -> u64 {
        self.va
    }

    /// The mapped size in bytes (a multiple of the granularity).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (zero-byte allocations are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The context this mapping belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Whether the allocation was created with `gpuDirectRDMACapable` (false when imported).
    pub fn gpu_direct_rdma(&self) -> bool {
        self.gpu_direct_rdma
    }

    /// Whether this mapping was imported from a file descriptor.
    pub fn is_imported(&self) -> bool {
        self.imported
    }
}

impl Drop for VmmAllocation {
    fn drop(&mut self) {
        let _cur = match self.ctx.enter() {
            Ok(cur) => cur,
            Err(e) => return log_drop_error("VMM allocation", Err(e)),
        };
        if self.mapped {
            // SAFETY: the range was mapped by `map` and is unmapped once.
            log_drop_error("VMM mapping", unsafe { cu!(cuMemUnmap(self.va, self.len)) });
        }
        if let Some(handle) = self.handle.take() {
            // SAFETY: the handle came from cuMemCreate / import and is released once.
            log_drop_error("VMM handle", unsafe { cu!(cuMemRelease(handle)) });
        }
        if self.va != 0 {
            // SAFETY: the range was reserved by `map` and is no longer mapped.
            log_drop_error("VMM address range", unsafe { cu!(cuMemAddressFree(self.va, self.len)) });
        }
    }
}
