//! The global prefix index: block operations per second for applying KV events and for lookups.
//!
//! Synthetic cluster: 4 nodes × 16 workers = 64 workers; 4096 conversations, each on one worker,
//! opening with one of 8 shared system prompts (16 blocks) and holding 40–240 blocks of context.
//! Every conversation's blocks are in its worker's G1 and its node's G2 and G3, so the index
//! starts with about 570 K distinct blocks and 1.7 M placements.
//!
//! - `apply` — one round of turns: each conversation stores a 16-block turn in its worker's G1,
//!   then every turn is removed again (so the state is the same each iteration; sequence numbers
//!   keep increasing). Throughput: blocks stored + removed.
//! - `find_matches` — every conversation's next prompt (its context plus a new 16-block turn)
//!   looked up once. Throughput: blocks in the queries.
//!
//! After criterion, a plain timed loop (best of a few repetitions) prints both rates in block
//! ops/s, plus lookups/s, so the numbers need no parsing of criterion's output. It also times
//! what a routing decision does with an answer: every worker's tier view, by one scan of the
//! answer per worker (`Matches::for_worker`) and by one pass for all (`Matches::views`), and prints
//! the ratio.
//!
//! Run with `cargo bench -p dynamo-benches --bench prefix_index`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use dynamo_actors::index::{
    Applied, IndexConfig, KvEvent, KvEventKind, Matches, PrefixIndex, SourceId, WorkerPrefix, WorkerViews,
};
use dynamo_config::TierName;
use dynamo_tiering::block::BlockHash;

const NODES: u16 = 4;
const WORKERS_PER_NODE: u16 = 16;
const CONVERSATIONS: usize = 4096;
const SYSTEM_PROMPTS: usize = 8;
const SYSTEM_BLOCKS: usize = 16;
const TURN_BLOCKS: usize = 16;
const WARM_UP: Duration = Duration::from_secs(1);
const MEASUREMENT: Duration = Duration::from_secs(3);
const TABLE_REPS: usize = 5;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn hash(&mut self) -> BlockHash {
        BlockHash((u128::from(self.next()) << 64) | u128::from(self.next()))
    }

    fn chain(&mut self, n: usize) -> Vec<BlockHash> {
        (0..n).map(|_| self.hash()).collect()
    }
}

struct Conversation {
    worker: SourceId,
    context: Vec<BlockHash>,
    next_turn: Vec<BlockHash>,
}

struct Workload {
    index: PrefixIndex,
    conversations: Vec<Conversation>,
    /// One round of turns stored then removed; `seq` is advanced before each replay.
    round: Vec<KvEvent>,
    round_blocks: u64,
    seq: Vec<u64>,
}

fn source_slot(source: SourceId) -> usize {
    usize::from(source.node) * usize::from(WORKERS_PER_NODE + 1) + usize::from(source.worker.min(WORKERS_PER_NODE))
}

fn workload() -> Workload {
    let mut rng = Rng(0x1D3_u64);
    let prompts: Vec<Vec<BlockHash>> = (0..SYSTEM_PROMPTS).map(|_| rng.chain(SYSTEM_BLOCKS)).collect();
    let conversations: Vec<Conversation> = (0..CONVERSATIONS)
        .map(|i| {
            let worker = SourceId::worker((i % usize::from(NODES)) as u16, (i / 4 % 16) as u16);
            let len = 40 + (rng.next() % 200) as usize;
            let mut context = prompts[i % SYSTEM_PROMPTS].clone();
            context.extend(rng.chain(len - SYSTEM_BLOCKS));
            Conversation { worker, context, next_turn: rng.chain(TURN_BLOCKS) }
        })
        .collect();

    let index = PrefixIndex::new(IndexConfig { max_blocks: 1 << 24, ..IndexConfig::default() });
    let mut seq = vec![0u64; usize::from(NODES) * usize::from(WORKERS_PER_NODE + 1)];
    let mut event = |source: SourceId, kind: KvEventKind| {
        let slot = source_slot(source);
        seq[slot] += 1;
        KvEvent { source, epoch: 1, seq: seq[slot], kind }
    };
    for c in &conversations {
        let node = SourceId::node_store(c.worker.node);
        for (source, tier) in [(c.worker, TierName::G1), (node, TierName::G2), (node, TierName::G3)] {
            let e = event(source, KvEventKind::Stored { hashes: c.context.clone(), parent: None, tier });
            index.apply(&e);
        }
    }
    // Sequence numbers are assigned each time a round is applied.
    let mut round = Vec::new();
    for c in &conversations {
        let kind =
            KvEventKind::Stored { hashes: c.next_turn.clone(), parent: c.context.last().copied(), tier: TierName::G1 };
        round.push(KvEvent { source: c.worker, epoch: 1, seq: 0, kind });
    }
    for c in &conversations {
        let kind = KvEventKind::Removed { hashes: c.next_turn.clone(), tier: TierName::G1 };
        round.push(KvEvent { source: c.worker, epoch: 1, seq: 0, kind });
    }
    let round_blocks = (2 * CONVERSATIONS * TURN_BLOCKS) as u64;
    Workload { index, conversations, round, round_blocks, seq }
}

impl Workload {
    /// Applies one round of turns (stored, then removed); the index ends as it started.
    fn apply_round(&mut self) {
        // Each source's events in the round follow its last applied one.
        let mut next = self.seq.clone();
        for e in &mut self.round {
            let slot = source_slot(e.source);
            next[slot] += 1;
            e.seq = next[slot];
        }
        self.seq = next;
        for e in &self.round {
            let applied = self.index.apply(e);
            assert_eq!(applied, Applied::Applied);
        }
    }

    fn queries(&self) -> (Vec<Vec<BlockHash>>, u64) {
        let queries: Vec<Vec<BlockHash>> =
            self.conversations.iter().map(|c| c.context.iter().chain(&c.next_turn).copied().collect()).collect();
        let blocks = queries.iter().map(|q| q.len() as u64).sum();
        (queries, blocks)
    }
}

fn lookup_all(index: &PrefixIndex, queries: &[Vec<BlockHash>], out: &mut Matches) -> usize {
    let mut total = 0;
    for q in queries {
        index.find_matches(q, out);
        total += out.longest();
    }
    total
}

/// Every worker's view of every query's answer, worker by worker (`views = None`) or in one pass.
fn all_views(
    index: &PrefixIndex,
    queries: &[Vec<BlockHash>],
    out: &mut Matches,
    views: Option<&mut WorkerViews>,
) -> usize {
    let workers: Vec<SourceId> =
        (0..NODES).flat_map(|n| (0..WORKERS_PER_NODE).map(move |w| SourceId::worker(n, w))).collect();
    let mut total = 0;
    let mut views = views;
    for q in queries {
        index.find_matches(q, out);
        let prefix = |v: WorkerPrefix| v.tiers.total();
        match views.as_deref_mut() {
            Some(views) => {
                out.views(views);
                total += workers.iter().map(|&w| prefix(views.for_worker(w))).sum::<usize>();
            }
            None => total += workers.iter().map(|&w| prefix(out.for_worker(w))).sum::<usize>(),
        }
    }
    total
}

/// Best rate of `f` (which performs `ops` operations per call) over [`TABLE_REPS`] repetitions.
fn best_rate(ops: u64, mut f: impl FnMut()) -> f64 {
    let mut best = 0.0f64;
    for _ in 0..TABLE_REPS {
        let start = Instant::now();
        f();
        best = best.max(ops as f64 / start.elapsed().as_secs_f64());
    }
    best
}

fn main() {
    let mut w = workload();
    let stats = w.index.stats();
    let (queries, query_blocks) = w.queries();
    let mut out = Matches::new();

    let mut criterion = Criterion::default().warm_up_time(WARM_UP).measurement_time(MEASUREMENT).configure_from_args();
    {
        let mut group = criterion.benchmark_group("prefix_index");
        group.throughput(Throughput::Elements(w.round_blocks));
        group.bench_function("apply", |b| b.iter(|| w.apply_round()));
        group.throughput(Throughput::Elements(query_blocks));
        group.bench_function("find_matches", |b| b.iter(|| black_box(lookup_all(&w.index, &queries, &mut out))));
        group.finish();
    }
    criterion.final_summary();

    let round_blocks = w.round_blocks;
    let apply = best_rate(round_blocks, || w.apply_round());
    let find = best_rate(query_blocks, || {
        black_box(lookup_all(&w.index, &queries, &mut out));
    });
    let lookups = find * queries.len() as f64 / query_blocks as f64;
    println!();
    println!(
        "prefix index: {} blocks, {} placements, {} locations; {} queries of {:.0} blocks on average",
        stats.blocks,
        stats.placements,
        stats.locations,
        queries.len(),
        query_blocks as f64 / queries.len() as f64
    );
    println!("  apply         {:>8.1} M block ops/s  (16-block stored and removed events)", apply / 1e6);
    println!("  find_matches  {:>8.1} M block ops/s  ({:.2} M lookups/s)", find / 1e6, lookups / 1e6);

    let mut views = WorkerViews::default();
    let n = queries.len() as u64;
    assert_eq!(
        all_views(&w.index, &queries, &mut out, None),
        all_views(&w.index, &queries, &mut out, Some(&mut views)),
        "both ways give every worker the same view"
    );
    let scan = best_rate(n, || {
        black_box(all_views(&w.index, &queries, &mut out, None));
    });
    let one_pass = best_rate(n, || {
        black_box(all_views(&w.index, &queries, &mut out, Some(&mut views)));
    });
    println!(
        "  lookup + {} workers' views: {:.1} k/s one pass vs {:.1} k/s a scan per worker: {:.2}×",
        NODES * WORKERS_PER_NODE,
        one_pass / 1e3,
        scan / 1e3,
        one_pass / scan
    );
    assert_eq!(w.index.stats().blocks, stats.blocks, "a round leaves the index as it found it");
}
