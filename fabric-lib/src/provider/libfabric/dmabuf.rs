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

    /// The hand-declared `struct fi_mr_dmabuf` and 2.x `struct fi_mr_attr` reach a real libfabric
    /// intact: a write into memory registered through `FI_MR_DMABUF` lands byte-exact. shm
    /// (libfabric's util MR map) turns the description into the range `base_addr + offset`,
    /// `len`, without using the descriptor, so a memfd stands in for a DMA-BUF and any field
    /// at the wrong place registers the wrong range (the write fails or lands elsewhere). Needs a
    /// running libfabric >= 1.20 with shm (the CUDA build: `LD_LIBRARY_PATH=.libfabric-cuda/lib`);
    /// says so and passes otherwise.
    #[test]
    fn dmabuf_attribute_layout_reaches_libfabric() {
        use std::os::fd::{FromRawFd, OwnedFd};

        use crate::provider::libfabric::mr::MrMemory;
        use crate::provider::libfabric::{Access, Completion, DomainSpec, LibfabricDomain, OpContext, OpKind, Posted};

        if runtime_version() < DMABUF_API_VERSION {
            eprintln!("libfabric {} has no FI_MR_DMABUF: not checked", version_string(runtime_version()));
            return;
        }
        let spec = DomainSpec { provider: Some("shm".into()), domain: None };
        let (Ok(mut writer), Ok(mut target)) =
            (LibfabricDomain::open(&spec, Some(true)), LibfabricDomain::open(&spec, Some(true)))
        else {
            eprintln!("no shm domains here: not checked");
            return;
        };
        assert!(target.has_hmem(), "shm of libfabric >= 1.20 has FI_HMEM");
        // SAFETY: memfd_create with a valid name and no flags; the fd is owned right away.
        let fd = unsafe { libc::memfd_create(c"fabric-lib-dmabuf-test".as_ptr(), 0) };
        assert!(fd >= 0);
        // SAFETY: a fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let (offset, len) = (4096 + 320, 3 * 4096 + 5);
        let mut landing = vec![0u8; 5 * 4096];
        let base = landing.as_mut_ptr();
        let range = cuda_lib::DmabufRange { fd, base: base as u64, offset: offset as u64, span: landing.len() };
        // SAFETY: `landing` outlives both registrations (dropped last).
        let dst = target
            .register_on(unsafe { base.add(offset) }, len, Access::RemoteWrite, MrMemory::Dmabuf(None, &range))
            .expect("shm registers host memory through FI_MR_DMABUF");
        let mut src: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let src_mr = writer.register(src.as_mut_ptr(), len, Access::RemoteWrite).unwrap();
        let peer = writer.resolve_peer(target.address()).unwrap();
        let context = Box::into_raw(OpContext::new(OpKind::Write { request: 1, region: 1 }));
        let remote = dst.remote_base();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        // shm answers EAGAIN until its peer is set up: progress both sides and post again.
        loop {
            // SAFETY: source and context stay put until the completion is read below.
            let posted = unsafe {
                writer.post_write(src.as_ptr(), len, src_mr.desc(), peer, remote, dst.key(), None, false, context)
            }
            .unwrap();
            if matches!(posted, Posted::Ok) {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "shm kept refusing the post for 10 s");
            writer.poll(&mut Vec::new()).unwrap();
            target.poll(&mut Vec::new()).unwrap();
        }
        let mut done = Vec::new();
        while done.is_empty() {
            assert!(std::time::Instant::now() < deadline, "no completion within 10 s");
            writer.poll(&mut done).unwrap();
            target.poll(&mut Vec::new()).unwrap();
        }
        // SAFETY: the completion of `context` was read; it is ours again.
        drop(unsafe { Box::from_raw(context) });
        assert!(matches!(done[0], Completion::Done { .. }), "{:?}", done[0]);
        assert_eq!(&landing[offset..offset + len], &src[..], "the write landed where FI_MR_DMABUF put the region");
        assert!(landing[..offset].iter().chain(&landing[offset + len..]).all(|&b| b == 0));
        drop((dst, src_mr));
    }

    #[test]
    fn runtime_version_is_at_least_the_oldest_supported() {
        assert!(runtime_version() >= sys::fi_version(1, 17), "{}", version_string(runtime_version()));
    }
}
