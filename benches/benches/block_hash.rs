//! Block hashing throughput: [`BlockHasher::hash_sequence`] against raw `xxh3_128` over the same bytes.
//!
//! Input: 1 Mi random token ids (4 MiB); throughput is reported in bytes of token ids. For each block
//! size the group holds:
//! - `ours` — the salted, chained block hashes of the whole sequence (what the node computes per request);
//! - `xxh3_128_per_block` — one bare `xxh3_128` call per block-sized chunk, no salt, no chaining, no copy:
//!   the floor that the hasher's extra work (a 32-byte prefix and a copy into its scratch buffer) is
//!   measured against.
//!
//! A last group hashes the whole buffer in one `xxh3_128` call, for scale.
//!
//! After criterion, a table is printed with the ratio ours ÷ per-block raw throughput for each block size,
//! from a plain timed loop (best of a few repetitions) run in this same process, so the ratio needs no
//! parsing of criterion's output.
//!
//! Run with `cargo bench -p dynamo-benches --bench block_hash`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use dynamo_tiering::block::{BlockHasher, Salt, SaltInputs, TokenId};
use xxhash_rust::xxh3::xxh3_128;

const TOKENS: usize = 1 << 20;
const BLOCK_SIZES: [usize; 4] = [16, 32, 64, 256];
const WARM_UP: Duration = Duration::from_secs(1);
const MEASUREMENT: Duration = Duration::from_secs(3);
/// Repetitions of the ratio table's timed loop; the best one counts.
const TABLE_REPS: usize = 5;
/// Minimum duration of one repetition of the table's timed loop.
const TABLE_REP_MIN: Duration = Duration::from_millis(60);

/// Deterministic pseudo-random token ids (splitmix64), so runs hash the same input.
fn random_tokens(n: usize) -> Vec<TokenId> {
    let mut state = 0x5EED_B10C_u64;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (z ^ (z >> 31)) as TokenId
        })
        .collect()
}

fn ours(hasher: &mut BlockHasher, tokens: &[TokenId]) -> u128 {
    hasher.hash_sequence(tokens).last().map_or(0, |h| h.0)
}

fn raw_per_block(bytes: &[u8], block_bytes: usize) -> u128 {
    bytes.chunks_exact(block_bytes).fold(0, |acc, chunk| acc ^ xxh3_128(chunk))
}

/// Best bytes-per-second of `f` over [`TABLE_REPS`] repetitions of at least [`TABLE_REP_MIN`] each.
fn best_rate(bytes_per_call: usize, mut f: impl FnMut() -> u128) -> f64 {
    let mut best = 0.0f64;
    for _ in 0..TABLE_REPS {
        let start = Instant::now();
        let mut calls = 0u64;
        while start.elapsed() < TABLE_REP_MIN {
            black_box(f());
            calls += 1;
        }
        let rate = (calls as f64 * bytes_per_call as f64) / start.elapsed().as_secs_f64();
        best = best.max(rate);
    }
    best
}

fn gbps(bytes_per_s: f64) -> f64 {
    bytes_per_s / 1e9
}

/// Whether criterion was asked only to smoke-test or list the benches (`--test`, `--list`).
fn quick_mode() -> bool {
    std::env::args().any(|a| a == "--test" || a == "--list")
}

fn main() {
    let tokens = random_tokens(TOKENS);
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let salt = Salt::derive(&SaltInputs { model: "bench", ..Default::default() });
    let throughput = Throughput::Bytes(bytes.len() as u64);

    let mut c = Criterion::default().warm_up_time(WARM_UP).measurement_time(MEASUREMENT).configure_from_args();
    for block_size in BLOCK_SIZES {
        let mut group = c.benchmark_group(format!("block_hash/B={block_size}"));
        group.throughput(throughput.clone());
        let mut hasher = BlockHasher::new(salt, block_size);
        group.bench_function("ours", |b| b.iter(|| ours(&mut hasher, black_box(&tokens))));
        group.bench_function("xxh3_128_per_block", |b| {
            b.iter(|| raw_per_block(black_box(&bytes), block_size * size_of::<TokenId>()))
        });
        group.finish();
    }
    let mut group = c.benchmark_group("block_hash/whole_buffer");
    group.throughput(throughput);
    group.bench_function("xxh3_128", |b| b.iter(|| xxh3_128(black_box(&bytes))));
    group.finish();
    c.final_summary();

    if quick_mode() {
        return;
    }
    println!();
    println!(
        "block_hash: {} tokens ({} MiB), best of {TABLE_REPS} timed loops, GB/s of token ids",
        TOKENS,
        bytes.len() >> 20
    );
    println!("{:>6}  {:>10}  {:>14}  {:>16}", "B", "ours GB/s", "raw/blk GB/s", "ours/raw (blk)");
    for block_size in BLOCK_SIZES {
        let mut hasher = BlockHasher::new(salt, block_size);
        let ours_rate = best_rate(bytes.len(), || ours(&mut hasher, black_box(&tokens)));
        let raw_rate = best_rate(bytes.len(), || raw_per_block(black_box(&bytes), block_size * size_of::<TokenId>()));
        println!(
            "{block_size:>6}  {:>10.2}  {:>14.2}  {:>16.3}",
            gbps(ours_rate),
            gbps(raw_rate),
            ours_rate / raw_rate
        );
    }
    let whole = best_rate(bytes.len(), || xxh3_128(black_box(&bytes)));
    println!("{:>6}  {:>10}  {:>14.2}  (one xxh3_128 call over the whole buffer)", "whole", "-", gbps(whole));
}
