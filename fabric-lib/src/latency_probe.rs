//! An opt-in record of when the latest request passed each stage of the engine (app call →
//! command enqueued → worker took it → first post → completion seen → callback run, and for
//! arriving immediates: seen by the worker → counted → waiter returned), to find where the
//! microseconds of a round trip go.
//!
//! Off by default; while off, every stage costs one relaxed load of a flag that is never
//! written on the data path. Each stage keeps the time of its latest event only, so the record
//! describes a request when one is in flight at a time (a latency test), not a busy engine.
//! Times are `CLOCK_MONOTONIC` nanoseconds, the clock of Python's `time.monotonic_ns()`, so an
//! application (Rust or Python) can stamp its own call and compare.
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;

/// A stage the probe records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The engine checked and planned the request and hands its command to the worker's queue
    /// (the queue's push and the worker's wake-up belong to the next step).
    Enqueued,
    /// The worker took a command from its queue, or fired an armed one (`arm_*`).
    Dequeued,
    /// The first post of the latest dequeued command returned (e.g. `fi_writedata`).
    Posted,
    /// The worker saw a request finish (its last completion) and reported it.
    Completed,
    /// The callback thread started that request's completion callback.
    CallbackRun,
    /// The worker read an arriving immediate (completion queue or same-host inbox).
    ImmSeen,
    /// The worker applies the arrivals to the ImmCounter table (waiters may wake from here).
    ImmCounted,
    /// `wait_imm_count` returned to its caller.
    WaitReturned,
}

impl Stage {
    /// Every stage, in the order a round trip passes them.
    pub const ALL: [Stage; 8] = [
        Stage::Enqueued,
        Stage::Dequeued,
        Stage::Posted,
        Stage::Completed,
        Stage::CallbackRun,
        Stage::ImmSeen,
        Stage::ImmCounted,
        Stage::WaitReturned,
    ];

    /// The stage's name in reports (`enqueued`, `dequeued`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Stage::Enqueued => "enqueued",
            Stage::Dequeued => "dequeued",
            Stage::Posted => "posted",
            Stage::Completed => "completed",
            Stage::CallbackRun => "callback_run",
            Stage::ImmSeen => "imm_seen",
            Stage::ImmCounted => "imm_counted",
            Stage::WaitReturned => "wait_returned",
        }
    }
}

/// Nanoseconds of `CLOCK_MONOTONIC` (what `std::time::Instant` reads on Linux).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// One command as the worker handled it: the latest arrival of an immediate before it, when
/// the worker took the command from its queue (or fired it, if armed) and when the command's
/// first post returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PostRecord {
    /// The latest immediate seen before the post (0: none since the probe was enabled): for
    /// a request armed on an immediate count, the arrival that fired it.
    pub seen_ns: u64,
    pub dequeued_ns: u64,
    pub posted_ns: u64,
    /// Requests (writes, reads, messages) the worker took before this one since the log was
    /// started: the n-th request of a single submitter is number n where nothing else submits
    /// (a request whose post the provider pushed back is logged late, or under the next one).
    pub command: u64,
}

/// The latest time of each stage (0: not seen since the probe was enabled), and optionally a
/// log of every command's first post (for callers that post many requests and need each one's
/// time, e.g. a proxy timing signal → first write posted).
#[derive(Default)]
pub struct LatencyProbe {
    enabled: AtomicBool,
    marks: [AtomicU64; Stage::ALL.len()],
    /// Records kept while `log_room` > 0 (it counts down).
    log: Mutex<Vec<PostRecord>>,
    log_room: AtomicU64,
    /// Commands taken since the log was started (`PostRecord::command`).
    dequeued: AtomicU64,
}

impl LatencyProbe {
    /// Turns recording on or off; turning it on clears every mark.
    pub fn enable(&self, on: bool) {
        if on {
            for m in &self.marks {
                m.store(0, Ordering::Relaxed);
            }
        }
        self.enabled.store(on, Ordering::Release);
    }

    /// Whether it records.
    #[inline]
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Records `stage` now (if enabled).
    #[inline]
    pub fn mark(&self, stage: Stage) {
        if self.enabled() {
            if matches!(stage, Stage::Dequeued) {
                self.dequeued.fetch_add(1, Ordering::Relaxed);
            }
            self.marks[stage as usize].store(monotonic_ns(), Ordering::Release);
        }
    }

    /// Records the first post after the latest dequeue (later posts of the same command keep it).
    #[inline]
    pub(crate) fn mark_first_post(&self) {
        if self.enabled() {
            let dequeued = self.marks[Stage::Dequeued as usize].load(Ordering::Acquire);
            let posted = &self.marks[Stage::Posted as usize];
            if posted.load(Ordering::Relaxed) < dequeued {
                let now = monotonic_ns();
                posted.store(now, Ordering::Release);
                if self.log_room.load(Ordering::Relaxed) > 0 {
                    self.log_room.fetch_sub(1, Ordering::Relaxed);
                    let seen = self.marks[Stage::ImmSeen as usize].load(Ordering::Acquire);
                    let command = self.dequeued.load(Ordering::Relaxed).saturating_sub(1);
                    self.log.lock().push(PostRecord { seen_ns: seen, dequeued_ns: dequeued, posted_ns: now, command });
                }
            }
        }
    }

    /// Turns the probe on and starts a log of the next `capacity` commands' first posts (in the
    /// order the worker took them), replacing any earlier log. Each record costs the worker a
    /// short uncontended lock.
    pub fn enable_post_log(&self, capacity: usize) {
        self.log.lock().clear();
        self.log_room.store(capacity as u64, Ordering::Relaxed);
        self.dequeued.store(0, Ordering::Relaxed);
        self.enable(true);
    }

    /// The post log so far (and clears it; logging goes on while room is left).
    pub fn take_post_log(&self) -> Vec<PostRecord> {
        std::mem::take(&mut *self.log.lock())
    }

    /// The latest time of `stage`, if it was recorded since the probe was enabled.
    pub fn get(&self, stage: Stage) -> Option<u64> {
        Some(self.marks[stage as usize].load(Ordering::Acquire)).filter(|&t| t != 0)
    }

    /// Every stage's latest time, in [`Stage::ALL`] order.
    pub fn snapshot(&self) -> Vec<(Stage, Option<u64>)> {
        Stage::ALL.iter().map(|&s| (s, self.get(s))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_only_while_enabled_and_keeps_the_first_post() {
        let p = LatencyProbe::default();
        p.mark(Stage::Enqueued);
        assert_eq!(p.get(Stage::Enqueued), None);
        p.enable(true);
        p.mark(Stage::Dequeued);
        p.mark_first_post();
        let first = p.get(Stage::Posted).expect("recorded");
        p.mark_first_post();
        assert_eq!(p.get(Stage::Posted), Some(first));
        std::thread::sleep(std::time::Duration::from_millis(1));
        p.mark(Stage::Dequeued);
        p.mark_first_post();
        assert!(p.get(Stage::Posted).unwrap() > first);
        assert!(p.get(Stage::Dequeued).unwrap() >= first);
        p.enable(false);
        p.mark(Stage::ImmSeen);
        assert_eq!(p.get(Stage::ImmSeen), None);
        p.enable(true);
        assert_eq!(p.get(Stage::Posted), None);
    }

    #[test]
    fn the_post_log_keeps_each_commands_first_post_up_to_its_capacity() {
        let p = LatencyProbe::default();
        p.enable_post_log(2);
        for _ in 0..3 {
            std::thread::sleep(std::time::Duration::from_micros(50));
            p.mark(Stage::Dequeued);
            p.mark_first_post();
            p.mark_first_post(); // a later post of the same command: not logged
        }
        let log = p.take_post_log();
        assert_eq!(log.len(), 2, "{log:?}");
        assert_eq!(log[0].seen_ns, 0, "no immediate was seen before the first: {log:?}");
        assert!(log[0].dequeued_ns <= log[0].posted_ns && log[0].posted_ns < log[1].dequeued_ns, "{log:?}");
        assert_eq!((log[0].command, log[1].command), (0, 1), "numbered in the order taken");
        assert!(p.take_post_log().is_empty());
        p.enable_post_log(1);
        p.mark(Stage::ImmSeen);
        let seen = p.get(Stage::ImmSeen).expect("marked");
        p.mark(Stage::Dequeued);
        p.mark_first_post();
        assert_eq!(p.take_post_log()[0].seen_ns, seen, "the arrival before the post is kept");
    }
}
