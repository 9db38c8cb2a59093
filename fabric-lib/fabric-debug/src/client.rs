//! The client side: connects to a server, then runs the throughput, op-rate and round-trip
//! tests against the server's buffer and has the server verify every immediate it sent. With
//! GPUs, one engine per GPU runs the tests against the server's engine of the same index, all
//! pairs at once, each on its own bootstrap connection.
use std::sync::mpsc;
use std::time::Duration;

use clap::Args;

use crate::bootstrap::{Channel, Control};
use crate::endpoint::{Endpoint, EngineArgs};
use crate::error::{Context, Error, Result};
use crate::gpu_buffers::{peer_registration_name, reads_supported, write_path, MemoryReport};
use crate::gpu_list::{GpuList, Placement};
use crate::gpu_report::{GpuRunReport, Output};
use crate::latency::RoundTrips;
use crate::progress::Progress;
use crate::report::{Report, VerifiedPhase};
use crate::run_info::RunHeader;
use crate::test_args::{Test, TestArgs};
use crate::throughput::{writes_for, Shape, Target};
use crate::tracker::Tracker;

/// Immediate values of the phases (distinct, so the server counts each phase on its own).
const IMM_THROUGHPUT: u32 = 1;
const IMM_OP_RATE: u32 = 2;
const IMM_FENCE: u32 = 3;
const IMM_PAGED: u32 = 6;
const IMM_PING: u32 = 4;
const IMM_PONG: u32 = 5;

/// `fabric-debug client` options.
#[derive(Args, Debug, Clone)]
pub struct ClientArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// GPUs whose memory holds the send buffers, e.g. `0,1`: one engine per GPU, engine `i`
    /// writes into the server's engine `i` (give the server the same number of GPUs).
    #[arg(long, value_name = "GPUS")]
    pub gpus: Option<GpuList>,
    /// Server's bootstrap address.
    #[arg(long)]
    pub connect: String,
    #[command(flatten)]
    pub tests: TestArgs,
}

/// Runs the selected tests, on one engine per GPU where GPUs are listed (all at once).
pub fn run(args: &ClientArgs) -> Result<Output> {
    args.tests.validate()?;
    if let Some(list) = &args.gpus {
        crate::gpu_buffers::check_gpus(list)?;
    }
    let placements = Placement::for_run(args.gpus.as_ref());
    if args.gpus.is_none() {
        return session(args, 0, &placements).map(|r| Output::Host(Box::new(r)));
    }
    run_pairs(args, &placements).map(|reports| Output::Gpus(Box::new(GpuRunReport::new(reports))))
}

/// Runs one session per placement, all at once; every one must succeed.
pub(crate) fn run_pairs(args: &ClientArgs, placements: &[Placement]) -> Result<Vec<Report>> {
    let results: Vec<Result<Report>> = std::thread::scope(|s| {
        let sessions: Vec<_> = (0..placements.len()).map(|i| s.spawn(move || session(args, i, placements))).collect();
        sessions.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error("a session panicked".into())))).collect()
    });
    let mut reports = Vec::new();
    let mut failures = Vec::new();
    for (i, (result, placement)) in results.into_iter().zip(placements).enumerate() {
        match result {
            Ok(r) => reports.push(r),
            Err(e) => failures.push(format!("engine {i} ({}): {e}", placement.name())),
        }
    }
    if !failures.is_empty() {
        crate::bail!("{}", failures.join("; "));
    }
    Ok(reports)
}

/// One engine's session: engine `index` of `placements` against the server's engine `index`.
fn session(args: &ClientArgs, index: usize, placements: &[Placement]) -> Result<Report> {
    let tests = &args.tests;
    let placement = placements[index];
    let stall = Duration::from_secs(tests.stall_timeout);
    let largest =
        tests.sizes.iter().chain(&tests.read_sizes).copied().chain([tests.op_size, 4096]).max().unwrap_or(4096);
    let ep = Endpoint::open(&args.engine, placement, largest as usize, false)?;
    let mut ch = Channel::connect(&args.connect, Duration::from_secs(tests.connect_timeout), stall)?;
    ch.send(&Control::Attach { engine: index, engines: placements.len() })?;
    let (_, server_mr) = ch.recv()?.into_peer().with_context(|| format!("server hello for engine {index}"))?;
    ch.send(&Control::hello(ep.engine.main_address(), &ep.descriptor))?;
    let (msg_tx, msg_rx) = mpsc::channel::<Vec<u8>>();
    ep.engine
        .set_recv_callback(Some(std::sync::Arc::new(move |m: Vec<u8>| {
            let _ = msg_tx.send(m);
        })))
        .context("installing the receive callback")?;

    let client_registration = ep.registration()?;
    let path = write_path(&ep.engine, ep.descriptor.kind, &client_registration, &server_mr);
    let staged_before = ep.engine.staging_stats();
    let target = Target { engine: &ep.engine, src: ep.handle, src_len: ep.len, dst: &server_mr, stall };
    let mut report = Report {
        header: RunHeader::collect(ep.engine.provider()),
        provider: ep.engine.provider().to_string(),
        domain: ep.engine.domain_names().join(","),
        poll_mode: args.engine.poll_mode_name(),
        wait: tests.wait.name(),
        reps: tests.reps,
        memory: MemoryReport {
            client_buffer: placement.name(),
            server_buffer: match server_mr.kind {
                fabric_lib::MemoryKind::Host => "host".into(),
                fabric_lib::MemoryKind::Cuda(g) => format!("cuda:{g}"),
            },
            client_registration,
            server_registration: peer_registration_name(&server_mr).into(),
            path: path.into(),
            staged_requests: 0,
            bounced_bytes: 0,
        },
        throughput: Vec::new(),
        read_throughput: Vec::new(),
        paged: Vec::new(),
        op_rate: None,
        rtt: None,
        verified: Vec::new(),
        skipped: Vec::new(),
    };
    // Ask the server to confirm `count` arrivals of `imm`; its verdict comes over the fabric.
    let mut verify = |phase: &str, imm: u32, count: u64, report: &mut Report| -> Result<()> {
        ch.send(&Control::Expect { imm, count, fence: IMM_FENCE })?;
        let tracker = Tracker::new(tests.wait);
        ep.engine.submit_imm(IMM_FENCE, &server_mr, tracker.callback()).context("posting the fence")?;
        tracker.wait_all(1, stall)?;
        let bytes = msg_rx.recv_timeout(stall).with_context(|| format!("waiting for the server's {phase} verdict"))?;
        Control::from_bytes(&bytes)?.into_ok(&format!("verifying the {phase} phase"))?;
        report.verified.push(VerifiedPhase { phase: phase.to_string(), immediates: count });
        Ok(())
    };

    let label = if placements.len() > 1 || args.gpus.is_some() { placement.name() } else { String::new() };
    let skip_reads = tests.has(Test::Read) && !reads_supported(path);
    let phases = tests.phase_count() - if skip_reads { tests.read_sizes.len() } else { 0 };
    let mut progress = Progress::new(phases, tests.quiet, label);
    if tests.has(Test::Throughput) {
        let mut posted = 0;
        for &size in &tests.sizes {
            progress.step(&format!("throughput {}", crate::units::format_size(size)));
            let writes = writes_for(size, tests.bytes_per_rep, tests.window);
            let shape = Shape { size, writes, window: tests.window, reps: tests.reps, imm: IMM_THROUGHPUT };
            let (result, n) = target.throughput(shape)?;
            report.throughput.push(result);
            posted += n;
        }
        verify("throughput", IMM_THROUGHPUT, posted, &mut report)?;
    }
    if skip_reads {
        report.skipped.push("read: reads are not staged (the provider has no FI_HMEM for this GPU memory)".into());
    } else if tests.has(Test::Read) {
        for &size in &tests.read_sizes {
            progress.step(&format!("read throughput {}", crate::units::format_size(size)));
            let reads = writes_for(size, tests.bytes_per_rep, tests.window);
            let shape = Shape { size, writes: reads, window: tests.window, reps: tests.reps, imm: 0 };
            report.read_throughput.push(target.read_throughput(shape)?);
        }
    }
    if tests.has(Test::Paged) {
        let (results, posted) =
            target.paged_sweep(&tests.page_sizes, &tests.page_counts, tests.reps, IMM_PAGED, &mut progress)?;
        report.paged = results;
        verify("paged", IMM_PAGED, posted, &mut report)?;
    }
    if tests.has(Test::Oprate) {
        progress.step(&format!("op rate, {} writes", crate::units::format_size(tests.op_size)));
        let shape = Shape {
            size: tests.op_size,
            writes: tests.ops,
            window: tests.op_window,
            reps: tests.reps,
            imm: IMM_OP_RATE,
        };
        let (mut result, posted) = target.op_rate(shape)?;
        verify("op-rate", IMM_OP_RATE, posted, &mut report)?;
        result.verified = true;
        report.op_rate = Some(result);
    }
    if tests.has(Test::Rtt) {
        progress.step("immediate round trips");
        let count = tests.warmup_iters + tests.iters;
        ch.send(&Control::Echo { ping: IMM_PING, pong: IMM_PONG, count })?;
        ch.recv()?.into_ok("arming the echo")?;
        let rtt = RoundTrips {
            engine: &ep.engine,
            dst: &server_mr,
            ping: IMM_PING,
            pong: IMM_PONG,
            warmup: tests.warmup_iters,
            iters: tests.iters,
            wait: tests.wait,
            timeout: stall,
            breakdown: tests.breakdown,
        };
        report.rtt = Some(rtt.run()?);
    }
    ch.send(&Control::Done)?;
    ch.recv()?.into_ok("ending the session")?;
    let staged = ep.engine.staging_stats();
    report.memory.staged_requests = staged.requests_sent - staged_before.requests_sent;
    report.memory.bounced_bytes = staged.bounced_bytes - staged_before.bounced_bytes;
    Ok(report)
}
