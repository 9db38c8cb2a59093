//! The client side: connects to a server, then runs the throughput, op-rate and round-trip
//! tests against the server's buffer and has the server verify every immediate it sent.
use std::sync::mpsc;
use std::time::Duration;

use clap::{Args, ValueEnum};

use crate::bootstrap::{Channel, Control};
use crate::endpoint::{Endpoint, EngineArgs};
use crate::error::{Context, Result};
use crate::latency::RoundTrips;
use crate::progress::Progress;
use crate::report::{Report, VerifiedPhase};
use crate::run_info::RunHeader;
use crate::throughput::{writes_for, Shape, Target};
use crate::tracker::{Tracker, WaitKind};
use crate::units::size_arg;

/// Immediate values of the phases (distinct, so the server counts each phase on its own).
const IMM_THROUGHPUT: u32 = 1;
const IMM_OP_RATE: u32 = 2;
const IMM_FENCE: u32 = 3;
const IMM_PAGED: u32 = 6;
const IMM_PING: u32 = 4;
const IMM_PONG: u32 = 5;

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

/// `fabric-debug client` options.
#[derive(Args, Debug)]
pub struct ClientArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Server's bootstrap address.
    #[arg(long)]
    pub connect: String,
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

/// How many progress steps the selected tests make.
fn phase_count(args: &ClientArgs) -> usize {
    let mut n = 0;
    if args.tests.contains(&Test::Throughput) {
        n += args.sizes.len();
    }
    if args.tests.contains(&Test::Paged) {
        n += args.page_sizes.len() * args.page_counts.len();
    }
    if args.tests.contains(&Test::Read) {
        n += args.read_sizes.len();
    }
    n + usize::from(args.tests.contains(&Test::Oprate)) + usize::from(args.tests.contains(&Test::Rtt))
}

/// Runs the selected tests and returns what they measured.
pub fn run(args: &ClientArgs) -> Result<Report> {
    if args.window == 0 || args.op_window == 0 || args.reps == 0 || args.ops == 0 || args.iters == 0 {
        crate::bail!("--window, --op-window, --reps, --ops and --iters must be positive");
    }
    let stall = Duration::from_secs(args.stall_timeout);
    let largest = args.sizes.iter().chain(&args.read_sizes).copied().chain([args.op_size, 4096]).max().unwrap_or(4096);
    let ep = Endpoint::open(&args.engine, largest as usize, false)?;
    let mut ch = Channel::connect(&args.connect, Duration::from_secs(args.connect_timeout), stall)?;
    let (_, server_mr) = ch.recv()?.into_peer().context("server hello")?;
    ch.send(&Control::hello(ep.engine.main_address(), &ep.descriptor))?;
    let (msg_tx, msg_rx) = mpsc::channel::<Vec<u8>>();
    ep.engine
        .set_recv_callback(Some(std::sync::Arc::new(move |m: Vec<u8>| {
            let _ = msg_tx.send(m);
        })))
        .context("installing the receive callback")?;

    let target = Target { engine: &ep.engine, src: ep.handle, src_len: ep.len, dst: &server_mr, stall };
    let mut report = Report {
        header: RunHeader::collect(ep.engine.provider()),
        provider: ep.engine.provider().to_string(),
        domain: ep.engine.domain_names().join(","),
        poll_mode: args.engine.poll_mode_name(),
        wait: args.wait.name(),
        reps: args.reps,
        throughput: Vec::new(),
        read_throughput: Vec::new(),
        paged: Vec::new(),
        op_rate: None,
        rtt: None,
        verified: Vec::new(),
    };
    // Ask the server to confirm `count` arrivals of `imm`; its verdict comes over the fabric.
    let mut verify = |phase: &str, imm: u32, count: u64, report: &mut Report| -> Result<()> {
        ch.send(&Control::Expect { imm, count, fence: IMM_FENCE })?;
        let tracker = Tracker::new(args.wait);
        ep.engine.submit_imm(IMM_FENCE, &server_mr, tracker.callback()).context("posting the fence")?;
        tracker.wait_all(1, stall)?;
        let bytes = msg_rx.recv_timeout(stall).with_context(|| format!("waiting for the server's {phase} verdict"))?;
        Control::from_bytes(&bytes)?.into_ok(&format!("verifying the {phase} phase"))?;
        report.verified.push(VerifiedPhase { phase: phase.to_string(), immediates: count });
        Ok(())
    };

    let mut progress = Progress::new(phase_count(args), args.quiet);
    if args.tests.contains(&Test::Throughput) {
        let mut posted = 0;
        for &size in &args.sizes {
            progress.step(&format!("throughput {}", crate::units::format_size(size)));
            let writes = writes_for(size, args.bytes_per_rep, args.window);
            let shape = Shape { size, writes, window: args.window, reps: args.reps, imm: IMM_THROUGHPUT };
            let (result, n) = target.throughput(shape)?;
            report.throughput.push(result);
            posted += n;
        }
        verify("throughput", IMM_THROUGHPUT, posted, &mut report)?;
    }
    if args.tests.contains(&Test::Read) {
        for &size in &args.read_sizes {
            progress.step(&format!("read throughput {}", crate::units::format_size(size)));
            let reads = writes_for(size, args.bytes_per_rep, args.window);
            let shape = Shape { size, writes: reads, window: args.window, reps: args.reps, imm: 0 };
            report.read_throughput.push(target.read_throughput(shape)?);
        }
    }
    if args.tests.contains(&Test::Paged) {
        let (results, posted) =
            target.paged_sweep(&args.page_sizes, &args.page_counts, args.reps, IMM_PAGED, &mut progress)?;
        report.paged = results;
        verify("paged", IMM_PAGED, posted, &mut report)?;
    }
    if args.tests.contains(&Test::Oprate) {
        progress.step(&format!("op rate, {} writes", crate::units::format_size(args.op_size)));
        let shape =
            Shape { size: args.op_size, writes: args.ops, window: args.op_window, reps: args.reps, imm: IMM_OP_RATE };
        let (mut result, posted) = target.op_rate(shape)?;
        verify("op-rate", IMM_OP_RATE, posted, &mut report)?;
        result.verified = true;
        report.op_rate = Some(result);
    }
    if args.tests.contains(&Test::Rtt) {
        progress.step("immediate round trips");
        let count = args.warmup_iters + args.iters;
        ch.send(&Control::Echo { ping: IMM_PING, pong: IMM_PONG, count })?;
        ch.recv()?.into_ok("arming the echo")?;
        let rtt = RoundTrips {
            engine: &ep.engine,
            dst: &server_mr,
            ping: IMM_PING,
            pong: IMM_PONG,
            warmup: args.warmup_iters,
            iters: args.iters,
            wait: args.wait,
            timeout: stall,
            breakdown: args.breakdown,
        };
        report.rtt = Some(rtt.run()?);
    }
    ch.send(&Control::Done)?;
    ch.recv()?.into_ok("ending the session")?;
    Ok(report)
}
