//! `#[repr(C)]` mirrors of the kernels' parameter blocks (`kernels/a2a_common.cuh`): every field
//! 64-bit, so the C and Rust layouts agree without padding rules.
use crate::config::MAX_PEERS;

/// Per-object constants shared by every kernel.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Common {
    pub rank: u64,
    pub world: u64,
    pub num_experts: u64,
    pub local_experts: u64,
    pub topk: u64,
    pub max_tokens: u64,
    pub max_rows: u64,
    pub hidden: u64,
    pub data_bytes: u64,
    pub num_scales: u64,
    pub rec_bytes: u64,
    pub timeout_ns: u64,
    pub state: u64,
    pub host: u64,
    pub send_grid: u64,
    pub off_dcf: u64,
    pub off_dcnt: u64,
    pub off_dtf: u64,
    pub off_hdr: u64,
    pub off_data: u64,
    pub off_cw: u64,
    pub off_ctf: u64,
    pub off_cdata: u64,
    pub st_seq: u64,
    pub st_poison: u64,
    pub st_my_tokens: u64,
    pub st_recv_tokens: u64,
    pub st_token_mask: u64,
    pub st_map: u64,
    pub st_queue: u64,
    /// Ranks of this rank's NVLink domain (bit r); the others are remote.
    pub nvmask: u64,
    /// Device address of the proxy block (0: no remote ranks).
    pub blk: u64,
    pub blk_dseq: u64,
    pub blk_ddone: u64,
    pub blk_cdone: u64,
    pub blk_rcf: u64,
    pub blk_rflag: u64,
    pub blk_rovf: u64,
    pub blk_crflag: u64,
    pub blk_pub_tok: u64,
    pub blk_pub_hist: u64,
    pub blk_msg_in: u64,
    pub msg_bytes: u64,
    pub dsend: u64,
    pub drecv: u64,
    pub csend: u64,
    pub crecv: u64,
    pub private_tokens: u64,
    pub rrec_bytes: u64,
    pub drecv_records: u64,
    pub csend_rows: u64,
    pub crecv_rows: u64,
    pub st_rpack: u64,
    pub st_rdone: u64,
    pub st_cdone_blocks: u64,
    pub st_sslot: u64,
    pub st_hist: u64,
    pub st_rcnt: u64,
    pub st_rhdr: u64,
    pub st_weights: u64,
    pub st_last_dseq: u64,
    pub st_host_wait: u64,
    pub peers: [u64; MAX_PEERS],
}

const _: () = assert!(std::mem::size_of::<Common>() == (62 + MAX_PEERS) * 8);

/// `A2ADispatchSendArgs`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DispatchSendParams {
    pub c: Common,
    pub x: u64,
    pub x_stride: u64,
    pub scales: u64,
    pub scales_stride: u64,
    pub idx: u64,
    pub idx_stride: u64,
    pub idx_is_64: u64,
    pub num_tokens: u64,
    pub num_tokens_ptr: u64,
    pub publish_host_counts: u64,
}

/// `A2ADispatchRecvArgs`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DispatchRecvParams {
    pub c: Common,
    pub out_x: u64,
    pub out_scales: u64,
    pub out_counts: u64,
}

/// `A2ACombineSendArgs`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CombineSendParams {
    pub c: Common,
    pub expert_out: u64,
    pub expert_out_stride: u64,
    pub weights: u64,
    pub weights_stride: u64,
}

/// `A2ACombineRecvArgs`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CombineRecvParams {
    pub c: Common,
    pub out: u64,
    pub out_stride: u64,
    pub num_rows: u64,
}

/// `A2ADispatchArgs` (both halves in one launch).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct DispatchParams {
    pub send: DispatchSendParams,
    pub recv: DispatchRecvParams,
    /// Warps per block that send while the others receive (`WARPS`: all send, then receive).
    pub send_warps: u64,
    /// Byte offset in dynamic shared memory of the sending warps' bulk-copy buffers (0: none).
    pub tma_smem: u64,
}

/// `A2ACombineArgs` (both halves in one launch).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CombineParams {
    pub send: CombineSendParams,
    pub recv: CombineRecvParams,
    /// Warps per block that send while the others receive (`WARPS`: all send, then receive).
    pub send_warps: u64,
}
