//! Triggered work: requests the worker posts itself, on its own thread, as soon as an immediate
//! has been counted often enough; no thread hand-off between the arrival and the post (what a
//! forwarding proxy or an echo needs).
//!
//! Counting rules: a trigger armed for `count` arrivals of `imm` first takes what the ImmCounter
//! table already counted (arrivals before arming count), then the arrivals as the worker reads
//! them, before the table sees them. Triggers of one value are served in the order they were
//! armed, each consuming its `count`; arrivals no trigger needs go to the table as before. A
//! trigger that times out fails its request with [`FabricError::Timeout`] and gives the arrivals
//! it had consumed back to the table.
use std::collections::VecDeque;
use std::time::Instant;

use super::Worker;
use crate::commands::{ArmCommand, Command};
use crate::config::deadline_after;
use crate::error::FabricError;

/// A request waiting for its count.
pub(super) struct Armed {
    /// Arrivals still needed.
    remaining: u64,
    /// Arrivals consumed so far (given back to the table if the trigger times out).
    taken: u64,
    deadline: Option<Instant>,
    request: Command,
}

/// Armed triggers, per immediate value in arming order.
#[derive(Default)]
pub(super) struct Triggers {
    /// Looked up with every arriving immediate (chosen by peers): a seeded hash, foldhash.
    queues: foldhash::HashMap<u32, VecDeque<Armed>>,
    /// No armed trigger's deadline is earlier (an armed trigger may have fired since): the
    /// expiry scan runs only once this passed, not on every idle poll of the worker, which may
    /// hold thousands of armed triggers (an echo server arms one per expected ping).
    next_deadline: Option<Instant>,
}

impl Worker {
    /// Arms a trigger; fires it at once if the table already counted enough.
    pub(super) fn arm(&mut self, a: ArmCommand) {
        let ArmCommand { imm, count, timeout, request } = a;
        // Earlier triggers of this value are served first: only an empty queue may take from
        // the table (arrivals counted there were not needed by any trigger).
        let queues = &self.triggers.queues;
        let taken = if queues.get(&imm).is_none_or(|q| q.is_empty()) { self.imm.take_up_to(imm, count) } else { 0 };
        if taken == count {
            return self.fire(*request);
        }
        let deadline = timeout.map(deadline_after);
        if let Some(d) = deadline {
            let next = &mut self.triggers.next_deadline;
            *next = Some(next.map_or(d, |n| n.min(d)));
        }
        let armed = Armed { remaining: count - taken, taken, deadline, request: *request };
        self.triggers.queues.entry(imm).or_default().push_back(armed);
    }

    /// Feeds a batch of arrivals to the armed triggers and posts the requests whose count was
    /// reached; `batch` keeps the arrivals left for the table.
    pub(super) fn feed_triggers(&mut self, batch: &mut Vec<(u32, u32)>) {
        if self.triggers.queues.is_empty() {
            return;
        }
        let mut due: smallvec::SmallVec<[Command; 1]> = smallvec::SmallVec::new();
        let queues = &mut self.triggers.queues;
        batch.retain_mut(|(imm, times)| {
            let Some(queue) = queues.get_mut(imm) else { return true };
            let mut left = u64::from(*times);
            while left > 0 {
                let Some(front) = queue.front_mut() else { break };
                let used = front.remaining.min(left);
                front.remaining -= used;
                front.taken += used;
                left -= used;
                if front.remaining == 0 {
                    due.push(queue.pop_front().expect("front exists").request);
                }
            }
            if queue.is_empty() {
                queues.remove(imm);
            }
            *times = left as u32;
            left > 0
        });
        for request in due {
            self.fire(request);
        }
    }

    /// Posts a triggered request as if it had just arrived from the engine.
    fn fire(&mut self, request: Command) {
        let handled = self.handle(request);
        debug_assert!(handled, "an armed request is never a Stop");
    }

    /// Fails triggers whose timeout passed; their consumed arrivals go back to the table.
    pub(super) fn expire_triggers(&mut self) {
        let Some(next) = self.triggers.next_deadline else { return };
        let now = Instant::now();
        if next > now {
            return;
        }
        let mut expired = Vec::new();
        let mut next: Option<Instant> = None;
        self.triggers.queues.retain(|&imm, queue| {
            queue.retain_mut(|a| {
                let keep = a.deadline.is_none_or(|d| d > now);
                if !keep {
                    expired.push((imm, a.taken, std::mem::replace(&mut a.request, Command::Stop)));
                } else if let Some(d) = a.deadline {
                    next = Some(next.map_or(d, |n| n.min(d)));
                }
                keep
            });
            !queue.is_empty()
        });
        self.triggers.next_deadline = next;
        for (imm, taken, request) in expired {
            self.give_back(imm, taken);
            if let Some(on_done) = request.into_stopped() {
                let e = FabricError::Timeout(format!("immediate {imm} was not counted often enough in time"));
                self.notify(on_done, Err(e));
            }
        }
    }

    /// Returns arrivals a failed trigger had consumed to the table.
    fn give_back(&mut self, imm: u32, mut taken: u64) {
        while taken > 0 {
            let n = taken.min(u64::from(u32::MAX)) as u32;
            let events = self.imm.add_batch(&[(imm, n)]);
            self.callbacks.push_imm_events(events);
            taken -= u64::from(n);
        }
    }

    /// Fails every armed trigger (the worker is stopping).
    pub(super) fn fail_triggers(&mut self) {
        let triggers = std::mem::take(&mut self.triggers);
        for request in triggers.queues.into_values().flatten().map(|a| a.request) {
            if let Some(on_done) = request.into_stopped() {
                self.notify(on_done, Err(FabricError::Stopped));
            }
        }
    }
}
