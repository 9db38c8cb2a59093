//! What a client measures: the tests and their sizes, windows and repetitions (shared by
//! `fabric-debug client` and the positional form's client).
use clap::{Args, ValueEnum};

use crate::tracker::WaitKind;
use crate::units::size_arg;

/// The tests a client can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Test {
    Throughput,
    Oprate,
    Rtt,
    /// Paged-write sweep (`--page-sizes` × `--page-counts`).
    Paged,
    /// Single-read throughput per `--read-sizes` (`--window` reads in flight).
    Read,
}

/// The client's test options.
#[derive(Args, Debug, Clone)]
pub struct TestArgs {
    /// Write sizes of the throughput test.
    #[arg(long, value_delimiter = ',', value_parser = size_arg,
          default_value = "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB")]
    pub sizes: Vec<u64>,
    /// Read sizes of the read test.
    #[arg(long, value_delimiter = ',', value_parser = size_arg, default_value = "4KiB,64KiB,1MiB,16MiB")]
    pub read_sizes: Vec<u64>,
    /// Writes (and reads) kept in flight in the throughput (and read) test.
    #[arg(long, default_value_t = 16)]
    pub window: u64,
    /// Bytes moved per timed repetition of each size (at least two windows of writes).
    #[arg(long, default_value = "512MiB", value_parser = size_arg)]
    pub bytes_per_rep: u64,
    /// Timed repetitions per measurement (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub reps: u64,
    /// Size of the op-rate test's writes.
    #[arg(long, default_value = "64", value_parser = size_arg)]
    pub op_size: u64,
    /// Writes kept in flight in the op-rate test.
    #[arg(long, default_value_t = 64)]
    pub op_window: u64,
    /// Writes per repetition of the op-rate test.
    #[arg(long, default_value_t = 200_000)]
    pub ops: u64,
    /// Measured round trips of the latency test.
    #[arg(long, default_value_t = 10_000)]
    pub iters: u64,
    /// Unmeasured round trips before them.
    #[arg(long, default_value_t = 1_000)]
    pub warmup_iters: u64,
    /// How the client waits for completions and pongs.
    #[arg(long, value_enum, default_value = "block")]
    pub wait: WaitKind,
    /// Report where the round trip's time goes, per step (the engine's latency probe; each
    /// round trip also waits for the ping's completion callback before the next).
    #[arg(long)]
    pub breakdown: bool,
    /// Page sizes of the paged test.
    #[arg(long, value_delimiter = ',', value_parser = size_arg,
          default_value = "1KiB,2KiB,4KiB,8KiB,16KiB,32KiB,64KiB")]
    pub page_sizes: Vec<u64>,
    /// Pages per request of the paged test.
    #[arg(long, value_delimiter = ',', default_value = "100,10000")]
    pub page_counts: Vec<u64>,
    /// Tests to run.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "throughput,oprate,rtt")]
    pub tests: Vec<Test>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Do not report progress on stderr.
    #[arg(long)]
    pub quiet: bool,
    /// Seconds to keep retrying the connection to the server.
    #[arg(long, default_value_t = 30)]
    pub connect_timeout: u64,
    /// Seconds without any completion (or answer) before a test is declared stuck.
    #[arg(long, default_value_t = 60)]
    pub stall_timeout: u64,
}

impl TestArgs {
    /// Refuses counts that would make a test empty or divide by zero.
    pub fn validate(&self) -> crate::error::Result<()> {
        if self.window == 0 || self.op_window == 0 || self.reps == 0 || self.ops == 0 || self.iters == 0 {
            crate::bail!("--window, --op-window, --reps, --ops and --iters must be positive");
        }
        Ok(())
    }

    /// Whether `test` was selected.
    pub fn has(&self, test: Test) -> bool {
        self.tests.contains(&test)
    }

    /// How many progress steps the selected tests make.
    pub fn phase_count(&self) -> usize {
        let mut n = 0;
        if self.has(Test::Throughput) {
            n += self.sizes.len();
        }
        if self.has(Test::Paged) {
            n += self.page_sizes.len() * self.page_counts.len();
        }
        if self.has(Test::Read) {
            n += self.read_sizes.len();
        }
        n + usize::from(self.has(Test::Oprate)) + usize::from(self.has(Test::Rtt))
    }
}
