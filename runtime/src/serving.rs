//! The node's engine workers as the HTTP frontend reaches them: one OS thread per worker, each
//! with its own current-thread tokio runtime (G3 reads and writes complete there) and a bounded
//! queue in front of it. A full queue everywhere is an `Overloaded` answer, never an unbounded
//! backlog. Requests go round-robin to the first worker with room; KV-aware routing replaces that
//! with the scheduler.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

use anyhow::Context;
use dynamo_actors::tiers::{G2Tier, G3Tier, NodeTiers};
use dynamo_actors::worker::{Finish, GenOutcome, GenRequest, Worker, WorkerError, WorkerEvent};
use dynamo_config::NodeConfig;
use dynamo_kernels::CpuBackend;
use dynamo_kernels::model::{HostWeights, Llama};
use dynamo_kernels::sampling::Sampling;
use dynamo_tiering::block::{Salt, SaltInputs};
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use tokio::sync::mpsc;

use crate::frontend::{FinishReason, GenerateError, GenerateEvent, GenerateRequest, Generator};
use crate::metrics;
use crate::node::Node;

/// What a worker reports for one request.
#[derive(Debug)]
pub enum JobEvent {
    /// Prefill done, or a token.
    Event(WorkerEvent),
    /// The request finished.
    Done(GenOutcome),
    /// The request failed.
    Failed(WorkerError),
}

struct Job {
    req: GenRequest,
    events: mpsc::UnboundedSender<JobEvent>,
}

/// Why a request was not queued.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// Every worker's queue is full.
    #[error("every worker is busy ({workers} workers, {per_worker} queued requests each)")]
    Overloaded {
        /// Workers.
        workers: usize,
        /// Queue bound per worker.
        per_worker: usize,
    },
    /// The pool is shutting down.
    #[error("the node is shutting down")]
    ShuttingDown,
}

/// The engine workers of a node.
#[derive(Debug)]
pub struct WorkerPool {
    queues: Vec<mpsc::Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    next: AtomicUsize,
    per_worker: usize,
    /// The model's name as clients address it.
    pub model: String,
    /// Longest prompt plus generation a request may have, in tokens.
    pub max_context: usize,
    tiers: Arc<NodeTiers>,
}

impl WorkerPool {
    /// Builds the model and starts `engine.workers` workers over the node's tiers.
    pub fn start(cfg: &NodeConfig, node: Node) -> anyhow::Result<Self> {
        let plan = &node.tiers;
        let weights = Arc::new(match &cfg.model.path {
            Some(dir) => HostWeights::load(dir).with_context(|| format!("loading weights from {}", dir.display()))?,
            None => HostWeights::random(plan.shape, cfg.model.seed),
        });
        let digest = match &cfg.model.path {
            Some(dir) => dir.display().to_string(),
            None => format!("random-seed-{}", cfg.model.seed),
        };
        let salt = Salt::derive(&SaltInputs {
            model: plan.shape.name,
            weights_digest: &digest,
            lora: cfg.model.lora.as_deref().unwrap_or(""),
            cache_salt: "",
        });
        let g2 = match (node.g2, node.g2_registry) {
            (Some(pool), Some(registry)) => Some(G2Tier::new(pool, registry)),
            _ => None,
        };
        let g3 = match (node.g3, node.g3_registry) {
            (Some(store), Some(registry)) => Some(G3Tier::new(store, registry)),
            _ => None,
        };
        let tiers = Arc::new(NodeTiers {
            block_tokens: plan.block_tokens,
            salt,
            layout: plan.layout,
            retention: cfg.retention.clone(),
            g2,
            g3,
        });
        let workers = cfg.engine.workers.max(1);
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let threads_each = (cores / workers).max(1);
        let pages = plan.g1.blocks as usize;
        let per_worker = cfg.engine.max_queued_requests.max(1);
        let mut queues = Vec::new();
        let mut threads = Vec::new();
        for w in 0..workers {
            let model = Llama::new(CpuBackend::new(threads_each), weights.as_ref()).context("building the model")?;
            let worker = Worker::new(model, tiers.clone(), pages, plan.g1.policy).context("building a worker")?;
            let (tx, rx) = mpsc::channel(per_worker);
            queues.push(tx);
            threads
                .push(std::thread::Builder::new().name(format!("worker-{w}")).spawn(move || run_worker(worker, rx))?);
        }
        Ok(Self {
            queues,
            threads,
            next: AtomicUsize::new(0),
            per_worker,
            model: cfg.model.name.clone(),
            max_context: pages * plan.block_tokens,
            tiers,
        })
    }

    /// The tiers the workers share.
    pub fn tiers(&self) -> &Arc<NodeTiers> {
        &self.tiers
    }

    /// Queues a request on the next worker with room; its events arrive on the returned channel.
    pub fn submit(&self, req: GenRequest) -> Result<mpsc::UnboundedReceiver<JobEvent>, SubmitError> {
        let (events, rx) = mpsc::unbounded_channel();
        let mut job = Job { req, events };
        let n = self.queues.len();
        let first = self.next.fetch_add(1, Ordering::Relaxed);
        for i in 0..n {
            match self.queues[(first + i) % n].try_send(job) {
                Ok(()) => return Ok(rx),
                Err(mpsc::error::TrySendError::Full(j)) => job = j,
                Err(mpsc::error::TrySendError::Closed(_)) => return Err(SubmitError::ShuttingDown),
            }
        }
        Err(SubmitError::Overloaded { workers: n, per_worker: self.per_worker })
    }

    /// Stops taking requests, lets the workers finish the queued ones and flush their G3 writes,
    /// and joins them.
    pub fn shutdown(mut self) {
        self.queues.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn run_worker(mut worker: Worker<CpuBackend>, mut rx: mpsc::Receiver<Job>) {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "a worker could not start its runtime");
            return;
        }
    };
    runtime.block_on(async move {
        while let Some(job) = rx.recv().await {
            let events = job.events.clone();
            let mut forward = |e| events.send(JobEvent::Event(e)).is_ok();
            let run = worker.generate(&job.req, &mut forward);
            // A panic fails this request, not the node: the worker restarts with an empty G1.
            let result = match AssertUnwindSafe(run).catch_unwind().await {
                Ok(result) => result,
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "unknown panic".to_string());
                    let dropped = worker.reset();
                    tracing::error!(panic = %what, g1_blocks_removed = dropped, "worker panicked; restarted with an empty G1");
                    metrics::record_worker_restart(dropped as u64);
                    Err(WorkerError::Panicked(what))
                }
            };
            let _ = job.events.send(match result {
                Ok(outcome) => JobEvent::Done(outcome),
                Err(e) => JobEvent::Failed(e),
            });
        }
        worker.flush().await;
    });
}

/// The worker pool as the HTTP frontend's [`Generator`]: requests are queued on a worker and its
/// events become the frontend's stream; dropping the stream stops the request at its next token.
#[derive(Debug, Clone)]
pub struct NodeGenerator {
    pool: Arc<WorkerPool>,
    vocab_limit: usize,
}

impl NodeGenerator {
    /// A generator over `pool` that samples only ids the tokenizer can decode (`vocab_limit`).
    pub fn new(pool: Arc<WorkerPool>, vocab_limit: usize) -> Self {
        Self { pool, vocab_limit }
    }
}

fn api_of(request_id: &str) -> metrics::Api {
    if request_id.starts_with("chatcmpl") { metrics::Api::ChatCompletions } else { metrics::Api::Completions }
}

impl Generator for NodeGenerator {
    fn models(&self) -> Vec<String> {
        vec![self.pool.model.clone()]
    }

    fn max_context(&self) -> usize {
        self.pool.max_context
    }

    fn generate(&self, req: GenerateRequest) -> BoxStream<'static, Result<GenerateEvent, GenerateError>> {
        let api = api_of(&req.request_id);
        if req.model != self.pool.model {
            metrics::record_request(api, 404, None);
            return futures::stream::once(std::future::ready(Err(GenerateError::ModelNotFound(req.model)))).boxed();
        }
        let prompt_len = req.prompt.len();
        let job = GenRequest {
            prompt: req.prompt,
            regions: req.regions,
            max_tokens: req.max_tokens,
            sampling: if req.temperature > 0.0 {
                Sampling::Temperature { temperature: req.temperature }
            } else {
                Sampling::Greedy
            },
            seed: req.seed.unwrap_or(0),
            stop_tokens: req.stop_token_ids,
            vocab_limit: self.vocab_limit,
        };
        let rx = match self.pool.submit(job) {
            Ok(rx) => rx,
            Err(e) => {
                metrics::record_request(api, 429, None);
                tracing::debug!(error = %e, "request refused");
                let err = GenerateError::Overloaded { retry_after: std::time::Duration::from_secs(1) };
                return futures::stream::once(std::future::ready(Err(err))).boxed();
            }
        };
        futures::stream::unfold(Some(rx), move |rx| async move {
            let mut rx = rx?;
            let item = match rx.recv().await? {
                JobEvent::Event(WorkerEvent::Prefilled { cached_tokens, .. }) => {
                    Ok(GenerateEvent::Started { cached_tokens })
                }
                JobEvent::Event(WorkerEvent::Token(id)) => Ok(GenerateEvent::Token { id }),
                JobEvent::Done(outcome) => {
                    metrics::record_prompt(prompt_len as u64, outcome.prefill_tokens as u64);
                    for (tier, tokens) in
                        [metrics::Tier::G1, metrics::Tier::G2, metrics::Tier::G3].into_iter().zip(outcome.hit_tokens)
                    {
                        if tokens > 0 {
                            metrics::record_hit_tokens(tier, tokens as u64);
                        }
                    }
                    let ttft = (!outcome.tokens.is_empty()).then_some(outcome.ttft);
                    metrics::record_request(api, 200, ttft);
                    let reason = match outcome.finish {
                        Finish::Length => FinishReason::Length,
                        Finish::Stop => FinishReason::Stop,
                    };
                    return Some((Ok(GenerateEvent::Finished { reason }), None));
                }
                JobEvent::Failed(e) => {
                    let (status, err) = match e {
                        WorkerError::TooLong { prompt, capacity, .. } => {
                            (400, GenerateError::PromptTooLong { tokens: prompt, limit: capacity })
                        }
                        WorkerError::Overloaded => {
                            (429, GenerateError::Overloaded { retry_after: std::time::Duration::from_secs(1) })
                        }
                        other => (500, GenerateError::Internal(other.to_string())),
                    };
                    metrics::record_request(api, status, None);
                    return Some((Err(err), None));
                }
            };
            Some((item, Some(rx)))
        })
        .boxed()
    }
}
