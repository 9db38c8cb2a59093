//! Turning Python callables into Rust callbacks that run on the engine's callback thread.
//! Each attaches to the interpreter only while it is alive, and logs (never propagates) errors.
use std::cell::Cell;
use std::sync::Arc;

use fabric_lib::{GenericImmCallback, OnDone, OnReached, RecvCallback, WatcherCallback};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::to_pyerr;

/// Logs an exception raised by a user callback on the `fabric_lib` logger.
fn log_callback_error(py: Python<'_>, err: PyErr) {
    let logged = (|| -> PyResult<()> {
        let logger = py.import("logging")?.call_method1("getLogger", ("fabric_lib",))?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("exc_info", err.value(py))?;
        logger.call_method("error", ("exception in a fabric_lib callback: %r", err.value(py)), Some(&kwargs))?;
        Ok(())
    })();
    if logged.is_err() {
        err.print(py);
    }
}

thread_local! {
    static THREAD_STATE_KEPT: Cell<bool> = const { Cell::new(false) };
}

/// Keeps this thread's Python thread state alive between callbacks. A Rust thread that attaches
/// to the interpreter gets a fresh thread state on every attach, and creating and deleting one
/// costs several microseconds of each callback's latency; the engine's callback and watcher
/// threads call into Python again and again. Called while attached: one extra `PyGILState_Ensure`
/// that is never released keeps the state (the GIL itself is still released after each call).
fn keep_thread_state() {
    THREAD_STATE_KEPT.with(|kept| {
        if !kept.get() {
            kept.set(true);
            // SAFETY: the caller holds the GIL (inside `Python::try_attach`), so the interpreter
            // is initialized; the nested ensure only bumps this thread's gilstate counter.
            unsafe { pyo3::ffi::PyGILState_Ensure() };
        }
    });
}

pub fn call_logged(
    callback: &Py<PyAny>,
    make_args: impl for<'py> FnOnce(Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>>,
) {
    let _ = Python::try_attach(|py| {
        keep_thread_state();
        let result = make_args(py).and_then(|args| callback.bind(py).call1(args));
        if let Err(err) = result {
            log_callback_error(py, err);
        }
    });
}

/// `callback(error_or_None)` once a request finishes.
pub fn on_done(callback: Py<PyAny>) -> OnDone {
    Box::new(move |result| {
        call_logged(&callback, |py| {
            let arg: Option<Py<PyAny>> = result.err().map(|e| to_pyerr(py, e).into_value(py).into_any());
            pyo3::types::PyTuple::new(py, [arg])
        })
    })
}

/// `callback()` once an expected immediate count is reached.
pub fn on_reached(callback: Py<PyAny>) -> OnReached {
    Box::new(move || call_logged(&callback, |py| Ok(pyo3::types::PyTuple::empty(py))))
}

/// `callback(imm)` for unclaimed immediates.
pub fn on_imm(callback: Py<PyAny>) -> GenericImmCallback {
    Arc::new(move |imm| call_logged(&callback, |py| pyo3::types::PyTuple::new(py, [imm])))
}

/// `callback(data: bytes)` for every received message.
pub fn on_recv(callback: Py<PyAny>) -> RecvCallback {
    Arc::new(move |data: Vec<u8>| call_logged(&callback, |py| pyo3::types::PyTuple::new(py, [PyBytes::new(py, &data)])))
}

/// `callback(old, new)` for every change a UVM watcher sees.
pub fn on_watch(callback: Py<PyAny>) -> WatcherCallback {
    Arc::new(move |old: u64, new: u64| call_logged(&callback, |py| pyo3::types::PyTuple::new(py, [old, new])))
}
