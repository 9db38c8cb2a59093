//! The worker's side of reads: each shard becomes one RMA read from the peer region into the
//! local region, queued and retried per destination like writes, under the same deadline and
//! fencing rules. A read carries no immediate; its completion is local.

use super::{Op, PendingPost, Worker};
use crate::commands::{SameHostRead, Transfer};
use crate::error::FabricError;
use crate::provider::same_host::{SameHostChannel, SameHostSrc};

impl Worker {
    /// Starts a read request. In a read's shards, `src_offset` is the offset in the local
    /// region (where the bytes land) and `dst_offset` the offset in the peer's region.
    pub(super) fn start_read(&mut self, t: Transfer) {
        let Transfer { region, targets, shards, deferred, on_done } = t;
        debug_assert!(deferred.is_empty(), "reads carry no immediate");
        let id = self.new_request(on_done, shards.len().max(1));
        if let Some(e) = self.fence_error(targets.iter()) {
            return self.fail_request(id, e);
        }
        let base = match self.regions.get(&region) {
            Some(r) if !r.mrs.is_empty() => r.ptr,
            Some(_) => {
                let e = FabricError::InvalidArgument(format!("memory handle {region} is not registered with the NIC"));
                return self.fail_request(id, e);
            }
            None => {
                let e = FabricError::InvalidArgument(format!("memory handle {region} was unregistered"));
                return self.fail_request(id, e);
            }
        };
        if shards.is_empty() {
            return self.finish(id, Ok(()));
        }
        for s in shards {
            let target = &targets[s.peer as usize];
            let (key, remote_base) = target.keys[s.domain as usize];
            let dest = match self.peer_dest(target.peer, s.domain) {
                Ok(d) => d,
                Err(e) => return self.fail_request(id, e),
            };
            let op = Op::Read {
                region,
                ptr: base + s.src_offset as usize,
                len: s.len as usize,
                dest,
                remote_addr: remote_base + s.dst_offset,
                key,
            };
            self.post_or_queue(s.domain as usize, PendingPost { request: id, op });
        }
        self.keep_peers(id, targets);
    }

    /// Starts a same-host read (GPU memory on either side): no network peer is involved, so
    /// there is nothing to fence; the deadline still bounds it.
    pub(super) fn start_same_host_read(&mut self, t: SameHostRead) {
        let SameHostRead { region, peer, copy, on_done } = t;
        let id = self.new_request(on_done, 1);
        let local = match self.regions.get(&region) {
            Some(r) => SameHostSrc { kind: r.kind, ptr: r.ptr as u64 },
            None => {
                let e = FabricError::InvalidArgument(format!("memory handle {region} was unregistered"));
                return self.fail_request(id, e);
            }
        };
        if self.same_host.is_none() {
            match SameHostChannel::new(self.paged_copy_blocks) {
                Ok(l) => self.same_host = Some(l),
                Err(e) => return self.fail_request(id, e),
            }
        }
        let channel = self.same_host.as_mut().expect("opened above");
        match channel.submit_read(id, region, local, peer, copy) {
            Ok(()) => self.track_region(region, 1),
            Err(e) => self.fail_request(id, e),
        }
    }
}
