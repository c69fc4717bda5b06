//! `[router]`: how the scheduler picks a worker and orders its queue.

use serde::{Deserialize, Serialize};

use crate::HumanDuration;

config_enum! {
    /// How a worker is chosen for a request.
    #[derive(Default)]
    pub enum RoutingPolicy ("routing policy") {
        /// Lowest estimated time to first token, from the global prefix index and the cost model.
        #[default]
        KvAware = "kv_aware",
        /// Each worker in turn.
        RoundRobin = "round_robin",
        /// Uniformly at random.
        Random = "random",
    }
}

config_enum! {
    /// Order of the scheduler's queue.
    #[derive(Default)]
    pub enum QueuePolicy ("queue policy") {
        /// First come, first served (within a priority).
        #[default]
        Fcfs = "fcfs",
        /// Weighted shortest processing time first: priority weight over estimated cost.
        Wspt = "wspt",
    }
}

/// `[router]`: how the scheduler picks a worker and orders its queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterSection {
    /// `"kv_aware"`, `"round_robin"` or `"random"`. Default `"kv_aware"`.
    pub policy: RoutingPolicy,
    /// Softmax temperature over the workers' negated TTFT estimates (in ms); `0` always picks
    /// the best. Default `0.0`.
    pub temperature: f64,
    /// `"fcfs"` or `"wspt"`. Default `"fcfs"`.
    pub queue_policy: QueuePolicy,
    /// Soft preference for a session's previous worker: it wins unless another worker's
    /// estimate is better by more than this. Default `"5ms"`.
    pub sticky_bonus: HumanDuration,
    /// Most block entries the global prefix index holds before it drops the oldest.
    /// Default `10000000`.
    pub index_max_blocks: usize,
    /// Lifetime of an index entry predicted from a routing decision and not yet confirmed by a
    /// KV event. Default `"120s"`.
    pub approximate_ttl: HumanDuration,
    /// Working-set admission (`kv_aware`): the most of the cache — the workers' G1 together
    /// and the node's G2 — that the contexts of the sessions in line may fill before a
    /// session's turn waits at the router for room (less while admitted sessions are measured
    /// to lose their context between turns); `0` routes every turn at once. With a G2, a
    /// worker with no request takes the longest-waiting turn at once. Default `1.0`.
    pub working_set: f64,
    /// A session stays in line this long after its last turn was routed (the tool-call gap it
    /// is expected back within). Default `"60s"`.
    pub session_gap: HumanDuration,
    /// Longest a turn waits for room before it is routed anyway (and its session moves to the
    /// front of the line). Default `"5m"`.
    pub admission_max_wait: HumanDuration,
    /// Late binding (`kv_aware`): while every worker has more than this much estimated prefill
    /// ahead (running prefills included), a request waits at the router instead of joining one
    /// worker's queue, and waiting requests are routed shortest first (aged, so none starves)
    /// as soon as a worker's prefill ahead falls to this; `"0s"` routes every request at once.
    /// Default `"1s"`.
    pub late_binding: HumanDuration,
}

impl Default for RouterSection {
    fn default() -> Self {
        RouterSection {
            policy: RoutingPolicy::KvAware,
            temperature: 0.0,
            queue_policy: QueuePolicy::Fcfs,
            sticky_bonus: HumanDuration::millis(5),
            index_max_blocks: 10_000_000,
            approximate_ttl: HumanDuration::secs(120),
            working_set: 1.0,
            session_gap: HumanDuration::secs(60),
            admission_max_wait: HumanDuration::mins(5),
            late_binding: HumanDuration::secs(1),
        }
    }
}
