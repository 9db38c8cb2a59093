//! Immediate round-trip latency: the client sends a zero-byte write carrying `ping`; the
//! server's expectation on `ping` fires and it sends `pong` back; the client waits for `pong`.
use std::time::{Duration, Instant};

use fabric_lib::{MrDescriptor, TransferEngine};

use crate::error::{Context, Result};
use crate::report::{median, percentile, Latency};
use crate::tracker::{spin_until, Tracker, WaitKind};

/// One round-trip test; the server must already be echoing `warmup + iters` pings.
pub struct RoundTrips<'a> {
    pub engine: &'a TransferEngine,
    pub dst: &'a MrDescriptor,
    pub ping: u32,
    pub pong: u32,
    pub warmup: u64,
    pub iters: u64,
    pub wait: WaitKind,
    pub timeout: Duration,
}

impl RoundTrips<'_> {
    fn one(&self, tracker: &std::sync::Arc<Tracker>, seen: u64) -> Result<Duration> {
        let start = Instant::now();
        self.engine.submit_imm(self.ping, self.dst, tracker.callback()).context("posting a ping")?;
        match self.wait {
            WaitKind::Block => self.engine.wait_imm_count(self.pong, 1, self.timeout).context("waiting for a pong")?,
            WaitKind::Spin => spin_until(
                || self.engine.imm_count(self.pong) > seen,
                || self.engine.imm_count(self.pong),
                self.timeout,
            )
            .context("waiting for a pong")?,
        }
        Ok(start.elapsed())
    }

    /// Runs the warm-up and the measured round trips.
    pub fn run(&self) -> Result<Latency> {
        let tracker = Tracker::new(self.wait);
        let mut samples = Vec::with_capacity(self.iters as usize);
        for i in 0..self.warmup + self.iters {
            let t = self.one(&tracker, i).with_context(|| format!("round trip {i}"))?;
            if i >= self.warmup {
                samples.push(t.as_secs_f64() * 1e6);
            }
        }
        tracker.wait_all(self.warmup + self.iters, self.timeout)?;
        if self.wait == WaitKind::Spin {
            self.engine.remove_imm_count(self.pong);
        }
        let mean = samples.iter().sum::<f64>() / samples.len().max(1) as f64;
        Ok(Latency {
            iters: self.iters,
            wait: self.wait.name().to_string(),
            p50_us: median(&samples),
            p99_us: percentile(&samples, 99.0),
            min_us: percentile(&samples, 0.0),
            mean_us: mean,
            max_us: percentile(&samples, 100.0),
        })
    }
}
