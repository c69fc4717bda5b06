//! The WorkerActor: one engine instance (reference model on the CPU or a GPU, or the simulated
//! engine), its G1 pool, onboarding and write-through.
//!
//! The forward pass is blocking work, so the engine lives on its own OS thread with a
//! current-thread tokio runtime (where its G3 reads and writes complete), fed by a bounded queue:
//! the actor owns the thread and hands the queue to the scheduler ([`WorkerMsg::Connect`]).
//! Requests never wait in an actor mailbox.
//!
//! Supervision: a panic inside the engine fails the request that caused it
//! ([`WorkerError::Panicked`]) and every request still queued ([`WorkerError::Restarting`], to be
//! retried), reports the worker's G1 blocks cleared, and then fails the actor so that the
//! NodeSupervisor restarts it with a fresh engine. The node goes on with its other workers.

pub mod batch;
mod engine_core;
pub mod queue;
mod reference;
mod request;
mod run;
pub mod simulated;
mod vllm;

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use tracing::Instrument;

use dynamo_config::QueuePolicy;
use futures::FutureExt;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::sync::{mpsc, oneshot};

use self::queue::JobQueue;

pub use self::reference::{DEFAULT_MAX_RUNNING, PreemptionStats, Resume, Worker};
pub use self::request::{
    Finish, GenOutcome, GenRequest, LeaseRequest, PromptHashes, WorkerError, WorkerEvent, unix_millis,
};
pub use self::vllm::{Naming, VllmEngine, VllmTarget};
use crate::telemetry;

/// A future the engine thread polls (engines need not be `Send`: they never leave their thread).
pub type LocalFuture<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// What a WorkerActor drives: one engine and its G1 pool.
///
/// Both serving engines, the reference worker and the simulated one, keep the requests they admit
/// in one engine core (`engine_core`: admission, waiting for room, resumption, each step's plan
/// from [`batch`] and its fates) that each [`Engine::step`] advances. An engine that answers
/// each request within [`Engine::admit`] (the test engines) runs no steps: the defaults say so.
pub trait Engine: 'static {
    /// Takes a request; what it reports and how it ends go to `ticket`.
    fn admit(&mut self, ticket: Ticket) -> LocalFuture<'_, ()>;
    /// Whether [`Engine::admit`] may take another request now.
    fn has_room(&self) -> bool {
        true
    }
    /// Requests admitted and not finished that [`Engine::step`] serves.
    fn running(&self) -> usize {
        0
    }
    /// One step over the running requests.
    fn step(&mut self) -> LocalFuture<'_, ()> {
        Box::pin(async {})
    }
    /// Ends the request admitted last at once, its caller having stopped listening
    /// ([`serve_alone`]); a request served through the queue ends at its next step instead.
    fn cancel_last(&mut self) {}
    /// Drops everything in G1 (after a panic its contents cannot be trusted) and fails the
    /// requests it was serving with `why`; returns how many blocks were dropped.
    fn reset(&mut self, why: &str) -> usize;
    /// Waits until every write-through started so far is acknowledged or failed.
    fn flush(&mut self) -> LocalFuture<'_, ()>;
    /// Its G1 in blocks, when it has a bounded one (the router's room estimate).
    fn g1_blocks(&self) -> Option<usize> {
        None
    }
    /// Whether its requests run as tasks of their own (an engine in another process): then
    /// [`Engine::step`] only waits for one of them to end, and may be dropped before it does
    /// when a request is queued.
    fn runs_in_background(&self) -> bool {
        false
    }
    /// Called once, before its first request, with its worker's load: an engine that can say
    /// how loaded it is (one in another process, which other clients may use too) keeps
    /// [`WorkerLoad::report`] current from then on.
    fn watch_load(&mut self, _load: Arc<WorkerLoad>) {}
}

impl<B: dynamo_kernels::Backend> Engine for Worker<B> {
    fn admit(&mut self, ticket: Ticket) -> LocalFuture<'_, ()> {
        Box::pin(Worker::admit(self, ticket))
    }

    fn has_room(&self) -> bool {
        Worker::has_room(self)
    }

    fn running(&self) -> usize {
        Worker::running(self)
    }

    fn step(&mut self) -> LocalFuture<'_, ()> {
        Box::pin(Worker::step(self))
    }

    fn cancel_last(&mut self) {
        Worker::cancel_last(self)
    }

    fn reset(&mut self, why: &str) -> usize {
        self.abort(why);
        Worker::reset(self)
    }

    fn flush(&mut self) -> LocalFuture<'_, ()> {
        Box::pin(Worker::flush(self))
    }

    fn g1_blocks(&self) -> Option<usize> {
        Some(Worker::pages(self))
    }
}

/// A request as an engine serves it: the request, where its events go, and the accounting of its
/// worker's load and of the node's metrics. A ticket is answered once ([`Ticket::finish`]); one
/// dropped unanswered (its engine went away) answers "restarting", so the caller may retry.
pub struct Ticket {
    /// The request.
    pub req: GenRequest,
    /// Agent-hint priority; higher goes first (and yields last).
    pub priority: i32,
    /// When it was queued (tokio's clock: virtual under a paused one).
    pub queued_at: tokio::time::Instant,
    predicted_cached: Option<usize>,
    /// What its worker's load counts for it.
    charge: Charge,
    events: mpsc::UnboundedSender<JobEvent>,
    /// The worker's load it is counted in; `None` for a request served directly
    /// ([`Worker::generate`]), which reports its prefill passes too and no metrics.
    load: Option<Arc<WorkerLoad>>,
    prefilled: bool,
    answered: bool,
    /// The request's span in this worker (its id and the worker's): what the worker logs about
    /// the request is logged in it.
    pub span: tracing::Span,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket").field("prompt", &self.req.prompt.len()).field("priority", &self.priority).finish()
    }
}

impl Ticket {
    /// The ticket of a job queued to worker `worker`, counted in `load`.
    pub fn new(job: Job, load: Arc<WorkerLoad>, worker: usize) -> Self {
        let Job { req, predicted_cached, priority, events, queued_at, charge, .. } = job;
        let span = tracing::info_span!("job", request_id = req.log_id(), worker);
        Self {
            req,
            priority,
            queued_at,
            predicted_cached,
            charge,
            events,
            load: Some(load),
            prefilled: false,
            answered: false,
            span,
        }
    }

    /// The ticket of a request served directly, reporting to `events` (prefill passes included).
    pub fn local(req: GenRequest, events: mpsc::UnboundedSender<JobEvent>) -> Self {
        let queued_at = tokio::time::Instant::now();
        let span = tracing::info_span!("job", request_id = req.log_id());
        Self {
            req,
            priority: 0,
            queued_at,
            predicted_cached: None,
            charge: Charge::default(),
            events,
            load: None,
            prefilled: false,
            answered: false,
            span,
        }
    }

    /// Prompt tokens the router expected its worker to find cached (`None`: not predicted).
    pub fn predicted_cached(&self) -> Option<usize> {
        self.predicted_cached
    }

    /// The load of the worker it is counted in (`None` for a request served directly).
    pub fn worker_load(&self) -> Option<&Arc<WorkerLoad>> {
        self.load.as_ref()
    }

    /// Whether nobody waits for the answer any more.
    pub fn is_closed(&self) -> bool {
        self.events.is_closed()
    }

    /// Reports `event`; false once nobody listens (the request should stop).
    pub fn event(&mut self, event: WorkerEvent) -> bool {
        match event {
            // Prefill passes are the worker's own business, unless served directly.
            WorkerEvent::Computed { .. } if self.load.is_some() => return !self.is_closed(),
            WorkerEvent::Prefilled { cached_tokens, hit_tokens } if !self.prefilled => {
                self.prefilled = true;
                self.span.in_scope(|| {
                    tracing::debug!(
                        prompt_tokens = self.req.prompt.len(),
                        cached_tokens,
                        hit_tokens = ?hit_tokens,
                        queued_ms = self.queued_at.elapsed().as_secs_f64() * 1e3,
                        "prefilled"
                    )
                });
                if let Some(load) = &self.load {
                    load.prefilled(&self.req, self.charge);
                }
            }
            _ => {}
        }
        self.events.send(JobEvent::Event(event)).is_ok()
    }

    /// Answers the request: its load leaves the worker, the node's metrics count it, and the
    /// caller gets the outcome or the error.
    pub fn finish(mut self, result: Result<GenOutcome, WorkerError>) {
        self.answered = true;
        self.span.in_scope(|| match &result {
            Ok(o) => tracing::debug!(
                generated = o.tokens.len(),
                cached_tokens = o.cached_tokens,
                prefill_tokens = o.prefill_tokens,
                corrupt_blocks = o.corrupt_blocks,
                finish = ?o.finish,
                cancelled = self.events.is_closed(),
                "finished"
            ),
            Err(e) => tracing::debug!(error = %e, "failed"),
        });
        if let Some(load) = &self.load {
            load.remove(&self.req, self.prefilled, self.charge);
            if self.events.is_closed() && matches!(result, Ok(GenOutcome { finish: Finish::Stop, .. })) {
                telemetry::record_cancelled(if self.prefilled { "decode" } else { "prefill" });
            }
            if let Ok(outcome) = &result {
                telemetry::record_prompt(self.req.prompt.len() as u64, outcome.prefill_tokens as u64);
                if let Some(predicted) = self.predicted_cached {
                    telemetry::record_prediction(predicted as u64, outcome.cached_tokens as u64);
                }
                for (tier, &hit) in outcome.hit_tokens.iter() {
                    if hit > 0 {
                        telemetry::record_hit_tokens(tier, hit as u64);
                    }
                }
            }
        }
        let _ = self.events.send(match result {
            Ok(outcome) => JobEvent::Done(outcome),
            Err(e) => JobEvent::Failed(e),
        });
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.answered {
            if let Some(load) = &self.load {
                load.remove(&self.req, self.prefilled, self.charge);
            }
            let _ = self.events.send(JobEvent::Failed(WorkerError::Restarting));
        }
    }
}

/// Serves one request on `engine` directly (no queue, no actor): admits it, then runs steps until
/// it ends; `on_event` sees the prefill passes, the prefill result and each generated token, and
/// returns false to stop early (the client went away). Requests admitted before it share its
/// steps.
pub async fn serve_alone<E: Engine + ?Sized>(
    engine: &mut E,
    req: &GenRequest,
    on_event: &mut (dyn FnMut(WorkerEvent) -> bool + Send),
) -> Result<GenOutcome, WorkerError> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    engine.admit(Ticket::local(req.clone(), tx)).await;
    let mut cancelled = false;
    loop {
        while let Ok(event) = rx.try_recv() {
            match event {
                JobEvent::Event(e) => {
                    if !cancelled && !on_event(e) {
                        cancelled = true;
                        engine.cancel_last();
                    }
                }
                JobEvent::Done(outcome) => return Ok(outcome),
                JobEvent::Failed(e) => return Err(e),
            }
        }
        if engine.running() == 0 {
            return Err(WorkerError::Restarting);
        }
        engine.step().await;
    }
}

/// Builds worker `id`'s engine, on the engine's own thread.
pub type EngineFactory = Arc<dyn Fn(usize) -> Result<Box<dyn Engine>, WorkerError> + Send + Sync>;

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

/// One queued request and where its events go.
#[derive(Debug)]
pub struct Job {
    /// The request.
    pub req: GenRequest,
    /// Prompt tokens the router expected to be cached on this worker (`None`: not predicted).
    pub predicted_cached: Option<usize>,
    /// Agent-hint priority; higher goes first.
    pub priority: i32,
    /// Strict tier (`nvext.agent_hints.strict_priority`): a higher tier goes before any lower
    /// one, whatever the queue policy says.
    pub tier: i32,
    /// The scheduler's estimate of the job's engine time in seconds (WSPT's processing time).
    pub cost_s: f64,
    /// What it adds to the worker's load while it is there, as the scheduler estimated it.
    pub charge: Charge,
    /// When it was queued (tokio's clock: virtual under a paused one).
    pub queued_at: tokio::time::Instant,
    /// Its events; a closed receiver stops the request at its next token.
    pub events: mpsc::UnboundedSender<JobEvent>,
}

/// A worker's load as the scheduler sees it: requests and prompt tokens queued or running.
#[derive(Debug, Default)]
pub struct WorkerLoad {
    requests: AtomicUsize,
    prompt_tokens: AtomicUsize,
    decode_tokens: AtomicUsize,
    /// Nanoseconds of estimated prefill of the requests not prefilled yet.
    prefill_ns: AtomicU64,
    /// G1 blocks the requests queued or running need of their own (beyond the prefix they
    /// found in G1), as estimated when they were routed.
    private_blocks: AtomicUsize,
    /// The engine's G1 in blocks; 0 when unbounded or unknown.
    g1_blocks: AtomicUsize,
    /// Notified when prefill ahead falls (a request prefilled, or left before it was): the
    /// router's late binding routes what it holds then.
    drained: tokio::sync::Notify,
    /// Its engine is down (an engine in another process that stopped answering): the router
    /// sends it nothing while another worker is up.
    down: std::sync::atomic::AtomicBool,
    /// Requests queued or running whose prompt is not prefilled yet.
    waiting: AtomicUsize,
    /// A running mean of the prefill each request was charged here (nanoseconds): what a
    /// request the node did not send is taken to cost.
    typical_prefill_ns: AtomicU64,
    /// What the engine itself last reported, if it reports anything, with what of it was not
    /// the node's own when it came.
    engine: std::sync::RwLock<Option<(EngineReport, Others)>>,
}

/// What an engine's report held beyond the node's own requests there, as the node counted them
/// when the report came (a report read later is stale, but this difference is not).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Others {
    waiting: usize,
    requests: usize,
}

/// How loaded an engine says it is (an engine in another process, from its own metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineReport {
    /// Requests waiting for their prefill to be scheduled.
    pub waiting: usize,
    /// Requests running (prefilling or decoding).
    pub running: usize,
    /// The share of its KV cache in use by running requests, 0 to 1.
    pub kv_usage: f64,
    /// Its KV cache in blocks (0: unknown).
    pub kv_blocks: usize,
}

impl WorkerLoad {
    /// Requests queued or running.
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::Relaxed)
    }

    /// Prompt tokens of the requests queued or running and not prefilled yet.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens.load(Ordering::Relaxed)
    }

    /// Tokens the requests queued or running may generate.
    pub fn decode_tokens(&self) -> usize {
        self.decode_tokens.load(Ordering::Relaxed)
    }

    /// Estimated engine seconds of the prefills (and loads) not done yet: the work ahead of a
    /// new request's first token here.
    pub fn prefill_s(&self) -> f64 {
        self.prefill_ns.load(Ordering::Relaxed) as f64 / 1e9
    }

    /// The queued work, as the cost model takes it: what the node sent there, and what the
    /// engine reports beyond it.
    ///
    /// An engine's own report counts where it showed more than the node had there when it came
    /// (other clients of the engine): each request waiting there beyond the node's adds a
    /// prefill of the typical size charged here, and each request beyond the node's counts; the
    /// KV cache its running requests hold is at least what it reports in use, out of the blocks
    /// it has.
    pub fn queued(&self) -> crate::cost::Queued {
        let mut queued = crate::cost::Queued {
            prefill_s: self.prefill_s(),
            decode_tokens: self.decode_tokens(),
            requests: self.requests(),
            private_blocks: self.private_blocks.load(Ordering::Relaxed),
            g1_blocks: self.g1_blocks.load(Ordering::Relaxed),
        };
        let report = *self.engine.read().unwrap_or_else(|e| e.into_inner());
        if let Some((engine, others)) = report {
            let typical_s = self.typical_prefill_ns.load(Ordering::Relaxed) as f64 / 1e9;
            queued.prefill_s += others.waiting as f64 * typical_s;
            queued.requests += others.requests;
            if engine.kv_blocks > 0 {
                queued.g1_blocks = engine.kv_blocks;
                let used = (engine.kv_usage.clamp(0.0, 1.0) * engine.kv_blocks as f64).round() as usize;
                queued.private_blocks = queued.private_blocks.max(used);
            }
        }
        queued
    }

    /// The engine's own report of its load, just read (`None`: it no longer reports, e.g. it is
    /// down). What it holds beyond the node's requests there now is another client's, and counts
    /// until the next report.
    pub fn report(&self, report: Option<EngineReport>) {
        let with_others = report.map(|r| {
            let others = Others {
                waiting: r.waiting.saturating_sub(self.waiting.load(Ordering::Relaxed)),
                requests: (r.waiting + r.running).saturating_sub(self.requests()),
            };
            (r, others)
        });
        *self.engine.write().unwrap_or_else(|e| e.into_inner()) = with_others;
    }

    /// Whether its engine is down.
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Relaxed)
    }

    /// Marks its engine down (or up again); true if that changed anything.
    pub fn set_down(&self, down: bool) -> bool {
        self.down.swap(down, Ordering::Relaxed) != down
    }

    /// Waits until prefill ahead has fallen, or the worker's last request left, since the last
    /// wait returned (at once if it has).
    pub async fn drained(&self) {
        self.drained.notified().await;
    }

    /// `req` was queued, charging this worker `charge`.
    pub fn add(&self, req: &GenRequest, charge: Charge) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let charged = nanos(charge.prefill_s);
        let _ = self.typical_prefill_ns.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |mean| {
            Some(if mean == 0 { charged } else { mean - mean / 8 + charged / 8 })
        });
        self.prompt_tokens.fetch_add(req.prompt.len(), Ordering::Relaxed);
        self.decode_tokens.fetch_add(req.max_tokens, Ordering::Relaxed);
        self.prefill_ns.fetch_add(charged, Ordering::Relaxed);
        self.private_blocks.fetch_add(charge.blocks, Ordering::Relaxed);
    }

    /// `req`'s prompt is prefilled: its prompt tokens and its prefill no longer wait.
    pub fn prefilled(&self, req: &GenRequest, charge: Charge) {
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        self.prompt_tokens.fetch_sub(req.prompt.len(), Ordering::Relaxed);
        self.prefill_ns.fetch_sub(nanos(charge.prefill_s), Ordering::Relaxed);
        self.drained.notify_one();
    }

    /// `req` left (finished, failed, or was never queued); `prefilled` if [`Self::prefilled`]
    /// was called for it; `charge` as it was [added](Self::add).
    pub fn remove(&self, req: &GenRequest, prefilled: bool, charge: Charge) {
        let last = self.requests.fetch_sub(1, Ordering::Relaxed) == 1;
        if !prefilled {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
            self.prompt_tokens.fetch_sub(req.prompt.len(), Ordering::Relaxed);
            self.prefill_ns.fetch_sub(nanos(charge.prefill_s), Ordering::Relaxed);
        }
        // An idle worker is drained too: a turn waiting for room in the cache may take it.
        if !prefilled || last {
            self.drained.notify_one();
        }
        self.decode_tokens.fetch_sub(req.max_tokens, Ordering::Relaxed);
        self.private_blocks.fetch_sub(charge.blocks, Ordering::Relaxed);
    }
}

/// What a request adds to its worker's load while it is there, as the router estimated it on
/// that worker.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Charge {
    /// Seconds of its prefill and loads: the worker's queue until its prompt is in.
    pub prefill_s: f64,
    /// G1 blocks of its own (prompt and answer beyond the prefix it finds in G1) until it ends.
    pub blocks: usize,
}

/// Whole nanoseconds of `seconds` (0 for a negative or unknown estimate), so that what is added
/// is exactly what is taken away.
fn nanos(seconds: f64) -> u64 {
    if seconds.is_finite() && seconds > 0.0 { (seconds * 1e9) as u64 } else { 0 }
}

/// How the scheduler reaches a worker: its bounded queue and its load.
#[derive(Clone, Debug)]
pub struct WorkerHandle {
    /// The worker's index in the node.
    pub id: usize,
    /// Its queue; `try_push` fails when it is full (backpressure) or the worker is gone.
    pub queue: Arc<JobQueue>,
    /// Its load.
    pub load: Arc<WorkerLoad>,
}

/// The WorkerActor.
#[derive(Debug)]
pub struct WorkerActor;

/// A reference to a WorkerActor.
pub type WorkerRef = ActorRef<WorkerMsg>;

/// What a WorkerActor starts from.
#[derive(Clone)]
pub struct WorkerArgs {
    /// The worker's index in the node.
    pub id: usize,
    /// Builds its engine.
    pub factory: EngineFactory,
    /// Requests waiting at most before the scheduler sees the worker full.
    pub queue_bound: usize,
    /// The order requests wait in.
    pub queue_policy: QueuePolicy,
    /// Where the engine runs.
    pub host: EngineHost,
}

impl std::fmt::Debug for WorkerArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerArgs").field("id", &self.id).field("queue_bound", &self.queue_bound).finish()
    }
}

/// Work for a [`LocalSpawner`]: builds a future that stays on the spawner's thread.
pub type LocalJob = Box<dyn FnOnce() -> LocalFuture<'static, ()> + Send>;

/// Spawns futures on a `tokio::task::LocalSet` (see [`EngineHost::Local`]).
pub type LocalSpawner = mpsc::UnboundedSender<LocalJob>;

/// Where a worker's engine runs.
#[derive(Clone, Debug, Default)]
pub enum EngineHost {
    /// Its own OS thread with a current-thread runtime: for engines whose steps block (the
    /// reference model on a CPU or a GPU).
    #[default]
    Thread,
    /// A task on the caller's `LocalSet`, reached through this spawner: for engines that only
    /// await (the simulated engine), so a whole node runs on one runtime — under tokio's paused
    /// clock, in virtual time.
    Local(LocalSpawner),
}

/// Runs `LocalJob`s sent to the returned spawner as local tasks; drive the returned future on a
/// `LocalSet` for as long as workers may start.
pub fn local_spawner() -> (LocalSpawner, impl Future<Output = ()>) {
    let (tx, mut rx) = mpsc::unbounded_channel::<LocalJob>();
    let run = async move {
        while let Some(job) = rx.recv().await {
            tokio::task::spawn_local(job());
        }
    };
    (tx, run)
}

/// A WorkerActor's state.
#[derive(Debug)]
pub struct WorkerState {
    handle: WorkerHandle,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Messages of the WorkerActor.
#[derive(Debug)]
pub enum WorkerMsg {
    /// Reply: the handle through which the scheduler queues requests. Always answered.
    Connect(RpcReplyPort<WorkerHandle>),
    /// From the engine thread, no reply: the engine panicked; the request and the queue have been
    /// failed and G1 reported cleared. The actor then fails so that its supervisor restarts it.
    EngineFailed {
        /// The panic message.
        panic: String,
        /// G1 blocks dropped.
        g1_blocks_removed: usize,
    },
}

impl Actor for WorkerActor {
    type Msg = WorkerMsg;
    type State = WorkerState;
    type Arguments = WorkerArgs;

    async fn pre_start(&self, myself: WorkerRef, args: WorkerArgs) -> Result<WorkerState, ActorProcessingErr> {
        let queue = Arc::new(JobQueue::new(args.queue_bound, args.queue_policy));
        let rx = queue.clone();
        let load = Arc::new(WorkerLoad::default());
        let (ready_tx, ready_rx) = oneshot::channel();
        let thread_load = load.clone();
        let id = args.id;
        let factory = args.factory;
        let thread = match args.host {
            EngineHost::Thread => Some(
                std::thread::Builder::new()
                    .name(format!("worker-{id}"))
                    .spawn(move || engine_thread(id, factory, rx, ready_tx, myself, thread_load))?,
            ),
            EngineHost::Local(spawner) => {
                let job: LocalJob = Box::new(move || Box::pin(serve(id, factory, rx, ready_tx, myself, thread_load)));
                spawner.send(job).map_err(|_| format!("worker {id}: the local spawner is gone"))?;
                None
            }
        };
        match ready_rx.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("worker {id} could not build its engine: {e}").into()),
            Err(_) => return Err(format!("worker {id}'s engine thread died while starting").into()),
        }
        Ok(WorkerState { handle: WorkerHandle { id, queue, load }, thread })
    }

    async fn handle(&self, _: WorkerRef, msg: WorkerMsg, state: &mut WorkerState) -> Result<(), ActorProcessingErr> {
        match msg {
            WorkerMsg::Connect(reply) => {
                let _ = reply.send(state.handle.clone());
                Ok(())
            }
            WorkerMsg::EngineFailed { panic, g1_blocks_removed } => {
                Err(format!("worker {} panicked ({panic}); {g1_blocks_removed} G1 block(s) dropped", state.handle.id)
                    .into())
            }
        }
    }

    async fn post_stop(&self, _: WorkerRef, state: &mut WorkerState) -> Result<(), ActorProcessingErr> {
        // Closing the queue ends the engine loop once it has served what is queued and flushed
        // write-through.
        state.handle.queue.close();
        if let Some(thread) = state.thread.take() {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        Ok(())
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}

fn engine_thread(
    id: usize,
    factory: EngineFactory,
    rx: Arc<JobQueue>,
    ready: oneshot::Sender<Result<(), String>>,
    actor: WorkerRef,
    load: Arc<WorkerLoad>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(format!("cannot start the worker's runtime: {e}")));
            return;
        }
    };
    runtime.block_on(serve(id, factory, rx, ready, actor, load));
}

/// The engine loop: builds the engine, then serves the queue until it closes. New requests join
/// the engine's batch between steps, as many as it has room for; while nothing runs the loop
/// waits for the queue.
async fn serve(
    id: usize,
    factory: EngineFactory,
    rx: Arc<JobQueue>,
    ready: oneshot::Sender<Result<(), String>>,
    actor: WorkerRef,
    load: Arc<WorkerLoad>,
) {
    let mut engine = match std::panic::catch_unwind(AssertUnwindSafe(|| factory(id))) {
        Ok(Ok(engine)) => engine,
        Ok(Err(e)) => {
            let _ = ready.send(Err(e.to_string()));
            return;
        }
        Err(panic) => {
            let _ = ready.send(Err(panic_message(panic.as_ref())));
            return;
        }
    };
    load.g1_blocks.store(engine.g1_blocks().unwrap_or(0), Ordering::Relaxed);
    engine.watch_load(load.clone());
    let _ = ready.send(Ok(()));
    let mut open = true;
    loop {
        while open && engine.has_room() {
            let job = if engine.running() == 0 {
                rx.pop().await
            } else {
                match rx.try_pop() {
                    Some(job) => Some(job),
                    None => break,
                }
            };
            let Some(job) = job else {
                open = false;
                break;
            };
            // Nobody waits for it any more (the client went away or timed out while it was queued).
            if job.events.is_closed() {
                load.remove(&job.req, false, job.charge);
                telemetry::record_cancelled("queued");
                continue;
            }
            let ticket = Ticket::new(job, load.clone(), id);
            let span = ticket.span.clone();
            let admitted = AssertUnwindSafe(engine.admit(ticket).instrument(span)).catch_unwind().await;
            if let Err(panic) = admitted {
                return restart(id, engine, &rx, &actor, &load, panic_message(panic.as_ref())).await;
            }
        }
        if engine.running() == 0 {
            if open {
                continue;
            }
            break;
        }
        if engine.runs_in_background() {
            // Its requests run by themselves: wait until one ends, or until one is queued while
            // it has room for it.
            let room = open && engine.has_room();
            tokio::select! {
                _ = rx.wait(), if room => {}
                _ = engine.step() => {}
            }
            continue;
        }
        if let Err(panic) = AssertUnwindSafe(engine.step()).catch_unwind().await {
            return restart(id, engine, &rx, &actor, &load, panic_message(panic.as_ref())).await;
        }
        // Queued requests, timers and the write-through's completions get their turn.
        tokio::task::yield_now().await;
    }
    engine.flush().await;
}

/// After a panic inside the engine: fails what it was serving and what is queued, and has the
/// actor restarted with a fresh engine.
async fn restart(
    id: usize,
    mut engine: Box<dyn Engine>,
    rx: &JobQueue,
    actor: &WorkerRef,
    load: &WorkerLoad,
    what: String,
) {
    // The queue closes before the requests' failures are reported: a client that retries at
    // once is routed to another worker, not queued behind the restart.
    rx.close();
    let dropped = engine.reset(&what);
    tracing::error!(worker = id, panic = %what, g1_blocks_removed = dropped, "worker panicked; restarting it");
    telemetry::record_worker_restart(dropped as u64);
    while let Some(queued) = rx.pop().await {
        load.remove(&queued.req, false, queued.charge);
        let _ = queued.events.send(JobEvent::Failed(WorkerError::Restarting));
    }
    engine.flush().await;
    let _ = actor.cast(WorkerMsg::EngineFailed { panic: what, g1_blocks_removed: dropped });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn charge(prefill_s: f64, blocks: usize) -> Charge {
        Charge { prefill_s, blocks }
    }

    #[test]
    fn an_engines_own_report_adds_what_the_node_did_not_send_and_no_more() {
        let load = WorkerLoad::default();
        let req = GenRequest::greedy(vec![1; 64], 16);
        load.add(&req, charge(0.2, 4));
        let alone = load.queued();
        assert_eq!((alone.requests, alone.private_blocks), (1, 4));
        assert!((alone.prefill_s - 0.2).abs() < 1e-9);

        // The engine sees the node's one request waiting: nothing more.
        load.report(Some(EngineReport { waiting: 1, running: 0, kv_usage: 0.0, kv_blocks: 0 }));
        assert_eq!(load.queued(), alone);

        // Three more wait there that the node did not send: each costs a typical prefill here.
        load.report(Some(EngineReport { waiting: 4, running: 2, kv_usage: 0.5, kv_blocks: 100 }));
        let busy = load.queued();
        assert!((busy.prefill_s - 0.8).abs() < 1e-6, "{busy:?}");
        assert_eq!(busy.requests, 6);
        assert_eq!((busy.private_blocks, busy.g1_blocks), (50, 100));

        // The node's request is prefilled after the report was read: the report is stale, but
        // what it showed of others' stands, and the node's own prefill no longer waits.
        load.prefilled(&req, charge(0.2, 4));
        assert!((load.queued().prefill_s - 0.6).abs() < 1e-6, "{:?}", load.queued());

        // An engine that stops reporting counts for nothing again.
        load.report(None);
        load.remove(&req, true, charge(0.2, 4));
        assert_eq!(load.queued(), crate::cost::Queued::default());
    }

    #[test]
    fn the_typical_prefill_follows_what_requests_are_charged() {
        let load = WorkerLoad::default();
        let req = GenRequest::greedy(vec![1; 8], 1);
        for _ in 0..64 {
            load.add(&req, charge(1.0, 0));
            load.remove(&req, false, charge(1.0, 0));
        }
        load.report(Some(EngineReport { waiting: 1, running: 0, kv_usage: 0.0, kv_blocks: 0 }));
        assert!((load.queued().prefill_s - 1.0).abs() < 1e-6);
    }
}
