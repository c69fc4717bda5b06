//! A brute-force reference model of the registry and property tests that run random operation
//! sequences against both and compare every result, every victim and the counters after each step.
//!
//! The model keeps a flat map of entries and re-derives everything on demand: children by scanning
//! for matching parents, eligibility from the rules of DESIGN.md §4, the victim as the minimum key
//! over all eligible blocks. It shares no code with the registry except the LFU score function
//! (which has its own unit tests in `lfu.rs`).

use std::collections::HashMap;

use dynamo_config::RegionKind;
use proptest::prelude::*;
use proptest::sample::Index;

use super::*;

/// Number of distinct hashes the generated operations draw from.
const UNIVERSE: usize = 24;
/// Half-life the LFU runs use: short enough that aging matters within a test's time range.
const TEST_HALF_LIFE: Millis = 16;

#[derive(Clone, Copy, Debug)]
enum ModelPolicy {
    Lru,
    Lfu(Millis),
}

#[derive(Clone, Debug)]
struct MEntry {
    parent: Option<BlockHash>,
    region: RegionKind,
    priority: u8,
    refs: u32,
    retain_until: Millis,
    lease_until: Millis,
    last_access: Millis,
    access_count: u32,
    seq: u64,
}

#[derive(Debug)]
struct Model {
    capacity: usize,
    policy: ModelPolicy,
    entries: HashMap<BlockHash, MEntry>,
    clock: Millis,
    seq: u64,
    evictions: [u64; 6],
    removals: [u64; 6],
    lease_budget: usize,
    lease_expiries: u64,
    lease_degradations: u64,
}

fn ri(region: RegionKind) -> usize {
    RegionKind::ALL.iter().position(|&r| r == region).unwrap()
}

impl Model {
    fn new(capacity: usize, policy: ModelPolicy, lease_budget: usize) -> Self {
        Self {
            capacity,
            policy,
            entries: HashMap::new(),
            clock: 0,
            seq: 0,
            evictions: [0; 6],
            removals: [0; 6],
            lease_budget,
            lease_expiries: 0,
            lease_degradations: 0,
        }
    }

    fn advance(&mut self, now: Millis) {
        let new = self.clock.max(now);
        let clock = self.clock;
        self.lease_expiries +=
            self.entries.values().filter(|e| e.lease_until > clock && e.lease_until <= new).count() as u64;
        self.clock = new;
    }

    fn live_leases(&self) -> usize {
        self.entries.values().filter(|e| e.lease_until > self.clock).count()
    }

    fn lease(&mut self, h: BlockHash, until: Millis) -> Result<(), RegistryError> {
        let old = self.resident(h)?.lease_until;
        if until <= old || until <= self.clock {
            return Ok(());
        }
        self.entries.get_mut(&h).unwrap().lease_until = until;
        while self.live_leases() > self.lease_budget {
            let clock = self.clock;
            let (&oldest, _) = self
                .entries
                .iter()
                .filter(|(_, e)| e.lease_until > clock)
                .min_by_key(|&(&k, e)| (e.lease_until, k))
                .unwrap();
            self.entries.get_mut(&oldest).unwrap().lease_until = 0;
            self.lease_degradations += 1;
        }
        Ok(())
    }

    fn unlease(&mut self, h: BlockHash) -> Result<(), RegistryError> {
        self.resident(h)?;
        let clock = self.clock;
        let e = self.entries.get_mut(&h).unwrap();
        if e.lease_until > clock {
            e.lease_until = 0;
        }
        Ok(())
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    fn children(&self, h: BlockHash) -> u32 {
        self.entries.values().filter(|e| e.parent == Some(h)).count() as u32
    }

    fn slot(&self, h: BlockHash) -> Slot {
        let e = &self.entries[&h];
        if e.refs > 0 {
            Slot::Referenced
        } else if self.children(h) > 0 {
            Slot::Interior
        } else if self.clock < e.lease_until {
            Slot::Leased
        } else if self.clock < e.retain_until {
            Slot::Held
        } else {
            Slot::Evictable
        }
    }

    fn key(&self, e: &MEntry) -> (u8, u128, Millis, u64) {
        let order = match self.policy {
            ModelPolicy::Lru => u128::from(e.last_access),
            ModelPolicy::Lfu(half_life) => lfu_score(half_life, e.access_count, e.last_access),
        };
        (e.priority, order, e.last_access, e.seq)
    }

    fn victim(&self) -> Option<BlockHash> {
        let evictable = self
            .entries
            .iter()
            .filter(|&(&h, _)| self.slot(h) == Slot::Evictable)
            .min_by_key(|&(_, e)| self.key(e))
            .map(|(&h, _)| h);
        // Holds are soft: a held block of lower priority than every evictable one goes first
        // (and with nothing evictable, the held block of lowest priority that ends soonest).
        let held = self
            .entries
            .iter()
            .filter(|&(&h, _)| self.slot(h) == Slot::Held)
            .min_by_key(|&(&h, e)| (e.priority, e.retain_until, h))
            .map(|(&h, e)| (h, e.priority));
        match (evictable, held) {
            (Some(e), Some((h, ph))) if ph < self.entries[&e].priority => Some(h),
            (Some(e), _) => Some(e),
            (None, held) => held.map(|(h, _)| h),
        }
    }

    fn evict_one(&mut self) -> Option<Evicted> {
        let h = self.victim()?;
        let e = &self.entries[&h];
        // Property (2): the victim is unreferenced and has no resident child; it is held only
        // when nothing was evictable.
        assert_eq!(e.refs, 0, "victim {h:?} is referenced");
        assert!(
            self.clock >= e.retain_until
                || self.entries.iter().all(|(&k, o)| self.slot(k) != Slot::Evictable || o.priority > e.priority),
            "victim {h:?} is held while an evictable block of its priority or lower was there"
        );
        assert_eq!(self.children(h), 0, "victim {h:?} has resident children");
        assert!(self.clock >= e.lease_until, "victim {h:?} is leased");
        let e = self.entries.remove(&h).unwrap();
        self.evictions[ri(e.region)] += 1;
        Some(Evicted { hash: h, region: e.region, priority: e.priority })
    }

    fn access(&mut self, h: BlockHash) {
        let seq = self.next_seq();
        let clock = self.clock;
        let e = self.entries.get_mut(&h).unwrap();
        e.access_count = e.access_count.saturating_add(1);
        e.last_access = clock;
        e.seq = seq;
    }

    fn insert(&mut self, hash: BlockHash, meta: BlockMeta, now: Millis) -> Result<Admission, RegistryError> {
        self.advance(now);
        let priority = meta.priority.min(100);
        if let Some(e) = self.entries.get_mut(&hash) {
            e.retain_until = e.retain_until.max(meta.retain_until);
            e.priority = e.priority.max(priority);
            self.access(hash);
            return Ok(Admission::AlreadyPresent);
        }
        if meta.parent == Some(hash) {
            return Err(RegistryError::SelfParent(hash));
        }
        let mut evicted = Vec::new();
        if self.entries.len() >= self.capacity {
            match self.evict_one() {
                Some(e) => evicted.push(e),
                None => {
                    return Err(RegistryError::Full { capacity: self.capacity });
                }
            }
        }
        let seq = self.next_seq();
        self.entries.insert(
            hash,
            MEntry {
                parent: meta.parent,
                region: meta.region,
                priority,
                refs: 0,
                retain_until: meta.retain_until,
                lease_until: 0,
                last_access: self.clock,
                access_count: 1,
                seq,
            },
        );
        Ok(Admission::Inserted { evicted })
    }

    fn resident(&self, h: BlockHash) -> Result<&MEntry, RegistryError> {
        self.entries.get(&h).ok_or(RegistryError::NotResident(h))
    }

    fn acquire(&mut self, h: BlockHash, now: Millis) -> Result<(), RegistryError> {
        self.advance(now);
        self.resident(h)?;
        self.entries.get_mut(&h).unwrap().refs += 1;
        self.access(h);
        Ok(())
    }

    fn release(&mut self, h: BlockHash) -> Result<(), RegistryError> {
        if self.resident(h)?.refs == 0 {
            return Err(RegistryError::NotReferenced(h));
        }
        self.entries.get_mut(&h).unwrap().refs -= 1;
        Ok(())
    }

    fn touch(&mut self, h: BlockHash, now: Millis) -> Result<(), RegistryError> {
        self.advance(now);
        self.resident(h)?;
        self.access(h);
        Ok(())
    }

    fn hold(&mut self, h: BlockHash, until: Millis) -> Result<(), RegistryError> {
        self.resident(h)?;
        let e = self.entries.get_mut(&h).unwrap();
        e.retain_until = e.retain_until.max(until);
        Ok(())
    }

    fn set_priority(&mut self, h: BlockHash, priority: u8) -> Result<(), RegistryError> {
        self.resident(h)?;
        self.entries.get_mut(&h).unwrap().priority = priority.min(100);
        Ok(())
    }

    fn remove(&mut self, h: BlockHash) -> Result<Evicted, RegistryError> {
        let refs = self.resident(h)?.refs;
        if refs > 0 {
            return Err(RegistryError::InUse { hash: h, refs });
        }
        let e = self.entries.remove(&h).unwrap();
        self.removals[ri(e.region)] += 1;
        Ok(Evicted { hash: h, region: e.region, priority: e.priority })
    }

    fn evict(&mut self, max: usize, now: Millis) -> Vec<Evicted> {
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

    fn evict_to(&mut self, target: usize, now: Millis) -> Vec<Evicted> {
        let excess = self.entries.len().saturating_sub(target);
        self.evict(excess, now)
    }

    fn view(&self, h: BlockHash) -> Option<EntryView> {
        let e = self.entries.get(&h)?;
        Some(EntryView {
            parent: e.parent,
            region: e.region,
            priority: e.priority,
            refs: e.refs,
            retain_until: e.retain_until,
            lease_until: e.lease_until,
            resident_children: self.children(h),
            access_count: e.access_count,
            last_access: e.last_access,
            slot: self.slot(h),
        })
    }

    fn stats(&self) -> RegistryStats {
        let mut regions = RegionKind::ALL.map(|r| (r, RegionStats::default()));
        for (i, (_, s)) in regions.iter_mut().enumerate() {
            s.evictions_total = self.evictions[i];
            s.removals_total = self.removals[i];
        }
        for (&h, e) in &self.entries {
            let s = &mut regions[ri(e.region)].1;
            s.resident += 1;
            match self.slot(h) {
                Slot::Referenced => s.referenced += 1,
                Slot::Interior => s.interior += 1,
                Slot::Leased => s.leased += 1,
                Slot::Held => s.held += 1,
                Slot::Evictable => s.evictable += 1,
            }
        }
        let leases = LeaseStats {
            live: self.live_leases(),
            expiries_total: self.lease_expiries,
            degradations_total: self.lease_degradations,
        };
        RegistryStats { capacity: self.capacity, regions, leases }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Insert { block: usize, region: usize, priority: u8, retain_until: Millis, back: Millis },
    Acquire { block: usize, back: Millis },
    Release { block: usize },
    Touch { block: usize, back: Millis },
    Hold { block: usize, until: Millis },
    Lease { block: usize, until: Millis },
    Unlease { block: usize },
    SetPriority { block: usize, priority: u8 },
    Remove { block: usize },
    Evict { max: usize, back: Millis },
    EvictTo { target: usize, back: Millis },
    Advance { dt: Millis },
}

fn priority() -> impl Strategy<Value = u8> {
    prop_oneof![Just(0u8), Just(10), Just(50), Just(100), Just(150), any::<u8>()]
}

/// How far behind the test's time an operation's `now` is (mostly 0: time is monotone).
fn back() -> impl Strategy<Value = Millis> {
    prop_oneof![6 => Just(0), 1 => 0..30u64]
}

fn op() -> impl Strategy<Value = Op> {
    let block = 0..UNIVERSE;
    prop_oneof![
        6 => (block.clone(), 0..6usize, priority(), prop_oneof![3 => Just(0), 2 => 0..400u64], back())
            .prop_map(|(block, region, priority, retain_until, back)| Op::Insert {
                block, region, priority, retain_until, back
            }),
        2 => (block.clone(), back()).prop_map(|(block, back)| Op::Acquire { block, back }),
        3 => block.clone().prop_map(|block| Op::Release { block }),
        2 => (block.clone(), back()).prop_map(|(block, back)| Op::Touch { block, back }),
        1 => (block.clone(), 0..400u64).prop_map(|(block, until)| Op::Hold { block, until }),
        1 => (block.clone(), 0..400u64).prop_map(|(block, until)| Op::Lease { block, until }),
        1 => block.clone().prop_map(|block| Op::Unlease { block }),
        1 => (block.clone(), priority()).prop_map(|(block, priority)| Op::SetPriority { block, priority }),
        1 => block.prop_map(|block| Op::Remove { block }),
        1 => (0..5usize, back()).prop_map(|(max, back)| Op::Evict { max, back }),
        1 => (0..UNIVERSE, back()).prop_map(|(target, back)| Op::EvictTo { target, back }),
        2 => (0..16u64).prop_map(|dt| Op::Advance { dt }),
    ]
}

/// Parents for the universe: block `i` has no parent, its predecessor `i - 1` (long chains), or
/// any earlier block (trees). Parents always precede children in index, so there are no cycles,
/// but operations insert in random order, so children often arrive before their parents.
fn parents() -> impl Strategy<Value = Vec<Option<usize>>> {
    proptest::collection::vec((0..4u8, any::<Index>()), UNIVERSE).prop_map(|raw| {
        raw.into_iter()
            .enumerate()
            .map(|(i, (kind, idx))| match kind {
                _ if i == 0 => None,
                0 => None,
                1 | 2 => Some(i - 1),
                _ => Some(idx.index(i)),
            })
            .collect()
    })
}

fn lease_budget() -> impl Strategy<Value = usize> {
    prop_oneof![2 => Just(usize::MAX), 1 => 0..6usize]
}

fn capacity() -> impl Strategy<Value = usize> {
    prop_oneof![3 => 0..=8usize, 1 => 0..=UNIVERSE + 2]
}

fn hash(i: usize) -> BlockHash {
    // Spread the values so hash order is unrelated to index order.
    BlockHash((i as u128 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))
}

fn check_state(reg: &TierRegistry, model: &Model, step: usize, op: &Op) {
    assert!(reg.len() <= reg.capacity(), "step {step} {op:?}: len exceeds capacity");
    assert_eq!(reg.len(), model.entries.len(), "step {step} {op:?}: len");
    assert_eq!(reg.is_empty(), model.entries.is_empty());
    assert_eq!(reg.clock(), model.clock, "step {step} {op:?}: clock");
    assert_eq!(reg.stats(), model.stats(), "step {step} {op:?}: stats");
    for i in 0..UNIVERSE {
        let h = hash(i);
        assert_eq!(reg.contains(h), model.entries.contains_key(&h), "step {step} {op:?}: contains {i}");
        assert_eq!(reg.meta(h), model.view(h), "step {step} {op:?}: meta of block {i}");
    }
    assert_eq!(reg.next_victim(), model.victim(), "step {step} {op:?}: next victim");
}

fn run(capacity: usize, kind: ModelPolicy, lease_budget: usize, parents: &[Option<usize>], ops: &[Op]) {
    let policy = match kind {
        ModelPolicy::Lru => Policy::Lru(LruPolicy::new()),
        ModelPolicy::Lfu(half_life) => Policy::Lfu(LfuPolicy::with_half_life(half_life)),
    };
    let mut reg = TierRegistry::with_policy(capacity, policy).with_lease_budget(lease_budget);
    let mut model = Model::new(capacity, kind, lease_budget);
    let mut t: Millis = 0;
    for (step, op) in ops.iter().enumerate() {
        // A block leased before an operation is still resident after it, unless the operation
        // removed it by name (a block that failed verification) or its lease ran out first.
        let leased: Vec<BlockHash> =
            model.entries.iter().filter(|(_, e)| e.lease_until > t.max(model.clock)).map(|(&h, _)| h).collect();
        match *op {
            Op::Insert { block, region, priority, retain_until, back } => {
                let meta = BlockMeta {
                    parent: parents[block].map(hash),
                    region: RegionKind::ALL[region],
                    priority,
                    retain_until,
                };
                let now = t.saturating_sub(back);
                let expected = model.insert(hash(block), meta, now);
                let before = reg.stats();
                let got = reg.insert(hash(block), meta, now);
                assert_eq!(got, expected, "step {step} {op:?}");
                if let Err(RegistryError::Full { .. }) = got {
                    // Nothing changes on Full (except that holds may have expired with the clock).
                    let after = reg.stats();
                    assert_eq!(before.total().resident, after.total().resident);
                    assert_eq!(before.total().evictions_total, after.total().evictions_total);
                }
            }
            Op::Acquire { block, back } => {
                let now = t.saturating_sub(back);
                assert_eq!(reg.acquire(hash(block), now), model.acquire(hash(block), now), "step {step} {op:?}");
            }
            Op::Release { block } => {
                assert_eq!(reg.release(hash(block)), model.release(hash(block)), "step {step} {op:?}");
            }
            Op::Touch { block, back } => {
                let now = t.saturating_sub(back);
                assert_eq!(reg.touch(hash(block), now), model.touch(hash(block), now), "step {step} {op:?}");
            }
            Op::Hold { block, until } => {
                assert_eq!(reg.hold(hash(block), until), model.hold(hash(block), until), "step {step} {op:?}");
            }
            Op::Lease { block, until } => {
                assert_eq!(reg.lease(hash(block), until), model.lease(hash(block), until), "step {step} {op:?}");
            }
            Op::Unlease { block } => {
                assert_eq!(reg.unlease(hash(block)), model.unlease(hash(block)), "step {step} {op:?}");
            }
            Op::SetPriority { block, priority } => {
                assert_eq!(
                    reg.set_priority(hash(block), priority),
                    model.set_priority(hash(block), priority),
                    "step {step} {op:?}"
                );
            }
            Op::Remove { block } => {
                assert_eq!(reg.remove(hash(block)), model.remove(hash(block)), "step {step} {op:?}");
            }
            Op::Evict { max, back } => {
                let now = t.saturating_sub(back);
                assert_eq!(reg.evict(max, now), model.evict(max, now), "step {step} {op:?}");
            }
            Op::EvictTo { target, back } => {
                let now = t.saturating_sub(back);
                assert_eq!(reg.evict_to(target, now), model.evict_to(target, now), "step {step} {op:?}");
            }
            Op::Advance { dt } => t += dt,
        }
        check_state(&reg, &model, step, op);
        for h in leased {
            let kept = reg.contains(h) || matches!(op, Op::Remove { block } if hash(*block) == h);
            assert!(kept, "step {step} {op:?}: leased block {h:?} was dropped");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn lru_matches_reference_model(
        capacity in capacity(),
        budget in lease_budget(),
        parents in parents(),
        ops in proptest::collection::vec(op(), 1..200),
    ) {
        run(capacity, ModelPolicy::Lru, budget, &parents, &ops);
    }

    #[test]
    fn lfu_matches_reference_model(
        capacity in capacity(),
        budget in lease_budget(),
        parents in parents(),
        ops in proptest::collection::vec(op(), 1..200),
    ) {
        run(capacity, ModelPolicy::Lfu(TEST_HALF_LIFE), budget, &parents, &ops);
    }

    #[test]
    fn lfu_default_half_life_matches_reference_model(
        capacity in capacity(),
        budget in lease_budget(),
        parents in parents(),
        ops in proptest::collection::vec(op(), 1..200),
    ) {
        run(capacity, ModelPolicy::Lfu(DEFAULT_HALF_LIFE_MS), budget, &parents, &ops);
    }
}
