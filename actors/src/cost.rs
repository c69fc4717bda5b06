//! The router's cost model (DESIGN.md §6): the estimated time to first token of a request on
//! each worker,
//!
//! ```text
//! ttft(w) = queue(w) + load(G2 run) + load(G3 run) + prefill(uncached tokens)
//! ```
//!
//! - `queue(w)`: the work ahead on `w` — the prompt tokens not prefilled yet at the prefill rate,
//!   plus its tokens to generate at the decode rate times `decode_weight` (1 for an engine that
//!   serves one request at a time, near 0 for one that batches decodes alongside prefills);
//! - the cached prefix comes from the worker's own G1 (free), then its node's G2, then G3, each
//!   run loaded only if that beats recomputing it (otherwise it is counted as prefill);
//! - `prefill`: the rest of the prompt at the engine's measured (or calibrated) throughput.
//!
//! All rates are per second; a rate of 0 means unknown, and an unknown load rate counts as free
//! (the worker decides again with its own measurements when it onboards).

use crate::index::WorkerPrefix;
use crate::tiers::NodeTiers;

/// The numbers the estimate is made of.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Tokens per block.
    pub block_tokens: usize,
    /// Bytes of one block image (what a load moves).
    pub image_bytes: usize,
    /// Prompt tokens per second one worker prefills.
    pub prefill_tokens_per_s: f64,
    /// Seconds per generated token of one worker.
    pub decode_s_per_token: f64,
    /// How much of the queued decode work delays a new request's first token: 1 when the engine
    /// serves one request at a time, 0 when decodes are batched alongside prefills.
    pub decode_weight: f64,
    /// G2 → G1 bytes per second.
    pub g2_bytes_per_s: f64,
    /// G3 → G1 bytes per second.
    pub g3_bytes_per_s: f64,
    /// Another node's G2/G3 → G1 bytes per second (G4; 0 = unknown, counted free).
    pub g4_bytes_per_s: f64,
}

/// A worker's queued work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Queued {
    /// Prompt tokens of the requests queued or running.
    pub prompt_tokens: usize,
    /// Tokens those requests may generate.
    pub decode_tokens: usize,
}

/// The estimate for one worker.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    /// Estimated time to first token, seconds.
    pub ttft_s: f64,
    /// Prompt blocks expected to be reused or loaded instead of computed.
    pub cached_blocks: usize,
}

impl CostModel {
    /// This model with the bandwidths measured on `tiers`' real transfers: G2 → G1 where none is
    /// configured (0, as the workers decide), G3 reads once G3 has been read.
    pub fn measured_on(mut self, tiers: &NodeTiers) -> Self {
        if self.g2_bytes_per_s <= 0.0
            && let Some(measured) = tiers.g2.as_ref().and_then(|g2| g2.measured_load_bandwidth())
        {
            self.g2_bytes_per_s = measured;
        }
        if let Some(measured) = tiers.g3.as_ref().and_then(|g3| g3.measured_read_bandwidth()) {
            self.g3_bytes_per_s = measured;
        }
        self
    }

    fn seconds(&self, bytes: usize, rate: f64) -> f64 {
        if rate > 0.0 { bytes as f64 / rate } else { 0.0 }
    }

    fn prefill_s(&self, tokens: usize) -> f64 {
        if self.prefill_tokens_per_s > 0.0 { tokens as f64 / self.prefill_tokens_per_s } else { 0.0 }
    }

    /// Whether loading a block at `rate` beats recomputing it.
    pub fn load_beats_recompute(&self, rate: f64) -> bool {
        self.seconds(self.image_bytes, rate) < self.prefill_s(self.block_tokens) || self.prefill_tokens_per_s <= 0.0
    }

    /// The estimate for a prompt of `prompt_tokens` on a worker whose tiers hold `prefix` and
    /// which has `queued` work ahead of it.
    pub fn estimate(&self, prompt_tokens: usize, prefix: WorkerPrefix, queued: Queued) -> Estimate {
        let b = self.block_tokens.max(1);
        // The last prompt token is always computed, so at most this many blocks are cached.
        let cap = prompt_tokens.saturating_sub(1) / b;
        let g1 = prefix.g1.max(prefix.g1_approximate).min(cap);
        let mut cached = g1;
        let mut load_s = 0.0;
        for (held, rate) in
            [(prefix.g2, self.g2_bytes_per_s), (prefix.g3, self.g3_bytes_per_s), (prefix.g4, self.g4_bytes_per_s)]
        {
            let held = held.min(cap);
            if held > cached && self.load_beats_recompute(rate) {
                load_s += self.seconds((held - cached) * self.image_bytes, rate);
                cached = held;
            }
        }
        let queue_s = self.prefill_s(queued.prompt_tokens)
            + queued.decode_tokens as f64 * self.decode_s_per_token * self.decode_weight;
        let ttft_s = queue_s + load_s + self.prefill_s(prompt_tokens - cached * b);
        Estimate { ttft_s, cached_blocks: cached }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> CostModel {
        CostModel {
            block_tokens: 32,
            image_bytes: 4 << 20,
            prefill_tokens_per_s: 32_000.0,
            decode_s_per_token: 0.01,
            decode_weight: 1.0,
            g2_bytes_per_s: 50e9,
            g3_bytes_per_s: 1.6e9,
            g4_bytes_per_s: 0.0,
        }
    }

    #[test]
    fn a_cached_prefix_beats_recompute_and_queue_time_counts() {
        let m = model();
        let cold = m.estimate(3200, WorkerPrefix::default(), Queued::default());
        assert!((cold.ttft_s - 0.1).abs() < 1e-9, "{cold:?}");
        let warm = m.estimate(3200, WorkerPrefix { g1: 99, ..Default::default() }, Queued::default());
        assert_eq!(warm.cached_blocks, 99, "capped so the last token is computed");
        assert!((warm.ttft_s - 32.0 / 32_000.0).abs() < 1e-9, "{warm:?}");
        let busy = m.estimate(
            3200,
            WorkerPrefix { g1: 99, ..Default::default() },
            Queued { prompt_tokens: 3200, decode_tokens: 10 },
        );
        assert!((busy.ttft_s - warm.ttft_s - 0.2).abs() < 1e-9, "{busy:?}");
    }

    #[test]
    fn tiers_nest_and_a_slow_tier_is_recomputed() {
        let m = model();
        // 4 MiB at 50 GB/s = 84 µs per block < 1 ms to recompute it: G2 loads.
        let g2 = m.estimate(3200, WorkerPrefix { g1: 10, g2: 50, ..Default::default() }, Queued::default());
        assert_eq!(g2.cached_blocks, 50);
        let expected = 40.0 * (4u64 << 20) as f64 / 50e9 + (3200.0 - 1600.0) / 32_000.0;
        assert!((g2.ttft_s - expected).abs() < 1e-9);
        // 4 MiB at 1.6 GB/s = 2.6 ms per block > 1 ms to recompute it: G3 is not worth it.
        let g3 = m.estimate(3200, WorkerPrefix { g1: 10, g3: 90, ..Default::default() }, Queued::default());
        assert_eq!(g3.cached_blocks, 10, "the disk is slower than the GPU here");
        // A G3 prefix shorter than G2's adds nothing.
        let both = m.estimate(3200, WorkerPrefix { g2: 50, g3: 30, ..Default::default() }, Queued::default());
        assert_eq!(both.cached_blocks, 50);
    }
}
