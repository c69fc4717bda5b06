//! Our global prefix index, [`dynamo_actors::index::PrefixIndex`], as a [`BenchIndex`] row.
//!
//! How the stream maps onto its API:
//!
//! - worker `w` is the source `SourceId::worker(0, w)`, its blocks in `G1`; each worker's events are
//!   numbered `1, 2, 3, …` in epoch 1 as the index requires (the harness builds a lane's events in
//!   stream order and keeps each worker on one lane, so the numbering follows the worker's order);
//! - a block is `BlockHash(seq)`: the workload's 64-bit chained sequence hash, widened;
//! - `Op::Stored` → `KvEventKind::Stored { hashes, parent, tier: G1 }`, `Op::Removed` →
//!   `KvEventKind::Removed`, one `PrefixIndex::apply` per event (every block of an event under one
//!   lock acquisition);
//! - a lookup is `PrefixIndex::find_matches` over the prompt's chained hashes into a per-lane
//!   reusable `Matches`; the answer is `(worker, leading blocks)` per location.
//!
//! [`Ours`] runs lookups and events inline on the replay threads: with two lanes, two threads
//! share the index (lookups under its shards' read locks, an event under its source's shard's
//! write lock), and every answer is exact for the lane's own workers — there is no queue to
//! settle. [`Ours::with_writer`] is the node's other way of feeding the index, the way Dynamo's
//! `ThreadPoolIndexer` works: the replay threads look up and hand events to an
//! [`IndexWriter`](dynamo_actors::index::IndexWriter) with its own threads (named in the row), and
//! `settle`/`finish` wait for them to be applied. `DYNAMO_BENCH_SHARDS` overrides the index's
//! default shard count.
//!
//! This file needs `dynamo-actors`, `dynamo-config` and `dynamo-tiering` next to the harness
//! (`crate::index_replay`, `crate::index_workload`), so the peer workspace includes it by path too.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dynamo_actors::index::{IndexConfig, IndexWriter, KvEvent, KvEventKind, Matches, PrefixIndex, SourceId};
use dynamo_config::TierName;
use dynamo_tiering::block::BlockHash;

use crate::index_replay::{BenchIndex, Lane};
use crate::index_workload::{Op, Workload, range};

/// The workload's sequence hashes as block hashes, shared by all passes.
pub fn block_arena(workload: &Workload) -> Arc<[BlockHash]> {
    workload.seq_hashes.iter().map(|&h| block_hash(h)).collect()
}

fn block_hash(seq: u64) -> BlockHash {
    BlockHash(u128::from(seq))
}

/// A fresh [`PrefixIndex`] over a workload's blocks, with per-worker event numbering; events are
/// applied on the replay threads, or through an [`IndexWriter`] ([`Ours::with_writer`]).
#[derive(Debug)]
pub struct Ours {
    index: Arc<PrefixIndex>,
    arena: Arc<[BlockHash]>,
    /// The last `seq` given to each worker's events.
    seq: Vec<AtomicU64>,
    writer: Option<IndexWriter>,
}

impl Ours {
    /// An empty index for `workers` workers over `arena` (from [`block_arena`]), of one shard
    /// per thread that will apply events at the same time (`DYNAMO_BENCH_SHARDS` overrides it).
    pub fn new(arena: Arc<[BlockHash]>, workers: u32, appliers: usize) -> Self {
        let config = IndexConfig { max_blocks: 1 << 26, ..IndexConfig::default() };
        let shards = std::env::var("DYNAMO_BENCH_SHARDS").ok().and_then(|v| v.parse().ok()).unwrap_or(appliers);
        let index = PrefixIndex::with_shards(config, shards);
        Self { index: Arc::new(index), arena, seq: (0..workers).map(|_| AtomicU64::new(0)).collect(), writer: None }
    }

    /// Like [`Ours::new`], with its events applied by `threads` writer threads (and as many
    /// shards).
    pub fn with_writer(arena: Arc<[BlockHash]>, workers: u32, threads: usize) -> Self {
        let mut ours = Self::new(arena, workers, threads);
        ours.writer = Some(IndexWriter::spawn(ours.index.clone(), threads, None).expect("starting the writer threads"));
        ours
    }

    /// The index (for its stats).
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    fn source(worker: u32) -> SourceId {
        SourceId::worker(0, u16::try_from(worker).expect("fewer than 65 536 workers"))
    }

    fn flush(&self) {
        if let Some(writer) = &self.writer {
            writer.flush();
        }
    }
}

/// A replay thread's handle on [`Ours`]: a reusable lookup result.
#[derive(Debug)]
pub struct OursLane<'a> {
    owner: &'a Ours,
    matches: Matches,
}

impl BenchIndex for Ours {
    type Query = Range<usize>;
    type Event = KvEvent;
    type Lane<'a> = OursLane<'a>;

    fn query(&self, _: &Workload, blocks: Range<u32>) -> Range<usize> {
        range(&blocks)
    }

    fn event(&self, _: &Workload, op: &Op, _: u64) -> KvEvent {
        let (worker, kind) = match op {
            Op::Stored { worker, parent, blocks } => {
                let hashes = self.arena[range(blocks)].to_vec();
                (*worker, KvEventKind::Stored { hashes, parent: parent.map(block_hash), tier: TierName::G1 })
            }
            Op::Removed { worker, blocks } => {
                (*worker, KvEventKind::Removed { hashes: self.arena[range(blocks)].to_vec(), tier: TierName::G1 })
            }
            Op::Lookup { .. } => unreachable!("lookups are not events"),
        };
        let seq = self.seq[worker as usize].fetch_add(1, Ordering::Relaxed) + 1;
        KvEvent { source: Self::source(worker), epoch: 1, seq, kind }
    }

    fn lane(&self) -> OursLane<'_> {
        OursLane { owner: self, matches: Matches::new() }
    }

    fn finish(&self) {
        self.flush();
    }
}

impl Lane for OursLane<'_> {
    type Query = Range<usize>;
    type Event = KvEvent;

    fn apply(&mut self, event: KvEvent) {
        match &self.owner.writer {
            Some(writer) => writer.send(event),
            None => {
                let applied = self.owner.index.apply(&event);
                debug_assert!(matches!(applied, dynamo_actors::index::Applied::Applied), "{applied:?}");
            }
        }
    }

    fn lookup(&mut self, query: Range<usize>, answer: Option<&mut Vec<(u32, u32)>>) -> usize {
        self.owner.index.find_matches(&self.owner.arena[query], &mut self.matches);
        let found = self.matches.locations();
        if let Some(answer) = answer {
            answer.clear();
            answer.extend(found.iter().map(|m| (u32::from(m.location.source.worker), m.blocks as u32)));
        }
        found.len()
    }

    fn settle(&mut self) {
        self.owner.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index_replay::{check_parallel, check_single, timed_pass_parallel};
    use crate::index_workload::WorkloadConfig;

    #[test]
    fn prefix_index_is_exact_on_one_and_two_lanes() {
        let prompts: Vec<Vec<u64>> = (0..300u64)
            .map(|r| {
                let mut p = vec![0, 1 + r % 3];
                p.extend((0..r % 40).map(|k| 10 + (r % 3) * 100 + k));
                p.extend((0..r % 5).map(|k| 1000 + r * 10 + k));
                p
            })
            .collect();
        let mut config = WorkloadConfig::new(6);
        config.capacity_fraction = 0.3;
        let w = Workload::from_prompts(&prompts, config).unwrap();
        assert!(w.removed_blocks > 0);
        let reference = w.reference_answers();
        let arena = block_arena(&w);
        let make = || Ours::new(arena.clone(), w.workers, 1);
        let one = check_single(&make, &w, &reference);
        assert!(one.exact(), "{one:?}");
        let make = || Ours::new(arena.clone(), w.workers, 2);
        let two = check_parallel(&make, &w, &w.lanes(2), &reference);
        assert!(two.exact(), "{two:?}");
        assert!(timed_pass_parallel(&make, &w, &w.lanes(2)) > std::time::Duration::ZERO);
        for threads in [1, 2] {
            let make = || Ours::with_writer(arena.clone(), w.workers, threads);
            let one = check_single(&make, &w, &reference);
            assert!(one.exact(), "{threads} writer threads: {one:?}");
            let two = check_parallel(&make, &w, &w.lanes(2), &reference);
            assert!(two.exact(), "{threads} writer threads, 2 lanes: {two:?}");
        }
    }
}
