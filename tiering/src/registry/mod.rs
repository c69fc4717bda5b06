//! The local block registry: per-tier bookkeeping of which blocks are resident and which may be
//! evicted (DESIGN.md §4).
//!
//! A [`TierRegistry`] does no I/O, reads no clock and runs no actor: the tier that owns it passes
//! the time in (`now`, in [`Millis`]) and frees the storage of every block the registry hands back
//! as [`Evicted`].
//!
//! # Eligibility
//!
//! Every resident block is in exactly one of four states ([`Slot`] in the stats):
//!
//! | state | condition | evictable |
//! |---|---|---|
//! | referenced | `refs > 0` | never |
//! | interior | `refs == 0`, at least one child resident in this tier | never (leaf-first) |
//! | leased | `refs == 0`, no resident child, `clock < lease_until` | never while the lease lives |
//! | held | `refs == 0`, no resident child, `clock < retain_until` | only before evictable blocks of higher priority, or when nothing is evictable: lowest priority, then earliest deadline, first |
//! | evictable | otherwise | yes, in policy order |
//!
//! Leases ([`lease`](TierRegistry::lease): a client's `cache_control`, held by its session) are
//! hard where holds are soft: a tier full of leased blocks refuses new ones. The tier that owns the
//! registry decides which it wants: the lowest tier that keeps a leased block leases it here (so
//! it is never dropped), the tiers above only hold it (under pressure it is demoted to the tier
//! below, not lost). A budget ([`with_lease_budget`](TierRegistry::with_lease_budget)) keeps leases
//! from starving everything else: past it, the lease that ends soonest falls back to plain
//! retention, and that is counted.
//!
//! Holds are soft: they keep a session's context through a tool-call gap against every block of
//! its priority or lower, but not against more valuable ones: a held conversation block
//! (priority 60) goes before an unheld system prompt (90), which every session shares. (The other
//! order, holds above priorities, cost 0.7 points of hit rate against plain LRU on an agentic
//! trace.) A tier full of held blocks still admits new ones by breaking the hold of the lowest
//! priority that ends soonest. Refusing the blocks of the request running now (certain to be
//! reused by its next turn) to honour a hold on a session that may not come back would be the
//! worse trade.
//!
//! Children are tracked by parent hash for every resident block, whether or not the parent is
//! resident, so a parent that arrives after its children (after a demotion, say) is interior from
//! the start. Evicting a chain therefore goes from the tail towards the root.
//!
//! # Time
//!
//! The registry keeps `clock`, the largest `now` it has been given; a smaller `now` is treated as
//! `clock` (time never goes backwards). Holds expire lazily: held blocks sit in a set ordered by
//! deadline, and every operation that takes `now` first moves the blocks whose deadline has passed
//! into the policy. Operations without `now` ([`hold`](TierRegistry::hold),
//! [`release`](TierRegistry::release), …) judge holds against `clock`.
//!
//! # Order
//!
//! Among evictable blocks the [`EvictionPolicy`] decides: lowest priority first, then recency
//! ([`LruPolicy`]) or aged frequency ([`LfuPolicy`]). An expired hold is just a normal block of its
//! priority. Every operation is `O(log n)` (plus `O(k log n)` for `k` expired holds or victims);
//! nothing scans the whole tier.

mod lfu;
mod lru;
mod policy;

#[cfg(test)]
mod reference;
#[cfg(test)]
mod tests;

use std::collections::BTreeSet;

use dynamo_config::RegionKind;

pub use lfu::{DEFAULT_HALF_LIFE_MS, LfuKey, LfuPolicy, log2_q4, score as lfu_score};
pub use lru::{LruKey, LruPolicy};
pub use policy::{Candidate, EvictionPolicy, Policy, PolicyKind};

use crate::block::{BlockHash, BlockMap};

/// Milliseconds on the caller's clock.
pub type Millis = u64;

/// Highest retention priority; larger values are clamped to it.
pub const MAX_PRIORITY: u8 = 100;

/// What the caller knows about a block when it registers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockMeta {
    /// The previous block of the chain, `None` for the first block of a sequence.
    pub parent: Option<BlockHash>,
    /// The retention region of the block's tokens.
    pub region: RegionKind,
    /// Retention priority 0–100 (clamped); lower is evicted first.
    pub priority: u8,
    /// Hold deadline: the block is not evicted while `now < retain_until`. 0 for none.
    pub retain_until: Millis,
}

/// A block the registry dropped; the caller frees its storage (or demotes it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Evicted {
    /// The block.
    pub hash: BlockHash,
    /// Its region.
    pub region: RegionKind,
    /// Its priority when it was dropped.
    pub priority: u8,
}

/// The outcome of a successful [`TierRegistry::insert`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admission {
    /// The block is now resident; `evicted` lists what was dropped to make room (at most one).
    Inserted {
        /// Blocks to free.
        evicted: Vec<Evicted>,
    },
    /// The block was already resident; the insert counted as an access.
    AlreadyPresent,
}

/// Why a registry operation failed. Nothing changes when an operation fails.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    /// The tier is full and no block is evictable.
    #[error("tier full ({capacity} blocks) and nothing is evictable")]
    Full {
        /// Capacity of the tier in blocks.
        capacity: usize,
    },
    /// The block is not resident in this tier.
    #[error("block {0} is not resident")]
    NotResident(BlockHash),
    /// The block is referenced and cannot be removed.
    #[error("block {hash} is in use ({refs} references)")]
    InUse {
        /// The block.
        hash: BlockHash,
        /// Its reference count.
        refs: u32,
    },
    /// `release` of a block with no references.
    #[error("block {0} is not referenced")]
    NotReferenced(BlockHash),
    /// A block named itself as its parent (it would pin itself forever).
    #[error("block {0} names itself as its parent")]
    SelfParent(BlockHash),
}

impl RegistryError {
    /// A stable, low-cardinality name for metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            RegistryError::Full { .. } => "full",
            RegistryError::NotResident(_) => "not_resident",
            RegistryError::InUse { .. } => "in_use",
            RegistryError::NotReferenced(_) => "not_referenced",
            RegistryError::SelfParent(_) => "self_parent",
        }
    }
}

/// What the registry's leases have done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeaseStats {
    /// Blocks whose lease lives (as of the registry's clock), in any state.
    pub live: usize,
    /// Leases that ran out.
    pub expiries_total: u64,
    /// Leases dropped to plain retention because the budget was exceeded.
    pub degradations_total: u64,
}

/// A read-only view of one resident block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryView {
    /// Parent hash as registered.
    pub parent: Option<BlockHash>,
    /// Region.
    pub region: RegionKind,
    /// Current priority.
    pub priority: u8,
    /// Reference count.
    pub refs: u32,
    /// Hold deadline (0 for none).
    pub retain_until: Millis,
    /// Lease deadline (0 for none).
    pub lease_until: Millis,
    /// Number of this block's children resident in the tier.
    pub resident_children: u32,
    /// Accesses since the block became resident (insert counts as the first).
    pub access_count: u32,
    /// Time of the last access.
    pub last_access: Millis,
    /// The block's eligibility state as of the registry's clock.
    pub slot: Slot,
}

/// The eligibility state of a resident block (see the [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Slot {
    /// `refs > 0`.
    Referenced,
    /// Unreferenced, with resident children.
    Interior,
    /// Unreferenced leaf whose lease has not expired.
    Leased,
    /// Unreferenced leaf whose hold has not expired.
    Held,
    /// In the policy's evictable set.
    Evictable,
}

impl Slot {
    const fn index(self) -> usize {
        match self {
            Slot::Referenced => 0,
            Slot::Interior => 1,
            Slot::Held => 2,
            Slot::Evictable => 3,
            Slot::Leased => 4,
        }
    }
}

/// Counts for one region. `referenced + interior + leased + held + evictable == resident`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionStats {
    /// Resident blocks.
    pub resident: usize,
    /// Blocks with `refs > 0`.
    pub referenced: usize,
    /// Unreferenced blocks kept because a child is resident.
    pub interior: usize,
    /// Unreferenced leaves kept by a live lease.
    pub leased: usize,
    /// Unreferenced leaves kept by an active hold (as of the registry's clock).
    pub held: usize,
    /// Blocks the policy may evict.
    pub evictable: usize,
    /// Blocks evicted by the policy (`insert`, `evict`, `evict_to`) since creation.
    pub evictions_total: u64,
    /// Blocks dropped by [`TierRegistry::remove`] since creation.
    pub removals_total: u64,
}

/// A snapshot of the registry's counters, per region and in total.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegistryStats {
    /// Capacity in blocks.
    pub capacity: usize,
    /// Per region, indexed like [`RegionKind::ALL`].
    pub regions: [(RegionKind, RegionStats); 6],
    /// Leases.
    pub leases: LeaseStats,
}

impl RegistryStats {
    /// The counters of one region.
    pub fn region(&self, region: RegionKind) -> RegionStats {
        self.regions[region_index(region)].1
    }

    /// The counters summed over all regions.
    pub fn total(&self) -> RegionStats {
        self.regions.iter().fold(RegionStats::default(), |mut acc, (_, s)| {
            acc.resident += s.resident;
            acc.referenced += s.referenced;
            acc.interior += s.interior;
            acc.leased += s.leased;
            acc.held += s.held;
            acc.evictable += s.evictable;
            acc.evictions_total += s.evictions_total;
            acc.removals_total += s.removals_total;
            acc
        })
    }
}

fn region_index(region: RegionKind) -> usize {
    RegionKind::ALL.iter().position(|&r| r == region).unwrap_or(0)
}

#[derive(Debug)]
struct Entry {
    parent: Option<BlockHash>,
    region: RegionKind,
    priority: u8,
    refs: u32,
    retain_until: Millis,
    lease_until: Millis,
    last_access: Millis,
    access_count: u32,
    seq: u64,
    /// Where the entry is filed; `None` only transiently, between `detach` and `attach`.
    slot: Option<Slot>,
}

impl Entry {
    fn candidate(&self) -> Candidate {
        Candidate {
            priority: self.priority,
            last_access: self.last_access,
            access_count: self.access_count,
            seq: self.seq,
        }
    }
}

/// Which blocks of one tier are resident, and which of them to evict next.
///
/// Generic over the policy so that a tier with a fixed policy is monomorphic; the default
/// [`Policy`] is the closed enum chosen by [`PolicyKind`].
#[derive(Debug)]
pub struct TierRegistry<P: EvictionPolicy = Policy> {
    capacity: usize,
    entries: BlockMap<Entry>,
    /// Number of resident blocks per parent hash (the parent need not be resident).
    children: BlockMap<u32>,
    /// Unreferenced leaves whose hold had not expired at `clock`, by deadline (for expiry).
    holds: BTreeSet<(Millis, BlockHash)>,
    /// The same, by priority and then deadline (for eviction).
    held: BTreeSet<(u8, Millis, BlockHash)>,
    /// Every block whose lease had not expired at `clock` (in any state), by deadline.
    leases: BTreeSet<(Millis, BlockHash)>,
    /// Live leases allowed at once.
    lease_budget: usize,
    lease_expiries: u64,
    lease_degradations: u64,
    policy: P,
    clock: Millis,
    seq: u64,
    /// `[region][slot]` counts.
    counts: [[usize; 5]; 6],
    evictions: [u64; 6],
    removals: [u64; 6],
}

impl TierRegistry<Policy> {
    /// An empty registry for a tier of `capacity_blocks`, running `policy` with its defaults.
    pub fn new(capacity_blocks: usize, policy: PolicyKind) -> Self {
        Self::with_policy(capacity_blocks, Policy::new(policy))
    }
}

impl<P: EvictionPolicy> TierRegistry<P> {
    /// An empty registry running `policy`, which must be empty.
    pub fn with_policy(capacity_blocks: usize, policy: P) -> Self {
        debug_assert!(policy.is_empty());
        Self {
            capacity: capacity_blocks,
            entries: BlockMap::default(),
            children: BlockMap::default(),
            holds: BTreeSet::new(),
            held: BTreeSet::new(),
            leases: BTreeSet::new(),
            lease_budget: usize::MAX,
            lease_expiries: 0,
            lease_degradations: 0,
            policy,
            clock: 0,
            seq: 0,
            counts: [[0; 5]; 6],
            evictions: [0; 6],
            removals: [0; 6],
        }
    }

    /// Live leases this registry keeps at most (see [`Self::with_lease_budget`]).
    pub fn lease_budget(&self) -> usize {
        self.lease_budget
    }

    /// This registry with at most `blocks` live leases: a lease past it makes the one that ends
    /// soonest fall back to plain retention.
    pub fn with_lease_budget(mut self, blocks: usize) -> Self {
        self.lease_budget = blocks;
        self
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Number of resident blocks.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no block is resident.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether `h` is resident.
    pub fn contains(&self, h: BlockHash) -> bool {
        self.entries.contains_key(&h)
    }

    /// The largest `now` seen so far.
    pub fn clock(&self) -> Millis {
        self.clock
    }

    /// The policy (read-only).
    pub fn policy(&self) -> &P {
        &self.policy
    }

    /// The block the next eviction would pick, judged at the registry's clock (holds that expired
    /// since then are not yet considered).
    pub fn next_victim(&self) -> Option<BlockHash> {
        self.victim().map(|(h, _)| h)
    }

    /// A view of a resident block.
    pub fn meta(&self, h: BlockHash) -> Option<EntryView> {
        let e = self.entries.get(&h)?;
        Some(EntryView {
            parent: e.parent,
            region: e.region,
            priority: e.priority,
            refs: e.refs,
            retain_until: e.retain_until,
            lease_until: e.lease_until,
            resident_children: self.resident_children(h),
            access_count: e.access_count,
            last_access: e.last_access,
            slot: e.slot.unwrap_or(Slot::Referenced),
        })
    }

    /// Registers a block. When the tier is full, first evicts one victim (returned so the caller
    /// frees its storage); `Err(Full)` when nothing is evictable, and nothing changes then.
    ///
    /// `AlreadyPresent` counts as an access and raises `retain_until` and `priority` to the
    /// maximum of the old and new values; the registered parent and region are kept.
    pub fn insert(&mut self, hash: BlockHash, meta: BlockMeta, now: Millis) -> Result<Admission, RegistryError> {
        self.advance(now);
        let priority = meta.priority.min(MAX_PRIORITY);
        if self.entries.contains_key(&hash) {
            self.detach(hash);
            let seq = self.next_seq();
            let clock = self.clock;
            let e = self.entry_mut(hash);
            e.retain_until = e.retain_until.max(meta.retain_until);
            e.priority = e.priority.max(priority);
            e.access_count = e.access_count.saturating_add(1);
            e.last_access = clock;
            e.seq = seq;
            self.attach(hash);
            return Ok(Admission::AlreadyPresent);
        }
        if meta.parent == Some(hash) {
            return Err(RegistryError::SelfParent(hash));
        }
        let mut evicted = Vec::new();
        if self.entries.len() >= self.capacity {
            match self.evict_one() {
                Some(victim) => evicted.push(victim),
                None => {
                    return Err(RegistryError::Full { capacity: self.capacity });
                }
            }
        }
        let seq = self.next_seq();
        self.entries.insert(
            hash,
            Entry {
                parent: meta.parent,
                region: meta.region,
                priority,
                refs: 0,
                retain_until: meta.retain_until,
                lease_until: 0,
                last_access: self.clock,
                access_count: 1,
                seq,
                slot: None,
            },
        );
        if let Some(parent) = meta.parent {
            self.add_child(parent);
        }
        self.attach(hash);
        Ok(Admission::Inserted { evicted })
    }

    /// Takes a reference (`refs += 1`); counts as an access. A referenced block is never evicted.
    pub fn acquire(&mut self, h: BlockHash, now: Millis) -> Result<(), RegistryError> {
        self.advance(now);
        self.check_resident(h)?;
        self.detach(h);
        let seq = self.next_seq();
        let clock = self.clock;
        let e = self.entry_mut(h);
        e.refs += 1;
        e.access_count = e.access_count.saturating_add(1);
        e.last_access = clock;
        e.seq = seq;
        self.attach(h);
        Ok(())
    }

    /// Drops a reference (`refs -= 1`). Not an access.
    pub fn release(&mut self, h: BlockHash) -> Result<(), RegistryError> {
        let refs = self.entries.get(&h).ok_or(RegistryError::NotResident(h))?.refs;
        if refs == 0 {
            return Err(RegistryError::NotReferenced(h));
        }
        self.detach(h);
        self.entry_mut(h).refs -= 1;
        self.attach(h);
        Ok(())
    }

    /// Records an access.
    pub fn touch(&mut self, h: BlockHash, now: Millis) -> Result<(), RegistryError> {
        self.advance(now);
        self.check_resident(h)?;
        let seq = self.next_seq();
        let clock = self.clock;
        let e = self.entry_mut(h);
        e.access_count = e.access_count.saturating_add(1);
        e.last_access = clock;
        e.seq = seq;
        if e.slot == Some(Slot::Evictable) {
            let candidate = e.candidate();
            self.policy.access(h, candidate);
        }
        Ok(())
    }

    /// Extends the hold: `retain_until = max(old, until)`.
    pub fn hold(&mut self, h: BlockHash, until: Millis) -> Result<(), RegistryError> {
        self.check_resident(h)?;
        self.detach(h);
        let e = self.entry_mut(h);
        e.retain_until = e.retain_until.max(until);
        self.attach(h);
        Ok(())
    }

    /// Leases `h` until `until` (`lease_until = max(old, until)`, judged at the registry's
    /// clock): while it lives the block is never evicted. Past the lease budget, the lease that
    /// ends soonest (perhaps this one) falls back to plain retention.
    pub fn lease(&mut self, h: BlockHash, until: Millis) -> Result<(), RegistryError> {
        self.check_resident(h)?;
        let old = self.entries[&h].lease_until;
        if until <= old || until <= self.clock {
            return Ok(());
        }
        self.detach(h);
        if old > self.clock {
            self.leases.remove(&(old, h));
        }
        self.entry_mut(h).lease_until = until;
        self.leases.insert((until, h));
        self.attach(h);
        while self.leases.len() > self.lease_budget {
            let (_, oldest) = self.leases.pop_first().expect("over budget, so not empty");
            self.detach(oldest);
            self.entry_mut(oldest).lease_until = 0;
            self.attach(oldest);
            self.lease_degradations += 1;
        }
        Ok(())
    }

    /// Ends `h`'s lease now (its session ended): plain retention again. Not counted as an expiry.
    pub fn unlease(&mut self, h: BlockHash) -> Result<(), RegistryError> {
        self.check_resident(h)?;
        let old = self.entries[&h].lease_until;
        if old > self.clock {
            self.detach(h);
            self.leases.remove(&(old, h));
            self.entry_mut(h).lease_until = 0;
            self.attach(h);
        }
        Ok(())
    }

    /// Ends the hold that runs until `until` (a lease's, in a tier that only holds leased blocks):
    /// `retain_until` goes back to 0 if it is exactly `until`; any other hold stays.
    pub fn end_hold(&mut self, h: BlockHash, until: Millis) -> Result<(), RegistryError> {
        self.check_resident(h)?;
        if until > 0 && self.entries[&h].retain_until == until {
            self.detach(h);
            self.entry_mut(h).retain_until = 0;
            self.attach(h);
        }
        Ok(())
    }

    /// Sets the priority (clamped to 100), up or down — e.g. generated → conversation when a turn
    /// completes.
    pub fn set_priority(&mut self, h: BlockHash, priority: u8) -> Result<(), RegistryError> {
        self.check_resident(h)?;
        self.detach(h);
        self.entry_mut(h).priority = priority.min(MAX_PRIORITY);
        self.attach(h);
        Ok(())
    }

    /// Drops a block regardless of holds and policy (e.g. it failed verification). `InUse` if it
    /// is referenced. Allowed while children are resident; they stay, and a later re-insert of the
    /// block sees them again.
    pub fn remove(&mut self, h: BlockHash) -> Result<Evicted, RegistryError> {
        let refs = self.entries.get(&h).ok_or(RegistryError::NotResident(h))?.refs;
        if refs > 0 {
            return Err(RegistryError::InUse { hash: h, refs });
        }
        self.detach(h);
        let evicted = self.drop_entry(h);
        self.removals[region_index(evicted.region)] += 1;
        Ok(evicted)
    }

    /// Evicts up to `max` blocks in policy order.
    pub fn evict(&mut self, max: usize, now: Millis) -> Vec<Evicted> {
        self.advance(now);
        let mut out = Vec::new();
        while out.len() < max {
            match self.evict_one() {
                Some(e) => out.push(e),
                None => break,
            }
        }
        out
    }

    /// Evicts in policy order until at most `target_len` blocks are resident or nothing more is
    /// evictable (watermark-driven reclaim).
    pub fn evict_to(&mut self, target_len: usize, now: Millis) -> Vec<Evicted> {
        let excess = self.entries.len().saturating_sub(target_len);
        self.evict(excess, now)
    }

    /// The counters, per region.
    pub fn stats(&self) -> RegistryStats {
        let regions = std::array::from_fn(|i| {
            let c = &self.counts[i];
            let s = RegionStats {
                resident: c.iter().sum(),
                referenced: c[Slot::Referenced.index()],
                interior: c[Slot::Interior.index()],
                leased: c[Slot::Leased.index()],
                held: c[Slot::Held.index()],
                evictable: c[Slot::Evictable.index()],
                evictions_total: self.evictions[i],
                removals_total: self.removals[i],
            };
            (RegionKind::ALL[i], s)
        });
        let leases = LeaseStats {
            live: self.leases.len(),
            expiries_total: self.lease_expiries,
            degradations_total: self.lease_degradations,
        };
        RegistryStats { capacity: self.capacity, regions, leases }
    }

    // --- internals -------------------------------------------------------------------------

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    fn check_resident(&self, h: BlockHash) -> Result<(), RegistryError> {
        if self.entries.contains_key(&h) { Ok(()) } else { Err(RegistryError::NotResident(h)) }
    }

    fn entry_mut(&mut self, h: BlockHash) -> &mut Entry {
        self.entries.get_mut(&h).expect("registry entry checked resident by the caller")
    }

    fn resident_children(&self, h: BlockHash) -> u32 {
        self.children.get(&h).copied().unwrap_or(0)
    }

    /// Advances the clock to `now` (never backwards), ends the leases that ran out and moves
    /// expired holds into the policy.
    fn advance(&mut self, now: Millis) {
        self.clock = self.clock.max(now);
        while let Some(&(deadline, h)) = self.leases.first() {
            if deadline > self.clock {
                break;
            }
            self.leases.pop_first();
            self.lease_expiries += 1;
            // Its state follows from its fields at the new clock (held, or evictable).
            self.detach(h);
            self.attach(h);
        }
        while let Some(&(deadline, h)) = self.holds.first() {
            if deadline > self.clock {
                break;
            }
            self.holds.pop_first();
            let e = self.entries.get_mut(&h).expect("held block is resident");
            self.held.remove(&(e.priority, deadline, h));
            debug_assert_eq!(e.slot, Some(Slot::Held));
            e.slot = Some(Slot::Evictable);
            let (region, candidate) = (region_index(e.region), e.candidate());
            self.counts[region][Slot::Held.index()] -= 1;
            self.counts[region][Slot::Evictable.index()] += 1;
            self.policy.insert(h, candidate);
        }
    }

    /// The state `h` belongs in now.
    fn desired_slot(&self, h: BlockHash, e: &Entry) -> Slot {
        if e.refs > 0 {
            Slot::Referenced
        } else if self.resident_children(h) > 0 {
            Slot::Interior
        } else if self.clock < e.lease_until {
            Slot::Leased
        } else if self.clock < e.retain_until {
            Slot::Held
        } else {
            Slot::Evictable
        }
    }

    /// Takes `h` out of whatever structure files it (before its fields change).
    fn detach(&mut self, h: BlockHash) {
        let e = self.entries.get_mut(&h).expect("detach of a resident block");
        let Some(slot) = e.slot.take() else { return };
        self.counts[region_index(e.region)][slot.index()] -= 1;
        match slot {
            Slot::Held => {
                let removed = self.holds.remove(&(e.retain_until, h));
                let also = self.held.remove(&(e.priority, e.retain_until, h));
                debug_assert!(removed && also);
            }
            Slot::Evictable => self.policy.remove(h),
            Slot::Referenced | Slot::Interior | Slot::Leased => {}
        }
    }

    /// Files `h` according to its current fields.
    fn attach(&mut self, h: BlockHash) {
        let e = &self.entries[&h];
        debug_assert!(e.slot.is_none());
        let slot = self.desired_slot(h, e);
        let (region, deadline, candidate) = (region_index(e.region), e.retain_until, e.candidate());
        match slot {
            Slot::Held => {
                self.holds.insert((deadline, h));
                let priority = self.entries[&h].priority;
                self.held.insert((priority, deadline, h));
            }
            Slot::Evictable => self.policy.insert(h, candidate),
            Slot::Referenced | Slot::Interior | Slot::Leased => {}
        }
        self.counts[region][slot.index()] += 1;
        self.entry_mut(h).slot = Some(slot);
    }

    /// Re-files `h` if it is resident (its eligibility may have changed).
    fn refile(&mut self, h: BlockHash) {
        if self.entries.contains_key(&h) {
            self.detach(h);
            self.attach(h);
        }
    }

    fn add_child(&mut self, parent: BlockHash) {
        *self.children.entry(parent).or_insert(0) += 1;
        self.refile(parent);
    }

    fn remove_child(&mut self, parent: BlockHash) {
        if let Some(n) = self.children.get_mut(&parent) {
            *n -= 1;
            if *n == 0 {
                self.children.remove(&parent);
            }
        }
        self.refile(parent);
    }

    /// Deletes a detached entry and updates its parent's child count.
    fn drop_entry(&mut self, h: BlockHash) -> Evicted {
        let e = self.entries.remove(&h).expect("drop of a resident block");
        debug_assert!(e.slot.is_none());
        if e.lease_until > self.clock {
            self.leases.remove(&(e.lease_until, h));
        }
        if let Some(parent) = e.parent {
            self.remove_child(parent);
        }
        Evicted { hash: h, region: e.region, priority: e.priority }
    }

    /// The next victim and its state: the policy's, unless a held block has a lower priority
    /// (or nothing is evictable): a hold protects a block against blocks of its own priority and
    /// below, never against more valuable ones, and among held blocks the lowest priority, then
    /// the soonest deadline, goes first.
    fn victim(&self) -> Option<(BlockHash, Slot)> {
        let evictable = self.policy.victim().map(|h| (h, self.entries[&h].priority));
        let held = self.held.first().map(|&(priority, _, h)| (h, priority));
        match (evictable, held) {
            (Some((e, pe)), Some((h, ph))) => Some(if ph < pe { (h, Slot::Held) } else { (e, Slot::Evictable) }),
            (Some((e, _)), None) => Some((e, Slot::Evictable)),
            (None, Some((h, _))) => Some((h, Slot::Held)),
            (None, None) => None,
        }
    }

    /// Drops the next victim. The clock must already be advanced.
    fn evict_one(&mut self) -> Option<Evicted> {
        let (h, slot) = self.victim()?;
        match slot {
            Slot::Evictable => {
                let popped = self.policy.pop();
                debug_assert_eq!(popped, Some(h));
            }
            _ => {
                let e = &self.entries[&h];
                self.holds.remove(&(e.retain_until, h));
                self.held.remove(&(e.priority, e.retain_until, h));
            }
        }
        let e = self.entries.get_mut(&h).expect("victim is resident");
        debug_assert_eq!(e.slot, Some(slot));
        e.slot = None;
        self.counts[region_index(e.region)][slot.index()] -= 1;
        let evicted = self.drop_entry(h);
        self.evictions[region_index(evicted.region)] += 1;
        Some(evicted)
    }
}
