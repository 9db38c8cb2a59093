//! The proxy block: host memory that the kernels (through a mapped device pointer), the proxy
//! thread and remote ranks (RDMA writes of count messages) share. One per rank, registered with
//! the engine. Byte offsets; every array doubled by call parity `p` is indexed `[p]` first.
//!
//! | word | written by | meaning |
//! |---|---|---|
//! | `dseq` u64 | send kernel | counts of dispatch `n` are in `pub_tok[p]` / `pub_hist[p]` |
//! | `ddone` u64 | send kernel | dispatch `n`'s records for remote ranks are packed in `dsend[p]` |
//! | `cdone` u64 | combine send kernel | `(cn << 32) \| dn`: combine `cn`'s rows (routing of dispatch `dn`) are in `csend` |
//! | `error` u64 | proxy | nonzero: the proxy failed (a write failed, a message was malformed) |
//! | `rcf[2][W]` u64 | proxy | `(n << 32) \| records`: every rank's counts of dispatch `n` arrived (remote source `s`) |
//! | `rflag[2][W]` u64 | proxy | `(n << 32) \| records`: every record of remote source `s` arrived |
//! | `rovf[2][W]` u64 | proxy | where source `s`'s overflow records start in the overflow area |
//! | `crflag[W]` u64 | proxy | `cn << 32`: remote rank `d`'s combine rows arrived |
//! | `pub_tok[2][W]` u32 | send kernel | records this rank sends to each rank |
//! | `pub_hist[2][E]` u32 | send kernel | rows this rank sends to each expert |
//! | `msg_out[2]` | proxy | this rank's count message (source of its writes) |
//! | `msg_in[2][W]` | peers | every rank's count message |
use crate::remote::RemoteLayout;

const ALIGN: usize = 64;

fn take(next: &mut usize, bytes: usize) -> usize {
    let off = *next;
    *next = (off + bytes).div_ceil(ALIGN) * ALIGN;
    off
}

/// Offsets of the proxy block (identical on every rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLayout {
    pub dseq: usize,
    pub ddone: usize,
    pub cdone: usize,
    pub error: usize,
    pub rcf: usize,
    pub rflag: usize,
    pub rovf: usize,
    pub crflag: usize,
    pub pub_tok: usize,
    pub pub_hist: usize,
    pub msg_out: usize,
    pub msg_in: usize,
    pub msg_bytes: usize,
    pub world: usize,
    pub experts: usize,
    /// Size of the block.
    pub bytes: usize,
}

impl BlockLayout {
    /// The block of a rank with `lay`'s sizes.
    pub fn new(lay: &RemoteLayout) -> Self {
        let (w, e) = (lay.world, lay.num_experts);
        let mut next = 0;
        let dseq = take(&mut next, 8);
        let ddone = take(&mut next, 8);
        let cdone = take(&mut next, 8);
        let error = take(&mut next, 8);
        let rcf = take(&mut next, 2 * 8 * w);
        let rflag = take(&mut next, 2 * 8 * w);
        let rovf = take(&mut next, 2 * 8 * w);
        let crflag = take(&mut next, 8 * w);
        let pub_tok = take(&mut next, 2 * 4 * w);
        let pub_hist = take(&mut next, 2 * 4 * e);
        let msg_out = take(&mut next, 2 * lay.msg_bytes);
        let msg_in = take(&mut next, 2 * w * lay.msg_bytes);
        BlockLayout {
            dseq,
            ddone,
            cdone,
            error,
            rcf,
            rflag,
            rovf,
            crflag,
            pub_tok,
            pub_hist,
            msg_out,
            msg_in,
            msg_bytes: lay.msg_bytes,
            world: w,
            experts: e,
            bytes: next,
        }
    }

    /// Offset of `rcf[p][s]`.
    pub fn rcf_at(&self, p: usize, s: usize) -> usize {
        self.rcf + 8 * (p * self.world + s)
    }

    /// Offset of `rflag[p][s]`.
    pub fn rflag_at(&self, p: usize, s: usize) -> usize {
        self.rflag + 8 * (p * self.world + s)
    }

    /// Offset of `rovf[p][s]`.
    pub fn rovf_at(&self, p: usize, s: usize) -> usize {
        self.rovf + 8 * (p * self.world + s)
    }

    /// Offset of `crflag[d]`.
    pub fn crflag_at(&self, d: usize) -> usize {
        self.crflag + 8 * d
    }

    /// Offset of `pub_tok[p][d]`.
    pub fn pub_tok_at(&self, p: usize, d: usize) -> usize {
        self.pub_tok + 4 * (p * self.world + d)
    }

    /// Offset of `pub_hist[p][e]`.
    pub fn pub_hist_at(&self, p: usize, e: usize) -> usize {
        self.pub_hist + 4 * (p * self.experts + e)
    }

    /// Offset of `msg_out[p]`.
    pub fn msg_out_at(&self, p: usize) -> usize {
        self.msg_out + p * self.msg_bytes
    }

    /// Offset of `msg_in[p][s]`.
    pub fn msg_in_at(&self, p: usize, s: usize) -> usize {
        self.msg_in + (p * self.world + s) * self.msg_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays_are_disjoint() {
        let lay = RemoteLayout::new(8, 64, 4, 32, 8, 1024, 512);
        let b = BlockLayout::new(&lay);
        let ends = [
            (b.dseq, 8),
            (b.ddone, 8),
            (b.cdone, 8),
            (b.error, 8),
            (b.rcf, 16 * 8),
            (b.rflag, 16 * 8),
            (b.rovf, 16 * 8),
            (b.crflag, 8 * 8),
            (b.pub_tok, 2 * 4 * 8),
            (b.pub_hist, 2 * 4 * 64),
            (b.msg_out, 2 * lay.msg_bytes),
            (b.msg_in, 16 * lay.msg_bytes),
        ];
        for w in ends.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{w:?}");
        }
        assert_eq!(b.msg_in_at(1, 7) + lay.msg_bytes, b.bytes);
        assert_eq!(b.rflag_at(1, 7) + 8, b.rovf);
        assert_eq!(b.pub_hist_at(1, 63) + 4, b.pub_hist + 2 * 4 * 64);
    }
}
