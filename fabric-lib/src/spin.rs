//! How long threads that wait for the worker poll before they sleep, by default, and how often
//! a busy worker yields its CPU.
//!
//! Polling saves the futex call on the waking side and the scheduler wake-up on the sleeping
//! side (several µs each), which is most of a round trip on a fast provider. It only pays where
//! the host has cores to spare for the polling thread: with fewer, the poller takes the core the
//! worker needs, so there every wait sleeps at once and the worker yields after every empty poll.
use std::sync::OnceLock;
use std::time::Duration;

/// Fewest CPUs (available to this process) on which waiters poll before sleeping by default.
pub const SPIN_MIN_CPUS: usize = 4;
/// The default polling time where cores are to spare.
pub const DEFAULT_WAIT_SPIN: Duration = Duration::from_micros(50);

/// Whether this process may use at least [`SPIN_MIN_CPUS`] CPUs (read once).
pub(crate) fn spare_cores() -> bool {
    static SPARE_CORES: OnceLock<bool> = OnceLock::new();
    *SPARE_CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()) >= SPIN_MIN_CPUS)
}

/// [`DEFAULT_WAIT_SPIN`] where this process may use at least [`SPIN_MIN_CPUS`] CPUs, else zero.
pub(crate) fn default_wait_spin() -> Duration {
    if spare_cores() {
        DEFAULT_WAIT_SPIN
    } else {
        Duration::ZERO
    }
}
