//! The protocol end to end with real threads: a writer thread and a receiver thread share a
//! landing area (the receiver's registered host memory, written by "RDMA") and talk over channels
//! (announcements one way, credits the other). Bytes, credits and immediates are all checked.
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};

use super::*;

/// Deterministic pseudo-random numbers (xorshift), so failures reproduce.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One staged request as the writer sees it.
struct Request {
    id: u64,
    imm: u32,
    /// (src offset, dst offset, len) pieces: one for a single write, one per page for paged.
    pieces: Vec<(u64, u64, u64)>,
}

const REGION: usize = 1 << 20;

struct Landing {
    slots: Vec<Mutex<Vec<u8>>>,
    /// Slots a writer is filling or the receiver is draining: never more than the pool has.
    busy: AtomicUsize,
    max_busy: AtomicUsize,
}

/// Runs the receiver until `wire` closes: checks and copies each announced chunk into `dst`,
/// gives the slot back as a credit, counts immediates of complete requests.
fn receiver(
    config: StagingConfig,
    landing: Arc<Landing>,
    wire: Receiver<Vec<u8>>,
    credits: Sender<u32>,
    slow: bool,
) -> (Vec<u8>, HashMap<u32, u32>, usize) {
    let mut dst = vec![0u8; REGION];
    let mut pool = SlotPool::new(config.slots as u32);
    while let Some(slot) = pool.acquire() {
        credits.send(slot).unwrap();
    }
    let mut requests: HashMap<u64, Reassembly> = HashMap::new();
    let mut counted: HashMap<u32, u32> = HashMap::new();
    let mut refused = 0;
    let mut rng = Rng(99);
    for bytes in wire {
        let h = ChunkHeader::from_bytes(&bytes).unwrap();
        h.check(config.slots as u32, config.chunk_bytes as u64, REGION as u64).unwrap();
        assert!(pool.is_held(h.slot), "a chunk arrived in slot {} that was not granted", h.slot);
        let r = requests.entry(h.request).or_insert_with(|| Reassembly::new(&h));
        if r.admit(&h).is_ok() {
            let slot = landing.slots[h.slot as usize].lock().unwrap();
            for p in &h.pieces {
                let (s, d, n) = (p.slot_offset as usize, p.dst_offset as usize, p.len as usize);
                dst[d..d + n].copy_from_slice(&slot[s..s + n]);
            }
            if let Progress::Complete { imm: Some(imm) } = r.accept(&h).unwrap() {
                *counted.entry(imm).or_default() += 1;
            }
        } else {
            refused += 1;
        }
        if slow && rng.below(4) == 0 {
            std::thread::sleep(Duration::from_micros(300));
        }
        landing.busy.fetch_sub(1, Ordering::SeqCst);
        // Drained: the slot goes back to the pool and out again as the next credit.
        pool.release(h.slot).unwrap();
        let slot = pool.acquire().expect("a slot was just released");
        let _ = credits.send(slot);
    }
    (dst, counted, refused)
}

/// Sends every chunk of `requests`, interleaving requests chunk by chunk (as a worker with
/// several requests in flight does); each chunk waits for a credit first.
fn writer(
    config: StagingConfig,
    landing: &Landing,
    src: &[u8],
    requests: &[Request],
    credits: &Receiver<u32>,
    wire: &Sender<Vec<u8>>,
    stop_after_chunks: Option<usize>,
) {
    let mut plans: Vec<_> = requests
        .iter()
        .map(|r| (r, plan_chunks(r.pieces.iter().copied(), config.chunk_bytes as u64).unwrap(), 0usize))
        .collect();
    let total: u64 = requests.iter().flat_map(|r| r.pieces.iter().map(|p| p.2)).sum();
    let mut sent = 0;
    loop {
        let mut progressed = false;
        for (request, chunks, next) in plans.iter_mut() {
            let Some(chunk) = chunks.get(*next) else { continue };
            if stop_after_chunks == Some(sent) {
                return;
            }
            let slot = credits.recv_timeout(Duration::from_secs(10)).expect("a credit within 10 s");
            let busy = landing.busy.fetch_add(1, Ordering::SeqCst) + 1;
            landing.max_busy.fetch_max(busy, Ordering::SeqCst);
            {
                let mut bytes = landing.slots[slot as usize].lock().unwrap();
                for p in &chunk.pieces {
                    let (s, o, n) = (p.src_offset as usize, p.slot_offset as usize, p.len as usize);
                    bytes[o..o + n].copy_from_slice(&src[s..s + n]);
                }
            }
            let h = ChunkHeader::for_chunk(
                request.id,
                0,
                chunks.len() as u32,
                request.pieces.iter().map(|p| p.2).sum(),
                Some(request.imm),
                slot,
                chunk,
            );
            wire.send(h.to_bytes()).unwrap();
            *next += 1;
            sent += 1;
            progressed = true;
        }
        if !progressed {
            break;
        }
    }
    assert!(total == 0 || sent > 0);
}

fn landing(config: StagingConfig) -> Arc<Landing> {
    Arc::new(Landing {
        slots: (0..config.slots).map(|_| Mutex::new(vec![0u8; config.chunk_bytes])).collect(),
        busy: AtomicUsize::new(0),
        max_busy: AtomicUsize::new(0),
    })
}

/// Random single and paged requests whose destinations do not overlap (each byte has one
/// expected value), with the bytes they should leave in the destination.
fn random_requests(rng: &mut Rng, src: &[u8], count: usize) -> (Vec<Request>, Vec<Option<u8>>) {
    let mut expected = vec![None; REGION];
    let mut requests = Vec::new();
    let mut cursor = 0usize;
    for i in 0..count {
        let room = REGION - cursor;
        if room < 64 {
            break;
        }
        let pieces = if rng.below(2) == 0 {
            let len = 1 + rng.below((room as u64 / 3).min(200_000)) as usize;
            let src_off = rng.below((REGION - len) as u64) as usize;
            let dst_off = cursor + rng.below(8) as usize;
            let len = len.min(REGION - dst_off);
            cursor = dst_off + len;
            vec![(src_off as u64, dst_off as u64, len as u64)]
        } else {
            // (A request of no bytes is a plain immediate: it is never staged.)
            let page = 1 + rng.below(9000.min(room as u64 - 1)) as usize;
            let pages = (1 + rng.below(12) as usize).min(room / page);
            let base = cursor;
            // Destination pages in shuffled order within the request's span.
            let mut order: Vec<usize> = (0..pages).collect();
            for j in (1..order.len()).rev() {
                order.swap(j, rng.below(j as u64 + 1) as usize);
            }
            cursor = base + pages * page;
            order.iter().map(|&d| (rng.below((REGION - page) as u64), (base + d * page) as u64, page as u64)).collect()
        };
        for &(s, d, n) in &pieces {
            for k in 0..n as usize {
                expected[d as usize + k] = Some(src[s as usize + k]);
            }
        }
        requests.push(Request { id: i as u64 + 1, imm: 100 + i as u32, pieces });
    }
    (requests, expected)
}

fn run(config: StagingConfig, seed: u64, slow: bool) {
    let mut rng = Rng(seed);
    let src: Vec<u8> = (0..REGION).map(|_| rng.next() as u8).collect();
    let (requests, expected) = random_requests(&mut rng, &src, 40);
    let landing = landing(config);
    let (wire_tx, wire_rx) = bounded::<Vec<u8>>(config.slots);
    let (credit_tx, credit_rx) = unbounded::<u32>();
    let rx_landing = landing.clone();
    let rx = std::thread::spawn(move || receiver(config, rx_landing, wire_rx, credit_tx, slow));
    writer(config, &landing, &src, &requests, &credit_rx, &wire_tx, None);
    drop(wire_tx);
    let (dst, counted, refused) = rx.join().unwrap();
    assert_eq!(refused, 0);
    for (i, want) in expected.iter().enumerate() {
        if let Some(b) = want {
            assert_eq!(dst[i], *b, "byte {i} (seed {seed})");
        }
    }
    for r in &requests {
        assert_eq!(counted.get(&r.imm), Some(&1), "request {} counted exactly once", r.id);
    }
    assert_eq!(counted.len(), requests.len());
    assert!(landing.max_busy.load(Ordering::SeqCst) <= config.slots, "credits bound the landing area");
}

#[test]
fn staged_requests_land_byte_exact_and_count_once() {
    for seed in [1, 2, 3] {
        run(StagingConfig { chunk_bytes: 4096, slots: 3 }, seed, false);
    }
    run(StagingConfig { chunk_bytes: 64 << 10, slots: 8 }, 4, false);
}

#[test]
fn a_slow_receiver_holds_the_writer_back_and_loses_nothing() {
    run(StagingConfig { chunk_bytes: 4096, slots: 2 }, 5, true);
}

#[test]
fn an_incomplete_request_is_never_counted() {
    let config = StagingConfig { chunk_bytes: 4096, slots: 2 };
    let src = vec![7u8; REGION];
    let requests = vec![Request { id: 1, imm: 5, pieces: vec![(0, 0, 5 * 4096)] }];
    let landing = landing(config);
    let (wire_tx, wire_rx) = bounded::<Vec<u8>>(config.slots);
    let (credit_tx, credit_rx) = unbounded::<u32>();
    let rx_landing = landing.clone();
    let rx = std::thread::spawn(move || receiver(config, rx_landing, wire_rx, credit_tx, false));
    // The writer dies after 4 of 5 chunks.
    writer(config, &landing, &src, &requests, &credit_rx, &wire_tx, Some(4));
    drop(wire_tx);
    let (dst, counted, _) = rx.join().unwrap();
    assert!(counted.is_empty(), "nothing counted for an incomplete request");
    assert!(dst[..4 * 4096].iter().all(|&b| b == 7) && dst[4 * 4096..5 * 4096].iter().all(|&b| b == 0));
}

#[test]
fn staging_sizes_are_checked() {
    StagingConfig::default().validate().unwrap();
    for bad in [
        StagingConfig { chunk_bytes: 0, slots: 1 },
        StagingConfig { chunk_bytes: 5000, slots: 1 },
        StagingConfig { chunk_bytes: 128 << 20, slots: 1 },
        StagingConfig { chunk_bytes: 4096, slots: 0 },
        StagingConfig { chunk_bytes: 64 << 20, slots: 4096 },
    ] {
        assert!(matches!(bad.validate(), Err(FabricError::InvalidArgument(_))), "{bad:?}");
    }
}
