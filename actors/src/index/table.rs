//! The index's block table: an open-addressing hash table of one cache line per block.
//!
//! Why not `HashMap`: the index's hot loop is a cache miss per block, and an event names all of its
//! blocks up front, so the misses can overlap if the table says where a block *will* be probed
//! before it is probed. [`BlockTable::prefetch`] does that, which a `HashMap` cannot, and every
//! slot is one aligned 64-byte line holding the key and its [`Entry`], so a probe that hits costs
//! one line.
//!
//! Linear probing from a Fibonacci-hashed home slot, at most [`MAX_LOAD_NUM`]/[`MAX_LOAD_DEN`]
//! full, with backward-shift deletion (no tombstones: a removal moves the rest of its cluster back,
//! so probe lengths never degrade). A slot is empty when its entry has no holder; the store never
//! keeps an entry without one. Slot indices are stable until the next removal or growth, which is
//! what lets a `Stored` event reach a block's parent (the block before it) by index.

use dynamo_tiering::block::BlockHash;
use smallvec::SmallVec;

use super::store::Entry;

/// The table grows past this fill, `MAX_LOAD_NUM / MAX_LOAD_DEN` (5/8: short clusters, about 1.3
/// lines per successful probe).
const MAX_LOAD_NUM: usize = 5;
const MAX_LOAD_DEN: usize = 8;

/// How many blocks ahead a walk over an event's (or a log's) blocks prefetches.
pub(crate) const PREFETCH: usize = 8;

/// The fewest slots a table has.
const MIN_SLOTS: usize = 64;

/// Hints the CPU to load `slot`'s cache line.
#[inline(always)]
fn prefetch_line(slot: &Slot) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` only hints the cache about an address; it never faults and reads
    // nothing into the program, and the address is a live slot anyway.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(std::ptr::from_ref(slot).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = slot;
}

/// One block: its hash and entry, a cache line.
#[derive(Debug, Default)]
#[repr(C, align(64))]
pub(crate) struct Slot {
    pub(crate) hash: BlockHash,
    pub(crate) entry: Entry,
}

impl Slot {
    fn is_empty(&self) -> bool {
        self.entry.holders.is_empty()
    }
}

/// Open-addressing map from block hash to [`Entry`]; see the module docs.
#[derive(Debug)]
pub(crate) struct BlockTable {
    slots: Box<[Slot]>,
    /// `slots.len() - 1` (the length is a power of two).
    mask: usize,
    /// `64 - log2(slots.len())`: the shift that turns a Fibonacci product into a home slot.
    shift: u32,
    len: usize,
}

/// Where [`BlockTable::probe`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// The block is in this slot.
    Found(usize),
    /// The block is absent; this empty slot is where it would go.
    Vacant(usize),
}

impl BlockTable {
    /// A table with room for `blocks` blocks before it grows.
    pub(crate) fn with_capacity(blocks: usize) -> Self {
        let slots = (blocks * MAX_LOAD_DEN).div_ceil(MAX_LOAD_NUM).next_power_of_two().max(MIN_SLOTS);
        Self::with_slots(slots)
    }

    fn with_slots(count: usize) -> Self {
        debug_assert!(count.is_power_of_two());
        let slots = std::iter::repeat_with(Slot::default).take(count).collect();
        Self { slots, mask: count - 1, shift: 64 - count.trailing_zeros(), len: 0 }
    }

    /// Blocks in the table.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Slots in the table (tests).
    #[cfg(test)]
    pub(crate) fn slots(&self) -> usize {
        self.slots.len()
    }

    /// The slot `hash` is probed from. The low 64 bits of a block hash are already uniform; the
    /// Fibonacci multiply takes the slot from its high bits, so a key set that differs only in high
    /// bits (a test's small integers, say) still spreads.
    #[inline]
    fn home(&self, hash: BlockHash) -> usize {
        ((hash.0 as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// Starts loading the line `hash` will be probed at (its home slot; the hardware's adjacent-
    /// line prefetcher tends to bring the next), so that a later probe of it does not wait for
    /// memory. Only a hint: it changes nothing. (Prefetching the next line too measured no faster
    /// and cost 2% more instructions.)
    #[inline]
    pub(crate) fn prefetch(&self, hash: BlockHash) {
        prefetch_line(&self.slots[self.home(hash)]);
    }

    /// Starts loading the lines of all of `hashes` (their misses overlap).
    #[inline(always)]
    pub(crate) fn prefetch_each(&self, hashes: impl IntoIterator<Item = BlockHash>) {
        for hash in hashes {
            self.prefetch(hash);
        }
    }

    /// At step `i` of a walk over `hashes`, starts loading the block [`PREFETCH`] places ahead,
    /// so the walk keeps that many misses in flight.
    #[inline(always)]
    pub(crate) fn prefetch_ahead(&self, hashes: &[BlockHash], i: usize) {
        if let Some(&ahead) = hashes.get(i + PREFETCH) {
            self.prefetch(ahead);
        }
    }

    /// Finds `hash`, or the empty slot where it would be inserted.
    #[inline]
    pub(crate) fn probe(&self, hash: BlockHash) -> Probe {
        let mut i = self.home(hash);
        loop {
            let slot = &self.slots[i];
            if slot.is_empty() {
                return Probe::Vacant(i);
            }
            if slot.hash == hash {
                return Probe::Found(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// The slot of `hash`, if present.
    #[inline]
    pub(crate) fn find(&self, hash: BlockHash) -> Option<usize> {
        match self.probe(hash) {
            Probe::Found(i) => Some(i),
            Probe::Vacant(_) => None,
        }
    }

    /// Whether slot `i` holds `hash` (a cheap check of a slot index remembered from earlier).
    #[inline]
    pub(crate) fn holds_at(&self, i: usize, hash: BlockHash) -> bool {
        self.slots.get(i).is_some_and(|slot| slot.hash == hash && !slot.is_empty())
    }

    /// The entry of `hash`, if present.
    #[inline]
    pub(crate) fn get(&self, hash: BlockHash) -> Option<&Entry> {
        self.find(hash).map(|i| &self.slots[i].entry)
    }

    /// The entry of `hash`, if present, mutably.
    #[inline]
    pub(crate) fn get_mut(&mut self, hash: BlockHash) -> Option<&mut Entry> {
        self.find(hash).map(|i| &mut self.slots[i].entry)
    }

    /// The entry in slot `i` (occupied).
    #[inline]
    pub(crate) fn at(&self, i: usize) -> &Entry {
        &self.slots[i].entry
    }

    /// The entry in slot `i` (occupied), mutably.
    #[inline]
    pub(crate) fn at_mut(&mut self, i: usize) -> &mut Entry {
        &mut self.slots[i].entry
    }

    /// Puts `hash` with `entry` (which must have a holder) into the slot a [`Probe::Vacant`] named,
    /// with no growth or removal since that probe; [`BlockTable::reserve`] first.
    pub(crate) fn fill(&mut self, i: usize, hash: BlockHash, entry: Entry) {
        debug_assert!(self.slots[i].is_empty() && !entry.holders.is_empty());
        debug_assert!(self.len < self.slots.len() * MAX_LOAD_NUM / MAX_LOAD_DEN + 1);
        self.slots[i] = Slot { hash, entry };
        self.len += 1;
    }

    /// Makes room for `additional` more blocks without growing.
    pub(crate) fn reserve(&mut self, additional: usize) {
        let needed = self.len + additional;
        if needed * MAX_LOAD_DEN <= self.slots.len() * MAX_LOAD_NUM {
            return;
        }
        let count = (needed * MAX_LOAD_DEN).div_ceil(MAX_LOAD_NUM).next_power_of_two().max(self.slots.len() * 2);
        let old = std::mem::replace(self, Self::with_slots(count));
        for slot in old.slots.into_vec().into_iter().filter(|s| !s.is_empty()) {
            let Probe::Vacant(i) = self.probe(slot.hash) else { unreachable!("keys are unique") };
            self.fill(i, slot.hash, slot.entry);
        }
    }

    /// Frees slot `i`, whose entry has no holder left, moving the rest of its cluster back. Slot
    /// indices of other blocks may change.
    #[inline]
    pub(crate) fn remove_at(&mut self, i: usize) {
        debug_assert!(self.slots[i].is_empty());
        if self.slots[i].entry.holders.spilled() {
            // Give the heap buffer back; an inline empty list is what a free slot holds.
            self.slots[i].entry.holders = SmallVec::new();
        }
        self.len -= 1;
        let mut hole = i;
        let mut j = (i + 1) & self.mask;
        while !self.slots[j].is_empty() {
            // The entry at `j` may fill the hole unless its home lies cyclically in (hole, j].
            let home = self.home(self.slots[j].hash);
            if (j.wrapping_sub(home) & self.mask) >= (j.wrapping_sub(hole) & self.mask) {
                self.slots.swap(hole, j);
                hole = j;
            }
            j = (j + 1) & self.mask;
        }
    }

    /// Every block and its entry, in slot order (tests).
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = (BlockHash, &Entry)> {
        self.slots.iter().filter(|s| !s.is_empty()).map(|s| (s.hash, &s.entry))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::store::Holder;
    use std::collections::HashMap;

    fn entry(tag: u32) -> Entry {
        let mut e = Entry::default();
        e.holders.push(Holder { loc: tag, children: 0 });
        e
    }

    fn tag(table: &BlockTable, hash: BlockHash) -> Option<u32> {
        table.get(hash).map(|e| e.holders[0].loc)
    }

    /// Random inserts and removals, including keys that share their home slot, against a HashMap.
    #[test]
    fn matches_a_hash_map_through_growth_and_backward_shift() {
        let mut table = BlockTable::with_capacity(0);
        let mut model: HashMap<BlockHash, u32> = HashMap::new();
        let mut inserted = std::collections::HashSet::new();
        let mut state = 0x1234_5678_u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            state >> 33
        };
        for step in 0..40_000u32 {
            // Few distinct keys so removals hit; some differ only in their high 64 bits.
            let k = next() % 3000;
            let hash = match k {
                // The empty slot's default and the largest value are valid block hashes too.
                2999 => BlockHash(u128::MAX),
                k => BlockHash(u128::from(k % 1000) | (u128::from(k / 1000) << 64)),
            };
            if next() % 3 == 0 {
                let was = table.find(hash).map(|i| {
                    let holder = table.at_mut(i).holders.remove(0);
                    table.remove_at(i);
                    holder.loc
                });
                assert_eq!(was, model.remove(&hash), "remove {hash:?} at step {step}");
            } else {
                table.reserve(1);
                match table.probe(hash) {
                    Probe::Found(i) => table.at_mut(i).holders[0].loc = step,
                    Probe::Vacant(i) => table.fill(i, hash, entry(step)),
                }
                model.insert(hash, step);
                inserted.insert(hash);
            }
            assert_eq!(table.len(), model.len());
        }
        for (&hash, &t) in &model {
            assert_eq!(tag(&table, hash), Some(t));
        }
        assert_eq!(table.iter().count(), model.len());
        assert!(model.len() > 100, "the test keeps a populated table");
        assert!(
            inserted.contains(&BlockHash(u128::MAX)) && inserted.contains(&BlockHash(0)),
            "the special keys took part"
        );
    }
}
