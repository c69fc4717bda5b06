//! The Mooncake conversation trace replayed through our prefix index harness and NVIDIA Dynamo's
//! `dynamo-kv-router` 1.6.1 indexes, side by side in one run.
//!
//! For 8, 64 and 256 workers the same fixed stream (`index_workload`: per request a lookup of the
//! prompt, then the routed worker's `Removed` and `Stored` events from its LRU capacity model) is
//! replayed by every row; each row is first checked against the brute-force reference answers, then
//! timed (best of `DYNAMO_BENCH_PASSES`, default 5). Columns: block ops/s (looked-up + stored +
//! removed blocks per second), requests/s, and the ratio to the best Dynamo row of the same group.
//!
//! Threads: a row replays the whole stream on one thread ("1 replay"), or splits it into two lanes
//! by the routed worker's parity ("2 replay": a request's lookup and events on its worker's lane),
//! so every worker's events stay ordered on one thread and both lanes carry about half the block
//! ops. Some indexes also run helper threads of their own that apply the events the replay threads
//! hand them: Dynamo's `ThreadPoolIndexer` its pool, ours an `IndexWriter`. The "threads" column
//! counts both, and rows are compared only with rows of the same count, so neither side is
//! measured against the other with more threads. `RadixTree` is single-threaded (`Rc` nodes,
//! `&mut self` writes), so it has only a 1-thread row; `ConcurrentRadixTreeCompressed` runs only
//! behind its pool, so it has no 1-thread row. See `kv_router_peer_bench::dynamo` for how each
//! index is driven.
//!
//! `cargo bench --bench index_vs_kv_router` in `benches/peers/kv-router`.

use std::path::Path;
use std::sync::Arc;

use dynamo_kv_router::indexer::positional::SearchMode;
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, PositionalIndexer};
use kv_router_peer_bench::dynamo::{JUMP_SIZE, PositionalDirect, Radix, ThreadPool, dynamo_chain, local_arena};
use kv_router_peer_bench::index_ours::{Ours, block_arena};
use kv_router_peer_bench::index_replay::{
    BenchSettings, HashBaseline, describe, measure_parallel, measure_single, print_table, time_rows,
};
use kv_router_peer_bench::index_workload::{Workload, WorkloadConfig, read_trace};

fn main() {
    let settings = BenchSettings::from_env(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.."));
    if !settings.run {
        return;
    }
    let prompts = read_trace(&settings.trace).expect("reading the trace");
    let passes = settings.passes;
    let mut measured = Vec::new();
    for &workers in &settings.workers {
        let config = WorkloadConfig { chain: dynamo_chain, ..WorkloadConfig::new(workers) };
        let w = Workload::from_prompts(&prompts, config).expect("building the workload");
        describe(&w);
        let reference = w.reference_answers();
        let seq: Arc<[u64]> = w.seq_hashes.clone().into();
        let local = local_arena(&w);
        let lanes = w.lanes(2);

        let arena = block_arena(&w);
        // One shard per thread applying events: 1 on one replay thread, 2 on two.
        let ours = || Ours::new(arena.clone(), w.workers, 1);
        let ours2 = || Ours::new(arena.clone(), w.workers, 2);
        let ours_writer = |threads| {
            let arena = arena.clone();
            move || Ours::with_writer(arena.clone(), w.workers, threads)
        };
        let (ours_writer1, ours_writer2) = (ours_writer(1), ours_writer(2));
        let baseline = || HashBaseline::new(seq.clone());
        let radix = || Radix::new(local.clone());
        let positional = || PositionalDirect::new(local.clone());
        let crtc_pool = |threads| {
            let local = local.clone();
            move || ThreadPool::new(ConcurrentRadixTreeCompressed::new(), threads, local.clone())
        };
        let (crtc_pool1, crtc_pool2) = (crtc_pool(1), crtc_pool(2));
        let positional_pool = |threads| {
            let local = local.clone();
            move || {
                ThreadPool::new(
                    PositionalIndexer::new_with_mode(JUMP_SIZE, SearchMode::Strided),
                    threads,
                    local.clone(),
                )
            }
        };
        let (positional_pool1, positional_pool2) = (positional_pool(1), positional_pool(2));

        // After what its rows borrow, so it is dropped first.
        let mut rows = Vec::new();
        // Rows are compared at equal total threads: replay threads (one lane, or two) plus the
        // index's own helper threads (our IndexWriter's, Dynamo's ThreadPoolIndexer's).
        //
        // 1 thread.
        rows.extend(settings.row("ours: PrefixIndex (1 replay)", |n| measure_single(n, false, &ours, &w, &reference)));
        rows.extend(
            settings.row("ours: HashBaseline (1 replay)", |n| measure_single(n, false, &baseline, &w, &reference)),
        );
        rows.extend(settings.row("Dynamo RadixTree (1 replay)", |n| measure_single(n, true, &radix, &w, &reference)));
        rows.extend(settings.row("Dynamo PositionalIndexer direct (1 replay)", |n| {
            measure_single(n, true, &positional, &w, &reference)
        }));

        // 2 threads.
        rows.extend(
            settings
                .row("ours: PrefixIndex (2 replay)", |n| measure_parallel(n, false, &ours2, &w, &lanes, &reference)),
        );
        rows.extend(settings.row("ours: PrefixIndex (1 replay + 1 writer)", |n| {
            measure_single(n, false, &ours_writer1, &w, &reference).with_helpers(1)
        }));
        rows.extend(
            settings.row("ours: HashBaseline (2 replay)", |n| {
                measure_parallel(n, false, &baseline, &w, &lanes, &reference)
            }),
        );
        rows.extend(settings.row("Dynamo PositionalIndexer direct (2 replay)", |n| {
            measure_parallel(n, true, &positional, &w, &lanes, &reference)
        }));
        rows.extend(settings.row("Dynamo ThreadPool<CRTC> (1 replay + 1 pool)", |n| {
            measure_single(n, true, &crtc_pool1, &w, &reference).with_helpers(1)
        }));
        rows.extend(settings.row("Dynamo ThreadPool<PositionalIndexer> (1 replay + 1 pool)", |n| {
            measure_single(n, true, &positional_pool1, &w, &reference).with_helpers(1)
        }));

        // 4 threads (on this 2-core machine, two per core).
        rows.extend(settings.row("ours: PrefixIndex (2 replay + 2 writers)", |n| {
            measure_parallel(n, false, &ours_writer2, &w, &lanes, &reference).with_helpers(2)
        }));
        rows.extend(settings.row("Dynamo ThreadPool<CRTC> (2 replay + 2 pool)", |n| {
            measure_parallel(n, true, &crtc_pool2, &w, &lanes, &reference).with_helpers(2)
        }));
        rows.extend(settings.row("Dynamo ThreadPool<PositionalIndexer> (2 replay + 2 pool)", |n| {
            measure_parallel(n, true, &positional_pool2, &w, &lanes, &reference).with_helpers(2)
        }));
        // The rows' passes take turns, so the machine's noise falls on all of them alike.
        measured.extend(time_rows(rows, passes));
    }
    print_table(&measured, "ours: PrefixIndex");
}
