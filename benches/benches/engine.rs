//! Reference-engine throughput on the CPU: prefill and decode tokens per second for `tiny` and
//! for a mid shape (`llama-1b`, seeded random weights, f32).
//!
//! `cargo bench -p dynamo-benches --bench engine` (llama-1b needs ~10 GiB of RAM while loading).

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use dynamo_config::ModelShape;
use dynamo_kernels::CpuBackend;
use dynamo_kernels::model::Llama;
use dynamo_kernels::model::weights::HostWeights;

const B: usize = 32;

fn engine(c: &mut Criterion) {
    for (name, prefill_tokens) in [("tiny", 512usize), ("llama-1b", 32)] {
        let shape = ModelShape::named(name).expect("known shape");
        let model = {
            let weights = HostWeights::random(shape, 7);
            Llama::new(CpuBackend::default(), &weights).expect("model")
        };
        let blocks = (prefill_tokens + 64).div_ceil(B);
        let table: Vec<u32> = (0..blocks as u32).collect();
        let prompt: Vec<u32> = (0..prefill_tokens as u32).map(|i| (i * 31 + 7) % 100_000).collect();
        let mut g = c.benchmark_group(format!("engine/{name}"));
        g.sample_size(10);
        g.throughput(Throughput::Elements(prefill_tokens as u64));
        let mut kv = model.kv_pool(B, blocks).expect("pool");
        g.bench_function(format!("prefill {prefill_tokens} tokens"), |b| {
            b.iter(|| model.forward(&mut kv, &prompt, 0, &table, B).expect("prefill"))
        });
        g.throughput(Throughput::Elements(1));
        g.bench_function(format!("decode 1 token at context {prefill_tokens}"), |b| {
            b.iter(|| model.forward(&mut kv, &[42], prefill_tokens, &table, B).expect("decode"))
        });
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(5));
    targets = engine
}
criterion_main!(benches);
