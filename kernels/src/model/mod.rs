//! The reference model and where its weights come from.

pub mod llama;
pub mod weights;

pub use llama::{Chunk, Llama, Logits, ModelError, WeightSource, forward_bytes, weight_bytes};
pub use weights::{HostTensor, HostWeights, WeightsError};
