//! Running the application's tasks (see `engine::tasks`). While a task polls, this thread
//! records which engine's worker it is; the engine's `command` then hands a request straight to
//! `Worker::handle` instead of the queue, so it is posted before the task's submit returns.
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crossbeam_channel::Sender;

use super::Worker;
use crate::commands::Command;
use crate::engine::{TaskId, WorkerTask};
use crate::error::Result;

thread_local! {
    /// While a task polls on this thread: its engine's id and worker.
    static RUNNING: Cell<Option<(u64, *mut Worker)>> = const { Cell::new(None) };
}

/// Whether this thread is engine `engine`'s worker, inside a task's poll.
pub(crate) fn running_task_of(engine: u64) -> bool {
    RUNNING.with(|r| r.get()).is_some_and(|(id, _)| id == engine)
}

/// Handles `cmd` on this thread if it is engine `engine`'s worker running a task; else gives
/// the command back (for the queue).
pub(crate) fn handle_inline(engine: u64, cmd: Command) -> Option<Command> {
    match RUNNING.with(|r| r.get()) {
        Some((id, worker)) if id == engine => {
            // SAFETY: `run_tasks` set this pointer from its `&mut Worker` on this thread and
            // clears it before using the worker again; meanwhile only the task runs, and it
            // reaches the worker only through here (tasks are moved out of the worker first).
            let worker = unsafe { &mut *worker };
            if !worker.handle(cmd) {
                worker.tasks.stop = true;
            }
            None
        }
        _ => Some(cmd),
    }
}

/// Attached tasks, and what arrived for them while they were being polled.
#[derive(Default)]
pub(super) struct Tasks {
    attached: Vec<(TaskId, Box<dyn WorkerTask>)>,
    /// Detaches asked for from inside a poll (the task list is out of the worker then).
    detach_later: Vec<(TaskId, Sender<Result<()>>)>,
    /// A task stopped the engine.
    pub stop: bool,
    polling: bool,
}

impl Tasks {
    pub fn is_empty(&self) -> bool {
        self.attached.is_empty()
    }
}

/// Restores the thread's previous task marker, also when a poll panics.
struct Marker(Option<(u64, *mut Worker)>);

impl Drop for Marker {
    fn drop(&mut self) {
        RUNNING.with(|r| r.set(self.0));
    }
}

impl Worker {
    pub(super) fn attach_task(&mut self, id: TaskId, task: Box<dyn WorkerTask>) {
        self.tasks.attached.push((id, task));
    }

    pub(super) fn detach_task(&mut self, id: TaskId, reply: Sender<Result<()>>) {
        if self.tasks.polling {
            self.tasks.detach_later.push((id, reply));
            return;
        }
        let result = match self.tasks.attached.iter().position(|(t, _)| *t == id) {
            Some(i) => {
                drop(self.tasks.attached.remove(i));
                Ok(())
            }
            None => Err(crate::engine::unknown_task(id)),
        };
        let _ = reply.send(result);
    }

    /// Polls every task once; true if any did something.
    pub(super) fn run_tasks(&mut self) -> bool {
        let mut tasks = std::mem::take(&mut self.tasks.attached);
        self.tasks.polling = true;
        let me = (self.engine_id, self as *mut Worker);
        let marker = Marker(RUNNING.with(|r| r.replace(Some(me))));
        let mut active = false;
        tasks.retain_mut(|(id, task)| match catch_unwind(AssertUnwindSafe(|| task.poll())) {
            Ok(a) => {
                active |= a;
                true
            }
            Err(_) => {
                tracing::error!("worker task {} panicked; it is detached", id.0);
                false
            }
        });
        drop(marker);
        self.tasks.polling = false;
        // Tasks attached during the polls run from the next round.
        tasks.append(&mut self.tasks.attached);
        self.tasks.attached = tasks;
        for (id, reply) in std::mem::take(&mut self.tasks.detach_later) {
            self.detach_task(id, reply);
        }
        active
    }
}
