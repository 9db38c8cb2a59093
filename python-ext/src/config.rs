//! The native engine's configuration crosses from Python by name: `TransferEngine(provider,
//! domains, **options)`. Defaults live once, in `fabric_lib::EngineConfig::default()`;
//! `engine_defaults()` shows them to Python. Every conversion error is an
//! `InvalidArgumentError` naming the option.
use std::time::Duration;

use fabric_lib::{EngineConfig, FabricError, GpuRegistration, PollMode, WriteCompletion};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_pyerr;

/// An `InvalidArgumentError` for Python.
pub fn invalid(py: Python<'_>, message: String) -> PyErr {
    to_pyerr(py, FabricError::InvalidArgument(message))
}

/// Seconds as a `Duration`: finite, non-negative and at most `fabric_lib::config::MAX_TIMEOUT`.
pub fn seconds(py: Python<'_>, value: f64, what: &str) -> PyResult<Duration> {
    if !(value.is_finite() && value >= 0.0) {
        return Err(invalid(py, format!("{what} must be a finite, non-negative number of seconds, got {value}")));
    }
    let duration =
        Duration::try_from_secs_f64(value).map_err(|_| invalid(py, format!("{what} of {value} s is out of range")))?;
    fabric_lib::config::check_timeout(what, duration).map_err(|e| to_pyerr(py, e))?;
    Ok(duration)
}

fn poll_mode_name(mode: PollMode) -> &'static str {
    match mode {
        PollMode::Busy => "busy",
        PollMode::Adaptive { .. } => "adaptive",
    }
}

/// Applies `options` (name → value; None keeps the default) to the default configuration.
pub fn engine_config(py: Python<'_>, options: Option<&Bound<'_, PyDict>>) -> PyResult<EngineConfig> {
    let mut config = EngineConfig::default();
    let Some(options) = options else { return Ok(config) };
    let (mut staging, mut chunk_bytes, mut slots) = (true, None, None);
    for (key, value) in options.iter() {
        let name: String = key.extract()?;
        if value.is_none() {
            continue;
        }
        let wrong = |e: PyErr| invalid(py, format!("engine option {name}={value}: {e}"));
        match name.as_str() {
            "worker_cpu" => config.worker_cpu = Some(value.extract().map_err(wrong)?),
            "cuda_device" => config.cuda_device = Some(value.extract().map_err(wrong)?),
            "uvm_watcher_cpu" => config.uvm_watcher_cpu = Some(value.extract().map_err(wrong)?),
            "poll_mode" => {
                config.poll_mode = match value.extract::<String>().map_err(wrong)?.as_str() {
                    "busy" => PollMode::Busy,
                    "adaptive" => PollMode::ADAPTIVE,
                    other => return Err(invalid(py, format!("poll_mode must be 'busy' or 'adaptive', not {other:?}"))),
                }
            }
            "write_completion" => {
                config.write_completion = match value.extract::<String>().map_err(wrong)?.as_str() {
                    "auto" => WriteCompletion::Auto,
                    "delivery" => WriteCompletion::Delivery,
                    "transmit" => WriteCompletion::Transmit,
                    other => {
                        let e = format!("write_completion must be 'auto', 'delivery' or 'transmit', not {other:?}");
                        return Err(invalid(py, e));
                    }
                }
            }
            "gpu_network" => config.gpu_network = Some(value.extract().map_err(wrong)?),
            "force_network" => config.force_network = value.extract().map_err(wrong)?,
            "same_host_host_memory" => config.same_host_host_memory = value.extract().map_err(wrong)?,
            "same_host_inbox_slots" => config.same_host_inbox_slots = value.extract().map_err(wrong)?,
            "gpu_registration" => {
                config.gpu_registration =
                    GpuRegistration::parse(&value.extract::<String>().map_err(wrong)?).map_err(|e| to_pyerr(py, e))?
            }
            "transfer_timeout" => config.transfer_timeout = seconds(py, value.extract().map_err(wrong)?, &name)?,
            "command_timeout" => config.command_timeout = seconds(py, value.extract().map_err(wrong)?, &name)?,
            "wait_spin" => config.wait_spin = Some(seconds(py, value.extract().map_err(wrong)?, &name)?),
            "max_message_size" => config.max_message_size = value.extract().map_err(wrong)?,
            "recv_buffers" => config.recv_buffers = value.extract().map_err(wrong)?,
            "send_buffers" => config.send_buffers = value.extract().map_err(wrong)?,
            "queue_depth" => config.queue_depth = value.extract().map_err(wrong)?,
            "shard_min_bytes" => config.shard_min_bytes = value.extract().map_err(wrong)?,
            "paged_copy_blocks" => config.paged_copy_blocks = value.extract().map_err(wrong)?,
            "staging" => staging = value.extract().map_err(wrong)?,
            "staging_chunk_bytes" => chunk_bytes = Some(value.extract().map_err(wrong)?),
            "staging_slots" => slots = Some(value.extract().map_err(wrong)?),
            "stage_host_memory" => config.stage_host_memory = value.extract().map_err(wrong)?,
            _ => {
                let known = defaults(py)?.keys().iter().map(|k| k.to_string()).collect::<Vec<_>>().join(", ");
                return Err(invalid(py, format!("unknown engine option {name:?} (known: {known})")));
            }
        }
    }
    config.staging = match (staging, config.staging) {
        (false, _) if chunk_bytes.is_some() || slots.is_some() => {
            return Err(invalid(py, "staging_chunk_bytes / staging_slots given with staging=False".into()))
        }
        (false, _) => None,
        (true, current) => {
            let mut sizes = current.unwrap_or_default();
            sizes.chunk_bytes = chunk_bytes.unwrap_or(sizes.chunk_bytes);
            sizes.slots = slots.unwrap_or(sizes.slots);
            Some(sizes)
        }
    };
    config.validate().map_err(|e| to_pyerr(py, e))?;
    Ok(config)
}

fn defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let c = EngineConfig::default();
    let d = PyDict::new(py);
    d.set_item("worker_cpu", c.worker_cpu)?;
    d.set_item("cuda_device", c.cuda_device)?;
    d.set_item("poll_mode", poll_mode_name(c.poll_mode))?;
    d.set_item("transfer_timeout", c.transfer_timeout.as_secs_f64())?;
    d.set_item("command_timeout", c.command_timeout.as_secs_f64())?;
    // None: chosen by the CPUs this process may use (see EngineConfig::wait_spin).
    d.set_item("wait_spin", c.wait_spin.map(|d| d.as_secs_f64()))?;
    d.set_item("max_message_size", c.max_message_size)?;
    d.set_item("recv_buffers", c.recv_buffers)?;
    d.set_item("send_buffers", c.send_buffers)?;
    d.set_item("queue_depth", c.queue_depth)?;
    d.set_item("shard_min_bytes", c.shard_min_bytes)?;
    d.set_item("paged_copy_blocks", c.paged_copy_blocks)?;
    d.set_item("uvm_watcher_cpu", c.uvm_watcher_cpu)?;
    d.set_item("gpu_network", c.gpu_network)?;
    d.set_item("force_network", c.force_network)?;
    d.set_item("same_host_host_memory", c.same_host_host_memory)?;
    d.set_item("same_host_inbox_slots", c.same_host_inbox_slots)?;
    d.set_item("gpu_registration", c.gpu_registration.name())?;
    let sizes = c.staging.unwrap_or_default();
    d.set_item("staging", c.staging.is_some())?;
    d.set_item("staging_chunk_bytes", sizes.chunk_bytes)?;
    d.set_item("staging_slots", sizes.slots)?;
    d.set_item("stage_host_memory", c.stage_host_memory)?;
    d.set_item(
        "write_completion",
        match c.write_completion {
            WriteCompletion::Auto => "auto",
            WriteCompletion::Delivery => "delivery",
            WriteCompletion::Transmit => "transmit",
        },
    )?;
    Ok(d)
}

/// The engine options and their defaults (`TransferEngine(**options)`), as a dict.
#[pyfunction]
pub fn engine_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    defaults(py)
}
