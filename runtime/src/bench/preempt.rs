//! `dynamo-node bench preempt`: what it costs to bring back a request that G1 ran out of room
//! for, resumed by loading its blocks back from the tiers (what the node does) against
//! recomputing them (vLLM's default preemption), on the reference engine on this CPU.
//!
//! One worker with a G1 too small for its burst: `--streams` requests of `--prompt-tokens` each
//! are admitted together and decode `--max-tokens` tokens; their prompts fit in G1, their answers
//! do not, so the lowest-priority (latest) request yields its pages while decoding. Its blocks are
//! in G2 by write-through; once G1 has room it resumes — loading them, or recomputing its whole
//! context — and the bench times the resumed request's next token from the moment it resumed.
//! Both runs serve the same requests and must answer the same tokens; the report prints the
//! times side by side and their ratio, recompute ÷ load.

use std::fmt;
use std::time::Duration;

use anyhow::{Context, ensure};
use clap::Args;
use dynamo_actors::builder::{G2Plan, NO_RECLAIM, NodeBuilder, StorePlan, TierSettings};
use dynamo_actors::cost::CostModel;
use dynamo_actors::index::IndexConfig;
use dynamo_actors::tiers::WriteBatch;
use dynamo_actors::worker::{GenRequest, JobEvent, PreemptionStats, Resume, Ticket, Worker};
use dynamo_config::{Dtype, ModelShape, RetentionSection};
use dynamo_kernels::CpuBackend;
use dynamo_kernels::model::{HostWeights, Llama};
use dynamo_tiering::block::{BlockLayout, Salt, SaltInputs};
use dynamo_tiering::g2::{HostPoolOptions, MlockPolicy, align_up};
use dynamo_tiering::registry::PolicyKind;

/// Options of `bench preempt`.
#[derive(Debug, Clone, Args)]
pub struct BenchPreemptArgs {
    /// Model shape, with seeded random weights.
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Requests admitted together.
    #[arg(long, default_value_t = 2)]
    pub streams: usize,
    /// Prompt tokens of each.
    #[arg(long, default_value_t = 4096)]
    pub prompt_tokens: usize,
    /// Tokens each generates.
    #[arg(long, default_value_t = 48)]
    pub max_tokens: usize,
    /// Tokens per block.
    #[arg(long, default_value_t = 32)]
    pub block_tokens: usize,
    /// Times the burst is served per mode; the median counts.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
}

/// One mode's runs.
#[derive(Debug, Clone)]
pub struct ModeRow {
    /// How the preempted request came back.
    pub resume: Resume,
    /// Requests preempted per run.
    pub preempted: usize,
    /// Tokens a resumed request did not recompute, per run.
    pub cached_tokens: usize,
    /// Tokens it recomputed, per run.
    pub computed_tokens: usize,
    /// Median time from resuming to the next token.
    pub resume_to_token: Duration,
    /// Median time from preemption to the next token (waiting for room included).
    pub preempted_for: Duration,
}

/// What the bench measured.
#[derive(Debug, Clone)]
pub struct PreemptReport {
    /// The options.
    pub args: BenchPreemptArgs,
    /// G1 pages of the worker.
    pub pages: usize,
    /// Loading, then recomputing.
    pub rows: Vec<ModeRow>,
}

impl PreemptReport {
    /// Recompute's time to the next token over loading's.
    pub fn ratio(&self) -> Option<f64> {
        let of = |r: Resume| self.rows.iter().find(|m| m.resume == r).map(|m| m.resume_to_token.as_secs_f64());
        Some(of(Resume::Recompute)? / of(Resume::Load)?.max(1e-9))
    }
}

impl fmt::Display for PreemptReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = &self.args;
        writeln!(
            f,
            "bench preempt: model {} (random weights, f32, CPU), {} requests of {} prompt tokens decoding {} each, \
             G1 {} pages of {} tokens (their prompts fit, their answers do not), G2 holds everything",
            a.model, a.streams, a.prompt_tokens, a.max_tokens, self.pages, a.block_tokens
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "| resume by | preempted | tokens not recomputed | tokens recomputed | resume → next token ms | preemption → next token ms |"
        )?;
        writeln!(f, "|---|--:|--:|--:|--:|--:|")?;
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        for r in &self.rows {
            let name = match r.resume {
                Resume::Load => "load (ours)",
                Resume::Recompute => "recompute (vLLM's default)",
            };
            writeln!(
                f,
                "| {name} | {} | {} | {} | {:.1} | {:.1} |",
                r.preempted,
                r.cached_tokens,
                r.computed_tokens,
                ms(r.resume_to_token),
                ms(r.preempted_for)
            )?;
        }
        if let Some(ratio) = self.ratio() {
            writeln!(f, "\ntime to the preempted request's next token, recompute ÷ load: {ratio:.1}×")?;
        }
        Ok(())
    }
}

/// Runs the bench.
pub fn run(args: &BenchPreemptArgs) -> anyhow::Result<PreemptReport> {
    let shape =
        ModelShape::named(&args.model).with_context(|| format!("--model {:?} is not a known shape", args.model))?;
    ensure!(args.streams >= 2, "--streams must be at least 2 (one request yields to the others)");
    ensure!(
        args.prompt_tokens >= args.block_tokens && args.max_tokens >= 2,
        "a prompt of a block or more, 2 tokens or more"
    );
    let b = args.block_tokens;
    // Every prompt fits with a block to spare each; the answers need more.
    let pages = args.streams * (args.prompt_tokens.div_ceil(b) + 1);
    let weights = HostWeights::random(shape, 7);
    let layout = BlockLayout::for_model(&shape, Dtype::F32, b);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().context("a runtime")?;
    let mut rows = Vec::new();
    let mut answers = None;
    for resume in [Resume::Load, Resume::Recompute] {
        let mut runs = Vec::new();
        for r in 0..args.repeat.max(1) {
            let (stats, tokens) = runtime.block_on(burst(args, &weights, layout, pages, resume, r as u32))?;
            ensure!(stats.preempted > 0, "G1 did not overflow: nothing was preempted ({resume:?})");
            match &answers {
                None => answers = Some((r, tokens.clone())),
                Some((first, want)) if *first == r => {
                    ensure!(&tokens == want, "resuming by {resume:?} changed the answers")
                }
                Some(_) => {}
            }
            runs.push(stats);
        }
        let median = |f: &dyn Fn(&PreemptionStats) -> Vec<Duration>| {
            let mut all: Vec<Duration> = runs.iter().flat_map(f).collect();
            all.sort();
            all.get(all.len() / 2).copied().unwrap_or_default()
        };
        let first = &runs[0];
        rows.push(ModeRow {
            resume,
            preempted: first.preempted,
            cached_tokens: first.resumed_cached_tokens,
            computed_tokens: first.resumed_computed_tokens,
            resume_to_token: median(&|s| s.resume_latency.clone()),
            preempted_for: median(&|s| s.preempted_for.clone()),
        });
    }
    Ok(PreemptReport { args: args.clone(), pages, rows })
}

/// Serves one burst (variant `variant` of its prompts) on a fresh worker; its preemption stats and
/// every request's tokens.
async fn burst(
    args: &BenchPreemptArgs,
    weights: &HostWeights,
    layout: BlockLayout,
    pages: usize,
    resume: Resume,
    variant: u32,
) -> anyhow::Result<(PreemptionStats, Vec<Vec<u32>>)> {
    let b = args.block_tokens;
    // G2 holds every block of the burst.
    let blocks = args.streams * (args.prompt_tokens + args.max_tokens).div_ceil(b) + 8;
    let plan = StorePlan {
        g2: Some(G2Plan {
            pool: HostPoolOptions {
                slot_bytes: align_up(layout.image_bytes()),
                slots: blocks as u32 + 8,
                mlock: MlockPolicy::Try,
            },
            resident: blocks,
            policy: PolicyKind::Lru,
            watermarks: NO_RECLAIM,
            shared: false,
        }),
        engines_g2: None,
        g3: None,
        lease_budget: 0.5,
    };
    // A node of the builder's up to its tiers, whose one worker the bench drives itself.
    let stores = NodeBuilder::new(IndexConfig::default()).without_kv_events().open(&plan).context("the G2 pool")?;
    let tiered = stores.tiers(TierSettings {
        block_tokens: b,
        salt: Salt::derive(&SaltInputs { model: "bench-preempt", ..Default::default() }),
        layout,
        retention: RetentionSection::default(),
        write_batch: WriteBatch::default(),
        g3_write_rate: None,
        // Unknown rates: loads are taken (the point is what they cost).
        cost: CostModel::unknown(b, layout.image_bytes()),
        g4: false,
    });
    let tiers = tiered.tiers().clone();
    let model = Llama::new(CpuBackend::default(), weights).context("the model")?;
    let mut worker = Worker::new(model, tiers, pages, PolicyKind::Lru)?.with_resume(resume);
    let vocab = weights.shape.vocab as u32;
    let mut receivers = Vec::new();
    for s in 0..args.streams as u32 {
        let prompt = (0..args.prompt_tokens as u32)
            .map(|i| (i * 7919 + s * 104_729 + variant * 15_485_863 + 11) % vocab)
            .collect();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        worker.admit(Ticket::local(GenRequest::greedy(prompt, args.max_tokens), tx)).await;
        receivers.push(rx);
    }
    while worker.running() > 0 {
        worker.step().await;
    }
    let mut answers = Vec::new();
    for mut rx in receivers {
        let mut tokens = None;
        while let Ok(event) = rx.try_recv() {
            match event {
                JobEvent::Done(outcome) => tokens = Some(outcome.tokens),
                JobEvent::Failed(e) => anyhow::bail!("a request failed: {e}"),
                JobEvent::Event(_) => {}
            }
        }
        answers.push(tokens.context("a request was not answered")?);
    }
    Ok((worker.preemption_stats().clone(), answers))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_burst_preempts_and_both_modes_answer_alike() {
        let args = BenchPreemptArgs {
            model: "tiny".into(),
            streams: 2,
            prompt_tokens: 64,
            max_tokens: 20,
            block_tokens: 16,
            repeat: 1,
        };
        let report = run(&args).expect("bench");
        assert_eq!(report.rows.len(), 2);
        let load = &report.rows[0];
        assert_eq!(load.resume, Resume::Load);
        assert!(load.preempted >= 1 && load.cached_tokens > 0, "{load:?}");
        assert_eq!(report.rows[1].cached_tokens, 0, "recompute loads nothing");
        assert!(report.ratio().is_some_and(|r| r > 0.0));
        let text = report.to_string();
        assert!(text.contains("recompute ÷ load"), "{text}");
    }
}
