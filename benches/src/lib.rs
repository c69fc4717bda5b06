//! # dynamo-benches
//!
//! Criterion benches for dynamo-node, one file per area under `benches/`, each with fixed warm-up and
//! measurement times. A comparison against a peer measures both sides in the same run and prints the
//! ratio, so the number never mixes two machines or two days.
//!
//! - `block_hash` — salted, chained block hashing (`BlockHasher::hash_sequence`) over 1 Mi random
//!   token ids at block sizes 16, 32, 64 and 256, beside bare `xxh3_128` over the same bytes (one call
//!   per block, and one over the whole buffer); prints ours ÷ raw throughput per block size.
//!
//!   `cargo bench -p dynamo-benches --bench block_hash`
//!
//! - `g3_vs_foyer` — the G3 store against the [foyer](https://crates.io/crates/foyer) hybrid cache:
//!   writing and reading back 1 MiB and 4 MiB block images with `O_DIRECT` and io_uring at queue depth
//!   32 on the same file system; prints G3 ÷ foyer throughput per image size and direction. foyer is
//!   only built with the `peers` feature, so the workspace's normal build and tests never compile it.
//!
//!   `cargo bench -p dynamo-benches --features peers --bench g3_vs_foyer`
//!
//!   Set `DYNAMO_BENCH_DIR` to a directory on the disk under test (default: the system temp dir; it
//!   must support `O_DIRECT`, so not tmpfs) and `DYNAMO_BENCH_PASS_MIB` to change the bytes written
//!   and read per pass (default 256).
//!
//! - `index_replay` — the global prefix index's workload: the Mooncake conversation trace
//!   (`../shared/traces/mooncake_conversation.jsonl`) turned by [`index_workload`] into a fixed stream
//!   of lookups and `Stored`/`Removed` events for 8, 64 and 256 workers, replayed by [`index_replay`]
//!   on one and two threads; prints block ops/s and requests/s per index after checking every
//!   lookup's answer against a brute-force reference.
//!
//!   `cargo bench -p dynamo-benches --bench index_replay`
//!
//!   The same harness against NVIDIA Dynamo's `dynamo-kv-router` indexes (`RadixTree`,
//!   `PositionalIndexer`, `ConcurrentRadixTreeCompressed` behind `ThreadPoolIndexer`) runs in its own
//!   workspace, because that crate pins `tokio = "=1.52.4"`, which would downgrade this workspace's
//!   lockfile: `cd benches/peers/kv-router && cargo bench`.
//!
//! Append `-- <filter>` to run part of a bench, e.g. `-- g3_vs_foyer/read`; the printed ratio table
//! is skipped under `--test` and `--list`.

pub mod index_ours;
pub mod index_replay;
pub mod index_workload;
