//! One request carried out as several worker requests (a scatter whose targets take different
//! paths): the caller's completion runs exactly once, after every part reported, with the first
//! error, and on the callback thread like every completion (the last part's report runs there;
//! a completion settled anywhere else is queued to it).
use std::sync::Arc;

use parking_lot::Mutex;

use crate::callback::CallbackQueue;
use crate::completion::Notify;
use crate::error::{FabricError, Result};

struct State {
    /// Parts not reported yet, plus one for the submitter until [`Joined::release`].
    remaining: usize,
    first_error: Option<FabricError>,
    /// A part was dropped without an outcome (its command never reached the worker).
    abandoned: bool,
    on_done: Option<Notify>,
    callbacks: CallbackQueue,
}

impl State {
    /// Counts one report; the caller's completion once it was the last.
    fn settle(&mut self) -> Option<Settled> {
        self.remaining -= 1;
        if self.remaining > 0 {
            return None;
        }
        let result = match (self.first_error.take(), self.abandoned) {
            (Some(e), _) => Err(e),
            (None, true) => Err(FabricError::Stopped),
            (None, false) => Ok(()),
        };
        self.on_done.take().map(|on_done| Settled { on_done, result, callbacks: self.callbacks.clone() })
    }
}

/// A completion ready to run.
struct Settled {
    on_done: Notify,
    result: Result<()>,
    callbacks: CallbackQueue,
}

impl Settled {
    /// Runs it here if this is the callback thread (a part's completion), else queues it there.
    fn run(self, on_callback_thread: bool) {
        match self.on_done {
            Notify::Callback(cb) if !on_callback_thread => {
                let result = self.result;
                self.callbacks.push_or_run(Box::new(move || cb(result)));
            }
            on_done => on_done.now(self.result),
        }
    }
}

/// The caller's completion, shared by the parts of one request.
pub(crate) struct Joined {
    state: Arc<Mutex<State>>,
}

/// A part's completion: reports into its [`Joined`] once, also when dropped unreported.
struct Part {
    state: Arc<Mutex<State>>,
    reported: bool,
}

impl Part {
    /// `None`: dropped without an outcome.
    fn record(&mut self, result: Option<Result<()>>) {
        self.reported = true;
        // A part's completion runs on the callback thread; a part dropped unreported anywhere.
        let on_callback_thread = result.is_some();
        let settled = {
            let mut s = self.state.lock();
            match result {
                Some(Err(e)) => {
                    s.first_error.get_or_insert(e);
                }
                Some(Ok(())) => {}
                None => s.abandoned = true,
            }
            s.settle()
        };
        // Outside the lock: the completion may run user code.
        if let Some(settled) = settled {
            settled.run(on_callback_thread);
        }
    }
}

impl Drop for Part {
    fn drop(&mut self) {
        if !self.reported {
            self.record(None);
        }
    }
}

impl Joined {
    pub fn new(on_done: Notify, callbacks: CallbackQueue) -> Self {
        let state = State { remaining: 1, first_error: None, abandoned: false, on_done: Some(on_done), callbacks };
        Joined { state: Arc::new(Mutex::new(state)) }
    }

    /// The completion of one more part.
    pub fn part(&self) -> Notify {
        self.state.lock().remaining += 1;
        let mut part = Part { state: self.state.clone(), reported: false };
        Notify::Callback(Box::new(move |result| part.record(Some(result))))
    }

    /// Records an error of the request as a whole (a part that could not be queued).
    pub fn fail(&self, e: FabricError) {
        self.state.lock().first_error.get_or_insert(e);
    }

    /// Nothing was queued: the caller learns the error from the submission, and its completion
    /// never runs.
    pub fn cancel(self) {
        self.state.lock().on_done = None;
    }

    /// Every part is queued (or abandoned): the completion runs once the last one reported
    /// (queued to the callback thread if they all did already).
    pub fn release(self) {
        let settled = self.state.lock().settle();
        if let Some(settled) = settled {
            settled.run(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
    use crate::callback::CallbackThread;
    use crate::completion::CompletionCounter;

    const BOUND: Duration = Duration::from_secs(5);

    /// What a completion saw: its result and the name of the thread it ran on.
    type Seen = (Result<()>, Option<String>);

    /// A join whose completion reports what it saw.
    fn joined(callbacks: &CallbackThread) -> (Joined, mpsc::Receiver<Seen>) {
        let (tx, rx) = mpsc::channel();
        let on_done = Notify::Callback(Box::new(move |r| {
            tx.send((r, std::thread::current().name().map(str::to_owned))).unwrap();
        }));
        (Joined::new(on_done, callbacks.queue()), rx)
    }

    /// Reports a part the way the worker does: on the callback thread.
    fn report(callbacks: &CallbackThread, part: Notify, result: Result<()>) {
        callbacks.queue().push(Box::new(move || part.now(result)));
    }

    #[test]
    fn reports_once_after_the_last_part_on_the_callback_thread() {
        let callbacks = CallbackThread::spawn(std::time::Duration::ZERO).unwrap();
        for parts in [1usize, 2, 7, 64] {
            let (join, rx) = joined(&callbacks);
            let notifies: Vec<Notify> = (0..parts).map(|_| join.part()).collect();
            join.release();
            for n in notifies {
                report(&callbacks, n, Ok(()));
            }
            let (result, thread) = rx.recv_timeout(BOUND).unwrap();
            assert_eq!(result, Ok(()));
            assert_eq!(thread.as_deref(), Some("fabric-callbacks"));
            assert!(rx.recv_timeout(Duration::from_millis(50)).is_err(), "reported more than once");
        }
    }

    #[test]
    fn a_completion_settled_by_the_submitter_still_runs_on_the_callback_thread() {
        let callbacks = CallbackThread::spawn(std::time::Duration::ZERO).unwrap();
        let (join, rx) = joined(&callbacks);
        let (a, b, c) = (join.part(), join.part(), join.part());
        // Every part finished before the submitter let go: the release settles it.
        a.now(Ok(()));
        b.now(Err(FabricError::Timeout("first".into())));
        c.now(Err(FabricError::TransferFailed("second".into())));
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err(), "reported before the release");
        join.release();
        let (result, thread) = rx.recv_timeout(BOUND).unwrap();
        assert_eq!(result, Err(FabricError::Timeout("first".into())), "the first error");
        assert_eq!(thread.as_deref(), Some("fabric-callbacks"));
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err());
    }

    #[test]
    fn a_part_dropped_unreported_fails_the_request_with_the_recorded_cause() {
        let callbacks = CallbackThread::spawn(std::time::Duration::ZERO).unwrap();
        let (join, rx) = joined(&callbacks);
        let (a, b) = (join.part(), join.part());
        report(&callbacks, a, Ok(()));
        drop(b); // its command never reached the worker
        join.fail(FabricError::Timeout("the worker's command queue stayed full".into()));
        join.release();
        let (result, _) = rx.recv_timeout(BOUND).unwrap();
        assert!(matches!(result, Err(FabricError::Timeout(m)) if m.contains("queue")));
        // Without a recorded cause: stopped.
        let (join, rx) = joined(&callbacks);
        drop(join.part());
        join.release();
        assert_eq!(rx.recv_timeout(BOUND).unwrap().0, Err(FabricError::Stopped));
    }

    #[test]
    fn a_cancelled_request_never_reports() {
        let callbacks = CallbackThread::spawn(std::time::Duration::ZERO).unwrap();
        let (join, rx) = joined(&callbacks);
        let parts: Vec<Notify> = (0..3).map(|_| join.part()).collect();
        join.cancel();
        drop(parts);
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err());
    }

    #[test]
    fn the_completion_runs_even_when_the_callback_thread_is_gone() {
        let callbacks = CallbackThread::spawn(std::time::Duration::ZERO).unwrap();
        let (join, rx) = joined(&callbacks);
        let part = join.part();
        callbacks.shutdown(BOUND);
        part.now(Ok(()));
        join.release();
        assert_eq!(rx.recv_timeout(BOUND).unwrap().0, Ok(()));
    }

    #[test]
    fn reports_into_a_counter_too() {
        let callbacks = CallbackThread::spawn(std::time::Duration::ZERO).unwrap();
        let counter = CompletionCounter::new();
        let join = Joined::new(Notify::Counter(counter.clone()), callbacks.queue());
        let parts: Vec<Notify> = (0..4).map(|_| join.part()).collect();
        join.release();
        for (i, p) in parts.into_iter().enumerate() {
            assert_eq!(counter.done(), 0);
            p.now(if i == 2 { Err(FabricError::Stopped) } else { Ok(()) });
        }
        assert_eq!((counter.done(), counter.failed()), (1, 1));
    }
}
