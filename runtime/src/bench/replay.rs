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

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant as WallInstant};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use dynamo_actors::cost::CostModel;
use dynamo_actors::index::{IndexConfig, PrefixIndex};
use dynamo_actors::publisher::KvPublisher;
use dynamo_actors::scheduler::{KvRouting, SchedulerArgs, SchedulerMsg, SchedulerRef};
use dynamo_actors::supervisor::{NodeArgs, NodeMsg, NodeSupervisor};
use dynamo_actors::tiers::KvObserver;
use dynamo_actors::worker::simulated::{SimNode, SimTiming, SimulatedEngine, WriteThrough, splitmix};
use dynamo_actors::worker::{
    Engine, EngineFactory, EngineHost, GenRequest, JobEvent, WorkerArgs, WorkerEvent, local_spawner,
};
use dynamo_config::{ByteSize, Calibration, RegionKind, RetentionSection, RoutingPolicy};
use dynamo_kernels::sampling::Sampling;
use dynamo_tiering::block::{BlockHasher, Salt};
use dynamo_tiering::registry::PolicyKind;
use ractor::Actor;
use ractor::rpc::CallResult;
use serde::Deserialize;
use tokio::time::Instant;

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
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// The trace file (JSON lines).
    #[arg(long, value_name = "FILE")]
    pub trace: PathBuf,
    /// Its format; detected from the first line when absent.
    #[arg(long, value_enum)]
    pub format: Option<TraceFormat>,
    /// Simulated workers (one GPU each).
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
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
    /// Routing policies to compare, each a full run: `kv_aware`, `round_robin`, `random`.
    #[arg(long, value_delimiter = ',', default_value = "kv_aware,round_robin", value_parser = parse_policy)]
    pub routing: Vec<RoutingPolicy>,
    /// Replay only the first N requests (Mooncake) or sessions (aiperf).
    #[arg(long)]
    pub limit: Option<usize>,
    /// Seconds per generated token (default: weights read from HBM once per step, ~3.7 ms for
    /// llama-8b on an H200).
    #[arg(long)]
    pub decode_ms: Option<f64>,
}

fn parse_policy(s: &str) -> Result<RoutingPolicy, String> {
    match s {
        "kv_aware" | "kv-aware" => Ok(RoutingPolicy::KvAware),
        "round_robin" | "round-robin" => Ok(RoutingPolicy::RoundRobin),
        "random" => Ok(RoutingPolicy::Random),
        other => Err(format!("unknown routing policy `{other}` (kv_aware, round_robin, random)")),
    }
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
    let mut sessions: Vec<Vec<Turn>> = Vec::new();
    match format {
        TraceFormat::Mooncake => {
            for l in lines.iter().take(limit.unwrap_or(usize::MAX)) {
                let turn = Turn {
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
    prompt: usize,
    hit: [usize; 3],
}

/// One policy's results.
#[derive(Debug)]
struct Outcome {
    routing: RoutingPolicy,
    samples: Vec<Sample>,
    wall: Duration,
    virtual_time: Duration,
    bound_hit_rate: f64,
}

impl Outcome {
    fn percentile_ms(&self, p: f64) -> f64 {
        let mut v: Vec<f64> = self.samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
        v.sort_by(f64::total_cmp);
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
}

/// Runs the replay and returns the report.
pub fn run(args: &ReplayArgs) -> anyhow::Result<String> {
    let (trace, outcomes) = replay(args)?;
    Ok(render(&trace, args, &outcomes))
}

fn replay(args: &ReplayArgs) -> anyhow::Result<(Trace, Vec<Outcome>)> {
    let trace = load_trace(&args.trace, args.format, args.limit)?;
    let calibration = Calibration::h200();
    let prefill = calibration
        .prefill_for(&args.model)
        .with_context(|| format!("no prefill calibration for `{}` (llama-1b, llama-8b)", args.model))?
        .clone();
    let b = args.block_tokens.max(1);
    let block_bytes = prefill.kv_bytes_per_token * b as u64;
    // A decode step reads the weights once: bf16 parameters over HBM (d2d copy rate × 2).
    let params = if args.model == "llama-1b" { 1.24e9 } else { 8.03e9 };
    let decode_s = args.decode_ms.map_or(params * 2.0 / (calibration.link.d2d_copy_gb_s * 2e9), |ms| ms / 1e3);
    let timing = SimTiming {
        prefill,
        decode_s_per_token: decode_s,
        link_bytes_per_s: calibration.link.h2d_pinned_gb_s * 1e9,
        disk_read_bytes_per_s: calibration.disk.seq_read_gb_s * 1e9,
        disk_write_bytes_per_s: calibration.disk.seq_write_gb_s * 1e9,
        block_bytes,
    };
    let blocks = |size: ByteSize| (size.0 / block_bytes) as usize;
    let mut outcomes = Vec::new();
    for &routing in &args.routing {
        let setup = Setup {
            workers: args.workers.max(1),
            block_tokens: b,
            timing: timing.clone(),
            g1_blocks: blocks(args.g1),
            g2_blocks: blocks(args.g2),
            g3_blocks: blocks(args.g3),
            routing,
        };
        outcomes.push(replay_one(&trace, &setup)?);
    }
    Ok((trace, outcomes))
}

#[derive(Debug, Clone)]
struct Setup {
    workers: usize,
    block_tokens: usize,
    timing: SimTiming,
    g1_blocks: usize,
    g2_blocks: usize,
    g3_blocks: usize,
    routing: RoutingPolicy,
}

fn replay_one(trace: &Trace, setup: &Setup) -> anyhow::Result<Outcome> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build()?;
    let local = tokio::task::LocalSet::new();
    let wall = WallInstant::now();
    let (samples, virtual_time, bound) = local.block_on(&runtime, drive(trace, setup))?;
    Ok(Outcome { routing: setup.routing, samples, wall: wall.elapsed(), virtual_time, bound_hit_rate: bound })
}

async fn drive(trace: &Trace, setup: &Setup) -> anyhow::Result<(Vec<Sample>, Duration, f64)> {
    let (spawner, spawn_loop) = local_spawner();
    tokio::task::spawn_local(spawn_loop);
    let salt = Salt(0x7265_706c_6179);
    let index = Arc::new(PrefixIndex::new(IndexConfig { max_blocks: 64 << 20, ..IndexConfig::default() }));
    let publisher: Arc<dyn KvObserver> = Arc::new(KvPublisher::new(0, 1, index.clone()));
    let node = Arc::new(SimNode::new(
        setup.block_tokens,
        salt,
        RetentionSection::default(),
        setup.timing.clone(),
        WriteThrough::G2G3,
        setup.g2_blocks,
        setup.g3_blocks,
        PolicyKind::Lru,
        publisher,
    ));
    let epoch = Instant::now();
    let g1_blocks = setup.g1_blocks;
    let factory_node = node.clone();
    let factory: EngineFactory = Arc::new(move |id| {
        Ok(Box::new(SimulatedEngine::new(id, factory_node.clone(), g1_blocks, PolicyKind::Lru, epoch))
            as Box<dyn Engine>)
    });
    let t = &setup.timing;
    let cost = CostModel {
        block_tokens: setup.block_tokens,
        image_bytes: t.block_bytes as usize,
        prefill_tokens_per_s: 8192.0 / (t.prefill.prefill_ms(8192) / 1e3),
        decode_s_per_token: t.decode_s_per_token,
        // The simulated engine batches decodes alongside prefills.
        decode_weight: 0.0,
        g2_bytes_per_s: t.link_bytes_per_s,
        g3_bytes_per_s: 1.0 / (1.0 / t.disk_read_bytes_per_s + 1.0 / t.link_bytes_per_s),
    };
    let args = NodeArgs {
        workers: (0..setup.workers)
            .map(|id| WorkerArgs {
                id,
                factory: factory.clone(),
                queue_bound: 1 << 16,
                queue_policy: dynamo_config::QueuePolicy::Fcfs,
                host: EngineHost::Local(spawner.clone()),
            })
            .collect(),
        scheduler: SchedulerArgs {
            policy: setup.routing,
            session_idle_timeout: Duration::from_secs(600),
            seed: 42,
            kv: Some(KvRouting {
                index,
                node: 0,
                salt,
                block_tokens: setup.block_tokens,
                cost,
                tiers: None,
                sticky_bonus: Duration::from_millis(5),
                temperature: 0.0,
            }),
        },
        g2: None,
        g3: None,
    };
    let (root, join) = Actor::spawn(None, NodeSupervisor, args).await.context("starting the simulated node")?;
    let scheduler = match root.call(NodeMsg::Scheduler, None).await? {
        CallResult::Success(s) => s,
        _ => bail!("the supervisor did not answer"),
    };
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (s, turns) in trace.sessions.iter().enumerate() {
        let scheduler = scheduler.clone();
        let turns = turns.clone();
        tasks.spawn_local(run_session(s, turns, scheduler, start));
    }
    let mut samples = Vec::with_capacity(trace.requests);
    let mut prompts: Vec<(Instant, Vec<u32>)> = Vec::with_capacity(trace.requests);
    while let Some(done) = tasks.join_next().await {
        let (s, p) = done.context("a session task failed")??;
        samples.extend(s);
        prompts.extend(p);
    }
    let virtual_time = start.elapsed();
    let _ = root.call(NodeMsg::Shutdown, None).await;
    let _ = join.await;
    Ok((samples, virtual_time, bound_hit_rate(prompts, setup.block_tokens, salt)))
}

/// The hit rate of an infinite cache: every block ever computed stays, in arrival order.
fn bound_hit_rate(mut prompts: Vec<(Instant, Vec<u32>)>, b: usize, salt: Salt) -> f64 {
    prompts.sort_by_key(|(at, _)| *at);
    let mut seen = HashSet::new();
    let (mut hit, mut total) = (0usize, 0usize);
    let mut hasher = BlockHasher::new(salt, b);
    for (_, prompt) in prompts {
        let hashes = hasher.hash_sequence(&prompt);
        let cap = prompt.len().saturating_sub(1) / b;
        hit += hashes.iter().take(cap).take_while(|h| seen.contains(*h)).count() * b;
        total += prompt.len();
        seen.extend(hashes);
    }
    hit as f64 / total.max(1) as f64
}

type SessionResult = anyhow::Result<(Vec<Sample>, Vec<(Instant, Vec<u32>)>)>;

async fn run_session(session: usize, turns: Vec<Turn>, scheduler: SchedulerRef, start: Instant) -> SessionResult {
    let mut samples = Vec::with_capacity(turns.len());
    let mut prompts = Vec::with_capacity(turns.len());
    let mut history: Vec<u32> = Vec::new();
    let id = format!("session-{session}");
    for (k, turn) in turns.into_iter().enumerate() {
        if k == 0 {
            tokio::time::sleep_until(start + Duration::from_secs_f64(turn.at_ms / 1e3)).await;
        } else {
            tokio::time::sleep(Duration::from_secs_f64(turn.delay_ms / 1e3)).await;
        }
        history.extend(&turn.new_tokens);
        let req = GenRequest {
            prompt: history.clone(),
            regions: vec![(0..history.len(), RegionKind::Conversation)],
            max_tokens: turn.output_length,
            sampling: Sampling::Greedy,
            seed: (session as u64) << 20 | k as u64,
            stop_tokens: vec![],
            vocab_limit: 0,
        };
        let submitted_at = Instant::now();
        prompts.push((submitted_at, history.clone()));
        let submitted = match scheduler
            .call(
                |reply| SchedulerMsg::Submit { req, session: Some(id.clone()), hints: Default::default(), reply },
                None,
            )
            .await?
        {
            CallResult::Success(Ok(s)) => s,
            CallResult::Success(Err(e)) => bail!("request refused: {e}"),
            _ => bail!("the scheduler did not answer"),
        };
        let mut events = submitted.events;
        let mut sample = Sample { prompt: history.len(), ..Sample::default() };
        while let Some(event) = events.recv().await {
            match event {
                JobEvent::Event(WorkerEvent::Prefilled { hit_tokens, .. }) => {
                    sample.ttft = submitted_at.elapsed();
                    sample.hit = hit_tokens;
                }
                JobEvent::Event(WorkerEvent::Token(t)) => history.push(t),
                JobEvent::Done(_) => break,
                JobEvent::Failed(e) => bail!("request failed: {e}"),
            }
        }
        samples.push(sample);
    }
    Ok((samples, prompts))
}

fn render(trace: &Trace, args: &ReplayArgs, outcomes: &[Outcome]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "replay of {} ({} sessions, {} requests) on {} simulated H200 workers, {} ({}-token blocks), G1 {}/worker, G2 {}, G3 {}",
        trace.name,
        trace.sessions.len(),
        trace.requests,
        args.workers,
        args.model,
        args.block_tokens,
        args.g1,
        args.g2,
        args.g3
    );
    let _ = writeln!(
        out,
        "\n| routing | hit rate | G1 | G2 | G3 | TTFT p50 ms | p90 ms | p99 ms | virtual time s | wall s | sim req/s |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|");
    for o in outcomes {
        let _ = writeln!(
            out,
            "| {} | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {:.1} | {:.1} | {:.1} | {:.0} | {:.1} | {:.0} |",
            policy_name(o.routing),
            o.hit_rate(None) * 100.0,
            o.hit_rate(Some(0)) * 100.0,
            o.hit_rate(Some(1)) * 100.0,
            o.hit_rate(Some(2)) * 100.0,
            o.percentile_ms(0.5),
            o.percentile_ms(0.9),
            o.percentile_ms(0.99),
            o.virtual_time.as_secs_f64(),
            o.wall.as_secs_f64(),
            o.samples.len() as f64 / o.wall.as_secs_f64().max(1e-9),
        );
    }
    if let Some(first) = outcomes.first() {
        let _ = writeln!(out, "\ninfinite-cache hit-rate bound: {:.1}%", first.bound_hit_rate * 100.0);
    }
    let kv = outcomes.iter().find(|o| o.routing == RoutingPolicy::KvAware);
    let rr = outcomes.iter().find(|o| o.routing == RoutingPolicy::RoundRobin);
    if let (Some(kv), Some(rr)) = (kv, rr) {
        let _ = writeln!(
            out,
            "p50 TTFT round_robin / kv_aware: {:.2}x ({:.1} ms vs {:.1} ms)",
            rr.percentile_ms(0.5) / kv.percentile_ms(0.5).max(1e-9),
            rr.percentile_ms(0.5),
            kv.percentile_ms(0.5)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_tokens_are_a_function_of_the_hash_ids() {
        assert_eq!(tokens_of(&[1, 2], 1024), tokens_of(&[1, 2], 1024));
        assert_eq!(tokens_of(&[1, 2], 700).len(), 700);
        assert_eq!(tokens_of(&[1, 2], 1024)[..512], tokens_of(&[1, 3], 1024)[..512]);
        assert_ne!(tokens_of(&[1], 512), tokens_of(&[2], 512));
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
        let args = ReplayArgs {
            trace: path,
            format: None,
            workers: 4,
            model: "llama-8b".into(),
            block_tokens: 64,
            g1: ByteSize(80 << 30),
            g2: ByteSize(1 << 40),
            g3: ByteSize(0),
            routing: vec![RoutingPolicy::KvAware, RoutingPolicy::RoundRobin],
            limit: None,
            decode_ms: None,
        };
        let trace = load_trace(&args.trace, None, None).unwrap();
        assert_eq!((trace.sessions.len(), trace.requests), (6, 24));
        let (trace, outcomes) = replay(&args).unwrap();
        let report = render(&trace, &args, &outcomes);
        assert!(report.contains("| kv_aware |") && report.contains("| round_robin |"), "{report}");
        assert!(report.contains("p50 TTFT round_robin / kv_aware"), "{report}");
        let (kv, rr) = (&outcomes[0], &outcomes[1]);
        assert_eq!((kv.samples.len(), rr.samples.len()), (24, 24));
        // Later turns find their session's history: in G1 of the same worker with KV-aware
        // routing, over the link from G2 otherwise.
        assert!(kv.hit_rate(Some(0)) > rr.hit_rate(Some(0)), "{report}");
        assert!(kv.percentile_ms(0.5) < rr.percentile_ms(0.5), "{report}");
        assert!(kv.hit_rate(None) <= kv.bound_hit_rate + 1e-9, "never above the infinite cache: {report}");
    }
}
