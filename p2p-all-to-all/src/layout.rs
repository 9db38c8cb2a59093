//! Byte offsets of every array in a rank's shared region, local state and host block (the map
//! in `kernels/a2a_common.cuh`). Identical on every rank for one [`Config`].
use crate::config::Config;

const ALIGN: usize = 256;

fn align(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// Offsets handed out one after another, each array starting on an `ALIGN` boundary; the
/// position after the last is the region's size.
#[derive(Default)]
struct Regions(usize);

impl Regions {
    fn take(&mut self, bytes: usize) -> usize {
        let off = self.0;
        self.0 = align(off + bytes);
        off
    }
}

/// Bytes of the host block: 8 error words, the counts' sequence number at 64, counts at 128.
pub const HOST_COUNTS_OFFSET: usize = 128;
/// Byte offset of the counts' sequence number in the host block.
pub const HOST_SEQ_OFFSET: usize = 64;
/// Error words in the host block.
pub const NUM_ERROR_WORDS: usize = 8;

/// Proxy flags a kernel may wait for (`A2A_HOST_KEYS` in the kernels): a count flag and a
/// records flag per source in dispatch, a rows flag per rank in combine.
pub const HOST_WAIT_KEYS: usize = 3 * crate::config::MAX_PEERS;

/// Sequence counters per kernel kind and block (`A2A_MAX_GRID` in the kernels).
pub const MAX_GRID: usize = 1024;
/// Bytes of one combine chunk (the unit of combine's flags): 128 vectors of 16 bytes.
pub const CHUNK_BYTES: usize = 2048;

/// Offsets (bytes) of the arrays the kernels use. Dispatch arrays are doubled (indexed by the
/// call's parity, first index); see `kernels/a2a_common.cuh`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Size of the shared (IPC) region.
    pub shared_bytes: usize,
    /// `dcf[2][W]` u64: count flags.
    pub off_dcf: usize,
    /// `dcnt[2][W][L]` i32.
    pub off_dcnt: usize,
    /// `dtf[2][W][Tmax]` u64: token flags.
    pub off_dtf: usize,
    /// `hdr[2][W][Tmax][K]` (i32, i32).
    pub off_hdr: usize,
    /// `data[2][W][Tmax][rec_bytes]`.
    pub off_data: usize,
    /// `cw[W][Tmax][K]` u64: combine weights, `(seq << 32) | fp32 bits`.
    pub off_cw: usize,
    /// `ctf[W][Tmax][combine_chunks]` u64: combine partial flags.
    pub off_ctf: usize,
    /// `cdata[W][Tmax][hidden]` bf16.
    pub off_cdata: usize,
    /// Bytes of one dispatched token record (values, then fp32 scales), a multiple of 128 (whole
    /// NVLink write packets).
    pub rec_bytes: usize,
    /// 2 KiB chunks of a bf16 row (combine's unit).
    pub combine_chunks: usize,
    /// Size of the local state.
    pub state_bytes: usize,
    /// `seq[4][MAX_GRID]` u32.
    pub st_seq: usize,
    /// `poison` u32.
    pub st_poison: usize,
    /// `my_tokens` u32.
    pub st_my_tokens: usize,
    /// `recv_tokens[W]` u32.
    pub st_recv_tokens: usize,
    /// `token_mask[Tmax]` u64: the ranks each of my tokens went to.
    pub st_token_mask: usize,
    /// `map[W][Tmax][K]` i32.
    pub st_map: usize,
    /// `queue[2]` u32: the combine senders' work counters, by call parity.
    pub st_queue: usize,
    /// Remote ranks (`kernels/a2a_common.cuh`): `rpack[2][W]` u32 records claimed per destination.
    pub st_rpack: usize,
    /// `rdone[2]` u32: dispatch send blocks done with their remote records.
    pub st_rdone: usize,
    /// `cdone_blocks[2]` u32: combine send blocks done with their remote rows.
    pub st_cdone_blocks: usize,
    /// `sslot[Tmax][K]` (i32, i32): (expert, position) of my slots.
    pub st_sslot: usize,
    /// `hist[E]` i32: my rows per expert.
    pub st_hist: usize,
    /// `rcnt[W][L]` i32: rows each remote source sent each local expert.
    pub st_rcnt: usize,
    /// `rhdr[W][Tmax][K]` (i32, i32): (local expert, position) of remote records' slots.
    pub st_rhdr: usize,
    /// `weights[Tmax][K]` f32: my top-k weights of the last combine.
    pub st_weights: usize,
    /// `last_dseq` u32: the last dispatch received.
    pub st_last_dseq: usize,
    /// `host_wait[HOST_WAIT_KEYS]` (u64 seen, u32 tag, u32): device-memory mirrors of the proxy's
    /// flags, one poller per grid (`wait_host_flag` in `kernels/a2a_common.cuh`).
    pub st_host_wait: usize,
    /// Size of the pinned host block.
    pub host_bytes: usize,
}

impl Layout {
    /// The layout for `cfg` (assumed valid).
    pub fn new(cfg: &Config) -> Self {
        let (w, t, k, l, h) =
            (cfg.world_size, cfg.max_num_tokens, cfg.experts_per_token, cfg.local_experts(), cfg.hidden);
        let rec_bytes = (cfg.data_bytes() + 4 * cfg.num_scales()).div_ceil(128) * 128;
        let combine_chunks = (2 * h).div_ceil(CHUNK_BYTES);
        let mut shared = Regions::default();
        let off_dcf = shared.take(2 * 8 * w);
        let off_dcnt = shared.take(2 * 4 * w * l);
        let off_dtf = shared.take(2 * 8 * w * t);
        let off_ctf = shared.take(8 * w * t * combine_chunks);
        let off_hdr = shared.take(2 * 8 * w * t * k);
        let off_cw = shared.take(8 * w * t * k);
        let off_data = shared.take(2 * w * t * rec_bytes);
        let off_cdata = shared.take(2 * w * t * h);
        let shared_bytes = shared.0;

        let mut state = Regions::default();
        let st_seq = state.take(4 * 4 * MAX_GRID);
        let st_poison = state.take(4);
        let st_my_tokens = state.take(4);
        let st_recv_tokens = state.take(4 * w);
        let st_token_mask = state.take(8 * t);
        let st_map = state.take(4 * w * t * k);
        let st_queue = state.take(4 * 2);
        let st_rpack = state.take(4 * 2 * w);
        let st_rdone = state.take(4 * 2);
        let st_cdone_blocks = state.take(4 * 2);
        let st_sslot = state.take(8 * t * k);
        let st_hist = state.take(4 * cfg.num_experts);
        let st_rcnt = state.take(4 * w * l);
        let st_rhdr = state.take(8 * w * t * k);
        let st_weights = state.take(4 * t * k);
        let st_last_dseq = state.take(4);
        let st_host_wait = state.take(16 * HOST_WAIT_KEYS);
        let state_bytes = state.0;
        Layout {
            shared_bytes,
            off_dcf,
            off_dcnt,
            off_dtf,
            off_hdr,
            off_data,
            off_cw,
            off_ctf,
            off_cdata,
            rec_bytes,
            combine_chunks,
            state_bytes,
            st_seq,
            st_poison,
            st_my_tokens,
            st_recv_tokens,
            st_token_mask,
            st_map,
            st_queue,
            st_rpack,
            st_rdone,
            st_cdone_blocks,
            st_sslot,
            st_hist,
            st_rcnt,
            st_rhdr,
            st_weights,
            st_last_dseq,
            st_host_wait,
            host_bytes: align(HOST_COUNTS_OFFSET + 4 * cfg.num_experts),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, DispatchDtype};
    use std::time::Duration;

    fn cfg(dtype: DispatchDtype, t: usize) -> Config {
        Config {
            rank: 0,
            world_size: 4,
            max_num_tokens: t,
            hidden: 7168,
            num_experts: 256,
            experts_per_token: 8,
            max_tokens_per_expert: 4 * t,
            dispatch_dtype: dtype,
            timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn arrays_are_aligned_ordered_and_disjoint() {
        for dtype in [DispatchDtype::Bf16, DispatchDtype::Fp8E4m3] {
            let l = Layout::new(&cfg(dtype, 128));
            let offs = [
                l.off_dcf,
                l.off_dcnt,
                l.off_dtf,
                l.off_ctf,
                l.off_hdr,
                l.off_cw,
                l.off_data,
                l.off_cdata,
                l.shared_bytes,
            ];
            assert!(offs.windows(2).all(|p| p[0] < p[1]), "{offs:?}");
            assert!(offs.iter().all(|o| o % 256 == 0));
            assert_eq!(l.rec_bytes % 128, 0);
            assert_eq!(l.combine_chunks, 7);
            assert_eq!(l.off_cdata - l.off_data, 2 * 4 * 128 * l.rec_bytes);
            assert_eq!(l.shared_bytes - l.off_cdata, 2 * 4 * 128 * 7168);
            assert_eq!(l.off_hdr - l.off_ctf, 8 * 4 * 128 * 7);
            let states = [
                l.st_seq,
                l.st_poison,
                l.st_my_tokens,
                l.st_recv_tokens,
                l.st_token_mask,
                l.st_map,
                l.st_queue,
                l.st_rpack,
                l.st_rdone,
                l.st_cdone_blocks,
                l.st_sslot,
                l.st_hist,
                l.st_rcnt,
                l.st_rhdr,
                l.st_weights,
                l.st_last_dseq,
                l.st_host_wait,
                l.state_bytes,
            ];
            assert!(states.windows(2).all(|p| p[0] < p[1]), "{states:?}");
        }
        let fp8 = Layout::new(&cfg(DispatchDtype::Fp8E4m3, 128));
        assert_eq!(fp8.rec_bytes, 7424); // 7168 values + 224 bytes of scales, padded to 128
        assert_eq!(Layout::new(&cfg(DispatchDtype::Bf16, 128)).rec_bytes, 14336);
    }

    #[test]
    fn prefill_fits_in_under_a_gigabyte() {
        // Two dispatch buffers of 4 x 4096 bf16 rows (470 MB) and one combine buffer (235 MB).
        let l = Layout::new(&cfg(DispatchDtype::Bf16, 4096));
        assert!(l.shared_bytes < 750 << 20, "{}", l.shared_bytes);
    }
}
