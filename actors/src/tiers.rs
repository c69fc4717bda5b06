//! The node's shared tiers below G1, as the workers use them: G2 (host pool + registry + the
//! hash → slot map) and G3 (store + registry), each behind its own lock, with admission that
//! evicts by the tier's policy and frees exactly what the registry gave up. G3 also carries its
//! [`G3Health`]: workers report I/O outcomes there and the G3 store actor decides when the node
//! runs without G3 and when it comes back.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dynamo_config::{RegionKind, RetentionSection, TierName, TiersSection};
use dynamo_tiering::block::guard::{ImageGuard, Tag};
use dynamo_tiering::block::{BlockHash, BlockLayout, BlockMap, Salt};
use dynamo_tiering::cost::{BytesPerSec, CostModel, Measurements, write_admitted};
use dynamo_tiering::g2::{HostPool, SlotMut, SlotRef};
use dynamo_tiering::g3::{G3Error, G3Store, ReadFailure};
use dynamo_tiering::pipeline::{Pipeline, WriteThrough};
use dynamo_tiering::registry::{Admission, BlockMeta, Millis, TierRegistry};

use crate::leases::{LeaseBook, LeasedTiers};
use crate::telemetry::{record_tier_error, record_transfer, record_write_skipped};
use crate::tier_store::{ReadMiss, TierStore};

/// Where a block is: one worker's G1, or one of the node's shared tiers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockSite {
    /// The G1 pool of worker `worker`.
    G1 {
        /// The worker's index in the node.
        worker: usize,
    },
    /// A node-shared tier (G2, G3).
    Node(TierName),
    /// A block an engine outside the node (a vLLM engine, through the engine endpoint) keeps in a
    /// node-shared tier under its own key, reported under the node's name for it so that the
    /// router finds it from a prompt ([`crate::engine_names`]). Peers are not told: they fetch by
    /// the engine's key, which the tier reports as [`BlockSite::Node`].
    Engines(TierName),
}

/// Sees every change of where blocks are: the source of KV events. Calls come from worker
/// threads and I/O completions, so they must be cheap and must not block; a `stored` is sent only
/// once the tier acknowledged the block (G3: after the write completed).
pub trait KvObserver: Send + Sync + std::fmt::Debug {
    /// `hashes` (in prefix order; the first one's parent is `parent`) are now in `site`.
    fn stored(&self, site: BlockSite, parent: Option<BlockHash>, hashes: &[BlockHash]);
    /// `hashes` are no longer in `site`.
    fn removed(&self, site: BlockSite, hashes: &[BlockHash]);
    /// Everything worker `worker` had in G1 is gone (it restarted).
    fn cleared(&self, worker: usize);
}

/// A [`KvObserver`] that ignores everything.
#[derive(Debug, Default)]
pub struct NoObserver;

impl KvObserver for NoObserver {
    fn stored(&self, _: BlockSite, _: Option<BlockHash>, _: &[BlockHash]) {}
    fn removed(&self, _: BlockSite, _: &[BlockHash]) {}
    fn cleared(&self, _: usize) {}
}

/// Counts a use of each block of `hashes` that `registry` holds.
fn touch_in(registry: &mut TierRegistry, hashes: &[BlockHash], now: Millis) {
    for &hash in hashes {
        let _ = registry.touch(hash, now);
    }
}

fn victims(evicted: &[dynamo_tiering::registry::Evicted]) -> Vec<BlockHash> {
    evicted.iter().map(|v| v.hash).collect()
}

/// G2: the pool and what it holds.
#[derive(Debug)]
pub struct G2Tier {
    /// The pool.
    pub pool: HostPool,
    registry: Arc<Mutex<TierRegistry>>,
    inner: Mutex<G2Inner>,
    observer: Arc<dyn KvObserver>,
    /// With a pool other processes map (the engine endpoint's), every image is tagged under a key
    /// only this process has when it is admitted, and checked against its tag on every read:
    /// an engine that rewrites an image, checksums and all, is caught before its bytes are used.
    guard: Option<ImageGuard>,
}

#[derive(Debug)]
struct G2Inner {
    slots: BlockMap<SlotRef>,
    tags: BlockMap<Tag>,
}

impl G2Tier {
    /// A G2 tier over `pool`, with `registry` deciding what stays (shared with whoever reports
    /// its stats).
    pub fn new(pool: HostPool, registry: Arc<Mutex<TierRegistry>>) -> Self {
        let guard = pool.share_fd().is_some().then(|| ImageGuard::new().expect("the OS's randomness"));
        Self {
            pool,
            registry,
            inner: Mutex::new(G2Inner { slots: BlockMap::default(), tags: BlockMap::default() }),
            observer: Arc::new(NoObserver),
            guard,
        }
    }

    /// `slot` if it is still the image admitted as `hash` (always, in a private pool). One that is
    /// not is dropped from G2 and counted corrupt: its bytes are never used.
    fn checked(&self, hash: BlockHash, slot: SlotRef, tag: Option<Tag>) -> Option<SlotRef> {
        let (Some(guard), Some(tag)) = (&self.guard, tag) else { return Some(slot) };
        if guard.check(slot.as_slice(), &tag) {
            return Some(slot);
        }
        tracing::warn!(%hash, "a G2 image changed after it was admitted (written by another process); dropped");
        crate::telemetry::record_corrupt_block(TierName::G2);
        self.forget(hash);
        None
    }

    /// Reports what this tier stores and drops to `observer`.
    pub fn with_observer(mut self, observer: Arc<dyn KvObserver>) -> Self {
        self.observer = observer;
        self
    }

    fn report_removed(&self, hashes: Vec<BlockHash>) {
        if !hashes.is_empty() {
            self.observer.removed(BlockSite::Node(TierName::G2), &hashes);
        }
    }

    fn lock(&self) -> (std::sync::MutexGuard<'_, G2Inner>, std::sync::MutexGuard<'_, TierRegistry>) {
        // Always slots first, then the registry: one order, no deadlock.
        let inner = self.inner.lock().expect("G2 lock");
        let registry = self.registry.lock().expect("G2 registry lock");
        (inner, registry)
    }

    /// The image of `hash`, if resident (counts as an access).
    pub fn get(&self, hash: BlockHash, now: Millis) -> Option<SlotRef> {
        let (g, mut registry) = self.lock();
        let slot = g.slots.get(&hash).cloned()?;
        let tag = g.tags.get(&hash).copied();
        let _ = registry.touch(hash, now);
        drop((g, registry));
        self.checked(hash, slot, tag)
    }

    /// The image of `hash`, if resident, without counting an access (write-through reading it
    /// on to G3 is not a use of the block).
    pub fn peek(&self, hash: BlockHash) -> Option<SlotRef> {
        let g = self.inner.lock().expect("G2 lock");
        let slot = g.slots.get(&hash).cloned()?;
        let tag = g.tags.get(&hash).copied();
        drop(g);
        self.checked(hash, slot, tag)
    }

    /// Whether `hash` is resident.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.inner.lock().expect("G2 lock").slots.contains_key(&hash)
    }

    /// Blocks resident.
    pub fn len(&self) -> usize {
        self.inner.lock().expect("G2 lock").slots.len()
    }

    /// Whether nothing is resident.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A free slot, evicting one block by policy if the pool is exhausted.
    pub fn alloc(&self, now: Millis) -> Option<SlotMut> {
        if let Some(slot) = self.pool.try_alloc() {
            return Some(slot);
        }
        let (mut g, mut registry) = self.lock();
        let evicted = registry.evict(1, now);
        for victim in &evicted {
            g.slots.remove(&victim.hash);
            g.tags.remove(&victim.hash);
        }
        drop((g, registry));
        self.report_removed(victims(&evicted));
        self.pool.try_alloc()
    }

    /// Admits a sealed image. Returns false when the tier refused it (everything pinned) or
    /// already had it.
    pub fn admit(&self, hash: BlockHash, meta: BlockMeta, image: SlotRef, now: Millis) -> bool {
        // Tagged before it is visible to any reader; the MAC runs outside the locks.
        let tag = self.guard.as_ref().map(|guard| guard.tag(image.as_slice()));
        let (mut g, mut registry) = self.lock();
        match registry.insert(hash, meta, now) {
            Ok(Admission::Inserted { evicted }) => {
                for victim in &evicted {
                    g.slots.remove(&victim.hash);
                    g.tags.remove(&victim.hash);
                }
                if let Some(tag) = tag {
                    g.tags.insert(hash, tag);
                }
                g.slots.insert(hash, image);
                drop((g, registry));
                self.report_removed(victims(&evicted));
                self.observer.stored(BlockSite::Node(TierName::G2), meta.parent, &[hash]);
                true
            }
            Ok(Admission::AlreadyPresent) | Err(_) => false,
        }
    }

    /// Drops `hash` from G2 (its image failed verification); readers holding the image keep it
    /// until they let go.
    pub fn forget(&self, hash: BlockHash) {
        let (mut g, mut registry) = self.lock();
        let removed = g.slots.remove(&hash).is_some();
        g.tags.remove(&hash);
        let _ = registry.remove(hash);
        drop((g, registry));
        if removed {
            self.report_removed(vec![hash]);
        }
    }

    /// Raises a resident block's priority (a turn's answer becoming conversation context).
    pub fn promote(&self, hash: BlockHash, priority: u8) {
        let _ = self.registry.lock().expect("G2 registry lock").set_priority(hash, priority);
    }

    /// Counts a use of each resident block of `hashes` (one lock for all).
    pub fn touch(&self, hashes: &[BlockHash], now: Millis) {
        touch_in(&mut self.registry.lock().expect("G2 registry lock"), hashes, now);
    }

    /// Extends the hold of a resident block.
    pub fn hold(&self, hash: BlockHash, until: Millis) {
        let _ = self.registry.lock().expect("G2 registry lock").hold(hash, until);
    }

    /// Evicts by policy until at most `target` blocks are resident (background eviction between
    /// the watermarks, so the hot path rarely has to). Returns the blocks evicted.
    pub fn evict_to(&self, target: usize, now: Millis) -> usize {
        let (mut g, mut registry) = self.lock();
        let evicted = registry.evict_to(target, now);
        for victim in &evicted {
            g.slots.remove(&victim.hash);
            g.tags.remove(&victim.hash);
        }
        drop((g, registry));
        let n = evicted.len();
        self.report_removed(victims(&evicted));
        n
    }

    /// Blocks the registry may keep resident.
    pub fn capacity(&self) -> usize {
        self.registry.lock().expect("G2 registry lock").capacity()
    }
}

/// G3's health as the node sees it. Workers report every I/O outcome; the G3 store actor turns a
/// run of failures into a degraded node (G1+G2 only) and probes the disk until it answers again.
/// Capacity (`Full`), missing blocks and corrupt images are not disk failures: only I/O errors
/// and a full device count.
#[derive(Debug, Default)]
pub struct G3Health {
    degraded: AtomicBool,
    consecutive_failures: AtomicU32,
    last_error: Mutex<Option<String>>,
}

impl G3Health {
    /// Whether the node runs without G3 now: no reads, no writes.
    pub fn is_degraded(&self) -> bool {
        self.degraded.load(Ordering::Acquire)
    }

    /// Marks G3 degraded or healthy; returns whether that changed anything.
    pub fn set_degraded(&self, degraded: bool) -> bool {
        if !degraded {
            self.consecutive_failures.store(0, Ordering::Relaxed);
        }
        self.degraded.swap(degraded, Ordering::AcqRel) != degraded
    }

    /// An operation succeeded: the failure run is over.
    pub fn record_ok(&self) {
        self.consecutive_failures.store(0, Ordering::Relaxed);
    }

    /// An operation failed with `error`; returns whether it counts as a disk failure.
    pub fn record_error(&self, error: &G3Error) -> bool {
        if !matches!(error, G3Error::NoSpace(_) | G3Error::Io(_)) {
            return false;
        }
        self.consecutive_failures.fetch_add(1, Ordering::Relaxed);
        *self.last_error.lock().expect("G3 health lock") = Some(error.to_string());
        true
    }

    /// Disk failures in a row since the last success.
    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive_failures.load(Ordering::Relaxed)
    }

    /// The last disk failure, for the log line.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().expect("G3 health lock").clone()
    }
}

/// G3: the store and what it holds.
#[derive(Debug)]
pub struct G3Tier {
    /// The store.
    pub store: Arc<G3Store>,
    /// Whether the node may use it now.
    pub health: G3Health,
    registry: Arc<Mutex<TierRegistry>>,
    observer: Arc<dyn KvObserver>,
    /// Bytes handed to the disk by write-through and not yet written, node-wide.
    writing: Arc<AtomicU64>,
    /// `tiers.g3.write_gb_s`; `None`: the rate timed on the node's own writes.
    write_rate: Option<BytesPerSec>,
}

impl G3Tier {
    /// A G3 tier over `store`, with `registry` (rebuilt from the store's recovery) deciding what
    /// stays (shared with whoever reports its stats).
    pub fn new(store: Arc<G3Store>, registry: Arc<Mutex<TierRegistry>>) -> Self {
        Self {
            store,
            health: G3Health::default(),
            registry,
            observer: Arc::new(NoObserver),
            writing: Arc::default(),
            write_rate: None,
        }
    }

    /// Takes the disk's write rate as `rate` (`tiers.g3.write_gb_s`) instead of timing it.
    pub fn with_write_rate(mut self, rate: Option<BytesPerSec>) -> Self {
        self.write_rate = rate;
        self
    }

    /// Admits one block's write-through to the disk's backlog under the node's one rule
    /// ([`write_admitted`]: one second of the disk's writes, at the configured rate or the one
    /// `measured` on its writes). `None` when the disk is that far behind — the block stays in
    /// G2 only and is counted as skipped — unless `leased` (G3 is where a lease pins it). The
    /// ticket counts the bytes out of the backlog when it is dropped, once the write is done.
    pub fn begin_write(&self, measured: &Measurements, leased: bool) -> Option<WriteTicket> {
        let bytes = self.store.slot_bytes() as u64;
        let rate = self.write_rate.or_else(|| measured.g3_write.get());
        if !leased && !write_admitted(self.writing.load(Ordering::Relaxed), bytes, rate) {
            record_write_skipped(TierName::G3);
            return None;
        }
        self.writing.fetch_add(bytes, Ordering::Relaxed);
        Some(WriteTicket { writing: self.writing.clone(), bytes })
    }

    /// Writes a sealed `image` of `hash` through: the one way every writer of G3 writes it. A
    /// completed write is acknowledged (a KV event); a failed one counts toward the tier's
    /// health, is counted by kind, and forgets the block (it stays in G1/G2 only).
    pub async fn write(&self, hash: BlockHash, parent: Option<BlockHash>, image: SlotRef) -> bool {
        match self.store.write(image).await {
            Ok(_) => {
                self.health.record_ok();
                self.acknowledge(hash, parent);
                true
            }
            Err(e) => {
                self.health.record_error(&e);
                record_tier_error(TierName::G3, e.kind());
                tracing::warn!(%hash, error = %e, "G3 write-through failed; the block stays in G1/G2 only");
                self.forget(hash);
                false
            }
        }
    }

    /// Reports what this tier stores and drops to `observer`.
    pub fn with_observer(mut self, observer: Arc<dyn KvObserver>) -> Self {
        self.observer = observer;
        self
    }

    /// The write of `hash` completed: G3 acknowledges it.
    pub fn acknowledge(&self, hash: BlockHash, parent: Option<BlockHash>) {
        self.observer.stored(BlockSite::Node(TierName::G3), parent, &[hash]);
    }

    /// Whether reads and writes may go to G3 now (false while the node is degraded).
    pub fn usable(&self) -> bool {
        !self.health.is_degraded()
    }

    /// Evicts by policy until at most `target` blocks are registered, removing them from the store.
    pub fn evict_to(&self, target: usize, now: Millis) -> usize {
        let evicted = self.registry.lock().expect("G3 lock").evict_to(target, now);
        for victim in &evicted {
            self.store.remove(victim.hash);
        }
        if !evicted.is_empty() {
            self.observer.removed(BlockSite::Node(TierName::G3), &victims(&evicted));
        }
        evicted.len()
    }

    /// Blocks registered, and the most the registry may keep.
    pub fn occupancy(&self) -> (usize, usize) {
        let r = self.registry.lock().expect("G3 lock");
        (r.len(), r.capacity())
    }

    /// Registers `hash` for writing, evicting by policy; returns false when it is present or the
    /// tier refuses it. The evicted blocks are removed from the store.
    pub fn reserve(&self, hash: BlockHash, meta: BlockMeta, now: Millis) -> bool {
        let mut r = self.registry.lock().expect("G3 lock");
        match r.insert(hash, meta, now) {
            Ok(Admission::Inserted { evicted }) => {
                drop(r);
                for victim in &evicted {
                    self.store.remove(victim.hash);
                }
                if !evicted.is_empty() {
                    self.observer.removed(BlockSite::Node(TierName::G3), &victims(&evicted));
                }
                true
            }
            Ok(Admission::AlreadyPresent) | Err(_) => false,
        }
    }

    /// Counts a use of each resident block of `hashes` (one lock for all).
    pub fn touch(&self, hashes: &[BlockHash], now: Millis) {
        touch_in(&mut self.registry.lock().expect("G3 lock"), hashes, now);
    }

    /// Reads `hash` into `dst`: the one way every reader of G3 (the workers, G4's block server, the
    /// engine endpoint) reads it. The outcome counts toward the tier's health; a failed read,
    /// whatever its cause, is counted by kind and forgets the block, so that no reader is offered
    /// it again (a corrupt image is never served; an unreadable one is recomputed).
    pub async fn read(&self, hash: BlockHash, dst: SlotMut) -> Result<SlotRef, ReadFailure> {
        let read = self.store.read(hash, dst).await;
        match &read {
            Ok(_) => self.health.record_ok(),
            Err(failure) => {
                self.health.record_error(&failure.error);
                record_tier_error(TierName::G3, failure.error.kind());
                self.forget(hash);
            }
        }
        read
    }

    /// Forgets `hash` (its write failed, or it failed verification).
    pub fn forget(&self, hash: BlockHash) {
        let _ = self.registry.lock().expect("G3 lock").remove(hash);
        if self.store.remove(hash) {
            self.observer.removed(BlockSite::Node(TierName::G3), &[hash]);
        }
    }
}

/// One block's place in G3's write backlog ([`G3Tier::begin_write`]); dropping it ends it.
#[derive(Debug)]
pub struct WriteTicket {
    writing: Arc<AtomicU64>,
    bytes: u64,
}

impl Drop for WriteTicket {
    fn drop(&mut self) {
        self.writing.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Everything below G1 that a node's workers share, and how blocks are named and laid out.
#[derive(Debug)]
pub struct NodeTiers {
    /// Tokens per block.
    pub block_tokens: usize,
    /// The salt of every block hash (model identity; tenants add theirs per request later).
    pub salt: Salt,
    /// Image layout of one block.
    pub layout: BlockLayout,
    /// Retention per region.
    pub retention: RetentionSection,
    /// G2, when enabled: the node's own, which no other process maps.
    pub g2: Option<G2Tier>,
    /// The external engines' G2 (`engine_endpoint`): shared memory every registered engine maps,
    /// holding only their blocks. Apart from the node's own, so that no engine can read or
    /// rewrite a block the node computed.
    pub engines_g2: Option<G2Tier>,
    /// G3, when enabled.
    pub g3: Option<G3Tier>,
    /// Write-through batch bounds.
    pub write_batch: WriteBatch,
    /// What loading costs against recomputing: the node's one cost model, as configured and
    /// measured at start-up (its unknown rates are filled in from `measured`).
    pub cost: CostModel,
    /// What real transfers measured.
    pub measured: Measurements,
    /// Where G1 changes are reported (G2 and G3 report through their own observer).
    pub observer: Arc<dyn KvObserver>,
    /// The node's names of the blocks engines store through the engine endpoint (with the
    /// engines' G2): the observer of the engines' G2 and of G3.
    pub engine_names: Option<Arc<crate::engine_names::EngineNames>>,
    /// Who leases which blocks until when.
    pub leases: Arc<LeaseBook>,
    /// G4, when `tiers.g4` is enabled: what this node serves to its peers and loads from theirs.
    pub g4: Option<G4Tier>,
}

/// G4 on a node: the feed of its G2 for its peers, and the links to theirs.
#[derive(Clone, Debug)]
pub struct G4Tier {
    /// What the block server serves, for peers' indexes (fed by the node's KV publisher).
    pub feed: Arc<dynamo_tiering::g4::feed::Feed>,
    /// The peers this node loads from.
    pub remote: Arc<crate::peer::RemoteTier>,
}

/// Write-through batch bounds: a batch leaves when it has this many blocks or its oldest block
/// waited this long (`tiers.g2.write_batch_*` for G1 → G2 gathers, `tiers.g3.write_batch_*` for
/// G2 → G3 writes). The end of every turn flushes both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteBatch {
    /// Most blocks per G1 → G2 gather.
    pub g2_blocks: usize,
    /// Longest wait of a block for its gather.
    pub g2_delay: Duration,
    /// Most blocks per G2 → G3 write batch.
    pub g3_blocks: usize,
    /// Longest wait of a block for its G3 write.
    pub g3_delay: Duration,
}

impl Default for WriteBatch {
    fn default() -> Self {
        Self { g2_blocks: 32, g2_delay: Duration::from_millis(2), g3_blocks: 64, g3_delay: Duration::from_millis(10) }
    }
}

impl WriteBatch {
    /// The bounds of `tiers`.
    pub fn from_config(tiers: &TiersSection) -> Self {
        Self {
            g2_blocks: tiers.g2.write_batch_blocks.max(1),
            g2_delay: tiers.g2.write_batch_delay.as_duration(),
            g3_blocks: tiers.g3.write_batch_blocks.max(1),
            g3_delay: tiers.g3.write_batch_delay.as_duration(),
        }
    }
}

impl NodeTiers {
    /// The image of `hash` in the node's G2 or the engines' (without counting an access).
    pub fn g2_peek(&self, hash: BlockHash) -> Option<SlotRef> {
        let own = self.g2.as_ref().and_then(|g2| g2.peek(hash));
        own.or_else(|| self.engines_g2.as_ref()?.peek(hash))
    }

    /// The cost model with what has been measured so far.
    pub fn cost_now(&self) -> CostModel {
        self.cost.measured(&self.measured)
    }

    /// Reads `hashes` from G3 into slots of `pool` (the node's G2, or the engines'), all in
    /// flight together: the one way every reader of G3 reads ([`Self::read_slots`]).
    pub async fn read_into(&self, pool: &G2Tier, hashes: &[BlockHash], now: Millis) -> Vec<Result<SlotRef, ReadMiss>> {
        self.read_slots(hashes.iter().map(|&hash| (hash, pool.alloc(now))).collect()).await
    }

    /// Reads each block of `reads` from G3 into the G2 slot beside it (`None`: there was no
    /// slot), all in flight together, and records the transfer. One result per read, in order;
    /// a failed read was counted toward G3's health and forgotten by [`G3Tier::read`].
    pub async fn read_slots(&self, reads: Vec<(BlockHash, Option<SlotMut>)>) -> Vec<Result<SlotRef, ReadMiss>> {
        let Some(g3) = self.g3.as_ref().filter(|g3| g3.usable()) else {
            return reads.iter().map(|_| Err(ReadMiss::Unavailable)).collect();
        };
        let started = std::time::Instant::now();
        let reads = reads.into_iter().map(|(hash, dst)| async move {
            match dst {
                Some(dst) => g3.read(hash, dst).await.map_err(|failure| ReadMiss::Failed(failure.error)),
                None => Err(ReadMiss::NoSlot),
            }
        });
        let results = futures::future::join_all(reads).await;
        let bytes = results.iter().filter(|r| r.is_ok()).count() * g3.store.slot_bytes();
        if bytes > 0 {
            let elapsed = started.elapsed();
            record_transfer(TierName::G3, TierName::G2, bytes as u64, elapsed);
            self.measured.g3_read.observe(bytes, elapsed);
        }
        results
    }
}

impl TierStore for NodeTiers {
    type Image = SlotRef;
    type WriteTicket = WriteTicket;

    /// Every worker writes through to G3.
    fn pipeline(&self) -> Pipeline<'_> {
        Pipeline { block_tokens: self.block_tokens, retention: &self.retention, write_through: WriteThrough::G2G3 }
    }

    fn contains(&self, tier: TierName, hash: BlockHash) -> bool {
        match tier {
            TierName::G2 => self.g2.as_ref().is_some_and(|g2| g2.contains(hash)),
            TierName::G3 => self.g3.as_ref().is_some_and(|g3| g3.usable() && g3.store.contains(hash)),
            TierName::G1 | TierName::G4 => false,
        }
    }

    fn reused(&self, hashes: &[BlockHash], now: Millis) {
        if hashes.is_empty() {
            return;
        }
        if let Some(g2) = &self.g2 {
            g2.touch(hashes, now);
        }
        if let Some(g3) = &self.g3 {
            g3.touch(hashes, now);
        }
    }

    fn promote(&self, hash: BlockHash, priority: u8) {
        if let Some(g2) = &self.g2 {
            g2.promote(hash, priority);
        }
    }

    fn hold(&self, hash: BlockHash, until: Millis) {
        if let Some(g2) = &self.g2 {
            g2.hold(hash, until);
        }
    }

    fn begin_g3_write(&self, leased: bool) -> Option<WriteTicket> {
        self.g3.as_ref().filter(|g3| g3.usable())?.begin_write(&self.measured, leased)
    }

    async fn read_into_g2(&self, hashes: &[BlockHash], now: Millis) -> Vec<Result<SlotRef, ReadMiss>> {
        match &self.g2 {
            Some(g2) => self.read_into(g2, hashes, now).await,
            None => hashes.iter().map(|_| Err(ReadMiss::NoSlot)).collect(),
        }
    }
}

impl LeasedTiers for NodeTiers {
    fn book(&self) -> &LeaseBook {
        &self.leases
    }

    fn now(&self) -> Millis {
        crate::worker::unix_millis()
    }

    fn each_registry(&self, tier: TierName, f: &mut dyn FnMut(&mut TierRegistry)) {
        let registry = match tier {
            TierName::G2 => self.g2.as_ref().map(|g2| &g2.registry),
            TierName::G3 => self.g3.as_ref().map(|g3| &g3.registry),
            _ => None,
        };
        if let Some(registry) = registry {
            f(&mut registry.lock().expect("tier registry lock"));
        }
    }

    /// The copies vLLM engines stored of `hash` (by the node's name), in the engines' G2 or in G3.
    fn each_copy(&self, tier: TierName, hash: BlockHash, f: &mut dyn FnMut(&mut TierRegistry, BlockHash)) {
        let Some(names) = &self.engine_names else { return };
        let copies = names.stored_as(hash);
        if copies.is_empty() {
            return;
        }
        let registry = match tier {
            TierName::G2 => self.engines_g2.as_ref().map(|g2| &g2.registry),
            TierName::G3 => self.g3.as_ref().map(|g3| &g3.registry),
            _ => None,
        };
        if let Some(registry) = registry {
            let mut registry = registry.lock().expect("tier registry lock");
            for copy in copies {
                f(&mut registry, copy);
            }
        }
    }

    fn has_tier(&self, tier: TierName) -> bool {
        match tier {
            TierName::G2 => self.g2.is_some(),
            TierName::G3 => self.g3.is_some(),
            _ => false,
        }
    }

    fn lowest_tier(&self, region: RegionKind) -> TierName {
        self.retention.policy(region).lowest_tier
    }
}

#[cfg(test)]
mod guard_tests {
    use dynamo_config::RegionKind;
    use dynamo_tiering::block::image::{HEADER_LEN, ImageSpec, RetentionMeta, seal, verify_image};
    use dynamo_tiering::block::{BlockHash, BlockLayout, Salt};
    use dynamo_tiering::g2::{HostPool, HostPoolOptions, MlockPolicy};
    use dynamo_tiering::registry::{BlockMeta, PolicyKind, TierRegistry};

    use super::*;

    /// A 4 KiB opaque image of `hash`.
    fn spec(hash: BlockHash) -> ImageSpec {
        ImageSpec {
            hash,
            parent: None,
            salt: Salt(0),
            layout: BlockLayout::opaque(4096),
            token_count: 1,
            retention: RetentionMeta::default(),
        }
    }

    fn admitted(g2: &G2Tier, hash: BlockHash) -> SlotRef {
        let mut slot = g2.pool.try_alloc().expect("a slot");
        let buf = &mut slot.as_mut_slice()[..HEADER_LEN + 4096];
        buf[HEADER_LEN..].fill(9);
        seal(buf, &spec(hash));
        let image = slot.freeze();
        let meta = BlockMeta { parent: None, region: RegionKind::Conversation, priority: 50, retain_until: 0 };
        assert!(g2.admit(hash, meta, image.clone(), 1));
        image
    }

    /// In a pool engines map, an image rewritten after it was admitted — its checksums
    /// recomputed, so it still verifies as an image — is caught on the next read and dropped;
    /// in a private pool nothing is tagged and nothing is paid.
    #[test]
    fn a_shared_pool_catches_an_image_rewritten_after_admission() {
        let options = HostPoolOptions { slot_bytes: HEADER_LEN + 4096, slots: 8, mlock: MlockPolicy::Off };
        let registry = || Arc::new(Mutex::new(TierRegistry::new(8, PolicyKind::Lru)));
        let g2 = G2Tier::new(HostPool::shared(options).expect("shared pool"), registry());
        let (hash, other) = (BlockHash(7), BlockHash(8));
        let image = admitted(&g2, hash);
        admitted(&g2, other);
        assert!(g2.get(hash, 2).is_some() && g2.peek(hash).is_some(), "untouched images read");

        // What an engine with the region mapped can do: new bytes, and the checksums to match.
        let (base, _) = g2.pool.region();
        let at = image.index() as usize * g2.pool.slot_bytes();
        let start = base.wrapping_add(at);
        // SAFETY: `start..start + HEADER_LEN + 4096` is the slot, inside the pool's mapping; nothing
        // reads or writes it concurrently here.
        let bytes = unsafe { std::slice::from_raw_parts_mut(start, HEADER_LEN + 4096) };
        bytes[HEADER_LEN + 100] ^= 0xff;
        seal(bytes, &spec(hash));
        assert!(verify_image(bytes, hash).is_ok(), "the forgery passes the image's own checks");
        drop(image);
        assert!(g2.peek(hash).is_none(), "caught on read");
        assert!(!g2.contains(hash), "and dropped from G2");
        assert!(g2.get(other, 3).is_some(), "the others are untouched");

        let private = G2Tier::new(HostPool::new(options).expect("pool"), registry());
        assert!(private.guard.is_none(), "a private pool is not tagged");
        admitted(&private, hash);
        assert!(private.get(hash, 2).is_some());
    }
}
