//! The global prefix index (DESIGN.md §6): for a chain of block hashes, how long a prefix each
//! location — a worker's G1, a node's G2 or G3 — holds. Pure data structures, no actors.
//!
//! # Feeding it
//!
//! Sources report [`KvEvent`]s numbered per source and epoch. [`PrefixIndex::apply`] applies an
//! event only if it is the next one of its source; a duplicate is ignored, a gap marks the source
//! as needing a resync and refuses its events until [`PrefixIndex::resync`] replaces everything
//! the index has from it with a snapshot, and a new epoch (a restarted source) drops what the old
//! incarnation reported. The index therefore never silently diverges from its sources.
//!
//! Sources that send no events can still be routed to by prefix: [`PrefixIndex::record_routing`]
//! assumes a request's blocks are in its worker's G1 for a configured TTL. Those placements live
//! in separate, *approximate* locations ([`Location::approximate`]) and are counted apart.
//!
//! # Structure and cost
//!
//! Block hashes are chained (a hash names its whole prefix), so there is no tree: one flat map
//! keyed by the hash itself (a pass-through hasher on its low 64 bits) gives each block's parent
//! and the sorted list of locations holding it; each location keeps an append-only log of its
//! blocks (compacted when half stale), so clearing a source costs its own blocks, not a scan, and
//! an event touches one hash table per block. The lookup jumps 32 blocks at a time over
//! locations whose blocks are prefix-closed and bisects where one drops out; the few locations
//! that are not (out-of-order events, interior evictions) are walked block by block, so the answer
//! is always exact (`store.rs` explains the bookkeeping).
//!
//! # Concurrency
//!
//! One `parking_lot::RwLock` around the whole index: lookups share it, each event takes it
//! exclusively once. An event is therefore atomic — a lookup sees the state after some prefix of
//! the applied events, never half an event — and each operation pays one lock acquisition for
//! all its blocks rather than one per block, as a sharded map would. Events of one source must
//! be applied in order anyway, and the scheduler applies them from one mailbox.
//!
//! # Bounded memory
//!
//! [`IndexConfig::max_blocks`] bounds the distinct blocks. When the index is full, a block new to
//! the index is refused (counted in [`IndexStats::rejected_full`]); a block already indexed can
//! still gain locations. Refusing errs on the safe side: the index may miss a cached prefix (a
//! routing opportunity lost) but never claims a block that is not there, and sources evict
//! continuously, so room comes back without a scan.

mod events;
mod hasher;
mod matches;
mod store;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::time::{Duration, Instant};

use dynamo_config::TierName;
use dynamo_tiering::block::BlockHash;
use parking_lot::RwLock;

pub use events::{EventDecodeError, KvEvent, KvEventKind, SourceId};
pub use matches::{Location, LocationMatch, Matches, WorkerPrefix};

use store::{Insert, LocId, Store};

/// Limits and timings of a [`PrefixIndex`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexConfig {
    /// The most distinct blocks the index holds; new blocks beyond it are refused. Each block
    /// costs about 80 bytes plus 24 per location holding it.
    pub max_blocks: usize,
    /// How long a block recorded by [`PrefixIndex::record_routing`] is assumed to stay in G1.
    pub approximate_ttl: Duration,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self { max_blocks: 16 << 20, approximate_ttl: Duration::from_secs(120) }
    }
}

/// What [`PrefixIndex::apply`] did with an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The next event of its source: applied.
    Applied,
    /// A duplicate or an old event (`seq` at or below the last applied, or an older epoch):
    /// ignored.
    Stale,
    /// Events are missing between the last applied one and this one: not applied; the source
    /// now needs a [`PrefixIndex::resync`].
    Gap {
        /// The source.
        source: SourceId,
        /// The `seq` the index expected.
        expected: u64,
        /// The `seq` it got.
        got: u64,
    },
    /// The first event of a new epoch (a restarted source): what the old epoch reported was
    /// dropped, then the event applied.
    NewEpoch {
        /// The epoch that ended.
        previous: u64,
    },
    /// The source needs a resync since an earlier gap: not applied.
    AwaitingResync {
        /// The source.
        source: SourceId,
    },
}

impl Applied {
    /// A stable name, usable as a metric label.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Stale => "stale",
            Self::Gap { .. } => "gap",
            Self::NewEpoch { .. } => "new_epoch",
            Self::AwaitingResync { .. } => "awaiting_resync",
        }
    }
}

/// A run of blocks a source holds in one tier, in the shape of a `Stored` event: the parent of
/// `hashes[0]` is `parent`, the parent of `hashes[i]` is `hashes[i - 1]`. A resync snapshot is a
/// list of runs (a source's registry knows each block's parent from its image header).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRun {
    /// Where the blocks are held.
    pub tier: TierName,
    /// The parent of `hashes[0]`, `None` if it is the first block of its sequence.
    pub parent: Option<BlockHash>,
    /// The blocks, in prefix order.
    pub hashes: Vec<BlockHash>,
}

/// Counters and sizes of a [`PrefixIndex`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct blocks indexed.
    pub blocks: u64,
    /// (block, location) pairs, approximate ones included.
    pub placements: u64,
    /// (block, location) pairs of approximate locations.
    pub approximate_placements: u64,
    /// Locations holding at least one block.
    pub locations: u64,
    /// Sources known to the index.
    pub sources: u64,
    /// Sources refused until a resync.
    pub sources_awaiting_resync: u64,
    /// Applied `Stored` events (a new epoch's first event included).
    pub stored_events: u64,
    /// Applied `Removed` events.
    pub removed_events: u64,
    /// Applied `Cleared` events.
    pub cleared_events: u64,
    /// Duplicate or old events ignored.
    pub stale_events: u64,
    /// Gaps detected.
    pub gaps: u64,
    /// Events refused because their source awaited a resync.
    pub refused_events: u64,
    /// Restarted sources seen.
    pub new_epochs: u64,
    /// Resyncs applied.
    pub resyncs: u64,
    /// Blocks refused because the index was full.
    pub rejected_full: u64,
    /// Blocks recorded by [`PrefixIndex::record_routing`] (refreshes included).
    pub approximate_recorded: u64,
    /// Approximate placements that expired.
    pub approximate_expired: u64,
}

/// Per-source sequencing state.
#[derive(Debug, Clone, Copy)]
struct SourceState {
    epoch: u64,
    last_seq: u64,
    awaiting_resync: bool,
}

/// Everything behind the lock.
#[derive(Debug)]
struct Inner {
    store: Store,
    sources: HashMap<SourceId, SourceState, hasher::FxBuild>,
    /// Approximate placements by deadline (the TTL is fixed, so recording order is deadline order).
    expiry: VecDeque<(Instant, LocId, BlockHash)>,
    stats: IndexStats,
}

/// The global prefix index. `Send + Sync`; every method takes `&self`.
pub struct PrefixIndex {
    config: IndexConfig,
    inner: RwLock<Inner>,
}

impl fmt::Debug for PrefixIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefixIndex").field("config", &self.config).field("stats", &self.stats()).finish()
    }
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new(IndexConfig::default())
    }
}

impl PrefixIndex {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Self {
        let inner = Inner {
            store: Store::new(config.max_blocks),
            sources: HashMap::default(),
            expiry: VecDeque::new(),
            stats: IndexStats::default(),
        };
        Self { config, inner: RwLock::new(inner) }
    }

    /// The configuration.
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// Applies `event` if it is the next one of its source; see [`Applied`] for the rest.
    pub fn apply(&self, event: &KvEvent) -> Applied {
        let mut guard = self.inner.write();
        let inner = &mut *guard;
        let source = event.source;
        let state = *inner.sources.entry(source).or_insert(SourceState {
            epoch: event.epoch,
            last_seq: 0,
            awaiting_resync: false,
        });
        let outcome = if event.epoch < state.epoch {
            Applied::Stale
        } else if event.epoch > state.epoch {
            inner.clear_source(source);
            inner.stats.new_epochs += 1;
            let fresh = SourceState { epoch: event.epoch, last_seq: 0, awaiting_resync: false };
            inner.sources.insert(source, fresh);
            match inner.sequence(source, fresh, event.seq) {
                Applied::Applied => Applied::NewEpoch { previous: state.epoch },
                other => other,
            }
        } else {
            inner.sequence(source, state, event.seq)
        };
        match outcome {
            Applied::Applied | Applied::NewEpoch { .. } => {
                inner.sources.get_mut(&source).expect("source inserted above").last_seq = event.seq;
                inner.apply_kind(source, &event.kind);
            }
            Applied::Stale => inner.stats.stale_events += 1,
            Applied::Gap { .. } => inner.stats.gaps += 1,
            Applied::AwaitingResync { .. } => inner.stats.refused_events += 1,
        }
        outcome
    }

    /// Replaces everything the index has from `source` (its exact locations) with `snapshot`,
    /// taken by the source after its event `last_seq` of `epoch`; events after `last_seq` then
    /// apply as usual, earlier ones are stale.
    pub fn resync(&self, source: SourceId, epoch: u64, snapshot: &[SnapshotRun], last_seq: u64) {
        let mut guard = self.inner.write();
        let inner = &mut *guard;
        inner.clear_source(source);
        for run in snapshot {
            let loc = inner.store.location_id(Location { source, tier: run.tier, approximate: false });
            inner.stats.rejected_full += inner.store.insert_chain(loc, run.parent, &run.hashes);
        }
        inner.sources.insert(source, SourceState { epoch, last_seq, awaiting_resync: false });
        inner.stats.resyncs += 1;
    }

    /// Whether `source` needs a resync (a gap was seen and no resync followed).
    pub fn awaiting_resync(&self, source: SourceId) -> bool {
        self.inner.read().sources.get(&source).is_some_and(|s| s.awaiting_resync)
    }

    /// Assumes the chain `hashes` (from block 0) is in `worker`'s G1 until `now` plus the
    /// configured TTL: the approximate mode for workers that send no events. Recording a block
    /// again extends its deadline. Also expires what is due at `now`.
    pub fn record_routing(&self, worker: SourceId, hashes: &[BlockHash], now: Instant) {
        let deadline = now + self.config.approximate_ttl;
        let mut guard = self.inner.write();
        let inner = &mut *guard;
        inner.expire(now);
        let loc = inner.store.location_id(Location { source: worker, tier: TierName::G1, approximate: true });
        let mut parent = None;
        for &hash in hashes {
            if inner.store.insert(loc, hash, parent) == Insert::Rejected {
                inner.stats.rejected_full += 1;
            } else {
                inner.store.set_deadline(loc, hash, deadline);
                inner.expiry.push_back((deadline, loc, hash));
                inner.stats.approximate_recorded += 1;
            }
            parent = Some(hash);
        }
    }

    /// Drops the approximate placements whose deadline is at or before `now`. Expiry is lazy:
    /// it runs here and in [`PrefixIndex::record_routing`], so a lookup may still see a
    /// placement until the next of those calls.
    pub fn expire_approximate(&self, now: Instant) {
        self.inner.write().expire(now);
    }

    /// For every location holding a prefix of `hashes`, the length in blocks of the longest
    /// prefix it holds contiguously from block 0; into `out`, replacing what it held.
    ///
    /// `hashes` must be a chain (the parent of `hashes[i]` is `hashes[i - 1]`), as the block
    /// hasher produces from a prompt.
    pub fn find_matches(&self, hashes: &[BlockHash], out: &mut Matches) {
        self.inner.read().store.find_matches(hashes, out);
    }

    /// Counters and sizes, as of now.
    pub fn stats(&self) -> IndexStats {
        let inner = self.inner.read();
        IndexStats {
            blocks: inner.store.blocks() as u64,
            placements: inner.store.placements(),
            approximate_placements: inner.store.approximate_placements(),
            locations: inner.store.live_locations() as u64,
            sources: inner.sources.len() as u64,
            sources_awaiting_resync: inner.sources.values().filter(|s| s.awaiting_resync).count() as u64,
            ..inner.stats.clone()
        }
    }

    /// Runs `f` on the store under the read lock (tests).
    #[cfg(test)]
    fn with_store<R>(&self, f: impl FnOnce(&Store) -> R) -> R {
        f(&self.inner.read().store)
    }
}

impl Inner {
    /// Decides whether the event `seq` of `source` (in its current epoch) applies.
    fn sequence(&mut self, source: SourceId, state: SourceState, seq: u64) -> Applied {
        if state.awaiting_resync {
            return Applied::AwaitingResync { source };
        }
        let expected = state.last_seq + 1;
        if seq < expected {
            Applied::Stale
        } else if seq > expected {
            self.sources.get_mut(&source).expect("source is known").awaiting_resync = true;
            Applied::Gap { source, expected, got: seq }
        } else {
            Applied::Applied
        }
    }

    fn apply_kind(&mut self, source: SourceId, kind: &KvEventKind) {
        match kind {
            KvEventKind::Stored { hashes, parent, tier } => {
                let loc = self.store.location_id(Location { source, tier: *tier, approximate: false });
                self.stats.rejected_full += self.store.insert_chain(loc, *parent, hashes);
                self.stats.stored_events += 1;
            }
            KvEventKind::Removed { hashes, tier } => {
                let location = Location { source, tier: *tier, approximate: false };
                if let Some(loc) = self.store.existing_location_id(location) {
                    for &hash in hashes {
                        self.store.remove(loc, hash);
                    }
                }
                self.stats.removed_events += 1;
            }
            KvEventKind::Cleared => {
                self.clear_source(source);
                self.stats.cleared_events += 1;
            }
        }
    }

    /// Drops every exact placement of `source`, in `O(its blocks)`.
    fn clear_source(&mut self, source: SourceId) {
        for &tier in TierName::ALL {
            if let Some(loc) = self.store.existing_location_id(Location { source, tier, approximate: false }) {
                self.store.clear(loc);
            }
        }
    }

    fn expire(&mut self, now: Instant) {
        while let Some(&(deadline, loc, hash)) = self.expiry.front() {
            if deadline > now {
                break;
            }
            self.expiry.pop_front();
            // A later record may have extended the deadline; then a later queue entry expires it.
            if self.store.deadline(loc, hash) == Some(deadline) && self.store.remove(loc, hash) {
                self.stats.approximate_expired += 1;
            }
        }
    }
}
