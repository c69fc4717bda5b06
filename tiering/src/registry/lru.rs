//! Priority-aware least-recently-used eviction.

use super::Millis;
use super::policy::{Candidate, EvictionPolicy, KeyedSet};
use crate::block::BlockHash;

/// The order key of [`LruPolicy`]: `(priority, last_access, seq)`, smallest evicted first.
pub type LruKey = (u8, Millis, u64);

/// Evicts the lowest priority first and, within a priority, the least recently accessed block;
/// blocks accessed in the same millisecond go in access order ([`Candidate::seq`]).
///
/// A B-tree over [`LruKey`]: `O(log n)` per operation. (An intrusive list per priority would make
/// `access` `O(1)`, but a block that becomes evictable again after a reference is released keeps
/// its old recency and must be inserted mid-list, which a plain list cannot do in `O(1)`.)
#[derive(Debug)]
pub struct LruPolicy {
    set: KeyedSet<LruKey>,
}

impl LruPolicy {
    /// An empty policy.
    pub fn new() -> Self {
        Self { set: KeyedSet::new() }
    }

    /// The key a candidate is ordered by.
    pub fn key(candidate: &Candidate) -> LruKey {
        (candidate.priority, candidate.last_access, candidate.seq)
    }
}

impl Default for LruPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl EvictionPolicy for LruPolicy {
    fn insert(&mut self, hash: BlockHash, candidate: Candidate) {
        self.set.insert(hash, Self::key(&candidate));
    }
    fn remove(&mut self, hash: BlockHash) {
        self.set.remove(hash);
    }
    fn access(&mut self, hash: BlockHash, candidate: Candidate) {
        self.set.rekey(hash, Self::key(&candidate));
    }
    fn victim(&self) -> Option<BlockHash> {
        self.set.first()
    }
    fn pop(&mut self) -> Option<BlockHash> {
        self.set.pop_first()
    }
    fn len(&self) -> usize {
        self.set.len()
    }
    fn contains(&self, hash: BlockHash) -> bool {
        self.set.contains(hash)
    }
}
