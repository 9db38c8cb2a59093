//! The RDMA half's arithmetic: which ranks are remote, the sizes and offsets of the remote-traffic
//! buffers and of the proxy block, the count message, and the offsets every rank derives from
//! all ranks' counts (overflow positions, combine segments). The kernels
//! (`kernels/a2a_common.cuh`) and the proxy (`src/proxy.rs`) use the same numbers.
//!
//! Per rank, for dispatch call `n` (parity `p = n & 1`; every array is doubled by parity):
//! - `dsend[p][W][Tmax]` records: tokens packed per destination, in the order the send kernel
//!   claimed them (record `j` of destination `d`).
//! - `drecv[p]`: a private area of `private_tokens` records per source (`[W][Q]`), then a shared
//!   overflow area of `W * (Tmax - Q)` records. Source `s`'s records `[0, Q)` land in its private
//!   area, records `[Q, n)` at [`overflow_offset`] in the overflow area.
//! - `csend[p]` / `crecv[p]` bf16 rows: combine returns every (token, slot) row unweighted;
//!   the source weights and sums the k copies. See [`combine_segment_at_source`].
use crate::error::{invalid, Result};

/// Which ranks share an NVLink domain: consecutive groups of `nvlink` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Topology {
    /// Ranks in the group.
    pub world: usize,
    /// Ranks per NVLink domain (divides `world`).
    pub nvlink: usize,
}

impl Topology {
    /// Checks that `nvlink` divides `world`.
    pub fn new(world: usize, nvlink: usize) -> Result<Self> {
        if nvlink == 0 || world == 0 || world % nvlink != 0 {
            return Err(invalid!("nvlink={nvlink} must be at least 1 and divide the world size {world}"));
        }
        Ok(Topology { world, nvlink })
    }

    /// The NVLink domain of rank `r`.
    pub fn domain_of(&self, r: usize) -> usize {
        r / self.nvlink
    }

    /// Whether `a` and `b` reach each other through the engine (different domains).
    pub fn is_remote(&self, a: usize, b: usize) -> bool {
        self.domain_of(a) != self.domain_of(b)
    }

    /// Whether any rank is remote to any other.
    pub fn has_remote(&self) -> bool {
        self.nvlink < self.world
    }

    /// Bit mask of the ranks in `r`'s domain.
    pub fn nvlink_mask(&self, r: usize) -> u64 {
        let first = self.domain_of(r) * self.nvlink;
        (first..first + self.nvlink).fold(0u64, |m, q| m | (1 << q))
    }
}

/// Bytes of a remote record's header after the token record: token index (u32), slot mask
/// (u32), then `(local expert, position)` (i32, i32) per slot, padded to 16 bytes.
pub fn header_bytes(topk: usize) -> usize {
    (8 + 8 * topk).div_ceil(16) * 16
}

/// Immediate kinds (what a remote write announces).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImmKind {
    /// A dispatch count message.
    Counts = 0,
    /// A dispatch data write (private quota or overflow).
    DispatchData = 1,
    /// A combine write (rows, or only the immediate when there are none).
    Combine = 2,
}

/// Tag in the top byte of every immediate of the all-to-all (other users of the engine keep
/// other values).
const IMM_TAG: u32 = 0xA2 << 24;
/// Calls apart that reuse an immediate value (every arrival is consumed long before).
pub const IMM_SEQ_MASK: u32 = 0xfff;

/// The immediate of (`kind`, call `seq`, sending rank `src` < 256).
pub fn imm(kind: ImmKind, seq: u32, src: usize) -> u32 {
    IMM_TAG | ((kind as u32) << 20) | ((seq & IMM_SEQ_MASK) << 8) | (src as u32 & 0xff)
}

/// Sizes of the remote-traffic buffers (identical on every rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteLayout {
    pub world: usize,
    pub num_experts: usize,
    pub topk: usize,
    pub max_tokens: usize,
    /// Records per (source, destination) pair sent into the destination's private area.
    pub private_tokens: usize,
    /// Bytes of one remote record (token record, then header), a multiple of 16.
    pub rrec_bytes: usize,
    /// Bytes of one combine row (bf16 hidden).
    pub row_bytes: usize,
    /// Rows of one parity of `csend` (every remote source's rows to this rank: `W * Tmax * K`).
    pub csend_rows: usize,
    /// Rows of one parity of `crecv` (this rank's (token, slot) pairs: `Tmax * K`).
    pub crecv_rows: usize,
    /// Bytes of one count message: seq u64, tokens per destination `[W]` u32, rows per expert
    /// `[E]` u32, padded to 64.
    pub msg_bytes: usize,
}

impl RemoteLayout {
    /// The layout for a record of `rec_bytes` (values, scales, padding) and `hidden` bf16
    /// combine rows.
    pub fn new(
        world: usize,
        num_experts: usize,
        topk: usize,
        max_tokens: usize,
        private_tokens: usize,
        rec_bytes: usize,
        hidden: usize,
    ) -> Self {
        RemoteLayout {
            world,
            num_experts,
            topk,
            max_tokens,
            private_tokens: private_tokens.min(max_tokens),
            rrec_bytes: rec_bytes + header_bytes(topk),
            row_bytes: 2 * hidden,
            csend_rows: world * max_tokens * topk,
            crecv_rows: max_tokens * topk,
            msg_bytes: (8 + 4 * world + 4 * num_experts).div_ceil(64) * 64,
        }
    }

    /// Records of one parity of `dsend` (`[W][Tmax]`).
    pub fn dsend_records(&self) -> usize {
        self.world * self.max_tokens
    }

    /// Bytes of `dsend` (both parities).
    pub fn dsend_bytes(&self) -> usize {
        2 * self.dsend_records() * self.rrec_bytes
    }

    /// Byte offset of record `j` for destination `d` in parity `p` of `dsend`.
    pub fn dsend_offset(&self, p: usize, d: usize, j: usize) -> usize {
        ((p * self.world + d) * self.max_tokens + j) * self.rrec_bytes
    }

    /// Records of one parity of `drecv`: `W` private areas, then the overflow area.
    pub fn drecv_records(&self) -> usize {
        self.world * self.private_tokens + self.overflow_records()
    }

    /// Records of the overflow area (the worst case: every source sends `Tmax`).
    pub fn overflow_records(&self) -> usize {
        self.world * (self.max_tokens - self.private_tokens)
    }

    /// Bytes of `drecv` (both parities).
    pub fn drecv_bytes(&self) -> usize {
        2 * self.drecv_records() * self.rrec_bytes
    }

    /// Byte offset in `drecv` of parity `p` of source `s`'s private record `j` (< Q).
    pub fn private_offset(&self, p: usize, s: usize, j: usize) -> usize {
        (p * self.drecv_records() + s * self.private_tokens + j) * self.rrec_bytes
    }

    /// Byte offset in `drecv` of parity `p` of overflow record `k`.
    pub fn overflow_byte_offset(&self, p: usize, k: usize) -> usize {
        (p * self.drecv_records() + self.world * self.private_tokens + k) * self.rrec_bytes
    }

    /// Bytes of `csend` (both parities).
    pub fn csend_bytes(&self) -> usize {
        2 * self.csend_rows * self.row_bytes
    }

    /// Bytes of `crecv` (both parities).
    pub fn crecv_bytes(&self) -> usize {
        2 * self.crecv_rows * self.row_bytes
    }

    /// Byte offset of row `r` of parity `p` of `csend`.
    pub fn csend_offset(&self, p: usize, r: usize) -> usize {
        (p * self.csend_rows + r) * self.row_bytes
    }

    /// Byte offset of row `r` of parity `p` of `crecv`.
    pub fn crecv_offset(&self, p: usize, r: usize) -> usize {
        (p * self.crecv_rows + r) * self.row_bytes
    }
}

/// All ranks' counts of one dispatch: `tok[s][d]` records `s` sends `d`, `hist[s][e]` rows `s`
/// sends expert `e`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counts {
    pub tok: Vec<Vec<u32>>,
    pub hist: Vec<Vec<u32>>,
}

impl Counts {
    /// All zero for `world` ranks and `experts` experts.
    pub fn new(world: usize, experts: usize) -> Self {
        Counts { tok: vec![vec![0; world]; world], hist: vec![vec![0; experts]; world] }
    }

    /// Rows (token, slot pairs) `s` sends to `d`.
    pub fn rows(&self, s: usize, d: usize) -> usize {
        let l = self.hist[s].len() / self.tok.len();
        self.hist[s][d * l..(d + 1) * l].iter().map(|&c| c as usize).sum()
    }
}

/// Where source `s`'s records beyond the private quota `q` start in `d`'s overflow area: the
/// overflow of the remote sources of `d` before `s`.
pub fn overflow_offset(c: &Counts, topo: &Topology, q: usize, s: usize, d: usize) -> usize {
    (0..s).filter(|&x| topo.is_remote(x, d)).map(|x| (c.tok[x][d] as usize).saturating_sub(q)).sum()
}

/// Where expert rank `d` packs the rows it returns to source `s` in its `csend`: after those of
/// the remote sources before `s`.
pub fn combine_segment_at_expert(c: &Counts, topo: &Topology, s: usize, d: usize) -> usize {
    (0..s).filter(|&x| topo.is_remote(x, d)).map(|x| c.rows(x, d)).sum()
}

/// Where the rows from expert rank `d` land in source `s`'s `crecv`: after those of the remote
/// ranks before `d`. Within a segment, rows are expert-major: the rows of `d`'s local expert
/// `el` start at the rows `s` sends to `d`'s experts before `el`, then by position (the order of
/// `s`'s (token, slot) pairs).
pub fn combine_segment_at_source(c: &Counts, topo: &Topology, s: usize, d: usize) -> usize {
    (0..d).filter(|&x| topo.is_remote(s, x)).map(|x| c.rows(s, x)).sum()
}

/// Encodes this rank's count message (see [`RemoteLayout::msg_bytes`]).
pub fn encode_counts(seq: u64, tok: &[u32], hist: &[u32], out: &mut [u8]) {
    out[..8].copy_from_slice(&seq.to_le_bytes());
    for (i, v) in tok.iter().chain(hist.iter()).enumerate() {
        out[8 + 4 * i..12 + 4 * i].copy_from_slice(&v.to_le_bytes());
    }
}

/// Decodes a count message into (seq, tokens per destination, rows per expert).
pub fn decode_counts(msg: &[u8], world: usize, experts: usize) -> (u64, Vec<u32>, Vec<u32>) {
    let word = |i: usize| u32::from_le_bytes(msg[8 + 4 * i..12 + 4 * i].try_into().expect("4 bytes"));
    let seq = u64::from_le_bytes(msg[..8].try_into().expect("8 bytes"));
    ((seq), (0..world).map(word).collect(), (world..world + experts).map(word).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic pseudo-random generator (no dependency needed for a few property loops).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self, n: u32) -> u32 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((self.0 >> 33) % n as u64) as u32
        }
    }

    /// The counts of a random routing: each rank has up to `t` tokens with `k` slots, each slot
    /// an expert of `w * l` or none.
    fn random_counts(rng: &mut Lcg, w: usize, l: usize, t: u32, k: usize) -> Counts {
        let mut c = Counts::new(w, w * l);
        for s in 0..w {
            for _ in 0..rng.next(t + 1) {
                let mut dests = 0u64;
                for _ in 0..k {
                    if rng.next(8) == 0 {
                        continue; // no expert
                    }
                    let e = rng.next((w * l) as u32) as usize;
                    c.hist[s][e] += 1;
                    dests |= 1 << (e / l);
                }
                for d in 0..w {
                    c.tok[s][d] += ((dests >> d) & 1) as u32;
                }
            }
        }
        c
    }

    #[test]
    fn topology() {
        assert!(Topology::new(6, 4).is_err());
        assert!(Topology::new(4, 0).is_err());
        let t = Topology::new(8, 4).unwrap();
        assert!(t.has_remote());
        assert!(!t.is_remote(1, 3));
        assert!(t.is_remote(3, 4));
        assert_eq!(t.nvlink_mask(5), 0xf0);
        assert!(!Topology::new(4, 4).unwrap().has_remote());
        assert_eq!(Topology::new(4, 1).unwrap().nvlink_mask(2), 0b100);
    }

    #[test]
    fn immediates_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for kind in [ImmKind::Counts, ImmKind::DispatchData, ImmKind::Combine] {
            for seq in 0..=IMM_SEQ_MASK {
                for src in 0..16 {
                    assert!(seen.insert(imm(kind, seq, src)));
                }
            }
        }
        assert_eq!(imm(ImmKind::Counts, IMM_SEQ_MASK + 1, 3), imm(ImmKind::Counts, 0, 3));
    }

    #[test]
    fn overflow_areas_are_disjoint_and_fit() {
        // Property: for every destination, the remote sources' overflow ranges tile a prefix
        // of the overflow area without overlap, whatever the counts and quota.
        let mut rng = Lcg(7);
        for case in 0..500 {
            let w = 1 + rng.next(8) as usize;
            let nvlink = [1, w].into_iter().chain((1..=w).filter(|n| w % n == 0)).nth(rng.next(3) as usize).unwrap();
            let topo = Topology::new(w, nvlink).unwrap();
            let t = 1 + rng.next(40);
            let q = rng.next(t + 1) as usize;
            let c = random_counts(&mut rng, w, 2, t, 4);
            let lay = RemoteLayout::new(w, 2 * w, 4, t as usize, q, 128, 64);
            for d in 0..w {
                let mut next = 0;
                for s in (0..w).filter(|&s| topo.is_remote(s, d)) {
                    let off = overflow_offset(&c, &topo, q, s, d);
                    assert_eq!(off, next, "case {case}: source {s} to {d}");
                    next += (c.tok[s][d] as usize).saturating_sub(q);
                }
                assert!(next <= lay.overflow_records(), "case {case}");
            }
        }
    }

    #[test]
    fn combine_segments_agree_on_both_sides() {
        // The expert rank's csend segment for s holds rows(s, d) rows; the source finds them
        // at its own segment for d; segments of one buffer tile it.
        let mut rng = Lcg(11);
        for _ in 0..300 {
            let w = 2 + rng.next(7) as usize;
            let topo = Topology::new(w, 1).unwrap();
            let c = random_counts(&mut rng, w, 3, 20, 3);
            for d in 0..w {
                let mut next = 0;
                for s in (0..w).filter(|&s| topo.is_remote(s, d)) {
                    assert_eq!(combine_segment_at_expert(&c, &topo, s, d), next);
                    next += c.rows(s, d);
                }
                assert!(next <= RemoteLayout::new(w, 3 * w, 3, 20, 4, 128, 64).csend_rows);
            }
            for s in 0..w {
                let mut next = 0;
                for d in (0..w).filter(|&d| topo.is_remote(s, d)) {
                    assert_eq!(combine_segment_at_source(&c, &topo, s, d), next);
                    next += c.rows(s, d);
                }
                assert!(next <= RemoteLayout::new(w, 3 * w, 3, 20, 4, 128, 64).crecv_rows);
            }
        }
    }

    #[test]
    fn count_messages_round_trip() {
        let lay = RemoteLayout::new(4, 32, 8, 128, 16, 7424, 7168);
        assert_eq!(lay.msg_bytes % 64, 0);
        assert!(lay.msg_bytes >= 8 + 4 * 36);
        let tok = [1, 2, 3, 4];
        let hist: Vec<u32> = (0..32).collect();
        let mut buf = vec![0u8; lay.msg_bytes];
        encode_counts(9, &tok, &hist, &mut buf);
        assert_eq!(decode_counts(&buf, 4, 32), (9, tok.to_vec(), hist));
    }

    #[test]
    fn buffer_offsets() {
        let lay = RemoteLayout::new(4, 32, 8, 128, 16, 7424, 7168);
        assert_eq!(lay.rrec_bytes, 7424 + 80);
        assert_eq!(lay.rrec_bytes % 16, 0);
        assert_eq!(lay.drecv_records(), 4 * 128);
        assert_eq!(lay.private_offset(1, 0, 0), lay.drecv_records() * lay.rrec_bytes);
        assert_eq!(lay.overflow_byte_offset(0, 0), 4 * 16 * lay.rrec_bytes);
        assert_eq!(lay.dsend_offset(1, 3, 127) + lay.rrec_bytes, lay.dsend_bytes());
        assert_eq!(lay.csend_offset(1, lay.csend_rows - 1) + lay.row_bytes, lay.csend_bytes());
        assert_eq!(lay.crecv_offset(1, lay.crecv_rows - 1) + lay.row_bytes, lay.crecv_bytes());
        // A quota above the token limit is clamped: no overflow area.
        assert_eq!(RemoteLayout::new(4, 32, 8, 128, 500, 7424, 7168).overflow_records(), 0);
    }
}
