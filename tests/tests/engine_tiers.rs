//! The tier invariant: a prompt's KV, gathered into block images, written to G2 and to G3, the
//! engine's G1 dropped, and scattered back from each tier in turn, continues decoding with bitwise
//! the logits and the greedy tokens of a run that recomputed everything — also with a prefix loaded
//! from one tier and the rest recomputed, and with the blocks landing in other G1 pages than they
//! were computed in.

use dynamo_config::{Dtype, ModelShape};
use dynamo_kernels::model::Llama;
use dynamo_kernels::model::weights::HostWeights;
use dynamo_kernels::sampling::argmax;
use dynamo_kernels::{Backend, CpuBackend};
use dynamo_tiering::block::{
    BlockHash, BlockHasher, BlockLayout, HEADER_LEN, ImageSpec, RetentionMeta, Salt, SaltInputs, payload_mut, seal,
    verify_image,
};
use dynamo_tiering::g2::{HostPool, HostPoolOptions, MlockPolicy, SlotRef};
use dynamo_tiering::g3::superblock::file_bytes;
use dynamo_tiering::g3::{EngineChoice, G3Options, G3Store};
use dynamo_tiering::io::uring::UringOptions;

const B: usize = 16;
const FULL_BLOCKS: usize = 3;
const DECODE_STEPS: usize = 6;

type Model = Llama<CpuBackend>;
type Kv = <CpuBackend as Backend>::Kv;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Greedy decoding from `logits` after `pos` tokens; returns every step's (token, logits bits).
fn decode(model: &Model, kv: &mut Kv, table: &[u32], mut logits: Vec<f32>, mut pos: usize) -> Vec<(u32, Vec<u32>)> {
    let mut out = Vec::new();
    for _ in 0..DECODE_STEPS {
        let next = argmax(&logits);
        out.push((next, bits(&logits)));
        logits = model.forward(kv, &[next], pos, table, B).expect("decode step");
        pos += 1;
    }
    out
}

struct Fixture {
    model: Model,
    prompt: Vec<u32>,
    hashes: Vec<BlockHash>,
    layout: BlockLayout,
    /// Logits after the whole prompt and the greedy continuation, recomputing everything.
    reference: Vec<(u32, Vec<u32>)>,
}

fn fixture() -> Fixture {
    let shape = ModelShape::named("tiny").expect("tiny");
    let weights = HostWeights::random(shape, 42);
    let model = Llama::new(CpuBackend::default(), &weights).expect("model");
    let prompt: Vec<u32> = (0..(FULL_BLOCKS * B + 5) as u32).map(|i| (i * 7919 + 13) % 199_000).collect();
    let salt = Salt::derive(&SaltInputs { model: "tiny/seed-42", ..Default::default() });
    let hashes = BlockHasher::new(salt, B).hash_sequence(&prompt);
    assert_eq!(hashes.len(), FULL_BLOCKS);
    let layout = BlockLayout::for_model(&shape, Dtype::F32, B);
    assert_eq!(layout.payload_bytes(), model.paged_layout(B).payload_bytes());

    let mut kv = model.kv_pool(B, 8).expect("pool");
    let table: Vec<u32> = (0..5).collect();
    let logits = model.forward(&mut kv, &prompt, 0, &table, B).expect("prefill");
    let reference = decode(&model, &mut kv, &table, logits, prompt.len());
    Fixture { model, prompt, hashes, layout, reference }
}

impl Fixture {
    /// Computes the prompt's KV in G1 pages other than the reference run's, gathers the complete
    /// blocks into sealed images in G2 slots, and drops that G1.
    fn images(&self, g2: &HostPool) -> Vec<SlotRef> {
        let mut kv = self.model.kv_pool(B, 8).expect("pool");
        let table = [6u32, 2, 7, 4];
        self.model.forward(&mut kv, &self.prompt, 0, &table, B).expect("prefill");
        let mut images = Vec::new();
        for (i, &hash) in self.hashes.iter().enumerate() {
            let mut slot = g2.try_alloc().expect("G2 slot");
            let payload = payload_mut(slot.as_mut_slice(), &self.layout);
            self.model.backend().kv_gather(&kv, &[table[i]], &mut [payload]).expect("gather");
            let spec = ImageSpec {
                hash,
                parent: i.checked_sub(1).map(|p| self.hashes[p]),
                salt: Salt(0),
                layout: self.layout,
                token_count: B as u16,
                retention: RetentionMeta::default(),
            };
            seal(slot.as_mut_slice(), &spec);
            images.push(slot.freeze());
        }
        drop(kv);
        images
    }

    /// Scatters `images[..n]` (already verified) into a fresh G1, recomputes from block `n`, and
    /// checks the logits and the greedy continuation bitwise against the reference.
    fn continue_from(&self, images: &[SlotRef], n: usize, tier: &str) {
        let mut kv = self.model.kv_pool(B, 8).expect("pool");
        // Loaded blocks land in yet other pages.
        let table = [3u32, 0, 5, 1];
        for (i, image) in images[..n].iter().enumerate() {
            let header = verify_image(image.as_slice(), self.hashes[i]).expect("verified image");
            let payload = &image.as_slice()[HEADER_LEN..HEADER_LEN + header.payload_len as usize];
            self.model.backend().kv_scatter(&mut kv, &[table[i]], &[payload]).expect("scatter");
        }
        let start = n * B;
        let logits = self.model.forward(&mut kv, &self.prompt[start..], start, &table, B).expect("suffix prefill");
        let got = decode(&self.model, &mut kv, &table, logits, self.prompt.len());
        for (step, (want, have)) in self.reference.iter().zip(&got).enumerate() {
            assert_eq!(want.1, have.1, "{tier}, {n} blocks loaded: logits differ at step {step}");
            assert_eq!(want.0, have.0, "{tier}, {n} blocks loaded: token differs at step {step}");
        }
    }
}

fn g2_pool(layout: &BlockLayout, slots: u32) -> HostPool {
    HostPool::new(HostPoolOptions { slot_bytes: layout.image_bytes(), slots, mlock: MlockPolicy::Try }).expect("G2")
}

#[test]
fn prefix_loaded_from_g2_decodes_exactly_like_recompute() {
    let f = fixture();
    let g2 = g2_pool(&f.layout, 8);
    let images = f.images(&g2);
    for n in 0..=FULL_BLOCKS {
        f.continue_from(&images, n, "G2");
    }
}

#[tokio::test]
async fn prefix_loaded_from_g3_decodes_exactly_like_recompute() {
    let f = fixture();
    let g2 = g2_pool(&f.layout, 16);
    let dir = tempfile::tempdir().expect("tempdir");
    let slot_bytes = dynamo_tiering::g2::align_up(f.layout.image_bytes());
    let options = G3Options {
        format_foreign: false,
        paths: vec![dir.path().join("store.0")],
        capacity_per_path: file_bytes(8, slot_bytes as u64),
        slot_bytes,
        direct_io: true,
        engine: EngineChoice::Uring(UringOptions { queue_depth: 4, threads: 1, register_buffers: true }),
    };
    let (store, _) = G3Store::open(&options, &g2).expect("G3");
    for image in f.images(&g2) {
        store.write(image).await.expect("write to G3");
    }
    // G1 and the G2 copies are gone: only G3 holds the prefix now.
    assert_eq!(g2.free_slots(), 16);
    let mut loaded = Vec::new();
    for &hash in &f.hashes {
        let slot = store.read(hash, g2.try_alloc().expect("slot")).await.expect("verified read from G3");
        loaded.push(slot);
    }
    for n in 0..=FULL_BLOCKS {
        f.continue_from(&loaded, n, "G3");
    }

    // After a restart the store still serves the same prefix, verified.
    drop(loaded);
    drop(store);
    let (store, recovery) = G3Store::open(&options, &g2).expect("reopen G3");
    assert_eq!(recovery.blocks.len(), FULL_BLOCKS);
    let mut loaded = Vec::new();
    for &hash in &f.hashes {
        loaded.push(store.read(hash, g2.try_alloc().expect("slot")).await.expect("read after restart"));
    }
    f.continue_from(&loaded, FULL_BLOCKS, "G3 after restart");
}
