//! The run header of a JSON report: what makes two runs comparable (the same fields as the
//! Python benchmarks' header, `benchmarks/report.py`).
use std::time::SystemTime;

use serde::Serialize;

extern "C" {
    /// libfabric's `fi_version()`: the loaded library's version, `(major << 16) | minor`.
    /// (libfabric-sys exposes only the `FI_VERSION` macro under that name.)
    #[link_name = "fi_version"]
    fn libfabric_runtime_version() -> u32;
}

/// Identifies the code, library, machine and time of a run.
#[derive(Serialize, Debug, Clone)]
pub struct RunHeader {
    pub schema: &'static str,
    pub benchmark: &'static str,
    pub package_version: &'static str,
    /// The commit fabric-debug was built from ("unknown" outside a git checkout).
    pub git_commit: &'static str,
    /// The libfabric loaded at run time, "major.minor".
    pub libfabric_version: String,
    /// The provider in use, e.g. "tcp;ofi_rxm".
    pub provider: String,
    pub host: String,
    pub cpu_count: usize,
    /// Start of the report, RFC 3339 UTC.
    pub time: String,
}

impl RunHeader {
    pub fn collect(provider: &str) -> Self {
        // SAFETY: fi_version takes no arguments and only returns a constant of the loaded library.
        let v = unsafe { libfabric_runtime_version() };
        Self {
            schema: "fabric-lib-benchmark/1",
            benchmark: "fabric-debug",
            package_version: env!("CARGO_PKG_VERSION"),
            git_commit: env!("FABRIC_DEBUG_GIT_COMMIT"),
            libfabric_version: format!("{}.{}", v >> 16, v & 0xFFFF),
            provider: provider.to_string(),
            host: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_else(|_| "unknown".into()),
            cpu_count: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            time: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
        }
    }
}
