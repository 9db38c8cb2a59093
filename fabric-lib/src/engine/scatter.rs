//! Scatter: a different slice of one local region to each of several peers.
//!
//! Each target takes the path a single write of its slice would take. Targets over the
//! provider (host memory, GPU memory registered with the NIC) go out as one worker request;
//! a target that is staged (GPU memory the NIC cannot reach) or same-host (GPU memory, CUDA IPC)
//! is planned exactly like a single write of its slice, as its own worker request. The caller's
//! completion then runs once, after every part reported ([`Joined`]). Either way each target's
//! receiver counts `imm` once, after all of that target's bytes are in place.
use super::routing::Route;
use super::{MrHandle, TransferEngine};
use crate::commands::{Command, Shards, Target, Targets, Transfer};
use crate::completion::{Notify, OnDone};
use crate::descriptor::check_range;
use crate::error::{FabricError, Result};
use crate::joined::Joined;
use crate::provider::same_host::SameHostCopy;
use crate::requests::{PeerGroup, ScatterSharding, ScatterTarget};
use crate::sharding::{split_bytes, stays_whole, DeferredImm, Shard};

impl TransferEngine {
    /// Writes a different slice of one local region to each target; each target's receiver
    /// counts `imm` once. With a `group`, every target must belong to it. Every target is
    /// checked before anything is posted.
    pub fn submit_scatter(
        &self,
        group: Option<PeerGroup>,
        src: MrHandle,
        targets: &[ScatterTarget<'_>],
        imm: Option<u32>,
        sharding: ScatterSharding,
        on_done: OnDone,
    ) -> Result<()> {
        let on_done = Notify::Callback(on_done);
        if targets.is_empty() {
            return Err(FabricError::InvalidArgument("scatter with no targets".into()));
        }
        let src_info = self.region_info(src)?;
        let members = group.map(|g| self.group(g)).transpose()?;
        let mut routes = Vec::with_capacity(targets.len());
        for (p, t) in targets.iter().enumerate() {
            check_range("source", src_info.len, t.src_offset, t.len)?;
            t.dst.check_range(t.dst_offset, t.len)?;
            if let Some(members) = &members {
                if !members.contains(&t.dst.owner) {
                    return Err(FabricError::InvalidArgument(format!(
                        "scatter target {p} is not a member of the peer group"
                    )));
                }
            }
            // Host memory on both sides takes the provider (a scatter never uses
            // `same_host_host_memory`).
            routes.push(self.route_from(src_info, t.dst, false)?);
        }
        if routes.iter().all(|r| matches!(r, Route::Network(_))) {
            let network = targets.iter().zip(routes).filter_map(|(t, r)| match r {
                Route::Network(target) => Some((t, target)),
                _ => None,
            });
            let transfer = self.plan_network_scatter(src, network.collect(), imm, sharding, on_done);
            return self.submit_transfer(transfer);
        }
        let joined = Joined::new(on_done, self.callbacks.queue());
        let commands = match self.plan_scatter_parts(src, targets, routes, imm, sharding, &joined) {
            Ok(commands) => commands,
            Err(e) => {
                joined.cancel();
                return Err(e);
            }
        };
        let mut queued = 0;
        for command in commands {
            match self.command(command) {
                Ok(()) => queued += 1,
                Err(e) if queued == 0 => {
                    // Nothing reached the worker: the caller gets the error, as for any request.
                    joined.cancel();
                    return Err(e);
                }
                Err(e) => {
                    // Some parts are under way: the rest fail, reported through the completion.
                    joined.fail(e);
                    break;
                }
            }
        }
        joined.release();
        Ok(())
    }

    /// One worker request per same-host or staged target (each planned as a single write of
    /// its slice), and one for every target over the provider.
    fn plan_scatter_parts(
        &self,
        src: MrHandle,
        targets: &[ScatterTarget<'_>],
        routes: Vec<Route>,
        imm: Option<u32>,
        sharding: ScatterSharding,
        joined: &Joined,
    ) -> Result<Vec<Command>> {
        let mut network = Vec::new();
        let mut commands = Vec::with_capacity(targets.len());
        for (t, route) in targets.iter().zip(routes) {
            match route {
                Route::Network(target) => network.push((t, target)),
                Route::SameHost(local) => {
                    let copy =
                        SameHostCopy::Contiguous { src_offset: t.src_offset, dst_offset: t.dst_offset, len: t.len };
                    commands.push(self.plan_same_host(src, t.dst, local, copy, imm, joined.part())?);
                }
                Route::Staged(staged) => {
                    let pieces = vec![(t.src_offset, t.dst_offset, t.len)];
                    commands.push(self.plan_staged(src, t.dst, staged, pieces, imm, joined.part())?);
                }
            }
        }
        if !network.is_empty() {
            commands.push(Command::Transfer(self.plan_network_scatter(src, network, imm, sharding, joined.part())));
        }
        Ok(commands)
    }

    /// The targets over the provider as one request: each target whole on one domain
    /// (rotating), or sharded over all domains like a single write.
    fn plan_network_scatter(
        &self,
        src: MrHandle,
        targets: Vec<(&ScatterTarget<'_>, Target)>,
        imm: Option<u32>,
        sharding: ScatterSharding,
        on_done: Notify,
    ) -> Transfer {
        let slices = targets.iter().enumerate().map(|(p, (t, _))| (p, t.src_offset, t.len, t.dst_offset));
        let (shards, deferred) = self.plan_scatter_shards(slices, imm, sharding);
        let resolved: Targets = targets.into_iter().map(|(_, target)| target).collect();
        Transfer { region: src.0, targets: resolved.into(), shards, deferred, on_done }
    }

    /// The shards of `(peer, src_offset, len, dst_offset)` slices, at most one per peer, and the
    /// immediates deferred after them: each named peer's receiver counts `imm` once, on the data
    /// of a slice that stays whole, after the last shard of one cut over several domains.
    pub(super) fn plan_scatter_shards(
        &self,
        slices: impl ExactSizeIterator<Item = (usize, u64, u64, u64)>,
        imm: Option<u32>,
        sharding: ScatterSharding,
    ) -> (Shards, Vec<DeferredImm>) {
        let n = self.num_domains();
        // Whole slices rotate over the domains; only large ones are cut (as a single write is).
        let min_shard = self.config().shard_min_bytes;
        let cut = n > 1 && sharding == ScatterSharding::ByBytes;
        let mut domain = self.rotate(slices.len()) % n;
        let mut shards = Shards::with_capacity(slices.len());
        let mut deferred = Vec::new();
        for (peer, src_offset, len, dst_offset) in slices {
            let peer = peer as u32;
            if cut && !stays_whole(len, min_shard) {
                let pieces = split_bytes(len, n, n, domain, min_shard);
                if let Some(imm) = imm {
                    deferred.push(DeferredImm { peer, domain: pieces[0].0 as u16, imm });
                }
                shards.extend(pieces.into_iter().map(|(d, off, len)| Shard {
                    peer,
                    domain: d as u16,
                    src_offset: src_offset + off,
                    len,
                    dst_offset: dst_offset + off,
                    imm: None,
                }));
            } else {
                shards.push(Shard { peer, domain: domain as u16, src_offset, len, dst_offset, imm });
            }
            domain = if domain + 1 == n { 0 } else { domain + 1 };
        }
        (shards, deferred)
    }
}
