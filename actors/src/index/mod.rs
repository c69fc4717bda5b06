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
//! Block hashes are chained (a hash names its whole prefix), so there is no tree: one flat
//! open-addressing table keyed by the hash itself (`table.rs`: one 64-byte line per block) gives
//! each block's parent and the sorted list of locations holding it; each location keeps an
//! append-only log of its blocks (compacted when three quarters stale), so clearing a source costs
//! its own blocks, not a scan, and an event touches one hash table per block. An event names all
//! its blocks up front, so their table lines are prefetched a few blocks ahead and the cache misses
//! overlap; a block's parent in a chain is reached by slot, not by a second probe. The lookup jumps
//! 32 blocks at a time over locations whose blocks are prefix-closed and bisects where one drops
//! out; the few locations that are not (out-of-order events, interior evictions) are searched the
//! same way before their first gap, so the answer is always exact (`store.rs` explains the
//! bookkeeping).
//!
//! # Concurrency
//!
//! The index is split into shards ([`DEFAULT_SHARDS`], or [`PrefixIndex::with_shards`]), each a
//! complete index of the sources assigned to it (a node's workers round-robin) behind its own
//! `parking_lot::RwLock`. An event, a resync or a routing record touches only its source's shard
//! and takes its lock exclusively once, so it is atomic and pays one lock acquisition for all its
//! blocks; events of different shards no longer serialize. A lookup takes each shard's read lock
//! in turn and appends that shard's answers.
//!
//! The guarantee: for every source, the part of an answer about that source's locations equals
//! the state after some prefix of that source's events — never half an event. Two shards may be
//! read at different moments, so with more than one shard an answer need not equal the state
//! after one global prefix of all events (Dynamo's `ThreadPoolIndexer` relaxes this the same
//! way, per worker thread). One shard restores the single global snapshot. Events of one source
//! must be applied in order anyway: the node's `KvPublisher` numbers them under one lock and hands
//! them to one writer.
//!
//! How many shards: one per thread that applies events at the same time. A lookup probes every
//! shard and a block held by sources of two shards is stored in both, so each shard costs a
//! single thread about 8% more instructions (and 4 shards up to ~25% of its time), while two
//! threads applying events to one shard serialize on its lock (measured on the peer bench: two
//! replay threads ran at 1.2–1.4× one thread on one shard, 1.5–2.2× on two). [`DEFAULT_SHARDS`]
//! is 1 because the serving node applies all its events on one [`IndexWriter`] thread and the
//! simulated replay on its one thread; lookups run beside that writer either way.
//!
//! The hot paths take a shard's lock by spinning, then yielding, and park only after 50 µs: an
//! event holds a shard for about a microsecond, and parking and waking a thread costs several
//! (measured on the peer bench: two replay threads went from no faster than one to 1.4–2.2× one).
//!
//! Events may also be applied off the producing thread: [`IndexWriter`] queues them to writer
//! threads of the index's own (per shard, so each source stays in order), which apply runs of
//! them under one lock acquisition and let waiting lookups in between two events.
//!
//! # Bounded memory
//!
//! [`IndexConfig::max_blocks`] bounds the distinct blocks: each shard holds at most its share
//! (`max_blocks` divided by the shard count, rounded up), and a block held by sources of two
//! shards counts in both (as it does in [`IndexStats::blocks`]). When a shard is full, a block new to
//! that shard is refused (counted in [`IndexStats::rejected_full`]); a block the shard already indexes can
//! still gain locations. An external engine's location (its G1, from its own KV events) holds at
//! most a quarter of its shard's share, so one engine's events cannot fill the index and push the
//! node's own routing entries out. Refusing errs on the safe side: the index may miss a cached prefix (a
//! routing opportunity lost) but never claims a block that is not there, and sources evict
//! continuously, so room comes back without a scan.

mod events;
mod hasher;
mod matches;
mod store;
mod table;
mod writer;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use dynamo_config::TierName;
use dynamo_tiering::block::{BlockHash, SetDigest};
use parking_lot::RwLock;

pub use events::{EventDecodeError, KvEvent, KvEventKind, SourceId};
pub use matches::{Location, LocationMatch, Matches, WorkerPrefix, WorkerViews};
pub use writer::{IndexWriter, OnApplied};

use store::{Insert, LocId, Store};

/// Limits and timings of a [`PrefixIndex`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexConfig {
    /// The most distinct blocks the index holds; new blocks beyond it are refused. Each block
    /// costs a 64-byte table slot at up to 5/8 load (100–200 bytes), 8 more per holder beyond
    /// three, and 16–64 bytes of log per holder.
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
    /// Distinct blocks indexed, summed over the shards (a block in two shards counts twice).
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

/// How many shards [`PrefixIndex::new`] splits the index into; see the module docs.
pub const DEFAULT_SHARDS: usize = 1;

/// One shard: an independent index of the sources assigned to it, on its own cache lines.
#[repr(align(128))]
struct Shard(RwLock<Inner>, Waiting);

/// Lookups waiting for a shard's read lock: a writer applying a run of events lets them in
/// between two events instead of after the whole run.
#[derive(Debug, Default)]
struct Waiting(std::sync::atomic::AtomicU32);

/// The global prefix index. `Send + Sync`; every method takes `&self`.
pub struct PrefixIndex {
    config: IndexConfig,
    shards: Box<[Shard]>,
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
    /// An empty index of [`DEFAULT_SHARDS`] shards.
    pub fn new(config: IndexConfig) -> Self {
        Self::with_shards(config, DEFAULT_SHARDS)
    }

    /// An empty index of `shards` shards (at least 1); each holds at most
    /// `max_blocks.div_ceil(shards)` distinct blocks. One shard gives a single global snapshot
    /// and an exact `max_blocks` (see the module docs).
    pub fn with_shards(config: IndexConfig, shards: usize) -> Self {
        let count = shards.max(1);
        let per_shard = config.max_blocks.div_ceil(count);
        let shards = (0..count)
            .map(|_| {
                Shard(
                    RwLock::new(Inner {
                        store: Store::new(per_shard, count),
                        sources: HashMap::default(),
                        expiry: VecDeque::new(),
                        stats: IndexStats::default(),
                    }),
                    Waiting::default(),
                )
            })
            .collect();
        Self { config, shards }
    }

    /// How many shards the index has.
    pub fn shards(&self) -> usize {
        self.shards.len()
    }

    /// The number of the shard of `source`: a node's workers round-robin over the shards.
    pub fn shard_index(&self, source: SourceId) -> usize {
        let mixed = usize::from(source.worker) ^ usize::from(source.node).wrapping_mul(0x9E37_79B1);
        mixed % self.shards.len()
    }

    /// The shard of `source`.
    fn shard(&self, source: SourceId) -> &RwLock<Inner> {
        &self.shards[self.shard_index(source)].0
    }

    /// The configuration.
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// Applies `event` if it is the next one of its source; see [`Applied`] for the rest.
    pub fn apply(&self, event: &KvEvent) -> Applied {
        write_spinning(self.shard(event.source)).apply(event)
    }

    /// Applies `events` in order, as [`PrefixIndex::apply`] would one by one, taking a shard's lock
    /// once for each run of consecutive events of that shard; `outcomes` gets one entry per event
    /// (it is cleared first).
    pub fn apply_run(&self, events: &[KvEvent], outcomes: &mut Vec<Applied>) {
        outcomes.clear();
        let mut rest = events;
        while let Some(first) = rest.first() {
            let shard = self.shard_index(first.source);
            let len = rest.iter().take_while(|e| self.shard_index(e.source) == shard).count();
            let Shard(lock, waiting) = &self.shards[shard];
            let mut inner = write_spinning(lock);
            for event in &rest[..len] {
                if waiting.0.load(Ordering::Relaxed) > 0 {
                    // Let the waiting lookups in (for a bounded time), then go on.
                    drop(inner);
                    let start = Instant::now();
                    while waiting.0.load(Ordering::Relaxed) > 0 && start.elapsed() < HANDOFF {
                        std::hint::spin_loop();
                    }
                    inner = write_spinning(lock);
                }
                outcomes.push(inner.apply(event));
            }
            drop(inner);
            rest = &rest[len..];
        }
    }

    /// Replaces everything the index has from `source` (its exact locations) with `snapshot`,
    /// taken by the source after its event `last_seq` of `epoch`; events after `last_seq` then
    /// apply as usual, earlier ones are stale.
    pub fn resync(&self, source: SourceId, epoch: u64, snapshot: &[SnapshotRun], last_seq: u64) {
        let mut guard = self.shard(source).write();
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
        self.shard(source).read().sources.get(&source).is_some_and(|s| s.awaiting_resync)
    }

    /// Assumes the chain `hashes` (from block 0) is in `worker`'s G1 until `now` plus the
    /// configured TTL: the approximate mode for workers that send no events. Recording a block
    /// again extends its deadline. Also expires what is due at `now`.
    pub fn record_routing(&self, worker: SourceId, hashes: &[BlockHash], now: Instant) {
        let deadline = now + self.config.approximate_ttl;
        self.expire_other_shards(worker, now);
        let mut guard = self.shard(worker).write();
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

    /// Expires what is due at `now` in the shards other than `source`'s, taking a shard's write
    /// lock only when something there is due.
    fn expire_other_shards(&self, source: SourceId, now: Instant) {
        let own: *const RwLock<Inner> = self.shard(source);
        for shard in self.shards.iter().filter(|s| !std::ptr::eq(&s.0, own)) {
            let due = shard.0.read().expiry.front().is_some_and(|&(deadline, ..)| deadline <= now);
            if due {
                shard.0.write().expire(now);
            }
        }
    }

    /// Drops the approximate placements whose deadline is at or before `now`. Expiry is lazy:
    /// it runs here and in [`PrefixIndex::record_routing`], so a lookup may still see a
    /// placement until the next of those calls.
    pub fn expire_approximate(&self, now: Instant) {
        for shard in self.shards.iter() {
            shard.0.write().expire(now);
        }
    }

    /// For every location holding a prefix of `hashes`, the length in blocks of the longest
    /// prefix it holds contiguously from block 0; into `out`, replacing what it held.
    ///
    /// `hashes` must be a chain (the parent of `hashes[i]` is `hashes[i - 1]`), as the block
    /// hasher produces from a prompt.
    ///
    /// Locations come shard by shard, each shard's in location order. Each shard is read under
    /// its own lock: the answer for one source's locations is exact for the state after some
    /// prefix of that source's events, but two shards may be seen at different moments.
    pub fn find_matches(&self, hashes: &[BlockHash], out: &mut Matches) {
        out.results.clear();
        for shard in self.shards.iter() {
            read_waiting(shard).store.find_matches(hashes, out);
        }
    }

    /// Blocks `location` holds, as its events and resyncs left it.
    pub fn held_count(&self, location: Location) -> u64 {
        self.shard(location.source).read().store.held_count(location)
    }

    /// Blocks `location` holds and the digest of their set, as its events and resyncs left it
    /// (one look, so the two agree).
    pub fn held_set(&self, location: Location) -> (u64, SetDigest) {
        self.shard(location.source).read().store.held_set(location)
    }

    /// Counters and sizes, as of now, summed over the shards (shard by shard, so not one
    /// snapshot). `blocks` counts a block once per shard holding it.
    pub fn stats(&self) -> IndexStats {
        let mut total = IndexStats::default();
        for shard in self.shards.iter() {
            let inner = shard.0.read();
            let s = &inner.stats;
            total.blocks += inner.store.blocks() as u64;
            total.placements += inner.store.placements();
            total.approximate_placements += inner.store.approximate_placements();
            total.locations += inner.store.live_locations() as u64;
            total.sources += inner.sources.len() as u64;
            total.sources_awaiting_resync += inner.sources.values().filter(|s| s.awaiting_resync).count() as u64;
            total.stored_events += s.stored_events;
            total.removed_events += s.removed_events;
            total.cleared_events += s.cleared_events;
            total.stale_events += s.stale_events;
            total.gaps += s.gaps;
            total.refused_events += s.refused_events;
            total.new_epochs += s.new_epochs;
            total.resyncs += s.resyncs;
            total.rejected_full += s.rejected_full;
            total.approximate_recorded += s.approximate_recorded;
            total.approximate_expired += s.approximate_expired;
        }
        total
    }

    /// Runs `f` on every shard's store under its read lock (tests).
    #[cfg(test)]
    fn with_store(&self, f: impl Fn(&Store)) {
        for shard in self.shards.iter() {
            f(&shard.0.read().store);
        }
    }
}

/// How long a lock acquisition of the hot paths keeps trying before it parks the thread.
const SPIN_LIMIT: Duration = Duration::from_micros(50);

/// Spins of a lock acquisition before it starts yielding the CPU between tries.
const SPINS: u32 = 128;

/// Takes a lock with `try_lock`, spinning (not parking) while it is held: an event holds a shard
/// for a microsecond or so, far less than a park and wake. After [`SPINS`] spins it yields the
/// CPU between tries (the holder may be waiting for this very core), and after [`SPIN_LIMIT`] it
/// parks with `lock`.
fn acquire<G>(held: impl Fn() -> bool, try_lock: impl Fn() -> Option<G>, lock: impl FnOnce() -> G) -> G {
    if let Some(guard) = try_lock() {
        return guard;
    }
    for _ in 0..SPINS {
        std::hint::spin_loop();
        if !held()
            && let Some(guard) = try_lock()
        {
            return guard;
        }
    }
    let start = Instant::now();
    while start.elapsed() < SPIN_LIMIT {
        std::thread::yield_now();
        if let Some(guard) = try_lock() {
            return guard;
        }
    }
    lock()
}

/// Takes `lock` for reading; see [`acquire`].
fn read_spinning(lock: &RwLock<Inner>) -> parking_lot::RwLockReadGuard<'_, Inner> {
    acquire(|| lock.is_locked_exclusive(), || lock.try_read(), || lock.read())
}

/// How long a writer between two events of a run waits for the lookups it let in.
const HANDOFF: Duration = Duration::from_micros(20);

/// Takes `shard` for reading as [`read_spinning`] does, counted among its waiting lookups while
/// it waits.
fn read_waiting(shard: &Shard) -> parking_lot::RwLockReadGuard<'_, Inner> {
    if let Some(guard) = shard.0.try_read() {
        return guard;
    }
    shard.1.0.fetch_add(1, Ordering::Relaxed);
    let guard = read_spinning(&shard.0);
    shard.1.0.fetch_sub(1, Ordering::Relaxed);
    guard
}

/// Takes `lock` for writing; see [`acquire`].
fn write_spinning(lock: &RwLock<Inner>) -> parking_lot::RwLockWriteGuard<'_, Inner> {
    acquire(|| lock.is_locked(), || lock.try_write(), || lock.write())
}

impl Inner {
    /// [`PrefixIndex::apply`] under the shard's lock.
    fn apply(&mut self, event: &KvEvent) -> Applied {
        let source = event.source;
        let inner = self;
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
                    self.store.remove_chain(loc, hashes);
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
