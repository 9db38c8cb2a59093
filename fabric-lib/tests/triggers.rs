//! Triggered requests (`arm_write`, `arm_imm`, `arm_send`): posted by the worker once an
//! immediate count is reached, byte- and count-exact over every loopback provider, including
//! `udp;ofi_rxd`, whose deliveries arrive in any order.
mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use common::register;
use fabric_lib::{DomainChoice, FabricError, MrDescriptor, MrHandle, TransferEngine, Trigger, WriteRequest};

const TIMEOUT: Duration = Duration::from_secs(20);
const PROVIDERS: [&str; 3] = ["tcp", "udp;ofi_rxd", "shm"];

fn engine(provider: &str) -> Option<TransferEngine> {
    common::engine_if_available(provider, TIMEOUT)
}

fn when(imm: u32, count: u64) -> Trigger {
    Trigger { imm, count, timeout: None }
}

/// A completion callback and the receiver of its outcome.
fn outcome() -> (fabric_lib::OnDone, mpsc::Receiver<fabric_lib::Result<()>>) {
    let (tx, rx) = mpsc::channel();
    (Box::new(move |r| tx.send(r).unwrap()), rx)
}

fn write(src: MrHandle, dst: &MrDescriptor, offset: u64, len: u64, imm: Option<u32>) -> WriteRequest<'_> {
    WriteRequest { src, src_offset: offset, len, dst, dst_offset: offset, imm, domains: DomainChoice::Shard(1) }
}

/// A → B: `pages` writes, each with immediate 10; B is armed to forward its whole buffer to C
/// with immediate 20 once it counted all of them. C must see every byte A wrote, and exactly one
/// immediate 20; B's counter must not see the immediates its trigger consumed.
fn proxy_forwards_exactly(provider: &str) {
    let Some(a) = engine(provider) else { return };
    let (b, c) = (engine(provider).unwrap(), engine(provider).unwrap());
    const PAGE: usize = 4096;
    for (round, pages) in [(0u8, 1usize), (1, 16), (2, 64)] {
        let mut src: Vec<u8> = (0..pages * PAGE).map(|i| (i as u8).wrapping_mul(13).wrapping_add(round) | 1).collect();
        let mut hop = vec![0u8; pages * PAGE];
        let mut dst = vec![0u8; pages * PAGE];
        let (src_h, _) = register(&a, &mut src);
        let (hop_h, hop_desc) = register(&b, &mut hop);
        let (_, dst_desc) = register(&c, &mut dst);
        let len = (pages * PAGE) as u64;
        let (fwd_done, fwd) = outcome();
        b.arm_write(when(10, pages as u64), &write(hop_h, &dst_desc, 0, len, Some(20)), fwd_done).unwrap();
        let done = Arc::new(AtomicUsize::new(0));
        for p in 0..pages {
            let d = done.clone();
            let req = write(src_h, &hop_desc, (p * PAGE) as u64, PAGE as u64, Some(10));
            a.submit_write(
                &req,
                Box::new(move |r| {
                    r.unwrap();
                    d.fetch_add(1, Ordering::SeqCst);
                }),
            )
            .unwrap();
        }
        fwd.recv_timeout(TIMEOUT * 2).expect("the trigger fired").unwrap_or_else(|e| panic!("{provider}: {e}"));
        c.wait_imm_count(20, 1, TIMEOUT).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(dst == src, "{provider} round {round}: C holds what A wrote");
        assert_eq!(c.imm_count(20), 0, "{provider}: one immediate per forward");
        assert_eq!(b.imm_count(10), 0, "{provider}: the trigger consumed B's arrivals");
        // Every write of A completed (bounded: each request settles within its timeout).
        while done.load(Ordering::SeqCst) < pages {
            std::thread::sleep(Duration::from_millis(1));
        }
        a.unregister_memory(src_h).unwrap();
    }
}

#[test]
fn a_proxy_forwards_exactly_on_every_provider() {
    for p in PROVIDERS {
        proxy_forwards_exactly(p);
    }
}

/// The echo of a round-trip benchmark: B is armed with one triggered immediate per ping; every
/// ping gets exactly one pong, and B's counter never sees a ping.
fn echo_answers_every_ping(provider: &str) {
    let Some(a) = engine(provider) else { return };
    let b = engine(provider).unwrap();
    let mut buf_a = vec![0u8; 64];
    let mut buf_b = vec![0u8; 64];
    let (_, desc_a) = register(&a, &mut buf_a);
    let (_, desc_b) = register(&b, &mut buf_b);
    const PINGS: u64 = 300;
    let answered = Arc::new(AtomicUsize::new(0));
    for _ in 0..PINGS {
        let n = answered.clone();
        b.arm_imm(
            when(4, 1),
            5,
            &desc_a,
            Box::new(move |r| {
                r.unwrap();
                n.fetch_add(1, Ordering::SeqCst);
            }),
        )
        .unwrap();
    }
    for i in 1..=PINGS {
        a.submit_imm(4, &desc_b, Box::new(|r| r.unwrap())).unwrap();
        a.wait_imm_count(5, 1, TIMEOUT).unwrap_or_else(|e| panic!("{provider}: pong {i}: {e}"));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(a.imm_count(5), 0, "{provider}: exactly one pong per ping");
    assert_eq!(b.imm_count(4), 0, "{provider}: the triggers consumed every ping");
    assert_eq!(answered.load(Ordering::SeqCst) as u64, PINGS);
}

#[test]
fn an_echo_answers_every_ping_on_every_provider() {
    for p in PROVIDERS {
        echo_answers_every_ping(p);
    }
}

/// Many writes in flight at once (udp;ofi_rxd delivers them in any order): a trigger per batch of
/// `per` arrivals, armed before and after the arrivals, fires exactly `batches` times.
fn triggers_count_exactly_under_reordering(provider: &str) {
    let Some(a) = engine(provider) else { return };
    let b = engine(provider).unwrap();
    let mut src = vec![7u8; 1 << 16];
    let mut dst = vec![0u8; 1 << 16];
    let (src_h, _) = register(&a, &mut src);
    let (_, dst_desc) = register(&b, &mut dst);
    let mut back = vec![0u8; 64];
    let (_, back_desc) = register(&a, &mut back);
    let (batches, per) = (40u64, 25u64);
    // Half the triggers armed before anything arrives.
    for _ in 0..batches / 2 {
        b.arm_imm(when(30, per), 31, &back_desc, Box::new(|r| r.unwrap())).unwrap();
    }
    for i in 0..batches * per {
        let req = write(src_h, &dst_desc, (i % 64) * 1024, 1024, Some(30));
        a.submit_write(&req, Box::new(|r| r.unwrap())).unwrap();
    }
    // The other half after (part of) the arrivals: they take what the counter already holds.
    for _ in 0..batches / 2 {
        b.arm_imm(when(30, per), 31, &back_desc, Box::new(|r| r.unwrap())).unwrap();
    }
    a.wait_imm_count(31, batches, TIMEOUT).unwrap_or_else(|e| panic!("{provider}: {e}"));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(a.imm_count(31), 0, "{provider}: one triggered immediate per batch");
    assert_eq!(b.imm_count(30), 0, "{provider}: every arrival consumed by a trigger");
}

#[test]
fn triggers_count_exactly_under_reordering_on_every_provider() {
    for p in PROVIDERS {
        triggers_count_exactly_under_reordering(p);
    }
}

#[test]
fn a_triggered_send_arrives_once() {
    let a = engine("tcp").unwrap();
    let b = engine("tcp").unwrap();
    let (tx, rx) = mpsc::channel();
    a.set_recv_callback(Some(Arc::new(move |m: Vec<u8>| tx.send(m).unwrap()))).unwrap();
    let mut buf = vec![0u8; 64];
    let (_, desc_b) = register(&b, &mut buf);
    let (done, sent) = outcome();
    b.arm_send(when(8, 3), a.main_address(), b"ready".to_vec(), done).unwrap();
    for _ in 0..2 {
        a.submit_imm(8, &desc_b, Box::new(|r| r.unwrap())).unwrap();
    }
    assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "fired before its count");
    a.submit_imm(8, &desc_b, Box::new(|r| r.unwrap())).unwrap();
    assert_eq!(rx.recv_timeout(TIMEOUT).unwrap(), b"ready");
    sent.recv_timeout(TIMEOUT).unwrap().unwrap();
    assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "sent once");
}

#[test]
fn a_trigger_that_times_out_fails_and_returns_its_arrivals() {
    let a = engine("tcp").unwrap();
    let b = engine("tcp").unwrap();
    let mut buf = vec![0u8; 64];
    let (_, desc_a) = register(&a, &mut buf);
    let mut buf_b = vec![0u8; 64];
    let (_, desc_b) = register(&b, &mut buf_b);
    let (done, fired) = outcome();
    let t = Trigger { imm: 9, count: 3, timeout: Some(Duration::from_millis(300)) };
    b.arm_imm(t, 1, &desc_a, done).unwrap();
    let (tx, rx) = mpsc::channel();
    for _ in 0..2 {
        let tx = tx.clone();
        a.submit_imm(9, &desc_b, Box::new(move |r| tx.send(r).unwrap())).unwrap();
    }
    for _ in 0..2 {
        rx.recv_timeout(TIMEOUT).unwrap().unwrap();
    }
    let r = fired.recv_timeout(TIMEOUT).unwrap();
    assert!(matches!(r, Err(FabricError::Timeout(_))), "{r:?}");
    b.wait_imm_count(9, 2, TIMEOUT).expect("the consumed arrivals are counted again");
    assert_eq!(a.imm_count(1), 0, "nothing was posted");
}

/// The worker scans armed triggers for expiry only once the earliest deadline passed: a short
/// timeout armed behind many long ones (and after a scan that found nothing due) still expires
/// on time, and the long ones keep waiting and fire when their count is reached.
#[test]
fn a_short_trigger_armed_behind_long_ones_expires_on_time() {
    let a = engine("tcp").unwrap();
    let b = engine("tcp").unwrap();
    let mut buf = vec![0u8; 64];
    let (_, desc_a) = register(&a, &mut buf);
    let long = Trigger { imm: 5, count: 1, timeout: Some(TIMEOUT * 3) };
    let mut long_ones = Vec::new();
    for _ in 0..1000 {
        let (done, fired) = outcome();
        b.arm_imm(long, 6, &desc_a, done).unwrap();
        long_ones.push(fired);
    }
    std::thread::sleep(Duration::from_millis(50)); // idle polls: nothing due yet
    let (done, short) = outcome();
    let started = std::time::Instant::now();
    b.arm_imm(Trigger { imm: 7, count: 1, timeout: Some(Duration::from_millis(200)) }, 8, &desc_a, done).unwrap();
    let r = short.recv_timeout(TIMEOUT).expect("the short trigger ended");
    assert!(matches!(r, Err(FabricError::Timeout(_))), "{r:?}");
    assert!(started.elapsed() < TIMEOUT, "expired at its own deadline, not a long one's");
    let mut buf_b = vec![0u8; 64];
    let (_, desc_b) = register(&b, &mut buf_b);
    for _ in 0..long_ones.len() {
        a.submit_imm(5, &desc_b, Box::new(|r| r.unwrap())).unwrap();
    }
    for fired in long_ones {
        fired.recv_timeout(TIMEOUT).unwrap().expect("a long trigger fired once counted");
    }
    a.wait_imm_count(6, 1000, TIMEOUT).unwrap();
    assert_eq!(a.imm_count(8), 0, "the expired trigger posted nothing");
}

#[test]
fn bad_triggered_requests_are_refused_when_armed_and_stop_fails_armed_ones() {
    let a = engine("tcp").unwrap();
    let b = engine("tcp").unwrap();
    let mut src = vec![0u8; 64];
    let mut dst = vec![0u8; 64];
    let (src_h, _) = register(&a, &mut src);
    let (_, dst_desc) = register(&b, &mut dst);
    let invalid = |r: fabric_lib::Result<()>| matches!(r, Err(FabricError::InvalidArgument(_)));
    assert!(invalid(a.arm_write(when(1, 1), &write(src_h, &dst_desc, 1, 64, None), Box::new(|_| panic!()))));
    assert!(invalid(a.arm_write(when(1, 0), &write(src_h, &dst_desc, 0, 8, None), Box::new(|_| panic!()))));
    let huge = Trigger { imm: 1, count: 1, timeout: Some(Duration::from_secs(u64::MAX / 2)) };
    assert!(invalid(a.arm_imm(huge, 2, &dst_desc, Box::new(|_| panic!()))));
    let big = vec![0u8; b.config().max_message_size + 1];
    assert!(invalid(a.arm_send(when(1, 1), b.main_address(), big, Box::new(|_| panic!()))));
    let (done, armed) = outcome();
    a.arm_write(when(1, 1), &write(src_h, &dst_desc, 0, 8, None), done).unwrap();
    a.stop();
    assert!(matches!(armed.recv_timeout(TIMEOUT).unwrap(), Err(FabricError::Stopped)));
}
