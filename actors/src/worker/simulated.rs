//! The simulated engine (DESIGN.md §7): does no math; its time comes from a calibration, and
//! everything around it is the product's own — the engine core the reference worker runs on
//! (admission, waiting for room, resumption, a step's fates, turn end) and its batch policy
//! ([`super::batch`]: decode tokens and prefill chunks per step within `engine.max_batch_tokens`
//! and `engine.max_running_requests`, preemption when G1 has no page, resumption by loading), the
//! tier pipeline ([`Pipeline`]: which cached blocks to reuse, load or recompute, and how far each
//! completed block is written through), G1/G2/G3 [`TierRegistry`]s with their eviction policies,
//! retention regions and holds, KV events to the index, the scheduler's cost model. It moves no
//! bytes, so a node of many workers with terabytes of tiers replays hours of traffic on a
//! laptop, under tokio's paused clock (see [`EngineHost::Local`]).
//!
//! Time, per worker:
//! - a step takes the calibrated prefill time of its prefill chunks (the marginal cost of each
//!   chunk given the KV before it: `prefill(start + len) − prefill(start)`), and at least one
//!   decode step (`decode_s_per_token`: a pass over the weights) when it carries decode tokens,
//!   which ride along a prefill for free;
//! - cached blocks loaded from G2, or from G3 after the disk read them, cross the worker's host
//!   link ([`SimulatedCopy`]'s lane) while the batch goes on; the step that first computes the
//!   request waits for them. A peer's G2 (G4) comes over the worker's NIC. Disk reads and writes
//!   queue on the node's disk ([`SimulatedIo`]'s lanes, one per direction); the reads of an
//!   admission are awaited, as the reference worker awaits them.
//! - completed blocks go to G1, then (write-through, per region) to G2 and, after the disk
//!   wrote them, to G3; each tier's acknowledgment is a KV event.
//!
//! Generated tokens are a deterministic function of the request's seed, so a replay driver can
//! build the next turn's prompt from them, exactly as an agent resends its history.
//!
//! [`EngineHost::Local`]: super::EngineHost::Local

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dynamo_config::{Calibration, PerTier, PrefillCalibration, RegionKind, RetentionSection, TierName};
use dynamo_tiering::block::{BlockHash, Salt};
use dynamo_tiering::cost::{BytesPerSec, CostModel, Prefill, write_admitted};
use dynamo_tiering::io::sim::{Direction, SimDisk, SimulatedIo};
use dynamo_tiering::pipeline::{Landed, Pipeline, TierLookup};
use dynamo_tiering::registry::{Admission, BlockMeta, Millis, PolicyKind, TierRegistry};
use dynamo_tiering::transfer::{Link, LinkBandwidths, SimulatedCopy};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::batch;
use super::engine_core::{Driver, EngineCore, Sequence, end_block};
use super::run::{After, Run};
use super::{Engine, Finish, GenOutcome, GenRequest, LocalFuture, Ticket, WorkerError, WorkerEvent};
use crate::leases::{LeaseBook, LeasedTiers};
use crate::tier_store::{ReadMiss, TierStore};
use crate::tiers::{BlockSite, KvObserver};

/// How far write-through takes completed blocks (a replay compares these).
pub use dynamo_tiering::pipeline::WriteThrough;

/// The calibrated rates of a simulated worker and its node.
#[derive(Clone, Debug)]
pub struct SimTiming {
    /// Prefill time by prompt length.
    pub prefill: PrefillCalibration,
    /// Seconds per generated token.
    pub decode_s_per_token: f64,
    /// Host ↔ device bytes per second (one link per worker).
    pub link_bytes_per_s: f64,
    /// Disk read bytes per second (one disk per node).
    pub disk_read_bytes_per_s: f64,
    /// Disk write bytes per second.
    pub disk_write_bytes_per_s: f64,
    /// Bytes per second from another node's G2 (the NIC of one worker's GPU; G4).
    pub network_bytes_per_s: f64,
    /// KV bytes of one block.
    pub block_bytes: u64,
}

/// Bytes per second of one 400 Gb/s RDMA NIC per GPU, as on an 8 × H200 node (G4).
pub const NIC_BYTES_PER_S: f64 = 50e9;

impl SimTiming {
    /// The rates `calibration` measured (its host link and disk, and `prefill` of the model),
    /// with `decode_s_per_token`, blocks of `block_bytes` and one [`NIC_BYTES_PER_S`] NIC per GPU.
    pub fn from_calibration(
        calibration: &Calibration,
        prefill: PrefillCalibration,
        decode_s_per_token: f64,
        block_bytes: u64,
    ) -> Self {
        Self {
            prefill,
            decode_s_per_token,
            link_bytes_per_s: calibration.link.h2d_pinned_gb_s * 1e9,
            disk_read_bytes_per_s: calibration.disk.seq_read_gb_s * 1e9,
            disk_write_bytes_per_s: calibration.disk.seq_write_gb_s * 1e9,
            network_bytes_per_s: NIC_BYTES_PER_S,
            block_bytes,
        }
    }

    fn prefill_s(&self, tokens: usize) -> f64 {
        self.prefill.prefill_ms(tokens as u64) / 1e3
    }

    /// The node's cost model on these rates: G2 crosses the host link; G3 is read from disk and
    /// then crosses it; a peer's G2 comes over the NIC straight into the GPU (GPUDirect RDMA),
    /// paced by the slower of the NIC and the link; recompute follows the calibrated curve.
    pub fn cost_model(&self, block_tokens: usize) -> CostModel {
        let link = BytesPerSec::new(self.link_bytes_per_s);
        let disk = BytesPerSec::new(self.disk_read_bytes_per_s);
        let net = BytesPerSec::new(self.network_bytes_per_s);
        CostModel {
            block_tokens,
            image_bytes: self.block_bytes as usize,
            prefill: Some(Prefill::Curve(Arc::new(self.prefill.clone()))),
            decode_s_per_token: Some(self.decode_s_per_token),
            decode_weight: 0.0,
            g2_read: link,
            g3_read: disk.zip(link).map(|(d, l)| d.then(l)),
            g4_read: match (link, net) {
                (Some(l), Some(n)) => Some(if l < n { l } else { n }),
                _ => None,
            },
        }
    }
}

/// What a simulated node moved and dropped, for the replay's report.
#[derive(Debug, Default)]
pub struct SimStats {
    /// Bytes loaded G2 → G1 over the host links.
    pub g2_to_g1_bytes: AtomicU64,
    /// Bytes read G3 → G1 (disk, then link).
    pub g3_to_g1_bytes: AtomicU64,
    /// Bytes loaded from other nodes' G2 (G4 → G1).
    pub g4_to_g1_bytes: AtomicU64,
    /// Bytes written through G1 → G2.
    pub g1_to_g2_bytes: AtomicU64,
    /// Bytes written through G2 → G3.
    pub g2_to_g3_bytes: AtomicU64,
    /// Blocks resident in the G1 of all workers.
    pub g1_resident: AtomicI64,
    /// G1 evictions by region, all workers.
    pub g1_evictions: Mutex<BTreeMap<RegionKind, u64>>,
    /// Write-through lag to G3 (completion in G1 to the disk's acknowledgment), summed in µs.
    pub g3_lag_us_sum: AtomicU64,
    /// Blocks acknowledged by G3.
    pub g3_acks: AtomicU64,
    /// Longest write-through lag to G3 in µs.
    pub g3_lag_us_max: AtomicU64,
    /// Blocks not written to G3 because the disk was too far behind (they stay in G2).
    pub g3_skipped: AtomicU64,
    /// Time requests waited (queued, or in the batch behind others) before their prefill's first
    /// step, summed in µs.
    pub queue_us_sum: AtomicU64,
    /// Prefills started.
    pub prefills: AtomicU64,
    /// Requests preempted out of G1 (they resumed by loading their blocks back).
    pub preemptions: AtomicU64,
}

/// The node-shared part of a simulated node: G2 and G3 as registries, the disk, where KV events
/// go.
#[derive(Debug)]
pub struct SimNode {
    /// Tokens per block.
    pub block_tokens: usize,
    /// The salt of every block hash.
    pub salt: Salt,
    /// Retention per region.
    pub retention: RetentionSection,
    /// Rates.
    pub timing: SimTiming,
    /// The cost model on those rates: what decides whether a cached block is loaded.
    pub cost: CostModel,
    /// How far blocks are written.
    pub write_through: WriteThrough,
    g2: Option<Mutex<TierRegistry>>,
    g3: Option<Mutex<TierRegistry>>,
    /// The node's disk (G3), shared by its workers.
    disk: SimulatedIo,
    observer: Arc<dyn KvObserver>,
    /// The other nodes of the cluster, whose G2 this node's workers can load from (G4).
    peers: std::sync::OnceLock<Vec<std::sync::Weak<SimNode>>>,
    /// The cluster's leases (one book for all its nodes, as one scheduler grants them).
    leases: Arc<LeaseBook>,
    /// Time zero of the simulation: the clock of holds and leases.
    epoch: Instant,
    /// Counters for the report.
    pub stats: SimStats,
}

impl SimNode {
    /// A node with G2 and G3 of these capacities in blocks (0: absent), evicting by `policy`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        block_tokens: usize,
        salt: Salt,
        retention: RetentionSection,
        timing: SimTiming,
        write_through: WriteThrough,
        g2_blocks: usize,
        g3_blocks: usize,
        policy: PolicyKind,
        observer: Arc<dyn KvObserver>,
    ) -> Self {
        let tier = |blocks: usize| (blocks > 0).then(|| Mutex::new(TierRegistry::new(blocks, policy)));
        let disk = SimDisk {
            read_gb_s: timing.disk_read_bytes_per_s / 1e9,
            write_gb_s: timing.disk_write_bytes_per_s / 1e9,
            latency: Duration::ZERO,
        };
        Self {
            block_tokens,
            salt,
            retention,
            cost: timing.cost_model(block_tokens),
            timing,
            write_through,
            g2: tier(g2_blocks),
            g3: tier(g3_blocks),
            disk: SimulatedIo::new(disk),
            observer,
            peers: std::sync::OnceLock::new(),
            leases: Arc::new(LeaseBook::default()),
            epoch: Instant::now(),
            stats: SimStats::default(),
        }
    }

    /// Leases are kept in `book` (shared by every node of the cluster) on the clock that starts
    /// at `epoch`, and may pin at most `budget` (a fraction) of G2 and of G3, as
    /// `tiers.lease_budget` bounds the node's tiers.
    pub fn with_leases(mut self, book: Arc<LeaseBook>, epoch: Instant, budget: f64) -> Self {
        let budgeted = |tier: Option<Mutex<TierRegistry>>| {
            tier.map(|r| {
                let r = r.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
                let blocks = (r.capacity() as f64 * budget.clamp(0.0, 1.0)) as usize;
                Mutex::new(r.with_lease_budget(blocks))
            })
        };
        self.g2 = budgeted(self.g2.take());
        self.g3 = budgeted(self.g3.take());
        self.leases = book;
        self.epoch = epoch;
        self
    }

    /// Makes every node of `nodes` a G4 peer of every other.
    pub fn connect(nodes: &[Arc<SimNode>]) {
        for (i, node) in nodes.iter().enumerate() {
            let others = nodes.iter().enumerate().filter(|(j, _)| *j != i).map(|(_, n)| Arc::downgrade(n)).collect();
            let _ = node.peers.set(others);
        }
    }

    fn peer_holds(&self, hash: BlockHash, now: Millis) -> bool {
        self.peers.get().is_some_and(|peers| {
            peers.iter().filter_map(std::sync::Weak::upgrade).any(|peer| SimNode::holds(&peer.g2, hash, now))
        })
    }

    /// Evictions by region of G2 and G3 so far.
    pub fn evictions(&self) -> [BTreeMap<RegionKind, u64>; 2] {
        let of = |t: &Option<Mutex<TierRegistry>>| {
            t.as_ref().map_or_else(BTreeMap::new, |r| {
                let stats = r.lock().expect("registry").stats();
                stats.regions.iter().map(|(region, s)| (*region, s.evictions_total)).collect()
            })
        };
        [of(&self.g2), of(&self.g3)]
    }

    /// Blocks resident in G2 and G3.
    pub fn resident(&self) -> (usize, usize) {
        let len = |t: &Option<Mutex<TierRegistry>>| t.as_ref().map_or(0, |r| r.lock().expect("registry").len());
        (len(&self.g2), len(&self.g3))
    }

    fn has(tier: &Option<Mutex<TierRegistry>>, hash: BlockHash) -> bool {
        tier.as_ref().is_some_and(|r| r.lock().expect("registry").contains(hash))
    }

    fn holds(tier: &Option<Mutex<TierRegistry>>, hash: BlockHash, now: Millis) -> bool {
        tier.as_ref().is_some_and(|r| {
            let mut r = r.lock().expect("registry");
            r.contains(hash) && r.touch(hash, now).is_ok()
        })
    }

    /// Admits a block to a node tier, reporting what it stored and evicted.
    fn admit(&self, tier: TierName, hash: BlockHash, meta: BlockMeta, now: Millis) {
        let registry = match tier {
            TierName::G2 => &self.g2,
            TierName::G3 => &self.g3,
            _ => return,
        };
        let Some(registry) = registry else { return };
        let result = registry.lock().expect("registry").insert(hash, meta, now);
        if let Ok(Admission::Inserted { evicted }) = result {
            if !evicted.is_empty() {
                let gone: Vec<BlockHash> = evicted.iter().map(|e| e.hash).collect();
                self.observer.removed(BlockSite::Node(tier), &gone);
            }
            self.observer.stored(BlockSite::Node(tier), meta.parent, &[hash]);
        }
    }
}

impl TierStore for SimNode {
    type Image = ();
    /// When the disk will have written the block.
    type WriteTicket = Instant;

    fn pipeline(&self) -> Pipeline<'_> {
        Pipeline { block_tokens: self.block_tokens, retention: &self.retention, write_through: self.write_through }
    }

    fn contains(&self, tier: TierName, hash: BlockHash) -> bool {
        match tier {
            TierName::G2 => SimNode::has(&self.g2, hash),
            TierName::G3 => SimNode::has(&self.g3, hash),
            TierName::G1 | TierName::G4 => false,
        }
    }

    fn reused(&self, hashes: &[BlockHash], now: Millis) {
        for tier in [&self.g2, &self.g3].into_iter().flatten() {
            let mut registry = tier.lock().expect("registry");
            for &hash in hashes {
                let _ = registry.touch(hash, now);
            }
        }
    }

    fn promote(&self, hash: BlockHash, priority: u8) {
        if let Some(g2) = &self.g2 {
            let _ = g2.lock().expect("registry").set_priority(hash, priority);
        }
    }

    fn hold(&self, hash: BlockHash, until: Millis) {
        if let Some(g2) = &self.g2 {
            let _ = g2.lock().expect("registry").hold(hash, until);
        }
    }

    /// The disk's write backlog is its queue of reserved time.
    fn begin_g3_write(&self, leased: bool) -> Option<Instant> {
        self.g3.as_ref()?;
        let bytes = self.timing.block_bytes;
        let rate = BytesPerSec::new(self.timing.disk_write_bytes_per_s);
        let pending = self.disk.backlog(Direction::Write).as_secs_f64() * self.timing.disk_write_bytes_per_s;
        if !leased && !write_admitted(pending as u64, bytes, rate) {
            self.stats.g3_skipped.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(self.disk.reserve(Direction::Write, bytes as usize))
    }

    /// The disk reads them in one go; no read fails.
    async fn read_into_g2(&self, hashes: &[BlockHash], _now: Millis) -> Vec<Result<(), ReadMiss>> {
        let bytes = hashes.len() as u64 * self.timing.block_bytes;
        if bytes > 0 {
            self.stats.g3_to_g1_bytes.fetch_add(bytes, Ordering::Relaxed);
            tokio::time::sleep_until(self.disk.reserve(Direction::Read, bytes as usize)).await;
        }
        hashes.iter().map(|_| Ok(())).collect()
    }
}

impl LeasedTiers for SimNode {
    fn book(&self) -> &LeaseBook {
        &self.leases
    }

    fn now(&self) -> Millis {
        now_ms(self.epoch)
    }

    fn each_registry(&self, tier: TierName, f: &mut dyn FnMut(&mut TierRegistry)) {
        fn of(node: &SimNode, tier: TierName) -> Option<&Mutex<TierRegistry>> {
            match tier {
                TierName::G2 => node.g2.as_ref(),
                TierName::G3 => node.g3.as_ref(),
                _ => None,
            }
        }
        if let Some(r) = of(self, tier) {
            f(&mut r.lock().expect("registry"));
        }
        for peer in self.peers.get().into_iter().flatten().filter_map(std::sync::Weak::upgrade) {
            if let Some(r) = of(&peer, tier) {
                f(&mut r.lock().expect("registry"));
            }
        }
    }

    fn has_tier(&self, tier: TierName) -> bool {
        match tier {
            TierName::G2 => self.g2.is_some() && self.write_through != WriteThrough::Off,
            TierName::G3 => self.g3.is_some() && self.write_through == WriteThrough::G2G3,
            _ => false,
        }
    }

    fn lowest_tier(&self, region: RegionKind) -> TierName {
        self.retention.policy(region).lowest_tier
    }
}

/// Milliseconds of tokio's clock (virtual under a paused clock), the clock of simulated holds.
fn now_ms(epoch: Instant) -> Millis {
    epoch.elapsed().as_millis() as Millis
}

/// One simulated worker: its G1 (a registry of the blocks in its pages), its host link and NIC,
/// its share of the node, and the requests in its batch.
#[derive(Debug)]
pub struct SimulatedEngine {
    id: usize,
    node: Arc<SimNode>,
    g1: TierRegistry,
    g1_blocks: usize,
    /// Pages held by requests with no registered block in them (being computed, or a duplicate
    /// G1 refused).
    private: usize,
    policy: PolicyKind,
    epoch: Instant,
    /// The host link G2 and G3 loads cross into the GPU.
    link: SimulatedCopy,
    /// When the NIC is done with the G4 loads queued on it.
    nic_free_at: Instant,
    /// Its batch: the requests running and waiting, and what each step does.
    core: EngineCore<SimSeq>,
    writes: JoinSet<()>,
}

/// A request in a simulated worker's batch.
#[derive(Debug)]
struct SimSeq {
    run: Run,
    /// One per G1 page it holds: the block registered in it, if any.
    blocks: Vec<Option<BlockHash>>,
    /// The generator of its tokens.
    rng: u64,
    /// Whether a step has computed for it (its wait ended).
    started: bool,
    /// When its loaded blocks are across the link: the step that computes it waits for them.
    loaded_at: Instant,
}

impl Sequence for SimSeq {
    fn run(&self) -> &Run {
        &self.run
    }
}

impl SimulatedEngine {
    /// Worker `id` of `node`, with a G1 of `g1_blocks` evicted by `policy`; `epoch` is the
    /// simulation's time zero (shared by the node's workers). Steps take everything pending and
    /// up to [`super::DEFAULT_MAX_RUNNING`] requests run at once unless [`Self::with_batch`] says
    /// otherwise.
    pub fn new(id: usize, node: Arc<SimNode>, g1_blocks: usize, policy: PolicyKind, epoch: Instant) -> Self {
        let link_gb_s = node.timing.link_bytes_per_s / 1e9;
        let node_block_tokens = node.block_tokens;
        let link = SimulatedCopy::new(LinkBandwidths {
            h2d_gb_s: link_gb_s,
            d2h_gb_s: link_gb_s,
            d2d_gb_s: link_gb_s,
            h2h_gb_s: link_gb_s,
        });
        Self {
            id,
            node,
            g1: TierRegistry::new(g1_blocks, policy),
            g1_blocks,
            private: 0,
            policy,
            epoch,
            link,
            nic_free_at: Instant::now(),
            core: EngineCore::new(node_block_tokens),
            writes: JoinSet::new(),
        }
    }

    /// Computes at most `max_batch_tokens` tokens per step and runs at most `max_running`
    /// requests at once, as `engine.max_batch_tokens` and `engine.max_running_requests` bound
    /// the reference worker.
    pub fn with_batch(mut self, max_batch_tokens: usize, max_running: usize) -> Self {
        self.core.set_budget(max_batch_tokens);
        self.core.set_max_running(max_running);
        self
    }

    /// Serves one request: admits it and runs steps until it ends; requests admitted before it
    /// share its steps.
    pub async fn generate(
        &mut self,
        req: &GenRequest,
        on_event: &mut (dyn FnMut(WorkerEvent) -> bool + Send),
    ) -> Result<GenOutcome, WorkerError> {
        super::serve_alone(self, req, on_event).await
    }

    fn site(&self) -> BlockSite {
        BlockSite::G1 { worker: self.id }
    }

    /// A free G1 page, or one whose unreferenced block is evicted for it.
    fn alloc_page(&mut self, now: Millis) -> Result<(), WorkerError> {
        if self.g1.len() + self.private < self.g1_blocks {
            self.private += 1;
            return Ok(());
        }
        let victim = self.g1.evict(1, now).pop().ok_or(WorkerError::Overloaded)?;
        let stats = &self.node.stats;
        stats.g1_resident.fetch_sub(1, Ordering::Relaxed);
        *stats.g1_evictions.lock().expect("stats").entry(victim.region).or_default() += 1;
        self.node.observer.removed(self.site(), &[victim.hash]);
        self.private += 1;
        Ok(())
    }

    /// Registers block `i` of `seq`, whose page it holds, in G1 (referenced by it). A block
    /// present already stays in its private page, as on the reference worker.
    fn register(&mut self, seq: &mut SimSeq, i: usize, now: Millis) {
        let hash = seq.run.chain[i];
        let parent = i.checked_sub(1).map(|p| seq.run.chain[p]);
        let meta = self.node.meta(parent, seq.run.region(i, self.node.block_tokens));
        if let Ok(Admission::Inserted { evicted }) = self.g1.insert(hash, meta, now) {
            self.private -= 1;
            let stats = &self.node.stats;
            stats.g1_resident.fetch_add(1 - evicted.len() as i64, Ordering::Relaxed);
            if !evicted.is_empty() {
                let mut by_region = stats.g1_evictions.lock().expect("stats");
                for e in &evicted {
                    *by_region.entry(e.region).or_default() += 1;
                }
                drop(by_region);
                let gone: Vec<BlockHash> = evicted.iter().map(|e| e.hash).collect();
                self.node.observer.removed(self.site(), &gone);
            }
            self.node.observer.stored(self.site(), parent, &[hash]);
            self.g1.acquire(hash, now).expect("just inserted");
            seq.blocks[i] = Some(hash);
        }
    }

    /// Writes block `i` of `seq` through as the pipeline says for how it `landed` in G1: to G2 at
    /// once, to G3 once the disk wrote it.
    fn write_through(&mut self, seq: &SimSeq, i: usize, landed: Landed, now: Millis) {
        let node = self.node.clone();
        let hash = seq.run.chain[i];
        let region = seq.run.region(i, node.block_tokens);
        let meta = node.meta(i.checked_sub(1).map(|p| seq.run.chain[p]), region);
        let bytes = node.timing.block_bytes;
        let targets = node.write_targets(hash, region, landed);
        if targets.g2 && node.g2.is_some() {
            // A block read from below lands in G2 on its way up; a computed one, or one G1 kept
            // after G2 dropped it, crosses G1 → G2.
            if matches!(landed, Landed::Computed | Landed::Reused) {
                node.stats.g1_to_g2_bytes.fetch_add(bytes, Ordering::Relaxed);
            }
            node.admit(TierName::G2, hash, meta, now);
            node.arrived(TierName::G2, hash, region, now);
        }
        if targets.g3 && node.g3.is_some() {
            let completed = Instant::now();
            let Some(done) = node.g3_write(hash, now) else { return };
            let epoch = self.epoch;
            self.writes.spawn(async move {
                tokio::time::sleep_until(done).await;
                let now = now_ms(epoch);
                node.admit(TierName::G3, hash, meta, now);
                node.arrived(TierName::G3, hash, region, now);
                let lag = (done - completed).as_micros() as u64;
                node.stats.g2_to_g3_bytes.fetch_add(bytes, Ordering::Relaxed);
                node.stats.g3_lag_us_sum.fetch_add(lag, Ordering::Relaxed);
                node.stats.g3_lag_us_max.fetch_max(lag, Ordering::Relaxed);
                node.stats.g3_acks.fetch_add(1, Ordering::Relaxed);
            });
        }
        while self.writes.try_join_next().is_some() {}
    }

    /// Releases `seq`'s G1 references and frees its private pages.
    fn release(&mut self, seq: &mut SimSeq) {
        for block in std::mem::take(&mut seq.blocks) {
            match block {
                Some(hash) => drop(self.g1.release(hash)),
                None => self.private -= 1,
            }
        }
    }

    /// Brings the cached prefix of `seq` into G1 as the pipeline plans it: G1 blocks in place;
    /// G3 blocks read by the disk (awaited), then with the G2 ones across the host link (the
    /// first step that computes the request waits for that); a peer's over the NIC. `first`: the
    /// request's admission (its hits are what it reports), not a resume after preemption.
    async fn onboard(&mut self, seq: &mut SimSeq, first: bool) -> Result<(), WorkerError> {
        let node = self.node.clone();
        let (b, bytes) = (node.block_tokens, node.timing.block_bytes);
        let now = now_ms(self.epoch);
        let from = {
            let mut lookup = SimLookup { engine: self, now };
            node.pipeline().plan_prefix(&seq.run.chain, seq.run.tokens.len(), &node.cost, &mut lookup)
        };
        let mut hits = PerTier::<usize>::default();
        // A reuse in G1 is a use of the block's images below: without it G2's recency would see
        // only the blocks that hop workers, and drop a sticky conversation's just before G1 does.
        let reused: Vec<BlockHash> =
            from.iter().zip(&seq.run.chain).filter(|(s, _)| **s == TierName::G1).map(|(_, h)| *h).collect();
        node.reused(&reused, now);
        for (i, &source) in from.iter().enumerate() {
            hits[source] += b;
            if source == TierName::G1 {
                seq.blocks.push(Some(seq.run.chain[i]));
                self.write_through(seq, i, Landed::Reused, now);
                continue;
            }
            if let Err(e) = self.alloc_page(now) {
                self.release(seq);
                // The rest of the plan's G1 blocks were acquired by the lookup.
                for (j, _) in from.iter().enumerate().skip(i).filter(|(_, s)| **s == TierName::G1) {
                    let _ = self.g1.release(seq.run.chain[j]);
                }
                return Err(e);
            }
            seq.blocks.push(None);
            self.register(seq, i, now);
            self.write_through(seq, i, Landed::Loaded(source), now);
        }
        let count = |of: TierName| from.iter().filter(|&&s| s == of).count() as u64;
        let (g2_blocks, g3_blocks, g4_blocks) = (count(TierName::G2), count(TierName::G3), count(TierName::G4));
        let stats = &node.stats;
        let from_g3: Vec<BlockHash> =
            from.iter().zip(&seq.run.chain).filter(|(s, _)| **s == TierName::G3).map(|(_, h)| *h).collect();
        node.read_into_g2(&from_g3, now).await;
        stats.g2_to_g1_bytes.fetch_add(g2_blocks * bytes, Ordering::Relaxed);
        stats.g4_to_g1_bytes.fetch_add(g4_blocks * bytes, Ordering::Relaxed);
        let link_bytes = (g2_blocks + g3_blocks) * bytes;
        let mut loaded_at =
            if link_bytes > 0 { self.link.reserve(Link::HostToDevice, link_bytes) } else { Instant::now() };
        if g4_blocks > 0 {
            let nic_s = node.cost.g4_read.map_or(0.0, |r| r.seconds((g4_blocks * bytes) as usize));
            self.nic_free_at = self.nic_free_at.max(Instant::now()) + Duration::from_secs_f64(nic_s);
            loaded_at = loaded_at.max(self.nic_free_at);
        }
        seq.loaded_at = loaded_at;
        seq.run.computed = seq.blocks.len() * b;
        if first {
            seq.run.count_hits(hits);
        }
        Ok(())
    }

    async fn admit_ticket(&mut self, ticket: Ticket) {
        let node = self.node.clone();
        let start = ticket.queued_at;
        let Some(run) = self.core.admit(ticket, &node.pipeline(), self.g1_blocks, node.salt, start) else { return };
        let blocks = Vec::with_capacity((run.tokens.len() + run.req().max_tokens).div_ceil(node.block_tokens));
        let rng = run.req().seed.unwrap_or(0) ^ 0x9e37_79b9_7f4a_7c15;
        let mut seq = SimSeq { run, blocks, rng, started: false, loaded_at: Instant::now() };
        // Without room in G1 beside the batch for its prompt, it waits for some.
        let shared = batch::shared_prefix(&self.g1, &seq.run.chain);
        if !self.core.may_enter(&seq.run, shared, self.available_pages()) {
            return self.wait_for_room(seq);
        }
        let loaded = self.onboard(&mut seq, true).await;
        self.entered(seq, loaded);
    }

    /// One step, as [`batch::plan_step`] plans it: preempted requests resume first when G1 has
    /// room; the step takes its calibrated time (and waits for the loads of the requests it
    /// computes first); then each request advances by what the step computed for it.
    async fn run_step(&mut self) {
        self.resume_preempted().await;
        let mut step = self.core.begin_step();
        step.plan(self);
        let chunks = std::mem::take(&mut step.chunks);

        // Its time: the prefill chunks' marginal cost, at least one pass over the weights for the
        // decodes, and no earlier than the loads of its requests are across.
        let now = Instant::now();
        let timing = &self.node.timing;
        let (mut prefill_s, mut decodes, mut ready) = (0.0, false, now);
        for &(i, take) in &chunks {
            let seq = &mut step.running[i];
            // A resumed request recomputing what it did not load pays prefill for it.
            if seq.run.prefilled && take == 1 {
                decodes = true;
            } else {
                prefill_s += (timing.prefill_s(seq.run.computed + take) - timing.prefill_s(seq.run.computed)).max(0.0);
            }
            ready = ready.max(seq.loaded_at);
            if !seq.started {
                seq.started = true;
                let waited = now.saturating_duration_since(seq.run.start).as_micros() as u64;
                self.node.stats.queue_us_sum.fetch_add(waited, Ordering::Relaxed);
                self.node.stats.prefills.fetch_add(1, Ordering::Relaxed);
            }
        }
        let step_s = if decodes { prefill_s.max(timing.decode_s_per_token) } else { prefill_s };
        tokio::time::sleep_until(ready.max(now + Duration::from_secs_f64(step_s))).await;

        for (i, take) in chunks {
            if let Some(end) = self.advance(&mut step.running[i], take) {
                step.ended(i, end);
            }
        }
        for (seq, end) in self.core.end_step(step) {
            self.end(seq, end);
        }
    }

    /// What one step's `take` tokens mean for `seq`: the blocks they complete are registered and
    /// written through, and once the prompt is in, a token is generated. `Some` when it ends.
    fn advance(&mut self, seq: &mut SimSeq, take: usize) -> Option<Result<Finish, WorkerError>> {
        let b = self.node.block_tokens;
        let now = now_ms(self.epoch);
        for i in seq.run.advance_by(take, b) {
            self.register(seq, i, now);
            self.write_through(seq, i, Landed::Computed, now);
        }
        let n = match seq.run.after_step() {
            After::Prefilling => return None,
            After::End(end) => return Some(end),
            After::Token(n) => n,
        };
        let rng = &mut seq.rng;
        seq.run.emit(n, |_, _| {
            *rng = splitmix(*rng);
            1000 + (*rng % 100_000) as u32
        })
    }

    /// Frees `seq`'s G1 pages for others (its blocks are in G2 already, written through as they
    /// completed); it resumes by loading them back.
    fn preempt(&mut self, seq: &mut SimSeq) {
        self.release(seq);
        seq.run.computed = 0;
        self.node.stats.preemptions.fetch_add(1, Ordering::Relaxed);
    }

    /// Resumes preempted requests, and those that waited for room since their admission, while G1
    /// has room for them ([`EngineCore::next_to_resume`]).
    async fn resume_preempted(&mut self) {
        loop {
            let (g1, available) = (&self.g1, self.available_pages());
            let Some(mut seq) = self.core.next_to_resume(|chain| batch::shared_prefix(g1, chain), available) else {
                return;
            };
            let first = !seq.run.onboarded;
            let loaded = self.onboard(&mut seq, first).await;
            if !self.entered(seq, loaded) {
                return;
            }
        }
    }

    /// G1 pages a newcomer may take: free ones, and those holding a block nobody references
    /// (interior ones too: their chains are evicted tail first).
    fn available_pages(&self) -> usize {
        let blocks = self.g1.stats().total();
        self.g1_blocks - self.g1.len() - self.private + blocks.evictable + blocks.held + blocks.interior
    }

    /// Ends `seq` and answers its caller: its G1 references are released and its private pages
    /// freed; held regions stay pinned through the tool-call gap, and the turn's answer becomes
    /// conversation context for the next turn (which resends it), so its blocks are promoted to
    /// the conversation's priority and hold.
    fn end(&mut self, mut seq: SimSeq, end: Result<Finish, WorkerError>) {
        let now = now_ms(self.epoch);
        let node = self.node.clone();
        for (i, block) in std::mem::take(&mut seq.blocks).into_iter().enumerate() {
            let Some(hash) = block else {
                self.private -= 1;
                continue;
            };
            end_block(&*node, &mut self.g1, &seq.run, i, hash, now);
        }
        seq.run.finish(end);
    }
}

/// The simulated engine drives the engine core: its pages are counts in a registry, and a
/// request's end holds its blocks as the reference worker's do.
impl Driver<SimSeq> for SimulatedEngine {
    fn core(&mut self) -> &mut EngineCore<SimSeq> {
        &mut self.core
    }

    fn grow(&mut self, seq: &mut SimSeq, blocks: usize) -> bool {
        let now = now_ms(self.epoch);
        while seq.blocks.len() < blocks {
            if self.alloc_page(now).is_err() {
                return false;
            }
            seq.blocks.push(None);
        }
        true
    }

    fn preempt(&mut self, seq: &mut SimSeq) {
        SimulatedEngine::preempt(self, seq);
    }

    fn release(&mut self, seq: &mut SimSeq) {
        SimulatedEngine::release(self, seq);
    }

    fn end(&mut self, seq: SimSeq, end: Result<Finish, WorkerError>) {
        SimulatedEngine::end(self, seq, end);
    }
}

/// The simulated executor's answers while the pipeline plans a prefix (each answer counts as an
/// access in that tier's registry, as a real lookup does; a G1 block found is referenced, so
/// nothing evicts it before it is used).
struct SimLookup<'e> {
    engine: &'e mut SimulatedEngine,
    now: Millis,
}

impl TierLookup for SimLookup<'_> {
    fn in_g1(&mut self, hash: BlockHash) -> bool {
        self.engine.g1.contains(hash) && self.engine.g1.acquire(hash, self.now).is_ok()
    }

    fn in_g2(&mut self, hash: BlockHash) -> bool {
        SimNode::holds(&self.engine.node.g2, hash, self.now)
    }

    fn in_g3(&mut self, hash: BlockHash) -> bool {
        SimNode::holds(&self.engine.node.g3, hash, self.now)
    }

    fn in_g4(&mut self, hash: BlockHash) -> bool {
        self.engine.node.peer_holds(hash, self.now)
    }
}

/// SplitMix64: one step of a tiny, good PRNG (deterministic generated tokens).
pub fn splitmix(state: u64) -> u64 {
    let mut z = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A batching engine in virtual time: requests join at the next step, each step takes its
/// calibrated time.
impl Engine for SimulatedEngine {
    fn admit(&mut self, ticket: Ticket) -> LocalFuture<'_, ()> {
        Box::pin(self.admit_ticket(ticket))
    }

    fn g1_blocks(&self) -> Option<usize> {
        Some(self.g1_blocks)
    }

    fn has_room(&self) -> bool {
        self.core.has_room()
    }

    fn running(&self) -> usize {
        self.core.len()
    }

    fn step(&mut self) -> LocalFuture<'_, ()> {
        Box::pin(self.run_step())
    }

    fn cancel_last(&mut self) {
        Driver::cancel_last(self);
    }

    fn reset(&mut self, why: &str) -> usize {
        for seq in self.core.drain() {
            seq.run.ticket.finish(Err(WorkerError::Panicked(why.to_string())));
        }
        let dropped = self.g1.len();
        self.node.stats.g1_resident.fetch_sub(dropped as i64, Ordering::Relaxed);
        self.g1 = TierRegistry::new(self.g1_blocks, self.policy);
        self.private = 0;
        self.node.observer.cleared(self.id);
        dropped
    }

    fn flush(&mut self) -> LocalFuture<'_, ()> {
        Box::pin(async move { while self.writes.join_next().await.is_some() {} })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::leases::{G1_LEASE_HOLD, Lessee};
    use crate::tiers::NoObserver;

    fn node(write_through: WriteThrough) -> Arc<SimNode> {
        let cal = Calibration::h200();
        let prefill = cal.prefill_for("llama-8b").expect("calibrated").clone();
        let block_bytes = prefill.kv_bytes_per_token * 512;
        let timing = SimTiming::from_calibration(&cal, prefill, 0.005, block_bytes);
        Arc::new(SimNode::new(
            512,
            Salt(7),
            RetentionSection::default(),
            timing,
            write_through,
            1000,
            1000,
            PolicyKind::Lru,
            Arc::new(NoObserver),
        ))
    }

    fn request(tokens: usize, seed: u64) -> GenRequest {
        GenRequest { seed: Some(seed), ..GenRequest::greedy((0..tokens as u32).collect(), 3) }
    }

    async fn run(engine: &mut SimulatedEngine, req: &GenRequest) -> GenOutcome {
        engine.generate(req, &mut |_| true).await.expect("generate")
    }

    #[tokio::test(start_paused = true)]
    async fn a_32k_prefix_from_g2_is_about_18x_faster_than_cold_on_an_h200() {
        let n = node(WriteThrough::G2G3);
        let epoch = Instant::now();
        let (mut a, mut b) = (
            SimulatedEngine::new(0, n.clone(), 1000, PolicyKind::Lru, epoch),
            SimulatedEngine::new(1, n.clone(), 1000, PolicyKind::Lru, epoch),
        );
        let cold = run(&mut a, &request(32768 + 1, 1)).await;
        assert_eq!(cold.cached_tokens, 0);
        assert!((cold.ttft.as_secs_f64() - 1.4093).abs() < 0.01, "the calibrated 32K prefill: {:?}", cold.ttft);
        let warm = run(&mut b, &request(32768 + 1, 2)).await;
        assert_eq!(
            warm.hit_tokens,
            PerTier { g2: 32768, ..PerTier::default() },
            "worker 1 loads worker 0's prefix from G2"
        );
        let ratio = cold.ttft.as_secs_f64() / warm.ttft.as_secs_f64();
        assert!((15.0..19.0).contains(&ratio), "the host link allows ~18x: {ratio}");
        let again = run(&mut a, &request(32768 + 1, 3)).await;
        assert_eq!(again.hit_tokens.g1, 32768, "worker 0 reuses its G1 in place");
        assert_eq!(run(&mut a, &request(600, 4)).await.tokens, run(&mut b, &request(600, 4)).await.tokens);
    }

    #[tokio::test(start_paused = true)]
    async fn the_disk_is_slower_than_recompute_so_g3_is_not_used_and_no_write_through_means_no_sharing() {
        let n = node(WriteThrough::Off);
        let epoch = Instant::now();
        let (mut a, mut b) = (
            SimulatedEngine::new(0, n.clone(), 1000, PolicyKind::Lru, epoch),
            SimulatedEngine::new(1, n.clone(), 1000, PolicyKind::Lru, epoch),
        );
        run(&mut a, &request(8193, 1)).await;
        assert_eq!(n.resident(), (0, 0));
        assert_eq!(run(&mut b, &request(8193, 2)).await.cached_tokens, 0, "nothing shared");

        let n = node(WriteThrough::G2G3);
        let mut c = SimulatedEngine::new(0, n.clone(), 1000, PolicyKind::Lru, epoch);
        run(&mut c, &request(8193, 1)).await;
        c.flush().await;
        assert_eq!(n.resident(), (16, 16), "written through to G2 and G3");
        // 64 MiB per block at 1.6 GB/s (≈ 42 ms) against ≈ 16 ms to recompute it: never from G3.
        n.g2.as_ref().expect("g2").lock().expect("g2").evict(16, u64::MAX);
        let mut d = SimulatedEngine::new(1, n.clone(), 1000, PolicyKind::Lru, epoch);
        assert_eq!(run(&mut d, &request(8193, 2)).await.cached_tokens, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_leased_system_prompt_is_demoted_not_dropped_by_a_flood_and_its_release_ends_that() {
        // G1 and G2 of 24 blocks each, no G3: G2 is the lowest tier, so it pins the lease.
        let cal = Calibration::h200();
        let prefill = cal.prefill_for("llama-8b").expect("calibrated").clone();
        let timing = SimTiming::from_calibration(&cal, prefill.clone(), 0.005, prefill.kv_bytes_per_token * 512);
        let epoch = Instant::now();
        let n = Arc::new(
            SimNode::new(
                512,
                Salt(7),
                RetentionSection::default(),
                timing,
                WriteThrough::G2,
                24,
                0,
                PolicyKind::Lru,
                Arc::new(NoObserver),
            )
            .with_leases(Arc::new(LeaseBook::default()), epoch, 0.5),
        );
        let mut engine = SimulatedEngine::new(0, n.clone(), 24, PolicyKind::Lru, epoch);
        // Eight-block system prompts, each of its own tokens.
        let system = |k: u32, seed: u64| GenRequest {
            regions: vec![(0..8 * 512 + 1, RegionKind::System)],
            seed: Some(seed),
            ..GenRequest::greedy((0..8 * 512 + 1).map(|t| t + k * 100_000).collect(), 1)
        };
        let (kept, plain) = (system(1, 1), system(2, 2));
        run(&mut engine, &kept).await;
        run(&mut engine, &plain).await;
        engine.flush().await;
        let chain: Vec<(BlockHash, RegionKind)> = dynamo_tiering::block::BlockHasher::new(Salt(7), 512)
            .hash_sequence(&kept.prompt)
            .into_iter()
            .take(8)
            .map(|h| (h, RegionKind::System))
            .collect();
        assert_eq!(
            n.lease(Lessee { owner: 1, tenant: 0 }, &chain, 3_600_000, n.now()),
            8,
            "all eight blocks newly leased"
        );
        assert_eq!(n.book().live(n.now()), 8);
        // A flood of other system prompts, later (each newer than both).
        for k in 3..9 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            run(&mut engine, &system(k, k as u64)).await;
        }
        engine.flush().await;
        let again = run(&mut engine, &system(1, 9)).await;
        assert_eq!(again.cached_tokens, 8 * 512, "the leased prompt comes back whole");
        assert_eq!(again.hit_tokens.g1, 0, "from G2: the flood pushed it out of G1");
        assert_eq!(run(&mut engine, &system(2, 10)).await.cached_tokens, 0, "the unleased one is gone");
        // Its release makes it plain retention again (G1's soft hold ends within a minute): the
        // next flood takes it too.
        n.unlease(Lessee { owner: 1, tenant: 0 }, &chain, n.now());
        assert_eq!(n.book().live(n.now()), 0);
        tokio::time::sleep(Duration::from_millis(G1_LEASE_HOLD)).await;
        for k in 11..17 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            run(&mut engine, &system(k, k as u64)).await;
        }
        engine.flush().await;
        assert_eq!(run(&mut engine, &system(1, 17)).await.cached_tokens, 0, "released, it was evicted");
    }
}
