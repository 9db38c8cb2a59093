//! Scatter over the staged path, without a GPU: engines over tcp with host memory taking the
//! staged path (`stage_host_memory`, as in tests/staged.rs), so a scatter's targets take the
//! paths GPU memory takes: bounced from the source, into a receiver's landing area, or plain
//! writes, mixed in one request. Each target must be planned like a single write of its slice,
//! each receiver count the immediate once per target addressed to it, after the bytes are in
//! place, and the caller's completion run exactly once.
mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{register, Rng};
use fabric_lib::staging::StagingConfig;
use fabric_lib::{EngineConfig, FabricError, PollMode, ProviderSpec, ScatterSharding, ScatterTarget, TransferEngine};

const REGION: usize = 1 << 20;
const BOUND: Duration = Duration::from_secs(30);

fn engine(stage_host_memory: bool, transfer_timeout: Duration) -> TransferEngine {
    let config = EngineConfig {
        provider: ProviderSpec::new(Some("tcp"), &[]),
        poll_mode: PollMode::ADAPTIVE,
        transfer_timeout,
        // Small chunks and few slots: targets of several chunks, writers waiting for credits.
        staging: Some(StagingConfig { chunk_bytes: 16 << 10, slots: 3 }),
        stage_host_memory,
        ..Default::default()
    };
    TransferEngine::new(config).expect("opening tcp")
}

fn filled(seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed);
    (0..REGION).map(|_| rng.next() as u8).collect()
}

/// Random scatters from one writer to a receiver that stages (landing area) and one that does
/// not, several targets per receiver, zero-byte targets included; every byte and count checked.
fn random_scatters(writer_stages: bool, seed: u64) {
    let mut src_buf = filled(seed);
    let mut dst_bufs = [vec![0u8; REGION], vec![0u8; REGION]];
    let a = engine(writer_stages, Duration::from_secs(20));
    let receivers = [engine(true, Duration::from_secs(20)), engine(false, Duration::from_secs(20))];
    let (src, _) = register(&a, &mut src_buf);
    let [d0, d1] = &mut dst_bufs;
    let dsts = [register(&receivers[0], d0).1, register(&receivers[1], d1).1];
    assert!(dsts[0].staged_reachable() && !dsts[1].staged_reachable());
    let mut rng = Rng(seed + 31);
    let mut expected: [Vec<Option<u8>>; 2] = [vec![None; REGION], vec![None; REGION]];
    let mut cursors = [0usize; 2];
    let mut counts = [[0u64; 2]; 16];
    let mut staged_bytes = [0u64; 2];
    let (tx, rx) = mpsc::channel();
    let mut scatters = 0;
    while cursors.iter().all(|c| REGION - c > 200_000) && scatters < 16 {
        let n = 1 + rng.below(5) as usize;
        let mut targets = Vec::with_capacity(n);
        for _ in 0..n {
            let r = rng.below(2) as usize;
            let len = if rng.below(6) == 0 { 0 } else { 1 + rng.below(40_000) as usize };
            let src_offset = rng.below((REGION - len) as u64) as usize;
            let dst_offset = cursors[r] + rng.below(9) as usize;
            cursors[r] = dst_offset + len;
            for k in 0..len {
                expected[r][dst_offset + k] = Some(src_buf[src_offset + k]);
            }
            counts[scatters][r] += 1;
            if writer_stages {
                staged_bytes[0] += len as u64;
            }
            if r == 0 {
                staged_bytes[1] += len as u64;
            }
            targets.push(ScatterTarget {
                len: len as u64,
                src_offset: src_offset as u64,
                dst: &dsts[r],
                dst_offset: dst_offset as u64,
            });
        }
        let imm = 700 + scatters as u32;
        let sharding = if rng.below(2) == 0 { ScatterSharding::ByPeer } else { ScatterSharding::ByBytes };
        let tx = tx.clone();
        a.submit_scatter(None, src, &targets, Some(imm), sharding, Box::new(move |r| tx.send((imm, r)).unwrap()))
            .unwrap();
        scatters += 1;
    }
    for _ in 0..scatters {
        let (imm, r) = rx.recv_timeout(BOUND).expect("every scatter completes in time");
        r.unwrap_or_else(|e| panic!("scatter with imm {imm} failed: {e}"));
    }
    assert!(rx.recv_timeout(Duration::from_millis(100)).is_err(), "a scatter completed twice");
    for (i, per_receiver) in counts.iter().enumerate().take(scatters) {
        for (r, e) in receivers.iter().enumerate() {
            let imm = 700 + i as u32;
            if per_receiver[r] > 0 {
                e.wait_imm_count(imm, per_receiver[r], BOUND).unwrap();
            }
        }
    }
    std::thread::sleep(Duration::from_millis(100));
    for i in 0..scatters {
        for e in &receivers {
            assert_eq!(e.imm_count(700 + i as u32), 0, "scatter {i} counted more than once per target");
        }
    }
    assert_eq!(a.staging_stats().bounced_bytes, staged_bytes[0]);
    assert_eq!(receivers[0].staging_stats().landed_bytes, staged_bytes[1]);
    assert_eq!(receivers[1].staging_stats().landed_bytes, 0);
    drop((a, receivers));
    for (r, buf) in dst_bufs.iter().enumerate() {
        for (i, want) in expected[r].iter().enumerate() {
            if let Some(b) = want {
                assert_eq!(buf[i], *b, "receiver {r} byte {i} (seed {seed})");
            }
        }
    }
}

#[test]
fn staged_scatter_targets_are_byte_exact_and_counted_once_each() {
    // As GPU -> GPU (bounce and landing) and GPU -> host (bounce, plain writes).
    random_scatters(true, 1);
}

#[test]
fn staged_and_plain_targets_share_one_scatter() {
    // As host -> GPU (landing) next to host -> host (one plain network request).
    random_scatters(false, 2);
}

#[test]
fn a_scatter_with_a_dead_target_fails_once_and_the_live_target_lands() {
    let mut src_buf = filled(3);
    let (mut d0, mut d1) = (vec![0u8; REGION], vec![0u8; REGION]);
    let a = engine(true, Duration::from_secs(2));
    let dead = engine(true, Duration::from_secs(2));
    let live = engine(true, Duration::from_secs(20));
    let (src, _) = register(&a, &mut src_buf);
    let dst_dead = register(&dead, &mut d0).1;
    let dst_live = register(&live, &mut d1).1;
    dead.stop();
    let targets = [
        ScatterTarget { len: 300_000, src_offset: 0, dst: &dst_dead, dst_offset: 0 },
        ScatterTarget { len: 200_000, src_offset: 7, dst: &dst_live, dst_offset: 3 },
    ];
    let (tx, rx) = mpsc::channel();
    let started = Instant::now();
    a.submit_scatter(None, src, &targets, Some(5), ScatterSharding::ByPeer, Box::new(move |r| tx.send(r).unwrap()))
        .unwrap();
    let r = rx.recv_timeout(Duration::from_secs(15)).expect("a scatter to a dead receiver must not hang");
    assert!(
        matches!(
            r,
            Err(FabricError::Timeout(_)) | Err(FabricError::TransferFailed(_)) | Err(FabricError::PeerFenced(_))
        ),
        "{r:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(15));
    assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "reported more than once");
    live.wait_imm_count(5, 1, BOUND).unwrap();
    drop((a, dead, live));
    assert_eq!(&d1[3..200_003], &src_buf[7..200_007]);
}

#[test]
fn a_refused_scatter_target_posts_nothing() {
    let mut src_buf = filled(4);
    let mut d0 = vec![0u8; REGION];
    let a = engine(true, Duration::from_secs(20));
    let b = engine(true, Duration::from_secs(20));
    let (src, _) = register(&a, &mut src_buf);
    let dst = register(&b, &mut d0).1;
    let targets = [
        ScatterTarget { len: 1000, src_offset: 0, dst: &dst, dst_offset: 0 },
        ScatterTarget { len: 1000, src_offset: 0, dst: &dst, dst_offset: REGION as u64 - 999 },
    ];
    let r = a.submit_scatter(None, src, &targets, Some(6), ScatterSharding::ByPeer, Box::new(|_| panic!("ran")));
    assert!(matches!(r, Err(FabricError::InvalidArgument(_))), "{r:?}");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(b.imm_count(6), 0);
    assert_eq!(a.staging_stats().requests_sent, 0, "nothing was posted");
}
