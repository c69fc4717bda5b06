//! The node's one cost model (DESIGN.md §6): what a block costs to load from each tier against
//! what it costs to recompute, and a request's estimated time to first token on a worker,
//!
//! ```text
//! ttft(w) = queue(w) + load(G2 run) + load(G3 run) + load(G4 run) + prefill(uncached tokens)
//! ```
//!
//! - `queue(w)`: the work ahead on `w` — the estimated prefill (and load) time of every request
//!   queued or prefilling there, each as it was estimated on `w` when it was routed (its cached
//!   prefix excluded: a queue of mostly cached prompts is short), plus its tokens to generate at
//!   the decode rate times `decode_weight` (1 for an engine that serves one request at a time, 0
//!   for one that batches decodes alongside prefills);
//! - the cached prefix comes from the worker's own G1 (free), then its node's G2, then G3, then
//!   another node's (G4), each run loaded only if that beats recomputing it (otherwise it is
//!   counted as prefill);
//! - `prefill`: the rest of the prompt at the engine's rate, or along its calibrated curve (the
//!   marginal cost of a suffix given its prefix, which grows with the prefix: attention).
//!
//! Every rate is an `Option`: `None` is unknown, never a zero that means something else. An
//! unknown load rate counts as free and an unknown prefill rate makes every load worth it — the
//! tiers measure their links on real transfers ([`Measurements`]) and [`CostModel::measured`]
//! fills the unknown rates in. The scheduler ranks workers with this model and the workers (the
//! real one and the simulated one) decide with it; nothing else answers "load or recompute?".

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dynamo_config::{Calibration, PrefillCalibration, TierName};

/// A transfer rate in bytes per second: finite and positive.
#[derive(Clone, Copy, Debug, PartialEq, PartialOrd)]
pub struct BytesPerSec(f64);

impl BytesPerSec {
    /// `rate`, or `None` unless it is finite and positive.
    pub fn new(rate: f64) -> Option<Self> {
        (rate.is_finite() && rate > 0.0).then_some(Self(rate))
    }

    /// Bytes per second.
    pub fn get(self) -> f64 {
        self.0
    }

    /// Seconds to move `bytes`.
    pub fn seconds(self, bytes: usize) -> f64 {
        bytes as f64 / self.0
    }

    /// The rate of two links one after the other (a G3 read, then the host link).
    pub fn then(self, next: BytesPerSec) -> BytesPerSec {
        BytesPerSec(1.0 / (1.0 / self.0 + 1.0 / next.0))
    }
}

/// How fast an engine prefills.
#[derive(Clone, Debug, PartialEq)]
pub enum Prefill {
    /// A constant rate in tokens per second (measured at start-up on the real engine).
    Rate(f64),
    /// A calibrated curve of prefill time by prompt length (the simulated engine's).
    Curve(Arc<PrefillCalibration>),
}

impl Prefill {
    /// A constant rate, or `None` unless it is finite and positive.
    pub fn rate(tokens_per_s: f64) -> Option<Self> {
        (tokens_per_s.is_finite() && tokens_per_s > 0.0).then_some(Prefill::Rate(tokens_per_s))
    }

    /// Seconds to prefill tokens `from..to` given that the first `from` are in G1 already.
    pub fn seconds(&self, from: usize, to: usize) -> f64 {
        match self {
            Prefill::Rate(rate) => to.saturating_sub(from) as f64 / rate,
            Prefill::Curve(curve) => {
                ((curve.prefill_ms(to as u64) - curve.prefill_ms(from.min(to) as u64)) / 1e3).max(0.0)
            }
        }
    }
}

/// The numbers the model is made of.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// Tokens per block.
    pub block_tokens: usize,
    /// Bytes one block moves when it is loaded (its image).
    pub image_bytes: usize,
    /// How fast a worker prefills; `None`: unknown (every load is taken).
    pub prefill: Option<Prefill>,
    /// Seconds per generated token of one worker; `None`: unknown (decode counts nothing).
    pub decode_s_per_token: Option<f64>,
    /// How much of the queued decode work delays a new request's first token: 1 when the engine
    /// serves one request at a time, 0 when decodes are batched alongside prefills.
    pub decode_weight: f64,
    /// G2 → G1: the host link on a GPU, memcpy on the CPU engine.
    pub g2_read: Option<BytesPerSec>,
    /// G3 → G1: the disk, then the host link.
    pub g3_read: Option<BytesPerSec>,
    /// Another node's G2/G3 → G1 (G4).
    pub g4_read: Option<BytesPerSec>,
}

/// How many blocks of a prompt's prefix each tier holds for one worker (each tier's own longest
/// prefix, so a later tier contributes only where it reaches further): G1 the worker's own, G2
/// and G3 its node's, G4 the best of the other nodes'.
pub type PrefixBlocks = dynamo_config::PerTier<usize>;

/// A worker's queued work.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Queued {
    /// Engine seconds of the prefills (and loads) of the requests queued or running there and
    /// not prefilled yet, as each was estimated for this worker.
    pub prefill_s: f64,
    /// Tokens the requests queued or running there may generate.
    pub decode_tokens: usize,
    /// Requests queued or running there.
    pub requests: usize,
    /// G1 blocks those requests need of their own (beyond the prefix they share in G1).
    pub private_blocks: usize,
    /// The worker's G1 in blocks; 0 when unbounded or unknown (no room term).
    pub g1_blocks: usize,
}

impl Queued {
    /// Seconds until G1 has room for `need` more blocks of a new request's own: none while the
    /// requests there leave room; otherwise as long as it takes them to free the overflow,
    /// finishing evenly over twice their mean decode (`decode_s` per token).
    pub fn room_wait_s(&self, need: usize, decode_s: f64) -> f64 {
        let overflow = (self.private_blocks + need).saturating_sub(self.g1_blocks);
        if self.g1_blocks == 0 || overflow == 0 || self.private_blocks == 0 || self.requests == 0 {
            return 0.0;
        }
        let span_s = 2.0 * self.decode_tokens as f64 / self.requests as f64 * decode_s;
        (overflow as f64 / self.private_blocks as f64).min(1.0) * span_s
    }
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
    /// A model with nothing known yet but the block geometry.
    pub fn unknown(block_tokens: usize, image_bytes: usize) -> Self {
        Self {
            block_tokens,
            image_bytes,
            prefill: None,
            decode_s_per_token: None,
            decode_weight: 0.0,
            g2_read: None,
            g3_read: None,
            g4_read: None,
        }
    }

    /// This model with its unknown load rates filled in from what `measured` has seen on real
    /// transfers (G2 → G1 loads; G3 reads and peer fetches, each followed by the host link when
    /// that is known).
    pub fn measured(&self, measured: &Measurements) -> Self {
        let mut cost = self.clone();
        if cost.g2_read.is_none() {
            cost.g2_read = measured.g2_load.get();
        }
        if cost.g3_read.is_none() {
            cost.g3_read = match (measured.g3_read.get(), cost.g2_read) {
                (Some(disk), Some(link)) => Some(disk.then(link)),
                (disk, _) => disk,
            };
        }
        if cost.g4_read.is_none() {
            cost.g4_read = match (measured.g4_read.get_within(G4_RATE_MAX_AGE), cost.g2_read) {
                (Some(net), Some(link)) => Some(net.then(link)),
                (net, _) => net,
            };
        }
        cost
    }

    /// The load rate of `from` into G1 (none for G1 itself: a block there is used in place).
    pub fn rate(&self, from: TierName) -> Option<BytesPerSec> {
        match from {
            TierName::G1 => None,
            TierName::G2 => self.g2_read,
            TierName::G3 => self.g3_read,
            TierName::G4 => self.g4_read,
        }
    }

    /// Seconds to recompute the block that ends at token `end`, given the tokens before it.
    pub fn recompute_block_s(&self, end: usize) -> Option<f64> {
        self.prefill.as_ref().map(|p| p.seconds(end.saturating_sub(self.block_tokens), end))
    }

    /// Whether loading the block that ends at token `end` from `from` beats recomputing it.
    /// Unknown numbers favour loading.
    pub fn worth_loading(&self, from: TierName, end: usize) -> bool {
        match (self.rate(from), self.recompute_block_s(end)) {
            (Some(rate), Some(recompute)) => rate.seconds(self.image_bytes) < recompute,
            _ => true,
        }
    }

    fn load_s(&self, blocks: usize, rate: Option<BytesPerSec>) -> f64 {
        rate.map_or(0.0, |r| r.seconds(blocks * self.image_bytes))
    }

    fn prefill_s(&self, from: usize, to: usize) -> f64 {
        self.prefill.as_ref().map_or(0.0, |p| p.seconds(from, to))
    }

    /// The estimate for a prompt of `prompt_tokens` on a worker whose tiers hold `prefix` and
    /// which has `queued` work ahead of it.
    pub fn estimate(&self, prompt_tokens: usize, prefix: PrefixBlocks, queued: Queued) -> Estimate {
        let b = self.block_tokens.max(1);
        // The last prompt token is always computed, so at most this many blocks are cached.
        let cap = prompt_tokens.saturating_sub(1) / b;
        let mut cached = prefix.g1.min(cap);
        let mut load_s = 0.0;
        for (held, from) in [(prefix.g2, TierName::G2), (prefix.g3, TierName::G3), (prefix.g4, TierName::G4)] {
            let held = held.min(cap);
            // A run is worth loading when its last block is (recompute grows along the prompt).
            if held > cached && self.worth_loading(from, held * b) {
                load_s += self.load_s(held - cached, self.rate(from));
                cached = held;
            }
        }
        let decode_s = self.decode_s_per_token.unwrap_or(0.0);
        let need = prompt_tokens.div_ceil(b).saturating_sub(prefix.g1.min(cap));
        let queue_s = queued.prefill_s.max(0.0)
            + queued.room_wait_s(need, decode_s)
            + queued.decode_tokens as f64 * self.decode_s_per_token.unwrap_or(0.0) * self.decode_weight;
        let ttft_s = queue_s + load_s + self.prefill_s(cached * b, prompt_tokens);
        Estimate { ttft_s, cached_blocks: cached }
    }
}

/// The smallest load that measures the G2 → G1 link for good: smaller ones are dominated by
/// launch and setup latency.
pub const LINK_SAMPLE_BYTES: usize = 16 << 20;

/// The node's one source of measured rates: every real G2 → G1 load and G3 read is folded in
/// here, and [`CostModel::measured`] reads it for the scheduler and the workers alike.
#[derive(Debug, Default)]
pub struct Measurements {
    /// G2 → G1 loads timed alone (the host link on a GPU worker, memcpy on the CPU engine).
    pub g2_load: MeasuredBandwidth,
    /// G3 reads into G2.
    pub g3_read: MeasuredBandwidth,
    /// Fetches from peers into G2 (G4).
    pub g4_read: MeasuredBandwidth,
    /// G3 write-through batches (the disk's write rate, for [`write_admitted`]).
    pub g3_write: MeasuredBandwidth,
    load_sampled: AtomicBool,
}

impl Measurements {
    /// Starts the host link's and the disk's rates from a calibration file's (`engine.calibration`):
    /// they stand until real transfers have been timed, each of which moves them toward what
    /// this machine does.
    pub fn seed(&self, calibration: &Calibration) {
        self.g2_load.seed(calibration.link.h2d_pinned_gb_s * 1e9);
        self.g3_read.seed(calibration.disk.seq_read_gb_s * 1e9);
        self.g3_write.seed(calibration.disk.seq_write_gb_s * 1e9);
    }

    /// Folds one batched load into G1 (`bytes` scattered in `elapsed`, with nothing else
    /// running) in.
    pub fn observe_load(&self, bytes: usize, elapsed: Duration) {
        self.g2_load.observe(bytes, elapsed);
        if bytes >= LINK_SAMPLE_BYTES {
            self.load_sampled.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the next load should be timed alone, before compute runs alongside it: until one
    /// of at least [`LINK_SAMPLE_BYTES`] has been. A load overlapped with compute shares the
    /// device with it, so its time says little about the link.
    pub fn wants_load_sample(&self) -> bool {
        !self.load_sampled.load(Ordering::Relaxed)
    }
}

/// A link's bandwidth as measured on real transfers: an exponentially weighted mean of bytes per
/// second, so the cost model follows the machine as it is now.
#[derive(Debug, Default)]
pub struct MeasuredBandwidth(Mutex<Option<(f64, std::time::Instant)>>);

impl MeasuredBandwidth {
    /// Folds one transfer of `bytes` in `elapsed` in.
    pub fn observe(&self, bytes: usize, elapsed: Duration) {
        self.fold(bytes, elapsed, |old, sample| old.map_or(sample, |old| 0.8 * old + 0.2 * sample));
    }

    /// A transfer that did not finish moving `bytes` in `elapsed` (it ran out of time): the link's
    /// rate is at most that now, whatever it was before.
    pub fn cap(&self, bytes: usize, elapsed: Duration) {
        self.fold(bytes, elapsed, |old, bound| old.map_or(bound, |old| old.min(bound)));
    }

    /// Starts the rate at `bytes_per_s` (a calibrated figure) if nothing was timed yet: the first
    /// transfers then move it as they would a measured one.
    pub fn seed(&self, bytes_per_s: f64) {
        let mut bw = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if bw.is_none() && BytesPerSec::new(bytes_per_s).is_some() {
            *bw = Some((bytes_per_s, std::time::Instant::now()));
        }
    }

    /// Sets the rate to `next(old rate, this transfer's bytes per second)`, stamped now.
    fn fold(&self, bytes: usize, elapsed: Duration, next: impl FnOnce(Option<f64>, f64) -> f64) {
        let secs = elapsed.as_secs_f64();
        if secs <= 0.0 || bytes == 0 {
            return;
        }
        let mut bw = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let rate = next(bw.map(|(old, _)| old), bytes as f64 / secs);
        *bw = Some((rate, std::time::Instant::now()));
    }

    /// The rate, once a transfer was timed.
    pub fn get(&self) -> Option<BytesPerSec> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).and_then(|(rate, _)| BytesPerSec::new(rate))
    }

    /// The rate, if a transfer was timed within `age`: a link judged too slow to use is not
    /// used, so nothing would measure it again; past `age` its rate is unknown once more, and
    /// the next load tries it.
    pub fn get_within(&self, age: Duration) -> Option<BytesPerSec> {
        let bw = *self.0.lock().unwrap_or_else(|e| e.into_inner());
        bw.filter(|(_, at)| at.elapsed() <= age).and_then(|(rate, _)| BytesPerSec::new(rate))
    }
}

/// How far G3's write-through may fall behind: one second of the disk's writes. A disk slower
/// than the stream of blocks written through must not build an unbounded backlog; a block past
/// it stays in G2 only (and is counted as skipped), unless a lease pins it to G3.
pub const WRITE_BACKLOG: Duration = Duration::from_secs(1);

/// The backlog allowed, in blocks, while the disk's write rate is unknown (none configured,
/// calibrated or timed yet).
pub const UNTIMED_WRITE_BACKLOG_BLOCKS: u64 = 512;

/// The one write-backlog rule, for the node's workers, its engine endpoint and the simulated
/// node alike: whether one more block of `block_bytes` may be handed to a disk writing at `rate`
/// while `in_flight` bytes of writes are still pending. The first write always goes.
pub fn write_admitted(in_flight: u64, block_bytes: u64, rate: Option<BytesPerSec>) -> bool {
    match rate {
        Some(rate) => rate.seconds(in_flight as usize) <= WRITE_BACKLOG.as_secs_f64(),
        None => in_flight <= UNTIMED_WRITE_BACKLOG_BLOCKS.saturating_sub(1) * block_bytes,
    }
}

/// How long a measured peer rate stands before the next load tries the link again.
pub const G4_RATE_MAX_AGE: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> CostModel {
        CostModel {
            block_tokens: 32,
            image_bytes: 4 << 20,
            prefill: Prefill::rate(32_000.0),
            decode_s_per_token: Some(0.01),
            decode_weight: 1.0,
            g2_read: BytesPerSec::new(50e9),
            g3_read: BytesPerSec::new(1.6e9),
            g4_read: None,
        }
    }

    #[test]
    fn a_cached_prefix_beats_recompute_and_queue_time_counts() {
        let m = model();
        let cold = m.estimate(3200, PrefixBlocks::default(), Queued::default());
        assert!((cold.ttft_s - 0.1).abs() < 1e-9, "{cold:?}");
        let warm = m.estimate(3200, PrefixBlocks { g1: 99, ..Default::default() }, Queued::default());
        assert_eq!(warm.cached_blocks, 99, "capped so the last token is computed");
        assert!((warm.ttft_s - 32.0 / 32_000.0).abs() < 1e-9, "{warm:?}");
        let busy = m.estimate(
            3200,
            PrefixBlocks { g1: 99, ..Default::default() },
            Queued { prefill_s: 0.1, decode_tokens: 10, ..Queued::default() },
        );
        assert!((busy.ttft_s - warm.ttft_s - 0.2).abs() < 1e-9, "{busy:?}");
    }

    #[test]
    fn a_full_g1_makes_a_new_request_wait_for_the_running_ones() {
        let m = model();
        // 10 requests decoding 100 tokens each on average, holding 900 of 1000 blocks.
        let running =
            Queued { decode_tokens: 1000, requests: 10, private_blocks: 900, g1_blocks: 1000, ..Queued::default() };
        assert_eq!(running.room_wait_s(100, 0.01), 0.0, "it fits: no wait");
        // 50 blocks too many: 50/900 of the running requests' span of 2 × 100 × 10 ms.
        let wait = running.room_wait_s(150, 0.01);
        assert!((wait - 50.0 / 900.0 * 2.0).abs() < 1e-9, "{wait}");
        assert_eq!(Queued { g1_blocks: 0, ..running }.room_wait_s(5000, 0.01), 0.0, "unknown G1: no room term");
        // The estimate counts it, and only for the blocks the prompt does not find in G1.
        // A prompt of 200 blocks: cold, all 200 are its own; warm, 199 are in G1 already.
        let cold = m.estimate(6400, PrefixBlocks::default(), running);
        let none = m.estimate(6400, PrefixBlocks::default(), Queued { g1_blocks: 0, ..running });
        assert!((cold.ttft_s - none.ttft_s - 100.0 / 900.0 * 2.0).abs() < 1e-9, "{cold:?} vs {none:?}");
        let warm = m.estimate(6400, PrefixBlocks { g1: 199, ..Default::default() }, running);
        let warm_alone = m.estimate(6400, PrefixBlocks { g1: 199, ..Default::default() }, Queued::default());
        let decode_queue = 1000.0 * 0.01;
        assert!((warm.ttft_s - warm_alone.ttft_s - decode_queue).abs() < 1e-9, "its one block fits: no room wait");
    }

    #[test]
    fn tiers_nest_and_a_slow_tier_is_recomputed() {
        let m = model();
        // 4 MiB at 50 GB/s = 84 µs per block < 1 ms to recompute it: G2 loads.
        let g2 = m.estimate(3200, PrefixBlocks { g1: 10, g2: 50, ..Default::default() }, Queued::default());
        assert_eq!(g2.cached_blocks, 50);
        let expected = 40.0 * (4u64 << 20) as f64 / 50e9 + (3200.0 - 1600.0) / 32_000.0;
        assert!((g2.ttft_s - expected).abs() < 1e-9);
        // 4 MiB at 1.6 GB/s = 2.6 ms per block > 1 ms to recompute it: G3 is not worth it.
        let g3 = m.estimate(3200, PrefixBlocks { g1: 10, g3: 90, ..Default::default() }, Queued::default());
        assert_eq!(g3.cached_blocks, 10, "the disk is slower than the GPU here");
        // A G3 prefix shorter than G2's adds nothing.
        let both = m.estimate(3200, PrefixBlocks { g2: 50, g3: 30, ..Default::default() }, Queued::default());
        assert_eq!(both.cached_blocks, 50);
        // An unknown G4 rate counts as free, and loading it is taken.
        let g4 = m.estimate(3200, PrefixBlocks { g4: 60, ..Default::default() }, Queued::default());
        assert_eq!(g4.cached_blocks, 60);
    }

    #[test]
    fn unknown_rates_are_none_and_measurements_fill_them_in() {
        assert_eq!(BytesPerSec::new(0.0), None);
        assert_eq!(BytesPerSec::new(f64::NAN), None);
        assert_eq!(Prefill::rate(0.0), None);
        let unknown = CostModel::unknown(32, 1 << 20);
        assert!(unknown.worth_loading(TierName::G3, 64), "unknown numbers favour loading");
        let measured = Measurements::default();
        assert!(measured.wants_load_sample());
        measured.observe_load(LINK_SAMPLE_BYTES, Duration::from_millis(1));
        measured.g3_read.observe(1 << 20, Duration::from_millis(1));
        assert!(!measured.wants_load_sample());
        let filled = unknown.measured(&measured);
        let link = filled.g2_read.expect("measured").get();
        assert!((link - LINK_SAMPLE_BYTES as f64 * 1e3).abs() < 1.0, "{link}");
        // A G3 read is followed by the host link.
        let g3 = filled.g3_read.expect("measured").get();
        assert!(g3 < (1u64 << 20) as f64 * 1e3 && g3 > 0.9 * (1u64 << 20) as f64 * 1e3, "{g3}");
        // So is a peer fetch; until one is timed, G4 stays unknown.
        assert_eq!(filled.g4_read, None);
        measured.g4_read.observe(1 << 20, Duration::from_millis(2));
        let g4 = unknown.measured(&measured).g4_read.expect("measured").get();
        assert!(g4 < (1u64 << 20) as f64 * 5e2 && g4 > 0.9 * (1u64 << 20) as f64 * 5e2, "{g4}");
        // A configured rate stands.
        let configured = CostModel { g2_read: BytesPerSec::new(5e9), ..unknown };
        assert_eq!(configured.measured(&measured).g2_read, BytesPerSec::new(5e9));
    }

    #[test]
    fn along_a_curve_recompute_grows_with_the_prefix() {
        let curve = PrefillCalibration {
            model: "m".into(),
            kv_bytes_per_token: 1,
            points_ms: vec![(0, 0.0), (1024, 10.0), (8192, 200.0)],
        };
        let m = CostModel { prefill: Some(Prefill::Curve(Arc::new(curve))), ..model() };
        let early = m.recompute_block_s(64).expect("known");
        let late = m.recompute_block_s(8192).expect("known");
        assert!(late > 2.0 * early, "{early} vs {late}");
    }

    /// A calibration starts the rates; real transfers move them from there; a configured rate
    /// still stands over both.
    #[test]
    fn calibrated_rates_stand_until_transfers_are_timed() {
        let cal = dynamo_config::Calibration::h200();
        let measured = Measurements::default();
        measured.seed(&cal);
        let unknown = CostModel::unknown(32, 4 << 20);
        let seeded = unknown.measured(&measured);
        assert_eq!(seeded.g2_read, BytesPerSec::new(cal.link.h2d_pinned_gb_s * 1e9));
        let disk_then_link = BytesPerSec::new(cal.disk.seq_read_gb_s * 1e9)
            .zip(BytesPerSec::new(cal.link.h2d_pinned_gb_s * 1e9))
            .map(|(d, l)| d.then(l));
        assert_eq!(seeded.g3_read, disk_then_link);
        assert_eq!(measured.g3_write.get(), BytesPerSec::new(cal.disk.seq_write_gb_s * 1e9));
        // 1 GB/s timed: the mean moves a fifth of the way there.
        measured.g3_write.observe(1_000_000_000, Duration::from_secs(1));
        let moved = measured.g3_write.get().unwrap().get();
        assert!((moved - (0.8 * cal.disk.seq_write_gb_s * 1e9 + 0.2e9)).abs() < 1.0, "{moved}");
        // A second seed does not undo what was timed.
        measured.g3_write.seed(1.0);
        assert_eq!(measured.g3_write.get().unwrap().get(), moved);
        let configured = CostModel { g2_read: BytesPerSec::new(5e9), ..unknown };
        assert_eq!(configured.measured(&measured).g2_read, BytesPerSec::new(5e9));
    }

    /// One second of the disk's writes when its rate is known; 512 blocks while it is not; the
    /// first write always.
    #[test]
    fn the_write_backlog_is_a_second_of_the_disk() {
        let block = 1 << 20;
        let disk = BytesPerSec::new(100.0 * block as f64);
        assert!(write_admitted(0, block, disk));
        assert!(write_admitted(100 * block, block, disk), "exactly one second behind");
        assert!(!write_admitted(101 * block, block, disk));
        let slow = BytesPerSec::new(block as f64 / 10.0);
        assert!(write_admitted(0, block, slow), "the first write goes on any disk");
        assert!(!write_admitted(block, block, slow));
        assert!(write_admitted(511 * block, block, None));
        assert!(!write_admitted(512 * block, block, None), "512 blocks in flight untimed");
    }
}
