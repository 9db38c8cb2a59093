//! How long an immediate takes from the worker's count to a polling waiter: two threads play
//! ping-pong through an `ImmCounterTable` (each raises one value with `add_batch`, as the worker
//! does for a completion batch, and waits for the other's with `wait`, polling), against the
//! floor of the same ping-pong through one bare atomic per direction. Rounds alternate the two;
//! the table's cost above the floor is what counting and waking add to every round trip.
//!
//!     cargo bench -p fabric-lib --bench imm_wake -- [--iters 200000] [--rounds 3]
//!         [--cpus 2,3] [--json-out imm_wake.json]
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
use fabric_lib::ImmCounterTable;

#[path = "common/flags.rs"]
mod flags;

const PING: u32 = 11;
const PONG: u32 = 12;

struct Args {
    iters: u64,
    rounds: usize,
    cpus: Option<(usize, usize)>,
    json_out: Option<String>,
}

fn parse_args() -> Args {
    let mut args = Args { iters: 200_000, rounds: 3, cpus: None, json_out: None };
    for (flag, value) in flags::flag_pairs() {
        match flag.as_str() {
            "--iters" => args.iters = value.parse().expect("--iters: a number"),
            "--rounds" => args.rounds = value.parse().expect("--rounds: a number"),
            "--cpus" => {
                let (a, b) = value.split_once(',').expect("--cpus: two CPUs, e.g. 2,3");
                args.cpus = Some((a.parse().expect("--cpus: numbers"), b.parse().expect("--cpus: numbers")));
            }
            "--json-out" => args.json_out = Some(value),
            other => panic!("unknown flag {other} (--iters, --rounds, --cpus, --json-out)"),
        }
    }
    args
}

fn pin(cpu: Option<usize>) {
    if let Some(id) = cpu {
        core_affinity::set_for_current(core_affinity::CoreId { id });
    }
}

/// Runs `iters` round trips: `answer` on a second thread, `ask` here; nanoseconds per round trip.
fn ping_pong(iters: u64, cpus: Option<(usize, usize)>, ask: impl Fn(u64), answer: impl Fn(u64) + Sync) -> f64 {
    std::thread::scope(|s| {
        s.spawn(|| {
            pin(cpus.map(|c| c.1));
            (1..=iters).for_each(&answer);
        });
        pin(cpus.map(|c| c.0));
        let start = Instant::now();
        (1..=iters).for_each(&ask);
        start.elapsed().as_nanos() as f64 / iters as f64
    })
}

fn atomic_round(iters: u64, cpus: Option<(usize, usize)>) -> f64 {
    let (ping, pong) = (CachePadded::new(AtomicU64::new(0)), CachePadded::new(AtomicU64::new(0)));
    let wait = |a: &AtomicU64, i: u64| {
        while a.load(Ordering::Acquire) < i {
            std::hint::spin_loop();
        }
    };
    ping_pong(
        iters,
        cpus,
        |i| {
            ping.store(i, Ordering::Release);
            wait(&pong, i);
        },
        |i| {
            wait(&ping, i);
            pong.store(i, Ordering::Release);
        },
    )
}

fn table_round(iters: u64, cpus: Option<(usize, usize)>) -> f64 {
    let table = Arc::new(ImmCounterTable::with_wait_spin(Duration::from_secs(10)));
    let timeout = Duration::from_secs(30);
    ping_pong(
        iters,
        cpus,
        |_| {
            assert!(table.add_batch(&[(PING, 1)]).is_empty());
            table.wait(PONG, 1, timeout).expect("pong counted");
        },
        |_| {
            table.wait(PING, 1, timeout).expect("ping counted");
            assert!(table.add_batch(&[(PONG, 1)]).is_empty());
        },
    )
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args = parse_args();
    let (mut floor, mut table) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        floor.push(atomic_round(args.iters, args.cpus));
        table.push(table_round(args.iters, args.cpus));
        println!(
            "round {}: bare atomics {:.0} ns, ImmCounterTable {:.0} ns per round trip",
            round + 1,
            floor[round],
            table[round]
        );
    }
    let (f, t) = (median(&mut floor), median(&mut table));
    println!(
        "median of {} rounds: bare atomics {f:.0} ns, ImmCounterTable {t:.0} ns per round trip \
         ({:.0} ns above the floor per one-way count and wake, ratio {:.2})",
        args.rounds,
        (t - f) / 2.0,
        t / f
    );
    if let Some(path) = args.json_out {
        let json = format!(
            "{{\"bench\": \"imm_wake\", \"iters\": {}, \"rounds\": {}, \"floor_ns\": {f:.1}, \"table_ns\": {t:.1}, \
             \"floor_rounds_ns\": {floor:?}, \"table_rounds_ns\": {table:?}}}\n",
            args.iters, args.rounds
        );
        std::fs::write(&path, json).unwrap_or_else(|e| panic!("writing {path}: {e}"));
        println!("wrote {path}");
    }
}
