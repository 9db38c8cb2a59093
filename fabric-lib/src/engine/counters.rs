//! Immediate counting on the receiving side (the ImmCounter table).
use std::time::Duration;

use super::TransferEngine;
use crate::error::{FabricError, Result};
use crate::imm_counter::{GenericImmCallback, OnReached};

impl TransferEngine {
    /// Calls `on_reached` once `imm` has arrived `n` times (arrivals so far count).
    pub fn set_imm_count_expected(&self, imm: u32, n: u64, on_reached: OnReached) -> Result<()> {
        if self.is_stopped() {
            return Err(FabricError::Stopped);
        }
        if let Some(due) = self.imm.set_expected(imm, n, on_reached)? {
            self.callbacks.queue().push(due);
        }
        Ok(())
    }

    /// Cancels the expectation on `imm` (unfired) and forgets its count, returning the count.
    pub fn remove_imm_count(&self, imm: u32) -> u64 {
        self.imm.remove(imm)
    }

    /// Arrivals of `imm` counted and not yet consumed.
    pub fn imm_count(&self, imm: u32) -> u64 {
        self.imm.value(imm)
    }

    /// Blocks until `imm` has arrived `n` times, then consumes them; errors after `timeout`.
    pub fn wait_imm_count(&self, imm: u32, n: u64, timeout: Duration) -> Result<()> {
        let waited = self.imm.wait(imm, n, timeout);
        self.probe.mark(crate::latency_probe::Stage::WaitReturned);
        waited
    }

    /// Consumes `n` arrivals of `imm` if they are all there; never waits.
    pub fn try_take_imm_count(&self, imm: u32, n: u64) -> bool {
        self.imm.try_take(imm, n)
    }

    /// A number that changes whenever arrivals are counted. A poller that read it before a
    /// pass of [`TransferEngine::try_take_imm_count`] calls that took nothing, and reads the
    /// same number again, knows those calls would still take nothing.
    pub fn imm_arrivals_generation(&self) -> u64 {
        self.imm.generation()
    }

    /// Counts `imm` even while a generic immediate callback is installed.
    pub fn claim_imm(&self, imm: u32) {
        self.imm.claim(imm)
    }

    /// Undoes [`TransferEngine::claim_imm`].
    pub fn unclaim_imm(&self, imm: u32) {
        self.imm.unclaim(imm)
    }

    /// Installs the callback for immediates nobody expects or waits for.
    pub fn set_imm_callback(&self, callback: Option<GenericImmCallback>) {
        self.imm.set_generic_callback(callback)
    }
}
