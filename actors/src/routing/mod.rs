//! Routing policies: the order in which the scheduler tries the workers for one request.
//!
//! Each policy is one file behind [`Policy`]. The scheduler keeps everything around the choice —
//! admission, late binding, leases, the workers' queues — and asks its policy only for the order
//! to try the workers in, with what the policy expects at each. A new policy is a file here, a
//! value of `router.policy` (`dynamo_config::RoutingPolicy`) and an arm in [`for_config`].

mod kv_aware;
mod random;
mod round_robin;

use dynamo_config::RoutingPolicy;

pub use kv_aware::KvAware;
pub use random::Random;
pub use round_robin::RoundRobin;

use crate::scheduler::KvRouting;
use crate::worker::{GenRequest, WorkerHandle};

/// What a policy ranks over.
#[derive(Clone, Copy, Debug)]
pub struct Candidates<'a> {
    /// Every worker slot; `None` while a worker restarts.
    pub workers: &'a [Option<WorkerHandle>],
    /// The worker of the request's session's previous turn, if it had one.
    pub sticky: Option<usize>,
}

impl Candidates<'_> {
    /// The workers up, in slot order.
    fn up(&self) -> Vec<usize> {
        (0..self.workers.len()).filter(|&i| self.workers[i].is_some()).collect()
    }
}

/// A worker to try, with what a policy that ranks by the prefix index expects there.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    /// The worker's slot.
    pub worker: usize,
    /// `None` from a policy that does not estimate.
    pub estimate: Option<Estimate>,
}

/// What a request is expected to find and cost on one worker.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    /// Prompt tokens expected to be reused or loaded rather than computed.
    pub cached_tokens: usize,
    /// Its time to first token there with nothing queued ahead, seconds.
    pub prefill_s: f64,
    /// Blocks of its prefix that worker's G1 holds already.
    pub g1_blocks: usize,
}

/// A routing policy. See the module documentation.
pub trait Policy: Send + std::fmt::Debug {
    /// Whether it ranks by the prefix index. The scheduler then lets the index catch up with the
    /// KV events sent before each decision, and turns on admission and late binding, which need
    /// its estimates.
    fn uses_index(&self) -> bool {
        false
    }

    /// The workers up, in the order to try them (best first). A policy that hashes the prompt
    /// leaves the hashes in `req.hashes`, so that the worker does not hash it again.
    fn rank(&mut self, candidates: Candidates<'_>, kv: Option<&KvRouting>, req: &mut GenRequest) -> Vec<Choice>;
}

/// The policy `router.policy` names, its random choices seeded with `seed`.
pub fn for_config(kind: RoutingPolicy, seed: u64) -> Box<dyn Policy> {
    match kind {
        RoutingPolicy::KvAware => Box::new(KvAware::new(seed)),
        RoutingPolicy::RoundRobin => Box::new(RoundRobin::default()),
        RoutingPolicy::Random => Box::new(Random::new(seed)),
    }
}

/// xorshift64*: enough for spreading load, seeded for reproducible tests and replays.
#[derive(Clone, Debug)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// `up` rotated to start at its `start`-th worker.
fn rotated(up: &[usize], start: usize) -> Vec<usize> {
    (0..up.len()).map(|k| up[(start + k) % up.len()]).collect()
}

/// Choices without estimates, in this order.
fn unestimated(order: Vec<usize>) -> Vec<Choice> {
    order.into_iter().map(|worker| Choice { worker, estimate: None }).collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use dynamo_config::QueuePolicy;

    use super::*;
    use crate::worker::queue::JobQueue;
    use crate::worker::{Charge, WorkerLoad};

    /// Worker slots with these prompt tokens queued (`None`: restarting).
    fn workers(queued: &[Option<usize>]) -> Vec<Option<WorkerHandle>> {
        queued
            .iter()
            .enumerate()
            .map(|(id, q)| {
                q.map(|tokens| {
                    let load = Arc::new(WorkerLoad::default());
                    if tokens > 0 {
                        load.add(&GenRequest::greedy(vec![1; tokens], 1), Charge::default());
                    }
                    WorkerHandle { id, queue: Arc::new(JobQueue::new(8, QueuePolicy::Fcfs)), load }
                })
            })
            .collect()
    }

    fn first(policy: &mut dyn Policy, slots: &[Option<WorkerHandle>], sticky: Option<usize>) -> Vec<usize> {
        let mut req = GenRequest::greedy(vec![1, 2, 3], 1);
        let order = policy.rank(Candidates { workers: slots, sticky }, None, &mut req);
        assert!(order.iter().all(|c| c.estimate.is_none()), "no estimate without an index");
        order.into_iter().map(|c| c.worker).collect()
    }

    #[test]
    fn round_robin_starts_each_request_one_worker_further_and_skips_restarting_ones() {
        let slots = workers(&[Some(0), None, Some(0), Some(0)]);
        let mut rr = RoundRobin::default();
        assert_eq!(first(&mut rr, &slots, None), [0, 2, 3]);
        assert_eq!(first(&mut rr, &slots, Some(3)), [2, 3, 0], "a session's worker is no preference");
        assert_eq!(first(&mut rr, &slots, None), [3, 0, 2]);
        assert_eq!(first(&mut rr, &slots, None), [0, 2, 3]);
        assert!(first(&mut rr, &workers(&[None, None]), None).is_empty());
        assert!(!rr.uses_index());
    }

    #[test]
    fn random_is_reproducible_per_seed_and_reaches_every_worker() {
        let slots = workers(&[Some(0); 4]);
        let draws = |seed| {
            let mut random = Random::new(seed);
            (0..64).map(|_| first(&mut random, &slots, None)[0]).collect::<Vec<_>>()
        };
        assert_eq!(draws(7), draws(7));
        assert_ne!(draws(7), draws(8));
        for w in 0..4 {
            assert!(draws(7).contains(&w), "worker {w} never drawn");
        }
        let mut random = Random::new(7);
        let mut order = first(&mut random, &slots, None);
        order.sort_unstable();
        assert_eq!(order, [0, 1, 2, 3], "every worker is tried");
    }

    #[test]
    fn kv_aware_without_an_index_takes_the_session_worker_then_the_least_loaded() {
        let slots = workers(&[Some(300), Some(100), None, Some(200)]);
        let mut kv = KvAware::new(1);
        assert!(kv.uses_index());
        assert_eq!(first(&mut kv, &slots, None), [1, 3, 0]);
        assert_eq!(first(&mut kv, &slots, Some(0)), [0, 1, 3]);
        assert_eq!(first(&mut kv, &slots, Some(2)), [1, 3, 0], "a restarting session worker is passed over");
    }
}
