//! The device abstraction: one trait that the CPU and CUDA backends implement, so that the
//! reference model's forward pass is written once.
//!
//! Activations are `f32` buffers in device memory ([`Backend::Buf`]), weights are whatever the
//! backend stores best ([`Backend::Weight`]: `f32` on the CPU, bf16 on CUDA), and the paged KV pool
//! is [`Backend::Kv`]. Small per-call index arrays (tokens, positions, slots, block tables) are passed
//! as host slices; a device backend uploads them. Shapes are passed explicitly: the model code owns
//! them, and every kernel checks the lengths it is given against them.
//!
//! Matrix convention: a weight matrix is `[rows = out_features, cols = in_features]` row-major, as
//! in PyTorch's `nn.Linear` and Hugging Face checkpoints, and `matmul` computes `y = x · Wᵀ`.
//!
//! Determinism contract (what the tier invariant test relies on): for a given backend, the value of
//! every output row depends only on that row's inputs — not on how many rows were computed together,
//! nor on where in the pool the KV it reads was written, nor on whether that KV was computed or
//! loaded. On the CPU this makes a prefix loaded from any tier give bitwise the logits of a
//! recomputed one.

use crate::kv_layout::PagedLayout;

/// Why a kernel or backend call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// A buffer or index array does not match the shape it was given with.
    #[error("shape mismatch in {op}: {detail}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// What did not match.
        detail: String,
    },
    /// A token, slot or block id is out of range.
    #[error("index out of range in {op}: {detail}")]
    Index {
        /// The operation.
        op: &'static str,
        /// What was out of range.
        detail: String,
    },
    /// No usable GPU, driver or CUDA library; the message says which and why.
    #[error("CUDA is unavailable: {0}")]
    CudaUnavailable(String),
    /// A CUDA driver, NVRTC or cuBLAS call failed.
    #[error("CUDA error in {op}: {detail}")]
    Cuda {
        /// The operation.
        op: &'static str,
        /// The error.
        detail: String,
    },
    /// A gather or scatter batch was refused.
    #[error(transparent)]
    Layout(#[from] crate::kv_layout::LayoutError),
    /// Device memory is exhausted.
    #[error("out of device memory allocating {bytes} bytes")]
    OutOfMemory {
        /// Bytes requested.
        bytes: usize,
    },
}

impl KernelError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            KernelError::Shape { .. } => "shape",
            KernelError::Index { .. } => "index",
            KernelError::CudaUnavailable(_) => "cuda_unavailable",
            KernelError::Cuda { .. } => "cuda",
            KernelError::OutOfMemory { .. } => "out_of_memory",
            KernelError::Layout(e) => e.kind(),
        }
    }

    pub(crate) fn shape(op: &'static str, detail: impl Into<String>) -> Self {
        KernelError::Shape { op, detail: detail.into() }
    }

    pub(crate) fn index(op: &'static str, detail: impl Into<String>) -> Self {
        KernelError::Index { op, detail: detail.into() }
    }
}

/// Attention geometry of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionSpec {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention: `heads % kv_heads == 0`).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens per KV block.
    pub block_tokens: usize,
}

/// Operations the reference model needs from a device.
///
/// Every method checks the lengths of its arguments against the shapes it is given and returns
/// [`KernelError::Shape`] / [`KernelError::Index`] rather than reading out of bounds.
pub trait Backend: Send + Sync + std::fmt::Debug + 'static {
    /// An `f32` activation buffer in device memory.
    type Buf: Send + Sync;
    /// A weight tensor (matrix `[rows, cols]` or vector `[cols]` with `rows = 1`).
    type Weight: Send + Sync;
    /// The paged KV pool of one engine (G1).
    type Kv: Send + Sync;
    /// A batch of KV copies started by [`Backend::kv_gather_start`] or [`Backend::kv_scatter_start`];
    /// dropping it waits for them.
    type Copies: Send + std::fmt::Debug;

    /// "cpu" or "cuda".
    fn name(&self) -> &'static str;

    /// Bytes per element of the KV pool this backend keeps (4 for f32, 2 for bf16).
    fn kv_elem_bytes(&self) -> usize;

    /// Uploads a weight given as `f32` host data of `rows × cols` (row-major).
    fn weight(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Weight, KernelError>;

    /// A zeroed activation buffer of `len` elements.
    fn zeros(&self, len: usize) -> Result<Self::Buf, KernelError>;

    /// Uploads host data into a new buffer.
    fn upload(&self, data: &[f32]) -> Result<Self::Buf, KernelError>;

    /// Copies a buffer (its first `out.len()` elements) to the host.
    fn download(&self, buf: &Self::Buf, out: &mut [f32]) -> Result<(), KernelError>;

    /// The first `len` elements of a buffer on the host, the buffer consumed (a host backend
    /// hands over its memory instead of copying it).
    fn download_owned(&self, buf: Self::Buf, len: usize) -> Result<Vec<f32>, KernelError> {
        let mut out = vec![0.0; len];
        self.download(&buf, &mut out)?;
        Ok(out)
    }

    /// `out[t] = table[tokens[t]]` for an embedding table `[vocab, dim]`; `out` has `tokens.len() × dim`.
    fn embed(&self, table: &Self::Weight, tokens: &[u32], out: &mut Self::Buf) -> Result<(), KernelError>;

    /// Row-wise RMSNorm: `out[r] = x[r] / sqrt(mean(x[r]²) + eps) * w` over `rows × dim`.
    fn rmsnorm(
        &self,
        x: &Self::Buf,
        w: &Self::Weight,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) -> Result<(), KernelError>;

    /// `out[r][n] = Σ_k x[r][k] · w[n][k]` for `x: [rows, w.cols]`, `out: [rows, w.rows]`.
    fn matmul(&self, x: &Self::Buf, rows: usize, w: &Self::Weight, out: &mut Self::Buf) -> Result<(), KernelError>;

    /// Rotary position embedding in place (rotate-half convention, as Hugging Face Llama), over
    /// `x: [rows, heads, head_dim]`, row `r` at position `positions[r]`, pair `i` rotated by the
    /// f32 angle `positions[r] as f32 * inv_freq[i]` (`inv_freq` has `head_dim / 2` entries, from
    /// [`rope_inv_freq`] or a scaled variant), as `transformers` computes it.
    fn rope(
        &self,
        x: &mut Self::Buf,
        rows: usize,
        heads: usize,
        head_dim: usize,
        positions: &[u32],
        inv_freq: &[f32],
    ) -> Result<(), KernelError>;

    /// `out = silu(gate) * up` element-wise over `len` elements.
    fn swiglu(&self, gate: &Self::Buf, up: &Self::Buf, len: usize, out: &mut Self::Buf) -> Result<(), KernelError>;

    /// A new buffer holding rows `picks` of `x: [rows, width]`, in that order.
    ///
    /// The default goes through the host; device backends should override it with device copies.
    fn gather_rows(&self, x: &Self::Buf, rows: usize, width: usize, picks: &[usize]) -> Result<Self::Buf, KernelError> {
        if let Some(&row) = picks.iter().find(|&&r| r >= rows) {
            return Err(KernelError::index("gather_rows", format!("row {row} of {rows}")));
        }
        let mut host = vec![0.0f32; rows * width];
        self.download(x, &mut host)?;
        let picked: Vec<f32> = picks.iter().flat_map(|&r| host[r * width..(r + 1) * width].iter().copied()).collect();
        self.upload(&picked)
    }

    /// `x[r][c] += bias[c]` over `x: [rows, cols]`, for a bias vector of `cols` (a linear
    /// layer's bias, Qwen2's `q_proj.bias`).
    fn add_bias(&self, x: &mut Self::Buf, bias: &Self::Weight, rows: usize, cols: usize) -> Result<(), KernelError>;

    /// `x += y` element-wise over `len` elements.
    fn add_assign(&self, x: &mut Self::Buf, y: &Self::Buf, len: usize) -> Result<(), KernelError>;

    /// A zeroed paged KV pool of `num_blocks` blocks per layer.
    fn kv_pool(&self, layout: PagedLayout, num_blocks: usize) -> Result<Self::Kv, KernelError>;

    /// Writes K and V rows (`[rows, kv_heads, head_dim]` each) of `layer` into token slots:
    /// row `r` goes to block `slots[r] / B`, offset `slots[r] % B`.
    fn kv_write(
        &self,
        kv: &mut Self::Kv,
        layer: usize,
        k: &Self::Buf,
        v: &Self::Buf,
        slots: &[u32],
    ) -> Result<(), KernelError>;

    /// Causal attention of the query rows of several sequences over the paged KV of `layer`, in
    /// one call: query row `r` of sequence `s` (rows `seqs.rows(s)`) at absolute position
    /// `positions[r]` attends to its sequence's positions `0..=positions[r]`, whose KV lives in
    /// block `seqs.table(s)[p / B]` at offset `p % B`. `q: [rows, heads, head_dim]`; writes
    /// `out: [rows, heads * head_dim]`. A row's output depends on its own sequence only.
    #[allow(clippy::too_many_arguments)]
    fn attention_batch(
        &self,
        q: &Self::Buf,
        kv: &Self::Kv,
        layer: usize,
        spec: AttentionSpec,
        seqs: SeqBatch<'_>,
        positions: &[u32],
        out: &mut Self::Buf,
    ) -> Result<(), KernelError>;

    /// [`Self::attention_batch`] of one sequence whose block table is `block_table`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Buf,
        kv: &Self::Kv,
        layer: usize,
        spec: AttentionSpec,
        block_table: &[u32],
        positions: &[u32],
        out: &mut Self::Buf,
    ) -> Result<(), KernelError> {
        let rows = [0, positions.len() as u32];
        let tables = [0, block_table.len() as u32];
        let seqs = SeqBatch { row_starts: &rows, table_starts: &tables, tables: block_table };
        self.attention_batch(q, kv, layer, spec, seqs, positions, out)
    }

    /// Gathers blocks of the pool into block-image payloads in host memory (`out[i]` ← `blocks[i]`,
    /// layout `[layer][k|v][B][kv_heads][head_dim]`, elements of `kv_elem_bytes()`).
    fn kv_gather(&self, kv: &Self::Kv, blocks: &[u32], out: &mut [&mut [u8]]) -> Result<(), KernelError>;

    /// Scatters block-image payloads from host memory into blocks of the pool.
    fn kv_scatter(&self, kv: &mut Self::Kv, blocks: &[u32], payloads: &[&[u8]]) -> Result<(), KernelError>;

    /// [`Self::kv_gather`] on the backend's copy engine, behind the compute queued so far, without
    /// waiting: compute queued later runs alongside it. A backend without a copy engine (the CPU)
    /// copies before it returns.
    ///
    /// # Safety
    /// Until the copies are finished ([`Self::copies_wait`], or dropped): every `out` buffer stays
    /// allocated and nobody else reads or writes it, and no block of `blocks` is written (by
    /// [`Self::kv_write`] or a scatter).
    unsafe fn kv_gather_start(
        &self,
        kv: &Self::Kv,
        blocks: &[u32],
        out: &mut [&mut [u8]],
    ) -> Result<Self::Copies, KernelError>;

    /// [`Self::kv_scatter`] on the backend's copy engine, behind the compute queued so far, without
    /// waiting. Layer by layer: compute queued later that reads or writes a layer of the pool waits
    /// (on the device, not the host) for that layer's pages only, so a prefix's later layers load
    /// while its first ones are already attended to.
    ///
    /// # Safety
    /// Until the copies are finished ([`Self::copies_wait`], or dropped): every payload stays
    /// allocated and unchanged.
    unsafe fn kv_scatter_start(
        &self,
        kv: &mut Self::Kv,
        blocks: &[u32],
        payloads: &[&[u8]],
    ) -> Result<Self::Copies, KernelError>;

    /// Whether the copies have finished; never waits.
    fn copies_done(&self, copies: &Self::Copies) -> Result<bool, KernelError>;

    /// Waits for the copies and answers how long they took on the copy engine, from their start to
    /// their end (what a link's bandwidth is measured on).
    fn copies_wait(&self, copies: Self::Copies) -> Result<std::time::Duration, KernelError>;
}

/// Copies that finished before their start call returned, and how long they took: what a backend
/// without a copy engine answers.
#[derive(Clone, Copy, Debug)]
pub struct FinishedCopies(pub std::time::Duration);

/// The sequences of one batched attention call: sequence `s` owns the query rows
/// `row_starts[s]..row_starts[s + 1]` and the block table `tables[table_starts[s]..table_starts[s + 1]]`.
/// Both offset arrays have one entry more than there are sequences and start at 0.
#[derive(Clone, Copy, Debug)]
pub struct SeqBatch<'a> {
    /// Row offsets, `S + 1` of them, non-decreasing.
    pub row_starts: &'a [u32],
    /// Block-table offsets into `tables`, `S + 1` of them, non-decreasing.
    pub table_starts: &'a [u32],
    /// Every sequence's block table, one after the other.
    pub tables: &'a [u32],
}

impl SeqBatch<'_> {
    /// Sequences in the batch.
    pub fn len(&self) -> usize {
        self.row_starts.len().saturating_sub(1)
    }

    /// Whether the batch has no sequence.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The query rows of sequence `s`.
    pub fn rows(&self, s: usize) -> std::ops::Range<usize> {
        self.row_starts[s] as usize..self.row_starts[s + 1] as usize
    }

    /// The block table of sequence `s`.
    pub fn table(&self, s: usize) -> &[u32] {
        &self.tables[self.table_starts[s] as usize..self.table_starts[s + 1] as usize]
    }

    /// Checks the batch against `positions` (one per row) and a pool of `num_blocks` blocks of
    /// `block_tokens` tokens: offsets well formed, every sequence's table covering its largest
    /// position with blocks inside the pool.
    pub fn check(
        &self,
        op: &'static str,
        positions: &[u32],
        block_tokens: usize,
        num_blocks: usize,
    ) -> Result<(), KernelError> {
        let (rs, ts) = (self.row_starts, self.table_starts);
        if rs.len() != ts.len() || rs.first().is_some_and(|&r| r != 0) || ts.first().is_some_and(|&t| t != 0) {
            return Err(KernelError::shape(
                op,
                "row and table offsets must have one entry per sequence plus one, from 0",
            ));
        }
        if rs.windows(2).any(|w| w[0] > w[1]) || ts.windows(2).any(|w| w[0] > w[1]) {
            return Err(KernelError::shape(op, "row and table offsets must not decrease"));
        }
        if rs.last().map_or(0, |&r| r as usize) != positions.len() {
            return Err(KernelError::shape(
                op,
                format!("the sequences hold {:?} rows, positions {}", rs.last(), positions.len()),
            ));
        }
        if ts.last().map_or(0, |&t| t as usize) > self.tables.len() {
            return Err(KernelError::shape(op, "table offsets run past the tables"));
        }
        for s in 0..self.len() {
            let table = self.table(s);
            if let Some(&p) = positions[self.rows(s)].iter().max() {
                let need = p as usize / block_tokens + 1;
                if need > table.len() {
                    return Err(KernelError::index(
                        op,
                        format!("position {p} beyond a block table of {}", table.len()),
                    ));
                }
                if let Some(&b) = table[..need].iter().find(|&&b| b as usize >= num_blocks) {
                    return Err(KernelError::index(op, format!("block {b} in a pool of {num_blocks}")));
                }
            }
        }
        Ok(())
    }
}

/// RoPE's inverse frequencies as `transformers` computes them for the default rope type, in f32
/// step by step: `1 / theta^((2i) / head_dim)`. Every backend rotates by these same f32 values:
/// at position 32K an angle moves by 2e-3 radians per ulp of its frequency, so a table computed
/// once on the host is what keeps the backends (and `transformers`) in agreement.
pub fn rope_inv_freq(theta: f32, head_dim: usize) -> Vec<f32> {
    (0..head_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32)).collect()
}
