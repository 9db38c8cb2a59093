//! Memory registration on one libfabric domain.
use std::os::fd::AsRawFd;
use std::ptr;
use std::rc::Rc;

use libfabric_sys as sys;

use super::domain::DomainFids;
use super::error::libfabric_error;
use crate::error::{FabricError, Result};

/// What a registration allows. Local access is what the engine's own posts need; remote
/// access is the only door peers have into this process's memory, so it is granted narrowly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// A region peers write into (user regions; the engine's immediate slot), and the source of
    /// this engine's writes and messages, and the destination of its reads. Not remotely readable.
    RemoteWrite,
    /// [`Access::RemoteWrite`], and peers may read it too (the owner opted in at registration).
    RemoteReadWrite,
    /// Library message buffers: sent from and received into, never touched remotely.
    MessagesOnly,
}

impl Access {
    fn flags(self) -> u64 {
        let local = (sys::FI_SEND | sys::FI_RECV) as u64;
        match self {
            Access::RemoteWrite => local | (sys::FI_WRITE | sys::FI_READ | sys::FI_REMOTE_WRITE) as u64,
            Access::RemoteReadWrite => Access::RemoteWrite.flags() | sys::FI_REMOTE_READ as u64,
            Access::MessagesOnly => local,
        }
    }
}

/// What memory a registration covers.
#[derive(Clone, Copy, Debug)]
pub(super) enum MrMemory<'a> {
    /// Host memory, by address.
    Host,
    /// CUDA memory of a device, by address (`iface = FI_HMEM_CUDA`).
    Cuda(u32),
    /// Memory behind a DMA-BUF (`FI_MR_DMABUF`): CUDA memory of a device (exported for the
    /// range), or with `None` host memory (`iface = FI_HMEM_SYSTEM`).
    Dmabuf(Option<u32>, &'a cuda_lib::DmabufRange),
}

/// A region registered on one domain. Holds its domain alive, and is closed before it.
pub struct LocalMr {
    mr: *mut sys::fid_mr,
    desc: *mut std::ffi::c_void,
    key: u64,
    remote_base: u64,
    /// The DMA-BUF the region was registered through, closed after the registration.
    pub(super) dmabuf: Option<cuda_lib::DmabufRange>,
    _domain: Rc<DomainFids>,
}

impl LocalMr {
    /// Registers `[ptr, ptr+len)` with `access`, asking for `requested_key` (ignored by
    /// providers that pick keys themselves, FI_MR_PROV_KEY).
    pub(super) fn register(
        fids: &Rc<DomainFids>,
        ptr: *mut u8,
        len: usize,
        access: Access,
        requested_key: u64,
        mr_mode: u64,
        memory: MrMemory<'_>,
    ) -> Result<Self> {
        let iov = sys::iovec { iov_base: ptr as *mut std::ffi::c_void, iov_len: len };
        let mut dmabuf: Option<sys::shim_fi_mr_dmabuf> = None;
        let (device, mut flags) = match memory {
            MrMemory::Host => (-1, 0),
            MrMemory::Cuda(device) => (device as i32, 0),
            MrMemory::Dmabuf(device, range) => {
                dmabuf = Some(sys::shim_fi_mr_dmabuf {
                    fd: range.fd.as_raw_fd(),
                    offset: range.offset,
                    len,
                    base_addr: range.base as *mut std::ffi::c_void,
                });
                (device.map_or(-1, |d| d as i32), sys::SHIM_FI_MR_DMABUF)
            }
        };
        if device >= 0 {
            // The memory is device memory only (never host-accessible): shm then moves it by
            // CUDA IPC instead of staging it through shared host memory (1.7 GB/s measured).
            flags |= sys::FI_HMEM_DEVICE_ONLY;
        }
        let dmabuf_ptr = dmabuf.as_ref().map_or(ptr::null(), |d| d as *const _);
        let mut mr: *mut sys::fid_mr = ptr::null_mut();
        // SAFETY: domain is open; the iovec and the dmabuf description live across the call (the
        // provider copies them); the caller guarantees ptr/len describe memory that stays valid
        // while registered, and a DMA-BUF range outlives the registration (the caller keeps it).
        let ret = unsafe {
            sys::shim_fi_mr_regattr2(
                fids.domain,
                &iov,
                dmabuf_ptr,
                access.flags(),
                requested_key,
                device,
                flags,
                &mut mr,
            )
        };
        if ret != 0 {
            return Err(libfabric_error("fi_mr_regattr", ret.into()));
        }
        let mut this =
            LocalMr { mr, desc: ptr::null_mut(), key: 0, remote_base: 0, dmabuf: None, _domain: fids.clone() };
        if mr_mode & sys::FI_MR_ENDPOINT as u64 != 0 {
            // SAFETY: mr and ep are open objects of the same domain.
            let ret = unsafe { sys::shim_fi_mr_bind(mr, &mut (*fids.ep).fid, 0) };
            if ret != 0 {
                return Err(libfabric_error("fi_mr_bind", ret.into()));
            }
            // SAFETY: mr was just bound.
            let ret = unsafe { sys::shim_fi_mr_enable(mr) };
            if ret != 0 {
                return Err(libfabric_error("fi_mr_enable", ret.into()));
            }
        }
        // SAFETY: mr is a valid, enabled registration.
        let (desc, key) = unsafe { (sys::shim_fi_mr_desc(mr), sys::shim_fi_mr_key(mr)) };
        if key == u64::MAX {
            // FI_KEY_NOTAVAIL
            return Err(FabricError::Libfabric { call: "fi_mr_key", code: 0, message: "key not available".into() });
        }
        let remote_base = if mr_mode & sys::FI_MR_VIRT_ADDR as u64 != 0 { ptr as u64 } else { 0 };
        this.desc = desc;
        this.key = key;
        this.remote_base = remote_base;
        Ok(this)
    }

    /// The local descriptor for data-path calls (may be null where FI_MR_LOCAL is off).
    pub fn desc(&self) -> *mut std::ffi::c_void {
        self.desc
    }

    /// The remote key peers use.
    pub fn key(&self) -> u64 {
        self.key
    }

    /// The remote address of byte 0 (its virtual address, or 0 for offset addressing).
    pub fn remote_base(&self) -> u64 {
        self.remote_base
    }
}

impl Drop for LocalMr {
    fn drop(&mut self) {
        if self.mr.is_null() {
            return;
        }
        // SAFETY: mr is a registration we own; closed exactly once, before its domain (we hold it).
        let ret = unsafe { sys::shim_fi_close(&mut (*self.mr).fid) };
        if ret != 0 {
            tracing::warn!("fi_close(mr) returned {ret}");
        }
    }
}
