//! How one request is cut into posted operations across the N domains of a device.
//!
//! Pure functions, so the rules are testable without a network. The immediate contract that
//! follows from them (see [`place_imm`]): **a request delivers each of its immediates exactly once
//! per target peer, however many operations it was cut into.** Single-operation targets carry the
//! immediate on their data; multi-operation targets get one zero-byte immediate after all data was
//! delivered (FI_DELIVERY_COMPLETE), so a receiver never has to know how the sender sharded.

/// Shards of a single write are multiples of this many bytes (except the last).
pub const SHARD_ALIGN: u64 = 8 * 1024;

/// One posted data operation of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// Index of the target peer within the request.
    pub peer: u32,
    /// Local domain (and, as all peers have the same N, the peer's domain) to use.
    pub domain: u16,
    pub src_offset: u64,
    pub len: u64,
    pub dst_offset: u64,
    /// The immediate carried by this very operation (single-operation targets only).
    pub imm: Option<u32>,
}

/// A zero-byte immediate write posted once every data shard of the request was delivered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeferredImm {
    pub peer: u32,
    pub domain: u16,
    pub imm: u32,
}

/// Which domains a single write may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DomainChoice {
    /// Shard over up to `k` domains (clamped to 1..=N), starting at a rotating domain.
    Shard(usize),
    /// All bytes on this one domain.
    Pinned(usize),
}

/// (domain, offset, length) pieces of one contiguous transfer; inline for up to 4 (no heap
/// allocation for the usual request or scatter target).
pub type Pieces = smallvec::SmallVec<[(usize, u64, u64); 4]>;

/// Whether a write of `len` bytes stays whole on one domain (shorter than `min_shard_len`, or too
/// short for two aligned shards).
pub fn stays_whole(len: u64, min_shard_len: u64) -> bool {
    len < min_shard_len.max(2 * SHARD_ALIGN)
}

/// Splits `len` bytes over `k` domains starting at `start`: (domain, offset, len) pieces, each a
/// multiple of [`SHARD_ALIGN`] except the last. Writes under `min_shard_len` stay whole.
pub fn split_bytes(len: u64, n_domains: usize, k: usize, start: usize, min_shard_len: u64) -> Pieces {
    let n = n_domains.max(1);
    let k = k.clamp(1, n) as u64;
    if k == 1 || stays_whole(len, min_shard_len) {
        return smallvec::smallvec![(start % n, 0, len)];
    }
    let per = len.div_ceil(k).div_ceil(SHARD_ALIGN) * SHARD_ALIGN;
    let mut out = Pieces::with_capacity(k as usize);
    let mut offset = 0;
    while offset < len {
        let piece = per.min(len - offset);
        out.push(((start + out.len()) % n, offset, piece));
        offset += piece;
    }
    out
}

/// The (source offset, destination offset, length) runs of a paged write: consecutive pages
/// that are adjacent on both sides (a fresh request's blocks often are) become one run of at
/// most `max_run` bytes, so the provider posts one write instead of one per page.
pub fn page_runs(pages: impl IntoIterator<Item = (u64, u64)>, page_len: u64, max_run: u64) -> Vec<(u64, u64, u64)> {
    let mut runs: Vec<(u64, u64, u64)> = Vec::new();
    for (src, dst) in pages {
        match runs.last_mut() {
            Some((s, d, len)) if *s + *len == src && *d + *len == dst && *len + page_len <= max_run => {
                *len += page_len;
            }
            _ => runs.push((src, dst, page_len)),
        }
    }
    runs
}

/// Places a single-target request's immediate: on its data when the request is one shard, else
/// as one zero-byte immediate to send once every shard was delivered (on the first shard's
/// domain). Every single write runs it.
pub fn place_imm(shards: &mut [Shard], imm: Option<u32>) -> Vec<DeferredImm> {
    if let [only] = shards {
        only.imm = imm;
        return Vec::new();
    }
    shards.iter_mut().for_each(|s| s.imm = None);
    let domain = shards.first().map_or(0, |s| s.domain);
    imm.map(|imm| DeferredImm { peer: 0, domain, imm }).into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_runs_merge_only_pages_adjacent_on_both_sides() {
        // 0,1,2 adjacent on both sides; 3 adjacent in the source only; 5 starts again.
        let pages = [(0, 100), (10, 110), (20, 120), (30, 200), (50, 210)];
        assert_eq!(page_runs(pages, 10, 1 << 20), vec![(0, 100, 30), (30, 200, 10), (50, 210, 10)]);
        // runs are cut at max_run
        let adjacent = (0..5).map(|i| (i * 10, 1000 + i * 10));
        assert_eq!(page_runs(adjacent, 10, 20), vec![(0, 1000, 20), (20, 1020, 20), (40, 1040, 10)]);
        // a page repeated is not adjacent to itself
        assert_eq!(page_runs([(0, 0), (0, 0)], 10, 100), vec![(0, 0, 10), (0, 0, 10)]);
        // runs cover exactly the pages' bytes
        let pages: Vec<(u64, u64)> = [3u64, 4, 5, 9, 10, 2].iter().map(|&p| (p * 8, (p + 1) * 8)).collect();
        let runs = page_runs(pages.iter().copied(), 8, 1 << 20);
        let covered: Vec<(u64, u64)> =
            runs.iter().flat_map(|&(s, d, len)| (0..len / 8).map(move |k| (s + 8 * k, d + 8 * k))).collect();
        assert_eq!(covered, pages);
    }

    fn total(pieces: &[(usize, u64, u64)]) -> u64 {
        pieces.iter().map(|p| p.2).sum()
    }

    #[test]
    fn small_or_unsharded_writes_stay_whole() {
        assert_eq!(split_bytes(1000, 4, 4, 6, 0).to_vec(), vec![(2, 0, 1000)]);
        assert_eq!(split_bytes(1 << 20, 4, 1, 1, 0).to_vec(), vec![(1, 0, 1 << 20)]);
        assert_eq!(split_bytes(0, 2, 2, 0, 0).to_vec(), vec![(0, 0, 0)]);
    }

    #[test]
    fn shards_are_aligned_cover_everything_and_rotate() {
        for len in [16 * 1024, 100_000, (1 << 20) + 3, 64 << 20] {
            for n in 1..=4 {
                for start in 0..4 {
                    let p = split_bytes(len, n, n, start, 0);
                    assert_eq!(total(&p), len, "len {len} n {n}");
                    assert!(p.len() <= n);
                    let mut expect = 0;
                    for (i, (d, off, l)) in p.iter().enumerate() {
                        assert_eq!(*off, expect);
                        expect += l;
                        assert_eq!(*d, (start + i) % n);
                        if i + 1 < p.len() {
                            assert_eq!(l % SHARD_ALIGN, 0);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn one_logical_imm_per_request() {
        let mk = |domain| Shard { peer: 0, domain, src_offset: 0, len: 1, dst_offset: 0, imm: Some(1) };
        // One shard: the immediate rides on the data.
        let mut one = [mk(1)];
        assert!(place_imm(&mut one, Some(5)).is_empty());
        assert_eq!(one[0].imm, Some(5));
        // Several: none on the data, one deferred on the first shard's domain.
        let mut three = [mk(1), mk(0), mk(1)];
        assert_eq!(place_imm(&mut three, Some(6)), vec![DeferredImm { peer: 0, domain: 1, imm: 6 }]);
        assert!(three.iter().all(|s| s.imm.is_none()));
        // No immediate: nothing anywhere.
        let mut two = [mk(0), mk(1)];
        assert!(place_imm(&mut two, None).is_empty() && two.iter().all(|s| s.imm.is_none()));
    }

    #[test]
    fn request_without_shards_still_gets_its_imm() {
        assert_eq!(place_imm(&mut [], Some(9)), vec![DeferredImm { peer: 0, domain: 0, imm: 9 }]);
    }
}
