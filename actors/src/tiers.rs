//! The node's shared tiers below G1, as the workers use them: G2 (host pool + registry + the
//! hash → slot map) and G3 (store + registry), each behind its own lock, with admission that
//! evicts by the tier's policy and frees exactly what the registry gave up.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dynamo_config::{RegionKind, RetentionSection, TierName};
use dynamo_tiering::block::{BlockHash, BlockLayout, Salt};
use dynamo_tiering::g2::{HostPool, SlotMut, SlotRef};
use dynamo_tiering::g3::G3Store;
use dynamo_tiering::registry::{Admission, BlockMeta, Millis, TierRegistry};

/// G2: the pool and what it holds.
#[derive(Debug)]
pub struct G2Tier {
    /// The pool.
    pub pool: HostPool,
    registry: Arc<Mutex<TierRegistry>>,
    inner: Mutex<G2Inner>,
}

#[derive(Debug)]
struct G2Inner {
    slots: HashMap<BlockHash, SlotRef>,
}

impl G2Tier {
    /// A G2 tier over `pool`, with `registry` deciding what stays (shared with whoever reports
    /// its stats).
    pub fn new(pool: HostPool, registry: Arc<Mutex<TierRegistry>>) -> Self {
        Self { pool, registry, inner: Mutex::new(G2Inner { slots: HashMap::new() }) }
    }

    fn lock(&self) -> (std::sync::MutexGuard<'_, G2Inner>, std::sync::MutexGuard<'_, TierRegistry>) {
        // Always slots first, then the registry: one order, no deadlock.
        let inner = self.inner.lock().expect("G2 lock");
        let registry = self.registry.lock().expect("G2 registry lock");
        (inner, registry)
    }

    /// The image of `hash`, if resident (counts as an access).
    pub fn get(&self, hash: BlockHash, now: Millis) -> Option<SlotRef> {
        let (g, mut registry) = self.lock();
        let slot = g.slots.get(&hash).cloned()?;
        let _ = registry.touch(hash, now);
        Some(slot)
    }

    /// Whether `hash` is resident.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.inner.lock().expect("G2 lock").slots.contains_key(&hash)
    }

    /// Blocks resident.
    pub fn len(&self) -> usize {
        self.inner.lock().expect("G2 lock").slots.len()
    }

    /// Whether nothing is resident.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A free slot, evicting one block by policy if the pool is exhausted.
    pub fn alloc(&self, now: Millis) -> Option<SlotMut> {
        if let Some(slot) = self.pool.try_alloc() {
            return Some(slot);
        }
        let (mut g, mut registry) = self.lock();
        for victim in registry.evict(1, now) {
            g.slots.remove(&victim.hash);
        }
        drop((g, registry));
        self.pool.try_alloc()
    }

    /// Admits a sealed image. Returns false when the tier refused it (everything pinned) or
    /// already had it.
    pub fn admit(&self, hash: BlockHash, meta: BlockMeta, image: SlotRef, now: Millis) -> bool {
        let (mut g, mut registry) = self.lock();
        match registry.insert(hash, meta, now) {
            Ok(Admission::Inserted { evicted }) => {
                for victim in evicted {
                    g.slots.remove(&victim.hash);
                }
                g.slots.insert(hash, image);
                true
            }
            Ok(Admission::AlreadyPresent) | Err(_) => false,
        }
    }

    /// Extends the hold of a resident block.
    pub fn hold(&self, hash: BlockHash, until: Millis) {
        let _ = self.registry.lock().expect("G2 registry lock").hold(hash, until);
    }
}

/// G3: the store and what it holds.
#[derive(Debug)]
pub struct G3Tier {
    /// The store.
    pub store: Arc<G3Store>,
    registry: Arc<Mutex<TierRegistry>>,
}

impl G3Tier {
    /// A G3 tier over `store`, with `registry` (rebuilt from the store's recovery) deciding what
    /// stays (shared with whoever reports its stats).
    pub fn new(store: Arc<G3Store>, registry: Arc<Mutex<TierRegistry>>) -> Self {
        Self { store, registry }
    }

    /// Registers `hash` for writing, evicting by policy; returns false when it is present or the
    /// tier refuses it. The evicted blocks are removed from the store.
    pub fn reserve(&self, hash: BlockHash, meta: BlockMeta, now: Millis) -> bool {
        let mut r = self.registry.lock().expect("G3 lock");
        match r.insert(hash, meta, now) {
            Ok(Admission::Inserted { evicted }) => {
                for victim in evicted {
                    self.store.remove(victim.hash);
                }
                true
            }
            Ok(Admission::AlreadyPresent) | Err(_) => false,
        }
    }

    /// Forgets `hash` (its write failed, or it failed verification).
    pub fn forget(&self, hash: BlockHash) {
        let _ = self.registry.lock().expect("G3 lock").remove(hash);
        self.store.remove(hash);
    }
}

/// Everything below G1 that a node's workers share, and how blocks are named and laid out.
#[derive(Debug)]
pub struct NodeTiers {
    /// Tokens per block.
    pub block_tokens: usize,
    /// The salt of every block hash (model identity; tenants add theirs per request later).
    pub salt: Salt,
    /// Image layout of one block.
    pub layout: BlockLayout,
    /// Retention per region.
    pub retention: RetentionSection,
    /// G2, when enabled.
    pub g2: Option<G2Tier>,
    /// G3, when enabled.
    pub g3: Option<G3Tier>,
}

impl NodeTiers {
    /// Registry metadata for a block of `region`.
    pub fn meta(&self, parent: Option<BlockHash>, region: RegionKind) -> BlockMeta {
        BlockMeta { parent, region, priority: self.retention.policy(region).priority, retain_until: 0 }
    }

    /// Whether blocks of `region` may be written down to `tier`.
    pub fn reaches(&self, region: RegionKind, tier: TierName) -> bool {
        tier <= self.retention.policy(region).lowest_tier
    }
}
