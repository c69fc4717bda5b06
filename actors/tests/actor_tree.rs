//! The actor tree with a scripted engine: bounded admission answers "overloaded" at once and
//! never queues without bound; a worker that panics fails its request, is restarted by the
//! supervisor, and the node keeps serving; a session's turns stay on its worker.

use std::sync::Arc;
use std::time::Duration;

use dynamo_actors::scheduler::{SchedulerArgs, SchedulerMsg, SchedulerRef, SchedulerStatus, SubmitError, Submitted};
use dynamo_actors::supervisor::{NodeArgs, NodeMsg, NodeSupervisor};
use dynamo_actors::worker::{
    Engine, EngineFactory, EngineHost, Finish, GenOutcome, GenRequest, JobEvent, LocalFuture, Ticket, WorkerArgs,
    WorkerError, WorkerEvent,
};
use dynamo_config::{PerTier, QueuePolicy, RoutingPolicy};
use ractor::Actor;
use ractor::rpc::CallResult;
use tokio::sync::Semaphore;

/// Serves one request at a time: waits for a permit per request; a prompt starting with 666
/// panics; answers with its worker id.
struct Scripted {
    id: usize,
    gate: Arc<Semaphore>,
    /// The request being served, answered by `reset` if serving it panics.
    serving: Option<Ticket>,
}

impl Engine for Scripted {
    fn admit(&mut self, ticket: Ticket) -> LocalFuture<'_, ()> {
        Box::pin(async move {
            self.gate.acquire().await.expect("gate").forget();
            let prompt = ticket.req.prompt.clone();
            let ticket = self.serving.insert(ticket);
            assert_ne!(prompt[0], 666, "scripted panic");
            ticket.event(WorkerEvent::Prefilled { cached_tokens: 0, hit_tokens: PerTier::default() });
            ticket.event(WorkerEvent::Token(self.id as u32));
            self.serving.take().expect("serving").finish(Ok(GenOutcome {
                tokens: vec![self.id as u32],
                cached_tokens: 0,
                hit_tokens: PerTier::default(),
                prefill_tokens: prompt.len(),
                finish: Finish::Length,
                ttft: Duration::ZERO,
                corrupt_blocks: 0,
            }));
        })
    }

    fn reset(&mut self, why: &str) -> usize {
        if let Some(ticket) = self.serving.take() {
            ticket.finish(Err(WorkerError::Panicked(why.to_string())));
        }
        0
    }

    fn flush(&mut self) -> LocalFuture<'_, ()> {
        Box::pin(async {})
    }
}

fn request(first: u32) -> GenRequest {
    GenRequest::greedy(vec![first, 1, 2], 1)
}

async fn node(gate: Arc<Semaphore>, policy: RoutingPolicy) -> (ractor::ActorRef<NodeMsg>, SchedulerRef) {
    node_with(gate, policy, 1024).await
}

async fn node_with(
    gate: Arc<Semaphore>,
    policy: RoutingPolicy,
    max_sessions: usize,
) -> (ractor::ActorRef<NodeMsg>, SchedulerRef) {
    let factory: EngineFactory =
        Arc::new(move |id| Ok(Box::new(Scripted { id, gate: gate.clone(), serving: None }) as Box<dyn Engine>));
    let workers = (0..2)
        .map(|id| WorkerArgs {
            id,
            factory: factory.clone(),
            queue_bound: 1,
            queue_policy: QueuePolicy::Fcfs,
            host: EngineHost::Thread,
        })
        .collect();
    let args = NodeArgs {
        workers,
        scheduler: SchedulerArgs {
            policy,
            session_idle_timeout: Duration::from_secs(60),
            max_sessions,
            seed: 1,
            kv: None,
        },
        g2: None,
        g3: None,
    };
    let (root, _) = Actor::spawn(None, NodeSupervisor, args).await.expect("node");
    let CallResult::Success(scheduler) = root.call(NodeMsg::Scheduler, None).await.expect("call") else {
        panic!("no scheduler")
    };
    (root, scheduler)
}

async fn submit(s: &SchedulerRef, req: GenRequest, session: Option<&str>) -> Result<Submitted, SubmitError> {
    let session = session.map(str::to_string);
    match s
        .call(|reply| SchedulerMsg::Submit { req: Box::new(req), session, hints: Default::default(), reply }, None)
        .await
    {
        Ok(CallResult::Success(r)) => r,
        other => panic!("scheduler did not answer: {other:?}"),
    }
}

async fn finish(mut s: Submitted) -> Result<GenOutcome, WorkerError> {
    while let Some(e) = s.events.recv().await {
        match e {
            JobEvent::Done(o) => return Ok(o),
            JobEvent::Failed(e) => return Err(e),
            JobEvent::Event(_) => {}
        }
    }
    panic!("the stream ended without an answer")
}

async fn status(s: &SchedulerRef) -> SchedulerStatus {
    match s.call(SchedulerMsg::Status, None).await {
        Ok(CallResult::Success(st)) => st,
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_node_answers_overloaded_at_once_and_serves_everything_it_took() {
    let gate = Arc::new(Semaphore::new(0));
    let (root, s) = node(gate.clone(), RoutingPolicy::RoundRobin).await;
    // Two requests run (one per worker, blocked on the gate), two wait (queue bound 1 each).
    let mut taken = Vec::new();
    for i in 0..4 {
        taken.push(submit(&s, request(i), None).await.expect("room"));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let refused = submit(&s, request(9), None).await;
    assert!(matches!(refused, Err(SubmitError::Overloaded { workers: 2, .. })), "{refused:?}");
    gate.add_permits(4);
    for t in taken {
        finish(t).await.expect("served");
    }
    let _ = root.call(NodeMsg::Shutdown, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_worker_is_restarted_and_the_node_goes_on() {
    let gate = Arc::new(Semaphore::new(100));
    let (root, s) = node(gate, RoutingPolicy::RoundRobin).await;
    let failed = finish(submit(&s, request(666), None).await.expect("queued")).await;
    assert!(matches!(failed, Err(WorkerError::Panicked(ref m)) if m.contains("scripted panic")), "{failed:?}");
    // Until the restarted worker is back, the other one takes everything; then both serve.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut served_by = std::collections::HashSet::new();
    for i in 0.. {
        let out = finish(submit(&s, request(i), None).await.expect("room")).await.expect("served");
        served_by.insert(out.tokens[0]);
        if served_by.len() == 2 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the worker never came back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(status(&s).await.workers_up, 2);
    assert_eq!(served_by.len(), 2, "both workers serve again");
    let _ = root.call(NodeMsg::Shutdown, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_turns_stay_on_its_worker() {
    let gate = Arc::new(Semaphore::new(100));
    let (root, s) = node(gate, RoutingPolicy::KvAware).await;
    let first = finish(submit(&s, request(1), Some("agent-7")).await.expect("room")).await.expect("served");
    for i in 0..4 {
        // Other traffic in between.
        finish(submit(&s, request(10 + i), None).await.expect("room")).await.expect("served");
        let again = finish(submit(&s, request(1), Some("agent-7")).await.expect("room")).await.expect("served");
        assert_eq!(again.tokens, first.tokens, "turn {i} stayed on worker {:?}", first.tokens);
    }
    assert_eq!(status(&s).await.sessions, 1);
    let _ = root.call(NodeMsg::Shutdown, None).await;
}

/// Clients choose session ids: past `max_sessions` live ones, a new conversation ends the
/// idlest, so their number (and the memory they hold) stays bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_sessions_are_capped() {
    let gate = Arc::new(Semaphore::new(100));
    let (root, s) = node_with(gate, RoutingPolicy::KvAware, 3).await;
    for i in 0..10 {
        let id = format!("agent-{i}");
        finish(submit(&s, request(i), Some(&id)).await.expect("room")).await.expect("served");
        // Keep agent-0 busy: it is never the idlest.
        finish(submit(&s, request(100 + i), Some("agent-0")).await.expect("room")).await.expect("served");
        assert!(status(&s).await.sessions <= 3, "after {} sessions: {:?}", i + 1, status(&s).await);
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(status(&s).await.sessions, 3);
    let _ = root.call(NodeMsg::Shutdown, None).await;
}
