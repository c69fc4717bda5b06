//! The node builder: the one way a node's tiers and actor tree are assembled.
//!
//! Every entry point — `serve`, `bench serve`, `bench replay` (simulated and reference engines),
//! `gpu-check`'s end-to-end section, `bench preempt` — builds its node here and differs only in the
//! engines it passes and where they run (the last two stop at [`NodeTiered`] and drive their
//! workers themselves: they clear G1 between scenarios, which no actor offers). Each stage is a
//! type whose methods take what that stage needs and return the next, so a half-built node cannot
//! be used (foyer's `HybridCacheBuilder` shape):
//!
//! ```text
//! NodeBuilder                               the prefix index; how KV events reach it
//!  ├─ open(&StorePlan) ─▶ NodeStores         the G2 pool; the G3 store, its registry recovered
//!  │   └─ tiers(TierSettings) ─▶ NodeTiered  NodeTiers with the node's one CostModel
//!  └─ simulated(Routing) ─▶ NodeSimulated    no stores: the simulated engines keep their own
//! NodeTiered or NodeSimulated
//!  └─ engines(EngineSet) ─▶ NodeEngines      the engine factory, and where the engines run
//!      └─ spawn(Scheduling) ─▶ RunningNode   the NodeSupervisor's tree: root, scheduler, tiers, index
//! ```
//!
//! - [`NodeBuilder`] creates the global prefix index and decides how KV events reach it (applied
//!   where published, or on a writer thread of the index's own); [`NodeBuilder::publisher`] hands
//!   out publishers for engines that keep their own tiers (the simulated nodes).
//! - [`NodeBuilder::open`] maps the G2 pool and opens the G3 store, whose registry is rebuilt from
//!   what it recovered ([`G3Store::open_recovered`]); it blocks while G3 scans. What is open is
//!   visible before any engine exists ([`NodeStores::g2_pool`]: a CUDA engine registers it with
//!   the device, and measures its rates, before the cost model is known).
//! - [`NodeStores::tiers`] builds [`NodeTiers`] with the node's one [`CostModel`], which the
//!   scheduler's [`KvRouting`] gets too, and tells the index what G3 recovered.
//! - [`NodeTiered::engines`] / [`NodeSimulated::engines`] take the engine factory and its host
//!   (threads, or a `LocalSet` in virtual time); [`NodeEngines::spawn`] starts the NodeSupervisor
//!   with the workers, the scheduler and the store actors, and returns a [`RunningNode`].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dynamo_config::{NodeConfig, QueuePolicy, RetentionSection, RoutingPolicy, TierName};
use dynamo_tiering::block::{BlockLayout, Salt};
use dynamo_tiering::cost::BytesPerSec;
use dynamo_tiering::g2::{HostPool, HostPoolOptions, PoolError};
use dynamo_tiering::g3::{G3Error, G3Options, G3Store, Recovery};
use dynamo_tiering::g4::feed::Feed;
use dynamo_tiering::registry::{PolicyKind, TierRegistry};
use ractor::rpc::CallResult;
use ractor::{Actor, SpawnErr};

use crate::cost::CostModel;
use crate::engine_names::EngineNames;
use crate::index::{IndexConfig, IndexWriter, PrefixIndex};
use crate::leases::{LeaseBook, LeasedTiers};
use crate::peer::RemoteTier;
use crate::publisher::KvPublisher;
use crate::scheduler::{Admission, KvRouting, SchedulerArgs, SchedulerRef};
use crate::stores::{StoreArgs, Watermarks};
use crate::supervisor::{NodeArgs, NodeMsg, NodeRef, NodeSupervisor};
use crate::tiers::{BlockSite, G2Tier, G3Tier, G4Tier, KvObserver, NoObserver, NodeTiers, WriteBatch};
use crate::worker::{EngineFactory, EngineHost, WorkerArgs, unix_millis};

/// How often the store actors check occupancy and G3 health.
pub const STORE_PERIOD: Duration = Duration::from_millis(500);
/// G3 disk failures in a row that degrade the node to G1+G2.
pub const G3_FAILURES_TO_DEGRADE: u32 = 4;
/// Watermarks that never reclaim: for a harness that stops at [`NodeTiered`] and drives its
/// workers itself (no store actor runs).
pub const NO_RECLAIM: Watermarks = Watermarks { high: 1.0, low: 1.0 };

/// Why a node could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The G2 pool could not be mapped (or locked, under `mlock = "require"`).
    #[error("building the G2 pool")]
    G2(#[source] PoolError),
    /// The G3 store could not be opened, or what it recovered could not be registered.
    #[error("opening the G3 store")]
    G3(#[source] G3Error),
    /// G3 reads and writes go through G2 slots: a plan with G3 needs G2.
    #[error("tiers.g3 is enabled but tiers.g2 is not: G3 reads and writes go through G2 slots; enable tiers.g2")]
    G3WithoutG2,
    /// The index's writer thread could not be started.
    #[error("starting the index writer")]
    IndexWriter(#[source] std::io::Error),
    /// The actor tree could not be started.
    #[error("starting the actor tree")]
    Spawn(#[source] SpawnErr),
    /// The NodeSupervisor did not say who its scheduler is.
    #[error("the node supervisor did not answer")]
    NoScheduler,
}

impl BuildError {
    /// A stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            BuildError::G2(_) => "g2",
            BuildError::G3(_) => "g3",
            BuildError::G3WithoutG2 => "g3_without_g2",
            BuildError::IndexWriter(_) => "index_writer",
            BuildError::Spawn(_) => "spawn",
            BuildError::NoScheduler => "no_scheduler",
        }
    }
}

/// The node's G2 and G3 as resolved from its configuration: what [`NodeBuilder::open`] opens.
/// The default opens neither.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StorePlan {
    /// The host pool, when G2 is enabled.
    pub g2: Option<G2Plan>,
    /// The external engines' G2 (`engine_endpoint`): shared memory they map, beside the node's
    /// own G2, which they never see.
    pub engines_g2: Option<G2Plan>,
    /// The NVMe store, when G3 is enabled (needs G2).
    pub g3: Option<G3Plan>,
    /// Fraction of each tier's blocks that leases may pin (`tiers.lease_budget`); past it
    /// the lease that ends soonest falls back to plain retention.
    pub lease_budget: f64,
}

/// Blocks of a registry of `blocks` that leases may pin at `fraction`.
fn lease_budget(blocks: usize, fraction: f64) -> usize {
    (blocks as f64 * fraction.clamp(0.0, 1.0)) as usize
}

/// G2: the pool and its registry.
#[derive(Clone, Debug, PartialEq)]
pub struct G2Plan {
    /// Slot size, slots, locking.
    pub pool: HostPoolOptions,
    /// Blocks the registry may keep resident: the slots minus a reserve that in-flight loads
    /// from G3 and write-through gathers always find free ([`G2Plan::new`] keeps
    /// [`g2_reserve`]).
    pub resident: usize,
    /// Eviction policy.
    pub policy: PolicyKind,
    /// Background reclaim bounds of the G2 store actor.
    pub watermarks: Watermarks,
    /// Whether the pool is shared memory that external engines map (the engines' G2).
    pub shared: bool,
}

impl G2Plan {
    /// A pool of `pool.slots` slots whose registry keeps all but [`g2_reserve`] of them.
    pub fn new(pool: HostPoolOptions, policy: PolicyKind, watermarks: Watermarks) -> Self {
        let slots = pool.slots as usize;
        Self { pool, resident: slots.saturating_sub(g2_reserve(slots)), policy, watermarks, shared: false }
    }

    /// The same pool as shared memory ([`HostPool::shared`]) that external engines can map.
    pub fn shared(self) -> Self {
        Self { shared: true, ..self }
    }
}

/// G2 slots kept out of the registry's reach for transfers in flight: 1/16 of the pool, between
/// 4 and 256 slots (never more than half a small pool).
pub fn g2_reserve(slots: usize) -> usize {
    (slots / 16).clamp(4, 256).min(slots / 2)
}

/// G3: the store and its registry's policy.
#[derive(Clone, Debug, PartialEq)]
pub struct G3Plan {
    /// Files, sizes, slot size, engine.
    pub options: G3Options,
    /// Eviction policy.
    pub policy: PolicyKind,
    /// Background reclaim bounds of the G3 store actor.
    pub watermarks: Watermarks,
}

/// Stage 1: the prefix index and how KV events reach it.
#[derive(Debug)]
pub struct NodeBuilder {
    index: Arc<PrefixIndex>,
    writer: Option<Arc<IndexWriter>>,
    node: u16,
    epoch: u64,
    kv_events: bool,
    index_metrics: Option<Duration>,
}

impl NodeBuilder {
    /// A node with id 0 in a new index of `index`'s bounds; events are applied where they are
    /// published, under an epoch from the wall clock (a restarted node gets a larger one).
    pub fn new(index: IndexConfig) -> Self {
        let epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        Self {
            index: Arc::new(PrefixIndex::new(index)),
            writer: None,
            node: 0,
            epoch,
            kv_events: true,
            index_metrics: None,
        }
    }

    /// Applies events on a writer thread of the index's own, so the engine threads that publish
    /// most of them never wait on the index; the scheduler flushes it before each decision.
    pub fn with_index_writer(mut self) -> Result<Self, BuildError> {
        let writer = IndexWriter::spawn(self.index.clone(), 1, Some(KvPublisher::on_applied()))
            .map_err(BuildError::IndexWriter)?;
        self.writer = Some(Arc::new(writer));
        Ok(self)
    }

    /// This node's incarnation in the index (deterministic runs pass a constant).
    pub fn with_epoch(mut self, epoch: u64) -> Self {
        self.epoch = epoch;
        self
    }

    /// The tiers report nothing: for a harness that drives workers itself and routes nothing.
    pub fn without_kv_events(mut self) -> Self {
        self.kv_events = false;
        self
    }

    /// Publishes the index's size and resyncs to the metrics every `period` while the node runs.
    pub fn with_index_metrics(mut self, period: Duration) -> Self {
        self.index_metrics = Some(period);
        self
    }

    /// The index the scheduler will route by.
    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.index
    }

    /// A publisher of node `node`'s events into the index (through the writer, if there is one),
    /// for engines that keep their own tiers.
    pub fn publisher(&self, node: u16) -> Arc<KvPublisher> {
        Arc::new(self.new_publisher(node))
    }

    fn new_publisher(&self, node: u16) -> KvPublisher {
        match &self.writer {
            Some(writer) => KvPublisher::with_writer(node, self.epoch, writer.clone()),
            None => KvPublisher::new(node, self.epoch, self.index.clone()),
        }
    }

    /// Maps G2 and opens G3 (blocking while it scans its slots), rebuilding G3's registry from
    /// what it recovered.
    pub fn open(self, plan: &StorePlan) -> Result<NodeStores, BuildError> {
        let open_g2 = |g2: &G2Plan| -> Result<G2Parts, BuildError> {
            let pool = if g2.shared { HostPool::shared(g2.pool) } else { HostPool::new(g2.pool) };
            let pool = pool.map_err(BuildError::G2)?;
            let budget = lease_budget(g2.resident, plan.lease_budget);
            let registry = Arc::new(Mutex::new(TierRegistry::new(g2.resident, g2.policy).with_lease_budget(budget)));
            Ok((pool, registry))
        };
        let g2 = plan.g2.as_ref().map(open_g2).transpose()?;
        let engines_g2 = plan.engines_g2.as_ref().map(open_g2).transpose()?;
        let mut recovery = Recovery::default();
        let g3 = match (&plan.g3, &g2) {
            (Some(g3), Some((pool, _))) => {
                let found =
                    G3Store::open_recovered(&g3.options, pool, g3.policy, unix_millis()).map_err(BuildError::G3)?;
                recovery = found.recovery;
                let budget = lease_budget(found.registry.capacity(), plan.lease_budget);
                Some((Arc::new(found.store), Arc::new(Mutex::new(found.registry.with_lease_budget(budget)))))
            }
            (Some(_), None) => return Err(BuildError::G3WithoutG2),
            (None, _) => None,
        };
        // The book holds what the lowest tier may pin: past it, the tenant holding the most gives way.
        let lowest = g3.as_ref().map(|(_, r)| r).or(g2.as_ref().map(|(_, r)| r));
        let budget = lowest.map_or(usize::MAX, |r| r.lock().expect("tier registry lock").lease_budget());
        let leases = Arc::new(LeaseBook::with_budget(budget));
        Ok(NodeStores { builder: self, plan: plan.clone(), g2, engines_g2, g3, recovery, leases })
    }

    /// A node without stores whose engines keep their own tiers (the simulated engine's
    /// [`SimNode`](crate::worker::simulated::SimNode)s, fed by [`NodeBuilder::publisher`]):
    /// routing by `routing`'s hashing and cost model.
    pub fn simulated(self, routing: Routing) -> NodeSimulated {
        NodeSimulated { builder: self, routing, leases: None }
    }
}

/// How requests are hashed and weighed when no [`NodeTiers`] says it.
#[derive(Clone, Debug)]
pub struct Routing {
    /// The engines' salt.
    pub salt: Salt,
    /// Tokens per block.
    pub block_tokens: usize,
    /// The node's one cost model.
    pub cost: CostModel,
    /// Blocks the node's G2 holds (the cache below the workers' G1 that working-set admission
    /// counts; 0 without G2).
    pub g2_blocks: usize,
}

/// A G2 pool and its registry.
type G2Parts = (HostPool, Arc<Mutex<TierRegistry>>);

/// Stage 2: the stores are open.
#[derive(Debug)]
pub struct NodeStores {
    builder: NodeBuilder,
    plan: StorePlan,
    g2: Option<G2Parts>,
    engines_g2: Option<G2Parts>,
    g3: Option<(Arc<G3Store>, Arc<Mutex<TierRegistry>>)>,
    recovery: Recovery,
    leases: Arc<LeaseBook>,
}

impl NodeStores {
    /// The G2 pool (a CUDA engine registers its mapping with the device).
    pub fn g2_pool(&self) -> Option<&HostPool> {
        self.g2.as_ref().map(|(pool, _)| pool)
    }

    /// G2's registry (shared with whoever reports its stats).
    pub fn g2_registry(&self) -> Option<&Arc<Mutex<TierRegistry>>> {
        self.g2.as_ref().map(|(_, registry)| registry)
    }

    /// The G3 store.
    pub fn g3_store(&self) -> Option<&Arc<G3Store>> {
        self.g3.as_ref().map(|(store, _)| store)
    }

    /// G3's registry, rebuilt from what the store recovered.
    pub fn g3_registry(&self) -> Option<&Arc<Mutex<TierRegistry>>> {
        self.g3.as_ref().map(|(_, registry)| registry)
    }

    /// The node's leases (shared with whoever reports their figures).
    pub fn leases(&self) -> &Arc<LeaseBook> {
        &self.leases
    }

    /// What G3 found when it opened (empty without G3).
    pub fn recovery(&self) -> &Recovery {
        &self.recovery
    }

    /// The index the scheduler will route by.
    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.builder.index
    }

    /// Builds the node's tiers over the open stores with the node's one cost model, and tells
    /// the index what G3 recovered.
    pub fn tiers(self, settings: TierSettings) -> NodeTiered {
        let NodeStores { builder, plan, g2, engines_g2, g3, recovery, leases } = self;
        // G4: the feed of G2 for peers, and the links to theirs (started by the caller).
        let g4 = settings.g4.then(|| G4Tier {
            feed: Arc::new(Feed::default()),
            remote: Arc::new(RemoteTier::new(builder.index.clone(), builder.node)),
        });
        let observer: Arc<dyn KvObserver> = match (builder.kv_events, &g4) {
            (false, _) => Arc::new(NoObserver),
            (true, Some(g4)) => Arc::new(builder.new_publisher(builder.node).with_feed(g4.feed.clone())),
            (true, None) => builder.publisher(builder.node),
        };
        let g2 = g2.map(|(pool, registry)| G2Tier::new(pool, registry).with_observer(observer.clone()));
        // Where engines store (their G2, and G3 behind it), their blocks are reported under the
        // node's names too, for the router.
        let engine_names = engines_g2.is_some().then(|| Arc::new(EngineNames::new(observer.clone())));
        let engines_observer: Arc<dyn KvObserver> = match &engine_names {
            Some(names) => names.clone(),
            None => observer.clone(),
        };
        let engines_g2 =
            engines_g2.map(|(pool, registry)| G2Tier::new(pool, registry).with_observer(engines_observer.clone()));
        let g3 = g3.map(|(store, registry)| {
            G3Tier::new(store, registry).with_observer(engines_observer).with_write_rate(settings.g3_write_rate)
        });
        // What G3 recovered at start-up is already there: the index learns it first.
        if g3.is_some() {
            for header in &recovery.blocks {
                observer.stored(BlockSite::Node(TierName::G3), header.parent, &[header.hash]);
            }
        }
        let g2_blocks = g2.as_ref().map_or(0, |g2| g2.capacity());
        let routing = Routing {
            salt: settings.salt,
            block_tokens: settings.block_tokens,
            cost: settings.cost.clone(),
            g2_blocks,
        };
        let tiers = Arc::new(NodeTiers {
            block_tokens: settings.block_tokens,
            salt: settings.salt,
            layout: settings.layout,
            retention: settings.retention,
            g2,
            engines_g2,
            g3,
            write_batch: settings.write_batch,
            cost: settings.cost,
            measured: Default::default(),
            observer,
            engine_names,
            leases,
            g4,
        });
        let store = |watermarks: Watermarks| StoreArgs {
            tiers: tiers.clone(),
            watermarks,
            period: STORE_PERIOD,
            failures_to_degrade: G3_FAILURES_TO_DEGRADE,
        };
        let stores = (
            tiers.g2.as_ref().and(plan.g2.as_ref()).map(|p| store(p.watermarks)),
            tiers.g3.as_ref().and(plan.g3.as_ref()).map(|p| store(p.watermarks)),
        );
        NodeTiered { builder, routing, tiers, stores }
    }
}

/// What the node's tiers are besides their stores.
#[derive(Clone, Debug)]
pub struct TierSettings {
    /// Tokens per block.
    pub block_tokens: usize,
    /// The salt of every block hash.
    pub salt: Salt,
    /// Image layout of one block.
    pub layout: BlockLayout,
    /// Retention per region.
    pub retention: RetentionSection,
    /// Write-through batch bounds.
    pub write_batch: WriteBatch,
    /// The disk's write rate (`tiers.g3.write_gb_s`), which bounds G3's write backlog; `None`:
    /// timed on the node's own writes.
    pub g3_write_rate: Option<BytesPerSec>,
    /// The node's one cost model: the workers decide "load or recompute?" with it and the
    /// scheduler ranks them with it.
    pub cost: CostModel,
    /// Whether the node serves its G2 to peers and loads from theirs (`tiers.g4.enabled`).
    pub g4: bool,
}

/// Stage 3: the tiers are built; engine factories take [`NodeTiered::tiers`].
#[derive(Debug)]
pub struct NodeTiered {
    builder: NodeBuilder,
    routing: Routing,
    tiers: Arc<NodeTiers>,
    stores: (Option<StoreArgs>, Option<StoreArgs>),
}

impl NodeTiered {
    /// The tiers every worker of the node shares.
    pub fn tiers(&self) -> &Arc<NodeTiers> {
        &self.tiers
    }

    /// The index the scheduler will route by.
    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.builder.index
    }

    /// The node's workers: `engines.workers` of them, each building its engine with
    /// `engines.factory` where `engines.host` says.
    pub fn engines(self, engines: EngineSet) -> NodeEngines {
        let NodeTiered { builder, routing, tiers, stores } = self;
        let leases: Arc<dyn LeasedTiers> = tiers.clone();
        NodeEngines { builder, routing, tiers: Some(tiers), leases: Some(leases), stores, engines }
    }
}

/// Stage 3 of a node without stores.
#[derive(Debug)]
pub struct NodeSimulated {
    builder: NodeBuilder,
    routing: Routing,
    leases: Option<Arc<dyn LeasedTiers>>,
}

impl NodeSimulated {
    /// The index the scheduler will route by.
    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.builder.index
    }

    /// Requests' `cache_control` leases go to `leases` (a simulated node's tiers); without this
    /// they lease nothing.
    pub fn leases(mut self, leases: Arc<dyn LeasedTiers>) -> Self {
        self.leases = Some(leases);
        self
    }

    /// The node's workers (see [`NodeTiered::engines`]).
    pub fn engines(self, engines: EngineSet) -> NodeEngines {
        let NodeSimulated { builder, routing, leases } = self;
        NodeEngines { builder, routing, tiers: None, leases, stores: (None, None), engines }
    }
}

/// The workers of a node.
#[derive(Clone)]
pub struct EngineSet {
    /// How many.
    pub workers: usize,
    /// Builds worker `id`'s engine, on its host, at start and after a restart.
    pub factory: EngineFactory,
    /// Where the engines run: their own threads, or a `LocalSet`.
    pub host: EngineHost,
    /// Requests waiting at most per worker.
    pub queue_bound: usize,
    /// The order they wait in.
    pub queue_policy: QueuePolicy,
}

impl std::fmt::Debug for EngineSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineSet")
            .field("workers", &self.workers)
            .field("host", &self.host)
            .field("queue_bound", &self.queue_bound)
            .field("queue_policy", &self.queue_policy)
            .finish_non_exhaustive()
    }
}

/// How the scheduler routes and keeps sessions.
#[derive(Clone, Debug, PartialEq)]
pub struct Scheduling {
    /// Worker choice.
    pub policy: RoutingPolicy,
    /// A session ends after this long without a turn.
    pub session_idle_timeout: Duration,
    /// Sessions tracked at once.
    pub max_sessions: usize,
    /// Seed of the `random` policy and of temperature sampling.
    pub seed: u64,
    /// The session's previous worker wins unless another is estimated better by more than this.
    pub sticky_bonus: Duration,
    /// Softmax temperature over the estimates in milliseconds; 0 picks the best.
    pub temperature: f64,
    /// Workers per node when one scheduler routes over several nodes (0: all on this one).
    pub workers_per_node: usize,
    /// Working-set admission of sessions' turns (`cache_blocks` is filled in from the tiers).
    pub admission: Admission,
}

impl Scheduling {
    /// `[router]`, the session bounds of `[frontend]` and `model.seed`, on one node.
    pub fn from_config(cfg: &NodeConfig) -> Self {
        Self {
            policy: cfg.router.policy,
            session_idle_timeout: cfg.frontend.session_idle_timeout.as_duration(),
            max_sessions: cfg.frontend.max_sessions,
            seed: cfg.model.seed,
            sticky_bonus: cfg.router.sticky_bonus.as_duration(),
            temperature: cfg.router.temperature,
            workers_per_node: 0,
            admission: Admission {
                working_set: cfg.router.working_set,
                cache_blocks: 0,
                session_gap: cfg.router.session_gap.as_duration(),
                max_wait: cfg.router.admission_max_wait.as_duration(),
                late_binding: cfg.router.late_binding.as_duration(),
            },
        }
    }
}

/// Stage 4: everything the actor tree starts from.
#[derive(Debug)]
pub struct NodeEngines {
    builder: NodeBuilder,
    routing: Routing,
    tiers: Option<Arc<NodeTiers>>,
    leases: Option<Arc<dyn LeasedTiers>>,
    stores: (Option<StoreArgs>, Option<StoreArgs>),
    engines: EngineSet,
}

impl NodeEngines {
    /// Starts the NodeSupervisor — the scheduler, the store actors, one WorkerActor per engine —
    /// and returns its handles. Call it inside the runtime (and, for engines on a `LocalSet`,
    /// inside that `LocalSet`) the node runs on.
    pub async fn spawn(self, scheduling: Scheduling) -> Result<RunningNode, BuildError> {
        let NodeEngines { builder, routing, tiers, leases, stores, engines } = self;
        let args = NodeArgs {
            workers: (0..engines.workers)
                .map(|id| WorkerArgs {
                    id,
                    factory: engines.factory.clone(),
                    queue_bound: engines.queue_bound,
                    queue_policy: engines.queue_policy,
                    host: engines.host.clone(),
                })
                .collect(),
            scheduler: SchedulerArgs {
                policy: scheduling.policy,
                session_idle_timeout: scheduling.session_idle_timeout,
                max_sessions: scheduling.max_sessions,
                seed: scheduling.seed,
                kv: Some(KvRouting {
                    index: builder.index.clone(),
                    writer: builder.writer.clone(),
                    node: builder.node,
                    workers_per_node: scheduling.workers_per_node,
                    salt: routing.salt,
                    block_tokens: routing.block_tokens,
                    cost: routing.cost.clone(),
                    tiers: tiers.clone(),
                    leases: leases.clone(),
                    sticky_bonus: scheduling.sticky_bonus,
                    temperature: scheduling.temperature,
                    admission: Admission { cache_blocks: routing.g2_blocks, ..scheduling.admission },
                }),
            },
            g2: stores.0,
            g3: stores.1,
        };
        let (root, join) = Actor::spawn(None, NodeSupervisor, args).await.map_err(BuildError::Spawn)?;
        let scheduler = match root.call(NodeMsg::Scheduler, None).await {
            Ok(CallResult::Success(scheduler)) => scheduler,
            _ => {
                root.stop(None);
                let _ = join.await;
                return Err(BuildError::NoScheduler);
            }
        };
        let index_metrics = builder.index_metrics.map(|period| {
            let polled = builder.index.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(period);
                loop {
                    tick.tick().await;
                    let stats = polled.stats();
                    crate::telemetry::publish_index(stats.blocks, stats.resyncs);
                }
            })
        });
        Ok(RunningNode { root, scheduler, tiers, index: builder.index, cost: routing.cost, join, index_metrics })
    }
}

/// A running node's handles.
#[derive(Debug)]
pub struct RunningNode {
    /// The root of the actor tree.
    pub root: NodeRef,
    /// The scheduler as it was at start (it changes when it is restarted:
    /// [`RunningNode::current_scheduler`]).
    pub scheduler: SchedulerRef,
    /// The tiers the workers share, with the observer (the node's KV publisher) they report
    /// every change of where blocks are to; none for a simulated node, whose engines publish
    /// through [`NodeBuilder::publisher`].
    pub tiers: Option<Arc<NodeTiers>>,
    /// The global prefix index the scheduler routes by.
    pub index: Arc<PrefixIndex>,
    /// The node's one cost model, as the tiers and the scheduler got it.
    pub cost: CostModel,
    join: tokio::task::JoinHandle<()>,
    index_metrics: Option<tokio::task::JoinHandle<()>>,
}

impl RunningNode {
    /// The scheduler as it is now.
    pub async fn current_scheduler(&self) -> Result<SchedulerRef, BuildError> {
        current_scheduler(&self.root, None).await
    }

    /// Stops taking requests, lets the workers finish their queues and flush write-through, and
    /// waits for the tree to stop.
    pub async fn shutdown(self) {
        if let Some(poller) = self.index_metrics {
            poller.abort();
        }
        let _ = self.root.call(NodeMsg::Shutdown, None).await;
        let _ = self.join.await;
    }
}

/// The scheduler of the node rooted at `root` as it is now, waiting at most `timeout` for the
/// supervisor's answer.
pub async fn current_scheduler(root: &NodeRef, timeout: Option<Duration>) -> Result<SchedulerRef, BuildError> {
    match root.call(NodeMsg::Scheduler, timeout).await {
        Ok(CallResult::Success(scheduler)) => Ok(scheduler),
        _ => Err(BuildError::NoScheduler),
    }
}

#[cfg(test)]
mod tests {
    use dynamo_config::{Dtype, ModelShape, PerTier, RegionKind};
    use dynamo_tiering::block::{BlockHash, ImageSpec, RetentionMeta, seal};
    use dynamo_tiering::g2::{MlockPolicy, align_up};
    use dynamo_tiering::g3::EngineChoice;
    use dynamo_tiering::g3::superblock::file_bytes;

    use super::*;
    use crate::scheduler::SchedulerMsg;
    use crate::worker::{Engine, Finish, GenOutcome, GenRequest, JobEvent, LocalFuture, Ticket, WorkerEvent};

    /// Answers every request at once with its worker's id.
    struct Echo(usize);

    impl Engine for Echo {
        fn admit(&mut self, mut ticket: Ticket) -> LocalFuture<'_, ()> {
            Box::pin(async move {
                let prompt = ticket.req.prompt.len();
                ticket.event(WorkerEvent::Prefilled { cached_tokens: 0, hit_tokens: PerTier::default() });
                ticket.event(WorkerEvent::Token(self.0 as u32));
                ticket.finish(Ok(GenOutcome {
                    tokens: vec![self.0 as u32],
                    cached_tokens: 0,
                    hit_tokens: PerTier::default(),
                    prefill_tokens: prompt,
                    finish: Finish::Length,
                    ttft: Duration::ZERO,
                    corrupt_blocks: 0,
                }));
            })
        }

        fn reset(&mut self, _: &str) -> usize {
            0
        }

        fn flush(&mut self) -> LocalFuture<'_, ()> {
            Box::pin(async {})
        }
    }

    const BLOCK_TOKENS: usize = 4;

    fn layout() -> BlockLayout {
        BlockLayout::for_model(&ModelShape::named("tiny").expect("tiny"), Dtype::F32, BLOCK_TOKENS)
    }

    fn marks() -> Watermarks {
        Watermarks { high: 0.9, low: 0.8 }
    }

    /// G2 of 16 slots and G3 of 32 in `dir`.
    fn plan(dir: &std::path::Path) -> StorePlan {
        let slot_bytes = align_up(layout().image_bytes());
        let pool = HostPoolOptions { slot_bytes, slots: 16, mlock: MlockPolicy::Off };
        StorePlan {
            g2: Some(G2Plan::new(pool, PolicyKind::Lru, marks())),
            engines_g2: None,
            g3: Some(G3Plan {
                options: G3Options {
                    paths: vec![dir.join("g3.data")],
                    capacity_per_path: file_bytes(32, slot_bytes as u64),
                    slot_bytes,
                    direct_io: false,
                    engine: EngineChoice::Psync { threads: 2 },
                    format_foreign: false,
                },
                policy: PolicyKind::Lru,
                watermarks: marks(),
            }),
            lease_budget: 0.5,
        }
    }

    fn settings() -> TierSettings {
        TierSettings {
            block_tokens: BLOCK_TOKENS,
            salt: Salt(9),
            layout: layout(),
            retention: RetentionSection::default(),
            write_batch: WriteBatch::default(),
            g3_write_rate: None,
            cost: CostModel::unknown(BLOCK_TOKENS, layout().image_bytes()),
            g4: false,
        }
    }

    fn echoes(workers: usize) -> EngineSet {
        EngineSet {
            workers,
            factory: Arc::new(|id| Ok(Box::new(Echo(id)) as Box<dyn Engine>)),
            host: EngineHost::Thread,
            queue_bound: 4,
            queue_policy: QueuePolicy::Fcfs,
        }
    }

    fn scheduling() -> Scheduling {
        Scheduling {
            policy: RoutingPolicy::RoundRobin,
            session_idle_timeout: Duration::from_secs(60),
            max_sessions: 16,
            seed: 1,
            sticky_bonus: Duration::ZERO,
            temperature: 0.0,
            workers_per_node: 0,
            admission: Admission::OFF,
        }
    }

    async fn build(dir: &std::path::Path) -> RunningNode {
        let plan = plan(dir);
        let stores = tokio::task::spawn_blocking(move || NodeBuilder::new(IndexConfig::default()).open(&plan))
            .await
            .expect("open task")
            .expect("open");
        stores.tiers(settings()).engines(echoes(2)).spawn(scheduling()).await.expect("spawn")
    }

    async fn answer(scheduler: &SchedulerRef, prompt: Vec<u32>) -> GenOutcome {
        let req = GenRequest::greedy(prompt, 1);
        let reply = scheduler.call(
            |reply| SchedulerMsg::Submit { req: Box::new(req), session: None, hints: Default::default(), reply },
            None,
        );
        let CallResult::Success(Ok(mut submitted)) = reply.await.expect("the scheduler answers") else {
            panic!("refused")
        };
        while let Some(event) = submitted.events.recv().await {
            match event {
                JobEvent::Done(outcome) => return outcome,
                JobEvent::Failed(e) => panic!("failed: {e}"),
                JobEvent::Event(_) => {}
            }
        }
        panic!("no answer")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_built_node_serves_requests_through_its_scheduler_and_shares_one_cost_model() {
        let dir = tempfile::tempdir().unwrap();
        let node = build(dir.path()).await;
        let tiers = node.tiers.clone().expect("a node with stores has tiers");
        assert!(tiers.g2.is_some() && tiers.g3.is_some());
        assert_eq!(tiers.cost, node.cost, "the tiers and the router weigh loads with one model");
        // Round-robin over the two echo engines: each answers with its id.
        let mut workers = Vec::new();
        for i in 0..2 {
            let outcome = answer(&node.scheduler, vec![i, 1, 2, 3, 4]).await;
            assert_eq!(outcome.prefill_tokens, 5);
            workers.push(outcome.tokens[0]);
        }
        workers.sort_unstable();
        assert_eq!(workers, [0, 1]);
        assert_eq!(node.current_scheduler().await.unwrap().get_id(), node.scheduler.get_id());
        node.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rebuilt_node_recovers_what_g3_held_into_its_registry_and_its_index() {
        let dir = tempfile::tempdir().unwrap();
        let chain = [(BlockHash(11), None), (BlockHash(12), Some(BlockHash(11)))];
        let node = build(dir.path()).await;
        let tiers = node.tiers.clone().unwrap();
        let (g2, g3) = (tiers.g2.as_ref().unwrap(), tiers.g3.as_ref().unwrap());
        for (hash, parent) in chain {
            let mut slot = g2.pool.try_alloc().unwrap();
            let retention = RetentionMeta { region: RegionKind::System, priority: 90, ..RetentionMeta::default() };
            seal(
                slot.as_mut_slice(),
                &ImageSpec { hash, parent, salt: Salt(9), layout: layout(), token_count: 4, retention },
            );
            g3.store.write(slot.freeze()).await.unwrap();
        }
        drop(tiers);
        node.shutdown().await;

        let plan = plan(dir.path());
        let stores = tokio::task::spawn_blocking(move || NodeBuilder::new(IndexConfig::default()).open(&plan))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(stores.recovery().blocks.len(), 2);
        {
            let registry = stores.g3_registry().unwrap().lock().unwrap();
            assert_eq!(registry.len(), 2);
            let child = registry.meta(BlockHash(12)).expect("the child is registered");
            assert_eq!((child.parent, child.region, child.priority), (Some(BlockHash(11)), RegionKind::System, 90));
        }
        let index = stores.index().clone();
        let node = stores.tiers(settings()).engines(echoes(1)).spawn(scheduling()).await.unwrap();
        // The index learned the recovered chain as this node's G3.
        assert_eq!(index.stats().blocks, 2);
        node.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_reaching_a_session_that_is_ending_is_still_served() {
        // One session at a time: each request of the other conversation ends the current one
        // while the requests sent before it may still be in its mailbox.
        let dir = tempfile::tempdir().unwrap();
        let plan = plan(dir.path());
        let stores = tokio::task::spawn_blocking(move || NodeBuilder::new(IndexConfig::default()).open(&plan))
            .await
            .unwrap()
            .unwrap();
        let engines = EngineSet { queue_bound: 1024, ..echoes(2) };
        let node = stores
            .tiers(settings())
            .engines(engines)
            .spawn(Scheduling { max_sessions: 1, ..scheduling() })
            .await
            .unwrap();
        let calls = (0..200u32).map(|i| {
            let req = GenRequest::greedy(vec![i, 1, 2], 1);
            let session = Some(if i % 2 == 0 { "a" } else { "b" }.to_string());
            node.scheduler.call(
                move |reply| SchedulerMsg::Submit { req: Box::new(req), session, hints: Default::default(), reply },
                None,
            )
        });
        let mut served = 0;
        for reply in futures::future::join_all(calls).await {
            match reply {
                Ok(CallResult::Success(Ok(_))) => served += 1,
                other => panic!("a request was lost: {other:?}"),
            }
        }
        assert_eq!(served, 200);
        node.shutdown().await;
    }

    #[test]
    fn g3_without_g2_is_refused_and_an_empty_plan_opens_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let plan = StorePlan { g2: None, ..plan(dir.path()) };
        let err = NodeBuilder::new(IndexConfig::default()).open(&plan).unwrap_err();
        assert_eq!(err.kind(), "g3_without_g2");
        let stores = NodeBuilder::new(IndexConfig::default()).open(&StorePlan::default()).unwrap();
        assert!(stores.g2_pool().is_none() && stores.g3_store().is_none() && stores.recovery().blocks.is_empty());
        let tiered = stores.tiers(settings());
        assert!(tiered.tiers().g2.is_none() && tiered.tiers().g3.is_none());
    }

    #[test]
    fn the_reserve_keeps_a_few_g2_slots_free_for_transfers() {
        assert_eq!(g2_reserve(16), 4);
        assert_eq!(g2_reserve(6), 3, "never more than half a small pool");
        assert_eq!(g2_reserve(1600), 100);
        assert_eq!(g2_reserve(1 << 20), 256);
        let plan = G2Plan::new(
            HostPoolOptions { slot_bytes: 4096, slots: 64, mlock: MlockPolicy::Off },
            PolicyKind::Lru,
            marks(),
        );
        assert_eq!(plan.resident, 60);
    }
}
