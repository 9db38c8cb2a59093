//! Results of a client run: plain structs that print as a table or serialize as one JSON object.
use serde::Serialize;

use crate::units::format_size;

/// Single-write throughput at one size.
#[derive(Serialize, Debug, Clone)]
pub struct Throughput {
    /// Bytes per write.
    pub size: u64,
    /// Writes kept in flight.
    pub window: u64,
    /// Writes per repetition.
    pub writes_per_rep: u64,
    /// Median over repetitions, in 10^9 bytes per second.
    pub gbytes_per_s: f64,
    /// The same in 10^9 bits per second.
    pub gbits_per_s: f64,
    /// Every repetition, GB/s.
    pub samples_gbytes_per_s: Vec<f64>,
}

/// Small-write operation rate.
#[derive(Serialize, Debug, Clone)]
pub struct OpRate {
    pub size: u64,
    pub window: u64,
    pub writes_per_rep: u64,
    /// Median over repetitions, in millions of writes per second.
    pub mops_per_s: f64,
    pub samples_mops_per_s: Vec<f64>,
    /// The server counted every immediate of the test.
    pub verified: bool,
}

/// Immediate round-trip latency (client imm -> server -> imm back), microseconds.
#[derive(Serialize, Debug, Clone)]
pub struct Latency {
    pub iters: u64,
    /// `block` (wait_imm_count) or `spin` (polling imm_count).
    pub wait: String,
    pub p50_us: f64,
    pub p99_us: f64,
    pub min_us: f64,
    pub mean_us: f64,
    pub max_us: f64,
    /// Per-step p50/p99 (`--breakdown`; empty otherwise).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub breakdown: Vec<crate::latency::StepLatency>,
}

/// A phase whose immediates the server counted, every one of them.
#[derive(Serialize, Debug, Clone)]
pub struct VerifiedPhase {
    pub phase: String,
    pub immediates: u64,
}

/// Everything one client run measured.
#[derive(Serialize, Debug, Clone)]
pub struct Report {
    /// What makes two runs comparable: version, commit, libfabric, host, time.
    pub header: crate::run_info::RunHeader,
    pub provider: String,
    pub domain: String,
    pub poll_mode: &'static str,
    /// How the client waited for completions (`block` or `spin`).
    pub wait: &'static str,
    pub reps: u64,
    /// Where the buffers live, how they are registered and the path writes take.
    pub memory: crate::gpu_buffers::MemoryReport,
    pub throughput: Vec<Throughput>,
    /// Single-read throughput per size (`writes_per_rep` counts reads).
    pub read_throughput: Vec<Throughput>,
    pub paged: Vec<crate::paged::Paged>,
    pub op_rate: Option<OpRate>,
    pub rtt: Option<Latency>,
    /// The phases whose immediates the server verified.
    pub verified: Vec<VerifiedPhase>,
    /// Selected tests that cannot run on this path, and why.
    pub skipped: Vec<String>,
}

/// Median of `v` (empty: 0).
pub fn median(v: &[f64]) -> f64 {
    percentile(v, 50.0)
}

/// Nearest-rank percentile of `v` (empty: 0).
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// The table of a throughput test (writes or reads), empty when it did not run.
fn throughput_table(rows: &[Throughput], size: &str, ops: &str) -> String {
    if rows.is_empty() {
        return String::new();
    }
    let mut out = format!("\n{:>10} {:>7} {:>9} {:>10} {:>10}\n", size, "window", ops, "GB/s", "Gbps");
    for t in rows {
        out += &format!(
            "{:>10} {:>7} {:>9} {:>10.3} {:>10.2}\n",
            format_size(t.size),
            t.window,
            t.writes_per_rep,
            t.gbytes_per_s,
            t.gbits_per_s
        );
    }
    out
}

impl Report {
    /// The human-readable form.
    pub fn table(&self) -> String {
        let mut out = format!(
            "fabric-debug {}: provider {} domain {} poll {} wait {} (median of {} reps), libfabric {}, {} ({} CPUs)\n",
            self.header.package_version,
            self.provider,
            self.domain,
            self.poll_mode,
            self.wait,
            self.reps,
            self.header.libfabric_version,
            self.header.host,
            self.header.cpu_count
        );
        let m = &self.memory;
        out += &format!(
            "memory: client {} ({}) -> server {} ({}), path {}",
            m.client_buffer, m.client_registration, m.server_buffer, m.server_registration, m.path
        );
        if m.staged_requests > 0 {
            out += &format!(", {} staged requests, {} bounced", m.staged_requests, format_size(m.bounced_bytes));
        }
        out += "\n";
        out += &throughput_table(&self.throughput, "size", "writes");
        out += &throughput_table(&self.read_throughput, "read size", "reads");
        if !self.paged.is_empty() {
            out += &format!(
                "\n{:>10} {:>7} {:>10} {:>10}  per domain Gbps (share)\n",
                "page", "pages", "Gbps", "Mpages/s"
            );
            for p in &self.paged {
                let doms: Vec<String> =
                    p.per_domain.iter().map(|d| format!("{:.2} ({:.0}%)", d.gbits_per_s, d.share * 100.0)).collect();
                out += &format!(
                    "{:>10} {:>7} {:>10.2} {:>10.4}  {}\n",
                    format_size(p.page_size),
                    p.pages,
                    p.gbits_per_s,
                    p.mpages_per_s,
                    doms.join(", ")
                );
            }
        }
        if let Some(o) = &self.op_rate {
            out += &format!(
                "\nop rate: {} writes with imm, window {}: {:.3} Mops/s (verified: {})\n",
                format_size(o.size),
                o.window,
                o.mops_per_s,
                o.verified
            );
        }
        if let Some(l) = &self.rtt {
            out += &format!(
                "imm round trip ({} iters, {} wait): p50 {:.1} us, p99 {:.1} us (min {:.1}, mean {:.1}, max {:.1})\n",
                l.iters, l.wait, l.p50_us, l.p99_us, l.min_us, l.mean_us, l.max_us
            );
            if !l.breakdown.is_empty() {
                out += "  breakdown (engine latency probe; p50 / p99 us):\n";
                for step in &l.breakdown {
                    out += &format!("    {:<30} {:>8.2} {:>8.2}\n", step.step, step.p50_us, step.p99_us);
                }
            }
        }
        for v in &self.verified {
            out += &format!("server counted all {} immediates of the {} phase\n", v.immediates, v.phase);
        }
        for s in &self.skipped {
            out += &format!("skipped {s}\n");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(median(&v), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[5.0, 1.0, 3.0]), 3.0);
    }
}
