//! Staged transfers end to end, without a GPU: two engines in one process over tcp, with host
//! memory taking the staged path (`stage_host_memory`), so the whole protocol runs for real:
//! bounce copies, writes into the receiver's landing area, announcements and credits as control
//! messages, copies into place, immediates counted once per complete request. The same worker
//! code moves GPU memory; only the copies differ (CUDA streams instead of memcpy), and those
//! are covered by tests/gpu/test_gpu_network.py (its `tcp` transport).
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

mod common;
use common::Rng;

use fabric_lib::staging::StagingConfig;
use fabric_lib::{
    DomainChoice, EngineConfig, FabricError, MemoryKind, MrDescriptor, MrHandle, PagedWriteRequest, PollMode,
    ProviderSpec, TransferEngine, Trigger, WriteRequest,
};

const REGION: usize = 1 << 20;
const BOUND: Duration = Duration::from_secs(30);

fn engine(stage_host_memory: bool, transfer_timeout: Duration) -> TransferEngine {
    engine_on("tcp", stage_host_memory, transfer_timeout)
}

fn engine_on(provider: &str, stage_host_memory: bool, transfer_timeout: Duration) -> TransferEngine {
    let config = EngineConfig {
        provider: ProviderSpec::new(Some(provider), &[]),
        poll_mode: PollMode::ADAPTIVE,
        transfer_timeout,
        // Small chunks and few slots: many chunks per request, and writers wait for credits.
        staging: Some(StagingConfig { chunk_bytes: 16 << 10, slots: 3 }),
        stage_host_memory,
        ..Default::default()
    };
    TransferEngine::new(config).unwrap_or_else(|e| panic!("opening {provider}: {e}"))
}

struct Pair {
    a: TransferEngine,
    b: TransferEngine,
    src: MrHandle,
    dst: MrDescriptor,
    /// Messages the receiver's application saw: staging control messages must never show up.
    messages: Arc<Mutex<Vec<Vec<u8>>>>,
}

/// Engine `a` writes from `src_buf` into `dst_buf` of engine `b`; either end stages or not.
fn pair(src_buf: &mut [u8], dst_buf: &mut [u8], writer_stages: bool, receiver_stages: bool) -> Pair {
    pair_on("tcp", src_buf, dst_buf, writer_stages, receiver_stages)
}

fn pair_on(provider: &str, src_buf: &mut [u8], dst_buf: &mut [u8], writer_stages: bool, receiver_stages: bool) -> Pair {
    let a = engine_on(provider, writer_stages, Duration::from_secs(20));
    let b = engine_on(provider, receiver_stages, Duration::from_secs(20));
    // SAFETY: the buffers outlive the engines (each test drops the pair first).
    let (src, _) = unsafe { a.register_memory(src_buf.as_mut_ptr(), src_buf.len(), MemoryKind::Host) }.unwrap();
    // SAFETY: as above.
    let (_, dst) = unsafe { b.register_memory(dst_buf.as_mut_ptr(), dst_buf.len(), MemoryKind::Host) }.unwrap();
    assert_eq!(dst.staged_reachable(), receiver_stages, "the descriptor says whether it lands staged");
    let dst = MrDescriptor::from_bytes(&dst.to_bytes()).unwrap();
    let messages = Arc::new(Mutex::new(Vec::new()));
    let seen = messages.clone();
    b.set_recv_callback(Some(Arc::new(move |m: Vec<u8>| seen.lock().unwrap().push(m)))).unwrap();
    Pair { a, b, src, dst, messages }
}

fn filled(seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed);
    (0..REGION).map(|_| rng.next() as u8).collect()
}

/// Random single and paged writes into disjoint destination spans (sizes and offsets not
/// multiples of the chunk), all in flight at once; checks every byte and every count.
fn random_requests(writer_stages: bool, receiver_stages: bool, seed: u64) {
    random_requests_on("tcp", writer_stages, receiver_stages, seed)
}

fn random_requests_on(provider: &str, writer_stages: bool, receiver_stages: bool, seed: u64) {
    let mut src_buf = filled(seed);
    let mut dst_buf = vec![0u8; REGION];
    let p = pair_on(provider, &mut src_buf, &mut dst_buf, writer_stages, receiver_stages);
    let mut rng = Rng(seed + 17);
    let mut expected: Vec<Option<u8>> = vec![None; REGION];
    let (tx, rx) = mpsc::channel();
    let mut cursor = 0usize;
    let mut requests = 0u32;
    while REGION - cursor > 70_000 {
        let imm = 500 + requests;
        let tx = tx.clone();
        let on_done = Box::new(move |r| tx.send((imm, r)).unwrap());
        if rng.below(2) == 0 {
            let len = 1 + rng.below(60_000) as usize;
            let src_offset = rng.below((REGION - len) as u64) as usize;
            let dst_offset = cursor + rng.below(7) as usize;
            cursor = dst_offset + len;
            for k in 0..len {
                expected[dst_offset + k] = Some(src_buf[src_offset + k]);
            }
            let req = WriteRequest {
                src: p.src,
                src_offset: src_offset as u64,
                len: len as u64,
                dst: &p.dst,
                dst_offset: dst_offset as u64,
                imm: Some(imm),
                domains: DomainChoice::Shard(1),
            };
            p.a.submit_write(&req, on_done).unwrap();
        } else {
            let page = 1 + rng.below(9000) as usize;
            let pages = 1 + rng.below(6) as usize;
            let src_pages: Vec<u32> = (0..pages).map(|_| rng.below((REGION / page) as u64) as u32).collect();
            let mut dst_pages: Vec<u32> = (0..pages as u32).collect();
            for j in (1..pages).rev() {
                dst_pages.swap(j, rng.below(j as u64 + 1) as usize);
            }
            for (s, d) in src_pages.iter().zip(&dst_pages) {
                for k in 0..page {
                    expected[cursor + *d as usize * page + k] = Some(src_buf[*s as usize * page + k]);
                }
            }
            let req = PagedWriteRequest {
                page_len: page as u64,
                src: p.src,
                src_pages: &src_pages,
                src_stride: page as u64,
                src_offset: 0,
                dst: &p.dst,
                dst_pages: &dst_pages,
                dst_stride: page as u64,
                dst_offset: cursor as u64,
                imm: Some(imm),
            };
            p.a.submit_paged_writes(&req, on_done).unwrap();
            cursor += pages * page;
        }
        requests += 1;
    }
    for _ in 0..requests {
        let (imm, r) = rx.recv_timeout(BOUND).expect("every request completes in time");
        r.unwrap_or_else(|e| panic!("request with imm {imm} failed: {e}"));
    }
    for i in 0..requests {
        p.b.wait_imm_count(500 + i, 1, BOUND).unwrap();
    }
    // Counted once (consumed above), and nothing counted again.
    std::thread::sleep(Duration::from_millis(100));
    for i in 0..requests {
        assert_eq!(p.b.imm_count(500 + i), 0, "request {i} counted more than once");
    }
    assert!(p.messages.lock().unwrap().is_empty(), "a staging message reached the receive callback");
    // The staged path was taken, on the sides that stage.
    let (sent, landed) = (p.a.staging_stats(), p.b.staging_stats());
    assert_eq!(sent.requests_sent, u64::from(requests));
    let total: u64 = expected.iter().filter(|b| b.is_some()).count() as u64;
    assert_eq!(sent.bounced_bytes, if writer_stages { total } else { 0 });
    assert_eq!(landed.requests_landed, if receiver_stages { u64::from(requests) } else { 0 });
    assert_eq!(landed.landed_bytes, if receiver_stages { total } else { 0 });
    drop(p);
    for (i, want) in expected.iter().enumerate() {
        if let Some(b) = want {
            assert_eq!(dst_buf[i], *b, "byte {i} (seed {seed})");
        }
    }
    assert!(requests > 10);
}

#[test]
fn staged_both_ends_are_byte_exact_and_count_once() {
    random_requests(true, true, 1);
}

#[test]
fn staged_over_udp_rxd_too() {
    random_requests_on("udp;ofi_rxd", true, true, 10);
}

#[test]
fn a_landing_destination_takes_direct_writes_from_a_reachable_source() {
    // As host → GPU: no bounce on the writer, copies out of the landing area on the receiver.
    random_requests(false, true, 2);
}

#[test]
fn a_bounced_source_writes_straight_into_a_reachable_destination() {
    // As GPU → host: bounce copies on the writer, nothing staged on the receiver.
    random_requests(true, false, 3);
}

#[test]
fn a_thousand_consecutive_requests_are_counted_exactly() {
    let mut src_buf = filled(4);
    let mut dst_buf = vec![0u8; REGION];
    let p = pair(&mut src_buf, &mut dst_buf, true, true);
    let counter = fabric_lib::CompletionCounter::new();
    let mut rng = Rng(5);
    for i in 0..1000u64 {
        let len = 1 + rng.below(40_000);
        let req = WriteRequest {
            src: p.src,
            src_offset: i * 1000 % (REGION as u64 - len),
            len,
            dst: &p.dst,
            dst_offset: 0,
            imm: Some(7),
            domains: DomainChoice::Shard(1),
        };
        p.a.submit_write_counted(&req, &counter).unwrap();
    }
    counter.wait_for(1000, BOUND).unwrap();
    assert_eq!(counter.failed(), 0, "{:?}", counter.first_error());
    p.b.wait_imm_count(7, 1000, BOUND).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(p.b.imm_count(7), 0, "more than 1000 counted");
}

#[test]
fn a_zero_byte_staged_write_delivers_its_immediate() {
    let mut src_buf = filled(6);
    let mut dst_buf = vec![0u8; REGION];
    let p = pair(&mut src_buf, &mut dst_buf, true, true);
    let (tx, rx) = mpsc::channel();
    let req = WriteRequest {
        src: p.src,
        src_offset: 0,
        len: 0,
        dst: &p.dst,
        dst_offset: 0,
        imm: Some(9),
        domains: DomainChoice::Shard(1),
    };
    p.a.submit_write(&req, Box::new(move |r| tx.send(r).unwrap())).unwrap();
    rx.recv_timeout(BOUND).unwrap().unwrap();
    p.b.wait_imm_count(9, 1, BOUND).unwrap();
}

#[test]
fn a_stopped_receiver_fails_staged_writes_with_a_typed_error_in_time() {
    let mut src_buf = filled(7);
    let mut dst_buf = vec![0u8; REGION];
    let a = engine(true, Duration::from_secs(2));
    let b = engine(true, Duration::from_secs(2));
    // SAFETY: the buffers outlive the engines.
    let (src, _) = unsafe { a.register_memory(src_buf.as_mut_ptr(), REGION, MemoryKind::Host) }.unwrap();
    // SAFETY: as above.
    let (_, dst) = unsafe { b.register_memory(dst_buf.as_mut_ptr(), REGION, MemoryKind::Host) }.unwrap();
    b.stop();
    let (tx, rx) = mpsc::channel();
    let started = Instant::now();
    for i in 0..4u64 {
        let tx = tx.clone();
        let req = WriteRequest {
            src,
            src_offset: 0,
            len: 200_000,
            dst: &dst,
            dst_offset: i * 200_000,
            imm: Some(1),
            domains: DomainChoice::Shard(1),
        };
        a.submit_write(&req, Box::new(move |r| tx.send(r).unwrap())).unwrap();
    }
    for _ in 0..4 {
        let r = rx.recv_timeout(Duration::from_secs(15)).expect("a staged write to a dead receiver must not hang");
        assert!(
            matches!(
                r,
                Err(FabricError::Timeout(_)) | Err(FabricError::TransferFailed(_)) | Err(FabricError::PeerFenced(_))
            ),
            "{r:?}"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(15));
    // The source is settled: it can be unregistered once the requests failed.
    let deadline = Instant::now() + BOUND;
    while a.unregister_memory(src).is_err() {
        assert!(Instant::now() < deadline, "the failed staged requests never released their source");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The writer survives: staged writes to another receiver go through.
    let c = engine(true, Duration::from_secs(20));
    let mut other = vec![0u8; REGION];
    // SAFETY: the buffers outlive the engines.
    let (src, _) = unsafe { a.register_memory(src_buf.as_mut_ptr(), REGION, MemoryKind::Host) }.unwrap();
    // SAFETY: as above.
    let (_, dst) = unsafe { c.register_memory(other.as_mut_ptr(), REGION, MemoryKind::Host) }.unwrap();
    let (tx, rx) = mpsc::channel();
    let req = WriteRequest {
        src,
        src_offset: 0,
        len: 200_000,
        dst: &dst,
        dst_offset: 0,
        imm: Some(4),
        domains: DomainChoice::Shard(1),
    };
    a.submit_write(&req, Box::new(move |r| tx.send(r).unwrap())).unwrap();
    rx.recv_timeout(BOUND).expect("the survivor serves another receiver").unwrap();
    c.wait_imm_count(4, 1, BOUND).unwrap();
    drop((a, b, c));
    assert_eq!(&other[..200_000], &src_buf[..200_000]);
}

#[test]
fn a_receiver_without_the_region_refuses_with_a_typed_error() {
    let mut src_buf = filled(8);
    let mut dst_buf = vec![0u8; REGION];
    let a = engine(true, Duration::from_secs(20));
    let b = engine(true, Duration::from_secs(20));
    // SAFETY: the buffers outlive the engines.
    let (src, _) = unsafe { a.register_memory(src_buf.as_mut_ptr(), REGION, MemoryKind::Host) }.unwrap();
    // SAFETY: as above.
    let (dst_h, dst) = unsafe { b.register_memory(dst_buf.as_mut_ptr(), REGION, MemoryKind::Host) }.unwrap();
    b.unregister_memory(dst_h).unwrap();
    let (tx, rx) = mpsc::channel();
    let req = WriteRequest {
        src,
        src_offset: 0,
        len: 100_000,
        dst: &dst,
        dst_offset: 0,
        imm: Some(3),
        domains: DomainChoice::Shard(1),
    };
    a.submit_write(&req, Box::new(move |r| tx.send(r).unwrap())).unwrap();
    let r = rx.recv_timeout(Duration::from_secs(10)).expect("refused well before the transfer timeout");
    assert!(matches!(&r, Err(FabricError::TransferFailed(m)) if m.contains("no region registered")), "{r:?}");
    assert_eq!(b.imm_count(3), 0);
    drop(a);
    drop(b);
}

#[test]
fn slots_of_a_writer_that_went_away_serve_others_after_the_timeout() {
    let mut src_buf = filled(9);
    let mut dst_buf = vec![0u8; REGION];
    let a = engine(true, Duration::from_secs(20));
    let b = engine(true, Duration::from_secs(2));
    let c = engine(true, Duration::from_secs(20));
    // SAFETY: the buffers outlive the engines.
    let (src_a, _) = unsafe { a.register_memory(src_buf.as_mut_ptr(), REGION, MemoryKind::Host) }.unwrap();
    // SAFETY: as above (two registrations of one buffer, read only).
    let (src_c, _) = unsafe { c.register_memory(src_buf.as_mut_ptr(), REGION, MemoryKind::Host) }.unwrap();
    // SAFETY: as above.
    let (_, dst) = unsafe { b.register_memory(dst_buf.as_mut_ptr(), REGION, MemoryKind::Host) }.unwrap();
    // `a` keeps many chunks in flight and stops once some landed: the slots it was granted stay
    // with `b` until `b` gives up on its requests (no chunk for its transfer_timeout).
    for _ in 0..64 {
        let req = WriteRequest {
            src: src_a,
            src_offset: 0,
            len: REGION as u64,
            dst: &dst,
            dst_offset: 0,
            imm: Some(1),
            domains: DomainChoice::Shard(1),
        };
        a.submit_write(&req, Box::new(|_| {})).unwrap();
    }
    let deadline = Instant::now() + BOUND;
    while a.staging_stats().bounced_bytes == 0 {
        assert!(Instant::now() < deadline, "the first writer never got a slot");
        std::thread::yield_now();
    }
    a.stop();
    let landed = b.staging_stats().requests_landed;
    assert!(landed < 64, "the first writer finished before it stopped ({landed} requests landed)");
    let started = Instant::now();
    let (tx, rx) = mpsc::channel();
    let req = WriteRequest {
        src: src_c,
        src_offset: 0,
        len: 300_000,
        dst: &dst,
        dst_offset: 0,
        imm: Some(2),
        domains: DomainChoice::Shard(1),
    };
    c.submit_write(&req, Box::new(move |r| tx.send(r).unwrap())).unwrap();
    rx.recv_timeout(Duration::from_secs(15)).expect("the second writer completes").unwrap();
    b.wait_imm_count(2, 1, BOUND).unwrap();
    // It waited for `b` to give up on `a` (2 s), not for the whole bound.
    assert!(started.elapsed() >= Duration::from_millis(1500), "the abandoned slots were not held");
    drop((a, c, b));
    assert_eq!(&dst_buf[..300_000], &src_buf[..300_000]);
}

#[test]
fn an_armed_staged_write_fires_on_its_trigger() {
    let mut src_buf = filled(11);
    let mut dst_buf = vec![0u8; REGION];
    let p = pair(&mut src_buf, &mut dst_buf, true, true);
    let (tx, rx) = mpsc::channel();
    let req = WriteRequest {
        src: p.src,
        src_offset: 3,
        len: 100_000,
        dst: &p.dst,
        dst_offset: 5,
        imm: Some(61),
        domains: DomainChoice::Shard(1),
    };
    let when = Trigger { imm: 60, count: 1, timeout: Some(BOUND) };
    p.a.arm_write(when, &req, Box::new(move |r| tx.send(r).unwrap())).unwrap();
    assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "fired before its trigger");
    p.b.submit_imm_to(60, p.a.main_address(), Box::new(|_| {})).unwrap();
    rx.recv_timeout(BOUND).expect("fired and completed").unwrap();
    p.b.wait_imm_count(61, 1, BOUND).unwrap();
    assert_eq!(p.a.staging_stats().requests_sent, 1);
    drop(p);
    assert_eq!(&dst_buf[5..100_005], &src_buf[3..100_003]);
}

#[test]
fn staging_off_keeps_host_memory_on_the_plain_path_and_validates_sizes() {
    let bad = EngineConfig { staging: Some(StagingConfig { chunk_bytes: 1000, slots: 2 }), ..Default::default() };
    assert!(matches!(TransferEngine::new(bad), Err(FabricError::InvalidArgument(_))));
    let bad = EngineConfig { staging: None, stage_host_memory: true, ..Default::default() };
    assert!(matches!(TransferEngine::new(bad), Err(FabricError::InvalidArgument(_))));
}
