//! What one all-to-all object is sized for, and the checks that keep the kernels in bounds.
use std::time::Duration;

use crate::error::{invalid, Result};

/// Most ranks of one all-to-all group (the kernels keep sets of ranks in 64-bit masks and give
/// each warp lane two ranks; also the size of the NVLink peer table in their parameters).
pub const MAX_PEERS: usize = 64;
/// Most experts (the send kernel keeps two counters per expert in shared memory).
pub const MAX_EXPERTS: usize = 1024;
/// Most experts per token (one warp lane per slot).
pub const MAX_TOPK: usize = 32;
/// Most tokens per rank and call.
pub const MAX_TOKENS: usize = 1 << 20;
/// fp32 scales cover this many values each (fp8 dispatch).
pub const SCALE_BLOCK: usize = 128;
/// Threads per block of every kernel.
pub const THREADS: u32 = 512;

/// The element type of dispatched tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchDtype {
    /// bfloat16, no scales.
    Bf16,
    /// float8 e4m3 with one fp32 scale per 128 values.
    Fp8E4m3,
}

impl DispatchDtype {
    /// Bytes per element.
    pub fn elem_bytes(self) -> usize {
        match self {
            DispatchDtype::Bf16 => 2,
            DispatchDtype::Fp8E4m3 => 1,
        }
    }
}

/// Sizes of one all-to-all (identical on every rank).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// This process's rank in the expert-parallel group.
    pub rank: usize,
    /// Ranks in the group (all on this host, reachable over NVLink).
    pub world_size: usize,
    /// Most tokens a rank dispatches per call.
    pub max_num_tokens: usize,
    /// Values per token.
    pub hidden: usize,
    /// Experts in total; rank r hosts experts `[r * L, (r + 1) * L)`, `L = num_experts / world_size`.
    pub num_experts: usize,
    /// Experts per token (top-k).
    pub experts_per_token: usize,
    /// Rows per local expert in dispatch's output (rows past it are dropped and reported).
    pub max_tokens_per_expert: usize,
    /// Element type of dispatched tokens.
    pub dispatch_dtype: DispatchDtype,
    /// How long a kernel waits for a peer before it reports a timeout and gives up.
    pub timeout: Duration,
}

impl Config {
    /// Experts hosted by each rank.
    pub fn local_experts(&self) -> usize {
        self.num_experts / self.world_size.max(1)
    }

    /// fp32 scales per token (0 for bf16).
    pub fn num_scales(&self) -> usize {
        match self.dispatch_dtype {
            DispatchDtype::Bf16 => 0,
            DispatchDtype::Fp8E4m3 => self.hidden / SCALE_BLOCK,
        }
    }

    /// Bytes of one dispatched token's values.
    pub fn data_bytes(&self) -> usize {
        self.hidden * self.dispatch_dtype.elem_bytes()
    }

    /// Checks every limit the kernels rely on.
    pub fn validate(&self) -> Result<()> {
        let (w, e, k) = (self.world_size, self.num_experts, self.experts_per_token);
        if w == 0 || w > MAX_PEERS {
            return Err(invalid!("world_size {w} must be in 1..={MAX_PEERS}"));
        }
        if self.rank >= w {
            return Err(invalid!("rank {} must be below world_size {w}", self.rank));
        }
        if e == 0 || e > MAX_EXPERTS || e % w != 0 {
            return Err(invalid!("num_experts {e} must be in 1..={MAX_EXPERTS} and a multiple of world_size {w}"));
        }
        if k == 0 || k > MAX_TOPK || k > e {
            return Err(invalid!("experts_per_token {k} must be in 1..={} (and at most num_experts)", MAX_TOPK.min(e)));
        }
        if self.max_num_tokens == 0 || self.max_num_tokens > MAX_TOKENS {
            return Err(invalid!("max_num_tokens {} must be in 1..={MAX_TOKENS}", self.max_num_tokens));
        }
        let need = match self.dispatch_dtype {
            DispatchDtype::Bf16 => 8,
            DispatchDtype::Fp8E4m3 => SCALE_BLOCK,
        };
        if self.hidden == 0 || self.hidden % need != 0 {
            return Err(invalid!(
                "hidden {} must be a positive multiple of {need} for {:?} dispatch",
                self.hidden,
                self.dispatch_dtype
            ));
        }
        // Work items of one launch are counted in 31 bits by the kernels: (tokens + blocks) x
        // ranks x 2 KiB chunks of a bf16 row.
        let items = (self.max_num_tokens as u64 + crate::layout::MAX_GRID as u64)
            * w as u64
            * (2 * self.hidden as u64).div_ceil(crate::layout::CHUNK_BYTES as u64);
        if items >= i32::MAX as u64 {
            return Err(invalid!(
                "max_num_tokens {} x world_size {w} x hidden {} is too large for one launch",
                self.max_num_tokens,
                self.hidden
            ));
        }
        let rows = self.max_tokens_per_expert;
        if rows == 0 || (rows as u64) * (self.local_experts() as u64) >= i32::MAX as u64 {
            return Err(invalid!(
                "max_tokens_per_expert {rows} times {} local experts must be in 1..2^31",
                self.local_experts()
            ));
        }
        if self.timeout.is_zero() {
            return Err(invalid!("timeout must be positive"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn decode() -> Config {
        Config {
            rank: 1,
            world_size: 4,
            max_num_tokens: 128,
            hidden: 7168,
            num_experts: 256,
            experts_per_token: 8,
            max_tokens_per_expert: 512,
            dispatch_dtype: DispatchDtype::Fp8E4m3,
            timeout: Duration::from_secs(10),
        }
    }

    #[test]
    fn decode_config_is_valid() {
        let c = decode();
        c.validate().unwrap();
        assert_eq!(c.local_experts(), 64);
        assert_eq!(c.num_scales(), 56);
        assert_eq!(c.data_bytes(), 7168);
    }

    #[test]
    fn bad_configs_are_rejected() {
        type Mutation = Box<dyn Fn(&mut Config)>;
        let cases: Vec<Mutation> = vec![
            Box::new(|c| c.world_size = 0),
            Box::new(|c| c.world_size = 65),
            Box::new(|c| c.rank = 4),
            Box::new(|c| c.num_experts = 255),
            Box::new(|c| c.num_experts = 2048),
            Box::new(|c| c.experts_per_token = 0),
            Box::new(|c| c.experts_per_token = 33),
            Box::new(|c| c.max_num_tokens = 0),
            Box::new(|c| c.hidden = 7000),
            Box::new(|c| c.hidden = 1 << 30),
            Box::new(|c| c.max_tokens_per_expert = 0),
            Box::new(|c| c.timeout = Duration::ZERO),
        ];
        for (i, mutate) in cases.iter().enumerate() {
            let mut c = decode();
            mutate(&mut c);
            assert!(c.validate().is_err(), "case {i} accepted: {c:?}");
        }
        let mut c = decode();
        c.dispatch_dtype = DispatchDtype::Bf16;
        c.hidden = 72;
        c.validate().unwrap();
    }
}
