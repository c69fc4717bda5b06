//! `dynamo-node bench serve`: generated tokens per second through the real HTTP API, at several
//! numbers of concurrent streams, against the memory-bandwidth bound of decode on this machine.
//!
//! The bench starts a node in this process from the embedded default configuration with the
//! reference engine on the CPU (`--model`, `--workers`; G3 disabled, G2 as configured), built from
//! the same steps as `dynamo-node serve` ([`ResolvedTiers::resolve`], then [`node::start`] and
//! [`NodeHandle::stop`]) on 127.0.0.1 with an ephemeral port, printing nothing and installing no
//! metrics. The one difference is that the frontend sends no stop tokens, the server-side
//! equivalent of vLLM's `ignore_eos`: the API has no `ignore_eos` or `min_tokens`, and random
//! weights can sample `<|endoftext|>`, so without this an answer could end early. Every answer's
//! length is still counted, never assumed: the generated tokens are the `usage.completion_tokens`
//! of each request, and requests that finished before `--max-tokens` are reported.
//!
//! For each level of `--streams`, that many clients (one task each, sharing a pooled `reqwest`
//! client) send streaming `POST /v1/completions` requests back to back, each with a prompt of
//! `--prompt-tokens` random token ids of its own (so no request finds another's prefix cached;
//! the cached prompt tokens the node reports are printed) and greedy decoding of `--max-tokens`
//! tokens. A client times its first non-empty text chunk (TTFT, from sending the request) and the
//! gaps between text chunks (inter-token latency; a chunk carries more than one token where a
//! token ends inside a UTF-8 character, so chunks are counted too). A level's throughput is its
//! generated tokens over its wall time, from launching its clients to the last one finishing.
//! One uncounted request warms the node up first. The clients run in the node's process and on
//! its cores, as a local load generator would.
//!
//! The bound: one decode step of a worker reads every weight it multiplies by once — all of them
//! but the embedding table, of which it reads one row per token — plus each running stream's KV,
//! and yields one token per running stream. With `s` streams over `w` workers sharing the
//! machine's read bandwidth `B`, at most `s × B ÷ (min(s, w) × weight bytes per step + s × KV
//! bytes per stream step)` tokens per second come out (the KV taken at the mean context,
//! `prompt + max_tokens / 2`). That grows with `s` until the arithmetic runs out, so the bound is
//! capped at the compute ceiling: the CPU backend's own GEMM rate (measured on the model's output
//! head, the largest matrix, with 64 rows) ÷ the 2 FLOPs per weight a token costs. `B` is
//! measured in the same run, after the node has stopped, with as many threads as the CPU backend
//! uses (`workers × per-worker threads`): the best of a few parallel streaming reads of a buffer
//! many times the last-level cache (`--bandwidth-mib`). Weights are `f32` on the CPU backend.
//!
//! A worker that serves one request at a time gets about the same tokens per second at every
//! level; one that batches its running requests (`engine.max_running_requests`, left at its
//! default) should approach the bound as the streams grow. The summary compares 16 streams with 1
//! against the goal of 8×.

use std::fmt;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use clap::Args;
use dynamo_config::{ByteSize, DeviceKind, Dtype, EngineKind, ModelShape, NodeConfig};
use dynamo_kernels::{Backend, CpuBackend};
use dynamo_tiering::block::BlockLayout;
use serde_json::{Value, json};

use crate::node::{self, Launch, NodeHandle};
use crate::plan::ResolvedTiers;

/// The goal: tokens per second at 16 streams over those at 1.
const GOAL_16_OVER_1: f64 = 8.0;
/// Rows of the GEMM that measures the compute ceiling: a batch large enough to be compute-bound.
const GEMM_ROWS: usize = 64;
/// Passes over the bandwidth buffer and repetitions of the GEMM; the best counts.
const BEST_OF: usize = 5;

/// Options of `bench serve`.
#[derive(Debug, Clone, Args)]
pub struct BenchServeArgs {
    /// Model shape, with seeded random weights (`tiny`, `llama-1b`, `llama-8b`).
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Engine workers (they share the cores).
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Numbers of concurrent streams, comma-separated; one table row each.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    pub streams: Vec<usize>,
    /// Requests each stream sends back to back. Default: ⌈8 ÷ streams⌉ between 1 and 4 (4 at one
    /// stream, 2 at four, 1 from eight up), which keeps the default run short.
    #[arg(long)]
    pub requests_per_stream: Option<usize>,
    /// Prompt length in tokens (random ids, different for every request).
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// MiB read per pass of the memory-bandwidth measurement (many times the last-level cache).
    #[arg(long, default_value_t = 1024)]
    pub bandwidth_mib: usize,
    /// Seed of the prompts.
    #[arg(long, default_value_t = 0x5eed)]
    pub seed: u64,
}

impl BenchServeArgs {
    /// Requests per stream at `streams` streams.
    pub fn requests_at(&self, streams: usize) -> usize {
        self.requests_per_stream.unwrap_or_else(|| 8usize.div_ceil(streams.max(1)).clamp(1, 4)).max(1)
    }
}

/// The 50th and 99th percentiles (nearest rank) of a set of durations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Percentiles {
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
}

impl Percentiles {
    /// The percentiles of `samples`; `None` when there are none.
    pub fn of(mut samples: Vec<Duration>) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_unstable();
        let rank = |p: f64| samples[((p * samples.len() as f64).ceil() as usize).clamp(1, samples.len()) - 1];
        Some(Self { p50: rank(0.50), p99: rank(0.99) })
    }
}

/// One level of concurrency.
#[derive(Debug, Clone)]
pub struct Row {
    /// Concurrent streams.
    pub streams: usize,
    /// Requests completed.
    pub requests: usize,
    /// Tokens generated, as the node counted them (`usage.completion_tokens`).
    pub tokens: usize,
    /// Non-empty text chunks received.
    pub chunks: usize,
    /// Requests that finished before `max_tokens`.
    pub early_stops: usize,
    /// Prompt tokens the node found cached (0 when no prefix was reused).
    pub cached_tokens: usize,
    /// From launching the streams to the last one finishing.
    pub wall: Duration,
    /// Time to the first text chunk, over the requests.
    pub ttft: Option<Percentiles>,
    /// Gaps between text chunks, over all requests.
    pub itl: Option<Percentiles>,
    /// The decode bound at this many streams, tokens per second.
    pub bound: f64,
}

impl Row {
    /// Generated tokens per second.
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.wall.as_secs_f64().max(1e-9)
    }
}

/// What the bench measured.
#[derive(Debug, Clone)]
pub struct ServeReport {
    /// The model shape.
    pub shape: ModelShape,
    /// Engine workers.
    pub workers: usize,
    /// CPU backend threads per worker.
    pub threads_per_worker: usize,
    /// Prompt tokens per request.
    pub prompt_tokens: usize,
    /// Tokens asked for per request.
    pub max_tokens: usize,
    /// One decode step of one worker as the node measured it at start-up.
    pub decode_step: Duration,
    /// G1 bytes per worker.
    pub g1_bytes: u64,
    /// G2 bytes, when enabled.
    pub g2_bytes: Option<u64>,
    /// One row per level, in the order run.
    pub rows: Vec<Row>,
    /// Memory read bandwidth, bytes per second.
    pub bandwidth: f64,
    /// Bytes per bandwidth pass.
    pub bandwidth_bytes: usize,
    /// The CPU backend's GEMM rate on the output head, FLOPs per second.
    pub gemm_flops: f64,
    /// All weights in `f32`.
    pub weight_bytes: u64,
    /// Weight bytes one decode step reads.
    pub step_weight_bytes: u64,
    /// KV bytes one stream's decode step reads at the mean context.
    pub step_kv_bytes: u64,
}

impl ServeReport {
    /// The row of `streams` streams.
    pub fn row(&self, streams: usize) -> Option<&Row> {
        self.rows.iter().find(|r| r.streams == streams)
    }

    /// Tokens per second at `streams` streams over those at one stream.
    pub fn speedup(&self, streams: usize) -> Option<f64> {
        let one = self.row(1)?.tokens_per_s();
        (one > 0.0).then(|| self.row(streams).map(|r| r.tokens_per_s() / one)).flatten()
    }

    /// The compute ceiling, tokens per second.
    pub fn compute_ceiling(&self) -> f64 {
        self.gemm_flops / (2.0 * (self.step_weight_bytes / 4) as f64)
    }
}

impl fmt::Display for ServeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gb = |b: f64| b / 1e9;
        writeln!(
            f,
            "bench serve: model {} (random weights, f32), {} CPU worker(s) × {} thread(s), {}-token prompts, {} generated tokens per request",
            self.shape.name, self.workers, self.threads_per_worker, self.prompt_tokens, self.max_tokens
        )?;
        writeln!(
            f,
            "node on 127.0.0.1 in this process: G1 {} per worker, G2 {}, G3 off; no stop tokens (every answer runs to its max_tokens)",
            ByteSize(self.g1_bytes),
            self.g2_bytes.map_or("off".to_owned(), |b| ByteSize(b).to_string())
        )?;
        writeln!(
            f,
            "memory read bandwidth: {:.1} GB/s ({} threads, best of {BEST_OF} passes over {})",
            gb(self.bandwidth),
            self.workers * self.threads_per_worker,
            ByteSize(self.bandwidth_bytes as u64)
        )?;
        writeln!(
            f,
            "weights: {:.3} GB in f32; a decode step reads {:.3} GB of them (all but the embedding table) \
             and {:.1} KiB of KV per stream at the mean context",
            gb(self.weight_bytes as f64),
            gb(self.step_weight_bytes as f64),
            self.step_kv_bytes as f64 / 1024.0
        )?;
        writeln!(
            f,
            "compute ceiling: {:.0} tokens/s ({:.1} GFLOP/s of the CPU backend's GEMM on {} × {} × {}, ÷ 2 FLOPs per weight read)",
            self.compute_ceiling(),
            self.gemm_flops / 1e9,
            GEMM_ROWS,
            self.shape.hidden,
            self.shape.vocab
        )?;
        writeln!(
            f,
            "bound = min(streams × bandwidth ÷ (busy workers × weight bytes per step + streams × KV bytes per step), compute ceiling)"
        )?;
        writeln!(f, "the node measured one decode step at {:.1} ms at start-up", self.decode_step.as_secs_f64() * 1e3)?;
        writeln!(f)?;
        writeln!(
            f,
            "| streams | requests | generated tokens | wall s | tokens/s | × 1 stream | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | bound tokens/s | ÷ bound |"
        )?;
        writeln!(f, "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")?;
        let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1e3);
        let pair = |p: Option<Percentiles>| p.map_or(("–".to_owned(), "–".to_owned()), |p| (ms(p.p50), ms(p.p99)));
        for row in &self.rows {
            let (ttft50, ttft99) = pair(row.ttft);
            let (itl50, itl99) = pair(row.itl);
            let speedup = self.speedup(row.streams).map_or("–".to_owned(), |x| format!("{x:.2}×"));
            writeln!(
                f,
                "| {} | {} | {} | {:.2} | {:.1} | {} | {} | {} | {} | {} | {:.0} | {:.3} |",
                row.streams,
                row.requests,
                row.tokens,
                row.wall.as_secs_f64(),
                row.tokens_per_s(),
                speedup,
                ttft50,
                ttft99,
                itl50,
                itl99,
                row.bound,
                row.tokens_per_s() / row.bound.max(1e-9),
            )?;
        }
        writeln!(f)?;
        let requests: usize = self.rows.iter().map(|r| r.requests).sum();
        let tokens: usize = self.rows.iter().map(|r| r.tokens).sum();
        let chunks: usize = self.rows.iter().map(|r| r.chunks).sum();
        let early: usize = self.rows.iter().map(|r| r.early_stops).sum();
        let cached: usize = self.rows.iter().map(|r| r.cached_tokens).sum();
        if early == 0 {
            writeln!(f, "every one of the {requests} requests generated {} tokens", self.max_tokens)?;
        } else {
            writeln!(f, "{early} of the {requests} requests finished before {} tokens", self.max_tokens)?;
        }
        writeln!(f, "{chunks} text chunks for {tokens} generated tokens; {cached} prompt tokens found cached")?;
        match self.speedup(16) {
            Some(x) => {
                let verdict = if x >= GOAL_16_OVER_1 { "met" } else { "not met" };
                writeln!(f, "16 streams ÷ 1 stream: {x:.2}× tokens/s (goal ≥ {GOAL_16_OVER_1:.0}×: {verdict})")?;
            }
            None => writeln!(f, "16 streams ÷ 1 stream: not measured (goal ≥ {GOAL_16_OVER_1:.0}×)")?,
        }
        Ok(())
    }
}

/// Runs the bench.
pub fn run(args: &BenchServeArgs) -> anyhow::Result<ServeReport> {
    let shape = ModelShape::named(&args.model).with_context(|| {
        let names: Vec<&str> = ModelShape::ALL.iter().map(|s| s.name).collect();
        format!("--model {:?} is not a known shape ({})", args.model, names.join(", "))
    })?;
    ensure!(!args.streams.is_empty() && args.streams.iter().all(|&s| s > 0), "--streams must be positive numbers");
    ensure!(args.prompt_tokens > 0 && args.max_tokens > 0, "--prompt-tokens and --max-tokens must be at least 1");
    let workers = args.workers.max(1);
    // What `Serving::start` gives each CPU worker.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads_per_worker = (cores / workers).max(1);
    let data = tempfile::tempdir().context("a scratch data directory")?;
    let cfg = bench_config(args, shape, data.path())?;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("bench-serve")
        .build()
        .context("starting the runtime")?;
    let (decode_step, rows) = runtime.block_on(async {
        let node = BenchNode::start(&cfg).await?;
        let decode_step = node.decode_step;
        // Idle connections are dropped before the node's `frontend.header_timeout` would close
        // them, so no request goes out on a connection the node is closing.
        let idle = cfg.frontend.header_timeout.as_duration() / 2;
        let measured = drive(&node.base, node.vocab.min(shape.vocab), idle, args, shape).await;
        node.stop().await?;
        measured.map(|rows| (decode_step, rows))
    })?;
    runtime.shutdown_timeout(Duration::from_millis(500));

    // After the node has stopped, so its threads neither compete nor hold the memory.
    let threads = workers * threads_per_worker;
    let bandwidth_bytes = args.bandwidth_mib.max(1) << 20;
    let bandwidth = read_bandwidth(bandwidth_bytes, threads, BEST_OF);
    let gemm_flops = gemm_flops(&shape, threads, BEST_OF.min(3))?;
    let weight_elements = dynamo_kernels::model::weight_bytes(&shape) / 2;
    let step_elements = weight_elements - (shape.vocab * shape.hidden) as u64;
    let mean_context = args.prompt_tokens + args.max_tokens / 2;
    let mut report = ServeReport {
        shape,
        workers,
        threads_per_worker,
        prompt_tokens: args.prompt_tokens,
        max_tokens: args.max_tokens,
        decode_step,
        g1_bytes: cfg.tiers.g1.capacity.as_u64(),
        g2_bytes: cfg.tiers.g2.enabled.then(|| cfg.tiers.g2.capacity.as_u64()),
        rows,
        bandwidth,
        bandwidth_bytes,
        gemm_flops,
        weight_bytes: weight_elements * 4,
        step_weight_bytes: step_elements * 4,
        // The CPU backend keeps KV in f32.
        step_kv_bytes: mean_context as u64 * shape.kv_bytes_per_token(Dtype::F32),
    };
    let ceiling = report.compute_ceiling();
    for row in &mut report.rows {
        let s = row.streams as f64;
        let bytes = row.streams.min(workers) as f64 * report.step_weight_bytes as f64 + s * report.step_kv_bytes as f64;
        row.bound = (s * bandwidth / bytes).min(ceiling);
    }
    Ok(report)
}

/// The embedded default configuration with the bench's changes: the reference engine on the CPU,
/// `shape` with random weights, `--workers`, G3 off, G1 and the queues large enough for every
/// stream of the largest level to run at once, and the data directory in `data`.
fn bench_config(args: &BenchServeArgs, shape: ModelShape, data: &std::path::Path) -> anyhow::Result<NodeConfig> {
    let mut cfg = NodeConfig::embedded_default();
    cfg.node.data_dir = data.to_owned();
    cfg.model.name = shape.name.to_owned();
    cfg.model.path = None;
    cfg.engine.kind = EngineKind::Reference;
    cfg.engine.device = DeviceKind::Cpu;
    cfg.engine.workers = args.workers.max(1);
    cfg.tiers.g3.enabled = false;
    cfg.frontend.http = "127.0.0.1:0".into();
    let most = args.streams.iter().copied().max().unwrap_or(1);
    let per_worker = most.div_ceil(cfg.engine.workers);
    cfg.engine.max_queued_requests = cfg.engine.max_queued_requests.max(per_worker + 1);
    let block_tokens = cfg.blocks.block_size;
    let blocks = (args.prompt_tokens + args.max_tokens).div_ceil(block_tokens) + 1;
    let block_bytes = BlockLayout::for_model(&shape, cfg.model.dtype, block_tokens).payload_bytes() as u64;
    let g1 = (per_worker * blocks) as u64 * block_bytes;
    cfg.tiers.g1.capacity = ByteSize(cfg.tiers.g1.capacity.as_u64().max(g1));
    cfg.validate().context("the bench's configuration")?;
    Ok(cfg)
}

/// A node serving the API on 127.0.0.1, started as `dynamo-node serve` starts it.
struct BenchNode {
    base: String,
    decode_step: Duration,
    /// The tokenizer's ids.
    vocab: usize,
    node: NodeHandle,
}

impl BenchNode {
    async fn start(cfg: &NodeConfig) -> anyhow::Result<Self> {
        let plan = ResolvedTiers::resolve(cfg)?;
        let launch = Launch::quiet().with_frontend(|state| state.with_stop_token_ids(Vec::new()));
        let node = node::start(cfg, plan, launch).await?;
        Ok(Self {
            base: format!("http://{}", node.local_addr()),
            decode_step: node.serving().decode_step,
            vocab: node.vocab(),
            node,
        })
    }

    async fn stop(self) -> anyhow::Result<()> {
        self.node.stop().await
    }
}

/// One request as its client saw it.
#[derive(Debug, Default)]
struct Sample {
    ttft: Option<Duration>,
    gaps: Vec<Duration>,
    chunks: usize,
    tokens: Option<usize>,
    cached_tokens: usize,
    finish: Option<String>,
}

/// Runs the warm-up and every level against the node at `base`, with prompt ids below `vocab`
/// and pooled connections kept `idle` at most.
async fn drive(
    base: &str,
    vocab: usize,
    idle: Duration,
    args: &BenchServeArgs,
    shape: ModelShape,
) -> anyhow::Result<Vec<Row>> {
    let url = format!("{base}/v1/completions");
    let client = reqwest::Client::builder().pool_idle_timeout(idle).build().context("building the HTTP client")?;
    let vocab = vocab as u64;
    let mut rng = SplitMix(args.seed);
    let body = |rng: &mut SplitMix| {
        let prompt: Vec<u64> = (0..args.prompt_tokens).map(|_| rng.next() % vocab).collect();
        json!({
            "model": shape.name,
            "prompt": prompt,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    };
    request(&client, &url, &body(&mut rng)).await.context("the warm-up request")?;
    let mut rows = Vec::with_capacity(args.streams.len());
    for &streams in &args.streams {
        let per_stream = args.requests_at(streams);
        let bodies: Vec<Vec<Value>> = (0..streams).map(|_| (0..per_stream).map(|_| body(&mut rng)).collect()).collect();
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for bodies in bodies {
            let (client, url) = (client.clone(), url.clone());
            tasks.spawn(async move {
                let mut samples = Vec::with_capacity(bodies.len());
                for body in &bodies {
                    samples.push(request(&client, &url, body).await?);
                }
                anyhow::Ok(samples)
            });
        }
        let mut samples = Vec::with_capacity(streams * per_stream);
        while let Some(done) = tasks.join_next().await {
            samples.extend(done.context("a stream's task failed")??);
        }
        let wall = started.elapsed();
        rows.push(row(streams, wall, samples, args.max_tokens));
    }
    Ok(rows)
}

/// The row of one level from its samples.
fn row(streams: usize, wall: Duration, samples: Vec<Sample>, max_tokens: usize) -> Row {
    let tokens_of = |s: &Sample| s.tokens.unwrap_or(0);
    Row {
        streams,
        requests: samples.len(),
        tokens: samples.iter().map(tokens_of).sum(),
        chunks: samples.iter().map(|s| s.chunks).sum(),
        early_stops: samples
            .iter()
            .filter(|s| tokens_of(s) < max_tokens || s.finish.as_deref() != Some("length"))
            .count(),
        cached_tokens: samples.iter().map(|s| s.cached_tokens).sum(),
        wall,
        ttft: Percentiles::of(samples.iter().filter_map(|s| s.ttft).collect()),
        itl: Percentiles::of(samples.iter().flat_map(|s| s.gaps.iter().copied()).collect()),
        bound: 0.0,
    }
}

/// Sends one streaming completion and reads its events to `[DONE]`.
async fn request(client: &reqwest::Client, url: &str, body: &Value) -> anyhow::Result<Sample> {
    let sent = Instant::now();
    let mut response = client.post(url).json(body).send().await.context("sending a request")?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        bail!("the node answered {status}: {text}");
    }
    let mut events = SseEvents::default();
    let mut sample = Sample::default();
    let mut last = None;
    let mut done = false;
    while let Some(bytes) = response.chunk().await.context("reading the event stream")? {
        let at = Instant::now();
        for data in events.push(&bytes) {
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let event: Value =
                serde_json::from_str(&data).with_context(|| format!("an event that is not JSON: {data}"))?;
            if let Some(error) = event.get("error") {
                bail!("the stream ended with an error: {error}");
            }
            if let Some(usage) = event.get("usage") {
                sample.tokens = usage["completion_tokens"].as_u64().map(|n| n as usize);
                sample.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) as usize;
            }
            let Some(choice) = event["choices"].get(0) else { continue };
            if let Some(reason) = choice["finish_reason"].as_str() {
                sample.finish = Some(reason.to_owned());
            }
            if choice["text"].as_str().is_some_and(|t| !t.is_empty()) {
                match last {
                    None => sample.ttft = Some(at - sent),
                    Some(previous) => sample.gaps.push(at - previous),
                }
                last = Some(at);
                sample.chunks += 1;
            }
        }
    }
    ensure!(done, "the event stream ended without [DONE]");
    ensure!(sample.tokens.is_some(), "the event stream carried no usage");
    Ok(sample)
}

/// Server-sent events from a byte stream cut anywhere: [`SseEvents::push`] returns the `data` of
/// each event completed by the bytes pushed (the node ends every event with a blank line).
#[derive(Debug, Default)]
struct SseEvents {
    pending: Vec<u8>,
}

impl SseEvents {
    fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event[..end]);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|line| line.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

/// The random prompt ids: splitmix64.
#[derive(Debug)]
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Memory read bandwidth in bytes per second: `threads` threads each sum their share of a
/// `bytes`-byte buffer (written first, so every page is really mapped), best of `passes`.
fn read_bandwidth(bytes: usize, threads: usize, passes: usize) -> f64 {
    let threads = threads.max(1);
    let words = (bytes / 8).max(threads * 8);
    let per = words.div_ceil(threads);
    let mut buffer = vec![0u64; words];
    std::thread::scope(|s| {
        for (i, part) in buffer.chunks_mut(per).enumerate() {
            s.spawn(move || {
                for (j, w) in part.iter_mut().enumerate() {
                    *w = ((i * per + j) as u64) | 1;
                }
            });
        }
    });
    let mut best = f64::INFINITY;
    for _ in 0..passes.max(1) {
        let started = Instant::now();
        let total = std::thread::scope(|s| {
            let parts: Vec<_> = buffer.chunks(per).map(|part| s.spawn(move || sum_words(part))).collect();
            parts.into_iter().map(|p| p.join().unwrap_or(0)).fold(0u64, u64::wrapping_add)
        });
        best = best.min(started.elapsed().as_secs_f64());
        std::hint::black_box(total);
    }
    (words * 8) as f64 / best.max(1e-9)
}

/// The wrapping sum of `words`, in eight independent lanes so that it vectorizes.
fn sum_words(words: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    let chunks = words.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, w) in lanes.iter_mut().zip(chunk) {
            *lane = lane.wrapping_add(*w);
        }
    }
    lanes.iter().chain(rest).fold(0, |a, &w| a.wrapping_add(w))
}

/// FLOPs per second of the CPU backend's GEMM with `threads` threads on a matrix of the output
/// head's shape (`vocab × hidden`) and [`GEMM_ROWS`] rows, best of `reps` after one warm-up.
fn gemm_flops(shape: &ModelShape, threads: usize, reps: usize) -> anyhow::Result<f64> {
    let backend = CpuBackend::new(threads);
    let (n, k) = (shape.vocab, shape.hidden);
    let w = backend.weight(&vec![1e-3; n * k], n, k)?;
    let x = backend.upload(&vec![1e-3; GEMM_ROWS * k])?;
    let mut out = backend.zeros(GEMM_ROWS * n)?;
    backend.matmul(&x, GEMM_ROWS, &w, &mut out)?;
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let started = Instant::now();
        backend.matmul(&x, GEMM_ROWS, &w, &mut out)?;
        best = best.min(started.elapsed().as_secs_f64());
    }
    Ok(2.0 * (GEMM_ROWS * k * n) as f64 / best.max(1e-9))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank_and_ordered() {
        let ms = |v: u64| Duration::from_millis(v);
        let p = Percentiles::of((1..=100).rev().map(ms).collect()).unwrap();
        assert_eq!((p.p50, p.p99), (ms(50), ms(99)));
        let one = Percentiles::of(vec![ms(7)]).unwrap();
        assert_eq!((one.p50, one.p99), (ms(7), ms(7)));
        assert_eq!(Percentiles::of(Vec::new()), None);
    }

    #[test]
    fn events_are_the_same_at_every_split() {
        let stream = "data: {\"a\":1}\n\ndata: {\"b\":\"x\\n\"}\n\n: comment\n\ndata: [DONE]\n\n";
        let whole = SseEvents::default().push(stream.as_bytes());
        assert_eq!(whole, ["{\"a\":1}", "{\"b\":\"x\\n\"}", "[DONE]"]);
        for cut in 0..=stream.len() {
            let mut events = SseEvents::default();
            let mut got = events.push(&stream.as_bytes()[..cut]);
            got.extend(events.push(&stream.as_bytes()[cut..]));
            assert_eq!(got, whole, "split at {cut}");
        }
    }

    #[test]
    fn default_requests_per_stream_shrink_with_the_streams() {
        let args = BenchServeArgs {
            model: "tiny".into(),
            workers: 1,
            streams: vec![1, 4, 16, 64],
            requests_per_stream: None,
            prompt_tokens: 128,
            max_tokens: 64,
            bandwidth_mib: 1024,
            seed: 1,
        };
        assert_eq!(args.streams.iter().map(|&s| args.requests_at(s)).collect::<Vec<_>>(), [4, 2, 1, 1]);
        let fixed = BenchServeArgs { requests_per_stream: Some(3), ..args };
        assert_eq!(fixed.requests_at(64), 3);
    }

    /// The whole bench on the tiny shape, scaled down: the node in this process, real HTTP.
    #[test]
    fn serve_bench_runs_on_the_tiny_shape() {
        let args = BenchServeArgs {
            model: "tiny".into(),
            workers: 1,
            streams: vec![1, 2],
            requests_per_stream: Some(2),
            prompt_tokens: 40,
            max_tokens: 3,
            bandwidth_mib: 16,
            seed: 7,
        };
        let report = run(&args).unwrap();
        let table = report.to_string();
        assert_eq!(
            report.rows.iter().map(|r| (r.streams, r.requests)).collect::<Vec<_>>(),
            [(1, 2), (2, 4)],
            "{table}"
        );
        for row in &report.rows {
            assert!(row.tokens > 0, "{table}");
            // No stop tokens are sent: every answer is exactly `max_tokens` long.
            assert_eq!((row.tokens, row.early_stops), (row.requests * args.max_tokens, 0), "{table}");
            assert_eq!(row.cached_tokens, 0, "{table}");
            for p in [row.ttft, row.itl] {
                let p = p.expect("measured");
                assert!(p.p50 <= p.p99, "{table}");
            }
            assert!(row.bound > 0.0 && row.bound.is_finite(), "{table}");
            assert!(table.contains(&format!("\n| {} | {} | {} |", row.streams, row.requests, row.tokens)), "{table}");
        }
        assert!(report.bandwidth > 0.0 && report.gemm_flops > 0.0, "{table}");
        assert!(table.contains("16 streams ÷ 1 stream: not measured"), "{table}");
    }
}
