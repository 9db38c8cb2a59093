//! The worker's side of staged transfers (see `crate::staging`): GPU memory crossing hosts over
//! providers without FI_HMEM, through registered host memory.
//!
//! Writer: each request is planned into chunks. A chunk whose source the NIC cannot reach is
//! first copied into a bounce slot (async, on the engine's stream; polled); then it is written
//! either straight to a host destination, or into a landing slot the receiver granted, and
//! announced ([`Control::StageChunk`]) once the writes were delivered. Several chunks are in
//! flight at once, so copies overlap the wire. A request completes when every chunk reached its
//! destination: for a landing destination, when the receiver credited its slot back as drained.
//!
//! Receiver: slots of the landing area are granted to requests ([`Grants`]); an announced chunk
//! is checked, copied into the destination region (async, polled), its slot drained and
//! credited back; the request's immediate is counted once its last chunk is in place, and never
//! for an incomplete one. Every control message is a two-sided message with CQ data
//! `CONTROL_TAG`, so none reaches the application's receive callback.
//!
//! Every request is bounded by `transfer_timeout` (the writer's request deadline; on the
//! receiver, a request that makes no progress for that long is dropped and its slots freed).
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Op, PendingPost, Region, Worker};
use crate::commands::{LandingKeys, StagedDest, StagedTransfer};
use crate::completion::{CompletionCounter, Notify};
use crate::config::EngineConfig;
use crate::descriptor::MemoryKind;
use crate::epoch::{cq_data, Control, CONTROL_TAG};
use crate::error::{FabricError, Result};
use crate::provider::libfabric::Access;
use crate::sharding::DeferredImm;
use crate::staging::memory::{Copier, Copying, Direction, StagingMemory};
use crate::staging::{
    plan_chunks_bounded, Chunk, ChunkHeader, Grants, Progress, Reassembly, RequestKey, SlotPool, StagingConfig,
    StagingCounters,
};

/// Region ids of the staging buffers among the worker's regions (user regions count up from 1).
const BOUNCE_REGION: u64 = u64::MAX - 1;
const LANDING_REGION: u64 = u64::MAX - 2;
/// Smallest message size staging works with (announcements and credits are control messages).
pub(crate) const MIN_STAGING_MESSAGE: usize = 4096;
/// An announcement's bytes besides its pieces, and the most one piece adds (three varints).
const HEADER_FRAME: usize = 256;
const PIECE_BYTES: usize = 30;
/// Slot numbers per credit message (at most 5 bytes each): well inside MIN_STAGING_MESSAGE.
const CREDITS_PER_MESSAGE: usize = 256;
/// How often the receiver looks for requests whose writer went silent.
const EXPIRY_PERIOD: Duration = Duration::from_millis(100);

struct Bounce {
    memory: StagingMemory,
    pool: SlotPool,
    chunk_bytes: u64,
}

struct LandingArea {
    memory: StagingMemory,
    grants: Grants,
    slots: u32,
    chunk_bytes: u64,
    keys: Vec<(u64, u64)>,
}

enum Stage {
    /// Copying the source into the bounce slot.
    Copying(Copying),
    /// Writes posted (as an internal request reporting to this counter).
    Writing(Arc<CompletionCounter>),
    /// Announced to the receiver; waiting for the slot to be credited back as drained.
    Announced,
}

struct Task {
    chunk: usize,
    bounce_slot: Option<u32>,
    landing_slot: Option<u32>,
    stage: Stage,
}

struct ToLanding {
    /// The receiver's first domain (announcements and asks go there).
    receiver: u64,
    chunk_bytes: u64,
    dst_base: u64,
    total: u64,
    imm: Option<u32>,
    tag: u32,
    granted: VecDeque<u32>,
    asked: bool,
    /// Chunks the receiver credited back as drained (all of them: the request succeeded).
    drained: usize,
}

struct WriterJob {
    src_region: u64,
    src_ptr: u64,
    src_kind: MemoryKind,
    bounce: bool,
    chunks: Vec<Chunk>,
    next: usize,
    /// Per domain: the destination's fi_addr and (key, remote base).
    dests: Vec<u64>,
    keys: Vec<(u64, u64)>,
    landing: Option<ToLanding>,
    tasks: Vec<Task>,
    /// The request finished (done, failed or timed out): start nothing more, settle the rest.
    dead: bool,
}

struct InboundJob {
    reply_to: u64,
    chunks: u32,
    tag: u32,
    region: u64,
    dst_ptr: u64,
    kind: MemoryKind,
    region_len: u64,
    reassembly: Option<Reassembly>,
    copying: usize,
    /// Slots granted to it and not announced yet: what a silent writer keeps from others.
    holding: usize,
    last_activity: Instant,
    drained: Vec<u32>,
    granted: Vec<u32>,
    complete: bool,
    failed: bool,
}

struct InboundCopy {
    key: RequestKey,
    header: ChunkHeader,
    copying: Copying,
}

/// Staging state of one worker; idle (and allocating nothing) until a staged request comes.
pub(super) struct Staged {
    config: Option<StagingConfig>,
    host_memory: bool,
    /// Names this engine as a writer (request ids are per engine).
    nonce: u64,
    copier: Copier,
    bounce: Option<Bounce>,
    landing: Option<LandingArea>,
    writes: BTreeMap<u64, WriterJob>,
    inbound: HashMap<RequestKey, InboundJob>,
    copies_in: Vec<InboundCopy>,
    /// Every staging control message reports here (failures are logged; a lost message
    /// shows up as the request's timeout).
    sends: Arc<CompletionCounter>,
    sends_failed_seen: u64,
    last_expiry: Instant,
    pub counters: Arc<StagingCounters>,
}

impl Staged {
    pub fn new(config: &EngineConfig) -> Result<Self> {
        Ok(Staged {
            config: config.staging,
            host_memory: config.stage_host_memory,
            nonce: getrandom::u64().map_err(|e| FabricError::InvalidArgument(format!("no random source: {e}")))?,
            copier: Copier::default(),
            bounce: None,
            landing: None,
            writes: BTreeMap::new(),
            inbound: HashMap::new(),
            copies_in: Vec::new(),
            sends: CompletionCounter::new(),
            sends_failed_seen: 0,
            last_expiry: Instant::now(),
            counters: Arc::default(),
        })
    }

    /// Whether staged work is in flight (the worker keeps polling).
    pub fn busy(&self) -> bool {
        !self.writes.is_empty() || !self.inbound.is_empty() || !self.copies_in.is_empty()
    }

    /// Waits for the copies still running (shutdown: staging memory is freed next).
    pub fn settle(&self) {
        self.copier.synchronize();
    }
}

/// Staging memory: pinned through the GPU's context, plain host memory without one.
fn device_of(kind: MemoryKind) -> Option<u32> {
    match kind {
        MemoryKind::Cuda(d) => Some(d),
        MemoryKind::Host => None,
    }
}

impl Worker {
    /// The largest control message both ends take.
    fn staging_message_limit(&self) -> usize {
        self.max_message_size.min(self.domains[0].send_buffers.slot_size())
    }

    fn staging_config(&self) -> Result<StagingConfig> {
        let config = self.staged.config.ok_or_else(|| {
            FabricError::ProviderUnavailable("staged transfers are off in this engine's configuration".into())
        })?;
        // Control messages are told apart from immediates by their CQ data, on receives that
        // remote writes do not consume.
        if !self.wide_cq_data || self.domains.iter().any(|d| d.domain.imm_consumes_recv()) {
            return Err(FabricError::ProviderUnavailable(
                "staged transfers need 8 bytes of remote CQ data on receives that remote writes do not \
                 consume, which this provider lacks"
                    .into(),
            ));
        }
        if self.staging_message_limit() < MIN_STAGING_MESSAGE {
            return Err(FabricError::InvalidArgument(format!(
                "staged transfers need max_message_size >= {MIN_STAGING_MESSAGE}"
            )));
        }
        Ok(config)
    }

    /// Registers `memory` on every domain as the staging region `region`.
    fn register_staging(&mut self, region: u64, memory: &StagingMemory, len: usize) -> Result<Vec<(u64, u64)>> {
        let mrs = self
            .domains
            .iter_mut()
            .map(|d| d.domain.register(memory.ptr(), len, Access::RemoteWrite))
            .collect::<Result<Vec<_>>>()?;
        let keys = mrs.iter().map(|m| (m.key(), m.remote_base())).collect();
        let ptr = memory.ptr() as usize;
        self.regions.insert(region, Region { mrs, ptr, len, kind: MemoryKind::Host, in_flight: 0 });
        Ok(keys)
    }

    /// Opens the landing area (once) and returns what peers need to write into it.
    pub(super) fn open_landing(&mut self, device: Option<u32>) -> Result<LandingKeys> {
        if let Some(l) = &self.staged.landing {
            return Ok((l.keys.clone(), l.slots, l.chunk_bytes));
        }
        let config = self.staging_config()?;
        let len = config.slots * config.chunk_bytes;
        let memory = StagingMemory::new(device, len)?;
        let keys = self.register_staging(LANDING_REGION, &memory, len)?;
        let (slots, chunk_bytes) = (config.slots as u32, config.chunk_bytes as u64);
        let grants = Grants::new(slots);
        self.staged.landing = Some(LandingArea { memory, grants, slots, chunk_bytes, keys: keys.clone() });
        Ok((keys, slots, chunk_bytes))
    }

    fn ensure_bounce(&mut self, device: Option<u32>) -> Result<()> {
        if self.staged.bounce.is_some() {
            return Ok(());
        }
        let config = self.staging_config()?;
        let len = config.slots * config.chunk_bytes;
        let memory = StagingMemory::new(device, len)?;
        self.register_staging(BOUNCE_REGION, &memory, len)?;
        let pool = SlotPool::new(config.slots as u32);
        self.staged.bounce = Some(Bounce { memory, pool, chunk_bytes: config.chunk_bytes as u64 });
        Ok(())
    }

    pub(super) fn start_staged(&mut self, t: StagedTransfer) {
        let StagedTransfer { region, bounce, target, dest, pieces, imm, on_done } = t;
        let id = self.new_request(on_done, 1);
        if let Some(e) = self.fence_error(std::iter::once(&target)) {
            return self.fail_request(id, e);
        }
        match self.plan_staged(id, region, bounce, &target, dest, pieces, imm) {
            Ok(job) => {
                self.keep_peers(id, smallvec::smallvec![target].into());
                self.track_region(region, 1);
                StagingCounters::add(&self.staged.counters.requests_sent, 1);
                self.staged.writes.insert(id, job);
            }
            Err(e) => self.fail_request(id, e),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn plan_staged(
        &mut self,
        id: u64,
        region: u64,
        bounce: bool,
        target: &crate::commands::Target,
        dest: StagedDest,
        pieces: Vec<(u64, u64, u64)>,
        imm: Option<u32>,
    ) -> Result<WriterJob> {
        self.staging_config()?;
        let (src_ptr, src_kind) = match self.regions.get(&region) {
            Some(r) => (r.ptr as u64, r.kind),
            None => return Err(FabricError::InvalidArgument(format!("memory handle {region} was unregistered"))),
        };
        if target.keys.len() != self.domains.len() {
            return Err(FabricError::InvalidDescriptor("the staged destination has a key per domain missing".into()));
        }
        let mut chunk_bytes = u64::MAX;
        if bounce {
            self.ensure_bounce(device_of(src_kind))?;
            chunk_bytes = self.staged.bounce.as_ref().expect("opened").chunk_bytes;
        }
        let mut max_pieces = usize::MAX;
        if let StagedDest::Landing { chunk_bytes: landing_chunk, peer_max_message, .. } = dest {
            chunk_bytes = chunk_bytes.min(landing_chunk);
            let limit = self.staging_message_limit().min(peer_max_message as usize);
            if limit < MIN_STAGING_MESSAGE {
                return Err(FabricError::InvalidArgument(format!(
                    "the receiver's max_message_size ({peer_max_message}) is below the {MIN_STAGING_MESSAGE} bytes staging needs"
                )));
            }
            max_pieces = (limit - HEADER_FRAME) / PIECE_BYTES;
        }
        let chunks = plan_chunks_bounded(pieces.iter().copied(), chunk_bytes, max_pieces)?;
        let total: u64 = pieces.iter().map(|p| p.2).sum();
        let dests =
            (0..self.domains.len()).map(|d| self.peer_dest(target.peer, d as u16)).collect::<Result<Vec<_>>>()?;
        let landing = match dest {
            StagedDest::Landing { dst_base, chunk_bytes, .. } => Some(ToLanding {
                receiver: dests[0],
                chunk_bytes,
                dst_base,
                total,
                imm,
                tag: self.tags_by_dest[0].get(&dests[0]).copied().unwrap_or(self.own_tag),
                granted: VecDeque::new(),
                asked: false,
                drained: 0,
            }),
            StagedDest::Region => None,
        };
        let req = self.requests.get_mut(id).expect("just created");
        req.remaining = chunks.len().max(1);
        if landing.is_none() {
            if let Some(imm) = imm {
                let (key, remote_base) = target.keys[0];
                req.deferred = vec![(DeferredImm { peer: 0, domain: 0, imm }, dests[0], key, remote_base)];
            }
        }
        if chunks.is_empty() {
            // Nothing to move (the engine sends zero-byte requests as plain immediates).
            self.finish(id, Ok(()));
        }
        Ok(WriterJob {
            src_region: region,
            src_ptr,
            src_kind,
            bounce,
            chunks,
            next: 0,
            dests,
            keys: target.keys.to_vec(),
            landing,
            tasks: Vec::new(),
            dead: false,
        })
    }

    /// Sends a staging control message to `dest` (domain 0).
    fn send_staging(&mut self, dest: u64, msg: &Control) {
        let id = self.new_request(Notify::Counter(self.staged.sends.clone()), 1);
        self.queue_send(id, dest, msg.encode(), Some(cq_data(CONTROL_TAG, 0)));
    }

    /// Drives every staged request one step; true if anything happened.
    pub(super) fn progress_staged(&mut self) -> bool {
        if !self.staged.busy() {
            return false;
        }
        let mut active = false;
        let ids: Vec<u64> = self.staged.writes.keys().copied().collect();
        for id in ids {
            let mut job = self.staged.writes.remove(&id).expect("listed");
            active |= self.advance_write(id, &mut job);
            if job.dead && job.tasks.is_empty() {
                self.track_region(job.src_region, -1);
            } else {
                self.staged.writes.insert(id, job);
            }
        }
        active |= self.advance_inbound();
        let failed = self.staged.sends.failed();
        if failed > self.staged.sends_failed_seen {
            self.staged.sends_failed_seen = failed;
            let e = self.staged.sends.first_error().map(|e| e.to_string()).unwrap_or_default();
            tracing::warn!("{failed} staging control messages failed so far (first: {e})");
        }
        if self.staged.last_expiry.elapsed() >= EXPIRY_PERIOD {
            self.staged.last_expiry = Instant::now();
            self.expire_inbound();
        }
        active
    }

    fn release_bounce(&mut self, slot: Option<u32>) {
        if let (Some(slot), Some(b)) = (slot, self.staged.bounce.as_mut()) {
            if let Err(e) = b.pool.release(slot) {
                tracing::error!("staging bounce slot bookkeeping: {e}");
            }
        }
    }

    fn kill_job(&mut self, id: u64, job: &mut WriterJob, e: FabricError) {
        if !job.dead && self.requests.contains(id) {
            self.fail_request(id, e);
        }
        if !job.dead {
            self.cancel_landing(id, job);
        }
        job.dead = true;
    }

    /// Tells the receiver a request it granted slots to will not complete (best effort: a
    /// dead receiver forgets it on its own).
    fn cancel_landing(&mut self, id: u64, job: &WriterJob) {
        if let Some(l) = job.landing.as_ref().filter(|l| l.asked && l.drained < job.chunks.len()) {
            let receiver = l.receiver;
            self.send_staging(receiver, &Control::StageCancel { writer: self.staged.nonce, request: id });
        }
    }

    fn advance_write(&mut self, id: u64, job: &mut WriterJob) -> bool {
        let mut active = false;
        if !job.dead && !self.requests.contains(id) {
            self.cancel_landing(id, job);
            job.dead = true;
        }
        let mut i = 0;
        while i < job.tasks.len() {
            let step: Result<Option<Option<FabricError>>> = match &job.tasks[i].stage {
                Stage::Copying(c) => c.is_done().map(|done| done.then_some(None)),
                Stage::Writing(c) => Ok((c.done() > 0).then(|| c.first_error())),
                Stage::Announced => Ok(job.dead.then_some(None)),
            };
            // step: Err = the copy failed; Ok(None) = nothing yet; Ok(Some(error)) = stage over.
            let stage_over = match step {
                Err(e) => {
                    let task = job.tasks.swap_remove(i);
                    self.release_bounce(task.bounce_slot);
                    self.kill_job(id, job, e);
                    active = true;
                    continue;
                }
                Ok(None) => {
                    i += 1;
                    continue;
                }
                Ok(Some(error)) => error,
            };
            active = true;
            match job.tasks[i].stage {
                Stage::Copying(_) if job.dead => {
                    let task = job.tasks.swap_remove(i);
                    self.release_bounce(task.bounce_slot);
                }
                Stage::Copying(_) => {
                    let counter = self.post_chunk_writes(job, i);
                    job.tasks[i].stage = Stage::Writing(counter);
                    i += 1;
                }
                Stage::Writing(_) => {
                    let bounce_slot = job.tasks[i].bounce_slot.take();
                    self.release_bounce(bounce_slot);
                    if let Some(e) = stage_over {
                        job.tasks.swap_remove(i);
                        self.kill_job(id, job, e);
                    } else if job.dead {
                        job.tasks.swap_remove(i);
                    } else if job.landing.is_some() {
                        self.announce(id, job, i);
                        job.tasks[i].stage = Stage::Announced;
                        i += 1;
                    } else {
                        job.tasks.swap_remove(i);
                        self.finish(id, Ok(()));
                    }
                }
                Stage::Announced => {
                    job.tasks.swap_remove(i);
                }
            }
        }
        if job.dead {
            return active;
        }
        if let Some(l) = job.landing.as_mut().filter(|l| !l.asked) {
            l.asked = true;
            let msg = Control::StageAsk {
                writer: self.staged.nonce,
                request: id,
                reply_to: self.domains[0].domain.address().to_vec(),
                tag: l.tag,
                chunks: job.chunks.len() as u32,
                dst_base: l.dst_base,
            };
            let receiver = l.receiver;
            self.send_staging(receiver, &msg);
            active = true;
        }
        while job.next < job.chunks.len() {
            let landing_slot = match job.landing.as_mut() {
                Some(l) => match l.granted.pop_front() {
                    Some(s) => Some(s),
                    None => break,
                },
                None => None,
            };
            let bounce_slot = if job.bounce {
                match self.staged.bounce.as_mut().and_then(|b| b.pool.acquire()) {
                    Some(s) => Some(s),
                    None => {
                        if let (Some(l), Some(s)) = (job.landing.as_mut(), landing_slot) {
                            l.granted.push_front(s);
                        }
                        break;
                    }
                }
            } else {
                None
            };
            let chunk = job.next;
            job.next += 1;
            active = true;
            if let Some(slot) = bounce_slot {
                match self.copy_to_bounce(job, chunk, slot) {
                    Ok(copying) => {
                        job.tasks.push(Task { chunk, bounce_slot, landing_slot, stage: Stage::Copying(copying) })
                    }
                    Err(e) => {
                        self.release_bounce(bounce_slot);
                        self.kill_job(id, job, e);
                        break;
                    }
                }
            } else {
                job.tasks.push(Task { chunk, bounce_slot, landing_slot, stage: Stage::Announced });
                let last = job.tasks.len() - 1;
                let counter = self.post_chunk_writes(job, last);
                job.tasks[last].stage = Stage::Writing(counter);
            }
        }
        active
    }

    fn copy_to_bounce(&mut self, job: &WriterJob, chunk: usize, slot: u32) -> Result<Copying> {
        let b = self.staged.bounce.as_ref().expect("a bounce slot implies the buffer");
        let base = b.memory.ptr() as u64 + u64::from(slot) * b.chunk_bytes;
        let pieces: Vec<(u64, u64, u64)> = job.chunks[chunk]
            .pieces
            .iter()
            .map(|p| (base + p.slot_offset, job.src_ptr + p.src_offset, p.len))
            .collect();
        StagingCounters::add(&self.staged.counters.bounced_bytes, job.chunks[chunk].bytes);
        // SAFETY: the source lies inside its region (checked by the engine), which cannot be
        // unregistered while the job holds it; the bounce slot is this task's alone until the
        // copy and the writes from it completed.
        unsafe { self.staged.copier.copy(job.src_kind, Direction::ToStaging, &pieces) }
    }

    /// Posts the writes of task `i` as one internal request; its counter reports when every
    /// write was delivered (or one failed).
    fn post_chunk_writes(&mut self, job: &WriterJob, i: usize) -> Arc<CompletionCounter> {
        let task = &job.tasks[i];
        let chunk = &job.chunks[task.chunk];
        let domain = chunk.index as usize % self.domains.len();
        let (dest, (key, remote_base)) = (job.dests[domain], job.keys[domain]);
        let landing_base = match (&job.landing, task.landing_slot) {
            (Some(l), Some(slot)) => Some(remote_base + u64::from(slot) * l.chunk_bytes),
            _ => None,
        };
        // (region, local address, length, remote address)
        let writes: Vec<(u64, usize, usize, u64)> = match (task.bounce_slot, landing_base) {
            (Some(slot), Some(landing)) => {
                let b = self.staged.bounce.as_ref().expect("bounce slot");
                let ptr = b.memory.ptr() as usize + slot as usize * b.chunk_bytes as usize;
                vec![(BOUNCE_REGION, ptr, chunk.bytes as usize, landing)]
            }
            (Some(slot), None) => {
                let b = self.staged.bounce.as_ref().expect("bounce slot");
                let base = b.memory.ptr() as usize + slot as usize * b.chunk_bytes as usize;
                let to = |p: &crate::staging::Piece| {
                    (BOUNCE_REGION, base + p.slot_offset as usize, p.len as usize, remote_base + p.dst_offset)
                };
                chunk.pieces.iter().map(to).collect()
            }
            (None, Some(landing)) => {
                let to = |p: &crate::staging::Piece| {
                    let ptr = (job.src_ptr + p.src_offset) as usize;
                    (job.src_region, ptr, p.len as usize, landing + p.slot_offset)
                };
                chunk.pieces.iter().map(to).collect()
            }
            (None, None) => unreachable!("a staged request stages at least one side"),
        };
        let counter = CompletionCounter::new();
        let request = self.new_request(Notify::Counter(counter.clone()), writes.len());
        for (region, ptr, len, remote_addr) in writes {
            let op = Op::Write { region, ptr, len, dest, remote_addr, key, imm: None, delivery: true };
            self.post_or_queue(domain, PendingPost { request, op });
        }
        counter
    }

    fn announce(&mut self, id: u64, job: &WriterJob, i: usize) {
        let task = &job.tasks[i];
        let l = job.landing.as_ref().expect("landing destination");
        let header = ChunkHeader::for_chunk(
            id,
            l.dst_base,
            job.chunks.len() as u32,
            l.total,
            l.imm,
            task.landing_slot.expect("a landing chunk has its slot"),
            &job.chunks[task.chunk],
        );
        let receiver = l.receiver;
        self.send_staging(receiver, &Control::StageChunk { writer: self.staged.nonce, header });
    }

    /// A staging control message arrived (see `epoch::Control`).
    pub(super) fn on_staging_control(&mut self, msg: Control) {
        match msg {
            Control::StageAsk { writer, request, reply_to, tag, chunks, dst_base } => {
                self.on_stage_ask((writer, request), &reply_to, tag, chunks, dst_base)
            }
            Control::StageChunk { writer, header } => self.on_stage_chunk((writer, header.request), header),
            Control::StageCredit { request, drained, granted, error } => {
                self.on_stage_credit(request, drained, granted, error)
            }
            Control::StageCancel { writer, request } => self.on_stage_cancel((writer, request)),
            Control::Readmit { .. } | Control::Counted { .. } => {
                tracing::error!("a re-admission message reached the staging handler")
            }
        }
    }

    fn on_stage_ask(&mut self, key: RequestKey, reply_to: &[u8], tag: u32, chunks: u32, dst_base: u64) {
        let reply = match self.domains[0].domain.resolve_peer(reply_to) {
            Ok(r) => r,
            Err(e) => return tracing::warn!("a staged request from an unreachable writer: {e}"),
        };
        let refuse = |this: &mut Self, why: String| {
            tracing::warn!("refused a staged request: {why}");
            let msg = Control::StageCredit { request: key.1, drained: vec![], granted: vec![], error: Some(why) };
            this.send_staging(reply, &msg);
        };
        if self.staged.inbound.contains_key(&key) {
            return tracing::warn!("a staged request announced twice; ignored");
        }
        let host_memory = self.staged.host_memory;
        let found = self
            .regions
            .iter()
            .filter(|(id, r)| {
                **id != LANDING_REGION
                    && **id != BOUNCE_REGION
                    && r.ptr as u64 == dst_base
                    && (matches!(r.kind, MemoryKind::Cuda(_)) || host_memory)
            })
            .max_by_key(|(_, r)| r.len)
            .map(|(id, r)| (*id, r.len as u64, r.kind));
        let Some((region, region_len, kind)) = found else {
            return refuse(self, format!("no region registered at {dst_base:#x} here (unregistered?)"));
        };
        let Some(landing) = self.staged.landing.as_mut() else {
            return refuse(self, "this engine has no landing area".into());
        };
        if let Err(e) = landing.grants.ask(key, chunks) {
            return refuse(self, e.to_string());
        }
        let job = InboundJob {
            reply_to: reply,
            chunks,
            tag,
            region,
            dst_ptr: dst_base,
            kind,
            region_len,
            reassembly: None,
            copying: 0,
            holding: 0,
            last_activity: Instant::now(),
            drained: Vec::new(),
            granted: Vec::new(),
            complete: false,
            failed: false,
        };
        self.staged.inbound.insert(key, job);
    }

    /// The writer gave up on a request: free its slots (copies running finish on their own).
    fn on_stage_cancel(&mut self, key: RequestKey) {
        let Some(job) = self.staged.inbound.get_mut(&key) else { return };
        if job.complete {
            return;
        }
        job.failed = true;
        job.drained.clear();
        job.granted.clear();
        if let Some(l) = self.staged.landing.as_mut() {
            l.grants.forget(key);
        }
    }

    /// Fails an incoming request: tells its writer why, frees the slots it holds.
    fn fail_inbound(&mut self, key: RequestKey, why: String) {
        let Some(job) = self.staged.inbound.get_mut(&key) else { return };
        if job.failed || job.complete {
            return;
        }
        job.failed = true;
        job.drained.clear();
        job.granted.clear();
        let reply = job.reply_to;
        tracing::warn!("a staged request failed here: {why}");
        if let Some(l) = self.staged.landing.as_mut() {
            l.grants.forget(key);
        }
        let why: String = why.chars().take(512).collect();
        self.send_staging(
            reply,
            &Control::StageCredit { request: key.1, drained: vec![], granted: vec![], error: Some(why) },
        );
    }

    fn on_stage_chunk(&mut self, key: RequestKey, header: ChunkHeader) {
        let Some(job) = self.staged.inbound.get_mut(&key) else {
            return tracing::warn!("a staged chunk of no request in progress here (timed out?); ignored");
        };
        if job.failed {
            return;
        }
        let (region, dst_ptr, kind) = (job.region, job.dst_ptr, job.kind);
        let landing = self.staged.landing.as_mut().expect("a request in progress implies the landing area");
        let checked = header
            .check(landing.slots, landing.chunk_bytes, job.region_len)
            .and_then(|()| {
                if header.dst_base != dst_ptr || header.chunks != job.chunks {
                    return Err(FabricError::InvalidDescriptor("a chunk that does not match its request".into()));
                }
                job.reassembly.get_or_insert_with(|| Reassembly::new(&header)).admit(&header)
            })
            .and_then(|()| landing.grants.fill(header.slot, key));
        let slot_base = landing.memory.ptr() as u64 + u64::from(header.slot) * landing.chunk_bytes;
        if let Err(e) = checked {
            return self.fail_inbound(key, format!("refused an announced chunk: {e}"));
        }
        if self.regions.get(&region).is_none_or(|r| r.ptr as u64 != dst_ptr) {
            if let Some(l) = self.staged.landing.as_mut() {
                let _ = l.grants.drain(header.slot);
            }
            return self.fail_inbound(key, "the destination region was unregistered".into());
        }
        let pieces: Vec<(u64, u64, u64)> =
            header.pieces.iter().map(|p| (dst_ptr + p.dst_offset, slot_base + p.slot_offset, p.len)).collect();
        // SAFETY: the pieces were checked against the slot and the region, which cannot be
        // unregistered while the copy is counted in it; the slot is this chunk's until drained.
        match unsafe { self.staged.copier.copy(kind, Direction::FromStaging, &pieces) } {
            Ok(copying) => {
                let job = self.staged.inbound.get_mut(&key).expect("present");
                job.copying += 1;
                job.holding = job.holding.saturating_sub(1);
                job.last_activity = Instant::now();
                self.track_region(region, 1);
                self.staged.copies_in.push(InboundCopy { key, header, copying });
            }
            Err(e) => {
                // The slot holds a chunk nobody copies: drain it so it serves others.
                if let Some(l) = self.staged.landing.as_mut() {
                    let _ = l.grants.drain(header.slot);
                }
                self.fail_inbound(key, format!("copying a staged chunk into place failed: {e}"));
            }
        }
    }

    fn advance_inbound(&mut self) -> bool {
        let mut active = false;
        let mut i = 0;
        while i < self.staged.copies_in.len() {
            let done = self.staged.copies_in[i].copying.is_done();
            if matches!(done, Ok(false)) {
                i += 1;
                continue;
            }
            active = true;
            let InboundCopy { key, header, .. } = self.staged.copies_in.swap_remove(i);
            if let Some(l) = self.staged.landing.as_mut() {
                if let Err(e) = l.grants.drain(header.slot) {
                    tracing::error!("staging landing slot bookkeeping: {e}");
                }
            }
            let Some(job) = self.staged.inbound.get_mut(&key) else { continue };
            job.copying -= 1;
            job.last_activity = Instant::now();
            let region = job.region;
            self.track_region(region, -1);
            let job = self.staged.inbound.get_mut(&key).expect("present");
            if let Err(e) = done {
                self.fail_inbound(key, format!("copying a staged chunk into place failed: {e}"));
                continue;
            }
            if job.failed {
                continue;
            }
            job.drained.push(header.slot);
            StagingCounters::add(&self.staged.counters.landed_bytes, header.pieces.iter().map(|p| p.len).sum());
            let accepted = job.reassembly.as_mut().expect("admitted before copying").accept(&header);
            match accepted {
                Ok(Progress::Complete { imm }) => {
                    job.complete = true;
                    StagingCounters::add(&self.staged.counters.requests_landed, 1);
                    if let Some(imm) = imm {
                        let tag = job.tag;
                        self.on_remote_imm(cq_data(tag, imm));
                    }
                }
                Ok(Progress::Partial { .. }) => {}
                Err(e) => self.fail_inbound(key, format!("a staged chunk did not fit its request: {e}")),
            }
        }
        if let Some(l) = self.staged.landing.as_mut() {
            for (key, slot) in l.grants.dispense() {
                if let Some(job) = self.staged.inbound.get_mut(&key) {
                    job.granted.push(slot);
                    job.holding += 1;
                    job.last_activity = Instant::now();
                }
            }
        }
        let keys: Vec<RequestKey> = self.staged.inbound.keys().copied().collect();
        for key in keys {
            let job = self.staged.inbound.get_mut(&key).expect("listed");
            if !job.drained.is_empty() || !job.granted.is_empty() {
                active = true;
                let (drained, granted, reply) =
                    (std::mem::take(&mut job.drained), std::mem::take(&mut job.granted), job.reply_to);
                let parts = drained.len().max(granted.len()).div_ceil(CREDITS_PER_MESSAGE);
                for p in 0..parts {
                    let range = |v: &[u32]| {
                        v.iter().skip(p * CREDITS_PER_MESSAGE).take(CREDITS_PER_MESSAGE).copied().collect::<Vec<u32>>()
                    };
                    let msg = Control::StageCredit {
                        request: key.1,
                        drained: range(&drained),
                        granted: range(&granted),
                        error: None,
                    };
                    self.send_staging(reply, &msg);
                }
            }
            let job = &self.staged.inbound[&key];
            if (job.complete || job.failed) && job.copying == 0 {
                if let Some(l) = self.staged.landing.as_mut() {
                    l.grants.forget(key);
                }
                self.staged.inbound.remove(&key);
            }
        }
        active
    }

    /// Drops incoming requests whose writer went silent for `transfer_timeout` while holding
    /// granted slots (one still waiting for slots holds nothing: it gets its turn first).
    fn expire_inbound(&mut self) {
        let timeout = self.transfer_timeout;
        let silent: HashSet<u64> = self
            .staged
            .inbound
            .iter()
            .filter(|(_, j)| j.holding > 0 && j.copying == 0 && !j.complete && j.last_activity.elapsed() > timeout)
            .map(|(k, _)| k.0)
            .collect();
        if silent.is_empty() {
            return;
        }
        // A writer silent that long on slots it holds is gone (its own requests timed out
        // by now): its requests still waiting for slots go too, or they would take the freed
        // slots in turn and hold them for another timeout each.
        let gone: Vec<RequestKey> = self
            .staged
            .inbound
            .iter()
            .filter(|(k, j)| silent.contains(&k.0) && j.copying == 0 && !j.complete)
            .map(|(k, _)| *k)
            .collect();
        tracing::warn!(
            "dropping {} staged requests of a writer that sent nothing for {timeout:?} on slots it holds",
            gone.len()
        );
        for key in gone {
            // Quietly: messages to a writer that is gone would only hold send buffers.
            if let Some(l) = self.staged.landing.as_mut() {
                l.grants.forget(key);
            }
            self.staged.inbound.remove(&key);
        }
    }

    fn on_stage_credit(&mut self, request: u64, drained: Vec<u32>, granted: Vec<u32>, error: Option<String>) {
        let Some(mut job) = self.staged.writes.remove(&request) else { return };
        if let Some(why) = error {
            let e = FabricError::TransferFailed(format!("the receiver failed the staged write: {why}"));
            self.kill_job(request, &mut job, e);
        } else if !job.dead {
            for slot in drained {
                let found =
                    job.tasks.iter().position(|t| t.landing_slot == Some(slot) && matches!(t.stage, Stage::Announced));
                match found {
                    Some(i) => {
                        job.tasks.swap_remove(i);
                        if let Some(l) = job.landing.as_mut() {
                            l.drained += 1;
                        }
                        self.finish(request, Ok(()));
                    }
                    None => tracing::warn!("a drained credit for landing slot {slot} that holds no chunk of ours"),
                }
            }
            if let Some(l) = job.landing.as_mut() {
                l.granted.extend(granted);
            }
        }
        self.staged.writes.insert(request, job);
    }
}
