//! Worker tasks: an application's polling work run on the engine's worker thread itself, once
//! per round of its loop, right after the worker read the provider's completions and counted
//! the immediates they carried. What a task submits to this same engine from `poll` is planned
//! and posted at once, on that thread: no command queue and no other thread's round to wait
//! for between a task noticing something and its write reaching the provider (the all-to-all's
//! CPU proxy, which reacts to GPU signals in host memory, runs this way).
use std::sync::atomic::Ordering;

use crossbeam_channel::bounded;

use super::TransferEngine;
use crate::commands::Command;
use crate::error::{FabricError, Result};

/// Work run on the engine's worker thread (see [`TransferEngine::attach_task`]).
///
/// `poll` must return quickly and never block: the engine moves nothing while it runs. Requests
/// it submits to the engine that runs it are posted before the call returns to it; waiting for
/// their completion from `poll` would wait forever (the worker completes them between polls),
/// and so would `stop()` of that engine (it waits for the worker, up to the command timeout).
pub trait WorkerTask: Send + 'static {
    /// One poll; returns whether it did anything (the worker's idle accounting counts it as
    /// activity).
    fn poll(&mut self) -> bool;
}

/// An attached task (see [`TransferEngine::attach_task`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TaskId(pub u64);

impl TransferEngine {
    /// Attaches `task` to the worker, which polls it once per round from then on. The worker
    /// drops it when it is detached, when it panics (logged), or when the engine stops. A task
    /// that holds the engine itself must be detached before the engine can be dropped.
    pub fn attach_task(&self, task: Box<dyn WorkerTask>) -> Result<TaskId> {
        let id = TaskId(self.next_task.fetch_add(1, Ordering::Relaxed));
        self.command(Command::AttachTask { id, task })?;
        Ok(id)
    }

    /// Detaches a task; returns once the worker dropped it (bounded by the command timeout).
    /// From the task's own `poll`, it is dropped once that poll returned.
    pub fn detach_task(&self, id: TaskId) -> Result<()> {
        if crate::worker::running_task_of(self.id) {
            // On the worker's thread, inside a poll: no reply can be awaited there.
            let (tx, _rx) = bounded(1);
            return self.command(Command::DetachTask { id, reply: tx });
        }
        self.request(|reply| Command::DetachTask { id, reply })
    }

    /// Whether the calling thread is this engine's worker, running one of its tasks.
    pub fn in_task(&self) -> bool {
        crate::worker::running_task_of(self.id)
    }
}

/// The error a detach of an unknown task gets.
pub(crate) fn unknown_task(id: TaskId) -> FabricError {
    FabricError::InvalidArgument(format!("worker task {} is not attached", id.0))
}
