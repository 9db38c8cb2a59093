//! Peer engines by a small id. A request names its peers by id, so the command that carries it
//! from the caller to the worker holds no copy of their endpoint names, and the worker finds a
//! peer's resolved addresses by index instead of hashing its names on every request.
//!
//! The caller interns a peer's endpoint list (one per domain) when it plans a request; the
//! worker reads the list back once per peer, the first time a request names it. Ids are never
//! reused: the table only grows, like the providers' address vectors behind it.
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use parking_lot::RwLock;
use rustc_hash::{FxHashMap, FxHasher};

use crate::error::{FabricError, Result};

/// Distinct peers one engine may name (each costs a few hundred bytes; a peer that keeps
/// inventing endpoint names gets an error instead of this engine's memory).
pub(crate) const MAX_PEERS: usize = 1 << 20;

/// A peer engine's endpoint names, one per domain.
pub(crate) type Endpoints = Arc<[Vec<u8>]>;

pub(crate) struct PeerTable {
    inner: RwLock<Inner>,
    limit: usize,
}

impl Default for PeerTable {
    fn default() -> Self {
        PeerTable { inner: RwLock::default(), limit: MAX_PEERS }
    }
}

#[derive(Default)]
struct Inner {
    /// Ids by the hash of their endpoint list (collisions share a bucket).
    by_hash: FxHashMap<u64, smallvec::SmallVec<[u32; 1]>>,
    endpoints: Vec<Endpoints>,
}

fn hash_of<'a>(endpoints: impl Iterator<Item = &'a [u8]>) -> u64 {
    let mut h = FxHasher::default();
    for e in endpoints {
        e.hash(&mut h);
    }
    h.finish()
}

impl PeerTable {
    /// The id of the peer with these endpoint names (one per domain), added if new.
    pub fn intern<'a, I>(&self, endpoints: I) -> Result<u32>
    where
        I: Iterator<Item = &'a [u8]> + Clone,
    {
        let hash = hash_of(endpoints.clone());
        let find = |inner: &Inner| {
            inner.by_hash.get(&hash).and_then(|ids| {
                ids.iter()
                    .copied()
                    .find(|&id| inner.endpoints[id as usize].iter().map(Vec::as_slice).eq(endpoints.clone()))
            })
        };
        if let Some(id) = find(&self.inner.read()) {
            return Ok(id);
        }
        let mut inner = self.inner.write();
        if let Some(id) = find(&inner) {
            return Ok(id);
        }
        if inner.endpoints.len() >= self.limit {
            return Err(FabricError::InvalidDescriptor(format!(
                "this engine already addressed {} distinct peers; refusing another",
                self.limit
            )));
        }
        let id = inner.endpoints.len() as u32;
        inner.endpoints.push(endpoints.map(<[u8]>::to_vec).collect());
        inner.by_hash.entry(hash).or_default().push(id);
        Ok(id)
    }

    /// The endpoint names of an interned peer.
    pub fn endpoints(&self, id: u32) -> Option<Endpoints> {
        self.inner.read().endpoints.get(id as usize).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&[u8]]) -> Vec<Vec<u8>> {
        list.iter().map(|s| s.to_vec()).collect()
    }

    #[test]
    fn the_same_endpoints_get_the_same_id_and_others_a_new_one() {
        let table = PeerTable::default();
        let a = names(&[b"a0", b"a1"]);
        let b = names(&[b"a0", b"b1"]);
        let id_a = table.intern(a.iter().map(Vec::as_slice)).unwrap();
        let id_b = table.intern(b.iter().map(Vec::as_slice)).unwrap();
        assert_ne!(id_a, id_b);
        assert_eq!(table.intern(a.iter().map(Vec::as_slice)).unwrap(), id_a);
        assert_eq!(&*table.endpoints(id_b).unwrap(), &b[..]);
        assert!(table.endpoints(7).is_none());
    }

    #[test]
    fn past_the_limit_new_peers_are_refused_and_known_ones_still_served() {
        let table = PeerTable { inner: RwLock::default(), limit: 3 };
        let lists: Vec<Vec<Vec<u8>>> = (0..4u8).map(|i| vec![vec![i; 8]]).collect();
        for (i, list) in lists.iter().take(3).enumerate() {
            assert_eq!(table.intern(list.iter().map(Vec::as_slice)).unwrap(), i as u32);
        }
        let refused = table.intern(lists[3].iter().map(Vec::as_slice));
        assert!(matches!(refused, Err(FabricError::InvalidDescriptor(_))), "{refused:?}");
        assert_eq!(table.intern(lists[1].iter().map(Vec::as_slice)).unwrap(), 1);
    }

    #[test]
    fn ids_sharing_a_bucket_are_told_apart_by_their_names() {
        let table = PeerTable::default();
        let first = names(&[b"x"]);
        let second = names(&[b"y"]);
        // A collision: the second list lands in the first one's bucket, ahead of it.
        let hash = hash_of(first.iter().map(Vec::as_slice));
        {
            let mut inner = table.inner.write();
            inner.endpoints.push(second.clone().into());
            inner.by_hash.entry(hash).or_default().push(0);
        }
        let id = table.intern(first.iter().map(Vec::as_slice)).unwrap();
        assert_eq!(id, 1, "not the colliding entry");
        assert_eq!(table.inner.read().by_hash[&hash].as_slice(), &[0, 1]);
        assert_eq!(table.intern(first.iter().map(Vec::as_slice)).unwrap(), 1);
    }
}
