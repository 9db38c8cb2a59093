//! Reads (`submit_read`, `submit_paged_reads`) over every software provider: byte-exact, local
//! completion, typed errors for bad input, and confinement: a reader gets only the bytes of the
//! region it was given, and only where its owner opted in to remote reads.
//!
//! Each peer region sits between two guard regions of the same allocation filled with a marker,
//! so a read that escaped its region by a byte would bring the marker home.
mod common;

use std::sync::mpsc;
use std::time::Duration;

use fabric_lib::{
    DomainChoice, FabricError, MemoryKind, MrDescriptor, MrHandle, PagedReadRequest, ReadRequest, RegisterOptions,
    TransferEngine,
};

const REGION: usize = 4096;
const TIMEOUT: Duration = Duration::from_secs(2);
const GUARD: u8 = 0x5A;
const PROVIDERS: [&str; 4] = ["tcp", "udp;ofi_rxd", "shm", "sockets"];

fn engine(provider: &str) -> Option<TransferEngine> {
    common::engine_if_available(provider, TIMEOUT)
}

fn register(e: &TransferEngine, buf: &mut [u8], remote_read: bool) -> (MrHandle, MrDescriptor) {
    // SAFETY: every buffer outlives the engines of its test (they are dropped first).
    unsafe { e.register_memory_with(buf.as_mut_ptr(), buf.len(), MemoryKind::Host, RegisterOptions { remote_read }) }
        .unwrap()
}

/// Reads and waits for the outcome (every request settles within its bound).
fn read(
    a: &TransferEngine,
    src: &MrDescriptor,
    src_offset: u64,
    len: u64,
    dst: MrHandle,
    dst_offset: u64,
) -> fabric_lib::Result<()> {
    let (tx, rx) = mpsc::channel();
    let req = ReadRequest { src, src_offset, len, dst, dst_offset, domains: DomainChoice::Shard(usize::MAX) };
    a.submit_read(&req, Box::new(move |r| tx.send(r).unwrap()))?;
    rx.recv_timeout(TIMEOUT * 4).expect("every request settles within its bound")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1).collect()
}

fn reads_are_byte_exact(provider: &str) {
    let Some(owner) = engine(provider) else { return };
    let reader = engine(provider).unwrap();
    let mut remote = pattern(64 * 1024, 3);
    let (_, desc) = register(&owner, &mut remote, true);
    assert!(desc.remote_read);
    let mut local = vec![0u8; 64 * 1024];
    let (h, _) = register(&reader, &mut local, false);
    for (src_off, len, dst_off) in
        [(0u64, 1u64, 0u64), (7, 100, 13), (0, 64 * 1024, 0), (4096, 8192, 100), (65535, 1, 65535)]
    {
        local.fill(0);
        read(&reader, &desc, src_off, len, h, dst_off).unwrap_or_else(|e| panic!("{provider} read {len}: {e}"));
        let (s, l, d) = (src_off as usize, len as usize, dst_off as usize);
        assert_eq!(&local[d..d + l], &remote[s..s + l], "{provider}: bytes of a {len}-byte read");
        assert!(local[..d].iter().chain(&local[d + l..]).all(|&x| x == 0), "{provider}: bytes outside the range");
    }
    // A zero-byte read posts nothing and completes.
    read(&reader, &desc, 64 * 1024, 0, h, 0).unwrap_or_else(|e| panic!("{provider} empty read: {e}"));
    // Paged: pages in any order, strides and offsets on both sides.
    local.fill(0);
    let src_pages = [5u32, 0, 3, 7];
    let dst_pages = [1u32, 6, 2, 0];
    let req = PagedReadRequest {
        page_len: 1000,
        src: &desc,
        src_pages: &src_pages,
        src_stride: 4096,
        src_offset: 10,
        dst: h,
        dst_pages: &dst_pages,
        dst_stride: 2048,
        dst_offset: 5,
    };
    let (tx, rx) = mpsc::channel();
    reader.submit_paged_reads(&req, Box::new(move |r| tx.send(r).unwrap())).unwrap();
    rx.recv_timeout(TIMEOUT * 4).unwrap().unwrap();
    let mut expected = vec![0u8; local.len()];
    for (&s, &d) in src_pages.iter().zip(&dst_pages) {
        let (s, d) = (s as usize * 4096 + 10, d as usize * 2048 + 5);
        expected[d..d + 1000].copy_from_slice(&remote[s..s + 1000]);
    }
    assert!(local == expected, "{provider}: paged read");
}

#[test]
fn reads_are_byte_exact_on_every_provider() {
    for p in PROVIDERS {
        reads_are_byte_exact(p);
    }
}

#[test]
fn bad_reads_are_typed_errors_and_post_nothing() {
    let a = engine("tcp").unwrap();
    let b = engine("tcp").unwrap();
    let mut readable = vec![1u8; REGION];
    let mut write_only = vec![2u8; REGION];
    let (_, readable_desc) = register(&b, &mut readable, true);
    let (_, write_only_desc) = register(&b, &mut write_only, false);
    assert!(!write_only_desc.remote_read);
    let mut local = vec![0u8; REGION];
    let (h, own_desc) = register(&a, &mut local, false);
    let n = REGION as u64;
    let invalid = |r: fabric_lib::Result<()>| matches!(r, Err(FabricError::InvalidArgument(_)));
    let submit = |src: &MrDescriptor, so: u64, len: u64, dst: MrHandle, doff: u64| {
        let req = ReadRequest { src, src_offset: so, len, dst, dst_offset: doff, domains: DomainChoice::Shard(1) };
        a.submit_read(&req, Box::new(|_| panic!("nothing may be posted")))
    };
    assert!(invalid(submit(&readable_desc, 1, n, h, 0)), "past the peer region's end");
    assert!(invalid(submit(&readable_desc, 0, n, h, 1)), "past the local region's end");
    assert!(invalid(submit(&readable_desc, u64::MAX, 2, h, 0)), "offset overflow");
    assert!(invalid(submit(&readable_desc, 0, 8, MrHandle(9999), 0)), "unregistered local region");
    assert!(
        matches!(submit(&write_only_desc, 0, 8, h, 0), Err(FabricError::NotReadable(_))),
        "a region registered without remote_read"
    );
    assert!(matches!(submit(&own_desc, 0, 8, h, 0), Err(FabricError::NotReadable(_))));
    let pinned = ReadRequest {
        src: &readable_desc,
        src_offset: 0,
        len: 8,
        dst: h,
        dst_offset: 0,
        domains: DomainChoice::Pinned(5),
    };
    assert!(invalid(a.submit_read(&pinned, Box::new(|_| panic!()))), "domain out of range");
    let paged = |src_pages: &[u32], dst_pages: &[u32], page_len: u64| {
        let req = PagedReadRequest {
            page_len,
            src: &readable_desc,
            src_pages,
            src_stride: 1024,
            src_offset: 0,
            dst: h,
            dst_pages,
            dst_stride: 1024,
            dst_offset: 0,
        };
        a.submit_paged_reads(&req, Box::new(|_| panic!("nothing may be posted")))
    };
    assert!(invalid(paged(&[0, 4], &[0, 1], 1024)), "source page past the end");
    assert!(invalid(paged(&[0, 1], &[0, 4], 1024)), "destination page past the end");
    assert!(invalid(paged(&[0], &[0, 1], 1024)), "page list lengths differ");
    assert!(invalid(paged(&[], &[], 1024)), "empty page list");
    assert!(invalid(paged(&[0], &[0], 0)), "zero page length");
    assert!(local.iter().all(|&x| x == 0));
    // A peer of another provider.
    let other = engine("udp;ofi_rxd").unwrap();
    let mut o = vec![0u8; 64];
    let (_, other_desc) = register(&other, &mut o, true);
    assert!(matches!(submit(&other_desc, 0, 8, h, 0), Err(FabricError::InvalidDescriptor(_))));
}

/// Whether the region owner's provider refuses a forged read (what a reader that bypasses this
/// library's own checks, which refuse all of these before posting, could do). Measured with
/// libfabric 1.17 (docs/hardening.md): `udp;ofi_rxd` and `sockets` check key, range and the
/// read permission; `tcp;ofi_rxm` checks key and range but not the read permission; `shm` reads
/// the peer's memory directly (cross-memory attach, bounded by ptrace permission only).
fn owner_provider_refuses(provider: &str, case: &str) -> bool {
    match provider {
        "shm" => false,
        "tcp" => case != "write-only region forged readable",
        _ => true,
    }
}

/// A reader with a forged, stale or misdirected descriptor gets nothing outside the region it
/// was given where the owner's provider enforces it (see [`owner_provider_refuses`]): the peer's
/// guards, its write-only neighbours and other engines stay unread.
fn forged_reads_bring_nothing_home(provider: &str) {
    let Some(b) = engine(provider) else { return };
    let other = engine(provider).unwrap();
    let mut peer = vec![GUARD; 3 * REGION];
    peer[REGION..2 * REGION].fill(0x11);
    let (_, _guard_lo) = register(&b, &mut peer[..REGION], false);
    let (_, target) = register(&b, &mut peer[REGION..2 * REGION], true);
    let (_, guard_hi) = register(&b, &mut peer[2 * REGION..], false);
    let mut decoy = vec![GUARD; REGION];
    let (_, other_desc) = register(&other, &mut decoy, true);
    let mut gone = vec![GUARD; REGION];
    let (gone_h, gone_desc) = register(&b, &mut gone, true);
    b.unregister_memory(gone_h).unwrap();

    let mut cases = common::forged_descriptors(&target, &gone_desc, &other_desc, REGION as u64, 2 * REGION as u64);
    let mut forged_readable = guard_hi.clone();
    forged_readable.remote_read = true;
    cases.push(("write-only region forged readable", forged_readable, 0, 64));
    for (name, desc, offset, len) in cases {
        let a = engine(provider).unwrap();
        let mut local = vec![0u8; 3 * REGION];
        let (h, _) = register(&a, &mut local, false);
        let outcome = read(&a, &desc, offset, len, h, REGION as u64);
        std::thread::sleep(Duration::from_millis(100));
        let leaked = local.contains(&GUARD);
        if owner_provider_refuses(provider, name) {
            assert!(!leaked, "{provider} {name}: bytes outside the region reached the reader ({outcome:?})");
            assert!(outcome.is_err(), "{provider} {name}: a refused read reported success");
        } else {
            eprintln!(
                "{provider} {name}: not enforced by the provider: reader told {outcome:?}, guard bytes read: {leaked}"
            );
        }
        drop(a);
    }
    // The owner still serves honest readers.
    let a = engine(provider).unwrap();
    let mut local = vec![0u8; REGION];
    let (h, _) = register(&a, &mut local, false);
    read(&a, &target, 0, REGION as u64, h, 0).unwrap_or_else(|e| panic!("{provider}: owner poisoned: {e}"));
    assert!(local.iter().all(|&x| x == 0x11));
}

#[test]
fn tcp_forged_reads_bring_nothing_home() {
    forged_reads_bring_nothing_home("tcp");
}

#[test]
fn udp_rxd_forged_reads_bring_nothing_home() {
    forged_reads_bring_nothing_home("udp;ofi_rxd");
}

#[test]
fn shm_forged_reads_bring_nothing_home() {
    forged_reads_bring_nothing_home("shm");
}

#[test]
fn sockets_forged_reads_bring_nothing_home() {
    forged_reads_bring_nothing_home("sockets");
}

#[test]
fn a_read_from_a_stopped_peer_fails_typed_and_fences_on_timeout() {
    let a = engine("tcp").unwrap();
    let b = engine("tcp").unwrap();
    let mut remote = vec![7u8; REGION];
    let (_, desc) = register(&b, &mut remote, true);
    let mut local = vec![0u8; REGION];
    let (h, _) = register(&a, &mut local, false);
    read(&a, &desc, 0, 64, h, 0).unwrap();
    b.stop();
    drop(b);
    let first = read(&a, &desc, 0, 64, h, 0);
    assert!(matches!(first, Err(FabricError::Timeout(_) | FabricError::TransferFailed(_))), "{first:?}");
    if matches!(first, Err(FabricError::Timeout(_))) {
        let again = read(&a, &desc, 0, 64, h, 0);
        assert!(matches!(again, Err(FabricError::PeerFenced(_))), "{again:?}");
        // The owner is gone: re-admission is a handshake it cannot answer, so the fence stays.
        let readmit = a.readmit_peer(&desc.owner);
        assert!(matches!(readmit, Err(FabricError::Timeout(_) | FabricError::TransferFailed(_))), "{readmit:?}");
        assert!(matches!(read(&a, &desc, 0, 64, h, 0), Err(FabricError::PeerFenced(_))));
    }
    // A region with a read in flight cannot be unregistered; once settled it can.
    a.unregister_memory(h).unwrap();
}

#[test]
fn large_reads_are_sharded_over_every_domain() {
    let open = common::two_domain_loopback_engine;
    let (a, b) = (open(), open());
    let mut remote = pattern(1 << 20, 9);
    let (_, desc) = register(&b, &mut remote, true);
    let mut local = vec![0u8; 1 << 20];
    let (h, _) = register(&a, &mut local, false);
    read(&a, &desc, 0, 1 << 20, h, 0).unwrap();
    assert!(local == remote);
    let stats = a.domain_stats();
    assert!(stats.iter().all(|s| s.ops > 0 && s.bytes > 0), "every domain carried part of the read: {stats:?}");
    assert_eq!(stats.iter().map(|s| s.bytes).sum::<u64>(), 1 << 20);
}
