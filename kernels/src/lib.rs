//! # dynamo-kernels
//!
//! Compute for dynamo-node: the device abstraction, the KV block copy and layout kernels, and the
//! reference model's math. Every CUDA kernel (in `kernels/cuda/*.cu`, compiled at run time with
//! NVRTC) has a CPU reference here that tests compare it against, and the CPU path is a complete
//! backend of its own: a node without a GPU runs the same code with G1 in host memory.
//!
//! Layout of the crate:
//! - [`kv_layout`] — the two KV layouts of DESIGN.md §3 and the gather/scatter between them: the
//!   engine's paged, layer-separate G1 layout (per layer, K and V
//!   `[num_blocks, B, kv_heads, head_dim]`) and the contiguous block-image payload
//!   (`[layer][k|v][B][kv_heads][head_dim]`) that G2, G3 and the wire carry. Batched over many
//!   blocks per call. This is the CPU reference of the CUDA gather/scatter kernels.
//! - [`cpu`] — the CPU backend (f32 everywhere); [`cuda`] — the CUDA backend (bf16 weights and KV,
//!   kernels compiled with NVRTC at run time, cuBLAS GEMM), detected at run time with
//!   [`cuda::probe`], and [`cuda::check::gpu_check`], which compares every CUDA kernel with the CPU
//!   backend and measures the KV copy paths.
//!
pub mod backend;
pub mod cpu;
pub mod cuda;
pub mod kv_layout;
pub mod model;
pub mod sampling;

pub use backend::{AttentionSpec, Backend, KernelError};
pub use cpu::CpuBackend;
