//! Splitting a transfer into chunks: each chunk fills at most one staging slot, packing the
//! transfer's pieces (one for a single write, one per page for paged writes) back to back and
//! splitting a piece where it crosses a slot's end.
use crate::error::{FabricError, Result};

/// Bytes that move from `src_offset` (in the source region) to `dst_offset` (in the destination
/// region) through `slot_offset` (in the chunk's staging slot).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub src_offset: u64,
    pub dst_offset: u64,
    pub slot_offset: u64,
    pub len: u64,
}

/// One slot's worth of a transfer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Position in the transfer (0-based).
    pub index: u32,
    /// Bytes used in the slot (the sum of the pieces' lengths).
    pub bytes: u64,
    pub pieces: Vec<Piece>,
}

/// Plans the chunks of a transfer made of `pieces` (source offset, destination offset, length),
/// each chunk at most `chunk_bytes`. Zero-length pieces are dropped; a transfer of no bytes has
/// no chunks (its immediate needs no data).
pub fn plan_chunks(pieces: impl IntoIterator<Item = (u64, u64, u64)>, chunk_bytes: u64) -> Result<Vec<Chunk>> {
    plan_chunks_bounded(pieces, chunk_bytes, usize::MAX)
}

/// [`plan_chunks`] with at most `max_pieces` pieces per chunk (a chunk's announcement lists its
/// pieces and must fit in one message).
pub fn plan_chunks_bounded(
    pieces: impl IntoIterator<Item = (u64, u64, u64)>,
    chunk_bytes: u64,
    max_pieces: usize,
) -> Result<Vec<Chunk>> {
    if chunk_bytes == 0 || max_pieces == 0 {
        return Err(FabricError::InvalidArgument("chunk size and pieces per chunk must be positive".into()));
    }
    let pieces: Vec<(u64, u64, u64)> = pieces.into_iter().collect();
    check_disjoint_destinations(&pieces)?;
    let mut chunks: Vec<Chunk> = Vec::new();
    let mut current = Chunk { index: 0, bytes: 0, pieces: Vec::new() };
    for (mut src, mut dst, mut len) in pieces {
        while len > 0 {
            let take = len.min(chunk_bytes - current.bytes);
            current.pieces.push(Piece { src_offset: src, dst_offset: dst, slot_offset: current.bytes, len: take });
            current.bytes += take;
            (src, dst, len) = (src + take, dst + take, len - take);
            if current.bytes == chunk_bytes || current.pieces.len() == max_pieces {
                let index = current.index;
                chunks.push(std::mem::replace(&mut current, Chunk { index: index + 1, bytes: 0, pieces: Vec::new() }));
            }
        }
    }
    if current.bytes > 0 {
        chunks.push(current);
    }
    if chunks.len() > u32::MAX as usize {
        return Err(FabricError::InvalidArgument(format!("a transfer of {} chunks is too many", chunks.len())));
    }
    Ok(chunks)
}

/// The receiver counts a staged transfer complete by its bytes, so a destination byte may be
/// written once per transfer: pieces whose destinations overlap are refused before anything is
/// posted (the receiver would refuse them after part of the transfer landed).
fn check_disjoint_destinations(pieces: &[(u64, u64, u64)]) -> Result<()> {
    let mut ranges: Vec<(u64, u64)> =
        pieces.iter().filter(|p| p.2 > 0).map(|&(_, dst, len)| (dst, dst.saturating_add(len))).collect();
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        if pair[1].0 < pair[0].1 {
            return Err(FabricError::InvalidArgument(format!(
                "staged transfer: destination ranges [{}, {}) and [{}, {}) overlap (a staged write may \
                 write each destination byte once)",
                pair[0].0, pair[0].1, pair[1].0, pair[1].1
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_write_splits_at_slot_ends() {
        let chunks = plan_chunks([(10, 1000, 10_000)], 4096).unwrap();
        assert_eq!(chunks.iter().map(|c| c.bytes).collect::<Vec<_>>(), vec![4096, 4096, 1808]);
        assert_eq!(chunks[1].pieces, vec![Piece { src_offset: 4106, dst_offset: 5096, slot_offset: 0, len: 4096 }]);
        assert_eq!(chunks.iter().map(|c| c.index).collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    #[test]
    fn pages_pack_back_to_back_and_split_across_slots() {
        // Three 3000-byte pages into 4096-byte slots: page 1 straddles slots 0 and 1.
        let chunks = plan_chunks([(0, 9000, 3000), (6000, 0, 3000), (3000, 3000, 3000)], 4096).unwrap();
        assert_eq!(chunks.len(), 3);
        assert_eq!(
            chunks[0].pieces,
            vec![
                Piece { src_offset: 0, dst_offset: 9000, slot_offset: 0, len: 3000 },
                Piece { src_offset: 6000, dst_offset: 0, slot_offset: 3000, len: 1096 },
            ]
        );
        assert_eq!(chunks[1].pieces[0], Piece { src_offset: 7096, dst_offset: 1096, slot_offset: 0, len: 1904 });
        let total: u64 = chunks.iter().map(|c| c.bytes).sum();
        assert_eq!(total, 9000);
    }

    #[test]
    fn pieces_per_chunk_are_bounded() {
        let pages: Vec<_> = (0..10u64).map(|i| (i * 100, i * 100, 100)).collect();
        let chunks = plan_chunks_bounded(pages, 4096, 4).unwrap();
        assert_eq!(chunks.iter().map(|c| c.pieces.len()).collect::<Vec<_>>(), vec![4, 4, 2]);
        assert_eq!(chunks[1].pieces[0], Piece { src_offset: 400, dst_offset: 400, slot_offset: 0, len: 100 });
        assert!(plan_chunks_bounded([(0, 0, 1)], 4096, 0).is_err());
    }

    #[test]
    fn nothing_to_move_has_no_chunks_and_zero_chunk_size_is_refused() {
        assert!(plan_chunks([(0, 0, 0)], 4096).unwrap().is_empty());
        assert!(plan_chunks(std::iter::empty(), 4096).unwrap().is_empty());
        assert!(matches!(plan_chunks([(0, 0, 1)], 0), Err(FabricError::InvalidArgument(_))));
    }

    #[test]
    fn overlapping_destinations_are_refused() {
        let err = plan_chunks([(0, 0, 4096), (4096, 2048, 4096)], 4096).unwrap_err();
        assert!(matches!(err, FabricError::InvalidArgument(ref m) if m.contains("overlap")), "{err}");
        // The same page twice, and adjacent or empty pieces (fine).
        assert!(plan_chunks([(0, 8192, 4096), (4096, 8192, 4096)], 4096).is_err());
        assert!(plan_chunks([(0, 0, 4096), (4096, 4096, 4096), (0, 100, 0)], 4096).is_ok());
    }
}
