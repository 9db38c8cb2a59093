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
//! Thread safety: one mutex guards the table's structure (which values exist, expectations, the
//! generic callback); each value's count is an atomic of its own, which only the table's updates
//! (under the mutex) raise and any consumer may lower. The worker applies a whole completion
//! batch under one lock acquisition, and callbacks are returned to the caller to run outside the
//! lock.
//!
//! Waiting: a waiter registers under the lock, then polls its value's count itself (no lock) for
//! the table's polling time (the engine's `wait_spin`), and only then sleeps on the condition
//! variable: an arrival that comes soon (a round trip's answer) then costs neither side a futex
//! call, a scheduler wake-up or the lock, only the count's cache line moving to the waiter.
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
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

/// One value's count and waiters, shared with the threads waiting for it (on a cache line of its
/// own: the worker raises it, one waiter polls it).
#[derive(Default)]
struct Count {
    arrivals: AtomicU64,
    waiters: AtomicUsize,
}

impl Count {
    fn get(&self) -> u64 {
        self.arrivals.load(Ordering::Acquire)
    }

    /// Consumes `n` if there are that many (all or nothing).
    fn take(&self, n: u64) -> bool {
        self.arrivals.fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| c.checked_sub(n)).is_ok()
    }

    /// Consumes up to `n`; returns how many.
    fn take_up_to(&self, n: u64) -> u64 {
        let before = self.arrivals.fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| Some(c - c.min(n)));
        before.map_or(0, |c| c.min(n))
    }
}

#[derive(Default)]
struct Slot {
    count: Arc<CachePadded<Count>>,
    expected: Option<(u64, OnReached)>,
}

impl Slot {
    fn claimed(&self) -> bool {
        self.expected.is_some() || self.count.waiters.load(Ordering::Acquire) > 0
    }

    fn take_if_reached(&mut self) -> Option<OnReached> {
        let n = self.expected.as_ref()?.0;
        if self.count.take(n) {
            return self.expected.take().map(|(_, cb)| cb);
        }
        None
    }
}

/// Values the table holds before it drops the empty, unclaimed ones (see `add_batch`).
const SWEEP_SLOTS: usize = 4096;

#[derive(Default)]
struct Inner {
    /// Keyed by values peers choose: a seeded hash (foldhash), fast but not predictable to them.
    slots: foldhash::HashMap<u32, Slot>,
    generic: Option<GenericImmCallback>,
    /// Size at which `add_batch` sweeps next (0: [`SWEEP_SLOTS`]).
    sweep_at: usize,
}

impl Inner {
    /// Drops the values that hold nothing (no count, expectation or waiter), once the table has
    /// grown past its sweep size: an application that counts ever new values (one per request)
    /// keeps a table about as large as what is pending.
    fn sweep(&mut self) {
        if self.slots.len() < self.sweep_at.max(SWEEP_SLOTS) {
            return;
        }
        self.slots.retain(|_, s| s.claimed() || s.count.get() > 0);
        self.sweep_at = 2 * self.slots.len();
    }
}

/// The table of counters of one engine.
///
/// `closed` and `generation` sit on cache lines of their own: waiters and pollers read them
/// while the worker takes the lock for every batch, and sharing the lock's line would move it
/// between their cores several times per arrival.
#[derive(Default)]
pub struct ImmCounterTable {
    inner: Mutex<Inner>,
    changed: Condvar,
    /// How long [`ImmCounterTable::wait`] polls before it sleeps.
    wait_spin: Duration,
    /// Set once by [`ImmCounterTable::close`]; read by polling waiters without the lock.
    closed: CachePadded<AtomicBool>,
    /// Raised after every batch of arrivals (see [`ImmCounterTable::generation`]).
    generation: CachePadded<AtomicU64>,
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
                    if slot.count.get() == 0 {
                        inner.slots.remove(&imm);
                    }
                    continue;
                }
                slot.count.arrivals.fetch_add(u64::from(times), Ordering::AcqRel);
                if let Some(cb) = slot.take_if_reached() {
                    events.push(ImmEvent::Reached(cb));
                }
            }
            inner.sweep();
        }
        // After the counts: a poller that reads the old number cannot have missed them.
        self.generation.fetch_add(1, Ordering::Release);
        self.changed.notify_all();
        events
    }

    /// Changes after every batch of arrivals: pollers skip the lock while it has not.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
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
    /// (A value with waiters keeps its entry, emptied, so they see later arrivals.)
    pub fn remove(&self, imm: u32) -> u64 {
        let mut inner = self.inner.lock();
        let Some(slot) = inner.slots.get_mut(&imm) else { return 0 };
        slot.expected = None;
        let had = slot.count.arrivals.swap(0, Ordering::AcqRel);
        if slot.count.waiters.load(Ordering::Acquire) == 0 {
            inner.slots.remove(&imm);
        }
        had
    }

    /// The current count of `imm` (arrivals not yet consumed).
    pub fn value(&self, imm: u32) -> u64 {
        self.inner.lock().slots.get(&imm).map_or(0, |s| s.count.get())
    }

    /// Marks `imm` as claimed, so arrivals are counted even with a generic callback installed.
    pub fn claim(&self, imm: u32) {
        self.inner.lock().slots.entry(imm).or_default().count.waiters.fetch_add(1, Ordering::AcqRel);
    }

    /// Undoes one [`ImmCounterTable::claim`].
    pub fn unclaim(&self, imm: u32) {
        if let Some(slot) = self.inner.lock().slots.get(&imm) {
            Self::release(&slot.count);
        }
    }

    fn release(count: &Count) {
        let _ = count.waiters.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| w.checked_sub(1));
    }

    /// Blocks until `imm` has been counted `n` times, then consumes `n`. Errors after `timeout`.
    /// Polls for up to the table's `wait_spin` before it sleeps.
    pub fn wait(&self, imm: u32, n: u64, timeout: Duration) -> Result<()> {
        let deadline = crate::config::deadline_after(timeout);
        let count = {
            let mut inner = self.inner.lock();
            let count = inner.slots.entry(imm).or_default().count.clone();
            count.waiters.fetch_add(1, Ordering::AcqRel);
            count
        };
        let result = self.poll(&count, n, deadline).unwrap_or_else(|| self.sleep(&count, imm, n, deadline, timeout));
        Self::release(&count);
        result
    }

    /// Polls `count` for up to the table's `wait_spin` (never past `deadline`); None: still
    /// waiting.
    fn poll(&self, count: &Count, n: u64, deadline: Instant) -> Option<Result<()>> {
        let until = Instant::now().checked_add(self.wait_spin).map_or(deadline, |t| t.min(deadline));
        let mut polls: u32 = 0;
        loop {
            if count.take(n) {
                return Some(Ok(()));
            }
            polls = polls.wrapping_add(1);
            if !polls.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            // Now and then only: a shutdown is rare, the count is what the poll waits for.
            if self.closed.load(Ordering::Acquire) {
                return Some(Err(FabricError::Stopped));
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::yield_now();
        }
    }

    /// Sleeps on the condition variable until `count` has `n` (arrivals are raised under the
    /// lock held here, so none is missed), the table closes or `deadline` passes.
    fn sleep(&self, count: &Count, imm: u32, n: u64, deadline: Instant, timeout: Duration) -> Result<()> {
        let mut inner = self.inner.lock();
        loop {
            if count.take(n) {
                return Ok(());
            }
            if self.closed.load(Ordering::Acquire) {
                return Err(FabricError::Stopped);
            }
            if self.changed.wait_until(&mut inner, deadline).timed_out() {
                if count.take(n) {
                    return Ok(());
                }
                let counted = count.get();
                return Err(FabricError::Timeout(format!(
                    "immediate {imm}: counted {counted} of {n} within {timeout:?}"
                )));
            }
        }
    }

    /// Consumes `n` arrivals of `imm` if they are there (one atomic check-and-take); false
    /// leaves the count untouched.
    pub fn try_take(&self, imm: u32, n: u64) -> bool {
        match self.inner.lock().slots.get(&imm) {
            Some(slot) => slot.count.take(n),
            None => n == 0,
        }
    }

    /// Consumes up to `n` counted arrivals of `imm`; returns how many it took (what a trigger
    /// armed on the worker finds already counted).
    pub(crate) fn take_up_to(&self, imm: u32, n: u64) -> u64 {
        self.inner.lock().slots.get(&imm).map_or(0, |slot| slot.count.take_up_to(n))
    }

    /// Installs (or with `None` removes) the callback for unclaimed immediates.
    pub fn set_generic_callback(&self, callback: Option<GenericImmCallback>) {
        self.inner.lock().generic = callback;
    }

    /// Ends every current and future wait with [`FabricError::Stopped`] (engine shutdown).
    pub fn close(&self) {
        {
            // Under the lock: a waiter about to sleep sees it before it does.
            let _inner = self.inner.lock();
            self.closed.store(true, Ordering::Release);
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
    fn generation_moves_with_arrivals_only() {
        let t = Arc::new(ImmCounterTable::new());
        let g0 = t.generation();
        assert!(!t.try_take(5, 1));
        t.claim(5);
        assert_eq!(t.generation(), g0, "takes and claims count nothing");
        t.add_batch(&[(5, 1)]);
        let g1 = t.generation();
        assert_ne!(g1, g0, "a batch of arrivals moves it");
        assert!(t.try_take(5, 1));
        assert_eq!(t.generation(), g1);
        // A poller that reads the generation before a pass that took nothing, and the same
        // generation after, never misses an arrival: every arrival here is taken.
        let adder = {
            let t = t.clone();
            std::thread::spawn(move || (0..2000).for_each(|_| drop(t.add_batch(&[(6, 1)]))))
        };
        let (mut taken, mut seen) = (0, u64::MAX);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while taken < 2000 && std::time::Instant::now() < deadline {
            let g = t.generation();
            if g == seen {
                continue;
            }
            seen = g;
            while t.try_take(6, 1) {
                taken += 1;
            }
        }
        adder.join().unwrap();
        assert_eq!((taken, t.value(6)), (2000, 0));
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

    #[test]
    fn a_waiter_keeps_its_claim_when_the_value_is_removed() {
        // With a generic callback installed, arrivals after `remove` still reach the waiter
        // (they would go to the callback if the removal had dropped the waiter's claim).
        let t = Arc::new(ImmCounterTable::with_wait_spin(Duration::from_millis(1)));
        let unclaimed = Arc::new(AtomicUsize::new(0));
        let u = unclaimed.clone();
        t.set_generic_callback(Some(Arc::new(move |_| {
            u.fetch_add(1, Ordering::SeqCst);
        })));
        let t2 = t.clone();
        let waiter = std::thread::spawn(move || t2.wait(5, 2, Duration::from_secs(10)));
        while t.inner.lock().slots.get(&5).is_none_or(|s| !s.claimed()) {
            std::thread::yield_now();
        }
        run(t.add_batch(&[(5, 1)]));
        assert_eq!(t.remove(5), 1, "the arrival before the removal is returned");
        run(t.add_batch(&[(5, 2)]));
        waiter.join().unwrap().expect("the waiter saw the later arrivals");
        assert_eq!(unclaimed.load(Ordering::SeqCst), 0);
        assert_eq!(t.value(5), 0);
    }

    #[test]
    fn concurrent_waiters_each_consume_exactly_what_they_wait_for() {
        // Polling and sleeping waiters, taking without the lock, against one adder: every wait
        // returns, and nothing is taken twice or left over.
        for spin in [Duration::from_millis(5), Duration::ZERO] {
            let t = Arc::new(ImmCounterTable::with_wait_spin(spin));
            let waiters: Vec<_> = (0..4)
                .map(|w| {
                    let t = t.clone();
                    std::thread::spawn(move || {
                        for _ in 0..500 {
                            t.wait(3, 1 + w % 2, Duration::from_secs(20)).unwrap();
                        }
                    })
                })
                .collect();
            // 4 waiters x 500 waits of 1 or 2: 3000 arrivals in uneven batches.
            let mut left = 3000u32;
            let mut i = 0u32;
            while left > 0 {
                let n = (1 + i % 7).min(left);
                t.add_batch(&[(3, n)]);
                left -= n;
                i += 1;
                if i.is_multiple_of(16) {
                    std::thread::yield_now();
                }
            }
            for w in waiters {
                w.join().unwrap();
            }
            assert_eq!(t.value(3), 0);
        }
    }

    #[test]
    fn values_that_hold_nothing_do_not_accumulate() {
        // Ever new values, each counted once and taken (what one value per request does), with
        // one value waited for and one expected throughout: the table stays near its sweep size
        // and keeps what is still pending.
        let t = ImmCounterTable::new();
        t.claim(1);
        t.set_expected(2, 5, Box::new(|| {})).unwrap();
        run(t.add_batch(&[(1, 3)]));
        for v in 100..100_000u32 {
            run(t.add_batch(&[(v, 1)]));
            assert!(t.try_take(v, 1));
        }
        let slots = t.inner.lock().slots.len();
        assert!(slots <= 2 * SWEEP_SLOTS, "{slots} values kept");
        assert_eq!(t.value(1), 3, "a claimed value keeps its count");
        run(t.add_batch(&[(2, 4)]));
        assert!(t.inner.lock().slots.get(&2).is_some_and(|s| s.expected.is_some()), "the expectation stays");
        run(t.add_batch(&[(100_000, 2)]));
        assert_eq!(t.value(100_000), 2, "a value with a count stays");
    }
}
