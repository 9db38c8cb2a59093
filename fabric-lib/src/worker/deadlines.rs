//! When each request times out. Requests get ids and deadlines in the same order (one timeout
//! for all), so a queue in id order is also in deadline order; finished requests leave it from
//! the front, or in a sweep once they outnumber the live ones, so it stays about as long as
//! what is in flight, not the request rate times the timeout.
use std::collections::VecDeque;
use std::time::Instant;

/// Extra entries of finished requests tolerated before a sweep (behind a slow request).
const SLACK: usize = 1024;

#[derive(Default)]
pub(super) struct Deadlines {
    queue: VecDeque<(Instant, u64)>,
}

impl Deadlines {
    pub fn push(&mut self, deadline: Instant, id: u64) {
        self.queue.push_back((deadline, id));
    }

    /// The next live request whose deadline passed by `now`, taken off the queue; finished
    /// requests met on the way are dropped.
    pub fn next_expired(&mut self, now: Instant, live: impl Fn(u64) -> bool) -> Option<u64> {
        while let Some(&(deadline, id)) = self.queue.front() {
            if !live(id) {
                self.queue.pop_front();
                continue;
            }
            if deadline > now {
                return None;
            }
            self.queue.pop_front();
            return Some(id);
        }
        None
    }

    /// Drops finished requests anywhere in the queue once they outnumber the `live` ones
    /// (plus some slack): amortized O(1) per request.
    pub fn sweep(&mut self, live_count: usize, live: impl Fn(u64) -> bool) {
        if self.queue.len() > 2 * live_count + SLACK {
            self.queue.retain(|&(_, id)| live(id));
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::time::Duration;

    #[test]
    fn finished_requests_leave_and_the_queue_stays_near_the_live_count() {
        let mut d = Deadlines::default();
        let later = Instant::now() + Duration::from_secs(3600);
        let mut live: HashSet<u64> = HashSet::new();
        // One slow request first, then 100k that finish at once (the front cannot move past
        // the slow one): the sweep keeps the queue short.
        d.push(later, 0);
        live.insert(0);
        for id in 1..100_000u64 {
            d.push(later, id);
            d.sweep(live.len(), |i| live.contains(&i));
        }
        assert!(d.len() <= 2 * live.len() + SLACK + 1, "queue grew to {}", d.len());
        assert_eq!(d.next_expired(Instant::now(), |i| live.contains(&i)), None, "not due yet");
        // The slow one finishes: the front pops everything finished behind it.
        live.clear();
        assert_eq!(d.next_expired(Instant::now(), |i| live.contains(&i)), None);
        assert_eq!(d.len(), 0);
    }

    #[test]
    fn live_requests_expire_in_order_and_finished_ones_are_skipped() {
        let mut d = Deadlines::default();
        let now = Instant::now();
        for id in 0..5u64 {
            d.push(now, id);
        }
        d.push(now + Duration::from_secs(3600), 5);
        let live = |i: u64| i != 1 && i != 3;
        let expired: Vec<u64> = std::iter::from_fn(|| d.next_expired(now, live)).collect();
        assert_eq!(expired, vec![0, 2, 4]);
        assert_eq!(d.len(), 1, "the one not yet due stays");
    }
}
