//! The reference model: a Llama-architecture decoder (RMSNorm, RoPE, grouped-query attention over
//! the paged KV pool, SwiGLU MLP), written once against [`Backend`] and so run on the CPU or CUDA.
//! Its [`Variant`]s cover the dense models built on the same layer: Mistral (Llama's layer), Qwen2
//! (biases on q, k and v), Qwen3 (RMSNorm of each query and key head before RoPE), and Llama's own
//! `attention_bias`; RoPE's frequencies come from the checkpoint's scaling (`llama3`, `linear`).
//!
//! The caller owns the sequence: it allocates pool blocks, keeps the block table (logical block
//! `i` of the sequence lives in pool block `block_table[i]`), and asks [`Llama::forward`] to process
//! a token range starting at any position whose earlier KV is already in the pool — computed by an
//! earlier call, or loaded from G2/G3/a peer with [`Backend::kv_scatter`]. Prefill is a forward
//! over many tokens; decode is a forward over one.

use dynamo_config::ModelShape;

use super::weights::Variant;
use crate::backend::{AttentionSpec, Backend, KernelError, SeqBatch};
use crate::kv_layout::PagedLayout;

/// Where the model's weights come from: named tensors in Hugging Face Llama naming
/// (`model.layers.{i}.self_attn.q_proj.weight`, …) as `f32` host data.
pub trait WeightSource {
    /// The model's dimensions.
    fn shape(&self) -> ModelShape;
    /// RoPE base frequency.
    fn rope_theta(&self) -> f32;
    /// RMSNorm epsilon.
    fn rms_eps(&self) -> f32;
    /// A tensor's shape and data, or `None` when absent.
    fn tensor(&self, name: &str) -> Option<(&[usize], &[f32])>;
    /// What the architecture adds to Llama's layers; plain Llama unless overridden.
    fn variant(&self) -> Variant {
        Variant::default()
    }
    /// RoPE's inverse frequencies (`head_dim / 2` of them); unscaled unless overridden.
    fn rope_inv_freq(&self) -> Vec<f32> {
        crate::backend::rope_inv_freq(self.rope_theta(), self.shape().head_dim)
    }
}

impl WeightSource for super::weights::HostWeights {
    fn shape(&self) -> ModelShape {
        self.shape
    }

    fn rope_theta(&self) -> f32 {
        self.rope_theta
    }

    fn rms_eps(&self) -> f32 {
        self.rms_eps
    }

    fn tensor(&self, name: &str) -> Option<(&[usize], &[f32])> {
        self.tensors.get(name).map(|t| (t.shape.as_slice(), t.data.as_slice()))
    }

    fn variant(&self) -> Variant {
        self.variant
    }

    fn rope_inv_freq(&self) -> Vec<f32> {
        self.rope_scaling.inv_freq(self.rope_theta, self.shape.head_dim)
    }
}

/// Why a model could not be built or run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A weight is missing from the source.
    #[error("weight `{0}` is missing")]
    MissingWeight(String),
    /// A weight has another shape than the model needs.
    #[error("weight `{name}` has shape {have:?}, expected {want:?}")]
    WeightShape {
        /// The tensor.
        name: String,
        /// Its shape.
        have: Vec<usize>,
        /// The expected shape.
        want: Vec<usize>,
    },
    /// The block table does not cover the positions to compute.
    #[error("block table of {blocks} blocks covers {covered} tokens; the forward needs {needed}")]
    BlockTable {
        /// Blocks in the table.
        blocks: usize,
        /// Tokens they cover.
        covered: usize,
        /// Tokens needed.
        needed: usize,
    },
    /// Nothing to compute.
    #[error("a forward needs at least one token")]
    Empty,
    /// A kernel failed.
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

impl ModelError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ModelError::MissingWeight(_) => "missing_weight",
            ModelError::WeightShape { .. } => "weight_shape",
            ModelError::BlockTable { .. } => "block_table",
            ModelError::Empty => "empty",
            ModelError::Kernel(e) => e.kind(),
        }
    }
}

struct Layer<B: Backend> {
    attn_norm: B::Weight,
    wq: B::Weight,
    wk: B::Weight,
    wv: B::Weight,
    wo: B::Weight,
    ffn_norm: B::Weight,
    w_gate: B::Weight,
    w_up: B::Weight,
    w_down: B::Weight,
    /// `q_proj`, `k_proj`, `v_proj` biases (Qwen2, Llama's `attention_bias`).
    qkv_bias: Option<[B::Weight; 3]>,
    /// `o_proj`'s bias (Llama's `attention_bias`).
    o_bias: Option<B::Weight>,
    /// `q_norm`, `k_norm` over each head (Qwen3).
    qk_norm: Option<[B::Weight; 2]>,
}

/// Bytes of the weights [`Llama::new`] uploads for `shape` to a backend that keeps them as bf16
/// (the CUDA backend), the output head counted apart from the embedding (a tied head is
/// uploaded as a second matrix too).
pub fn weight_bytes(shape: &ModelShape) -> u64 {
    let elements: usize =
        super::weights::tensor_specs(shape, false).iter().map(|(_, dims)| dims.iter().product::<usize>()).sum();
    elements as u64 * 2
}

/// Bytes of the activations one [`Llama::forward`] over `tokens` tokens allocates: its f32
/// buffers, and the bf16 copy of the widest one that the CUDA backend's GEMM makes.
pub fn forward_bytes(shape: &ModelShape, tokens: usize) -> u64 {
    let (h, q, kv, f) = (shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.ffn);
    // x, normed, proj; q, attn; k, v; gate, up, act; then the last row, its norm and the logits.
    let f32s = tokens * (3 * h + 2 * q + 2 * kv + 3 * f) + 2 * h + shape.vocab;
    let bf16s = tokens * f.max(h).max(q);
    (f32s * 4 + bf16s * 2) as u64
}

/// The reference model on backend `B`.
pub struct Llama<B: Backend> {
    backend: B,
    shape: ModelShape,
    /// RoPE's inverse frequencies, one table for every layer and backend.
    rope_inv_freq: Vec<f32>,
    rms_eps: f32,
    embed: B::Weight,
    layers: Vec<Layer<B>>,
    norm: B::Weight,
    lm_head: B::Weight,
}

impl<B: Backend> std::fmt::Debug for Llama<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llama").field("backend", &self.backend.name()).field("shape", &self.shape).finish()
    }
}

fn load<B: Backend>(backend: &B, src: &impl WeightSource, name: &str, want: &[usize]) -> Result<B::Weight, ModelError> {
    let (shape, data) = src.tensor(name).ok_or_else(|| ModelError::MissingWeight(name.to_string()))?;
    if shape != want {
        return Err(ModelError::WeightShape { name: name.to_string(), have: shape.to_vec(), want: want.to_vec() });
    }
    let (rows, cols) = if want.len() == 2 { (want[0], want[1]) } else { (1, want[0]) };
    Ok(backend.weight(data, rows, cols)?)
}

impl<B: Backend> Llama<B> {
    /// Uploads the weights of `src` to `backend`. `lm_head.weight` falls back to the embedding
    /// (tied embeddings) when absent.
    pub fn new(backend: B, src: &impl WeightSource) -> Result<Self, ModelError> {
        let s = src.shape();
        let (h, q, kv, f, v) = (s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.ffn, s.vocab);
        let w = |name: &str, want: &[usize]| load(&backend, src, name, want);
        let variant = src.variant();
        let mut layers = Vec::with_capacity(s.layers);
        for i in 0..s.layers {
            let p = format!("model.layers.{i}");
            let qkv_bias = match variant.qkv_bias {
                true => Some([
                    w(&format!("{p}.self_attn.q_proj.bias"), &[q])?,
                    w(&format!("{p}.self_attn.k_proj.bias"), &[kv])?,
                    w(&format!("{p}.self_attn.v_proj.bias"), &[kv])?,
                ]),
                false => None,
            };
            let o_bias = match variant.o_bias {
                true => Some(w(&format!("{p}.self_attn.o_proj.bias"), &[h])?),
                false => None,
            };
            let qk_norm = match variant.qk_norm {
                true => Some([
                    w(&format!("{p}.self_attn.q_norm.weight"), &[s.head_dim])?,
                    w(&format!("{p}.self_attn.k_norm.weight"), &[s.head_dim])?,
                ]),
                false => None,
            };
            layers.push(Layer {
                qkv_bias,
                o_bias,
                qk_norm,
                attn_norm: w(&format!("{p}.input_layernorm.weight"), &[h])?,
                wq: w(&format!("{p}.self_attn.q_proj.weight"), &[q, h])?,
                wk: w(&format!("{p}.self_attn.k_proj.weight"), &[kv, h])?,
                wv: w(&format!("{p}.self_attn.v_proj.weight"), &[kv, h])?,
                wo: w(&format!("{p}.self_attn.o_proj.weight"), &[h, q])?,
                ffn_norm: w(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                w_gate: w(&format!("{p}.mlp.gate_proj.weight"), &[f, h])?,
                w_up: w(&format!("{p}.mlp.up_proj.weight"), &[f, h])?,
                w_down: w(&format!("{p}.mlp.down_proj.weight"), &[h, f])?,
            });
        }
        let embed = w("model.embed_tokens.weight", &[v, h])?;
        let lm_head = match src.tensor("lm_head.weight") {
            Some(_) => w("lm_head.weight", &[v, h])?,
            None => w("model.embed_tokens.weight", &[v, h])?,
        };
        let norm = w("model.norm.weight", &[h])?;
        Ok(Self {
            shape: s,
            rope_inv_freq: src.rope_inv_freq(),
            rms_eps: src.rms_eps(),
            embed,
            layers,
            norm,
            lm_head,
            backend,
        })
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The model's dimensions.
    pub fn shape(&self) -> ModelShape {
        self.shape
    }

    /// The paged layout of this model's KV at `block_tokens` tokens per block on this backend.
    pub fn paged_layout(&self, block_tokens: usize) -> PagedLayout {
        PagedLayout {
            layers: self.shape.layers,
            block_tokens,
            kv_heads: self.shape.kv_heads,
            head_dim: self.shape.head_dim,
            elem_bytes: self.backend.kv_elem_bytes(),
        }
    }

    /// A KV pool of `num_blocks` blocks for this model.
    pub fn kv_pool(&self, block_tokens: usize, num_blocks: usize) -> Result<B::Kv, ModelError> {
        Ok(self.backend.kv_pool(self.paged_layout(block_tokens), num_blocks)?)
    }

    /// Runs `tokens` at positions `start..start + tokens.len()`, writing their KV into the pool
    /// and attending to everything before them that the pool already holds; returns the logits of
    /// the last token (`vocab` values).
    ///
    /// `block_table[i]` is the pool block of the sequence's logical block `i`; it must cover every
    /// position up to the last token.
    pub fn forward(
        &self,
        kv: &mut B::Kv,
        tokens: &[u32],
        start: usize,
        block_table: &[u32],
        block_tokens: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let chunk = Chunk { tokens, start, block_table };
        Ok(self.forward_batch(kv, &[chunk], block_tokens)?.data)
    }

    /// One engine step over several sequences: each [`Chunk`] (a prefill chunk or a decode
    /// token of its own sequence) is computed in the same pass over the weights — every matrix
    /// multiply takes all the chunks' rows at once — and attends through its own block table.
    /// Returns the logits of each chunk's last token, one row per chunk in the chunks' order.
    ///
    /// The determinism contract holds across the batch: a chunk's logits do not depend on the
    /// chunks it was computed with (bitwise on the CPU).
    pub fn forward_batch(
        &self,
        kv: &mut B::Kv,
        chunks: &[Chunk<'_>],
        block_tokens: usize,
    ) -> Result<Logits, ModelError> {
        if chunks.is_empty() || chunks.iter().any(|c| c.tokens.is_empty()) {
            return Err(ModelError::Empty);
        }
        let t: usize = chunks.iter().map(|c| c.tokens.len()).sum();
        let mut tokens = Vec::with_capacity(t);
        let mut positions = Vec::with_capacity(t);
        let mut slots = Vec::with_capacity(t);
        let mut row_starts = Vec::with_capacity(chunks.len() + 1);
        let mut table_starts = Vec::with_capacity(chunks.len() + 1);
        let mut tables = Vec::new();
        let mut last_rows = Vec::with_capacity(chunks.len());
        row_starts.push(0u32);
        table_starts.push(0u32);
        for c in chunks {
            let end = c.start + c.tokens.len();
            if c.block_table.len() * block_tokens < end {
                return Err(ModelError::BlockTable {
                    blocks: c.block_table.len(),
                    covered: c.block_table.len() * block_tokens,
                    needed: end,
                });
            }
            tokens.extend_from_slice(c.tokens);
            for p in c.start as u32..end as u32 {
                positions.push(p);
                slots.push(c.block_table[p as usize / block_tokens] * block_tokens as u32 + p % block_tokens as u32);
            }
            // Only the blocks the chunk reaches: the rest of its table is not read.
            tables.extend_from_slice(&c.block_table[..end.div_ceil(block_tokens)]);
            row_starts.push(positions.len() as u32);
            table_starts.push(tables.len() as u32);
            last_rows.push(positions.len() - 1);
        }
        let seqs = SeqBatch { row_starts: &row_starts, table_starts: &table_starts, tables: &tables };
        let s = self.shape;
        let (hd, h, qd, kvd, f) = (s.head_dim, s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.ffn);
        let be = &self.backend;
        let spec = AttentionSpec { heads: s.heads, kv_heads: s.kv_heads, head_dim: hd, block_tokens };

        let mut x = be.zeros(t * h)?;
        be.embed(&self.embed, &tokens, &mut x)?;
        let mut normed = be.zeros(t * h)?;
        let mut q = be.zeros(t * qd)?;
        let mut k = be.zeros(t * kvd)?;
        let mut v = be.zeros(t * kvd)?;
        let mut attn = be.zeros(t * qd)?;
        let mut proj = be.zeros(t * h)?;
        let mut gate = be.zeros(t * f)?;
        let mut up = be.zeros(t * f)?;
        let mut act = be.zeros(t * f)?;
        // The per-head norms' outputs (Qwen3), swapped with `q` and `k`.
        let mut head_normed = match self.layers.first().is_some_and(|l| l.qk_norm.is_some()) {
            true => Some((be.zeros(t * qd)?, be.zeros(t * kvd)?)),
            false => None,
        };
        for (i, layer) in self.layers.iter().enumerate() {
            be.rmsnorm(&x, &layer.attn_norm, t, h, self.rms_eps, &mut normed)?;
            be.matmul(&normed, t, &layer.wq, &mut q)?;
            be.matmul(&normed, t, &layer.wk, &mut k)?;
            be.matmul(&normed, t, &layer.wv, &mut v)?;
            if let Some([bq, bk, bv]) = &layer.qkv_bias {
                be.add_bias(&mut q, bq, t, qd)?;
                be.add_bias(&mut k, bk, t, kvd)?;
                be.add_bias(&mut v, bv, t, kvd)?;
            }
            if let (Some([nq, nk]), Some((q_out, k_out))) = (&layer.qk_norm, head_normed.as_mut()) {
                be.rmsnorm(&q, nq, t * s.heads, hd, self.rms_eps, q_out)?;
                be.rmsnorm(&k, nk, t * s.kv_heads, hd, self.rms_eps, k_out)?;
                std::mem::swap(&mut q, q_out);
                std::mem::swap(&mut k, k_out);
            }
            be.rope(&mut q, t, s.heads, hd, &positions, &self.rope_inv_freq)?;
            be.rope(&mut k, t, s.kv_heads, hd, &positions, &self.rope_inv_freq)?;
            be.kv_write(kv, i, &k, &v, &slots)?;
            be.attention_batch(&q, kv, i, spec, seqs, &positions, &mut attn)?;
            be.matmul(&attn, t, &layer.wo, &mut proj)?;
            if let Some(bo) = &layer.o_bias {
                be.add_bias(&mut proj, bo, t, h)?;
            }
            be.add_assign(&mut x, &proj, t * h)?;
            be.rmsnorm(&x, &layer.ffn_norm, t, h, self.rms_eps, &mut normed)?;
            be.matmul(&normed, t, &layer.w_gate, &mut gate)?;
            be.matmul(&normed, t, &layer.w_up, &mut up)?;
            be.swiglu(&gate, &up, t * f, &mut act)?;
            be.matmul(&act, t, &layer.w_down, &mut proj)?;
            be.add_assign(&mut x, &proj, t * h)?;
        }
        let n = chunks.len();
        let last = be.gather_rows(&x, t, h, &last_rows)?;
        let mut last_normed = be.zeros(n * h)?;
        be.rmsnorm(&last, &self.norm, n, h, self.rms_eps, &mut last_normed)?;
        let mut logits = be.zeros(n * s.vocab)?;
        be.matmul(&last_normed, n, &self.lm_head, &mut logits)?;
        Ok(Logits { data: be.download_owned(logits, n * s.vocab)?, vocab: s.vocab })
    }
}

/// The logits of a batched forward: one row of `vocab` per chunk, in one buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct Logits {
    data: Vec<f32>,
    vocab: usize,
}

impl Logits {
    /// The rows, in the chunks' order.
    pub fn rows(&self) -> std::slice::ChunksExact<'_, f32> {
        self.data.chunks_exact(self.vocab)
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    /// Rows.
    pub fn len(&self) -> usize {
        self.data.len() / self.vocab.max(1)
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// One sequence's part of a batched forward ([`Llama::forward_batch`]): its tokens at positions
/// `start..start + tokens.len()`, and its block table, which must cover them.
#[derive(Clone, Copy, Debug)]
pub struct Chunk<'a> {
    /// The tokens to compute.
    pub tokens: &'a [u32],
    /// The position of the first.
    pub start: usize,
    /// The sequence's block table.
    pub block_table: &'a [u32],
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::cpu::CpuBackend;
    use crate::sampling::{SeededRng, argmax};

    /// A minimal random weight source for a toy shape (the real one is `model::weights`).
    struct Toy {
        shape: ModelShape,
        tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
    }

    impl Toy {
        fn new(seed: u64) -> Self {
            let shape = ModelShape {
                name: "toy",
                layers: 2,
                hidden: 32,
                heads: 4,
                kv_heads: 2,
                head_dim: 8,
                ffn: 48,
                vocab: 64,
            };
            let mut rng = SeededRng::new(seed);
            let mut tensors = HashMap::new();
            let mut add = |name: String, dims: Vec<usize>, norm: bool| {
                let n: usize = dims.iter().product();
                let scale = (3.0 / *dims.last().expect("dims") as f64).sqrt();
                let data =
                    (0..n).map(|_| if norm { 1.0 } else { ((rng.next_f64() * 2.0 - 1.0) * scale) as f32 }).collect();
                tensors.insert(name, (dims, data));
            };
            let (h, q, kv, f, v) = (32, 32, 16, 48, 64);
            for i in 0..2 {
                let p = format!("model.layers.{i}");
                add(format!("{p}.input_layernorm.weight"), vec![h], true);
                add(format!("{p}.self_attn.q_proj.weight"), vec![q, h], false);
                add(format!("{p}.self_attn.k_proj.weight"), vec![kv, h], false);
                add(format!("{p}.self_attn.v_proj.weight"), vec![kv, h], false);
                add(format!("{p}.self_attn.o_proj.weight"), vec![h, q], false);
                add(format!("{p}.post_attention_layernorm.weight"), vec![h], true);
                add(format!("{p}.mlp.gate_proj.weight"), vec![f, h], false);
                add(format!("{p}.mlp.up_proj.weight"), vec![f, h], false);
                add(format!("{p}.mlp.down_proj.weight"), vec![h, f], false);
            }
            add("model.embed_tokens.weight".into(), vec![v, h], false);
            add("model.norm.weight".into(), vec![h], true);
            Self { shape, tensors }
        }
    }

    impl WeightSource for Toy {
        fn shape(&self) -> ModelShape {
            self.shape
        }
        fn rope_theta(&self) -> f32 {
            10000.0
        }
        fn rms_eps(&self) -> f32 {
            1e-5
        }
        fn tensor(&self, name: &str) -> Option<(&[usize], &[f32])> {
            self.tensors.get(name).map(|(s, d)| (s.as_slice(), d.as_slice()))
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn split_prefill_and_moved_blocks_give_bitwise_equal_logits() {
        let model = Llama::new(CpuBackend::new(2), &Toy::new(1)).expect("model");
        let b = 4;
        let prompt: Vec<u32> = (0..19).map(|i| (i * 7 + 3) % 64).collect();
        let mut pool = model.kv_pool(b, 16).expect("pool");
        let table: Vec<u32> = (0..5).collect();
        let whole = model.forward(&mut pool, &prompt, 0, &table, b).expect("forward");
        assert_eq!(whole.len(), 64);
        assert!(whole.iter().all(|x| x.is_finite()));

        // The same prompt in three calls, in other pool blocks: bitwise the same logits.
        let mut pool2 = model.kv_pool(b, 16).expect("pool");
        let table2 = [9u32, 3, 12, 0, 7];
        model.forward(&mut pool2, &prompt[..8], 0, &table2, b).expect("part 1");
        model.forward(&mut pool2, &prompt[8..18], 8, &table2, b).expect("part 2");
        let split = model.forward(&mut pool2, &prompt[18..], 18, &table2, b).expect("part 3");
        assert_eq!(bits(&whole), bits(&split));

        // Decoding continues identically from either pool.
        let next = argmax(&whole);
        let a = model.forward(&mut pool, &[next], 19, &table, b).expect("decode");
        let c = model.forward(&mut pool2, &[next], 19, &table2, b).expect("decode");
        assert_eq!(bits(&a), bits(&c));
    }

    #[test]
    fn a_batched_step_gives_each_sequence_bitwise_the_logits_it_gets_alone() {
        let model = Llama::new(CpuBackend::new(2), &Toy::new(3)).expect("model");
        let b = 4;
        let a: Vec<u32> = (0..13).map(|i| (i * 5 + 1) % 64).collect();
        let c: Vec<u32> = (0..6).map(|i| (i * 11 + 2) % 64).collect();
        // Alone: a's first 9 tokens, then its last 4; c's first 5, then its 6th (a decode step).
        let mut solo = model.kv_pool(b, 16).expect("pool");
        let (ta, tc) = ([0u32, 1, 2, 3], [4u32, 5]);
        model.forward(&mut solo, &a[..9], 0, &ta, b).expect("a1");
        let want_a = model.forward(&mut solo, &a[9..], 9, &ta, b).expect("a2");
        model.forward(&mut solo, &c[..5], 0, &tc, b).expect("c1");
        let want_c = model.forward(&mut solo, &c[5..], 5, &tc, b).expect("c2");
        // Batched: the same chunks two at a time, in other pages and the other order.
        let mut pool = model.kv_pool(b, 16).expect("pool");
        let (ta, tc) = ([9u32, 2, 14, 7], [11u32, 0]);
        let first = [
            Chunk { tokens: &c[..5], start: 0, block_table: &tc },
            Chunk { tokens: &a[..9], start: 0, block_table: &ta },
        ];
        model.forward_batch(&mut pool, &first, b).expect("step 1");
        let second = [
            Chunk { tokens: &a[9..], start: 9, block_table: &ta },
            Chunk { tokens: &c[5..], start: 5, block_table: &tc },
        ];
        let got = model.forward_batch(&mut pool, &second, b).expect("step 2");
        assert_eq!(got.len(), 2);
        assert_eq!(bits(got.row(0)), bits(&want_a));
        assert_eq!(bits(got.row(1)), bits(&want_c));
        assert_eq!(model.forward_batch(&mut pool, &[], b).unwrap_err().kind(), "empty");
    }

    #[test]
    fn bad_inputs_are_errors() {
        let toy = Toy::new(2);
        let model = Llama::new(CpuBackend::new(1), &toy).expect("model");
        let mut pool = model.kv_pool(4, 2).expect("pool");
        assert_eq!(model.forward(&mut pool, &[], 0, &[0], 4).unwrap_err().kind(), "empty");
        assert_eq!(model.forward(&mut pool, &[1; 5], 0, &[0], 4).unwrap_err().kind(), "block_table");
        assert_eq!(model.forward(&mut pool, &[64], 0, &[0], 4).unwrap_err().kind(), "index");
        assert_eq!(model.forward(&mut pool, &[1; 5], 0, &[0, 5], 4).unwrap_err().kind(), "index");
        let mut broken = Toy::new(2);
        broken.tensors.remove("model.norm.weight");
        assert_eq!(Llama::new(CpuBackend::new(1), &broken).unwrap_err().kind(), "missing_weight");
        let mut broken = Toy::new(2);
        broken.tensors.get_mut("model.layers.1.mlp.up_proj.weight").expect("present").0 = vec![32, 48];
        assert_eq!(Llama::new(CpuBackend::new(1), &broken).unwrap_err().kind(), "weight_shape");
    }
}

#[cfg(test)]
mod checkpoint_tests {
    use dynamo_config::Dtype;

    use super::*;
    use crate::cpu::CpuBackend;
    use crate::model::weights::HostWeights;

    fn small() -> ModelShape {
        ModelShape { name: "small", layers: 2, hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, ffn: 96, vocab: 300 }
    }

    /// A Llama-format safetensors directory drives the same engine: f32 checkpoints give bitwise
    /// the logits of the weights they were written from; bf16 ones stay close.
    #[test]
    fn a_safetensors_checkpoint_runs_the_engine() {
        let weights = HostWeights::random(small(), 5);
        let prompt: Vec<u32> = (0..21).map(|i| (i * 37 + 1) % 300).collect();
        let table = [0u32, 1, 2];
        let run = |w: &HostWeights| {
            let model = Llama::new(CpuBackend::new(2), w).expect("model");
            let mut kv = model.kv_pool(8, 3).expect("pool");
            model.forward(&mut kv, &prompt, 0, &table, 8).expect("forward")
        };
        let want = run(&weights);
        for (dtype, exact) in [(Dtype::F32, true), (Dtype::Bf16, false)] {
            let dir = tempfile::tempdir().expect("tempdir");
            weights.save_safetensors(dir.path(), dtype).expect("save");
            let loaded = HostWeights::load(dir.path()).expect("load");
            let got = run(&loaded);
            if exact {
                assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?}");
            } else {
                let err = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                let scale = want.iter().map(|a| a.abs()).fold(0.0f32, f32::max);
                assert!(err < 0.05 * scale, "{dtype:?}: max error {err} vs scale {scale}");
            }
        }
    }
}
