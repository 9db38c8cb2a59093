//! Counting local completions of many in-flight operations, and waiting on that count.
//!
//! Each posted operation gets a callback from [`Tracker::callback`]; the engine's callback
//! thread bumps an atomic counter. The posting thread waits in one of two ways ([`WaitKind`]):
//! spinning (then yielding), or spinning briefly and then sleeping on a condition variable that
//! the callback signals only while someone sleeps. Blocking matters on machines with fewer
//! cores than busy threads: a spinning waiter takes CPU from the engine's worker.
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use clap::ValueEnum;
use fabric_lib::OnDone;

use crate::bail;
use crate::error::Result;

/// How a thread waits for completions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WaitKind {
    /// Spin briefly, then sleep until signalled (round trips: `wait_imm_count`).
    Block,
    /// Spin, yielding the CPU now and then (round trips: polling `imm_count`).
    Spin,
}

impl WaitKind {
    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            WaitKind::Block => "block",
            WaitKind::Spin => "spin",
        }
    }
}

/// Spins (then yields) until `ready()` holds; errors once `progress()` stayed put for `stall`.
pub fn spin_until(mut ready: impl FnMut() -> bool, mut progress: impl FnMut() -> u64, stall: Duration) -> Result<()> {
    let mut last = progress();
    let mut since = Instant::now();
    let mut spins: u32 = 0;
    while !ready() {
        spins = spins.wrapping_add(1);
        if spins & 63 != 0 {
            std::hint::spin_loop();
            continue;
        }
        std::thread::yield_now();
        if spins & 1023 == 0 {
            let now = progress();
            if now != last {
                last = now;
                since = Instant::now();
            } else if since.elapsed() > stall {
                bail!("no progress for {stall:?} (stuck at {now})");
            }
        }
    }
    Ok(())
}

/// Completion counter shared with the callbacks of one batch of operations.
pub struct Tracker {
    done: AtomicU64,
    failed: AtomicU64,
    first_error: Mutex<Option<String>>,
    sleeping: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
    kind: WaitKind,
}

impl Tracker {
    /// A fresh counter whose waiters wait the `kind` way.
    pub fn new(kind: WaitKind) -> Arc<Self> {
        Arc::new(Tracker {
            done: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            first_error: Mutex::new(None),
            sleeping: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            kind,
        })
    }

    /// The completion callback of one operation.
    pub fn callback(self: &Arc<Self>) -> OnDone {
        let me = self.clone();
        Box::new(move |result| {
            if let Err(e) = result {
                if me.failed.fetch_add(1, Ordering::Relaxed) == 0 {
                    *me.first_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                }
            }
            me.done.fetch_add(1, Ordering::SeqCst);
            if me.sleeping.load(Ordering::SeqCst) {
                let _guard = me.lock.lock().unwrap_or_else(|p| p.into_inner());
                me.wake.notify_one();
            }
        })
    }

    /// Operations completed (successfully or not).
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::SeqCst)
    }

    /// Fails if any operation failed so far.
    pub fn check(&self) -> Result<()> {
        let failed = self.failed.load(Ordering::Acquire);
        if failed > 0 {
            let first = self.first_error.lock().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or_default();
            bail!("{failed} operation(s) failed; first: {first}");
        }
        Ok(())
    }

    /// Waits until `done() >= target`.
    fn wait_done(&self, target: u64, stall: Duration) -> Result<()> {
        if self.kind == WaitKind::Spin {
            return spin_until(|| self.done() >= target, || self.done(), stall);
        }
        for _ in 0..256 {
            if self.done() >= target {
                return Ok(());
            }
            std::hint::spin_loop();
        }
        let (mut last, mut since) = (self.done(), Instant::now());
        let mut guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            self.sleeping.store(true, Ordering::SeqCst);
            let now = self.done();
            if now >= target {
                self.sleeping.store(false, Ordering::SeqCst);
                return Ok(());
            }
            if now != last {
                (last, since) = (now, Instant::now());
            } else if since.elapsed() > stall {
                self.sleeping.store(false, Ordering::SeqCst);
                bail!("no progress for {stall:?} (stuck at {now} of {target})");
            }
            guard = self.wake.wait_timeout(guard, Duration::from_millis(10)).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Waits until all `posted` operations completed, then reports any failure.
    pub fn wait_all(&self, posted: u64, stall: Duration) -> Result<()> {
        self.wait_done(posted, stall)
            .map_err(|e| crate::error::Error(format!("waiting for {posted} completions: {e}")))?;
        self.check()
    }
}
