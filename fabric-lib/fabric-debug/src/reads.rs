//! Read throughput: many single reads of the server's buffer into the client's, kept `window`
//! deep in flight, timed from the first post to the last local completion (a read is complete
//! when its bytes are in the client's buffer). The server registers its buffer readable.
use std::time::{Duration, Instant};

use fabric_lib::{CompletionCounter, DomainChoice, ReadRequest};

use crate::bail;
use crate::error::{Context, Result};
use crate::report::{median, Throughput};
use crate::throughput::{Shape, Target};
use crate::tracker::check_counter;
use crate::units::format_size;

impl Target<'_> {
    /// Posts `reads` reads of `size` bytes from the server's buffer (`dst`) into the local one
    /// (`src`), at most `window` in flight; returns the elapsed time.
    fn timed_reads(&self, size: u64, reads: u64, window: u64) -> Result<Duration> {
        if size > self.src_len || size > self.dst.len {
            bail!(
                "read size {} exceeds the local buffer ({}) or the server's buffer ({})",
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
        for i in 0..reads {
            if i >= window {
                counter.wait_for(i - window + 1, self.stall).context("waiting for the window")?;
                check_counter(&counter)?;
            }
            let req = ReadRequest {
                src: self.dst,
                src_offset: (i % remote_slots) * size,
                len: size,
                dst: self.src,
                dst_offset: (i % local_slots) * size,
                domains: DomainChoice::Shard(usize::MAX),
            };
            self.engine
                .submit_read_counted(&req, &counter)
                .with_context(|| format!("posting read {i} of {reads} ({size} bytes)"))?;
        }
        counter.wait_for(reads, self.stall).with_context(|| format!("waiting for {reads} read completions"))?;
        check_counter(&counter)?;
        Ok(start.elapsed())
    }

    /// Throughput of single reads of `shape.size` bytes (one untimed warm-up run, then reps).
    pub fn read_throughput(&self, shape: Shape) -> Result<Throughput> {
        let warmup = shape.writes.min(shape.window * 4).max(1);
        self.timed_reads(shape.size, warmup, shape.window)
            .with_context(|| format!("read warm-up at {}", format_size(shape.size)))?;
        let mut samples = Vec::new();
        for rep in 0..shape.reps {
            let t = self
                .timed_reads(shape.size, shape.writes, shape.window)
                .with_context(|| format!("read repetition {rep} at {}", format_size(shape.size)))?;
            samples.push((shape.size * shape.writes) as f64 / t.as_secs_f64() / 1e9);
        }
        let gbytes = median(&samples);
        Ok(Throughput {
            size: shape.size,
            window: shape.window,
            writes_per_rep: shape.writes,
            gbytes_per_s: gbytes,
            gbits_per_s: gbytes * 8.0,
            samples_gbytes_per_s: samples,
        })
    }
}
