//! Devices: ordinals, attributes, peer capabilities.
use cudarc::driver::sys::{self, CUdevice_attribute as Attr};

use crate::{
    driver::Driver,
    error::{CudaError, Result},
};

/// A CUDA device (ordinal as seen by this process, after `CUDA_VISIBLE_DEVICES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Device {
    ordinal: usize,
    raw: sys::CUdevice,
}

impl Device {
    /// The device with this ordinal.
    pub fn get(ordinal: usize) -> Result<Self> {
        let count = crate::device_count()?;
        if ordinal >= count {
            return Err(CudaError::InvalidArgument(format!("device {ordinal} does not exist ({count} visible)")));
        }
        let mut raw = 0;
        // SAFETY: the driver is initialized (device_count succeeded); `raw` is a valid out pointer.
        unsafe { cu!(cuDeviceGet(&mut raw, ordinal as i32)) }?;
        Ok(Device { ordinal, raw })
    }

    /// Every visible device.
    pub fn all() -> Result<Vec<Self>> {
        (0..crate::device_count()?).map(Self::get).collect()
    }

    /// The ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The raw `CUdevice`.
    pub fn raw(&self) -> sys::CUdevice {
        self.raw
    }

    /// One device attribute.
    pub fn attribute(&self, attr: Attr) -> Result<i32> {
        let mut value = 0;
        // SAFETY: a Device exists only after the driver initialized; `value` is a valid out pointer.
        unsafe { cu!(cuDeviceGetAttribute(&mut value, attr, self.raw)) }?;
        Ok(value)
    }

    fn flag(&self, attr: Attr) -> Result<bool> {
        Ok(self.attribute(attr)? != 0)
    }

    /// The marketing name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn name(&self) -> Result<String> {
        let mut buf = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer holds 256 chars and its length is passed along.
        unsafe { cu!(cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, self.raw)) }?;
        // SAFETY: the driver wrote a NUL-terminated string into `buf` (zero-initialized anyway).
        Ok(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
    }

    /// PCI address as sysfs writes it, e.g. `0000:18:00.0` (lowercase hex, function 0).
    pub fn pci_bus_id(&self) -> Result<String> {
        Ok(format!(
            "{:04x}:{:02x}:{:02x}.0",
            self.attribute(Attr::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            self.attribute(Attr::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            self.attribute(Attr::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
        ))
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> Result<usize> {
        let mut bytes = 0;
        // SAFETY: `bytes` is a valid out pointer.
        unsafe { cu!(cuDeviceTotalMem_v2(&mut bytes, self.raw)) }?;
        Ok(bytes)
    }

    /// (major, minor) compute capability, e.g. (9, 0) for Hopper.
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        Ok((
            self.attribute(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            self.attribute(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ))
    }

    /// Number of streaming multiprocessors.
    pub fn multiprocessor_count(&self) -> Result<u32> {
        Ok(self.attribute(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32)
    }

    /// SM clock in kHz (what `clock64()` counts), if the driver reports one.
    pub fn clock_rate_khz(&self) -> Option<u32> {
        self.attribute(Attr::CU_DEVICE_ATTRIBUTE_CLOCK_RATE).ok().filter(|k| *k > 0).map(|k| k as u32)
    }

    /// Whether the VMM API (cuMemCreate / cuMemMap) is supported.
    pub fn supports_vmm(&self) -> Result<bool> {
        self.flag(Attr::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
    }

    /// Whether VMM allocations can be exported as POSIX file descriptors.
    pub fn supports_posix_fd_handles(&self) -> Result<bool> {
        self.flag(Attr::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
    }

    /// Whether VMM allocations can be made GPUDirect RDMA capable.
    pub fn supports_gpu_direct_rdma_vmm(&self) -> Result<bool> {
        self.flag(Attr::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)
    }

    /// Whether device memory can be exported as DMA-BUF.
    pub fn supports_dmabuf(&self) -> Result<bool> {
        self.flag(Attr::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
    }

    /// Whether this device can map memory of `peer` (NVLink or PCIe peer-to-peer).
    pub fn can_access_peer(&self, peer: Device) -> Result<bool> {
        if peer == *self {
            return Ok(true);
        }
        let mut can = 0;
        // SAFETY: both devices are valid; `can` is a valid out pointer.
        unsafe { cu!(cuDeviceCanAccessPeer(&mut can, self.raw, peer.raw)) }?;
        Ok(can != 0)
    }
}

/// The driver's CUDA version as (major, minor), e.g. (13, 0).
pub fn driver_version() -> Result<(i32, i32)> {
    Ok(Driver::get()?.cuda_version())
}
