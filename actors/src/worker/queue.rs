//! A worker's bounded queue, in the order of the router's queue policy (`router.queue_policy`).
//!
//! - **FCFS**: higher agent-hint priority first, then arrival order.
//! - **WSPT** (weighted shortest processing time): the largest `weight / cost` first, where the
//!   weight grows with the priority and the cost is the scheduler's estimate of the request's
//!   GPU time (prefill of its uncached tokens plus its expected decode); arrival order breaks
//!   ties. It minimises the weighted mean completion time on one machine, which is what an agent
//!   waiting on many short tool calls feels.
//!
//! A strict tier (`nvext.agent_hints.strict_priority`) comes before either: every job of a
//! higher tier leaves before any of a lower one.
//!
//! A full queue refuses at once (the scheduler tries the next worker, then answers
//! "overloaded"); a closed queue refuses everything and hands out what it still holds.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::sync::Mutex;

use dynamo_config::QueuePolicy;
use tokio::sync::Notify;

use super::Job;

/// Why a job was not queued; the job comes back.
#[derive(Debug)]
pub enum PushError {
    /// The queue holds its bound.
    Full(Box<Job>),
    /// The worker is gone or restarting.
    Closed(Box<Job>),
}

struct Entry {
    tier: i32,
    score: f64,
    seq: u64,
    job: Job,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Entry {}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Entry {
    /// The max-heap pops the highest tier, then the highest score, then the earliest arrival.
    fn cmp(&self, other: &Self) -> Ordering {
        self.tier
            .cmp(&other.tier)
            .then_with(|| self.score.total_cmp(&other.score))
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

struct Inner {
    heap: BinaryHeap<Entry>,
    seq: u64,
    closed: bool,
}

/// A bounded priority queue of jobs, shared by the scheduler (push) and the engine (pop).
pub struct JobQueue {
    inner: Mutex<Inner>,
    ready: Notify,
    bound: usize,
    policy: QueuePolicy,
}

impl std::fmt::Debug for JobQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobQueue").field("bound", &self.bound).field("policy", &self.policy).finish()
    }
}

impl JobQueue {
    /// A queue of at most `bound` jobs ordered by `policy`.
    pub fn new(bound: usize, policy: QueuePolicy) -> Self {
        Self {
            inner: Mutex::new(Inner { heap: BinaryHeap::new(), seq: 0, closed: false }),
            ready: Notify::new(),
            bound: bound.max(1),
            policy,
        }
    }

    fn score(&self, job: &Job) -> f64 {
        let priority = f64::from(job.priority);
        match self.policy {
            QueuePolicy::Fcfs => priority,
            QueuePolicy::Wspt => {
                // Weight doubles per priority step; the cost never reaches 0.
                let weight = 2f64.powf(priority.clamp(-30.0, 30.0));
                weight / job.cost_s.max(1e-6)
            }
        }
    }

    /// Queues `job`, or hands it back.
    pub fn try_push(&self, job: Job) -> Result<(), PushError> {
        let score = self.score(&job);
        let mut inner = self.inner.lock().expect("queue lock");
        if inner.closed {
            return Err(PushError::Closed(Box::new(job)));
        }
        if inner.heap.len() >= self.bound {
            return Err(PushError::Full(Box::new(job)));
        }
        inner.seq += 1;
        let seq = inner.seq;
        inner.heap.push(Entry { tier: job.tier, score, seq, job });
        drop(inner);
        self.ready.notify_one();
        Ok(())
    }

    /// The next job by policy; `None` once the queue is closed and empty.
    pub async fn pop(&self) -> Option<Job> {
        loop {
            let notified = self.ready.notified();
            {
                let mut inner = self.inner.lock().expect("queue lock");
                if let Some(entry) = inner.heap.pop() {
                    return Some(entry.job);
                }
                if inner.closed {
                    return None;
                }
            }
            notified.await;
        }
    }

    /// Waits until a job is queued (at once if one is); a closed queue that is empty never
    /// returns.
    pub async fn wait(&self) {
        loop {
            let notified = self.ready.notified();
            if !self.inner.lock().expect("queue lock").heap.is_empty() {
                return;
            }
            notified.await;
        }
    }

    /// The next job by policy if one waits, without waiting.
    pub fn try_pop(&self) -> Option<Job> {
        self.inner.lock().expect("queue lock").heap.pop().map(|entry| entry.job)
    }

    /// Refuses every later push; [`Self::pop`] still hands out what is queued, then `None`.
    pub fn close(&self) {
        self.inner.lock().expect("queue lock").closed = true;
        self.ready.notify_waiters();
        self.ready.notify_one();
    }

    /// Most jobs it holds.
    pub fn bound(&self) -> usize {
        self.bound
    }

    /// Jobs waiting.
    pub fn len(&self) -> usize {
        self.inner.lock().expect("queue lock").heap.len()
    }

    /// Whether no job waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::GenRequest;

    fn job(tag: usize, priority: i32, cost_s: f64) -> Job {
        let (events, _) = tokio::sync::mpsc::unbounded_channel();
        let req = GenRequest::greedy(vec![0; tag + 1], 1);
        Job {
            req,
            predicted_cached: None,
            priority,
            tier: 0,
            cost_s,
            charge: crate::worker::Charge { prefill_s: cost_s, blocks: 0 },
            events,
            queued_at: tokio::time::Instant::now(),
        }
    }

    async fn order(q: &JobQueue) -> Vec<usize> {
        let mut out = Vec::new();
        while !q.is_empty() {
            out.push(q.pop().await.expect("job").req.prompt.len() - 1);
        }
        out
    }

    #[tokio::test]
    async fn fcfs_is_arrival_order_within_a_priority() {
        let q = JobQueue::new(8, QueuePolicy::Fcfs);
        for (tag, priority) in [(0, 0), (1, 0), (2, 5), (3, 0), (4, 5)] {
            q.try_push(job(tag, priority, 1.0)).unwrap();
        }
        assert_eq!(order(&q).await, vec![2, 4, 0, 1, 3]);
    }

    #[tokio::test]
    async fn a_strict_tier_goes_first_whatever_the_policy_says_within_it() {
        for policy in [QueuePolicy::Fcfs, QueuePolicy::Wspt] {
            let q = JobQueue::new(8, policy);
            q.try_push(job(0, 9, 0.1)).unwrap();
            let mut strict = job(1, -5, 60.0);
            strict.tier = 1;
            q.try_push(strict).unwrap();
            q.try_push(job(2, 0, 1.0)).unwrap();
            assert_eq!(order(&q).await[0], 1, "{policy:?}: the higher tier first, long and low as it is");
        }
    }

    #[tokio::test]
    async fn wspt_runs_short_jobs_first_and_weighs_priority() {
        let q = JobQueue::new(8, QueuePolicy::Wspt);
        q.try_push(job(0, 0, 4.0)).unwrap();
        q.try_push(job(1, 0, 0.5)).unwrap();
        q.try_push(job(2, 0, 1.0)).unwrap();
        // Priority 3 weighs 8x: 8/6 beats 1/1.
        q.try_push(job(3, 3, 6.0)).unwrap();
        assert_eq!(order(&q).await, vec![1, 3, 2, 0]);
    }

    #[tokio::test]
    async fn a_full_queue_refuses_and_a_closed_one_drains_then_ends() {
        let q = JobQueue::new(2, QueuePolicy::Fcfs);
        q.try_push(job(0, 0, 1.0)).unwrap();
        q.try_push(job(1, 0, 1.0)).unwrap();
        assert!(matches!(q.try_push(job(2, 0, 1.0)), Err(PushError::Full(_))));
        q.close();
        assert!(matches!(q.try_push(job(3, 0, 1.0)), Err(PushError::Closed(_))));
        assert_eq!(q.pop().await.map(|j| j.req.prompt.len()), Some(1));
        assert_eq!(q.pop().await.map(|j| j.req.prompt.len()), Some(2));
        assert!(q.pop().await.is_none());
    }
}
