//! The worker: one thread per device that solely owns the device's domains, posts operations,
//! drives progress, counts immediates and hands completions to the callback thread.
//!
//! No locks on the data path: commands arrive on a bounded channel, completions leave on the
//! callback queue, and the ImmCounter table is updated once per completion batch.
use std::collections::{HashMap, HashSet, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender, TryRecvError};
use crossbeam_utils::CachePadded;
use rustc_hash::{FxHashMap, FxHashSet};

use crate::callback::CallbackQueue;
use crate::commands::{
    Command, RecvCallback, SameHostTransfer, SendCommand, Target, TargetList, Transfer, SCRATCH_REGION,
};
use crate::completion::{CompletionCounter, Notify, OnDone};
use crate::config::{deadline_after, EngineConfig, PollMode};
use crate::descriptor::MemoryKind;
use crate::domain_state::DomainState;
use crate::epoch::{PendingReadmit, ReceivedEpochs};
use crate::error::{FabricError, Result};
use crate::imm_counter::ImmCounterTable;
use crate::latency_probe::{LatencyProbe, Stage};
use crate::peers::{Endpoints, PeerTable};
use crate::provider::libfabric::{Access, Completion, LocalMr, OpContext, OpKind, Posted};
use crate::provider::same_host::{copy_host_to_host, SameHostChannel, SameHostDone, SameHostSrc};
use crate::sharding::DeferredImm;

/// Messages copied out and kept while no receive callback is installed. Past this, arriving
/// messages stay in their receive buffers, which are not re-posted: the provider then holds
/// back senders (back-pressure) instead of anything being dropped.
const UNDELIVERED_LIMIT: usize = 4096;
/// Contexts of completed posts kept for reuse (more are freed).
const SPARE_CONTEXTS: usize = 4096;

mod deadlines;
mod epochs;
mod inbox;
mod reads;
mod request_table;
mod staged;
mod tasks;
mod triggers;

pub(crate) use tasks::{handle_inline, running_task_of};

/// What the worker reports once its domains are open.
pub(crate) struct WorkerInfo {
    pub provider: String,
    /// Per domain: name, endpoint address, (key, remote base) of the immediate slot.
    pub domains: Vec<(String, Vec<u8>, (u64, u64))>,
    /// Per-domain traffic counters the worker updates.
    pub stats: Arc<[DomainCounters]>,
    /// Set once the worker left its loop (stopped, or a bug made it panic): from then on no
    /// command is served, and the engine fails what it finds in the queue itself.
    pub exited: Arc<CachePadded<AtomicBool>>,
    /// Messages refused for exceeding max_message_size.
    pub oversized_messages: Arc<AtomicU64>,
    /// Immediates refused for carrying a retired epoch (see `epoch`).
    pub stale_immediates: Arc<AtomicU64>,
    /// Every domain has FI_HMEM: GPU memory can be registered with the NIC.
    pub hmem: bool,
    /// Staged traffic (see `staging`).
    pub staging: Arc<crate::staging::StagingCounters>,
    /// Every domain can issue and serve RMA reads.
    pub read: bool,
    /// This engine's same-host immediate inbox, if it has one.
    pub inbox: Option<crate::address::InboxAddress>,
    /// Malformed same-host inbox entries refused.
    pub refused_immediates: Arc<AtomicU64>,
}

/// Operations and bytes posted on one domain (relaxed atomics: read for reports only). Aligned
/// to a line pair of its own (as `CachePadded`), so the worker's bumps never evict a line that
/// another thread polls.
#[derive(Default)]
#[repr(align(128))]
pub(crate) struct DomainCounters {
    pub ops: std::sync::atomic::AtomicU64,
    pub bytes: std::sync::atomic::AtomicU64,
}

impl DomainCounters {
    /// Counts one post of `len` bytes. Only the worker writes: a load and a store each, not a
    /// locked read-modify-write (readers see either value).
    fn record(&self, len: usize) {
        let bump = |c: &AtomicU64, n: u64| c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
        bump(&self.ops, 1);
        bump(&self.bytes, len as u64);
    }
}

struct Region {
    mrs: Vec<LocalMr>,
    ptr: usize,
    len: usize,
    kind: MemoryKind,
    /// Posted operations that read from this region and have not completed.
    in_flight: usize,
}

struct Request {
    remaining: usize,
    error: Option<FabricError>,
    on_done: Notify,
    /// Immediates to send once every data shard was delivered, with their resolved targets.
    deferred: Vec<(DeferredImm, u64, u64, u64)>,
    /// The peers it writes to or sends to (moved in, not copied): fenced if it times out.
    peers: TargetList,
    /// A same-host immediate for the peer's inbox, pushed once the data is visible.
    inbox_imm: Option<inbox::InboxPush>,
}

#[derive(Clone, Copy)]
enum Op {
    Write {
        region: u64,
        ptr: usize,
        len: usize,
        dest: u64,
        remote_addr: u64,
        key: u64,
        imm: Option<u32>,
        delivery: bool,
    },
    Send {
        slot: usize,
        len: usize,
        dest: u64,
        /// Remote CQ data: set on control messages only (see `epoch`).
        data: Option<u64>,
    },
    /// Pulls `len` bytes of a peer region into `ptr` (inside local region `region`).
    Read { region: u64, ptr: usize, len: usize, dest: u64, remote_addr: u64, key: u64 },
}

impl Op {
    fn len(&self) -> usize {
        match *self {
            Op::Write { len, .. } | Op::Send { len, .. } | Op::Read { len, .. } => len,
        }
    }

    fn dest(&self) -> u64 {
        match *self {
            Op::Write { dest, .. } | Op::Send { dest, .. } | Op::Read { dest, .. } => dest,
        }
    }
}

/// A peer as this worker knows it: its endpoint names (from the engine's `PeerTable`) and, per
/// domain, its address in the provider's address vector once resolved.
struct KnownPeer {
    endpoints: Endpoints,
    dests: smallvec::SmallVec<[Option<u64>; 2]>,
}

struct PendingPost {
    request: u64,
    op: Op,
}

/// A running worker: its command queue (both ends: the engine fails what the worker left in
/// it after exiting), its thread, and what it reported when ready.
pub(crate) struct Spawned {
    pub commands: Sender<Command>,
    pub leftovers: Receiver<Command>,
    pub handle: JoinHandle<()>,
    pub info: WorkerInfo,
}

/// Starts a worker thread for `specs` (one per domain) and waits (bounded) until it is ready.
pub(crate) fn spawn(
    config: &EngineConfig,
    imm: Arc<ImmCounterTable>,
    callbacks: CallbackQueue,
    probe: Arc<LatencyProbe>,
    peers: Arc<PeerTable>,
    engine_id: u64,
) -> Result<Spawned> {
    let (tx, rx) = bounded::<Command>(config.queue_depth.max(1));
    let leftovers = rx.clone();
    let (ready_tx, ready_rx) = bounded::<Result<WorkerInfo>>(1);
    let config = config.clone();
    let timeout = config.command_timeout;
    let handle = std::thread::Builder::new()
        .name("fabric-worker".into())
        .spawn(move || {
            if let Some(cpu) = config.worker_cpu {
                if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
                    tracing::warn!("could not pin the worker to CPU {cpu}");
                }
            }
            let opened = bind_device(config.cuda_device).and_then(|cuda| {
                let mut worker = Worker::open(&config, rx, imm, callbacks, probe, peers, engine_id)?;
                worker.cuda = cuda;
                Ok(worker)
            });
            match opened {
                Ok(mut worker) => {
                    let info = WorkerInfo {
                        provider: worker.domains[0].domain.provider_name(),
                        domains: worker
                            .domains
                            .iter()
                            .map(|d| (d.domain.domain_name(), d.domain.address().to_vec(), d.imm_target()))
                            .collect(),
                        stats: worker.stats.clone(),
                        exited: worker.exited.clone(),
                        oversized_messages: worker.oversized_messages.clone(),
                        stale_immediates: worker.received.stale.clone(),
                        hmem: worker.domains.iter().all(|d| d.domain.has_hmem()),
                        staging: worker.staged.counters.clone(),
                        read: worker.domains.iter().all(|d| d.domain.supports_read()),
                        inbox: worker.inboxes.address(),
                        refused_immediates: worker.inboxes.refused.clone(),
                    };
                    let _ = ready_tx.send(Ok(info));
                    // A bug must not leave futures pending forever: whatever happens in the
                    // loop, every request and queued command is failed on the way out.
                    if catch_unwind(AssertUnwindSafe(|| worker.run())).is_err() {
                        tracing::error!("the fabric-lib worker panicked; failing every request and stopping");
                    }
                    worker.shutdown();
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| FabricError::InvalidArgument(format!("cannot spawn the worker thread: {e}")))?;
    let info = ready_rx
        .recv_timeout(timeout)
        .map_err(|_| FabricError::Timeout(format!("worker did not open its domains within {timeout:?}")))??;
    Ok(Spawned { commands: tx, leftovers, handle, info })
}

/// Makes `device`'s primary context current on this thread (see `EngineConfig::cuda_device`).
fn bind_device(device: Option<u32>) -> Result<Option<Arc<cuda_lib::Context>>> {
    let Some(device) = device else { return Ok(None) };
    let ctx = cuda_lib::Context::new(device as usize).map_err(|e| match e {
        cuda_lib::CudaError::InvalidArgument(m) => FabricError::InvalidArgument(format!("cuda_device: {m}")),
        other => other.into(),
    })?;
    ctx.bind()?;
    Ok(Some(ctx))
}

struct Worker {
    rx: Receiver<Command>,
    imm: Arc<ImmCounterTable>,
    callbacks: CallbackQueue,
    poll_mode: PollMode,
    transfer_timeout: Duration,

    regions: FxHashMap<u64, Region>,
    recv_callback: Option<RecvCallback>,
    undelivered: VecDeque<Vec<u8>>,
    /// Receive buffers (domain, slot, length) holding a message nobody took yet.
    held: VecDeque<(u16, usize, usize)>,
    /// Messages refused for being larger than `max_message_size` (a misconfigured peer).
    oversized_messages: Arc<AtomicU64>,
    max_message_size: usize,

    /// Live requests, by id (a slab: see `request_table`).
    requests: request_table::RequestTable<Request>,
    deadlines: deadlines::Deadlines,
    /// The maps below are touched for every operation: keyed by ids and pointers this engine
    /// made (or immediates it counts), they use a fast non-keyed hash.
    /// Posts the provider pushed back on, per domain and destination, each in order. Keyed by
    /// destination so a dead or slow peer (whose posts keep failing with EAGAIN) never holds up
    /// posts to other peers.
    pending: Vec<FxHashMap<u64, VecDeque<PendingPost>>>,
    /// Messages waiting for a free send buffer (request, peer, bytes, remote CQ data).
    waiting_sends: VecDeque<(u64, u64, Vec<u8>, Option<u64>)>,
    outstanding: FxHashSet<usize>,
    /// Receive contexts by address: (domain, slot). Completions are only ever matched against
    /// these and `outstanding`; an unknown pointer (e.g. the undefined op_context of a remote
    /// write completion) is never dereferenced.
    recv_contexts: FxHashMap<usize, (u16, usize)>,
    completions: Vec<Completion>,
    /// Contexts of completed posts, reused by the next ones (boxed: a posted context's address
    /// is the provider's, so contexts never move).
    #[allow(clippy::vec_box)]
    spare_contexts: Vec<Box<OpContext>>,
    /// Immediates counted in this round, by (epoch tag, immediate).
    imm_batch: FxHashMap<(u32, u32), u32>,
    /// `count_imm_batch`'s list of this round's arrivals, kept to save an allocation per round.
    imm_arrivals: Vec<(u32, u32)>,
    stats: Arc<[DomainCounters]>,
    /// Requests finished in this round, delivered by `flush_done`.
    done: Vec<(OnDone, Result<()>)>,
    /// Counters of requests that succeeded since the last `flush_counters`, in order.
    counted: Vec<Arc<CompletionCounter>>,
    /// The same-host channel, opened on the first same-host GPU write.
    same_host: Option<SameHostChannel>,
    same_host_done: Vec<SameHostDone>,
    paged_copy_blocks: u32,
    exited: Arc<CachePadded<AtomicBool>>,
    /// Whether writes ask for delivery completion (see `WriteCompletion`).
    delivery: bool,
    /// Peers (by their first domain's endpoint) that a request timed out on: nothing is sent
    /// to them until the application re-admits them.
    fenced: HashSet<Vec<u8>>,
    /// Remote CQ data has 8 bytes: writes carry epoch tags, re-admission is a handshake.
    wide_cq_data: bool,
    /// This engine's epoch tag towards peers never re-admitted.
    own_tag: u32,
    /// Tags towards re-admitted peers: by first endpoint, and per domain by fi_addr (posting).
    tags_by_peer: HashMap<Vec<u8>, u32>,
    tags_by_dest: Vec<FxHashMap<u64, u32>>,
    /// Re-admission handshakes waiting for the peer's answer, by nonce.
    readmits: HashMap<u64, PendingReadmit>,
    /// What this engine counted per writer epoch, and the epochs it retired.
    received: ReceivedEpochs,
    /// Staged transfers (GPU memory over providers without FI_HMEM).
    staged: staged::Staged,
    /// Requests armed to be posted when an immediate count is reached.
    triggers: triggers::Triggers,
    /// Same-host immediates: this engine's inbox and the peers' it pushes into.
    inboxes: inbox::Inboxes,
    /// Stage times for latency tests (off unless the application enabled it).
    probe: Arc<LatencyProbe>,
    /// The engine's peer table, and the peers requests named so far, by id.
    peers: Arc<PeerTable>,
    known: Vec<Option<KnownPeer>>,
    /// A busy worker yields the CPU after this many consecutive empty polls.
    yield_every: u32,
    /// The application's tasks polled every round (see `engine::tasks`), and the engine's id
    /// (a task's requests to this engine are handled inline).
    tasks: tasks::Tasks,
    engine_id: u64,

    // Last: every registration above holds its domain alive and is closed before it.
    domains: Vec<DomainState>,
    /// The primary context of `cuda_device`, or else of the GPU whose memory this engine
    /// registered first, current on this thread from then on (see `bind_cuda`); dropped after
    /// the domains, which may still make CUDA calls while they close.
    cuda: Option<Arc<cuda_lib::Context>>,
}

impl Worker {
    fn open(
        config: &EngineConfig,
        rx: Receiver<Command>,
        imm: Arc<ImmCounterTable>,
        callbacks: CallbackQueue,
        probe: Arc<LatencyProbe>,
        peers: Arc<PeerTable>,
        engine_id: u64,
    ) -> Result<Self> {
        let domains = config
            .provider
            .specs()
            .iter()
            .enumerate()
            .map(|(i, spec)| DomainState::open(i, spec, config))
            .collect::<Result<Vec<_>>>()?;
        let providers: HashSet<String> = domains.iter().map(|d| d.domain.provider_name()).collect();
        if providers.len() != 1 {
            return Err(FabricError::InvalidArgument(format!(
                "all domains of a device must use one provider, got {providers:?}"
            )));
        }
        let recv_contexts = domains
            .iter()
            .enumerate()
            .flat_map(|(d, state)| state.recv_context_addresses().map(move |(addr, slot)| (addr, (d as u16, slot))))
            .collect();
        Ok(Worker {
            recv_contexts,
            rx,
            imm,
            callbacks,
            poll_mode: config.poll_mode,
            transfer_timeout: config.transfer_timeout,
            regions: FxHashMap::default(),
            recv_callback: None,
            undelivered: VecDeque::new(),
            held: VecDeque::new(),
            oversized_messages: Arc::new(AtomicU64::new(0)),
            max_message_size: config.max_message_size,
            requests: request_table::RequestTable::default(),
            deadlines: deadlines::Deadlines::default(),
            pending: (0..domains.len()).map(|_| FxHashMap::default()).collect(),
            waiting_sends: VecDeque::new(),
            outstanding: FxHashSet::default(),
            completions: Vec::with_capacity(crate::provider::libfabric::CQ_BATCH),
            spare_contexts: Vec::new(),
            imm_batch: FxHashMap::default(),
            imm_arrivals: Vec::new(),
            done: Vec::new(),
            counted: Vec::new(),
            stats: (0..domains.len()).map(|_| DomainCounters::default()).collect(),
            same_host: None,
            same_host_done: Vec::new(),
            paged_copy_blocks: config.paged_copy_blocks,
            exited: Arc::new(CachePadded::new(AtomicBool::new(false))),
            delivery: config.write_completion.delivery_for(&domains[0].domain.provider_name()),
            fenced: HashSet::new(),
            wide_cq_data: domains.iter().all(|d| d.domain.wide_cq_data()),
            own_tag: crate::epoch::draw_tag(|_| false)?,
            tags_by_peer: HashMap::new(),
            tags_by_dest: (0..domains.len()).map(|_| FxHashMap::default()).collect(),
            readmits: HashMap::new(),
            received: ReceivedEpochs::default(),
            staged: staged::Staged::new(config)?,
            triggers: triggers::Triggers::default(),
            inboxes: inbox::Inboxes::open(config.same_host_inbox_slots),
            probe,
            peers,
            known: Vec::new(),
            yield_every: if crate::spin::spare_cores() { 64 } else { 1 },
            tasks: tasks::Tasks::default(),
            engine_id,
            domains,
            cuda: None,
        })
    }

    /// Serves commands and drives progress until told to stop (the caller shuts down).
    fn run(&mut self) {
        let mut last_active = Instant::now();
        let mut iterations: u32 = 0;
        let mut idle_polls: u32 = 0;
        loop {
            let mut active = false;
            for _ in 0..64 {
                match self.rx.try_recv() {
                    Ok(cmd) => {
                        active = true;
                        if !self.handle(cmd) {
                            return;
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
            active |= self.progress();
            if !self.tasks.is_empty() {
                // After progress: a task sees the arrivals of this round at once.
                active |= self.run_tasks();
                if self.tasks.stop {
                    return;
                }
            }
            iterations = iterations.wrapping_add(1);
            if iterations.is_multiple_of(256) || !active {
                self.expire_requests();
                self.expire_triggers();
            }
            if active {
                last_active = Instant::now();
                continue;
            }
            let busy = !self.outstanding.is_empty()
                || self.pending.iter().any(|p| p.values().any(|q| !q.is_empty()))
                || self.same_host.as_ref().is_some_and(|l| l.busy())
                || self.inboxes.busy()
                || self.staged.busy();
            match self.poll_mode {
                PollMode::Adaptive { spin, park } if !busy && last_active.elapsed() > spin => {
                    match self.rx.recv_timeout(park) {
                        Ok(cmd) => {
                            last_active = Instant::now();
                            if !self.handle(cmd) {
                                return;
                            }
                        }
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => return,
                    }
                }
                // Yield between empty polls where cores are oversubscribed, so the application
                // and callback threads run; with cores to spare only now and then: the system
                // call would otherwise add its time to the reaction to every arrival.
                _ => {
                    idle_polls = idle_polls.wrapping_add(1);
                    if idle_polls.is_multiple_of(self.yield_every) {
                        std::thread::yield_now();
                    }
                }
            }
        }
    }

    /// Handles one command; false means stop.
    fn handle(&mut self, cmd: Command) -> bool {
        if cmd.is_request() {
            self.probe.mark(Stage::Dequeued);
        }
        match cmd {
            Command::Register { region, ptr, len, kind, network, remote_read, gpu_registration, reply } => {
                let access = if remote_read { Access::RemoteReadWrite } else { Access::RemoteWrite };
                let mut nic = None;
                let mrs: Result<Vec<LocalMr>> = match (network, kind) {
                    (false, _) => Ok(Vec::new()),
                    (true, MemoryKind::Host) => {
                        self.domains.iter_mut().map(|d| d.domain.register(ptr as *mut u8, len, access)).collect()
                    }
                    (true, MemoryKind::Cuda(device)) => self.bind_cuda(device).and_then(|()| {
                        self.domains
                            .iter_mut()
                            .map(|d| {
                                let (mr, how) =
                                    d.domain.register_cuda(ptr as *mut u8, len, device, gpu_registration, access)?;
                                // Reported: the fallback where domains differ.
                                nic = nic.max(Some(how));
                                Ok(mr)
                            })
                            .collect()
                    }),
                };
                let result = mrs.map(|mrs| {
                    let keys = mrs.iter().map(|m| (m.key(), m.remote_base())).collect();
                    self.regions.insert(region, Region { mrs, ptr, len, kind, in_flight: 0 });
                    (keys, nic)
                });
                let _ = reply.send(result);
            }
            Command::Unregister { region, reply } => {
                let result = match self.regions.get(&region) {
                    None => Err(FabricError::InvalidArgument(format!("memory handle {region} is not registered"))),
                    Some(r) if r.in_flight > 0 => Err(FabricError::InvalidArgument(format!(
                        "memory handle {region} has {} operations in flight; wait for them first",
                        r.in_flight
                    ))),
                    Some(_) => {
                        self.regions.remove(&region);
                        Ok(())
                    }
                };
                let _ = reply.send(result);
            }
            Command::Transfer(t) => self.start_transfer(t),
            Command::Read(t) => self.start_read(t),
            Command::SameHostRead(t) => self.start_same_host_read(*t),
            Command::SameHost(t) => self.start_same_host(*t),
            Command::Staged(t) => self.start_staged(t),
            Command::Landing { device, reply } => {
                let _ = reply.send(self.open_landing(device));
            }
            Command::Send(cmd) => self.start_send(cmd),
            Command::Arm(armed) => self.arm(armed),
            Command::SetRecvCallback(cb) => {
                self.recv_callback = cb;
                if let Some(cb) = self.recv_callback.clone() {
                    for msg in self.undelivered.drain(..) {
                        let cb = cb.clone();
                        self.callbacks.push(Box::new(move || cb(msg)));
                    }
                    while let Some((domain, slot, len)) = self.held.pop_front() {
                        self.take_message(domain, slot, len);
                    }
                }
            }
            Command::Readmit { peer, max_message_size, reply } => self.start_readmit(peer, max_message_size, reply),
            Command::AttachTask { id, task } => self.attach_task(id, task),
            Command::DetachTask { id, reply } => self.detach_task(id, reply),
            Command::Stop => return false,
        }
        true
    }

    /// Makes `device`'s primary context current on this thread before its memory reaches the
    /// provider, unless one is bound already (`cuda_device`, or an earlier registration). A
    /// provider's own CUDA calls (shm's device copies and CUDA IPC opens, through the CUDA
    /// runtime) run in the calling thread's current context, and a thread without one gets
    /// device 0's: an engine serving another GPU would then copy on device 0, time-sliced with
    /// that GPU's work, and outside the stream its application waits for. Memory of other GPUs
    /// still works, through peer access.
    fn bind_cuda(&mut self, device: u32) -> Result<()> {
        match &self.cuda {
            None => self.cuda = bind_device(Some(device))?,
            Some(ctx) if ctx.device().ordinal() != device as usize => tracing::debug!(
                "GPU {device} memory registered on an engine bound to GPU {}: the provider's device copies run there",
                ctx.device().ordinal()
            ),
            Some(_) => {}
        }
        Ok(())
    }

    fn new_request(&mut self, on_done: Notify, parts: usize) -> u64 {
        let request = Request {
            remaining: parts,
            error: None,
            on_done,
            deferred: Vec::new(),
            peers: TargetList::default(),
            inbox_imm: None,
        };
        let id = self.requests.insert(request);
        self.deadlines.push(deadline_after(self.transfer_timeout), id);
        id
    }

    /// The error for a request to a fenced peer, if one of `peers` is.
    fn fence_error<'a>(&self, mut peers: impl Iterator<Item = &'a Target>) -> Option<FabricError> {
        if self.fenced.is_empty() {
            return None; // the common case: no address to hash
        }
        let fenced = peers.any(|p| {
            self.peers.endpoints(p.peer).is_some_and(|e| e.first().is_some_and(|first| self.fenced.contains(first)))
        });
        fenced.then(|| {
            FabricError::PeerFenced(
                "an earlier request to this peer timed out; call readmit_peer(address) once the application \
                 knows what the peer received"
                    .into(),
            )
        })
    }

    /// Keeps a request's peers, to fence them if it times out.
    fn keep_peers(&mut self, request: u64, peers: TargetList) {
        if let Some(req) = self.requests.get_mut(request) {
            req.peers = peers;
        }
    }

    /// Fences a peer after a timeout: no more posts to it, and posts still queued for it fail.
    fn fence(&mut self, peer: &[Vec<u8>]) {
        let Some(first) = peer.first() else { return };
        if !self.fenced.insert(first.clone()) {
            return;
        }
        tracing::warn!("fencing a peer after a request to it timed out; readmit_peer() lifts it");
        for (domain, endpoint) in peer.iter().enumerate().take(self.domains.len()) {
            let Some(dest) = self.domains[domain].domain.known_peer(endpoint) else { continue };
            let stuck: Vec<PendingPost> = self.pending[domain].remove(&dest).map(Vec::from).unwrap_or_default();
            for post in stuck {
                let e = FabricError::PeerFenced("the peer was fenced after a timeout".into());
                self.fail_post(post, e);
            }
        }
    }

    /// The endpoint names of peer `id` (looked up in the engine's table the first time).
    fn peer_endpoints(&mut self, id: u32) -> Result<Endpoints> {
        if let Some(Some(known)) = self.known.get(id as usize) {
            return Ok(known.endpoints.clone());
        }
        let endpoints = self
            .peers
            .endpoints(id)
            .ok_or_else(|| FabricError::InvalidArgument(format!("no peer with id {id} was interned")))?;
        if endpoints.len() != self.domains.len() {
            return Err(FabricError::InvalidDescriptor(format!(
                "the peer has {} endpoints, this engine {} domains",
                endpoints.len(),
                self.domains.len()
            )));
        }
        if self.known.len() <= id as usize {
            self.known.resize_with(id as usize + 1, || None);
        }
        let dests = smallvec::smallvec![None; endpoints.len()];
        self.known[id as usize] = Some(KnownPeer { endpoints: endpoints.clone(), dests });
        Ok(endpoints)
    }

    /// The fi_addr of peer `id` on `domain` (inserted into the address vector the first time).
    fn peer_dest(&mut self, id: u32, domain: u16) -> Result<u64> {
        if let Some(Some(known)) = self.known.get(id as usize) {
            if let Some(Some(dest)) = known.dests.get(domain as usize) {
                return Ok(*dest);
            }
        }
        let endpoints = self.peer_endpoints(id)?;
        let d = domain as usize;
        let dest = self.domains[d].domain.resolve_peer(&endpoints[d])?;
        if let Some(Some(known)) = self.known.get_mut(id as usize) {
            known.dests[d] = Some(dest);
        }
        Ok(dest)
    }

    fn start_transfer(&mut self, t: Transfer) {
        let Transfer { region, targets, shards, deferred, on_done } = t;
        let id = self.new_request(on_done, shards.len().max(1));
        if let Some(e) = self.fence_error(targets.iter()) {
            return self.fail_request(id, e);
        }
        let base = if region == SCRATCH_REGION {
            None
        } else {
            match self.regions.get(&region) {
                Some(r) => Some(r.ptr),
                None => {
                    let e = FabricError::InvalidArgument(format!("memory handle {region} was unregistered"));
                    return self.fail_request(id, e);
                }
            }
        };
        let mut resolved = Vec::with_capacity(deferred.len());
        for d in &deferred {
            let target = &targets[d.peer as usize];
            let (key, remote_base) = target.keys[d.domain as usize];
            match self.peer_dest(target.peer, d.domain) {
                Ok(dest) => resolved.push((*d, dest, key, remote_base)),
                Err(e) => return self.fail_request(id, e),
            }
        }
        let delivery = self.delivery || !resolved.is_empty();
        self.requests.get_mut(id).expect("just inserted").deferred = resolved;
        if shards.is_empty() {
            // Immediate-only request (barrier, or no data): the deferred imms are the request.
            self.keep_peers(id, targets);
            return self.finish(id, Ok(()));
        }
        for s in shards {
            let target = &targets[s.peer as usize];
            let (key, remote_base) = target.keys[s.domain as usize];
            let dest = match self.peer_dest(target.peer, s.domain) {
                Ok(d) => d,
                Err(e) => return self.fail_request(id, e),
            };
            let domain = s.domain as usize;
            let ptr = match base {
                Some(b) => b + s.src_offset as usize,
                None => self.domains[domain].scratch.slot_ptr(0) as usize,
            };
            let op = Op::Write {
                region,
                ptr,
                len: s.len as usize,
                dest,
                remote_addr: remote_base + s.dst_offset,
                key,
                imm: s.imm,
                delivery,
            };
            self.post_or_queue(domain, PendingPost { request: id, op });
        }
        self.keep_peers(id, targets);
    }

    fn start_same_host(&mut self, t: SameHostTransfer) {
        let SameHostTransfer { region, write, imm, on_done } = t;
        let id = self.new_request(on_done, 1);
        if let Some(imm) = imm {
            if let Some(e) = self.fence_error(std::iter::once(&imm.target)) {
                return self.fail_request(id, e);
            }
            if let Err(e) = self.plan_same_host_imm(id, imm) {
                return self.fail_request(id, e);
            }
        }
        let Some((dst, copy)) = write else { return self.finish(id, Ok(())) };
        let (ptr, kind) = match self.regions.get(&region) {
            Some(r) => (r.ptr as u64, r.kind),
            None => {
                let e = FabricError::InvalidArgument(format!("memory handle {region} was unregistered"));
                return self.fail_request(id, e);
            }
        };
        if kind == MemoryKind::Host && dst.kind == MemoryKind::Host {
            let result = copy_host_to_host(ptr, &dst, &copy);
            return self.finish(id, result);
        }
        if self.same_host.is_none() {
            match SameHostChannel::new(self.paged_copy_blocks) {
                Ok(l) => self.same_host = Some(l),
                Err(e) => return self.fail_request(id, e),
            }
        }
        let local = self.same_host.as_mut().expect("opened above");
        match local.submit(id, region, SameHostSrc { kind, ptr }, dst, copy) {
            Ok(()) => self.track_region(region, 1),
            Err(e) => self.fail_request(id, e),
        }
    }

    fn start_send(&mut self, cmd: SendCommand) {
        let SendCommand { peer, data, on_done } = cmd;
        let id = self.new_request(on_done, 1);
        let target = Target { peer, keys: smallvec::SmallVec::new() };
        if let Some(e) = self.fence_error(std::iter::once(&target)) {
            return self.finish(id, Err(e));
        }
        match self.peer_dest(peer, 0) {
            Ok(dest) => {
                self.keep_peers(id, TargetList::Own(smallvec::smallvec![target]));
                self.queue_send(id, dest, data, None)
            }
            Err(e) => self.finish(id, Err(e)),
        }
    }

    /// Copies a message into a free send buffer (of domain 0) and posts it, or waits for one.
    fn queue_send(&mut self, request: u64, dest: u64, data: Vec<u8>, cq_data: Option<u64>) {
        let d = &mut self.domains[0];
        match d.free_send_slots.pop() {
            Some(slot) => {
                d.send_buffers.fill(slot, &data);
                let op = Op::Send { slot, len: data.len(), dest, data: cq_data };
                self.post_or_queue(0, PendingPost { request, op });
            }
            None => self.waiting_sends.push_back((request, dest, data, cq_data)),
        }
    }

    /// Adjusts the count of operations that use a region, queued, posted or copying
    /// (unregister refuses while it is not zero: the provider or CUDA may still read the
    /// memory). Library buffers (SCRATCH_REGION) are not in `regions` and are not counted.
    fn track_region(&mut self, region: u64, delta: isize) {
        if let Some(r) = self.regions.get_mut(&region) {
            r.in_flight = r.in_flight.saturating_add_signed(delta);
        }
    }

    /// [`Worker::track_region`] for the region a post reads from or reads into (sends use
    /// library buffers).
    fn track(&mut self, op: &Op, delta: isize) {
        if let Op::Write { region, .. } | Op::Read { region, .. } = *op {
            self.track_region(region, delta);
        }
    }

    fn post_or_queue(&mut self, domain: usize, post: PendingPost) {
        self.track(&post.op, 1);
        let dest = post.op.dest();
        if let Some(queue) = self.pending[domain].get_mut(&dest).filter(|q| !q.is_empty()) {
            queue.push_back(post);
            return;
        }
        match self.try_post(domain, &post) {
            Ok(true) => {}
            Ok(false) => self.pending[domain].entry(dest).or_default().push_back(post),
            Err(e) => self.fail_post(post, e),
        }
    }

    /// Drops a queued or refused post (releasing what it holds) and fails its request.
    fn fail_post(&mut self, post: PendingPost, e: FabricError) {
        self.discard_post(&post);
        self.finish(post.request, Err(e));
    }

    /// Releases what a post that will never run holds: its send slot and its region use.
    fn discard_post(&mut self, post: &PendingPost) {
        self.track(&post.op, -1);
        if let Op::Send { slot, .. } = post.op {
            self.release_send_slot(slot);
        }
    }

    /// Removes the queued posts of a request that already failed or timed out.
    fn purge_pending(&mut self, request: u64) {
        let mut dropped = Vec::new();
        for queues in &mut self.pending {
            for queue in queues.values_mut() {
                queue.retain(|p| {
                    let keep = p.request != request;
                    if !keep {
                        dropped.push(PendingPost { request: p.request, op: p.op });
                    }
                    keep
                });
            }
            queues.retain(|_, q| !q.is_empty());
        }
        for post in &dropped {
            self.discard_post(post);
        }
    }

    /// Posts one operation on `domain`; Ok(false) when the provider asks us to retry later.
    fn try_post(&mut self, domain: usize, post: &PendingPost) -> Result<bool> {
        let kind = match post.op {
            Op::Write { region, .. } => OpKind::Write { request: post.request, region },
            Op::Send { slot, .. } => OpKind::Send { request: post.request, slot, domain: domain as u16 },
            Op::Read { region, .. } => OpKind::Read { request: post.request, region },
        };
        let context = Box::into_raw(self.new_context(kind));
        let imm_data = match post.op {
            Op::Write { imm: Some(imm), dest, .. } => Some(self.cq_data(domain, dest, imm)),
            _ => None,
        };
        let d = &mut self.domains[domain];
        // SAFETY: the source memory is registered (regions keep their MRs until no operation is
        // in flight; library buffers live as long as the worker) and `context` stays allocated
        // until its completion is read or the worker shuts down.
        let posted = unsafe {
            match post.op {
                Op::Write { region, ptr, len, dest, remote_addr, key, delivery, .. } => {
                    let desc = if region == SCRATCH_REGION {
                        d.scratch.desc()
                    } else {
                        match self.regions.get(&region).and_then(|r| r.mrs.get(domain)) {
                            Some(mr) => mr.desc(),
                            None => {
                                // Cannot happen (a region with queued posts cannot be
                                // unregistered), but must not take the worker down if it does.
                                self.recycle_context(Box::from_raw(context));
                                let e = format!("memory handle {region} is no longer registered");
                                return Err(FabricError::InvalidArgument(e));
                            }
                        }
                    };
                    d.domain.post_write(
                        ptr as *const u8,
                        len,
                        desc,
                        dest,
                        remote_addr,
                        key,
                        imm_data,
                        delivery,
                        context,
                    )
                }
                Op::Send { slot, len, dest, data } => {
                    let ptr = d.send_buffers.slot_ptr(slot);
                    let desc = d.send_buffers.desc();
                    d.domain.post_send(ptr, len, desc, dest, self.delivery, data, context)
                }
                Op::Read { region, ptr, len, dest, remote_addr, key } => {
                    match self.regions.get(&region).and_then(|r| r.mrs.get(domain)) {
                        Some(mr) => d.domain.post_read(ptr as *mut u8, len, mr.desc(), dest, remote_addr, key, context),
                        None => {
                            // As for writes: a region with queued posts cannot be unregistered.
                            self.recycle_context(Box::from_raw(context));
                            let e = format!("memory handle {region} is no longer registered");
                            return Err(FabricError::InvalidArgument(e));
                        }
                    }
                }
            }
        };
        match posted {
            Ok(Posted::Ok) => {
                self.probe.mark_first_post();
                self.stats[domain].record(post.op.len());
                self.outstanding.insert(context as usize);
                Ok(true)
            }
            other => {
                // SAFETY: the provider did not take the context; we still own it.
                self.recycle_context(unsafe { Box::from_raw(context) });
                other.map(|_| false)
            }
        }
    }

    /// Posts what is queued for `dest` on `domain`, in order, until the provider pushes back.
    fn retry_pending(&mut self, domain: usize, dest: u64) -> bool {
        let mut active = false;
        loop {
            let Some(post) = self.pending[domain].get_mut(&dest).and_then(|q| q.pop_front()) else {
                self.pending[domain].remove(&dest);
                return active;
            };
            if !self.requests.contains(post.request) {
                self.discard_post(&post);
                continue; // failed or timed out meanwhile
            }
            match self.try_post(domain, &post) {
                Ok(true) => active = true,
                Ok(false) => {
                    self.pending[domain].entry(dest).or_default().push_front(post);
                    return active;
                }
                Err(e) => self.fail_post(post, e),
            }
        }
    }

    /// Retries queued posts and drains the completion queues; true if anything happened.
    fn progress(&mut self) -> bool {
        let mut active = false;
        for domain in 0..self.domains.len() {
            if !self.pending[domain].is_empty() {
                let dests: Vec<u64> = self.pending[domain].keys().copied().collect();
                for dest in dests {
                    active |= self.retry_pending(domain, dest);
                }
            }
            if !self.domains[domain].recv_to_post.is_empty() {
                if let Err(e) = self.domains[domain].post_receives() {
                    tracing::error!("re-posting receive buffers failed: {e}");
                }
            }
            let mut completions = std::mem::take(&mut self.completions);
            for _ in 0..4 {
                completions.clear();
                match self.domains[domain].domain.poll(&mut completions) {
                    Ok(0) => break,
                    Ok(n) => {
                        active = true;
                        for c in completions.drain(..) {
                            self.on_completion(c);
                        }
                        if n < crate::provider::libfabric::CQ_BATCH {
                            // Drained: count and hand over what arrived now rather than pay
                            // another progress call (a system call on tcp) first.
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::error!("polling the completion queue failed: {e}");
                        break;
                    }
                }
            }
            self.completions = completions;
            if !self.imm_batch.is_empty() {
                // Count (and fire the triggers of) what this queue carried before polling
                // anything else: an armed echo's pong leaves with no other work in between.
                self.count_imm_batch();
            }
            if !self.counted.is_empty() {
                self.flush_counters();
            }
        }
        if let Some(local) = self.same_host.as_mut() {
            let mut done = std::mem::take(&mut self.same_host_done);
            if local.poll(&mut done) {
                active = true;
                for (request, region, result) in done.drain(..) {
                    self.track_region(region, -1);
                    self.finish(request, result);
                }
            }
            self.same_host_done = done;
        }
        active |= self.poll_inboxes();
        active |= self.progress_staged();
        if !self.imm_batch.is_empty() {
            self.count_imm_batch();
        }
        self.flush_done();
        active
    }

    /// Reports a request's outcome: counters are bumped here, callbacks wait for `flush_done`.
    fn notify(&mut self, on_done: Notify, result: Result<()>) {
        self.probe.mark(Stage::Completed);
        match on_done {
            Notify::Counter(counter) if result.is_ok() => self.counted.push(counter),
            Notify::Counter(counter) => counter.complete(result),
            Notify::Callback(cb) => self.done.push((cb, result)),
        }
    }

    /// Raises the counters of the requests that succeeded since the last call: once per run of
    /// requests on one counter, not once per request (the counter's line, which its caller
    /// reads, then moves to this core once per completion batch).
    fn flush_counters(&mut self) {
        for run in self.counted.chunk_by(Arc::ptr_eq) {
            run[0].complete_many(run.len() as u64);
        }
        self.counted.clear();
    }

    /// Hands the completions gathered in this round to the callback thread as one job (one
    /// channel send and at most one wake-up per round, not per request).
    fn flush_done(&mut self) {
        if !self.counted.is_empty() {
            self.flush_counters();
        }
        match self.done.len() {
            0 => {}
            1 => {
                let (on_done, result) = self.done.pop().expect("one");
                if self.probe.enabled() {
                    let probe = self.probe.clone();
                    self.callbacks.push(Box::new(move || {
                        probe.mark(Stage::CallbackRun);
                        on_done(result)
                    }));
                } else {
                    self.callbacks.push(Box::new(move || on_done(result)));
                }
            }
            _ => {
                let done = std::mem::take(&mut self.done);
                let probe = self.probe.enabled().then(|| self.probe.clone());
                self.callbacks.push(Box::new(move || {
                    if let Some(probe) = probe {
                        probe.mark(Stage::CallbackRun);
                    }
                    for (on_done, result) in done {
                        // One panicking callback must not swallow the others of the batch.
                        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| on_done(result))).is_err() {
                            tracing::error!("a fabric-lib completion callback panicked");
                        }
                    }
                }));
            }
        }
    }

    fn on_completion(&mut self, completion: Completion) {
        match completion {
            Completion::Done { context, len } => match self.take_context(context) {
                Some(OpKind::Recv { slot, domain }) => self.on_message(domain, slot, len),
                Some(kind) => self.finish_op(kind, Ok(())),
                None => tracing::warn!("completion with an unknown context"),
            },
            Completion::RemoteImm { data, context, len } => {
                self.probe.mark(Stage::ImmSeen);
                if let Some(OpKind::Recv { slot, domain }) = self.take_context(context) {
                    if !self.domains[domain as usize].domain.imm_consumes_recv() {
                        // A receive only completes with CQ data for a message sent with it.
                        return self.on_control(domain, slot, len, data);
                    }
                    self.domains[domain as usize].recv_to_post.push(slot); // FI_RX_CQ_DATA
                }
                self.on_remote_imm(data);
            }
            Completion::Failed { context, message } => match self.take_context(context) {
                Some(OpKind::Recv { slot, domain }) => {
                    // A message the provider could not place (too long for the buffer, say).
                    self.oversized_messages.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("a message could not be received: {message}");
                    self.domains[domain as usize].recv_to_post.push(slot);
                }
                Some(kind) => self.finish_op(kind, Err(FabricError::TransferFailed(message))),
                None => tracing::warn!("completion error with an unknown context: {message}"),
            },
        }
    }

    /// Identifies a completed context: a request context (freed here) or a receive context
    /// (reused). Anything else is not ours and is ignored.
    fn take_context(&mut self, context: *mut OpContext) -> Option<OpKind> {
        let addr = context as usize;
        if self.outstanding.remove(&addr) {
            // SAFETY: `outstanding` holds exactly the request contexts we leaked with
            // Box::into_raw and have not freed; removing it first makes this the only free.
            let boxed = unsafe { Box::from_raw(context) };
            let kind = boxed.kind;
            self.recycle_context(boxed);
            return Some(kind);
        }
        self.recv_contexts.get(&addr).map(|&(domain, slot)| OpKind::Recv { slot, domain })
    }

    /// A context for a post: a recycled one if there is one (no allocation per operation).
    fn new_context(&mut self, kind: OpKind) -> Box<OpContext> {
        match self.spare_contexts.pop() {
            Some(spare) => spare.reuse(kind),
            None => OpContext::new(kind),
        }
    }

    /// Keeps a context the provider no longer references (its completion was read, or the post
    /// did not take it) for the next post.
    fn recycle_context(&mut self, context: Box<OpContext>) {
        if self.spare_contexts.len() < SPARE_CONTEXTS {
            self.spare_contexts.push(context);
        }
    }

    fn finish_op(&mut self, kind: OpKind, result: Result<()>) {
        match kind {
            OpKind::Write { request, region } | OpKind::Read { request, region } => {
                self.track_region(region, -1);
                self.finish(request, result);
            }
            OpKind::Send { request, slot, .. } => {
                self.release_send_slot(slot);
                self.finish(request, result);
            }
            OpKind::Recv { .. } => unreachable!("receives are handled by the caller"),
        }
    }

    fn fail_request(&mut self, request: u64, e: FabricError) {
        self.purge_pending(request);
        if let Some(req) = self.requests.get_mut(request) {
            req.deferred.clear();
            req.inbox_imm = None;
            req.remaining = 1;
        }
        self.finish(request, Err(e));
    }

    /// Records one finished part of a request. When all data parts are done, posts the deferred
    /// immediates (on success) as the request's last parts; then completes the request.
    fn finish(&mut self, request: u64, result: Result<()>) {
        let Some(req) = self.requests.get_mut(request) else { return };
        if let Err(e) = result {
            req.error.get_or_insert(e);
        }
        req.remaining -= 1;
        if req.remaining > 0 {
            return;
        }
        if let Some(push) = req.inbox_imm.take().filter(|_| req.error.is_none()) {
            req.remaining = 1;
            return self.push_inbox(request, push);
        }
        if req.error.is_none() && !req.deferred.is_empty() {
            let deferred = std::mem::take(&mut req.deferred);
            req.remaining = deferred.len();
            for (d, dest, key, remote_base) in deferred {
                let domain = d.domain as usize;
                let ptr = self.domains[domain].scratch.slot_ptr(0) as usize;
                let op = Op::Write {
                    region: SCRATCH_REGION,
                    ptr,
                    len: 0,
                    dest,
                    remote_addr: remote_base,
                    key,
                    imm: Some(d.imm),
                    delivery: self.delivery,
                };
                self.post_or_queue(domain, PendingPost { request, op });
            }
            return;
        }
        let req = self.requests.remove(request).expect("present");
        let result = req.error.map_or(Ok(()), Err);
        self.notify(req.on_done, result);
    }

    /// A message landed in a receive buffer. Buffers are one byte larger than the largest
    /// message, so a longer (truncated) one is recognised and refused, never delivered cut.
    fn on_message(&mut self, domain: u16, slot: usize, len: usize) {
        if len > self.max_message_size {
            self.oversized_messages.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "refused a message of at least {len} bytes: larger than max_message_size ({}); \
                 the sender ignored this engine's limit",
                self.max_message_size
            );
            self.domains[domain as usize].recv_to_post.push(slot);
            return;
        }
        if self.recv_callback.is_none() && self.undelivered.len() >= UNDELIVERED_LIMIT {
            self.held.push_back((domain, slot, len));
            return;
        }
        self.take_message(domain, slot, len);
    }

    /// Copies a message out of its buffer, re-posts the buffer and delivers (or keeps) it.
    fn take_message(&mut self, domain: u16, slot: usize, len: usize) {
        let d = &mut self.domains[domain as usize];
        let msg = d.recv_buffers.slot_bytes(slot, len).to_vec();
        d.recv_to_post.push(slot);
        match &self.recv_callback {
            Some(cb) => {
                let cb = cb.clone();
                self.callbacks.push(Box::new(move || cb(msg)));
            }
            None => self.undelivered.push_back(msg),
        }
    }

    fn release_send_slot(&mut self, slot: usize) {
        self.domains[0].free_send_slots.push(slot);
        while let Some((request, dest, data, cq_data)) = self.waiting_sends.pop_front() {
            if self.requests.contains(request) {
                self.queue_send(request, dest, data, cq_data);
                break;
            }
        }
    }

    /// Fails requests older than the transfer timeout (a peer that stopped answering).
    fn expire_requests(&mut self) {
        let now = Instant::now();
        self.expire_readmits(now);
        while let Some(id) = self.deadlines.next_expired(now, |id| self.requests.contains(id)) {
            let req = self.requests.remove(id).expect("live");
            self.purge_pending(id);
            for peer in req.peers.iter() {
                if let Some(endpoints) = self.peers.endpoints(peer.peer) {
                    self.fence(&endpoints);
                }
            }
            let timeout = self.transfer_timeout;
            let e = FabricError::Timeout(format!("request not completed within {timeout:?} (peer unreachable?)"));
            self.notify(req.on_done, Err(e));
        }
        let requests = &self.requests;
        self.deadlines.sweep(requests.len(), |id| requests.contains(id));
    }

    /// Fails everything still in flight, closes the domains and frees leftover contexts.
    fn shutdown(mut self) {
        self.exited.store(true, Ordering::Release);
        self.imm.close(); // wakes every waiter with Stopped
        let requests: Vec<Request> = self.requests.drain();
        for req in requests {
            self.notify(req.on_done, Err(FabricError::Stopped));
        }
        self.fail_triggers();
        self.waiting_sends.clear();
        for (_, readmit) in self.readmits.drain() {
            let _ = readmit.reply.send(Err(FabricError::Stopped));
        }
        while let Ok(cmd) = self.rx.try_recv() {
            if let Some(on_done) = cmd.into_stopped() {
                self.notify(on_done, Err(FabricError::Stopped));
            }
        }
        self.flush_done();
        let outstanding: Vec<usize> = self.outstanding.drain().collect();
        drop(self.same_host.take()); // waits for same-host copies still running
        self.staged.settle(); // staging copies too
        drop(self); // closes every registration, then the endpoints and domains
        for context in outstanding {
            // SAFETY: the endpoints are closed, so the provider no longer references these
            // contexts; each came from Box::into_raw and was never freed.
            drop(unsafe { Box::from_raw(context as *mut OpContext) });
        }
    }
}
