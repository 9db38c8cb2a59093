//! Paged-write sweeps: for each page size and page count, one paged write (random source and
//! destination page indices, one immediate) per repetition; throughput and page rate in total
//! and per domain (from the engine's per-domain counters).
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_lib::{PagedWriteRequest, TransferEngine};
use serde::Serialize;

use crate::bail;
use crate::error::{Context, Result};
use crate::progress::Progress;
use crate::report::median;
use crate::throughput::Target;
use crate::tracker::{Tracker, WaitKind};

/// One (page size, page count) point of the sweep.
#[derive(Serialize, Debug, Clone)]
pub struct Paged {
    pub page_size: u64,
    pub pages: u64,
    /// Median over repetitions, Gbps of page payload.
    pub gbits_per_s: f64,
    /// Median over repetitions, millions of pages per second.
    pub mpages_per_s: f64,
    /// Per domain (in domain order), over all repetitions.
    pub per_domain: Vec<DomainShare>,
}

/// What one domain (NIC) carried of a paged sweep point.
#[derive(Serialize, Debug, Clone)]
pub struct DomainShare {
    /// Gbps of page payload through this domain.
    pub gbits_per_s: f64,
    /// Millions of pages per second through this domain.
    pub mpages_per_s: f64,
    /// This domain's share of all bytes, 0..=1.
    pub share: f64,
}

/// A small deterministic generator (xorshift64*), so runs are repeatable without a dependency.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1)) as u32
    }
}

fn random_pages(rng: &mut Rng, count: u64, pool: u64) -> Vec<u32> {
    if count > pool {
        // More pages than the buffer holds: some repeat.
        return (0..count).map(|_| rng.below(pool)).collect();
    }
    // Distinct pages (a partial Fisher-Yates shuffle), as a KV cache's block list: a request
    // that writes one destination page twice is refused on the staged path.
    let mut all: Vec<u32> = (0..pool as u32).collect();
    for i in 0..count as usize {
        let j = i + rng.below(pool - i as u64) as usize;
        all.swap(i, j);
    }
    all.truncate(count as usize);
    all
}

impl Target<'_> {
    /// Runs every (page size, page count) pair `reps` times; `imm` is carried once per request.
    pub fn paged_sweep(
        &self,
        sizes: &[u64],
        counts: &[u64],
        reps: u64,
        imm: u32,
        progress: &mut Progress,
    ) -> Result<(Vec<Paged>, u64)> {
        let mut out = Vec::new();
        let mut posted = 0;
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        for &size in sizes {
            if size == 0 || size > self.src_len || size > self.dst.len {
                bail!("page size {size} must be positive and fit both buffers");
            }
            let (src_pool, dst_pool) = (self.src_len / size, self.dst.len / size);
            for &count in counts {
                progress.step(&format!("paged {} x {count}", crate::units::format_size(size)));
                let src_pages = random_pages(&mut rng, count, src_pool);
                let dst_pages = random_pages(&mut rng, count, dst_pool);
                let req = PagedWriteRequest {
                    page_len: size,
                    src: self.src,
                    src_pages: &src_pages,
                    src_stride: size,
                    src_offset: 0,
                    dst: self.dst,
                    dst_pages: &dst_pages,
                    dst_stride: size,
                    dst_offset: 0,
                    imm: Some(imm),
                };
                self.paged_once(&req).context("paged warm-up")?;
                let before = self.engine.domain_stats();
                let mut times = Vec::new();
                for _ in 0..reps {
                    times.push(self.paged_once(&req)?);
                }
                posted += reps + 1;
                out.push(summarize(self.engine, size, count, &times, &before));
            }
        }
        Ok((out, posted))
    }

    fn paged_once(&self, req: &PagedWriteRequest<'_>) -> Result<Duration> {
        let tracker: Arc<Tracker> = Tracker::new(WaitKind::Block);
        let start = Instant::now();
        self.engine.submit_paged_writes(req, tracker.callback()).context("posting a paged write")?;
        tracker.wait_all(1, self.stall)?;
        Ok(start.elapsed())
    }
}

fn summarize(
    engine: &TransferEngine,
    size: u64,
    count: u64,
    times: &[Duration],
    before: &[fabric_lib::DomainStats],
) -> Paged {
    let bytes = (size * count) as f64;
    let gbps: Vec<f64> = times.iter().map(|t| bytes * 8.0 / t.as_secs_f64() / 1e9).collect();
    let mpps: Vec<f64> = times.iter().map(|t| count as f64 / t.as_secs_f64() / 1e6).collect();
    let total: f64 = times.iter().map(Duration::as_secs_f64).sum::<f64>().max(1e-9);
    let after = engine.domain_stats();
    let moved: Vec<(f64, f64)> =
        after.iter().zip(before).map(|(a, b)| ((a.bytes - b.bytes) as f64, (a.ops - b.ops) as f64)).collect();
    let all_bytes: f64 = moved.iter().map(|m| m.0).sum::<f64>().max(1.0);
    Paged {
        page_size: size,
        pages: count,
        gbits_per_s: median(&gbps),
        mpages_per_s: median(&mpps),
        per_domain: moved
            .iter()
            .map(|(b, o)| DomainShare {
                gbits_per_s: b * 8.0 / total / 1e9,
                mpages_per_s: o / total / 1e6,
                share: b / all_bytes,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_distinct_while_the_pool_allows() {
        let mut rng = Rng(7);
        let mut pages = random_pages(&mut rng, 1000, 1024);
        assert!(pages.iter().all(|&p| p < 1024));
        pages.sort_unstable();
        pages.dedup();
        assert_eq!(pages.len(), 1000);
        assert_eq!(random_pages(&mut rng, 10, 4).len(), 10);
    }
}
