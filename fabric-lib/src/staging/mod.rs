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
//! tested on machines without a GPU, with real threads standing in for the two engines. The
//! worker drives it (`worker/staged.rs`): copies on the engine's own CUDA streams, polled, never
//! waited for; writes and announcements posted like any other; every request bounded by
//! `transfer_timeout`. [`memory`] holds the pinned buffers and the copier.
mod credits;
mod grants;
mod header;
pub(crate) mod memory;
mod plan;
mod reassembly;

pub use credits::SlotPool;
pub use grants::{Grants, RequestKey};
pub use header::{ChunkHeader, HeaderPiece};
pub use plan::{plan_chunks, plan_chunks_bounded, Chunk, Piece};
pub use reassembly::{Progress, Reassembly};

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{FabricError, Result};

/// What one engine moved through staging, updated by its worker (relaxed: for reports).
#[derive(Debug, Default)]
pub(crate) struct StagingCounters {
    pub requests_sent: AtomicU64,
    pub bounced_bytes: AtomicU64,
    pub requests_landed: AtomicU64,
    pub landed_bytes: AtomicU64,
}

impl StagingCounters {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> StagingStats {
        StagingStats {
            requests_sent: self.requests_sent.load(Ordering::Relaxed),
            bounced_bytes: self.bounced_bytes.load(Ordering::Relaxed),
            requests_landed: self.requests_landed.load(Ordering::Relaxed),
            landed_bytes: self.landed_bytes.load(Ordering::Relaxed),
        }
    }
}

/// Staged traffic of an engine (see [`crate::TransferEngine::staging_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StagingStats {
    /// Staged requests this engine started as the writer.
    pub requests_sent: u64,
    /// Bytes copied from source regions into bounce buffers.
    pub bounced_bytes: u64,
    /// Staged requests that completed into this engine's regions (immediate counted).
    pub requests_landed: u64,
    /// Bytes copied from the landing area into destination regions.
    pub landed_bytes: u64,
}

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
        // 32 × 1 MiB: chunks large enough to amortize a write's and an announcement's cost on
        // tcp, and enough of them in flight that copies and credits hide behind the wire even
        // for requests of one chunk (each takes a whole slot).
        StagingConfig { chunk_bytes: 1 << 20, slots: 32 }
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
