//! [`AllToAll`]: the buffers of one rank, the peers' buffers mapped through CUDA IPC, and the
//! four launches (dispatch send/recv, combine send/recv) on a caller-provided stream.
use std::sync::{atomic::Ordering, Arc};

use cuda_lib::{ipc_export, Context, DeviceBuffer, IpcMapping, IpcMemHandle, PinnedHostBuffer, Stream};

use crate::{
    config::{Config, DispatchDtype, THREADS},
    error::{invalid, A2aError, Result},
    kernels::Kernels,
    layout::{Layout, HOST_COUNTS_OFFSET, HOST_SEQ_OFFSET, MAX_GRID, NUM_ERROR_WORDS},
    params::{
        CombineParams, CombineRecvParams, CombineSendParams, Common, DispatchParams, DispatchRecvParams,
        DispatchSendParams,
    },
    proxy::{CombineSample, DispatchSample},
    remote::{RemoteLayout, Topology},
    remote_path::{RemoteOptions, RemotePath},
};

/// Errors the kernels report through the host block (bit `i` of [`AllToAll::errors`]).
pub mod device_error {
    /// A kernel waited longer than the timeout for a peer; the object is unusable afterwards.
    pub const TIMEOUT: u32 = 1 << 0;
    /// An expert index was `>= num_experts` or `< -1` (that slot was skipped).
    pub const BAD_EXPERT: u32 = 1 << 1;
    /// The device token count was negative or above the rows of `x` (rows of `x` were used).
    pub const BAD_NUM_TOKENS: u32 = 1 << 2;
    /// A local expert received more rows than `max_tokens_per_expert` (the extra rows were dropped).
    pub const EXPERT_OVERFLOW: u32 = 1 << 3;
    /// A send half ran again before the receive half of the previous call (results undefined).
    pub const CALL_ORDER: u32 = 1 << 4;
    /// The proxy that carries remote ranks' traffic failed (a write failed); the object is
    /// unusable afterwards.
    pub const PROXY: u32 = 1 << 5;
}

/// Warps per block of every kernel.
const WARPS: u32 = THREADS / 32;
/// Fused dispatch with at least this many tokens per block streams: `DISPATCH_STREAM_WARPS` warps
/// of each block send while the others expand what has arrived. Fewer concurrent NVLink writers
/// move more bytes per second (4x H200, 4096 tokens, bf16: 2 warps 490 us, 4: 560, 8: 645,
/// all 16 then receive: 737; docs/all_to_all.md).
const DISPATCH_STREAM_TOKENS_PER_BLOCK: usize = 4;
const DISPATCH_STREAM_WARPS: u32 = 2;
/// Fused combine with at least this many tokens streams with `COMBINE_STREAM_WARPS` sending warps
/// (10: 503-505 us at 4096 tokens, 12: 505-506, 14: 593-599 (too few receivers), 16: 529-534).
const COMBINE_STREAM_TOKENS: usize = 1024;
const COMBINE_STREAM_WARPS: u32 = 10;
/// Environment overrides of the sending warps per block of fused calls (1..=16; 0 or unset: auto).
const ENV_DISPATCH_SEND_WARPS: &str = "FABRIC_A2A_DISPATCH_SEND_WARPS";
const ENV_COMBINE_SEND_WARPS: &str = "FABRIC_A2A_COMBINE_SEND_WARPS";
/// `1` moves the tokens of streaming dispatches through the bulk copy engine (TMA: global ->
/// shared -> every destination) instead of registers. Off by default: measured slower on 4x H200
/// (4096 tokens, 2 sending warps: fp8 274 us against 266, bf16 536 against 490).
const ENV_TMA: &str = "FABRIC_A2A_TMA";
/// Streaming dispatch moves tokens through the bulk copy engine when the sending warps' record
/// buffers fit in this many bytes of shared memory per block (two blocks per multiprocessor).
const TMA_MAX_BUFFER_BYTES: usize = 64 * 1024;
/// Dynamic shared memory the fused dispatch kernel may use: the send part's arrays, the buffers
/// and their mbarriers.
const DISPATCH_MAX_DYNAMIC_SHARED: usize = MAX_DYNAMIC_SHARED + TMA_MAX_BUFFER_BYTES + 1024;

fn env_warps(name: &str) -> Option<u32> {
    let v: u32 = std::env::var(name).ok()?.trim().parse().ok()?;
    (1..=WARPS).contains(&v).then_some(v)
}

const HANDLE_MAGIC: &[u8; 4] = b"A2A3";
const HANDLE_WORDS: usize = 6;
const HANDLE_LEN: usize = 4 + 8 * HANDLE_WORDS + 64;
/// Dynamic shared memory of the dispatch send part: 48 KiB per block without opting in, less
/// the receive part's static arrays (about 4.3 KiB).
const MAX_DYNAMIC_SHARED: usize = 40 * 1024;

/// Arguments of [`AllToAll::dispatch_send`]: device addresses and strides (bytes unless noted).
#[derive(Debug, Clone, Copy, Default)]
pub struct DispatchSend {
    /// Tokens `[num_tokens, hidden]` of the configured dtype, 16-byte aligned rows.
    pub x: u64,
    /// Bytes between rows of `x`.
    pub x_stride: u64,
    /// fp32 scales `[num_tokens, hidden / 128]` (fp8 only; 0 for bf16).
    pub scales: u64,
    /// Bytes between rows of `scales`.
    pub scales_stride: u64,
    /// Expert ids `[num_tokens, K]` (int32 or int64; -1 = no expert).
    pub indices: u64,
    /// Elements between rows of `indices`.
    pub indices_stride: u64,
    /// Whether `indices` holds int64.
    pub indices_are_i64: bool,
    /// Rows of `x` (and `indices`).
    pub num_tokens: usize,
    /// Optional device `int32` holding the live token count (`<= num_tokens`), read by the kernel.
    pub num_tokens_ptr: u64,
    /// Whether to publish per-expert counts to the host block ([`AllToAll::host_counts`]).
    pub publish_host_counts: bool,
}

/// Arguments of [`AllToAll::dispatch_recv`].
#[derive(Debug, Clone, Copy, Default)]
pub struct DispatchRecv {
    /// Output `[local_experts, max_tokens_per_expert, hidden]`, contiguous.
    pub out_x: u64,
    /// Output fp32 scales `[local_experts, max_tokens_per_expert, hidden / 128]` (fp8 only).
    pub out_scales: u64,
    /// Output rows per local expert, `[local_experts]` int32.
    pub out_counts: u64,
}

/// Arguments of [`AllToAll::combine_send`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CombineSend {
    /// Expert outputs, bf16 rows in dispatch's layout (`[local_experts * max_tokens_per_expert, hidden]`).
    pub expert_out: u64,
    /// Bytes between rows of `expert_out`.
    pub expert_out_stride: u64,
    /// fp32 top-k weights of this rank's tokens `[num_tokens, K]`.
    pub weights: u64,
    /// Elements between rows of `weights`.
    pub weights_stride: u64,
}

/// Arguments of [`AllToAll::combine_recv`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CombineRecv {
    /// Output `[num_rows, hidden]` bf16.
    pub out: u64,
    /// Bytes between rows of `out`.
    pub out_stride: u64,
    /// Rows of `out` (rows past the live token count are zeroed).
    pub num_rows: usize,
}

/// One rank's side of an expert-parallel all-to-all over NVLink.
///
/// Created per rank with [`AllToAll::new`]; every rank then shares [`AllToAll::export_handle`]
/// with the others (any collective) and calls [`AllToAll::connect`] with all handles in rank
/// order. Calls must then be made by every rank, in the same order: dispatch send, dispatch recv,
/// combine send, combine recv. A whole dispatch or combine (both halves) may be repeated; a send
/// half must be followed by its receive half before the next send half of the same kind
/// ([`device_error::CALL_ORDER`] otherwise).
#[derive(Debug)]
pub struct AllToAll {
    cfg: Config,
    layout: Layout,
    // Declared before the buffers: dropped first (the proxy stops before the kernels' memory goes).
    remote: Option<RemotePath>,
    // Declared before the buffers: dropped (closed) first.
    peers: Vec<IpcMapping>,
    kernels: Kernels,
    shared: DeviceBuffer,
    state: DeviceBuffer,
    host: PinnedHostBuffer,
    common: Option<Common>,
    dispatch_grid: u32,
    combine_grid: u32,
    send_shared_bytes: u32,
    dispatch_send_warps: Option<u32>,
    combine_send_warps: Option<u32>,
    tma: bool,
    ctx: Arc<Context>,
}

impl AllToAll {
    /// Allocates this rank's buffers on `device` (zeroed) and loads the kernels; every rank is
    /// reached over NVLink.
    pub fn new(device: usize, cfg: Config) -> Result<Self> {
        Self::with_remote(device, cfg, None)
    }

    /// [`AllToAll::new`] where ranks outside this rank's NVLink domain (`remote.nvlink`
    /// consecutive ranks) are reached through a TransferEngine and its CPU proxy.
    pub fn with_remote(device: usize, cfg: Config, remote: Option<RemoteOptions>) -> Result<Self> {
        cfg.validate()?;
        let topo = Topology::new(cfg.world_size, remote.as_ref().map_or(cfg.world_size, |r| r.nvlink))?;
        if topo.has_remote() && cfg.world_size > 256 {
            return Err(invalid!("remote ranks: at most 256 ranks"));
        }
        let ctx = Context::new(device)?;
        let sms = ctx.device().multiprocessor_count()?;
        // Dispatch kernels run two blocks per multiprocessor (few registers, latency-bound);
        // combine kernels one (more registers). Every rank must use the same dispatch grid
        // (receivers follow the senders' token chunks).
        let dispatch_grid = 2 * sms;
        let combine_grid = sms;
        if dispatch_grid as usize > MAX_GRID || combine_grid as usize > MAX_GRID {
            return Err(invalid!("{sms} multiprocessors: more blocks per launch than {MAX_GRID}"));
        }
        let chunk = cfg.max_num_tokens.div_ceil(dispatch_grid as usize);
        let send_shared = 4 * (2 * cfg.num_experts + chunk * cfg.experts_per_token);
        if send_shared > MAX_DYNAMIC_SHARED {
            return Err(invalid!(
                "max_num_tokens {} with {} experts per token needs {send_shared} bytes of shared \
                 memory per block (limit {MAX_DYNAMIC_SHARED})",
                cfg.max_num_tokens,
                cfg.experts_per_token
            ));
        }
        let layout = Layout::new(&cfg);
        let kernels = Kernels::load(&ctx, topo.has_remote() && remote.is_some(), cfg.world_size > 32)?;
        // Tokens to remote ranks are packed by the register path only.
        let tma = !topo.has_remote()
            && std::env::var(ENV_TMA).is_ok_and(|v| v.trim() == "1")
            && kernels.dispatch.set_max_dynamic_shared_bytes(DISPATCH_MAX_DYNAMIC_SHARED as u32).is_ok();
        let shared = DeviceBuffer::new(&ctx, layout.shared_bytes)?;
        let state = DeviceBuffer::new(&ctx, layout.state_bytes)?;
        let host = PinnedHostBuffer::new(&ctx, layout.host_bytes)?;
        let stream = Stream::new(&ctx)?;
        // SAFETY: both ranges are the buffers just allocated, untouched by anyone else yet.
        unsafe {
            stream.memset_d8_async(shared.ptr(), 0, layout.shared_bytes)?;
            stream.memset_d8_async(state.ptr(), 0, layout.state_bytes)?;
        }
        stream.synchronize()?;
        let remote = match remote {
            Some(opts) if topo.has_remote() => {
                let rl = RemoteLayout::new(
                    cfg.world_size,
                    cfg.num_experts,
                    cfg.experts_per_token,
                    cfg.max_num_tokens,
                    opts.private_tokens,
                    layout.rec_bytes,
                    cfg.hidden,
                );
                Some(RemotePath::new(&ctx, device, cfg.rank, topo, rl, &opts)?)
            }
            _ => None,
        };
        Ok(AllToAll {
            cfg,
            layout,
            remote,
            peers: Vec::new(),
            kernels,
            shared,
            state,
            host,
            common: None,
            dispatch_grid,
            combine_grid,
            send_shared_bytes: send_shared as u32,
            dispatch_send_warps: env_warps(ENV_DISPATCH_SEND_WARPS),
            combine_send_warps: env_warps(ENV_COMBINE_SEND_WARPS),
            tma,
            ctx,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The buffer layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Blocks per launch of (dispatch kernels, combine kernels).
    pub fn grid(&self) -> (u32, u32) {
        (self.dispatch_grid, self.combine_grid)
    }

    /// Whether [`AllToAll::connect`] succeeded.
    pub fn is_connected(&self) -> bool {
        self.common.is_some()
    }

    /// What a peer needs to map this rank's receive buffers (opaque bytes).
    pub fn export_handle(&self) -> Result<Vec<u8>> {
        let export = ipc_export(&self.ctx, self.shared.ptr())?;
        let mut out = Vec::with_capacity(HANDLE_LEN);
        out.extend_from_slice(HANDLE_MAGIC);
        for v in [
            self.cfg.rank as u64,
            self.cfg.world_size as u64,
            self.layout.shared_bytes as u64,
            export.offset,
            export.alloc_len as u64,
            self.dispatch_grid as u64,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&export.handle.0);
        if let Some(remote) = &self.remote {
            out.extend_from_slice(&remote.export());
        }
        Ok(out)
    }

    /// The RDMA half, when some ranks are remote.
    pub fn remote(&self) -> Option<&RemotePath> {
        self.remote.as_ref()
    }

    /// The proxy's recorded costs of recent calls (and clears them); empty without remote ranks.
    pub fn proxy_samples(&self) -> (Vec<DispatchSample>, Vec<CombineSample>) {
        self.remote.as_ref().map(|r| r.take_samples()).unwrap_or_default()
    }

    /// Maps every peer's buffers; `handles[r]` is rank r's [`AllToAll::export_handle`] (this
    /// rank's own entry is checked and otherwise ignored). Every rank must have zeroed its
    /// buffers (done by `new`) before any rank launches: exchange handles after `new` on all.
    pub fn connect(&mut self, handles: &[Vec<u8>]) -> Result<()> {
        if self.common.is_some() {
            return Err(invalid!("already connected"));
        }
        let w = self.cfg.world_size;
        if handles.len() != w {
            return Err(invalid!("{} handles for a world of {w}", handles.len()));
        }
        let mut peer_ptrs = [0u64; crate::config::MAX_PEERS];
        let mut peers = Vec::new();
        for (r, bytes) in handles.iter().enumerate() {
            let h = decode_handle(bytes)?;
            if h.rank != r || h.world != w || h.shared_bytes != self.layout.shared_bytes {
                return Err(invalid!(
                    "handle {r} is rank {} of {} with {} shared bytes; expected rank {r} of {w} with {} \
                     (every rank must use the same sizes)",
                    h.rank,
                    h.world,
                    h.shared_bytes,
                    self.layout.shared_bytes
                ));
            }
            if self.remote.is_none() && bytes.len() > HANDLE_LEN {
                return Err(invalid!(
                    "rank {r} reaches some ranks through the engine (nvlink below the world size) and this \
                     rank does not: every rank must use the same nvlink"
                ));
            }
            let nvlink_peer = !self.remote.as_ref().is_some_and(|rp| rp.topo.is_remote(self.cfg.rank, r));
            if nvlink_peer && h.dispatch_grid != self.dispatch_grid as u64 {
                return Err(invalid!(
                    "rank {r} launches {} dispatch blocks, this rank {}: every GPU of the group must \
                     have the same number of multiprocessors",
                    h.dispatch_grid,
                    self.dispatch_grid
                ));
            }
            if r == self.cfg.rank {
                peer_ptrs[r] = self.shared.ptr();
                continue;
            }
            if !nvlink_peer {
                continue; // reached through the engine (may be on another host)
            }
            let mapping = IpcMapping::open(&self.ctx, &IpcMemHandle(h.handle))?;
            peer_ptrs[r] = mapping.ptr() + h.offset;
            peers.push(mapping);
        }
        let mut nvmask = u64::MAX >> (64 - w); // every rank (w is 1..=64)
        let mut rc = RemoteCommon::default();
        if let Some(rp) = &mut self.remote {
            let exports: Vec<&[u8]> = handles.iter().map(|b| &b[HANDLE_LEN..]).collect();
            rp.connect(&exports)?;
            nvmask = rp.topo.nvlink_mask(self.cfg.rank);
            let [blk, dsend, drecv, csend, crecv] = rp.device_ptrs();
            let (b, rl) = (&rp.block, &rp.layout);
            rc = RemoteCommon {
                blk,
                blk_dseq: b.dseq as u64,
                blk_ddone: b.ddone as u64,
                blk_cdone: b.cdone as u64,
                blk_rcf: b.rcf as u64,
                blk_rflag: b.rflag as u64,
                blk_rovf: b.rovf as u64,
                blk_crflag: b.crflag as u64,
                blk_pub_tok: b.pub_tok as u64,
                blk_pub_hist: b.pub_hist as u64,
                blk_msg_in: b.msg_in as u64,
                msg_bytes: b.msg_bytes as u64,
                dsend,
                drecv,
                csend,
                crecv,
                private_tokens: rl.private_tokens as u64,
                rrec_bytes: rl.rrec_bytes as u64,
                drecv_records: rl.drecv_records() as u64,
                csend_rows: rl.csend_rows as u64,
                crecv_rows: rl.crecv_rows as u64,
            };
        }
        let (c, l) = (&self.cfg, &self.layout);
        self.common = Some(Common {
            rank: c.rank as u64,
            world: w as u64,
            num_experts: c.num_experts as u64,
            local_experts: c.local_experts() as u64,
            topk: c.experts_per_token as u64,
            max_tokens: c.max_num_tokens as u64,
            max_rows: c.max_tokens_per_expert as u64,
            hidden: c.hidden as u64,
            data_bytes: c.data_bytes() as u64,
            num_scales: c.num_scales() as u64,
            rec_bytes: l.rec_bytes as u64,
            timeout_ns: u64::try_from(c.timeout.as_nanos()).unwrap_or(u64::MAX),
            state: self.state.ptr(),
            host: self.host.device_ptr(),
            send_grid: self.dispatch_grid as u64,
            off_dcf: l.off_dcf as u64,
            off_dcnt: l.off_dcnt as u64,
            off_dtf: l.off_dtf as u64,
            off_hdr: l.off_hdr as u64,
            off_data: l.off_data as u64,
            off_cw: l.off_cw as u64,
            off_ctf: l.off_ctf as u64,
            off_cdata: l.off_cdata as u64,
            st_seq: l.st_seq as u64,
            st_poison: l.st_poison as u64,
            st_my_tokens: l.st_my_tokens as u64,
            st_recv_tokens: l.st_recv_tokens as u64,
            st_token_mask: l.st_token_mask as u64,
            st_map: l.st_map as u64,
            st_queue: l.st_queue as u64,
            nvmask,
            blk: rc.blk,
            blk_dseq: rc.blk_dseq,
            blk_ddone: rc.blk_ddone,
            blk_cdone: rc.blk_cdone,
            blk_rcf: rc.blk_rcf,
            blk_rflag: rc.blk_rflag,
            blk_rovf: rc.blk_rovf,
            blk_crflag: rc.blk_crflag,
            blk_pub_tok: rc.blk_pub_tok,
            blk_pub_hist: rc.blk_pub_hist,
            blk_msg_in: rc.blk_msg_in,
            msg_bytes: rc.msg_bytes,
            dsend: rc.dsend,
            drecv: rc.drecv,
            csend: rc.csend,
            crecv: rc.crecv,
            private_tokens: rc.private_tokens,
            rrec_bytes: rc.rrec_bytes,
            drecv_records: rc.drecv_records,
            csend_rows: rc.csend_rows,
            crecv_rows: rc.crecv_rows,
            st_rpack: l.st_rpack as u64,
            st_rdone: l.st_rdone as u64,
            st_cdone_blocks: l.st_cdone_blocks as u64,
            st_sslot: l.st_sslot as u64,
            st_hist: l.st_hist as u64,
            st_rcnt: l.st_rcnt as u64,
            st_rhdr: l.st_rhdr as u64,
            st_weights: l.st_weights as u64,
            st_last_dseq: l.st_last_dseq as u64,
            st_host_wait: l.st_host_wait as u64,
            peers: peer_ptrs,
        });
        self.peers = peers;
        Ok(())
    }

    fn common(&self) -> Result<Common> {
        self.common.ok_or_else(|| A2aError::NotConnected("call connect() with every rank's handle first".into()))
    }

    fn dispatch_send_params(&self, a: &DispatchSend) -> Result<DispatchSendParams> {
        let c = self.common()?;
        let cfg = &self.cfg;
        let data = cfg.data_bytes() as u64;
        if a.num_tokens > cfg.max_num_tokens {
            return Err(invalid!("{} tokens exceed max_num_tokens {}", a.num_tokens, cfg.max_num_tokens));
        }
        if a.num_tokens > 0 {
            check_ptr("x", a.x, 16)?;
            if a.x_stride % 16 != 0 || a.x_stride < data {
                return Err(invalid!("x row stride {} must be a multiple of 16 and >= {data}", a.x_stride));
            }
            check_ptr("indices", a.indices, if a.indices_are_i64 { 8 } else { 4 })?;
            if a.indices_stride < cfg.experts_per_token as u64 {
                return Err(invalid!("indices row stride {} < top-k", a.indices_stride));
            }
            match cfg.dispatch_dtype {
                DispatchDtype::Fp8E4m3 => {
                    check_ptr("scales", a.scales, 4)?;
                    let need = 4 * cfg.num_scales() as u64;
                    if a.scales_stride % 4 != 0 || a.scales_stride < need {
                        return Err(invalid!(
                            "scales row stride {} must be a multiple of 4 and >= {need}",
                            a.scales_stride
                        ));
                    }
                }
                DispatchDtype::Bf16 if a.scales != 0 => {
                    return Err(invalid!("scales are only for fp8 dispatch"));
                }
                DispatchDtype::Bf16 => {}
            }
        }
        if a.num_tokens_ptr != 0 {
            check_ptr("num_tokens", a.num_tokens_ptr, 4)?;
        }
        let p = DispatchSendParams {
            c,
            x: a.x,
            x_stride: a.x_stride,
            scales: a.scales,
            scales_stride: a.scales_stride,
            idx: a.indices,
            idx_stride: a.indices_stride,
            idx_is_64: a.indices_are_i64 as u64,
            num_tokens: a.num_tokens as u64,
            num_tokens_ptr: a.num_tokens_ptr,
            publish_host_counts: a.publish_host_counts as u64,
        };
        Ok(p)
    }

    fn dispatch_recv_params(&self, a: &DispatchRecv) -> Result<DispatchRecvParams> {
        let c = self.common()?;
        check_ptr("out_x", a.out_x, 16)?;
        check_ptr("out_counts", a.out_counts, 4)?;
        match self.cfg.dispatch_dtype {
            DispatchDtype::Fp8E4m3 => check_ptr("out_scales", a.out_scales, 4)?,
            DispatchDtype::Bf16 if a.out_scales != 0 => return Err(invalid!("out_scales are only for fp8 dispatch")),
            DispatchDtype::Bf16 => {}
        }
        let p = DispatchRecvParams { c, out_x: a.out_x, out_scales: a.out_scales, out_counts: a.out_counts };
        Ok(p)
    }

    fn combine_send_params(&self, a: &CombineSend) -> Result<CombineSendParams> {
        let c = self.common()?;
        let row = 2 * self.cfg.hidden as u64;
        check_ptr("expert_out", a.expert_out, 16)?;
        if a.expert_out_stride % 16 != 0 || a.expert_out_stride < row {
            return Err(invalid!(
                "expert_out row stride {} must be a multiple of 16 and >= {row}",
                a.expert_out_stride
            ));
        }
        check_ptr("weights", a.weights, 4)?;
        if a.weights_stride < self.cfg.experts_per_token as u64 {
            return Err(invalid!("weights row stride {} < top-k", a.weights_stride));
        }
        let p = CombineSendParams {
            c,
            expert_out: a.expert_out,
            expert_out_stride: a.expert_out_stride,
            weights: a.weights,
            weights_stride: a.weights_stride,
        };
        Ok(p)
    }

    fn combine_recv_params(&self, a: &CombineRecv) -> Result<CombineRecvParams> {
        let c = self.common()?;
        let row = 2 * self.cfg.hidden as u64;
        if a.num_rows > self.cfg.max_num_tokens {
            return Err(invalid!("{} rows exceed max_num_tokens {}", a.num_rows, self.cfg.max_num_tokens));
        }
        if a.num_rows > 0 {
            check_ptr("out", a.out, 16)?;
            if a.out_stride % 16 != 0 || a.out_stride < row {
                return Err(invalid!("out row stride {} must be a multiple of 16 and >= {row}", a.out_stride));
            }
        }
        let p = CombineRecvParams { c, out: a.out, out_stride: a.out_stride, num_rows: a.num_rows as u64 };
        Ok(p)
    }

    /// Enqueues dispatch's send half on `stream`.
    ///
    /// # Safety
    /// Every address must be device memory of this context valid for the described shape until
    /// the kernel completed; `stream` must be a live stream of this context. Every rank must make
    /// the matching call.
    pub unsafe fn dispatch_send(&self, stream: u64, a: &DispatchSend) -> Result<()> {
        let p = self.dispatch_send_params(a)?;
        // SAFETY: `p` mirrors the kernel's parameter; the caller guarantees addresses and stream.
        unsafe {
            Kernels::launch(
                &self.kernels.dispatch_send,
                self.dispatch_grid,
                THREADS,
                self.send_shared_bytes,
                stream,
                &p,
            )
        }
    }

    /// Enqueues dispatch's receive half on `stream`.
    ///
    /// # Safety
    /// As for [`AllToAll::dispatch_send`]; the outputs must hold the shapes in [`DispatchRecv`].
    pub unsafe fn dispatch_recv(&self, stream: u64, a: &DispatchRecv) -> Result<()> {
        let p = self.dispatch_recv_params(a)?;
        // SAFETY: `p` mirrors the kernel's parameter; the caller guarantees addresses and stream.
        unsafe { Kernels::launch(&self.kernels.dispatch_recv, self.dispatch_grid, THREADS, 0, stream, &p) }
    }

    /// Enqueues combine's send half on `stream`.
    ///
    /// # Safety
    /// As for [`AllToAll::dispatch_send`]; `expert_out` must hold every row dispatch produced
    /// and `weights` the rows of this rank's last dispatch.
    pub unsafe fn combine_send(&self, stream: u64, a: &CombineSend) -> Result<()> {
        let p = self.combine_send_params(a)?;
        // SAFETY: `p` mirrors the kernel's parameter; the caller guarantees addresses and stream.
        unsafe { Kernels::launch(&self.kernels.combine_send, self.combine_grid, THREADS, 0, stream, &p) }
    }

    /// Enqueues combine's receive half on `stream`.
    ///
    /// # Safety
    /// As for [`AllToAll::dispatch_send`]; `out` must hold `num_rows` rows.
    pub unsafe fn combine_recv(&self, stream: u64, a: &CombineRecv) -> Result<()> {
        let p = self.combine_recv_params(a)?;
        // SAFETY: `p` mirrors the kernel's parameter; the caller guarantees addresses and stream.
        unsafe { Kernels::launch(&self.kernels.combine_recv, self.combine_grid, THREADS, 0, stream, &p) }
    }

    /// Enqueues both halves of dispatch as one kernel (what [`AllToAll::dispatch_send`] then
    /// [`AllToAll::dispatch_recv`] do, without the launch gap).
    ///
    /// # Safety
    /// As for both halves.
    pub unsafe fn dispatch(&self, stream: u64, send: &DispatchSend, recv: &DispatchRecv) -> Result<()> {
        let send_warps = self.dispatch_send_warps(send.num_tokens);
        let tma_smem = self.dispatch_tma_smem(send, send_warps);
        let shared = match tma_smem {
            Some(off) => off + send_warps as usize * (self.layout.rec_bytes + 8),
            None => self.send_shared_bytes as usize,
        };
        let p = DispatchParams {
            send: self.dispatch_send_params(send)?,
            recv: self.dispatch_recv_params(recv)?,
            send_warps: send_warps as u64,
            tma_smem: tma_smem.unwrap_or(0) as u64,
        };
        // SAFETY: as for the halves.
        unsafe { Kernels::launch(&self.kernels.dispatch, self.dispatch_grid, THREADS, shared as u32, stream, &p) }
    }

    /// Enqueues both halves of combine as one kernel.
    ///
    /// # Safety
    /// As for both halves.
    pub unsafe fn combine(&self, stream: u64, send: &CombineSend, recv: &CombineRecv) -> Result<()> {
        let p = CombineParams {
            send: self.combine_send_params(send)?,
            recv: self.combine_recv_params(recv)?,
            send_warps: self.combine_send_warps(recv.num_rows) as u64,
        };
        // SAFETY: as for the halves.
        unsafe { Kernels::launch(&self.kernels.combine, self.combine_grid, THREADS, 0, stream, &p) }
    }

    /// Sending warps per block of a fused dispatch of `num_tokens` rows: all of them (send, then
    /// receive: fewest round trips) unless every block has several tokens, then a few, and the
    /// others expand what has arrived meanwhile.
    pub fn dispatch_send_warps(&self, num_tokens: usize) -> u32 {
        self.dispatch_send_warps.unwrap_or_else(|| {
            let per_block = num_tokens.div_ceil(self.dispatch_grid as usize);
            if per_block >= DISPATCH_STREAM_TOKENS_PER_BLOCK {
                DISPATCH_STREAM_WARPS
            } else {
                WARPS
            }
        })
    }

    /// Where the sending warps' bulk-copy buffers start in the fused dispatch's dynamic shared
    /// memory, when tokens can move through the bulk copy engine: streaming (some warps send),
    /// their records fit, and rows of values and scales are whole 16-byte vectors.
    fn dispatch_tma_smem(&self, send: &DispatchSend, send_warps: u32) -> Option<usize> {
        let scales = self.cfg.num_scales();
        let scales_ok = scales == 0 || (scales % 4 == 0 && send.scales % 16 == 0 && send.scales_stride % 16 == 0);
        (self.tma
            && send_warps < WARPS
            && send.num_tokens > 0
            && scales_ok
            && send.x % 16 == 0
            && send.x_stride % 16 == 0
            && send_warps as usize * self.layout.rec_bytes <= TMA_MAX_BUFFER_BYTES)
            .then(|| (self.send_shared_bytes as usize).div_ceil(128) * 128)
    }

    /// Sending warps per block of a fused combine of `num_rows` tokens (see
    /// [`AllToAll::dispatch_send_warps`]).
    pub fn combine_send_warps(&self, num_rows: usize) -> u32 {
        self.combine_send_warps.unwrap_or(if num_rows >= COMBINE_STREAM_TOKENS { COMBINE_STREAM_WARPS } else { WARPS })
    }

    /// Errors reported by kernels so far (bits of [`device_error`]); read without synchronizing,
    /// so a launch still running may add more.
    pub fn errors(&self) -> u32 {
        let proxy = self.remote.as_ref().is_some_and(|r| r.error().is_some());
        (0..NUM_ERROR_WORDS)
            .filter(|&i| self.host.atomic_u32(i).load(Ordering::Acquire) != 0)
            .fold(if proxy { device_error::PROXY } else { 0 }, |acc, i| acc | (1 << i))
    }

    /// What the proxy reported when [`device_error::PROXY`] is set.
    pub fn proxy_error(&self) -> Option<String> {
        self.remote.as_ref().and_then(|r| r.error())
    }

    /// Clears the reported errors except [`device_error::TIMEOUT`] (a timed-out object stays
    /// unusable: its peers' flags are out of step).
    pub fn clear_errors(&self) {
        for i in 1..NUM_ERROR_WORDS {
            self.host.atomic_u32(i).store(0, Ordering::Release);
        }
    }

    /// The per-expert row counts of the last dispatch that published them (and its sequence
    /// number): the hook a CPU proxy for remote ranks starts from.
    pub fn host_counts(&self) -> (u64, Vec<u32>) {
        let seq = self.host.atomic_u64(HOST_SEQ_OFFSET / 8).load(Ordering::Acquire);
        let counts = (0..self.cfg.num_experts)
            .map(|e| self.host.atomic_u32(HOST_COUNTS_OFFSET / 4 + e).load(Ordering::Acquire))
            .collect();
        (seq, counts)
    }
}

fn check_ptr(what: &str, ptr: u64, align: u64) -> Result<()> {
    if ptr == 0 || ptr % align != 0 {
        return Err(invalid!("{what} address {ptr:#x} must be non-null and {align}-byte aligned"));
    }
    Ok(())
}

struct Handle {
    rank: usize,
    world: usize,
    shared_bytes: usize,
    offset: u64,
    dispatch_grid: u64,
    handle: [u8; 64],
}

/// The remote half of [`Common`] (zero without remote ranks).
#[derive(Default)]
struct RemoteCommon {
    blk: u64,
    blk_dseq: u64,
    blk_ddone: u64,
    blk_cdone: u64,
    blk_rcf: u64,
    blk_rflag: u64,
    blk_rovf: u64,
    blk_crflag: u64,
    blk_pub_tok: u64,
    blk_pub_hist: u64,
    blk_msg_in: u64,
    msg_bytes: u64,
    dsend: u64,
    drecv: u64,
    csend: u64,
    crecv: u64,
    private_tokens: u64,
    rrec_bytes: u64,
    drecv_records: u64,
    csend_rows: u64,
    crecv_rows: u64,
}

/// Decodes the NVLink part of a handle (the first `HANDLE_LEN` bytes; the RDMA half's regions
/// follow when ranks are remote).
fn decode_handle(bytes: &[u8]) -> Result<Handle> {
    if bytes.len() < HANDLE_LEN || &bytes[..4] != HANDLE_MAGIC {
        return Err(invalid!("not an all-to-all handle ({} bytes)", bytes.len()));
    }
    let word = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[4 + 8 * i..12 + 8 * i]);
        u64::from_le_bytes(b)
    };
    let mut handle = [0u8; 64];
    handle.copy_from_slice(&bytes[4 + 8 * HANDLE_WORDS..HANDLE_LEN]);
    Ok(Handle {
        rank: word(0) as usize,
        world: word(1) as usize,
        shared_bytes: word(2) as usize,
        offset: word(3),
        dispatch_grid: word(5),
        handle,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_handles_are_rejected() {
        assert!(decode_handle(b"nope").is_err());
        let mut bytes = vec![0u8; HANDLE_LEN];
        assert!(decode_handle(&bytes).is_err());
        bytes[..4].copy_from_slice(HANDLE_MAGIC);
        bytes[4] = 3;
        let h = decode_handle(&bytes).unwrap();
        assert_eq!(h.rank, 3);
        assert_eq!(h.world, 0);
    }

    #[test]
    fn pointer_checks() {
        assert!(check_ptr("x", 0, 16).is_err());
        assert!(check_ptr("x", 0x1008, 16).is_err());
        check_ptr("x", 0x1000, 16).unwrap();
    }
}
