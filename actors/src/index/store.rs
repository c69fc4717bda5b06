//! The index's data: which location holds which block, and the prefix lookup over it.
//!
//! Single-threaded; [`PrefixIndex`](super::PrefixIndex) puts it behind a lock.
//!
//! # Layout
//!
//! - `blocks`: block hash → [`Entry`] (the block's parent and the sorted list of locations that
//!   hold it). A chained hash names its whole prefix, so the map needs no tree.
//! - `locations`: per location, the set of blocks it holds (so clearing a source costs its own
//!   blocks, not a scan) and its *orphan* bookkeeping.
//!
//! # Orphans and the jump search
//!
//! A location's blocks are *prefix-closed* when, for each block it holds, it also holds the
//! block's parent. Write-through in prefix order and leaf-first eviction keep every location
//! prefix-closed in practice. For such a location, holding block `i` of a query chain implies
//! holding blocks `0..i`, so the lookup can probe every [`JUMP`]-th block and bisect only where a
//! location drops out: `O(len / JUMP + drops · log JUMP)` probes instead of `O(len)`.
//!
//! Events may still arrive out of order, or evict an interior block, so each location counts its
//! *orphans* — held blocks whose parent it does not hold — exactly: per held block the number of
//! its children the location also holds, and per location a multiset of the missing parents of
//! its orphans. A location with orphans is walked block by block, so answers stay exact in every
//! state.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use dynamo_tiering::block::BlockHash;
use smallvec::SmallVec;

use super::Location;
use super::hasher::BlockHashBuild;
use super::matches::Matches;

/// Dense id of a location, assigned on first sight and never reused.
pub(crate) type LocId = u32;

/// How far the lookup jumps between probes of prefix-closed locations.
pub(crate) const JUMP: usize = 32;

type BlockMap<V> = HashMap<BlockHash, V, BlockHashBuild>;
type BlockSet = HashSet<BlockHash, BlockHashBuild>;

/// One block: its parent and the locations holding it. With its key, 64 bytes.
#[derive(Debug)]
struct Entry {
    /// The parent block; equal to the block's own hash for the first block of a sequence (a hash
    /// is never its own parent), which keeps the entry one cache line with its key.
    parent: BlockHash,
    /// Sorted by `loc`; never empty while the entry is in the map. Inline up to three holders
    /// (a block's worker G1 and its node's G2 and G3), so a probe costs one cache miss, not two.
    holders: SmallVec<[Holder; 3]>,
}

impl Entry {
    fn parent(&self, hash: BlockHash) -> Option<BlockHash> {
        (self.parent != hash).then_some(self.parent)
    }

    fn find(&self, loc: LocId) -> Result<usize, usize> {
        self.holders.binary_search_by_key(&loc, |h| h.loc)
    }
}

/// One location holding a block.
#[derive(Debug, Clone, Copy)]
struct Holder {
    loc: LocId,
    /// How many children of this block the same location holds.
    children: u32,
}

/// What the index keeps per location.
#[derive(Debug)]
struct LocationState {
    location: Location,
    held: BlockSet,
    /// Held blocks whose parent this location does not hold.
    orphans: u64,
    /// The missing parents of the orphans, with multiplicity.
    orphan_parents: BlockMap<u32>,
    /// Approximate locations only: when each block expires.
    deadlines: BlockMap<Instant>,
}

/// The outcome of adding one block to one location.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Insert {
    /// The location now holds the block.
    Added,
    /// The location already held it.
    Present,
    /// The block is new to the index and the index is full.
    Rejected,
}

/// Blocks, locations and the lookup.
#[derive(Debug)]
pub(crate) struct Store {
    blocks: BlockMap<Entry>,
    locations: Vec<LocationState>,
    location_ids: HashMap<Location, LocId>,
    max_blocks: usize,
    placements: u64,
    approximate_placements: u64,
}

impl Store {
    pub(crate) fn new(max_blocks: usize) -> Self {
        Self {
            blocks: BlockMap::default(),
            locations: Vec::new(),
            location_ids: HashMap::new(),
            max_blocks,
            placements: 0,
            approximate_placements: 0,
        }
    }

    /// Distinct blocks in the index.
    pub(crate) fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// (block, location) pairs, approximate ones included.
    pub(crate) fn placements(&self) -> u64 {
        self.placements
    }

    /// (block, location) pairs of approximate locations.
    pub(crate) fn approximate_placements(&self) -> u64 {
        self.approximate_placements
    }

    /// Locations that hold at least one block.
    pub(crate) fn live_locations(&self) -> usize {
        self.locations.iter().filter(|l| !l.held.is_empty()).count()
    }

    /// The id of `location`, assigning one on first sight.
    pub(crate) fn location_id(&mut self, location: Location) -> LocId {
        if let Some(&id) = self.location_ids.get(&location) {
            return id;
        }
        let id = LocId::try_from(self.locations.len()).expect("fewer than 2^32 locations");
        self.locations.push(LocationState {
            location,
            held: BlockSet::default(),
            orphans: 0,
            orphan_parents: BlockMap::default(),
            deadlines: BlockMap::default(),
        });
        self.location_ids.insert(location, id);
        id
    }

    /// The id of `location` if it was ever seen.
    pub(crate) fn existing_location_id(&self, location: Location) -> Option<LocId> {
        self.location_ids.get(&location).copied()
    }

    /// Adds the chain `hashes` (parent of `hashes[0]` is `parent`) to `loc`; returns how many
    /// blocks the full index refused.
    pub(crate) fn insert_chain(&mut self, loc: LocId, mut parent: Option<BlockHash>, hashes: &[BlockHash]) -> u64 {
        let mut rejected = 0;
        for &hash in hashes {
            if self.insert(loc, hash, parent) == Insert::Rejected {
                rejected += 1;
            }
            parent = Some(hash);
        }
        rejected
    }

    /// Adds `hash` (whose parent is `parent`) to `loc`.
    pub(crate) fn insert(&mut self, loc: LocId, hash: BlockHash, parent: Option<BlockHash>) -> Insert {
        let full = self.blocks.len() >= self.max_blocks;
        let state = &mut self.locations[loc as usize];
        let entry = match self.blocks.entry(hash) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(_) if full => return Insert::Rejected,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Entry { parent: parent.unwrap_or(hash), holders: SmallVec::new() })
            }
        };
        let Err(at) = entry.find(loc) else { return Insert::Present };
        // Children of `hash` this location already holds were orphans until now.
        let children = if state.orphans == 0 { 0 } else { state.orphan_parents.remove(&hash).unwrap_or(0) };
        state.orphans -= u64::from(children);
        entry.holders.insert(at, Holder { loc, children });
        // The parent recorded first wins: it is a function of the hash, and the bookkeeping must
        // use the same parent on insert and on removal.
        let parent = entry.parent(hash);
        state.held.insert(hash);
        self.placements += 1;
        if state.location.approximate {
            self.approximate_placements += 1;
        }
        if let Some(parent) = parent {
            self.adopt(loc, parent);
        }
        Insert::Added
    }

    /// A child of `parent` was added to `loc`: count it under the parent, or as an orphan.
    fn adopt(&mut self, loc: LocId, parent: BlockHash) {
        let held_parent = self.blocks.get_mut(&parent).and_then(|e| {
            let at = e.find(loc).ok()?;
            Some(&mut e.holders[at])
        });
        match held_parent {
            Some(holder) => holder.children += 1,
            None => {
                let state = &mut self.locations[loc as usize];
                state.orphans += 1;
                *state.orphan_parents.entry(parent).or_insert(0) += 1;
            }
        }
    }

    /// Removes `hash` from `loc`; returns whether `loc` held it.
    pub(crate) fn remove(&mut self, loc: LocId, hash: BlockHash) -> bool {
        let Some(entry) = self.blocks.get_mut(&hash) else { return false };
        let Ok(at) = entry.find(loc) else { return false };
        let holder = entry.holders.remove(at);
        let parent = entry.parent(hash);
        if entry.holders.is_empty() {
            self.blocks.remove(&hash);
        }
        let state = &mut self.locations[loc as usize];
        state.held.remove(&hash);
        state.deadlines.remove(&hash);
        self.placements -= 1;
        if state.location.approximate {
            self.approximate_placements -= 1;
        }
        // Its children in this location become orphans.
        if holder.children > 0 {
            state.orphans += u64::from(holder.children);
            *state.orphan_parents.entry(hash).or_insert(0) += holder.children;
        }
        if let Some(parent) = parent {
            self.abandon(loc, parent);
        }
        true
    }

    /// A child of `parent` left `loc`: uncount it under the parent, or as an orphan.
    fn abandon(&mut self, loc: LocId, parent: BlockHash) {
        let held_parent = self.blocks.get_mut(&parent).and_then(|e| {
            let at = e.find(loc).ok()?;
            Some(&mut e.holders[at])
        });
        match held_parent {
            Some(holder) => holder.children -= 1,
            None => {
                let state = &mut self.locations[loc as usize];
                state.orphans -= 1;
                let count = state.orphan_parents.get_mut(&parent).expect("an orphan's parent is counted");
                *count -= 1;
                if *count == 0 {
                    state.orphan_parents.remove(&parent);
                }
            }
        }
    }

    /// Drops every block of `loc`, in `O(blocks of loc)`.
    pub(crate) fn clear(&mut self, loc: LocId) {
        let state = &mut self.locations[loc as usize];
        let held = std::mem::take(&mut state.held);
        state.orphans = 0;
        state.orphan_parents = BlockMap::default();
        state.deadlines = BlockMap::default();
        let removed = held.len() as u64;
        self.placements -= removed;
        if state.location.approximate {
            self.approximate_placements -= removed;
        }
        for hash in held {
            let entry = self.blocks.get_mut(&hash).expect("a held block has an entry");
            let at = entry.find(loc).expect("a held block lists its location");
            entry.holders.remove(at);
            if entry.holders.is_empty() {
                self.blocks.remove(&hash);
            }
        }
    }

    /// Sets when `hash` expires from the approximate location `loc`.
    pub(crate) fn set_deadline(&mut self, loc: LocId, hash: BlockHash, deadline: Instant) {
        self.locations[loc as usize].deadlines.insert(hash, deadline);
    }

    /// When `hash` expires from the approximate location `loc`, if it is held there.
    pub(crate) fn deadline(&self, loc: LocId, hash: BlockHash) -> Option<Instant> {
        self.locations[loc as usize].deadlines.get(&hash).copied()
    }

    /// The locations that hold `hash`, sorted.
    fn holders(&self, hash: BlockHash) -> &[Holder] {
        self.blocks.get(&hash).map_or(&[], |e| &e.holders)
    }

    /// For every location holding `hashes[0]`, the number of leading blocks of `hashes` it holds.
    ///
    /// `hashes` must be a chain (the parent of `hashes[i]` is `hashes[i - 1]`), as the block
    /// hasher produces.
    pub(crate) fn find_matches(&self, hashes: &[BlockHash], out: &mut Matches) {
        out.clear();
        let Some(&first) = hashes.first() else { return };
        for holder in self.holders(first) {
            if self.locations[holder.loc as usize].orphans == 0 {
                out.alive.push(holder.loc);
            } else {
                out.walk.push(holder.loc);
            }
        }
        self.jump(hashes, out);
        self.walk(hashes, out);
        let Matches { found, results, .. } = out;
        found.sort_unstable_by_key(|&(loc, _)| loc);
        results.extend(
            found
                .iter()
                .map(|&(loc, blocks)| super::LocationMatch { location: self.locations[loc as usize].location, blocks }),
        );
    }

    /// The jump search over the prefix-closed locations in `out.alive` (all hold `hashes[0]`).
    fn jump(&self, hashes: &[BlockHash], out: &mut Matches) {
        let n = hashes.len();
        let mut lo = 0;
        while !out.alive.is_empty() {
            if lo + 1 == n {
                out.found.extend(out.alive.drain(..).map(|loc| (loc, n)));
                return;
            }
            let hi = (lo + JUMP).min(n - 1);
            let holders = self.holders(hashes[hi]);
            if holds_all(holders, &out.alive) {
                lo = hi;
                continue;
            }
            // Partition: survivors to `next`, the others drop out somewhere in (lo, hi].
            out.next.clear();
            out.dropped.clear();
            let mut h = holders.iter().map(|h| h.loc).peekable();
            for &loc in &out.alive {
                while h.next_if(|&l| l < loc).is_some() {}
                if h.next_if_eq(&loc).is_some() {
                    out.next.push(loc);
                } else {
                    out.dropped.push(loc);
                }
            }
            std::mem::swap(&mut out.alive, &mut out.next);
            let mut dropped = std::mem::take(&mut out.dropped);
            self.bisect(hashes, lo, hi, &mut dropped, &mut out.found);
            out.dropped = dropped;
            lo = hi;
        }
    }

    /// Every location in `set` holds `hashes[lo]` and not `hashes[hi]`: record where each stops.
    fn bisect(&self, hashes: &[BlockHash], lo: usize, hi: usize, set: &mut [LocId], found: &mut Vec<(LocId, usize)>) {
        if set.is_empty() {
            return;
        }
        if hi == lo + 1 {
            found.extend(set.iter().map(|&loc| (loc, hi)));
            return;
        }
        let mid = lo + (hi - lo) / 2;
        let holders = self.holders(hashes[mid]);
        // Those still holding `hashes[mid]` go first.
        let mut split = 0;
        for i in 0..set.len() {
            if holders.binary_search_by_key(&set[i], |h| h.loc).is_ok() {
                set.swap(i, split);
                split += 1;
            }
        }
        let (holding, stopped) = set.split_at_mut(split);
        self.bisect(hashes, lo, mid, stopped, found);
        self.bisect(hashes, mid, hi, holding, found);
    }

    /// The block-by-block walk for locations with orphans (all hold `hashes[0]`).
    fn walk(&self, hashes: &[BlockHash], out: &mut Matches) {
        let mut walk = std::mem::take(&mut out.walk);
        for (i, &hash) in hashes.iter().enumerate().skip(1) {
            if walk.is_empty() {
                break;
            }
            let holders = self.holders(hash);
            walk.retain(|&loc| {
                let holds = holders.binary_search_by_key(&loc, |h| h.loc).is_ok();
                if !holds {
                    out.found.push((loc, i));
                }
                holds
            });
        }
        out.found.extend(walk.drain(..).map(|loc| (loc, hashes.len())));
        out.walk = walk;
    }

    /// Checks the orphan bookkeeping against a recount from scratch (tests).
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        let mut placements = 0;
        for (id, state) in self.locations.iter().enumerate() {
            let loc = id as LocId;
            let mut orphan_parents: BlockMap<u32> = BlockMap::default();
            for &hash in &state.held {
                let entry = &self.blocks[&hash];
                let holder = entry.holders[entry.find(loc).expect("held block lists its location")];
                placements += 1;
                if let Some(parent) = entry.parent(hash) {
                    let parent_held = self.blocks.get(&parent).is_some_and(|p| p.find(loc).is_ok());
                    if !parent_held {
                        *orphan_parents.entry(parent).or_insert(0) += 1;
                    }
                }
                let children =
                    state.held.iter().filter(|&&c| c != hash && self.blocks[&c].parent(c) == Some(hash)).count();
                assert_eq!(holder.children as usize, children, "children of {hash:?} in {loc}");
            }
            assert_eq!(state.orphan_parents, orphan_parents, "orphan parents of {loc}");
            assert_eq!(state.orphans, orphan_parents.values().map(|&c| u64::from(c)).sum::<u64>());
        }
        for (hash, entry) in &self.blocks {
            assert!(!entry.holders.is_empty(), "{hash:?} has no holder");
            assert!(entry.holders.windows(2).all(|w| w[0].loc < w[1].loc));
            for h in &entry.holders {
                assert!(self.locations[h.loc as usize].held.contains(hash));
            }
        }
        assert_eq!(self.placements, placements);
    }
}

/// Whether every location in `alive` (sorted) is in `holders` (sorted).
fn holds_all(holders: &[Holder], alive: &[LocId]) -> bool {
    if holders.len() < alive.len() {
        return false;
    }
    let mut h = holders.iter();
    alive.iter().all(|&loc| h.find(|x| x.loc >= loc).is_some_and(|x| x.loc == loc))
}

// An entry and its 16-byte key fill one cache line.
const _: () = assert!(std::mem::size_of::<Entry>() == 48);
