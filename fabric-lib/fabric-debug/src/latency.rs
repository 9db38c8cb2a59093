//! Immediate round-trip latency: the client sends the immediate `ping` to the server's engine
//! (a zero-byte write into its immediate slot, as `raw_write` does into its peer's buffer); the
//! server answers each with `pong` to the client's engine; the client waits for `pong`.
//!
//! With `breakdown`, the engine's latency probe records when each round trip passed each stage
//! (see `fabric_lib::latency_probe`), and the test reports p50/p99 per step between stages.
//! Each round trip then also waits for the ping's completion callback before the next one (so
//! its stages belong to that round trip); the time of that wait is not part of the round trip.
use std::time::{Duration, Instant};

use fabric_lib::{monotonic_ns, MrDescriptor, Stage, TransferEngine};
use serde::Serialize;

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
    /// Record and report the per-stage breakdown.
    pub breakdown: bool,
}

/// p50/p99 of one step of the round trip, in microseconds.
#[derive(Serialize, Debug, Clone)]
pub struct StepLatency {
    /// `from_to_to`, e.g. `enqueued_to_dequeued` (`app`: the application's call or return).
    pub step: String,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Round trips in which both ends of the step were recorded.
    pub samples: usize,
}

/// The steps reported, as (name, from, to); `None` is the application's own stamp (its call for
/// a `from`, its return for a `to`). The ping's own completion runs beside the pong's path.
const STEPS: [(&str, Option<Stage>, Option<Stage>); 10] = [
    ("app_to_enqueued", None, Some(Stage::Enqueued)),
    ("enqueued_to_dequeued", Some(Stage::Enqueued), Some(Stage::Dequeued)),
    ("dequeued_to_posted", Some(Stage::Dequeued), Some(Stage::Posted)),
    ("posted_to_imm_seen", Some(Stage::Posted), Some(Stage::ImmSeen)),
    ("imm_seen_to_imm_counted", Some(Stage::ImmSeen), Some(Stage::ImmCounted)),
    ("imm_counted_to_wait_returned", Some(Stage::ImmCounted), Some(Stage::WaitReturned)),
    ("wait_returned_to_app", Some(Stage::WaitReturned), None),
    ("imm_counted_to_app", Some(Stage::ImmCounted), None),
    ("posted_to_completed", Some(Stage::Posted), Some(Stage::Completed)),
    ("completed_to_callback_run", Some(Stage::Completed), Some(Stage::CallbackRun)),
];

/// Per-step samples (µs) of the measured round trips.
struct Breakdown {
    samples: Vec<Vec<f64>>,
}

impl Breakdown {
    fn new() -> Self {
        Breakdown { samples: vec![Vec::new(); STEPS.len()] }
    }

    /// Adds one round trip: `start` and `end` are the application's stamps around it. A stage
    /// recorded before `start` belongs to an earlier round trip and is left out.
    fn add(&mut self, engine: &TransferEngine, start: u64, end: u64) {
        let probe = engine.latency_probe();
        let at = |stage: Option<Stage>, app: u64| match stage {
            None => Some(app),
            Some(s) => probe.get(s).filter(|&t| t >= start),
        };
        for (i, &(_, from, to)) in STEPS.iter().enumerate() {
            if let (Some(a), Some(b)) = (at(from, start), at(to, end)) {
                self.samples[i].push(b.saturating_sub(a) as f64 / 1e3);
            }
        }
    }

    fn steps(&self) -> Vec<StepLatency> {
        STEPS
            .iter()
            .zip(&self.samples)
            .filter(|(_, s)| !s.is_empty())
            .map(|(&(step, ..), s)| StepLatency {
                step: step.to_string(),
                p50_us: median(s),
                p99_us: percentile(s, 99.0),
                samples: s.len(),
            })
            .collect()
    }
}

impl RoundTrips<'_> {
    fn one(&self, tracker: &std::sync::Arc<Tracker>, seen: u64) -> Result<Duration> {
        let start = Instant::now();
        self.engine.submit_imm_to(self.ping, &self.dst.owner, tracker.callback()).context("posting a ping")?;
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
        let mut breakdown = Breakdown::new();
        self.engine.latency_probe().enable(self.breakdown);
        for i in 0..self.warmup + self.iters {
            let start = monotonic_ns();
            let t = self.one(&tracker, i).with_context(|| format!("round trip {i}"))?;
            let end = monotonic_ns();
            if self.breakdown {
                // The ping's callback may run after the pong arrived: let it, so its stages are
                // this round trip's.
                tracker.wait_all(i + 1, self.timeout)?;
                if i >= self.warmup {
                    breakdown.add(self.engine, start, end);
                }
            }
            if i >= self.warmup {
                samples.push(t.as_secs_f64() * 1e6);
            }
        }
        self.engine.latency_probe().enable(false);
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
            breakdown: breakdown.steps(),
        })
    }
}
