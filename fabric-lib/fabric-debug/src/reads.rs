//! Read throughput: many single reads of the server's buffer into the client's, kept `window`
//! deep in flight, timed from the first post to the last local completion (a read is complete
//! when its bytes are in the client's buffer). The server registers its buffer readable.
use std::time::Duration;

use fabric_lib::{DomainChoice, ReadRequest};

use crate::error::{Context, Result};
use crate::report::{median, Throughput};
use crate::throughput::{Shape, Target};
use crate::units::format_size;

impl Target<'_> {
    /// Posts `reads` reads of `size` bytes from the server's buffer (`dst`) into the local one
    /// (`src`), at most `window` in flight; returns the elapsed time.
    fn timed_reads(&self, size: u64, reads: u64, window: u64) -> Result<Duration> {
        self.windowed("read", size, reads, window, |local_offset, server_offset, counter| {
            let req = ReadRequest {
                src: self.dst,
                src_offset: server_offset,
                len: size,
                dst: self.src,
                dst_offset: local_offset,
                domains: DomainChoice::Shard(usize::MAX),
            };
            self.engine.submit_read_counted(&req, counter)
        })
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
