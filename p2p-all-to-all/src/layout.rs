//! Byte offsets of every array in a rank's shared region, local state and host block (the map
//! in `kernels/a2a_common.cuh`). Identical on every rank for one [`Config`].
use crate::config::Config;

const ALIGN: usize = 256;

fn align(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// Bytes of the host block: 8 error words, the counts' sequence number at 64, counts at 128.
pub const HOST_COUNTS_OFFSET: usize = 128;
/// Byte offset of the counts' sequence number in the host block.
pub const HOST_SEQ_OFFSET: usize = 64;
/// Error words in the host block.
pub const NUM_ERROR_WORDS: usize = 8;

/// Offsets (bytes) of the arrays the kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Size of the shared (IPC) region.
    pub shared_bytes: usize,
    /// `dflag[W]` u64.
    pub off_dflag: usize,
    /// `dack[W]` u64.
    pub off_dack: usize,
    /// `cwflag[W]` u64.
    pub off_cwflag: usize,
    /// `cflag[W]` u64.
    pub off_cflag: usize,
    /// `dcnt[W][L]` i32.
    pub off_dcnt: usize,
    /// `hdr[W][Tmax][K]` (i32, i32).
    pub off_hdr: usize,
    /// `data[W][Tmax][rec_bytes]`.
    pub off_data: usize,
    /// `cw[W][Tmax][K]` f32.
    pub off_cw: usize,
    /// `cdata[W][Tmax][hidden]` bf16.
    pub off_cdata: usize,
    /// Bytes of one dispatched token record (values, then fp32 scales), a multiple of 16.
    pub rec_bytes: usize,
    /// Size of the local state.
    pub state_bytes: usize,
    /// `seq[4]` u64.
    pub st_seq: usize,
    /// `done[4]` u32.
    pub st_done: usize,
    /// `poison` u32.
    pub st_poison: usize,
    /// `my_tokens` u32.
    pub st_my_tokens: usize,
    /// `recv_tokens[W]` u32.
    pub st_recv_tokens: usize,
    /// `token_mask[Tmax]` u32.
    pub st_token_mask: usize,
    /// `map[W][Tmax][K]` i32.
    pub st_map: usize,
    /// Size of the pinned host block.
    pub host_bytes: usize,
}

impl Layout {
    /// The layout for `cfg` (assumed valid).
    pub fn new(cfg: &Config) -> Self {
        let (w, t, k, l, h) = (
            cfg.world_size,
            cfg.max_num_tokens,
            cfg.experts_per_token,
            cfg.local_experts(),
            cfg.hidden,
        );
        let rec_bytes = (cfg.data_bytes() + 4 * cfg.num_scales()).div_ceil(16) * 16;
        let mut at = 0usize;
        let mut take = |bytes: usize| {
            let off = at;
            at = align(at + bytes);
            off
        };
        let off_dflag = take(8 * w);
        let off_dack = take(8 * w);
        let off_cwflag = take(8 * w);
        let off_cflag = take(8 * w);
        let off_dcnt = take(4 * w * l);
        let off_hdr = take(8 * w * t * k);
        let off_data = take(w * t * rec_bytes);
        let off_cw = take(4 * w * t * k);
        let off_cdata = take(2 * w * t * h);
        let shared_bytes = at;

        let mut at = 0usize;
        let mut take = |bytes: usize| {
            let off = at;
            at = align(at + bytes);
            off
        };
        let st_seq = take(8 * 4);
        let st_done = take(4 * 4);
        let st_poison = take(4);
        let st_my_tokens = take(4);
        let st_recv_tokens = take(4 * w);
        let st_token_mask = take(4 * t);
        let st_map = take(4 * w * t * k);
        let state_bytes = at;
        Layout {
            shared_bytes,
            off_dflag,
            off_dack,
            off_cwflag,
            off_cflag,
            off_dcnt,
            off_hdr,
            off_data,
            off_cw,
            off_cdata,
            rec_bytes,
            state_bytes,
            st_seq,
            st_done,
            st_poison,
            st_my_tokens,
            st_recv_tokens,
            st_token_mask,
            st_map,
            host_bytes: align(HOST_COUNTS_OFFSET + 4 * cfg.num_experts),
        }
    }

    /// The flag words at the start of the shared region (zeroed before peers connect).
    pub fn flag_bytes(&self) -> usize {
        self.off_dcnt
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
                l.off_dflag,
                l.off_dack,
                l.off_cwflag,
                l.off_cflag,
                l.off_dcnt,
                l.off_hdr,
                l.off_data,
                l.off_cw,
                l.off_cdata,
                l.shared_bytes,
            ];
            assert!(offs.windows(2).all(|p| p[0] < p[1]), "{offs:?}");
            assert!(offs.iter().all(|o| o % 256 == 0));
            assert_eq!(l.rec_bytes % 16, 0);
            assert!(l.off_cdata - l.off_data >= 4 * 128 * l.rec_bytes);
            assert_eq!(l.shared_bytes - l.off_cdata, 2 * 4 * 128 * 7168);
        }
        let fp8 = Layout::new(&cfg(DispatchDtype::Fp8E4m3, 128));
        assert_eq!(fp8.rec_bytes, 7168 + 56 * 4);
        assert_eq!(Layout::new(&cfg(DispatchDtype::Bf16, 128)).rec_bytes, 14336);
    }

    #[test]
    fn prefill_fits_in_a_few_hundred_megabytes() {
        let l = Layout::new(&cfg(DispatchDtype::Bf16, 4096));
        assert!(l.shared_bytes < 600 << 20, "{}", l.shared_bytes);
    }
}
