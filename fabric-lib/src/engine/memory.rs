//! Registering memory: host regions with the NIC (after checking they are mapped read-write),
//! GPU regions through CUDA IPC for same-host peers.
use std::sync::atomic::Ordering;

use super::{MrHandle, RegionInfo, RegisterOptions, TransferEngine};
use crate::commands::Command;
use crate::config::GpuRegistration;
use crate::descriptor::{CudaIpc, DomainKey, Landing, MemoryKind, MrDescriptor};
use crate::error::{FabricError, Result};
use crate::provider::libfabric::NicRegistration;

impl TransferEngine {
    /// Registers `[ptr, ptr + len)` for local use and remote writes.
    ///
    /// # Safety
    /// The memory must stay allocated until [`TransferEngine::unregister_memory`] returns (or
    /// the engine is stopped).
    pub unsafe fn register_memory(
        &self,
        ptr: *mut u8,
        len: usize,
        kind: MemoryKind,
    ) -> Result<(MrHandle, MrDescriptor)> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.register_memory_with(ptr, len, kind, RegisterOptions::default()) }
    }

    /// [`TransferEngine::register_memory`] with options: `remote_read` lets peers read the
    /// region as well (see [`RegisterOptions`]).
    ///
    /// # Safety
    /// As for [`TransferEngine::register_memory`].
    pub unsafe fn register_memory_with(
        &self,
        ptr: *mut u8,
        len: usize,
        kind: MemoryKind,
        options: RegisterOptions,
    ) -> Result<(MrHandle, MrDescriptor)> {
        let remote_read = options.remote_read;
        if ptr.is_null() {
            return Err(FabricError::InvalidArgument("cannot register a null pointer".into()));
        }
        if len == 0 {
            return Err(FabricError::InvalidArgument("cannot register an empty region".into()));
        }
        if (ptr as usize).checked_add(len).is_none() {
            return Err(FabricError::InvalidArgument("region extent overflows the address space".into()));
        }
        if let MemoryKind::Cuda(device) = kind {
            return self.register_cuda(ptr as u64, len, device, remote_read);
        }
        crate::host_memory::check_host_range(ptr as u64, len as u64)?;
        let region = self.next_region.fetch_add(1, Ordering::Relaxed);
        let gpu_registration = self.config.gpu_registration;
        let (registered, _) = self.request(|reply| Command::Register {
            region,
            ptr: ptr as usize,
            len,
            kind,
            network: true,
            remote_read,
            gpu_registration,
            reply,
        })?;
        self.regions
            .write()
            .insert(region, RegionInfo { len: len as u64, ptr: ptr as u64, kind, network: true, nic: None });
        let descriptor = MrDescriptor {
            base: ptr as u64,
            len: len as u64,
            kind,
            owner: self.address.clone(),
            keys: self.domain_keys(&registered),
            cuda: None,
            landing: if self.config.stage_host_memory { self.landing(None) } else { None },
            remote_read,
        };
        Ok((MrHandle(region), descriptor))
    }

    /// GPU memory: exported through a legacy CUDA IPC handle for same-host peers and, where the
    /// provider has FI_HMEM, registered with the NIC as well (the descriptor then carries keys
    /// and the region is network-reachable). Without FI_HMEM the network cannot reach it: network
    /// writes from or to it fail with [`TransferEngine::gpu_network_error`].
    fn register_cuda(&self, ptr: u64, len: usize, device: u32, remote_read: bool) -> Result<(MrHandle, MrDescriptor)> {
        match crate::gpu::detect_memory_kind(ptr) {
            MemoryKind::Cuda(d) if d == device => {}
            MemoryKind::Cuda(d) => {
                return Err(FabricError::InvalidArgument(format!(
                    "pointer {ptr:#x} is memory of CUDA device {d}, not of device {device}"
                )))
            }
            MemoryKind::Host => {
                cuda_lib::Driver::get()?;
                return Err(FabricError::InvalidArgument(format!(
                    "pointer {ptr:#x} is not CUDA device memory (registered as cuda:{device})"
                )));
            }
        }
        let ctx = cuda_lib::Context::new(device as usize)?;
        let export = cuda_lib::ipc_export(&ctx, ptr).map_err(|e| {
            FabricError::Cuda(format!(
                "exporting a CUDA IPC handle for {ptr:#x}: {e} (only cudaMalloc/cuMemAlloc memory can be \
                 shared; torch's expandable_segments allocations cannot)"
            ))
        })?;
        if export.offset + len as u64 > export.alloc_len as u64 {
            return Err(FabricError::InvalidArgument(format!(
                "GPU region [{ptr:#x}, +{len}) extends past the end of its allocation ({} bytes from offset {})",
                export.alloc_len, export.offset
            )));
        }
        let kind = MemoryKind::Cuda(device);
        let region = self.next_region.fetch_add(1, Ordering::Relaxed);
        let gpu_registration = self.config.gpu_registration;
        let register = |network| {
            self.request(|reply| Command::Register {
                region,
                ptr: ptr as usize,
                len,
                kind,
                network,
                remote_read,
                gpu_registration,
                reply,
            })
        };
        let (keys, nic) = if !self.hmem {
            register(false)?
        } else if gpu_registration == GpuRegistration::Auto {
            register(true).or_else(|e| {
                tracing::info!("GPU memory at {ptr:#x} not registered with the NIC ({e}); same-host peers only");
                register(false)
            })?
        } else {
            // A forced registration mode is what the caller tests or needs: its refusal is an error.
            register(true)?
        };
        if let Some(how) = nic {
            tracing::info!("GPU memory at {ptr:#x}+{len} of cuda:{device} registered with the NIC through {how}");
        }
        let landing = if keys.is_empty() && self.config.staging.is_some() { self.landing(Some(device)) } else { None };
        self.regions.write().insert(region, RegionInfo { len: len as u64, ptr, kind, network: !keys.is_empty(), nic });
        let descriptor = MrDescriptor {
            base: ptr,
            len: len as u64,
            kind,
            owner: self.address.clone(),
            keys: self.domain_keys(&keys),
            cuda: Some(CudaIpc {
                handle: export.handle.0.to_vec(),
                offset: export.offset,
                alloc_len: export.alloc_len as u64,
            }),
            landing,
            remote_read,
        };
        Ok((MrHandle(region), descriptor))
    }

    /// This engine's landing area for staged writes (opened on first use), for descriptors of
    /// regions the NIC cannot reach; None (logged) where it cannot be opened: such regions then
    /// serve same-host peers only.
    fn landing(&self, device: Option<u32>) -> Option<Landing> {
        match self.request(|reply| Command::Landing { device, reply }) {
            Ok((keys, slots, chunk_bytes)) => Some(Landing { keys: self.domain_keys(&keys), slots, chunk_bytes }),
            Err(e) => {
                tracing::warn!("no landing area for staged transfers ({e}); GPU regions serve same-host peers only");
                None
            }
        }
    }

    /// A descriptor's per-domain keys from what the worker registered.
    fn domain_keys(&self, registered: &[(u64, u64)]) -> Vec<DomainKey> {
        registered
            .iter()
            .zip(&self.address.domains)
            .map(|(&(key, remote_base), address)| DomainKey { address: address.clone(), key, remote_base })
            .collect()
    }

    /// Information about a local registration.
    pub(crate) fn region_info(&self, handle: MrHandle) -> Result<RegionInfo> {
        self.regions
            .read()
            .get(&handle.0)
            .copied()
            .ok_or_else(|| FabricError::InvalidArgument(format!("memory handle {} is not registered", handle.0)))
    }

    /// Releases a registration. Fails while operations reading from it are in flight.
    pub fn unregister_memory(&self, handle: MrHandle) -> Result<()> {
        if !self.regions.read().contains_key(&handle.0) {
            return Err(FabricError::InvalidArgument(format!("memory handle {} is not registered", handle.0)));
        }
        // Before the release: calls after this one returns look the region up again.
        self.released_regions.fetch_add(1, Ordering::AcqRel);
        self.request(|reply| Command::Unregister { region: handle.0, reply })?;
        self.regions.write().remove(&handle.0);
        Ok(())
    }

    /// Length of a local registration.
    pub fn region_len(&self, handle: MrHandle) -> Result<u64> {
        self.region_info(handle).map(|r| r.len)
    }

    /// Address of a local registration's first byte.
    pub fn region_base(&self, handle: MrHandle) -> Result<u64> {
        self.region_info(handle).map(|r| r.ptr)
    }

    /// How a local GPU registration reached the NIC: DMA-BUF or the CUDA interface; None for host
    /// memory and for GPU memory that serves same-host peers only.
    pub fn region_nic_registration(&self, handle: MrHandle) -> Result<Option<NicRegistration>> {
        self.region_info(handle).map(|r| r.nic)
    }

    /// Memory kind of a local registration.
    pub fn region_kind(&self, handle: MrHandle) -> Result<MemoryKind> {
        self.region_info(handle).map(|r| r.kind)
    }
}
