//! The node's names for the blocks vLLM engines keep in its tiers, so that the router can price a
//! load from G2 or G3 into an engine.
//!
//! An engine stores a block through the engine endpoint under its own key (vLLM's block hash
//! and KV group), and the node keeps it in the engines' G2 and G3 under a hash of that key
//! ([`ForeignEngine::block_hash`](dynamo_tiering::foreign::ForeignEngine::block_hash)). The
//! router cannot compute that name from a prompt: vLLM's hash is not the node's. The worker in
//! front of the engine can, though: its engine's KV events carry each block's tokens, and the
//! worker names the block as the node would ([`crate::worker::VllmEngine`]). It tells
//! [`EngineNames`] which engine hash has which node name; the endpoint tells it which engine hash
//! a stored block has; and `EngineNames`, as the observer of the tiers the engines store into,
//! reports each such block's arrivals and departures a second time, under the node's name
//! ([`BlockSite::Engines`]). The router then finds an engine's offloaded prefix in G2 or G3 like
//! the node's own.
//!
//! Ordering: the worker usually names a block (its engine publishes the block's G1 event at the
//! end of the step that filled it) before the engine offloads it (a later step). A block stored
//! before it is named waits, for [`UNNAMED_TTL`] at most, and is reported once named.
//!
//! Retention: the worker also says which of its requests' blocks belong to a region other than
//! the conversation (a system prompt, tool definitions, reasoning, …), by the node's name. A block
//! an engine stores then takes that region's retention in the node's tiers, and the hold of a
//! lease the node's book has on it (`cache_control`), as a block the node computed would: the
//! region and lease travel with the request on the node's side, never as the engine's say-so.
//!
//! Memory: names are kept for the [`RECENT_NAMES`] blocks named last (a block is offloaded
//! within moments of being named, or not at all), regions for as many; aliases only while their
//! block is in G2 or G3.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dynamo_config::{RegionKind, TierName};
use dynamo_tiering::block::BlockHash;
use parking_lot::Mutex;

use crate::tiers::{BlockSite, KvObserver};

/// Engine blocks whose node names are kept, the latest ones.
pub const RECENT_NAMES: usize = 1 << 18;
/// Stored blocks that may wait for their name at once.
pub const MAX_UNNAMED: usize = 1 << 16;
/// How long a stored block waits for its name.
pub const UNNAMED_TTL: Duration = Duration::from_secs(30);

/// A block's name as the node hashes it, and its parent's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeName {
    /// The node's hash of the block.
    pub hash: BlockHash,
    /// The node's hash of the block before it (`None`: the first of its sequence).
    pub parent: Option<BlockHash>,
}

/// See the module documentation. It is the [`KvObserver`] of the tiers engines store into: it
/// passes every event on to the node's observer, and adds the aliases'.
#[derive(Debug)]
pub struct EngineNames {
    observer: Arc<dyn KvObserver>,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The engine's hash (its low 64 bits) → the node's name, for the blocks named last.
    named: HashMap<u64, NodeName>,
    named_order: VecDeque<u64>,
    /// A stored block's hash in the node's tiers → its alias.
    aliases: HashMap<BlockHash, Alias>,
    /// The node's name → the stored blocks (their hashes in the tiers) named so.
    copies: HashMap<BlockHash, Vec<BlockHash>>,
    /// Stored blocks waiting for a name: the engine's hash → the block's hash in the tiers.
    unnamed: HashMap<u64, BlockHash>,
    unnamed_order: VecDeque<(Instant, u64)>,
    /// Blocks of recent requests in a region other than the conversation, by the node's name.
    regions: HashMap<BlockHash, RegionKind>,
    regions_order: VecDeque<BlockHash>,
}

#[derive(Debug)]
struct Alias {
    /// The engine's hash.
    theirs: u64,
    /// `None` until the worker names it.
    name: Option<NodeName>,
    /// Where the block is: G2, G3.
    in_g2: bool,
    in_g3: bool,
}

impl Alias {
    fn tiers(&self) -> impl Iterator<Item = TierName> {
        [(self.in_g2, TierName::G2), (self.in_g3, TierName::G3)].into_iter().filter(|(held, _)| *held).map(|(_, t)| t)
    }

    fn held(&mut self, tier: TierName) -> &mut bool {
        if tier == TierName::G2 { &mut self.in_g2 } else { &mut self.in_g3 }
    }
}

impl EngineNames {
    /// Names reported to `observer` (the node's), beside everything the tiers report.
    pub fn new(observer: Arc<dyn KvObserver>) -> Self {
        Self { observer, state: Mutex::new(State::default()) }
    }

    /// A worker named its engine's block `theirs` (the low 64 bits of vLLM's hash) `name`.
    pub fn named(&self, theirs: u64, name: NodeName) {
        let mut state = self.state.lock();
        if state.named.insert(theirs, name).is_none() {
            state.named_order.push_back(theirs);
            while state.named_order.len() > RECENT_NAMES {
                if let Some(old) = state.named_order.pop_front() {
                    state.named.remove(&old);
                }
            }
        }
        // A block stored before it was named is reported now, where it is.
        let Some(hash) = state.unnamed.remove(&theirs) else { return };
        let Some(alias) = state.aliases.get_mut(&hash).filter(|a| a.name.is_none()) else { return };
        alias.name = Some(name);
        let tiers: Vec<TierName> = alias.tiers().collect();
        state.copies.entry(name.hash).or_default().push(hash);
        drop(state);
        for tier in tiers {
            self.observer.stored(BlockSite::Engines(tier), name.parent, &[name.hash]);
        }
    }

    /// An engine is storing block `hash` (its key's hash in the node's tiers), whose vLLM hash
    /// ends in `theirs`: from now on its arrivals and departures in G2 and G3 are reported under
    /// the node's name too. Call [`Self::settle`] if it did not arrive.
    pub fn storing(&self, hash: BlockHash, theirs: u64) {
        let now = Instant::now();
        let mut state = self.state.lock();
        state.expire(now);
        if state.aliases.contains_key(&hash) {
            return;
        }
        let name = state.named.get(&theirs).copied();
        if name.is_none() {
            if state.unnamed.len() >= MAX_UNNAMED {
                return;
            }
            state.unnamed.insert(theirs, hash);
            state.unnamed_order.push_back((now, theirs));
        }
        if let Some(name) = name {
            state.copies.entry(name.hash).or_default().push(hash);
        }
        state.aliases.insert(hash, Alias { theirs, name, in_g2: false, in_g3: false });
    }

    /// `hash`'s store ended: if it is in no tier (its store failed), its alias goes.
    pub fn settle(&self, hash: BlockHash) {
        let mut state = self.state.lock();
        if state.aliases.get(&hash).is_some_and(|a| !a.in_g2 && !a.in_g3) {
            state.forget(hash);
        }
    }

    /// Blocks (by the node's names) a request sent to an engine holds in a region other than
    /// the conversation.
    pub fn regions(&self, blocks: impl IntoIterator<Item = (BlockHash, RegionKind)>) {
        let mut state = self.state.lock();
        for (hash, region) in blocks {
            if state.regions.insert(hash, region).is_none() {
                state.regions_order.push_back(hash);
            }
        }
        while state.regions_order.len() > RECENT_NAMES {
            if let Some(old) = state.regions_order.pop_front() {
                state.regions.remove(&old);
            }
        }
    }

    /// The node's name of block `hash` (as an engine stores it) and its region, when known.
    pub fn retention(&self, hash: BlockHash) -> Option<(BlockHash, Option<RegionKind>)> {
        let state = self.state.lock();
        let name = state.aliases.get(&hash)?.name?;
        Some((name.hash, state.regions.get(&name.hash).copied()))
    }

    /// The stored blocks (their hashes in the tiers) the node names `name`: what leases on
    /// `name` also hold ([`crate::leases::LeasedTiers::each_copy`]).
    pub fn stored_as(&self, name: BlockHash) -> Vec<BlockHash> {
        self.state.lock().copies.get(&name).cloned().unwrap_or_default()
    }

    /// Blocks with an alias (named or waiting for a name).
    pub fn aliases(&self) -> usize {
        self.state.lock().aliases.len()
    }
}

impl State {
    /// Drops the alias of `hash`.
    fn forget(&mut self, hash: BlockHash) {
        let Some(alias) = self.aliases.remove(&hash) else { return };
        match alias.name {
            None => drop(self.unnamed.remove(&alias.theirs)),
            Some(name) => {
                if let Some(copies) = self.copies.get_mut(&name.hash) {
                    copies.retain(|&c| c != hash);
                    if copies.is_empty() {
                        self.copies.remove(&name.hash);
                    }
                }
            }
        }
    }

    /// Stored blocks that waited too long for a name lose their alias: nothing was reported of
    /// them under the node's name, so nothing is taken back.
    fn expire(&mut self, now: Instant) {
        while let Some(&(since, theirs)) = self.unnamed_order.front() {
            if now.duration_since(since) < UNNAMED_TTL && self.unnamed_order.len() <= MAX_UNNAMED {
                break;
            }
            self.unnamed_order.pop_front();
            if let Some(hash) = self.unnamed.remove(&theirs)
                && self.aliases.get(&hash).is_some_and(|a| a.name.is_none())
            {
                self.aliases.remove(&hash);
            }
        }
    }
}

impl KvObserver for EngineNames {
    fn stored(&self, site: BlockSite, parent: Option<BlockHash>, hashes: &[BlockHash]) {
        self.observer.stored(site, parent, hashes);
        let BlockSite::Node(tier @ (TierName::G2 | TierName::G3)) = site else { return };
        let mut named = Vec::new();
        {
            let mut state = self.state.lock();
            for hash in hashes {
                if let Some(alias) = state.aliases.get_mut(hash) {
                    let held = alias.held(tier);
                    if !*held {
                        *held = true;
                        named.extend(alias.name);
                    }
                }
            }
        }
        for name in named {
            self.observer.stored(BlockSite::Engines(tier), name.parent, &[name.hash]);
        }
    }

    fn removed(&self, site: BlockSite, hashes: &[BlockHash]) {
        self.observer.removed(site, hashes);
        let BlockSite::Node(tier @ (TierName::G2 | TierName::G3)) = site else { return };
        let mut gone = Vec::new();
        {
            let mut state = self.state.lock();
            for hash in hashes {
                let Some(alias) = state.aliases.get_mut(hash) else { continue };
                let held = alias.held(tier);
                if !*held {
                    continue;
                }
                *held = false;
                gone.extend(alias.name.map(|n| n.hash));
                if !alias.in_g2 && !alias.in_g3 {
                    state.forget(*hash);
                }
            }
        }
        if !gone.is_empty() {
            self.observer.removed(BlockSite::Engines(tier), &gone);
        }
    }

    fn cleared(&self, worker: usize) {
        self.observer.cleared(worker);
    }
}

/// The low 64 bits of vLLM's block hash in an offload key (`block hash ‖ KV group`, the group 4
/// bytes big-endian): what vLLM's KV events carry for the same block.
pub fn engine_hash_of_key(key: &[u8]) -> Option<u64> {
    let hash = key.get(..key.len().checked_sub(4)?)?;
    let low = hash.get(hash.len().checked_sub(8)?..)?;
    Some(u64::from_be_bytes(low.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every event the node's observer got.
    #[derive(Debug, Default)]
    struct Seen(Mutex<Vec<(BlockSite, bool, Vec<BlockHash>)>>);

    impl KvObserver for Seen {
        fn stored(&self, site: BlockSite, _: Option<BlockHash>, hashes: &[BlockHash]) {
            self.0.lock().push((site, true, hashes.to_vec()));
        }
        fn removed(&self, site: BlockSite, hashes: &[BlockHash]) {
            self.0.lock().push((site, false, hashes.to_vec()));
        }
        fn cleared(&self, _: usize) {}
    }

    impl Seen {
        fn engines(&self) -> Vec<(TierName, bool, Vec<BlockHash>)> {
            let seen = self.0.lock();
            seen.iter()
                .filter_map(|(site, stored, hashes)| match site {
                    BlockSite::Engines(tier) => Some((*tier, *stored, hashes.clone())),
                    _ => None,
                })
                .collect()
        }
    }

    fn h(n: u64) -> BlockHash {
        BlockHash(n as u128 | 1 << 100)
    }

    fn setup() -> (Arc<Seen>, EngineNames) {
        let seen = Arc::new(Seen::default());
        (seen.clone(), EngineNames::new(seen))
    }

    #[test]
    fn a_named_block_an_engine_stores_is_reported_under_the_nodes_name_where_it_is() {
        let (seen, names) = setup();
        names.named(7, NodeName { hash: h(70), parent: Some(h(60)) });
        names.storing(h(700), 7);
        names.stored(BlockSite::Node(TierName::G2), None, &[h(700)]);
        names.stored(BlockSite::Node(TierName::G3), None, &[h(700)]);
        assert_eq!(seen.engines(), [(TierName::G2, true, vec![h(70)]), (TierName::G3, true, vec![h(70)])]);
        assert_eq!(seen.0.lock().len(), 4, "the tiers' own events pass through");

        names.removed(BlockSite::Node(TierName::G2), &[h(700)]);
        assert_eq!(names.aliases(), 1, "still in G3");
        names.removed(BlockSite::Node(TierName::G3), &[h(700), h(701)]);
        assert_eq!(seen.engines()[2..], [(TierName::G2, false, vec![h(70)]), (TierName::G3, false, vec![h(70)])]);
        assert_eq!(names.aliases(), 0, "in no tier: forgotten");
    }

    #[test]
    fn a_block_stored_before_it_is_named_is_reported_once_named() {
        let (seen, names) = setup();
        names.storing(h(800), 8);
        names.stored(BlockSite::Node(TierName::G2), None, &[h(800)]);
        assert!(seen.engines().is_empty());
        names.named(8, NodeName { hash: h(80), parent: None });
        assert_eq!(seen.engines(), [(TierName::G2, true, vec![h(80)])]);
        names.removed(BlockSite::Node(TierName::G2), &[h(800)]);
        assert_eq!(seen.engines()[1], (TierName::G2, false, vec![h(80)]));
    }

    #[test]
    fn blocks_of_the_nodes_own_and_failed_stores_leave_nothing_behind() {
        let (seen, names) = setup();
        names.stored(BlockSite::Node(TierName::G2), None, &[h(1)]);
        names.removed(BlockSite::Node(TierName::G2), &[h(1)]);
        names.named(9, NodeName { hash: h(90), parent: None });
        names.storing(h(900), 9);
        names.settle(h(900));
        names.storing(h(901), 10);
        names.settle(h(901));
        assert_eq!(names.aliases(), 0);
        assert!(seen.engines().is_empty());
        // An unnamed store that was settled is not reported when its name comes later.
        names.named(10, NodeName { hash: h(100), parent: None });
        assert!(seen.engines().is_empty());
    }

    #[test]
    fn a_stored_block_takes_the_region_its_request_gave_it() {
        let (_, names) = setup();
        names.named(5, NodeName { hash: h(50), parent: None });
        names.named(6, NodeName { hash: h(60), parent: Some(h(50)) });
        names.regions([(h(50), RegionKind::System)]);
        names.storing(h(500), 5);
        names.storing(h(600), 6);
        assert_eq!(names.retention(h(500)), Some((h(50), Some(RegionKind::System))));
        assert_eq!(names.retention(h(600)), Some((h(60), None)), "the conversation, the default");
        assert_eq!(names.retention(h(700)), None, "never stored");
    }

    #[test]
    fn the_copies_of_a_name_are_known_while_they_are_in_a_tier() {
        let (_, names) = setup();
        names.named(3, NodeName { hash: h(30), parent: None });
        names.storing(h(300), 3);
        names.storing(h(301), 4);
        assert_eq!(names.stored_as(h(30)), [h(300)]);
        assert!(names.stored_as(h(40)).is_empty(), "not named yet");
        names.named(4, NodeName { hash: h(30), parent: None });
        assert_eq!(names.stored_as(h(30)), [h(300), h(301)], "two engines' copies of one block");
        names.stored(BlockSite::Node(TierName::G2), None, &[h(300), h(301)]);
        names.removed(BlockSite::Node(TierName::G2), &[h(300)]);
        assert_eq!(names.stored_as(h(30)), [h(301)]);
        names.removed(BlockSite::Node(TierName::G2), &[h(301)]);
        assert!(names.stored_as(h(30)).is_empty());
        assert!(names.state.lock().copies.is_empty(), "nothing kept of a name with no copy");
    }

    #[test]
    fn names_are_kept_for_the_latest_blocks_only() {
        let (_, names) = setup();
        for n in 0..(RECENT_NAMES as u64 + 10) {
            names.named(n, NodeName { hash: h(n), parent: None });
        }
        let state = names.state.lock();
        assert_eq!(state.named.len(), RECENT_NAMES);
        assert!(!state.named.contains_key(&0) && state.named.contains_key(&(RECENT_NAMES as u64 + 9)));
    }

    #[test]
    fn the_engine_hash_is_read_from_the_end_of_the_offload_keys_block_hash() {
        let mut key = vec![0u8; 24];
        key.extend_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        key.extend_from_slice(&0u32.to_be_bytes());
        assert_eq!(engine_hash_of_key(&key), Some(0x0102_0304_0506_0708));
        assert_eq!(engine_hash_of_key(&[1, 2, 3]), None);
        assert_eq!(engine_hash_of_key(&[0; 11]), None);
    }
}
