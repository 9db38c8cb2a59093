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
    /// One key per domain, in the owner's domain order.
    pub keys: Vec<DomainKey>,
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
        if self.keys.is_empty() || self.keys.len() != self.owner.domains.len() {
            return Err(FabricError::InvalidDescriptor(format!(
                "memory descriptor has {} keys for {} domains",
                self.keys.len(),
                self.owner.domains.len()
            )));
        }
        Ok(())
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
