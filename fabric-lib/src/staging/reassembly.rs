//! The receiver's record of one staged request: which destination bytes arrived. The request
//! completes, and its immediate is counted, exactly once: when every byte of it is in place.
//! Overlapping, duplicate or inconsistent chunks are refused (a retry after a timeout, or a
//! forged announcement) and change nothing.
use std::collections::BTreeMap;

use super::header::ChunkHeader;
use crate::error::{FabricError, Result};

/// What accepting a chunk did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// More chunks are due.
    Partial { received: u64 },
    /// The last byte arrived: count `imm` now (this is returned once per request).
    Complete { imm: Option<u32> },
}

/// Arrived destination ranges of one request.
#[derive(Debug)]
pub struct Reassembly {
    total: u64,
    chunks: u32,
    imm: Option<u32>,
    dst_base: u64,
    received: u64,
    /// Disjoint arrived ranges, start → end.
    ranges: BTreeMap<u64, u64>,
    seen: Vec<bool>,
    complete: bool,
}

impl Reassembly {
    /// Starts from the request's first announcement (any chunk may come first).
    pub fn new(first: &ChunkHeader) -> Self {
        Reassembly {
            total: first.total,
            chunks: first.chunks,
            imm: first.imm,
            dst_base: first.dst_base,
            received: 0,
            ranges: BTreeMap::new(),
            seen: vec![false; first.chunks as usize],
            complete: false,
        }
    }

    /// Bytes arrived so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// Whether the request completed (its immediate was handed out).
    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// Records a chunk whose pieces were copied into the destination. Call [`Reassembly::admit`]
    /// first: it checks without recording, so a refused chunk's bytes are never copied.
    pub fn accept(&mut self, h: &ChunkHeader) -> Result<Progress> {
        self.admit(h)?;
        self.seen[h.chunk as usize] = true;
        for p in &h.pieces {
            self.ranges.insert(p.dst_offset, p.dst_offset + p.len);
            self.received += p.len;
        }
        if self.received == self.total {
            self.complete = true;
            return Ok(Progress::Complete { imm: self.imm });
        }
        Ok(Progress::Partial { received: self.received })
    }

    /// Whether `h` may be copied and recorded: same request shape, a chunk not seen before, and
    /// pieces that overlap neither each other nor bytes already received.
    pub fn admit(&self, h: &ChunkHeader) -> Result<()> {
        let bad = |why: String| Err(FabricError::InvalidDescriptor(format!("staged chunk {}: {why}", h.chunk)));
        if self.complete {
            return bad("its request already completed".into());
        }
        if (h.total, h.chunks, h.imm, h.dst_base) != (self.total, self.chunks, self.imm, self.dst_base) {
            return bad("does not match its request's earlier chunks".into());
        }
        if self.seen.get(h.chunk as usize).is_none_or(|&s| s) {
            return bad("arrived twice".into());
        }
        let mut pieces: Vec<(u64, u64)> = h.pieces.iter().map(|p| (p.dst_offset, p.dst_offset + p.len)).collect();
        pieces.sort_unstable();
        for pair in pieces.windows(2) {
            if pair[1].0 < pair[0].1 {
                return bad("its pieces overlap".into());
            }
        }
        let mut bytes = 0;
        for &(start, end) in &pieces {
            // The arrived range starting at or before `start`, and the first one after it.
            let before = self.ranges.range(..=start).next_back().is_some_and(|(_, &e)| e > start);
            let after = self.ranges.range(start..).next().is_some_and(|(&s, _)| s < end);
            if before || after {
                return bad(format!("bytes [{start}, {end}) already arrived"));
            }
            bytes += end - start;
        }
        if self.received + bytes > self.total {
            return bad(format!("more than the request's {} bytes", self.total));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::staging::{plan_chunks, ChunkHeader};

    fn headers(total: u64) -> Vec<ChunkHeader> {
        let chunks = plan_chunks([(0, 0, total)], 4096).unwrap();
        let n = chunks.len() as u32;
        chunks.iter().map(|c| ChunkHeader::for_chunk(1, 0, n, total, Some(5), 0, c)).collect()
    }

    #[test]
    fn completes_once_in_any_order() {
        let hs = headers(10_000);
        let mut r = Reassembly::new(&hs[2]);
        assert_eq!(r.accept(&hs[2]).unwrap(), Progress::Partial { received: 10_000 - 8192 });
        assert_eq!(r.accept(&hs[0]).unwrap(), Progress::Partial { received: 10_000 - 4096 });
        assert!(!r.is_complete());
        assert_eq!(r.accept(&hs[1]).unwrap(), Progress::Complete { imm: Some(5) });
        assert!(r.is_complete());
        assert!(r.accept(&hs[1]).is_err(), "nothing after completion");
    }

    #[test]
    fn duplicates_overlaps_and_mismatches_are_refused_without_effect() {
        let hs = headers(10_000);
        let mut r = Reassembly::new(&hs[0]);
        r.accept(&hs[0]).unwrap();
        assert!(r.accept(&hs[0]).is_err(), "same chunk twice");
        let mut overlapping = hs[1].clone();
        overlapping.pieces[0].dst_offset = 4000;
        assert!(r.accept(&overlapping).is_err(), "overlaps chunk 0");
        let mut other_imm = hs[1].clone();
        other_imm.imm = Some(6);
        assert!(r.accept(&other_imm).is_err());
        let mut out_of_range = hs[1].clone();
        out_of_range.chunk = 9;
        assert!(r.accept(&out_of_range).is_err());
        assert_eq!(r.received(), 4096, "refusals change nothing");
        r.accept(&hs[1]).unwrap();
        assert_eq!(r.accept(&hs[2]).unwrap(), Progress::Complete { imm: Some(5) });
    }
}
