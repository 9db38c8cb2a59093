//! What a submit call costs the calling thread: validation, planning and the hand-off to the
//! worker, timed around each call (the worker posts afterwards, on its own thread). Scatters to
//! 1…N targets give the cost per target, what the all-to-all's CPU proxy pays per remote rank.
//!
//! Two engines in this process over a loopback provider; each scatter target is a different
//! 4 KiB slice of one peer region (the per-target work on the caller's thread is the same for
//! different peers), and the same writes through a prepared scatter (`prepare_scatter`). Calls
//! go in windows of 32, each window waited for before the next.
//!
//!     cargo bench -p fabric-lib --bench submit_cost -- [--provider tcp] [--targets 1,8,64]
//!         [--calls 20000] [--json-out submit_cost.json]
/// Small requests are allocated on the caller's thread and freed on the worker's: mimalloc frees
/// them without the system allocator's cross-thread cost.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_lib::{
    DomainChoice, EngineConfig, MemoryKind, MrDescriptor, MrHandle, PollMode, ProviderSpec, ScatterSharding,
    ScatterSlice, ScatterTarget, TransferEngine, WriteRequest,
};

#[path = "common/flags.rs"]
mod flags;

const WINDOW: usize = 32;
const SLICE: u64 = 4096;

struct Args {
    provider: String,
    targets: Vec<usize>,
    calls: usize,
    json_out: Option<String>,
}

fn parse_args() -> Args {
    let mut args = Args { provider: "tcp".into(), targets: vec![1, 8, 64], calls: 20_000, json_out: None };
    for (flag, value) in flags::flag_pairs() {
        match flag.as_str() {
            "--provider" => args.provider = value,
            "--targets" => args.targets = value.split(',').map(|t| t.parse().expect("--targets: numbers")).collect(),
            "--calls" => args.calls = value.parse().expect("--calls: a number"),
            "--json-out" => args.json_out = Some(value),
            other => panic!("unknown flag {other} (--provider, --targets, --calls, --json-out)"),
        }
    }
    args
}

fn engine(provider: &str) -> TransferEngine {
    let config = EngineConfig {
        provider: ProviderSpec::new(Some(provider), &[]),
        poll_mode: PollMode::ADAPTIVE,
        ..Default::default()
    };
    TransferEngine::new(config).unwrap_or_else(|e| panic!("opening {provider}: {e}"))
}

/// Nanoseconds of each call, in windows of [`WINDOW`] waited for in between.
fn time_calls(calls: usize, done: &AtomicU64, mut submit: impl FnMut()) -> Vec<u64> {
    let mut times = Vec::with_capacity(calls);
    let mut issued = 0u64;
    while times.len() < calls {
        for _ in 0..WINDOW {
            let t = Instant::now();
            submit();
            times.push(t.elapsed().as_nanos() as u64);
            issued += 1;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while done.load(Ordering::Acquire) < issued {
            assert!(Instant::now() < deadline, "requests did not complete within 30 s");
            std::hint::spin_loop();
        }
    }
    times.sort_unstable();
    times
}

fn pct(sorted: &[u64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize] as f64 / 1000.0
}

fn counting(done: &Arc<AtomicU64>) -> fabric_lib::OnDone {
    let done = done.clone();
    Box::new(move |r| {
        r.expect("the write completes");
        done.fetch_add(1, Ordering::Release);
    })
}

fn main() {
    let args = parse_args();
    let max_targets = args.targets.iter().copied().max().unwrap_or(1);
    let (writer, receiver) = (engine(&args.provider), engine(&args.provider));
    let mut src = vec![1u8; SLICE as usize * max_targets];
    let mut dst = vec![0u8; SLICE as usize * max_targets];
    // SAFETY: both buffers outlive the engines (dropped after them at the end of main).
    let (h, _) = unsafe { writer.register_memory(src.as_mut_ptr(), src.len(), MemoryKind::Host) }.unwrap();
    // SAFETY: as above.
    let (_, desc) = unsafe { receiver.register_memory(dst.as_mut_ptr(), dst.len(), MemoryKind::Host) }.unwrap();
    let done = Arc::new(AtomicU64::new(0));
    let mut rows = Vec::new();
    let mut report = |name: String, targets: usize, times: Vec<u64>| {
        let p50 = pct(&times, 0.5);
        println!(
            "{name:<24} p50 {p50:>7.3} µs  p99 {:>7.3} µs  per target {:>6.3} µs",
            pct(&times, 0.99),
            p50 / targets as f64
        );
        rows.push(format!(
            "{{\"call\": \"{name}\", \"targets\": {targets}, \"p50_us\": {p50:.4}, \"p99_us\": {:.4}, \"calls\": {}}}",
            pct(&times, 0.99),
            times.len()
        ));
    };
    println!("{} ({} calls each, windows of {WINDOW})", args.provider, args.calls);

    let d = done.clone();
    report(
        "submit_imm".into(),
        1,
        time_calls(args.calls, &d.clone(), || {
            writer.submit_imm(7, &desc, counting(&done)).unwrap();
        }),
    );
    done.store(0, Ordering::Release);
    report(
        "submit_write 64 B".into(),
        1,
        time_calls(args.calls, &d.clone(), || {
            let req = write_request(h, &desc);
            writer.submit_write(&req, counting(&done)).unwrap();
        }),
    );
    for &n in &args.targets {
        done.store(0, Ordering::Release);
        let targets: Vec<ScatterTarget<'_>> = (0..n as u64)
            .map(|i| ScatterTarget { len: 64, src_offset: i * SLICE, dst: &desc, dst_offset: i * SLICE })
            .collect();
        report(
            format!("submit_scatter {n}"),
            n,
            time_calls(args.calls, &d.clone(), || {
                writer.submit_scatter(None, h, &targets, Some(9), ScatterSharding::ByPeer, counting(&done)).unwrap();
            }),
        );
        // The same writes through a prepared set of n destinations (the proxy's way).
        done.store(0, Ordering::Release);
        let prepared = writer.prepare_scatter(h, &vec![desc.clone(); n]).unwrap();
        let slices: Vec<ScatterSlice> = (0..n)
            .map(|i| ScatterSlice { dst: i, src_offset: i as u64 * SLICE, len: 64, dst_offset: i as u64 * SLICE })
            .collect();
        report(
            format!("prepared_scatter {n}"),
            n,
            time_calls(args.calls, &d.clone(), || {
                let on_done = counting(&done);
                writer.submit_prepared_scatter(&prepared, &slices, Some(9), ScatterSharding::ByPeer, on_done).unwrap();
            }),
        );
    }
    if let Some(path) = &args.json_out {
        let json =
            format!("{{\"provider\": \"{}\", \"window\": {WINDOW}, \"rows\": [{}]}}\n", args.provider, rows.join(", "));
        // cargo bench runs a bench in its crate's folder: relative paths start there.
        let here = std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_default();
        std::fs::write(path, json).unwrap_or_else(|e| panic!("writing {path} (relative to {here}): {e}"));
        println!("wrote {path}");
    }
    drop(writer);
    drop(receiver);
    drop((src, dst));
}

fn write_request<'a>(src: MrHandle, dst: &'a MrDescriptor) -> WriteRequest<'a> {
    WriteRequest { src, src_offset: 0, len: 64, dst, dst_offset: 0, imm: Some(8), domains: DomainChoice::Pinned(0) }
}
