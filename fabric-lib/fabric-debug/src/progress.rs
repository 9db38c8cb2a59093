//! Progress of a client run on stderr, one line per phase, so long runs are never silent
//! (stdout stays the table or the JSON object).
use std::time::Instant;

/// Counts phases and reports each as it starts, with the time the previous ones took.
pub struct Progress {
    total: usize,
    done: usize,
    started: Instant,
    quiet: bool,
}

impl Progress {
    pub fn new(total: usize, quiet: bool) -> Self {
        Self { total, done: 0, started: Instant::now(), quiet }
    }

    /// Announces the next phase.
    pub fn step(&mut self, what: &str) {
        self.done += 1;
        if !self.quiet {
            let elapsed = self.started.elapsed().as_secs_f64();
            eprintln!("fabric-debug client: [{}/{}] {what} ({elapsed:.1} s elapsed)", self.done, self.total);
        }
    }
}
