//! Progress of a client run on stderr, one line per phase, so long runs are never silent
//! (stdout stays the table or the JSON object).
use std::time::Instant;

/// Counts phases and reports each as it starts, with the time the previous ones took.
pub struct Progress {
    total: usize,
    done: usize,
    started: Instant,
    quiet: bool,
    /// Which engine's phases these are (`cuda:0 `; empty for the one host-memory engine).
    label: String,
}

impl Progress {
    pub fn new(total: usize, quiet: bool, label: String) -> Self {
        let label = if label.is_empty() { label } else { format!("{label} ") };
        Self { total, done: 0, started: Instant::now(), quiet, label }
    }

    /// Announces the next phase.
    pub fn step(&mut self, what: &str) {
        self.done += 1;
        if !self.quiet {
            let elapsed = self.started.elapsed().as_secs_f64();
            eprintln!(
                "fabric-debug client: {}[{}/{}] {what} ({elapsed:.1} s elapsed)",
                self.label, self.done, self.total
            );
        }
    }
}
