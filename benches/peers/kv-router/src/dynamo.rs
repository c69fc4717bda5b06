//! `dynamo-kv-router` 1.6.1's exact indexes as [`BenchIndex`] rows.
//!
//! How the stream maps onto its API (all from `dynamo_kv_router::{indexer, protocols}`):
//!
//! - a worker `w` is `WorkerWithDpRank { worker_id: w, dp_rank: 0 }`; events are
//!   `RouterEvent::new(w, KvCacheEvent { event_id, dp_rank: 0, data })` with `event_id` the op's
//!   index in the stream (increasing per worker);
//! - `Op::Stored` → `KvCacheEventData::Stored(KvCacheStoreData { parent_hash, start_position: None,
//!   blocks })`, one `KvCacheStoredBlockData { block_hash: ExternalSequenceBlockHash(seq),
//!   tokens_hash: LocalBlockHash(local), mm_extra_info: None }` per block — as vLLM's events arrive
//!   (no start position: the index finds the parent itself);
//! - `Op::Removed` → `KvCacheEventData::Removed(KvCacheRemoveData { block_hashes })`, leaves first;
//! - a lookup is `find_matches(&[LocalBlockHash], early_exit = false)`, which answers
//!   `OverlapScores { scores: worker → leading blocks matched, .. }`.
//!
//! Events and lookup inputs are built before the clock starts. The workload must be built with
//! [`dynamo_chain`]: `PositionalIndexer` recomputes sequence hashes with Dynamo's chaining function.
//!
//! The rows:
//!
//! - [`Radix`]: `RadixTree` (`Rc<RefCell>` nodes, `&mut self` writes): single-threaded only;
//!   `apply_event(RouterEvent)` and `find_matches(Vec<LocalBlockHash>, false)` on the replay thread.
//! - [`PositionalDirect`]: `PositionalIndexer` (jump 32, `SearchMode::Strided`) driven directly: its
//!   public `apply_event(&mut per-lane worker_blocks, RouterEvent, None)` on the replay thread that
//!   owns the worker, and `SyncIndexer::find_matches` inline — exactly what one `ThreadPoolIndexer`
//!   lane runs, without the channel hop. One or two lanes.
//! - [`ThreadPool`]: `ThreadPoolIndexer<T>` for `T` = `ConcurrentRadixTreeCompressed` or
//!   `PositionalIndexer`, as Dynamo deploys them: replay threads do lookups inline
//!   (`backend().find_matches`, what its `KvIndexerInterface::find_matches` does minus a `Vec`
//!   copy) and hand events to `enqueue_event`, which its own pool threads apply (sticky per worker);
//!   the timed pass ends with `flush()` (every queued event applied). `ConcurrentRadixTreeCompressed`
//!   cannot be driven any other way: its `apply_event` is private. Lookups therefore run concurrently
//!   with the pool's writes and may see it a little behind — its design; for the exactness check the
//!   replay thread waits for `flush()` after each request's events.

use std::future::Future;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use dynamo_kv_router::indexer::positional::{LevelIndex, PositionalIndexer, SearchMode};
use dynamo_kv_router::indexer::{RadixTree, SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent, WorkerWithDpRank,
};
use rustc_hash::FxHashMap;

use crate::index_replay::{BenchIndex, Lane};
use crate::index_workload::{Op, Workload, range};

/// Dynamo's chaining function (`protocols::compute_next_seq_hash`), for `WorkloadConfig::chain`.
pub fn dynamo_chain(parent: u64, local: u64) -> u64 {
    dynamo_kv_router::protocols::compute_next_seq_hash(parent, LocalBlockHash(local))
}

/// The block size the indexes are told (it only matters for hashing tokens, which is not used).
const KV_BLOCK_SIZE: u32 = 512;

/// `PositionalIndexer`'s jump size (the value its documentation uses).
pub const JUMP_SIZE: usize = 32;

/// The workload's local hashes as Dynamo's type, shared by all passes.
pub fn local_arena(workload: &Workload) -> Arc<[LocalBlockHash]> {
    workload.local_hashes.iter().map(|&h| LocalBlockHash(h)).collect()
}

fn router_event(workload: &Workload, op: &Op, event_id: u64) -> RouterEvent {
    let (worker, data) = match op {
        Op::Stored { worker, parent, blocks } => {
            let blocks = range(blocks)
                .map(|i| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(workload.seq_hashes[i]),
                    tokens_hash: LocalBlockHash(workload.local_hashes[i]),
                    mm_extra_info: None,
                })
                .collect();
            let parent_hash = parent.map(ExternalSequenceBlockHash);
            (worker, KvCacheEventData::Stored(KvCacheStoreData { parent_hash, start_position: None, blocks }))
        }
        Op::Removed { worker, blocks } => {
            let block_hashes = range(blocks).map(|i| ExternalSequenceBlockHash(workload.seq_hashes[i])).collect();
            (worker, KvCacheEventData::Removed(KvCacheRemoveData { block_hashes }))
        }
        Op::Lookup { .. } => unreachable!("lookups are not events"),
    };
    RouterEvent::new(u64::from(*worker), KvCacheEvent { event_id, data, dp_rank: 0 })
}

fn report(scores: &OverlapScores, answer: Option<&mut Vec<(u32, u32)>>) -> usize {
    if let Some(answer) = answer {
        answer.clear();
        answer.extend(scores.scores.iter().map(|(w, &n)| (w.worker_id as u32, n)));
    }
    scores.scores.len()
}

// ------------------------------------------------------------------------------------------------

/// `RadixTree`, single-threaded (not `Sync`: the harness only runs it on one lane).
pub struct Radix {
    tree: std::cell::RefCell<RadixTree>,
    local: Arc<[LocalBlockHash]>,
}

impl Radix {
    /// An empty tree.
    pub fn new(local: Arc<[LocalBlockHash]>) -> Self {
        Self { tree: std::cell::RefCell::new(RadixTree::new()), local }
    }
}

impl std::fmt::Debug for Radix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Radix")
    }
}

/// A replay thread's handle on a [`Radix`].
#[derive(Debug)]
pub struct RadixLane<'a>(&'a Radix);

impl BenchIndex for Radix {
    type Query = Vec<LocalBlockHash>;
    type Event = RouterEvent;
    type Lane<'a> = RadixLane<'a>;

    fn query(&self, _: &Workload, blocks: Range<u32>) -> Vec<LocalBlockHash> {
        self.local[range(&blocks)].to_vec()
    }

    fn event(&self, workload: &Workload, op: &Op, event_id: u64) -> RouterEvent {
        router_event(workload, op, event_id)
    }

    fn lane(&self) -> RadixLane<'_> {
        RadixLane(self)
    }
}

impl Lane for RadixLane<'_> {
    type Query = Vec<LocalBlockHash>;
    type Event = RouterEvent;

    fn apply(&mut self, event: RouterEvent) {
        self.0.tree.borrow_mut().apply_event(event).expect("RadixTree rejected an event");
    }

    fn lookup(&mut self, query: Vec<LocalBlockHash>, answer: Option<&mut Vec<(u32, u32)>>) -> usize {
        report(&self.0.tree.borrow().find_matches(query, false), answer)
    }
}

// ------------------------------------------------------------------------------------------------

/// `PositionalIndexer` driven directly, one `worker_blocks` map per lane (as each `ThreadPoolIndexer`
/// pool thread keeps one).
pub struct PositionalDirect {
    index: PositionalIndexer,
    local: Arc<[LocalBlockHash]>,
}

impl std::fmt::Debug for PositionalDirect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PositionalDirect")
    }
}

impl PositionalDirect {
    /// An empty index.
    pub fn new(local: Arc<[LocalBlockHash]>) -> Self {
        Self { index: PositionalIndexer::new_with_mode(JUMP_SIZE, SearchMode::Strided), local }
    }
}

/// A replay thread's handle on a [`PositionalDirect`]: the reverse map of the workers it owns.
pub struct PositionalLane<'a> {
    owner: &'a PositionalDirect,
    worker_blocks: FxHashMap<WorkerWithDpRank, LevelIndex>,
}

impl std::fmt::Debug for PositionalLane<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PositionalLane")
    }
}

impl BenchIndex for PositionalDirect {
    type Query = Range<usize>;
    type Event = RouterEvent;
    type Lane<'a> = PositionalLane<'a>;

    fn query(&self, _: &Workload, blocks: Range<u32>) -> Range<usize> {
        range(&blocks)
    }

    fn event(&self, workload: &Workload, op: &Op, event_id: u64) -> RouterEvent {
        router_event(workload, op, event_id)
    }

    fn lane(&self) -> PositionalLane<'_> {
        PositionalLane { owner: self, worker_blocks: FxHashMap::default() }
    }
}

impl Lane for PositionalLane<'_> {
    type Query = Range<usize>;
    type Event = RouterEvent;

    fn apply(&mut self, event: RouterEvent) {
        self.owner
            .index
            .apply_event(&mut self.worker_blocks, event, None)
            .expect("PositionalIndexer rejected an event");
    }

    fn lookup(&mut self, query: Range<usize>, answer: Option<&mut Vec<(u32, u32)>>) -> usize {
        report(&SyncIndexer::find_matches(&self.owner.index, &self.owner.local[query], false), answer)
    }
}

// ------------------------------------------------------------------------------------------------

/// A `ThreadPoolIndexer` over `T` with its own pool threads.
pub struct ThreadPool<T: SyncIndexer> {
    pool: ThreadPoolIndexer<T>,
    local: Arc<[LocalBlockHash]>,
}

impl<T: SyncIndexer> std::fmt::Debug for ThreadPool<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ThreadPool")
    }
}

impl<T: SyncIndexer> ThreadPool<T> {
    /// `backend` behind `ThreadPoolIndexer::new(backend, pool_threads, 512)`.
    pub fn new(backend: T, pool_threads: usize, local: Arc<[LocalBlockHash]>) -> Self {
        Self { pool: ThreadPoolIndexer::new(backend, pool_threads, KV_BLOCK_SIZE), local }
    }
}

/// A replay thread's handle on a [`ThreadPool`].
pub struct ThreadPoolLane<'a, T: SyncIndexer>(&'a ThreadPool<T>);

impl<T: SyncIndexer> std::fmt::Debug for ThreadPoolLane<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ThreadPoolLane")
    }
}

impl<T: SyncIndexer> BenchIndex for ThreadPool<T> {
    type Query = Range<usize>;
    type Event = RouterEvent;
    type Lane<'a> = ThreadPoolLane<'a, T>;

    fn query(&self, _: &Workload, blocks: Range<u32>) -> Range<usize> {
        range(&blocks)
    }

    fn event(&self, workload: &Workload, op: &Op, event_id: u64) -> RouterEvent {
        router_event(workload, op, event_id)
    }

    fn lane(&self) -> ThreadPoolLane<'_, T> {
        ThreadPoolLane(self)
    }

    fn finish(&self) {
        block_on(self.pool.flush());
    }
}

impl<T: SyncIndexer> Lane for ThreadPoolLane<'_, T> {
    type Query = Range<usize>;
    type Event = RouterEvent;

    fn apply(&mut self, event: RouterEvent) {
        self.0.pool.enqueue_event(event).expect("ThreadPoolIndexer is offline");
    }

    fn lookup(&mut self, query: Range<usize>, answer: Option<&mut Vec<(u32, u32)>>) -> usize {
        report(&self.0.pool.backend().find_matches(&self.0.local[query], false), answer)
    }

    fn settle(&mut self) {
        block_on(self.0.pool.flush());
    }
}

/// Runs a future to completion on this thread (`flush` only awaits `tokio::sync::oneshot`
/// receivers, which need no runtime).
fn block_on<F: Future>(future: F) -> F::Output {
    struct Unpark(Mutex<Option<std::thread::Thread>>);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            if let Some(t) = self.0.lock().expect("waker poisoned").as_ref() {
                t.unpark();
            }
        }
    }
    let waker = Waker::from(Arc::new(Unpark(Mutex::new(Some(std::thread::current())))));
    let mut cx = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        match future.as_mut().poll(&mut cx) {
            Poll::Ready(out) => return out,
            Poll::Pending => std::thread::park(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index_replay::{check_parallel, check_single};
    use crate::index_workload::WorkloadConfig;
    use dynamo_kv_router::ConcurrentRadixTreeCompressed;

    fn workload() -> Workload {
        let prompts: Vec<Vec<u64>> = (0..300u64)
            .map(|r| {
                let mut p = vec![0, 1 + r % 3];
                p.extend((0..r % 40).map(|k| 10 + (r % 3) * 100 + k));
                p.extend((0..r % 5).map(|k| 1000 + r * 10 + k));
                p
            })
            .collect();
        let config =
            WorkloadConfig { workers: 6, capacity_fraction: 0.3, chain: dynamo_chain, ..WorkloadConfig::new(6) };
        Workload::from_prompts(&prompts, config).unwrap()
    }

    #[test]
    fn every_row_is_exact() {
        let w = workload();
        assert!(w.removed_blocks > 0);
        let reference = w.reference_answers();
        let local = local_arena(&w);
        let lanes = w.lanes(2);
        let radix = check_single(&|| Radix::new(local.clone()), &w, &reference);
        assert!(radix.exact(), "{radix:?}");
        let positional = || PositionalDirect::new(local.clone());
        assert!(check_single(&positional, &w, &reference).exact());
        assert!(check_parallel(&positional, &w, &lanes, &reference).exact());
        let crtc = || ThreadPool::new(ConcurrentRadixTreeCompressed::new(), 2, local.clone());
        assert!(check_single(&crtc, &w, &reference).exact());
        assert!(check_parallel(&crtc, &w, &lanes, &reference).exact());
    }
}
