//! Bandwidth and operation-rate tests: many single writes (each with an immediate) kept
//! `window` deep in flight, timed from the first post to the last local completion.
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_lib::{CompletionCounter, DomainChoice, MrDescriptor, MrHandle, TransferEngine, WriteRequest};

use crate::bail;
use crate::error::{Context, Result};
use crate::report::{median, OpRate, Throughput};
use crate::tracker::check_counter;
use crate::units::format_size;

/// Where writes go: a local source region and the peer's destination region.
pub struct Target<'a> {
    pub engine: &'a TransferEngine,
    pub src: MrHandle,
    pub src_len: u64,
    pub dst: &'a MrDescriptor,
    /// Longest time without a single completion before a run is declared stuck.
    pub stall: Duration,
}

/// Shape of one test: `writes` writes of `size` bytes, `window` in flight, `reps` timed runs
/// after one untimed warm-up run.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub size: u64,
    pub writes: u64,
    pub window: u64,
    pub reps: u64,
    pub imm: u32,
}

impl Target<'_> {
    /// Posts `writes` writes of `size` bytes, at most `window` in flight; returns the elapsed
    /// time from the first post to the last completion. Offsets cycle through both buffers.
    pub fn timed_writes(&self, size: u64, writes: u64, window: u64, imm: u32) -> Result<Duration> {
        self.windowed("write", size, writes, window, |src_offset, dst_offset, counter| {
            let req = WriteRequest {
                src: self.src,
                src_offset,
                len: size,
                dst: self.dst,
                dst_offset,
                imm: Some(imm),
                domains: DomainChoice::Shard(usize::MAX),
            };
            self.engine.submit_write_counted(&req, counter)
        })
    }

    /// Runs `n` operations of `size` bytes, at most `window` in flight, timed from the first
    /// post to the last completion. `post(local offset, server offset, counter)` posts one;
    /// offsets cycle through both buffers. Completions are counted by the worker itself (no
    /// callback-thread hop per operation).
    pub(crate) fn windowed(
        &self,
        what: &str,
        size: u64,
        n: u64,
        window: u64,
        mut post: impl FnMut(u64, u64, &Arc<CompletionCounter>) -> fabric_lib::Result<()>,
    ) -> Result<Duration> {
        if size > self.src_len || size > self.dst.len {
            bail!(
                "{what} size {} exceeds the local buffer ({}) or the server's buffer ({})",
                format_size(size),
                format_size(self.src_len),
                format_size(self.dst.len)
            );
        }
        let local_slots = self.src_len / size;
        let remote_slots = self.dst.len / size;
        let counter = CompletionCounter::new();
        let window = window.max(1);
        let start = Instant::now();
        for i in 0..n {
            if i >= window {
                counter.wait_for(i - window + 1, self.stall).context("waiting for the window")?;
                check_counter(&counter)?;
            }
            post((i % local_slots) * size, (i % remote_slots) * size, &counter)
                .with_context(|| format!("posting {what} {i} of {n} ({size} bytes)"))?;
        }
        counter.wait_for(n, self.stall).with_context(|| format!("waiting for {n} {what} completions"))?;
        check_counter(&counter)?;
        Ok(start.elapsed())
    }

    /// Runs `shape` (warm-up plus reps); returns per-rep durations and the writes posted.
    fn repeat(&self, shape: Shape) -> Result<(Vec<Duration>, u64)> {
        let warmup = shape.writes.min(shape.window * 4).max(1);
        self.timed_writes(shape.size, warmup, shape.window, shape.imm)
            .with_context(|| format!("warm-up at {}", format_size(shape.size)))?;
        let mut times = Vec::new();
        for rep in 0..shape.reps {
            let t = self
                .timed_writes(shape.size, shape.writes, shape.window, shape.imm)
                .with_context(|| format!("repetition {rep} at {}", format_size(shape.size)))?;
            times.push(t);
        }
        Ok((times, warmup + shape.writes * shape.reps))
    }

    /// Throughput of single writes of `shape.size` bytes.
    pub fn throughput(&self, shape: Shape) -> Result<(Throughput, u64)> {
        let (times, posted) = self.repeat(shape)?;
        let bytes = (shape.size * shape.writes) as f64;
        let samples: Vec<f64> = times.iter().map(|t| bytes / t.as_secs_f64() / 1e9).collect();
        let gbytes = median(&samples);
        let result = Throughput {
            size: shape.size,
            window: shape.window,
            writes_per_rep: shape.writes,
            gbytes_per_s: gbytes,
            gbits_per_s: gbytes * 8.0,
            samples_gbytes_per_s: samples,
        };
        Ok((result, posted))
    }

    /// Operation rate of small writes (`verified` is set by the caller once the server agrees).
    pub fn op_rate(&self, shape: Shape) -> Result<(OpRate, u64)> {
        let (times, posted) = self.repeat(shape)?;
        let samples: Vec<f64> = times.iter().map(|t| shape.writes as f64 / t.as_secs_f64() / 1e6).collect();
        let result = OpRate {
            size: shape.size,
            window: shape.window,
            writes_per_rep: shape.writes,
            mops_per_s: median(&samples),
            samples_mops_per_s: samples,
            verified: false,
        };
        Ok((result, posted))
    }
}

/// Writes per repetition for a size: enough to move `bytes_per_rep`, and at least two windows.
pub fn writes_for(size: u64, bytes_per_rep: u64, window: u64) -> u64 {
    bytes_per_rep.div_ceil(size).max(2 * window).max(1)
}
