//! Per-peer epochs: once a request to a peer timed out and the peer was re-admitted, late
//! deliveries of the writer's older requests are not counted by the receiver.
//!
//! Every write with an immediate carries, in the upper 32 bits of its remote CQ data, the
//! writer's *epoch tag* for that receiver: a random 32-bit number that names both the writer
//! and its epoch (0 and `CONTROL_TAG` are never drawn). The receiver counts each delivery
//! under its tag. Re-admission is a handshake over two-sided messages that carry CQ data
//! `CONTROL_TAG`: the writer sends [`Control::Readmit`] with the tag of the epoch that ended;
//! the receiver *retires* that tag (later deliveries carrying it are dropped and counted as
//! stale) and answers [`Control::Counted`] with what it counted under it, per immediate value,
//! and the tag the writer uses from then on. Every delivery of the ended epoch is therefore
//! either counted before the handshake (and in the report) or dropped after it, never both.
//!
//! Same-host writes carry the tag as well: in the entry they push into the receiver's inbox
//! (`provider::same_host::inbox`), which the receiver counts through the same filter, or in the
//! zero-byte write over the provider that announces them where the receiver has no inbox.
//!
//! Needs 8 bytes of remote CQ data (`cq_data_size`; tcp, udp;ofi_rxd, shm and sockets in
//! libfabric 1.17). With 4 (efa, verbs) writes carry the immediate only: the fence and the
//! explicit re-admission hold, late deliveries are still counted and no report is available.
//!
//! Tags are random, not assigned: two writers of one receiver share a tag with probability
//! about n/2³² for n writers; then re-admitting one also retires the other's epoch (its
//! immediates are dropped as stale, logged and counted) and the report adds both.
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::encoding::{decode_versioned, encode_versioned};
use crate::error::{FabricError, Result};

/// Upper CQ-data bits of a control message; never a writer's tag.
pub(crate) const CONTROL_TAG: u32 = u32::MAX;
const CONTROL_MAGIC: [u8; 4] = *b"FLCM";
/// Most parts a report may announce (bounds what a corrupt report makes the writer allocate).
const MAX_REPORT_PARTS: u32 = 1 << 20;

/// The remote CQ data of a write: the writer's epoch tag above the immediate.
pub(crate) fn cq_data(tag: u32, imm: u32) -> u64 {
    (u64::from(tag) << 32) | u64::from(imm)
}

/// (epoch tag, immediate) of received remote CQ data.
pub(crate) fn split_cq_data(data: u64) -> (u32, u32) {
    ((data >> 32) as u32, data as u32)
}

/// A random epoch tag, never 0, `CONTROL_TAG` or one for which `taken` holds.
pub(crate) fn draw_tag(taken: impl Fn(u32) -> bool) -> Result<u32> {
    for _ in 0..64 {
        let tag = getrandom::u32().map_err(|e| FabricError::InvalidArgument(format!("no random source: {e}")))?;
        if tag != 0 && tag != CONTROL_TAG && !taken(tag) {
            return Ok(tag);
        }
    }
    Err(FabricError::InvalidArgument("no free epoch tag after 64 random draws".into()))
}

/// What the receiver counted under one epoch: (immediate, arrivals), sorted by immediate.
pub type EpochCounts = Vec<(u32, u64)>;

/// The messages of the re-admission handshake (versioned, checksummed bytes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Control {
    /// Writer → receiver: retire epoch `old` of mine; answer to `reply_to` (my first domain's
    /// endpoint) in messages of at most `max_message_size` bytes.
    Readmit { nonce: u64, old: u32, reply_to: Vec<u8>, max_message_size: u64 },
    /// Receiver → writer: part `part` of `parts` of what was counted under the retired epoch;
    /// `next` is the writer's tag from now on.
    Counted { nonce: u64, next: u32, part: u32, parts: u32, counts: EpochCounts },
    /// Staging (see `staging`), writer → receiver: grant slots of your landing area to my
    /// request `request` of `chunks` chunks into your region at `dst_base`; count its immediate
    /// under my epoch `tag`; credits go to `reply_to` (my first domain's endpoint). `writer`
    /// names the writing engine (request ids are per engine).
    StageAsk { writer: u64, request: u64, reply_to: Vec<u8>, tag: u32, chunks: u32, dst_base: u64 },
    /// Staging, writer → receiver: a chunk of `writer`'s request is in its landing slot.
    StageChunk { writer: u64, header: crate::staging::ChunkHeader },
    /// Staging, receiver → writer: slots of `request` whose chunks reached the destination
    /// (`drained`), slots the request may fill next (`granted`), or why it cannot complete.
    StageCredit { request: u64, drained: Vec<u32>, granted: Vec<u32>, error: Option<String> },
    /// Staging, writer → receiver: `writer`'s request failed or timed out; free its slots.
    StageCancel { writer: u64, request: u64 },
}

impl Control {
    pub(crate) fn encode(&self) -> Vec<u8> {
        encode_versioned(CONTROL_MAGIC, self)
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Self> {
        decode_versioned(CONTROL_MAGIC, bytes, "control message")
    }

    /// The answer to a `Readmit`, cut into messages of at most `limit` bytes each.
    pub(crate) fn counted_parts(nonce: u64, next: u32, counts: &[(u32, u64)], limit: usize) -> Result<Vec<Vec<u8>>> {
        let encode = |part: u32, parts: u32, counts: &[(u32, u64)]| {
            Control::Counted { nonce, next, part, parts, counts: counts.to_vec() }.encode()
        };
        // Worst case of one entry: 5 + 10 varint bytes; the frame around it is measured.
        let frame = encode(u32::MAX, u32::MAX, &[]).len() + 5;
        let per_part = limit.saturating_sub(frame) / 15;
        if per_part == 0 {
            return Err(FabricError::InvalidArgument(format!(
                "a {limit}-byte message cannot carry the re-admission report; raise max_message_size"
            )));
        }
        let chunks: Vec<&[(u32, u64)]> = if counts.is_empty() { vec![&[]] } else { counts.chunks(per_part).collect() };
        let parts = chunks.len() as u32;
        Ok(chunks.iter().enumerate().map(|(i, c)| encode(i as u32, parts, c)).collect())
    }
}

/// The receiver's side: counts per epoch tag, retired tags with their frozen reports, and
/// the deliveries refused for carrying a retired tag. Keyed by tags and immediates that peers
/// choose: a seeded hash (foldhash), fast (every arrival is recorded) but not predictable to them.
#[derive(Default)]
pub(crate) struct ReceivedEpochs {
    counted: foldhash::HashMap<u32, foldhash::HashMap<u32, u64>>,
    retired: foldhash::HashMap<u32, Arc<EpochCounts>>,
    pub stale: Arc<AtomicU64>,
}

impl ReceivedEpochs {
    /// Whether a delivery under `tag` may be counted (its epoch was not retired).
    pub fn accepts(&self, tag: u32) -> bool {
        !self.retired.contains_key(&tag)
    }

    /// Records `n` counted arrivals of `imm` under `tag`.
    pub fn record(&mut self, tag: u32, imm: u32, n: u32) {
        *self.counted.entry(tag).or_default().entry(imm).or_default() += u64::from(n);
    }

    /// Records `n` deliveries refused for a retired epoch.
    pub fn refuse(&self, n: u64) {
        self.stale.fetch_add(n, Ordering::Relaxed);
    }

    /// Retires `old` (idempotent: a repeated handshake gets the same report) and draws the
    /// writer's next tag. Returns (next tag, what was counted under `old`).
    pub fn retire(&mut self, old: u32) -> Result<(u32, Arc<EpochCounts>)> {
        let report = match self.retired.get(&old) {
            Some(r) => r.clone(),
            None => {
                let mut counts: EpochCounts = self.counted.remove(&old).unwrap_or_default().into_iter().collect();
                counts.sort_unstable();
                let r = Arc::new(counts);
                self.retired.insert(old, r.clone());
                r
            }
        };
        let next = draw_tag(|t| self.counted.contains_key(&t) || self.retired.contains_key(&t))?;
        Ok((next, report))
    }
}

/// The writer's side of one re-admission handshake in progress.
pub(crate) struct PendingReadmit {
    /// The peer's endpoints, one per domain.
    pub endpoints: Vec<Vec<u8>>,
    pub parts: Option<u32>,
    pub received: Vec<bool>,
    pub counts: HashMap<u32, u64>,
    pub next: u32,
    pub deadline: std::time::Instant,
    pub reply: crossbeam_channel::Sender<Result<Readmission>>,
}

impl PendingReadmit {
    /// Adds one part of the answer; true once every part is in.
    pub fn add(&mut self, next: u32, part: u32, parts: u32, counts: EpochCounts) -> bool {
        if parts == 0 || parts > MAX_REPORT_PARTS || part >= parts || self.parts.is_some_and(|p| p != parts) {
            return false;
        }
        self.parts = Some(parts);
        self.received.resize(parts as usize, false);
        if !std::mem::replace(&mut self.received[part as usize], true) {
            self.next = next;
            for (imm, n) in counts {
                *self.counts.entry(imm).or_default() += n;
            }
        }
        self.received.iter().all(|&r| r)
    }
}

/// The outcome of [`crate::TransferEngine::readmit_peer`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Readmission {
    /// Whether the peer was fenced (false: nothing was done).
    pub fenced: bool,
    /// What the peer counted from this engine in the epoch that ended, per immediate value:
    /// every request of that epoch (since the engine started or the last re-admission) whose
    /// immediate the peer counted, including the ones that timed out or were still in flight.
    /// Deliveries of that epoch arriving later are dropped by the peer. `None` when the peer
    /// was not fenced, or the provider's CQ data has no room for epochs (4 bytes: efa, verbs).
    pub counted: Option<HashMap<u32, u64>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cq_data_round_trips() {
        assert_eq!(split_cq_data(cq_data(0xDEAD_BEEF, 7)), (0xDEAD_BEEF, 7));
        assert_eq!(split_cq_data(u64::from(u32::MAX)), (0, u32::MAX));
    }

    #[test]
    fn retired_epochs_are_refused_and_reported_once() {
        let mut r = ReceivedEpochs::default();
        r.record(5, 1, 2);
        r.record(5, 2, 1);
        r.record(6, 1, 1);
        let (next, report) = r.retire(5).unwrap();
        assert_eq!(*report, vec![(1, 2), (2, 1)]);
        assert!(!r.accepts(5) && r.accepts(6) && r.accepts(next));
        assert!(next != 5 && next != 6 && next != 0 && next != CONTROL_TAG);
        // Late deliveries under 5 would be refused, so a repeated handshake reports the same.
        let (_, again) = r.retire(5).unwrap();
        assert_eq!(again, report);
    }

    #[test]
    fn reports_are_cut_to_the_message_limit_and_reassembled() {
        let counts: EpochCounts = (0..1000u32).map(|i| (i * 7919, u64::from(i) << 33)).collect();
        let parts = Control::counted_parts(9, 77, &counts, 512).unwrap();
        assert!(parts.len() > 1 && parts.iter().all(|p| p.len() <= 512));
        let (tx, _rx) = crossbeam_channel::bounded(1);
        let mut pending = PendingReadmit {
            endpoints: vec![],
            parts: None,
            received: vec![],
            counts: HashMap::new(),
            next: 0,
            deadline: std::time::Instant::now(),
            reply: tx,
        };
        let mut done = false;
        for bytes in parts.iter().rev().chain(parts.iter()) {
            let Control::Counted { nonce, next, part, parts, counts } = Control::decode(bytes).unwrap() else {
                panic!("not a report")
            };
            assert_eq!((nonce, next), (9, 77));
            done = pending.add(next, part, parts, counts);
        }
        assert!(done);
        assert_eq!(pending.counts.len(), 1000);
        assert_eq!(pending.counts[&(999 * 7919)], 999 << 33);
        assert!(Control::counted_parts(9, 77, &counts, 20).is_err());
        // A part that does not fit the announced shape is ignored, never allocated for.
        assert!(!pending.add(77, 0, u32::MAX, vec![]));
        assert!(!pending.add(77, 5, 3, vec![]));
    }
}
