//! Replays a [`Workload`] through prefix indexes, times them and checks their answers.
//!
//! An index joins the comparison by implementing [`BenchIndex`] (the shared part, plus how it wants
//! its lookups and events: built before the clock starts, so no row pays for converting the stream)
//! and [`Lane`] (what one replay thread holds). The harness then:
//!
//! - **times** a pass: a fresh index, the stream's requests split into lanes
//!   ([`Workload::lanes`]: a request, lookup then events, goes to the lane of the worker it was routed
//!   to, so each worker's events stay in order on one thread), one thread per lane released together,
//!   from the first lane's start until the last lane is done and [`BenchIndex::finish`] (e.g.
//!   draining queues) has returned. The best of several passes counts, and the passes of all the
//!   rows of one workload take turns ([`time_rows`]): block ops/s = [`Workload::block_ops`] /
//!   time, requests/s = [`Workload::requests`] / time. One lane runs on the calling thread.
//! - **checks** a pass against [`Workload::reference_answers`]: after each request's events the lane
//!   calls [`Lane::settle`] (an index that applies events asynchronously waits for them there), and
//!   every lookup's answer must equal the reference — with several lanes, restricted to the workers
//!   of the lane doing the lookup, which are exactly the ones whose events are ordered before it.
//!
//! [`HashBaseline`] is a simple index of ours that exercises the harness end to end. This file uses
//! only `std`, so another workspace can include it with `#[path]` next to `index_workload.rs`.

use std::collections::HashMap;
use std::fmt;
use std::hint::black_box;
use std::ops::Range;
use std::sync::{Arc, Barrier, RwLock};
use std::time::{Duration, Instant};

use crate::index_workload::{Op, Workload, range};

/// A prefix index under test: the part shared by all replay threads.
pub trait BenchIndex {
    /// A lookup in the form the index takes it.
    type Query: Send;
    /// A `Stored` or `Removed` event in the form the index takes it.
    type Event: Send;
    /// What one replay thread uses to drive the index.
    type Lane<'a>: Lane<Query = Self::Query, Event = Self::Event>
    where
        Self: 'a;

    /// Builds the native lookup of the blocks `blocks` of `workload`'s arena (untimed).
    fn query(&self, workload: &Workload, blocks: Range<u32>) -> Self::Query;
    /// Builds the native event for a `Stored` or `Removed` op (untimed).
    fn event(&self, workload: &Workload, op: &Op, event_id: u64) -> Self::Event;
    /// A handle for one replay thread.
    fn lane(&self) -> Self::Lane<'_>;
    /// Called once after every lane is done, inside the timed region.
    fn finish(&self) {}
}

/// One replay thread's handle on an index.
pub trait Lane {
    /// See [`BenchIndex::Query`].
    type Query;
    /// See [`BenchIndex::Event`].
    type Event;

    /// Applies one event.
    fn apply(&mut self, event: Self::Event);
    /// Looks up one prompt and returns how many workers hold at least its first block. With
    /// `answer`, also fills it (cleared first) with `(worker, leading blocks held)` pairs, any order.
    fn lookup(&mut self, query: Self::Query, answer: Option<&mut Vec<(u32, u32)>>) -> usize;
    /// Makes the events applied so far visible to lookups (only the exactness check calls this).
    fn settle(&mut self) {}
}

/// One step of a lane's pre-built stream.
enum Step<Q, E> {
    Lookup(Q),
    Event(E),
    EndOfRequest,
}

fn steps<I: BenchIndex>(index: &I, workload: &Workload, requests: &[u32]) -> Vec<Step<I::Query, I::Event>> {
    let mut out = Vec::with_capacity(requests.len() * 3);
    for &r in requests {
        let start = workload.request_starts[r as usize] as u64;
        for (k, op) in workload.request_ops(r as usize).iter().enumerate() {
            out.push(match op {
                Op::Lookup { blocks } => Step::Lookup(index.query(workload, blocks.clone())),
                _ => Step::Event(index.event(workload, op, start + k as u64)),
            });
        }
        out.push(Step::EndOfRequest);
    }
    out
}

fn run_lane<L: Lane>(lane: &mut L, steps: Vec<Step<L::Query, L::Event>>) -> usize {
    let mut found = 0;
    for step in steps {
        match step {
            Step::Lookup(q) => found += lane.lookup(q, None),
            Step::Event(e) => lane.apply(e),
            Step::EndOfRequest => {}
        }
    }
    found
}

/// Times one pass of `workload` on a fresh index from `make`, on the calling thread.
pub fn timed_pass_single<I: BenchIndex>(make: &dyn Fn() -> I, workload: &Workload) -> Duration {
    let index = make();
    let all: Vec<u32> = (0..workload.requests as u32).collect();
    let steps = steps(&index, workload, &all);
    let mut lane = index.lane();
    let start = Instant::now();
    black_box(run_lane(&mut lane, steps));
    index.finish();
    let elapsed = start.elapsed();
    drop(lane);
    elapsed
}

/// Times one pass of `workload` on a fresh index from `make`, one thread per lane of `lanes`.
pub fn timed_pass_parallel<I>(make: &dyn Fn() -> I, workload: &Workload, lanes: &[Vec<u32>]) -> Duration
where
    I: BenchIndex + Sync,
{
    let index = make();
    let barrier = Barrier::new(lanes.len() + 1);
    // Each lane takes its own start after the barrier: with more threads than cores (an index's
    // helper threads), the lanes may run to their end before the calling thread is scheduled again.
    let (starts, end) = std::thread::scope(|s| {
        let handles: Vec<_> = lanes
            .iter()
            .map(|requests| {
                let steps = steps(&index, workload, requests);
                let (index, barrier) = (&index, &barrier);
                s.spawn(move || {
                    let mut lane = index.lane();
                    barrier.wait();
                    let start = Instant::now();
                    black_box(run_lane(&mut lane, steps));
                    start
                })
            })
            .collect();
        barrier.wait();
        let starts: Vec<Instant> = handles.into_iter().map(|h| h.join().expect("replay thread panicked")).collect();
        // What the index still does in the background (queued events) counts too.
        index.finish();
        (starts, Instant::now())
    });
    starts.into_iter().min().map_or(Duration::ZERO, |start| end.duration_since(start))
}

/// The outcome of an exactness check.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Check {
    /// Lookups compared.
    pub lookups: u64,
    /// `(worker, length)` pairs of the reference that were compared.
    pub pairs: u64,
    /// Lookups whose answer differed from the reference.
    pub mismatches: u64,
    /// The first difference, for the report.
    pub first: Option<String>,
}

impl Check {
    /// No lookup differed.
    pub fn exact(&self) -> bool {
        self.mismatches == 0
    }

    fn compare(&mut self, request: u32, mut got: Vec<(u32, u32)>, want: &[(u32, u32)], keep: impl Fn(u32) -> bool) {
        got.retain(|&(w, _)| keep(w));
        got.sort_unstable();
        let want: Vec<(u32, u32)> = want.iter().copied().filter(|&(w, _)| keep(w)).collect();
        self.lookups += 1;
        self.pairs += want.len() as u64;
        if got != want {
            self.mismatches += 1;
            if self.first.is_none() {
                self.first = Some(format!("request {request}: got {got:?}, want {want:?}"));
            }
        }
    }

    fn merge(&mut self, other: Check) {
        self.lookups += other.lookups;
        self.pairs += other.pairs;
        self.mismatches += other.mismatches;
        if self.first.is_none() {
            self.first = other.first;
        }
    }
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.exact() {
            write!(f, "exact ({} lookups, {} pairs)", self.lookups, self.pairs)
        } else {
            write!(f, "WRONG in {} of {} lookups", self.mismatches, self.lookups)
        }
    }
}

fn check_lane<L: Lane>(
    lane: &mut L,
    steps: Vec<Step<L::Query, L::Event>>,
    requests: &[u32],
    reference: &[Vec<(u32, u32)>],
    keep: impl Fn(u32) -> bool + Copy,
) -> Check {
    let mut check = Check::default();
    let mut next = requests.iter();
    let mut answer = Vec::new();
    for step in steps {
        match step {
            Step::Lookup(q) => {
                let r = *next.next().expect("one lookup per request");
                lane.lookup(q, Some(&mut answer));
                check.compare(r, std::mem::take(&mut answer), &reference[r as usize], keep);
            }
            Step::Event(e) => lane.apply(e),
            Step::EndOfRequest => lane.settle(),
        }
    }
    check
}

/// Replays `workload` on one thread with a fresh index and compares every lookup with `reference`.
pub fn check_single<I: BenchIndex>(make: &dyn Fn() -> I, workload: &Workload, reference: &[Vec<(u32, u32)>]) -> Check {
    let index = make();
    let all: Vec<u32> = (0..workload.requests as u32).collect();
    let steps = steps(&index, workload, &all);
    let mut lane = index.lane();
    check_lane(&mut lane, steps, &all, reference, |_| true)
}

/// Replays `workload` over `lanes` threads with a fresh index; each lookup is compared with
/// `reference` on the workers of its own lane.
pub fn check_parallel<I>(
    make: &dyn Fn() -> I,
    workload: &Workload,
    lanes: &[Vec<u32>],
    reference: &[Vec<(u32, u32)>],
) -> Check
where
    I: BenchIndex + Sync,
{
    let index = make();
    let n = lanes.len() as u32;
    let mut total = Check::default();
    std::thread::scope(|s| {
        let handles: Vec<_> = lanes
            .iter()
            .enumerate()
            .map(|(k, requests)| {
                let steps = steps(&index, workload, requests);
                let index = &index;
                s.spawn(move || {
                    let mut lane = index.lane();
                    check_lane(&mut lane, steps, requests, reference, move |w| w % n == k as u32)
                })
            })
            .collect();
        for h in handles {
            total.merge(h.join().expect("check thread panicked"));
        }
    });
    index.finish();
    total
}

/// A row checked for exact answers and ready to be timed by [`time_rows`].
pub struct Row<'a> {
    name: String,
    peer: bool,
    threads: usize,
    check: Check,
    workload: &'a Workload,
    pass: Box<dyn FnMut() -> Duration + 'a>,
}

impl fmt::Debug for Row<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Row").field("name", &self.name).field("threads", &self.threads).finish_non_exhaustive()
    }
}

impl Row<'_> {
    /// The same row, counting `helpers` threads of the index's own (pool or writer threads)
    /// besides its replay threads.
    pub fn with_helpers(mut self, helpers: usize) -> Self {
        self.threads += helpers;
        self
    }
}

/// A single-threaded row: its exactness pass runs now, its timed passes in [`time_rows`].
pub fn measure_single<'a, I: BenchIndex>(
    name: &str,
    peer: bool,
    make: &'a dyn Fn() -> I,
    workload: &'a Workload,
    reference: &[Vec<(u32, u32)>],
) -> Row<'a> {
    let check = check_single(make, workload, reference);
    let pass = Box::new(move || timed_pass_single(make, workload));
    Row { name: name.into(), peer, threads: 1, check, workload, pass }
}

/// A row over `lanes` threads: its exactness pass runs now, its timed passes in [`time_rows`].
pub fn measure_parallel<'a, I: BenchIndex + Sync>(
    name: &str,
    peer: bool,
    make: &'a dyn Fn() -> I,
    workload: &'a Workload,
    lanes: &'a [Vec<u32>],
    reference: &[Vec<(u32, u32)>],
) -> Row<'a> {
    let check = check_parallel(make, workload, lanes, reference);
    let pass = Box::new(move || timed_pass_parallel(make, workload, lanes));
    Row { name: name.into(), peer, threads: lanes.len(), check, workload, pass }
}

/// Times `rows` over `passes` rounds of one pass per row, in turn, and keeps each row's best pass:
/// a noisy stretch of a shared machine then falls on every row alike rather than on whichever
/// row was running, so the ratios between rows hold better than the absolute numbers.
pub fn time_rows(mut rows: Vec<Row<'_>>, passes: usize) -> Vec<Measurement> {
    let mut best = vec![Duration::MAX; rows.len()];
    for _ in 0..passes.max(1) {
        for (row, best) in rows.iter_mut().zip(&mut best) {
            *best = (*best).min((row.pass)());
        }
    }
    rows.into_iter()
        .zip(best)
        .map(|(row, time)| Measurement::new(row.name, row.peer, row.workload, row.threads, time, row.check))
        .collect()
}

/// Settings of a replay bench binary, from the environment and its arguments.
#[derive(Debug, Clone)]
pub struct BenchSettings {
    /// The trace (`DYNAMO_BENCH_TRACE`, default `<repo>/../shared/traces/mooncake_conversation.jsonl`).
    pub trace: std::path::PathBuf,
    /// Worker counts (`DYNAMO_BENCH_WORKERS`, comma-separated, default `8,64,256`).
    pub workers: Vec<u32>,
    /// Timed passes per row, best counts (`DYNAMO_BENCH_PASSES`, default 5); see [`time_rows`].
    pub passes: usize,
    /// Whether to measure at all: `false` under `--test` or `--list` (as `cargo test --benches` runs it).
    pub run: bool,
    /// Only the rows whose name contains one of these (`DYNAMO_BENCH_ROWS`, comma-separated, `=name`
    /// for an exact name; default every row).
    pub rows: Vec<String>,
}

impl BenchSettings {
    /// Reads the settings; `repo_root` locates the default trace.
    pub fn from_env(repo_root: &std::path::Path) -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let trace = var("DYNAMO_BENCH_TRACE")
            .map_or_else(|| repo_root.join("../shared/traces/mooncake_conversation.jsonl"), std::path::PathBuf::from);
        let workers = var("DYNAMO_BENCH_WORKERS")
            .map(|v| v.split(',').map(|w| w.trim().parse().expect("DYNAMO_BENCH_WORKERS: numbers")).collect())
            .unwrap_or_else(|| vec![8, 64, 256]);
        let passes = var("DYNAMO_BENCH_PASSES").map_or(5, |v| v.parse().expect("DYNAMO_BENCH_PASSES: a number"));
        let run = !std::env::args().any(|a| a == "--test" || a == "--list");
        let rows =
            var("DYNAMO_BENCH_ROWS").map_or_else(Vec::new, |v| v.split(',').map(|r| r.trim().to_owned()).collect());
        Self { trace, workers, passes, run, rows }
    }

    /// Whether the row `name` is selected by `DYNAMO_BENCH_ROWS` (a pattern that starts with `=`
    /// must match the whole name).
    pub fn wants(&self, name: &str) -> bool {
        self.rows.is_empty()
            || self
                .rows
                .iter()
                .any(|r| r.strip_prefix('=').map_or_else(|| name.contains(r.as_str()), |exact| name == exact))
    }

    /// The row `name`, measured by `measure` (its exactness pass runs then) if it is selected;
    /// rows not asked for are not built.
    pub fn row<'a>(&self, name: &str, measure: impl FnOnce(&str) -> Row<'a>) -> Option<Row<'a>> {
        self.wants(name).then(|| measure(name))
    }
}

/// Prints what a workload is made of.
pub fn describe(workload: &Workload) {
    let lanes = workload.lanes(2);
    let lane_ops: Vec<u64> =
        lanes.iter().map(|l| l.iter().map(|&r| workload.request_block_ops(r as usize)).sum()).collect();
    println!(
        "{} workers: {} requests, {} block ops = {} looked up + {} stored + {} removed; \
         {} unique blocks, capacity {} blocks/worker; 2-lane split {:?} block ops",
        workload.workers,
        workload.requests,
        workload.block_ops,
        workload.lookup_blocks,
        workload.stored_blocks,
        workload.removed_blocks,
        workload.unique_blocks,
        workload.capacity,
        lane_ops
    );
}

/// One measured row of the table.
#[derive(Debug, Clone)]
pub struct Measurement {
    /// Which index, and how it was driven.
    pub name: String,
    /// Whether the row is a peer's index (ratios are to the best peer row).
    pub peer: bool,
    /// Workers in the workload.
    pub workers: u32,
    /// Threads the row used: its replay threads (lanes) plus the index's own helper threads
    /// ([`Row::with_helpers`]); rows are compared within the same count.
    pub threads: usize,
    /// Best pass time.
    pub time: Duration,
    /// Block operations per second.
    pub block_ops_per_s: f64,
    /// Requests per second.
    pub requests_per_s: f64,
    /// The exactness check's outcome.
    pub check: Check,
}

impl Measurement {
    /// A row from its best pass time over `workload`.
    pub fn new(
        name: impl Into<String>,
        peer: bool,
        workload: &Workload,
        threads: usize,
        time: Duration,
        check: Check,
    ) -> Self {
        let secs = time.as_secs_f64().max(1e-9);
        Self {
            name: name.into(),
            peer,
            workers: workload.workers,
            threads,
            time,
            block_ops_per_s: workload.block_ops as f64 / secs,
            requests_per_s: workload.requests as f64 / secs,
            check,
        }
    }
}

/// The (workers, threads) groups of `rows`, in order of first appearance.
fn groups(rows: &[Measurement]) -> Vec<(u32, usize)> {
    let mut groups: Vec<(u32, usize)> = Vec::new();
    for key in rows.iter().map(|r| (r.workers, r.threads)) {
        if !groups.contains(&key) {
            groups.push(key);
        }
    }
    groups.sort_by_key(|&(workers, threads)| (workers, threads));
    groups
}

/// Prints the table: per worker count and thread count, every row with its ratio to the best peer
/// row of the same group (in block ops/s); then, per group, the best row whose name starts with
/// `headline` against the best peer row.
pub fn print_table(rows: &[Measurement], headline: &str) {
    println!(
        "\n{:>7} {:>7}  {:<52} {:>13} {:>12} {:>12}  exactness",
        "workers", "threads", "index", "block ops/s", "requests/s", "× best peer"
    );
    for (workers, threads) in groups(rows) {
        let group: Vec<&Measurement> = rows.iter().filter(|r| r.workers == workers && r.threads == threads).collect();
        let best_peer = group.iter().filter(|r| r.peer).map(|r| r.block_ops_per_s).fold(0.0, f64::max);
        for r in group {
            let ratio = if best_peer > 0.0 { format!("{:.2}×", r.block_ops_per_s / best_peer) } else { "—".into() };
            println!(
                "{:>7} {:>7}  {:<52} {:>13} {:>12} {:>12}  {}",
                workers,
                threads,
                r.name,
                si(r.block_ops_per_s),
                si(r.requests_per_s),
                ratio,
                r.check
            );
        }
    }
    print_summary(rows, headline);
}

/// Prints, per worker count and thread count, the block ops/s of the best row whose name starts
/// with `headline` divided by the best peer row's (nothing if the table has no peer rows).
fn print_summary(rows: &[Measurement], headline: &str) {
    let best = |peer: bool, workers: u32, threads: usize| {
        rows.iter()
            .filter(|r| r.workers == workers && r.threads == threads)
            .filter(|r| if peer { r.peer } else { !r.peer && r.name.starts_with(headline) })
            .max_by(|a, b| a.block_ops_per_s.total_cmp(&b.block_ops_per_s))
    };
    if !rows.iter().any(|r| r.peer) {
        return;
    }
    println!("\n{:>7} {:>7}  {:<44} {:<52} {:>12}", "workers", "threads", "ours", "best peer", "× best peer");
    for (workers, threads) in groups(rows) {
        let (Some(ours), Some(peer)) = (best(false, workers, threads), best(true, workers, threads)) else { continue };
        println!(
            "{:>7} {:>7}  {:<44} {:<52} {:>11.2}×",
            workers,
            threads,
            format!("{} ({})", ours.name, si(ours.block_ops_per_s)),
            format!("{} ({})", peer.name, si(peer.block_ops_per_s)),
            ours.block_ops_per_s / peer.block_ops_per_s
        );
    }
}

fn si(x: f64) -> String {
    if x >= 1e6 { format!("{:.2} M", x / 1e6) } else { format!("{:.1} k", x / 1e3) }
}

// ------------------------------------------------------------------------------------------------
// A simple baseline of ours.
// ------------------------------------------------------------------------------------------------

const BASELINE_SHARDS: usize = 16;

/// The simplest exact index: sequence hash → workers holding it, in 16 `RwLock<HashMap>` shards.
/// A lookup walks the prompt's chained hashes and drops a worker at the first block it lacks.
/// (Stand-in row of ours until `dynamo_actors::index::PrefixIndex` plugs in.)
#[derive(Debug)]
pub struct HashBaseline {
    shards: Vec<RwLock<HashMap<u64, Vec<u32>>>>,
    seq: Arc<[u64]>,
}

impl HashBaseline {
    /// An empty index over the arena `seq` of sequence hashes.
    pub fn new(seq: Arc<[u64]>) -> Self {
        Self { shards: (0..BASELINE_SHARDS).map(|_| RwLock::new(HashMap::new())).collect(), seq }
    }

    fn shard(&self, hash: u64) -> &RwLock<HashMap<u64, Vec<u32>>> {
        &self.shards[(hash >> 32) as usize % BASELINE_SHARDS]
    }
}

/// A baseline event: stored (`true`) or removed blocks of a worker.
#[derive(Debug)]
pub struct BaselineEvent {
    stored: bool,
    worker: u32,
    blocks: Range<usize>,
}

/// A replay thread's handle on a [`HashBaseline`].
#[derive(Debug)]
pub struct BaselineLane<'a> {
    index: &'a HashBaseline,
    candidates: Vec<u32>,
}

impl BenchIndex for HashBaseline {
    type Query = Range<usize>;
    type Event = BaselineEvent;
    type Lane<'a> = BaselineLane<'a>;

    fn query(&self, _: &Workload, blocks: Range<u32>) -> Range<usize> {
        range(&blocks)
    }

    fn event(&self, _: &Workload, op: &Op, _: u64) -> BaselineEvent {
        match op {
            Op::Stored { worker, blocks, .. } => BaselineEvent { stored: true, worker: *worker, blocks: range(blocks) },
            Op::Removed { worker, blocks } => BaselineEvent { stored: false, worker: *worker, blocks: range(blocks) },
            Op::Lookup { .. } => unreachable!("lookups are not events"),
        }
    }

    fn lane(&self) -> BaselineLane<'_> {
        BaselineLane { index: self, candidates: Vec::new() }
    }
}

impl Lane for BaselineLane<'_> {
    type Query = Range<usize>;
    type Event = BaselineEvent;

    fn apply(&mut self, e: BaselineEvent) {
        for &h in &self.index.seq[e.blocks] {
            let mut shard = self.index.shard(h).write().expect("baseline shard poisoned");
            if e.stored {
                let workers = shard.entry(h).or_default();
                if !workers.contains(&e.worker) {
                    workers.push(e.worker);
                }
            } else if let Some(workers) = shard.get_mut(&h) {
                workers.retain(|&w| w != e.worker);
                if workers.is_empty() {
                    shard.remove(&h);
                }
            }
        }
    }

    fn lookup(&mut self, q: Range<usize>, mut answer: Option<&mut Vec<(u32, u32)>>) -> usize {
        let seq = &self.index.seq[q];
        if let Some(a) = answer.as_deref_mut() {
            a.clear();
        }
        let Some(&first) = seq.first() else { return 0 };
        self.candidates.clear();
        if let Some(w) = self.index.shard(first).read().expect("baseline shard poisoned").get(&first) {
            self.candidates.extend_from_slice(w);
        }
        let found = self.candidates.len();
        for (i, &h) in seq.iter().enumerate().skip(1) {
            if self.candidates.is_empty() {
                break;
            }
            let shard = self.index.shard(h).read().expect("baseline shard poisoned");
            let here = shard.get(&h).map_or(&[][..], Vec::as_slice);
            self.candidates.retain(|w| {
                let keep = here.contains(w);
                if !keep && let Some(a) = answer.as_deref_mut() {
                    a.push((*w, i as u32));
                }
                keep
            });
        }
        if let Some(a) = answer {
            a.extend(self.candidates.iter().map(|&w| (w, seq.len() as u32)));
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index_workload::WorkloadConfig;

    fn workload() -> Workload {
        let prompts: Vec<Vec<u64>> = (0..200u64)
            .map(|r| {
                let mut p = vec![0, 1 + r % 3];
                p.extend((0..r % 7).map(|k| 10 + (r % 3) * 100 + k));
                p.extend((0..r % 4).map(|k| 1000 + r * 10 + k));
                p
            })
            .collect();
        let mut config = WorkloadConfig::new(5);
        config.capacity_fraction = 0.3;
        Workload::from_prompts(&prompts, config).unwrap()
    }

    #[test]
    fn baseline_is_exact_on_one_and_two_lanes() {
        let w = workload();
        assert!(w.removed_blocks > 0);
        let reference = w.reference_answers();
        let seq: Arc<[u64]> = w.seq_hashes.clone().into();
        let make = || HashBaseline::new(seq.clone());
        let one = check_single(&make, &w, &reference);
        assert!(one.exact(), "{one:?}");
        assert_eq!(one.lookups, w.requests);
        let two = check_parallel(&make, &w, &w.lanes(2), &reference);
        assert!(two.exact(), "{two:?}");
        assert_eq!(two.lookups, w.requests);
        assert!(timed_pass_parallel(&make, &w, &w.lanes(2)) > Duration::ZERO);
        assert!(timed_pass_single(&make, &w) > Duration::ZERO);
    }

    #[test]
    fn rows_take_turns_and_keep_their_best_pass() {
        let w = workload();
        let reference = w.reference_answers();
        let seq: Arc<[u64]> = w.seq_hashes.clone().into();
        let make = || HashBaseline::new(seq.clone());
        let lanes = w.lanes(2);
        let rows = vec![
            measure_single("one", false, &make, &w, &reference),
            measure_parallel("two", true, &make, &w, &lanes, &reference).with_helpers(1),
        ];
        let measured = time_rows(rows, 3);
        let summary: Vec<(&str, bool, usize, bool)> =
            measured.iter().map(|m| (m.name.as_str(), m.peer, m.threads, m.check.exact())).collect();
        assert_eq!(summary, [("one", false, 1, true), ("two", true, 3, true)]);
        for m in &measured {
            assert!(m.time > Duration::ZERO && m.time < Duration::MAX, "{m:?}");
            assert!((m.block_ops_per_s - w.block_ops as f64 / m.time.as_secs_f64()).abs() < 1e-6 * m.block_ops_per_s);
        }

        // The passes interleave: row A, row B, row A, row B…
        let order = std::cell::RefCell::new(Vec::new());
        let order = &order;
        let row = |name: &'static str| Row {
            name: name.into(),
            peer: false,
            threads: 1,
            check: Check::default(),
            workload: &w,
            pass: Box::new(move || {
                order.borrow_mut().push(name);
                Duration::from_millis(if order.borrow().len() == 3 { 1 } else { 5 })
            }),
        };
        let measured = time_rows(vec![row("a"), row("b")], 2);
        assert_eq!(*order.borrow(), ["a", "b", "a", "b"]);
        // The third pass (row a's second) was its fastest; row b kept 5 ms.
        assert_eq!(
            measured.iter().map(|m| m.time).collect::<Vec<_>>(),
            [Duration::from_millis(1), Duration::from_millis(5)]
        );
    }
}
