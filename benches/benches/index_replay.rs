//! Replays the Mooncake conversation trace through prefix indexes of ours — `PrefixIndex`
//! (`dynamo_benches::index_ours`) and a simple sharded-map baseline — (see
//! `dynamo_benches::index_replay`): 8, 64 and 256 workers, one and two threads, block ops/s and
//! requests/s, each row checked for exact answers first.
//!
//! The side-by-side comparison with NVIDIA Dynamo's `dynamo-kv-router` indexes runs the same harness
//! from its own workspace, `benches/peers/kv-router` (its exact `tokio` pin would move this
//! workspace's lockfile): `cd benches/peers/kv-router && cargo bench`.
//!
//! `cargo bench -p dynamo-benches --bench index_replay`; `DYNAMO_BENCH_TRACE`, `DYNAMO_BENCH_WORKERS`
//! and `DYNAMO_BENCH_PASSES` change the trace, worker counts and passes per row.

use std::path::Path;
use std::sync::Arc;

use dynamo_benches::index_ours::{Ours, block_arena};
use dynamo_benches::index_replay::{
    BenchSettings, HashBaseline, describe, measure_parallel, measure_single, print_table, time_rows,
};
use dynamo_benches::index_workload::{Workload, WorkloadConfig};

fn main() {
    let settings = BenchSettings::from_env(&Path::new(env!("CARGO_MANIFEST_DIR")).join(".."));
    if !settings.run {
        return;
    }
    let prompts = dynamo_benches::index_workload::read_trace(&settings.trace).expect("reading the trace");
    let mut measured = Vec::new();
    for &workers in &settings.workers {
        let workload = Workload::from_prompts(&prompts, WorkloadConfig::new(workers)).expect("building the workload");
        describe(&workload);
        let reference = workload.reference_answers();
        let seq: Arc<[u64]> = workload.seq_hashes.clone().into();
        let make = || HashBaseline::new(seq.clone());
        let arena = block_arena(&workload);
        let ours = || Ours::new(arena.clone(), workload.workers, 1);
        let ours2 = || Ours::new(arena.clone(), workload.workers, 2);
        let lanes = workload.lanes(2);
        // After what its rows borrow, so it is dropped first.
        let mut rows = Vec::new();
        let (baseline, prefix) = ("ours: HashBaseline (sharded RwLock<HashMap>)", "ours: PrefixIndex");
        rows.extend(settings.row(prefix, |n| measure_single(n, false, &ours, &workload, &reference)));
        rows.extend(settings.row(baseline, |n| measure_single(n, false, &make, &workload, &reference)));
        rows.extend(settings.row(prefix, |n| measure_parallel(n, false, &ours2, &workload, &lanes, &reference)));
        rows.extend(settings.row(baseline, |n| measure_parallel(n, false, &make, &workload, &lanes, &reference)));
        measured.extend(time_rows(rows, settings.passes));
    }
    print_table(&measured, "ours: PrefixIndex");
}
