//! `[model]`: which model the workers serve.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::Dtype;

/// `[model]`: which model the workers serve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// Model name. Without `path` it must be a named shape (`"tiny"`, `"llama-1b"`,
    /// `"llama-8b"`) and the weights are random from `seed`; with `path` it is only the model's
    /// identity (it goes into the block-hash salt). Default `"tiny"`.
    pub name: String,
    /// Directory of a Llama-format safetensors checkpoint (`config.json` + `*.safetensors`).
    /// Default: none (random weights for the shape `name`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// Element type of weights and KV: `"f32"`, `"f16"` or `"bf16"`. Default `"f32"`.
    pub dtype: Dtype,
    /// Seed of the random weights when there is no `path`. Default `0`.
    pub seed: u64,
    /// `tokenizer.json` to use. Default: none (the one in `path`, else the built-in o200k_base BPE).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// Jinja chat template: a file, or the name of a family template of this project (`llama3`,
    /// `qwen3`, `qwen3_preserve`, `deepseek_r1`, `gpt_oss`, `nemotron`, `glm47`, `kimi_k2`).
    /// Default: none (the one in `path`, else the built-in `llama3`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<PathBuf>,
    /// LoRA adapter name; part of the block-hash salt so adapters never share blocks.
    /// Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora: Option<String>,
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            name: "tiny".to_owned(),
            path: None,
            dtype: Dtype::F32,
            seed: 0,
            tokenizer: None,
            chat_template: None,
            lora: None,
        }
    }
}
