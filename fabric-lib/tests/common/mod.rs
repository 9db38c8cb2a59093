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
