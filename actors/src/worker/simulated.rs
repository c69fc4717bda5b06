//! The simulated engine (DESIGN.md §7): does no math; its time comes from a calibration, and the
//! bookkeeping around it is the product's own — G1/G2/G3 [`TierRegistry`]s with their eviction
//! policies, retention regions and holds, write-through per region, KV events to the index, the
//! scheduler's cost model. It moves no bytes, so a node of many workers with terabytes of tiers
//! replays hours of traffic on a laptop, under tokio's paused clock (see [`EngineHost::Local`]).
//!
//! Timing of one request on worker `w`:
//! - blocks found in `w`'s G1 are free; blocks in the node's G2 cross the host link
//!   (`link_bytes_per_s`), blocks in G3 are read from disk (`disk_read_bytes_per_s`, the disk
//!   shared by the node's workers and queued) and then cross the link — each tier used only while
//!   loading beats recomputing;
//! - prefill of the rest costs `prefill(len) − prefill(cached)` from the calibrated curve (the
//!   marginal cost of the suffix given its prefix);
//! - the first token comes right after prefill; decoding costs `decode_s_per_token` per token;
//! - completed blocks go to G1, then (write-through, per region) to G2 and, after the disk
//!   wrote them, to G3; each tier's acknowledgment is a KV event.
//!
//! Generated tokens are a deterministic function of the request's seed, so a replay driver can
//! build the next turn's prompt from them, exactly as an agent resends its history.
//!
//! [`EngineHost::Local`]: super::EngineHost::Local

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dynamo_config::{Calibration, PrefillCalibration, RegionKind, RetentionSection, TierName};
use dynamo_tiering::block::{BlockHash, BlockHasher, Salt};
use dynamo_tiering::cost::{BytesPerSec, CostModel, Prefill};
use dynamo_tiering::pipeline::{Landed, Pipeline, Presence, Refusal, Source, TierLookup, region_of};
use dynamo_tiering::registry::{Admission, BlockMeta, Millis, PolicyKind, TierRegistry};
use tokio::time::Instant;

use super::{Engine, Finish, GenOutcome, GenRequest, LocalFuture, Ticket, WorkerError, WorkerEvent};
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
    /// Time requests waited for their worker's GPU before their prefill began, summed in µs.
    pub queue_us_sum: AtomicU64,
    /// Prefills started.
    pub prefills: AtomicU64,
}

/// Write-through to G3 skips a block (it stays in G2) rather than queue it behind more than this
/// much disk work: a disk slower than the write stream must not build an unbounded backlog.
pub const MAX_DISK_BACKLOG: Duration = Duration::from_secs(1);

/// The node-shared part of a simulated node: G2 and G3 as registries, the disk's queue, where
/// KV events go.
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
    disk_free_at: Mutex<Instant>,
    observer: Arc<dyn KvObserver>,
    /// The other nodes of the cluster, whose G2 this node's workers can load from (G4).
    peers: std::sync::OnceLock<Vec<std::sync::Weak<SimNode>>>,
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
        Self {
            block_tokens,
            salt,
            retention,
            cost: timing.cost_model(block_tokens),
            timing,
            write_through,
            g2: tier(g2_blocks),
            g3: tier(g3_blocks),
            disk_free_at: Mutex::new(Instant::now()),
            observer,
            peers: std::sync::OnceLock::new(),
            stats: SimStats::default(),
        }
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

    /// The pipeline's policy over this node's retention and write-through.
    pub fn pipeline(&self) -> Pipeline<'_> {
        Pipeline { block_tokens: self.block_tokens, retention: &self.retention, write_through: self.write_through }
    }

    fn meta(&self, parent: Option<BlockHash>, region: RegionKind) -> BlockMeta {
        self.pipeline().meta(parent, region)
    }

    fn contains(tier: &Option<Mutex<TierRegistry>>, hash: BlockHash) -> bool {
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

    fn promote_g2(&self, hash: BlockHash, priority: u8) {
        if let Some(g2) = &self.g2 {
            let _ = g2.lock().expect("registry").set_priority(hash, priority);
        }
    }

    fn hold_g2(&self, hash: BlockHash, until: Millis) {
        if let Some(g2) = &self.g2 {
            let _ = g2.lock().expect("registry").hold(hash, until);
        }
    }

    /// When a disk write of `bytes` submitted now completes (the disk serves one at a time), or
    /// `None` when the disk is more than [`MAX_DISK_BACKLOG`] behind.
    fn disk_write_done(&self, bytes: u64) -> Option<Instant> {
        let mut free = self.disk_free_at.lock().expect("disk");
        let now = Instant::now();
        if *free > now + MAX_DISK_BACKLOG {
            self.stats.g3_skipped.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let start = (*free).max(now);
        *free = start + Duration::from_secs_f64(bytes as f64 / self.timing.disk_write_bytes_per_s.max(1.0));
        Some(*free)
    }

    /// When a disk read of `bytes` submitted now completes.
    fn disk_read_done(&self, bytes: u64) -> Instant {
        let mut free = self.disk_free_at.lock().expect("disk");
        let start = (*free).max(Instant::now());
        *free = start + Duration::from_secs_f64(bytes as f64 / self.timing.disk_read_bytes_per_s.max(1.0));
        *free
    }
}

/// Milliseconds of tokio's clock (virtual under a paused clock), the clock of simulated holds.
fn now_ms(epoch: Instant) -> Millis {
    epoch.elapsed().as_millis() as Millis
}

/// One simulated worker: its G1 registry and its share of the node. It batches like a serving
/// engine: prefills take the GPU one at a time, decodes run alongside ([`Engine::fork`] hands
/// out handles on the same worker).
#[derive(Debug, Clone)]
pub struct SimulatedEngine {
    shared: Rc<SimWorker>,
}

#[derive(Debug)]
struct SimWorker {
    id: usize,
    node: Arc<SimNode>,
    g1: RefCell<TierRegistry>,
    g1_blocks: usize,
    policy: PolicyKind,
    epoch: Instant,
    /// Held while a request loads and prefills: the GPU computes one prefill at a time.
    gpu: tokio::sync::Mutex<()>,
    writes: RefCell<tokio::task::JoinSet<()>>,
}

impl SimulatedEngine {
    /// Worker `id` of `node`, with a G1 of `g1_blocks` evicted by `policy`; `epoch` is the
    /// simulation's time zero (shared by the node's workers).
    pub fn new(id: usize, node: Arc<SimNode>, g1_blocks: usize, policy: PolicyKind, epoch: Instant) -> Self {
        Self {
            shared: Rc::new(SimWorker {
                id,
                node,
                g1: RefCell::new(TierRegistry::new(g1_blocks, policy)),
                g1_blocks,
                policy,
                epoch,
                gpu: tokio::sync::Mutex::new(()),
                writes: RefCell::new(tokio::task::JoinSet::new()),
            }),
        }
    }
}

/// The simulated executor's answers while the pipeline plans a prefix (each answer counts as an
/// access in that tier's registry, as a real lookup does).
struct SimLookup<'w> {
    worker: &'w SimWorker,
    now: Millis,
}

impl TierLookup for SimLookup<'_> {
    fn in_g1(&mut self, hash: BlockHash) -> bool {
        self.worker.g1.borrow().contains(hash)
    }

    fn in_g2(&mut self, hash: BlockHash) -> bool {
        SimNode::holds(&self.worker.node.g2, hash, self.now)
    }

    fn in_g3(&mut self, hash: BlockHash) -> bool {
        SimNode::holds(&self.worker.node.g3, hash, self.now)
    }

    fn in_g4(&mut self, hash: BlockHash) -> bool {
        self.worker.node.peer_holds(hash, self.now)
    }
}

impl SimWorker {
    fn site(&self) -> BlockSite {
        BlockSite::G1 { worker: self.id }
    }

    /// Registers a block in G1 (referenced) and writes it through as the pipeline says; returns
    /// whether it is referenced (to be released at the end).
    fn complete(&self, hash: BlockHash, parent: Option<BlockHash>, region: RegionKind, landed: Landed) -> bool {
        let now = now_ms(self.epoch);
        let node = self.node.clone();
        let meta = node.meta(parent, region);
        let mut g1 = self.g1.borrow_mut();
        let referenced = match g1.insert(hash, meta, now) {
            Ok(Admission::Inserted { evicted }) => {
                node.stats.g1_resident.fetch_add(1 - evicted.len() as i64, Ordering::Relaxed);
                if !evicted.is_empty() {
                    let mut by_region = node.stats.g1_evictions.lock().expect("stats");
                    for e in &evicted {
                        *by_region.entry(e.region).or_default() += 1;
                    }
                    drop(by_region);
                    let gone: Vec<BlockHash> = evicted.iter().map(|e| e.hash).collect();
                    node.observer.removed(self.site(), &gone);
                }
                node.observer.stored(self.site(), parent, &[hash]);
                g1.acquire(hash, now).is_ok()
            }
            Ok(Admission::AlreadyPresent) => g1.acquire(hash, now).is_ok(),
            Err(_) => false,
        };
        drop(g1);
        let bytes = node.timing.block_bytes;
        let present = Presence { g2: SimNode::contains(&node.g2, hash), g3: SimNode::contains(&node.g3, hash) };
        let targets = node.pipeline().write_targets(region, landed, present);
        if targets.g2 && node.g2.is_some() {
            // A block read from below lands in G2 on its way up; only a computed one crosses G1 → G2.
            if landed == Landed::Computed {
                node.stats.g1_to_g2_bytes.fetch_add(bytes, Ordering::Relaxed);
            }
            node.admit(TierName::G2, hash, meta, now);
        }
        // Down to G3 (duplicates are not written again).
        if targets.g3 && node.g3.is_some() {
            let completed = Instant::now();
            let Some(done) = node.disk_write_done(bytes) else { return referenced };
            self.writes.borrow_mut().spawn(async move {
                tokio::time::sleep_until(done).await;
                let now = now_ms(Instant::now().min(done));
                node.admit(TierName::G3, hash, meta, now);
                let lag = (done - completed).as_micros() as u64;
                node.stats.g2_to_g3_bytes.fetch_add(bytes, Ordering::Relaxed);
                node.stats.g3_lag_us_sum.fetch_add(lag, Ordering::Relaxed);
                node.stats.g3_lag_us_max.fetch_max(lag, Ordering::Relaxed);
                node.stats.g3_acks.fetch_add(1, Ordering::Relaxed);
            });
        }
        referenced
    }

    async fn run(
        &self,
        req: &GenRequest,
        on_event: &mut (dyn FnMut(WorkerEvent) -> bool + Send),
    ) -> Result<GenOutcome, WorkerError> {
        let start = Instant::now();
        let b = self.node.block_tokens;
        let len = req.prompt.len();
        let needed = match self.node.pipeline().admit(len, req.max_tokens, self.g1_blocks) {
            Ok(()) => (len + req.max_tokens).div_ceil(b),
            Err(Refusal::EmptyPrompt) => return Err(WorkerError::EmptyPrompt),
            Err(Refusal::TooLong { needed }) => {
                let (max_tokens, capacity) = (req.max_tokens, self.g1_blocks);
                return Err(WorkerError::TooLong { prompt: len, max_tokens, needed, capacity });
            }
        };
        let node = self.node.clone();
        let timing = &node.timing;
        let hashes = req.block_hashes(node.salt, b);
        // The GPU prefills one request at a time; the cached prefix is looked up once it is ours.
        let gpu = self.gpu.lock().await;
        node.stats.queue_us_sum.fetch_add(start.elapsed().as_micros() as u64, Ordering::Relaxed);
        node.stats.prefills.fetch_add(1, Ordering::Relaxed);
        let now = now_ms(self.epoch);

        // The cached prefix, as the pipeline plans it: G1 in place, then G2 over the link, then
        // G3 from disk, then a peer, each block only while loading it beats recomputing it.
        let link_s = timing.block_bytes as f64 / timing.link_bytes_per_s.max(1.0);
        let net_s = node.cost.g4_read.map_or(0.0, |r| r.seconds(timing.block_bytes as usize));
        let mut lookup = SimLookup { worker: self, now };
        let from = node.pipeline().plan_prefix(&hashes, len, &node.cost, &mut lookup);
        let mut hit = [0usize; 4];
        for source in &from {
            hit[source.index()] += b;
        }
        let cached = from.len() * b;
        let count = |of: &[Source]| from.iter().filter(|s| of.contains(s)).count() as u64;
        let g3_blocks = count(&[Source::G3]);
        let link_blocks = count(&[Source::G2, Source::G3]);
        let g4_blocks = count(&[Source::G4]);
        node.stats.g4_to_g1_bytes.fetch_add(g4_blocks * timing.block_bytes, Ordering::Relaxed);
        if g3_blocks > 0 {
            node.stats.g3_to_g1_bytes.fetch_add(g3_blocks * timing.block_bytes, Ordering::Relaxed);
            tokio::time::sleep_until(node.disk_read_done(g3_blocks * timing.block_bytes)).await;
        }
        node.stats.g2_to_g1_bytes.fetch_add((link_blocks - g3_blocks) * timing.block_bytes, Ordering::Relaxed);
        let load = Duration::from_secs_f64(link_blocks as f64 * link_s + g4_blocks as f64 * net_s);
        let compute = Duration::from_secs_f64((timing.prefill_s(len) - timing.prefill_s(cached)).max(0.0));
        tokio::time::sleep(load + compute).await;

        // The prompt's blocks are in G1 now.
        let mut referenced = Vec::with_capacity(needed);
        for (i, &hash) in hashes.iter().enumerate() {
            let landed = match from.get(i) {
                None => Landed::Computed,
                Some(Source::G1) => Landed::Reused,
                Some(&source) => Landed::Loaded(source),
            };
            let region = region_of(&req.regions, i * b);
            if self.complete(hash, i.checked_sub(1).map(|p| hashes[p]), region, landed) {
                referenced.push((hash, region));
            }
        }
        drop(gpu);
        let ttft = start.elapsed();
        let mut outcome = GenOutcome {
            tokens: Vec::with_capacity(req.max_tokens),
            cached_tokens: cached,
            hit_tokens: hit,
            prefill_tokens: len - cached,
            finish: Finish::Length,
            ttft,
            corrupt_blocks: 0,
        };
        let mut go_on = on_event(WorkerEvent::Prefilled { cached_tokens: cached, hit_tokens: hit });

        // Decode: the first token comes with the prefill, the rest at the decode rate.
        if go_on && req.max_tokens > 1 {
            tokio::time::sleep(Duration::from_secs_f64((req.max_tokens - 1) as f64 * timing.decode_s_per_token)).await;
        }
        let mut sequence = req.prompt.clone();
        let mut chain = hashes;
        let mut state = req.seed ^ 0x9e37_79b9_7f4a_7c15;
        for _ in 0..req.max_tokens {
            if !go_on {
                outcome.finish = Finish::Stop;
                break;
            }
            state = splitmix(state);
            let token = 1000 + (state % 100_000) as u32;
            outcome.tokens.push(token);
            sequence.push(token);
            go_on = on_event(WorkerEvent::Token(token));
            if sequence.len().is_multiple_of(b) {
                let i = sequence.len() / b - 1;
                let parent = chain.last().copied();
                let hash = BlockHasher::new(node.salt, b).hash_block(parent, &sequence[i * b..]);
                chain.push(hash);
                if self.complete(hash, parent, RegionKind::Generated, Landed::Computed) {
                    referenced.push((hash, RegionKind::Generated));
                }
            }
        }

        // Release the request's blocks; held regions stay pinned through the tool-call gap. The
        // turn's answer becomes conversation context for the next turn (which resends it), so
        // its blocks are promoted to the conversation's priority and hold.
        let end = now_ms(self.epoch);
        let mut g1 = self.g1.borrow_mut();
        let pipeline = node.pipeline();
        for (hash, region) in referenced {
            let _ = g1.release(hash);
            let fate = pipeline.turn_end(region, region == RegionKind::Generated, end);
            if let Some(priority) = fate.priority {
                let _ = g1.set_priority(hash, priority);
                node.promote_g2(hash, priority);
            }
            if let Some(until) = fate.hold_until {
                let _ = g1.hold(hash, until);
                node.hold_g2(hash, until);
            }
        }
        drop(g1);
        let mut writes = self.writes.borrow_mut();
        while writes.try_join_next().is_some() {}
        Ok(outcome)
    }
}

/// SplitMix64: one step of a tiny, good PRNG (deterministic generated tokens).
pub fn splitmix(state: u64) -> u64 {
    let mut z = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl SimulatedEngine {
    /// Serves one request on this worker: prefill when the GPU is free, then decode alongside the
    /// worker's other requests.
    pub async fn generate(
        &mut self,
        req: &GenRequest,
        on_event: &mut (dyn FnMut(WorkerEvent) -> bool + Send),
    ) -> Result<GenOutcome, WorkerError> {
        self.shared.run(req, on_event).await
    }
}

/// Each request runs on a task of its own, concurrently with the worker's others (prefills take
/// the GPU one at a time; decodes run alongside).
impl Engine for SimulatedEngine {
    fn admit(&mut self, mut ticket: Ticket) -> LocalFuture<'_, ()> {
        let shared = self.shared.clone();
        tokio::task::spawn_local(async move {
            let req = ticket.req.clone();
            let result = shared.run(&req, &mut |e| ticket.event(e)).await;
            ticket.finish(result);
        });
        Box::pin(async {})
    }

    fn reset(&mut self, _why: &str) -> usize {
        let w = &self.shared;
        let dropped = w.g1.borrow().len();
        w.node.stats.g1_resident.fetch_sub(dropped as i64, Ordering::Relaxed);
        *w.g1.borrow_mut() = TierRegistry::new(w.g1_blocks, w.policy);
        w.node.observer.cleared(w.id);
        dropped
    }

    fn flush(&mut self) -> LocalFuture<'_, ()> {
        Box::pin(async move {
            let mut writes = std::mem::take(&mut *self.shared.writes.borrow_mut());
            while writes.join_next().await.is_some() {}
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
        GenRequest { seed, ..GenRequest::greedy((0..tokens as u32).collect(), 3) }
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
        assert_eq!(warm.hit_tokens, [0, 32768, 0, 0], "worker 1 loads worker 0's prefix from G2");
        let ratio = cold.ttft.as_secs_f64() / warm.ttft.as_secs_f64();
        assert!((15.0..19.0).contains(&ratio), "the host link allows ~18x: {ratio}");
        let again = run(&mut a, &request(32768 + 1, 3)).await;
        assert_eq!(again.hit_tokens[0], 32768, "worker 0 reuses its G1 in place");
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
}
