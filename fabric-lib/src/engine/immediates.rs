//! Immediates without data, peer groups and barriers.
use std::sync::atomic::Ordering;

use super::TransferEngine;
use crate::address::EngineAddress;
use crate::commands::{Command, SameHostTransfer, Targets, Transfer, SCRATCH_REGION};
use crate::completion::{Notify, OnDone};
use crate::descriptor::MrDescriptor;
use crate::error::{FabricError, Result};
use crate::requests::{PeerGroup, ScatterSharding};

impl TransferEngine {
    /// Sends only an immediate (a zero-byte write into `dst`'s region; for a GPU region without
    /// network keys, into its owner engine's immediate slot: the receiver counts it the same).
    pub fn submit_imm(&self, imm: u32, dst: &MrDescriptor, on_done: OnDone) -> Result<()> {
        self.command(self.plan_imm(imm, dst, Notify::Callback(on_done))?)
    }

    /// Sends only an immediate to an engine (its immediate slot, or with `same_host_host_memory`
    /// its same-host inbox); no region needed.
    pub fn submit_imm_to(&self, imm: u32, peer: &EngineAddress, on_done: OnDone) -> Result<()> {
        self.command(self.plan_imm_to(imm, peer, Notify::Callback(on_done))?)
    }

    /// Plans an immediate to the owner of `dst` (through the region's keys where it has them and
    /// the owner is not reached the same-host way).
    pub(super) fn plan_imm(&self, imm: u32, dst: &MrDescriptor, on_done: Notify) -> Result<Command> {
        if !dst.network_reachable() || self.same_host_imm(&dst.owner) {
            return self.plan_imm_to(imm, &dst.owner, on_done);
        }
        Ok(self.plan_imm_to_targets(imm, smallvec::smallvec![self.region_target(dst)?], on_done))
    }

    /// Plans an immediate to an engine: into its same-host inbox (`same_host_host_memory`), else
    /// its immediate slot over the provider.
    pub(super) fn plan_imm_to(&self, imm: u32, peer: &EngineAddress, on_done: Notify) -> Result<Command> {
        if self.same_host_imm(peer) {
            let imm = Some(self.same_host_imm_target(imm, peer)?);
            let transfer = SameHostTransfer { region: SCRATCH_REGION, write: None, imm, on_done };
            return Ok(Command::SameHost(Box::new(transfer)));
        }
        Ok(self.plan_imm_to_targets(imm, smallvec::smallvec![self.engine_target(peer)?], on_done))
    }

    fn submit_imm_to_targets(&self, imm: u32, targets: Targets, on_done: OnDone) -> Result<()> {
        self.command(self.plan_imm_to_targets(imm, targets, Notify::Callback(on_done)))
    }

    pub(super) fn plan_imm_to_targets(&self, imm: u32, targets: Targets, on_done: Notify) -> Command {
        // A zero-byte slice per target: one write each, carrying the immediate, domains rotating.
        let slices = (0..targets.len()).map(|p| (p, 0, 0, 0));
        let (shards, deferred) = self.plan_scatter_shards(slices, Some(imm), ScatterSharding::ByPeer);
        Command::Transfer(Transfer { region: SCRATCH_REGION, targets: targets.into(), shards, deferred, on_done })
    }

    /// Registers a set of peer engines for scatters and barriers.
    pub fn add_peer_group(&self, peers: &[EngineAddress]) -> Result<PeerGroup> {
        if peers.is_empty() {
            return Err(FabricError::InvalidArgument("a peer group needs at least one peer".into()));
        }
        for p in peers {
            self.check_peer(p)?;
        }
        let id = self.next_group.fetch_add(1, Ordering::Relaxed);
        self.peer_groups.write().insert(id, peers.to_vec());
        Ok(PeerGroup(id))
    }

    pub(super) fn group(&self, group: PeerGroup) -> Result<Vec<EngineAddress>> {
        self.peer_groups
            .read()
            .get(&group.0)
            .cloned()
            .ok_or_else(|| FabricError::InvalidArgument(format!("peer group {} does not exist", group.0)))
    }

    /// Sends `imm` to every member of `group` (each member counts it once).
    pub fn submit_barrier(&self, imm: u32, group: PeerGroup, on_done: OnDone) -> Result<()> {
        let members = self.group(group)?;
        let targets = members.iter().map(|m| self.engine_target(m)).collect::<Result<Targets>>()?;
        self.submit_imm_to_targets(imm, targets, on_done)
    }
}
