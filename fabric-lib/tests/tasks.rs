//! Worker tasks (`attach_task`): polled on the engine's worker thread, their requests to that
//! engine posted before the submit returns (no queue, no hand-off), over every loopback provider;
//! detaching, panicking and stopping drop the task and leave the engine serving.
mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::register;
use fabric_lib::{
    CompletionCounter, DomainChoice, FabricError, MrDescriptor, MrHandle, TransferEngine, WorkerTask, WriteRequest,
};

const TIMEOUT: Duration = Duration::from_secs(20);
const PROVIDERS: [&str; 3] = ["tcp", "udp;ofi_rxd", "shm"];
const PAGE: usize = 4096;

fn engine(provider: &str) -> Option<TransferEngine> {
    common::engine_if_available(provider, TIMEOUT)
}

/// Sets its flag when dropped (the worker let go of the task).
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < TIMEOUT, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Watches a host word like the all-to-all's proxy watches a GPU's: call `n` raised, it writes
/// page `n % pages` to the peer with immediate `n`.
struct Forwarder {
    engine: Arc<TransferEngine>,
    signal: Arc<AtomicU64>,
    done: u64,
    src: MrHandle,
    dst: MrDescriptor,
    pages: usize,
    counter: Arc<CompletionCounter>,
    /// Calls whose write the provider had taken before the submit returned, and calls polled
    /// anywhere but on this engine's worker thread.
    posted_inline: Arc<AtomicU64>,
    off_worker: Arc<AtomicU64>,
    _dropped: DropFlag,
}

impl WorkerTask for Forwarder {
    fn poll(&mut self) -> bool {
        let n = self.signal.load(Ordering::Acquire);
        if n <= self.done {
            return false;
        }
        self.done = n;
        if !self.engine.in_task() || std::thread::current().name() != Some("fabric-worker") {
            self.off_worker.fetch_add(1, Ordering::Relaxed);
        }
        let before: u64 = self.engine.domain_stats().iter().map(|s| s.ops).sum();
        let at = ((n as usize) % self.pages * PAGE) as u64;
        let req = WriteRequest {
            src: self.src,
            src_offset: at,
            len: PAGE as u64,
            dst: &self.dst,
            dst_offset: at,
            imm: Some(n as u32),
            domains: DomainChoice::Shard(1),
        };
        self.engine.submit_write_counted(&req, &self.counter).unwrap();
        let after: u64 = self.engine.domain_stats().iter().map(|s| s.ops).sum();
        if after > before {
            self.posted_inline.fetch_add(1, Ordering::Relaxed);
        }
        true
    }
}

fn a_task_forwards_each_signal_at_once(provider: &str) {
    let Some(a) = engine(provider) else { return };
    let (a, b) = (Arc::new(a), engine(provider).unwrap());
    const PAGES: usize = 4;
    const CALLS: u64 = 200;
    let mut src = vec![0u8; PAGES * PAGE];
    let mut dst = vec![0u8; PAGES * PAGE];
    let (src_h, _) = register(&a, &mut src);
    let (_, dst_desc) = register(&b, &mut dst);
    let signal = Arc::new(AtomicU64::new(0));
    let (posted_inline, off_worker) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let dropped = Arc::new(AtomicBool::new(false));
    let counter = CompletionCounter::new();
    let task = Forwarder {
        engine: a.clone(),
        signal: signal.clone(),
        done: 0,
        src: src_h,
        dst: dst_desc,
        pages: PAGES,
        counter: counter.clone(),
        posted_inline: posted_inline.clone(),
        off_worker: off_worker.clone(),
        _dropped: DropFlag(dropped.clone()),
    };
    let id = a.attach_task(Box::new(task)).unwrap();
    for n in 1..=CALLS {
        let page = (n as usize) % PAGES * PAGE;
        let fill = (n as u8).wrapping_mul(7) | 1;
        // The task reads page `n % PAGES` only after the signal below; B counted the previous
        // write from it before we get here.
        src[page..page + PAGE].fill(fill);
        signal.store(n, Ordering::Release);
        b.wait_imm_count(n as u32, 1, TIMEOUT).unwrap_or_else(|e| panic!("{provider}: call {n}: {e}"));
        assert!(dst[page..page + PAGE].iter().all(|&x| x == fill), "{provider}: call {n}'s page");
    }
    counter.wait_for(CALLS, TIMEOUT).unwrap();
    assert_eq!(off_worker.load(Ordering::Relaxed), 0, "{provider}: polled off the worker thread");
    // Through the queue none would be: the worker runs the task. A provider may push a post
    // back (EAGAIN, e.g. while a connection is set up), which the worker retries later.
    let inline = posted_inline.load(Ordering::Relaxed);
    assert!(inline >= CALLS * 9 / 10, "{provider}: {inline} of {CALLS} writes posted before their submit returned");
    assert!(!a.in_task(), "the test thread is not in a task");
    a.detach_task(id).unwrap();
    assert!(dropped.load(Ordering::SeqCst), "{provider}: detach returns once the task is dropped");
    assert!(matches!(a.detach_task(id), Err(FabricError::InvalidArgument(_))), "a second detach is refused");
    // Detached: a new signal is not forwarded.
    signal.store(CALLS + 1, Ordering::Release);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(b.imm_count((CALLS + 1) as u32), 0, "{provider}: a detached task no longer runs");
    a.unregister_memory(src_h).unwrap();
}

#[test]
fn a_task_forwards_each_signal_at_once_on_every_provider() {
    for p in PROVIDERS {
        a_task_forwards_each_signal_at_once(p);
    }
}

/// Without an engine: panics on its 100th poll. With one: detaches itself once it knows its
/// id.
struct Faulty {
    polls: u64,
    engine: Option<Arc<TransferEngine>>,
    id: Arc<AtomicU64>,
    _dropped: DropFlag,
}

impl WorkerTask for Faulty {
    fn poll(&mut self) -> bool {
        self.polls += 1;
        match &self.engine {
            None if self.polls == 100 => panic!("a task's bug"),
            Some(e) if self.id.load(Ordering::SeqCst) != 0 => {
                e.detach_task(fabric_lib::TaskId(self.id.load(Ordering::SeqCst))).unwrap()
            }
            _ => {}
        }
        false
    }
}

fn serves_a_write(a: &TransferEngine, b: &TransferEngine, imm: u32) {
    let mut src = vec![7u8; PAGE];
    let mut dst = vec![0u8; PAGE];
    let (src_h, _) = register(a, &mut src);
    let (_, dst_desc) = register(b, &mut dst);
    let counter = CompletionCounter::new();
    let req = WriteRequest {
        src: src_h,
        src_offset: 0,
        len: PAGE as u64,
        dst: &dst_desc,
        dst_offset: 0,
        imm: Some(imm),
        domains: DomainChoice::Shard(1),
    };
    a.submit_write_counted(&req, &counter).unwrap();
    counter.wait_for(1, TIMEOUT).unwrap();
    b.wait_imm_count(imm, 1, TIMEOUT).unwrap();
    assert!(dst.iter().all(|&x| x == 7));
    a.unregister_memory(src_h).unwrap();
}

#[test]
fn a_panicking_or_self_detaching_task_is_dropped_and_the_engine_keeps_serving() {
    let Some(a) = engine("tcp") else { return };
    let (a, b) = (Arc::new(a), engine("tcp").unwrap());
    let dropped = Arc::new(AtomicBool::new(false));
    let faulty = Faulty { polls: 0, engine: None, id: Arc::default(), _dropped: DropFlag(dropped.clone()) };
    let id = a.attach_task(Box::new(faulty)).unwrap();
    wait_until("the panicking task is dropped", || dropped.load(Ordering::SeqCst));
    assert!(matches!(a.detach_task(id), Err(FabricError::InvalidArgument(_))), "already gone");
    serves_a_write(&a, &b, 1);

    let dropped = Arc::new(AtomicBool::new(false));
    let own_id = Arc::new(AtomicU64::new(0));
    let task = Faulty { polls: 0, engine: Some(a.clone()), id: own_id.clone(), _dropped: DropFlag(dropped.clone()) };
    // Its id is known only once attached.
    let id = a.attach_task(Box::new(task)).unwrap();
    own_id.store(id.0, Ordering::SeqCst);
    wait_until("the task detached itself", || dropped.load(Ordering::SeqCst));
    serves_a_write(&a, &b, 2);
}

/// Does nothing; dropped with the worker.
struct Idle(#[allow(dead_code)] DropFlag);

impl WorkerTask for Idle {
    fn poll(&mut self) -> bool {
        false
    }
}

#[test]
fn stopping_the_engine_drops_its_tasks_and_refuses_new_ones() {
    let Some(a) = engine("tcp") else { return };
    let dropped = Arc::new(AtomicBool::new(false));
    a.attach_task(Box::new(Idle(DropFlag(dropped.clone())))).unwrap();
    a.stop();
    assert!(dropped.load(Ordering::SeqCst), "stop returns after the worker dropped its tasks");
    let late = Arc::new(AtomicBool::new(false));
    assert!(matches!(a.attach_task(Box::new(Idle(DropFlag(late.clone())))), Err(FabricError::Stopped)));
    assert!(late.load(Ordering::SeqCst), "a refused task is dropped");
}
