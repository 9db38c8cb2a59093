//! Two engines in one process, over real libfabric providers on loopback.
mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::register;
use fabric_lib::{
    DomainChoice, EngineConfig, FabricError, MrDescriptor, PollMode, ProviderSpec, TransferEngine, WriteRequest,
};

fn engine(provider: &str) -> TransferEngine {
    let config = EngineConfig {
        provider: ProviderSpec::new(Some(provider), &[]),
        poll_mode: PollMode::ADAPTIVE,
        transfer_timeout: Duration::from_secs(20),
        ..Default::default()
    };
    TransferEngine::new(config).unwrap_or_else(|e| panic!("opening {provider}: {e}"))
}

fn wait(rx: &mpsc::Receiver<fabric_lib::Result<()>>) {
    rx.recv_timeout(Duration::from_secs(20)).expect("completion in time").expect("transfer ok");
}

fn write_imm_and_message(provider: &str) {
    let mut src = vec![0u8; 1 << 20];
    let mut dst = vec![0u8; 1 << 20];
    for (i, b) in src.iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    let a = engine(provider);
    let b = engine(provider);
    let (src_h, _) = register(&a, &mut src);
    let (_, dst_desc) = register(&b, &mut dst);
    let dst_desc = MrDescriptor::from_bytes(&dst_desc.to_bytes()).unwrap();

    let (tx, rx) = mpsc::channel();
    let n_writes = 16u64;
    let chunk = (1u64 << 20) / n_writes;
    for i in 0..n_writes {
        let tx = tx.clone();
        let req = WriteRequest {
            src: src_h,
            src_offset: i * chunk,
            len: chunk,
            dst: &dst_desc,
            dst_offset: i * chunk,
            imm: Some(42),
            domains: DomainChoice::Shard(1),
        };
        a.submit_write(&req, Box::new(move |r| tx.send(r).unwrap())).unwrap();
    }
    b.wait_imm_count(42, n_writes, Duration::from_secs(20)).unwrap();
    for _ in 0..n_writes {
        wait(&rx);
    }
    assert!(src == dst, "every byte arrives");

    let tx2 = tx.clone();
    a.submit_imm(7, &dst_desc, Box::new(move |r| tx2.send(r).unwrap())).unwrap();
    wait(&rx);
    b.wait_imm_count(7, 1, Duration::from_secs(20)).unwrap();

    let (mtx, mrx) = mpsc::channel();
    b.set_recv_callback(Some(std::sync::Arc::new(move |m: Vec<u8>| mtx.send(m).unwrap()))).unwrap();
    let tx3 = tx.clone();
    a.submit_send(b.main_address(), b"hello fabric".to_vec(), Box::new(move |r| tx3.send(r).unwrap())).unwrap();
    wait(&rx);
    assert_eq!(mrx.recv_timeout(Duration::from_secs(20)).unwrap(), b"hello fabric");

    let bad = WriteRequest {
        src: src_h,
        src_offset: 1,
        len: 1 << 20,
        dst: &dst_desc,
        dst_offset: 0,
        imm: None,
        domains: DomainChoice::Shard(1),
    };
    assert!(matches!(a.submit_write(&bad, Box::new(|_| {})), Err(FabricError::InvalidArgument(_))));
    a.stop();
    a.stop();
    assert_eq!(a.submit_imm(1, &dst_desc, Box::new(|_| {})), Err(FabricError::Stopped));
    drop(a);
    drop(b);
}

#[test]
fn tcp_write_imm_and_message() {
    write_imm_and_message("tcp");
}

#[test]
fn shm_write_imm_and_message() {
    write_imm_and_message("shm");
}

#[test]
fn unknown_provider_is_a_typed_error() {
    let config = EngineConfig { provider: ProviderSpec::new(Some("no-such-provider"), &[]), ..Default::default() };
    assert!(matches!(TransferEngine::new(config), Err(FabricError::ProviderUnavailable(_))));
}

/// Two loopback domains per engine (the tcp provider lists `lo` for IPv4 and IPv6 separately is
/// not guaranteed, so both domains are `lo`): sharded single writes, paged writes, scatter and
/// barrier each deliver exactly one immediate per target.
#[test]
fn two_domains_shard_and_count_one_imm_per_request() {
    let mk = common::two_domain_loopback_engine;
    let (a, b, c) = (mk(), mk(), mk());
    assert_eq!(a.num_domains(), 2);
    let mut src: Vec<u8> = (0..(4u32 << 20)).map(|i| (i % 251) as u8).collect();
    let mut dst_b = vec![0u8; 4 << 20];
    let mut dst_c = vec![0u8; 4 << 20];
    let (src_h, _) = register(&a, &mut src);
    let (_, desc_b) = register(&b, &mut dst_b);
    let (_, desc_c) = register(&c, &mut dst_c);
    let (tx, rx) = mpsc::channel();
    let done = |tx: &mpsc::Sender<fabric_lib::Result<()>>| {
        let tx = tx.clone();
        Box::new(move |r| tx.send(r).unwrap()) as fabric_lib::OnDone
    };

    // Sharded single write: 1 MiB + 3 over both domains, one imm.
    let req = WriteRequest {
        src: src_h,
        src_offset: 5,
        len: (1 << 20) + 3,
        dst: &desc_b,
        dst_offset: 7,
        imm: Some(1),
        domains: DomainChoice::Shard(2),
    };
    a.submit_write(&req, done(&tx)).unwrap();
    wait(&rx);
    b.wait_imm_count(1, 1, Duration::from_secs(20)).unwrap();
    assert_eq!(&dst_b[7..7 + (1 << 20) + 3], &src[5..5 + (1 << 20) + 3]);

    // Paged write: 64 pages of 4 KiB, reversed order, one imm.
    let src_pages: Vec<u32> = (0..64).collect();
    let dst_pages: Vec<u32> = (0..64).rev().collect();
    let paged = fabric_lib::PagedWriteRequest {
        page_len: 4096,
        src: src_h,
        src_pages: &src_pages,
        src_stride: 4096,
        src_offset: 1,
        dst: &desc_c,
        dst_pages: &dst_pages,
        dst_stride: 8192,
        dst_offset: 3,
        imm: Some(2),
    };
    a.submit_paged_writes(&paged, done(&tx)).unwrap();
    wait(&rx);
    c.wait_imm_count(2, 1, Duration::from_secs(20)).unwrap();
    for (s, d) in src_pages.iter().zip(&dst_pages) {
        let (s, d) = (*s as usize * 4096 + 1, *d as usize * 8192 + 3);
        assert_eq!(&dst_c[d..d + 4096], &src[s..s + 4096]);
    }
    let bad = fabric_lib::PagedWriteRequest { dst_pages: &[0; 64][..], src_pages: &[4096; 64][..], ..paged };
    assert!(matches!(a.submit_paged_writes(&bad, done(&tx)), Err(FabricError::InvalidArgument(_))));

    // Scatter by bytes to two peers, and a barrier: one imm per target each.
    let group = a.add_peer_group(&[b.main_address().clone(), c.main_address().clone()]).unwrap();
    let targets = [
        fabric_lib::ScatterTarget { len: 600_000, src_offset: 0, dst: &desc_b, dst_offset: 2 << 20 },
        fabric_lib::ScatterTarget { len: 300_000, src_offset: 600_000, dst: &desc_c, dst_offset: 3 << 20 },
    ];
    a.submit_scatter(Some(group), src_h, &targets, Some(3), fabric_lib::ScatterSharding::ByBytes, done(&tx)).unwrap();
    wait(&rx);
    a.submit_barrier(4, group, done(&tx)).unwrap();
    wait(&rx);
    for e in [&b, &c] {
        e.wait_imm_count(3, 1, Duration::from_secs(20)).unwrap();
        e.wait_imm_count(4, 1, Duration::from_secs(20)).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(e.imm_count(3) + e.imm_count(4) + e.imm_count(1) + e.imm_count(2), 0, "no extra immediates");
    }
    assert_eq!(&dst_b[2 << 20..(2 << 20) + 600_000], &src[..600_000]);
    assert_eq!(&dst_c[3 << 20..(3 << 20) + 300_000], &src[600_000..900_000]);
    drop((a, b, c));
}

/// Pages adjacent on both sides go as one write; the others stay one write each, and every
/// byte lands where its page says.
#[test]
fn paged_writes_merge_pages_adjacent_on_both_sides() {
    const PAGE: usize = 4096;
    let mut src: Vec<u8> = (0..64 * PAGE).map(|i| (i * 13 + 5) as u8).collect();
    let mut dst = vec![0u8; 128 * PAGE];
    let a = engine("tcp");
    let b = engine("tcp");
    let (src_h, _) = register(&a, &mut src);
    let (_, desc) = register(&b, &mut dst);
    // 0..32 -> 40..72 (one run); then 8 scattered pages, none adjacent to the previous one.
    let mut src_pages: Vec<u32> = (0..32).collect();
    let mut dst_pages: Vec<u32> = (40..72).collect();
    src_pages.extend([50, 40, 60, 33, 45, 35, 63, 37]);
    dst_pages.extend([0, 2, 4, 6, 8, 10, 12, 14]);
    let posted = |e: &TransferEngine| e.domain_stats().iter().map(|s| s.ops).sum::<u64>();
    let before = posted(&a);
    let (tx, rx) = mpsc::channel();
    let req = fabric_lib::PagedWriteRequest {
        page_len: PAGE as u64,
        src: src_h,
        src_pages: &src_pages,
        src_stride: PAGE as u64,
        src_offset: 0,
        dst: &desc,
        dst_pages: &dst_pages,
        dst_stride: PAGE as u64,
        dst_offset: 0,
        imm: Some(9),
    };
    a.submit_paged_writes(&req, Box::new(move |r| tx.send(r).unwrap())).unwrap();
    wait(&rx);
    b.wait_imm_count(9, 1, Duration::from_secs(20)).unwrap();
    for (s, d) in src_pages.iter().zip(&dst_pages) {
        let (s, d) = (*s as usize * PAGE, *d as usize * PAGE);
        assert_eq!(&dst[d..d + PAGE], &src[s..s + PAGE], "page {s} -> {d}");
    }
    // 1 run + 8 pages, plus the immediate (a separate zero-byte write when there are several).
    assert_eq!(posted(&a) - before, 1 + 8 + 1, "adjacent pages were not merged");
}

#[test]
fn counters_of_interleaved_requests_each_count_their_own() {
    // The worker raises a counter once per run of requests on it: runs of every length, on
    // counters interleaved in one completion batch, must still add up exactly.
    let mut src = vec![5u8; 1 << 16];
    let mut dst = vec![0u8; 1 << 16];
    let a = engine("shm");
    let b = engine("shm");
    let (src_h, _) = register(&a, &mut src);
    let (_, dst_desc) = register(&b, &mut dst);
    let counters = [fabric_lib::CompletionCounter::new(), fabric_lib::CompletionCounter::new()];
    let mut rng = common::Rng(11);
    let mut expected = [0u64; 2];
    for i in 0..2000u64 {
        let which = (rng.below(3) == 0) as usize; // runs of the first, single requests of the second
        let req = WriteRequest {
            src: src_h,
            src_offset: i % 1024 * 64,
            len: 64,
            dst: &dst_desc,
            dst_offset: i % 1024 * 64,
            imm: Some(3),
            domains: DomainChoice::Shard(1),
        };
        a.submit_write_counted(&req, &counters[which]).unwrap();
        expected[which] += 1;
    }
    for (counter, n) in counters.iter().zip(expected) {
        counter.wait_for(n, Duration::from_secs(20)).unwrap();
    }
    b.wait_imm_count(3, 2000, Duration::from_secs(20)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    for (counter, n) in counters.iter().zip(expected) {
        assert_eq!((counter.done(), counter.failed()), (n, 0), "no completion counted twice or lost");
    }
    assert!(dst == src, "every write landed");
}
