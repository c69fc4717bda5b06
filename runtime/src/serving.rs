//! The serving side of a node: the actor tree over the node's tiers, built by the node builder
//! ([`dynamo_actors::builder`]), and the HTTP frontend's [`Generator`] on top of it.
//!
//! [`Serving::open`] opens the node's stores from the resolved configuration (G3's registry
//! rebuilt from what it recovered). [`Serving::start`] loads the model once, measures its prefill
//! throughput (the cost model's "is loading faster than recomputing?"), builds the tiers with that
//! one cost model, and starts the NodeSupervisor with one reference WorkerActor per
//! `engine.workers` on threads of their own, the SchedulerActor and the G2/G3 store actors.
//! [`NodeGenerator`] hands each request to the scheduler, which queues it on a worker or answers
//! "overloaded" at once.
//!
//! The workers' engines run where [`EngineDevice`] says. On CUDA each worker opens its own backend
//! (stream, cuBLAS, kernels) on its device, in its engine thread, with its G1 pool in device memory;
//! the G2 pool is registered with the device once (page-locked and mapped), and every worker's
//! backend gathers into and scatters from it directly.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use dynamo_actors::builder::{EngineSet, NodeBuilder, NodeStores, NodeTiered, RunningNode, Scheduling, TierSettings};
use dynamo_actors::cost::{BytesPerSec, CostModel, Prefill};
use dynamo_actors::index::IndexConfig;
use dynamo_actors::leases::{self, LeasedTiers};
use dynamo_actors::scheduler::{Hints, SchedulerMsg, SchedulerRef, SubmitError};
use dynamo_actors::supervisor::NodeRef;
use dynamo_actors::tiers::{NodeTiers, WriteBatch};
use dynamo_actors::worker::{
    Engine, EngineFactory, EngineHost, Finish, GenRequest, JobEvent, LeaseRequest, Naming, VllmEngine, VllmTarget,
    Worker, WorkerError, WorkerEvent,
};
use dynamo_config::{EngineKind, NodeConfig};
use dynamo_kernels::cuda::{CudaBackend, HostRegistration};
use dynamo_kernels::model::{HostWeights, Llama};
use dynamo_kernels::sampling::TokenSet;
use dynamo_kernels::{Backend, CpuBackend};
use dynamo_tiering::block::{Namespace, Salt, SaltInputs};
use dynamo_tiering::registry::PolicyKind;
use futures::StreamExt;
use futures::stream::BoxStream;
use ractor::rpc::CallResult;

use crate::frontend::{FinishReason, GenerateError, GenerateEvent, GenerateRequest, Generator};
use crate::plan::{EngineDevice, ResolvedTiers};
use crate::vllm::launch::Launched;

/// How often the index's size is published to the metrics.
const INDEX_METRICS_PERIOD: Duration = Duration::from_secs(1);
/// What a client is told to wait before retrying a refused request when the scheduler has no
/// estimate (a full node's own estimate comes from its queues).
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The node's running actor tree.
#[derive(Debug)]
pub struct Serving {
    /// The G2 pool's registration with the CUDA device. Declared before `node` and `tiers`, so it
    /// is dropped (the pool unregistered) before the pool can be.
    _g2_registration: Option<Arc<HostRegistration>>,
    /// The running tree's handles.
    pub node: RunningNode,
    /// The tiers the workers share.
    pub tiers: Arc<NodeTiers>,
    /// The model's name as clients address it.
    pub model: String,
    /// Longest prompt plus generation a request may have, in tokens.
    pub max_context: usize,
    /// Measured prefill throughput of one worker, tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Measured time of one decode step of one worker.
    pub decode_step: Duration,
    /// Where the leases are saved while the node runs (the outer ring's lease saver): none
    /// without G3, which is all that survives a restart.
    pub lease_file: Option<PathBuf>,
    /// The vLLM engines the node launched (`[engine.vllm.launch]`), stopped after the workers.
    launched: Option<Launched>,
}

/// The file in `node.data_dir` where the node's live leases outlast a restart.
pub const LEASE_FILE: &str = "leases.bin";

/// How often the leases are saved while they change (a crash loses at most this much).
const LEASE_SAVE_PERIOD: Duration = Duration::from_secs(10);

/// The actor tree over `tiered`: `workers` workers, each on a thread of its own with the engine
/// `factory` builds, queued and routed as `cfg` says.
async fn spawn_tree(
    cfg: &NodeConfig,
    tiered: NodeTiered,
    workers: usize,
    factory: EngineFactory,
) -> anyhow::Result<RunningNode> {
    let engines = EngineSet {
        workers,
        factory,
        host: EngineHost::Thread,
        queue_bound: cfg.engine.max_queued_requests.max(1),
        queue_policy: cfg.router.queue_policy,
    };
    Ok(tiered.engines(engines).spawn(Scheduling::from_config(cfg)).await?)
}

/// The node's one cost model, for the router and the workers alike, from its engines' prefill
/// rate and decode step (timed at start).
fn cost_model(cfg: &NodeConfig, plan: &ResolvedTiers, prefill_tokens_per_s: f64, decode_step: Duration) -> CostModel {
    CostModel {
        block_tokens: plan.block_tokens,
        image_bytes: plan.layout.image_bytes(),
        prefill: Prefill::rate(prefill_tokens_per_s),
        decode_s_per_token: Some(decode_step.as_secs_f64()).filter(|s| *s > 0.0),
        // Decodes run batched alongside prefills (the reference engine's and vLLM's): queued
        // decode work barely delays a first token.
        decode_weight: 0.0,
        // G2 → G1: measured on the workers' batched loads (until then, loads are taken).
        g2_read: None,
        // G3: a configured disk rate stands; otherwise measured on real reads.
        g3_read: cfg.tiers.g3.read_gb_s.and_then(|gb| BytesPerSec::new(gb * 1e9)),
        // Peers: measured on real fetches (until then, loads are taken).
        g4_read: None,
    }
}

/// The salt of every block name the node computes: the model, its weights and adapter, and the
/// engine kind whose layout the blocks have. The reference engine's blocks and a vLLM engine's
/// differ for the same model, so their names differ too: a node never prices, nor asks a peer
/// for, a block its workers cannot load. (Peers' feeds carry the names of vLLM engines' blocks,
/// so this holds across nodes as well.)
fn node_salt(cfg: &NodeConfig, model: &str) -> Salt {
    let weights = match &cfg.model.path {
        Some(dir) => dir.display().to_string(),
        None => format!("random-seed-{}", cfg.model.seed),
    };
    let model = match cfg.engine.kind {
        EngineKind::Vllm => format!("{model}@vllm"),
        _ => model.to_owned(),
    };
    Salt::derive(&SaltInputs {
        model: &model,
        weights_digest: &weights,
        lora: cfg.model.lora.as_deref().unwrap_or(""),
        cache_salt: "",
    })
}

/// The node's tiers over `stores`, with blocks named under `salt` and loads priced by `cost`;
/// a named calibration seeds the link and disk rates until this machine's are timed, and the
/// leases saved before a restart are restored (where their blocks survive: in G3). Also where the
/// leases are saved from now on.
fn open_tiers(
    cfg: &NodeConfig,
    plan: &ResolvedTiers,
    stores: NodeStores,
    salt: Salt,
    cost: CostModel,
) -> anyhow::Result<(NodeTiered, Arc<NodeTiers>, Option<PathBuf>)> {
    let tiered = stores.tiers(TierSettings {
        block_tokens: plan.block_tokens,
        salt,
        layout: plan.layout,
        retention: cfg.retention.clone(),
        write_batch: WriteBatch::from_config(&cfg.tiers),
        g3_write_rate: cfg.tiers.g3.write_gb_s.and_then(|gb| BytesPerSec::new(gb * 1e9)),
        cost,
        g4: cfg.tiers.g4.enabled,
    });
    let tiers = tiered.tiers().clone();
    if cfg.engine.calibration.is_some() {
        tiers.measured.seed(&cfg.calibration().context("engine.calibration")?);
    }
    let lease_file = tiers.g3.is_some().then(|| cfg.node.data_dir.join(LEASE_FILE));
    if let Some(path) = &lease_file {
        restore_leases(&tiers, path);
    }
    Ok((tiered, tiers, lease_file))
}

/// Restores what `path` saved onto the blocks G3 recovered (before the node serves).
fn restore_leases(tiers: &Arc<NodeTiers>, path: &std::path::Path) {
    let slots = tiers.g3.as_ref().map_or(0, |g3| g3.store.capacity_slots());
    match read_lease_file(path, leases::file_bytes(slots)) {
        Ok(bytes) => match leases::decode(&bytes) {
            Ok(saved) => {
                let saved = leases::clamp(saved, tiers.now());
                let restored = tiers.restore(&saved, tiers.now());
                tracing::info!(path = %path.display(), saved = saved.len(), restored, "restored leases");
            }
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "ignoring the saved leases"),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(path = %path.display(), error = %e, "could not read the saved leases"),
    }
}

/// Saves the node's live leases to `path` every [`LEASE_SAVE_PERIOD`] while they change, until
/// stopped: the outer ring's lease saver, which saves once more when it stops.
pub(crate) fn save_leases_periodically(tiers: Arc<NodeTiers>, path: PathBuf) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut saved_at = tiers.leases.changes();
        let mut tick = tokio::time::interval(LEASE_SAVE_PERIOD);
        tick.tick().await;
        loop {
            tick.tick().await;
            let changes = tiers.leases.changes();
            if changes != saved_at {
                saved_at = changes;
                let (tiers, path) = (tiers.clone(), path.clone());
                let _ = tokio::task::spawn_blocking(move || save_leases(&tiers, &path)).await;
            }
        }
    })
}

/// The bytes of the lease file at `path`, read only if it is what the node wrote: a regular file
/// (not followed through a symbolic link, never waited on as a FIFO or a device would be) of at
/// most `limit` bytes.
fn read_lease_file(path: &std::path::Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file =
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path)?;
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "not a regular file"));
    }
    if meta.len() > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} bytes, more than G3's blocks can have leases for ({limit})", meta.len()),
        ));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.by_ref().take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "it grew while it was read"));
    }
    Ok(bytes)
}

/// Writes the live leases of `tiers` to `path` (a new file renamed over the old one, so a crash
/// mid-write leaves the previous save).
pub(crate) fn save_leases(tiers: &NodeTiers, path: &std::path::Path) {
    let bytes = leases::encode(&tiers.leases.snapshot(tiers.now()));
    let tmp = path.with_extension("tmp");
    let written = (|| -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut f = std::fs::File::create(&tmp)?;
        std::io::Write::write_all(&mut f, &bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        tracing::warn!(path = %path.display(), error = %e, "could not save the leases");
    }
}

impl Serving {
    /// Opens the node's stores as `plan` resolved them, with the prefix index of `[router]` fed
    /// by a writer thread of its own. Blocks while G3 scans its slots.
    pub fn open(cfg: &NodeConfig, plan: &ResolvedTiers) -> anyhow::Result<NodeStores> {
        let builder = NodeBuilder::new(IndexConfig {
            max_blocks: cfg.router.index_max_blocks,
            approximate_ttl: cfg.router.approximate_ttl.as_duration(),
        })
        .with_index_writer()?
        .with_index_metrics(INDEX_METRICS_PERIOD);
        Ok(builder.open(&plan.store_plan(&cfg.tiers)?)?)
    }

    /// Loads the model, measures it, and starts the actor tree over `stores`; with
    /// `engine.kind = "vllm"`, attaches to the engines instead ([`Self::start_vllm`]).
    pub async fn start(cfg: &NodeConfig, plan: &ResolvedTiers, stores: NodeStores) -> anyhow::Result<Self> {
        if cfg.engine.kind == EngineKind::Vllm {
            return Self::start_vllm(cfg, plan, stores).await;
        }
        let model_cfg = cfg.model.clone();
        let shape = plan.shape;
        let weights = tokio::task::spawn_blocking(move || -> anyhow::Result<HostWeights> {
            Ok(match &model_cfg.path {
                Some(dir) => {
                    HostWeights::load(dir).with_context(|| format!("loading weights from {}", dir.display()))?
                }
                None => HostWeights::random(shape, model_cfg.seed),
            })
        })
        .await
        .context("start-up task")??;
        let weights = Arc::new(weights);
        let salt = node_salt(cfg, plan.shape.name);
        let workers = cfg.engine.workers.max(1);
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let threads_each = (cores / workers).max(1);
        let pages = plan.g1.blocks as usize;
        let block_tokens = plan.block_tokens;
        let device = plan.device.clone();

        // The engine's rates, measured on the device the workers use; on CUDA the same backend
        // then registers the G2 pool with the device.
        let measure_weights = weights.clone();
        let g2_pool = stores.g2_pool().cloned();
        let batch_blocks = (cfg.engine.max_batch_tokens / block_tokens).max(4);
        let (prefill_tokens_per_s, decode_step, g2_registration) =
            tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
                match device {
                    EngineDevice::Cpu => {
                        let model = Llama::new(CpuBackend::new(threads_each), measure_weights.as_ref())
                            .context("building the model")?;
                        let (rate, step) = measure_engine(&model, block_tokens, 4)?;
                        Ok((rate, step, None))
                    }
                    EngineDevice::Cuda(info) => {
                        let backend = CudaBackend::new(info.ordinal)
                            .with_context(|| format!("opening {info} for the first worker"))?;
                        tracing::info!(device = %info, attention = %backend.attention_kernel(), "CUDA engine");
                        let registration = match &g2_pool {
                            // SAFETY: the pool's mapping lives in the node's tiers, which outlive the
                            // registration: `Serving` declares it first and so drops it first.
                            Some(pool) => Some(Arc::new(
                                unsafe { backend.register_host(pool.region().0, pool.region().1) }
                                    .context("registering the G2 pool with the device")?,
                            )),
                            None => None,
                        };
                        let model = Llama::new(backend, measure_weights.as_ref()).context("uploading the model")?;
                        // One full forward pass of the engine (`engine.max_batch_tokens`).
                        let (rate, step) = measure_engine(&model, block_tokens, batch_blocks)?;
                        Ok((rate, step, registration))
                    }
                }
            })
            .await
            .context("start-up task")??;

        let cost = cost_model(cfg, plan, prefill_tokens_per_s, decode_step);
        let (tiered, tiers, lease_file) = open_tiers(cfg, plan, stores, salt, cost)?;

        let spec = EngineSpec {
            weights,
            tiers: tiers.clone(),
            pages,
            policy: plan.g1.policy,
            prefill_chunk: cfg.engine.max_batch_tokens,
            max_running: cfg.engine.max_running_requests,
        };
        // Called on each worker's engine thread, at start and after a restart.
        let factory: EngineFactory = match plan.device.clone() {
            EngineDevice::Cpu => Arc::new(move |id| spec.engine(CpuBackend::new(threads_each), id)),
            device @ EngineDevice::Cuda(_) => {
                let registration = g2_registration.clone();
                Arc::new(move |id| {
                    let ordinal = device.ordinal_of(id).unwrap_or(0);
                    let backend = CudaBackend::new(ordinal).map_err(dynamo_kernels::model::ModelError::from)?;
                    if let Some(registration) = &registration {
                        registration.share(&backend);
                    }
                    spec.engine(backend, id)
                })
            }
        };
        let node = spawn_tree(cfg, tiered, workers, factory).await?;
        Ok(Self {
            _g2_registration: g2_registration,
            node,
            tiers,
            model: cfg.model.name.clone(),
            max_context: match &cfg.model.path {
                // The reference engine attends to every earlier position: a sliding-window model
                // is computed exactly only within its window.
                Some(dir) => match dynamo_kernels::model::weights::read_hf_config(dir)?.sliding_window {
                    Some(window) if window < pages * block_tokens => {
                        tracing::warn!(window, "the model's sliding window caps the context");
                        window
                    }
                    _ => pages * block_tokens,
                },
                None => pages * block_tokens,
            },
            prefill_tokens_per_s,
            decode_step,
            lease_file,
            launched: None,
        })
    }

    /// Attaches to `[engine.vllm]`'s engines (each checked to serve `model.path`'s tokenizer) and
    /// starts the actor tree over `stores` with one worker per engine, forwarding token ids. The
    /// engines compute, sample and keep G1; the node's tiers stay the node's (and the engines',
    /// through the engine endpoint).
    async fn start_vllm(cfg: &NodeConfig, plan: &ResolvedTiers, stores: NodeStores) -> anyhow::Result<Self> {
        let dir = cfg.model.path.as_deref().context("engine.kind = \"vllm\" needs model.path")?;
        let tokenizer = crate::tokenizer::Tokenizer::from_dir(dir)
            .with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
        let vocab = dynamo_kernels::model::weights::read_hf_config(dir)?.vocab_size.max(tokenizer.vocab_size());
        let launched = match cfg.engine.vllm.launches() {
            true => {
                let guard =
                    std::env::current_exe().context("this binary's path (its engine-guard runs each engine)")?;
                Some(Launched::start(cfg, plan.block_tokens, &guard).await?)
            }
            false => None,
        };
        let attached = match crate::vllm::attach(&cfg.engine.vllm, &tokenizer, plan.block_tokens).await {
            Ok(attached) => attached,
            Err(e) => {
                if let Some(launched) = launched {
                    launched.stop().await;
                }
                return Err(e);
            }
        };
        let salt = node_salt(cfg, plan.shape.name);
        // The router prices a request on an engine with the engines' rates, as timed at start.
        let engines = attached.len().max(1) as f64;
        let prefill_tokens_per_s = attached.iter().map(|e| e.prefill_tokens_per_s).sum::<f64>() / engines;
        let decode_step =
            Duration::from_secs_f64(attached.iter().map(|e| e.decode_step.as_secs_f64()).sum::<f64>() / engines);
        let cost = cost_model(cfg, plan, prefill_tokens_per_s, decode_step);
        let (tiered, tiers, lease_file) = open_tiers(cfg, plan, stores, salt, cost)?;
        let vllm = &cfg.engine.vllm;
        let targets: Vec<Arc<VllmTarget>> = attached
            .iter()
            .map(|engine| {
                Arc::new(VllmTarget {
                    url: engine.url.clone(),
                    api_key: vllm.api_key.clone(),
                    request_timeout: vllm.request_timeout.as_duration(),
                    vocab,
                    max_running: cfg.engine.max_running_requests,
                    kv_events: engine.kv_events.clone(),
                    load_interval: vllm.load_interval.as_duration(),
                })
            })
            .collect();
        let naming = Naming {
            salt,
            block_tokens: plan.block_tokens,
            observer: tiers.observer.clone(),
            engine_names: tiers.engine_names.clone(),
        };
        let max_context = attached.iter().map(|engine| engine.max_model_len).min().unwrap_or(0);
        let factory: EngineFactory = Arc::new(move |id| {
            let target = targets.get(id).cloned().ok_or_else(|| WorkerError::Engine(format!("no engine {id}")))?;
            Ok(Box::new(VllmEngine::new(id, target, naming.clone())?) as Box<dyn Engine>)
        });
        let node = spawn_tree(cfg, tiered, attached.len(), factory).await?;
        Ok(Self {
            _g2_registration: None,
            node,
            tiers,
            model: cfg.model.name.clone(),
            max_context,
            prefill_tokens_per_s,
            decode_step,
            lease_file,
            launched,
        })
    }

    /// The frontend's generator over this tree; it samples only the ids in `decodable` (those
    /// the tokenizer can decode).
    pub async fn generator(&self, decodable: Arc<TokenSet>) -> anyhow::Result<NodeGenerator> {
        let scheduler = scheduler_of(&self.node.root).await?;
        Ok(NodeGenerator {
            node: self.node.root.clone(),
            scheduler: Arc::new(Mutex::new(scheduler)),
            model: self.model.clone(),
            max_context: self.max_context,
            decodable,
        })
    }

    /// Stops taking requests, lets the workers finish their queues and flush write-through, and
    /// waits for the tree to stop.
    pub async fn shutdown(self) {
        self.node.shutdown().await;
        if let Some(launched) = self.launched {
            launched.stop().await;
        }
    }
}

/// What every worker's engine is built from.
struct EngineSpec {
    weights: Arc<HostWeights>,
    tiers: Arc<NodeTiers>,
    pages: usize,
    policy: PolicyKind,
    prefill_chunk: usize,
    max_running: usize,
}

impl EngineSpec {
    /// Worker `id` on `backend`: the model uploaded, its G1 pool allocated there.
    fn engine<B: Backend + 'static>(&self, backend: B, id: usize) -> Result<Box<dyn Engine>, WorkerError> {
        let model = Llama::new(backend, self.weights.as_ref())?;
        let worker = Worker::new(model, self.tiers.clone(), self.pages, self.policy)?
            .with_id(id)
            .with_prefill_chunk(self.prefill_chunk)
            .with_max_running(self.max_running);
        Ok(Box::new(worker))
    }
}

/// Times a prefill of `prefill_blocks` blocks and one decode step on a scratch KV pool (after one
/// warm-up pass, so thread start-up, first-touch page faults and kernel loading are not counted):
/// the engine's rates for the cost model. A GPU needs a long prefill to show its rate; a CPU's
/// rate shows on a few blocks.
fn measure_engine<B: Backend>(
    model: &Llama<B>,
    block_tokens: usize,
    prefill_blocks: usize,
) -> anyhow::Result<(f64, Duration)> {
    let blocks = prefill_blocks as u32 + 1;
    let mut kv = model.kv_pool(block_tokens, blocks as usize).context("a scratch KV pool")?;
    let table: Vec<u32> = (0..blocks).collect();
    let tokens: Vec<u32> = (0..(prefill_blocks * block_tokens) as u32).collect();
    model.forward(&mut kv, &tokens, 0, &table, block_tokens).context("warming up")?;
    let started = Instant::now();
    model.forward(&mut kv, &tokens, 0, &table, block_tokens).context("measuring prefill")?;
    let prefill = tokens.len() as f64 / started.elapsed().as_secs_f64().max(1e-9);
    let started = Instant::now();
    model.forward(&mut kv, &[1], tokens.len(), &table, block_tokens).context("measuring decode")?;
    Ok((prefill, started.elapsed()))
}

async fn scheduler_of(node: &NodeRef) -> anyhow::Result<SchedulerRef> {
    Ok(dynamo_actors::builder::current_scheduler(node, Some(Duration::from_secs(5))).await?)
}

/// The actor tree as the HTTP frontend's [`Generator`]: each request is routed and queued by the
/// scheduler, and its worker's events become the frontend's stream; dropping the stream stops
/// the request at its next token.
#[derive(Debug, Clone)]
pub struct NodeGenerator {
    node: NodeRef,
    scheduler: Arc<Mutex<SchedulerRef>>,
    model: String,
    max_context: usize,
    decodable: Arc<TokenSet>,
}

impl NodeGenerator {
    /// Submits `job` through the current scheduler; if the scheduler was restarted in between,
    /// asks the supervisor for the new one and tries once more.
    /// [`Self::submit`], and the request's first event. A request whose engine turned out to be
    /// down before it began (it failed having produced nothing) is submitted again, up to
    /// [`REROUTES`] times: its worker is marked down by then, so the router sends it elsewhere
    /// if another worker is up.
    async fn submit_until_started(
        &self,
        job: GenRequest,
        session: Option<String>,
        hints: Hints,
    ) -> Result<(Option<JobEvent>, dynamo_actors::scheduler::Submitted), GenerateError> {
        let mut reroutes = 0;
        loop {
            let mut submitted = self.submit(job.clone(), session.clone(), hints).await?;
            let first = submitted.events.recv().await;
            if let Some(JobEvent::Failed(WorkerError::EngineDown(why))) = &first
                && reroutes < REROUTES
            {
                reroutes += 1;
                tracing::info!(
                    worker = submitted.worker,
                    why,
                    "the engine was down before the request began; routing it again"
                );
                continue;
            }
            return Ok((first, submitted));
        }
    }

    async fn submit(
        &self,
        job: GenRequest,
        session: Option<String>,
        hints: Hints,
    ) -> Result<dynamo_actors::scheduler::Submitted, GenerateError> {
        let mut retried = false;
        loop {
            let scheduler = self.scheduler.lock().unwrap_or_else(PoisonError::into_inner).clone();
            let job = job.clone();
            let session = session.clone();
            match scheduler.call(|reply| SchedulerMsg::Submit { req: Box::new(job), session, hints, reply }, None).await
            {
                Ok(CallResult::Success(Ok(submitted))) => return Ok(submitted),
                Ok(CallResult::Success(Err(SubmitError::Overloaded { retry_after, .. }))) => {
                    return Err(GenerateError::Overloaded { retry_after: retry_after.unwrap_or(RETRY_AFTER) });
                }
                Ok(CallResult::Success(Err(e))) => {
                    return Err(GenerateError::Unavailable { message: e.to_string(), retry_after: RETRY_AFTER });
                }
                _ if !retried => {
                    retried = true;
                    let fresh = scheduler_of(&self.node)
                        .await
                        .map_err(|e| GenerateError::Unavailable { message: e.to_string(), retry_after: RETRY_AFTER })?;
                    *self.scheduler.lock().unwrap_or_else(PoisonError::into_inner) = fresh;
                }
                _ => {
                    return Err(GenerateError::Unavailable {
                        message: "the scheduler is restarting".into(),
                        retry_after: RETRY_AFTER,
                    });
                }
            }
        }
    }
}

impl Generator for NodeGenerator {
    fn models(&self) -> Vec<String> {
        vec![self.model.clone()]
    }

    fn max_context(&self) -> usize {
        self.max_context
    }

    fn generate(&self, req: GenerateRequest) -> BoxStream<'static, Result<GenerateEvent, GenerateError>> {
        if req.model != self.model {
            return futures::stream::once(std::future::ready(Err(GenerateError::ModelNotFound(req.model)))).boxed();
        }
        // A speculative prefill warms the cache and generates nothing; it waits behind real work.
        let speculative = req.hints.speculative_prefill.unwrap_or(false);
        let hints = Hints {
            priority: queue_priority(req.hints.priority(), speculative),
            strict: req.hints.strict_priority(),
            expected_output_tokens: req.hints.expected_output_tokens(),
            tenant: req.tenant.name().map_or(0, |name| xxhash_rust::xxh3::xxh3_64(name.as_bytes()) | 1),
        };
        let warm_next = req.hints.warm_next_turn() && !speculative;
        let job = GenRequest {
            prompt: req.prompt,
            regions: req.regions,
            max_tokens: if speculative { 0 } else { req.max_tokens },
            sampling: req.sampling,
            seed: req.seed,
            stop_tokens: req.stop_token_ids,
            allowed: Some(self.decodable.clone()),
            forced: req.forced.map(Arc::from),
            // The router hashes the prompt (once) when it looks it up.
            hashes: None,
            namespace: Namespace::new(req.tenant.name().unwrap_or(""), req.cache_salt.as_deref().unwrap_or("")),
            leases: req.cache_leases.iter().map(|&(tokens, ttl)| LeaseRequest { tokens, ttl }).collect(),
            request_id: Some(req.request_id),
        };
        let this = self.clone();
        let session = req.session_id;
        let warm = warm_next.then(|| (self.clone(), job.clone(), session.clone(), hints));
        let started = async move { this.submit_until_started(job, session, hints).await };
        let stream = futures::stream::once(started).flat_map(|submitted| match submitted {
            Err(e) => futures::stream::once(std::future::ready(Err(e))).boxed(),
            Ok((first, submitted)) => {
                let leased = (submitted.leased_tokens.short, submitted.leased_tokens.long);
                events(first, submitted.events, leased).boxed()
            }
        });
        match warm {
            None => stream.boxed(),
            Some((this, job, session, hints)) => warm_after(stream, this, job, session, hints).boxed(),
        }
    }
}

/// `stream`, and once it finished, a speculative prefill of the next turn's prefix (Dynamo's
/// `agent_hints.speculative_prefill`): the prompt and the answer's tokens, which the frontend
/// replays into the next prompt as they were, prefilled without generating, behind real work, in
/// the background. The router sends it where the prompt is cached, so the answer's blocks join
/// them there.
fn warm_after(
    stream: impl futures::Stream<Item = Result<GenerateEvent, GenerateError>> + Send + 'static,
    generator: NodeGenerator,
    mut job: GenRequest,
    session: Option<String>,
    hints: Hints,
) -> impl futures::Stream<Item = Result<GenerateEvent, GenerateError>> + Send {
    let answer = Arc::new(Mutex::new(Vec::new()));
    let seen = answer.clone();
    stream.map(move |event| {
        match &event {
            Ok(GenerateEvent::Token { id }) => seen.lock().unwrap_or_else(PoisonError::into_inner).push(*id),
            Ok(GenerateEvent::Finished { .. }) => {
                let answer = std::mem::take(&mut *answer.lock().unwrap_or_else(PoisonError::into_inner));
                job.prompt.extend(answer);
                job.max_tokens = 0;
                job.leases.clear();
                job.request_id = job.request_id.as_ref().map(|id| format!("{id}-warm").into());
                let (generator, job, session) = (generator.clone(), job.clone(), session.clone());
                let hints = Hints { priority: queue_priority(Some(hints.priority), true), ..hints };
                tokio::spawn(async move {
                    // Its events are drained to the end: a request nobody listens to is dropped.
                    if let Ok(mut submitted) = generator.submit(job, session, hints).await {
                        while submitted.events.recv().await.is_some() {}
                    }
                });
            }
            _ => {}
        }
        event
    })
}

/// Times a request whose engine was down before it began is routed again.
const REROUTES: usize = 2;

/// A request's queue priority: the agent's hint (0 without one), one lower for a speculative
/// prefill, which waits behind real work; it saturates at `i32::MIN` instead of wrapping to the
/// highest priority.
fn queue_priority(hint: Option<i32>, speculative: bool) -> i32 {
    hint.unwrap_or(0).saturating_sub(i32::from(speculative))
}

fn events(
    first: Option<JobEvent>,
    rx: tokio::sync::mpsc::UnboundedReceiver<JobEvent>,
    leased_tokens: (usize, usize),
) -> impl futures::Stream<Item = Result<GenerateEvent, GenerateError>> + Send {
    futures::stream::unfold((first, Some(rx)), move |(first, rx)| async move {
        let mut rx = rx?;
        let mut event = match first {
            Some(event) => event,
            None => rx.recv().await?,
        };
        // Prefill passes are the worker's own business (they are never sent).
        while let JobEvent::Event(WorkerEvent::Computed { .. }) = event {
            event = rx.recv().await?;
        }
        let item = match event {
            JobEvent::Event(WorkerEvent::Prefilled { cached_tokens, .. }) => {
                Ok(GenerateEvent::Started { cached_tokens, leased_tokens })
            }
            JobEvent::Event(WorkerEvent::Token(id)) => Ok(GenerateEvent::Token { id }),
            JobEvent::Event(WorkerEvent::Computed { .. }) => unreachable!("skipped above"),
            JobEvent::Done(outcome) => {
                let reason = match outcome.finish {
                    Finish::Length => FinishReason::Length,
                    Finish::Stop => FinishReason::Stop,
                };
                let cached_tokens = outcome.cached_tokens;
                return Some((Ok(GenerateEvent::Finished { reason, cached_tokens }), (None, None)));
            }
            JobEvent::Failed(e) => {
                let err = match e {
                    WorkerError::TooLong { prompt, capacity, .. } => {
                        GenerateError::PromptTooLong { tokens: prompt, limit: capacity }
                    }
                    WorkerError::Overloaded => GenerateError::Overloaded { retry_after: RETRY_AFTER },
                    WorkerError::Restarting | WorkerError::EngineDown(_) => {
                        GenerateError::Unavailable { message: e.to_string(), retry_after: RETRY_AFTER }
                    }
                    other => GenerateError::Internal(other.to_string()),
                };
                return Some((Err(err), (None, None)));
            }
        };
        Some((item, (None, Some(rx))))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lease file is read only when it is a regular file within its bound: a symbolic link
    /// (to `/dev/zero`, which once took RSS to 16 GB), a FIFO (which once hung the start), a
    /// directory and an oversized file are refused at once, without reading them.
    #[test]
    fn the_lease_file_is_read_only_as_a_bounded_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let regular = dir.path().join("leases.bin");
        std::fs::write(&regular, [7u8; 100]).unwrap();
        assert_eq!(read_lease_file(&regular, 100).unwrap(), vec![7u8; 100]);
        assert!(read_lease_file(&regular, 99).is_err(), "over the bound");

        let link = dir.path().join("link.bin");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        assert!(read_lease_file(&link, u64::MAX).is_err(), "a symbolic link is not followed");

        let fifo = dir.path().join("fifo.bin");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
        let err = read_lease_file(&fifo, u64::MAX).expect_err("a FIFO is refused");
        assert!(err.to_string().contains("not a regular file"), "{err}");

        assert!(read_lease_file(dir.path(), u64::MAX).is_err(), "a directory is refused");
        assert_eq!(read_lease_file(&dir.path().join("absent"), 10).unwrap_err().kind(), std::io::ErrorKind::NotFound);
    }

    /// A vLLM engine's blocks and the reference engine's never share a name, even for the same
    /// checkpoint: each node kind computes its own names, and peers' feeds carry them.
    #[test]
    fn block_names_differ_by_engine_kind_and_by_model() {
        let mut cfg = NodeConfig::default();
        cfg.model.path = Some(PathBuf::from("/models/tiny"));
        let reference = node_salt(&cfg, "tiny");
        cfg.engine.kind = EngineKind::Scripted;
        assert_eq!(node_salt(&cfg, "tiny"), reference, "the scripted engine lays blocks out as the reference does");
        cfg.engine.kind = EngineKind::Vllm;
        let vllm = node_salt(&cfg, "tiny");
        assert_ne!(vllm, reference);
        assert_eq!(node_salt(&cfg, "tiny"), vllm, "two vLLM nodes over one checkpoint name blocks alike");
        cfg.model.path = Some(PathBuf::from("/models/other"));
        assert_ne!(node_salt(&cfg, "tiny"), vllm);
    }

    #[test]
    fn a_speculative_prefill_waits_behind_real_work_and_never_wraps_to_the_front() {
        assert_eq!(queue_priority(None, false), 0);
        assert_eq!(queue_priority(Some(2), true), 1);
        assert_eq!(queue_priority(Some(i32::MIN), true), i32::MIN);
        assert_eq!(queue_priority(Some(i32::MAX), false), i32::MAX);
        assert!(queue_priority(Some(i32::MIN), true) < queue_priority(None, true));
    }
}
