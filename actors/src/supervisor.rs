//! The NodeSupervisor: the root of a node's actor tree.
//!
//! It spawns and links the SchedulerActor, one WorkerActor per engine instance, and the G2 and
//! G3 store actors, and it decides what happens when one of them fails:
//! - a **worker** is restarted with a fresh engine (its G1 was reported cleared by the worker;
//!   the restart is counted), and the scheduler gets its new queue; a worker that cannot be
//!   rebuilt is retried every second while the others serve;
//! - the **scheduler** is restarted and every worker reconnected (sessions start afresh);
//! - a **store actor** is restarted; if it was G3's, G3 is marked degraded until the new actor's
//!   probe passes.
//!
//! The node never exits because one child did. [`NodeMsg::Shutdown`] stops the tree in order:
//! the scheduler first (no new requests; it drops its queue handles), then the workers (each
//! finishes its queue and flushes write-through), then the stores.

use std::time::Duration;

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};

use crate::scheduler::{SchedulerActor, SchedulerArgs, SchedulerMsg, SchedulerRef};
use crate::stores::{G2StoreActor, G3StoreActor, StoreArgs, StoreRef};
use crate::telemetry;
use crate::worker::{WorkerActor, WorkerArgs, WorkerMsg, WorkerRef};
use dynamo_config::TierName;

/// The NodeSupervisor.
#[derive(Debug)]
pub struct NodeSupervisor;

/// A reference to the NodeSupervisor.
pub type NodeRef = ActorRef<NodeMsg>;

/// What a node's actor tree starts from.
#[derive(Clone, Debug)]
pub struct NodeArgs {
    /// One per worker, in order.
    pub workers: Vec<WorkerArgs>,
    /// The scheduler.
    pub scheduler: SchedulerArgs,
    /// G2's store actor, when G2 is enabled.
    pub g2: Option<StoreArgs>,
    /// G3's store actor, when G3 is enabled.
    pub g3: Option<StoreArgs>,
}

/// Messages of the NodeSupervisor.
#[derive(Debug)]
pub enum NodeMsg {
    /// Reply: the scheduler as it is now (it changes when it is restarted). Always answered.
    Scheduler(RpcReplyPort<SchedulerRef>),
    /// Reply: `()` once the tree has stopped in order (see the module doc).
    Shutdown(RpcReplyPort<()>),
    /// No reply: try to start worker `0` again (after a failed restart).
    RestartWorker(usize),
}

/// The supervisor's state.
#[derive(Debug)]
pub struct NodeState {
    args: NodeArgs,
    scheduler: SchedulerRef,
    workers: Vec<Option<WorkerRef>>,
    g2: Option<StoreRef>,
    g3: Option<StoreRef>,
    stopping: bool,
}

/// What a supervision event is about.
enum Child {
    Scheduler,
    Worker(usize),
    G2,
    G3,
}

impl NodeState {
    fn which(&self, cell: &ActorCell) -> Option<Child> {
        let id = cell.get_id();
        if self.scheduler.get_id() == id {
            return Some(Child::Scheduler);
        }
        if let Some(i) = self.workers.iter().position(|w| w.as_ref().is_some_and(|w| w.get_id() == id)) {
            return Some(Child::Worker(i));
        }
        if self.g2.as_ref().is_some_and(|g| g.get_id() == id) {
            return Some(Child::G2);
        }
        if self.g3.as_ref().is_some_and(|g| g.get_id() == id) {
            return Some(Child::G3);
        }
        None
    }
}

async fn spawn_worker(myself: &NodeRef, args: WorkerArgs, scheduler: &SchedulerRef) -> Result<WorkerRef, String> {
    let id = args.id;
    let (worker, _) = Actor::spawn_linked(None, WorkerActor, args, myself.get_cell())
        .await
        .map_err(|e| format!("worker {id}: {e}"))?;
    let handle = worker
        .call(WorkerMsg::Connect, Some(Duration::from_secs(10)))
        .await
        .map_err(|e| format!("worker {id}: {e}"))?
        .success_or(format!("worker {id} did not answer"))?;
    scheduler.cast(SchedulerMsg::WorkerUp(handle)).map_err(|e| format!("scheduler: {e}"))?;
    Ok(worker)
}

async fn spawn_scheduler(myself: &NodeRef, args: &NodeArgs) -> Result<SchedulerRef, ActorProcessingErr> {
    let (scheduler, _) = Actor::spawn_linked(None, SchedulerActor, args.scheduler.clone(), myself.get_cell()).await?;
    Ok(scheduler)
}

impl Actor for NodeSupervisor {
    type Msg = NodeMsg;
    type State = NodeState;
    type Arguments = NodeArgs;

    async fn pre_start(&self, myself: NodeRef, args: NodeArgs) -> Result<NodeState, ActorProcessingErr> {
        let scheduler = spawn_scheduler(&myself, &args).await?;
        let g2 = match &args.g2 {
            Some(a) => Some(Actor::spawn_linked(None, G2StoreActor, a.clone(), myself.get_cell()).await?.0),
            None => None,
        };
        let g3 = match &args.g3 {
            Some(a) => Some(Actor::spawn_linked(None, G3StoreActor, a.clone(), myself.get_cell()).await?.0),
            None => None,
        };
        let mut workers = Vec::with_capacity(args.workers.len());
        for w in &args.workers {
            workers.push(Some(spawn_worker(&myself, w.clone(), &scheduler).await?));
        }
        Ok(NodeState { args, scheduler, workers, g2, g3, stopping: false })
    }

    async fn handle(&self, myself: NodeRef, msg: NodeMsg, state: &mut NodeState) -> Result<(), ActorProcessingErr> {
        match msg {
            NodeMsg::Scheduler(reply) => {
                let _ = reply.send(state.scheduler.clone());
            }
            NodeMsg::RestartWorker(i) => {
                if state.stopping || state.workers.get(i).is_none_or(|w| w.is_some()) {
                    return Ok(());
                }
                restart_worker(&myself, state, i).await;
            }
            NodeMsg::Shutdown(reply) => {
                state.stopping = true;
                let _ = state.scheduler.stop_and_wait(Some("shutdown".into()), None).await;
                for worker in state.workers.iter_mut().filter_map(Option::take) {
                    let _ = worker.stop_and_wait(Some("shutdown".into()), None).await;
                }
                for store in [state.g2.take(), state.g3.take()].into_iter().flatten() {
                    let _ = store.stop_and_wait(Some("shutdown".into()), None).await;
                }
                let _ = reply.send(());
                myself.stop(Some("shutdown".into()));
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: NodeRef,
        event: SupervisionEvent,
        state: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, why) = match event {
            SupervisionEvent::ActorFailed(cell, err) => (cell, err.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => (cell, reason.unwrap_or_else(|| "stopped".into())),
            _ => return Ok(()),
        };
        if state.stopping {
            return Ok(());
        }
        match state.which(&cell) {
            Some(Child::Worker(i)) => {
                tracing::warn!(worker = i, reason = %why, "worker stopped; restarting it");
                state.workers[i] = None;
                let _ = state.scheduler.cast(SchedulerMsg::WorkerDown(i));
                restart_worker(&myself, state, i).await;
            }
            Some(Child::Scheduler) => {
                tracing::error!(reason = %why, "scheduler stopped; restarting it and reconnecting the workers");
                state.scheduler = spawn_scheduler(&myself, &state.args).await?;
                for w in state.workers.iter().flatten() {
                    if let Ok(ractor::rpc::CallResult::Success(handle)) =
                        w.call(WorkerMsg::Connect, Some(Duration::from_secs(10))).await
                    {
                        let _ = state.scheduler.cast(SchedulerMsg::WorkerUp(handle));
                    }
                }
            }
            Some(Child::G2) => {
                tracing::error!(reason = %why, "G2 store actor stopped; restarting it");
                if let Some(args) = state.args.g2.clone() {
                    state.g2 = Some(Actor::spawn_linked(None, G2StoreActor, args, myself.get_cell()).await?.0);
                }
            }
            Some(Child::G3) => {
                tracing::error!(reason = %why, "G3 store actor stopped; G3 is degraded until its successor's probe passes");
                if let Some(args) = state.args.g3.clone() {
                    if let Some(g3) = &args.tiers.g3 {
                        g3.health.set_degraded(true);
                        telemetry::set_tier_degraded(TierName::G3, true);
                    }
                    state.g3 = Some(Actor::spawn_linked(None, G3StoreActor, args, myself.get_cell()).await?.0);
                }
            }
            None => {}
        }
        Ok(())
    }
}

async fn restart_worker(myself: &NodeRef, state: &mut NodeState, i: usize) {
    match spawn_worker(myself, state.args.workers[i].clone(), &state.scheduler).await {
        Ok(worker) => {
            tracing::info!(worker = i, "worker restarted with an empty G1");
            state.workers[i] = Some(worker);
        }
        Err(e) => {
            tracing::error!(worker = i, error = %e, "worker restart failed; retrying in 1 s");
            myself.send_after(Duration::from_secs(1), move || NodeMsg::RestartWorker(i));
        }
    }
}
