//! How a request reports that it finished: a callback on the callback thread, or a
//! [`CompletionCounter`] the worker bumps itself (no thread hop: the fast path for many small
//! operations whose caller only needs to know how many are done).
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{FabricError, Result};

/// Completion callback of one request.
pub type OnDone = Box<dyn FnOnce(Result<()>) + Send + 'static>;

/// Where a request's outcome goes.
pub(crate) enum Notify {
    Callback(OnDone),
    Counter(Arc<CompletionCounter>),
}

impl Notify {
    /// As a callback (a counter's is bumped by whichever thread runs it).
    pub fn into_callback(self) -> OnDone {
        match self {
            Notify::Callback(cb) => cb,
            Notify::Counter(counter) => counter.on_done(),
        }
    }

    /// Reports `result` right here, on the calling thread (for requests failed outside the
    /// worker loop, e.g. drained from the command queue after the worker exited).
    pub fn now(self, result: Result<()>) {
        match self {
            Notify::Callback(cb) => cb(result),
            Notify::Counter(counter) => counter.complete(result),
        }
    }
}

/// Counts finished requests (and failed ones, keeping the first error). Updated by the worker
/// directly; any thread may wait on it.
#[derive(Default)]
pub struct CompletionCounter {
    done: AtomicU64,
    failed: AtomicU64,
    first_error: Mutex<Option<FabricError>>,
    sleeping: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

impl CompletionCounter {
    /// A counter at zero.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Requests finished so far, failed ones included.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Acquire)
    }

    /// Requests that failed so far.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Acquire)
    }

    /// The first failure, if any.
    pub fn first_error(&self) -> Option<FabricError> {
        if self.failed() == 0 {
            return None; // no lock on the success path (the error is stored before the count)
        }
        self.first_error.lock().clone()
    }

    /// A completion callback that reports into this counter (for APIs that take callbacks).
    pub fn on_done(self: &Arc<Self>) -> OnDone {
        let me = self.clone();
        Box::new(move |result| me.complete(result))
    }

    /// Records one finished request.
    pub fn complete(&self, result: Result<()>) {
        if let Err(e) = result {
            self.first_error.lock().get_or_insert(e);
            self.failed.fetch_add(1, Ordering::AcqRel);
        }
        self.complete_many(1);
    }

    /// Records `n` requests that succeeded.
    pub(crate) fn complete_many(&self, n: u64) {
        // SeqCst on both sides (here: count, then look for a sleeper; the waiter: announce
        // itself, then look at the count): with weaker orders each may miss the other's write,
        // and a waiter whose last completions came in one batch would sleep to its deadline.
        self.done.fetch_add(n, Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            let _guard = self.lock.lock();
            self.wake.notify_all();
        }
    }

    /// Waits until at least `n` requests finished: spins (yielding) briefly, then sleeps until
    /// woken. Errors after `timeout`.
    pub fn wait_for(&self, n: u64, timeout: Duration) -> Result<()> {
        let deadline = crate::config::deadline_after(timeout);
        let spin_until = Instant::now() + Duration::from_micros(50);
        while self.done() < n {
            if Instant::now() < spin_until {
                std::thread::yield_now();
                continue;
            }
            let mut guard = self.lock.lock();
            self.sleeping.store(true, Ordering::SeqCst);
            while self.done.load(Ordering::SeqCst) < n {
                if self.wake.wait_until(&mut guard, deadline).timed_out() && self.done() < n {
                    self.sleeping.store(false, Ordering::Release);
                    return Err(FabricError::Timeout(format!(
                        "{} of {n} requests finished within {timeout:?}",
                        self.done()
                    )));
                }
            }
            self.sleeping.store(false, Ordering::Release);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_errors_and_wakes_waiters() {
        let c = CompletionCounter::new();
        assert!(matches!(c.wait_for(1, Duration::from_millis(10)), Err(FabricError::Timeout(_))));
        let c2 = c.clone();
        let t = std::thread::spawn(move || {
            for i in 0..1000 {
                c2.complete(if i == 7 { Err(FabricError::Stopped) } else { Ok(()) });
            }
        });
        c.wait_for(1000, Duration::from_secs(10)).unwrap();
        t.join().unwrap();
        assert_eq!((c.done(), c.failed()), (1000, 1));
        assert_eq!(c.first_error(), Some(FabricError::Stopped));
    }

    #[test]
    fn a_waiter_going_to_sleep_is_woken_by_a_single_batch() {
        // Each round's completions come as one batch, timed to land around the moment the waiter
        // stops spinning and goes to sleep; nothing else would wake it, so a missed wake-up
        // fails the round's wait. (The race it guards against is narrow: a regression shows as
        // an occasional failure, not a certain one.)
        let c = CompletionCounter::new();
        let c2 = c.clone();
        let turn = Arc::new(AtomicU64::new(0));
        let turn2 = turn.clone();
        let rounds = 3000u64;
        let t = std::thread::spawn(move || {
            for i in 1..=rounds {
                while turn2.load(Ordering::Acquire) < i {
                    std::hint::spin_loop();
                }
                let delay = Duration::from_nanos(40_000 + (i * 7919) % 20_000);
                let start = Instant::now();
                while start.elapsed() < delay {
                    std::hint::spin_loop();
                }
                c2.complete_many(2);
            }
        });
        for i in 1..=rounds {
            turn.store(i, Ordering::Release);
            c.wait_for(2 * i, Duration::from_secs(2)).unwrap_or_else(|e| panic!("round {i}: {e}"));
        }
        t.join().unwrap();
    }
}
