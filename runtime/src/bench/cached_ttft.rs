//! Time to first token of one long prompt with its prefix cold, resident in G1, in G2 only, in G3
//! only, and computed by another worker: the end-to-end section of `dynamo-node gpu-check`.
//!
//! The harness is generic over the [`Backend`], so the same code runs the product's worker loop
//! ([`Worker`]: onboarding, batched scatter, write-through) on a CUDA device in `gpu-check` and on
//! the CPU backend in the tests. What it builds is a node of its own, through the node builder's
//! stages up to the tiers ([`NodeBuilder`] → [`NodeStores`] → [`NodeTiers`]): a G2 pool
//! (registered with the device through `prepare`, so loads into G1 read pinned host memory
//! directly), a G3 store in a scratch directory, and two workers on one device (one backend
//! each), which the harness drives itself — it clears their G1 between scenarios, so no scheduler
//! or actor stands between it and them.
//!
//! Per run `r`, with a prompt of its own:
//! 1. **cold**: worker A computes the whole prompt, then flushes write-through (G2 and G3 hold it);
//! 2. **G1**: A again: the prefix is resident in its G1;
//! 3. **other worker**: worker B, which never saw the prompt, loads it from G2;
//! 4. **G2**: A with its G1 cleared loads from G2;
//! 5. **G3**: A with its G1 cleared and G2 emptied loads from G3 (through G2 slots), or recomputes
//!    where the cost model says the disk is slower than computing;
//! 6. **overlap**: the prompt with new tokens after it (an eighth of its length, as the next turn of
//!    a conversation brings), first with the prefix resident in A's G1 (the new tokens' compute
//!    alone), then with it in G2 only: the load runs on the copy engine layer by layer ahead of the
//!    compute, so it should add less than its plain copy time.
//!
//! Each row is the median over the runs; the tier hits of the last run say where the prefix came
//! from. `plain_copy` times a plain host-to-device copy of the prefix's KV bytes (the link's limit).

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use dynamo_actors::builder::{G2Plan, G3Plan, NO_RECLAIM, NodeBuilder, NodeStores, StorePlan, TierSettings};
use dynamo_actors::cost::{CostModel, Prefill};
use dynamo_actors::index::IndexConfig;
use dynamo_actors::tiers::{NodeTiers, WriteBatch};
use dynamo_actors::worker::{GenOutcome, GenRequest, Worker, unix_millis};
use dynamo_config::{Dtype, ModelShape, PerTier, RegionKind, RetentionSection};
use dynamo_kernels::backend::Backend;
use dynamo_kernels::model::{HostWeights, Llama};
use dynamo_tiering::block::{BlockLayout, Salt, SaltInputs};
use dynamo_tiering::g2::{HostPool, HostPoolOptions, MlockPolicy, align_up};
use dynamo_tiering::g3::superblock::file_bytes;
use dynamo_tiering::g3::{EngineChoice, G3Options};
use dynamo_tiering::io::uring::UringOptions;
use dynamo_tiering::registry::PolicyKind;

/// What to measure.
#[derive(Debug, Clone)]
pub struct CachedTtftOptions {
    /// The model shape (random weights with `seed`).
    pub shape: ModelShape,
    /// The dtype of block images in G2 and G3.
    pub dtype: Dtype,
    /// Tokens per block.
    pub block_tokens: usize,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Runs per scenario (the median counts).
    pub runs: usize,
    /// Directory for the G3 store's file (removed with the node).
    pub dir: PathBuf,
    /// Weight seed.
    pub seed: u64,
    /// The prefill rate the workers weigh loads against: `None` measures it first (a cold
    /// prefill of the prompt on a worker without G2 or G3, which also warms the device up);
    /// `Some(0.0)` makes every load win.
    pub prefill_tokens_per_s: Option<f64>,
}

/// One scenario's row.
#[derive(Debug, Clone)]
pub struct TtftRow {
    /// Where the prefix was.
    pub scenario: &'static str,
    /// Median time to first token over the runs.
    pub median: Duration,
    /// Fastest run.
    pub min: Duration,
    /// Prompt tokens taken from each tier in the last run.
    pub hit_tokens: PerTier<usize>,
}

/// The prompt with `new_tokens` after it: its prefix in G1, then in G2 only.
#[derive(Debug, Clone)]
pub struct OverlapRows {
    /// Tokens after the prompt.
    pub new_tokens: usize,
    /// The prefix resident in G1: the new tokens' compute alone.
    pub g1: TtftRow,
    /// The prefix in G2 only: its load overlapped with that compute.
    pub g2: TtftRow,
}

impl OverlapRows {
    /// The share of a load taking `copy` that the G2 row hides behind compute: 1 when loading adds
    /// nothing to the G1 row, 0 when it adds the whole copy (or more).
    pub fn hidden(&self, copy: Duration) -> f64 {
        let added = self.g2.median.as_secs_f64() - self.g1.median.as_secs_f64();
        (1.0 - added / copy.as_secs_f64().max(1e-9)).clamp(0.0, 1.0)
    }
}

/// The table.
#[derive(Debug, Clone)]
pub struct CachedTtftReport {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// KV bytes of the prompt's complete blocks (what a cached prefix moves).
    pub kv_bytes: usize,
    /// cold, G1, other worker, G2, G3.
    pub rows: Vec<TtftRow>,
    /// The prefix with new tokens after it.
    pub overlap: OverlapRows,
    /// A plain copy of `kv_bytes` from pinned host memory to the device, if measured.
    pub plain_copy: Option<Duration>,
    /// The prefill rate the workers weighed loads against (0: every load wins).
    pub prefill_tokens_per_s: f64,
}

impl CachedTtftReport {
    /// The row of `scenario`.
    pub fn row(&self, scenario: &str) -> Option<&TtftRow> {
        self.rows.iter().find(|r| r.scenario == scenario)
    }

    /// Cold TTFT divided by `scenario`'s.
    pub fn speedup(&self, scenario: &str) -> Option<f64> {
        let cold = self.row("cold")?.median.as_secs_f64();
        let row = self.row(scenario)?.median.as_secs_f64();
        (row > 0.0).then(|| cold / row)
    }
}

impl fmt::Display for CachedTtftReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "cached-prefix TTFT: {}-token prompt, {:.1} MiB of KV in its complete blocks",
            self.prompt_tokens,
            self.kv_bytes as f64 / (1 << 20) as f64
        )?;
        writeln!(
            f,
            "loads are weighed against {:.0} prefill tokens/s (a tier is used only where loading beats that)",
            self.prefill_tokens_per_s
        )?;
        writeln!(f, "{:<14} {:>12} {:>12} {:>10}  tokens from G1/G2/G3", "prefix", "median", "fastest", "× cold")?;
        for r in &self.rows {
            let speedup = self.speedup(r.scenario).map_or_else(|| "—".into(), |s| format!("{s:.1}×"));
            let PerTier { g1, g2, g3, .. } = r.hit_tokens;
            writeln!(
                f,
                "{:<14} {:>9.1} ms {:>9.1} ms {:>10}  {g1}/{g2}/{g3}",
                r.scenario,
                ms(r.median),
                ms(r.min),
                speedup
            )?;
        }
        if let Some(copy) = self.plain_copy {
            let g2 = self.row("G2").map_or(0.0, |r| ms(r.median));
            writeln!(
                f,
                "plain pinned copy of the same KV bytes: {:.1} ms ({:.1} GB/s); G2 TTFT / copy = {:.2}",
                ms(copy),
                self.kv_bytes as f64 / copy.as_secs_f64() / 1e9,
                g2 / ms(copy).max(1e-9)
            )?;
        }
        let o = &self.overlap;
        writeln!(f, "overlap: the prompt + {} new tokens", o.new_tokens)?;
        for (name, r) in [("prefix in G1", &o.g1), ("prefix in G2", &o.g2)] {
            let PerTier { g1, g2, g3, .. } = r.hit_tokens;
            writeln!(f, "{name:<14} {:>9.1} ms {:>9.1} ms {:>10}  {g1}/{g2}/{g3}", ms(r.median), ms(r.min), "")?;
        }
        if let Some(copy) = self.plain_copy {
            writeln!(
                f,
                "loading the prefix added {:.1} ms to computing the new tokens; serially it would add the \
                 copy's {:.1} ms: {:.0}% of it hidden behind compute",
                ms(o.g2.median) - ms(o.g1.median),
                ms(copy),
                100.0 * o.hidden(copy)
            )?;
        }
        Ok(())
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The scratch node: tiers and the device registration of G2 (dropped first).
struct Scratch<G> {
    registration: G,
    tiers: Arc<NodeTiers>,
}

/// Runs the five scenarios. `make` builds one backend per worker; `prepare` gets the first
/// backend and the G2 pool before any work (CUDA registers the pool's mapping there) and returns
/// what must live as long as the node; `share` hands that to the second worker's backend, as the
/// node does; `plain_copy` times a plain copy of that many bytes.
pub async fn run<B: Backend, G>(
    make: &dyn Fn() -> anyhow::Result<B>,
    prepare: &dyn Fn(&B, &HostPool) -> anyhow::Result<G>,
    share: &dyn Fn(&G, &B),
    plain_copy: &dyn Fn(usize) -> Option<Duration>,
    opts: &CachedTtftOptions,
) -> anyhow::Result<CachedTtftReport> {
    anyhow::ensure!(opts.prompt_tokens > opts.block_tokens, "the prompt must span more than one block");
    let b = opts.block_tokens;
    let blocks = opts.prompt_tokens.div_ceil(b);
    let new_tokens = (opts.prompt_tokens / 8).max(b);
    // The blocks of the prompt and of both overlap requests' new tokens.
    let held = blocks + 2 * (new_tokens.div_ceil(b) + 1);
    let layout = BlockLayout::for_model(&opts.shape, opts.dtype, b);
    let slot_bytes = align_up(layout.image_bytes());
    // G2 holds them all plus headroom for in-flight loads; G3 them all and a spare.
    let g2_slots = u32::try_from(held + 8).context("G2 slots")?;
    std::fs::create_dir_all(&opts.dir).with_context(|| format!("creating {}", opts.dir.display()))?;
    let g3_path = opts.dir.join("cached-ttft.g3");
    // A file left by an interrupted run would bring its blocks back: every run starts empty.
    let _ = std::fs::remove_file(&g3_path);
    let plan = StorePlan {
        g2: Some(G2Plan {
            pool: HostPoolOptions { slot_bytes, slots: g2_slots, mlock: MlockPolicy::Try },
            resident: held + 4,
            policy: PolicyKind::Lru,
            watermarks: NO_RECLAIM,
            shared: false,
        }),
        engines_g2: None,
        g3: Some(G3Plan {
            options: G3Options {
                format_foreign: false,
                paths: vec![g3_path.clone()],
                capacity_per_path: file_bytes(2 * (held as u64 + 8), slot_bytes as u64),
                slot_bytes,
                direct_io: true,
                engine: EngineChoice::Uring(UringOptions { queue_depth: 32, threads: 1, register_buffers: true }),
            },
            policy: PolicyKind::Lru,
            watermarks: NO_RECLAIM,
        }),
        lease_budget: 0.5,
    };
    let stores = scratch_node().open(&plan).context("opening the scratch node's G2 and G3")?;
    let weights = HostWeights::random(opts.shape, opts.seed);
    let model = format!("{}/seed-{}", opts.shape.name, opts.seed);
    let salt = Salt::derive(&SaltInputs { model: &model, ..Default::default() });
    let prefill_tokens_per_s = match opts.prefill_tokens_per_s {
        Some(rate) => rate,
        None => measure_prefill(make, &weights, layout, salt, opts).await?,
    };
    let first = make().context("the first worker's backend")?;
    let pool = stores.g2_pool().expect("the plan has G2");
    let registration = prepare(&first, pool).context("registering G2 with the device")?;
    let tiers = scratch_tiers(stores, opts, layout, salt, prefill_tokens_per_s);
    let node = Scratch { registration, tiers };
    let pages = held + 4;
    let mut a = Worker::new(Llama::new(first, &weights)?, node.tiers.clone(), pages, PolicyKind::Lru)?.with_id(0);
    let second = make().context("the second worker's backend")?;
    share(&node.registration, &second);
    let mut other = Worker::new(Llama::new(second, &weights)?, node.tiers.clone(), pages, PolicyKind::Lru)?.with_id(1);

    let names = ["cold", "G1", "other worker", "G2", "G3", "G1 + new", "G2 + new"];
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); names.len()];
    let mut hits = [PerTier::default(); 7];
    let vocab = opts.shape.vocab as u32;
    for r in 0..opts.runs.max(1) {
        let req = request(opts, vocab, r as u32 + 1);
        let mut record = |k: usize, out: GenOutcome| {
            times[k].push(out.ttft);
            hits[k] = out.hit_tokens;
        };
        record(0, first_token(&mut a, &req).await?);
        a.flush().await;
        record(1, first_token(&mut a, &req).await?);
        record(2, first_token(&mut other, &req).await?);
        other.reset();
        a.reset();
        record(3, first_token(&mut a, &req).await?);
        a.reset();
        node.tiers.g2.as_ref().expect("G2").evict_to(0, unix_millis());
        record(4, first_token(&mut a, &req).await?);
        // A's G1 and G2 hold the prefix again (loaded from G3 or recomputed and written through).
        record(5, first_token(&mut a, &extended(&req, new_tokens, vocab, 1)).await?);
        a.reset();
        record(6, first_token(&mut a, &extended(&req, new_tokens, vocab, 2)).await?);
        a.reset();
        // The next run starts from empty G1s and an empty G2.
        node.tiers.g2.as_ref().expect("G2").evict_to(0, unix_millis());
    }
    let mut rows: Vec<TtftRow> = names
        .iter()
        .zip(times.iter_mut())
        .zip(hits)
        .map(|((&scenario, t), hit_tokens)| {
            t.sort();
            TtftRow { scenario, median: t[t.len() / 2], min: t[0], hit_tokens }
        })
        .collect();
    let g2_new = rows.pop().expect("G2 + new");
    let g1_new = rows.pop().expect("G1 + new");
    let kv_bytes = (opts.prompt_tokens - 1) / b * layout.payload_bytes();
    drop((a, other));
    drop(node);
    let _ = std::fs::remove_file(&g3_path);
    Ok(CachedTtftReport {
        prompt_tokens: opts.prompt_tokens,
        kv_bytes,
        rows,
        overlap: OverlapRows { new_tokens, g1: g1_new, g2: g2_new },
        plain_copy: plain_copy(kv_bytes),
        prefill_tokens_per_s,
    })
}

/// The prompt of run `r` (each run its own tokens), generating one token.
fn request(opts: &CachedTtftOptions, vocab: u32, r: u32) -> GenRequest {
    let prompt = (0..opts.prompt_tokens as u32).map(|i| (i * 7919 + r * 104_729 + 11) % vocab).collect();
    GenRequest { regions: vec![(0..opts.prompt_tokens, RegionKind::Conversation)], ..GenRequest::greedy(prompt, 1) }
}

/// `req` with `new` tokens after its prompt (variant `v` of them), generating one token.
fn extended(req: &GenRequest, new: usize, vocab: u32, v: u32) -> GenRequest {
    let mut prompt = req.prompt.clone();
    prompt.extend((0..new as u32).map(|i| (i * 6151 + v * 7877 + 5) % vocab));
    GenRequest { regions: vec![(0..prompt.len(), RegionKind::Conversation)], ..GenRequest::greedy(prompt, 1) }
}

/// Prompt tokens per second of a cold prefill of the prompt's length, on a worker of its own with
/// no G2 or G3 (after one warm-up pass).
async fn measure_prefill<B: Backend>(
    make: &dyn Fn() -> anyhow::Result<B>,
    weights: &HostWeights,
    layout: BlockLayout,
    salt: Salt,
    opts: &CachedTtftOptions,
) -> anyhow::Result<f64> {
    let stores = scratch_node().open(&StorePlan::default()).context("a node without stores")?;
    let tiers = scratch_tiers(stores, opts, layout, salt, 0.0);
    let pages = opts.prompt_tokens.div_ceil(opts.block_tokens) + 4;
    let backend = make().context("the measuring worker's backend")?;
    let mut worker = Worker::new(Llama::new(backend, weights)?, tiers, pages, PolicyKind::Lru)?;
    let vocab = opts.shape.vocab as u32;
    // Run 0 warms up; prompts of other seeds share no block with the measured runs.
    first_token(&mut worker, &request(opts, vocab, 1_000)).await?;
    worker.reset();
    let out = first_token(&mut worker, &request(opts, vocab, 1_001)).await?;
    Ok(out.prefill_tokens as f64 / out.ttft.as_secs_f64().max(1e-9))
}

/// The scratch node: no KV events (nothing routes by them).
fn scratch_node() -> NodeBuilder {
    NodeBuilder::new(IndexConfig::default()).without_kv_events()
}

/// The scratch node's tiers over `stores`, loads weighed against `prefill_tokens_per_s`.
fn scratch_tiers(
    stores: NodeStores,
    opts: &CachedTtftOptions,
    layout: BlockLayout,
    salt: Salt,
    prefill_tokens_per_s: f64,
) -> Arc<NodeTiers> {
    let tiered = stores.tiers(TierSettings {
        block_tokens: opts.block_tokens,
        salt,
        layout,
        retention: RetentionSection::default(),
        write_batch: WriteBatch::default(),
        g3_write_rate: None,
        cost: CostModel {
            prefill: Prefill::rate(prefill_tokens_per_s),
            ..CostModel::unknown(opts.block_tokens, layout.image_bytes())
        },
        g4: false,
    });
    tiered.tiers().clone()
}

/// Runs `req` on `worker` to its first token.
async fn first_token<B: Backend>(worker: &mut Worker<B>, req: &GenRequest) -> anyhow::Result<GenOutcome> {
    let started = Instant::now();
    let out = worker.generate(req, &mut |_| true).await.context("generating")?;
    anyhow::ensure!(!out.tokens.is_empty(), "no token after {:?}", started.elapsed());
    Ok(out)
}

/// A plain host-to-host copy of `bytes` (the CPU backend's "link"), best of three.
pub fn memcpy_time(bytes: usize) -> Option<Duration> {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    (0..3)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&dst);
            t.elapsed()
        })
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynamo_kernels::CpuBackend;

    /// The `tiny` shape in 16-token f32 blocks, its G3 file in `dir`.
    fn tiny(
        dir: &tempfile::TempDir,
        prompt_tokens: usize,
        runs: usize,
        seed: u64,
        prefill_tokens_per_s: Option<f64>,
    ) -> CachedTtftOptions {
        CachedTtftOptions {
            shape: ModelShape::named("tiny").expect("tiny"),
            dtype: Dtype::F32,
            block_tokens: 16,
            prompt_tokens,
            runs,
            dir: dir.path().to_path_buf(),
            seed,
            prefill_tokens_per_s,
        }
    }

    /// The five scenarios on the CPU backend: each takes its prefix from the tier it names.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_scenario_takes_its_prefix_from_its_tier() {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = tiny(&dir, 16 * 12 + 5, 2, 3, Some(0.0));
        let report =
            run(&|| Ok(CpuBackend::default()), &|_: &CpuBackend, _: &HostPool| Ok(()), &|_, _| {}, &memcpy_time, &opts)
                .await
                .expect("the harness runs");
        let cached = 12 * 16;
        let hits = |s: &str| report.row(s).expect(s).hit_tokens;
        assert_eq!(hits("cold"), PerTier::default());
        assert_eq!(hits("G1"), PerTier { g1: cached, ..PerTier::default() });
        assert_eq!(hits("other worker"), PerTier { g2: cached, ..PerTier::default() });
        assert_eq!(hits("G2"), PerTier { g2: cached, ..PerTier::default() });
        assert_eq!(hits("G3"), PerTier { g3: cached, ..PerTier::default() });
        // The prompt's 12 complete blocks plus its 5-token tail and 24 new tokens.
        let overlap = &report.overlap;
        assert_eq!(overlap.new_tokens, 24);
        assert_eq!(overlap.g1.hit_tokens, PerTier { g1: cached, ..PerTier::default() });
        assert_eq!(overlap.g2.hit_tokens, PerTier { g2: cached, ..PerTier::default() });
        let hidden = overlap.hidden(report.plain_copy.expect("timed"));
        assert!((0.0..=1.0).contains(&hidden), "{hidden}");
        // Speed is the benchmark's business (on the device); here each ratio only has to exist.
        for scenario in ["G1", "other worker", "G2", "G3"] {
            let speedup = report.speedup(scenario).expect(scenario);
            assert!(speedup.is_finite() && speedup > 0.0, "{scenario}: {speedup}");
        }
        assert_eq!(report.kv_bytes, 12 * BlockLayout::for_model(&opts.shape, opts.dtype, 16).payload_bytes());
        let table = report.to_string();
        assert!(table.contains("plain pinned copy") && table.contains("other worker"), "{table}");
        assert!(table.contains("hidden behind compute"), "{table}");
        println!("{table}");
    }

    #[test]
    fn the_hidden_share_is_what_loading_did_not_add() {
        let row = |ms: u64| TtftRow {
            scenario: "x",
            median: Duration::from_millis(ms),
            min: Duration::from_millis(ms),
            hit_tokens: PerTier::default(),
        };
        let overlap = |g1: u64, g2: u64| OverlapRows { new_tokens: 1, g1: row(g1), g2: row(g2) };
        let copy = Duration::from_millis(80);
        assert!((overlap(100, 120).hidden(copy) - 0.75).abs() < 1e-9);
        assert_eq!(overlap(100, 100).hidden(copy), 1.0);
        assert_eq!(overlap(100, 200).hidden(copy), 0.0, "serial or worse hides nothing");
    }

    /// With no rate given, the harness measures the prefill rate first and weighs loads against it
    /// (G1 reuse needs no weighing).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_prefill_rate_is_measured_when_not_given() {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = tiny(&dir, 16 * 6 + 1, 1, 4, None);
        let report =
            run(&|| Ok(CpuBackend::default()), &|_: &CpuBackend, _: &HostPool| Ok(()), &|_, _| {}, &|_| None, &opts)
                .await
                .expect("the harness runs");
        assert!(report.prefill_tokens_per_s.is_finite() && report.prefill_tokens_per_s > 0.0, "{report}");
        assert_eq!(report.row("G1").expect("G1").hit_tokens, PerTier { g1: 6 * 16, ..PerTier::default() });
        assert_eq!(report.rows.len(), 5);
        assert!(!report.to_string().contains("plain pinned copy"), "no copy was timed");
    }
}
