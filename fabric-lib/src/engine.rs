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

use crossbeam_channel::{bounded, Receiver, SendTimeoutError, Sender};
use parking_lot::{Mutex, RwLock};

use crate::address::{local_host_id, local_process_id, DomainAddress, EngineAddress};
use crate::callback::CallbackThread;
use crate::config::EngineConfig;
use crate::descriptor::{CudaIpc, DomainKey, MemoryKind, MrDescriptor};
use crate::error::{FabricError, Result};
use crate::gpu::{GpuFlag, UvmWatcher, WatcherCallback, Watchers};
use crate::imm_counter::{GenericImmCallback, ImmCounterTable, OnReached};
use crate::worker::{self, Command, OnDone, RecvCallback, SendCommand, Target, Transfer};

/// Traffic posted on one domain (see [`TransferEngine::domain_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DomainStats {
    pub ops: u64,
    pub bytes: u64,
}

/// A registered region of this engine, as returned by [`TransferEngine::register_memory`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MrHandle(pub u64);

#[derive(Clone, Copy, Debug)]
pub(crate) struct RegionInfo {
    pub len: u64,
    pub ptr: u64,
    pub kind: MemoryKind,
}

/// Moves memory to and from peers; see the crate docs.
pub struct TransferEngine {
    config: EngineConfig,
    address: EngineAddress,
    domain_names: Vec<String>,
    commands: Sender<Command>,
    /// The worker's end of the command queue, to fail what it left there after it exited.
    leftovers: Receiver<Command>,
    worker_exited: Arc<AtomicBool>,
    oversized_messages: Arc<AtomicU64>,
    regions: RwLock<HashMap<u64, RegionInfo>>,
    next_region: AtomicU64,
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
}

impl TransferEngine {
    /// Opens the configured provider and starts the worker and callback threads.
    pub fn new(config: EngineConfig) -> Result<Self> {
        config.validate()?;
        let imm = Arc::new(ImmCounterTable::new());
        let callbacks = CallbackThread::spawn()
            .map_err(|e| FabricError::InvalidArgument(format!("cannot spawn the callback thread: {e}")))?;
        let worker::Spawned { commands, leftovers, handle, info } =
            match worker::spawn(&config, imm.clone(), callbacks.queue()) {
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
        };
        Ok(TransferEngine {
            config,
            address,
            domain_names: info.domains.into_iter().map(|(name, _, _)| name).collect(),
            commands,
            leftovers,
            worker_exited: info.exited.clone(),
            oversized_messages: info.oversized_messages.clone(),
            regions: RwLock::new(HashMap::new()),
            next_region: AtomicU64::new(worker::SCRATCH_REGION + 1),
            next_domain: AtomicUsize::new(0),
            peer_groups: RwLock::new(HashMap::new()),
            next_group: AtomicU64::new(1),
            imm,
            callbacks,
            worker: Mutex::new(Some(handle)),
            watchers: Watchers::new(),
            stopped: AtomicBool::new(false),
            stats: info.stats.clone(),
        })
    }

    /// The address peers use to reach this engine.
    pub fn main_address(&self) -> &EngineAddress {
        &self.address
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

    /// Number of domains of this engine's device.
    pub fn num_domains(&self) -> usize {
        self.domain_names.len()
    }

    /// The configuration the engine was built with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub(crate) fn command(&self, cmd: Command) -> Result<()> {
        if self.is_stopped() {
            return Err(FabricError::Stopped);
        }
        self.commands.send_timeout(cmd, self.config.command_timeout).map_err(|e| match e {
            SendTimeoutError::Timeout(_) => FabricError::Timeout(format!(
                "the worker's command queue stayed full for {:?}",
                self.config.command_timeout
            )),
            SendTimeoutError::Disconnected(_) => FabricError::Stopped,
        })?;
        if self.worker_exited.load(Ordering::Acquire) {
            // The worker may have drained the queue before this command arrived: fail what is
            // left (each command is received once, by the worker or here).
            self.fail_leftovers();
        }
        Ok(())
    }

    fn fail_leftovers(&self) {
        while let Ok(cmd) = self.leftovers.try_recv() {
            cmd.fail_stopped();
        }
    }

    /// Checks that `peer` can be reached from this engine: same provider, same domain count.
    pub(crate) fn check_peer(&self, peer: &EngineAddress) -> Result<()> {
        if peer.provider != self.address.provider {
            return Err(FabricError::InvalidDescriptor(format!(
                "peer belongs to a '{}' engine, this engine uses '{}'",
                peer.provider, self.address.provider
            )));
        }
        if peer.domains.len() != self.address.domains.len() {
            return Err(FabricError::InvalidDescriptor(format!(
                "peer has {} domains, this engine {}; all peers must use the same number",
                peer.domains.len(),
                self.address.domains.len()
            )));
        }
        Ok(())
    }

    /// Where the worker writes for a region descriptor (checked against this engine).
    pub(crate) fn region_target(&self, dst: &MrDescriptor) -> Result<Target> {
        self.check_peer(&dst.owner)?;
        Ok(Target {
            addresses: dst.keys.iter().map(|k| k.address.endpoint.clone()).collect(),
            keys: dst.keys.iter().map(|k| (k.key, k.remote_base)).collect(),
        })
    }

    /// Where the worker sends immediates addressed to an engine (its immediate slots).
    pub(crate) fn engine_target(&self, peer: &EngineAddress) -> Result<Target> {
        self.check_peer(peer)?;
        Ok(Target {
            addresses: peer.domains.iter().map(|d| d.endpoint.clone()).collect(),
            keys: peer.domains.iter().map(|d| (d.imm_key, d.imm_base)).collect(),
        })
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

    /// Registers `[ptr, ptr + len)` for local use and remote writes.
    ///
    /// # Safety
    /// The memory must stay allocated until [`TransferEngine::unregister_memory`] returns (or
    /// the engine is stopped).
    pub unsafe fn register_memory(
        &self,
        ptr: *mut u8,
        len: usize,
        kind: MemoryKind,
    ) -> Result<(MrHandle, MrDescriptor)> {
        if ptr.is_null() {
            return Err(FabricError::InvalidArgument("cannot register a null pointer".into()));
        }
        if len == 0 {
            return Err(FabricError::InvalidArgument("cannot register an empty region".into()));
        }
        if (ptr as usize).checked_add(len).is_none() {
            return Err(FabricError::InvalidArgument("region extent overflows the address space".into()));
        }
        if let MemoryKind::Cuda(device) = kind {
            return self.register_cuda(ptr as u64, len, device);
        }
        crate::host_memory::check_host_range(ptr as u64, len as u64)?;
        let region = self.next_region.fetch_add(1, Ordering::Relaxed);
        let registered =
            self.request(|reply| Command::Register { region, ptr: ptr as usize, len, kind, network: true, reply })?;
        self.regions.write().insert(region, RegionInfo { len: len as u64, ptr: ptr as u64, kind });
        let descriptor = MrDescriptor {
            base: ptr as u64,
            len: len as u64,
            kind,
            owner: self.address.clone(),
            keys: registered
                .iter()
                .zip(&self.address.domains)
                .map(|(&(key, remote_base), address)| DomainKey { address: address.clone(), key, remote_base })
                .collect(),
            cuda: None,
        };
        Ok((MrHandle(region), descriptor))
    }

    /// GPU memory: exported through a legacy CUDA IPC handle for same-host peers. The libfabric
    /// providers opened here lack FI_HMEM, so it is not registered with the NIC (no DMA-BUF
    /// registration is implemented: it cannot be tested on these hosts); network writes from or
    /// to it fail with an error saying so (see [`TransferEngine::gpu_network_error`]).
    fn register_cuda(&self, ptr: u64, len: usize, device: u32) -> Result<(MrHandle, MrDescriptor)> {
        match crate::gpu::detect_memory_kind(ptr) {
            MemoryKind::Cuda(d) if d == device => {}
            MemoryKind::Cuda(d) => {
                return Err(FabricError::InvalidArgument(format!(
                    "pointer {ptr:#x} is memory of CUDA device {d}, not of device {device}"
                )))
            }
            MemoryKind::Host => {
                cuda_lib::Driver::get()?;
                return Err(FabricError::InvalidArgument(format!(
                    "pointer {ptr:#x} is not CUDA device memory (registered as cuda:{device})"
                )));
            }
        }
        let ctx = cuda_lib::Context::new(device as usize)?;
        let export = cuda_lib::ipc_export(&ctx, ptr).map_err(|e| {
            FabricError::Cuda(format!(
                "exporting a CUDA IPC handle for {ptr:#x}: {e} (only cudaMalloc/cuMemAlloc memory can be \
                 shared; torch's expandable_segments allocations cannot)"
            ))
        })?;
        if export.offset + len as u64 > export.alloc_len as u64 {
            return Err(FabricError::InvalidArgument(format!(
                "GPU region [{ptr:#x}, +{len}) extends past the end of its allocation ({} bytes from offset {})",
                export.alloc_len, export.offset
            )));
        }
        let kind = MemoryKind::Cuda(device);
        let region = self.next_region.fetch_add(1, Ordering::Relaxed);
        self.request(|reply| Command::Register { region, ptr: ptr as usize, len, kind, network: false, reply })?;
        self.regions.write().insert(region, RegionInfo { len: len as u64, ptr, kind });
        let descriptor = MrDescriptor {
            base: ptr,
            len: len as u64,
            kind,
            owner: self.address.clone(),
            keys: Vec::new(),
            cuda: Some(CudaIpc {
                handle: export.handle.0.to_vec(),
                offset: export.offset,
                alloc_len: export.alloc_len as u64,
            }),
        };
        Ok((MrHandle(region), descriptor))
    }

    /// The error for a network transfer that involves GPU memory.
    pub(crate) fn gpu_network_error(&self, side: &str, kind: MemoryKind) -> FabricError {
        FabricError::ProviderUnavailable(format!(
            "the {side} is GPU memory ({kind:?}) on a peer on another host: provider '{}' was opened without \
             FI_HMEM, so GPU regions are registered for same-host (CUDA IPC) transfers only and are never \
             copied through host memory behind your back. Remedy: stage through a registered host buffer, or \
             use a provider with FI_HMEM (efa, or verbs;ofi_rxm with a CUDA-enabled libfabric) once DMA-BUF \
             registration is implemented (it is not: it cannot be tested on these hosts)",
            self.address.provider
        ))
    }

    /// Information about a local registration.
    pub(crate) fn region_info(&self, handle: MrHandle) -> Result<RegionInfo> {
        self.regions
            .read()
            .get(&handle.0)
            .copied()
            .ok_or_else(|| FabricError::InvalidArgument(format!("memory handle {} is not registered", handle.0)))
    }

    /// Allocates a UVM watcher on `device`: a 64-bit word in mapped pinned host memory that
    /// kernels (also inside CUDA graphs) write; `callback(old, new)` runs on the callback thread
    /// after every change a per-device polling thread sees.
    pub fn alloc_uvm_watcher(&self, device: usize, callback: WatcherCallback) -> Result<UvmWatcher> {
        if self.is_stopped() {
            return Err(FabricError::Stopped);
        }
        self.watchers.alloc(
            device,
            self.config.uvm_watcher_cpu,
            self.config.poll_mode,
            self.callbacks.queue(),
            callback,
        )
    }

    /// Allocates a GPU flag on `device` (a word kernels poll; set from the CPU or by an
    /// ImmCounter, see [`TransferEngine::set_imm_count_expected_flag`]).
    pub fn alloc_gpu_flag(&self, device: usize) -> Result<GpuFlag> {
        GpuFlag::new(device)
    }

    /// Stores `value` into `flag` once `imm` has arrived `n` times (no Python involved; the
    /// store runs on the engine's callback thread right after the count is reached). Then
    /// `on_reached`, if given, runs.
    pub fn set_imm_count_expected_flag(
        &self,
        imm: u32,
        n: u64,
        flag: GpuFlag,
        value: u64,
        on_reached: Option<OnReached>,
    ) -> Result<()> {
        self.set_imm_count_expected(
            imm,
            n,
            Box::new(move || {
                flag.set(value);
                if let Some(cb) = on_reached {
                    cb();
                }
            }),
        )
    }

    /// Releases a registration. Fails while operations reading from it are in flight.
    pub fn unregister_memory(&self, handle: MrHandle) -> Result<()> {
        if !self.regions.read().contains_key(&handle.0) {
            return Err(FabricError::InvalidArgument(format!("memory handle {} is not registered", handle.0)));
        }
        self.request(|reply| Command::Unregister { region: handle.0, reply })?;
        self.regions.write().remove(&handle.0);
        Ok(())
    }

    /// Length of a local registration.
    pub fn region_len(&self, handle: MrHandle) -> Result<u64> {
        self.region_info(handle).map(|r| r.len)
    }

    /// Address of a local registration's first byte.
    pub fn region_base(&self, handle: MrHandle) -> Result<u64> {
        self.region_info(handle).map(|r| r.ptr)
    }

    /// Memory kind of a local registration.
    pub fn region_kind(&self, handle: MrHandle) -> Result<MemoryKind> {
        self.region_info(handle).map(|r| r.kind)
    }

    /// Sends a small two-sided message (at most `max_message_size` bytes) to `peer`, whose
    /// receive callback gets the bytes.
    pub fn submit_send(&self, peer: &EngineAddress, data: Vec<u8>, on_done: OnDone) -> Result<()> {
        self.check_peer(peer)?;
        if data.len() > self.config.max_message_size {
            return Err(FabricError::InvalidArgument(format!(
                "message of {} bytes exceeds this engine's max_message_size ({})",
                data.len(),
                self.config.max_message_size
            )));
        }
        if data.len() as u64 > peer.max_message_size {
            return Err(FabricError::InvalidArgument(format!(
                "message of {} bytes exceeds the receiving engine's max_message_size ({})",
                data.len(),
                peer.max_message_size
            )));
        }
        self.command(Command::Send(SendCommand {
            peer: peer.domains[0].endpoint.clone(),
            data,
            on_done: crate::completion::Notify::Callback(on_done),
        }))
    }

    /// Lifts the fence that a timed-out request put on `peer` (see [`FabricError::PeerFenced`]);
    /// returns whether it was fenced. Requests that timed out may or may not have landed: re-admit
    /// once the application has settled with the peer what it received.
    pub fn readmit_peer(&self, peer: &EngineAddress) -> Result<bool> {
        self.check_peer(peer)?;
        let first = peer.domains[0].endpoint.clone();
        self.request(|reply| Command::Readmit { peer: first, reply })
    }

    /// Installs the callback for received messages (`None` keeps messages until one is set).
    pub fn set_recv_callback(&self, callback: Option<RecvCallback>) -> Result<()> {
        self.command(Command::SetRecvCallback(callback))
    }

    /// Calls `on_reached` once `imm` has arrived `n` times (arrivals so far count).
    pub fn set_imm_count_expected(&self, imm: u32, n: u64, on_reached: OnReached) -> Result<()> {
        if self.is_stopped() {
            return Err(FabricError::Stopped);
        }
        if let Some(due) = self.imm.set_expected(imm, n, on_reached)? {
            self.callbacks.queue().push(due);
        }
        Ok(())
    }

    /// Cancels the expectation on `imm` (unfired) and forgets its count, returning the count.
    pub fn remove_imm_count(&self, imm: u32) -> u64 {
        self.imm.remove(imm)
    }

    /// Arrivals of `imm` counted and not yet consumed.
    pub fn imm_count(&self, imm: u32) -> u64 {
        self.imm.value(imm)
    }

    /// Blocks until `imm` has arrived `n` times, then consumes them; errors after `timeout`.
    pub fn wait_imm_count(&self, imm: u32, n: u64, timeout: Duration) -> Result<()> {
        self.imm.wait(imm, n, timeout)
    }

    /// Consumes `n` arrivals of `imm` if they are all there; never waits.
    pub fn try_take_imm_count(&self, imm: u32, n: u64) -> bool {
        self.imm.try_take(imm, n)
    }

    /// Counts `imm` even while a generic immediate callback is installed.
    pub fn claim_imm(&self, imm: u32) {
        self.imm.claim(imm)
    }

    /// Undoes [`TransferEngine::claim_imm`].
    pub fn unclaim_imm(&self, imm: u32) {
        self.imm.unclaim(imm)
    }

    /// Installs the callback for immediates nobody expects or waits for.
    pub fn set_imm_callback(&self, callback: Option<GenericImmCallback>) {
        self.imm.set_generic_callback(callback)
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
