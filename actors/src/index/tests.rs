//! Tests of the prefix index: unit cases, property tests against a reference model, and a
//! concurrent reader against a writer.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dynamo_config::{PerTier, TierName};
use dynamo_tiering::block::BlockHash;
use proptest::prelude::*;

use super::*;

const W00: SourceId = SourceId::worker(0, 0);
const W01: SourceId = SourceId::worker(0, 1);
const W10: SourceId = SourceId::worker(1, 0);
const N0: SourceId = SourceId::node_store(0);
const N1: SourceId = SourceId::node_store(1);

/// A chain of `n` distinct, random-looking hashes from `seed`.
fn chain(seed: u64, n: usize) -> Vec<BlockHash> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            let hi = splitmix(&mut state);
            BlockHash((u128::from(hi) << 64) | u128::from(splitmix(&mut state)))
        })
        .collect()
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn exact(source: SourceId, tier: TierName) -> Location {
    Location { source, tier, approximate: false }
}

fn stored(source: SourceId, seq: u64, tier: TierName, parent: Option<BlockHash>, hashes: &[BlockHash]) -> KvEvent {
    KvEvent { source, epoch: 1, seq, kind: KvEventKind::Stored { hashes: hashes.to_vec(), parent, tier } }
}

fn removed(source: SourceId, seq: u64, tier: TierName, hashes: &[BlockHash]) -> KvEvent {
    KvEvent { source, epoch: 1, seq, kind: KvEventKind::Removed { hashes: hashes.to_vec(), tier } }
}

/// The index's answer to `query`, after checking that each shard gives the same answer counting
/// its candidates as tagging them.
fn answers(index: &PrefixIndex, query: &[BlockHash]) -> BTreeMap<Location, usize> {
    index.with_store(|store| {
        let answer = |counted| {
            let mut out = Matches::new();
            store.find_matches_with(query, &mut out, counted);
            out.results
        };
        assert_eq!(answer(true), answer(false), "counted and tagged answers to {query:?}");
    });
    let mut out = Matches::new();
    index.find_matches(query, &mut out);
    out.locations().iter().map(|m| (m.location, m.blocks)).collect()
}

#[test]
fn the_index_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<PrefixIndex>();
}

#[test]
fn each_location_answers_its_own_longest_prefix() {
    // One shard, so `stats.blocks` counts distinct blocks (with more, once per shard).
    let index = PrefixIndex::with_shards(IndexConfig::default(), 1);
    let c = chain(1, 100);
    assert_eq!(index.apply(&stored(W00, 1, TierName::G1, None, &c[..70])), Applied::Applied);
    assert_eq!(index.apply(&stored(W01, 1, TierName::G1, None, &c[..5])), Applied::Applied);
    assert_eq!(index.apply(&stored(N0, 1, TierName::G2, None, &c[..40])), Applied::Applied);
    assert_eq!(index.apply(&stored(N0, 2, TierName::G3, None, &c[..33])), Applied::Applied);
    assert_eq!(index.apply(&stored(N0, 3, TierName::G3, Some(c[32]), &c[33..99])), Applied::Applied);

    let got = answers(&index, &c);
    let want = BTreeMap::from([
        (exact(W00, TierName::G1), 70),
        (exact(W01, TierName::G1), 5),
        (exact(N0, TierName::G2), 40),
        (exact(N0, TierName::G3), 99),
    ]);
    assert_eq!(got, want);
    // A query that diverges after block 3 matches at most 3 blocks anywhere.
    let mut diverging = c[..3].to_vec();
    diverging.extend(chain(2, 50));
    assert!(answers(&index, &diverging).values().all(|&n| n == 3));
    // A query that shares nothing matches nothing.
    assert!(answers(&index, &chain(3, 10)).is_empty());
    assert!(answers(&index, &[]).is_empty());

    let stats = index.stats();
    assert_eq!(stats.blocks, 99);
    assert_eq!(stats.placements, 70 + 5 + 40 + 99);
    assert_eq!(stats.locations, 4);
    assert_eq!(stats.stored_events, 5);
}

#[test]
fn the_worker_view_splits_tiers_and_nodes() {
    let index = PrefixIndex::default();
    let c = chain(4, 64);
    index.apply(&stored(W00, 1, TierName::G1, None, &c[..10]));
    index.apply(&stored(W01, 1, TierName::G1, None, &c[..30]));
    index.apply(&stored(N0, 1, TierName::G2, None, &c[..20]));
    index.apply(&stored(N0, 2, TierName::G3, None, &c[..40]));
    index.apply(&stored(N1, 1, TierName::G2, None, &c[..50]));
    index.record_routing(W00, &c[..12], Instant::now());
    let mut out = Matches::new();
    index.find_matches(&c, &mut out);
    assert_eq!(
        out.for_worker(W00),
        WorkerPrefix { tiers: PerTier { g1: 10, g2: 20, g3: 40, g4: 50 }, g1_approximate: 12 }
    );
    assert_eq!(
        out.for_worker(W10),
        WorkerPrefix { tiers: PerTier { g1: 0, g2: 50, g3: 0, g4: 40 }, g1_approximate: 0 }
    );
    assert_eq!(out.longest(), 50);
    assert_eq!(out.blocks_at(exact(W01, TierName::G1)), 30);
    let mut views = WorkerViews::default();
    out.views(&mut views);
    for worker in [W00, W01, W10, SourceId::worker(2, 0)] {
        assert_eq!(views.for_worker(worker), out.for_worker(worker), "{worker:?}");
    }
}

/// The one-pass views agree with the per-worker scan on random clusters: several nodes, each
/// with workers' G1 (exact and approximate) and its stores' G2 and G3.
#[test]
fn worker_views_agree_with_the_per_worker_scan() {
    let mut state = 0x5eed_u64;
    let mut views = WorkerViews::default();
    for round in 0..200u64 {
        let index = PrefixIndex::default();
        let c = chain(round, 40);
        let nodes = 1 + splitmix(&mut state) % 4;
        let mut seq: HashMap<SourceId, u64> = HashMap::new();
        let mut next = |source: SourceId| {
            let s = seq.entry(source).or_insert(0);
            *s += 1;
            *s
        };
        for node in 0..nodes as u16 {
            for worker in 0..3u16 {
                let n = (splitmix(&mut state) % 41) as usize;
                let w = SourceId::worker(node, worker);
                if n > 0 {
                    index.apply(&stored(w, next(w), TierName::G1, None, &c[..n]));
                }
                let n = (splitmix(&mut state) % 41) as usize;
                if n > 0 && splitmix(&mut state).is_multiple_of(3) {
                    index.record_routing(w, &c[..n], Instant::now());
                }
            }
            let store = SourceId::node_store(node);
            for tier in TierName::NODE {
                let n = (splitmix(&mut state) % 41) as usize;
                if n > 0 {
                    index.apply(&stored(store, next(store), tier, None, &c[..n]));
                }
            }
        }
        let mut out = Matches::new();
        index.find_matches(&c, &mut out);
        out.views(&mut views);
        for node in 0..=nodes as u16 {
            for worker in 0..4u16 {
                let w = SourceId::worker(node, worker);
                assert_eq!(views.for_worker(w), out.for_worker(w), "round {round}, {w:?}");
            }
        }
    }
}

#[test]
fn duplicates_are_stale_and_a_gap_waits_for_a_resync() {
    let index = PrefixIndex::default();
    let c = chain(5, 40);
    assert_eq!(index.apply(&stored(W00, 1, TierName::G1, None, &c[..10])), Applied::Applied);
    assert_eq!(index.apply(&stored(W00, 1, TierName::G1, None, &c[..10])), Applied::Stale);
    // Event 2 is lost.
    let gap = index.apply(&stored(W00, 3, TierName::G1, Some(c[19]), &c[20..30]));
    assert_eq!(gap, Applied::Gap { source: W00, expected: 2, got: 3 });
    assert!(index.awaiting_resync(W00));
    let refused = index.apply(&stored(W00, 4, TierName::G1, Some(c[29]), &c[30..35]));
    assert_eq!(refused, Applied::AwaitingResync { source: W00 });
    assert_eq!(answers(&index, &c)[&exact(W00, TierName::G1)], 10);

    // The source's snapshot after its event 4: blocks 0..35 (the lost event stored 10..20).
    let snapshot = [SnapshotRun { tier: TierName::G1, parent: None, hashes: c[..35].to_vec() }];
    index.resync(W00, 1, &snapshot, 4);
    assert!(!index.awaiting_resync(W00));
    assert_eq!(answers(&index, &c)[&exact(W00, TierName::G1)], 35);
    assert_eq!(index.apply(&stored(W00, 4, TierName::G1, None, &c[..1])), Applied::Stale);
    assert_eq!(index.apply(&stored(W00, 5, TierName::G1, Some(c[34]), &c[35..40])), Applied::Applied);
    assert_eq!(answers(&index, &c)[&exact(W00, TierName::G1)], 40);

    let stats = index.stats();
    assert_eq!((stats.stale_events, stats.gaps, stats.refused_events, stats.resyncs), (2, 1, 1, 1));
}

#[test]
fn a_source_that_starts_mid_stream_needs_a_resync() {
    let index = PrefixIndex::default();
    let got = index.apply(&stored(W00, 7, TierName::G1, None, &chain(6, 3)));
    assert_eq!(got, Applied::Gap { source: W00, expected: 1, got: 7 });
    assert!(answers(&index, &chain(6, 3)).is_empty());
}

#[test]
fn a_new_epoch_drops_what_the_old_one_reported() {
    let index = PrefixIndex::default();
    let c = chain(7, 20);
    index.apply(&stored(W00, 1, TierName::G1, None, &c[..10]));
    index.apply(&stored(W01, 1, TierName::G1, None, &c[..10]));
    let mut restart = stored(W00, 1, TierName::G1, None, &c[..3]);
    restart.epoch = 2;
    assert_eq!(index.apply(&restart), Applied::NewEpoch { previous: 1 });
    let got = answers(&index, &c);
    assert_eq!(got[&exact(W00, TierName::G1)], 3);
    assert_eq!(got[&exact(W01, TierName::G1)], 10);
    // An event of the old epoch arriving late is stale.
    assert_eq!(index.apply(&stored(W00, 2, TierName::G1, None, &c[..10])), Applied::Stale);
    // A restart whose first event is lost: dropped, then a gap.
    let mut late = stored(W01, 2, TierName::G1, None, &c[..1]);
    late.epoch = 5;
    assert_eq!(index.apply(&late), Applied::Gap { source: W01, expected: 1, got: 2 });
    assert!(!answers(&index, &c).contains_key(&exact(W01, TierName::G1)));
    assert_eq!(index.stats().new_epochs, 2);
}

#[test]
fn cleared_drops_every_tier_of_the_source_only() {
    let index = PrefixIndex::default();
    let c = chain(8, 10);
    index.apply(&stored(N0, 1, TierName::G2, None, &c));
    index.apply(&stored(N0, 2, TierName::G3, None, &c));
    index.apply(&stored(N1, 1, TierName::G3, None, &c));
    index.apply(&KvEvent { source: N0, epoch: 1, seq: 3, kind: KvEventKind::Cleared });
    assert_eq!(answers(&index, &c), BTreeMap::from([(exact(N1, TierName::G3), 10)]));
    let stats = index.stats();
    assert_eq!((stats.blocks, stats.placements, stats.cleared_events), (10, 10, 1));
}

#[test]
fn out_of_order_events_and_interior_evictions_stay_exact() {
    let index = PrefixIndex::default();
    let c = chain(9, 200);
    // Children before their parents: orphans until the parents arrive.
    index.apply(&stored(W00, 1, TierName::G1, Some(c[99]), &c[100..200]));
    assert!(answers(&index, &c).is_empty());
    index.apply(&stored(W00, 2, TierName::G1, None, &c[..50]));
    assert_eq!(answers(&index, &c)[&exact(W00, TierName::G1)], 50);
    index.apply(&stored(W00, 3, TierName::G1, Some(c[49]), &c[50..100]));
    assert_eq!(answers(&index, &c)[&exact(W00, TierName::G1)], 200);
    // An interior block leaves: everything after it is stranded, wherever the jumps land.
    index.apply(&removed(W00, 4, TierName::G1, &[c[65]]));
    assert_eq!(answers(&index, &c)[&exact(W00, TierName::G1)], 65);
    index.apply(&removed(W00, 5, TierName::G1, &[c[0]]));
    assert!(answers(&index, &c).is_empty());
    index.apply(&stored(W00, 6, TierName::G1, None, &c[..1]));
    index.apply(&stored(W00, 7, TierName::G1, Some(c[64]), &c[65..66]));
    assert_eq!(answers(&index, &c)[&exact(W00, TierName::G1)], 200);
    index.with_store(Store::check_invariants);
}

#[test]
fn a_location_with_gaps_is_searched_by_jumps_and_stays_exact() {
    // One location holding a long chain with 1 to 12 interior gaps, or every third block
    // missing (a sparse tier), beside a prefix-closed one; every prefix of the chain as a query,
    // checked against the first block missing.
    let c = chain(12, 400);
    let mut state = 5;
    let mut patterns: Vec<Vec<bool>> = (1..=12)
        .map(|gaps| {
            let mut held = vec![true; c.len()];
            for _ in 0..gaps {
                let start = 1 + (splitmix(&mut state) % 398) as usize;
                let len = 1 + (splitmix(&mut state) % 40) as usize;
                held[start..(start + len).min(c.len() - 1)].fill(false);
            }
            held
        })
        .collect();
    patterns.push((0..c.len()).map(|i| i % 3 != 2 || i < 150).collect());
    for (gaps, held) in patterns.into_iter().enumerate() {
        let index = PrefixIndex::default();
        let mut seq = 0;
        let mut run = 0;
        while run < c.len() {
            let end = run + held[run..].iter().take_while(|&&h| h == held[run]).count();
            if held[run] {
                seq += 1;
                let parent = run.checked_sub(1).map(|p| c[p]);
                index.apply(&stored(W00, seq, TierName::G1, parent, &c[run..end]));
            }
            run = end;
        }
        let other = SourceId::worker(0, 1);
        index.apply(&stored(other, 1, TierName::G1, None, &c[..300]));
        for n in 1..=c.len() {
            let got = answers(&index, &c[..n]);
            let want = held[..n].iter().position(|&h| !h).unwrap_or(n);
            assert_eq!(got[&exact(W00, TierName::G1)], want, "{gaps} gaps, query of {n}");
            assert_eq!(got[&exact(other, TierName::G1)], n.min(300), "{gaps} gaps, query of {n}");
        }
        index.with_store(Store::check_invariants);
    }
}

#[test]
fn many_locations_dropping_between_jumps_get_exact_lengths() {
    let index = PrefixIndex::default();
    let c = chain(10, 300);
    for w in 0..64u16 {
        let len = 1 + usize::from(w) * 37 % 300;
        index.apply(&stored(SourceId::worker(0, w), 1, TierName::G1, None, &c[..len]));
    }
    let got = answers(&index, &c);
    assert_eq!(got.len(), 64);
    for w in 0..64u16 {
        assert_eq!(got[&exact(SourceId::worker(0, w), TierName::G1)], 1 + usize::from(w) * 37 % 300);
    }
    // Queries shorter than the stored chains, of every length around the jump size.
    for n in 1..70 {
        let got = answers(&index, &c[..n]);
        for w in 0..64u16 {
            let want = (1 + usize::from(w) * 37 % 300).min(n);
            assert_eq!(got[&exact(SourceId::worker(0, w), TierName::G1)], want, "query of {n}");
        }
    }
    // A few locations with orphans (a stranded run beyond a gap) hold some of the probes too:
    // they are walked, and the others' counts leave them out.
    for w in 64..67u16 {
        let source = SourceId::worker(0, w);
        index.apply(&stored(source, 1, TierName::G1, None, &c[..usize::from(w) - 50]));
        index.apply(&stored(source, 2, TierName::G1, Some(c[usize::from(w) - 30]), &c[usize::from(w) - 29..250]));
    }
    for n in [20, 33, 64, 65, 100, 300] {
        let got = answers(&index, &c[..n]);
        for w in 64..67u16 {
            assert_eq!(got[&exact(SourceId::worker(0, w), TierName::G1)], (usize::from(w) - 50).min(n), "query of {n}");
        }
    }
}

#[test]
fn a_full_index_refuses_new_blocks_but_not_new_holders() {
    // One shard: `max_blocks` is then exact (with more, each shard gets its share).
    let index = PrefixIndex::with_shards(IndexConfig { max_blocks: 8, ..IndexConfig::default() }, 1);
    let c = chain(11, 12);
    index.apply(&stored(W00, 1, TierName::G1, None, &c));
    assert_eq!(answers(&index, &c)[&exact(W00, TierName::G1)], 8);
    index.apply(&stored(W01, 1, TierName::G1, None, &c[..10]));
    assert_eq!(answers(&index, &c)[&exact(W01, TierName::G1)], 8);
    let stats = index.stats();
    assert_eq!((stats.blocks, stats.placements, stats.rejected_full), (8, 16, 6));
    // Room comes back when sources evict.
    index.apply(&removed(W00, 2, TierName::G1, &c[4..8]));
    index.apply(&removed(W01, 2, TierName::G1, &c[4..8]));
    assert_eq!(index.stats().blocks, 4);
    index.apply(&stored(W00, 3, TierName::G1, Some(c[3]), &c[4..12]));
    assert_eq!(answers(&index, &c)[&exact(W00, TierName::G1)], 8);
    let stats = index.stats();
    assert_eq!((stats.blocks, stats.rejected_full), (8, 6 + 4));
}

/// One external engine's events fill at most a quarter of the index (10M entries of one vLLM
/// once pushed the node's own out); the node's workers still index theirs, and another engine
/// gets its own quarter.
#[test]
fn an_external_engine_holds_at_most_its_share_of_the_index() {
    let index = PrefixIndex::with_shards(IndexConfig { max_blocks: 400, ..IndexConfig::default() }, 1);
    let (vllm, other) = (SourceId::external(0, 0), SourceId::external(0, 1));
    let c = chain(21, 300);
    index.apply(&stored(vllm, 1, TierName::G1, None, &c));
    let stats = index.stats();
    assert_eq!((stats.blocks, stats.rejected_full), (100, 200), "a quarter of 400");
    index.apply(&stored(other, 1, TierName::G1, None, &c[..150]));
    assert_eq!(answers(&index, &c)[&exact(other, TierName::G1)], 100, "its own quarter, shared blocks included");
    let mine = chain(22, 200);
    index.apply(&stored(W00, 1, TierName::G1, None, &mine));
    assert_eq!(answers(&index, &mine)[&exact(W00, TierName::G1)], 200, "the node's own workers are not crowded out");
    // The engine's evictions give its room back.
    index.apply(&removed(vllm, 2, TierName::G1, &c[50..100]));
    index.apply(&stored(vllm, 3, TierName::G1, Some(c[49]), &c[50..120]));
    assert_eq!(answers(&index, &c)[&exact(vllm, TierName::G1)], 100);
}

#[test]
fn a_full_index_does_not_grow_its_table() {
    let max_blocks = 1000;
    let index = PrefixIndex::with_shards(IndexConfig { max_blocks, ..IndexConfig::default() }, 1);
    let c = chain(12, 5000);
    index.apply(&stored(W00, 1, TierName::G1, None, &c));
    // Events far longer than the room left, and single blocks, once full.
    for (k, block) in c.iter().enumerate().take(50) {
        index.apply(&stored(W01, k as u64 + 1, TierName::G1, k.checked_sub(1).map(|p| c[p]), &[*block]));
    }
    index.apply(&stored(W10, 1, TierName::G1, None, &chain(13, 5000)));
    assert_eq!(index.stats().blocks, max_blocks as u64);
    // Room for `max_blocks` at the table's load bound, no more.
    let most = (max_blocks * 8).div_ceil(5).next_power_of_two();
    index.with_store(|store| assert!(store.table_slots() <= most, "{} slots", store.table_slots()));
}

#[test]
fn approximate_placements_expire_lazily_and_refresh() {
    let ttl = Duration::from_secs(10);
    let index = PrefixIndex::new(IndexConfig { approximate_ttl: ttl, ..IndexConfig::default() });
    let t0 = Instant::now();
    let a = chain(12, 8);
    let b = chain(13, 4);
    index.record_routing(W00, &a, t0);
    let approx = Location { source: W00, tier: TierName::G1, approximate: true };
    assert_eq!(answers(&index, &a), BTreeMap::from([(approx, 8)]));
    index.record_routing(W00, &a[..3], t0 + Duration::from_secs(8));
    // At t0 + 10 s the first record expires; the refreshed blocks 0..3 stay until t0 + 18 s.
    index.record_routing(W01, &b, t0 + ttl);
    assert_eq!(answers(&index, &a), BTreeMap::from([(approx, 3)]));
    index.expire_approximate(t0 + Duration::from_secs(18));
    assert!(answers(&index, &a).is_empty());
    assert_eq!(answers(&index, &b).len(), 1);
    let stats = index.stats();
    assert_eq!(stats.approximate_recorded, 8 + 3 + 4);
    assert_eq!(stats.approximate_expired, 8);
    assert_eq!(stats.approximate_placements, 4);
    // Exact events for the same worker live in their own location.
    index.apply(&stored(W00, 1, TierName::G1, None, &a[..2]));
    index.record_routing(W00, &a, t0 + Duration::from_secs(20));
    let got = answers(&index, &a);
    assert_eq!((got[&exact(W00, TierName::G1)], got[&approx]), (2, 8));
}

// ---------------------------------------------------------------------------------------------
// Property tests against a reference model.
// ---------------------------------------------------------------------------------------------

/// A forest of blocks: every node's hash and its parent.
#[derive(Debug, Clone)]
struct Forest {
    hashes: Vec<BlockHash>,
    parents: Vec<Option<usize>>,
}

impl Forest {
    /// `shape[i]` decides node `i`'s parent: mostly the previous node, so chains grow longer
    /// than the lookup's jump.
    fn new(shape: &[(u8, u16, u128)]) -> Self {
        let mut parents = Vec::new();
        for (i, &(choice, pick, _)) in shape.iter().enumerate() {
            parents.push(match choice {
                _ if i == 0 => None,
                0 => None,
                1..=7 => Some(i - 1),
                _ => Some(usize::from(pick) % i),
            });
        }
        Self { hashes: shape.iter().map(|&(_, _, h)| BlockHash(h)).collect(), parents }
    }

    fn path(&self, mut node: usize) -> Vec<usize> {
        let mut path = vec![node];
        while let Some(p) = self.parents[node] {
            path.push(p);
            node = p;
        }
        path.reverse();
        path
    }

    fn parent_hash(&self, node: usize) -> Option<BlockHash> {
        self.parents[node].map(|p| self.hashes[p])
    }

    /// Every root-to-node chain, and each of them followed by a block nobody holds.
    fn queries(&self) -> Vec<Vec<BlockHash>> {
        let mut queries = Vec::new();
        for node in 0..self.hashes.len() {
            let path: Vec<BlockHash> = self.path(node).into_iter().map(|i| self.hashes[i]).collect();
            let mut longer = path.clone();
            longer.push(BlockHash(!path[path.len() - 1].0));
            queries.push(path);
            queries.push(longer);
        }
        queries
    }
}

#[derive(Debug, Clone, Copy)]
struct ModelSource {
    epoch: u64,
    last_seq: u64,
    awaiting: bool,
}

/// The index as its contract describes it, by brute force.
#[derive(Debug, Default)]
struct Model {
    max_blocks: usize,
    ttl: Duration,
    exact: BTreeMap<Location, BTreeSet<BlockHash>>,
    approx: BTreeMap<Location, HashMap<BlockHash, Instant>>,
    sources: HashMap<SourceId, ModelSource>,
}

impl Model {
    fn new(max_blocks: usize, ttl: Duration) -> Self {
        Self { max_blocks, ttl, ..Self::default() }
    }

    fn indexed(&self, hash: BlockHash) -> bool {
        self.exact.values().any(|s| s.contains(&hash)) || self.approx.values().any(|s| s.contains_key(&hash))
    }

    fn distinct(&self) -> usize {
        let mut all: BTreeSet<BlockHash> = self.exact.values().flatten().copied().collect();
        all.extend(self.approx.values().flat_map(|s| s.keys().copied()));
        all.len()
    }

    fn admit(&self, hash: BlockHash) -> bool {
        self.indexed(hash) || self.distinct() < self.max_blocks
    }

    fn insert(&mut self, location: Location, hashes: &[BlockHash]) {
        for &hash in hashes {
            if self.admit(hash) {
                self.exact.entry(location).or_default().insert(hash);
            }
        }
    }

    fn clear_source(&mut self, source: SourceId) {
        self.exact.retain(|l, _| l.source != source);
    }

    fn apply(&mut self, event: &KvEvent) -> Applied {
        let source = event.source;
        let state =
            *self.sources.entry(source).or_insert(ModelSource { epoch: event.epoch, last_seq: 0, awaiting: false });
        let mut new_epoch = None;
        let mut state = if event.epoch < state.epoch {
            return Applied::Stale;
        } else if event.epoch > state.epoch {
            self.clear_source(source);
            new_epoch = Some(state.epoch);
            ModelSource { epoch: event.epoch, last_seq: 0, awaiting: false }
        } else {
            state
        };
        let outcome = if state.awaiting {
            Applied::AwaitingResync { source }
        } else if event.seq <= state.last_seq {
            Applied::Stale
        } else if event.seq > state.last_seq + 1 {
            state.awaiting = true;
            Applied::Gap { source, expected: state.last_seq + 1, got: event.seq }
        } else {
            state.last_seq = event.seq;
            match &event.kind {
                KvEventKind::Stored { hashes, tier, .. } => self.insert(exact(source, *tier), hashes),
                KvEventKind::Removed { hashes, tier } => {
                    if let Some(set) = self.exact.get_mut(&exact(source, *tier)) {
                        hashes.iter().for_each(|h| {
                            set.remove(h);
                        });
                    }
                }
                KvEventKind::Cleared => self.clear_source(source),
            }
            match new_epoch {
                Some(previous) => Applied::NewEpoch { previous },
                None => Applied::Applied,
            }
        };
        self.sources.insert(source, state);
        outcome
    }

    fn resync(&mut self, source: SourceId, epoch: u64, snapshot: &[SnapshotRun], last_seq: u64) {
        self.clear_source(source);
        for run in snapshot {
            self.insert(exact(source, run.tier), &run.hashes);
        }
        self.sources.insert(source, ModelSource { epoch, last_seq, awaiting: false });
    }

    fn expire(&mut self, now: Instant) {
        for set in self.approx.values_mut() {
            set.retain(|_, deadline| *deadline > now);
        }
    }

    fn record(&mut self, worker: SourceId, hashes: &[BlockHash], now: Instant) {
        self.expire(now);
        let location = Location { source: worker, tier: TierName::G1, approximate: true };
        for &hash in hashes {
            if self.admit(hash) {
                self.approx.entry(location).or_default().insert(hash, now + self.ttl);
            }
        }
    }

    fn find(&self, query: &[BlockHash]) -> BTreeMap<Location, usize> {
        let exact = self.exact.iter().map(|(l, s)| (*l, query.iter().take_while(|h| s.contains(h)).count()));
        let approx = self.approx.iter().map(|(l, s)| (*l, query.iter().take_while(|h| s.contains_key(h)).count()));
        exact.chain(approx).filter(|&(_, n)| n > 0).collect()
    }
}

/// What a source really holds, and the events it sends about it.
#[derive(Debug)]
struct WorldSource {
    id: SourceId,
    epoch: u64,
    seq: u64,
    held: BTreeMap<TierName, BTreeSet<usize>>,
    last: Option<KvEvent>,
}

impl WorldSource {
    fn tiers(&self) -> &'static [TierName] {
        if self.id.is_node_store() { &TierName::NODE } else { &[TierName::G1] }
    }

    fn event(&mut self, kind: KvEventKind) -> KvEvent {
        self.seq += 1;
        let event = KvEvent { source: self.id, epoch: self.epoch, seq: self.seq, kind };
        self.last = Some(event.clone());
        event
    }

    fn snapshot(&self, forest: &Forest) -> Vec<SnapshotRun> {
        // One run per block, parents from the forest: the index must rebuild its orphan
        // bookkeeping from blocks in any order.
        let mut runs = Vec::new();
        for (&tier, nodes) in &self.held {
            for &node in nodes.iter().rev() {
                runs.push(SnapshotRun { tier, parent: forest.parent_hash(node), hashes: vec![forest.hashes[node]] });
            }
        }
        runs
    }
}

/// One step of a scenario, decoded from raw numbers so the shrinker can work on them.
#[derive(Debug, Clone, Copy)]
struct Step {
    op: u8,
    source: u8,
    a: u16,
    b: u16,
    delivery: u8,
}

fn step() -> impl Strategy<Value = Step> {
    (0u8..100, 0u8..5, any::<u16>(), any::<u16>(), 0u8..10).prop_map(|(op, source, a, b, delivery)| Step {
        op,
        source,
        a,
        b,
        delivery,
    })
}

fn forest() -> impl Strategy<Value = Forest> {
    prop::collection::vec((0u8..10, any::<u16>(), any::<u128>()), 40..120).prop_map(|s| Forest::new(&s))
}

/// Runs `steps` against the index and the model, comparing every query's answer after each.
/// Replays `steps` against the index (`shards` shards) and the model. With several shards the
/// per-shard `max_blocks` share and the per-shard block count differ from the model's global ones,
/// so those are only compared with one shard.
fn run_scenario(forest: &Forest, steps: &[Step], max_blocks: usize, shards: usize) -> Result<(), TestCaseError> {
    let ttl = Duration::from_secs(5);
    let index = PrefixIndex::with_shards(IndexConfig { max_blocks, approximate_ttl: ttl }, shards);
    let mut model = Model::new(max_blocks, ttl);
    let mut world: Vec<WorldSource> = [W00, W01, W10, N0, N1]
        .into_iter()
        .map(|id| WorldSource { id, epoch: 1, seq: 0, held: BTreeMap::new(), last: None })
        .collect();
    let queries = forest.queries();
    let n = forest.hashes.len();
    let t0 = Instant::now();
    let mut now = t0;

    for s in steps {
        let src = &mut world[usize::from(s.source)];
        let tier = src.tiers()[usize::from(s.b) % src.tiers().len()];
        let deliver = |event: &KvEvent, model: &mut Model| -> Result<(), TestCaseError> {
            prop_assert_eq!(index.apply(event), model.apply(event));
            Ok(())
        };
        match s.op {
            // Store a chain segment ending at node `a`.
            0..=44 => {
                let path = forest.path(usize::from(s.a) % n);
                let start = usize::from(s.b) % path.len();
                let segment = &path[start..];
                src.held.entry(tier).or_default().extend(segment);
                let kind = KvEventKind::Stored {
                    hashes: segment.iter().map(|&i| forest.hashes[i]).collect(),
                    parent: forest.parent_hash(segment[0]),
                    tier,
                };
                let event = src.event(kind);
                match s.delivery {
                    0 => {}                                                     // lost
                    1 => (0..2).try_for_each(|_| deliver(&event, &mut model))?, // duplicated
                    _ => deliver(&event, &mut model)?,
                }
            }
            // Remove a few blocks, interior ones included.
            45..=69 => {
                let held = src.held.entry(tier).or_default();
                let mut picked = Vec::new();
                for k in 0..=(s.b % 4) {
                    let node = (usize::from(s.a) + usize::from(k) * 7) % n;
                    if held.remove(&node) || s.delivery == 9 {
                        picked.push(forest.hashes[node]);
                    }
                }
                let event = src.event(KvEventKind::Removed { hashes: picked, tier });
                if s.delivery != 0 {
                    deliver(&event, &mut model)?;
                }
            }
            70..=72 => {
                src.held.clear();
                let event = src.event(KvEventKind::Cleared);
                deliver(&event, &mut model)?;
            }
            // Replay an old event.
            73..=76 => {
                if let Some(event) = src.last.clone() {
                    deliver(&event, &mut model)?;
                }
            }
            // Restart: a new epoch with nothing held.
            77..=80 => {
                src.epoch += 1;
                src.seq = 0;
                src.held.clear();
                src.last = None;
            }
            // Resync from the source's snapshot.
            81..=87 => {
                let snapshot = src.snapshot(forest);
                index.resync(src.id, src.epoch, &snapshot, src.seq);
                model.resync(src.id, src.epoch, &snapshot, src.seq);
            }
            // Approximate mode: route a request to a worker.
            88..=95 => {
                now += Duration::from_millis(u64::from(s.b % 3000));
                let worker = [W00, W01, W10][usize::from(s.source) % 3];
                let query: Vec<BlockHash> =
                    forest.path(usize::from(s.a) % n).iter().map(|&i| forest.hashes[i]).collect();
                index.record_routing(worker, &query, now);
                model.record(worker, &query, now);
            }
            _ => {
                now += Duration::from_millis(u64::from(s.b % 3000));
                index.expire_approximate(now);
                model.expire(now);
            }
        }
        for query in &queries {
            prop_assert_eq!(answers(&index, query), model.find(query), "query {:?}", query);
        }
        index.with_store(Store::check_invariants);
        let stats = index.stats();
        if shards == 1 {
            prop_assert_eq!(stats.blocks as usize, model.distinct());
            prop_assert!(stats.blocks as usize <= max_blocks);
        }
    }

    // Resync every source that needs it (and restarted ones the index has not heard from): the
    // index then agrees with what the sources hold.
    for src in &world {
        let snapshot = src.snapshot(forest);
        index.resync(src.id, src.epoch, &snapshot, src.seq);
        model.resync(src.id, src.epoch, &snapshot, src.seq);
    }
    index.expire_approximate(now + ttl);
    model.expire(now + ttl);
    for query in &queries {
        prop_assert_eq!(answers(&index, query), model.find(query));
    }
    if max_blocks >= n {
        // Nothing was refused: the model equals the world exactly.
        let truth: BTreeMap<Location, BTreeSet<BlockHash>> = world
            .iter()
            .flat_map(|s| s.held.iter().map(move |(&t, nodes)| (exact(s.id, t), nodes)))
            .filter(|(_, nodes)| !nodes.is_empty())
            .map(|(l, nodes)| (l, nodes.iter().map(|&i| forest.hashes[i]).collect()))
            .collect();
        let model_exact: BTreeMap<_, _> =
            model.exact.iter().filter(|(_, s)| !s.is_empty()).map(|(l, s)| (*l, s.clone())).collect();
        prop_assert_eq!(model_exact, truth);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn the_index_agrees_with_the_reference_model(forest in forest(), steps in prop::collection::vec(step(), 1..80)) {
        run_scenario(&forest, &steps, usize::MAX, 1)?;
        run_scenario(&forest, &steps, usize::MAX, 3)?;
    }

    #[test]
    fn a_full_index_agrees_with_the_reference_model(
        forest in forest(),
        steps in prop::collection::vec(step(), 1..80),
        max_blocks in 1usize..40,
    ) {
        run_scenario(&forest, &steps, max_blocks, 1)?;
    }
}

// ---------------------------------------------------------------------------------------------
// Concurrency.
// ---------------------------------------------------------------------------------------------

#[test]
fn readers_see_whole_events_while_a_writer_applies_them() {
    for shards in [1, 2, 3] {
        readers_see_whole_events(shards);
    }
}

/// Two readers look up while one thread applies a random event stream: for every source, the
/// part of an answer about that source's locations equals the state after some prefix of the
/// events applied between the lookup's start and end (with one shard, one prefix for all sources;
/// with several, each shard may be seen at a different moment, never mid-event).
fn readers_see_whole_events(shards: usize) {
    let sources = [W00, W01, W10, N0];
    let chains: Vec<Vec<BlockHash>> = (0..4).map(|i| chain(100 + i, 150)).collect();
    // Conversations share a 40-block system prompt.
    let chains: Vec<Vec<BlockHash>> =
        chains.iter().map(|c| chains[0][..40].iter().chain(&c[40..]).copied().collect()).collect();
    let mut rng = 7u64;
    let mut events = Vec::new();
    let mut seqs = [0u64; 4];
    let mut lens = [0usize; 4];
    for _ in 0..400 {
        let s = (splitmix(&mut rng) % 4) as usize;
        let c = (splitmix(&mut rng) % 4) as usize;
        let tier = if sources[s].is_node_store() { TierName::G2 } else { TierName::G1 };
        seqs[s] += 1;
        let kind = match splitmix(&mut rng) % 10 {
            0 => {
                lens[s] = 0;
                KvEventKind::Cleared
            }
            1..=3 if lens[s] > 0 => {
                let from = (splitmix(&mut rng) as usize) % lens[s];
                let hashes = chains[c][from..lens[s]].to_vec();
                lens[s] = from;
                KvEventKind::Removed { hashes, tier }
            }
            _ => {
                let to = (lens[s] + 1 + (splitmix(&mut rng) as usize) % 40).min(150);
                let parent = lens[s].checked_sub(1).map(|i| chains[c][i]);
                let hashes = chains[c][lens[s].min(to)..to].to_vec();
                lens[s] = lens[s].max(to);
                KvEventKind::Stored { hashes, parent, tier }
            }
        };
        events.push(KvEvent { source: sources[s], epoch: 1, seq: seqs[s], kind });
    }

    // The answer to every query after each prefix of the events.
    let mut model = Model::new(usize::MAX, Duration::from_secs(1));
    let mut expected = vec![chains.iter().map(|q| model.find(q)).collect::<Vec<_>>()];
    for event in &events {
        model.apply(event);
        expected.push(chains.iter().map(|q| model.find(q)).collect());
    }

    let index = Arc::new(PrefixIndex::with_shards(IndexConfig::default(), shards));
    let applied = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (index, applied, done, chains, expected) =
                (index.clone(), applied.clone(), done.clone(), chains.clone(), expected.clone());
            std::thread::spawn(move || {
                let mut out = Matches::new();
                let mut lookups = 0;
                while !done.load(Ordering::Acquire) || lookups == 0 {
                    for (q, query) in chains.iter().enumerate() {
                        let before = applied.load(Ordering::Acquire);
                        index.find_matches(query, &mut out);
                        let after = applied.load(Ordering::Acquire);
                        let got: BTreeMap<Location, usize> =
                            out.locations().iter().map(|m| (m.location, m.blocks)).collect();
                        let last = (after + 1).min(expected.len() - 1);
                        if shards == 1 {
                            assert!(
                                (before..=last).any(|k| expected[k][q] == got),
                                "an answer of no state between events {before} and {last}: {got:?}"
                            );
                        }
                        for source in sources {
                            let of = |answer: &BTreeMap<Location, usize>| {
                                answer.iter().filter(|(l, _)| l.source == source).map(|(l, n)| (*l, *n)).collect()
                            };
                            let got: BTreeMap<Location, usize> = of(&got);
                            assert!(
                                (before..=last).any(|k| of(&expected[k][q]) == got),
                                "{shards} shards: {source:?}: an answer of no state between events {before} and \
                                 {last}: {got:?}"
                            );
                        }
                        lookups += 1;
                    }
                }
                lookups
            })
        })
        .collect();
    for event in &events {
        assert_eq!(index.apply(event), Applied::Applied);
        applied.fetch_add(1, Ordering::Release);
    }
    done.store(true, Ordering::Release);
    for reader in readers {
        assert!(reader.join().expect("reader panicked") > 0);
    }
    for (q, query) in chains.iter().enumerate() {
        assert_eq!(answers(&index, query), expected[events.len()][q]);
    }
}

#[test]
fn churn_compacts_the_log_and_clear_still_drops_everything() {
    let index = PrefixIndex::default();
    let c = chain(7, 300);
    let mut seq = 0;
    let mut next = || {
        seq += 1;
        seq
    };
    assert_eq!(index.apply(&stored(W00, next(), TierName::G1, None, &c[..100])), Applied::Applied);
    // Evict and re-store the tail many times, so the log fills with stale and repeated records.
    for round in 0..20 {
        let keep = 10 + round;
        let tail: Vec<BlockHash> = c[keep..100].iter().rev().copied().collect();
        assert_eq!(index.apply(&removed(W00, next(), TierName::G1, &tail)), Applied::Applied);
        let parent = Some(c[keep - 1]);
        assert_eq!(index.apply(&stored(W00, next(), TierName::G1, parent, &c[keep..100])), Applied::Applied);
        index.with_store(Store::check_invariants);
    }
    assert_eq!(answers(&index, &c[..150]), BTreeMap::from([(exact(W00, TierName::G1), 100)]));
    assert_eq!(index.stats().placements, 100);
    assert_eq!(
        index.apply(&KvEvent { source: W00, epoch: 1, seq: next(), kind: KvEventKind::Cleared }),
        Applied::Applied
    );
    assert_eq!(index.stats().blocks, 0);
    assert!(answers(&index, &c[..150]).is_empty());
    index.with_store(Store::check_invariants);
}

#[test]
fn a_writer_applies_each_sources_events_in_order_and_reports_every_outcome() {
    let inline = PrefixIndex::default();
    let index = Arc::new(PrefixIndex::default());
    let heard: Arc<parking_lot::Mutex<Vec<(SourceId, u64, Applied)>>> = Arc::default();
    let hook: OnApplied = {
        let heard = heard.clone();
        Arc::new(move |event: &KvEvent, outcome| heard.lock().push((event.source, event.seq, outcome)))
    };
    let writer = IndexWriter::spawn(index.clone(), 2, Some(hook)).expect("writer threads");
    let sources = [W00, W01, SourceId::worker(0, 2), N0];
    let mut events = Vec::new();
    for (k, &source) in sources.iter().enumerate() {
        let c = chain(10 + k as u64, 200);
        for round in 0..25u64 {
            let seq = 2 * round + 1;
            let lo = (round as usize * 7) % 150;
            let parent = lo.checked_sub(1).map(|p| c[p]);
            events.push(stored(source, seq, TierName::G1, parent, &c[lo..lo + 40]));
            let tail: Vec<BlockHash> = c[lo + 30..lo + 40].iter().rev().copied().collect();
            events.push(removed(source, seq + 1, TierName::G1, &tail));
        }
    }
    // Interleave the sources (each source's own events stay in order) and add a gap.
    events.sort_by_key(|e| (e.seq, e.source));
    events.push(stored(W01, 99, TierName::G1, None, &chain(99, 3)));
    for event in &events {
        inline.apply(event);
        writer.send(event.clone());
    }
    writer.flush();
    for (k, _) in sources.iter().enumerate() {
        let query = chain(10 + k as u64, 200);
        assert_eq!(answers(&index, &query), answers(&inline, &query));
    }
    assert_eq!(index.stats(), inline.stats());
    let heard = heard.lock().clone();
    assert_eq!(heard.len(), events.len(), "one outcome per event");
    for &source in &sources {
        let seqs: Vec<u64> = heard.iter().filter(|h| h.0 == source).map(|h| h.1).collect();
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{source:?} applied out of order: {seqs:?}");
    }
    assert!(heard.contains(&(W01, 99, Applied::Gap { source: W01, expected: 51, got: 99 })));

    // Dropping the writer applies what is still queued.
    let c = chain(500, 64);
    for (i, block) in c.iter().enumerate() {
        let parent = i.checked_sub(1).map(|p| c[p]);
        writer.send(stored(N0, 51 + i as u64, TierName::G2, parent, std::slice::from_ref(block)));
    }
    drop(writer);
    assert_eq!(answers(&index, &c), BTreeMap::from([(exact(N0, TierName::G2), 64)]));
}
