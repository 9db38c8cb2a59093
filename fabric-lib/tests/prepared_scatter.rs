//! Prepared scatters (`prepare_scatter` / `submit_prepared_scatter`) over real loopback
//! providers: random slices of one source into three receivers, several calls on one prepared
//! set; every byte and every immediate checked (a destination counts once per call that names
//! it, never when none does). Bad slices are refused before anything moves; a set
//! whose destinations take the staged path goes the general scatter way with the same result.
mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::{engine_if_available, register, Rng};
use fabric_lib::staging::StagingConfig;
use fabric_lib::{
    CompletionCounter, EngineConfig, FabricError, MrHandle, PollMode, PreparedScatter, ProviderSpec, ScatterSharding,
    ScatterSlice, TransferEngine,
};

const REGION: usize = 1 << 20;
const BOUND: Duration = Duration::from_secs(20);

fn done(tx: &mpsc::Sender<fabric_lib::Result<()>>) -> fabric_lib::OnDone {
    let tx = tx.clone();
    Box::new(move |r| tx.send(r).unwrap())
}

/// Calls `calls` random prepared scatters from `a` into the receivers and checks every byte and
/// count. Each call: a slice for a random subset of the destinations, zero-length ones included.
fn random_calls(make: impl Fn() -> TransferEngine, sharding: ScatterSharding, seed: u64) {
    let mut rng = Rng(seed);
    let mut src: Vec<u8> = (0..REGION).map(|_| rng.next() as u8).collect();
    let mut dsts: Vec<Vec<u8>> = vec![vec![0u8; REGION]; 3];
    // The engines are made after the buffers and dropped before them.
    let a = make();
    let receivers: Vec<TransferEngine> = (0..3).map(|_| make()).collect();
    let (src_h, _) = register(&a, &mut src);
    let descs: Vec<_> = receivers.iter().zip(dsts.iter_mut()).map(|(r, d)| register(r, d).1).collect();
    let prepared = a.prepare_scatter(src_h, &descs).unwrap();
    assert!(prepared.is_network() && prepared.len() == receivers.len());
    let mut expected: Vec<Vec<u8>> = dsts.clone();
    let (tx, rx) = mpsc::channel();
    let counter = CompletionCounter::new();
    let mut cursor = vec![0usize; receivers.len()];
    for call in 0..12u32 {
        let imm = 100 + call;
        let mut slices = Vec::new();
        let first = rng.below(receivers.len() as u64) as usize;
        let named: Vec<usize> = (0..receivers.len()).filter(|&d| d == first || rng.below(2) == 0).collect();
        for dst in named {
            let len = if rng.below(5) == 0 { 0 } else { 1 + rng.below(30_000) as usize };
            let src_offset = rng.below((REGION - len) as u64) as usize;
            // Destination ranges never overlap: each slice lands in fresh bytes.
            let dst_offset = cursor[dst];
            cursor[dst] += len + 1;
            expected[dst][dst_offset..dst_offset + len].copy_from_slice(&src[src_offset..src_offset + len]);
            slices.push(ScatterSlice {
                dst,
                src_offset: src_offset as u64,
                len: len as u64,
                dst_offset: dst_offset as u64,
            });
        }
        // Odd calls report to a counter (the worker bumps it), even ones through a callback.
        if call % 2 == 1 {
            a.submit_prepared_scatter_counted(&prepared, &slices, Some(imm), sharding, &counter).unwrap();
            counter.wait_for(u64::from(call / 2 + 1), BOUND).expect("counted completion in time");
        } else {
            a.submit_prepared_scatter(&prepared, &slices, Some(imm), sharding, done(&tx)).unwrap();
            rx.recv_timeout(BOUND).expect("completion in time").expect("scatter ok");
        }
        for (i, r) in receivers.iter().enumerate() {
            let named = slices.iter().any(|s| s.dst == i);
            if named {
                r.wait_imm_count(imm, 1, BOUND).unwrap();
            }
        }
    }
    std::thread::sleep(Duration::from_millis(50));
    for (i, r) in receivers.iter().enumerate() {
        for call in 0..12u32 {
            assert_eq!(r.imm_count(100 + call), 0, "receiver {i}: an immediate counted twice or unasked");
        }
        assert!(dsts[i] == expected[i], "receiver {i}: every byte where its slice says, nothing else");
    }
    assert_eq!((counter.done(), counter.failed()), (6, 0), "each counted call completed once, none failed");
    drop((prepared, a, receivers));
}

#[test]
fn prepared_scatter_over_tcp_shm_and_rxd() {
    for (i, provider) in ["tcp", "shm", "udp;ofi_rxd"].into_iter().enumerate() {
        if engine_if_available(provider, BOUND).is_none() {
            eprintln!("{provider}: not available here");
            continue;
        }
        random_calls(|| engine_if_available(provider, BOUND).unwrap(), ScatterSharding::ByPeer, 7 + i as u64);
    }
}

#[test]
fn prepared_scatter_sharded_over_two_domains() {
    random_calls(common::two_domain_loopback_engine, ScatterSharding::ByBytes, 3);
}

/// A fresh set of one writer and one receiver, the source registered.
fn pair(provider: &str) -> (TransferEngine, TransferEngine) {
    (engine_if_available(provider, BOUND).unwrap(), engine_if_available(provider, BOUND).unwrap())
}

#[test]
fn bad_slices_are_refused_before_anything_moves() {
    let (a, b) = pair("tcp");
    let mut src = vec![7u8; 4096];
    let mut dst = vec![0u8; 4096];
    let (src_h, _) = register(&a, &mut src);
    let (_, desc) = register(&b, &mut dst);
    let prepared = a.prepare_scatter(src_h, std::slice::from_ref(&desc)).unwrap();
    let (tx, _rx) = mpsc::channel();
    let slice = ScatterSlice { dst: 0, src_offset: 0, len: 16, dst_offset: 0 };
    let bad = [
        ("destination index", ScatterSlice { dst: 1, ..slice }),
        ("source range", ScatterSlice { src_offset: 4090, ..slice }),
        ("destination range", ScatterSlice { dst_offset: 4081, ..slice }),
        ("overflowing offset", ScatterSlice { dst_offset: u64::MAX, ..slice }),
        ("second slice of one destination", ScatterSlice { dst_offset: 100, ..slice }),
    ];
    for (what, s) in bad {
        // A good slice first: the call must refuse the whole request, the good one included.
        let r = a.submit_prepared_scatter(&prepared, &[slice, s], Some(5), ScatterSharding::ByPeer, done(&tx));
        assert!(matches!(r, Err(FabricError::InvalidArgument(_))), "{what}: {r:?}");
    }
    let r = a.submit_prepared_scatter(&prepared, &[], Some(5), ScatterSharding::ByPeer, done(&tx));
    assert!(matches!(r, Err(FabricError::InvalidArgument(_))), "no slices: {r:?}");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(b.imm_count(5), 0, "nothing was delivered");
    assert!(dst.iter().all(|&x| x == 0), "no byte was written");
    assert!(matches!(a.prepare_scatter(src_h, &[]), Err(FabricError::InvalidArgument(_))));

    // A set prepared by another engine is refused, even with the same provider and handles.
    let (c, _) = pair("tcp");
    let mut other = vec![0u8; 4096];
    let (other_h, _) = register(&c, &mut other);
    assert_eq!(other_h, MrHandle(src_h.0), "the two engines number their first region alike");
    let r = c.submit_prepared_scatter(&prepared, &[slice], Some(5), ScatterSharding::ByPeer, done(&tx));
    assert!(matches!(r, Err(FabricError::InvalidArgument(_))), "foreign set: {r:?}");

    // An unregistered source fails the call, typed, nothing sent.
    a.unregister_memory(src_h).unwrap();
    let r = a.submit_prepared_scatter(&prepared, &[slice], Some(5), ScatterSharding::ByPeer, done(&tx));
    assert!(r.is_err(), "unregistered source accepted");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(b.imm_count(5), 0);
    drop((a, b, c, prepared));
}

fn staged_engine() -> TransferEngine {
    TransferEngine::new(EngineConfig {
        provider: ProviderSpec::new(Some("tcp"), &[]),
        poll_mode: PollMode::ADAPTIVE,
        transfer_timeout: BOUND,
        staging: Some(StagingConfig { chunk_bytes: 16 << 10, slots: 3 }),
        stage_host_memory: true,
        ..Default::default()
    })
    .expect("opening tcp")
}

/// Destinations on the staged path (host memory staged for testing, as GPU memory the NIC
/// cannot reach would be): the set plans each call like `submit_scatter`, with the same bytes
/// and counts.
#[test]
fn staged_destinations_take_the_general_path() {
    let a = staged_engine();
    let rs = vec![staged_engine(), staged_engine()];
    let mut src: Vec<u8> = (0..REGION).map(|i| (i % 241) as u8).collect();
    let mut dsts = [vec![0u8; REGION], vec![0u8; REGION]];
    let (src_h, _) = register(&a, &mut src);
    let [d0, d1] = &mut dsts;
    let descs = [register(&rs[0], d0).1, register(&rs[1], d1).1];
    let prepared: PreparedScatter = a.prepare_scatter(src_h, &descs).unwrap();
    assert!(!prepared.is_network());
    let (tx, rx) = mpsc::channel();
    let one = [ScatterSlice { dst: 1, src_offset: 10, len: 50_000, dst_offset: 3 }];
    a.submit_prepared_scatter(&prepared, &one, Some(9), ScatterSharding::ByPeer, done(&tx)).unwrap();
    rx.recv_timeout(BOUND).expect("completion in time").expect("scatter ok");
    rs[1].wait_imm_count(9, 1, BOUND).unwrap();
    let both = [
        ScatterSlice { dst: 0, src_offset: 0, len: 0, dst_offset: 0 },
        ScatterSlice { dst: 1, src_offset: 70_000, len: 20_000, dst_offset: 60_000 },
    ];
    // Reported to a counter: once, after both parts (two worker requests on this path).
    let counter = CompletionCounter::new();
    a.submit_prepared_scatter_counted(&prepared, &both, Some(10), ScatterSharding::ByPeer, &counter).unwrap();
    counter.wait_for(1, BOUND).expect("counted completion in time");
    for r in &rs {
        r.wait_imm_count(10, 1, BOUND).unwrap();
    }
    std::thread::sleep(Duration::from_millis(50));
    let extra: u64 = rs.iter().map(|r| r.imm_count(9) + r.imm_count(10)).sum();
    assert_eq!(extra, 0, "one immediate per named destination and call, none for the others");
    assert_eq!(&dsts[1][3..50_003], &src[10..50_010]);
    assert_eq!(&dsts[1][60_000..80_000], &src[70_000..90_000]);
    assert!(dsts[0].iter().all(|&x| x == 0));
    assert_eq!((counter.done(), counter.failed()), (1, 0), "the caller's completion ran exactly once");
    drop((a, rs, prepared));
}
