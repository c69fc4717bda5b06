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
pub trait Backend: Send + Sync + std::fmt::Debug {
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
    /// `x: [rows, heads, head_dim]`, row `r` at position `positions[r]`, frequencies
    /// `theta^(-2i/head_dim)`.
    fn rope(
        &self,
        x: &mut Self::Buf,
        rows: usize,
        heads: usize,
        head_dim: usize,
        positions: &[u32],
        theta: f32,
    ) -> Result<(), KernelError>;

    /// `out = silu(gate) * up` element-wise over `len` elements.
    fn swiglu(&self, gate: &Self::Buf, up: &Self::Buf, len: usize, out: &mut Self::Buf) -> Result<(), KernelError>;

    /// A new buffer holding row `row` of `x: [rows, width]`.
    ///
    /// The default goes through the host; device backends should override it with a device copy.
    fn row(&self, x: &Self::Buf, rows: usize, width: usize, row: usize) -> Result<Self::Buf, KernelError> {
        if row >= rows {
            return Err(KernelError::index("row", format!("row {row} of {rows}")));
        }
        let mut host = vec![0.0f32; rows * width];
        self.download(x, &mut host)?;
        self.upload(&host[row * width..(row + 1) * width])
    }

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

    /// Causal attention of `q: [rows, heads, head_dim]` over the paged KV of `layer`: query row `r`
    /// at absolute position `positions[r]` attends to positions `0..=positions[r]`, whose KV lives
    /// in block `block_table[p / B]` at offset `p % B`. Writes `out: [rows, heads * head_dim]`.
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
    ) -> Result<(), KernelError>;

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
