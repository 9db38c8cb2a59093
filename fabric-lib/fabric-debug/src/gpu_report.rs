//! The report of a run with GPU buffers: each GPU pair's report (with how its memory was
//! registered and the path its writes took) and the total over all GPUs, measured at once.
use serde::Serialize;

use crate::report::Report;
use crate::units::format_size;

/// Throughput summed over the GPUs at one size.
#[derive(Serialize, Debug, Clone)]
pub struct SizeTotal {
    pub size: u64,
    /// Sum of the GPUs' medians (the pairs ran concurrently, each its own sequence of sizes).
    pub gbytes_per_s: f64,
    pub gbits_per_s: f64,
}

/// One paged sweep point summed over the GPUs.
#[derive(Serialize, Debug, Clone)]
pub struct PagedTotal {
    pub page_size: u64,
    pub pages: u64,
    pub gbits_per_s: f64,
    pub mpages_per_s: f64,
}

/// Totals over every GPU.
#[derive(Serialize, Debug, Clone)]
pub struct Total {
    pub gpus: usize,
    pub throughput: Vec<SizeTotal>,
    pub read_throughput: Vec<SizeTotal>,
    pub paged: Vec<PagedTotal>,
    /// Sum of the GPUs' op rates, millions of writes per second.
    pub op_rate_mops_per_s: Option<f64>,
    /// The slowest GPU's round-trip p50 and p99, microseconds.
    pub rtt_p50_us_worst: Option<f64>,
    pub rtt_p99_us_worst: Option<f64>,
    /// Immediates the servers counted, over every GPU and verified phase.
    pub immediates_verified: u64,
}

/// A run with GPU buffers.
#[derive(Serialize, Debug, Clone)]
pub struct GpuRunReport {
    pub header: crate::run_info::RunHeader,
    /// One report per GPU pair, in the order of the GPU list.
    pub gpus: Vec<Report>,
    pub total: Total,
}

/// What a client run prints: the host-memory report as before, or the GPU report.
#[derive(Serialize, Debug, Clone)]
#[serde(untagged)]
pub enum Output {
    Host(Box<Report>),
    Gpus(Box<GpuRunReport>),
}

impl Output {
    /// The human-readable form.
    pub fn table(&self) -> String {
        match self {
            Output::Host(r) => r.table(),
            Output::Gpus(r) => r.table(),
        }
    }
}

fn sum_sizes(per_gpu: Vec<&[crate::report::Throughput]>) -> Vec<SizeTotal> {
    let Some(first) = per_gpu.first() else { return Vec::new() };
    first
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let gbytes: f64 = per_gpu.iter().filter_map(|g| g.get(i)).map(|x| x.gbytes_per_s).sum();
            SizeTotal { size: t.size, gbytes_per_s: gbytes, gbits_per_s: gbytes * 8.0 }
        })
        .collect()
}

impl GpuRunReport {
    /// Sums the reports of the GPU pairs (every pair ran the same tests and sizes).
    pub fn new(gpus: Vec<Report>) -> Self {
        let header = gpus.first().map(|r| r.header.clone()).unwrap_or_else(|| crate::run_info::RunHeader::collect(""));
        let paged = gpus.first().map(|r| r.paged.clone()).unwrap_or_default();
        let total = Total {
            gpus: gpus.len(),
            throughput: sum_sizes(gpus.iter().map(|r| r.throughput.as_slice()).collect()),
            read_throughput: sum_sizes(gpus.iter().map(|r| r.read_throughput.as_slice()).collect()),
            paged: paged
                .iter()
                .enumerate()
                .map(|(i, p)| PagedTotal {
                    page_size: p.page_size,
                    pages: p.pages,
                    gbits_per_s: gpus.iter().filter_map(|r| r.paged.get(i)).map(|x| x.gbits_per_s).sum(),
                    mpages_per_s: gpus.iter().filter_map(|r| r.paged.get(i)).map(|x| x.mpages_per_s).sum(),
                })
                .collect(),
            op_rate_mops_per_s: gpus.iter().map(|r| r.op_rate.as_ref().map(|o| o.mops_per_s)).sum(),
            rtt_p50_us_worst: gpus.iter().filter_map(|r| r.rtt.as_ref().map(|l| l.p50_us)).reduce(f64::max),
            rtt_p99_us_worst: gpus.iter().filter_map(|r| r.rtt.as_ref().map(|l| l.p99_us)).reduce(f64::max),
            immediates_verified: gpus.iter().flat_map(|r| &r.verified).map(|v| v.immediates).sum(),
        };
        GpuRunReport { header, gpus, total }
    }

    /// Each GPU pair's table, then the totals.
    pub fn table(&self) -> String {
        let mut out = String::new();
        for r in &self.gpus {
            out += &format!("== {} ==\n{}\n", r.memory.client_buffer, r.table());
        }
        let t = &self.total;
        out += &format!("== total over {} GPU(s), measured at once ==\n", t.gpus);
        for (what, rows) in [("write", &t.throughput), ("read", &t.read_throughput)] {
            for s in rows {
                out += &format!(
                    "{what} {:>10}: {:>10.3} GB/s {:>10.2} Gbps\n",
                    format_size(s.size),
                    s.gbytes_per_s,
                    s.gbits_per_s
                );
            }
        }
        for p in &t.paged {
            out += &format!(
                "paged {:>10} x {:>6}: {:>10.2} Gbps {:>10.4} Mpages/s\n",
                format_size(p.page_size),
                p.pages,
                p.gbits_per_s,
                p.mpages_per_s
            );
        }
        if let Some(o) = t.op_rate_mops_per_s {
            out += &format!("op rate: {o:.3} Mops/s\n");
        }
        if let (Some(p50), Some(p99)) = (t.rtt_p50_us_worst, t.rtt_p99_us_worst) {
            out += &format!("imm round trip, slowest GPU: p50 {p50:.1} us, p99 {p99:.1} us\n");
        }
        out += &format!("servers counted all {} immediates\n", t.immediates_verified);
        out
    }
}
