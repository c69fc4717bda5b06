//! Unit tests of the obvious cases; the reference-model property tests live in `reference.rs`.

use dynamo_config::RegionKind;

use super::*;

fn h(n: u128) -> BlockHash {
    BlockHash(n)
}

fn meta(parent: Option<u128>, priority: u8) -> BlockMeta {
    BlockMeta { parent: parent.map(h), region: RegionKind::Conversation, priority, retain_until: 0 }
}

fn hashes(ev: &[Evicted]) -> Vec<u128> {
    ev.iter().map(|e| e.hash.0).collect()
}

fn inserted(a: Admission) -> Vec<Evicted> {
    match a {
        Admission::Inserted { evicted } => evicted,
        Admission::AlreadyPresent => panic!("expected a fresh insert"),
    }
}

fn both() -> [TierRegistry; 2] {
    [TierRegistry::new(8, PolicyKind::Lru), TierRegistry::new(8, PolicyKind::Lfu)]
}

#[test]
fn leaf_first_chain_evicts_from_the_tail() {
    for mut r in both() {
        // chain 1 <- 2 <- 3 <- 4, inserted root first so the root is the least recent.
        for i in 1..=4 {
            r.insert(h(i), meta((i > 1).then(|| i - 1), 50), i as u64).unwrap();
        }
        assert_eq!(r.meta(h(1)).unwrap().slot, Slot::Interior);
        assert_eq!(r.meta(h(4)).unwrap().slot, Slot::Evictable);
        let ev = r.evict(10, 100);
        assert_eq!(hashes(&ev), vec![4, 3, 2, 1]);
        assert!(r.is_empty());
        assert_eq!(r.stats().total().evictions_total, 4);
    }
}

#[test]
fn referenced_block_is_never_evicted() {
    for mut r in both() {
        r.insert(h(1), meta(None, 0), 0).unwrap();
        r.insert(h(2), meta(None, 50), 1).unwrap();
        r.acquire(h(1), 2).unwrap();
        assert_eq!(hashes(&r.evict(10, 3)), vec![2]);
        assert!(r.contains(h(1)));
        assert_eq!(r.remove(h(1)), Err(RegistryError::InUse { hash: h(1), refs: 1 }));
        r.release(h(1)).unwrap();
        assert_eq!(r.release(h(1)), Err(RegistryError::NotReferenced(h(1))));
        assert_eq!(hashes(&r.evict(10, 4)), vec![1]);
    }
}

#[test]
fn hold_is_respected_until_expiry_then_evicted() {
    for mut r in both() {
        let mut m = meta(None, 50);
        m.retain_until = 100;
        r.insert(h(1), m, 0).unwrap();
        r.insert(h(2), meta(None, 50), 1).unwrap();
        assert_eq!(r.stats().total().held, 1);
        // While held, the unheld block of its priority goes first, though it is newer.
        assert_eq!(hashes(&r.evict(1, 99)), vec![2]);
        // With nothing else evictable the hold gives way (holds are soft), still counted held.
        assert_eq!(r.stats().total().held, 1);
        assert_eq!(hashes(&r.evict(1, 99)), vec![1]);
        assert!(r.is_empty());
    }
}

#[test]
fn expired_hold_is_a_normal_block_of_its_priority() {
    for mut r in both() {
        let mut m = meta(None, 60);
        m.retain_until = 10;
        r.insert(h(1), m, 0).unwrap();
        r.insert(h(2), meta(None, 20), 1).unwrap();
        assert_eq!(hashes(&r.evict(1, 50)), vec![2]);
        assert_eq!(hashes(&r.evict(1, 50)), vec![1]);
    }
}

#[test]
fn hold_extends_and_release_into_hold() {
    let mut r = TierRegistry::new(4, PolicyKind::Lru);
    r.insert(h(1), meta(None, 10), 0).unwrap();
    r.acquire(h(1), 1).unwrap();
    r.hold(h(1), 50).unwrap();
    r.hold(h(1), 20).unwrap(); // never shortens
    assert_eq!(r.meta(h(1)).unwrap().retain_until, 50);
    r.release(h(1)).unwrap();
    assert_eq!(r.meta(h(1)).unwrap().slot, Slot::Held);
    // Another block of its priority is evictable at 49: the hold keeps block 1; at 50 it has
    // expired.
    r.insert(h(2), meta(None, 10), 2).unwrap();
    assert_eq!(hashes(&r.evict(1, 49)), vec![2]);
    assert_eq!(r.meta(h(1)).unwrap().slot, Slot::Held);
    assert_eq!(hashes(&r.evict(1, 50)), vec![1]);
}

#[test]
fn a_lease_held_in_an_upper_tier_ends_with_it() {
    let mut r = TierRegistry::new(4, PolicyKind::Lru);
    r.insert(h(1), meta(None, 60), 0).unwrap();
    r.hold(h(1), 500).unwrap();
    r.end_hold(h(1), 400).unwrap();
    assert_eq!(r.meta(h(1)).unwrap().retain_until, 500, "another hold stays");
    r.end_hold(h(1), 500).unwrap();
    assert_eq!(r.meta(h(1)).unwrap().slot, Slot::Evictable);
    assert_eq!(r.stats().total().held, 0);
}

#[test]
fn a_hold_never_outranks_a_higher_priority() {
    let mut r = TierRegistry::new(4, PolicyKind::Lru);
    let mut held = meta(None, 60);
    held.retain_until = 1000;
    r.insert(h(1), held, 0).unwrap();
    r.insert(h(2), meta(None, 90), 1).unwrap();
    r.insert(h(3), meta(None, 60), 2).unwrap();
    // The unheld block of the held one's priority goes first, then the held one (below 90).
    assert_eq!(hashes(&r.evict(1, 10)), vec![3]);
    assert_eq!(r.next_victim(), Some(h(1)));
    assert_eq!(hashes(&r.evict(2, 10)), vec![1, 2]);
}

#[test]
fn priority_order_then_recency() {
    let mut r = TierRegistry::new(8, PolicyKind::Lru);
    r.insert(h(1), meta(None, 90), 0).unwrap();
    r.insert(h(2), meta(None, 10), 1).unwrap();
    r.insert(h(3), meta(None, 60), 2).unwrap();
    r.insert(h(4), meta(None, 10), 3).unwrap();
    r.insert(h(5), meta(None, 200), 4).unwrap(); // clamped to 100
    assert_eq!(r.meta(h(5)).unwrap().priority, 100);
    r.touch(h(2), 5).unwrap(); // 2 is now more recent than 4
    assert_eq!(hashes(&r.evict(10, 6)), vec![4, 2, 3, 1, 5]);
}

#[test]
fn lru_ties_in_the_same_millisecond_go_by_access_order() {
    let mut r = TierRegistry::new(8, PolicyKind::Lru);
    for i in [3, 1, 2] {
        r.insert(h(i), meta(None, 50), 7).unwrap();
    }
    r.touch(h(3), 7).unwrap();
    assert_eq!(hashes(&r.evict(10, 7)), vec![1, 2, 3]);
}

#[test]
fn lfu_prefers_frequent_blocks_and_ages_them() {
    let mut r = TierRegistry::with_policy(8, Policy::Lfu(LfuPolicy::with_half_life(100)));
    r.insert(h(1), meta(None, 50), 0).unwrap();
    for t in 1..8 {
        r.touch(h(1), t).unwrap(); // 8 accesses by t = 7: worth 3 half-lives (300 ms)
    }
    r.insert(h(2), meta(None, 50), 10).unwrap();
    assert_eq!(r.next_victim(), Some(h(2)));
    // A block accessed once at 400 is fresher than 8 accesses at 7 aged by 3 half-lives.
    r.remove(h(2)).unwrap();
    r.insert(h(2), meta(None, 50), 400).unwrap();
    assert_eq!(r.next_victim(), Some(h(1)));
}

#[test]
fn full_when_everything_is_pinned_and_nothing_changes() {
    for mut r in [TierRegistry::new(2, PolicyKind::Lru), TierRegistry::new(2, PolicyKind::Lfu)] {
        r.insert(h(1), meta(None, 0), 0).unwrap();
        r.insert(h(2), meta(None, 0), 0).unwrap();
        r.acquire(h(1), 1).unwrap();
        r.acquire(h(2), 1).unwrap();
        let before = r.stats();
        assert_eq!(r.insert(h(3), meta(None, 100), 2), Err(RegistryError::Full { capacity: 2 }));
        assert_eq!(r.stats(), before);
        assert!(!r.contains(h(3)));
        assert_eq!(r.len(), 2);
        // Once something is evictable, insert makes room by evicting exactly one victim; a held
        // block gives way too when it is all there is (holds are soft).
        r.release(h(1)).unwrap();
        r.hold(h(1), 1_000).unwrap();
        let ev = inserted(r.insert(h(3), meta(None, 100), 3).unwrap());
        assert_eq!(hashes(&ev), vec![1]);
    }
}

#[test]
fn zero_capacity_is_always_full() {
    let mut r = TierRegistry::new(0, PolicyKind::Lru);
    assert_eq!(r.insert(h(1), meta(None, 0), 0), Err(RegistryError::Full { capacity: 0 }));
    assert_eq!(RegistryError::Full { capacity: 0 }.kind(), "full");
}

#[test]
fn child_before_parent_arrival() {
    for mut r in both() {
        r.insert(h(2), meta(Some(1), 50), 0).unwrap();
        r.insert(h(3), meta(Some(2), 50), 1).unwrap();
        r.insert(h(1), meta(None, 0), 2).unwrap(); // parent arrives last, lowest priority
        let v = r.meta(h(1)).unwrap();
        assert_eq!(v.resident_children, 1);
        assert_eq!(v.slot, Slot::Interior);
        assert_eq!(hashes(&r.evict(1, 3)), vec![3]);
        assert_eq!(hashes(&r.evict(10, 3)), vec![2, 1]);
    }
}

#[test]
fn remove_with_resident_children_keeps_them_and_reinsert_sees_them() {
    let mut r = TierRegistry::new(8, PolicyKind::Lru);
    r.insert(h(1), meta(None, 50), 0).unwrap();
    r.insert(h(2), meta(Some(1), 50), 1).unwrap();
    let ev = r.remove(h(1)).unwrap();
    assert_eq!(ev.hash, h(1));
    assert!(r.contains(h(2)));
    assert_eq!(r.stats().total().removals_total, 1);
    assert_eq!(r.stats().total().evictions_total, 0);
    r.insert(h(1), meta(None, 50), 2).unwrap();
    assert_eq!(r.meta(h(1)).unwrap().slot, Slot::Interior);
    assert_eq!(hashes(&r.evict(10, 3)), vec![2, 1]);
}

#[test]
fn already_present_is_an_access_and_raises_priority_and_hold() {
    let mut r = TierRegistry::new(8, PolicyKind::Lru);
    r.insert(h(1), meta(None, 20), 0).unwrap();
    r.insert(h(2), meta(None, 20), 1).unwrap();
    let mut again = meta(None, 10);
    again.retain_until = 30;
    assert_eq!(r.insert(h(1), again, 5).unwrap(), Admission::AlreadyPresent);
    let v = r.meta(h(1)).unwrap();
    assert_eq!((v.priority, v.retain_until, v.access_count, v.last_access), (20, 30, 2, 5));
    assert_eq!(hashes(&r.evict(1, 6)), vec![2]);
    // Held until 30: it goes only now that nothing else is left (holds are soft).
    assert_eq!(r.stats().total().held, 1);
    assert_eq!(hashes(&r.evict(1, 6)), vec![1]);
}

#[test]
fn set_priority_promotes_and_demotes() {
    let mut r = TierRegistry::new(8, PolicyKind::Lru);
    r.insert(h(1), meta(None, 20), 0).unwrap();
    r.insert(h(2), meta(None, 20), 1).unwrap();
    r.set_priority(h(1), 60).unwrap();
    assert_eq!(r.next_victim(), Some(h(2)));
    r.set_priority(h(1), 0).unwrap();
    assert_eq!(r.next_victim(), Some(h(1)));
}

#[test]
fn evict_to_watermark_stops_at_target_or_when_nothing_is_evictable() {
    let mut r = TierRegistry::new(8, PolicyKind::Lru);
    for i in 1..=6 {
        r.insert(h(i), meta(None, 50), i as u64).unwrap();
    }
    r.acquire(h(1), 10).unwrap();
    r.acquire(h(2), 10).unwrap();
    assert_eq!(hashes(&r.evict_to(4, 11)), vec![3, 4]);
    assert_eq!(hashes(&r.evict_to(0, 11)), vec![5, 6]);
    assert_eq!(r.len(), 2);
}

#[test]
fn errors_on_absent_blocks_and_self_parent() {
    let mut r = TierRegistry::new(4, PolicyKind::Lfu);
    let x = h(9);
    assert_eq!(r.acquire(x, 0), Err(RegistryError::NotResident(x)));
    assert_eq!(r.release(x), Err(RegistryError::NotResident(x)));
    assert_eq!(r.touch(x, 0), Err(RegistryError::NotResident(x)));
    assert_eq!(r.hold(x, 1), Err(RegistryError::NotResident(x)));
    assert_eq!(r.set_priority(x, 1), Err(RegistryError::NotResident(x)));
    assert_eq!(r.remove(x), Err(RegistryError::NotResident(x)));
    assert_eq!(r.insert(x, meta(Some(9), 1), 0), Err(RegistryError::SelfParent(x)));
    assert_eq!(RegistryError::NotResident(x).kind(), "not_resident");
    assert!(r.is_empty());
}

#[test]
fn time_never_goes_backwards() {
    let mut r = TierRegistry::new(4, PolicyKind::Lru);
    let mut m = meta(None, 0);
    m.retain_until = 10;
    r.insert(h(1), m, 20).unwrap(); // already expired
    r.touch(h(1), 5).unwrap(); // stale now: last access stays at the clock
    assert_eq!(r.meta(h(1)).unwrap().last_access, 20);
    assert_eq!(hashes(&r.evict(1, 0)), vec![1]);
}
