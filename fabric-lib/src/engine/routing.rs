//! Where a request goes: checks that a peer can be reached (provider, domain count), turns
//! descriptors into worker targets, picks the network or the same-host path, and fences.
use super::TransferEngine;
use crate::address::EngineAddress;
use crate::commands::{Command, SameHostImm, StagedDest, Target};
use crate::descriptor::{MemoryKind, MrDescriptor};
use crate::engine::MrHandle;
use crate::epoch::Readmission;
use crate::error::{FabricError, Result};
use crate::provider::same_host::SameHostDst;

/// How a request from a local region to a descriptor is carried.
pub(super) enum Route {
    /// Over the libfabric domains.
    Network(Target),
    /// Same host, GPU memory on either side: CUDA IPC + copy engines / copy kernel (host memory
    /// on both sides with `same_host_host_memory`: `process_vm_writev`).
    SameHost(SameHostDst),
    /// Over the libfabric domains through host memory, for GPU memory the NIC cannot reach.
    Staged(StagedRoute),
}

/// How a staged request travels (see `staging`).
pub(super) struct StagedRoute {
    /// The source is copied into a bounce buffer first.
    pub bounce: bool,
    /// The destination region's keys, or its owner's landing area's.
    pub target: Target,
    pub dest: StagedDest,
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
            peer: self.peers.intern(dst.keys.iter().map(|k| k.address.endpoint.as_slice()))?,
            keys: dst.keys.iter().map(|k| (k.key, k.remote_base)).collect(),
        })
    }

    /// Whether an immediate-only request to `peer` goes into its same-host inbox (with
    /// `same_host_host_memory`; the worker falls back to the provider if it cannot map it).
    pub(crate) fn same_host_imm(&self, peer: &EngineAddress) -> bool {
        self.config.same_host_host_memory && !self.config.force_network && peer.inbox.is_some() && peer.is_same_host()
    }

    /// The immediate of a same-host request to `peer`: its inbox, with its slots as fallback.
    pub(crate) fn same_host_imm_target(&self, imm: u32, peer: &EngineAddress) -> Result<SameHostImm> {
        let target = self.engine_target(peer)?;
        Ok(SameHostImm { imm, target, inbox: peer.inbox.map(|a| (peer.pid, peer.process, a)) })
    }

    /// Where the worker sends immediates addressed to an engine (its immediate slots).
    pub(crate) fn engine_target(&self, peer: &EngineAddress) -> Result<Target> {
        self.check_peer(peer)?;
        Ok(Target { peer: self.peer_id(peer)?, keys: peer.domains.iter().map(|d| (d.imm_key, d.imm_base)).collect() })
    }

    /// A peer engine's id in this engine's peer table (see `peers`).
    pub(crate) fn peer_id(&self, peer: &EngineAddress) -> Result<u32> {
        self.peers.intern(peer.domains.iter().map(|d| d.endpoint.as_slice()))
    }

    /// Picks the path of a write: same-host CUDA when either side is GPU memory and the owner
    /// shares this host (another process or this one) unless `force_network` is set (host memory
    /// on both sides too with `same_host_host_memory`); the network otherwise, which needs GPU
    /// memory on either side registered with the NIC (FI_HMEM).
    pub(super) fn route(&self, src: MrHandle, dst: &MrDescriptor) -> Result<Route> {
        self.route_via(src, dst, self.config.same_host_host_memory)
    }

    /// [`TransferEngine::route`], with host memory on both sides taking the same-host path only
    /// if `host_to_host` (reads between host regions always take the provider).
    pub(super) fn route_via(&self, src: MrHandle, dst: &MrDescriptor, host_to_host: bool) -> Result<Route> {
        self.route_from(self.region_info(src)?, dst, host_to_host)
    }

    /// [`TransferEngine::route_via`] for a source already looked up (a scatter's many targets).
    pub(super) fn route_from(&self, src: super::RegionInfo, dst: &MrDescriptor, host_to_host: bool) -> Result<Route> {
        let gpu = src.kind != MemoryKind::Host || dst.kind != MemoryKind::Host;
        let same_host_path = gpu || host_to_host;
        if !same_host_path || !dst.owner.is_same_host() || self.config.force_network {
            if let Some(staged) = self.staged_route(src, dst)? {
                return Ok(Route::Staged(staged));
            }
            if !src.network {
                return Err(self.gpu_network_error("source", src.kind));
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

    /// The staged route for a network transfer, if either side needs one: a source the NIC
    /// cannot reach is bounced through host memory, a destination the NIC cannot reach is
    /// reached through its owner's landing area. None: the plain network path.
    fn staged_route(&self, src: super::RegionInfo, dst: &MrDescriptor) -> Result<Option<StagedRoute>> {
        if self.config.staging.is_none() {
            return Ok(None);
        }
        let testing = self.config.stage_host_memory;
        let bounce = match src.kind {
            MemoryKind::Cuda(_) => !src.network,
            MemoryKind::Host => testing,
        };
        let landing = match (&dst.landing, dst.kind) {
            (Some(l), MemoryKind::Host) => Some(l),
            (Some(l), MemoryKind::Cuda(_)) if !dst.network_reachable() => Some(l),
            _ => None,
        };
        if !bounce && landing.is_none() {
            return Ok(None);
        }
        if landing.is_none() && !dst.network_reachable() {
            return Err(self.gpu_network_error("destination", dst.kind));
        }
        self.check_peer(&dst.owner)?;
        Ok(Some(match landing {
            Some(l) => StagedRoute {
                bounce,
                target: Target {
                    peer: self.peers.intern(l.keys.iter().map(|k| k.address.endpoint.as_slice()))?,
                    keys: l.keys.iter().map(|k| (k.key, k.remote_base)).collect(),
                },
                dest: StagedDest::Landing {
                    chunk_bytes: l.chunk_bytes,
                    dst_base: dst.base,
                    peer_max_message: dst.owner.max_message_size,
                },
            },
            None => StagedRoute { bounce, target: self.region_target(dst)?, dest: StagedDest::Region },
        }))
    }

    /// The error for a network transfer that involves GPU memory the NIC cannot reach.
    pub(crate) fn gpu_network_error(&self, side: &str, kind: MemoryKind) -> FabricError {
        FabricError::ProviderUnavailable(format!(
            "the {side} is GPU memory ({kind:?}) not registered with the NIC, and the transfer takes the \
             network (a peer on another host, or force_network): provider '{}' has no FI_HMEM here (or \
             gpu_network is off), and staged transfers through host memory are off on this engine or on the \
             region's owner (EngineConfig::staging, staging=False in Python), so the region serves same-host \
             (CUDA IPC) peers only. Remedy: turn staging on at both ends, or use a provider with FI_HMEM: \
             efa, or shm / verbs;ofi_rxm of a CUDA-enabled libfabric (docs/gpu.md)",
            self.address.provider
        ))
    }

    /// Lifts the fence that a timed-out request put on `peer` (see [`FabricError::PeerFenced`]).
    ///
    /// Where the provider carries epochs (8-byte CQ data: tcp, udp;ofi_rxd, shm, sockets) this
    /// is a handshake with the peer, bounded by the transfer timeout: the peer stops counting
    /// immediates of this engine's ended epoch and reports what it counted under it
    /// ([`Readmission::counted`]), so the application resends exactly the requests whose
    /// immediates are missing. If the peer does not answer, this fails with
    /// [`FabricError::Timeout`] and the peer stays fenced.
    pub fn readmit_peer(&self, peer: &EngineAddress) -> Result<Readmission> {
        self.check_peer(peer)?;
        let endpoints = peer.domains.iter().map(|d| d.endpoint.clone()).collect();
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.command(Command::Readmit { peer: endpoints, max_message_size: peer.max_message_size, reply: tx })?;
        // The worker answers within the transfer timeout (the handshake's bound).
        let bound = self.config.command_timeout.saturating_add(self.config.transfer_timeout);
        rx.recv_timeout(bound).map_err(|_| {
            if self.is_stopped() {
                FabricError::Stopped
            } else {
                FabricError::Timeout(format!("the worker did not answer the re-admission within {bound:?}"))
            }
        })?
    }
}
