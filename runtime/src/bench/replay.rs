//! `dynamo-node bench replay`: the node's own actors — scheduler, prefix index, cost model,
//! workers with their G1/G2/G3 registries — driven by a recorded or synthetic trace, with the
//! simulated engine in virtual time (tokio's paused clock), one run per policy, side by side.
//!
//! Trace formats (`../shared/traces/README.md`):
//! - `mooncake`: one request per line at `timestamp` ms, the full prompt as `hash_ids`;
//! - `aiperf-agentic`: sessions of turns; a session's first turn has `timestamp` and the whole
//!   prompt, each later turn the new input only and a `delay` (ms) after the previous turn of its
//!   session completed — so a slow node sees later arrivals, as it would in production. A turn's
//!   prompt is the previous prompt, the previous answer, and the new input.
//!
//! A trace hash id stands for 512 tokens, derived deterministically from the id (equal ids, equal
//! tokens); the prompt is cut to `input_length`. Generated tokens come from the simulated engine,
//! deterministic per request, and are new content.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant as WallInstant};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use dynamo_actors::builder::{EngineSet, NodeBuilder, Routing, Scheduling};
use dynamo_actors::index::IndexConfig;
use dynamo_actors::leases::{LeaseBook, LeasedTiers};
use dynamo_actors::scheduler::{Hints, SchedulerMsg, SchedulerRef};
use dynamo_actors::tiers::KvObserver;
use dynamo_actors::worker::simulated::{SimNode, SimTiming, SimulatedEngine, WriteThrough, splitmix};
use dynamo_actors::worker::{
    Engine, EngineFactory, EngineHost, GenRequest, JobEvent, LeaseRequest, WorkerEvent, local_spawner,
};
use dynamo_config::{ByteSize, Calibration, RegionKind, RetentionSection, RoutingPolicy};
use dynamo_tiering::block::{BlockHash, BlockHasher, Salt};
use dynamo_tiering::registry::PolicyKind;
use ractor::rpc::CallResult;
use serde::Deserialize;
use tokio::time::Instant;

use crate::serving::Serving;
use dynamo_actors::telemetry::names;

/// Tokens a trace hash id stands for.
const TRACE_BLOCK_TOKENS: usize = 512;

/// The trace's format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TraceFormat {
    /// Mooncake: full prompts at timestamps.
    Mooncake,
    /// aiperf agentic sessions: incremental turns with delays.
    AiperfAgentic,
}

/// `bench replay` arguments.
#[derive(Clone, Debug, Args)]
pub struct ReplayArgs {
    /// The trace file (JSON lines).
    #[arg(long, value_name = "FILE")]
    pub trace: PathBuf,
    /// Its format; detected from the first line when absent.
    #[arg(long, value_enum)]
    pub format: Option<TraceFormat>,
    /// Simulated workers (one GPU each) per node.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Simulated nodes, each with its own G2 and G3; a worker loads another node's G2 over its
    /// NIC (G4, 400 Gb/s).
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// Model shape whose calibrated prefill curve times the engine (`llama-1b`, `llama-8b`).
    #[arg(long, default_value = "llama-8b")]
    pub model: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 64)]
    pub block_tokens: usize,
    /// G1 (HBM for KV) per worker.
    #[arg(long, default_value = "100GiB")]
    pub g1: ByteSize,
    /// G2 (pinned host memory) of the node.
    #[arg(long, default_value = "1TiB")]
    pub g2: ByteSize,
    /// G3 (NVMe) of the node.
    #[arg(long, default_value = "4TiB")]
    pub g3: ByteSize,
    /// Axes to compare, each against the best configuration (KV-aware routing, retention-aware
    /// eviction, write-through to G2+G3), plus the baseline with all three at their simplest:
    /// `routing`, `eviction`, `write-through`, `preamble`, `priority` (a fifth of the sessions
    /// at a high agent-hint priority, honoured vs ignored), `leases` (`cache_control` on every
    /// session's system prompt vs none), `g4` (with `--nodes`: nodes loading each other's G2 vs
    /// the same nodes without it).
    #[arg(long, value_delimiter = ',', default_value = "routing,eviction,write-through", value_parser = parse_axis)]
    pub compare: Vec<Axis>,
    /// Run the best configuration once per capacity instead: `g1=40GiB,80GiB` or
    /// `g2=256GiB,512GiB,1TiB`.
    #[arg(long, value_name = "TIER=SIZE,…")]
    pub sweep: Option<String>,
    /// Replay only the first N requests (Mooncake) or sessions (aiperf).
    #[arg(long)]
    pub limit: Option<usize>,
    /// Arrival rate against the trace's: `2` sends requests twice as fast (timestamps and
    /// think-time delays halved), `0.5` half as fast. Several values (`0.25,0.5,1,2`) run the
    /// comparison once per rate: the load sweep.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub load: Vec<f64>,
    /// What `--load` is a multiple of. `trace`: the trace's own timing (timestamps and think
    /// times scaled). `capacity`: what the workers sustain — a first run of the best
    /// configuration with every session open at once and no think time measures the requests
    /// per second the node completes, and sessions then start as a Poisson process (seeded) at
    /// `--load` × that rate ÷ the mean turns per session, each keeping the trace's think times.
    #[arg(long, value_enum, default_value = "trace")]
    pub load_of: LoadOf,
    /// `simulated` (virtual time, calibrated H200 timing) or `reference` (the real reference
    /// engine on this machine's CPU, its real G1/G2/G3, in real time; use `--limit`).
    #[arg(long, value_enum, default_value = "simulated")]
    pub engine: ReplayEngine,
    /// A node configuration whose `[retention]` the retention-aware runs use (priorities, holds,
    /// lowest tiers per region) and whose `[router]` sets the sticky bonus, temperature and
    /// queue policy.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// A calibration file to time the simulated engine with (the format of
    /// `../shared/calibration/h200.toml`); default: the embedded H200 calibration.
    #[arg(long, value_name = "FILE")]
    pub calibration: Option<PathBuf>,
    /// Seconds per generated token (default: weights read from HBM once per step, ~3.7 ms for
    /// llama-8b on an H200).
    #[arg(long)]
    pub decode_ms: Option<f64>,
    /// Also write the results as JSON here.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Also draw SVG plots here: TTFT CDF per policy, tier occupancy over time, hit rate by
    /// capacity (with `--sweep`).
    #[arg(long, value_name = "DIR")]
    pub plots: Option<PathBuf>,
}

/// What `--load` scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LoadOf {
    /// The trace's timestamps and think times.
    Trace,
    /// The request rate the workers sustain, measured by a saturating run.
    Capacity,
}

/// The engine a replay drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ReplayEngine {
    /// Calibrated timing, virtual time, no math.
    Simulated,
    /// The real reference engine and tiers, real time.
    Reference,
}

/// A dimension `--compare` varies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Axis {
    /// KV-aware vs round-robin vs random.
    Routing,
    /// Retention-aware vs plain LRU.
    Eviction,
    /// G2+G3 vs G2 vs off.
    WriteThrough,
    /// Claude Code's billing header stripped (the node's default) vs kept: kept, every
    /// request starts with a block of its own, as a `cch=` that changes on every request makes
    /// it, and shares no prefix with any other.
    Preamble,
    /// Agent-hint priorities honoured vs ignored: every fifth session asks for priority
    /// [`HIGH_PRIORITY`] (`nvext.priority`), the others for none.
    Priority,
    /// `cache_control` on every session's system prompt (a [`LEASE_TTL`] lease, run again by
    /// each hit, on system prompts of at least `frontend.cache_min_tokens`) vs none.
    Leases,
    /// The nodes of `--nodes` loading each other's G2 (G4) vs the same nodes without it (each
    /// recomputes what only another node holds; the router does not count other nodes' blocks).
    G4,
}

/// The TTL of the leases of `--compare leases`: Anthropic's default `ephemeral` one, as Claude
/// Code sends it.
const LEASE_TTL: Duration = Duration::from_secs(300);

/// The `nvext.priority` of the high-priority class of `--compare priority`.
const HIGH_PRIORITY: i32 = 10;

/// Whether session `s` is of the high-priority class (every fifth).
fn high_priority(s: usize) -> bool {
    s.is_multiple_of(5)
}

fn parse_axis(s: &str) -> Result<Axis, String> {
    match s {
        "routing" => Ok(Axis::Routing),
        "eviction" => Ok(Axis::Eviction),
        "write-through" | "write_through" => Ok(Axis::WriteThrough),
        "preamble" => Ok(Axis::Preamble),
        "priority" => Ok(Axis::Priority),
        "leases" => Ok(Axis::Leases),
        "g4" => Ok(Axis::G4),
        other => {
            Err(format!("unknown axis `{other}` (routing, eviction, write-through, preamble, priority, leases, g4)"))
        }
    }
}

/// How blocks are kept: by retention region (priorities, holds) or plain LRU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Eviction {
    Retention,
    PlainLru,
}

/// One configuration a replay runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Policy {
    routing: RoutingPolicy,
    eviction: Eviction,
    write_through: WriteThrough,
    /// Every request starts with a block of its own (a billing header left in).
    preamble_kept: bool,
    /// The high-priority class's hints are sent (otherwise every request has priority 0).
    priorities: bool,
    /// What every request marks with `cache_control`.
    leased: Leased,
    /// Nodes load each other's G2.
    g4: bool,
}

/// The `cache_control` breakpoints of `--compare leases`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Leased {
    /// None: plain retention.
    No,
    /// The system prompt.
    System,
    /// The system prompt and the whole prompt (the last message), as Claude Code marks them.
    Conversation,
}

impl Policy {
    const BEST: Policy = Policy {
        routing: RoutingPolicy::KvAware,
        eviction: Eviction::Retention,
        write_through: WriteThrough::G2G3,
        preamble_kept: false,
        priorities: false,
        leased: Leased::No,
        g4: true,
    };
    const BASELINE: Policy = Policy {
        routing: RoutingPolicy::RoundRobin,
        eviction: Eviction::PlainLru,
        write_through: WriteThrough::Off,
        preamble_kept: false,
        priorities: false,
        leased: Leased::No,
        g4: true,
    };

    fn name(&self) -> String {
        let preamble = if self.preamble_kept { "+preamble-kept" } else { "" };
        let priorities = if self.priorities { "+priorities" } else { "" };
        let leased = match self.leased {
            Leased::No => "",
            Leased::System => "+leased-system",
            Leased::Conversation => "+leased-conversation",
        };
        let g4 = if self.g4 { "" } else { "+no-g4" };
        format!(
            "{}+{}+{}{preamble}{priorities}{leased}{g4}",
            policy_name(self.routing),
            self.eviction_name(),
            self.write_through_name()
        )
    }

    fn eviction_name(&self) -> &'static str {
        match self.eviction {
            Eviction::Retention => "retention",
            Eviction::PlainLru => "lru",
        }
    }

    fn write_through_name(&self) -> &'static str {
        match self.write_through {
            WriteThrough::Off => "no-wt",
            WriteThrough::G2 => "wt-g2",
            WriteThrough::G2G3 => "wt-g2g3",
        }
    }

    /// The best configuration, one variant per compared axis value, and the baseline.
    fn compared(axes: &[Axis]) -> Vec<Policy> {
        let mut out = vec![Policy::BEST];
        let mut push = |p: Policy| {
            if !out.contains(&p) {
                out.push(p);
            }
        };
        for axis in axes {
            match axis {
                Axis::Routing => {
                    for routing in [RoutingPolicy::RoundRobin, RoutingPolicy::Random] {
                        push(Policy { routing, ..Policy::BEST });
                    }
                }
                Axis::Eviction => push(Policy { eviction: Eviction::PlainLru, ..Policy::BEST }),
                Axis::WriteThrough => {
                    for write_through in [WriteThrough::G2, WriteThrough::Off] {
                        push(Policy { write_through, ..Policy::BEST });
                    }
                }
                Axis::Preamble => push(Policy { preamble_kept: true, ..Policy::BEST }),
                Axis::Priority => push(Policy { priorities: true, ..Policy::BEST }),
                Axis::Leases => {
                    for leased in [Leased::System, Leased::Conversation] {
                        push(Policy { leased, ..Policy::BEST });
                    }
                }
                Axis::G4 => push(Policy { g4: false, ..Policy::BEST }),
            }
        }
        if !axes.is_empty() {
            push(Policy::BASELINE);
        }
        out
    }
}

/// Retention without regions: every block the same priority, no holds.
fn plain_lru() -> RetentionSection {
    let mut r = RetentionSection::default();
    for region in RegionKind::ALL {
        let p = match region {
            RegionKind::System => &mut r.system,
            RegionKind::Tools => &mut r.tools,
            RegionKind::Conversation => &mut r.conversation,
            RegionKind::ToolResult => &mut r.tool_result,
            RegionKind::Reasoning => &mut r.reasoning,
            RegionKind::Generated => &mut r.generated,
        };
        p.priority = 50;
        p.hold = dynamo_config::HumanDuration(Duration::ZERO);
    }
    r
}

fn policy_name(p: RoutingPolicy) -> &'static str {
    match p {
        RoutingPolicy::KvAware => "kv_aware",
        RoutingPolicy::RoundRobin => "round_robin",
        RoutingPolicy::Random => "random",
    }
}

#[derive(Debug, Deserialize)]
struct Line {
    #[serde(default)]
    session_id: Option<String>,
    #[serde(default)]
    timestamp: Option<f64>,
    #[serde(default)]
    delay: Option<f64>,
    input_length: usize,
    output_length: usize,
    hash_ids: Vec<u64>,
}

/// One turn (or one Mooncake request).
#[derive(Debug, Clone)]
struct Turn {
    /// Leading tokens shared by many sessions (system prompt, tools, group context): the
    /// `system` retention region.
    system_tokens: usize,
    /// Mooncake: arrival; aiperf first turn: session start.
    at_ms: f64,
    /// aiperf later turns: wait after the previous turn completed.
    delay_ms: f64,
    new_tokens: Vec<u32>,
    output_length: usize,
}

/// A trace as sessions of turns (a Mooncake request is a session of one full-prompt turn).
#[derive(Debug)]
struct Trace {
    name: String,
    sessions: Vec<Vec<Turn>>,
    requests: usize,
}

fn tokens_of(ids: &[u64], len: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(ids.len() * TRACE_BLOCK_TOKENS);
    for &id in ids {
        let mut state = id.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x5eed;
        for _ in 0..TRACE_BLOCK_TOKENS {
            state = splitmix(state);
            out.push((state % 120_000) as u32 + 256);
        }
    }
    out.truncate(len.max(1).min(out.len()));
    out
}

fn load_trace(path: &Path, format: Option<TraceFormat>, limit: Option<usize>) -> anyhow::Result<Trace> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = Vec::new();
    for (n, raw) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let line: Line =
            serde_json::from_str(raw).with_context(|| format!("{}:{}: not a trace request", path.display(), n + 1))?;
        lines.push(line);
    }
    let format = format.unwrap_or(if lines.first().is_some_and(|l| l.session_id.is_some()) {
        TraceFormat::AiperfAgentic
    } else {
        TraceFormat::Mooncake
    });
    // A hash id that starts the prompts of many sessions is shared instruction (system prompt,
    // tool definitions, a group's repository context): it is tagged `system`, as the frontend
    // tags those messages. "Many": at least 3 and 2% of the first prompts.
    let firsts: Vec<&Line> = match format {
        TraceFormat::Mooncake => lines.iter().collect(),
        TraceFormat::AiperfAgentic => lines.iter().filter(|l| l.delay.is_none()).collect(),
    };
    let mut counts: HashMap<u64, usize> = HashMap::new();
    for l in &firsts {
        for id in &l.hash_ids {
            *counts.entry(*id).or_default() += 1;
        }
    }
    let shared = (firsts.len() / 50).max(3);
    let system_tokens = |l: &Line| {
        let ids = l.hash_ids.iter().take_while(|id| counts.get(id).is_some_and(|&c| c >= shared)).count();
        (ids * TRACE_BLOCK_TOKENS).min(l.input_length)
    };
    let mut sessions: Vec<Vec<Turn>> = Vec::new();
    match format {
        TraceFormat::Mooncake => {
            for l in lines.iter().take(limit.unwrap_or(usize::MAX)) {
                let turn = Turn {
                    system_tokens: system_tokens(l),
                    at_ms: l.timestamp.unwrap_or(0.0),
                    delay_ms: 0.0,
                    new_tokens: tokens_of(&l.hash_ids, l.input_length),
                    output_length: l.output_length.max(1),
                };
                sessions.push(vec![turn]);
            }
        }
        TraceFormat::AiperfAgentic => {
            let mut by_id: HashMap<String, usize> = HashMap::new();
            for (n, l) in lines.iter().enumerate() {
                let Some(id) = &l.session_id else { bail!("{}:{}: no session_id", path.display(), n + 1) };
                let at = *by_id.entry(id.clone()).or_insert_with(|| {
                    sessions.push(Vec::new());
                    sessions.len() - 1
                });
                let first = sessions[at].is_empty();
                sessions[at].push(Turn {
                    system_tokens: if first { system_tokens(l) } else { 0 },
                    at_ms: if first { l.timestamp.unwrap_or(0.0) } else { 0.0 },
                    delay_ms: l.delay.unwrap_or(0.0),
                    new_tokens: tokens_of(&l.hash_ids, l.input_length),
                    output_length: l.output_length.max(1),
                });
            }
            sessions.truncate(limit.unwrap_or(usize::MAX));
        }
    }
    let requests = sessions.iter().map(Vec::len).sum();
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    Ok(Trace { name, sessions, requests })
}

/// What one request did.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    ttft: Duration,
    /// When it completed, from the replay's start.
    done_at: Duration,
    prompt: usize,
    hit: [usize; 4],
    output: usize,
    /// Of a session of the high-priority class (whether or not its hints were sent).
    high: bool,
    /// Tokens of its system region (the prompt's first ones).
    system: usize,
}

/// Tier occupancy at one moment of virtual time.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
struct Occupancy {
    at_s: f64,
    g1: i64,
    g2: usize,
    g3: usize,
}

/// The tier and size a sweep run used.
type Capacity = Option<(String, ByteSize)>;

/// One configuration's results.
#[derive(Debug)]
struct Outcome {
    policy: Policy,
    samples: Vec<Sample>,
    wall: Duration,
    virtual_time: Duration,
    bound_hit_rate: f64,
    bytes: [u64; 5],
    g3_skipped: u64,
    /// Mean wait before a request's prefill began (queued, or in its worker's batch), ms.
    queue_ms: f64,
    /// Requests preempted out of G1 (resumed by loading their blocks back).
    preempted: u64,
    evictions: [BTreeMap<RegionKind, u64>; 3],
    lag_ms: (f64, f64),
    timeline: Vec<Occupancy>,
    capacity: Capacity,
    /// The wall time of each routing decision, sorted, in seconds (simulated runs).
    decisions_s: Vec<f64>,
}

impl Outcome {
    fn ttfts_ms(&self) -> Vec<f64> {
        let mut v: Vec<f64> = self.samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
        v.sort_by(f64::total_cmp);
        v
    }

    fn percentile_ms(&self, p: f64) -> f64 {
        let v = self.ttfts_ms();
        if v.is_empty() {
            return 0.0;
        }
        v[((v.len() - 1) as f64 * p).round() as usize]
    }

    fn hit_rate(&self, tier: Option<usize>) -> f64 {
        let prompt: usize = self.samples.iter().map(|s| s.prompt).sum();
        let hit: usize = self.samples.iter().map(|s| tier.map_or(s.hit.iter().sum(), |t| s.hit[t])).sum();
        hit as f64 / prompt.max(1) as f64
    }

    /// The share of system-region tokens found cached.
    fn system_hit_rate(&self) -> f64 {
        let system: usize = self.samples.iter().map(|s| s.system).sum();
        let hit: usize = self.samples.iter().map(|s| s.hit.iter().sum::<usize>().min(s.system)).sum();
        hit as f64 / system.max(1) as f64
    }

    /// The `q` quantile of the routing decisions' wall time, in µs.
    fn decision_us(&self, q: f64) -> f64 {
        let d = &self.decisions_s;
        d.get(((d.len().max(1) - 1) as f64 * q).round() as usize).map_or(0.0, |s| s * 1e6)
    }

    fn saved_tokens(&self) -> usize {
        self.samples.iter().map(|s| s.hit.iter().sum::<usize>()).sum()
    }

    fn json(&self) -> serde_json::Value {
        let regions = |m: &BTreeMap<RegionKind, u64>| -> serde_json::Value {
            m.iter().map(|(r, n)| (r.as_str().to_string(), serde_json::json!(n))).collect()
        };
        let secs = self.virtual_time.as_secs_f64().max(1e-9);
        serde_json::json!({
            "name": self.policy.name(),
            "routing": policy_name(self.policy.routing),
            "eviction": self.policy.eviction_name(),
            "write_through": self.policy.write_through_name(),
            "preamble_kept": self.policy.preamble_kept,
            "priorities": self.policy.priorities,
            "leased": format!("{:?}", self.policy.leased).to_lowercase(),
            "capacity": self.capacity.as_ref().map(|(tier, size)| serde_json::json!({"tier": tier, "bytes": size.0})),
            "requests": self.samples.len(),
            "hit_rate": self.hit_rate(None),
            "system_hit_rate": self.system_hit_rate(),
            "hit_rate_by_tier": {"g1": self.hit_rate(Some(0)), "g2": self.hit_rate(Some(1)), "g3": self.hit_rate(Some(2)), "g4": self.hit_rate(Some(3))},
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
struct Shared {
    workers: usize,
    nodes: usize,
    block_tokens: usize,
    timing: SimTiming,
    g1: ByteSize,
    g2: ByteSize,
    g3: ByteSize,
    retention: RetentionSection,
    sticky_bonus: Duration,
    temperature: f64,
    engine: ReplayEngine,
    config: dynamo_config::NodeConfig,
}

impl Shared {
    fn blocks(&self, size: ByteSize) -> usize {
        (size.0 / self.timing.block_bytes.max(1)) as usize
    }
}

fn shared(args: &ReplayArgs) -> anyhow::Result<Shared> {
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

fn parse_sweep(spec: &str) -> anyhow::Result<(String, Vec<ByteSize>)> {
    let Some((tier, sizes)) = spec.split_once('=') else {
        bail!("--sweep wants TIER=SIZE,SIZE,… (e.g. g2=256GiB,1TiB), got `{spec}`")
    };
    let tier = tier.trim().to_ascii_lowercase();
    if !["g1", "g2", "g3"].contains(&tier.as_str()) {
        bail!("--sweep: the tier is g1, g2 or g3, not `{tier}`");
    }
    let sizes = sizes
        .split(',')
        .map(|s| s.trim().parse::<ByteSize>().map_err(|e| anyhow::anyhow!("--sweep: `{s}`: {e}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok((tier, sizes))
}

/// Runs the replay and returns the report; writes JSON and plots when asked.
pub fn run(args: &ReplayArgs) -> anyhow::Result<String> {
    if args.load.len() > 1 {
        return sweep_load(args);
    }
    let (trace, outcomes) = replay(args)?;
    let report = render(&trace, args, &outcomes);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report_json(&trace, args, &outcomes))?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(dir) = &args.plots {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        plots::draw(dir, &outcomes, args.sweep.is_some())?;
    }
    Ok(report)
}

/// `--load 0.25,0.5,…`: the comparison once per arrival rate, then one table of TTFT percentiles
/// per policy and rate, each KV-aware percentile against the best of the other policies. With
/// aiperf's sessions a turn arrives a think time after the previous one completed, so a policy
/// that completes turns sooner is offered more load: the table shows the requests per virtual
/// second each policy sustained beside its percentiles.
fn sweep_load(args: &ReplayArgs) -> anyhow::Result<String> {
    use std::fmt::Write as _;
    let mut out = String::new();
    let mut table = String::new();
    let _ = writeln!(table, "\nload sweep ({}):", args.trace.display());
    let _ = writeln!(
        table,
        "{:>6}  {:<12} {:>9} {:>9} {:>9} {:>7} {:>8}   KV-aware ÷ best other (p50 / p90 / p99)",
        "load", "routing", "p50 s", "p90 s", "p99 s", "hit %", "req/s"
    );
    let sustained = match args.load_of {
        LoadOf::Trace => None,
        LoadOf::Capacity => {
            let rate = sustained_rate(args)?;
            let _ = writeln!(
                table,
                "load is of what the workers sustain: {rate:.2} requests/s (best configuration, every session open, no think time)"
            );
            Some(rate)
        }
    };
    let mut json = Vec::new();
    for &load in &args.load {
        let one = ReplayArgs { load: vec![load], json: None, plots: None, ..args.clone() };
        let (trace, outcomes) = replay_at(&one, sustained)?;
        out.push_str(&render(&trace, &one, &outcomes));
        json.push(serde_json::json!({
            "load": load,
            "sustained_requests_per_s": sustained,
            "report": report_json(&trace, &one, &outcomes),
        }));
        // The best configuration under each routing policy, and the baseline.
        let rows: Vec<&Outcome> = outcomes
            .iter()
            .filter(|o| {
                Policy { routing: RoutingPolicy::KvAware, ..o.policy } == Policy::BEST || o.policy == Policy::BASELINE
            })
            .collect();
        let pct = |o: &Outcome, q: f64| o.percentile_ms(q) / 1e3;
        let kv = rows.iter().find(|o| o.policy == Policy::BEST);
        let others: Vec<&&Outcome> =
            rows.iter().filter(|o| o.policy != Policy::BEST && o.policy != Policy::BASELINE).collect();
        let best_other = |q: f64| others.iter().map(|o| pct(o, q)).fold(f64::INFINITY, f64::min);
        let baseline = rows.iter().find(|o| o.policy == Policy::BASELINE);
        for o in &rows {
            let ratio = match (kv, o.policy == Policy::BEST) {
                (Some(kv), true) => {
                    let mut r = format!(
                        "{:.2} / {:.2} / {:.2}",
                        pct(kv, 0.5) / best_other(0.5),
                        pct(kv, 0.9) / best_other(0.9),
                        pct(kv, 0.99) / best_other(0.99)
                    );
                    if let Some(b) = baseline {
                        let _ =
                            write!(r, "; baseline p50 ÷ KV-aware p50 = {:.1}×", pct(b, 0.5) / pct(kv, 0.5).max(1e-9));
                    }
                    r
                }
                _ => String::new(),
            };
            let name = if o.policy == Policy::BASELINE {
                "baseline".to_owned()
            } else {
                policy_name(o.policy.routing).to_owned()
            };
            let _ = writeln!(
                table,
                "{:>5}×  {:<12} {:>9.2} {:>9.2} {:>9.2} {:>7.1} {:>8.2}   {ratio}",
                load,
                name,
                pct(o, 0.5),
                pct(o, 0.9),
                pct(o, 0.99),
                o.hit_rate(None) * 100.0,
                o.samples.len() as f64 / o.virtual_time.as_secs_f64().max(1e-9)
            );
        }
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    out.push_str(&table);
    Ok(out)
}

fn replay(args: &ReplayArgs) -> anyhow::Result<(Trace, Vec<Outcome>)> {
    let sustained = match args.load_of {
        LoadOf::Trace => None,
        LoadOf::Capacity => Some(sustained_rate(args)?),
    };
    replay_at(args, sustained)
}

/// The requests per virtual second the best configuration completes with every session of the
/// trace open at once and no think time (the middle 80% of completions, so neither the ramp nor
/// the last sessions' drain counts): what the workers sustain.
fn sustained_rate(args: &ReplayArgs) -> anyhow::Result<f64> {
    let mut trace = load_trace(&args.trace, args.format, args.limit)?;
    for turn in trace.sessions.iter_mut().flatten() {
        turn.at_ms = 0.0;
        turn.delay_ms = 0.0;
    }
    let outcome = replay_one(&trace, &shared(args)?, Policy::BEST, "[capacity] saturating run")?;
    let mut done: Vec<Duration> = outcome.samples.iter().map(|s| s.done_at).collect();
    done.sort();
    let (from, to) = (done.len() / 10, done.len() * 9 / 10);
    let span = done.get(to).zip(done.get(from)).map_or(0.0, |(b, a)| (*b - *a).as_secs_f64());
    if to <= from || span <= 0.0 {
        bail!("the trace is too short to measure what the workers sustain ({} requests)", done.len());
    }
    Ok((to - from) as f64 / span)
}

/// Session starts as a Poisson process of `per_s` sessions per second (seeded: every policy sees
/// the same arrivals), the first at 0.
fn open_sessions(trace: &mut Trace, per_s: f64) {
    let mut state = 0x6f70_656e_u64;
    let mut at_ms = 0.0;
    for turns in &mut trace.sessions {
        if let Some(first) = turns.first_mut() {
            first.at_ms = at_ms;
        }
        state = splitmix(state);
        let u = ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        at_ms += -u.ln() / per_s * 1e3;
    }
}

/// The replay at `--load`: of the trace's timing, or (with `sustained`, requests per second) of
/// what the workers sustain.
fn replay_at(args: &ReplayArgs, sustained: Option<f64>) -> anyhow::Result<(Trace, Vec<Outcome>)> {
    let mut trace = load_trace(&args.trace, args.format, args.limit)?;
    let load = match args.load[..] {
        [one] => one,
        _ => bail!("--load takes one rate here; bench replay runs a sweep of several itself"),
    };
    if !(load.is_finite() && load > 0.0) {
        bail!("--load {load}: the arrival rate must be a positive factor");
    }
    match sustained {
        None => {
            for turn in trace.sessions.iter_mut().flatten() {
                turn.at_ms /= load;
                turn.delay_ms /= load;
            }
        }
        Some(rate) => {
            let turns = trace.requests as f64 / trace.sessions.len().max(1) as f64;
            open_sessions(&mut trace, load * rate / turns.max(1.0));
        }
    }
    let base = shared(args)?;
    let mut runs: Vec<(Policy, Shared, Capacity)> = Vec::new();
    match &args.sweep {
        Some(spec) => {
            let (tier, sizes) = parse_sweep(spec)?;
            for size in sizes {
                let mut s = base.clone();
                match tier.as_str() {
                    "g1" => s.g1 = size,
                    "g2" => s.g2 = size,
                    _ => s.g3 = size,
                }
                runs.push((Policy::BEST, s, Some((tier.clone(), size))));
            }
        }
        None => runs.extend(Policy::compared(&args.compare).into_iter().map(|p| (p, base.clone(), None))),
    }
    // Each run is one thread's simulation in its own virtual time: they run side by side.
    let total = runs.len();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(total.max(1));
    let mut results: Vec<Option<anyhow::Result<Outcome>>> = (0..total).map(|_| None).collect();
    let done = std::sync::Mutex::new(&mut results);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((policy, setup, capacity)) = runs.get(i) else { break };
                    let label = format!("[{}/{total}] {}", i + 1, policy.name());
                    let outcome = replay_one(&trace, setup, *policy, &label).map(|mut o| {
                        o.capacity = capacity.clone();
                        o
                    });
                    done.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(outcome);
                }
            });
        }
    });
    let outcomes = results.into_iter().map(|r| r.expect("every run ran")).collect::<anyhow::Result<Vec<_>>>()?;
    Ok((trace, outcomes))
}

fn replay_one(trace: &Trace, setup: &Shared, policy: Policy, label: &str) -> anyhow::Result<Outcome> {
    let local = tokio::task::LocalSet::new();
    let wall = WallInstant::now();
    let mut outcome = match setup.engine {
        ReplayEngine::Simulated => {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build()?;
            // The whole node runs on this thread: a recorder local to it sees this run's decisions.
            let decisions = Arc::new(Decisions::default());
            let recorder = DecisionRecorder(decisions.clone());
            let mut outcome = metrics::with_local_recorder(&recorder, || {
                local.block_on(&runtime, drive(trace, setup, policy, label))
            })?;
            outcome.decisions_s = std::mem::take(&mut *decisions.0.lock().unwrap_or_else(|e| e.into_inner()));
            outcome.decisions_s.sort_by(f64::total_cmp);
            outcome
        }
        ReplayEngine::Reference => {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            local.block_on(&runtime, drive_reference(trace, setup, policy, label))?
        }
    };
    outcome.wall = wall.elapsed();
    Ok(outcome)
}

/// The wall time of every routing decision of a run, in seconds.
#[derive(Debug, Default)]
struct Decisions(std::sync::Mutex<Vec<f64>>);

impl metrics::HistogramFn for Decisions {
    fn record(&self, value: f64) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(value);
    }
}

/// Keeps `dynamo_node_router_decision_seconds` (what the scheduler records of each decision, in
/// wall time) and drops every other metric.
struct DecisionRecorder(Arc<Decisions>);

impl metrics::Recorder for DecisionRecorder {
    fn describe_counter(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_gauge(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_histogram(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}

    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::noop()
    }

    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }

    fn register_histogram(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        if key.name() == names::ROUTER_DECISION_SECONDS {
            metrics::Histogram::from_arc(self.0.clone())
        } else {
            metrics::Histogram::noop()
        }
    }
}

/// A progress line on stderr while a long replay runs (only on a terminal).
struct Progress {
    label: String,
    total: usize,
    done: std::cell::Cell<usize>,
    shown: std::cell::Cell<usize>,
    tty: bool,
}

impl Progress {
    fn tick(&self) {
        let done = self.done.get() + 1;
        self.done.set(done);
        let pct = done * 100 / self.total.max(1);
        if self.tty && pct != self.shown.get() {
            self.shown.set(pct);
            let bar: String = (0..40).map(|i| if i * 100 < pct * 40 { '#' } else { '.' }).collect();
            eprint!("\r{} [{bar}] {done}/{} requests", self.label, self.total);
            if done == self.total {
                eprintln!();
            }
        }
    }
}

async fn drive(trace: &Trace, setup: &Shared, policy: Policy, label: &str) -> anyhow::Result<Outcome> {
    let (spawner, spawn_loop) = local_spawner();
    tokio::task::spawn_local(spawn_loop);
    let salt = Salt(0x7265_706c_6179);
    // Events applied where published, under a constant epoch: the replay is deterministic in
    // virtual time.
    let builder = NodeBuilder::new(IndexConfig { max_blocks: 64 << 20, ..IndexConfig::default() }).with_epoch(1);
    let retention = match policy.eviction {
        Eviction::Retention => setup.retention.clone(),
        Eviction::PlainLru => plain_lru(),
    };
    // One simulated node per `--nodes`, each with its G2/G3 and its KV events (node id n) into
    // the one index; every node can load from the others' G2 (G4).
    let epoch = Instant::now();
    let book = Arc::new(LeaseBook::default());
    let nodes: Vec<Arc<SimNode>> = (0..setup.nodes)
        .map(|n| {
            let publisher: Arc<dyn KvObserver> = builder.publisher(n as u16);
            Arc::new(
                SimNode::new(
                    setup.block_tokens,
                    salt,
                    retention.clone(),
                    setup.timing.clone(),
                    policy.write_through,
                    setup.blocks(setup.g2),
                    setup.blocks(setup.g3),
                    PolicyKind::Lru,
                    publisher,
                )
                .with_leases(book.clone(), epoch, setup.config.tiers.lease_budget),
            )
        })
        .collect();
    if policy.g4 {
        SimNode::connect(&nodes);
    }
    let g1_blocks = setup.blocks(setup.g1);
    let factory_nodes = nodes.clone();
    let per_node = setup.workers;
    // Each simulated worker batches as the reference worker does, within the configured
    // `engine.max_batch_tokens` and `engine.max_running_requests`.
    let (batch_tokens, max_running) = (setup.config.engine.max_batch_tokens, setup.config.engine.max_running_requests);
    let factory: EngineFactory = Arc::new(move |id| {
        let node = factory_nodes[id / per_node].clone();
        let engine = SimulatedEngine::new(id, node, g1_blocks, PolicyKind::Lru, epoch);
        Ok(Box::new(engine.with_batch(batch_tokens, max_running)) as Box<dyn Engine>)
    });
    // The router ranks workers with the same cost model the simulated workers decide with.
    let mut cost = setup.timing.cost_model(setup.block_tokens);
    if !policy.g4 {
        // Without G4 no load from another node is ever worth it: the router counts none.
        cost.g4_read = dynamo_tiering::cost::BytesPerSec::new(1.0);
    }
    // Working-set admission counts the nodes' G2 beside the workers' G1.
    let g2_blocks = match policy.write_through {
        WriteThrough::Off => 0,
        _ => setup.blocks(setup.g2) * setup.nodes,
    };
    let routing = Routing { salt, block_tokens: setup.block_tokens, cost, g2_blocks };
    let engines = EngineSet {
        workers: setup.workers * setup.nodes,
        factory,
        host: EngineHost::Local(spawner),
        queue_bound: 1 << 16,
        queue_policy: setup.config.router.queue_policy,
    };
    let scheduling = Scheduling {
        policy: policy.routing,
        session_idle_timeout: Duration::from_secs(600),
        max_sessions: usize::MAX,
        seed: 42,
        sticky_bonus: setup.sticky_bonus,
        temperature: setup.temperature,
        workers_per_node: setup.workers,
        admission: Scheduling::from_config(&setup.config).admission,
    };
    // The scheduler grants `cache_control` leases in the nodes' tiers (one book for all).
    let leases: Arc<dyn LeasedTiers> = nodes[0].clone();
    let node = builder
        .simulated(routing)
        .leases(leases)
        .engines(engines)
        .spawn(scheduling)
        .await
        .context("starting the simulated node")?;
    let scheduler = node.scheduler.clone();
    let start = Instant::now();
    // Occupancy over virtual time, sampled every 10 virtual seconds.
    let sampled = nodes.clone();
    let timeline = Rc::new(std::cell::RefCell::new(Vec::new()));
    let samples_out = timeline.clone();
    let sampler = tokio::task::spawn_local(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            tick.tick().await;
            let mut sample = Occupancy { at_s: start.elapsed().as_secs_f64(), ..Occupancy::default() };
            for node in &sampled {
                let (g2, g3) = node.resident();
                sample.g1 += node.stats.g1_resident.load(Ordering::Relaxed);
                sample.g2 += g2;
                sample.g3 += g3;
            }
            samples_out.borrow_mut().push(sample);
        }
    });
    let min_lease = setup.config.frontend.cache_min_tokens;
    let bound = BoundHashing { block_tokens: setup.block_tokens, salt };
    let (samples, prompts) = run_sessions(trace, &scheduler, start, label, policy, min_lease, bound).await?;
    let virtual_time = start.elapsed();
    sampler.abort();
    node.shutdown().await;
    let load = |f: &dyn Fn(&SimNode) -> &std::sync::atomic::AtomicU64| -> u64 {
        nodes.iter().map(|n| f(n).load(Ordering::Relaxed)).sum()
    };
    let acks = load(&|n| &n.stats.g3_acks).max(1) as f64;
    let mut evictions: [BTreeMap<RegionKind, u64>; 3] = Default::default();
    for node in &nodes {
        let [g2, g3] = node.evictions();
        for (tier, by_region) in
            [node.stats.g1_evictions.lock().expect("stats").clone(), g2, g3].into_iter().enumerate()
        {
            for (region, n) in by_region {
                *evictions[tier].entry(region).or_default() += n;
            }
        }
    }
    let lag_max = nodes.iter().map(|n| n.stats.g3_lag_us_max.load(Ordering::Relaxed)).max().unwrap_or(0);
    let timeline = timeline.borrow().clone();
    Ok(Outcome {
        policy,
        samples,
        wall: Duration::ZERO,
        virtual_time,
        bound_hit_rate: bound_hit_rate(prompts, setup.block_tokens),
        bytes: [
            load(&|n| &n.stats.g2_to_g1_bytes),
            load(&|n| &n.stats.g3_to_g1_bytes),
            load(&|n| &n.stats.g1_to_g2_bytes),
            load(&|n| &n.stats.g2_to_g3_bytes),
            load(&|n| &n.stats.g4_to_g1_bytes),
        ],
        g3_skipped: load(&|n| &n.stats.g3_skipped),
        preempted: load(&|n| &n.stats.preemptions),
        queue_ms: load(&|n| &n.stats.queue_us_sum) as f64 / load(&|n| &n.stats.prefills).max(1) as f64 / 1e3,
        evictions,
        lag_ms: (load(&|n| &n.stats.g3_lag_us_sum) as f64 / acks / 1e3, lag_max as f64 / 1e3),
        timeline,
        capacity: None,
        decisions_s: Vec::new(),
    })
}

/// Replays on the real node: the reference engine on this machine's CPU over real G1/G2/G3 (in a
/// scratch data directory), with the same actors, in real time. Link bytes, evictions and the
/// occupancy timeline are the simulator's counters and are not reported here (the node's
/// Prometheus metrics carry them).
async fn drive_reference(trace: &Trace, setup: &Shared, policy: Policy, label: &str) -> anyhow::Result<Outcome> {
    let mut cfg = setup.config.clone();
    let dir = std::env::temp_dir().join(format!("dynamo-replay-{}-{}", std::process::id(), label.len()));
    let _ = std::fs::remove_dir_all(&dir);
    cfg.node.data_dir = dir.clone();
    cfg.engine.workers = setup.workers;
    cfg.engine.max_queued_requests = 1 << 16;
    cfg.router.policy = policy.routing;
    cfg.retention = match policy.eviction {
        Eviction::Retention => setup.retention.clone(),
        Eviction::PlainLru => plain_lru(),
    };
    match policy.write_through {
        WriteThrough::Off => {
            cfg.tiers.g2.enabled = false;
            cfg.tiers.g3.enabled = false;
        }
        WriteThrough::G2 => cfg.tiers.g3.enabled = false,
        WriteThrough::G2G3 => {}
    }
    let plan = crate::plan::ResolvedTiers::resolve(&cfg)?;
    let (open_cfg, open_plan) = (cfg.clone(), plan.clone());
    let stores = tokio::task::spawn_blocking(move || Serving::open(&open_cfg, &open_plan)).await??;
    let serving = Serving::start(&cfg, &plan, stores).await?;
    let scheduler = serving.node.current_scheduler().await?;
    let start = Instant::now();
    let bound = BoundHashing { block_tokens: cfg.blocks.block_size, salt: Salt(0) };
    let (samples, prompts) =
        run_sessions(trace, &scheduler, start, label, policy, cfg.frontend.cache_min_tokens, bound).await?;
    let elapsed = start.elapsed();
    serving.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Outcome {
        policy,
        samples,
        wall: Duration::ZERO,
        virtual_time: elapsed,
        bound_hit_rate: bound_hit_rate(prompts, cfg.blocks.block_size),
        bytes: [0; 5],
        g3_skipped: 0,
        preempted: 0,
        queue_ms: 0.0,
        evictions: Default::default(),
        lag_ms: (0.0, 0.0),
        timeline: Vec::new(),
        capacity: None,
        decisions_s: Vec::new(),
    })
}

/// One request as the bound sees it: when it arrived, its prompt length, and the whole sequence
/// after it (prompt and answer: the answer's blocks are computed, so an infinite cache has them),
/// as the first `n` block hashes of a chain. A session's sequences are prefixes of its final
/// history, so its turns share one chain; tokens are not kept (an 800-session trace's prompts
/// add up to billions of them).
type Turned = (Instant, usize, Rc<[BlockHash]>, usize);

/// What each session task of a run goes by.
#[derive(Clone, Copy)]
struct SessionRules {
    policy: Policy,
    min_lease: usize,
    bound: BoundHashing,
}

/// What the infinite-cache bound hashes with.
#[derive(Clone, Copy)]
struct BoundHashing {
    block_tokens: usize,
    salt: Salt,
}

/// The hit rate of an infinite cache: every block ever computed — prompts and answers — stays,
/// in arrival order.
fn bound_hit_rate(mut turns: Vec<Turned>, b: usize) -> f64 {
    turns.sort_by_key(|(at, ..)| *at);
    let mut seen = HashSet::new();
    let (mut hit, mut total) = (0usize, 0usize);
    for (_, prompt, chain, blocks) in turns {
        let hashes = &chain[..blocks];
        let cap = prompt.saturating_sub(1) / b;
        hit += hashes.iter().take(cap).take_while(|h| seen.contains(*h)).count() * b;
        total += prompt;
        seen.extend(hashes.iter().copied());
    }
    hit as f64 / total.max(1) as f64
}

type SessionResult = anyhow::Result<(Vec<Sample>, Vec<Turned>)>;

/// Runs every session of `trace` against `scheduler` (one local task each, from `start`) and
/// collects what each request did.
async fn run_sessions(
    trace: &Trace,
    scheduler: &SchedulerRef,
    start: Instant,
    label: &str,
    policy: Policy,
    min_lease: usize,
    bound: BoundHashing,
) -> SessionResult {
    let progress = Rc::new(Progress {
        label: label.to_string(),
        total: trace.requests,
        done: Default::default(),
        shown: Default::default(),
        tty: std::io::stderr().is_terminal(),
    });
    let mut tasks = tokio::task::JoinSet::new();
    for (s, turns) in trace.sessions.iter().enumerate() {
        let session = run_session(
            s,
            turns.clone(),
            scheduler.clone(),
            start,
            progress.clone(),
            SessionRules { policy, min_lease, bound },
        );
        tasks.spawn_local(session);
    }
    let mut samples = Vec::with_capacity(trace.requests);
    let mut prompts = Vec::with_capacity(trace.requests);
    while let Some(done) = tasks.join_next().await {
        let (s, p) = done.context("a session task failed")??;
        samples.extend(s);
        prompts.extend(p);
    }
    Ok((samples, prompts))
}

async fn run_session(
    session: usize,
    turns: Vec<Turn>,
    scheduler: SchedulerRef,
    start: Instant,
    progress: Rc<Progress>,
    rules: SessionRules,
) -> SessionResult {
    let SessionRules { policy, min_lease, bound } = rules;
    let preamble_kept = policy.preamble_kept;
    let hints = Hints {
        priority: if policy.priorities && high_priority(session) { HIGH_PRIORITY } else { 0 },
        ..Hints::default()
    };
    let mut samples = Vec::with_capacity(turns.len());
    let mut prompts = Vec::with_capacity(turns.len());
    let mut history: Vec<u32> = Vec::new();
    let mut hasher = BlockHasher::new(bound.salt, bound.block_tokens);
    let mut sequences = Vec::new();
    let mut system = 0;
    let id = format!("session-{session}");
    for (k, turn) in turns.into_iter().enumerate() {
        if k == 0 {
            tokio::time::sleep_until(start + Duration::from_secs_f64(turn.at_ms / 1e3)).await;
            system = turn.system_tokens;
        } else {
            tokio::time::sleep(Duration::from_secs_f64(turn.delay_ms / 1e3)).await;
        }
        history.extend(&turn.new_tokens);
        // A billing header left in: tokens of this request's own before everything else.
        let preamble: Vec<u32> = if preamble_kept {
            let mut state = ((session as u64) << 20 | k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xb111;
            (0..PREAMBLE_TOKENS)
                .map(|_| {
                    state = splitmix(state);
                    (state % 120_000) as u32 + 256
                })
                .collect()
        } else {
            Vec::new()
        };
        let prompt = [preamble.as_slice(), history.as_slice()].concat();
        let system = system + preamble.len();
        let mut regions = vec![(0..system, RegionKind::System)];
        regions.push((system..prompt.len(), RegionKind::Conversation));
        let prompt_len = prompt.len();
        // `cache_control` on the system prompt, as an agent marks it, when long enough to count.
        let mut leases = Vec::new();
        if policy.leased != Leased::No && system >= min_lease.max(1) {
            leases.push(LeaseRequest { tokens: system, ttl: LEASE_TTL });
        }
        if policy.leased == Leased::Conversation && prompt.len() >= min_lease.max(1) {
            leases.push(LeaseRequest { tokens: prompt.len(), ttl: LEASE_TTL });
        }
        let req = GenRequest {
            regions,
            leases,
            seed: (session as u64) << 20 | k as u64,
            ..GenRequest::greedy(prompt, turn.output_length)
        };
        let submitted_at = Instant::now();
        let submitted = match scheduler
            .call(|reply| SchedulerMsg::Submit { req: Box::new(req), session: Some(id.clone()), hints, reply }, None)
            .await?
        {
            CallResult::Success(Ok(s)) => s,
            CallResult::Success(Err(e)) => bail!("request refused: {e}"),
            _ => bail!("the scheduler did not answer"),
        };
        let mut events = submitted.events;
        let mut sample = Sample { prompt: prompt_len, high: high_priority(session), system, ..Sample::default() };
        while let Some(event) = events.recv().await {
            match event {
                JobEvent::Event(WorkerEvent::Prefilled { hit_tokens, .. }) => {
                    sample.ttft = submitted_at.elapsed();
                    sample.hit = hit_tokens;
                }
                JobEvent::Event(WorkerEvent::Token(t)) => {
                    history.push(t);
                    sample.output += 1;
                }
                JobEvent::Event(WorkerEvent::Computed { .. }) => {}
                JobEvent::Done(_) => break,
                JobEvent::Failed(e) => bail!("request failed: {e}"),
            }
        }
        sample.done_at = start.elapsed();
        if preamble_kept {
            // Each sequence starts with tokens of its own: a chain of its own.
            let sequence = [preamble.as_slice(), history.as_slice()].concat();
            let chain: Rc<[BlockHash]> = hasher.hash_sequence(&sequence).into();
            prompts.push((submitted_at, sample.prompt, chain.clone(), chain.len()));
        } else {
            sequences.push((submitted_at, sample.prompt, history.len() / bound.block_tokens));
        }
        samples.push(sample);
        progress.tick();
    }
    if !sequences.is_empty() {
        let chain: Rc<[BlockHash]> = hasher.hash_sequence(&history).into();
        prompts.extend(sequences.into_iter().map(|(at, prompt, blocks)| (at, prompt, chain.clone(), blocks)));
    }
    Ok((samples, prompts))
}

/// Tokens of a kept billing header (`x-anthropic-billing-header: cc_version=…; cch=…;`, 74
/// characters).
const PREAMBLE_TOKENS: usize = 20;

fn gb(bytes: u64) -> f64 {
    bytes as f64 / 1e9
}

fn render(trace: &Trace, args: &ReplayArgs, outcomes: &[Outcome]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "replay of {} ({} sessions, {} requests) on {} node(s) × {} simulated H200 workers, {} ({}-token blocks), G1 {}/worker, G2 {}/node, G3 {}/node",
        trace.name,
        trace.sessions.len(),
        trace.requests,
        args.nodes,
        args.workers,
        args.model,
        args.block_tokens,
        args.g1,
        args.g2,
        args.g3
    );
    let _ = writeln!(
        out,
        "\n| policy | capacity | hit rate | G1 | G2 | G3 | G4 | TTFT p50 ms | p90 ms | p99 ms | queue ms (mean) | preempted | req/s (virtual) | G2→G1 GB | G3→G1 GB | G1→G2 GB | G2→G3 GB | G1 evictions (sys/conv/gen) | G3 lag ms mean/max | wall s | sim req/s |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for o in outcomes {
        let ev = |r: RegionKind| o.evictions[0].get(&r).copied().unwrap_or(0);
        let _ = writeln!(
            out,
            "| {} | {} | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {:.1} | {:.1} | {:.1} | {:.1} | {} | {:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {}/{}/{} | {:.1}/{:.1} | {:.1} | {:.0} |",
            o.policy.name(),
            o.capacity.as_ref().map_or_else(|| "-".to_string(), |(t, s)| format!("{t}={s}")),
            o.hit_rate(None) * 100.0,
            o.hit_rate(Some(0)) * 100.0,
            o.hit_rate(Some(1)) * 100.0,
            o.hit_rate(Some(2)) * 100.0,
            o.hit_rate(Some(3)) * 100.0,
            o.percentile_ms(0.5),
            o.percentile_ms(0.9),
            o.percentile_ms(0.99),
            o.queue_ms,
            o.preempted,
            o.samples.len() as f64 / o.virtual_time.as_secs_f64().max(1e-9),
            gb(o.bytes[0]),
            gb(o.bytes[1]),
            gb(o.bytes[2]),
            gb(o.bytes[3]),
            ev(RegionKind::System),
            ev(RegionKind::Conversation),
            ev(RegionKind::Generated),
            o.lag_ms.0,
            o.lag_ms.1,
            o.wall.as_secs_f64(),
            o.samples.len() as f64 / o.wall.as_secs_f64().max(1e-9),
        );
    }
    if let Some(first) = outcomes.first() {
        let _ = writeln!(out, "\ninfinite-cache hit-rate bound: {:.1}%", first.bound_hit_rate * 100.0);
    }
    for line in comparisons(outcomes) {
        let _ = writeln!(out, "{line}");
    }
    out
}

fn find(outcomes: &[Outcome], p: Policy) -> Option<&Outcome> {
    outcomes.iter().find(|o| o.policy == p && o.capacity.is_none())
}

/// The comparisons the replay exists for, as lines.
fn comparisons(outcomes: &[Outcome]) -> Vec<String> {
    let mut lines = Vec::new();
    let best = find(outcomes, Policy::BEST);
    if let (Some(best), Some(base)) = (best, find(outcomes, Policy::BASELINE)) {
        lines.push(format!(
            "p50 TTFT baseline ({}) / best ({}): {:.2}x ({:.1} ms vs {:.1} ms); hit rate {:.1}% vs {:.1}%",
            base.policy.name(),
            best.policy.name(),
            base.percentile_ms(0.5) / best.percentile_ms(0.5).max(1e-9),
            base.percentile_ms(0.5),
            best.percentile_ms(0.5),
            base.hit_rate(None) * 100.0,
            best.hit_rate(None) * 100.0
        ));
    }
    if let (Some(best), Some(rr)) =
        (best, find(outcomes, Policy { routing: RoutingPolicy::RoundRobin, ..Policy::BEST }))
    {
        lines.push(format!(
            "p50 TTFT round_robin / kv_aware (both retention + G2+G3 write-through): {:.2}x ({:.1} ms vs {:.1} ms)",
            rr.percentile_ms(0.5) / best.percentile_ms(0.5).max(1e-9),
            rr.percentile_ms(0.5),
            best.percentile_ms(0.5)
        ));
    }
    if let (Some(best), Some(lru)) = (best, find(outcomes, Policy { eviction: Eviction::PlainLru, ..Policy::BEST })) {
        lines.push(format!(
            "retention-aware vs plain LRU at equal capacity: {:+.1} points of hit rate ({:.1}% vs {:.1}%), p50 TTFT {:.1} vs {:.1} ms",
            (best.hit_rate(None) - lru.hit_rate(None)) * 100.0,
            best.hit_rate(None) * 100.0,
            lru.hit_rate(None) * 100.0,
            best.percentile_ms(0.5),
            lru.percentile_ms(0.5)
        ));
    }
    if let (Some(best), Some(kept)) = (best, find(outcomes, Policy { preamble_kept: true, ..Policy::BEST })) {
        lines.push(format!(
            "p50 TTFT billing header kept / stripped: {:.2}x ({:.1} ms vs {:.1} ms; hit rate {:.1}% vs {:.1}%; \
             NVIDIA Dynamo reports 912 -> 169 ms, 5.4x)",
            kept.percentile_ms(0.5) / best.percentile_ms(0.5).max(1e-9),
            kept.percentile_ms(0.5),
            best.percentile_ms(0.5),
            kept.hit_rate(None) * 100.0,
            best.hit_rate(None) * 100.0
        ));
    }
    if let (Some(ignored), Some(honoured)) = (best, find(outcomes, Policy { priorities: true, ..Policy::BEST })) {
        let class = |o: &Outcome, high: bool, q: f64| {
            let mut v: Vec<f64> =
                o.samples.iter().filter(|s| s.high == high).map(|s| s.ttft.as_secs_f64() * 1e3).collect();
            v.sort_by(f64::total_cmp);
            v.get(((v.len().max(1) - 1) as f64 * q).round() as usize).copied().unwrap_or(0.0)
        };
        let lower = |q: f64| 1.0 - class(honoured, true, q) / class(ignored, true, q).max(1e-9);
        lines.push(format!(
            "priority (a fifth of the sessions at nvext.priority {HIGH_PRIORITY}), honoured vs ignored: high class p50 \
             {:.1} vs {:.1} ms ({:.0}% lower), p90 {:.1} vs {:.1} ms ({:.0}% lower); the rest p50 {:.2}x, p90 {:.2}x \
             (NVIDIA's NeMo Agent Toolkit router: up to 63% lower)",
            class(honoured, true, 0.5),
            class(ignored, true, 0.5),
            lower(0.5) * 100.0,
            class(honoured, true, 0.9),
            class(ignored, true, 0.9),
            lower(0.9) * 100.0,
            class(honoured, false, 0.5) / class(ignored, false, 0.5).max(1e-9),
            class(honoured, false, 0.9) / class(ignored, false, 0.9).max(1e-9),
        ));
    }
    for (what, leased) in
        [("the system prompts", Leased::System), ("the system prompts and the last message", Leased::Conversation)]
    {
        let (Some(plain), Some(leased)) = (best, find(outcomes, Policy { leased, ..Policy::BEST })) else { continue };
        lines.push(format!(
            "cache_control on {what} ({} min leases) vs none: system-region hit rate {:.1}% vs {:.1}%, \
             p50 TTFT {:.1} vs {:.1} ms ({:.2}x), p90 {:.1} vs {:.1} ms; overall hit rate {:.1}% vs {:.1}%",
            LEASE_TTL.as_secs() / 60,
            leased.system_hit_rate() * 100.0,
            plain.system_hit_rate() * 100.0,
            leased.percentile_ms(0.5),
            plain.percentile_ms(0.5),
            leased.percentile_ms(0.5) / plain.percentile_ms(0.5).max(1e-9),
            leased.percentile_ms(0.9),
            plain.percentile_ms(0.9),
            leased.hit_rate(None) * 100.0,
            plain.hit_rate(None) * 100.0,
        ));
    }
    if let Some(best) = best.filter(|b| !b.decisions_s.is_empty()) {
        lines.push(format!(
            "router decision of {} (wall time): p50 {:.1} µs, p99 {:.1} µs, max {:.1} µs over {} decisions",
            best.policy.name(),
            best.decision_us(0.5),
            best.decision_us(0.99),
            best.decision_us(1.0),
            best.decisions_s.len()
        ));
    }
    if let Some(best) = best {
        lines.push(format!(
            "best configuration vs the infinite-cache bound: {:.1}% vs {:.1}% ({:.1} points)",
            best.hit_rate(None) * 100.0,
            best.bound_hit_rate * 100.0,
            (best.bound_hit_rate - best.hit_rate(None)) * 100.0
        ));
    }
    lines
}

fn report_json(trace: &Trace, args: &ReplayArgs, outcomes: &[Outcome]) -> serde_json::Value {
    serde_json::json!({
        "trace": trace.name,
        "sessions": trace.sessions.len(),
        "requests": trace.requests,
        "workers": args.workers,
        "model": args.model,
        "block_tokens": args.block_tokens,
        "capacity_bytes": {"g1_per_worker": args.g1.0, "g2": args.g2.0, "g3": args.g3.0},
        "bound_hit_rate": outcomes.first().map_or(0.0, |o| o.bound_hit_rate),
        "policies": outcomes.iter().map(Outcome::json).collect::<Vec<_>>(),
        "comparisons": comparisons(outcomes),
        "timeline": outcomes.first().map(|o| serde_json::json!(o.timeline)),
    })
}

mod plots {
    //! SVG plots of a replay, drawn with `plotters`.

    use std::path::Path;

    use anyhow::Context;
    use plotters::prelude::*;

    use super::Outcome;

    const COLORS: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];

    fn err(e: impl std::fmt::Display) -> anyhow::Error {
        anyhow::anyhow!("drawing: {e}")
    }

    /// `ttft_cdf.svg`, `occupancy.svg`, and with a sweep `hit_rate_by_capacity.svg`.
    pub(super) fn draw(dir: &Path, outcomes: &[Outcome], sweep: bool) -> anyhow::Result<()> {
        ttft_cdf(&dir.join("ttft_cdf.svg"), outcomes).context("ttft_cdf.svg")?;
        if let Some(first) = outcomes.first() {
            occupancy(&dir.join("occupancy.svg"), first).context("occupancy.svg")?;
        }
        if sweep {
            by_capacity(&dir.join("hit_rate_by_capacity.svg"), outcomes).context("hit_rate_by_capacity.svg")?;
        }
        Ok(())
    }

    fn ttft_cdf(path: &Path, outcomes: &[Outcome]) -> anyhow::Result<()> {
        let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let max = outcomes.iter().flat_map(|o| o.ttfts_ms().last().copied()).fold(1.0f64, f64::max);
        let mut chart = ChartBuilder::on(&root)
            .caption("TTFT CDF per policy", ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d((1.0f64..max * 1.1).log_scale(), 0.0f64..1.0)
            .map_err(err)?;
        chart.configure_mesh().x_desc("TTFT (ms, log)").y_desc("fraction of requests").draw().map_err(err)?;
        for (i, o) in outcomes.iter().enumerate() {
            let v = o.ttfts_ms();
            let n = v.len().max(1) as f64;
            let color = COLORS[i % COLORS.len()];
            let label = match &o.capacity {
                Some((tier, size)) => format!("{} {tier}={size}", o.policy.name()),
                None => o.policy.name(),
            };
            chart
                .draw_series(LineSeries::new(
                    v.iter().enumerate().map(|(k, &ms)| (ms.max(1.0), (k + 1) as f64 / n)),
                    color.stroke_width(2),
                ))
                .map_err(err)?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        }
        chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw().map_err(err)?;
        root.present().map_err(err)?;
        Ok(())
    }

    fn occupancy(path: &Path, o: &Outcome) -> anyhow::Result<()> {
        let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let end = o.timeline.last().map_or(1.0, |s| s.at_s).max(1.0);
        let top = o.timeline.iter().map(|s| (s.g1.max(0) as usize).max(s.g2).max(s.g3)).max().unwrap_or(1).max(1);
        let mut chart = ChartBuilder::on(&root)
            .caption(format!("Tier occupancy over time ({})", o.policy.name()), ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0f64..end, 0usize..top + top / 10)
            .map_err(err)?;
        chart.configure_mesh().x_desc("virtual time (s)").y_desc("blocks resident").draw().map_err(err)?;
        type Column = fn(&super::Occupancy) -> usize;
        let series: [(&str, Column); 3] =
            [("G1 (all workers)", |s| s.g1.max(0) as usize), ("G2", |s| s.g2), ("G3", |s| s.g3)];
        for (i, (name, f)) in series.iter().enumerate() {
            let color = COLORS[i];
            chart
                .draw_series(LineSeries::new(o.timeline.iter().map(|s| (s.at_s, f(s))), color.stroke_width(2)))
                .map_err(err)?
                .label(*name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        }
        chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw().map_err(err)?;
        root.present().map_err(err)?;
        Ok(())
    }

    fn by_capacity(path: &Path, outcomes: &[Outcome]) -> anyhow::Result<()> {
        let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let points: Vec<(f64, f64)> = outcomes
            .iter()
            .filter_map(|o| {
                o.capacity.as_ref().map(|(_, s)| (s.0 as f64 / (1u64 << 30) as f64, o.hit_rate(None) * 100.0))
            })
            .collect();
        let tier = outcomes.iter().find_map(|o| o.capacity.as_ref().map(|(t, _)| t.clone())).unwrap_or_default();
        let max_x = points.iter().map(|p| p.0).fold(1.0f64, f64::max);
        let mut chart = ChartBuilder::on(&root)
            .caption(format!("Hit rate by {tier} capacity"), ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0f64..max_x * 1.1, 0.0f64..100.0)
            .map_err(err)?;
        chart.configure_mesh().x_desc(format!("{tier} capacity (GiB)")).y_desc("hit rate (%)").draw().map_err(err)?;
        chart.draw_series(LineSeries::new(points.iter().copied(), COLORS[0].stroke_width(2))).map_err(err)?;
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, COLORS[0].filled()))).map_err(err)?;
        root.present().map_err(err)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A simulated replay of `trace` on one node of 4 workers with large tiers, comparing routing.
    fn args(trace: PathBuf) -> ReplayArgs {
        ReplayArgs {
            trace,
            format: None,
            workers: 4,
            nodes: 1,
            model: "llama-8b".into(),
            block_tokens: 64,
            g1: ByteSize(80 << 30),
            g2: ByteSize(1 << 40),
            g3: ByteSize(0),
            compare: vec![Axis::Routing],
            sweep: None,
            limit: None,
            load: vec![1.0],
            load_of: LoadOf::Trace,
            calibration: None,
            engine: ReplayEngine::Simulated,
            config: None,
            decode_ms: None,
            json: None,
            plots: None,
        }
    }

    #[test]
    fn trace_tokens_are_a_function_of_the_hash_ids() {
        assert_eq!(tokens_of(&[1, 2], 1024), tokens_of(&[1, 2], 1024));
        assert_eq!(tokens_of(&[1, 2], 700).len(), 700);
        assert_eq!(tokens_of(&[1, 2], 1024)[..512], tokens_of(&[1, 3], 1024)[..512]);
        assert_ne!(tokens_of(&[1], 512), tokens_of(&[2], 512));
    }

    /// `--compare preamble`: with the billing header kept, every request starts with tokens of
    /// its own and reuses nothing; stripped, later turns read their prefix.
    #[test]
    fn a_kept_preamble_reuses_no_prefix() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        let mut lines = String::new();
        for s in 0..4u64 {
            let first: Vec<u64> = (0..8).collect();
            lines.push_str(&format!(
                "{{\"session_id\":\"s{s}\",\"timestamp\":{},\"input_length\":{},\"output_length\":20,\"hash_ids\":{first:?}}}\n",
                s * 10,
                first.len() * 512
            ));
            lines.push_str(&format!(
                "{{\"session_id\":\"s{s}\",\"input_length\":300,\"output_length\":20,\"hash_ids\":[{}],\"delay\":1000}}\n",
                1000 + s
            ));
        }
        std::fs::write(&path, lines).unwrap();
        let args = ReplayArgs { compare: vec![Axis::Preamble], ..args(path) };
        let (_, outcomes) = replay(&args).unwrap();
        let names: Vec<String> = outcomes.iter().map(|o| o.policy.name()).collect();
        assert_eq!(names[..2], ["kv_aware+retention+wt-g2g3", "kv_aware+retention+wt-g2g3+preamble-kept"]);
        let (stripped, kept) = (&outcomes[0], &outcomes[1]);
        assert!(stripped.hit_rate(None) > 0.25, "{}", stripped.hit_rate(None));
        assert_eq!(kept.hit_rate(None), 0.0);
        assert!(kept.samples.iter().zip(&stripped.samples).all(|(k, s)| k.prompt == s.prompt + PREAMBLE_TOKENS));
        assert!(comparisons(&outcomes).iter().any(|l| l.starts_with("p50 TTFT billing header kept / stripped")));
    }

    #[test]
    fn a_small_agentic_trace_replays_and_kv_aware_routing_hits_more() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        let mut lines = String::new();
        for s in 0..6u64 {
            let first: Vec<u64> = (0..8).chain((100 * (s + 1))..(100 * (s + 1) + 4)).collect();
            lines.push_str(&format!(
                "{{\"session_id\":\"s{s}\",\"timestamp\":{},\"input_length\":{},\"output_length\":40,\"hash_ids\":{first:?}}}\n",
                s * 10,
                first.len() * 512
            ));
            for t in 0..3u64 {
                let id = 10_000 + s * 10 + t;
                lines.push_str(&format!(
                    "{{\"session_id\":\"s{s}\",\"input_length\":300,\"output_length\":30,\"hash_ids\":[{id}],\"delay\":1500}}\n"
                ));
            }
        }
        std::fs::write(&path, lines).unwrap();
        let args =
            ReplayArgs { json: Some(dir.path().join("out.json")), plots: Some(dir.path().join("plots")), ..args(path) };
        let trace = load_trace(&args.trace, None, None).unwrap();
        assert_eq!((trace.sessions.len(), trace.requests), (6, 24));
        let report = run(&args).unwrap();
        assert!(report.contains("| kv_aware+retention+wt-g2g3 |"), "{report}");
        assert!(report.contains("p50 TTFT round_robin / kv_aware"), "{report}");
        let (trace, outcomes) = replay(&args).unwrap();
        assert_eq!(trace.requests, 24);
        let names: Vec<String> = outcomes.iter().map(|o| o.policy.name()).collect();
        assert_eq!(
            names,
            [
                "kv_aware+retention+wt-g2g3",
                "round_robin+retention+wt-g2g3",
                "random+retention+wt-g2g3",
                "round_robin+lru+no-wt"
            ]
        );
        let (kv, rr) = (&outcomes[0], &outcomes[1]);
        assert_eq!((kv.samples.len(), rr.samples.len()), (24, 24));
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join("out.json")).unwrap()).unwrap();
        assert_eq!(json["policies"].as_array().map(Vec::len), Some(4));
        assert!(json["policies"][0]["ttft_ms"]["p50"].as_f64().unwrap() > 0.0);
        assert!(json["bound_hit_rate"].as_f64().unwrap() > 0.5);
        for plot in ["ttft_cdf.svg", "occupancy.svg"] {
            let svg = std::fs::read_to_string(dir.path().join("plots").join(plot)).unwrap();
            assert!(svg.starts_with("<svg") && svg.contains("<polyline"), "{plot}: {}", &svg[..svg.len().min(200)]);
        }
        // Later turns find their session's history: in G1 of the same worker with KV-aware
        // routing, over the link from G2 otherwise (loads this small hide behind the step they
        // join, so the first token comes no later).
        assert!(kv.hit_rate(Some(0)) > rr.hit_rate(Some(0)), "{report}");
        assert!(kv.percentile_ms(0.5) <= rr.percentile_ms(0.5), "{report}");
        assert!(kv.hit_rate(None) <= kv.bound_hit_rate + 1e-9, "never above the infinite cache: {report}");
    }

    #[test]
    fn under_a_burst_past_the_cache_kv_aware_hits_no_less_and_preempts_no_more_than_random() {
        // 24 sessions open at once over a shared system prompt, each growing by 1,024 tokens a
        // turn every 2 s, on 2 workers whose G1 (and the node's G2) hold the contexts of a few:
        // served all at once they evict each other's before every next turn.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("burst.jsonl");
        let mut lines = String::new();
        for s in 0..24u64 {
            let first: Vec<u64> = (0..4).chain((1000 * (s + 1))..(1000 * (s + 1) + 4)).collect();
            lines.push_str(&format!(
                "{{\"session_id\":\"s{s}\",\"timestamp\":0,\"input_length\":{},\"output_length\":64,\"hash_ids\":{first:?}}}\n",
                first.len() * 512
            ));
            for t in 0..6u64 {
                let id = 1000 * (s + 1) + 10 + 2 * t;
                lines.push_str(&format!(
                    "{{\"session_id\":\"s{s}\",\"input_length\":1024,\"output_length\":64,\"hash_ids\":[{id},{}],\"delay\":2000}}\n",
                    id + 1
                ));
            }
        }
        std::fs::write(&path, lines).unwrap();
        let args = ReplayArgs { workers: 2, g1: ByteSize(2 << 30), g2: ByteSize(4 << 30), ..args(path) };
        let (trace, outcomes) = replay(&args).unwrap();
        assert_eq!(trace.requests, 24 * 7);
        let by = |name: &str| outcomes.iter().find(|o| o.policy.name() == name).expect(name);
        let kv = by("kv_aware+retention+wt-g2g3");
        let random = by("random+retention+wt-g2g3");
        assert_eq!(kv.samples.len(), 24 * 7, "every request answered");
        assert!(
            kv.hit_rate(None) >= random.hit_rate(None),
            "hit rate: kv_aware {:.3} vs random {:.3}",
            kv.hit_rate(None),
            random.hit_rate(None)
        );
        assert!(
            kv.preempted <= random.preempted,
            "preempted: kv_aware {} vs random {}",
            kv.preempted,
            random.preempted
        );
    }

    #[test]
    fn late_binding_serves_a_short_request_before_a_burst_queued_ahead_of_it() {
        // 32 sessions open at once with 12,288-token prompts on 2 workers (seconds of prefill
        // queued on each); a 512-token request comes 100 ms later. Routed at once, it joins a
        // worker's queue behind the burst; held at the router, it goes as soon as a worker has
        // no more than `router.late_binding` (1 s) of prefill ahead, before the long prompts
        // still held.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("burst.jsonl");
        let mut lines = String::new();
        for s in 0..32u64 {
            let ids: Vec<u64> = (1000 * (s + 1)..1000 * (s + 1) + 24).collect();
            lines.push_str(&format!(
                "{{\"session_id\":\"long{s}\",\"timestamp\":0,\"input_length\":{},\"output_length\":16,\"hash_ids\":{ids:?}}}\n",
                ids.len() * 512
            ));
        }
        lines.push_str(
            "{\"session_id\":\"short\",\"timestamp\":100,\"input_length\":512,\"output_length\":16,\"hash_ids\":[99999]}\n",
        );
        std::fs::write(&path, lines).unwrap();
        let config = dir.path().join("off.toml");
        std::fs::write(&config, "[router]\nlate_binding = \"0s\"\n").unwrap();
        let short_ttft = |config: Option<PathBuf>| {
            let args = ReplayArgs { workers: 2, compare: Vec::new(), config, ..args(path.clone()) };
            let (_, outcomes) = replay(&args).unwrap();
            let kv = &outcomes[0];
            assert_eq!(kv.samples.len(), 33, "every request answered");
            let short = kv.samples.iter().find(|s| s.prompt == 512).expect("the short request");
            let longest = kv.samples.iter().map(|s| s.ttft).max().unwrap();
            (short.ttft, longest)
        };
        let (held, held_longest) = short_ttft(None);
        let (queued, queued_longest) = short_ttft(Some(config));
        assert!(queued > Duration::from_secs(4), "routed at once it waits behind the burst: {queued:?}");
        assert!(held * 3 < queued, "held: {held:?}, routed at once: {queued:?}");
        // The burst itself is served no later for it (the same work, reordered).
        assert!(
            held_longest.as_secs_f64() <= queued_longest.as_secs_f64() * 1.1,
            "slowest: {held_longest:?} held vs {queued_longest:?}"
        );
    }

    #[test]
    fn sessions_open_as_a_poisson_process_at_the_asked_rate() {
        let turn = || Turn { system_tokens: 0, at_ms: 77.0, delay_ms: 5.0, new_tokens: vec![1], output_length: 1 };
        let mut trace =
            Trace { name: "t".into(), sessions: (0..4000).map(|_| vec![turn(), turn()]).collect(), requests: 8000 };
        open_sessions(&mut trace, 4.0);
        let starts: Vec<f64> = trace.sessions.iter().map(|s| s[0].at_ms).collect();
        assert_eq!(starts[0], 0.0);
        assert!(starts.windows(2).all(|w| w[0] < w[1]), "in order, never two at once");
        let mean_gap = starts[3999] / 3999.0;
        assert!((mean_gap - 250.0).abs() < 15.0, "4 sessions/s: 250 ms apart on average, got {mean_gap}");
        let short = starts.windows(2).filter(|w| w[1] - w[0] < 250.0).count() as f64 / 3999.0;
        assert!((short - (1.0 - (-1.0f64).exp())).abs() < 0.03, "exponential gaps: {short}");
        assert!(trace.sessions.iter().all(|s| s[1].at_ms == 77.0 && s[1].delay_ms == 5.0), "think times stay");
    }

    #[test]
    fn a_load_sweep_scales_arrivals_and_tabulates_every_rate() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        let mut lines = String::new();
        for s in 0..4u64 {
            let first: Vec<u64> = (0..6).chain((100 * (s + 1))..(100 * (s + 1) + 2)).collect();
            lines.push_str(&format!(
                "{{\"session_id\":\"s{s}\",\"timestamp\":{},\"input_length\":{},\"output_length\":20,\"hash_ids\":{first:?}}}\n",
                s * 4000,
                first.len() * 512
            ));
            lines.push_str(&format!(
                "{{\"session_id\":\"s{s}\",\"input_length\":200,\"output_length\":20,\"hash_ids\":[{}],\"delay\":8000}}\n",
                9000 + s
            ));
        }
        std::fs::write(&path, lines).unwrap();
        let slow = ReplayArgs { load: vec![0.5], compare: vec![], ..args(path.clone()) };
        let fast = ReplayArgs { load: vec![4.0], ..slow.clone() };
        let (_, slow) = replay(&slow).unwrap();
        let (_, fast) = replay(&fast).unwrap();
        // 8 s of think time and 12 s of arrivals: at 8× the rate the trace is over far sooner.
        assert!(
            fast[0].virtual_time * 3 < slow[0].virtual_time,
            "{:?} vs {:?}",
            fast[0].virtual_time,
            slow[0].virtual_time
        );

        let sweep = ReplayArgs { load: vec![0.5, 2.0], json: Some(dir.path().join("sweep.json")), ..args(path) };
        let report = run(&sweep).unwrap();
        for row in ["0.5×  kv_aware", "0.5×  round_robin", "0.5×  random", "0.5×  baseline", "2×  kv_aware"] {
            assert!(report.contains(row), "no `{row}` row:\n{report}");
        }
        assert!(report.contains("baseline p50 ÷ KV-aware p50"), "{report}");
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join("sweep.json")).unwrap()).unwrap();
        assert_eq!(json.as_array().map(Vec::len), Some(2), "one report per rate");
        assert_eq!(json[1]["load"], 2.0);
        // Of what the workers sustain: a saturating run measures the rate first, once.
        let capacity = ReplayArgs { load_of: LoadOf::Capacity, json: None, compare: vec![], ..sweep.clone() };
        let report = run(&capacity).unwrap();
        let line = report.lines().find(|l| l.starts_with("load is of what the workers sustain")).expect("the rate");
        let rate: f64 = line.split(": ").nth(1).and_then(|r| r.split(' ').next()).unwrap().parse().unwrap();
        assert!(rate.is_finite() && rate > 0.0, "{line}");
        let bad = ReplayArgs { load: vec![0.0], ..sweep.clone() };
        assert!(replay(&bad).is_err(), "a rate of 0 is refused");

        // The priority axis: the same trace with a fifth of the sessions' hints honoured.
        let priority = ReplayArgs { load: vec![1.0], json: None, compare: vec![Axis::Priority], ..sweep };
        let (_, outcomes) = replay(&priority).unwrap();
        let names: Vec<String> = outcomes.iter().map(|o| o.policy.name()).collect();
        assert_eq!(names[1], "kv_aware+retention+wt-g2g3+priorities", "{names:?}");
        assert_eq!(outcomes[1].samples.iter().filter(|s| s.high).count(), 2, "session 0 of 4, both its turns");
        let lines = comparisons(&outcomes);
        assert!(lines.iter().any(|l| l.starts_with("priority (a fifth")), "{lines:?}");
    }

    #[test]
    fn the_reference_engine_replays_a_small_trace_in_real_time_on_the_real_node() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        let mut lines = String::new();
        for s in 0..2u64 {
            lines.push_str(&format!(
                "{{\"session_id\":\"s{s}\",\"timestamp\":0,\"input_length\":700,\"output_length\":4,\"hash_ids\":[1,{}]}}\n",
                10 + s
            ));
            lines.push_str(&format!(
                "{{\"session_id\":\"s{s}\",\"input_length\":100,\"output_length\":4,\"hash_ids\":[{}],\"delay\":10}}\n",
                20 + s
            ));
        }
        std::fs::write(&path, lines).unwrap();
        let args =
            ReplayArgs { workers: 2, block_tokens: 32, compare: vec![], engine: ReplayEngine::Reference, ..args(path) };
        let (_, outcomes) = replay(&args).unwrap();
        assert_eq!(outcomes.len(), 1, "only the best configuration");
        let o = &outcomes[0];
        assert_eq!(o.samples.len(), 4);
        assert!(o.samples.iter().all(|s| s.ttft > Duration::ZERO && s.output > 0));
        // Each session's second turn finds its first turn's blocks; the two sessions share block 1.
        assert!(o.hit_rate(None) > 0.3, "{:?}", o.samples);
    }

    #[test]
    fn two_nodes_load_each_others_g2_over_g4() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        let mut lines = String::new();
        for s in 0..3u64 {
            let first: Vec<u64> = (100 * (s + 1)..100 * (s + 1) + 6).collect();
            lines.push_str(&format!(
                "{{\"session_id\":\"s{s}\",\"timestamp\":0,\"input_length\":{},\"output_length\":20,\"hash_ids\":{first:?}}}\n",
                first.len() * 512
            ));
            for t in 0..3u64 {
                lines.push_str(&format!(
                    "{{\"session_id\":\"s{s}\",\"input_length\":200,\"output_length\":20,\"hash_ids\":[{}],\"delay\":500}}\n",
                    10_000 + s * 10 + t
                ));
            }
        }
        std::fs::write(&path, lines).unwrap();
        let args = ReplayArgs { workers: 2, nodes: 2, ..args(path) };
        let (_, outcomes) = replay(&args).unwrap();
        let rr = outcomes.iter().find(|o| o.policy.routing == RoutingPolicy::RoundRobin).unwrap();
        // Three sessions over four workers: round-robin moves each session between workers.
        assert_eq!(rr.samples.len(), 12);
        let hits: Vec<[usize; 4]> = rr.samples.iter().map(|s| s.hit).collect();
        assert!(
            rr.hit_rate(Some(3)) > 0.0,
            "round-robin over two nodes loads some turns from the other node's G2: {hits:?}"
        );
        assert!(rr.bytes[4] > 0);
        let kv = &outcomes[0];
        assert!(kv.hit_rate(Some(0)) > rr.hit_rate(Some(0)), "KV-aware keeps sessions on their worker");
    }
}
