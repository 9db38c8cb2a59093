//! `p2p-all-to-all`: MoE expert-parallel dispatch and combine between the GPUs of one host,
//! over NVLink.
//!
//! Each rank allocates receive buffers (cuMemAlloc through `cuda-lib`), shares them with its
//! peers through CUDA IPC handles, and launches four kernels on a stream the caller gives as a
//! raw handle (torch's current stream, from Python): no libtorch, no host synchronization.
//! - **dispatch send**: counts rows per expert (published first, with the token count), sends
//!   each token once to every rank hosting one of its experts (NVLink stores), with a header
//!   naming (local expert, position) per slot, then raises that token's flag on every rank.
//! - **dispatch recv**: lays each token out expert-major
//!   `[local_experts, max_tokens_per_expert, hidden]` as soon as its flag is up, with per-expert
//!   counts (grouped-GEMM ready). Fused with the send half, part of each block's warps receive
//!   while the others still send (prefill sizes).
//! - **combine send**: publishes this rank's top-k weights, then sums the weighted outputs of its
//!   local experts per received token in fp32 and sends one bf16 partial per 2 KiB chunk back,
//!   with a flag per chunk.
//! - **combine recv**: adds the partials of the ranks each token went to (fp32) into `[T, hidden]`
//!   as their flags come up.
//!
//! Flags carry per-block sequence numbers kept in device memory (no host resets, no grid-wide
//! barrier), so calls can run back to back and inside CUDA graphs; the live token count may come
//! from device memory. Dispatch buffers are doubled (by call parity), so no acknowledgements are
//! needed. Waits time out (reported through [`AllToAll::errors`]) instead of hanging. Per-expert
//! counts can be published to mapped host memory ([`AllToAll::host_counts`]): the hook for a CPU
//! proxy that would carry remote (RDMA) ranks with the same flags; only NVLink is implemented.
//!
//! **Threads.** [`AllToAll`] is `Send + Sync`; launches take `&self`. Calls on one object must
//! be issued in the same order on every rank (they are collective).
//!
//! **Cleanup.** Dropping closes the peers' mappings, then frees this rank's buffers; peers must
//! have stopped using them (a barrier before dropping).
mod all_to_all;
mod config;
mod error;
mod kernels;
mod layout;
mod params;
pub mod proxy;
pub mod proxy_block;
pub mod remote;
mod remote_path;

pub use all_to_all::{device_error, AllToAll, CombineRecv, CombineSend, DispatchRecv, DispatchSend};
pub use config::{Config, DispatchDtype, MAX_EXPERTS, MAX_PEERS, MAX_TOKENS, MAX_TOPK, SCALE_BLOCK};
pub use cuda_lib::CudaError;
pub use error::{A2aError, Result};
pub use kernels::{kernel_archs, kernel_image};
pub use layout::Layout;
pub use remote_path::RemoteOptions;
