//! The eviction-policy contract and the closed set of policies a tier can run.

use std::collections::BTreeMap;

use super::Millis;
use super::lfu::LfuPolicy;
use super::lru::LruPolicy;
use crate::block::{BlockHash, BlockMap};

/// What a policy may order a block by: a snapshot of the registry's entry, taken when the block
/// becomes evictable or is accessed while evictable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// Retention priority, 0–100; lower is evicted first by every policy.
    pub priority: u8,
    /// Time of the last access (already clamped by the registry to be non-decreasing).
    pub last_access: Millis,
    /// Number of accesses since the block became resident (saturating).
    pub access_count: u32,
    /// The registry's sequence number at the last access. Unique per block and increasing with
    /// every access, so it breaks every remaining tie deterministically.
    pub seq: u64,
}

/// Orders the *evictable* blocks of one tier.
///
/// A policy never sees a block that may not be evicted: the registry alone decides eligibility
/// (references, holds, resident children) and tells the policy about changes to the evictable set.
///
/// # Contract
///
/// - [`insert`](Self::insert): `hash` has just become evictable. The caller guarantees that `hash`
///   is not already in the policy.
/// - [`remove`](Self::remove): `hash` is no longer evictable (it was referenced, held, gained a
///   resident child, or is being dropped). The caller guarantees that `hash` is in the policy.
/// - [`access`](Self::access): `hash`, which is in the policy, was accessed; `candidate` is its new
///   snapshot and replaces the old one. The caller guarantees that `hash` is in the policy.
/// - [`victim`](Self::victim) names the block that [`pop`](Self::pop) would remove, without
///   removing it; `pop` removes and returns it. Both return `None` exactly when the policy is empty.
///
/// Every policy evicts the lowest priority first and breaks its last tie by [`Candidate::seq`], so
/// the victim is a deterministic function of the candidates. Every operation is `O(log n)` or
/// better in the number of evictable blocks. Violating the caller's guarantees may panic (in
/// debug builds) or corrupt the order, but never causes undefined behaviour.
pub trait EvictionPolicy {
    /// `hash` became evictable.
    fn insert(&mut self, hash: BlockHash, candidate: Candidate);
    /// `hash` stopped being evictable.
    fn remove(&mut self, hash: BlockHash);
    /// `hash` was accessed while evictable.
    fn access(&mut self, hash: BlockHash, candidate: Candidate);
    /// The next victim, if any block is evictable.
    fn victim(&self) -> Option<BlockHash>;
    /// Removes and returns the next victim.
    fn pop(&mut self) -> Option<BlockHash>;
    /// Number of evictable blocks.
    fn len(&self) -> usize;
    /// Whether no block is evictable.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether `hash` is in the evictable set.
    fn contains(&self, hash: BlockHash) -> bool;
}

/// Which policy a tier runs (configuration-level choice).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    /// Priority-aware least-recently-used. See [`LruPolicy`].
    #[default]
    Lru,
    /// Priority-aware least-frequently-used with time-based aging. See [`LfuPolicy`].
    Lfu,
}

/// The closed set of policies, dispatched by `match` rather than through a trait object so the
/// eviction hot path stays monomorphic.
#[derive(Debug)]
pub enum Policy {
    /// See [`LruPolicy`].
    Lru(LruPolicy),
    /// See [`LfuPolicy`].
    Lfu(LfuPolicy),
}

impl Policy {
    /// A policy of `kind` with default parameters.
    pub fn new(kind: PolicyKind) -> Self {
        match kind {
            PolicyKind::Lru => Policy::Lru(LruPolicy::new()),
            PolicyKind::Lfu => Policy::Lfu(LfuPolicy::new()),
        }
    }

    /// Which kind this is.
    pub fn kind(&self) -> PolicyKind {
        match self {
            Policy::Lru(_) => PolicyKind::Lru,
            Policy::Lfu(_) => PolicyKind::Lfu,
        }
    }
}

impl From<PolicyKind> for Policy {
    fn from(kind: PolicyKind) -> Self {
        Policy::new(kind)
    }
}

macro_rules! dispatch {
    ($self:ident, $p:ident => $e:expr) => {
        match $self {
            Policy::Lru($p) => $e,
            Policy::Lfu($p) => $e,
        }
    };
}

impl EvictionPolicy for Policy {
    fn insert(&mut self, hash: BlockHash, candidate: Candidate) {
        dispatch!(self, p => p.insert(hash, candidate))
    }
    fn remove(&mut self, hash: BlockHash) {
        dispatch!(self, p => p.remove(hash))
    }
    fn access(&mut self, hash: BlockHash, candidate: Candidate) {
        dispatch!(self, p => p.access(hash, candidate))
    }
    fn victim(&self) -> Option<BlockHash> {
        dispatch!(self, p => p.victim())
    }
    fn pop(&mut self) -> Option<BlockHash> {
        dispatch!(self, p => p.pop())
    }
    fn len(&self) -> usize {
        dispatch!(self, p => p.len())
    }
    fn contains(&self, hash: BlockHash) -> bool {
        dispatch!(self, p => p.contains(hash))
    }
}

/// A set of blocks ordered by a unique key `K`: the shared machinery of the ordered policies
/// (a B-tree from key to block plus the reverse map to find a block's key on removal).
#[derive(Debug)]
pub(super) struct KeyedSet<K> {
    order: BTreeMap<K, BlockHash>,
    keys: BlockMap<K>,
}

impl<K: Ord + Copy> KeyedSet<K> {
    pub(super) fn new() -> Self {
        Self { order: BTreeMap::new(), keys: BlockMap::default() }
    }

    pub(super) fn insert(&mut self, hash: BlockHash, key: K) {
        let previous = self.keys.insert(hash, key);
        debug_assert!(previous.is_none(), "policy insert of a block already present: {hash:?}");
        if let Some(previous) = previous {
            self.order.remove(&previous);
        }
        let clash = self.order.insert(key, hash);
        debug_assert!(clash.is_none(), "policy keys must be unique");
    }

    pub(super) fn remove(&mut self, hash: BlockHash) {
        let key = self.keys.remove(&hash);
        debug_assert!(key.is_some(), "policy remove of an absent block: {hash:?}");
        if let Some(key) = key {
            self.order.remove(&key);
        }
    }

    pub(super) fn rekey(&mut self, hash: BlockHash, key: K) {
        match self.keys.get_mut(&hash) {
            Some(old) => {
                self.order.remove(old);
                *old = key;
                self.order.insert(key, hash);
            }
            None => {
                debug_assert!(false, "policy access of an absent block: {hash:?}");
                self.insert(hash, key);
            }
        }
    }

    pub(super) fn first(&self) -> Option<BlockHash> {
        self.order.first_key_value().map(|(_, &hash)| hash)
    }

    pub(super) fn pop_first(&mut self) -> Option<BlockHash> {
        let (_, hash) = self.order.pop_first()?;
        self.keys.remove(&hash);
        Some(hash)
    }

    pub(super) fn len(&self) -> usize {
        self.order.len()
    }

    pub(super) fn contains(&self, hash: BlockHash) -> bool {
        self.keys.contains_key(&hash)
    }
}

impl From<dynamo_config::EvictionPolicyKind> for PolicyKind {
    fn from(kind: dynamo_config::EvictionPolicyKind) -> Self {
        match kind {
            dynamo_config::EvictionPolicyKind::Lru => PolicyKind::Lru,
            dynamo_config::EvictionPolicyKind::Lfu => PolicyKind::Lfu,
        }
    }
}
