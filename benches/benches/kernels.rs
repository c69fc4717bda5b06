//! CPU kernels of the reference model: GEMM (prefill-shaped and decode-shaped), paged attention
//! (a decode query over a long context), RMSNorm, RoPE, and the KV block gather/scatter between
//! the paged G1 layout and block-image payloads. Shapes are llama-1b's. First, the decode GEMV's
//! memory stream against a plain read of as many bytes (a ratio, printed).
//!
//! `cargo bench -p dynamo-benches --bench kernels`

use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use dynamo_kernels::kv_layout::PagedLayout;
use dynamo_kernels::{AttentionSpec, Backend, CpuBackend};

fn rand_vec(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

fn kernels(c: &mut Criterion) {
    let cpu = CpuBackend::default();
    let (hidden, ffn) = (2048usize, 8192usize);

    // Ours (weights packed once at upload) against `matrixmultiply` (which packs both operands on
    // every call), both on one thread.
    let mut g = c.benchmark_group("matmul");
    let one = CpuBackend::new(1);
    let raw = rand_vec(1, ffn * hidden);
    let w = one.weight(&raw, ffn, hidden).expect("weight");
    for rows in [1usize, 16, 256] {
        let x = rand_vec(2, rows * hidden);
        let mut out = vec![0.0; rows * ffn];
        g.throughput(Throughput::Elements((2 * rows * hidden * ffn) as u64));
        g.bench_function(format!("{rows}x{hidden}x{ffn} (flop)"), |b| {
            b.iter(|| one.matmul(&x, rows, &w, &mut out).expect("matmul"))
        });
        g.bench_function(format!("{rows}x{hidden}x{ffn} matrixmultiply (flop)"), |b| {
            // SAFETY: `x` is [rows, hidden], `raw` is [ffn, hidden] read as its transpose (row
            // stride 1, column stride hidden), `out` is [rows, ffn]; all hold that many elements.
            b.iter(|| unsafe {
                matrixmultiply::sgemm(
                    rows,
                    hidden,
                    ffn,
                    1.0,
                    x.as_ptr(),
                    hidden as isize,
                    1,
                    raw.as_ptr(),
                    1,
                    hidden as isize,
                    0.0,
                    out.as_mut_ptr(),
                    ffn as isize,
                    1,
                )
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("attention");
    let spec = AttentionSpec { heads: 32, kv_heads: 8, head_dim: 64, block_tokens: 32 };
    let layout = PagedLayout { layers: 1, block_tokens: 32, kv_heads: 8, head_dim: 64, elem_bytes: 4 };
    let ctx = 2048usize;
    let mut kv = cpu.kv_pool(layout, ctx / 32).expect("pool");
    let table: Vec<u32> = (0..(ctx / 32) as u32).collect();
    let slots: Vec<u32> = (0..ctx as u32).collect();
    cpu.kv_write(&mut kv, 0, &rand_vec(3, ctx * 512), &rand_vec(4, ctx * 512), &slots).expect("write");
    let q = rand_vec(5, 32 * 64);
    let mut out = vec![0.0; 32 * 64];
    g.throughput(Throughput::Bytes((2 * ctx * 512 * 4) as u64));
    g.bench_function("decode over 2048 tokens (KV bytes)", |b| {
        b.iter(|| cpu.attention(&q, &kv, 0, spec, &table, &[(ctx - 1) as u32], &mut out).expect("attention"))
    });
    g.finish();

    let mut g = c.benchmark_group("elementwise");
    let rows = 64;
    let x = rand_vec(6, rows * hidden);
    let norm = cpu.weight(&vec![1.0; hidden], 1, hidden).expect("norm");
    let mut y = vec![0.0; rows * hidden];
    g.throughput(Throughput::Elements((rows * hidden) as u64));
    g.bench_function("rmsnorm 64x2048", |b| {
        b.iter(|| cpu.rmsnorm(&x, &norm, rows, hidden, 1e-5, &mut y).expect("rmsnorm"))
    });
    let positions: Vec<u32> = (0..rows as u32).collect();
    let mut q = rand_vec(7, rows * hidden);
    let inv_freq = dynamo_kernels::backend::rope_inv_freq(500_000.0, 64);
    g.bench_function("rope 64x32x64", |b| {
        b.iter(|| cpu.rope(&mut q, rows, 32, 64, &positions, &inv_freq).expect("rope"))
    });
    g.finish();

    let mut g = c.benchmark_group("kv_copy");
    let layout = PagedLayout { layers: 16, block_tokens: 32, kv_heads: 8, head_dim: 64, elem_bytes: 4 };
    let blocks = 64usize;
    let mut pool = cpu.kv_pool(layout, blocks).expect("pool");
    let ids: Vec<u32> = (0..blocks as u32).rev().collect();
    let mut images = vec![vec![0u8; layout.payload_bytes()]; blocks];
    g.throughput(Throughput::Bytes((blocks * layout.payload_bytes()) as u64));
    g.bench_function("gather 64 llama-1b blocks", |b| {
        b.iter(|| {
            let mut outs: Vec<&mut [u8]> = images.iter_mut().map(|v| v.as_mut_slice()).collect();
            cpu.kv_gather(&pool, &ids, &mut outs).expect("gather")
        })
    });
    g.bench_function("scatter 64 llama-1b blocks", |b| {
        b.iter(|| {
            let ins: Vec<&[u8]> = images.iter().map(|v| v.as_slice()).collect();
            cpu.kv_scatter(&mut pool, &ids, &ins).expect("scatter")
        })
    });
    g.finish();
}

/// Decode at batch 1 streams every weight once per token: a one-row GEMM over bf16 matrices too
/// many to stay in the caches (16 of llama-1b's FFN shape, 512 MiB), on all the backend's threads,
/// against the limit it works under, a plain sequential read of as many bytes on as many threads
/// (the compiler's vectorized sum), measured in the same run. Prints both and the ratio.
fn decode_gemv_against_memory() {
    let (hidden, ffn, matrices) = (2048usize, 8192usize, 16usize);
    let cpu = CpuBackend::default();
    // bf16-exact values, so the backend keeps the matrices as bf16 (as it does a bf16 checkpoint).
    let raw: Vec<f32> =
        rand_vec(8, ffn * hidden).into_iter().map(|v| f32::from_bits(v.to_bits() & 0xffff_0000)).collect();
    let weights: Vec<_> = (0..matrices).map(|_| cpu.weight(&raw, ffn, hidden).expect("weight")).collect();
    drop(raw);
    let x = rand_vec(9, hidden);
    let mut out = vec![0.0; ffn];
    let bytes = (matrices * ffn * hidden * 2) as f64;
    let best = |f: &mut dyn FnMut()| {
        (0..5)
            .map(|_| {
                let t = Instant::now();
                f();
                bytes / t.elapsed().as_secs_f64() / 1e9
            })
            .fold(0.0, f64::max)
    };
    let gemv = best(&mut || {
        for w in &weights {
            cpu.matmul(&x, 1, w, &mut out).expect("matmul");
        }
    });
    drop(weights);
    let words = vec![1u64; matrices * ffn * hidden / 4];
    let threads = cpu.threads();
    let read = best(&mut || {
        let per = words.len().div_ceil(threads);
        let sum: u64 = std::thread::scope(|s| {
            let parts: Vec<_> = words
                .chunks(per)
                .map(|part| {
                    s.spawn(move || {
                        part.chunks_exact(8).fold([0u64; 8], |mut a, c| {
                            for (a, c) in a.iter_mut().zip(c) {
                                *a = a.wrapping_add(*c);
                            }
                            a
                        })
                    })
                })
                .collect();
            parts.into_iter().map(|p| p.join().expect("reader").iter().sum::<u64>()).sum()
        });
        assert_eq!(sum, words.len() as u64);
    });
    println!(
        "decode GEMV, 16 x {ffn}x{hidden} bf16, {threads} threads: {gemv:.1} GB/s; plain read: {read:.1} GB/s; \
         ratio {:.2}x of the read",
        gemv / read
    );
}

fn all(c: &mut Criterion) {
    decode_gemv_against_memory();
    kernels(c);
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3)).sample_size(20);
    targets = all
}
criterion_main!(benches);
