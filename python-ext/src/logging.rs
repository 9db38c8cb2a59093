//! The crates' log events go to Python's `logging`, under the `fabric_lib` logger hierarchy
//! (target `fabric_lib::worker` becomes logger `fabric_lib.worker`), so applications format,
//! filter and route them like any other library's logs (no colour codes, no direct stderr).
//!
//! `FABRIC_LIB_LOG` (error, warn, info, debug, trace, off; default warn) bounds what the Rust
//! side hands over at all: records below it cost one comparison and never take the GIL.
use log::LevelFilter;
use pyo3::prelude::*;

/// The environment variable that bounds the level of records passed to Python.
const LEVEL_VAR: &str = "FABRIC_LIB_LOG";

/// Installs the bridge once per process; a second call (or another bridge) is left alone.
pub fn route_to_python(py: Python<'_>) {
    let level = max_level(std::env::var(LEVEL_VAR).ok().as_deref());
    let logger = pyo3_log::Logger::new(py, pyo3_log::Caching::LoggersAndLevels).map(|logger| logger.filter(level));
    if let Ok(logger) = logger {
        if logger.install().is_ok() {
            log::set_max_level(level);
        }
    }
}

/// The level named by `FABRIC_LIB_LOG` (an `env_logger`-style directive's level part).
fn max_level(setting: Option<&str>) -> LevelFilter {
    let Some(setting) = setting else { return LevelFilter::Warn };
    // "fabric_lib=debug,info" style: the most verbose level named anywhere wins.
    setting
        .split(',')
        .filter_map(|part| part.rsplit('=').next()?.trim().parse::<LevelFilter>().ok())
        .max()
        .unwrap_or(LevelFilter::Warn)
}
