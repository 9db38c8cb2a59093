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

impl EngineConfig {
    /// The polling time of waiting threads this configuration gives (see `wait_spin`).
    pub fn wait_spin(&self) -> Duration {
        self.wait_spin.unwrap_or_else(crate::spin::default_wait_spin)
    }
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

/// How GPU memory is registered with the NIC where the provider has FI_HMEM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuRegistration {
    /// DMA-BUF where the running libfabric has it (≥ 1.20), falling back to the CUDA interface
    /// when the driver or provider refuses it.
    Auto,
    /// DMA-BUF only: a region that cannot be registered that way fails to register.
    Dmabuf,
    /// By address with `iface = FI_HMEM_CUDA` only.
    Cuda,
}

impl GpuRegistration {
    /// The option's name: `auto`, `dmabuf` or `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            GpuRegistration::Auto => "auto",
            GpuRegistration::Dmabuf => "dmabuf",
            GpuRegistration::Cuda => "cuda",
        }
    }

    /// Parses the option's name.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "auto" => Ok(GpuRegistration::Auto),
            "dmabuf" => Ok(GpuRegistration::Dmabuf),
            "cuda" => Ok(GpuRegistration::Cuda),
            other => Err(FabricError::InvalidArgument(format!(
                "gpu_registration must be 'auto', 'dmabuf' or 'cuda', not {other:?}"
            ))),
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
    /// The GPU this engine serves (a CUDA device ordinal). Its worker makes that GPU's primary
    /// context current on itself before it opens the provider, so the provider's own CUDA work
    /// (shm's host registrations, device copies and CUDA IPC opens with FI_HMEM) runs on this
    /// GPU and never creates a context on another. `None`: the first GPU whose memory the
    /// engine registers, from that registration on.
    pub cuda_device: Option<u32>,
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
    /// Ask for FI_HMEM and register GPU memory with the NIC, so peers on other hosts reach GPU
    /// regions directly. `None`: on the RDMA providers (efa, verbs;ofi_rxm) only; `Some(true)`
    /// also on software providers that offer it (shm of a CUDA-enabled libfabric). FI_HMEM
    /// changes a provider's protocol, so software providers use it only when asked.
    pub gpu_network: Option<bool>,
    /// Send same-host transfers involving GPU memory over the provider too, as two hosts would,
    /// instead of CUDA IPC (tests and benchmarks of the network path on one machine).
    pub force_network: bool,
    /// How GPU memory is registered with the NIC on FI_HMEM providers (a forced mode is for
    /// tests and for NICs known to need one).
    pub gpu_registration: GpuRegistration,
    /// Entries of this engine's same-host immediate inbox (a power of two; 0: no inbox, and
    /// same-host writers announce their immediates over the provider).
    pub same_host_inbox_slots: usize,
    /// Also carry host → host writes and immediate-only requests (`submit_imm`,
    /// `submit_imm_to`) to engines in other processes of this host the same-host way:
    /// `process_vm_writev` (needs ptrace permission over the peer) and the peer's inbox.
    pub same_host_host_memory: bool,
    /// Staged transfers of GPU memory where the provider has no FI_HMEM (see `staging`): sizes
    /// of the pinned bounce buffers and landing area. `None` turns staging off (GPU memory then
    /// serves same-host peers only, as with staging unsupported).
    pub staging: Option<crate::staging::StagingConfig>,
    /// Testing aid: host memory takes the staged path too (bounce copies and landing copies by
    /// memcpy), so the staging protocol runs end to end on machines without a GPU. Never needed
    /// in production: host memory is always reachable over the network directly.
    pub stage_host_memory: bool,
    /// How long threads that wait on the engine (`wait_imm_count`, the callback thread between
    /// jobs) poll before they sleep: polling saves a futex wake-up and a scheduler wake-up
    /// (several µs each) per hand-off, but takes a core while it lasts. `None`: 50 µs where this
    /// process may use at least 4 CPUs, none with fewer (the poller would take the worker's core).
    pub wait_spin: Option<Duration>,
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
        let slots = self.same_host_inbox_slots;
        let max_slots = crate::provider::same_host::MAX_INBOX_SLOTS;
        if slots != 0 && (slots < 2 || slots > max_slots || !slots.is_power_of_two()) {
            return bad(format!("same_host_inbox_slots must be 0 or a power of two in 2..={max_slots}, got {slots}"));
        }
        if self.paged_copy_blocks == 0 || self.paged_copy_blocks > 65_535 {
            return bad(format!("paged_copy_blocks must be in 1..=65535, got {}", self.paged_copy_blocks));
        }
        if self.gpu_registration != GpuRegistration::Auto && self.gpu_network == Some(false) {
            return bad(format!(
                "gpu_registration='{}' registers GPU memory with the NIC, which gpu_network=False turns off",
                self.gpu_registration.name()
            ));
        }
        if let Some(staging) = &self.staging {
            staging.validate()?;
        }
        if let Some(spin) = self.wait_spin {
            check_timeout("wait_spin", spin)?;
        }
        if self.stage_host_memory && self.staging.is_none() {
            return bad("stage_host_memory needs staging on".into());
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
            cuda_device: None,
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
            gpu_network: None,
            force_network: false,
            gpu_registration: GpuRegistration::Auto,
            same_host_inbox_slots: 4096,
            same_host_host_memory: false,
            staging: Some(crate::staging::StagingConfig::default()),
            stage_host_memory: false,
            wait_spin: None,
        }
    }
}
