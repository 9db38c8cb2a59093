//! Helpers the integration tests share (each test binary compiles this module; not every test
//! uses every helper).
#![allow(dead_code)]
use std::time::Duration;

use fabric_lib::{
    EngineConfig, FabricError, MemoryKind, MrDescriptor, MrHandle, PollMode, ProviderSpec, TransferEngine,
};

/// An engine on `provider` (adaptive polling), or None where this libfabric lacks the provider.
pub fn engine_if_available(provider: &str, transfer_timeout: Duration) -> Option<TransferEngine> {
    let config = EngineConfig {
        provider: ProviderSpec::new(Some(provider), &[]),
        poll_mode: PollMode::ADAPTIVE,
        transfer_timeout,
        ..Default::default()
    };
    match TransferEngine::new(config) {
        Ok(e) => Some(e),
        Err(FabricError::ProviderUnavailable(_)) => None,
        Err(e) => panic!("opening {provider}: {e}"),
    }
}

/// A tcp engine with two domains, both on `lo`, that shards every request (`shard_min_bytes: 0`)
/// so that each transfer spreads over both domains.
pub fn two_domain_loopback_engine() -> TransferEngine {
    TransferEngine::new(EngineConfig {
        provider: ProviderSpec::new(Some("tcp"), &["lo", "lo"]),
        poll_mode: PollMode::ADAPTIVE,
        shard_min_bytes: 0,
        ..Default::default()
    })
    .unwrap()
}

/// Registers host memory for remote writes.
pub fn register(e: &TransferEngine, buf: &mut [u8]) -> (MrHandle, MrDescriptor) {
    // SAFETY: every buffer outlives the engines of its test (they are dropped first).
    unsafe { e.register_memory(buf.as_mut_ptr(), buf.len(), MemoryKind::Host) }.unwrap()
}

/// Deterministic pseudo-random numbers (xorshift), so failures reproduce.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Descriptors that must not reach beyond `target` (a region of `region` bytes), each with the
/// offset and length to move through it: `(what is wrong, descriptor, offset, length)`. `gone` is
/// a region of the same owner that was unregistered; `other` belongs to another engine;
/// `claimed_len` is the length the "length forged past the end" descriptor claims (that case
/// moves `2 * region` bytes).
pub fn forged_descriptors(
    target: &MrDescriptor,
    gone: &MrDescriptor,
    other: &MrDescriptor,
    region: u64,
    claimed_len: u64,
) -> Vec<(&'static str, MrDescriptor, u64, u64)> {
    let forge = |f: &dyn Fn(&mut MrDescriptor)| {
        let mut d = target.clone();
        f(&mut d);
        d
    };
    vec![
        ("key + 1", forge(&|d| d.keys[0].key = d.keys[0].key.wrapping_add(1)), 0, 64),
        ("key - 1", forge(&|d| d.keys[0].key = d.keys[0].key.wrapping_sub(1)), 0, 64),
        ("length forged past the end", forge(&|d| d.len = claimed_len), 0, 2 * region),
        ("last byte + 1", forge(&|d| d.len = region + 1), region, 1),
        ("stale: region unregistered", gone.clone(), 0, 64),
        ("another engine's key", forge(&|d| d.keys[0].key = other.keys[0].key), 0, 64),
        ("misdirected to another engine", forge(&|d| d.keys[0].address = other.keys[0].address.clone()), 0, 64),
    ]
}
