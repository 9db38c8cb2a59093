//! The worker's live requests: a slab addressed by ids that carry a generation. A lookup is an
//! index and a compare, not a hash (the worker makes several per request); the id of a finished
//! request never finds its slot's next occupant (the generation moved on), however late it comes
//! back (a completion, a queued post, a deadline entry). Ids are never 0.
pub(super) struct RequestTable<T> {
    slots: Vec<Slot<T>>,
    /// Indices of empty slots, reused last-freed first (their lines are the warmest).
    free: Vec<u32>,
    live: usize,
}

struct Slot<T> {
    /// Raised each time the slot is emptied; starts at 1.
    generation: u32,
    value: Option<T>,
}

impl<T> Default for RequestTable<T> {
    fn default() -> Self {
        RequestTable { slots: Vec::new(), free: Vec::new(), live: 0 }
    }
}

fn split(id: u64) -> (usize, u32) {
    (id as u32 as usize, (id >> 32) as u32)
}

impl<T> RequestTable<T> {
    /// Stores `value`; returns its id.
    pub fn insert(&mut self, value: T) -> u64 {
        let index = match self.free.pop() {
            Some(i) => i as usize,
            None => {
                let index = self.slots.len();
                assert!(index < u32::MAX as usize, "more than 2^32 - 1 requests in flight");
                self.slots.push(Slot { generation: 1, value: None });
                index
            }
        };
        let slot = &mut self.slots[index];
        slot.value = Some(value);
        self.live += 1;
        (u64::from(slot.generation) << 32) | index as u64
    }

    pub fn get_mut(&mut self, id: u64) -> Option<&mut T> {
        let (index, generation) = split(id);
        self.slots.get_mut(index).filter(|s| s.generation == generation).and_then(|s| s.value.as_mut())
    }

    pub fn contains(&self, id: u64) -> bool {
        let (index, generation) = split(id);
        self.slots.get(index).is_some_and(|s| s.generation == generation && s.value.is_some())
    }

    /// Takes the request out; its id is dead from then on.
    pub fn remove(&mut self, id: u64) -> Option<T> {
        let (index, generation) = split(id);
        let slot = self.slots.get_mut(index).filter(|s| s.generation == generation)?;
        let value = slot.value.take()?;
        // Skips 0 on wrapping, so no id is ever 0. An id 2^32 - 1 reuses of its slot old would
        // alias; nothing keeps one that long (deadline entries and queued posts go with it).
        slot.generation = slot.generation.checked_add(1).unwrap_or(1);
        self.free.push(index as u32);
        self.live -= 1;
        Some(value)
    }

    /// Requests in the table.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Takes every request out.
    pub fn drain(&mut self) -> Vec<T> {
        let ids: Vec<u64> = (0..self.slots.len())
            .filter(|&i| self.slots[i].value.is_some())
            .map(|i| (u64::from(self.slots[i].generation) << 32) | i as u64)
            .collect();
        ids.into_iter().filter_map(|id| self.remove(id)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::RequestTable;
    use std::collections::HashMap;

    #[test]
    fn ids_of_removed_requests_never_find_the_next_occupant() {
        let mut t = RequestTable::default();
        let a = t.insert("a");
        assert_ne!(a, 0);
        assert_eq!(t.remove(a), Some("a"));
        let b = t.insert("b");
        assert_eq!(b as u32, a as u32, "the slot is reused");
        assert_ne!(a, b);
        assert!(!t.contains(a) && t.get_mut(a).is_none() && t.remove(a).is_none());
        assert_eq!(t.get_mut(b), Some(&mut "b"));
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn behaves_like_a_map_over_random_inserts_and_removes() {
        let (mut t, mut model, mut dead) = (RequestTable::default(), HashMap::new(), Vec::new());
        let mut x = 0x9e37_79b9_7f4a_7c15u64; // xorshift64: a fixed, reproducible sequence
        for step in 0..200_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let ids: Vec<u64> = model.keys().copied().collect();
            if ids.is_empty() || !x.is_multiple_of(3) {
                let id = t.insert(step);
                assert!(model.insert(id, step).is_none(), "id {id:#x} handed out twice");
            } else {
                let id = ids[(x >> 8) as usize % ids.len()];
                assert_eq!(t.remove(id), model.remove(&id));
                dead.push(id);
            }
            if step.is_multiple_of(1000) {
                assert!(dead.iter().all(|&d| !t.contains(d)), "a removed id came back");
                dead.clear();
            }
            assert_eq!(t.len(), model.len());
        }
        for (&id, &v) in &model {
            assert_eq!(t.get_mut(id), Some(&mut v.clone()));
        }
        let mut drained = t.drain();
        drained.sort_unstable();
        let mut want: Vec<u64> = model.into_values().collect();
        want.sort_unstable();
        assert_eq!(drained, want);
        assert_eq!(t.len(), 0);
    }
}
