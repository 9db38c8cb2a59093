//! Same-host host-memory writes and immediates between two engines of one process
//! (`same_host_host_memory`): plain copies into the peer's region and immediates through its
//! shared-memory inbox (opened through this process's own `/proc/self/fd`), nothing posted on a
//! domain. (Between processes: tests/processes/test_same_host_inbox.py.)
use std::sync::mpsc;
use std::time::Duration;

use fabric_lib::{
    DomainChoice, EngineConfig, MemoryKind, PagedWriteRequest, PollMode, ProviderSpec, TransferEngine, WriteRequest,
};

const T: Duration = Duration::from_secs(20);

fn engine(same_host: bool, inbox_slots: usize) -> TransferEngine {
    TransferEngine::new(EngineConfig {
        provider: ProviderSpec::new(Some("tcp"), &[]),
        poll_mode: PollMode::ADAPTIVE,
        transfer_timeout: T,
        same_host_host_memory: same_host,
        same_host_inbox_slots: inbox_slots,
        ..Default::default()
    })
    .expect("opening tcp")
}

fn posted(e: &TransferEngine) -> u64 {
    e.domain_stats().iter().map(|s| s.ops).sum()
}

/// Single and paged writes with immediates plus immediate-only requests, every byte and count
/// exact; returns what the writer posted on its domains.
fn round(inbox_slots: usize) -> u64 {
    let mut src: Vec<u8> = (0..1 << 16).map(|i| (i * 13 + 5) as u8).collect();
    let mut dst = vec![0u8; 1 << 16];
    let a = engine(true, 4096);
    let b = engine(false, inbox_slots);
    assert_eq!(b.main_address().inbox.is_some(), inbox_slots > 0);
    // SAFETY: both buffers outlive the engines (dropped at the end of this function, first).
    let (src_h, _) = unsafe { a.register_memory(src.as_mut_ptr(), src.len(), MemoryKind::Host) }.unwrap();
    // SAFETY: as above.
    let (_, dst_desc) = unsafe { b.register_memory(dst.as_mut_ptr(), dst.len(), MemoryKind::Host) }.unwrap();
    let (tx, rx) = mpsc::channel();
    let done = |tx: &mpsc::Sender<fabric_lib::Result<()>>| {
        let tx = tx.clone();
        Box::new(move |r| tx.send(r).unwrap())
    };
    for i in 0..16u64 {
        let req = WriteRequest {
            src: src_h,
            src_offset: i * 2048,
            len: 2048,
            dst: &dst_desc,
            dst_offset: i * 2048,
            imm: Some(1),
            domains: DomainChoice::Shard(1),
        };
        a.submit_write(&req, done(&tx)).unwrap();
    }
    let (src_pages, dst_pages): (Vec<u32>, Vec<u32>) = (0..16).map(|i| (i, 31 - i)).unzip();
    let paged = PagedWriteRequest {
        page_len: 1024,
        src: src_h,
        src_pages: &src_pages,
        src_stride: 1024,
        src_offset: 0,
        dst: &dst_desc,
        dst_pages: &dst_pages,
        dst_stride: 1024,
        dst_offset: 1 << 15,
        imm: Some(2),
    };
    a.submit_paged_writes(&paged, done(&tx)).unwrap();
    for _ in 0..100 {
        a.submit_imm_to(3, b.main_address(), done(&tx)).unwrap();
    }
    for _ in 0..117 {
        rx.recv_timeout(T).expect("completion in time").expect("request ok");
    }
    b.wait_imm_count(1, 16, T).unwrap();
    b.wait_imm_count(2, 1, T).unwrap();
    b.wait_imm_count(3, 100, T).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!([1, 2, 3].map(|imm| b.imm_count(imm)), [0; 3], "an immediate was counted twice");
    assert_eq!(dst[..1 << 15], src[..1 << 15]);
    for (s, d) in src_pages.iter().zip(&dst_pages) {
        let (s, d) = (*s as usize * 1024, (1 << 15) + *d as usize * 1024);
        assert_eq!(dst[d..d + 1024], src[s..s + 1024], "page {s} -> {d}");
    }
    assert_eq!(b.refused_immediates(), 0);
    let n = posted(&a);
    a.stop();
    b.stop();
    n
}

#[test]
fn same_host_writes_and_immediates_skip_the_provider() {
    assert_eq!(round(64), 0, "everything went through the inbox");
}

#[test]
fn without_an_inbox_the_immediates_take_the_provider() {
    assert_eq!(round(0), 16 + 1 + 100, "one zero-byte write per immediate");
}

#[test]
fn an_inbox_that_cannot_be_opened_falls_back_to_the_provider() {
    let a = engine(true, 4096);
    let b = engine(false, 4096);
    // The address names descriptor 0 (not an inbox memfd), or carries a stale nonce: the writer
    // refuses to map it and announces over the provider instead.
    for forge in [|i: &mut fabric_lib::InboxAddress| i.fd = 0, |i: &mut fabric_lib::InboxAddress| i.nonce ^= 1] {
        let mut peer = b.main_address().clone();
        forge(peer.inbox.as_mut().expect("b has an inbox"));
        let before = posted(&a);
        let (tx, rx) = mpsc::channel();
        for _ in 0..10 {
            let tx = tx.clone();
            a.submit_imm_to(9, &peer, Box::new(move |r| tx.send(r).unwrap())).unwrap();
        }
        for _ in 0..10 {
            rx.recv_timeout(T).expect("completion in time").expect("request ok");
        }
        b.wait_imm_count(9, 10, T).unwrap();
        assert_eq!(posted(&a) - before, 10, "each immediate went over the provider");
    }
    a.stop();
    b.stop();
}

#[test]
fn inbox_immediates_fire_triggers_and_triggered_immediates_take_the_inbox() {
    let a = engine(true, 64);
    let b = engine(true, 64);
    // B answers every 10 immediates 5 from A with one immediate 6 into A's inbox: an echo with
    // no thread hand-off on either side of the shared memory.
    for round in 1..=20u64 {
        let (tx, rx) = mpsc::channel();
        let when = fabric_lib::Trigger { imm: 5, count: 10, timeout: None };
        let echo = tx.clone();
        b.arm_imm_to(when, 6, a.main_address(), Box::new(move |r| echo.send(r).unwrap())).unwrap();
        for _ in 0..10 {
            let tx = tx.clone();
            a.submit_imm_to(5, b.main_address(), Box::new(move |r| tx.send(r).unwrap())).unwrap();
        }
        for _ in 0..11 {
            rx.recv_timeout(T).expect("completion in time").expect("request ok");
        }
        a.wait_imm_count(6, 1, T).unwrap_or_else(|e| panic!("round {round}: {e}"));
    }
    assert_eq!(b.imm_count(5), 0, "the trigger consumed what it counted");
    assert_eq!((posted(&a), posted(&b)), (0, 0), "nothing went over the provider");
    a.stop();
    b.stop();
}
