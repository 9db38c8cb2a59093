//! Counting local completions of many in-flight operations, and waiting on that count.
//!
//! Each posted operation gets a callback from [`Tracker::callback`] that bumps a fabric-lib
//! `CompletionCounter`. The posting thread waits in one of two ways ([`WaitKind`]): spinning
//! (then yielding), or the counter's own wait (brief spin, then sleep). Blocking matters on
//! machines with fewer cores than busy threads: a spinning waiter takes CPU from the worker.
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::ValueEnum;
use fabric_lib::{CompletionCounter, OnDone};

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

/// Fails if any operation counted by `counter` failed so far.
pub fn check_counter(counter: &CompletionCounter) -> Result<()> {
    match counter.first_error() {
        Some(e) => bail!("{} operation(s) failed; first: {e}", counter.failed()),
        None => Ok(()),
    }
}

/// Completion counter shared with the callbacks of one batch of operations: fabric-lib's
/// [`CompletionCounter`] plus the way this tool waits on it.
pub struct Tracker {
    counter: Arc<CompletionCounter>,
    kind: WaitKind,
}

impl Tracker {
    /// A fresh counter whose waiters wait the `kind` way.
    pub fn new(kind: WaitKind) -> Arc<Self> {
        Arc::new(Tracker { counter: CompletionCounter::new(), kind })
    }

    /// The completion callback of one operation.
    pub fn callback(&self) -> OnDone {
        self.counter.on_done()
    }

    /// Operations completed (successfully or not).
    pub fn done(&self) -> u64 {
        self.counter.done()
    }

    /// Fails if any operation failed so far.
    pub fn check(&self) -> Result<()> {
        check_counter(&self.counter)
    }

    /// Waits until all `posted` operations completed, then reports any failure.
    pub fn wait_all(&self, posted: u64, stall: Duration) -> Result<()> {
        let waited = match self.kind {
            WaitKind::Spin => spin_until(|| self.done() >= posted, || self.done(), stall),
            WaitKind::Block => self.counter.wait_for(posted, stall).map_err(|e| crate::error::Error(e.to_string())),
        };
        waited.map_err(|e| crate::error::Error(format!("waiting for {posted} completions: {e}")))?;
        self.check()
    }
}
