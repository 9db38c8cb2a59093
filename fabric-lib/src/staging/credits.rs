//! Credits: the slots of a staging area (a writer's bounce buffers, a receiver's landing area).
//! A slot is either free or held by exactly one chunk; a writer sends a chunk only into a slot
//! the receiver granted, so a slow receiver holds writers back and nothing is ever dropped.
use std::collections::VecDeque;

use crate::error::{FabricError, Result};

/// A fixed set of slots, handed out lowest-first-freed order (FIFO), each to one holder at a time.
#[derive(Debug)]
pub struct SlotPool {
    free: VecDeque<u32>,
    held: Vec<bool>,
}

impl SlotPool {
    /// A pool of `slots` free slots.
    pub fn new(slots: u32) -> Self {
        SlotPool { free: (0..slots).collect(), held: vec![false; slots as usize] }
    }

    /// Takes a free slot, or None when every slot is held (the caller waits for a release).
    pub fn acquire(&mut self) -> Option<u32> {
        let slot = self.free.pop_front()?;
        self.held[slot as usize] = true;
        Some(slot)
    }

    /// Returns a held slot. Releasing a slot that is not held (twice, or one never handed out,
    /// e.g. named by a forged or stale announcement) is an error and changes nothing.
    pub fn release(&mut self, slot: u32) -> Result<()> {
        match self.held.get_mut(slot as usize) {
            Some(held) if *held => {
                *held = false;
                self.free.push_back(slot);
                Ok(())
            }
            Some(_) => Err(FabricError::InvalidArgument(format!("staging slot {slot} is not held"))),
            None => Err(FabricError::InvalidArgument(format!(
                "staging slot {slot} does not exist ({} slots)",
                self.held.len()
            ))),
        }
    }

    /// Whether `slot` is held.
    pub fn is_held(&self, slot: u32) -> bool {
        self.held.get(slot as usize).copied().unwrap_or(false)
    }

    /// Slots held now.
    pub fn in_use(&self) -> usize {
        self.held.len() - self.free.len()
    }

    /// Slots in the pool.
    pub fn capacity(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_held_once_and_reused_after_release() {
        let mut pool = SlotPool::new(2);
        let (a, b) = (pool.acquire().unwrap(), pool.acquire().unwrap());
        assert_ne!(a, b);
        assert_eq!(pool.acquire(), None, "exhausted: the writer must wait");
        assert_eq!(pool.in_use(), 2);
        pool.release(a).unwrap();
        assert!(pool.release(a).is_err(), "double release");
        assert!(pool.release(7).is_err(), "unknown slot");
        assert_eq!(pool.acquire(), Some(a));
        assert!(pool.is_held(a) && pool.is_held(b));
        assert_eq!(pool.capacity(), 2);
    }
}
