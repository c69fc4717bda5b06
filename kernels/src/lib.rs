//! # dynamo-kernels
//!
//! Compute for dynamo-node: the device abstraction, the KV block copy and layout kernels, and the
//! reference model's math. Every CUDA kernel (in `kernels/cuda/*.cu`, compiled at run time with
//! NVRTC) has a CPU reference here that tests compare it against, and the CPU path is a complete
//! backend of its own: a node without a GPU runs the same code with G1 in host memory.
//!
//! Layout of the crate:
//! - [`backend`] — the [`Backend`] trait (activations, weights and the paged KV pool of a device,
//!   and every operation the model needs), with its determinism contract.
//! - [`cpu`] — [`CpuBackend`]: `f32` everywhere, GEMMs over weights packed once at upload, split
//!   across threads by rows or output columns (never along a reduction), paged attention, RoPE,
//!   RMSNorm, SwiGLU.
//! - [`model`] — the Llama reference model written once against [`Backend`] ([`model::Llama`]),
//!   and its weights ([`model::weights`]): seeded random weights for a named shape, or a
//!   Llama-format safetensors checkpoint (bf16/f16/f32 → f32) validated against its `config.json`.
//! - [`sampling`] — greedy and seeded temperature sampling.
//! - [`kv_layout`] — the two KV layouts of DESIGN.md §3 and the gather/scatter between them: the
//!   engine's paged, layer-separate G1 layout (per layer, K and V
//!   `[num_blocks, B, kv_heads, head_dim]`) and the contiguous block-image payload
//!   (`[layer][k|v][B][kv_heads][head_dim]`) that G2, G3 and the wire carry. Batched over many
//!   blocks per call. This is the CPU reference of the CUDA gather/scatter kernels.
//! - [`cuda`] — the CUDA backend (bf16 weights and KV, kernels in `kernels/cuda/*.cu` compiled
//!   with NVRTC at run time, cuBLAS GEMM), detected at run time with [`cuda::probe`] — a missing
//!   driver or library is an error, never a panic — and [`cuda::check::gpu_check`], which compares
//!   every CUDA kernel with the CPU backend and measures the KV copy paths.

pub mod backend;
pub mod cpu;
pub mod cuda;
mod gemm;
pub mod kv_layout;
pub mod model;
pub mod sampling;
#[cfg(test)]
mod test_data;

pub use backend::{AttentionSpec, Backend, FinishedCopies, KernelError, SeqBatch};
pub use cpu::CpuBackend;
