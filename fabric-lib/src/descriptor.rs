//! Memory-region descriptors: what a peer needs to write into a registered region.
use serde::{Deserialize, Serialize};

use crate::address::{DomainAddress, EngineAddress};
use crate::encoding::{decode_versioned, encode_versioned};
use crate::error::{FabricError, Result};

const DESCRIPTOR_MAGIC: [u8; 4] = *b"FLMR";

/// Where the registered bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemoryKind {
    /// Ordinary (pageable or pinned) host memory.
    Host,
    /// Device memory of the given CUDA ordinal.
    Cuda(u32),
}

/// The remote-access key of a region on one domain.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DomainKey {
    /// The owning domain's endpoint address.
    pub address: DomainAddress,
    /// Remote key from `fi_mr_key`.
    pub key: u64,
    /// Remote address of byte 0 of the region: its virtual address for FI_MR_VIRT_ADDR providers,
    /// 0 for providers that address by offset.
    pub remote_base: u64,
}

/// What a process on the same host needs to reach a GPU region through CUDA IPC.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CudaIpc {
    /// The legacy IPC handle (`cuIpcGetMemHandle`, 64 bytes) of the allocation holding the region.
    pub handle: Vec<u8>,
    /// Offset of the region's first byte within that allocation.
    pub offset: u64,
    /// Size of the whole allocation.
    pub alloc_len: u64,
}

/// Length of a legacy CUDA IPC handle.
pub const CUDA_IPC_HANDLE_LEN: usize = 64;

/// The owner engine's landing area for staged transfers (see `staging`): registered host
/// memory of `slots` slots of `chunk_bytes`, into which writers put chunks of a staged request
/// for the owner to copy into this region. Present on GPU regions the NIC cannot reach when the
/// owner has staging on: a writer without this must not take the network path.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Landing {
    /// One key per domain of the owner, for the whole landing area.
    pub keys: Vec<DomainKey>,
    pub slots: u32,
    pub chunk_bytes: u64,
}

/// A registered region as seen by peers: its extent plus one key per domain of the owner.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MrDescriptor {
    /// Virtual address of the region in the owner's process.
    pub base: u64,
    /// Length in bytes.
    pub len: u64,
    /// Host or device memory.
    pub kind: MemoryKind,
    /// Address of the owning engine (provider, host and every domain).
    pub owner: EngineAddress,
    /// One key per domain, in the owner's domain order; empty for GPU regions that are only
    /// reachable from the same host (the provider has no FI_HMEM).
    pub keys: Vec<DomainKey>,
    /// For GPU regions: how same-host peers open the memory.
    pub cuda: Option<CudaIpc>,
    /// Where peers on other hosts put staged chunks for this region (GPU memory the NIC cannot
    /// reach, on an owner with staging on).
    pub landing: Option<Landing>,
    /// Peers may read the region (`submit_read`): the owner opted in at registration, and only
    /// then do its keys carry remote-read access. Readers check this before posting.
    pub remote_read: bool,
}

impl MrDescriptor {
    /// Serializes to versioned bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        encode_versioned(DESCRIPTOR_MAGIC, self)
    }

    /// Decodes [`MrDescriptor::to_bytes`] output, rejecting corrupt or inconsistent bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let desc: MrDescriptor = decode_versioned(DESCRIPTOR_MAGIC, bytes, "memory descriptor")?;
        desc.validate()?;
        Ok(desc)
    }

    fn validate(&self) -> Result<()> {
        if self.len == 0 {
            return Err(FabricError::InvalidDescriptor("memory descriptor has length 0".into()));
        }
        if self.base.checked_add(self.len).is_none() {
            return Err(FabricError::InvalidDescriptor("memory descriptor extent overflows".into()));
        }
        self.owner.validate()?;
        let same_host_only = self.keys.is_empty() && self.cuda.is_some();
        if !same_host_only && self.keys.len() != self.owner.domains.len() {
            return Err(FabricError::InvalidDescriptor(format!(
                "memory descriptor has {} keys for {} domains",
                self.keys.len(),
                self.owner.domains.len()
            )));
        }
        if let Some(landing) = &self.landing {
            if landing.keys.len() != self.owner.domains.len() {
                return Err(FabricError::InvalidDescriptor(format!(
                    "landing area has {} keys for {} domains",
                    landing.keys.len(),
                    self.owner.domains.len()
                )));
            }
            let config = crate::staging::StagingConfig {
                chunk_bytes: landing.chunk_bytes as usize,
                slots: landing.slots as usize,
            };
            config.validate().map_err(|e| FabricError::InvalidDescriptor(format!("landing area: {e}")))?;
        }
        match (&self.kind, &self.cuda) {
            (MemoryKind::Host, Some(_)) => {
                return Err(FabricError::InvalidDescriptor("host memory descriptor carries CUDA IPC data".into()))
            }
            (MemoryKind::Cuda(_), None) => {
                return Err(FabricError::InvalidDescriptor("GPU memory descriptor lacks its CUDA IPC data".into()))
            }
            (MemoryKind::Cuda(_), Some(ipc)) => {
                if ipc.handle.len() != CUDA_IPC_HANDLE_LEN {
                    return Err(FabricError::InvalidDescriptor(format!(
                        "CUDA IPC handle of {} bytes, expected {CUDA_IPC_HANDLE_LEN}",
                        ipc.handle.len()
                    )));
                }
                if ipc.offset.checked_add(self.len).is_none_or(|end| end > ipc.alloc_len) {
                    return Err(FabricError::InvalidDescriptor(format!(
                        "GPU region [{}, +{}) lies outside its {}-byte allocation",
                        ipc.offset, self.len, ipc.alloc_len
                    )));
                }
            }
            (MemoryKind::Host, None) => {}
        }
        Ok(())
    }

    /// Whether peers on other hosts can write this region over the network.
    pub fn network_reachable(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Whether peers on other hosts reach this region through the owner's landing area.
    pub fn staged_reachable(&self) -> bool {
        self.landing.is_some()
    }

    /// Checks that the owner made the region remotely readable.
    pub fn check_readable(&self) -> Result<()> {
        if self.remote_read {
            return Ok(());
        }
        Err(FabricError::NotReadable(format!(
            "the peer region at {:#x} ({} bytes) was registered for remote writes only; its owner must \
             register it with remote_read=True for peers to read it",
            self.base, self.len
        )))
    }

    /// Checks that `[offset, offset + len)` lies inside the region.
    pub fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        check_range("destination", self.len, offset, len)
    }
}

/// Checks `[offset, offset + len)` against a region of `region_len` bytes.
pub(crate) fn check_range(side: &str, region_len: u64, offset: u64, len: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(FabricError::InvalidArgument(format!(
            "{side} range [{offset}, {offset}+{len}) exceeds the registered region of {region_len} bytes"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::address::DomainAddress;

    fn sample() -> MrDescriptor {
        let owner = EngineAddress {
            provider: "tcp;ofi_rxm".into(),
            host_id: "boot".into(),
            pid: 42,
            process: 7,
            max_message_size: 65536,
            inbox: Some(crate::address::InboxAddress { fd: 9, nonce: 3, slots: 4096 }),
            domains: vec![
                DomainAddress { endpoint: vec![1, 2, 3], imm_key: 9, imm_base: 0 },
                DomainAddress { endpoint: vec![4, 5], imm_key: 10, imm_base: 0 },
            ],
        };
        MrDescriptor {
            base: 0x7000_0000,
            len: 4096,
            kind: MemoryKind::Host,
            keys: owner
                .domains
                .iter()
                .enumerate()
                .map(|(i, a)| DomainKey { address: a.clone(), key: i as u64 + 1, remote_base: 0 })
                .collect(),
            owner,
            cuda: None,
            landing: None,
            remote_read: false,
        }
    }

    fn gpu_sample() -> MrDescriptor {
        MrDescriptor {
            kind: MemoryKind::Cuda(1),
            keys: Vec::new(),
            cuda: Some(CudaIpc { handle: (0..64).collect(), offset: 512, alloc_len: 1 << 20 }),
            ..sample()
        }
    }

    #[test]
    fn gpu_descriptors_round_trip_and_are_checked() {
        let d = gpu_sample();
        assert_eq!(MrDescriptor::from_bytes(&d.to_bytes()).unwrap(), d);
        assert!(!d.network_reachable());
        let bytes = d.to_bytes();
        for cut in 0..bytes.len() {
            assert!(MrDescriptor::from_bytes(&bytes[..cut]).is_err(), "cut {cut}");
        }
        let mut bad = gpu_sample();
        bad.cuda.as_mut().unwrap().handle.pop();
        assert!(MrDescriptor::from_bytes(&bad.to_bytes()).is_err());
        let mut bad = gpu_sample();
        bad.cuda.as_mut().unwrap().offset = (1 << 20) - 100;
        assert!(MrDescriptor::from_bytes(&bad.to_bytes()).is_err());
        let mut bad = gpu_sample();
        bad.cuda = None;
        assert!(MrDescriptor::from_bytes(&bad.to_bytes()).is_err());
        let mut bad = sample();
        bad.cuda = gpu_sample().cuda;
        assert!(MrDescriptor::from_bytes(&bad.to_bytes()).is_err());
        let mut bad = sample();
        bad.keys.clear();
        assert!(MrDescriptor::from_bytes(&bad.to_bytes()).is_err(), "host regions need keys");
    }

    #[test]
    fn landing_areas_round_trip_and_are_checked() {
        let mut d = gpu_sample();
        d.landing = Some(Landing { keys: sample().keys, slots: 8, chunk_bytes: 1 << 20 });
        assert_eq!(MrDescriptor::from_bytes(&d.to_bytes()).unwrap(), d);
        assert!(d.staged_reachable() && !d.network_reachable());
        let mut bad = d.clone();
        bad.landing.as_mut().unwrap().keys.pop();
        assert!(MrDescriptor::from_bytes(&bad.to_bytes()).is_err(), "a key per domain");
        let mut bad = d.clone();
        bad.landing.as_mut().unwrap().chunk_bytes = 1000;
        assert!(MrDescriptor::from_bytes(&bad.to_bytes()).is_err(), "chunk size not a multiple of 4 KiB");
        let mut bad = d;
        bad.landing.as_mut().unwrap().slots = 0;
        assert!(MrDescriptor::from_bytes(&bad.to_bytes()).is_err(), "no slots");
    }

    #[test]
    fn round_trip() {
        let d = sample();
        assert_eq!(MrDescriptor::from_bytes(&d.to_bytes()).unwrap(), d);
        let a = d.owner.clone();
        assert_eq!(EngineAddress::from_bytes(&a.to_bytes()).unwrap(), a);
        assert_eq!(EngineAddress::from_hex(&a.to_hex()).unwrap(), a);
    }

    #[test]
    fn every_truncation_and_single_byte_corruption_is_an_error_not_a_crash() {
        let bytes = sample().to_bytes();
        for cut in 0..bytes.len() {
            assert!(
                matches!(MrDescriptor::from_bytes(&bytes[..cut]), Err(FabricError::InvalidDescriptor(_))),
                "cut {cut}"
            );
        }
        let mut extended = bytes.clone();
        extended.push(0);
        assert!(MrDescriptor::from_bytes(&extended).is_err());
        for i in 0..bytes.len() {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut b = bytes.clone();
                b[i] ^= flip;
                // Either rejected, or (payload bits that still decode) a valid, different value.
                if let Ok(d) = MrDescriptor::from_bytes(&b) {
                    assert!(i >= 10, "header corruption at byte {i} must be rejected");
                    assert_ne!(d, sample());
                }
            }
        }
        assert!(MrDescriptor::from_bytes(&sample().owner.to_bytes()).is_err(), "an address is not a descriptor");
    }

    #[test]
    fn inconsistent_descriptors_are_rejected() {
        let mut d = sample();
        d.keys.pop();
        assert!(MrDescriptor::from_bytes(&d.to_bytes()).is_err());
        let mut d = sample();
        d.len = 0;
        assert!(MrDescriptor::from_bytes(&d.to_bytes()).is_err());
        let mut d = sample();
        d.base = u64::MAX;
        assert!(MrDescriptor::from_bytes(&d.to_bytes()).is_err());
    }

    #[test]
    fn ranges_are_checked_without_overflow() {
        let d = sample();
        assert!(d.check_range(0, 4096).is_ok());
        assert!(d.check_range(4096, 0).is_ok());
        assert!(d.check_range(1, 4096).is_err());
        assert!(d.check_range(u64::MAX, 2).is_err());
    }
}
