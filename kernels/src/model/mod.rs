//! The reference model and where its weights come from.

pub mod llama;

pub use llama::{Llama, ModelError, WeightSource};
