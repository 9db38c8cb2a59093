//! TransferEngine: the public entry point. Validates requests on the caller's thread, routes
//! them to the device's worker, and owns the callback thread and the ImmCounter table.
//!
//! Thread safety: every method takes `&self` and may be called from any thread. Callbacks run on
//! the engine's callback thread, never on the caller's or the worker's. `stop()` (also run on
//! drop) is idempotent: in-flight requests fail with [`FabricError::Stopped`].
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, SendTimeoutError, Sender, TrySendError};
use parking_lot::{Mutex, RwLock};

use crate::address::{local_host_id, local_process_id, DomainAddress, EngineAddress};
use crate::callback::CallbackThread;
use crate::commands::{Command, Transfer};
use crate::config::EngineConfig;
use crate::descriptor::MemoryKind;
use crate::error::{FabricError, Result};
use crate::gpu::Watchers;
use crate::imm_counter::ImmCounterTable;
use crate::latency_probe::{LatencyProbe, Stage};
use crate::peers::PeerTable;
use crate::worker;

/// Traffic posted on one domain (see [`TransferEngine::domain_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DomainStats {
    pub ops: u64,
    pub bytes: u64,
}

/// How [`TransferEngine::register_memory_with`] registers a region.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegisterOptions {
    /// Let peers read the region (`submit_read`). Off by default: a region is then remotely
    /// writable only, and its keys refuse reads in the provider.
    pub remote_read: bool,
}

/// A registered region of this engine, as returned by [`TransferEngine::register_memory`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MrHandle(pub u64);

#[derive(Clone, Copy, Debug)]
pub(crate) struct RegionInfo {
    pub len: u64,
    pub ptr: u64,
    pub kind: MemoryKind,
    /// Registered with the NIC (host memory always; GPU memory on FI_HMEM providers).
    pub network: bool,
    /// How GPU memory was registered with the NIC (None: host memory, or same-host only).
    pub nic: Option<crate::provider::libfabric::NicRegistration>,
}

static NEXT_ENGINE_ID: AtomicU64 = AtomicU64::new(1);

/// Moves memory to and from peers; see the crate docs.
pub struct TransferEngine {
    /// Unique in this process: ties prepared scatters to the engine that checked them.
    id: u64,
    config: EngineConfig,
    address: EngineAddress,
    domain_names: Vec<String>,
    commands: Sender<Command>,
    /// The worker's end of the command queue, to fail what it left there after it exited.
    leftovers: Receiver<Command>,
    /// On a line of its own: every submit reads it, and the worker allocated it among its own.
    worker_exited: Arc<crossbeam_utils::CachePadded<AtomicBool>>,
    oversized_messages: Arc<AtomicU64>,
    stale_immediates: Arc<AtomicU64>,
    refused_immediates: Arc<AtomicU64>,
    regions: RwLock<rustc_hash::FxHashMap<u64, RegionInfo>>,
    next_region: AtomicU64,
    /// Registrations released so far: a prepared scatter made after the last release knows its
    /// source is still registered without looking it up.
    pub(crate) released_regions: AtomicU64,
    /// Rotates the first domain of successive requests so load spreads over every NIC.
    pub(crate) next_domain: AtomicUsize,
    pub(crate) peer_groups: RwLock<HashMap<u64, Vec<EngineAddress>>>,
    pub(crate) next_group: AtomicU64,
    imm: Arc<ImmCounterTable>,
    callbacks: CallbackThread,
    worker: Mutex<Option<JoinHandle<()>>>,
    watchers: Watchers,
    stopped: AtomicBool,
    stats: Arc<[worker::DomainCounters]>,
    /// Every domain moves GPU memory itself (FI_HMEM): GPU regions are registered with the NIC.
    hmem: bool,
    staging: Arc<crate::staging::StagingCounters>,
    /// Every domain issues and serves RMA reads (FI_READ | FI_REMOTE_READ).
    rma_read: bool,
    /// Stage times of the latest request, when enabled (see `latency_probe`).
    probe: Arc<LatencyProbe>,
    /// The peers requests name, by id (shared with the worker).
    pub(crate) peers: Arc<PeerTable>,
    pub(crate) next_task: AtomicU64,
}

impl TransferEngine {
    /// Opens the configured provider and starts the worker and callback threads.
    pub fn new(config: EngineConfig) -> Result<Self> {
        config.validate()?;
        let imm = Arc::new(ImmCounterTable::with_wait_spin(config.wait_spin()));
        let probe = Arc::new(LatencyProbe::default());
        let peers = Arc::new(PeerTable::default());
        let id = NEXT_ENGINE_ID.fetch_add(1, Ordering::Relaxed);
        let callbacks = CallbackThread::spawn(config.wait_spin())
            .map_err(|e| FabricError::InvalidArgument(format!("cannot spawn the callback thread: {e}")))?;
        let worker::Spawned { commands, leftovers, handle, info } =
            match worker::spawn(&config, imm.clone(), callbacks.queue(), probe.clone(), peers.clone(), id) {
                Ok(started) => started,
                Err(e) => {
                    callbacks.shutdown(Duration::from_secs(1));
                    return Err(e);
                }
            };
        let address = EngineAddress {
            provider: info.provider,
            host_id: local_host_id(),
            pid: std::process::id(),
            process: local_process_id(),
            max_message_size: config.max_message_size as u64,
            domains: info
                .domains
                .iter()
                .map(|(_, endpoint, (imm_key, imm_base))| DomainAddress {
                    endpoint: endpoint.clone(),
                    imm_key: *imm_key,
                    imm_base: *imm_base,
                })
                .collect(),
            inbox: info.inbox,
        };
        Ok(TransferEngine {
            config,
            id,
            next_task: AtomicU64::new(1),
            address,
            domain_names: info.domains.into_iter().map(|(name, _, _)| name).collect(),
            commands,
            leftovers,
            worker_exited: info.exited.clone(),
            oversized_messages: info.oversized_messages.clone(),
            stale_immediates: info.stale_immediates.clone(),
            refused_immediates: info.refused_immediates.clone(),
            regions: RwLock::new(rustc_hash::FxHashMap::default()),
            next_region: AtomicU64::new(crate::commands::SCRATCH_REGION + 1),
            released_regions: AtomicU64::new(0),
            next_domain: AtomicUsize::new(0),
            peer_groups: RwLock::new(HashMap::new()),
            next_group: AtomicU64::new(1),
            imm,
            callbacks,
            worker: Mutex::new(Some(handle)),
            watchers: Watchers::new(),
            stopped: AtomicBool::new(false),
            stats: info.stats.clone(),
            hmem: info.hmem,
            staging: info.staging.clone(),
            rma_read: info.read,
            probe,
            peers,
        })
    }

    /// The address peers use to reach this engine.
    pub fn main_address(&self) -> &EngineAddress {
        &self.address
    }

    /// What this engine moved through staging (GPU memory over providers without FI_HMEM).
    pub fn staging_stats(&self) -> crate::staging::StagingStats {
        self.staging.snapshot()
    }

    /// Whether GPU memory the NIC cannot reach travels staged through host memory (staging
    /// on and the provider without FI_HMEM): GPU descriptors then carry a landing area.
    pub fn staging(&self) -> bool {
        self.config.staging.is_some() && !self.hmem
    }

    /// The provider in use, e.g. `tcp;ofi_rxm`.
    pub fn provider(&self) -> &str {
        &self.address.provider
    }

    /// The domains (NICs or interfaces) in use, in order, e.g. `["lo"]`.
    pub fn domain_names(&self) -> &[String] {
        &self.domain_names
    }

    /// Operations and bytes posted on each domain since the engine started, in domain order.
    pub fn domain_stats(&self) -> Vec<DomainStats> {
        self.stats
            .iter()
            .map(|c| DomainStats { ops: c.ops.load(Ordering::Relaxed), bytes: c.bytes.load(Ordering::Relaxed) })
            .collect()
    }

    /// Messages this engine could not take: over its `max_message_size`, or failed in the
    /// provider (senders check the limit first, so this counts misbehaving or misconfigured
    /// peers). Such messages are never delivered, whole or cut.
    pub fn refused_messages(&self) -> u64 {
        self.oversized_messages.load(Ordering::Relaxed)
    }

    /// Immediates this engine refused because they belong to a writer's epoch that ended: the
    /// writer timed out on requests to this engine and re-admitted it (see
    /// [`TransferEngine::readmit_peer`]); they were delivered too late to be counted.
    pub fn stale_immediates(&self) -> u64 {
        self.stale_immediates.load(Ordering::Relaxed)
    }

    /// Entries of this engine's same-host inbox refused as malformed (a slot no writer of this
    /// library produces, or an impossible epoch tag): some process of this host that can open
    /// the inbox wrote into it. They are never counted.
    pub fn refused_immediates(&self) -> u64 {
        self.refused_immediates.load(Ordering::Relaxed)
    }

    /// Whether GPU regions of this engine are registered with the NIC (the provider has
    /// FI_HMEM and `gpu_network` is on), so peers on other hosts reach them directly.
    pub fn gpu_network(&self) -> bool {
        self.hmem
    }

    /// Number of domains of this engine's device.
    pub fn num_domains(&self) -> usize {
        self.domain_names.len()
    }

    /// The configuration the engine was built with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The engine's latency probe: off until [`LatencyProbe::enable`]; then it records when the
    /// latest request passed each stage (diagnostics for latency tests, one request at a time).
    pub fn latency_probe(&self) -> &LatencyProbe {
        &self.probe
    }

    pub(crate) fn command(&self, cmd: Command) -> Result<()> {
        if self.is_stopped() {
            return Err(FabricError::Stopped);
        }
        // Before the send: the worker may take the command before send_timeout returns.
        self.probe.mark(Stage::Enqueued);
        // From a task on this engine's worker: handled here and now (see `tasks`).
        let Some(cmd) = worker::handle_inline(self.id, cmd) else { return Ok(()) };
        // A queue with room (the usual case) takes the command without reading the clock.
        let cmd = match self.commands.try_send(cmd) {
            Ok(()) => None,
            Err(TrySendError::Full(cmd)) => Some(cmd),
            Err(TrySendError::Disconnected(_)) => return Err(FabricError::Stopped),
        };
        if let Some(cmd) = cmd {
            self.commands.send_timeout(cmd, self.config.command_timeout).map_err(|e| match e {
                SendTimeoutError::Timeout(_) => FabricError::Timeout(format!(
                    "the worker's command queue stayed full for {:?}",
                    self.config.command_timeout
                )),
                SendTimeoutError::Disconnected(_) => FabricError::Stopped,
            })?;
        }
        if self.worker_exited.load(Ordering::Acquire) {
            // The worker may have drained the queue before this command arrived: fail what is
            // left (each command is received once, by the worker or here).
            self.fail_leftovers();
        }
        Ok(())
    }

    fn fail_leftovers(&self) {
        while let Ok(cmd) = self.leftovers.try_recv() {
            if let Some(on_done) = cmd.into_stopped() {
                on_done.now(Err(FabricError::Stopped));
            }
        }
    }

    /// The first domain for a request of `by` parts; successive requests start on successive
    /// domains so load spreads over every NIC.
    pub(super) fn rotate(&self, by: usize) -> usize {
        self.next_domain.fetch_add(by.max(1), Ordering::Relaxed)
    }

    pub(crate) fn submit_transfer(&self, transfer: Transfer) -> Result<()> {
        self.command(Command::Transfer(transfer))
    }

    fn request<T>(&self, make: impl FnOnce(Sender<Result<T>>) -> Command) -> Result<T> {
        let (tx, rx) = bounded(1);
        self.command(make(tx))?;
        rx.recv_timeout(self.config.command_timeout).map_err(|_| {
            if self.is_stopped() {
                FabricError::Stopped
            } else {
                FabricError::Timeout(format!("the worker did not answer within {:?}", self.config.command_timeout))
            }
        })?
    }

    /// Whether the engine serves no more requests: [`TransferEngine::stop`] ran, or its worker
    /// exited (it only does so on stop, or after an internal error it reported in the log).
    pub fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire) || self.worker_exited.load(Ordering::Acquire)
    }

    /// Stops the worker (failing what is in flight), then the callback thread. Idempotent;
    /// bounded by the command timeout.
    pub fn stop(&self) {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        let timeout = self.config.command_timeout;
        let _ = self.commands.send_timeout(Command::Stop, timeout);
        if let Some(handle) = self.worker.lock().take() {
            let deadline = crate::config::deadline_after(timeout);
            while !handle.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_micros(200));
            }
            if handle.is_finished() {
                let _ = handle.join();
            } else {
                tracing::warn!("worker did not stop within {timeout:?}; detaching it");
            }
        }
        self.fail_leftovers();
        self.watchers.stop();
        self.imm.close();
        self.callbacks.shutdown(timeout);
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        self.stop();
    }
}

mod counters;
mod immediates;
mod memory;
mod messages;
mod pages;
mod prepared;
mod reads;
mod routing;
mod scatter;
mod signals;
mod tasks;
mod triggers;
mod writes;

pub use prepared::PreparedScatter;
pub(crate) use tasks::unknown_task;
pub use tasks::{TaskId, WorkerTask};
pub use triggers::Trigger;
