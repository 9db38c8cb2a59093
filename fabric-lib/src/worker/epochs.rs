//! The worker's side of per-peer epochs (see `crate::epoch`): tags on outgoing immediates, the
//! epoch filter on incoming ones, and the re-admission handshake on both ends.
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crossbeam_channel::Sender;

use super::Worker;
use crate::completion::Notify;
use crate::config::deadline_after;
use crate::epoch::{cq_data, split_cq_data, Control, PendingReadmit, Readmission, CONTROL_TAG};
use crate::error::{FabricError, Result};

impl Worker {
    /// The remote CQ data of a write with `imm` to `dest` on `domain`.
    pub(super) fn cq_data(&self, domain: usize, dest: u64, imm: u32) -> u64 {
        if !self.wide_cq_data {
            return u64::from(imm);
        }
        let tag = self.tags_by_dest[domain].get(&dest).copied().unwrap_or(self.own_tag);
        cq_data(tag, imm)
    }

    /// A remote write's immediate arrived: counted under its epoch, or refused if retired.
    pub(super) fn on_remote_imm(&mut self, data: u64) {
        let (tag, imm) = if self.wide_cq_data { split_cq_data(data) } else { (0, data as u32) };
        *self.imm_batch.entry((tag, imm)).or_default() += 1;
    }

    /// Applies this round's immediates: those of retired epochs are refused (counted as stale,
    /// logged), the rest go to the ImmCounter table and to their epoch's tally.
    pub(super) fn count_imm_batch(&mut self) {
        let mut batch = std::mem::take(&mut self.imm_arrivals);
        batch.clear();
        let mut stale = 0u64;
        for ((tag, imm), n) in self.imm_batch.drain() {
            if !self.wide_cq_data {
                batch.push((imm, n)); // no epochs to check or report
                continue;
            }
            if !self.received.accepts(tag) {
                stale += u64::from(n);
                continue;
            }
            self.received.record(tag, imm, n);
            batch.push((imm, n)); // one value may appear once per writer: the table adds them
        }
        if stale > 0 {
            self.received.refuse(stale);
            tracing::warn!(
                "dropped {stale} immediates of a writer's epoch that ended (it timed out and re-admitted this \
                 engine); its re-admission report tells it what was counted"
            );
        }
        // Armed triggers take the arrivals they wait for before the table sees them.
        self.feed_triggers(&mut batch);
        if !batch.is_empty() {
            // Before the table: a polling waiter may return before add_batch does.
            self.probe.mark(crate::latency_probe::Stage::ImmCounted);
            let events = self.imm.add_batch(&batch);
            self.callbacks.push_imm_events(events);
        }
        self.imm_arrivals = batch;
    }

    /// Lifts the fence on `peer`: where epochs are carried, after the handshake in which the
    /// peer retires the ended epoch and reports what it counted under it.
    pub(super) fn start_readmit(
        &mut self,
        peer: Vec<Vec<u8>>,
        peer_max_message: u64,
        reply: Sender<Result<Readmission>>,
    ) {
        let Some(first) = peer.first() else {
            let _ = reply.send(Err(FabricError::InvalidArgument("peer address without domains".into())));
            return;
        };
        if !self.fenced.contains(first) {
            let _ = reply.send(Ok(Readmission { fenced: false, counted: None }));
            return;
        }
        if !self.wide_cq_data {
            self.fenced.remove(first);
            let _ = reply.send(Ok(Readmission { fenced: true, counted: None }));
            return;
        }
        let nonce = match getrandom::u64() {
            Ok(n) => n,
            Err(e) => {
                let _ = reply.send(Err(FabricError::InvalidArgument(format!("no random source: {e}"))));
                return;
            }
        };
        let old = self.tags_by_peer.get(first).copied().unwrap_or(self.own_tag);
        let limit = self.max_message_size.min(self.domains[0].send_buffers.slot_size());
        let msg = Control::Readmit {
            nonce,
            old,
            reply_to: self.domains[0].domain.address().to_vec(),
            max_message_size: limit as u64,
        }
        .encode();
        if msg.len() as u64 > peer_max_message || msg.len() > limit {
            let e = format!(
                "the re-admission handshake needs {} bytes, more than max_message_size ({limit} here, \
                 {peer_max_message} at the peer)",
                msg.len()
            );
            let _ = reply.send(Err(FabricError::InvalidArgument(e)));
            return;
        }
        if let Err(e) = self.send_control(first, msg) {
            let _ = reply.send(Err(e));
            return;
        }
        let readmit = PendingReadmit {
            endpoints: peer,
            parts: None,
            received: Vec::new(),
            counts: HashMap::new(),
            next: 0,
            deadline: deadline_after(self.transfer_timeout),
            reply,
        };
        self.readmits.insert(nonce, readmit);
    }

    /// Sends a control message to `endpoint` (domain 0), fenced or not; a failure is logged
    /// (the handshake that waits for an answer times out on its own).
    fn send_control(&mut self, endpoint: &[u8], msg: Vec<u8>) -> Result<()> {
        let dest = self.domains[0].domain.resolve_peer(endpoint)?;
        let id = self.new_request(
            Notify::Callback(Box::new(|r| {
                if let Err(e) = r {
                    tracing::warn!("a re-admission control message failed: {e}");
                }
            })),
            1,
        );
        self.queue_send(id, dest, msg, Some(cq_data(CONTROL_TAG, 0)));
        Ok(())
    }

    /// A message with CQ data arrived in receive buffer `slot`: a control message.
    pub(super) fn on_control(&mut self, domain: u16, slot: usize, len: usize, data: u64) {
        let d = &mut self.domains[domain as usize];
        let bytes = (len <= d.recv_buffers.slot_size()).then(|| d.recv_buffers.slot_bytes(slot, len).to_vec());
        d.recv_to_post.push(slot);
        let decoded = match bytes {
            Some(b) if split_cq_data(data).0 == CONTROL_TAG => Control::decode(&b),
            _ => Err(FabricError::InvalidDescriptor(format!("a message with CQ data {data:#x} and {len} bytes"))),
        };
        match decoded {
            Ok(Control::Readmit { nonce, old, reply_to, max_message_size }) => {
                // Immediates that arrived before the handshake count under the ended epoch,
                // those already in the same-host inbox included.
                self.drain_own_inbox();
                if !self.imm_batch.is_empty() {
                    self.count_imm_batch();
                }
                if let Err(e) = self.answer_readmit(nonce, old, &reply_to, max_message_size) {
                    tracing::warn!("could not answer a peer's re-admission: {e}");
                }
            }
            Ok(Control::Counted { nonce, next, part, parts, counts }) => {
                self.on_counted(nonce, next, part, parts, counts)
            }
            Ok(staging) => self.on_staging_control(staging),
            Err(e) => {
                self.oversized_messages.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("refused a control message: {e}");
            }
        }
    }

    /// The receiver's end of the handshake: retire the writer's ended epoch, report it.
    fn answer_readmit(&mut self, nonce: u64, old: u32, reply_to: &[u8], limit: u64) -> Result<()> {
        let (next, report) = self.received.retire(old)?;
        tracing::info!("a writer re-admitted this engine: its epoch {old:#x} ended, {} values counted", report.len());
        let limit = (limit as usize).min(self.max_message_size).min(self.domains[0].send_buffers.slot_size());
        for part in Control::counted_parts(nonce, next, &report, limit)? {
            self.send_control(reply_to, part)?;
        }
        Ok(())
    }

    /// The writer's end: collect the report; once complete, adopt the new tag and lift the fence.
    fn on_counted(&mut self, nonce: u64, next: u32, part: u32, parts: u32, counts: Vec<(u32, u64)>) {
        let Some(readmit) = self.readmits.get_mut(&nonce) else {
            tracing::warn!("a re-admission report for no handshake in progress (late or forged); ignored");
            return;
        };
        if next == 0 || next == CONTROL_TAG || !readmit.add(next, part, parts, counts) {
            return;
        }
        let readmit = self.readmits.remove(&nonce).expect("present");
        let first = readmit.endpoints[0].clone();
        for (domain, endpoint) in readmit.endpoints.iter().enumerate().take(self.domains.len()) {
            match self.domains[domain].domain.resolve_peer(endpoint) {
                Ok(dest) => {
                    self.tags_by_dest[domain].insert(dest, readmit.next);
                }
                Err(e) => {
                    // Without the tag on that domain its writes would carry the ended epoch.
                    let _ = readmit.reply.send(Err(e));
                    return;
                }
            }
        }
        self.tags_by_peer.insert(first.clone(), readmit.next);
        self.fenced.remove(&first);
        let _ = readmit.reply.send(Ok(Readmission { fenced: true, counted: Some(readmit.counts) }));
    }

    /// Fails handshakes the peer did not answer in time; the peer stays fenced.
    pub(super) fn expire_readmits(&mut self, now: Instant) {
        if self.readmits.is_empty() {
            return;
        }
        let late: Vec<u64> = self.readmits.iter().filter(|(_, r)| r.deadline <= now).map(|(n, _)| *n).collect();
        for nonce in late {
            if let Some(r) = self.readmits.remove(&nonce) {
                let e = FabricError::Timeout(format!(
                    "the peer did not answer the re-admission within {:?}; it stays fenced (try again)",
                    self.transfer_timeout
                ));
                let _ = r.reply.send(Err(e));
            }
        }
    }
}
