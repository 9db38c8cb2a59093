//! Engine configuration with defaults that work on a laptop and on an RDMA host, and the
//! bounds every value is checked against before anything is allocated or spawned.
use std::time::{Duration, Instant};

use crate::error::{FabricError, Result};
use crate::provider::libfabric::ProviderSpec;

/// Longest timeout any call accepts (about 31 years): larger values overflow deadlines.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(1_000_000_000);
/// Largest two-sided message (each send and receive buffer is this large).
pub const MAX_MESSAGE_SIZE: usize = 64 << 20;
/// Most memory the library-owned message buffers of one domain may take.
pub const MAX_MESSAGE_BUFFER_BYTES: usize = 1 << 30;
/// Most send or receive buffers per domain, and the deepest command queue.
pub const MAX_BUFFERS: usize = 1 << 16;
pub const MAX_QUEUE_DEPTH: usize = 1 << 20;

/// `now + timeout`, saturating far in the future instead of overflowing.
pub(crate) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout.min(MAX_TIMEOUT)).unwrap_or(now)
}

/// Checks a caller-supplied timeout against [`MAX_TIMEOUT`].
pub fn check_timeout(what: &str, timeout: Duration) -> Result<()> {
    if timeout > MAX_TIMEOUT {
        return Err(FabricError::InvalidArgument(format!(
            "{what} of {timeout:?} exceeds the maximum of {} s",
            MAX_TIMEOUT.as_secs()
        )));
    }
    Ok(())
}

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

/// When a write counts as done for its writer (its Future / `on_done`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteCompletion {
    /// Delivery where the provider reports a receiver's refusal only that way (tcp, sockets:
    /// with transmit completion a refused write "succeeds" and the connection breaks), transmit
    /// elsewhere (RDMA NICs report remote access errors either way; libfabric 1.17's shm
    /// stalls on refused delivery-complete writes).
    Auto,
    /// Done once the bytes are in the receiver's memory (FI_DELIVERY_COMPLETE): refused
    /// writes fail with an error. One more message per write on software providers.
    Delivery,
    /// Done once the source buffer may be reused; the receiver's immediate count is what says
    /// the bytes arrived.
    Transmit,
}

impl WriteCompletion {
    /// Whether writes on `provider` ask for delivery completion.
    pub fn delivery_for(self, provider: &str) -> bool {
        match self {
            WriteCompletion::Delivery => true,
            WriteCompletion::Transmit => false,
            WriteCompletion::Auto => provider.starts_with("tcp") || provider.starts_with("sockets"),
        }
    }
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
    /// When a write counts as done for its writer.
    pub write_completion: WriteCompletion,
}

impl EngineConfig {
    /// Checks every value against its bounds (before anything is allocated or spawned).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(FabricError::InvalidArgument(m));
        check_timeout("transfer_timeout", self.transfer_timeout)?;
        check_timeout("command_timeout", self.command_timeout)?;
        if self.transfer_timeout.is_zero() || self.command_timeout.is_zero() {
            return bad("transfer_timeout and command_timeout must be positive".into());
        }
        if let PollMode::Adaptive { spin, park } = self.poll_mode {
            check_timeout("poll_mode spin", spin)?;
            check_timeout("poll_mode park", park)?;
        }
        if self.max_message_size == 0 || self.max_message_size > MAX_MESSAGE_SIZE {
            return bad(format!("max_message_size must be in 1..={MAX_MESSAGE_SIZE}, got {}", self.max_message_size));
        }
        for (name, n) in [("send_buffers", self.send_buffers), ("recv_buffers", self.recv_buffers)] {
            if n == 0 || n > MAX_BUFFERS {
                return bad(format!("{name} must be in 1..={MAX_BUFFERS}, got {n}"));
            }
        }
        let bytes = (self.send_buffers + self.recv_buffers).saturating_mul(self.max_message_size + 1);
        if bytes > MAX_MESSAGE_BUFFER_BYTES {
            return bad(format!(
                "(send_buffers + recv_buffers) * max_message_size = {bytes} bytes of message buffers per domain \
                 exceeds {MAX_MESSAGE_BUFFER_BYTES}; lower one of them"
            ));
        }
        if self.queue_depth == 0 || self.queue_depth > MAX_QUEUE_DEPTH {
            return bad(format!("queue_depth must be in 1..={MAX_QUEUE_DEPTH}, got {}", self.queue_depth));
        }
        if self.paged_copy_blocks == 0 || self.paged_copy_blocks > 65_535 {
            return bad(format!("paged_copy_blocks must be in 1..=65535, got {}", self.paged_copy_blocks));
        }
        // Affinity masks hold CPU_SETSIZE (1024) CPUs; a larger index cannot be pinned.
        for (name, cpu) in [("worker_cpu", self.worker_cpu), ("uvm_watcher_cpu", self.uvm_watcher_cpu)] {
            if let Some(cpu) = cpu.filter(|&c| c >= 1024) {
                return bad(format!("{name} {cpu} is not a CPU index (0..1024)"));
            }
        }
        Ok(())
    }
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
            write_completion: WriteCompletion::Auto,
        }
    }
}
