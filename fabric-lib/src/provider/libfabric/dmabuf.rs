//! How GPU memory is registered with the NIC on FI_HMEM domains: through DMA-BUF where the
//! running libfabric has it (≥ 1.20, `FI_MR_DMABUF`), else by address with `iface = FI_HMEM_CUDA`.
//!
//! DMA-BUF is what RDMA NICs use for GPUDirect without the `nvidia-peermem` kernel module: the GPU
//! range is exported by the CUDA driver (`cuMemGetHandleForAddressRange`) and the NIC maps its
//! pages through the file descriptor. The bindings come from libfabric 1.17 headers, so the
//! attribute layout is declared by hand in the shim, and libfabric reads it only for domains opened
//! with API version ≥ 1.20 (which `info::query` asks for when the running library has it).
use std::fmt;

use libfabric_sys as sys;

use crate::config::GpuRegistration;
use crate::error::{FabricError, Result};

/// First libfabric API version with `FI_MR_DMABUF` and `struct fi_mr_dmabuf`.
pub const DMABUF_API_VERSION: u32 = sys::fi_version(1, 20);

/// The version of the libfabric that runs (not the headers the bindings came from).
pub fn runtime_version() -> u32 {
    // SAFETY: fi_version takes no arguments and only returns a constant.
    unsafe { sys::shim_fi_runtime_version() }
}

/// `major.minor` of a packed libfabric version.
pub fn version_string(version: u32) -> String {
    format!("{}.{}", version >> 16, version & 0xffff)
}

/// How a GPU region was registered with the NIC (ordered: the fallback is the greater).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NicRegistration {
    /// Through a DMA-BUF file descriptor (`FI_MR_DMABUF`).
    Dmabuf,
    /// By virtual address with `iface = FI_HMEM_CUDA` (the provider resolves the pages).
    CudaIface,
}

impl NicRegistration {
    /// The name the Python API and `fabric-debug` show: `dmabuf` or `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            NicRegistration::Dmabuf => "dmabuf",
            NicRegistration::CudaIface => "cuda",
        }
    }
}

impl fmt::Display for NicRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The registrations to try, in order, for `mode` on a domain opened with `api_version`.
/// `Auto` falls back from DMA-BUF to the CUDA interface; a forced mode is the only one tried and
/// fails with a typed error when the domain cannot do it.
pub fn attempts(mode: GpuRegistration, api_version: u32, provider: &str) -> Result<Vec<NicRegistration>> {
    let dmabuf = api_version >= DMABUF_API_VERSION;
    match mode {
        GpuRegistration::Auto if dmabuf => Ok(vec![NicRegistration::Dmabuf, NicRegistration::CudaIface]),
        GpuRegistration::Auto | GpuRegistration::Cuda => Ok(vec![NicRegistration::CudaIface]),
        GpuRegistration::Dmabuf if dmabuf => Ok(vec![NicRegistration::Dmabuf]),
        GpuRegistration::Dmabuf => Err(FabricError::ProviderUnavailable(format!(
            "gpu_registration='dmabuf': provider '{provider}' was opened with libfabric API {} (the running \
             libfabric is {}); DMA-BUF registration needs 1.20 or newer (scripts/build_libfabric.sh builds one)",
            version_string(api_version),
            version_string(runtime_version())
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_prefers_dmabuf_and_falls_back_only_where_the_api_has_it() {
        let new = sys::fi_version(2, 1);
        let old = sys::fi_version(1, 17);
        use NicRegistration::*;
        assert_eq!(attempts(GpuRegistration::Auto, new, "shm").unwrap(), vec![Dmabuf, CudaIface]);
        assert_eq!(attempts(GpuRegistration::Auto, old, "shm").unwrap(), vec![CudaIface]);
        assert_eq!(attempts(GpuRegistration::Cuda, new, "shm").unwrap(), vec![CudaIface]);
        assert_eq!(attempts(GpuRegistration::Dmabuf, new, "shm").unwrap(), vec![Dmabuf]);
        let e = attempts(GpuRegistration::Dmabuf, old, "shm").unwrap_err();
        assert!(matches!(&e, FabricError::ProviderUnavailable(m) if m.contains("1.17") && m.contains("1.20")), "{e}");
    }

    #[test]
    fn runtime_version_is_at_least_the_oldest_supported() {
        assert!(runtime_version() >= sys::fi_version(1, 17), "{}", version_string(runtime_version()));
    }
}
