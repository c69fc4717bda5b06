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
use dynamo_config::{ByteSize, Calibration, PerTier, RegionKind, RetentionSection, RoutingPolicy, TierName};
use dynamo_tiering::block::{BlockHash, BlockHasher, Salt};
use dynamo_tiering::registry::PolicyKind;
use ractor::rpc::CallResult;
use serde::Deserialize;
use tokio::time::Instant;

use crate::serving::Serving;
use dynamo_actors::telemetry::names;

mod drive;
mod outcome;
mod report;
#[cfg(test)]
mod tests;
mod trace;

use drive::*;
use outcome::*;
use report::*;
use trace::*;

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
            self.routing.as_str(),
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
            let name =
                if o.policy == Policy::BASELINE { "baseline".to_owned() } else { o.policy.routing.as_str().to_owned() };
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

/// Tokens of a kept billing header (`x-anthropic-billing-header: cc_version=…; cch=…;`, 74
/// characters).
const PREAMBLE_TOKENS: usize = 20;
