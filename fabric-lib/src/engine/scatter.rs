//! Scatter: a different slice of one local region to each of several peers.
use super::{MrHandle, TransferEngine};
use crate::commands::Transfer;
use crate::completion::{Notify, OnDone};
use crate::descriptor::{check_range, MemoryKind};
use crate::error::{FabricError, Result};
use crate::requests::{PeerGroup, ScatterSharding, ScatterTarget};
use crate::sharding::{plan_imms, split_bytes, Shard};

impl TransferEngine {
    /// Writes a different slice of one local region to each target; each target's receiver
    /// counts `imm` once. With a `group`, every target must belong to it.
    pub fn submit_scatter(
        &self,
        group: Option<PeerGroup>,
        src: MrHandle,
        targets: &[ScatterTarget<'_>],
        imm: Option<u32>,
        sharding: ScatterSharding,
        on_done: OnDone,
    ) -> Result<()> {
        if targets.is_empty() {
            return Err(FabricError::InvalidArgument("scatter with no targets".into()));
        }
        let src_len = self.region_len(src)?;
        if self.region_kind(src)? != MemoryKind::Host || targets.iter().any(|t| t.dst.kind != MemoryKind::Host) {
            return Err(FabricError::InvalidArgument(
                "submit_scatter does not support GPU memory yet; use one submit_write per target".into(),
            ));
        }
        let members = group.map(|g| self.group(g)).transpose()?;
        let n = self.num_domains();
        let start = self.rotate(targets.len());
        let mut resolved = Vec::with_capacity(targets.len());
        let mut shards = Vec::with_capacity(targets.len());
        for (p, t) in targets.iter().enumerate() {
            check_range("source", src_len, t.src_offset, t.len)?;
            t.dst.check_range(t.dst_offset, t.len)?;
            if let Some(members) = &members {
                if !members.contains(&t.dst.owner) {
                    return Err(FabricError::InvalidArgument(format!(
                        "scatter target {p} is not a member of the peer group"
                    )));
                }
            }
            resolved.push(self.region_target(t.dst)?);
            let pieces = match sharding {
                ScatterSharding::ByPeer => vec![((start + p) % n, 0, t.len)],
                ScatterSharding::ByBytes => split_bytes(t.len, n, n, start + p, self.config().shard_min_bytes),
            };
            shards.extend(pieces.into_iter().map(|(domain, off, len)| Shard {
                peer: p as u32,
                domain: domain as u16,
                src_offset: t.src_offset + off,
                len,
                dst_offset: t.dst_offset + off,
                imm: None,
            }));
        }
        let deferred = plan_imms(&mut shards, &vec![imm; targets.len()]);
        self.submit_transfer(Transfer {
            region: src.0,
            targets: resolved,
            shards,
            deferred,
            on_done: Notify::Callback(on_done),
        })
    }
}
