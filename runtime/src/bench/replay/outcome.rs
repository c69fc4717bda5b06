//! What a run measured (per request, per tier, over time) and the rates every run shares.

use super::*;

/// What one request did.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Sample {
    pub(super) ttft: Duration,
    /// When it completed, from the replay's start.
    pub(super) done_at: Duration,
    pub(super) prompt: usize,
    pub(super) hit: PerTier<usize>,
    pub(super) output: usize,
    /// Of a session of the high-priority class (whether or not its hints were sent).
    pub(super) high: bool,
    /// Tokens of its system region (the prompt's first ones).
    pub(super) system: usize,
}

/// Tier occupancy at one moment of virtual time.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub(super) struct Occupancy {
    pub(super) at_s: f64,
    pub(super) g1: i64,
    pub(super) g2: usize,
    pub(super) g3: usize,
}

/// The tier and size a sweep run used.
pub(super) type Capacity = Option<(String, ByteSize)>;

/// One configuration's results.
#[derive(Debug)]
pub(super) struct Outcome {
    pub(super) policy: Policy,
    pub(super) samples: Vec<Sample>,
    pub(super) wall: Duration,
    pub(super) virtual_time: Duration,
    pub(super) bound_hit_rate: f64,
    pub(super) bytes: [u64; 5],
    pub(super) g3_skipped: u64,
    /// Mean wait before a request's prefill began (queued, or in its worker's batch), ms.
    pub(super) queue_ms: f64,
    /// Requests preempted out of G1 (resumed by loading their blocks back).
    pub(super) preempted: u64,
    pub(super) evictions: [BTreeMap<RegionKind, u64>; 3],
    pub(super) lag_ms: (f64, f64),
    pub(super) timeline: Vec<Occupancy>,
    pub(super) capacity: Capacity,
    /// The wall time of each routing decision, sorted, in seconds (simulated runs).
    pub(super) decisions_s: Vec<f64>,
}

impl Outcome {
    pub(super) fn ttfts_ms(&self) -> Vec<f64> {
        let mut v: Vec<f64> = self.samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
        v.sort_by(f64::total_cmp);
        v
    }

    pub(super) fn percentile_ms(&self, p: f64) -> f64 {
        let v = self.ttfts_ms();
        if v.is_empty() {
            return 0.0;
        }
        v[((v.len() - 1) as f64 * p).round() as usize]
    }

    /// The share of prompt tokens found cached: in `tier`, or in any.
    pub(super) fn hit_rate(&self, tier: Option<TierName>) -> f64 {
        let prompt: usize = self.samples.iter().map(|s| s.prompt).sum();
        let hit: usize = self.samples.iter().map(|s| tier.map_or(s.hit.total(), |t| s.hit[t])).sum();
        hit as f64 / prompt.max(1) as f64
    }

    /// The share of system-region tokens found cached.
    pub(super) fn system_hit_rate(&self) -> f64 {
        let system: usize = self.samples.iter().map(|s| s.system).sum();
        let hit: usize = self.samples.iter().map(|s| s.hit.total().min(s.system)).sum();
        hit as f64 / system.max(1) as f64
    }

    /// The `q` quantile of the routing decisions' wall time, in µs.
    pub(super) fn decision_us(&self, q: f64) -> f64 {
        let d = &self.decisions_s;
        d.get(((d.len().max(1) - 1) as f64 * q).round() as usize).map_or(0.0, |s| s * 1e6)
    }

    pub(super) fn saved_tokens(&self) -> usize {
        self.samples.iter().map(|s| s.hit.total()).sum()
    }

    pub(super) fn json(&self) -> serde_json::Value {
        let regions = |m: &BTreeMap<RegionKind, u64>| -> serde_json::Value {
            m.iter().map(|(r, n)| (r.as_str().to_string(), serde_json::json!(n))).collect()
        };
        let secs = self.virtual_time.as_secs_f64().max(1e-9);
        serde_json::json!({
            "name": self.policy.name(),
            "routing": self.policy.routing.as_str(),
            "eviction": self.policy.eviction_name(),
            "write_through": self.policy.write_through_name(),
            "preamble_kept": self.policy.preamble_kept,
            "priorities": self.policy.priorities,
            "leased": format!("{:?}", self.policy.leased).to_lowercase(),
            "capacity": self.capacity.as_ref().map(|(tier, size)| serde_json::json!({"tier": tier, "bytes": size.0})),
            "requests": self.samples.len(),
            "hit_rate": self.hit_rate(None),
            "system_hit_rate": self.system_hit_rate(),
            "hit_rate_by_tier": TierName::ALL.iter().map(|&t| (t.as_str().to_string(), serde_json::json!(self.hit_rate(Some(t))))).collect::<serde_json::Map<_, _>>(),
            "prefill_tokens_saved": self.saved_tokens(),
            "ttft_ms": {"p50": self.percentile_ms(0.5), "p90": self.percentile_ms(0.9), "p99": self.percentile_ms(0.99)},
            "queue_ms_mean": self.queue_ms,
            "router_decision_us": {"count": self.decisions_s.len(), "p50": self.decision_us(0.5), "p99": self.decision_us(0.99), "max": self.decision_us(1.0)},
            "preempted": self.preempted,
            "throughput": {
                "requests_per_s": self.samples.len() as f64 / secs,
                "output_tokens_per_s": self.samples.iter().map(|s| s.output).sum::<usize>() as f64 / secs,
            },
            "bytes": {"g2_to_g1": self.bytes[0], "g3_to_g1": self.bytes[1], "g1_to_g2": self.bytes[2], "g2_to_g3": self.bytes[3], "g4_to_g1": self.bytes[4]},
            "evictions": {"g1": regions(&self.evictions[0]), "g2": regions(&self.evictions[1]), "g3": regions(&self.evictions[2])},
            "write_through_lag_ms": {"g3_mean": self.lag_ms.0, "g3_max": self.lag_ms.1},
            "g3_writes_skipped_disk_behind": self.g3_skipped,
            "virtual_seconds": self.virtual_time.as_secs_f64(),
            "wall_seconds": self.wall.as_secs_f64(),
            "simulated_requests_per_wall_second": self.samples.len() as f64 / self.wall.as_secs_f64().max(1e-9),
        })
    }
}

/// The calibrated rates and sizes every run of a replay shares.
#[derive(Debug, Clone)]
pub(super) struct Shared {
    pub(super) workers: usize,
    pub(super) nodes: usize,
    pub(super) block_tokens: usize,
    pub(super) timing: SimTiming,
    pub(super) g1: ByteSize,
    pub(super) g2: ByteSize,
    pub(super) g3: ByteSize,
    pub(super) retention: RetentionSection,
    pub(super) sticky_bonus: Duration,
    pub(super) temperature: f64,
    pub(super) engine: ReplayEngine,
    pub(super) config: dynamo_config::NodeConfig,
}

impl Shared {
    pub(super) fn blocks(&self, size: ByteSize) -> usize {
        (size.0 / self.timing.block_bytes.max(1)) as usize
    }
}

pub(super) fn shared(args: &ReplayArgs) -> anyhow::Result<Shared> {
    let calibration = match &args.calibration {
        Some(path) => Calibration::load(path).map_err(|e| anyhow::anyhow!("{e}"))?,
        None => Calibration::h200(),
    };
    let prefill = calibration
        .prefill_for(&args.model)
        .with_context(|| format!("no prefill calibration for `{}` (llama-1b, llama-8b)", args.model))?
        .clone();
    let b = args.block_tokens.max(1);
    let block_bytes = prefill.kv_bytes_per_token * b as u64;
    // A decode step reads the weights once: bf16 parameters over HBM (d2d copy rate × 2).
    let params = if args.model == "llama-1b" { 1.24e9 } else { 8.03e9 };
    let decode_s = args.decode_ms.map_or(params * 2.0 / (calibration.link.d2d_copy_gb_s * 2e9), |ms| ms / 1e3);
    let cfg = match &args.config {
        Some(path) => dynamo_config::NodeConfig::load(path).map_err(|e| anyhow::anyhow!("{e}"))?,
        None => dynamo_config::NodeConfig::default(),
    };
    Ok(Shared {
        engine: args.engine,
        config: cfg.clone(),
        retention: cfg.retention.clone(),
        sticky_bonus: cfg.router.sticky_bonus.as_duration(),
        temperature: cfg.router.temperature,
        workers: args.workers.max(1),
        nodes: args.nodes.max(1),
        block_tokens: b,
        timing: SimTiming::from_calibration(&calibration, prefill, decode_s, block_bytes),
        g1: args.g1,
        g2: args.g2,
        g3: args.g3,
    })
}
