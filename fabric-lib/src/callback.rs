//! The callback thread: runs every user callback, so neither the worker nor the caller ever does.
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{unbounded, Receiver, Sender};
use parking_lot::Mutex;

use crate::imm_counter::ImmEvent;

/// A unit of work for the callback thread.
pub type Job = Box<dyn FnOnce() + Send + 'static>;

enum Message {
    Run(Job),
    Exit,
}

/// A cloneable handle that queues jobs on the callback thread (never blocks).
#[derive(Clone)]
pub struct CallbackQueue(Sender<Message>);

impl CallbackQueue {
    /// Queues a job; dropped silently if the thread has exited (the engine is gone).
    pub fn push(&self, job: Job) {
        let _ = self.0.send(Message::Run(job));
    }

    /// Queues a job, or runs it on this thread when the callback thread is gone (the engine
    /// stopped): for completions that must run once whatever happens.
    pub fn push_or_run(&self, job: Job) {
        if let Err(crossbeam_channel::SendError(Message::Run(job))) = self.0.send(Message::Run(job)) {
            job();
        }
    }

    /// Queues the callbacks produced by an ImmCounter update.
    pub fn push_imm_events(&self, events: Vec<ImmEvent>) {
        for event in events {
            match event {
                ImmEvent::Reached(cb) => self.push(cb),
                ImmEvent::Unclaimed(cb, imm, times) => self.push(Box::new(move || (0..times).for_each(|_| cb(imm)))),
            }
        }
    }
}

/// The thread plus its queue.
pub struct CallbackThread {
    queue: CallbackQueue,
    handle: Mutex<Option<JoinHandle<()>>>,
}

fn next(rx: &Receiver<Message>, spin: Duration) -> Option<Message> {
    if !spin.is_zero() {
        let until = std::time::Instant::now() + spin;
        let mut polls: u32 = 0;
        loop {
            match rx.try_recv() {
                Ok(m) => return Some(m),
                Err(crossbeam_channel::TryRecvError::Disconnected) => return None,
                Err(crossbeam_channel::TryRecvError::Empty) => {
                    polls = polls.wrapping_add(1);
                    if !polls.is_multiple_of(64) {
                        std::hint::spin_loop();
                    } else if std::time::Instant::now() < until {
                        std::thread::yield_now();
                    } else {
                        break;
                    }
                }
            }
        }
    }
    rx.recv().ok()
}

/// After a job, the thread polls for the next one for `spin` before it blocks (the engine's
/// `wait_spin`): the worker's next hand-off (a round trip's completion, a UVM-watcher
/// callback) then costs it no futex wake-up and the job no scheduler wake-up.
fn run(rx: Receiver<Message>, spin: Duration) {
    let mut after_job = Duration::ZERO;
    while let Some(Message::Run(job)) = next(&rx, after_job) {
        if catch_unwind(AssertUnwindSafe(job)).is_err() {
            tracing::error!("a fabric-lib callback panicked; the callback thread carries on");
        }
        after_job = spin;
    }
}

impl CallbackThread {
    /// Starts the thread; after each job it polls for the next for `spin` before it sleeps.
    pub fn spawn(spin: Duration) -> std::io::Result<Self> {
        let (tx, rx) = unbounded();
        let handle = std::thread::Builder::new().name("fabric-callbacks".into()).spawn(move || run(rx, spin))?;
        Ok(CallbackThread { queue: CallbackQueue(tx), handle: Mutex::new(Some(handle)) })
    }

    /// A handle for queueing jobs.
    pub fn queue(&self) -> CallbackQueue {
        self.queue.clone()
    }

    /// Runs what is queued, then stops the thread. Waits at most `timeout` (a callback that
    /// blocks forever leaves the thread detached rather than hanging the caller).
    pub fn shutdown(&self, timeout: Duration) {
        let Some(handle) = self.handle.lock().take() else { return };
        let _ = self.queue.0.send(Message::Exit);
        if handle.thread().id() == std::thread::current().id() {
            return; // stop() called from inside a callback: the loop exits after this job
        }
        let deadline = crate::config::deadline_after(timeout);
        while !handle.is_finished() {
            if std::time::Instant::now() >= deadline {
                tracing::warn!("callback thread still busy after {timeout:?}; detaching it");
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let _ = handle.join();
    }
}
