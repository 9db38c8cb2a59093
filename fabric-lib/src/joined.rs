//! One request carried out as several worker requests (a scatter whose targets take different
//! paths): the caller's completion runs exactly once, after every part reported, with the first
//! error.
use std::sync::Arc;

use parking_lot::Mutex;

use crate::completion::Notify;
use crate::error::{FabricError, Result};

struct State {
    /// Parts not reported yet, plus one for the submitter until [`Joined::release`].
    remaining: usize,
    first_error: Option<FabricError>,
    /// A part was dropped without an outcome (its command never reached the worker).
    abandoned: bool,
    on_done: Option<Notify>,
}

impl State {
    /// Counts one report; the caller's completion once it was the last.
    fn settle(&mut self) -> Option<(Notify, Result<()>)> {
        self.remaining -= 1;
        if self.remaining > 0 {
            return None;
        }
        let result = match (self.first_error.take(), self.abandoned) {
            (Some(e), _) => Err(e),
            (None, true) => Err(FabricError::Stopped),
            (None, false) => Ok(()),
        };
        self.on_done.take().map(|n| (n, result))
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
        if let Some((on_done, result)) = settled {
            on_done.now(result);
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
    pub fn new(on_done: Notify) -> Self {
        let state = State { remaining: 1, first_error: None, abandoned: false, on_done: Some(on_done) };
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

    /// Every part is queued (or abandoned): the completion runs once the last one reported.
    pub fn release(self) {
        let settled = self.state.lock().settle();
        if let Some((on_done, result)) = settled {
            on_done.now(result);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
    use crate::completion::CompletionCounter;

    fn joined() -> (Joined, mpsc::Receiver<Result<()>>) {
        let (tx, rx) = mpsc::channel();
        (Joined::new(Notify::Callback(Box::new(move |r| tx.send(r).unwrap()))), rx)
    }

    fn run(n: Notify, result: Result<()>) {
        n.now(result)
    }

    #[test]
    fn reports_once_after_the_last_part_from_any_thread() {
        for parts in [1usize, 2, 7, 64] {
            let (join, rx) = joined();
            let notifies: Vec<Notify> = (0..parts).map(|_| join.part()).collect();
            join.release();
            let threads: Vec<_> = notifies.into_iter().map(|n| std::thread::spawn(move || run(n, Ok(())))).collect();
            for t in threads {
                t.join().unwrap();
            }
            assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), Ok(()));
            assert!(rx.try_recv().is_err(), "reported more than once");
        }
    }

    #[test]
    fn waits_for_the_submitter_and_keeps_the_first_error() {
        let (join, rx) = joined();
        let (a, b, c) = (join.part(), join.part(), join.part());
        run(a, Ok(()));
        run(b, Err(FabricError::Timeout("first".into())));
        run(c, Err(FabricError::TransferFailed("second".into())));
        assert!(rx.try_recv().is_err(), "reported before the submitter released it");
        join.release();
        assert_eq!(rx.try_recv().unwrap(), Err(FabricError::Timeout("first".into())));
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn a_part_dropped_unreported_fails_the_request_with_the_recorded_cause() {
        let (join, rx) = joined();
        let (a, b) = (join.part(), join.part());
        run(a, Ok(()));
        drop(b); // its command never reached the worker
        join.fail(FabricError::Timeout("the worker's command queue stayed full".into()));
        join.release();
        assert!(matches!(rx.try_recv().unwrap(), Err(FabricError::Timeout(m)) if m.contains("queue")));
        // Without a recorded cause: stopped.
        let (join, rx) = joined();
        drop(join.part());
        join.release();
        assert_eq!(rx.try_recv().unwrap(), Err(FabricError::Stopped));
    }

    #[test]
    fn a_cancelled_request_never_reports() {
        let (join, rx) = joined();
        let parts: Vec<Notify> = (0..3).map(|_| join.part()).collect();
        join.cancel();
        drop(parts);
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn reports_into_a_counter_too() {
        let counter = CompletionCounter::new();
        let join = Joined::new(Notify::Counter(counter.clone()));
        let parts: Vec<Notify> = (0..4).map(|_| join.part()).collect();
        join.release();
        for (i, p) in parts.into_iter().enumerate() {
            assert_eq!(counter.done(), 0);
            run(p, if i == 2 { Err(FabricError::Stopped) } else { Ok(()) });
        }
        assert_eq!((counter.done(), counter.failed()), (1, 1));
    }
}
