//! Where a request goes: checks that a peer can be reached (provider, domain count), turns
//! descriptors into worker targets, picks the network or the same-host path, and fences.
use super::TransferEngine;
use crate::address::EngineAddress;
use crate::commands::{Command, Target};
use crate::descriptor::{MemoryKind, MrDescriptor};
use crate::engine::MrHandle;
use crate::error::{FabricError, Result};
use crate::provider::same_host::SameHostDst;

/// How a request from a local region to a descriptor is carried.
pub(super) enum Route {
    /// Over the libfabric domains.
    Network(Target),
    /// Same host, GPU memory on either side: CUDA IPC + copy engines / copy kernel.
    SameHost(SameHostDst),
}

impl TransferEngine {
    /// Checks that `peer` can be reached from this engine: same provider, same domain count.
    pub(crate) fn check_peer(&self, peer: &EngineAddress) -> Result<()> {
        if peer.provider != self.address.provider {
            return Err(FabricError::InvalidDescriptor(format!(
                "peer belongs to a '{}' engine, this engine uses '{}'",
                peer.provider, self.address.provider
            )));
        }
        if peer.domains.len() != self.address.domains.len() {
            return Err(FabricError::InvalidDescriptor(format!(
                "peer has {} domains, this engine {}; all peers must use the same number",
                peer.domains.len(),
                self.address.domains.len()
            )));
        }
        Ok(())
    }

    /// Where the worker writes for a region descriptor (checked against this engine).
    pub(crate) fn region_target(&self, dst: &MrDescriptor) -> Result<Target> {
        self.check_peer(&dst.owner)?;
        Ok(Target {
            addresses: dst.keys.iter().map(|k| k.address.endpoint.clone()).collect(),
            keys: dst.keys.iter().map(|k| (k.key, k.remote_base)).collect(),
        })
    }

    /// Where the worker sends immediates addressed to an engine (its immediate slots).
    pub(crate) fn engine_target(&self, peer: &EngineAddress) -> Result<Target> {
        self.check_peer(peer)?;
        Ok(Target {
            addresses: peer.domains.iter().map(|d| d.endpoint.clone()).collect(),
            keys: peer.domains.iter().map(|d| (d.imm_key, d.imm_base)).collect(),
        })
    }

    /// Picks the path: same-host CUDA when either side is GPU memory and the owner shares this
    /// host (another process or this one), the network otherwise (host memory only).
    pub(super) fn route(&self, src: MrHandle, dst: &MrDescriptor) -> Result<Route> {
        let src_kind = self.region_info(src)?.kind;
        let gpu = src_kind != MemoryKind::Host || dst.kind != MemoryKind::Host;
        if !gpu {
            return self.region_target(dst).map(Route::Network);
        }
        if !dst.owner.is_same_host() {
            if src_kind != MemoryKind::Host {
                return Err(self.gpu_network_error("source", src_kind));
            }
            if !dst.network_reachable() {
                return Err(self.gpu_network_error("destination", dst.kind));
            }
            return self.region_target(dst).map(Route::Network);
        }
        self.check_peer(&dst.owner)?;
        Ok(Route::SameHost(SameHostDst {
            kind: dst.kind,
            base: dst.base,
            len: dst.len,
            pid: dst.owner.pid,
            process: dst.owner.process,
            same_process: dst.owner.is_same_process(),
            cuda: dst.cuda.clone(),
        }))
    }

    /// The error for a network transfer that involves GPU memory.
    pub(crate) fn gpu_network_error(&self, side: &str, kind: MemoryKind) -> FabricError {
        FabricError::ProviderUnavailable(format!(
            "the {side} is GPU memory ({kind:?}) on a peer on another host: provider '{}' was opened without \
             FI_HMEM, so GPU regions are registered for same-host (CUDA IPC) transfers only and are never \
             copied through host memory behind your back. Remedy: stage through a registered host buffer, or \
             use a provider with FI_HMEM (efa, or verbs;ofi_rxm with a CUDA-enabled libfabric) once DMA-BUF \
             registration is implemented (it is not: it cannot be tested on these hosts)",
            self.address.provider
        ))
    }

    /// Lifts the fence that a timed-out request put on `peer` (see [`FabricError::PeerFenced`]);
    /// returns whether it was fenced. Requests that timed out may or may not have landed: re-admit
    /// once the application has settled with the peer what it received.
    pub fn readmit_peer(&self, peer: &EngineAddress) -> Result<bool> {
        self.check_peer(peer)?;
        let first = peer.domains[0].endpoint.clone();
        self.request(|reply| Command::Readmit { peer: first, reply })
    }
}
