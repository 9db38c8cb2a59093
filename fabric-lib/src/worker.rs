//! The worker: one thread per device that solely owns the device's domain, posts operations,
//! drives progress, counts immediates and hands completions to the callback thread.
//!
//! No locks on the data path: commands arrive on a bounded channel, completions leave on the
//! callback queue, and the ImmCounter table is updated once per completion batch.
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender, TryRecvError};

use crate::callback::CallbackQueue;
use crate::config::{EngineConfig, PollMode};
use crate::error::{FabricError, Result};
use crate::imm_counter::ImmCounterTable;
use crate::msg_buffers::MsgBuffers;
use crate::provider::libfabric::{Completion, LibfabricDomain, LocalMr, OpContext, OpKind, Posted};
use crate::provider::libfabric::ProviderSpec;

/// Completion callback of one request.
pub type OnDone = Box<dyn FnOnce(Result<()>) + Send + 'static>;
/// Receives every two-sided message.
pub type RecvCallback = Arc<dyn Fn(Vec<u8>) + Send + Sync + 'static>;

/// Region id of the worker's scratch buffer (source of zero-byte immediate writes).
pub(crate) const SCRATCH_REGION: u64 = 0;
/// Messages kept while no receive callback is installed; older ones are dropped past this.
const UNDELIVERED_LIMIT: usize = 4096;

/// A write, validated by the engine.
pub(crate) struct WriteCommand {
    pub region: u64,
    pub src_offset: usize,
    pub len: usize,
    pub peer: Vec<u8>,
    pub remote_addr: u64,
    pub key: u64,
    pub imm: Option<u32>,
    pub on_done: OnDone,
}

/// A two-sided message, validated by the engine.
pub(crate) struct SendCommand {
    pub peer: Vec<u8>,
    pub data: Vec<u8>,
    pub on_done: OnDone,
}

/// The result of registering memory on the worker's domain.
pub(crate) struct Registered {
    pub key: u64,
    pub remote_base: u64,
}

pub(crate) enum Command {
    Register { region: u64, ptr: usize, len: usize, reply: Sender<Result<Registered>> },
    Unregister { region: u64, reply: Sender<Result<()>> },
    Write(WriteCommand),
    Send(SendCommand),
    SetRecvCallback(Option<RecvCallback>),
    Stop,
}

/// What the worker reports once its domain is open.
pub(crate) struct WorkerInfo {
    pub address: Vec<u8>,
    pub provider: String,
    pub domain: String,
}

struct Region {
    mr: LocalMr,
    ptr: usize,
    /// Posted operations that read from this region and have not completed.
    in_flight: usize,
}

struct Request {
    remaining: u32,
    error: Option<FabricError>,
    on_done: OnDone,
}

enum Op {
    Write { region: u64, ptr: usize, len: usize, dest: u64, remote_addr: u64, key: u64, imm: Option<u32> },
    Send { slot: usize, len: usize, dest: u64 },
}

struct PendingPost {
    request: u64,
    op: Op,
}

/// Starts a worker thread and waits (bounded) until its domain is open.
pub(crate) fn spawn(
    config: &EngineConfig,
    imm: Arc<ImmCounterTable>,
    callbacks: CallbackQueue,
) -> Result<(Sender<Command>, JoinHandle<()>, WorkerInfo)> {
    let (tx, rx) = bounded::<Command>(config.queue_depth.max(1));
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
            match Worker::open(&config, rx, imm, callbacks) {
                Ok(worker) => {
                    let info = WorkerInfo {
                        address: worker.domain.address().to_vec(),
                        provider: worker.domain.provider_name(),
                        domain: worker.domain.domain_name(),
                    };
                    let _ = ready_tx.send(Ok(info));
                    worker.run();
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| FabricError::InvalidArgument(format!("cannot spawn the worker thread: {e}")))?;
    let info = ready_rx
        .recv_timeout(timeout)
        .map_err(|_| FabricError::Timeout(format!("worker did not open its domain within {timeout:?}")))??;
    Ok((tx, handle, info))
}

struct Worker {
    rx: Receiver<Command>,
    imm: Arc<ImmCounterTable>,
    callbacks: CallbackQueue,
    poll_mode: PollMode,
    transfer_timeout: Duration,

    regions: HashMap<u64, Region>,
    scratch: MsgBuffers,
    send_buffers: MsgBuffers,
    free_send_slots: Vec<usize>,
    recv_buffers: MsgBuffers,
    recv_contexts: Vec<Box<OpContext>>,
    recv_to_post: Vec<usize>,
    recv_callback: Option<RecvCallback>,
    undelivered: VecDeque<Vec<u8>>,

    requests: HashMap<u64, Request>,
    next_request: u64,
    deadlines: VecDeque<(Instant, u64)>,
    pending: VecDeque<PendingPost>,
    waiting_sends: VecDeque<(u64, u64, Vec<u8>)>,
    outstanding: HashSet<usize>,
    completions: Vec<Completion>,
    imm_batch: HashMap<u32, u32>,

    // Last: every registration above holds the domain alive and is closed before it.
    domain: LibfabricDomain,
}

impl Worker {
    fn open(config: &EngineConfig, rx: Receiver<Command>, imm: Arc<ImmCounterTable>, callbacks: CallbackQueue) -> Result<Self> {
        let spec: &ProviderSpec = &config.provider;
        let mut domain = LibfabricDomain::open(spec)?;
        let scratch = MsgBuffers::new(&mut domain, 1, 64)?;
        let send_buffers = MsgBuffers::new(&mut domain, config.send_buffers.max(1), config.max_message_size)?;
        let recv_count = config.recv_buffers.max(1);
        let recv_buffers = MsgBuffers::new(&mut domain, recv_count, config.max_message_size)?;
        let mut worker = Worker {
            rx,
            imm,
            callbacks,
            poll_mode: config.poll_mode,
            transfer_timeout: config.transfer_timeout,
            regions: HashMap::new(),
            scratch,
            free_send_slots: (0..config.send_buffers.max(1)).rev().collect(),
            send_buffers,
            recv_contexts: (0..recv_count).map(|slot| OpContext::new(OpKind::Recv { slot })).collect(),
            recv_buffers,
            recv_to_post: (0..recv_count).collect(),
            recv_callback: None,
            undelivered: VecDeque::new(),
            requests: HashMap::new(),
            next_request: 1,
            deadlines: VecDeque::new(),
            pending: VecDeque::new(),
            waiting_sends: VecDeque::new(),
            outstanding: HashSet::new(),
            completions: Vec::with_capacity(crate::provider::libfabric::CQ_BATCH),
            imm_batch: HashMap::new(),
            domain,
        };
        worker.post_receives()?;
        Ok(worker)
    }

    fn run(mut self) {
        let mut last_active = Instant::now();
        let mut iterations: u32 = 0;
        loop {
            let mut active = false;
            for _ in 0..64 {
                match self.rx.try_recv() {
                    Ok(cmd) => {
                        active = true;
                        if !self.handle(cmd) {
                            return self.shutdown();
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return self.shutdown(),
                }
            }
            active |= self.progress();
            iterations = iterations.wrapping_add(1);
            if iterations % 256 == 0 || !active {
                self.expire_requests();
            }
            if active {
                last_active = Instant::now();
                continue;
            }
            let busy = !self.outstanding.is_empty() || !self.pending.is_empty();
            match self.poll_mode {
                PollMode::Adaptive { spin, park } if !busy && last_active.elapsed() > spin => {
                    match self.rx.recv_timeout(park) {
                        Ok(cmd) => {
                            last_active = Instant::now();
                            if !self.handle(cmd) {
                                return self.shutdown();
                            }
                        }
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => return self.shutdown(),
                    }
                }
                _ => std::hint::spin_loop(),
            }
        }
    }

    /// Handles one command; false means stop.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Register { region, ptr, len, reply } => {
                let result = self.domain.register(ptr as *mut u8, len).map(|mr| {
                    let out = Registered { key: mr.key(), remote_base: mr.remote_base() };
                    self.regions.insert(region, Region { mr, ptr, in_flight: 0 });
                    out
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
            Command::Write(cmd) => self.start_write(cmd),
            Command::Send(cmd) => self.start_send(cmd),
            Command::SetRecvCallback(cb) => {
                self.recv_callback = cb;
                if let Some(cb) = &self.recv_callback {
                    for msg in self.undelivered.drain(..) {
                        let cb = cb.clone();
                        self.callbacks.push(Box::new(move || cb(msg)));
                    }
                }
            }
            Command::Stop => return false,
        }
        true
    }

    fn new_request(&mut self, on_done: OnDone) -> u64 {
        let id = self.next_request;
        self.next_request += 1;
        self.requests.insert(id, Request { remaining: 1, error: None, on_done });
        self.deadlines.push_back((Instant::now() + self.transfer_timeout, id));
        id
    }

    fn start_write(&mut self, cmd: WriteCommand) {
        let id = self.new_request(cmd.on_done);
        let ptr = if cmd.region == SCRATCH_REGION {
            self.scratch.slot_ptr(0) as usize
        } else {
            match self.regions.get(&cmd.region) {
                Some(r) => r.ptr + cmd.src_offset,
                None => {
                    let e = FabricError::InvalidArgument(format!("memory handle {} was unregistered", cmd.region));
                    return self.finish(id, Err(e));
                }
            }
        };
        let dest = match self.domain.resolve_peer(&cmd.peer) {
            Ok(d) => d,
            Err(e) => return self.finish(id, Err(e)),
        };
        let op = Op::Write { region: cmd.region, ptr, len: cmd.len, dest, remote_addr: cmd.remote_addr, key: cmd.key, imm: cmd.imm };
        self.post_or_queue(PendingPost { request: id, op });
    }

    fn start_send(&mut self, cmd: SendCommand) {
        let SendCommand { peer, data, on_done } = cmd;
        let id = self.new_request(on_done);
        match self.domain.resolve_peer(&peer) {
            Ok(dest) => self.queue_send(id, dest, data),
            Err(e) => self.finish(id, Err(e)),
        }
    }

    /// Copies a message into a free send buffer and posts it, or waits for a buffer.
    fn queue_send(&mut self, request: u64, dest: u64, data: Vec<u8>) {
        match self.free_send_slots.pop() {
            Some(slot) => {
                self.send_buffers.fill(slot, &data);
                self.post_or_queue(PendingPost { request, op: Op::Send { slot, len: data.len(), dest } });
            }
            None => self.waiting_sends.push_back((request, dest, data)),
        }
    }

    fn post_or_queue(&mut self, post: PendingPost) {
        if !self.pending.is_empty() {
            self.pending.push_back(post);
            return;
        }
        match self.try_post(&post) {
            Ok(true) => {}
            Ok(false) => self.pending.push_back(post),
            Err(e) => self.fail_post(post, e),
        }
    }

    fn fail_post(&mut self, post: PendingPost, e: FabricError) {
        if let Op::Send { slot, .. } = post.op {
            self.release_send_slot(slot);
        }
        self.finish(post.request, Err(e));
    }

    /// Posts one operation; Ok(false) when the provider asks us to retry later.
    fn try_post(&mut self, post: &PendingPost) -> Result<bool> {
        let (kind, region) = match post.op {
            Op::Write { region, .. } => (OpKind::Write { request: post.request, region }, Some(region)),
            Op::Send { slot, .. } => (OpKind::Send { request: post.request, slot }, None),
        };
        let context = Box::into_raw(OpContext::new(kind));
        // SAFETY: the source memory is registered (regions keep their MR until no operation is
        // in flight; buffers live as long as the worker) and `context` stays allocated until its
        // completion is read or the worker shuts down.
        let posted = unsafe {
            match post.op {
                Op::Write { region, ptr, len, dest, remote_addr, key, imm } => {
                    let desc = if region == SCRATCH_REGION { self.scratch.desc() } else { self.regions[&region].mr.desc() };
                    self.domain.post_write(ptr as *const u8, len, desc, dest, remote_addr, key, imm, context)
                }
                Op::Send { slot, len, dest } => {
                    let ptr = self.send_buffers.slot_ptr(slot);
                    let desc = self.send_buffers.desc();
                    self.domain.post_send(ptr, len, desc, dest, context)
                }
            }
        };
        match posted {
            Ok(Posted::Ok) => {
                self.outstanding.insert(context as usize);
                if let Some(r) = region.and_then(|r| self.regions.get_mut(&r)) {
                    r.in_flight += 1;
                }
                Ok(true)
            }
            other => {
                // SAFETY: the provider did not take the context; we still own it.
                drop(unsafe { Box::from_raw(context) });
                other.map(|_| false)
            }
        }
    }

    fn post_receives(&mut self) -> Result<()> {
        while let Some(slot) = self.recv_to_post.pop() {
            let ptr = self.recv_buffers.slot_ptr(slot);
            let len = self.recv_buffers.slot_size();
            let desc = self.recv_buffers.desc();
            let context: *mut OpContext = &mut *self.recv_contexts[slot];
            // SAFETY: the receive buffers and their contexts live as long as the worker.
            match unsafe { self.domain.post_recv(ptr, len, desc, context) }? {
                Posted::Ok => {}
                Posted::Again => {
                    self.recv_to_post.push(slot);
                    break;
                }
            }
        }
        Ok(())
    }

    /// Retries queued posts and drains the completion queue; true if anything happened.
    fn progress(&mut self) -> bool {
        let mut active = false;
        while let Some(post) = self.pending.pop_front() {
            if !self.requests.contains_key(&post.request) {
                if let Op::Send { slot, .. } = post.op {
                    self.release_send_slot(slot);
                }
                continue; // failed or timed out meanwhile
            }
            match self.try_post(&post) {
                Ok(true) => active = true,
                Ok(false) => {
                    self.pending.push_front(post);
                    break;
                }
                Err(e) => self.fail_post(post, e),
            }
        }
        if !self.recv_to_post.is_empty() {
            if let Err(e) = self.post_receives() {
                tracing::error!("re-posting receive buffers failed: {e}");
            }
        }
        let mut completions = std::mem::take(&mut self.completions);
        for _ in 0..4 {
            completions.clear();
            match self.domain.poll(&mut completions) {
                Ok(0) => break,
                Ok(_) => {
                    active = true;
                    for c in completions.drain(..) {
                        self.on_completion(c);
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
            let batch: Vec<(u32, u32)> = self.imm_batch.drain().collect();
            let events = self.imm.add_batch(&batch);
            self.callbacks.push_imm_events(events);
        }
        active
    }

    fn on_completion(&mut self, completion: Completion) {
        match completion {
            Completion::Done { context, len } => match self.take_context(context) {
                Some(OpKind::Recv { slot }) => {
                    let msg = self.recv_buffers.slot_bytes(slot, len).to_vec();
                    self.recv_to_post.push(slot);
                    self.deliver(msg);
                }
                Some(kind) => self.finish_op(kind, Ok(())),
                None => tracing::warn!("completion without a context"),
            },
            Completion::RemoteImm { imm, context } => {
                *self.imm_batch.entry(imm).or_default() += 1;
                if let Some(OpKind::Recv { slot }) = self.take_context(context) {
                    self.recv_to_post.push(slot); // FI_RX_CQ_DATA: the write consumed a receive
                }
            }
            Completion::Failed { context, message } => match self.take_context(context) {
                Some(OpKind::Recv { slot }) => {
                    tracing::warn!("a receive failed: {message}");
                    self.recv_to_post.push(slot);
                }
                Some(kind) => self.finish_op(kind, Err(FabricError::TransferFailed(message))),
                None => tracing::warn!("completion error without a context: {message}"),
            },
        }
    }

    /// Reads a completed context's kind, freeing request contexts (receive contexts are reused).
    fn take_context(&mut self, context: *mut OpContext) -> Option<OpKind> {
        if context.is_null() {
            return None;
        }
        // SAFETY: every non-null context we get back is one we posted and have not freed.
        let kind = unsafe { (*context).kind };
        if !matches!(kind, OpKind::Recv { .. }) {
            self.outstanding.remove(&(context as usize));
            // SAFETY: request contexts come from Box::into_raw and complete exactly once.
            drop(unsafe { Box::from_raw(context) });
        }
        Some(kind)
    }

    fn finish_op(&mut self, kind: OpKind, result: Result<()>) {
        match kind {
            OpKind::Write { request, region } => {
                if let Some(r) = self.regions.get_mut(&region) {
                    r.in_flight = r.in_flight.saturating_sub(1);
                }
                self.finish(request, result);
            }
            OpKind::Send { request, slot } => {
                self.release_send_slot(slot);
                self.finish(request, result);
            }
            OpKind::Recv { .. } => unreachable!("receives are handled by the caller"),
        }
    }

    /// Records one finished part of a request; completes it when all parts are done.
    fn finish(&mut self, request: u64, result: Result<()>) {
        let Some(req) = self.requests.get_mut(&request) else { return };
        if let Err(e) = result {
            req.error.get_or_insert(e);
        }
        req.remaining -= 1;
        if req.remaining == 0 {
            let req = self.requests.remove(&request).expect("present");
            let result = req.error.map_or(Ok(()), Err);
            let on_done = req.on_done;
            self.callbacks.push(Box::new(move || on_done(result)));
        }
    }

    fn deliver(&mut self, msg: Vec<u8>) {
        match &self.recv_callback {
            Some(cb) => {
                let cb = cb.clone();
                self.callbacks.push(Box::new(move || cb(msg)));
            }
            None => {
                if self.undelivered.len() == UNDELIVERED_LIMIT {
                    tracing::warn!("no receive callback installed; dropping the oldest kept message");
                    self.undelivered.pop_front();
                }
                self.undelivered.push_back(msg);
            }
        }
    }

    fn release_send_slot(&mut self, slot: usize) {
        self.free_send_slots.push(slot);
        while let Some((request, dest, data)) = self.waiting_sends.pop_front() {
            if self.requests.contains_key(&request) {
                self.queue_send(request, dest, data);
                break;
            }
        }
    }

    /// Fails requests older than the transfer timeout (a peer that stopped answering).
    fn expire_requests(&mut self) {
        let now = Instant::now();
        while let Some(&(deadline, id)) = self.deadlines.front() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_front();
            if let Some(req) = self.requests.remove(&id) {
                let timeout = self.transfer_timeout;
                let on_done = req.on_done;
                self.callbacks.push(Box::new(move || {
                    on_done(Err(FabricError::Timeout(format!("request not completed within {timeout:?} (peer unreachable?)"))))
                }));
            }
        }
    }

    /// Fails everything still in flight, closes the domain and frees leftover contexts.
    fn shutdown(mut self) {
        for (_, req) in self.requests.drain() {
            let on_done = req.on_done;
            self.callbacks.push(Box::new(move || on_done(Err(FabricError::Stopped))));
        }
        self.waiting_sends.clear();
        while let Ok(cmd) = self.rx.try_recv() {
            match cmd {
                Command::Write(WriteCommand { on_done, .. }) | Command::Send(SendCommand { on_done, .. }) => {
                    self.callbacks.push(Box::new(move || on_done(Err(FabricError::Stopped))));
                }
                Command::Register { reply, .. } => {
                    let _ = reply.send(Err(FabricError::Stopped));
                }
                Command::Unregister { reply, .. } => {
                    let _ = reply.send(Err(FabricError::Stopped));
                }
                Command::SetRecvCallback(_) | Command::Stop => {}
            }
        }
        let outstanding: Vec<usize> = self.outstanding.drain().collect();
        drop(self); // closes every registration, then the endpoint and domain
        for context in outstanding {
            // SAFETY: the endpoint is closed, so the provider no longer references these
            // contexts; each came from Box::into_raw and was never freed.
            drop(unsafe { Box::from_raw(context as *mut OpContext) });
        }
    }
}
