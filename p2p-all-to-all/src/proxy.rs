//! The CPU proxy: one thread per rank that carries the all-to-all's traffic to remote ranks
//! (other NVLink domains) through this rank's [`TransferEngine`], following the kernels'
//! sequence numbers in the proxy block (not the host's calls, so CUDA graph replays work).
//! By default that thread is the engine's worker ([`ProxyRunner::EngineWorker`]): the proxy
//! polls between the worker's rounds and the thread that sees a kernel's signal posts its
//! writes itself, with no hand-off to another thread.
//!
//! Dispatch call `n` (parity `p`):
//! 1. The send kernel publishes its counts and raises `dseq = n` before it copies any token: the
//!    proxy sends the count message to every other rank at once (they travel while tokens are
//!    copied).
//! 2. When the kernel raised `ddone = n` (records packed per destination), it writes each remote
//!    rank's first `private_tokens` records into that rank's private area for this source; the
//!    records beyond go in a second write into the receiver's overflow area, at an offset known
//!    once the counts of the sources before this one arrived. At most 2 data writes per remote
//!    rank (each sharded over the engine's domains).
//! 3. Arrivals are learnt only from immediate counts (no ordering is assumed): once every rank's
//!    count message is in, each remote source's expected data writes are known; when they all
//!    arrived, the proxy raises `rflag[p][s]`, which the receive kernel waits on. Once every
//!    count message is in it raises `rcf[p][s]` first: the kernel computes its rows' offsets
//!    (and expands NVLink sources' tokens) while remote records are still in flight.
//!
//! Combine call `cn`: when the combine send kernel raised `cdone`, one write per remote rank, all
//! in one scatter (or only an immediate where there are no rows: every rank always hears from
//! every remote rank, which is what makes the doubled buffers safe to reuse); each arrival raises
//! `crflag[d]`.
//!
//! The proxy never blocks on a peer: a dead peer leaves flags down and the kernels' waits time
//! out. Failed writes are recorded in the block's `error` word and [`Proxy::error`].
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fabric_lib::{
    CompletionCounter, DomainChoice, MrDescriptor, MrHandle, PreparedScatter, ScatterSharding, ScatterSlice, TaskId,
    TransferEngine, WorkerTask, WriteRequest,
};
use parking_lot::Mutex;

use crate::proxy_block::BlockLayout;
use crate::remote::{decode_counts, encode_counts, imm, overflow_offset, Counts, ImmKind, RemoteLayout, Topology};

/// Where one rank's regions are, as its peers need them.
#[derive(Debug, Clone)]
pub struct PeerRegions {
    /// The proxy block (count messages land in `msg_in`).
    pub block: MrDescriptor,
    /// Dispatch receive buffer.
    pub drecv: MrDescriptor,
    /// Combine receive buffer.
    pub crecv: MrDescriptor,
}

/// This rank's registered regions.
#[derive(Debug, Clone, Copy)]
pub struct LocalRegions {
    /// Host address of the proxy block (the proxy reads and writes it directly).
    pub block_ptr: *mut u8,
    pub block: MrHandle,
    pub dsend: MrHandle,
    pub csend: MrHandle,
}

// SAFETY: the block is host memory that stays allocated while the proxy runs (the owner stops
// the proxy before freeing it); every access goes through atomics.
unsafe impl Send for LocalRegions {}

/// Tells when bytes whose immediates were counted are in place (see
/// [`ProxyConfig::placement_fence`]), without blocking: the proxy may run on the engine's
/// worker, which must not wait.
pub trait PlacementFence: Send + Sync {
    /// Marks the work queued until now; returns the mark's ticket.
    fn mark(&self) -> Result<u64, String>;
    /// Whether the work before mark `ticket` completed.
    fn passed(&self, ticket: u64) -> Result<bool, String>;
}

/// Which thread runs the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyRunner {
    /// The engine's worker, once per round of its loop (`TransferEngine::attach_task`): writes
    /// are posted by the thread that saw the kernel's signal, before it polls anything else.
    /// The worker's `EngineConfig::worker_cpu` pins it, its `poll_mode` decides how it idles.
    EngineWorker,
    /// A thread of its own, pinned to `cpu`, that hands each post to the worker through the
    /// engine's command queue; after `idle_spin` without work it sleeps 20 µs between polls.
    OwnThread { cpu: Option<usize>, idle_spin: Duration },
}

/// What the proxy is for.
#[derive(Clone)]
pub struct ProxyConfig {
    pub rank: usize,
    pub topo: Topology,
    pub layout: RemoteLayout,
    pub runner: ProxyRunner,
    /// Post the private writes of a dispatch, and a combine's writes, as one scatter (one
    /// request for every remote rank) rather than one write each.
    pub scatter_data: bool,
    /// Where a counted immediate does not yet mean the bytes are in place (`shm` with FI_HMEM
    /// counts it while the device copy is still queued on the receiver's legacy default
    /// stream): a receive flag then goes up once the work queued before its arrivals were
    /// taken completed. None elsewhere (RDMA NICs place the bytes first).
    pub placement_fence: Option<Arc<dyn PlacementFence>>,
    /// A scatter to more targets than this hands its first `eager_targets` to the engine as a
    /// request of their own, then the rest: the first writes leave while the others are
    /// planned. 0: every scatter is one request.
    pub eager_targets: usize,
}

impl std::fmt::Debug for ProxyConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyConfig")
            .field("rank", &self.rank)
            .field("topo", &self.topo)
            .field("layout", &self.layout)
            .field("runner", &self.runner)
            .field("scatter_data", &self.scatter_data)
            .field("placement_fence", &self.placement_fence.is_some())
            .field("eager_targets", &self.eager_targets)
            .finish()
    }
}

/// One dispatch's costs as the proxy saw them (nanoseconds).
#[derive(Debug, Clone, Copy, Default)]
pub struct DispatchSample {
    /// Counts seen (`dseq`) → every count message posted.
    pub counts_post_ns: u64,
    /// Counts seen → first count message posted.
    pub counts_signal_to_first_write_ns: u64,
    /// Records packed (`ddone`) → first data write posted.
    pub signal_to_first_write_ns: u64,
    /// Time spent posting the private writes, per remote rank.
    pub post_per_peer_ns: u64,
    /// Data writes posted.
    pub data_writes: u32,
    /// Count messages posted.
    pub count_writes: u32,
    /// Remote ranks.
    pub remote_peers: u32,
    /// Counts seen → every remote source's records arrived (flags raised).
    pub total_ns: u64,
    /// The call that handed the first count message to the engine (to time from the kernel's
    /// signal).
    pub counts_first_write: Option<FirstWrite>,
    /// The call that handed the first data write to the engine.
    pub data_first_write: Option<FirstWrite>,
}

/// One combine's costs as the proxy saw them (nanoseconds).
#[derive(Debug, Clone, Copy, Default)]
pub struct CombineSample {
    /// Rows packed (`cdone`) → first write posted.
    pub signal_to_first_write_ns: u64,
    /// Time spent posting, per remote rank.
    pub post_per_peer_ns: u64,
    /// Writes posted (one per remote rank).
    pub writes: u32,
    pub remote_peers: u32,
    /// The call that handed the first write to the engine (to time from the kernel's signal).
    pub first_write: Option<FirstWrite>,
}

/// The all-to-all's `ProxyConfig::eager_targets`: the first target alone. On a 16-core host
/// (shm, rank 0 on CPUs of its own) it took world 8's signal → first write posted from
/// 3.0–3.7 to 2.2–3.0 µs and world 64's from 12–14 to 11–13 µs (dispatch data 95 to 12–17 µs),
/// for 0.01–0.04 µs more posting per remote rank (`proxy_costs --eager 0,1`).
pub const EAGER_TARGETS: usize = 1;

/// Samples kept (the most recent calls).
const MAX_SAMPLES: usize = 1 << 14;

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    /// `error` holds something (read every pass, without the lock).
    failed: AtomicBool,
    error: Mutex<Option<String>>,
    dispatch: Mutex<Vec<DispatchSample>>,
    combine: Mutex<Vec<CombineSample>>,
    dispatch_done: AtomicU64,
    combine_done: AtomicU64,
}

/// Where a started proxy runs.
enum Running {
    Task(TaskId),
    Thread(JoinHandle<()>),
}

/// The running proxy; stopped on drop (its task detached, or its thread joined).
pub struct Proxy {
    shared: Arc<Shared>,
    running: Option<Running>,
    engine: Arc<TransferEngine>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy").field("running", &self.running.is_some()).finish()
    }
}

impl Proxy {
    /// Starts the thread. `peers[r]` is rank r's regions (this rank's own entry is ignored).
    pub fn start(
        engine: Arc<TransferEngine>,
        cfg: ProxyConfig,
        local: LocalRegions,
        peers: Vec<PeerRegions>,
    ) -> crate::Result<Self> {
        if peers.len() != cfg.topo.world {
            return Err(crate::error::invalid!("{} peer regions for a world of {}", peers.len(), cfg.topo.world));
        }
        let shared = Arc::new(Shared::default());
        let runner = cfg.runner;
        let state = State::new(engine.clone(), cfg, local, peers, shared.clone())?;
        let running = match runner {
            ProxyRunner::EngineWorker => Running::Task(engine.attach_task(Box::new(state))?),
            ProxyRunner::OwnThread { cpu, idle_spin } => Running::Thread(
                std::thread::Builder::new()
                    .name("a2a-proxy".into())
                    .spawn(move || state.run(cpu, idle_spin))
                    .map_err(|e| crate::error::invalid!("spawning the proxy thread: {e}"))?,
            ),
        };
        Ok(Proxy { shared, running: Some(running), engine })
    }

    /// The engine the proxy posts on.
    pub fn engine(&self) -> &Arc<TransferEngine> {
        &self.engine
    }

    /// The first failure, if any (the object is unusable afterwards).
    pub fn error(&self) -> Option<String> {
        self.shared.error.lock().clone()
    }

    /// Dispatch and combine calls the proxy finished.
    pub fn calls_done(&self) -> (u64, u64) {
        (self.shared.dispatch_done.load(Ordering::Acquire), self.shared.combine_done.load(Ordering::Acquire))
    }

    /// The recorded costs of recent calls (and clears them).
    pub fn take_samples(&self) -> (Vec<DispatchSample>, Vec<CombineSample>) {
        (std::mem::take(&mut *self.shared.dispatch.lock()), std::mem::take(&mut *self.shared.combine.lock()))
    }

    /// Stops the proxy (also done on drop): returns once its task was detached (bounded by the
    /// engine's command timeout) or its thread joined.
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        match self.running.take() {
            // Fails only where the engine stopped, which dropped the task already.
            Some(Running::Task(id)) => {
                if let Err(e) = self.engine.detach_task(id) {
                    tracing::debug!("all-to-all proxy: detaching its task: {e}");
                }
            }
            Some(Running::Thread(t)) => {
                let _ = t.join();
            }
            None => {}
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The dispatch call in progress.
struct DispatchCall {
    n: u64,
    started: bool,
    seen: Instant,
    known: Vec<bool>,
    counts_raised: bool,
    private_posted: bool,
    overflow_posted: Vec<bool>,
    flagged: Vec<bool>,
    sample: DispatchSample,
}

/// The combine call in progress.
struct CombineCall {
    n: u64,
    posted: bool,
    got: Vec<bool>,
}

struct State {
    engine: Arc<TransferEngine>,
    cfg: ProxyConfig,
    block: BlockLayout,
    local: LocalRegions,
    peers: Vec<PeerRegions>,
    shared: Arc<Shared>,
    /// Counts of the dispatch of each parity, and which dispatch they are (0: none).
    counts: [Counts; 2],
    counts_seq: [u64; 2],
    /// Per parity, `rows_to_me[p][s]`: the rows source `s` sends this rank (`Counts::rows`),
    /// which this rank's combine returns to it.
    rows_to_me: [Vec<u32>; 2],
    /// Per parity, `rows_before_me[p][s]`: the rows source `s` sends the ranks below this one
    /// that are remote to it (where this rank's combine rows start in `s`'s receive area).
    rows_before_me: [Vec<u32>; 2],
    dispatch: DispatchCall,
    combine: CombineCall,
    writes: Arc<CompletionCounter>,
    remote: Vec<usize>,
    scatters: Scatters,
    /// Per parity, the count message's `(rank, src_offset, len, dst_offset)` targets: the same
    /// every call.
    count_targets: [Vec<(usize, usize, usize, usize)>; 2],
    /// The count message being sent.
    msg: Vec<u8>,
    /// A call's targets, and their slices for the engine (kept: nothing allocated per call).
    targets: Vec<(usize, usize, usize, usize)>,
    slices: std::cell::RefCell<Vec<ScatterSlice>>,
    /// Whether this pass looks for arrivals (see `poll`).
    poll_arrivals: bool,
    /// The engine's arrivals generation when arrivals were last looked for.
    polled_generation: u64,
    /// Whether the last pass changed anything.
    progressed: bool,
    /// Write failures already reported.
    failed_seen: u64,
    /// Requests submitted to the engine so far (`FirstWrite::request`).
    submitted: std::cell::Cell<u64>,
    /// With a placement fence: flag writes (offset in the block, value) waiting for their mark,
    /// in order, and this pass's mark (one covers every arrival counted before it).
    fenced: std::collections::VecDeque<(u64, FlagWrites)>,
    pass_mark: Option<u64>,
}

/// The words one flag raise stores, the flag itself last.
type FlagWrites = smallvec::SmallVec<[(usize, u64); 2]>;

/// The call that handed a post's first targets to the engine.
#[derive(Debug, Clone, Copy)]
pub struct FirstWrite {
    /// When it started.
    pub call: Instant,
    /// When it returned: the write was handed to the engine (on the engine's worker,
    /// `ProxyRunner::EngineWorker`: posted, unless the provider pushed it back).
    pub handed: Instant,
    /// Requests this proxy had submitted to its engine before this one: where the request is
    /// in the engine's post log (`LatencyProbe::enable_post_log`) when nothing else posts on
    /// the engine and no post was pushed back.
    pub request: u64,
}

/// Which of the proxy's scatters a post belongs to.
#[derive(Clone, Copy, Debug)]
enum Set {
    Counts,
    Dispatch,
    Combine,
}

impl Set {
    /// The local region it writes from, and the peer region it writes into.
    fn regions(self, local: &LocalRegions) -> (MrHandle, fn(&PeerRegions) -> &MrDescriptor) {
        match self {
            Set::Counts => (local.block, |p| &p.block),
            Set::Dispatch => (local.dsend, |p| &p.drecv),
            Set::Combine => (local.csend, |p| &p.crecv),
        }
    }
}

/// The proxy's three scatters, their destinations checked once (see
/// `TransferEngine::prepare_scatter`): count messages to every other rank, dispatch data and
/// combine rows to every remote rank. A slice names its rank's index in the set.
struct Scatters {
    counts: Option<PreparedScatter>,
    dispatch: Option<PreparedScatter>,
    combine: Option<PreparedScatter>,
    /// Rank → index in `counts` (every rank but this one).
    count_index: Vec<usize>,
    /// Rank → index in `dispatch` and `combine` (the remote ranks).
    remote_index: Vec<usize>,
}

impl Scatters {
    fn new(
        engine: &TransferEngine,
        me: usize,
        local: &LocalRegions,
        peers: &[PeerRegions],
        remote: &[usize],
    ) -> crate::Result<Self> {
        let others: Vec<usize> = (0..peers.len()).filter(|&r| r != me).collect();
        let index = |ranks: &[usize]| {
            let mut at = vec![usize::MAX; peers.len()];
            for (i, &r) in ranks.iter().enumerate() {
                at[r] = i;
            }
            at
        };
        // No ranks (one NVLink domain): nothing to prepare.
        let prepare = |set: Set, ranks: &[usize]| -> crate::Result<Option<PreparedScatter>> {
            if ranks.is_empty() {
                return Ok(None);
            }
            let (src, pick) = set.regions(local);
            let dsts: Vec<MrDescriptor> = ranks.iter().map(|&r| pick(&peers[r]).clone()).collect();
            Ok(Some(engine.prepare_scatter(src, &dsts)?))
        };
        Ok(Scatters {
            counts: prepare(Set::Counts, &others)?,
            dispatch: prepare(Set::Dispatch, remote)?,
            combine: prepare(Set::Combine, remote)?,
            count_index: index(&others),
            remote_index: index(remote),
        })
    }
}

impl State {
    fn new(
        engine: Arc<TransferEngine>,
        cfg: ProxyConfig,
        local: LocalRegions,
        peers: Vec<PeerRegions>,
        shared: Arc<Shared>,
    ) -> crate::Result<Self> {
        let w = cfg.topo.world;
        let block = BlockLayout::new(&cfg.layout);
        let remote: Vec<usize> = (0..w).filter(|&r| cfg.topo.is_remote(cfg.rank, r)).collect();
        let scatters = Scatters::new(&engine, cfg.rank, &local, &peers, &remote)?;
        let e = cfg.layout.num_experts;
        let me = cfg.rank;
        let count_targets = [0, 1].map(|p| {
            let (src, len, dst) = (block.msg_out_at(p), block.msg_bytes, block.msg_in_at(p, me));
            (0..w).filter(|&r| r != me).map(|r| (r, src, len, dst)).collect()
        });
        let msg = vec![0u8; block.msg_bytes];
        Ok(State {
            engine,
            block,
            local,
            peers,
            shared,
            counts: [Counts::new(w, e), Counts::new(w, e)],
            counts_seq: [0, 0],
            rows_to_me: [vec![0; w], vec![0; w]],
            rows_before_me: [vec![0; w], vec![0; w]],
            dispatch: DispatchCall::new(1, w),
            combine: CombineCall { n: 1, posted: false, got: vec![false; w] },
            writes: CompletionCounter::new(),
            remote,
            scatters,
            count_targets,
            msg,
            targets: Vec::with_capacity(w),
            slices: std::cell::RefCell::new(Vec::with_capacity(w)),
            poll_arrivals: true,
            polled_generation: u64::MAX,
            progressed: true,
            failed_seen: 0,
            submitted: std::cell::Cell::new(0),
            fenced: std::collections::VecDeque::new(),
            pass_mark: None,
            cfg,
        })
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `off` is an 8-aligned offset inside the block (BlockLayout), which outlives
        // the thread; the block is 64-byte aligned host memory.
        unsafe { &*(self.local.block_ptr.add(off) as *const AtomicU64) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as for `u64_at`, 4-aligned.
        unsafe { &*(self.local.block_ptr.add(off) as *const AtomicU32) }
    }

    fn bytes_at(&self, off: usize, len: usize) -> &[u8] {
        // SAFETY: a range inside the block that peers finished writing (msg_in, after its
        // immediate was counted).
        unsafe { std::slice::from_raw_parts(self.local.block_ptr.add(off), len) }
    }

    fn put_bytes(&self, off: usize, bytes: &[u8]) {
        // SAFETY: a range inside the block that only this thread writes (msg_out), not read
        // by the NIC at this time (its previous writes landed: see `dispatch_step`).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.local.block_ptr.add(off), bytes.len()) }
    }

    fn fail(&self, what: String) {
        tracing::error!("all-to-all proxy of rank {}: {what}", self.cfg.rank);
        self.shared.error.lock().get_or_insert(what);
        self.shared.failed.store(true, Ordering::Release);
        self.u64_at(self.block.error).store(1, Ordering::Release);
    }

    /// One pass over the calls in progress; true if it changed anything.
    fn pass(&mut self) -> bool {
        // A pass that follows one which changed nothing, with no arrivals counted since, would
        // take nothing either: it skips the counter table (and its lock) entirely.
        let generation = self.engine.imm_arrivals_generation();
        self.poll_arrivals = self.progressed || generation != self.polled_generation;
        if self.poll_arrivals {
            self.polled_generation = generation;
        }
        let mut progressed = false;
        self.pass_mark = None;
        if !self.fenced.is_empty() {
            progressed |= self.release_fenced();
        }
        if !self.shared.failed.load(Ordering::Acquire) {
            // Combine first: its `cdone` names the dispatch whose counts it uses.
            progressed |= self.combine_step();
            progressed |= self.dispatch_step();
        }
        let failed = self.writes.failed();
        if failed != self.failed_seen {
            self.failed_seen = failed;
            let e = self.writes.first_error().map(|e| e.to_string()).unwrap_or_default();
            self.fail(format!("a write to a remote rank failed: {e}"));
        }
        self.progressed = progressed;
        progressed
    }

    /// The loop of `ProxyRunner::OwnThread`.
    fn run(mut self, cpu: Option<usize>, idle_spin: Duration) {
        if let Some(cpu) = cpu {
            if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
                tracing::warn!("all-to-all proxy: could not pin to CPU {cpu}");
            }
        }
        let mut last_work = Instant::now();
        while !self.shared.stop.load(Ordering::Acquire) {
            if self.pass() {
                last_work = Instant::now();
            } else if last_work.elapsed() > idle_spin {
                std::thread::sleep(Duration::from_micros(20));
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Consumes `n` arrivals of `imm` if they are there, in a pass that looks for arrivals.
    fn take(&self, imm: u32, n: u64) -> bool {
        self.poll_arrivals && self.engine.try_take_imm_count(imm, n)
    }

    /// Raises a flag: stores `writes` (the flag last) now, or with a placement fence once the
    /// work queued before this pass's mark completed (flags keep their order); false after
    /// recording a failure of the fence.
    fn raise(&mut self, writes: FlagWrites) -> bool {
        let Some(fence) = self.cfg.placement_fence.as_ref() else {
            self.store(&writes);
            return true;
        };
        let ticket = match self.pass_mark {
            Some(t) => t,
            None => match fence.mark() {
                Ok(t) => *self.pass_mark.insert(t),
                Err(e) => {
                    self.fail(format!("marking received bytes to wait for: {e}"));
                    return false;
                }
            },
        };
        self.fenced.push_back((ticket, writes));
        self.release_fenced();
        true
    }

    fn store(&self, writes: &[(usize, u64)]) {
        for &(off, value) in writes {
            self.u64_at(off).store(value, Ordering::Release);
        }
    }

    /// Stores the fenced flag writes whose mark passed; true if any.
    fn release_fenced(&mut self) -> bool {
        let Some(fence) = self.cfg.placement_fence.as_ref() else { return false };
        let mut released = false;
        while let Some(&(ticket, _)) = self.fenced.front() {
            match fence.passed(ticket) {
                Ok(true) => {
                    let (_, writes) = self.fenced.pop_front().expect("front exists");
                    self.store(&writes);
                    released = true;
                }
                Ok(false) => break,
                Err(e) => {
                    self.fail(format!("waiting for received bytes to be in place: {e}"));
                    self.fenced.clear();
                    break;
                }
            }
        }
        released
    }

    fn write(&self, src: MrHandle, src_offset: usize, len: usize, dst: &MrDescriptor, dst_offset: usize, imm: u32) {
        let req = WriteRequest {
            src,
            src_offset: src_offset as u64,
            len: len as u64,
            dst,
            dst_offset: dst_offset as u64,
            imm: Some(imm),
            domains: DomainChoice::Shard(self.engine.num_domains()),
        };
        self.submitted.set(self.submitted.get() + 1);
        if let Err(e) = self.engine.submit_write_counted(&req, &self.writes) {
            self.fail(format!("posting a write of {len} bytes: {e}"));
        }
    }

    /// One request writing `(rank, src_offset, len, dst_offset)` per target of `set` (two with
    /// `eager_targets`), each target's receiver counting `imm` once. Returns when the call
    /// handing the first targets to the engine started and returned (None: no targets).
    fn scatter(&self, set: Set, targets: &[(usize, usize, usize, usize)], imm: u32) -> Option<FirstWrite> {
        if targets.is_empty() {
            return None;
        }
        let (prepared, index) = match set {
            Set::Counts => (&self.scatters.counts, &self.scatters.count_index),
            Set::Dispatch => (&self.scatters.dispatch, &self.scatters.remote_index),
            Set::Combine => (&self.scatters.combine, &self.scatters.remote_index),
        };
        let Some(prepared) = prepared else {
            self.fail(format!("no prepared scatter for {set:?}"));
            return None;
        };
        let mut slices = self.slices.borrow_mut();
        slices.clear();
        slices.extend(targets.iter().map(|&(rank, src_offset, len, dst_offset)| ScatterSlice {
            dst: index[rank],
            src_offset: src_offset as u64,
            len: len as u64,
            dst_offset: dst_offset as u64,
        }));
        let eager = self.cfg.eager_targets;
        let head = if eager > 0 && slices.len() > eager { eager } else { slices.len() };
        let submit = |part: &[ScatterSlice]| {
            self.submitted.set(self.submitted.get() + 1);
            let sharding = ScatterSharding::ByBytes;
            if let Err(e) =
                self.engine.submit_prepared_scatter_counted(prepared, part, Some(imm), sharding, &self.writes)
            {
                self.fail(format!("posting a scatter to {} ranks: {e}", part.len()));
            }
        };
        let (call, request) = (Instant::now(), self.submitted.get());
        submit(&slices[..head]);
        let handed = Instant::now();
        if head < slices.len() {
            submit(&slices[head..]);
        }
        Some(FirstWrite { call, handed, request })
    }

    /// Posts `(rank, src_offset, len, dst_offset)` per target of `set`, each target's receiver
    /// counting `imm` once: one scatter with `scatter_data`, else one write each (a zero-length
    /// target: the immediate alone). Returns when the call handing the first one to the engine
    /// started and returned.
    fn post(&self, set: Set, targets: &[(usize, usize, usize, usize)], imm: u32) -> Option<FirstWrite> {
        if self.cfg.scatter_data {
            return self.scatter(set, targets, imm);
        }
        let mut first = None;
        let (src, pick) = set.regions(&self.local);
        for &(rank, src_offset, len, dst_offset) in targets {
            let dst = pick(&self.peers[rank]);
            let (call, request) = (Instant::now(), self.submitted.get());
            if len > 0 {
                self.write(src, src_offset, len, dst, dst_offset, imm);
            } else {
                self.imm_only(imm, dst);
            }
            first.get_or_insert_with(|| FirstWrite { call, handed: Instant::now(), request });
        }
        first
    }

    fn imm_only(&self, imm: u32, dst: &MrDescriptor) {
        let counter = self.writes.clone();
        self.submitted.set(self.submitted.get() + 1);
        if let Err(e) = self.engine.submit_imm(imm, dst, counter.on_done()) {
            self.fail(format!("posting an immediate: {e}"));
        }
    }

    /// Keeps rank `s`'s counts of parity `p`, and what the combine's segments need of them
    /// (computed here, off the combine's path).
    fn store_counts(&mut self, p: usize, s: usize, tok: Vec<u32>, hist: Vec<u32>) {
        let c = &mut self.counts[p];
        c.tok[s] = tok;
        c.hist[s] = hist;
        let (topo, me) = (self.cfg.topo, self.cfg.rank);
        self.rows_to_me[p][s] = c.rows(s, me) as u32;
        self.rows_before_me[p][s] = (0..me).filter(|&x| topo.is_remote(s, x)).map(|x| c.rows(s, x) as u32).sum();
    }

    fn dispatch_step(&mut self) -> bool {
        let (me, w, q) = (self.cfg.rank, self.cfg.topo.world, self.cfg.layout.private_tokens);
        let n = self.dispatch.n;
        let p = (n & 1) as usize;
        let mut progressed = false;
        if !self.dispatch.started {
            if self.u64_at(self.block.dseq).load(Ordering::Acquire) < n {
                return false;
            }
            let seen = Instant::now();
            // Into the vectors of the call two back (this parity's), nothing allocated.
            let mut tok = std::mem::take(&mut self.counts[p].tok[me]);
            let mut hist = std::mem::take(&mut self.counts[p].hist[me]);
            tok.clear();
            tok.extend((0..w).map(|d| self.u32_at(self.block.pub_tok_at(p, d)).load(Ordering::Relaxed)));
            hist.clear();
            hist.extend(
                (0..self.cfg.layout.num_experts)
                    .map(|e| self.u32_at(self.block.pub_hist_at(p, e)).load(Ordering::Relaxed)),
            );
            encode_counts(n, &tok, &hist, &mut self.msg);
            self.put_bytes(self.block.msg_out_at(p), &self.msg);
            // One scatter: the same message to every other rank.
            let first = self.post(Set::Counts, &self.count_targets[p], imm(ImmKind::Counts, n as u32, me));
            self.store_counts(p, me, tok, hist);
            self.counts_seq[p] = 0;
            let d = &mut self.dispatch;
            d.started = true;
            d.seen = seen;
            d.known[me] = true;
            d.sample.counts_post_ns = seen.elapsed().as_nanos() as u64;
            d.sample.counts_signal_to_first_write_ns = first.map_or(0, |t| (t.handed - seen).as_nanos() as u64);
            d.sample.counts_first_write = first;
            d.sample.count_writes = (w - 1) as u32;
            d.sample.remote_peers = self.remote.len() as u32;
            progressed = true;
        }
        // Before reading the others' counts: the private writes need only this rank's.
        if !self.dispatch.private_posted && self.u64_at(self.block.ddone).load(Ordering::Acquire) >= n {
            let signal = Instant::now();
            let lay = self.cfg.layout;
            let tag = imm(ImmKind::DispatchData, n as u32, me);
            let mut targets = std::mem::take(&mut self.targets);
            targets.clear();
            targets.extend(
                self.remote
                    .iter()
                    .map(|&d| (d, (self.counts[p].tok[me][d] as usize).min(q)))
                    .filter(|&(_, records)| records > 0)
                    .map(|(d, records)| {
                        let dst = lay.private_offset(p, me, 0);
                        (d, lay.dsend_offset(p, d, 0), records * lay.rrec_bytes, dst)
                    }),
            );
            let first = self.post(Set::Dispatch, &targets, tag);
            self.dispatch.sample.data_writes += targets.len() as u32;
            self.targets = targets;
            let sample = &mut self.dispatch.sample;
            sample.signal_to_first_write_ns = first.map_or(0, |t| (t.handed - signal).as_nanos() as u64);
            sample.data_first_write = first;
            sample.post_per_peer_ns = signal.elapsed().as_nanos() as u64 / self.remote.len().max(1) as u64;
            self.dispatch.private_posted = true;
            progressed = true;
        }
        for s in 0..w {
            if self.dispatch.known[s] || !self.take(imm(ImmKind::Counts, n as u32, s), 1) {
                continue;
            }
            let msg = self.bytes_at(self.block.msg_in_at(p, s), self.block.msg_bytes);
            let (seq, tok, hist) = decode_counts(msg, w, self.cfg.layout.num_experts);
            if seq != n {
                self.fail(format!("rank {s}'s count message is for dispatch {seq}, expected {n}"));
                return true;
            }
            self.store_counts(p, s, tok, hist);
            self.dispatch.known[s] = true;
            progressed = true;
        }
        if self.dispatch.private_posted {
            let lay = self.cfg.layout;
            for i in 0..self.remote.len() {
                let d = self.remote[i];
                if self.dispatch.overflow_posted[d] {
                    continue;
                }
                let records = self.counts[p].tok[me][d] as usize;
                if records <= q {
                    self.dispatch.overflow_posted[d] = true;
                    continue;
                }
                let ready = (0..me).all(|x| !self.cfg.topo.is_remote(x, d) || self.dispatch.known[x]);
                if !ready {
                    continue;
                }
                let off = overflow_offset(&self.counts[p], &self.cfg.topo, q, me, d);
                self.write(
                    self.local.dsend,
                    lay.dsend_offset(p, d, q),
                    (records - q) * lay.rrec_bytes,
                    &self.peers[d].drecv,
                    lay.overflow_byte_offset(p, off),
                    imm(ImmKind::DispatchData, n as u32, me),
                );
                self.dispatch.sample.data_writes += 1;
                self.dispatch.overflow_posted[d] = true;
                progressed = true;
            }
        }
        // Every count message must be in before any flag goes up: a rank's receive half
        // finishing then proves its proxy read them all (the buffers of this parity are free
        // for call n + 2).
        if self.dispatch.started && self.dispatch.known.iter().all(|&k| k) {
            if !self.dispatch.counts_raised {
                // The receive kernel lays out its rows from these before the records arrive.
                for &s in &self.remote {
                    let records = u64::from(self.counts[p].tok[s][me]);
                    self.u64_at(self.block.rcf_at(p, s)).store((n << 32) | records, Ordering::Release);
                }
                self.dispatch.counts_raised = true;
                progressed = true;
            }
            for i in 0..self.remote.len() {
                let s = self.remote[i];
                if self.dispatch.flagged[s] {
                    continue;
                }
                let records = self.counts[p].tok[s][me] as usize;
                let expect = u64::from(records.min(q) > 0) + u64::from(records > q);
                if expect > 0 && !self.take(imm(ImmKind::DispatchData, n as u32, s), expect) {
                    continue;
                }
                let off = overflow_offset(&self.counts[p], &self.cfg.topo, q, s, me);
                let writes = smallvec::smallvec![
                    (self.block.rovf_at(p, s), off as u64),
                    (self.block.rflag_at(p, s), (n << 32) | records as u64)
                ];
                if !self.raise(writes) {
                    return true;
                }
                self.dispatch.flagged[s] = true;
                progressed = true;
            }
            let all_flagged = self.remote.iter().all(|&s| self.dispatch.flagged[s]);
            let all_sent =
                self.dispatch.private_posted && self.remote.iter().all(|&d| self.dispatch.overflow_posted[d]);
            if all_flagged && all_sent {
                self.counts_seq[p] = n;
                let mut sample = self.dispatch.sample;
                sample.total_ns = self.dispatch.seen.elapsed().as_nanos() as u64;
                push(&self.shared.dispatch, sample);
                self.shared.dispatch_done.store(n, Ordering::Release);
                self.dispatch = DispatchCall::new(n + 1, w);
                return true;
            }
        }
        progressed
    }

    fn combine_step(&mut self) -> bool {
        let me = self.cfg.rank;
        let cn = self.combine.n;
        let cp = (cn & 1) as usize;
        let mut progressed = false;
        if !self.combine.posted {
            let v = self.u64_at(self.block.cdone).load(Ordering::Acquire);
            if v >> 32 < cn {
                return false;
            }
            let dn = v & 0xffff_ffff;
            let dp = (dn & 1) as usize;
            if self.counts_seq[dp] & 0xffff_ffff != dn {
                // The dispatch it follows is still being finished here (its writes posted).
                return false;
            }
            let signal = Instant::now();
            let lay = self.cfg.layout;
            let (to_me, before_me) = (&self.rows_to_me[dp], &self.rows_before_me[dp]);
            let tag = imm(ImmKind::Combine, cn as u32, me);
            // Every remote rank hears from this one: its rows, or the immediate alone. Segments
            // as `combine_segment_at_expert` / `_at_source` place them: here after the rows of
            // the remote sources before `s` (a running sum over `remote`, ascending), there after
            // the rows `s` sends the remote ranks below this one (kept when its counts came).
            let mut at_expert = 0;
            let mut targets = std::mem::take(&mut self.targets);
            targets.clear();
            targets.extend(self.remote.iter().map(|&s| {
                let n_rows = to_me[s] as usize;
                let at_source = before_me[s] as usize;
                let target =
                    (s, lay.csend_offset(cp, at_expert), n_rows * lay.row_bytes, lay.crecv_offset(cp, at_source));
                at_expert += n_rows;
                target
            }));
            let first = self.post(Set::Combine, &targets, tag);
            self.targets = targets;
            let peers = self.remote.len() as u32;
            push(
                &self.shared.combine,
                CombineSample {
                    signal_to_first_write_ns: first.map_or(0, |t| (t.handed - signal).as_nanos() as u64),
                    post_per_peer_ns: signal.elapsed().as_nanos() as u64 / u64::from(peers.max(1)),
                    writes: peers,
                    remote_peers: peers,
                    first_write: first,
                },
            );
            self.combine.posted = true;
            progressed = true;
        }
        for i in 0..self.remote.len() {
            let d = self.remote[i];
            if !self.combine.got[d] && self.take(imm(ImmKind::Combine, cn as u32, d), 1) {
                if !self.raise(smallvec::smallvec![(self.block.crflag_at(d), cn << 32)]) {
                    return true;
                }
                self.combine.got[d] = true;
                progressed = true;
            }
        }
        if self.combine.posted && self.remote.iter().all(|&d| self.combine.got[d]) {
            self.shared.combine_done.store(cn, Ordering::Release);
            self.combine = CombineCall { n: cn + 1, posted: false, got: vec![false; self.cfg.topo.world] };
            return true;
        }
        progressed
    }
}

impl WorkerTask for State {
    fn poll(&mut self) -> bool {
        self.pass()
    }
}

impl Drop for State {
    /// Dropped without being stopped: the engine stopped (and its worker dropped the task) or
    /// the task panicked. The kernels' waits then end with the block's error word.
    fn drop(&mut self) {
        if !self.shared.stop.load(Ordering::Acquire) {
            self.fail("the proxy stopped: its engine stopped, or it failed (see the log)".into());
        }
    }
}

impl DispatchCall {
    fn new(n: u64, w: usize) -> Self {
        DispatchCall {
            n,
            started: false,
            seen: Instant::now(),
            known: vec![false; w],
            counts_raised: false,
            private_posted: false,
            overflow_posted: vec![false; w],
            flagged: vec![false; w],
            sample: DispatchSample::default(),
        }
    }
}

fn push<T>(samples: &Mutex<Vec<T>>, s: T) {
    let mut v = samples.lock();
    if v.len() >= MAX_SAMPLES {
        v.remove(0);
    }
    v.push(s);
}
