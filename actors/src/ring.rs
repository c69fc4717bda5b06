//! The node's outer ring: the parts that run around the actor tree and the API (the engine
//! endpoint, G4's block server and peer links, cluster membership, the tiers' metrics poller, the
//! traffic recorder, the lease saver), built as stages, supervised, and stopped in one order.
//!
//! A [`RingBuilder`] takes each part as a [`Stage`]: its name, the [`Phase`] it stops in, its
//! [`Restart`] policy and how to start it. [`RingBuilder::start`] starts the stages in the order
//! given; a stage that fails to start stops those already running (in the ring's stop order) and
//! returns its error. The running [`Ring`] watches every stage's task: one that ends while the
//! node runs (a panic, or a part that gave up) is logged, counted in
//! `dynamo_node_ring_restarts_total{part}`, and started again after its backoff if its policy
//! says so. [`Ring::stop`] stops one phase's stages, each after those started after it (so a part
//! stops before what it was started on): [`Phase::Outside`] before the API stops accepting (what
//! faces other processes), [`Phase::Inside`] once every response is over (what watches and
//! records the node).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio::task::{AbortHandle, JoinHandle};

use crate::telemetry;

/// A boxed future that outlives its maker.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// When a stage stops, relative to the API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Before the API stops accepting: what other processes reach (peers stop finding the node,
    /// engines stop loading from it).
    Outside,
    /// Once every response is over: what watches and records the node, so it sees the end.
    Inside,
}

/// What the ring does with a stage whose task ends while the node runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Restart {
    /// Started again after `first`, doubled after each failure in a row up to `max` (a start
    /// that then runs for a minute resets it).
    Backoff {
        /// The first wait.
        first: Duration,
        /// The longest wait.
        max: Duration,
    },
    /// Left stopped; the node serves without it. For a part that heals itself (a peer link
    /// reconnects) or whose loss only counts (a recorder counts the lines it could not write).
    Never,
}

impl Restart {
    /// The backoff most parts use: 1 s, doubling up to 30 s.
    pub const BACKOFF: Restart = Restart::Backoff { first: Duration::from_secs(1), max: Duration::from_secs(30) };
}

/// Stops a running stage and waits until it has.
pub type Stop = Box<dyn FnOnce() -> BoxFuture<()> + Send>;

/// A running stage: the task to watch (it ends when the part stops), and how to stop it.
pub struct Running {
    /// Ends when the part stops; the ring restarts it by its policy if that was not asked for.
    pub task: JoinHandle<()>,
    /// Stops the part and waits until it has.
    pub stop: Stop,
}

impl Running {
    /// A part whose task is all there is: stopping aborts it.
    pub fn task(task: JoinHandle<()>) -> Self {
        let abort = task.abort_handle();
        Running { task, stop: Box::new(move || Box::pin(async move { abort.abort() })) }
    }

    /// A part with no task of its own to watch (a thread, or tasks it supervises itself): the
    /// ring only stops it.
    pub fn untasked(stop: impl FnOnce() -> BoxFuture<()> + Send + 'static) -> Self {
        Running { task: tokio::spawn(std::future::pending()), stop: Box::new(stop) }
    }
}

impl fmt::Debug for Running {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Running").field("finished", &self.task.is_finished()).finish_non_exhaustive()
    }
}

/// Starts a stage (again, after a restart).
pub type Start = Box<dyn FnMut() -> BoxFuture<Result<Running, String>> + Send>;

/// One part of the ring.
pub struct Stage {
    name: &'static str,
    phase: Phase,
    restart: Restart,
    start: Start,
}

impl fmt::Debug for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stage")
            .field("name", &self.name)
            .field("phase", &self.phase)
            .field("restart", &self.restart)
            .finish_non_exhaustive()
    }
}

impl Stage {
    /// A stage called `name` (its metric label), stopped in `phase`, restarted by `restart`,
    /// started by `start`.
    pub fn new<F, Fut>(name: &'static str, phase: Phase, restart: Restart, mut start: F) -> Self
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: Future<Output = Result<Running, String>> + Send + 'static,
    {
        Stage { name, phase, restart, start: Box::new(move || Box::pin(start())) }
    }
}

/// The ring's stages, in the order they start; within each phase they stop in the reverse order.
#[derive(Debug, Default)]
pub struct RingBuilder {
    stages: Vec<Stage>,
}

/// Why the ring did not start: the stage that failed, and why.
#[derive(Debug, thiserror::Error)]
#[error("{stage}: {reason}")]
pub struct RingError {
    /// The stage.
    pub stage: &'static str,
    /// Why.
    pub reason: String,
}

impl RingBuilder {
    /// An empty ring.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `stage` after the others.
    pub fn stage(mut self, stage: Stage) -> Self {
        self.stages.push(stage);
        self
    }

    /// Starts every stage in order and the supervisor that watches them. A stage that fails to
    /// start stops the ones already running, outside first, and its error is returned.
    pub async fn start(self) -> Result<Ring, RingError> {
        let mut slots: Vec<Slot> = Vec::with_capacity(self.stages.len());
        let mut tasks = Vec::with_capacity(self.stages.len());
        for mut stage in self.stages {
            match (stage.start)().await {
                Ok(part) => {
                    let mut slot = Slot { stage, part: None, failures: 0, started_at: tokio::time::Instant::now() };
                    tasks.push(slot.run(part));
                    slots.push(slot);
                }
                Err(reason) => {
                    let name = stage.name;
                    for phase in [Phase::Outside, Phase::Inside] {
                        stop_phase(&mut slots, phase).await;
                    }
                    return Err(RingError { stage: name, reason });
                }
            }
        }
        let (tx, rx) = mpsc::channel(4);
        let names = slots.iter().map(|s| s.stage.name).collect();
        let supervisor = tokio::spawn(supervise(slots, tasks, rx));
        Ok(Ring { tx, supervisor: Some(supervisor), names })
    }
}

/// The running ring (see the module doc).
#[derive(Debug)]
pub struct Ring {
    tx: mpsc::Sender<(Phase, oneshot::Sender<()>)>,
    supervisor: Option<JoinHandle<()>>,
    names: Vec<&'static str>,
}

impl Ring {
    /// A ring with no stages.
    pub async fn empty() -> Ring {
        RingBuilder::new().start().await.expect("nothing to fail")
    }

    /// The stages' names, in order.
    pub fn stages(&self) -> &[&'static str] {
        &self.names
    }

    /// Stops `phase`'s stages, last started first, and waits until they have stopped; none of
    /// them is restarted after. Stopping [`Phase::Inside`] ends the supervisor.
    pub async fn stop(&mut self, phase: Phase) {
        let (done, stopped) = oneshot::channel();
        if self.tx.send((phase, done)).await.is_ok() {
            let _ = stopped.await;
        }
        if phase == Phase::Inside
            && let Some(supervisor) = self.supervisor.take()
        {
            let _ = supervisor.await;
        }
    }

    /// Stops both phases, outside first: a start that failed after the ring was up.
    pub async fn stop_all(&mut self) {
        self.stop(Phase::Outside).await;
        self.stop(Phase::Inside).await;
    }
}

struct Slot {
    stage: Stage,
    /// The running part's stop and its task's abort; `None` while it waits to restart, or once
    /// stopped.
    part: Option<(Stop, AbortHandle)>,
    /// Failures in a row, for the backoff.
    failures: u32,
    /// When it last started.
    started_at: tokio::time::Instant,
}

impl Slot {
    /// Takes `part` in: its task is returned to be watched.
    fn run(&mut self, part: Running) -> JoinHandle<()> {
        self.part = Some((part.stop, part.task.abort_handle()));
        self.started_at = tokio::time::Instant::now();
        part.task
    }

    /// The wait before its next start by its policy (`None`: it is not restarted), counting one
    /// more failure in a row.
    fn next_wait(&mut self) -> Option<Duration> {
        let Restart::Backoff { first, max } = self.stage.restart else { return None };
        let wait = backoff(first, max, self.failures);
        self.failures += 1;
        Some(wait)
    }

    /// Stops the part if it runs, and waits until it has.
    async fn stop(&mut self) {
        if let Some((stop, abort)) = self.part.take() {
            stop().await;
            abort.abort();
        }
    }
}

/// Stops `phase`'s parts, last started first.
async fn stop_phase(slots: &mut [Slot], phase: Phase) {
    for slot in slots.iter_mut().rev().filter(|s| s.stage.phase == phase) {
        slot.stop().await;
    }
}

/// What a watched future reports: stage `i`'s task (of generation `gen`) ended, or its restart
/// wait is over.
enum Event {
    Ended(usize, u64),
    Retry(usize),
}

fn watch(i: usize, generation: u64, task: JoinHandle<()>) -> BoxFuture<Event> {
    Box::pin(async move {
        let _ = task.await;
        Event::Ended(i, generation)
    })
}

fn retry_after(i: usize, wait: Duration) -> BoxFuture<Event> {
    Box::pin(async move {
        tokio::time::sleep(wait).await;
        Event::Retry(i)
    })
}

async fn supervise(
    mut slots: Vec<Slot>,
    tasks: Vec<JoinHandle<()>>,
    mut rx: mpsc::Receiver<(Phase, oneshot::Sender<()>)>,
) {
    // Each slot's task is watched under a generation number, so a task that a stop or a restart
    // ended does not count as a failure of its successor.
    let mut generation = vec![0u64; slots.len()];
    let mut stopped = [false; 2];
    let mut watched: FuturesUnordered<BoxFuture<Event>> =
        tasks.into_iter().enumerate().map(|(i, task)| watch(i, 0, task)).collect();
    loop {
        tokio::select! {
            request = rx.recv() => {
                let Some((phase, done)) = request else {
                    // The ring was dropped without a stop: everything stops, in order.
                    for phase in [Phase::Outside, Phase::Inside] {
                        stop_phase(&mut slots, phase).await;
                    }
                    return;
                };
                stopped[phase as usize] = true;
                for (i, slot) in slots.iter_mut().enumerate().rev().filter(|(_, s)| s.stage.phase == phase) {
                    generation[i] += 1;
                    slot.stop().await;
                }
                let _ = done.send(());
                if phase == Phase::Inside {
                    return;
                }
            }
            Some(event) = watched.next() => match event {
                Event::Ended(i, of) if of == generation[i] && !stopped[slots[i].stage.phase as usize] => {
                    let slot = &mut slots[i];
                    slot.part = None;
                    telemetry::record_ring_restart(slot.stage.name);
                    if slot.started_at.elapsed() >= Duration::from_secs(60) {
                        slot.failures = 0;
                    }
                    match slot.next_wait() {
                        None => {
                            tracing::error!(part = slot.stage.name, "stopped; the node serves without it (its policy: not restarted)");
                        }
                        Some(wait) => {
                            tracing::error!(part = slot.stage.name, ?wait, "stopped; restarting it");
                            watched.push(retry_after(i, wait));
                        }
                    }
                }
                Event::Retry(i) if !stopped[slots[i].stage.phase as usize] => {
                    let slot = &mut slots[i];
                    match (slot.stage.start)().await {
                        Ok(part) => {
                            tracing::info!(part = slot.stage.name, "restarted");
                            generation[i] += 1;
                            let task = slot.run(part);
                            watched.push(watch(i, generation[i], task));
                        }
                        Err(reason) => {
                            let Some(wait) = slot.next_wait() else { continue };
                            tracing::error!(part = slot.stage.name, %reason, ?wait, "restart failed; trying again");
                            watched.push(retry_after(i, wait));
                        }
                    }
                }
                Event::Ended(..) | Event::Retry(_) => {}
            },
        }
    }
}

/// The wait before restart number `failures + 1`.
fn backoff(first: Duration, max: Duration, failures: u32) -> Duration {
    first.saturating_mul(1u32 << failures.min(16)).min(max)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use super::*;

    type Log = Arc<Mutex<Vec<String>>>;

    /// A stage whose task runs until stopped, logging its starts and stops; with `fail_first`,
    /// its first `fail_first` runs panic at once instead.
    fn logged(name: &'static str, phase: Phase, restart: Restart, log: &Log, fail_first: usize) -> Stage {
        let (log, runs) = (log.clone(), Arc::new(AtomicUsize::new(0)));
        Stage::new(name, phase, restart, move || {
            let (log, run) = (log.clone(), runs.fetch_add(1, Ordering::SeqCst));
            async move {
                log.lock().unwrap().push(format!("start {name}"));
                let task = tokio::spawn(async move {
                    if run < fail_first {
                        panic!("{name} fails");
                    }
                    std::future::pending::<()>().await;
                });
                let stop_log = log.clone();
                Ok(Running {
                    task,
                    stop: Box::new(move || {
                        Box::pin(async move { stop_log.lock().unwrap().push(format!("stop {name}")) })
                    }),
                })
            }
        })
    }

    fn entries(log: &Log) -> Vec<String> {
        log.lock().unwrap().clone()
    }

    #[tokio::test(start_paused = true)]
    async fn phases_stop_apart_each_last_started_first() {
        let log = Log::default();
        let mut ring = RingBuilder::new()
            .stage(logged("a", Phase::Outside, Restart::BACKOFF, &log, 0))
            .stage(logged("poller", Phase::Inside, Restart::BACKOFF, &log, 0))
            .stage(logged("b", Phase::Outside, Restart::Never, &log, 0))
            .start()
            .await
            .unwrap();
        assert_eq!(ring.stages(), ["a", "poller", "b"]);
        ring.stop(Phase::Outside).await;
        assert_eq!(entries(&log)[3..], ["stop b", "stop a"], "outside only, b (started last) first");
        ring.stop(Phase::Inside).await;
        assert_eq!(entries(&log)[5..], ["stop poller"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_part_that_dies_is_restarted_by_its_policy_and_the_others_are_not() {
        let log = Log::default();
        let mut ring = RingBuilder::new()
            .stage(logged("restarted", Phase::Outside, Restart::BACKOFF, &log, 2))
            .stage(logged("left", Phase::Outside, Restart::Never, &log, 1))
            .start()
            .await
            .unwrap();
        // Two failures in a row: restarts after 1 s and 2 s.
        tokio::time::sleep(Duration::from_secs(10)).await;
        let starts = |name: &str| entries(&log).iter().filter(|e| **e == format!("start {name}")).count();
        assert_eq!(starts("restarted"), 3, "two failures, two restarts, then it runs: {:?}", entries(&log));
        assert_eq!(starts("left"), 1, "Never: not started again");
        ring.stop(Phase::Outside).await;
        assert_eq!(entries(&log).last().map(String::as_str), Some("stop restarted"), "the one running is stopped");
        assert!(!entries(&log).contains(&"stop left".to_owned()), "the one that died is not stopped twice");
        ring.stop(Phase::Inside).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_stage_that_cannot_start_stops_those_started_and_says_which() {
        let log = Log::default();
        let failing = Stage::new("endpoint", Phase::Outside, Restart::BACKOFF, || async {
            Err::<Running, _>("socket in use".to_owned())
        });
        let err = RingBuilder::new()
            .stage(logged("server", Phase::Outside, Restart::BACKOFF, &log, 0))
            .stage(logged("saver", Phase::Inside, Restart::BACKOFF, &log, 0))
            .stage(failing)
            .start()
            .await
            .unwrap_err();
        assert_eq!((err.stage, err.reason.as_str()), ("endpoint", "socket in use"));
        assert_eq!(entries(&log), ["start server", "start saver", "stop server", "stop saver"]);
    }

    #[test]
    fn the_backoff_doubles_up_to_its_ceiling() {
        let (first, max) = (Duration::from_secs(1), Duration::from_secs(30));
        let waits: Vec<u64> = (0..7).map(|n| backoff(first, max, n).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
    }
}
