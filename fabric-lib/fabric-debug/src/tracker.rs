//! Counting local completions of many in-flight operations, and waiting on that count.
//!
//! Each posted operation gets a callback from [`Tracker::callback`]; the callback thread bumps
//! an atomic counter. The posting thread spins briefly and then yields while it waits, so on a
//! machine with few cores it does not starve the engine's worker of CPU.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fabric_lib::OnDone;

use crate::bail;
use crate::error::Result;

/// Completion counter shared with the callbacks of one batch of operations.
#[derive(Default)]
pub struct Tracker {
    done: AtomicU64,
    failed: AtomicU64,
    first_error: Mutex<Option<String>>,
}

/// Spins (then yields) until `ready()` holds; errors once nothing changed for `stall`.
pub fn spin_until(mut ready: impl FnMut() -> bool, mut progress: impl FnMut() -> u64, stall: Duration) -> Result<()> {
    let mut last = progress();
    let mut since = Instant::now();
    let mut spins: u32 = 0;
    while !ready() {
        spins = spins.wrapping_add(1);
        if spins % 64 != 0 {
            std::hint::spin_loop();
            continue;
        }
        std::thread::yield_now();
        if spins % 1024 == 0 {
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

impl Tracker {
    /// A fresh counter.
    pub fn new() -> Arc<Self> {
        Arc::new(Tracker::default())
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
            me.done.fetch_add(1, Ordering::Release);
        })
    }

    /// Operations completed (successfully or not).
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Acquire)
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

    /// Waits until fewer than `window` of `posted` operations are in flight.
    pub fn wait_window(&self, posted: u64, window: u64, stall: Duration) -> Result<()> {
        if posted - self.done() < window {
            return Ok(());
        }
        spin_until(|| posted - self.done() < window, || self.done(), stall)?;
        self.check()
    }

    /// Waits until all `posted` operations completed, then reports any failure.
    pub fn wait_all(&self, posted: u64, stall: Duration) -> Result<()> {
        spin_until(|| self.done() >= posted, || self.done(), stall)
            .map_err(|e| crate::error::Error(format!("waiting for {posted} completions: {e}")))?;
        self.check()
    }
}
