//! The announcement of one chunk: which request, which slot of the landing area holds it, and
//! where each piece goes in the destination region. Encoded like descriptors (versioned,
//! checksummed); a receiver checks it against its own landing area before touching anything.
use serde::{Deserialize, Serialize};

use super::plan::Chunk;
use crate::encoding::{decode_versioned, encode_versioned};
use crate::error::{FabricError, Result};

const MAGIC: [u8; 4] = *b"FLSC";

/// Where `len` bytes at `slot_offset` of the slot go in the destination region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeaderPiece {
    pub dst_offset: u64,
    pub slot_offset: u64,
    pub len: u64,
}

/// One chunk of a staged request, announced after its bytes were written into `slot`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkHeader {
    /// The writer's request id (unique per writer engine).
    pub request: u64,
    /// The destination region's base address, as its descriptor says.
    pub dst_base: u64,
    pub chunk: u32,
    /// Chunks of the request.
    pub chunks: u32,
    /// Bytes of the request.
    pub total: u64,
    /// Counted once the whole request is in the destination.
    pub imm: Option<u32>,
    pub slot: u32,
    pub pieces: Vec<HeaderPiece>,
}

impl ChunkHeader {
    /// The announcement of `chunk` of a request, written into `slot`.
    pub fn for_chunk(
        request: u64,
        dst_base: u64,
        chunks: u32,
        total: u64,
        imm: Option<u32>,
        slot: u32,
        chunk: &Chunk,
    ) -> Self {
        ChunkHeader {
            request,
            dst_base,
            chunk: chunk.index,
            chunks,
            total,
            imm,
            slot,
            pieces: chunk
                .pieces
                .iter()
                .map(|p| HeaderPiece { dst_offset: p.dst_offset, slot_offset: p.slot_offset, len: p.len })
                .collect(),
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        encode_versioned(MAGIC, self)
    }

    /// Decodes an announcement (any corruption is an [`FabricError::InvalidDescriptor`]).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        decode_versioned(MAGIC, bytes, "staged chunk header")
    }

    /// Checks the announcement against the receiver's landing area (`slots` of `chunk_bytes`)
    /// and the destination region's length: every piece inside its slot and inside the region,
    /// the chunk inside the request.
    pub fn check(&self, slots: u32, chunk_bytes: u64, region_len: u64) -> Result<()> {
        let bad = |why: String| Err(FabricError::InvalidDescriptor(format!("staged chunk {}: {why}", self.chunk)));
        if self.slot >= slots {
            return bad(format!("slot {} outside the landing area ({slots} slots)", self.slot));
        }
        if self.chunks == 0 || self.chunk >= self.chunks {
            return bad(format!("chunk index outside the request's {} chunks", self.chunks));
        }
        if self.total > region_len {
            return bad(format!("request of {} bytes into a region of {region_len}", self.total));
        }
        let mut bytes = 0u64;
        for p in &self.pieces {
            let slot_end = p.slot_offset.checked_add(p.len).filter(|&e| e <= chunk_bytes);
            let dst_end = p.dst_offset.checked_add(p.len).filter(|&e| e <= region_len);
            if p.len == 0 || slot_end.is_none() || dst_end.is_none() {
                return bad(format!(
                    "piece {p:?} outside its slot ({chunk_bytes} bytes) or region ({region_len} bytes)"
                ));
            }
            bytes += p.len;
        }
        if bytes == 0 || bytes > self.total {
            return bad(format!("{bytes} bytes in a request of {}", self.total));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::staging::plan_chunks;

    #[test]
    fn round_trips_and_rejects_corruption() {
        let chunk = &plan_chunks([(0, 100, 5000)], 4096).unwrap()[1];
        let h = ChunkHeader::for_chunk(7, 0x7000_0000, 2, 5000, Some(9), 3, chunk);
        let bytes = h.to_bytes();
        assert_eq!(ChunkHeader::from_bytes(&bytes).unwrap(), h);
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(ChunkHeader::from_bytes(&bad).is_err(), "flipped byte {i} decoded");
        }
        assert!(ChunkHeader::from_bytes(&bytes[..bytes.len() - 1]).is_err());
    }

    #[test]
    fn check_keeps_pieces_inside_slot_and_region() {
        let chunk = &plan_chunks([(0, 100, 5000)], 4096).unwrap()[0];
        let h = ChunkHeader::for_chunk(1, 0, 2, 5000, None, 1, chunk);
        h.check(2, 4096, 5100).unwrap();
        assert!(h.check(1, 4096, 5100).is_err(), "slot 1 of a 1-slot area");
        assert!(h.check(2, 2048, 5100).is_err(), "piece longer than the slot");
        assert!(h.check(2, 4096, 4000).is_err(), "request longer than the region");
        let mut past = h.clone();
        past.pieces[0].dst_offset = u64::MAX - 10;
        assert!(past.check(2, 4096, u64::MAX).is_err(), "offset overflow");
        let mut beyond = h.clone();
        beyond.chunk = 2;
        assert!(beyond.check(2, 4096, 5100).is_err(), "chunk index past the request");
    }
}
