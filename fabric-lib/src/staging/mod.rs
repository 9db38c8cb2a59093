//! The host-side protocol of staged GPU transfers, for providers without FI_HMEM (tcp,
//! udp;ofi_rxd): GPU memory crosses hosts through registered host memory.
//!
//! The writer copies its source chunk by chunk into pinned bounce buffers, writes each chunk into
//! a slot of the receiver's registered landing area, and announces it ([`ChunkHeader`]); the
//! receiver's worker copies the slot into the destination region, frees the slot (a credit back
//! to the writer) and counts the request's immediate once every byte is in place
//! ([`Reassembly`]). Chunks of one request are independent, so several are in flight at once:
//! the copy of one overlaps the wire time of the others.
//!
//! Everything here is sans-IO (plans, credits, reassembly, the header's bytes) so that it is
//! tested on machines without a GPU, with real threads standing in for the two engines. Not done
//! yet: the worker integration (CUDA copies on the engine's stream, posting the writes and
//! announcements, `transfer_timeout` on staged requests); until then the engine raises
//! `ProviderUnavailableError` for GPU memory on such providers, as documented in docs/gpu.md.
mod credits;
mod header;
mod plan;
mod reassembly;

pub use credits::SlotPool;
pub use header::{ChunkHeader, HeaderPiece};
pub use plan::{plan_chunks, Chunk, Piece};
pub use reassembly::{Progress, Reassembly};

use crate::error::{FabricError, Result};

/// Sizes of one engine's staging memory: `slots` chunks of `chunk_bytes` each, for bounce
/// buffers (writer) and for the landing area (receiver) alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingConfig {
    /// Bytes per chunk (a multiple of 4 KiB): the unit of copy, write and credit.
    pub chunk_bytes: usize,
    /// Chunks in flight at once per engine (bounded memory: `slots * chunk_bytes`).
    pub slots: usize,
}

/// Most staging memory one engine may pin per side.
pub const MAX_STAGING_BYTES: usize = 4 << 30;

impl Default for StagingConfig {
    fn default() -> Self {
        // 8 × 4 MiB: large enough to amortize a write's per-operation cost on tcp, deep enough
        // that copies hide behind the wire.
        StagingConfig { chunk_bytes: 4 << 20, slots: 8 }
    }
}

impl StagingConfig {
    /// Checks the sizes before anything is allocated.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(FabricError::InvalidArgument(m));
        if self.chunk_bytes == 0 || !self.chunk_bytes.is_multiple_of(4096) || self.chunk_bytes > 64 << 20 {
            return bad(format!(
                "staging chunk_bytes must be a multiple of 4096 in 4 KiB..=64 MiB, got {}",
                self.chunk_bytes
            ));
        }
        if self.slots == 0 || self.slots > 4096 {
            return bad(format!("staging slots must be in 1..=4096, got {}", self.slots));
        }
        if self.slots.saturating_mul(self.chunk_bytes) > MAX_STAGING_BYTES {
            return bad(format!(
                "staging memory of {} × {} bytes exceeds {MAX_STAGING_BYTES} bytes",
                self.slots, self.chunk_bytes
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
