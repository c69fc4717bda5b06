//! The SchedulerActor: routes every request to a worker and queues it there.
//!
//! It knows every worker's bounded queue and load ([`WorkerHandle`]) and every live session
//! (a [`SessionActor`] per conversation, which it supervises). A request goes to the first worker
//! in the routing policy's order whose queue has room; when none has, the answer is
//! [`SubmitError::Overloaded`] at once: the node never builds an unbounded backlog.
//!
//! Routing policies (`router.policy`): `round_robin`, `random`, and `kv_aware`. Until the global
//! prefix index lands, `kv_aware` prefers the session's previous worker (whose G1 holds the
//! conversation) and otherwise the least loaded worker; the node's shared G2/G3 make any other
//! worker's load of the prefix cheap either way.

use std::collections::HashMap;
use std::time::Duration;

use dynamo_config::RoutingPolicy;
use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};
use tokio::sync::mpsc;

use crate::session::{SessionActor, SessionArgs, SessionMsg, SessionRef};
use crate::worker::{GenRequest, Job, JobEvent, WorkerHandle};

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
    /// Seed of the `random` policy.
    pub seed: u64,
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
    },
    /// No worker is up (all are restarting).
    #[error("no worker is available right now")]
    NoWorkers,
    /// The node is shutting down.
    #[error("the node is shutting down")]
    ShuttingDown,
}

/// A queued request: its events, and the worker it went to.
#[derive(Debug)]
pub struct Submitted {
    /// The request's events; the last one is `Done` or `Failed`.
    pub events: mpsc::UnboundedReceiver<JobEvent>,
    /// The worker.
    pub worker: usize,
}

/// Messages of the SchedulerActor.
#[derive(Debug)]
pub enum SchedulerMsg {
    /// Reply: the request was queued on a worker (its events follow on the receiver), or why not.
    /// Always answered, without waiting for the request to run.
    Submit {
        /// The request.
        req: GenRequest,
        /// Its conversation.
        session: Option<String>,
        /// Where the answer goes.
        reply: RpcReplyPort<Result<Submitted, SubmitError>>,
    },
    /// No reply: a worker is up (new or restarted) behind this handle.
    WorkerUp(WorkerHandle),
    /// No reply: worker `0` is gone until a `WorkerUp`.
    WorkerDown(usize),
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

struct SessionEntry {
    actor: SessionRef,
    last_worker: Option<usize>,
}

/// The scheduler's state.
pub struct SchedulerState {
    args: SchedulerArgs,
    workers: Vec<Option<WorkerHandle>>,
    next: usize,
    rng: u64,
    sessions: HashMap<String, SessionEntry>,
    session_of: HashMap<ActorId, String>,
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
    /// Workers in the order the policy would try them.
    fn order(&mut self, sticky: Option<usize>) -> Vec<usize> {
        let up: Vec<usize> = (0..self.workers.len()).filter(|&i| self.workers[i].is_some()).collect();
        if up.is_empty() {
            return up;
        }
        let n = up.len();
        let start = match self.args.policy {
            RoutingPolicy::Random => {
                // xorshift64*: enough for spreading load, seeded for reproducible tests.
                self.rng ^= self.rng >> 12;
                self.rng ^= self.rng << 25;
                self.rng ^= self.rng >> 27;
                (self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
            }
            _ => {
                self.next = self.next.wrapping_add(1);
                self.next % n
            }
        };
        let mut order: Vec<usize> = (0..n).map(|k| up[(start + k) % n]).collect();
        if self.args.policy == RoutingPolicy::KvAware {
            let load = |i: &usize| self.workers[*i].as_ref().map_or(usize::MAX, |w| w.load.prompt_tokens());
            order.sort_by_key(load);
            if let Some(s) = sticky.filter(|s| up.contains(s)) {
                order.retain(|&i| i != s);
                order.insert(0, s);
            }
        }
        order
    }

    async fn submit(
        &mut self,
        myself: &SchedulerRef,
        req: GenRequest,
        session: Option<String>,
    ) -> Result<Submitted, SubmitError> {
        let sticky = session.as_ref().and_then(|s| self.sessions.get(s)).and_then(|e| e.last_worker);
        let order = self.order(sticky);
        if order.is_empty() {
            return Err(SubmitError::NoWorkers);
        }
        let prompt_tokens = req.prompt.len();
        let (events, rx) = mpsc::unbounded_channel();
        let mut job = Job { req, events };
        for &i in &order {
            let Some(handle) = &self.workers[i] else { continue };
            handle.load.add(prompt_tokens);
            match handle.queue.try_send(job) {
                Ok(()) => {
                    if let Some(id) = session {
                        self.note_turn(myself, id, i, prompt_tokens).await;
                    }
                    return Ok(Submitted { events: rx, worker: i });
                }
                Err(mpsc::error::TrySendError::Full(j)) => {
                    handle.load.remove(prompt_tokens);
                    job = j;
                }
                Err(mpsc::error::TrySendError::Closed(j)) => {
                    handle.load.remove(prompt_tokens);
                    job = j;
                }
            }
        }
        Err(SubmitError::Overloaded { workers: order.len() })
    }

    async fn note_turn(&mut self, myself: &SchedulerRef, id: String, worker: usize, prompt_tokens: usize) {
        if let Some(entry) = self.sessions.get_mut(&id) {
            entry.last_worker = Some(worker);
            let _ = entry.actor.cast(SessionMsg::Turn { worker, prompt_tokens });
            return;
        }
        // A new conversation: its actor is supervised by the scheduler.
        let args = SessionArgs { id: id.clone(), idle_timeout: self.args.session_idle_timeout };
        let (actor, _) = match Actor::spawn_linked(None, SessionActor, args, myself.get_cell()).await {
            Ok(spawned) => spawned,
            Err(e) => {
                tracing::warn!(session = %id, error = %e, "could not start a session actor");
                return;
            }
        };
        let _ = actor.cast(SessionMsg::Turn { worker, prompt_tokens });
        self.session_of.insert(actor.get_id(), id.clone());
        self.sessions.insert(id, SessionEntry { actor, last_worker: Some(worker) });
    }
}

impl Actor for SchedulerActor {
    type Msg = SchedulerMsg;
    type State = SchedulerState;
    type Arguments = SchedulerArgs;

    async fn pre_start(&self, _: SchedulerRef, args: SchedulerArgs) -> Result<SchedulerState, ActorProcessingErr> {
        let rng = args.seed | 1;
        Ok(SchedulerState {
            args,
            workers: Vec::new(),
            next: usize::MAX,
            rng,
            sessions: HashMap::new(),
            session_of: HashMap::new(),
        })
    }

    async fn handle(
        &self,
        myself: SchedulerRef,
        msg: SchedulerMsg,
        state: &mut SchedulerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SchedulerMsg::Submit { req, session, reply } => {
                let result = state.submit(&myself, req, session).await;
                let _ = reply.send(result);
            }
            SchedulerMsg::WorkerUp(handle) => {
                let id = handle.id;
                if state.workers.len() <= id {
                    state.workers.resize_with(id + 1, || None);
                }
                state.workers[id] = Some(handle);
            }
            SchedulerMsg::WorkerDown(id) => {
                if let Some(slot) = state.workers.get_mut(id) {
                    *slot = None;
                }
                for entry in state.sessions.values_mut() {
                    if entry.last_worker == Some(id) {
                        entry.last_worker = None;
                    }
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
        Ok(())
    }
}
