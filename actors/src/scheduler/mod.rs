//! The SchedulerActor: routes every request to a worker and queues it there.
//!
//! It knows every worker's bounded queue and load ([`WorkerHandle`]) and every live session
//! (a [`SessionActor`] per conversation, which it starts and supervises). A request of a session
//! goes through that session's actor and comes back as [`SchedulerMsg::Route`] with the session's
//! sticky worker and lease owner. A request goes to the first worker in the routing policy's
//! order whose queue has room; when none has, the answer is [`SubmitError::Overloaded`] at once:
//! the node never builds an unbounded backlog. A queued request's `cache_control` breakpoints are
//! then leased in the node's tiers ([`NodeTiers::lease`]) to its session.
//!
//! A worker's queue, as the cost model prices it, is the estimated prefill of what is queued
//! there (each request's uncached part as it was routed), the wait for room when its G1 is full,
//! and its queued decode work times `decode_weight`.
//!
//! Routing policies (`router.policy`: `kv_aware`, `round_robin`, `random`) live in
//! [`crate::routing`], one file each behind [`routing::Policy`]: the scheduler asks its policy for
//! the order to try the workers in (with `kv_aware`, each worker's estimate from the global prefix
//! index and the [`CostModel`]), and does the rest itself. Sessions and leases are in
//! `sessions.rs`.
//!
//! Admission (`kv_aware` with an index and `router.working_set` above 0): a session's turn is
//! routed only when the contexts of the sessions ahead of it in the line and its own fit the
//! share of the cache that measured thrashing leaves them ([`crate::admission`]); otherwise it
//! waits here and is routed, on the state of that moment, when sessions ahead leave the line or
//! it has waited `router.admission_max_wait` (its session then moves to the front). Waiting
//! turns are at most as many as the workers' queues hold; past that the answer is
//! [`SubmitError::Overloaded`].
//!
//! Late binding (`kv_aware`, `router.late_binding` above 0): while every worker has more
//! estimated prefill ahead than that, requests are held here instead of joining a queue; each
//! time a worker's prefill ahead falls ([`WorkerLoad::drained`](crate::worker::WorkerLoad::drained)),
//! the held requests due first — by arrival plus `HOLD_STRETCH` (4) times their estimated prefill,
//! shortest first among those that came together — are routed on the state of that moment, until
//! every worker is busy again. Held and queued requests together are at most as many as the
//! workers' queues hold.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

use dynamo_config::RegionKind;
use dynamo_config::RoutingPolicy;
use dynamo_tiering::block::{BlockHash, Salt};
use dynamo_tiering::pipeline::region_of;
use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tokio::sync::mpsc;

use crate::admission::WorkingSet;
use crate::cost::{CostModel, Queued};
use crate::index::{IndexWriter, PrefixIndex};
use crate::leases::{LeasedTiers, Lessee};
use crate::routing::{self, Candidates, Policy};
use crate::session::{LeasedChain, SessionActor, SessionArgs, SessionMsg, SessionRef};
use crate::telemetry;
use crate::tiers::NodeTiers;
use crate::worker::queue::PushError;
use crate::worker::{Charge, GenRequest, Job, JobEvent, WorkerHandle};

mod sessions;

/// The SchedulerActor.
#[derive(Debug)]
pub struct SchedulerActor;

/// A reference to a SchedulerActor.
pub type SchedulerRef = ActorRef<SchedulerMsg>;

/// What the scheduler starts from.
#[derive(Clone, Debug)]
pub struct SchedulerArgs {
    /// Worker choice.
    pub policy: RoutingPolicy,
    /// A session ends after this long without a turn.
    pub session_idle_timeout: Duration,
    /// Sessions tracked at once; a new one past it ends the idlest (`frontend.max_sessions`).
    pub max_sessions: usize,
    /// Seed of the `random` policy and of temperature sampling.
    pub seed: u64,
    /// What `kv_aware` routing needs; `None` falls back to sessions and load.
    pub kv: Option<KvRouting>,
}

/// The pieces of KV-aware routing.
#[derive(Clone, Debug)]
pub struct KvRouting {
    /// The global prefix index, fed by the node's KV events.
    pub index: Arc<PrefixIndex>,
    /// The writer applying those events, if they are not applied where they are published: each
    /// decision first waits, asleep, for what was sent to it (microseconds; at most 2 ms), so
    /// it sees every event published before it.
    pub writer: Option<Arc<IndexWriter>>,
    /// This node's id in the index (the first node's, with `workers_per_node`).
    pub node: u16,
    /// Workers per node when one scheduler routes over several nodes (worker `i` is on node
    /// `node + i / workers_per_node`); 0 means all on `node`.
    pub workers_per_node: usize,
    /// The salt and block size requests are hashed with (the workers' own).
    pub salt: Salt,
    /// Tokens per block.
    pub block_tokens: usize,
    /// The cost model; its G3 rate is replaced by the measured one once G3 has been read, and
    /// its G2 rate, if 0, by the measured G2 → G1 load bandwidth once a load was timed.
    pub cost: CostModel,
    /// The node's tiers, for live measurements (none for a simulated node).
    pub tiers: Option<Arc<NodeTiers>>,
    /// Where `cache_control` leases are granted, refreshed and released: the node's tiers, or
    /// a simulated node's (none: requests lease nothing).
    pub leases: Option<Arc<dyn LeasedTiers>>,
    /// The session's previous worker wins unless another is estimated better by more than this.
    pub sticky_bonus: Duration,
    /// Softmax temperature over the estimates in milliseconds; 0 picks the best.
    pub temperature: f64,
    /// Working-set admission of sessions' turns ([`crate::admission`]).
    pub admission: Admission,
}

/// How sessions' turns are admitted under `kv_aware` routing ([`crate::admission`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Admission {
    /// The most of the cache (the workers' G1 together and `cache_blocks`) the contexts of the
    /// sessions in line may fill before a turn waits (less while thrashing is measured); 0: no
    /// admission.
    pub working_set: f64,
    /// Blocks the nodes' G2 hold beside the workers' G1.
    pub cache_blocks: usize,
    /// A session stays in line this long after its last turn was routed.
    pub session_gap: Duration,
    /// Longest a turn waits for room before it is routed anyway.
    pub max_wait: Duration,
    /// Late binding: while every worker has more estimated prefill ahead than this, requests
    /// wait at the router; zero routes at once.
    pub late_binding: Duration,
}

impl Admission {
    /// Every turn routed at once.
    pub const OFF: Admission = Admission {
        working_set: 0.0,
        cache_blocks: 0,
        session_gap: Duration::ZERO,
        max_wait: Duration::ZERO,
        late_binding: Duration::ZERO,
    };
}

/// Why a request was not queued.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// Every worker's queue is full.
    #[error("every worker is busy ({workers} workers up, each with a full queue)")]
    Overloaded {
        /// Workers up.
        workers: usize,
        /// When a queue slot is expected to free: the estimated engine time per queued request
        /// of the least busy worker (`None` without a cost model).
        retry_after: Option<Duration>,
    },
    /// No worker is up (all are restarting).
    #[error("no worker is available right now")]
    NoWorkers,
    /// The node is shutting down.
    #[error("the node is shutting down")]
    ShuttingDown,
}

/// What an agent says about a request (`nvext`): how urgent, how long an answer it expects.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Hints {
    /// Higher is more urgent; 0 is normal.
    pub priority: i32,
    /// A strict tier: every request of a higher tier is queued ahead of every one of a lower
    /// tier, whatever the queue policy orders within a tier; 0 is normal.
    pub strict: i32,
    /// Tokens the answer is expected to have (the cost estimate's decode part).
    pub expected_output_tokens: Option<usize>,
    /// Whose request it is (a digest of the tenant's name; 0 for the shared tenant): at the
    /// session cap, sessions are ended from the tenant holding the most.
    pub tenant: u64,
}

/// A queued request: its events, and the worker it went to.
#[derive(Debug)]
pub struct Submitted {
    /// The request's events; the last one is `Done` or `Failed`.
    pub events: mpsc::UnboundedReceiver<JobEvent>,
    /// The worker.
    pub worker: usize,
    /// Prompt tokens its leases newly cover (no live lease had them before), for leases of up to
    /// an hour and for longer ones: Anthropic's `cache_creation` by TTL.
    pub leased_tokens: LeasedTokens,
}

/// Prompt tokens newly leased by a request, by TTL.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeasedTokens {
    /// Under leases shorter than an hour (`ttl: "5m"`).
    pub short: usize,
    /// Under leases of an hour or more (`ttl: "1h"`, `prompt_cache_retention: "24h"`).
    pub long: usize,
}

/// What a session adds to its request on the way to the scheduler.
#[derive(Debug)]
pub struct SessionTurn {
    /// The session, told where the turn went ([`SessionMsg::Routed`]).
    pub actor: SessionRef,
    /// Who its leases belong to.
    pub lessee: Lessee,
    /// The worker of its last turn.
    pub sticky: Option<usize>,
}

/// Messages of the SchedulerActor.
#[derive(Debug)]
pub enum SchedulerMsg {
    /// Reply: the request was queued on a worker (its events follow on the receiver), or why not.
    /// Always answered, without waiting for the request to run. A request of a session goes
    /// through that session's actor first ([`SessionMsg::Submit`]), which sends it back as a
    /// [`SchedulerMsg::Route`].
    Submit {
        /// The request (boxed: it is most of the message).
        req: Box<GenRequest>,
        /// Its conversation.
        session: Option<String>,
        /// Agent hints.
        hints: Hints,
        /// Where the answer goes.
        reply: RpcReplyPort<Result<Submitted, SubmitError>>,
    },
    /// Reply as for `Submit`: route a request its session has seen.
    Route {
        /// The request.
        req: Box<GenRequest>,
        /// Its session.
        session: Option<SessionTurn>,
        /// Agent hints.
        hints: Hints,
        /// Where the answer goes.
        reply: RpcReplyPort<Result<Submitted, SubmitError>>,
    },
    /// No reply: a worker is up (new or restarted) behind this handle.
    WorkerUp(WorkerHandle),
    /// No reply: worker `0` is gone until a `WorkerUp`.
    WorkerDown(usize),
    /// No reply: a waiting turn may go now (a session left the line, or a turn has waited its
    /// longest).
    Admit,
    /// No reply: a worker's prefill ahead fell; requests held by late binding may go.
    Drained,
    /// Reply: the live sessions and the workers up.
    Status(RpcReplyPort<SchedulerStatus>),
}

/// What [`SchedulerMsg::Status`] answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerStatus {
    /// Workers up.
    pub workers_up: usize,
    /// Live sessions.
    pub sessions: usize,
}

/// A session's turn, waiting for the working set to have room for its context.
struct Parked {
    req: Box<GenRequest>,
    session: Option<SessionTurn>,
    hints: Hints,
    reply: RpcReplyPort<Result<Submitted, SubmitError>>,
    since: tokio::time::Instant,
}

/// A request held by late binding: every worker had more prefill ahead than
/// `router.late_binding` when it came.
struct Held {
    parked: Parked,
    /// How it is routed when it goes (its working-set check, if any, was passed).
    gate: Gate,
}

/// How much later than its arrival a held request may go for each second of its estimated
/// prefill: requests go by `arrival + HOLD_STRETCH × prefill / 2^priority`, shortest first
/// among those that came together, and one that waited `HOLD_STRETCH` times its own prefill
/// goes before anything that came after that.
const HOLD_STRETCH: f64 = 4.0;

/// What [`SchedulerState::route`] did with a request.
enum Routed {
    /// Queued on a worker, with the leases it was granted.
    Queued(Submitted, Vec<LeasedChain>),
    /// Refused.
    Refused(SubmitError),
    /// A session's turn that does not fit the working set now.
    Wait(Box<GenRequest>),
    /// Held by late binding: every worker is busy; the request's estimated prefill (seconds).
    Hold(Box<GenRequest>, f64),
}

/// Whether [`SchedulerState::route`] may make a request wait for the working set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Gate {
    /// Route it: no admission.
    Open,
    /// A session's turn: route it only if it fits.
    Check,
    /// A session's turn, routed whether it fits or not (it fits already, or waited its longest).
    Admit,
    /// A session's turn that fitted without waiting and was held by late binding: routed as it
    /// is, and its context counted as found or lost.
    Pass,
}

struct SessionEntry {
    actor: SessionRef,
    last_request: Instant,
    tenant: u64,
}

/// The scheduler's state.
pub struct SchedulerState {
    args: SchedulerArgs,
    workers: Vec<Option<WorkerHandle>>,
    /// `router.policy`: the order to try the workers in.
    policy: Box<dyn Policy>,
    sessions: HashMap<String, SessionEntry>,
    session_of: HashMap<ActorId, String>,
    /// The sessions in line ([`crate::admission`]).
    working: WorkingSet<ActorId>,
    /// Sessions' turns waiting for room, in arrival order.
    parked: VecDeque<Parked>,
    /// When a [`SchedulerMsg::Admit`] is due, if one is.
    wake_at: Option<tokio::time::Instant>,
    /// Requests held by late binding, by when they go (then arrival).
    held: std::collections::BTreeMap<(tokio::time::Instant, u64), Held>,
    /// Requests held so far (the tie-break of `held`).
    held_seq: u64,
    /// Whether requests are held or turns wait for room: the workers' drain signals are
    /// forwarded only then.
    holding: Arc<std::sync::atomic::AtomicBool>,
    /// Per worker, the task forwarding its drain signals.
    forwarders: Vec<Option<tokio::task::JoinHandle<()>>>,
}

impl std::fmt::Debug for SchedulerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchedulerState")
            .field("workers", &self.workers.len())
            .field("sessions", &self.sessions.len())
            .finish()
    }
}

impl SchedulerState {
    async fn route(
        &mut self,
        mut req: Box<GenRequest>,
        session: Option<&SessionTurn>,
        hints: Hints,
        gate: Gate,
        may_hold: bool,
    ) -> Routed {
        let sticky = session.and_then(|s| s.sticky);
        // Each candidate with the cached tokens expected there and the request's engine time
        // there (WSPT's processing time: its prefill alone plus its expected decode).
        let expected_output = hints.expected_output_tokens.unwrap_or(req.max_tokens);
        let decode_s = |kv: &KvRouting| expected_output as f64 * kv.cost.decode_s_per_token.unwrap_or(0.0);
        // Its blocks: prompt and expected answer (G1 holds both until it ends).
        let b = self.args.kv.as_ref().map_or(1, |kv| kv.block_tokens.max(1));
        let blocks = (req.prompt.len() + expected_output).div_ceil(b);
        let kv = self.args.kv.clone();
        if self.policy.uses_index()
            && let Some(writer) = kv.as_ref().and_then(|kv| kv.writer.as_ref())
        {
            writer.catch_up(INDEX_CATCH_UP).await;
        }
        let candidates = Candidates { workers: &self.workers, sticky };
        let ranked = self.policy.rank(candidates, kv.as_ref(), &mut req);
        // A policy that does not estimate charges every worker the request's prefill alone.
        let (prefill, decode) = kv.as_ref().map_or((0.0, req.prompt.len() as f64), |kv| {
            (kv.cost.estimate(req.prompt.len(), Default::default(), Queued::default()).ttft_s, decode_s(kv))
        });
        // (worker, predicted cached tokens, its charge there, engine seconds there)
        let order: Vec<(usize, Option<usize>, Charge, f64)> = ranked
            .into_iter()
            .map(|choice| match choice.estimate {
                Some(e) => {
                    let charge = Charge { prefill_s: e.prefill_s, blocks: blocks.saturating_sub(e.g1_blocks) };
                    (choice.worker, Some(e.cached_tokens), charge, e.prefill_s + decode)
                }
                None => (choice.worker, None, Charge { prefill_s: prefill, blocks }, prefill + decode),
            })
            .collect();
        if order.is_empty() {
            return Routed::Refused(SubmitError::NoWorkers);
        }
        // A worker whose engine is down is tried only when every worker's is.
        let down = |i: usize| self.workers[i].as_ref().is_some_and(|w| w.load.is_down());
        let order =
            if order.iter().all(|o| down(o.0)) { order } else { order.into_iter().filter(|o| !down(o.0)).collect() };
        // A session's context beyond what other sessions put in the cache already (its first
        // turn's longest cached prefix anywhere).
        let context = req.prompt.len() + hints.expected_output_tokens.unwrap_or(0);
        let shared = order.iter().filter_map(|o| o.1).max().unwrap_or(0);
        // A session's turn under admission sets its context's tokens in the line (`fits`), and
        // waits if it does not fit and has not waited already.
        let admitted = if gate == Gate::Open { None } else { self.working_set_capacity().zip(session) };
        if let Some((capacity, turn)) = admitted
            && !self.working.fits(&turn.actor.get_id(), context, shared, capacity)
            && gate == Gate::Check
        {
            return Routed::Wait(req);
        }
        // Late binding: with every worker busy, wait here, where the next worker to drain takes
        // the shortest request held, rather than behind one worker's queue.
        // Held requests count against the workers' queues' bound, as queued ones do.
        if may_hold && (!self.held.is_empty() || self.saturated()) {
            let queued: usize = self.workers.iter().flatten().map(|w| w.queue.len()).sum();
            if self.held.len() + queued < self.queues_bound() {
                return Routed::Hold(req, order[0].2.prefill_s);
            }
            tracing::debug!(held = self.held.len(), queued, "every worker is busy and the hold is full; refused");
            return Routed::Refused(SubmitError::Overloaded { workers: order.len(), retry_after: self.retry_after() });
        }
        if let Some((_, turn)) = admitted {
            self.working.observe(&turn.actor.get_id(), req.prompt.len(), shared, gate == Gate::Admit);
        }
        let leases = self.lease_plan(&mut req);
        let (events, rx) = mpsc::unbounded_channel();
        let mut job = Job {
            req: *req,
            predicted_cached: None,
            priority: hints.priority,
            tier: hints.strict,
            cost_s: 0.0,
            charge: Charge::default(),
            events,
            queued_at: tokio::time::Instant::now(),
        };
        for &(i, predicted, charge, cost_s) in &order {
            let Some(handle) = &self.workers[i] else { continue };
            job.predicted_cached = predicted;
            job.cost_s = cost_s;
            job.charge = charge;
            handle.load.add(&job.req, charge);
            match handle.queue.try_push(job) {
                Ok(()) => {
                    tracing::debug!(worker = i, predicted_cached = ?predicted, cost_s, "routed");
                    let lessee = session.map_or(Lessee { owner: 0, tenant: hints.tenant }, |s| s.lessee);
                    let (leased_tokens, chains) = self.grant(lessee, leases);
                    return Routed::Queued(Submitted { events: rx, worker: i, leased_tokens }, chains);
                }
                Err(PushError::Full(j) | PushError::Closed(j)) => {
                    handle.load.remove(&j.req, false, j.charge);
                    job = *j;
                }
            }
        }
        tracing::debug!(workers = order.len(), "every worker's queue is full; refused");
        Routed::Refused(SubmitError::Overloaded { workers: order.len(), retry_after: self.retry_after() })
    }

    /// Whether a worker up has no request at all, the node's or its engine's other clients'.
    fn a_worker_is_idle(&self) -> bool {
        self.workers.iter().flatten().any(|w| !w.load.is_down() && w.load.queued().requests == 0)
    }

    /// Whether late binding holds requests now: under `kv_aware` with `router.late_binding` set,
    /// while every worker up has more estimated prefill ahead than that.
    fn saturated(&self) -> bool {
        let Some(kv) = self.args.kv.as_ref().filter(|_| self.policy.uses_index()) else {
            return false;
        };
        let limit = kv.admission.late_binding.as_secs_f64();
        let mut up = self.workers.iter().flatten().peekable();
        limit > 0.0 && up.peek().is_some() && up.all(|w| w.load.prefill_s() > limit)
    }

    /// The tokens the working set may hold: the cache — the workers' G1 together and the
    /// nodes' G2 — times `router.working_set`, times the share the thrashing measured leaves
    /// ([`crate::admission`]). `None` (no admission) under another policy, without an index, or
    /// while a worker's G1 size is unknown.
    fn working_set_capacity(&self) -> Option<usize> {
        let kv = self.args.kv.as_ref().filter(|_| self.policy.uses_index())?;
        let admission = kv.admission;
        if admission.working_set <= 0.0 {
            return None;
        }
        let mut g1 = 0;
        for w in self.workers.iter().flatten() {
            match w.load.queued().g1_blocks {
                0 => return None,
                blocks => g1 += blocks,
            }
        }
        let blocks = (g1 > 0).then_some(g1 + admission.cache_blocks)?;
        Some((blocks as f64 * kv.block_tokens as f64 * admission.working_set * self.working.share()) as usize)
    }

    /// Takes a request to route: without admission, or without a session, it goes at once; a
    /// session's turn goes if it fits the working set, and waits otherwise (past the workers'
    /// queues' worth of waiting turns it is refused). Then admits what fits.
    async fn admit(&mut self, myself: &SchedulerRef, parked: Parked) {
        self.working.expire(tokio::time::Instant::now());
        let gate = match &parked.session {
            Some(turn) if self.working_set_capacity().is_some() => {
                self.working.arrive(turn.actor.get_id(), parked.hints.priority);
                Gate::Check
            }
            _ => Gate::Open,
        };
        if let Some(waits) = self.dispatch(parked, gate, true).await {
            if self.parked.len() >= self.queues_bound() {
                let workers = self.workers.iter().flatten().count();
                let retry_after = self.retry_after();
                self.finish_waiting(&waits);
                let _ = waits.reply.send(Err(SubmitError::Overloaded { workers, retry_after }));
            } else {
                self.parked.push_back(waits);
            }
        }
        self.drain(myself).await;
    }

    /// Routes the waiting turns that fit now, and those that waited their longest (their
    /// sessions move to the front of the line); drops those whose caller is gone; and sets a
    /// wake-up for when the next may go.
    async fn drain(&mut self, myself: &SchedulerRef) {
        let now = tokio::time::Instant::now();
        self.working.expire(now);
        let max_wait = self.args.kv.as_ref().map_or(Duration::ZERO, |kv| kv.admission.max_wait);
        let backed = self.args.kv.as_ref().is_some_and(|kv| kv.admission.cache_blocks > 0);
        if !self.parked.is_empty() {
            let capacity = self.working_set_capacity();
            let fit: std::collections::HashSet<ActorId> =
                capacity.map(|c| self.working.admissible(c)).unwrap_or_default().into_iter().collect();
            for parked in std::mem::take(&mut self.parked) {
                let key = parked.session.as_ref().map(|s| s.actor.get_id());
                if parked.reply.is_closed() {
                    self.finish_waiting(&parked);
                    continue;
                }
                // Waiting keeps the contexts of the sessions in line from being evicted by
                // work that would run beside them. With a G2 behind G1 what is evicted is
                // loaded back, so a worker with nothing to do would sit out the wait for
                // little: the longest-waiting turn takes it. Without one, the evicted context
                // is computed again, and waiting wins (the replays of `../shared/traces/` say
                // so: p50 TTFT 144 ms against 445 ms).
                let waited_out = now >= parked.since + max_wait || (backed && self.a_worker_is_idle());
                if capacity.is_some()
                    && waited_out
                    && let Some(key) = &key
                {
                    self.working.promote(key);
                }
                if capacity.is_none() || waited_out || key.is_none_or(|k| fit.contains(&k)) {
                    // `Admit`, even with admission now off: the line still counts this turn
                    // as waiting until it is routed.
                    if let Some(waits) = self.dispatch(parked, Gate::Admit, true).await {
                        self.parked.push_back(waits);
                    }
                } else {
                    self.parked.push_back(parked);
                }
            }
        }
        // Late binding: held requests whose caller is gone leave; the rest go, by when they are
        // due, until every worker is busy again.
        let gone: Vec<_> = self.held.iter().filter(|(_, h)| h.parked.reply.is_closed()).map(|(k, _)| *k).collect();
        for key in gone {
            if let Some(held) = self.held.remove(&key)
                && held.gate != Gate::Open
            {
                self.finish_waiting(&held.parked);
            }
        }
        while !self.held.is_empty() && !self.saturated() {
            let Some((_, held)) = self.held.pop_first() else { break };
            if let Some(waits) = self.dispatch(held.parked, held.gate, false).await {
                self.parked.push_back(waits);
            }
        }
        // Drained workers wake the scheduler while it holds requests or turns wait for room.
        self.holding.store(!self.held.is_empty() || !self.parked.is_empty(), std::sync::atomic::Ordering::Relaxed);
        telemetry::set_router_held(self.held.len());
        telemetry::set_router_waiting(self.parked.len());
        telemetry::set_working_set(self.working.len(), self.working.tokens(), self.working_set_capacity());
        // The next may go when a session leaves the line or one waited its longest.
        let longest = self.parked.iter().map(|p| p.since + max_wait).min();
        if let Some(longest) = longest {
            let due = self.working.next_expiry().map_or(longest, |at| at.min(longest)).max(now);
            if self.wake_at.is_none_or(|at| due < at || at <= now) {
                self.wake_at = Some(due);
                myself.send_after(due - now, || SchedulerMsg::Admit);
            }
        }
    }

    /// Forwards `handle`'s drain signals as [`SchedulerMsg::Drained`] while requests are held
    /// (with late binding or working-set admission on); replaces the forwarder of the worker's
    /// previous handle.
    fn forward_drains(&mut self, myself: &SchedulerRef, handle: &WorkerHandle) {
        let waits = self
            .args
            .kv
            .as_ref()
            .is_some_and(|kv| !kv.admission.late_binding.is_zero() || kv.admission.working_set > 0.0);
        if !waits || !self.policy.uses_index() {
            return;
        }
        if self.forwarders.len() <= handle.id {
            self.forwarders.resize_with(handle.id + 1, || None);
        }
        let (load, me, holding) = (handle.load.clone(), myself.clone(), self.holding.clone());
        let forwarder = tokio::spawn(async move {
            loop {
                load.drained().await;
                if holding.load(std::sync::atomic::Ordering::Relaxed) && me.cast(SchedulerMsg::Drained).is_err() {
                    break;
                }
            }
        });
        if let Some(old) = self.forwarders[handle.id].replace(forwarder) {
            old.abort();
        }
    }

    /// The working set's side of a waiting turn that is routed, refused or abandoned.
    fn finish_waiting(&mut self, parked: &Parked) {
        if let Some(turn) = &parked.session {
            self.working.done(&turn.actor.get_id(), tokio::time::Instant::now());
        }
    }

    /// Most requests waiting at the router for the working set, and most held by late binding
    /// and queued on workers together: as many as the workers' queues hold.
    fn queues_bound(&self) -> usize {
        self.workers.iter().flatten().map(|w| w.queue.bound()).sum::<usize>().max(1)
    }

    /// Routes one request and answers its caller, or holds it (late binding, if `may_hold`);
    /// gives it back if it must wait for the working set.
    async fn dispatch(&mut self, parked: Parked, gate: Gate, may_hold: bool) -> Option<Parked> {
        if parked.reply.is_closed() {
            if gate != Gate::Open {
                self.finish_waiting(&parked);
            }
            return None;
        }
        let Parked { req, session, hints, reply, since } = parked;
        let prompt_tokens = req.prompt.len();
        let span = tracing::info_span!("route", request_id = req.log_id());
        let routed = self.route(req, session.as_ref(), hints, gate, may_hold).instrument(span).await;
        if gate != Gate::Open
            && !matches!(routed, Routed::Wait(_) | Routed::Hold(..))
            && let Some(turn) = &session
        {
            self.working.done(&turn.actor.get_id(), tokio::time::Instant::now());
        }
        match routed {
            Routed::Wait(req) => return Some(Parked { req, session, hints, reply, since }),
            Routed::Hold(req, prefill_s) => {
                let weight = 2f64.powf(f64::from(hints.priority).clamp(-30.0, 30.0));
                let due = since + Duration::from_secs_f64((HOLD_STRETCH * prefill_s / weight).clamp(0.0, 86_400.0));
                self.held_seq += 1;
                let gate = if gate == Gate::Check { Gate::Pass } else { gate };
                let parked = Parked { req, session, hints, reply, since };
                self.held.insert((due, self.held_seq), Held { parked, gate });
            }
            Routed::Refused(e) => {
                let _ = reply.send(Err(e));
            }
            Routed::Queued(submitted, leased) => {
                telemetry::record_router_wait(since.elapsed());
                if let Some(turn) = &session
                    && let Err(ractor::MessagingErr::SendErr(SessionMsg::Routed { leased, .. })) =
                        turn.actor.cast(SessionMsg::Routed { worker: submitted.worker, prompt_tokens, leased })
                {
                    // The session ended while its request was being routed: nobody would
                    // release these leases.
                    if let Some(tiers) = self.args.kv.as_ref().and_then(|kv| kv.leases.as_ref()) {
                        for chain in leased {
                            tiers.unlease(turn.lessee, &chain.blocks, tiers.now());
                        }
                    }
                }
                let _ = reply.send(Ok(submitted));
            }
        }
        None
    }

    /// When a full node is worth retrying: the least busy worker's queued engine time (the cost
    /// model's estimate of what a request admitted now would wait), at least a second.
    fn retry_after(&self) -> Option<Duration> {
        let kv = self.args.kv.as_ref()?;
        // The wait a request admitted now would see on the least busy worker: the whole queue
        // ahead of it, not one request's share (a share said 1 s while admitted requests waited
        // 10.9 s).
        let wait = self
            .workers
            .iter()
            .flatten()
            .filter(|w| w.load.requests() > 0)
            .map(|w| {
                let queued = w.load.queued();
                kv.cost.estimate(1, Default::default(), queued).ttft_s
                    - kv.cost.estimate(1, Default::default(), Queued::default()).ttft_s
            })
            .min_by(f64::total_cmp)?;
        Some(Duration::from_secs_f64(wait.clamp(1.0, 600.0)))
    }
}

/// Breakpoints a request may lease (Anthropic's limit).
pub const MAX_LEASES_PER_REQUEST: usize = 4;

/// Longest a decision waits (asleep, never spinning or blocking the actor's thread) for the index
/// writer to apply the KV events sent before it: past that it routes on a view a few events
/// behind, which costs at most a missed hit, never a wrong answer.
const INDEX_CATCH_UP: Duration = Duration::from_millis(2);

impl Actor for SchedulerActor {
    type Msg = SchedulerMsg;
    type State = SchedulerState;
    type Arguments = SchedulerArgs;

    async fn pre_start(&self, _: SchedulerRef, args: SchedulerArgs) -> Result<SchedulerState, ActorProcessingErr> {
        let gap = args.kv.as_ref().map_or(Duration::ZERO, |kv| kv.admission.session_gap);
        Ok(SchedulerState {
            policy: routing::for_config(args.policy, args.seed),
            args,
            workers: Vec::new(),
            sessions: HashMap::new(),
            session_of: HashMap::new(),
            working: WorkingSet::new(gap),
            parked: VecDeque::new(),
            wake_at: None,
            held: Default::default(),
            held_seq: 0,
            holding: Default::default(),
            forwarders: Vec::new(),
        })
    }

    async fn handle(
        &self,
        myself: SchedulerRef,
        msg: SchedulerMsg,
        state: &mut SchedulerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SchedulerMsg::Submit { req, session, hints, reply } => {
                // A session's request goes through its actor, which sends it back to be routed.
                let tenant = hints.tenant;
                let mut msg = SessionMsg::Submit { req, hints, reply };
                if let Some(id) = session {
                    // An actor that is ending (drained at its idle timeout, or at the cap) refuses
                    // new messages: the conversation goes on in a new one.
                    for _ in 0..2 {
                        let Some(actor) = state.session_actor(&myself, id.clone(), tenant).await else { break };
                        match actor.cast(msg) {
                            Ok(()) => return Ok(()),
                            Err(ractor::MessagingErr::SendErr(back)) => {
                                msg = back;
                                state.forget_session(&actor);
                            }
                            Err(_) => return Ok(()),
                        }
                    }
                }
                if let SessionMsg::Submit { req, hints, reply } = msg {
                    let since = tokio::time::Instant::now();
                    state.admit(&myself, Parked { req, session: None, hints, reply, since }).await;
                }
            }
            SchedulerMsg::Route { req, session, hints, reply } => {
                let since = tokio::time::Instant::now();
                state.admit(&myself, Parked { req, session, hints, reply, since }).await;
            }
            SchedulerMsg::Admit => {
                state.wake_at = None;
                state.drain(&myself).await;
            }
            SchedulerMsg::Drained => state.drain(&myself).await,
            SchedulerMsg::WorkerUp(handle) => {
                let id = handle.id;
                if state.workers.len() <= id {
                    state.workers.resize_with(id + 1, || None);
                }
                state.forward_drains(&myself, &handle);
                state.workers[id] = Some(handle);
                // A worker (new, or back) adds to the cache.
                state.drain(&myself).await;
            }
            SchedulerMsg::WorkerDown(id) => {
                if let Some(slot) = state.workers.get_mut(id) {
                    *slot = None;
                }
            }
            SchedulerMsg::Status(reply) => {
                let _ = reply.send(SchedulerStatus {
                    workers_up: state.workers.iter().filter(|w| w.is_some()).count(),
                    sessions: state.sessions.len(),
                });
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _: SchedulerRef,
        event: SupervisionEvent,
        state: &mut SchedulerState,
    ) -> Result<(), ActorProcessingErr> {
        // A session that ends (idle) or fails is forgotten; the conversation starts a new one.
        if let SupervisionEvent::ActorTerminated(cell, ..) | SupervisionEvent::ActorFailed(cell, _) = event
            && let Some(id) = state.session_of.remove(&cell.get_id())
            && state.sessions.get(&id).is_some_and(|e| e.actor.get_id() == cell.get_id())
        {
            state.sessions.remove(&id);
        }
        Ok(())
    }

    async fn post_stop(&self, _: SchedulerRef, state: &mut SchedulerState) -> Result<(), ActorProcessingErr> {
        for entry in state.sessions.values() {
            entry.actor.stop(None);
        }
        // Dropping the handles closes the workers' queues from this side.
        state.workers.clear();
        for parked in state.parked.drain(..).chain(std::mem::take(&mut state.held).into_values().map(|h| h.parked)) {
            let _ = parked.reply.send(Err(SubmitError::ShuttingDown));
        }
        for forwarder in state.forwarders.drain(..).flatten() {
            forwarder.abort();
        }
        telemetry::set_router_waiting(0);
        telemetry::set_router_held(0);
        Ok(())
    }
}
