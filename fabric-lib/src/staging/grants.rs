//! The receiver's side of the credits: which staged request holds which landing slot, and who
//! gets the next free one. Requests ask for as many slots as they have chunks; free slots go
//! round-robin, one at a time, to the requests still short of slots, so one large request does
//! not starve the others and the landing area never holds more than its slots.
use std::collections::{HashMap, VecDeque};

use super::SlotPool;
use crate::error::{FabricError, Result};

/// A staged request as the receiver knows it: (writer engine, the writer's request id).
pub type RequestKey = (u64, u64);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Holding {
    /// Granted, the writer may fill it.
    Granted,
    /// Announced full: its bytes are being copied out.
    Filled,
}

/// Landing slots and the requests they are granted to.
#[derive(Debug)]
pub struct Grants {
    pool: SlotPool,
    owners: Vec<Option<(RequestKey, Holding)>>,
    /// Requests still owed slots, in turn order; `owed` says how many.
    turn: VecDeque<RequestKey>,
    owed: HashMap<RequestKey, u32>,
}

impl Grants {
    /// A landing area of `slots` slots, all free.
    pub fn new(slots: u32) -> Self {
        Grants {
            pool: SlotPool::new(slots),
            owners: vec![None; slots as usize],
            turn: VecDeque::new(),
            owed: HashMap::new(),
        }
    }

    /// `key` needs `chunks` slots over its lifetime (asking twice is refused).
    pub fn ask(&mut self, key: RequestKey, chunks: u32) -> Result<()> {
        if chunks == 0 {
            return Err(FabricError::InvalidArgument("a staged request of no chunks needs no slots".into()));
        }
        if self.owed.contains_key(&key) || self.owners.iter().flatten().any(|(k, _)| *k == key) {
            return Err(FabricError::InvalidArgument(format!("staged request {key:?} asked twice")));
        }
        self.owed.insert(key, chunks);
        self.turn.push_back(key);
        Ok(())
    }

    /// Hands out free slots, one per request in turn, until none is free or nobody is owed
    /// any. Returns (request, slot) grants to send.
    pub fn dispense(&mut self) -> Vec<(RequestKey, u32)> {
        let mut out = Vec::new();
        while !self.turn.is_empty() {
            let Some(slot) = self.pool.acquire() else { break };
            let key = self.turn.pop_front().expect("not empty");
            let owed = self.owed.get_mut(&key).expect("in turn means owed");
            *owed -= 1;
            if *owed > 0 {
                self.turn.push_back(key);
            } else {
                self.owed.remove(&key);
            }
            self.owners[slot as usize] = Some((key, Holding::Granted));
            out.push((key, slot));
        }
        out
    }

    /// A chunk of `key` was announced in `slot`: only a slot granted to `key` and not yet
    /// announced may be (anything else is a stale or forged announcement).
    pub fn fill(&mut self, slot: u32, key: RequestKey) -> Result<()> {
        match self.owners.get_mut(slot as usize) {
            Some(Some((k, h))) if *k == key && *h == Holding::Granted => {
                *h = Holding::Filled;
                Ok(())
            }
            _ => Err(FabricError::InvalidDescriptor(format!(
                "landing slot {slot} is not granted to staged request {key:?} (or already announced)"
            ))),
        }
    }

    /// The filled `slot` was copied out: it is free again.
    pub fn drain(&mut self, slot: u32) -> Result<RequestKey> {
        match self.owners.get(slot as usize).copied().flatten() {
            Some((key, Holding::Filled)) => {
                self.owners[slot as usize] = None;
                self.pool.release(slot)?;
                Ok(key)
            }
            _ => Err(FabricError::InvalidArgument(format!("landing slot {slot} holds no announced chunk"))),
        }
    }

    /// Gives up on `key` (completed, failed or its writer went silent): frees the slots granted
    /// to it and not filled, stops granting it more. Filled slots stay held until drained (a
    /// copy may still read them). Returns the freed slots.
    pub fn forget(&mut self, key: RequestKey) -> Vec<u32> {
        self.owed.remove(&key);
        self.turn.retain(|k| *k != key);
        let mut freed = Vec::new();
        for (slot, owner) in self.owners.iter_mut().enumerate() {
            if matches!(owner, Some((k, Holding::Granted)) if *k == key) {
                *owner = None;
                freed.push(slot as u32);
            }
        }
        for &slot in &freed {
            self.pool.release(slot).expect("a granted slot is held");
        }
        freed
    }

    /// Slots granted or filled now.
    pub fn in_use(&self) -> usize {
        self.pool.in_use()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_slots_go_round_robin_and_never_exceed_the_area() {
        let mut g = Grants::new(3);
        g.ask((1, 1), 5).unwrap();
        g.ask((2, 7), 2).unwrap();
        let first = g.dispense();
        assert_eq!(first.iter().map(|(k, _)| *k).collect::<Vec<_>>(), vec![(1, 1), (2, 7), (1, 1)]);
        assert!(g.dispense().is_empty(), "the area is full");
        assert_eq!(g.in_use(), 3);
        let (_, slot) = first[1];
        assert!(g.drain(slot).is_err(), "granted, not announced");
        assert!(g.fill(slot, (1, 1)).is_err(), "another request's slot");
        g.fill(slot, (2, 7)).unwrap();
        assert!(g.fill(slot, (2, 7)).is_err(), "announced twice");
        assert_eq!(g.drain(slot).unwrap(), (2, 7));
        // (2, 7) is owed one more, (1, 1) three: (2, 7) is next in turn.
        assert_eq!(g.dispense(), vec![((2, 7), slot)]);
        assert!(g.ask((2, 7), 1).is_err(), "asked twice");
    }

    #[test]
    fn forgetting_frees_granted_slots_only() {
        let mut g = Grants::new(2);
        g.ask((1, 1), 4).unwrap();
        let grants = g.dispense();
        assert_eq!(grants.len(), 2);
        g.fill(grants[0].1, (1, 1)).unwrap();
        assert_eq!(g.forget((1, 1)), vec![grants[1].1]);
        assert_eq!(g.in_use(), 1, "the filled slot stays until its copy is done");
        assert!(g.dispense().is_empty(), "nobody is owed slots any more");
        assert_eq!(g.drain(grants[0].1).unwrap(), (1, 1));
        assert_eq!(g.in_use(), 0);
        assert!(g.ask((1, 2), 0).is_err());
    }
}
