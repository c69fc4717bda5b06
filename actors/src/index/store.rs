//! The index's data: which location holds which block, and the prefix lookup over it.
//!
//! Single-threaded; [`PrefixIndex`](super::PrefixIndex) puts it behind a lock.
//!
//! # Layout
//!
//! - `blocks`: block hash → [`Entry`] (the block's parent and the sorted list of locations that
//!   hold it), in a [`BlockTable`] of one cache line per block. A chained hash names its whole
//!   prefix, so the map needs no tree.
//! - `locations`: per location, a log of the blocks it was given (so clearing a source costs its
//!   own blocks, not a scan) and its *orphan* bookkeeping. The log is append-only: removing a block
//!   costs nothing there, and the log is compacted (its records checked against the map) when
//!   more than three quarters of it are stale, so the map is the one place that says who holds
//!   what and an event touches one hash table per block, not two.
//!
//! # Memory-level parallelism
//!
//! Each block of an event is a cache miss somewhere in the table, and an event names all of its
//! blocks up front: [`Store::insert_chain`] and [`Store::remove_chain`] prefetch the slot of the
//! block [`PREFETCH`] places ahead while they work on the current one, a lookup prefetches all of
//! its jump probes before the first, and a log compaction prefetches ahead too, so the misses
//! overlap instead of queueing. In a chain the parent of a block is the block just inserted, so
//! its child count is updated through the slot index the insert returned, not by a second probe.
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
//! its orphans. Every gap in a query chain that a held block follows ends in one of those
//! missing parents, so a location with orphans is still searched by jumps: to where it seems to
//! stop, then again before the first of its missing parents that the chain holds up to there
//! (looked up in its own map of them, which stays in cache, instead of the block table). A
//! sparse tier — a G3 that skipped blocks under a write backlog holds thousands of orphans —
//! costs a lookup a pass over a small map, not a table probe per block. Answers stay exact in
//! every state.
//!
//! The same bookkeeping makes a probe cheap when a block is held by many locations (a system
//! prompt every worker has): every prefix-closed holder of a later probe is still a candidate, so
//! while few locations have orphans (they are listed), the candidates holding a probe are counted
//! from the length of its holder list, not found one by one ([`Members`]). A lookup then pays per
//! location only to list the first block's holders and to write each one's answer.

use std::collections::HashMap;
use std::time::Instant;

use dynamo_tiering::block::{BlockHash, SetDigest};
use smallvec::SmallVec;

use super::Location;
use super::hasher::{BlockHashBuild, FxBuild};
use super::matches::{Marks, Matches};
use super::table::{BlockTable, PREFETCH, Probe};

/// Dense id of a location, assigned on first sight and never reused.
pub(crate) type LocId = u32;

/// How far the lookup jumps between probes of prefix-closed locations.
pub(crate) const JUMP: usize = 32;

type BlockMap<V> = HashMap<BlockHash, V, BlockHashBuild>;

/// Blocks the map is sized for up front (capped by `max_blocks`), so a filling index does not
/// rehash through its first sizes.
const INITIAL_BLOCKS: usize = 1 << 16;

/// Minimum log length before a compaction is considered.
const MIN_COMPACT: usize = 64;

/// A log is compacted when it is more than this many times its location's live blocks.
const COMPACT_RATIO: u64 = 4;

/// With at most this many locations with orphans in the store, a lookup counts its candidates
/// among a probe's holders instead of tagging them (see [`Members`]).
const COUNTED_ORPHANED: usize = 8;

/// Marks a holder during a log compaction (in `children`, which never gets near it).
const COMPACT_MARK: u32 = 1 << 31;

/// One block: its parent and the locations holding it. With its key, 64 bytes.
#[derive(Debug, Default)]
pub(crate) struct Entry {
    /// The parent block; equal to the block's own hash for the first block of a sequence (a hash
    /// is never its own parent), which keeps the entry one cache line with its key.
    parent: BlockHash,
    /// Sorted by `loc`; never empty while the entry is in the table (an empty one marks a free
    /// slot). Inline up to three holders (a block's worker G1 and its node's G2 and G3), so a
    /// probe costs one cache miss, not two.
    pub(crate) holders: SmallVec<[Holder; 3]>,
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
pub(crate) struct Holder {
    pub(crate) loc: LocId,
    /// How many children of this block the same location holds.
    pub(crate) children: u32,
}

/// What a lookup reads per location, apart from the rest so that the lookup's pass over the
/// first block's holders stays in a few cache lines.
#[derive(Debug, Clone, Copy)]
struct LocationKey {
    location: Location,
    /// Held blocks whose parent this location does not hold.
    orphans: u64,
}

/// What the index keeps per location besides its [`LocationKey`].
#[derive(Debug)]
struct LocationState {
    /// Every block added since the last compaction, in order; blocks since removed and repeated
    /// additions stay until the next compaction. The map is authoritative.
    log: Vec<BlockHash>,
    /// Blocks held.
    live: u64,
    /// The digest of the set of blocks held.
    digest: SetDigest,
    /// The missing parents of the orphans, with multiplicity.
    orphan_parents: BlockMap<u32>,
    /// Approximate locations only: when each block expires.
    deadlines: BlockMap<Instant>,
}

/// How a lookup tells the members of a candidate set — prefix-closed locations that hold a probe
/// `hashes[lo]` — among the holders of a later probe.
///
/// - *Tagged*: the members carry `tag` in [`Marks`], and the holders are checked one by one.
/// - *Counted*: every prefix-closed holder of a later probe is a member or one of `outside`
///   other candidates known to hold it (they were split off as holding a probe further on), so
///   the members among `h` holders are `h - outside - (listed locations with orphans among them)`:
///   a few binary searches, whatever the number of holders. This is what makes a lookup over a
///   block every worker holds cost nothing per worker until the candidates split.
#[derive(Debug, Clone, Copy)]
struct Members {
    tag: u32,
    outside: usize,
    counted: bool,
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
    blocks: BlockTable,
    locations: Vec<LocationState>,
    /// Indexed by location id, as `locations`.
    keys: Vec<LocationKey>,
    location_ids: HashMap<Location, LocId, FxBuild>,
    /// The locations with orphans (any order); few in practice, so lookups count holders instead
    /// of tagging them while there are at most [`COUNTED_ORPHANED`] (see [`Store::jump`]).
    orphaned: Vec<LocId>,
    max_blocks: usize,
    placements: u64,
    approximate_placements: u64,
}

impl Store {
    /// An empty store of at most `max_blocks` blocks, one of `shards` sharing the initial sizing.
    pub(crate) fn new(max_blocks: usize, shards: usize) -> Self {
        let initial = max_blocks.min(INITIAL_BLOCKS / shards.max(1));
        Self {
            blocks: BlockTable::with_capacity(initial),
            locations: Vec::new(),
            keys: Vec::new(),
            location_ids: HashMap::default(),
            orphaned: Vec::new(),
            max_blocks,
            placements: 0,
            approximate_placements: 0,
        }
    }

    /// The most blocks one external engine's location may hold: a quarter of the store.
    fn engine_share(&self) -> u64 {
        (self.max_blocks as u64 / 4).max(1)
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
        self.locations.iter().filter(|l| l.live > 0).count()
    }

    /// The id of `location`, assigning one on first sight.
    pub(crate) fn location_id(&mut self, location: Location) -> LocId {
        if let Some(&id) = self.location_ids.get(&location) {
            return id;
        }
        let id = LocId::try_from(self.locations.len()).expect("fewer than 2^32 locations");
        self.keys.push(LocationKey { location, orphans: 0 });
        self.locations.push(LocationState {
            log: Vec::new(),
            live: 0,
            digest: SetDigest::default(),
            orphan_parents: BlockMap::default(),
            deadlines: BlockMap::default(),
        });
        self.location_ids.insert(location, id);
        id
    }

    /// Blocks `location` holds.
    pub(crate) fn held_count(&self, location: Location) -> u64 {
        self.existing_location_id(location).map_or(0, |id| self.locations[id as usize].live)
    }

    /// Blocks `location` holds, and the digest of their set.
    pub(crate) fn held_set(&self, location: Location) -> (u64, SetDigest) {
        self.existing_location_id(location).map_or_else(Default::default, |id| {
            let state = &self.locations[id as usize];
            (state.live, state.digest)
        })
    }

    /// The id of `location` if it was ever seen.
    pub(crate) fn existing_location_id(&self, location: Location) -> Option<LocId> {
        self.location_ids.get(&location).copied()
    }

    /// Adds the chain `hashes` (parent of `hashes[0]` is `parent`) to `loc`; returns how many
    /// blocks the full index refused.
    pub(crate) fn insert_chain(&mut self, loc: LocId, mut parent: Option<BlockHash>, hashes: &[BlockHash]) -> u64 {
        // No growth mid-chain, so the slot of the block before stays valid.
        self.reserve(hashes.len());
        self.blocks.prefetch_each(hashes.iter().take(PREFETCH).copied());
        let mut rejected = 0;
        // The slot of the previous block while `loc` holds it: the next block's parent.
        let mut parent_slot = None;
        for (i, &hash) in hashes.iter().enumerate() {
            self.blocks.prefetch_ahead(hashes, i);
            let (outcome, slot) = self.insert_at(loc, hash, parent, parent_slot);
            rejected += u64::from(outcome == Insert::Rejected);
            parent_slot = slot;
            parent = Some(hash);
        }
        rejected
    }

    /// Adds `hash` (whose parent is `parent`) to `loc`.
    pub(crate) fn insert(&mut self, loc: LocId, hash: BlockHash, parent: Option<BlockHash>) -> Insert {
        self.reserve(1);
        self.insert_at(loc, hash, parent, None).0
    }

    /// Makes room in the table for `blocks` new blocks, but never for more than `max_blocks` in
    /// all: a full index refuses new blocks, so growing past that would only waste memory.
    fn reserve(&mut self, blocks: usize) {
        self.blocks.reserve(blocks.min(self.max_blocks.saturating_sub(self.blocks.len())));
    }

    /// Adds `hash` to `loc` with room reserved; `parent_slot`, if given, is the slot of `parent`,
    /// which `loc` holds. Returns the outcome and, unless rejected, the block's slot.
    #[inline(always)]
    fn insert_at(
        &mut self,
        loc: LocId,
        hash: BlockHash,
        parent: Option<BlockHash>,
        parent_slot: Option<usize>,
    ) -> (Insert, Option<usize>) {
        // An external engine holds at most its share: its events cannot fill the index and push
        // out the node's own routing entries.
        let engine_full = self.keys[loc as usize].location.source.external_engine().is_some()
            && self.locations[loc as usize].live >= self.engine_share();
        let slot = match self.blocks.probe(hash) {
            Probe::Found(i) => {
                let entry = self.blocks.at_mut(i);
                let Err(at) = entry.find(loc) else { return (Insert::Present, Some(i)) };
                if engine_full {
                    return (Insert::Rejected, None);
                }
                entry.holders.insert(at, Holder { loc, children: 0 });
                i
            }
            Probe::Vacant(_) if engine_full || self.blocks.len() >= self.max_blocks => return (Insert::Rejected, None),
            Probe::Vacant(i) => {
                let mut holders = SmallVec::new();
                holders.push(Holder { loc, children: 0 });
                self.blocks.fill(i, hash, Entry { parent: parent.unwrap_or(hash), holders });
                i
            }
        };
        let state = &mut self.locations[loc as usize];
        let LocationKey { location, orphans } = self.keys[loc as usize];
        // Children of `hash` this location already holds were orphans until now.
        let adopted = if orphans != 0 { state.orphan_parents.remove(&hash) } else { None };
        state.log.push(hash);
        state.live += 1;
        state.digest.insert(hash);
        let compact = state.log.len() >= MIN_COMPACT && state.log.len() as u64 > COMPACT_RATIO * state.live;
        self.placements += 1;
        if location.approximate {
            self.approximate_placements += 1;
        }
        if let Some(children) = adopted {
            self.set_orphans(loc, orphans - u64::from(children));
            let entry = self.blocks.at_mut(slot);
            let at = entry.find(loc).expect("just added");
            entry.holders[at].children = children;
        }
        // The parent recorded first wins: it is a function of the hash, and the bookkeeping must
        // use the same parent on insert and on removal.
        match (self.blocks.at(slot).parent(hash), parent_slot) {
            (Some(recorded), Some(at)) if Some(recorded) == parent => {
                let entry = self.blocks.at_mut(at);
                let held = entry.find(loc).expect("the caller's parent slot is held by the location");
                entry.holders[held].children += 1;
            }
            (Some(recorded), _) => self.adopt(loc, recorded),
            (None, _) => {}
        }
        if compact {
            self.compact(loc);
        }
        (Insert::Added, Some(slot))
    }

    /// A child of `parent` was added to `loc`: count it under the parent, or as an orphan.
    fn adopt(&mut self, loc: LocId, parent: BlockHash) {
        match self.held_by(loc, parent) {
            Some(holder) => holder.children += 1,
            None => {
                *self.locations[loc as usize].orphan_parents.entry(parent).or_insert(0) += 1;
                self.set_orphans(loc, self.keys[loc as usize].orphans + 1);
            }
        }
    }

    /// The holder record of `loc` in `hash`'s entry, if `loc` holds it.
    fn held_by(&mut self, loc: LocId, hash: BlockHash) -> Option<&mut Holder> {
        let entry = self.blocks.get_mut(hash)?;
        let at = entry.find(loc).ok()?;
        Some(&mut entry.holders[at])
    }

    /// Removes each of `hashes` from `loc` (in order); returns how many `loc` held.
    pub(crate) fn remove_chain(&mut self, loc: LocId, hashes: &[BlockHash]) -> u64 {
        self.blocks.prefetch_each(hashes.iter().take(PREFETCH).copied());
        let mut removed = 0;
        // Leaves come first, so the parent of a block is usually the next block: the slot where
        // the last removal found its parent is tried before a probe.
        let mut hint = None;
        for (i, &hash) in hashes.iter().enumerate() {
            self.blocks.prefetch_ahead(hashes, i);
            let (held, parent_slot) = self.remove_hinted(loc, hash, hint);
            removed += u64::from(held);
            hint = parent_slot;
        }
        removed
    }

    /// Removes `hash` from `loc`; returns whether `loc` held it.
    pub(crate) fn remove(&mut self, loc: LocId, hash: BlockHash) -> bool {
        self.remove_hinted(loc, hash, None).0
    }

    /// Removes `hash` from `loc`, trying slot `hint` before a probe; returns whether `loc` held
    /// it and, if `loc` holds its parent, the parent's slot.
    #[inline(always)]
    fn remove_hinted(&mut self, loc: LocId, hash: BlockHash, hint: Option<usize>) -> (bool, Option<usize>) {
        let Some(slot) = hint.filter(|&i| self.blocks.holds_at(i, hash)).or_else(|| self.blocks.find(hash)) else {
            return (false, None);
        };
        let entry = self.blocks.at_mut(slot);
        let Ok(at) = entry.find(loc) else { return (false, None) };
        let holder = if entry.holders.len() == 1 {
            // The usual case: the last holder goes (no shifting, no call).
            let holder = entry.holders[0];
            entry.holders.clear();
            holder
        } else {
            entry.holders.remove(at)
        };
        let parent = entry.parent(hash);
        if entry.holders.is_empty() {
            self.blocks.remove_at(slot);
        }
        let state = &mut self.locations[loc as usize];
        let LocationKey { location, orphans } = self.keys[loc as usize];
        state.live -= 1;
        state.digest.remove(hash);
        self.placements -= 1;
        if location.approximate {
            state.deadlines.remove(&hash);
            self.approximate_placements -= 1;
        }
        // Its children in this location become orphans.
        if holder.children > 0 {
            *state.orphan_parents.entry(hash).or_insert(0) += holder.children;
            self.set_orphans(loc, orphans + u64::from(holder.children));
        }
        let parent_slot = parent.and_then(|parent| self.abandon(loc, parent));
        (true, parent_slot)
    }

    /// A child of `parent` left `loc`: uncount it under the parent, or as an orphan. Returns the
    /// parent's slot if `loc` holds it.
    fn abandon(&mut self, loc: LocId, parent: BlockHash) -> Option<usize> {
        if let Some(slot) = self.blocks.find(parent) {
            let entry = self.blocks.at_mut(slot);
            if let Ok(at) = entry.find(loc) {
                entry.holders[at].children -= 1;
                return Some(slot);
            }
        }
        let state = &mut self.locations[loc as usize];
        let count = state.orphan_parents.get_mut(&parent).expect("an orphan's parent is counted");
        *count -= 1;
        if *count == 0 {
            state.orphan_parents.remove(&parent);
        }
        self.set_orphans(loc, self.keys[loc as usize].orphans - 1);
        None
    }

    /// Sets how many orphans `loc` has, keeping [`Store::orphaned`] in step.
    fn set_orphans(&mut self, loc: LocId, orphans: u64) {
        let key = &mut self.keys[loc as usize];
        match (key.orphans, orphans) {
            (0, 1..) => self.orphaned.push(loc),
            (1.., 0) => {
                let at = self.orphaned.iter().position(|&l| l == loc).expect("a location with orphans is listed");
                self.orphaned.swap_remove(at);
            }
            _ => {}
        }
        key.orphans = orphans;
    }

    /// Drops every block of `loc`, in `O(blocks of loc)` (its log is at most [`COMPACT_RATIO`]
    /// times that).
    pub(crate) fn clear(&mut self, loc: LocId) {
        self.set_orphans(loc, 0);
        let state = &mut self.locations[loc as usize];
        let log = std::mem::take(&mut state.log);
        let key = &self.keys[loc as usize];
        state.orphan_parents = BlockMap::default();
        state.deadlines = BlockMap::default();
        let removed = std::mem::take(&mut state.live);
        state.digest = SetDigest::default();
        self.placements -= removed;
        if key.location.approximate {
            self.approximate_placements -= removed;
        }
        // A repeated or stale record finds the location gone from the entry and is skipped.
        for (i, &hash) in log.iter().enumerate() {
            self.blocks.prefetch_ahead(&log, i);
            let Some(slot) = self.blocks.find(hash) else { continue };
            let entry = self.blocks.at_mut(slot);
            let Ok(at) = entry.find(loc) else { continue };
            entry.holders.remove(at);
            if entry.holders.is_empty() {
                self.blocks.remove_at(slot);
            }
        }
    }

    /// Rewrites the log of `loc` to the blocks it holds, each once.
    fn compact(&mut self, loc: LocId) {
        let mut log = std::mem::take(&mut self.locations[loc as usize].log);
        let blocks = &mut self.blocks;
        let mut kept = 0;
        for i in 0..log.len() {
            // Spelled out rather than `prefetch_ahead`: the loop writes `log`, and the call cost
            // the index 1% more instructions (callgrind).
            if let Some(&next) = log.get(i + PREFETCH) {
                blocks.prefetch(next);
            }
            let hash = log[i];
            let Some(entry) = blocks.get_mut(hash) else { continue };
            let Ok(at) = entry.find(loc) else { continue };
            let holder = &mut entry.holders[at];
            // Marked: an earlier record of the same block was kept.
            if holder.children & COMPACT_MARK == 0 {
                holder.children |= COMPACT_MARK;
                log[kept] = hash;
                kept += 1;
            }
        }
        log.truncate(kept);
        for (i, &hash) in log.iter().enumerate() {
            blocks.prefetch_ahead(&log, i);
            let entry = blocks.get_mut(hash).expect("a kept block has an entry");
            let at = entry.find(loc).expect("a kept block lists its location");
            entry.holders[at].children &= !COMPACT_MARK;
        }
        debug_assert_eq!(log.len() as u64, self.locations[loc as usize].live);
        self.locations[loc as usize].log = log;
    }

    /// The block table's slots (tests).
    #[cfg(test)]
    pub(crate) fn table_slots(&self) -> usize {
        self.blocks.slots()
    }

    /// The blocks `loc` holds, each once (tests).
    #[cfg(test)]
    fn held(&self, loc: LocId) -> std::collections::BTreeSet<BlockHash> {
        let log = &self.locations[loc as usize].log;
        log.iter().copied().filter(|&h| self.blocks.get(h).is_some_and(|e| e.find(loc).is_ok())).collect()
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
        self.blocks.get(hash).map_or(&[], |e| &e.holders)
    }

    /// For every location holding `hashes[0]`, the number of leading blocks of `hashes` it holds.
    ///
    /// `hashes` must be a chain (the parent of `hashes[i]` is `hashes[i - 1]`), as the block
    /// hasher produces.
    ///
    /// Appends to `out.results` (the caller clears it), so several shards can answer into one.
    pub(crate) fn find_matches(&self, hashes: &[BlockHash], out: &mut Matches) {
        self.find_matches_with(hashes, out, self.orphaned.len() <= COUNTED_ORPHANED);
    }

    /// [`Store::find_matches`], telling a probe's holders apart by counting (see [`Members`]) or
    /// by tags.
    pub(crate) fn find_matches_with(&self, hashes: &[BlockHash], out: &mut Matches, counted: bool) {
        out.clear_scratch();
        let Some(&first) = hashes.first() else { return };
        // The jump probes, all at once: their misses overlap with the first block's.
        for &probe in hashes.iter().step_by(JUMP).skip(1).chain(hashes.last()) {
            self.blocks.prefetch(probe);
        }
        let holders = self.holders(first);
        if holders.is_empty() {
            return;
        }
        out.marks.prepare(self.locations.len());
        if self.orphaned.is_empty() {
            out.alive.extend(holders.iter().map(|h| h.loc));
        } else {
            for holder in holders {
                if self.keys[holder.loc as usize].orphans == 0 {
                    out.alive.push(holder.loc);
                } else {
                    out.walk.push(holder.loc);
                }
            }
        }
        self.jump(hashes, out, counted);
        self.walk(hashes, out);
        // In location order, as the first block's holders are. Written into the spare capacity
        // and counted once at the end, not one length update per answer.
        let keys = &self.keys[..];
        let lens = &out.marks.len[..keys.len()];
        let results = &mut out.results;
        results.reserve(holders.len());
        let spare = &mut results.spare_capacity_mut()[..holders.len()];
        for (slot, h) in spare.iter_mut().zip(holders) {
            let at = h.loc as usize;
            slot.write(super::LocationMatch { location: keys[at].location, blocks: lens[at] as usize });
        }
        let len = results.len() + holders.len();
        // SAFETY: the `holders.len()` slots past the old length were written just above, and
        // `reserve` made them part of the allocation.
        unsafe { results.set_len(len) };
    }

    /// The jump search over the prefix-closed locations in `out.alive` (all hold `hashes[0]`).
    ///
    /// A probe that every candidate (or none) holds moves on without touching the candidates; only
    /// a probe that splits them costs a pass over them.
    fn jump(&self, hashes: &[BlockHash], out: &mut Matches, counted: bool) {
        let n = hashes.len();
        let Matches { alive, marks, .. } = out;
        let mut members = Members { tag: marks.fresh(), outside: 0, counted };
        if !counted {
            for &loc in alive.iter() {
                marks.tag[loc as usize] = members.tag;
            }
        }
        let mut lo = 0;
        while !alive.is_empty() {
            if lo + 1 == n {
                for &loc in alive.iter() {
                    marks.len[loc as usize] = n as u32;
                }
                alive.clear();
                return;
            }
            let hi = (lo + JUMP).min(n - 1);
            let holders = self.holders(hashes[hi]);
            let holding = self.holding(holders, members, marks);
            if holding == alive.len() {
                lo = hi;
                continue;
            }
            // Someone drops out in (lo, hi): the bisection's probes, all at once.
            self.blocks.prefetch_each(hashes[lo + 1..hi].iter().copied());
            // The survivors go first, with a fresh tag; the others keep theirs and are bisected.
            let (held, fresh) =
                if holding == 0 { (0, members.tag) } else { self.split(holders, alive, members, marks) };
            let stopped = Members { outside: held, ..members };
            self.bisect(hashes, lo, hi, &mut alive[held..], stopped, marks);
            alive.truncate(held);
            members.tag = fresh;
            lo = hi;
        }
    }

    /// Every location in `set` (told apart as `members` says) holds `hashes[lo]` and not
    /// `hashes[hi]`: record where each stops.
    fn bisect(
        &self,
        hashes: &[BlockHash],
        lo: usize,
        hi: usize,
        set: &mut [LocId],
        members: Members,
        marks: &mut Marks,
    ) {
        if set.is_empty() {
            return;
        }
        if hi == lo + 1 {
            for &loc in set.iter() {
                marks.len[loc as usize] = hi as u32;
            }
            return;
        }
        let mid = lo + (hi - lo) / 2;
        let holders = self.holders(hashes[mid]);
        let holding = self.holding(holders, members, marks);
        if holding == 0 {
            return self.bisect(hashes, lo, mid, set, members, marks);
        }
        if holding == set.len() {
            return self.bisect(hashes, mid, hi, set, members, marks);
        }
        let (held, fresh) = self.split(holders, set, members, marks);
        let (holding, stopped) = set.split_at_mut(held);
        self.bisect(hashes, lo, mid, stopped, Members { outside: members.outside + held, ..members }, marks);
        self.bisect(hashes, mid, hi, holding, Members { tag: fresh, ..members }, marks);
    }

    /// How many members of a candidate set hold the block whose holders are `holders`.
    #[inline]
    fn holding(&self, holders: &[Holder], members: Members, marks: &Marks) -> usize {
        if members.counted {
            let orphaned = self.orphaned.iter().filter(|&&loc| holders.binary_search_by_key(&loc, |h| h.loc).is_ok());
            let other = orphaned.count() + members.outside;
            debug_assert!(other <= holders.len(), "the orphan bookkeeping is exact");
            holders.len().saturating_sub(other)
        } else {
            holders.iter().filter(|h| marks.has(h.loc, members.tag)).count()
        }
    }

    /// Moves the members of `set` that hold the block whose holders are `holders` to its front,
    /// tagged with a fresh tag; returns how many there are and the tag.
    fn split(&self, holders: &[Holder], set: &mut [LocId], members: Members, marks: &mut Marks) -> (usize, u32) {
        let fresh = marks.fresh();
        for h in holders {
            // Counting needs no tags to tell the set apart, so every holder may take the new one.
            if members.counted || marks.has(h.loc, members.tag) {
                marks.tag[h.loc as usize] = fresh;
            }
        }
        let mut held = 0;
        for i in 0..set.len() {
            if marks.has(set[i], fresh) {
                set.swap(i, held);
                held += 1;
            }
        }
        (held, fresh)
    }

    /// The locations in `out.walk` (all hold `hashes[0]`, and have orphans), one by one.
    fn walk(&self, hashes: &[BlockHash], out: &mut Matches) {
        let Matches { walk, marks, .. } = out;
        for loc in walk.drain(..) {
            marks.len[loc as usize] = self.search_with_gaps(hashes, loc) as u32;
        }
    }

    /// How many leading blocks of `hashes` the location `loc` holds, when it holds `hashes[0]`.
    ///
    /// Every gap in the chain that a held block follows ends in a missing parent of one of the
    /// location's orphans, so the location is prefix-closed before the first of those: jump to
    /// where it seems to stop, look for a missing parent before that point (in its own small
    /// map, which stays in cache, not the block table), and if there is one, search again before
    /// it.
    fn search_with_gaps(&self, hashes: &[BlockHash], loc: LocId) -> usize {
        let gaps = &self.locations[loc as usize].orphan_parents;
        let seems = self.search_closed(hashes, hashes.len(), loc);
        match hashes[1..seems].iter().position(|h| gaps.contains_key(h)) {
            None => seems,
            // `hashes[before + 1]` is missing, and the blocks before it are prefix-closed.
            Some(before) => self.search_closed(hashes, before + 1, loc),
        }
    }

    /// For a location holding `hashes[0]`, some `m` in `1..=end` such that it holds
    /// `hashes[m - 1]` and, if `m < end`, not `hashes[m]`: the length of its prefix within
    /// `hashes[..end]` when it is prefix-closed there. One probe per [`JUMP`] blocks, then a
    /// bisection.
    fn search_closed(&self, hashes: &[BlockHash], end: usize, loc: LocId) -> usize {
        let holds = |i: usize| self.holders(hashes[i]).binary_search_by_key(&loc, |h| h.loc).is_ok();
        let mut lo = 0;
        while lo + 1 < end {
            let mut hi = (lo + JUMP).min(end - 1);
            if holds(hi) {
                lo = hi;
                continue;
            }
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if holds(mid) {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            return hi;
        }
        end
    }

    /// Checks the orphan bookkeeping against a recount from scratch (tests).
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        let mut placements = 0;
        for (id, state) in self.locations.iter().enumerate() {
            let loc = id as LocId;
            let mut orphan_parents: BlockMap<u32> = BlockMap::default();
            let held = self.held(loc);
            assert_eq!(held.len() as u64, state.live, "blocks held by {loc}");
            let mut digest = SetDigest::default();
            held.iter().for_each(|&hash| digest.insert(hash));
            assert_eq!(digest, state.digest, "the digest of the blocks held by {loc}");
            for &hash in &held {
                let entry = self.blocks.get(hash).expect("a held block has an entry");
                let holder = entry.holders[entry.find(loc).expect("held block lists its location")];
                placements += 1;
                if let Some(parent) = entry.parent(hash) {
                    let parent_held = self.blocks.get(parent).is_some_and(|p| p.find(loc).is_ok());
                    if !parent_held {
                        *orphan_parents.entry(parent).or_insert(0) += 1;
                    }
                }
                let children = held
                    .iter()
                    .filter(|&&c| c != hash && self.blocks.get(c).and_then(|e| e.parent(c)) == Some(hash))
                    .count();
                assert_eq!(holder.children as usize, children, "children of {hash:?} in {loc}");
            }
            assert_eq!(state.orphan_parents, orphan_parents, "orphan parents of {loc}");
            assert_eq!(self.keys[id].orphans, orphan_parents.values().map(|&c| u64::from(c)).sum::<u64>());
        }
        for (hash, entry) in self.blocks.iter() {
            assert!(!entry.holders.is_empty(), "{hash:?} has no holder");
            assert!(entry.holders.windows(2).all(|w| w[0].loc < w[1].loc));
            for h in &entry.holders {
                assert!(self.locations[h.loc as usize].log.contains(&hash));
            }
        }
        assert_eq!(self.placements, placements);
        let mut listed = self.orphaned.clone();
        listed.sort_unstable();
        let with_orphans: Vec<LocId> =
            (0..self.keys.len() as LocId).filter(|&l| self.keys[l as usize].orphans > 0).collect();
        assert_eq!(listed, with_orphans, "the list of locations with orphans");
    }
}

// An entry and its 16-byte key fill one cache line.
const _: () = assert!(std::mem::size_of::<Entry>() == 48);
