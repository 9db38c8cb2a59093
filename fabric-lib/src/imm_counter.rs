//! ImmCounter: counts arrivals of 32-bit immediates, in any order, and tells waiters when a
//! target is reached.
//!
//! Semantics, per immediate value:
//! - Every arrival adds one to the value's count, unless the value is *unclaimed* (no expectation
//!   and no waiter) while a generic immediate callback is installed: then the arrival is handed to
//!   that callback instead. Without a generic callback, arrivals before any registration are kept.
//! - [`ImmCounterTable::set_expected`] fires its callback exactly once, when the count reaches `n`
//!   (at once if it already has), and then consumes `n` from the count; surplus arrivals carry
//!   over to the next round.
//! - [`ImmCounterTable::wait`] blocks (bounded) until the count reaches `n` and consumes `n`.
//! - [`ImmCounterTable::remove`] forgets the value: its expectation is dropped unfired and its
//!   count is returned.
//!
//! Thread safety: one mutex guards the table. The worker applies a whole completion batch under
//! one lock acquisition, and callbacks are returned to the caller to run outside the lock.
//!
//! Waiting: a waiter first polls a generation number the table bumps on every change, for the
//! table's polling time (the engine's `wait_spin`), and only then sleeps on the condition
//! variable: an arrival that comes soon (a round trip's answer) then costs neither side a futex
//! call or a scheduler wake-up.
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{FabricError, Result};

/// A callback fired once when an expected count is reached.
pub type OnReached = Box<dyn FnOnce() + Send + 'static>;
/// The callback for immediates that nobody claimed.
pub type GenericImmCallback = Arc<dyn Fn(u32) + Send + Sync + 'static>;

/// Work produced by updating the table, to be run outside its lock (on the callback thread).
pub enum ImmEvent {
    /// An expectation was met.
    Reached(OnReached),
    /// An unclaimed immediate arrived `count` times.
    Unclaimed(GenericImmCallback, u32, u32),
}

#[derive(Default)]
struct Slot {
    count: u64,
    expected: Option<(u64, OnReached)>,
    waiters: usize,
}

impl Slot {
    fn claimed(&self) -> bool {
        self.expected.is_some() || self.waiters > 0
    }

    fn take_if_reached(&mut self) -> Option<OnReached> {
        match &self.expected {
            Some((n, _)) if self.count >= *n => {
                let (n, cb) = self.expected.take().expect("checked above");
                self.count -= n;
                Some(cb)
            }
            _ => None,
        }
    }
}

#[derive(Default)]
struct Inner {
    slots: HashMap<u32, Slot>,
    generic: Option<GenericImmCallback>,
    closed: bool,
}

/// The table of counters of one engine.
#[derive(Default)]
pub struct ImmCounterTable {
    inner: Mutex<Inner>,
    changed: Condvar,
    /// Bumped (under the lock) on every change a waiter may be waiting for.
    generation: AtomicU64,
    /// How long [`ImmCounterTable::wait`] polls before it sleeps.
    wait_spin: Duration,
}

impl ImmCounterTable {
    /// An empty table whose waiters sleep at once.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty table whose waiters poll for up to `wait_spin` before they sleep (yielding the
    /// CPU now and then while they poll).
    pub fn with_wait_spin(wait_spin: Duration) -> Self {
        ImmCounterTable { wait_spin, ..Self::default() }
    }

    /// Applies a batch of arrivals `(imm, times)`; returns the callbacks that became due.
    pub fn add_batch(&self, arrivals: &[(u32, u32)]) -> Vec<ImmEvent> {
        let mut events = Vec::new();
        {
            let mut inner = self.inner.lock();
            let generic = inner.generic.clone();
            for &(imm, times) in arrivals {
                let slot = inner.slots.entry(imm).or_default();
                if let (false, Some(cb)) = (slot.claimed(), &generic) {
                    events.push(ImmEvent::Unclaimed(cb.clone(), imm, times));
                    if slot.count == 0 {
                        inner.slots.remove(&imm);
                    }
                    continue;
                }
                slot.count += u64::from(times);
                if let Some(cb) = slot.take_if_reached() {
                    events.push(ImmEvent::Reached(cb));
                }
            }
            self.generation.fetch_add(1, Ordering::Release);
        }
        self.changed.notify_all();
        events
    }

    /// Registers a one-shot expectation of `n` arrivals of `imm`.
    ///
    /// Returns the callback back to the caller, to run, if the count is already there.
    pub fn set_expected(&self, imm: u32, n: u64, on_reached: OnReached) -> Result<Option<OnReached>> {
        if n == 0 {
            return Err(FabricError::InvalidArgument("expected immediate count must be at least 1".into()));
        }
        let mut inner = self.inner.lock();
        let slot = inner.slots.entry(imm).or_default();
        if slot.expected.is_some() {
            return Err(FabricError::InvalidArgument(format!(
                "immediate {imm} already has an expectation; remove it first"
            )));
        }
        slot.expected = Some((n, on_reached));
        Ok(slot.take_if_reached())
    }

    /// Forgets `imm`: drops its expectation without firing it and returns the count it had.
    pub fn remove(&self, imm: u32) -> u64 {
        let removed = {
            let mut inner = self.inner.lock();
            self.generation.fetch_add(1, Ordering::Release);
            inner.slots.remove(&imm)
        };
        self.changed.notify_all();
        removed.map_or(0, |s| s.count)
    }

    /// The current count of `imm` (arrivals not yet consumed).
    pub fn value(&self, imm: u32) -> u64 {
        self.inner.lock().slots.get(&imm).map_or(0, |s| s.count)
    }

    /// Marks `imm` as claimed, so arrivals are counted even with a generic callback installed.
    pub fn claim(&self, imm: u32) {
        self.inner.lock().slots.entry(imm).or_default().waiters += 1;
    }

    /// Undoes one [`ImmCounterTable::claim`].
    pub fn unclaim(&self, imm: u32) {
        let mut inner = self.inner.lock();
        if let Some(slot) = inner.slots.get_mut(&imm) {
            slot.waiters = slot.waiters.saturating_sub(1);
        }
    }

    /// Blocks until `imm` has been counted `n` times, then consumes `n`. Errors after `timeout`.
    /// Polls for up to the table's `wait_spin` before it sleeps.
    pub fn wait(&self, imm: u32, n: u64, timeout: Duration) -> Result<()> {
        let deadline = crate::config::deadline_after(timeout);
        let spin_until = Instant::now().checked_add(self.wait_spin).map_or(deadline, |t| t.min(deadline));
        let mut inner = self.inner.lock();
        inner.slots.entry(imm).or_default().waiters += 1;
        let result = loop {
            let slot = inner.slots.get(&imm);
            let count = slot.map_or(0, |s| s.count);
            if count >= n {
                break Ok(());
            }
            if inner.closed {
                break Err(FabricError::Stopped);
            }
            if Instant::now() < spin_until {
                // Read under the lock: any later change bumps it.
                let seen = self.generation.load(Ordering::Acquire);
                parking_lot::MutexGuard::unlocked(&mut inner, || self.poll_change(seen, spin_until));
                continue;
            }
            if self.changed.wait_until(&mut inner, deadline).timed_out() {
                let count = inner.slots.get(&imm).map_or(0, |s| s.count);
                if count >= n {
                    break Ok(());
                }
                break Err(FabricError::Timeout(format!("immediate {imm}: counted {count} of {n} within {timeout:?}")));
            }
        };
        let slot = inner.slots.entry(imm).or_default();
        slot.waiters = slot.waiters.saturating_sub(1);
        if result.is_ok() {
            slot.count -= n;
        }
        result
    }

    /// Polls until the generation moves past `seen` or `until` passes.
    fn poll_change(&self, seen: u64, until: Instant) {
        let mut polls: u32 = 0;
        while self.generation.load(Ordering::Acquire) == seen {
            polls = polls.wrapping_add(1);
            if !polls.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            if Instant::now() >= until {
                return;
            }
            std::thread::yield_now();
        }
    }

    /// Consumes `n` arrivals of `imm` if they are there (one atomic check-and-take); false
    /// leaves the count untouched.
    pub fn try_take(&self, imm: u32, n: u64) -> bool {
        let mut inner = self.inner.lock();
        match inner.slots.get_mut(&imm) {
            Some(slot) if slot.count >= n => {
                slot.count -= n;
                true
            }
            _ => n == 0,
        }
    }

    /// Consumes up to `n` counted arrivals of `imm`; returns how many it took (what a trigger
    /// armed on the worker finds already counted).
    pub(crate) fn take_up_to(&self, imm: u32, n: u64) -> u64 {
        let mut inner = self.inner.lock();
        let Some(slot) = inner.slots.get_mut(&imm) else { return 0 };
        let taken = slot.count.min(n);
        slot.count -= taken;
        taken
    }

    /// Installs (or with `None` removes) the callback for unclaimed immediates.
    pub fn set_generic_callback(&self, callback: Option<GenericImmCallback>) {
        self.inner.lock().generic = callback;
    }

    /// Ends every current and future wait with [`FabricError::Stopped`] (engine shutdown).
    pub fn close(&self) {
        {
            let mut inner = self.inner.lock();
            inner.closed = true;
            self.generation.fetch_add(1, Ordering::Release);
        }
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn run(events: Vec<ImmEvent>) {
        for e in events {
            match e {
                ImmEvent::Reached(cb) => cb(),
                ImmEvent::Unclaimed(cb, imm, times) => (0..times).for_each(|_| cb(imm)),
            }
        }
    }

    #[test]
    fn arrivals_before_registration_count_and_surplus_carries_over() {
        let t = ImmCounterTable::new();
        run(t.add_batch(&[(7, 3)]));
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        let due = t
            .set_expected(
                7,
                2,
                Box::new(move || {
                    h.fetch_add(1, Ordering::SeqCst);
                }),
            )
            .unwrap();
        due.expect("already reached")();
        assert_eq!(hits.load(Ordering::SeqCst), 1);
        assert_eq!(t.value(7), 1);
    }

    #[test]
    fn try_take_is_all_or_nothing_and_races_cleanly() {
        let t = Arc::new(ImmCounterTable::new());
        t.add_batch(&[(4, 3)]);
        assert!(!t.try_take(4, 4));
        assert_eq!(t.value(4), 3);
        assert!(t.try_take(4, 2));
        assert_eq!(t.value(4), 1);
        // Many consumers taking one each: exactly as many succeed as there were arrivals.
        t.add_batch(&[(4, 999)]);
        let taken: usize = (0..8)
            .map(|_| {
                let t = t.clone();
                std::thread::spawn(move || (0..200).filter(|_| t.try_take(4, 1)).count())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .sum();
        assert_eq!(taken, 1000);
        assert_eq!(t.value(4), 0);
    }

    #[test]
    fn fires_exactly_once() {
        let t = ImmCounterTable::new();
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        assert!(t
            .set_expected(
                1,
                4,
                Box::new(move || {
                    h.fetch_add(1, Ordering::SeqCst);
                })
            )
            .unwrap()
            .is_none());
        for _ in 0..3 {
            run(t.add_batch(&[(1, 1)]));
        }
        assert_eq!(hits.load(Ordering::SeqCst), 0);
        run(t.add_batch(&[(1, 2)]));
        run(t.add_batch(&[(1, 9)]));
        assert_eq!(hits.load(Ordering::SeqCst), 1);
        assert_eq!(t.value(1), 10);
    }

    #[test]
    fn duplicate_expectation_and_zero_are_rejected() {
        let t = ImmCounterTable::new();
        t.set_expected(1, 2, Box::new(|| {})).unwrap();
        assert!(matches!(t.set_expected(1, 2, Box::new(|| {})), Err(FabricError::InvalidArgument(_))));
        assert!(matches!(t.set_expected(2, 0, Box::new(|| {})), Err(FabricError::InvalidArgument(_))));
    }

    #[test]
    fn remove_drops_expectation_unfired() {
        let t = ImmCounterTable::new();
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        t.set_expected(
            5,
            2,
            Box::new(move || {
                h.fetch_add(1, Ordering::SeqCst);
            }),
        )
        .unwrap();
        run(t.add_batch(&[(5, 1)]));
        assert_eq!(t.remove(5), 1);
        run(t.add_batch(&[(5, 5)]));
        assert_eq!(hits.load(Ordering::SeqCst), 0);
        assert_eq!(t.value(5), 5);
    }

    #[test]
    fn unclaimed_go_to_generic_callback_and_claimed_are_counted() {
        let t = ImmCounterTable::new();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        t.set_generic_callback(Some(Arc::new(move |imm| s.lock().push(imm))));
        run(t.add_batch(&[(3, 2), (4, 1)]));
        assert_eq!(*seen.lock(), vec![3, 3, 4]);
        assert_eq!(t.value(3), 0);
        t.claim(4);
        run(t.add_batch(&[(4, 1)]));
        assert_eq!(t.value(4), 1);
        assert_eq!(seen.lock().len(), 3);
    }

    /// 1000 arrivals of immediate 9 from another thread, waited for at once, then consumed.
    fn wait_for_a_thousand(t: &Arc<ImmCounterTable>) {
        let t2 = t.clone();
        let adder = std::thread::spawn(move || {
            for _ in 0..1000 {
                t2.add_batch(&[(9, 1)]);
            }
        });
        t.wait(9, 1000, Duration::from_secs(10)).unwrap();
        adder.join().unwrap();
        assert_eq!(t.value(9), 0);
    }

    #[test]
    fn wait_times_out_then_succeeds_and_consumes() {
        let t = Arc::new(ImmCounterTable::new());
        assert!(matches!(t.wait(9, 1, Duration::from_millis(20)), Err(FabricError::Timeout(_))));
        wait_for_a_thousand(&t);
    }

    #[test]
    fn polling_waits_see_arrivals_stay_bounded_and_end_on_close() {
        // Polling far longer than any wait here: the deadline, not the polling, must end it.
        let t = Arc::new(ImmCounterTable::with_wait_spin(Duration::from_secs(10)));
        let started = Instant::now();
        assert!(matches!(t.wait(9, 1, Duration::from_millis(20)), Err(FabricError::Timeout(_))));
        assert!(started.elapsed() < Duration::from_secs(5));
        wait_for_a_thousand(&t);
        let t3 = t.clone();
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            t3.close();
        });
        assert!(matches!(t.wait(9, 1, Duration::from_secs(10)), Err(FabricError::Stopped)));
        closer.join().unwrap();
    }

    #[test]
    fn concurrent_arrivals_are_neither_lost_nor_doubled() {
        let t = Arc::new(ImmCounterTable::new());
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        t.set_expected(
            0,
            40_000,
            Box::new(move || {
                h.fetch_add(1, Ordering::SeqCst);
            }),
        )
        .unwrap();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let t = t.clone();
                std::thread::spawn(move || {
                    let mut due = Vec::new();
                    for i in 0..10_000u32 {
                        due.extend(t.add_batch(&[(0, 1), (1 + i % 3, 1)]));
                    }
                    due
                })
            })
            .collect();
        for th in threads {
            run(th.join().unwrap());
        }
        assert_eq!(hits.load(Ordering::SeqCst), 1);
        assert_eq!(t.value(0), 0);
        assert_eq!(t.value(1) + t.value(2) + t.value(3), 40_000);
    }
}
