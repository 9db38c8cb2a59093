//! The CPU proxy's own costs, without a GPU: every rank is a thread whose stand-in kernels
//! publish counts, pack records and rows in host memory and raise the proxy block's words (see
//! `tests/host_ranks`), and each rank's proxy carries the remote traffic on its own engine. For
//! each world size it reports, over every rank and call (the first tenth left out as warm-up):
//!
//! - kernel signal → first write handed to the engine, for the count messages (`dseq`), the
//!   dispatch data (`ddone`) and the combine (`cdone`): the proxy noticing the word included
//!   (with the proxy on the engine's worker, handing over is posting);
//! - with `--posted`, kernel signal → first write posted and the proxy's call into the engine
//!   (the app call) → first write posted: until the engine's worker returned from the
//!   provider's post of that request's first write (each engine logs its requests' first
//!   posts, `LatencyProbe::enable_post_log`; the probe's clock reads are then included), and
//!   for the combine where that time goes: the call → the worker took the request, the worker
//!   took it → the first write's post returned;
//! - time the proxy spent posting per remote rank (the private dispatch writes, the combine
//!   writes): handing over, or with the proxy on the worker the posts themselves;
//! - writes per remote rank per call (dispatch data, combine) and count messages per call;
//! - a dispatch from counts seen to every remote source's flag raised.
//!
//! Every received byte is checked, as in the protocol tests. With `nvlink = 1` every other
//! rank is remote.
//!
//!     cargo bench -p p2p-all-to-all --bench proxy_costs -- [--provider tcp] [--worlds 2,4,8]
//!         [--calls 300] [--proxy-cpus 2,3,4,5] [--poll adaptive|busy] [--posted]
//!         [--eager 0,1] [--runner worker,thread] [--rounds 3] [--measured-cpus 2,3,4]
//!         [--json-out proxy_costs.json]
//!
//! `--runner` names where each rank's proxy runs: `worker` (the default, on the engine's worker
//! thread, `ProxyRunner::EngineWorker`) or `thread` (a thread of its own handing its posts to
//! the worker, `ProxyRunner::OwnThread`). With several runners or `--rounds`, every world runs
//! once per runner per round, alternating, and a last table gives each metric's median p50
//! over the rounds per runner, and its ratio to the first runner's.
//!
//! `--eager` runs each world once per value of `ProxyConfig::eager_targets` (a scatter to more
//! targets hands its first ones to the engine as a request of their own). `--measured-cpus K,P,W`
//! pins rank 0's stand-in kernels, proxy and engine worker to one CPU each (the worker polling
//! busily) and reports rank 0 alone: with the other ranks kept off those CPUs (start the bench
//! under `taskset` with the rest), its latencies mean something at world sizes whose threads
//! outnumber the cores.
//!
//! `--poll busy` keeps every engine worker polling (give each a core: a rank then has three
//! spinning threads); the default lets idle workers sleep, and a call to a sleeping worker pays
//! its wake-up.

/// Small requests are allocated on the caller's thread and freed on the worker's: mimalloc frees
/// them without the system allocator's cross-thread cost.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "../tests/host_ranks/mod.rs"]
mod host_ranks;

use std::time::{Duration, Instant};

use fabric_lib::PostRecord;
use host_ranks::{run, Scenario};
use p2p_all_to_all::proxy::FirstWrite;

struct Args {
    provider: String,
    worlds: Vec<usize>,
    calls: u64,
    private_tokens: usize,
    proxy_cpus: Option<Vec<usize>>,
    /// How the engine workers poll: "adaptive" or "busy".
    poll: &'static str,
    posted: bool,
    eager: Vec<usize>,
    /// Where proxies run: true for their own thread.
    runners: Vec<bool>,
    rounds: usize,
    measured_cpus: Option<[usize; 3]>,
    json_out: Option<String>,
}

fn runner_name(own_thread: bool) -> &'static str {
    if own_thread {
        "thread"
    } else {
        "worker"
    }
}

fn list(value: &str, flag: &str) -> Vec<usize> {
    value.split(',').map(|v| v.trim().parse().unwrap_or_else(|_| panic!("{flag}: a list of numbers"))).collect()
}

fn parse_args() -> Args {
    let mut args = Args {
        provider: "tcp".into(),
        worlds: vec![2, 4, 8],
        calls: 300,
        private_tokens: 8,
        proxy_cpus: None,
        poll: "adaptive",
        posted: false,
        eager: vec![p2p_all_to_all::proxy::EAGER_TARGETS],
        runners: vec![false],
        rounds: 1,
        measured_cpus: None,
        json_out: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--bench" {
            continue; // cargo bench passes it to harness-less benches
        }
        if flag == "--posted" {
            args.posted = true;
            continue;
        }
        let value = it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--provider" => args.provider = value,
            "--worlds" => args.worlds = list(&value, "--worlds"),
            "--calls" => args.calls = value.parse().expect("--calls: a number"),
            "--private-tokens" => args.private_tokens = value.parse().expect("--private-tokens: a number"),
            "--proxy-cpus" => args.proxy_cpus = Some(list(&value, "--proxy-cpus")),
            "--poll" => {
                args.poll = match value.as_str() {
                    "busy" => "busy",
                    "adaptive" => "adaptive",
                    _ => panic!("--poll: busy or adaptive"),
                }
            }
            "--eager" => args.eager = list(&value, "--eager"),
            "--runner" => {
                args.runners = value
                    .split(',')
                    .map(|r| match r.trim() {
                        "worker" => false,
                        "thread" => true,
                        _ => panic!("--runner: worker and/or thread"),
                    })
                    .collect()
            }
            "--rounds" => args.rounds = value.parse().expect("--rounds: a number"),
            "--measured-cpus" => {
                let cpus = list(&value, "--measured-cpus");
                let [k, p, w] = cpus[..] else { panic!("--measured-cpus: three CPUs (kernels, proxy, worker)") };
                args.measured_cpus = Some([k, p, w]);
            }
            "--json-out" => args.json_out = Some(value),
            other => panic!(
                "unknown flag {other} (--provider, --worlds, --calls, --private-tokens, --proxy-cpus, --poll, \
                 --posted, --eager, --runner, --rounds, --measured-cpus, --json-out)"
            ),
        }
    }
    args
}

/// p50 and p99 of `values` (µs), and how many.
fn summary(mut values: Vec<f64>) -> (f64, f64, usize) {
    if values.is_empty() {
        return (f64::NAN, f64::NAN, 0);
    }
    values.sort_by(f64::total_cmp);
    let at = |p: f64| values[((values.len() - 1) as f64 * p).round() as usize];
    (at(0.5), at(0.99), values.len())
}

fn since(from: Instant, to: Option<Instant>) -> Option<f64> {
    to.map(|t| t.saturating_duration_since(from).as_nanos() as f64 / 1000.0)
}

/// `Instant`s as `CLOCK_MONOTONIC` nanoseconds (the engine's post log's clock; `Instant` reads
/// the same clock on Linux, but does not expose it).
struct Clock {
    at: Instant,
    ns: u64,
}

impl Clock {
    fn new() -> Self {
        let before = fabric_lib::monotonic_ns();
        let at = Instant::now();
        let after = fabric_lib::monotonic_ns();
        Clock { at, ns: before + (after - before) / 2 }
    }

    fn ns(&self, t: Instant) -> u64 {
        match t.checked_duration_since(self.at) {
            Some(d) => self.ns + d.as_nanos() as u64,
            None => self.ns - (self.at - t).as_nanos() as u64,
        }
    }

    /// A request's way through the engine, in µs: the kernel's `signal` → its first post
    /// returned, the proxy's call → that post returned, the call → the worker took it, the
    /// worker took it → the post returned. The request is found by its number
    /// (`FirstWrite::request`): nothing else posts on the proxy's engine, and the worker takes
    /// requests in order.
    fn through_engine(&self, log: &[PostRecord], signal: Instant, first: Option<FirstWrite>) -> [Option<f64>; 4] {
        let Some(first) = first else { return [None; 4] };
        let call = self.ns(first.call);
        let at = log.partition_point(|r| r.command < first.request);
        let Some(record) = log.get(at).filter(|r| r.command == first.request && r.dequeued_ns >= call) else {
            return [None; 4]; // no post logged for it (pushed back by the provider, retried later)
        };
        let us = |from: u64, to: u64| Some(to.saturating_sub(from) as f64 / 1000.0);
        let posted = record.posted_ns;
        [us(self.ns(signal), posted), us(call, posted), us(call, record.dequeued_ns), us(record.dequeued_ns, posted)]
    }
}

fn main() {
    let args = parse_args();
    println!(
        "{}: proxy costs per world size, {} calls, private quota {}, workers poll: {}{}",
        args.provider,
        args.calls,
        args.private_tokens,
        args.poll,
        match args.measured_cpus {
            Some(c) => format!(", rank 0 alone on CPUs {c:?} (kernels, proxy, worker)"),
            None => String::new(),
        }
    );
    println!("{:<52} {:>9} {:>9} {:>8}", "", "p50", "p99", "samples");
    let clock = Clock::new();
    let mut worlds_json = Vec::new();
    // (world, eager, runner) → per metric, its p50 of each round.
    let mut rounds: Vec<Round> = Vec::new();
    for round in 0..args.rounds {
        for &world in &args.worlds {
            for &eager in &args.eager {
                for &own_thread in &args.runners {
                    let Some((json, metrics)) = measure(&args, world, eager, own_thread, round, &clock) else {
                        println!("provider {} is not available here", args.provider);
                        return;
                    };
                    worlds_json.push(json);
                    let key = (world, eager, own_thread);
                    let at = match rounds.iter().position(|(k, _)| *k == key) {
                        Some(i) => i,
                        None => {
                            rounds.push((key, metrics.iter().map(|(name, _)| (*name, Vec::new())).collect()));
                            rounds.len() - 1
                        }
                    };
                    for ((_, p50s), (_, p50)) in rounds[at].1.iter_mut().zip(&metrics) {
                        p50s.push(*p50);
                    }
                }
            }
        }
    }
    let comparison = compare(&args, &rounds);
    if let Some(path) = &args.json_out {
        let json = format!(
            "{{\"provider\": \"{}\", \"poll\": \"{}\", \"calls\": {}, \"private_tokens\": {}, \
             \"measured_cpus\": {}, \"rounds\": {}, \"runs\": [{}], \"medians\": [{}]}}\n",
            args.provider,
            args.poll,
            args.calls,
            args.private_tokens,
            args.measured_cpus.map_or("null".to_string(), |c| format!("{c:?}")),
            args.rounds,
            worlds_json.join(", "),
            comparison.join(", ")
        );
        // cargo bench runs a bench in its crate's folder: relative paths start there.
        let here = std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_default();
        std::fs::write(path, json).unwrap_or_else(|e| panic!("writing {path} (relative to {here}): {e}"));
        println!("wrote {path}");
    }
}

fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// With several runners or rounds: per world and metric, each runner's median p50 over the
/// rounds and its ratio to the first runner's; printed, and returned as JSON rows.
fn compare(args: &Args, rounds: &[Round]) -> Vec<String> {
    if args.runners.len() < 2 && args.rounds < 2 {
        return Vec::new();
    }
    let base = args.runners[0];
    println!("median p50 over {} rounds; ratio: to the {} runner", args.rounds, runner_name(base));
    let mut rows = Vec::new();
    for ((world, eager, own_thread), metrics) in rounds {
        let first = rounds.iter().find(|((w, e, o), _)| w == world && e == eager && *o == base).map(|(_, m)| m);
        println!("world {world}, eager targets {eager}, proxy on {}", runner_name(*own_thread));
        for (i, (name, p50s)) in metrics.iter().enumerate() {
            let m = median(p50s);
            let ratio = first.map_or(f64::NAN, |f| m / median(&f[i].1));
            println!("  {name:<50} {m:>9.3} {ratio:>8.2}x");
            rows.push(format!(
                "{{\"world\": {world}, \"eager_targets\": {eager}, \"runner\": \"{}\", \"metric\": \"{name}\", \
                 \"median_p50\": {m:.4}, \"ratio\": {ratio:.4}, \"p50s\": {p50s:?}}}",
                runner_name(*own_thread)
            ));
        }
    }
    rows
}

/// Per (world, eager targets, own thread): per metric, its p50 in each round.
type Round = ((usize, usize, bool), Vec<(&'static str, Vec<f64>)>);

/// Per metric, its p50 in one run.
type Metrics = Vec<(&'static str, f64)>;

/// Runs one world size with one `eager_targets` and proxy runner, prints its metrics and
/// returns them, also as JSON (None: the provider is missing).
fn measure(
    args: &Args,
    world: usize,
    eager: usize,
    own_thread: bool,
    round: usize,
    clock: &Clock,
) -> Option<(String, Metrics)> {
    let provider: &'static str = Box::leak(args.provider.clone().into_boxed_str());
    let sc = Scenario {
        provider,
        world,
        nvlink: 1,
        private_tokens: args.private_tokens,
        calls: args.calls,
        skew: false,
        dies: None,
        fence: false,
        scatter: true,
        proxy_cpus: args.proxy_cpus.as_ref().map(|c| (0..world).map(|r| c[r % c.len()]).collect()),
        own_thread,
        // As the all-to-all ran it: the proxy spins through the gaps between calls.
        proxy_idle_spin: Some(Duration::from_millis(50)),
        busy_workers: args.poll == "busy",
        eager_targets: eager,
        measured_cpus: args.measured_cpus,
        post_log: args.posted,
    };
    let results = run(sc)?;
    let warm = (args.calls / 10) as usize;
    let mut names = vec![
        "counts: signal -> first write (µs)",
        "dispatch data: signal -> first write (µs)",
        "combine: signal -> first write (µs)",
        "dispatch: posting per remote rank (µs)",
        "combine: posting per remote rank (µs)",
        "dispatch: counts seen -> flags raised (µs)",
        "dispatch data writes per remote rank",
        "combine writes per remote rank",
    ];
    if args.posted {
        names.extend([
            "counts: signal -> first write posted (µs)",
            "dispatch data: signal -> first write posted (µs)",
            "combine: signal -> first write posted (µs)",
            "counts: call -> first write posted (µs)",
            "dispatch data: call -> first write posted (µs)",
            "combine: call -> first write posted (µs)",
            "combine: call -> worker took it (µs)",
            "combine: worker took it -> first write posted (µs)",
        ]);
    }
    let mut metrics: Vec<(&str, Vec<f64>)> = names.into_iter().map(|name| (name, Vec::new())).collect();
    for (rank, result) in results.into_iter().enumerate() {
        let outcome = result.unwrap_or_else(|e| panic!("world {world}, rank {rank}: {e}"));
        if args.measured_cpus.is_some() && rank != 0 {
            continue;
        }
        let log = &outcome.post_log;
        let calls = outcome.raised.iter().zip(&outcome.dispatch).zip(&outcome.combine).skip(warm);
        for ((raised, d), c) in calls {
            let remote = f64::from(d.remote_peers.max(1));
            let values = [
                since(raised.dseq, d.counts_first_write.map(|f| f.handed)),
                since(raised.ddone, d.data_first_write.map(|f| f.handed)),
                since(raised.cdone, c.first_write.map(|f| f.handed)),
                Some(d.post_per_peer_ns as f64 / 1000.0),
                Some(c.post_per_peer_ns as f64 / 1000.0),
                Some(d.total_ns as f64 / 1000.0),
                Some(f64::from(d.data_writes) / remote),
                Some(f64::from(c.writes) / f64::from(c.remote_peers.max(1))),
            ];
            let counts = clock.through_engine(log, raised.dseq, d.counts_first_write);
            let data = clock.through_engine(log, raised.ddone, d.data_first_write);
            let combine = clock.through_engine(log, raised.cdone, c.first_write);
            let posted = [counts[0], data[0], combine[0], counts[1], data[1], combine[1], combine[2], combine[3]];
            let values = values.into_iter().chain(posted);
            for ((_, column), v) in metrics.iter_mut().zip(values) {
                column.extend(v);
            }
        }
    }
    let whose = if args.measured_cpus.is_some() { "rank 0" } else { "all ranks" };
    let runner = runner_name(own_thread);
    println!(
        "world {world} ({} remote ranks each), eager targets {eager}, proxy on {runner}, round {round}, {whose}",
        world - 1
    );
    let mut rows = Vec::new();
    let mut p50s = Vec::new();
    for (name, values) in metrics {
        let (p50, p99, n) = summary(values);
        println!("  {name:<50} {p50:>9.3} {p99:>9.3} {n:>8}");
        rows.push(format!("{{\"metric\": \"{name}\", \"p50\": {p50:.4}, \"p99\": {p99:.4}, \"samples\": {n}}}"));
        p50s.push((name, p50));
    }
    let json = format!(
        "{{\"world\": {world}, \"eager_targets\": {eager}, \"runner\": \"{runner}\", \"round\": {round}, \
         \"metrics\": [{}]}}",
        rows.join(", ")
    );
    Some((json, p50s))
}
