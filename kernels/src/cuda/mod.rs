//! CUDA backend (stub while building).
pub mod loader;
/// tmp
pub const KERNEL_NAMES: &[&str] = &["embed_bf16","swiglu_f32","add_assign_f32","f32_to_bf16_kernel","rmsnorm_f32","rope_f32","attention_paged","kv_write_bf16","kv_gather_pages","kv_scatter_pages","argmax_rows"];
