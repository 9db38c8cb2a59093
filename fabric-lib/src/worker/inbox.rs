//! The worker's side of same-host immediates (`provider::same_host::inbox`): this engine's inbox
//! is drained into the round's immediates (counted, epoch filter included, exactly like
//! immediates from the provider), and the immediates of finished same-host requests are pushed
//! into peers' inboxes, waiting in order behind a full ring until the request's deadline.
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::Worker;
use crate::address::InboxAddress;
use crate::commands::SameHostImm;
use crate::error::{FabricError, Result};
use crate::provider::same_host::{Inbox, PeerInbox};
use crate::sharding::DeferredImm;

/// Entries taken from the inbox per progress round (bounds one round's work).
const DRAIN_BATCH: usize = 1024;

/// A peer's inbox: (its engine's process id, the inbox's nonce).
type InboxKey = (u64, u64);

/// The immediate of a same-host request, pushed once its data is visible.
pub(super) struct InboxPush {
    key: InboxKey,
    /// The peer's first endpoint: this engine's epoch tag towards it is kept under it.
    peer: Vec<u8>,
    imm: u32,
}

#[derive(Default)]
pub(super) struct Inboxes {
    own: Option<Inbox>,
    /// Peers' inboxes, mapped on first use; `None`: not mappable (the provider carries those).
    peers: HashMap<InboxKey, Option<PeerInbox>>,
    /// Pushes refused by a full ring, per peer inbox, in order: (request, push).
    waiting: HashMap<InboxKey, VecDeque<(u64, InboxPush)>>,
    /// Inbox entries refused as malformed (a same-host peer wrote garbage into the inbox).
    pub refused: Arc<AtomicU64>,
    /// Immediates sent over the provider instead (no reachable inbox): they rotate over the
    /// domains by this count (request ids are slab slots, reused, so they would not).
    provider_imms: usize,
}

impl Inboxes {
    /// Creates this engine's inbox (`slots` 0: none). Failing to create one is not fatal:
    /// same-host writers then announce their immediates over the provider.
    pub fn open(slots: usize) -> Self {
        let own = match slots {
            0 => None,
            _ => Inbox::create(slots)
                .map_err(|e| tracing::warn!("no same-host inbox ({e}); same-host immediates take the provider"))
                .ok(),
        };
        Inboxes { own, ..Default::default() }
    }

    pub fn address(&self) -> Option<InboxAddress> {
        self.own.as_ref().map(Inbox::address)
    }

    /// Whether pushes wait for room (the worker keeps polling rather than parking).
    pub fn busy(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// Maps the inbox once; whether immediates can go there.
    fn reachable(&mut self, pid: u32, process: u64, address: &InboxAddress) -> bool {
        let opened = self.peers.entry((process, address.nonce)).or_insert_with(|| {
            PeerInbox::open(pid, address)
                .map_err(|e| tracing::info!("same-host immediates to process {pid} take the provider: {e}"))
                .ok()
        });
        opened.is_some()
    }
}

/// What became of one push.
enum Pushed {
    Yes,
    /// No room (or contended): retried until the request's deadline.
    Full,
    /// The receiving process is gone: the request fails now.
    OwnerExited,
}

fn owner_exited((process, _): InboxKey) -> FabricError {
    FabricError::TransferFailed(format!(
        "the same-host receiver (engine process {process}) exited: its data may have been copied, nothing was counted"
    ))
}

impl Worker {
    /// Plans the immediate of a same-host request: into the peer's inbox where it can be mapped,
    /// else a zero-byte write over the provider once the data is visible.
    pub(super) fn plan_same_host_imm(&mut self, id: u64, same_host: SameHostImm) -> Result<()> {
        let SameHostImm { imm, target, inbox } = same_host;
        let push = match inbox {
            Some((pid, process, address)) if self.inboxes.reachable(pid, process, &address) => Some(InboxPush {
                key: (process, address.nonce),
                peer: self.peer_endpoints(target.peer)?.first().cloned().unwrap_or_default(),
                imm,
            }),
            _ => None,
        };
        match push {
            Some(push) => self.requests.get_mut(id).expect("live request").inbox_imm = Some(push),
            None => {
                let domain = (self.inboxes.provider_imms % self.domains.len()) as u16;
                self.inboxes.provider_imms = self.inboxes.provider_imms.wrapping_add(1);
                let (key, remote_base) = target.keys[domain as usize];
                let dest = self.peer_dest(target.peer, domain)?;
                let d = DeferredImm { peer: 0, domain, imm };
                self.requests.get_mut(id).expect("live request").deferred = vec![(d, dest, key, remote_base)];
            }
        }
        self.keep_peers(id, smallvec::smallvec![target].into());
        Ok(())
    }

    /// A same-host request's data is visible: push its immediate, or wait behind a full ring
    /// (never dropped; the request's deadline bounds the wait).
    pub(super) fn push_inbox(&mut self, request: u64, push: InboxPush) {
        if let Some(queue) = self.inboxes.waiting.get_mut(&push.key) {
            return queue.push_back((request, push));
        }
        match self.try_push(&push) {
            Pushed::Yes => self.finish(request, Ok(())),
            Pushed::Full => self.inboxes.waiting.entry(push.key).or_default().push_back((request, push)),
            Pushed::OwnerExited => self.finish(request, Err(owner_exited(push.key))),
        }
    }

    fn try_push(&self, push: &InboxPush) -> Pushed {
        // The same tag a write over the provider would carry now (`epoch`).
        let tag = self.tags_by_peer.get(&push.peer).copied().unwrap_or(self.own_tag);
        match self.inboxes.peers.get(&push.key) {
            Some(Some(inbox)) if inbox.owner_exited() => Pushed::OwnerExited,
            Some(Some(inbox)) if inbox.push(tag, push.imm) => Pushed::Yes,
            _ => Pushed::Full,
        }
    }

    /// Drains this engine's inbox and retries waiting pushes; true if anything happened.
    pub(super) fn poll_inboxes(&mut self) -> bool {
        let mut active = self.drain_own_inbox();
        if self.inboxes.busy() {
            active |= self.retry_pushes();
        }
        active
    }

    /// Moves what peers pushed into the round's immediates (`count_imm_batch` counts them).
    pub(super) fn drain_own_inbox(&mut self) -> bool {
        let Some(own) = self.inboxes.own.as_mut() else { return false };
        let batch = &mut self.imm_batch;
        let drained = own.drain(DRAIN_BATCH, |tag, imm| *batch.entry((tag, imm)).or_default() += 1);
        if drained.refused > 0 {
            self.inboxes.refused.fetch_add(drained.refused, Ordering::Relaxed);
            tracing::warn!(
                "refused {} malformed entries of the same-host inbox (a same-host process wrote into it)",
                drained.refused
            );
        }
        if drained.taken > 0 {
            self.probe.mark(crate::latency_probe::Stage::ImmSeen);
        }
        drained.taken > 0 || drained.refused > 0
    }

    fn retry_pushes(&mut self) -> bool {
        let mut pushed = Vec::new();
        let mut dead = Vec::new();
        let keys: Vec<InboxKey> = self.inboxes.waiting.keys().copied().collect();
        for key in keys {
            let Some(mut queue) = self.inboxes.waiting.remove(&key) else { continue };
            while let Some((request, push)) = queue.pop_front() {
                if !self.requests.contains(request) {
                    continue; // failed or timed out meanwhile: nothing to announce
                }
                match self.try_push(&push) {
                    Pushed::Yes => pushed.push(request),
                    Pushed::OwnerExited => dead.push((request, push.key)),
                    Pushed::Full => {
                        queue.push_front((request, push));
                        self.inboxes.waiting.insert(key, queue);
                        break;
                    }
                }
            }
        }
        let active = !pushed.is_empty() || !dead.is_empty();
        for request in pushed {
            self.finish(request, Ok(()));
        }
        for (request, key) in dead {
            self.finish(request, Err(owner_exited(key)));
        }
        active
    }
}
