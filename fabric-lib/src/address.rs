//! Engine addresses: what a peer needs to reach this engine, as versioned bytes.
use serde::{Deserialize, Serialize};

use crate::encoding::{decode_versioned, encode_versioned};
use crate::error::Result;

const ADDRESS_MAGIC: [u8; 4] = *b"FLEA";

/// How to reach one domain (NIC) of an engine.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DomainAddress {
    /// The raw endpoint name, as `fi_getname` returns it.
    pub endpoint: Vec<u8>,
    /// Remote key of the engine's immediate slot on this domain (target of `submit_imm` and
    /// barriers addressed to the engine rather than to a region).
    pub imm_key: u64,
    /// Remote address of that slot (0 for offset-addressing providers).
    pub imm_base: u64,
}

/// Everything needed to reach an engine: its provider and one address per domain of its device.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EngineAddress {
    /// Provider name, e.g. `tcp;ofi_rxm`; peers must use the same provider.
    pub provider: String,
    /// Identifies the host (boot id), for choosing same-host paths.
    pub host_id: String,
    /// The owning process's pid (same-host writes into host memory use `process_vm_writev`).
    pub pid: u32,
    /// A random identifier of the owning process (pids repeat across containers), used to tell
    /// "this very process" apart: CUDA refuses to open IPC handles a process exported itself.
    pub process: u64,
    /// Largest two-sided message this engine receives (senders check it before sending).
    pub max_message_size: u64,
    /// One address per domain of the device, in domain order.
    pub domains: Vec<DomainAddress>,
    /// The engine's same-host immediate inbox (`None`: it has none, same-host writers announce
    /// their immediates over the provider).
    pub inbox: Option<InboxAddress>,
}

/// Where a same-host writer finds an engine's immediate inbox (see
/// `provider::same_host::inbox`): a memfd of the owning process (`EngineAddress::pid`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct InboxAddress {
    /// The memfd's descriptor number in the owning process (opened as `/proc/<pid>/fd/<fd>`).
    pub fd: u32,
    /// A random number in the inbox's header: tells this inbox apart from whatever file a
    /// reused descriptor number or pid may name later.
    pub nonce: u64,
    /// Ring entries (a power of two).
    pub slots: u32,
}

impl EngineAddress {
    /// Serializes to versioned bytes (`from_bytes` reverses it).
    pub fn to_bytes(&self) -> Vec<u8> {
        encode_versioned(ADDRESS_MAGIC, self)
    }

    /// Decodes bytes from [`EngineAddress::to_bytes`]; garbage is an `InvalidDescriptor` error.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let addr: EngineAddress = decode_versioned(ADDRESS_MAGIC, bytes, "engine address")?;
        addr.validate()?;
        Ok(addr)
    }

    /// Lower-case hex of [`EngineAddress::to_bytes`], handy for logs and command lines.
    pub fn to_hex(&self) -> String {
        hex::encode(self.to_bytes())
    }

    /// Parses [`EngineAddress::to_hex`] output.
    pub fn from_hex(text: &str) -> Result<Self> {
        let bytes = hex::decode(text.trim())
            .map_err(|e| crate::FabricError::InvalidDescriptor(format!("engine address is not hex: {e}")))?;
        Self::from_bytes(&bytes)
    }
}

impl EngineAddress {
    /// Shape checks that need no provider: at least one domain, a non-empty endpoint each.
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(crate::FabricError::InvalidDescriptor(format!("engine address: {m}")));
        if self.domains.is_empty() {
            return bad("no domains");
        }
        if self.domains.iter().any(|d| d.endpoint.is_empty()) {
            return bad("a domain has an empty endpoint");
        }
        if self.max_message_size == 0 {
            return bad("max_message_size is 0");
        }
        if let Some(inbox) = self.inbox {
            let max = crate::provider::same_host::MAX_INBOX_SLOTS;
            if !inbox.slots.is_power_of_two() || inbox.slots < 2 || inbox.slots as usize > max {
                return bad("inbox size is not a power of two in 2..=2^20");
            }
        }
        Ok(())
    }

    /// Whether this engine runs on the same host as the caller's process.
    pub fn is_same_host(&self) -> bool {
        !self.host_id.is_empty() && self.host_id == local_host_id()
    }

    /// Whether this engine lives in the caller's process.
    pub fn is_same_process(&self) -> bool {
        self.is_same_host() && self.process == local_process_id()
    }
}

/// A random 64-bit identifier of this process, fixed for its lifetime.
pub(crate) fn local_process_id() -> u64 {
    static ID: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *ID.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        // RandomState is seeded from the OS's random source; mix in pid and time for good measure.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0),
        );
        h.finish() | 1
    })
}

/// A stable identifier of this machine's boot, so peers can tell "same host" apart.
pub(crate) fn local_host_id() -> String {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
    })
    .clone()
}
