//! `Completion`: a request's outcome, set by the engine's completion callback without the GIL.
//!
//! A `submit_*` without `on_done` returns one of these (wrapped in a Python Future). The engine's
//! callback thread records the outcome under a mutex and wakes waiters; it attaches to the
//! interpreter only when a Python callback was registered (a done-callback, or a
//! `concurrent.futures.wait` on the Future). So a Future nobody watches costs the callback thread
//! no Python at all, and never contends for the GIL with the thread that submitted it.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_lib::{FabricError, OnDone, OnReached};
use parking_lot::{Condvar, Mutex};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::callbacks;
use crate::errors::to_pyerr;

enum State {
    /// Not finished; the Python callable to call once it is (with no arguments), if any.
    Pending(Option<Py<PyAny>>),
    /// Finished: `None` on success, else the error (converted to Python once, on first read).
    Done(Option<Failure>),
    /// Cancelled from Python before it finished (an expectation's Future); the outcome, should
    /// it still come, is ignored.
    Cancelled,
}

enum Failure {
    Native(FabricError),
    Python(Py<PyAny>),
}

struct Shared {
    state: Mutex<State>,
    /// Set (after `state` leaves Pending) for waiters that poll without the lock.
    settled: AtomicBool,
    finished: Condvar,
    /// How long `wait` polls before it sleeps (the engine's `wait_spin`).
    wait_spin: Duration,
}

impl Shared {
    /// Records the outcome (first one wins), wakes waiters, then calls the registered callable.
    fn finish(&self, result: Result<(), FabricError>) {
        let callback = {
            let mut state = self.state.lock();
            let State::Pending(callback) = &mut *state else { return };
            let callback = callback.take();
            *state = State::Done(result.err().map(Failure::Native));
            self.settled.store(true, Ordering::Release);
            self.finished.notify_all();
            callback
        };
        if let Some(callback) = callback {
            callbacks::call_logged(&callback, |py| Ok(PyTuple::empty(py)));
        }
    }
}

/// The outcome of one request or expectation, settled by the engine.
#[pyclass(name = "Completion", module = "fabric_lib._rust", frozen)]
pub struct PyCompletion(Arc<Shared>);

impl PyCompletion {
    fn new(wait_spin: Duration) -> Self {
        PyCompletion(Arc::new(Shared {
            state: Mutex::new(State::Pending(None)),
            settled: AtomicBool::new(false),
            finished: Condvar::new(),
            wait_spin,
        }))
    }

    /// A pending completion whose waiters poll for `wait_spin`, and the request callback that
    /// settles it.
    pub fn for_request(wait_spin: Duration) -> (Self, OnDone) {
        let completion = Self::new(wait_spin);
        let shared = completion.0.clone();
        (completion, Box::new(move |result| shared.finish(result)))
    }

    /// A pending completion and the expectation callback that settles it (successfully).
    pub fn for_expectation(wait_spin: Duration) -> (Self, OnReached) {
        let completion = Self::new(wait_spin);
        let shared = completion.0.clone();
        (completion, Box::new(move || shared.finish(Ok(()))))
    }
}

/// How often a long `Completion.wait` lets Python's signal handlers run.
const SIGNAL_CHECK: Duration = Duration::from_millis(50);

impl PyCompletion {
    /// Whether it settled by `until`: polls first (see `poll`), then sleeps on the condition.
    fn wait_until(&self, until: Instant) -> bool {
        if self.poll(until) {
            return true;
        }
        let mut state = self.0.state.lock();
        while matches!(*state, State::Pending(_)) {
            if self.0.finished.wait_until(&mut state, until).timed_out() {
                break;
            }
        }
        !matches!(*state, State::Pending(_))
    }

    /// Polls for up to the engine's `wait_spin` (and at most until `deadline`): a waiter that
    /// polls is not woken through the scheduler, which costs several µs per round trip.
    fn poll(&self, deadline: Instant) -> bool {
        if self.0.wait_spin.is_zero() {
            return self.0.settled.load(Ordering::Acquire);
        }
        let Some(until) = Instant::now().checked_add(self.0.wait_spin) else { return false };
        let until = deadline.min(until);
        let mut polls: u32 = 0;
        while !self.0.settled.load(Ordering::Acquire) {
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(64) && Instant::now() >= until {
                return false;
            }
            std::hint::spin_loop();
        }
        true
    }
}

/// A request's callback: the Python `callback(error_or_None)` when one is given, else a
/// `Completion` settled without the GIL.
pub fn request_callback(callback: Option<Py<PyAny>>, wait_spin: Duration) -> (Option<PyCompletion>, OnDone) {
    match callback {
        Some(callback) => (None, callbacks::on_done(callback)),
        None => {
            let (completion, on_done) = PyCompletion::for_request(wait_spin);
            (Some(completion), on_done)
        }
    }
}

#[pymethods]
impl PyCompletion {
    /// Whether it finished or was cancelled (never blocks).
    fn done(&self) -> bool {
        self.0.settled.load(Ordering::Acquire)
    }

    fn cancelled(&self) -> bool {
        matches!(*self.0.state.lock(), State::Cancelled)
    }

    /// Cancels it if still pending (waiters wake; a registered callable is dropped, not
    /// called); False when it already finished or was cancelled.
    fn cancel(&self) -> bool {
        let callback = {
            let mut state = self.0.state.lock();
            let State::Pending(callback) = &mut *state else { return false };
            let callback = callback.take();
            *state = State::Cancelled;
            self.0.settled.store(true, Ordering::Release);
            self.0.finished.notify_all();
            callback
        };
        drop(callback); // outside the lock: dropping may run Python
        true
    }

    /// Blocks (GIL released) until done (or cancelled) or `timeout` seconds passed (None: no
    /// limit; a negative or NaN timeout does not wait); returns `done()`. Signal handlers run
    /// every `SIGNAL_CHECK` meanwhile, so Ctrl-C interrupts a long wait as it would a Python one.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        if self.done() {
            return Ok(true);
        }
        let deadline = match timeout {
            None => None,
            Some(t) if t.is_nan() || t <= 0.0 => return Ok(false),
            // Beyond what an Instant can hold: treated as no limit.
            Some(t) => Duration::try_from_secs_f64(t).ok().and_then(|d| Instant::now().checked_add(d)),
        };
        loop {
            let slice_end = Instant::now() + SIGNAL_CHECK;
            let until = deadline.map_or(slice_end, |d| d.min(slice_end));
            if py.detach(|| self.wait_until(until)) {
                return Ok(true);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
            py.check_signals()?;
        }
    }

    /// The exception the request failed with (a `fabric_lib.errors` class; the same object on
    /// every call), or None when it succeeded or is not done.
    fn error(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        // Converting runs Python, which may switch threads: never with the lock held.
        let native = match &*self.0.state.lock() {
            State::Done(Some(Failure::Python(exc))) => return Some(exc.clone_ref(py)),
            State::Done(Some(Failure::Native(e))) => e.clone(),
            _ => return None,
        };
        let converted = to_pyerr(py, native).into_value(py).into_any();
        let mut state = self.0.state.lock();
        if let State::Done(Some(failure)) = &mut *state {
            if let Failure::Python(exc) = failure {
                return Some(exc.clone_ref(py)); // converted meanwhile by another thread
            }
            *failure = Failure::Python(converted.clone_ref(py));
        }
        Some(converted)
    }

    /// Registers `callback()` to run on the engine's callback thread once done; False (and
    /// nothing registered) when already done. A second registration replaces the first.
    fn call_when_done(&self, callback: Py<PyAny>) -> bool {
        let replaced = {
            let mut state = self.0.state.lock();
            match &mut *state {
                State::Pending(slot) => slot.replace(callback),
                State::Done(_) | State::Cancelled => return false,
            }
        };
        drop(replaced); // outside the lock: dropping may run Python
        true
    }

    fn __repr__(&self) -> String {
        let state = match &*self.0.state.lock() {
            State::Pending(_) => "pending",
            State::Done(None) => "succeeded",
            State::Done(Some(_)) => "failed",
            State::Cancelled => "cancelled",
        };
        format!("Completion({state})")
    }
}
