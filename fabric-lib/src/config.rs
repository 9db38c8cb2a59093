//! Engine configuration with defaults that work on a laptop and on an RDMA host.
use std::time::Duration;

use crate::provider::libfabric::ProviderSpec;

/// How the worker waits when there is nothing to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollMode {
    /// Poll the completion queue without sleeping (yielding between empty polls): lowest
    /// latency, one core per worker.
    Busy,
    /// Busy-poll for `spin` after the last activity, then sleep up to `park` between polls (a new
    /// command wakes the worker at once). Idle engines cost almost no CPU; incoming traffic is
    /// noticed within `park`.
    Adaptive { spin: Duration, park: Duration },
}

impl PollMode {
    /// Adaptive polling with defaults suited to shared machines.
    pub const ADAPTIVE: PollMode =
        PollMode::Adaptive { spin: Duration::from_micros(200), park: Duration::from_micros(50) };
}

/// Everything a [`crate::TransferEngine`] is built from.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Provider and domains (NICs) to open; every peer must open the same number of domains.
    pub provider: ProviderSpec,
    /// Single writes at least this long are sharded over the domains (multiples of 8 KiB).
    pub shard_min_bytes: u64,
    /// CPU to pin the worker thread to (`None`: not pinned).
    pub worker_cpu: Option<usize>,
    /// Worker idle behaviour.
    pub poll_mode: PollMode,
    /// A request not completed after this long fails with a timeout (dead or stuck peer).
    pub transfer_timeout: Duration,
    /// Longest wait for the worker to accept or answer a command.
    pub command_timeout: Duration,
    /// Capacity of the worker's command queue.
    pub queue_depth: usize,
    /// Largest two-sided message, in bytes (the size of each library-owned buffer).
    pub max_message_size: usize,
    /// Receive buffers kept posted for two-sided messages.
    pub recv_buffers: usize,
    /// Send buffers (messages in flight at once; more wait in order).
    pub send_buffers: usize,
    /// Blocks of the same-host paged-copy kernel (each takes one SM while it runs).
    pub paged_copy_blocks: u32,
    /// CPU to pin the UVM watcher threads to (`None`: not pinned).
    pub uvm_watcher_cpu: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            provider: ProviderSpec::default(),
            shard_min_bytes: 256 * 1024,
            worker_cpu: None,
            poll_mode: PollMode::Busy,
            transfer_timeout: Duration::from_secs(30),
            command_timeout: Duration::from_secs(10),
            queue_depth: 8192,
            max_message_size: 64 * 1024,
            recv_buffers: 64,
            send_buffers: 64,
            paged_copy_blocks: cuda_lib::PAGED_COPY_DEFAULT_BLOCKS,
            uvm_watcher_cpu: None,
        }
    }
}
