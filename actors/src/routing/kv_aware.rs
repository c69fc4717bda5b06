//! `kv_aware`: the lowest estimated time to first token, from the global prefix index and the
//! node's cost model.
//!
//! For each worker up: the longest prefix of the prompt each tier can give it (its own G1, its
//! node's G2 and G3, the best peer), priced by the cost model against recomputing, plus the work
//! queued there. The session's previous worker wins unless another is better by more than
//! `router.sticky_bonus`; a `router.temperature` above 0 samples among the workers by a softmax
//! over their estimates. Without an index it falls back to the session's worker, then the least
//! loaded.

use std::sync::Arc;
use std::time::Instant;

use dynamo_tiering::block::BlockHasher;

use super::{Candidates, Choice, Estimate, Policy, Rng, rotated, unestimated};
use crate::cost::Queued;
use crate::index::{Matches, SourceId, WorkerViews};
use crate::scheduler::KvRouting;
use crate::telemetry;
use crate::worker::{GenRequest, PromptHashes};

/// See the module documentation.
#[derive(Debug)]
pub struct KvAware {
    rng: Rng,
    /// The rotation of the fallback without an index (its tie-break between equal loads).
    next: usize,
    matches: Matches,
    /// Every worker's view of the last lookup.
    views: WorkerViews,
}

impl KvAware {
    /// A policy whose temperature sampling is seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self { rng: Rng::new(seed), next: usize::MAX, matches: Matches::new(), views: WorkerViews::default() }
    }

    /// Ranks by the estimates; hashes the prompt once, for the index and for the worker.
    fn by_estimate(&mut self, candidates: Candidates<'_>, kv: &KvRouting, req: &mut GenRequest) -> Vec<Choice> {
        let started = Instant::now();
        let salt = req.salt(kv.salt);
        let hashes = BlockHasher::new(salt, kv.block_tokens).hash_sequence(&req.prompt);
        kv.index.find_matches(&hashes, &mut self.matches);
        req.hashes = Some(Arc::new(PromptHashes { salt, block_tokens: kv.block_tokens, hashes: hashes.into() }));
        self.matches.views(&mut self.views);
        let mut cost = match &kv.tiers {
            Some(tiers) => kv.cost.measured(&tiers.measured),
            None => kv.cost.clone(),
        };
        // A load from a peer is priced at the link to the peer with the longest prefix, the one
        // the worker will ask, as the worker prices it.
        if let Some(g4) = kv.tiers.as_ref().and_then(|t| t.g4.as_ref())
            && let Some((peer, _)) = self.views.best_other_node(kv.node)
            && let Some(link) = g4.remote.link(peer)
        {
            link.price(&mut cost);
        }
        // (worker, estimated TTFT there, its estimate)
        let mut ranked: Vec<(usize, f64, Estimate)> = Vec::with_capacity(candidates.workers.len());
        for (i, w) in candidates.workers.iter().enumerate() {
            let Some(w) = w else { continue };
            let node = match kv.workers_per_node {
                0 => kv.node,
                per => kv.node + (i / per) as u16,
            };
            let prefix = self.views.for_worker(SourceId::worker(node, i as u16));
            let e = cost.estimate(req.prompt.len(), prefix.into(), w.load.queued());
            let alone = cost.estimate(req.prompt.len(), prefix.into(), Queued::default()).ttft_s;
            let estimate = Estimate {
                cached_tokens: e.cached_blocks * kv.block_tokens,
                prefill_s: alone,
                g1_blocks: prefix.tiers.g1.max(prefix.g1_approximate),
            };
            ranked.push((i, e.ttft_s, estimate));
        }
        ranked.sort_by(|a, b| a.1.total_cmp(&b.1));
        if let (Some(s), Some(best)) = (candidates.sticky, ranked.first().map(|r| r.1))
            && let Some(pos) = ranked.iter().position(|r| r.0 == s)
            && ranked[pos].1 <= best + kv.sticky_bonus.as_secs_f64()
        {
            let chosen = ranked.remove(pos);
            ranked.insert(0, chosen);
        } else if kv.temperature > 0.0 && ranked.len() > 1 {
            let best = ranked[0].1;
            let weights: Vec<f64> = ranked.iter().map(|r| (-(r.1 - best) * 1e3 / kv.temperature).exp()).collect();
            let total: f64 = weights.iter().sum();
            let mut pick = (self.rng.next() >> 11) as f64 / (1u64 << 53) as f64 * total;
            let mut chosen = ranked.len() - 1;
            for (k, w) in weights.iter().enumerate() {
                if pick < *w {
                    chosen = k;
                    break;
                }
                pick -= w;
            }
            let first = ranked.remove(chosen);
            ranked.insert(0, first);
        }
        telemetry::record_router_decision(started.elapsed());
        ranked.into_iter().map(|(worker, _, estimate)| Choice { worker, estimate: Some(estimate) }).collect()
    }

    /// Without an index: the session's worker, then the least loaded (in prompt tokens queued).
    fn by_load(&mut self, candidates: Candidates<'_>) -> Vec<Choice> {
        let up = candidates.up();
        if up.is_empty() {
            return Vec::new();
        }
        self.next = self.next.wrapping_add(1);
        let mut order = rotated(&up, self.next % up.len());
        let load = |i: &usize| candidates.workers[*i].as_ref().map_or(usize::MAX, |w| w.load.prompt_tokens());
        order.sort_by_key(load);
        if let Some(s) = candidates.sticky.filter(|s| up.contains(s)) {
            order.retain(|&i| i != s);
            order.insert(0, s);
        }
        unestimated(order)
    }
}

impl Policy for KvAware {
    fn uses_index(&self) -> bool {
        true
    }

    fn rank(&mut self, candidates: Candidates<'_>, kv: Option<&KvRouting>, req: &mut GenRequest) -> Vec<Choice> {
        match kv {
            Some(kv) => self.by_estimate(candidates, kv, req),
            None => self.by_load(candidates),
        }
    }
}
