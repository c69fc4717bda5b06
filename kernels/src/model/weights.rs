//! Model weights in host memory, as `f32`: seeded random weights for a named shape, or a
//! Llama-format Hugging Face checkpoint (`config.json` + `*.safetensors`).
//!
//! Tensors are keyed by their Hugging Face Llama names and keep the checkpoint's layout (a
//! weight matrix is `[out_features, in_features]`, which is what [`crate::Backend::weight`]
//! takes):
//!
//! | name | shape |
//! |---|---|
//! | `model.embed_tokens.weight` | `[vocab, hidden]` |
//! | `model.layers.{i}.input_layernorm.weight` | `[hidden]` |
//! | `model.layers.{i}.self_attn.q_proj.weight` | `[heads * head_dim, hidden]` |
//! | `model.layers.{i}.self_attn.{k,v}_proj.weight` | `[kv_heads * head_dim, hidden]` |
//! | `model.layers.{i}.self_attn.o_proj.weight` | `[hidden, heads * head_dim]` |
//! | `model.layers.{i}.post_attention_layernorm.weight` | `[hidden]` |
//! | `model.layers.{i}.mlp.{gate,up}_proj.weight` | `[ffn, hidden]` |
//! | `model.layers.{i}.mlp.down_proj.weight` | `[hidden, ffn]` |
//! | `model.norm.weight` | `[hidden]` |
//! | `lm_head.weight` | `[vocab, hidden]`, absent when the embeddings are tied |
//!
//! [`HostWeights::lm_head`] resolves the tie. Loading memory-maps every safetensors file and
//! converts bf16, f16 and f32 to `f32` on all cores; random generation uses the same parallel
//! fill, with one seed per fixed-size chunk so that the result does not depend on the number of
//! threads.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use dynamo_config::{Dtype, ModelShape};
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};

/// Name of the token embedding.
pub const EMBED_TOKENS: &str = "model.embed_tokens.weight";
/// Name of the final norm.
pub const FINAL_NORM: &str = "model.norm.weight";
/// Name of the output projection (absent when the embeddings are tied).
pub const LM_HEAD: &str = "lm_head.weight";

/// Elements per unit of parallel work. Fixed, so that seeded weights do not depend on how many
/// threads generated them.
const CHUNK: usize = 1 << 20;

/// Why weights could not be read, validated or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WeightsError {
    /// A file could not be read, mapped or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// `config.json` (or the shard index) is not valid JSON, or a key has the wrong type.
    #[error("{}: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error (names the line and column).
        #[source]
        source: serde_json::Error,
    },
    /// `config.json` lacks a key that has no default.
    #[error("{}: missing key `{key}`", path.display())]
    MissingConfigKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: &'static str,
    },
    /// `config.json` parsed but its values are impossible (zero sizes, heads not a multiple of
    /// the KV heads…).
    #[error("{}: {detail}", path.display())]
    InvalidConfig {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// The directory holds no `*.safetensors` file.
    #[error("{}: no *.safetensors files", dir.display())]
    NoWeightFiles {
        /// The directory.
        dir: PathBuf,
    },
    /// `model.safetensors.index.json` names a file that does not exist.
    #[error("{}: names {file:?}, which does not exist", path.display())]
    Index {
        /// The index file.
        path: PathBuf,
        /// The shard it names.
        file: String,
    },
    /// A file is not a valid safetensors file.
    #[error("{}: not a valid safetensors file: {source}", path.display())]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// A tensor the model needs is in none of the files.
    #[error("{}: tensor `{tensor}` is missing from {files}", dir.display())]
    MissingTensor {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The tensor.
        tensor: String,
        /// The files searched, comma-separated.
        files: String,
    },
    /// A tensor has a shape other than the one `config.json` implies.
    #[error("{}: tensor `{tensor}` has shape {found:?}, expected {expected:?}", path.display())]
    TensorShape {
        /// The file holding it.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The shape `config.json` implies.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A tensor has an element type other than F32, F16 or BF16.
    #[error("{}: tensor `{tensor}` has dtype {dtype}; only F32, F16 and BF16 are supported", path.display())]
    UnsupportedDtype {
        /// The file holding it.
        path: PathBuf,
        /// The tensor.
        tensor: String,
        /// The dtype in the file.
        dtype: String,
    },
    /// A tensor appears in two files.
    #[error("tensor `{tensor}` appears in both {} and {}", first.display(), second.display())]
    DuplicateTensor {
        /// The tensor.
        tensor: String,
        /// The first file.
        first: PathBuf,
        /// The second file.
        second: PathBuf,
    },
    /// In-memory weights do not match their shape (on save).
    #[error("weights for `{model}` do not match the shape: {detail}")]
    Inconsistent {
        /// The model name.
        model: &'static str,
        /// What does not match.
        detail: String,
    },
}

impl WeightsError {
    /// A stable label for metrics: `io`, `json`, `missing_config_key`, `invalid_config`,
    /// `no_weight_files`, `index`, `safetensors`, `missing_tensor`, `tensor_shape`,
    /// `unsupported_dtype`, `duplicate_tensor` or `inconsistent`.
    pub fn kind(&self) -> &'static str {
        match self {
            WeightsError::Io { .. } => "io",
            WeightsError::Json { .. } => "json",
            WeightsError::MissingConfigKey { .. } => "missing_config_key",
            WeightsError::InvalidConfig { .. } => "invalid_config",
            WeightsError::NoWeightFiles { .. } => "no_weight_files",
            WeightsError::Index { .. } => "index",
            WeightsError::Safetensors { .. } => "safetensors",
            WeightsError::MissingTensor { .. } => "missing_tensor",
            WeightsError::TensorShape { .. } => "tensor_shape",
            WeightsError::UnsupportedDtype { .. } => "unsupported_dtype",
            WeightsError::DuplicateTensor { .. } => "duplicate_tensor",
            WeightsError::Inconsistent { .. } => "inconsistent",
        }
    }

    fn io(path: &Path, source: std::io::Error) -> Self {
        WeightsError::Io { path: path.to_owned(), source }
    }
}

/// What the reference model needs from a Hugging Face Llama `config.json`, defaults applied.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `num_key_value_heads`; defaults to `num_attention_heads`.
    pub num_key_value_heads: usize,
    /// `head_dim`; defaults to `hidden_size / num_attention_heads`.
    pub head_dim: usize,
    /// `intermediate_size`.
    pub intermediate_size: usize,
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `rope_theta` (or `rope_parameters.rope_theta`); defaults to 10000.
    pub rope_theta: f32,
    /// `rms_norm_eps`; defaults to 1e-5.
    pub rms_norm_eps: f32,
    /// `tie_word_embeddings`; defaults to false.
    pub tie_word_embeddings: bool,
    /// What the architecture adds to Llama's layers (biases, per-head norms).
    pub variant: Variant,
    /// `rope_parameters` (or `rope_scaling`): how RoPE's frequencies are scaled.
    pub rope_scaling: RopeScaling,
    /// The attention window of a sliding-window model (Mistral's `sliding_window`; Qwen's when
    /// `use_sliding_window`): a sequence longer than it is not served.
    pub sliding_window: Option<usize>,
}

/// The architectures the reference engine computes, as `transformers` names them.
pub const SUPPORTED_ARCHITECTURES: [&str; 4] =
    ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"];

/// What an architecture adds to the Llama layer: which projections have biases, and whether
/// queries and keys are RMS-normed per head before RoPE.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Variant {
    /// `q_proj`, `k_proj` and `v_proj` have biases (Qwen2; Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// `o_proj` has a bias (Llama's `attention_bias`).
    pub o_bias: bool,
    /// `self_attn.q_norm` and `self_attn.k_norm` over each head (Qwen3).
    pub qk_norm: bool,
}

/// RoPE's frequency scaling, as `transformers`' `ROPE_INIT_FUNCTIONS` computes it. Types that
/// change with the sequence length or scale the attention (`dynamic`, `yarn`, `longrope`) are
/// refused when the config is read.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum RopeScaling {
    /// `default`: `1 / theta^(2i/d)`.
    #[default]
    Default,
    /// `linear`: the default frequencies divided by `factor`.
    Linear {
        /// The factor.
        factor: f32,
    },
    /// `llama3` (Llama 3.1 and later): low frequencies divided by `factor`, high ones kept, the
    /// band between smoothly interpolated.
    Llama3 {
        /// `factor`.
        factor: f32,
        /// `low_freq_factor`.
        low_freq_factor: f32,
        /// `high_freq_factor`.
        high_freq_factor: f32,
        /// `original_max_position_embeddings`.
        original_max_position_embeddings: f32,
    },
}

impl RopeScaling {
    /// The inverse frequencies of a head of `head_dim` at base `theta`, in f32 step by step as
    /// `transformers` computes them.
    pub fn inv_freq(self, theta: f32, head_dim: usize) -> Vec<f32> {
        let base = crate::backend::rope_inv_freq(theta, head_dim);
        match self {
            RopeScaling::Default => base,
            RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let old = original_max_position_embeddings;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.into_iter()
                    .map(|f| {
                        let wavelen = (2.0 * std::f64::consts::PI) as f32 / f;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        if wavelen < high_wavelen || wavelen > low_wavelen {
                            return scaled;
                        }
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    })
                    .collect()
            }
        }
    }
}

/// `config.json` as written, before defaults. Unknown keys are ignored: real configs carry many
/// that the reference model does not use.
#[derive(serde::Deserialize)]
struct RawHfConfig {
    hidden_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    intermediate_size: Option<usize>,
    vocab_size: Option<usize>,
    rope_theta: Option<f64>,
    rope_parameters: Option<serde_json::Value>,
    rope_scaling: Option<serde_json::Value>,
    rms_norm_eps: Option<f64>,
    tie_word_embeddings: Option<bool>,
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    kv_lora_rank: Option<usize>,
    partial_rotary_factor: Option<f64>,
}

impl HfConfig {
    /// The config of `shape`, as [`HostWeights::save_safetensors`] writes it.
    pub fn from_shape(shape: &ModelShape, rope_theta: f32, rms_norm_eps: f32, tie_word_embeddings: bool) -> Self {
        HfConfig {
            hidden_size: shape.hidden,
            num_hidden_layers: shape.layers,
            num_attention_heads: shape.heads,
            num_key_value_heads: shape.kv_heads,
            head_dim: shape.head_dim,
            intermediate_size: shape.ffn,
            vocab_size: shape.vocab,
            rope_theta,
            rms_norm_eps,
            tie_word_embeddings,
            variant: Variant::default(),
            rope_scaling: RopeScaling::Default,
            sliding_window: None,
        }
    }

    /// The model shape, called `name`.
    pub fn shape(&self, name: &'static str) -> ModelShape {
        ModelShape {
            name,
            layers: self.num_hidden_layers,
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            ffn: self.intermediate_size,
            vocab: self.vocab_size,
        }
    }

    /// The model shape, named after the checkpoint directory (its path as given).
    ///
    /// [`ModelShape::name`] is `&'static str`, so this leaks the name: one small string per call,
    /// which is made once per model load.
    pub fn shape_for_dir(&self, dir: &Path) -> ModelShape {
        self.shape(Box::leak(dir.display().to_string().into_boxed_str()))
    }

    fn to_json(&self, dtype: Dtype) -> serde_json::Value {
        let torch_dtype = match dtype {
            Dtype::F32 => "float32",
            Dtype::F16 => "float16",
            Dtype::Bf16 => "bfloat16",
        };
        let (architecture, model_type) = match self.variant {
            Variant { qk_norm: true, .. } => ("Qwen3ForCausalLM", "qwen3"),
            Variant { qkv_bias: true, o_bias: false, .. } => ("Qwen2ForCausalLM", "qwen2"),
            _ => ("LlamaForCausalLM", "llama"),
        };
        let rope_scaling = match self.rope_scaling {
            RopeScaling::Default => serde_json::Value::Null,
            RopeScaling::Linear { factor } => serde_json::json!({"rope_type": "linear", "factor": factor}),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                serde_json::json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": original_max_position_embeddings})
            }
        };
        serde_json::json!({
            "architectures": [architecture],
            "model_type": model_type,
            "attention_bias": self.variant.o_bias,
            "rope_scaling": rope_scaling,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": torch_dtype,
        })
    }
}

/// Reads and checks `dir/config.json`.
pub fn read_hf_config(dir: &Path) -> Result<HfConfig, WeightsError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| WeightsError::io(&path, e))?;
    let raw: RawHfConfig =
        serde_json::from_str(&text).map_err(|source| WeightsError::Json { path: path.clone(), source })?;
    let required = |value: Option<usize>, key: &'static str| {
        value.ok_or(WeightsError::MissingConfigKey { path: path.clone(), key })
    };
    let hidden_size = required(raw.hidden_size, "hidden_size")?;
    let num_hidden_layers = required(raw.num_hidden_layers, "num_hidden_layers")?;
    let num_attention_heads = required(raw.num_attention_heads, "num_attention_heads")?;
    let intermediate_size = required(raw.intermediate_size, "intermediate_size")?;
    let vocab_size = required(raw.vocab_size, "vocab_size")?;
    let invalid = |detail: String| WeightsError::InvalidConfig { path: path.clone(), detail };
    if num_attention_heads == 0 {
        return Err(invalid("num_attention_heads is 0".into()));
    }
    let architecture = match (raw.architectures.as_deref(), raw.model_type.as_deref()) {
        (Some([first, ..]), _) => first.clone(),
        (_, Some("llama") | None) => "LlamaForCausalLM".to_owned(),
        (_, Some("mistral")) => "MistralForCausalLM".to_owned(),
        (_, Some("qwen2")) => "Qwen2ForCausalLM".to_owned(),
        (_, Some("qwen3")) => "Qwen3ForCausalLM".to_owned(),
        (_, Some(other)) => format!("model_type {other:?}"),
    };
    let unsupported = |why: &str| {
        invalid(format!(
            "{architecture}{why} is not an architecture the reference engine computes (it computes {}: \
             Llama, Mistral, Qwen2 and Qwen3 dense models); serve it with an engine that does, such as vLLM \
             attached through [engine_endpoint]",
            SUPPORTED_ARCHITECTURES.join(", ")
        ))
    };
    let mut variant = match architecture.as_str() {
        "LlamaForCausalLM" | "MistralForCausalLM" => Variant::default(),
        "Qwen2ForCausalLM" => Variant { qkv_bias: true, ..Variant::default() },
        "Qwen3ForCausalLM" => Variant { qk_norm: true, ..Variant::default() },
        _ => return Err(unsupported("")),
    };
    // Qwen2's q, k and v always have biases and its o never has; the others follow the key.
    if raw.attention_bias == Some(true) && architecture != "Qwen2ForCausalLM" {
        variant.qkv_bias = true;
        variant.o_bias = true;
    }
    if raw.num_experts.or(raw.num_local_experts).is_some_and(|n| n > 0) {
        return Err(unsupported(" with experts (num_experts)"));
    }
    if raw.kv_lora_rank.is_some() {
        return Err(unsupported(" with latent attention (kv_lora_rank)"));
    }
    if raw.mlp_bias == Some(true) {
        return Err(unsupported(" with mlp_bias"));
    }
    if let Some(act) = raw.hidden_act.as_deref().filter(|a| *a != "silu") {
        return Err(unsupported(&format!(" with hidden_act {act:?}")));
    }
    if raw.partial_rotary_factor.is_some_and(|f| f != 1.0) {
        return Err(unsupported(" with partial_rotary_factor"));
    }
    // `transformers` 5 writes `rope_parameters` (with `rope_theta` in it); older ones
    // `rope_theta` and `rope_scaling` (its type under `type` before 4.45).
    let rope = raw.rope_parameters.as_ref().or(raw.rope_scaling.as_ref()).filter(|r| !r.is_null());
    let rope_number = |key: &str| rope.and_then(|r| r.get(key)).and_then(serde_json::Value::as_f64);
    let rope_type =
        rope.and_then(|r| r.get("rope_type").or_else(|| r.get("type"))).and_then(|t| t.as_str()).unwrap_or("default");
    let factor = || -> Result<f32, WeightsError> {
        match rope_number("factor") {
            Some(f) if f.is_finite() && f >= 1.0 => Ok(f as f32),
            _ => Err(invalid(format!("rope type {rope_type:?} needs a `factor` of at least 1"))),
        }
    };
    let rope_scaling = match rope_type {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "llama3" => {
            let field = |key: &'static str| {
                rope_number(key)
                    .filter(|v| v.is_finite() && *v > 0.0)
                    .map(|v| v as f32)
                    .ok_or_else(|| invalid(format!("rope type \"llama3\" needs a positive `{key}`")))
            };
            let (low, high) = (field("low_freq_factor")?, field("high_freq_factor")?);
            if high <= low {
                return Err(invalid("rope type \"llama3\": high_freq_factor must exceed low_freq_factor".into()));
            }
            RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: field("original_max_position_embeddings")?,
            }
        }
        other => return Err(unsupported(&format!(" with rope type {other:?}"))),
    };
    let sliding_window = match architecture.as_str() {
        "MistralForCausalLM" => raw.sliding_window,
        _ if raw.use_sliding_window == Some(true) => raw.sliding_window,
        _ => None,
    };
    let config = HfConfig {
        hidden_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads: raw.num_key_value_heads.unwrap_or(num_attention_heads),
        head_dim: raw.head_dim.unwrap_or(hidden_size / num_attention_heads),
        intermediate_size,
        vocab_size,
        rope_theta: raw.rope_theta.or(rope_number("rope_theta")).unwrap_or(10_000.0) as f32,
        rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-5) as f32,
        tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
        variant,
        rope_scaling,
        sliding_window,
    };
    for (key, value) in [
        ("hidden_size", config.hidden_size),
        ("num_hidden_layers", config.num_hidden_layers),
        ("num_key_value_heads", config.num_key_value_heads),
        ("head_dim", config.head_dim),
        ("intermediate_size", config.intermediate_size),
        ("vocab_size", config.vocab_size),
    ] {
        if value == 0 {
            return Err(invalid(format!("{key} is 0")));
        }
    }
    if !config.num_attention_heads.is_multiple_of(config.num_key_value_heads) {
        return Err(invalid(format!(
            "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
            config.num_attention_heads, config.num_key_value_heads
        )));
    }
    if !(config.rope_theta.is_finite() && config.rope_theta > 0.0) {
        return Err(invalid(format!("rope_theta must be positive, not {}", config.rope_theta)));
    }
    if !(config.rms_norm_eps.is_finite() && config.rms_norm_eps > 0.0) {
        return Err(invalid(format!("rms_norm_eps must be positive, not {}", config.rms_norm_eps)));
    }
    Ok(config)
}

/// Every tensor a Llama model of `shape` has, with its shape, in a fixed order (embedding,
/// layers in order, final norm, output projection unless tied).
pub fn tensor_specs(shape: &ModelShape, tie_word_embeddings: bool) -> Vec<(String, Vec<usize>)> {
    variant_tensor_specs(shape, tie_word_embeddings, Variant::default())
}

/// [`tensor_specs`] of an architecture `variant`: each layer's biases (`….bias`, `[out]`) and
/// per-head norms (`self_attn.{q,k}_norm.weight`, `[head_dim]`) after its Llama tensors.
pub fn variant_tensor_specs(
    shape: &ModelShape,
    tie_word_embeddings: bool,
    variant: Variant,
) -> Vec<(String, Vec<usize>)> {
    let (hidden, q, kv, ffn) = (shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.ffn);
    let mut specs = vec![(EMBED_TOKENS.to_owned(), vec![shape.vocab, hidden])];
    for i in 0..shape.layers {
        let p = format!("model.layers.{i}");
        if variant.qkv_bias {
            specs.extend([
                (format!("{p}.self_attn.q_proj.bias"), vec![q]),
                (format!("{p}.self_attn.k_proj.bias"), vec![kv]),
                (format!("{p}.self_attn.v_proj.bias"), vec![kv]),
            ]);
        }
        if variant.o_bias {
            specs.push((format!("{p}.self_attn.o_proj.bias"), vec![hidden]));
        }
        if variant.qk_norm {
            specs.extend([
                (format!("{p}.self_attn.q_norm.weight"), vec![shape.head_dim]),
                (format!("{p}.self_attn.k_norm.weight"), vec![shape.head_dim]),
            ]);
        }
        specs.extend([
            (format!("{p}.input_layernorm.weight"), vec![hidden]),
            (format!("{p}.self_attn.q_proj.weight"), vec![q, hidden]),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv, hidden]),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv, hidden]),
            (format!("{p}.self_attn.o_proj.weight"), vec![hidden, q]),
            (format!("{p}.post_attention_layernorm.weight"), vec![hidden]),
            (format!("{p}.mlp.gate_proj.weight"), vec![ffn, hidden]),
            (format!("{p}.mlp.up_proj.weight"), vec![ffn, hidden]),
            (format!("{p}.mlp.down_proj.weight"), vec![hidden, ffn]),
        ]);
    }
    specs.push((FINAL_NORM.to_owned(), vec![hidden]));
    if !tie_word_embeddings {
        specs.push((LM_HEAD.to_owned(), vec![shape.vocab, hidden]));
    }
    specs
}

/// One tensor in host memory, row-major.
#[derive(Clone, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` elements.
    pub data: Vec<f32>,
}

impl HostTensor {
    /// `(rows, cols)` as [`crate::Backend::weight`] takes them: a vector is one row.
    pub fn rows_cols(&self) -> (usize, usize) {
        match self.shape.as_slice() {
            [cols] => (1, *cols),
            [rows, cols] => (*rows, *cols),
            dims => (dims[..dims.len().saturating_sub(1)].iter().product(), dims.last().copied().unwrap_or(1)),
        }
    }
}

impl fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostTensor").field("shape", &self.shape).field("len", &self.data.len()).finish()
    }
}

/// All weights of a Llama model in host memory, as `f32`.
#[derive(Clone, PartialEq)]
pub struct HostWeights {
    /// The model's dimensions.
    pub shape: ModelShape,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// What the architecture adds to Llama's layers.
    pub variant: Variant,
    /// RoPE's frequency scaling.
    pub rope_scaling: RopeScaling,
    /// Tensors by Hugging Face name (see the module documentation).
    pub tensors: HashMap<String, HostTensor>,
}

impl fmt::Debug for HostWeights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostWeights")
            .field("shape", &self.shape)
            .field("rope_theta", &self.rope_theta)
            .field("rms_eps", &self.rms_eps)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl HostWeights {
    /// Deterministic random weights for `shape`: the same `seed` gives bitwise the same weights,
    /// whatever the number of threads.
    ///
    /// A matrix is uniform in `±sqrt(3 / in_features)`, so a unit-scale input gives a unit-scale
    /// output; the embedding is uniform in `±sqrt(3)` (unit-scale token vectors); norm weights
    /// are 1. The output projection is its own matrix (never tied). `rope_theta` is 500000 for
    /// `llama-1b` and `llama-8b` (as Llama 3) and 10000 otherwise; `rms_eps` is 1e-5.
    pub fn random(shape: ModelShape, seed: u64) -> HostWeights {
        let rope_theta = random_rope_theta(shape.name);
        let mut tensors: HashMap<String, HostTensor> = tensor_specs(&shape, false)
            .into_iter()
            .map(|(name, dims)| {
                let len = dims.iter().product();
                (name, HostTensor { shape: dims, data: vec![0.0; len] })
            })
            .collect();
        let mut jobs = Vec::new();
        for (name, tensor) in &mut tensors {
            let scale = match (name.as_str(), tensor.shape.as_slice()) {
                (_, [_]) => None,
                (EMBED_TOKENS, _) => Some(3f32.sqrt()),
                (_, dims) => Some((3.0 / *dims.last().unwrap_or(&1) as f32).sqrt()),
            };
            let tensor_seed = splitmix64(seed ^ fnv1a(name.as_bytes()));
            for (index, chunk) in tensor.data.chunks_mut(CHUNK).enumerate() {
                jobs.push((chunk, scale, splitmix64(tensor_seed.wrapping_add(index as u64))));
            }
        }
        run_parallel(jobs, |(chunk, scale, chunk_seed)| match scale {
            None => chunk.fill(1.0),
            Some(scale) => fill_uniform(chunk, chunk_seed, scale),
        });
        HostWeights {
            shape,
            rope_theta,
            rms_eps: 1e-5,
            variant: Variant::default(),
            rope_scaling: RopeScaling::Default,
            tensors,
        }
    }

    /// Loads a Llama-format checkpoint: `dir/config.json` and the safetensors files that
    /// `dir/model.safetensors.index.json` names, or every `dir/*.safetensors` when there is no
    /// index. Every tensor of [`tensor_specs`] must be present once, with its shape, as F32, F16
    /// or BF16; other tensors are ignored (so is `lm_head.weight` when the embeddings are tied).
    ///
    /// The shape is named after `dir` ([`HfConfig::shape_for_dir`], which leaks that name). The
    /// files are memory-mapped and must not be modified while this runs.
    pub fn load(dir: &Path) -> Result<HostWeights, WeightsError> {
        let config = read_hf_config(dir)?;
        let shape = config.shape_for_dir(dir);
        let files = weight_files(dir)?;
        let mut maps = Vec::with_capacity(files.len());
        for path in &files {
            let file = std::fs::File::open(path).map_err(|e| WeightsError::io(path, e))?;
            // SAFETY: the map is read-only and private to this call, and lives until every view of
            // it is dropped below. Like every memory-mapping loader, this relies on the checkpoint
            // not being truncated or rewritten while it is read (documented above).
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| WeightsError::io(path, e))?;
            maps.push(map);
        }
        let mut parsed = Vec::with_capacity(files.len());
        for (path, map) in files.iter().zip(&maps) {
            let st = SafeTensors::deserialize(map)
                .map_err(|source| WeightsError::Safetensors { path: path.clone(), source })?;
            parsed.push(st);
        }

        let specs = variant_tensor_specs(&shape, config.tie_word_embeddings, config.variant);
        let wanted: HashMap<&str, &[usize]> = specs.iter().map(|(n, s)| (n.as_str(), s.as_slice())).collect();
        let mut found: HashMap<&str, (usize, TensorView<'_>)> = HashMap::new();
        for (file_index, st) in parsed.iter().enumerate() {
            for (name, view) in st.iter() {
                let Some((&name, _)) = wanted.get_key_value(name) else { continue };
                if let Some((first, _)) = found.insert(name, (file_index, view)) {
                    return Err(WeightsError::DuplicateTensor {
                        tensor: name.to_owned(),
                        first: files[first].clone(),
                        second: files[file_index].clone(),
                    });
                }
            }
        }

        let mut tensors = HashMap::with_capacity(specs.len());
        let mut sources = HashMap::with_capacity(specs.len());
        for (name, dims) in &specs {
            let Some((file_index, view)) = found.remove(name.as_str()) else {
                let files = files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ");
                return Err(WeightsError::MissingTensor { dir: dir.to_owned(), tensor: name.clone(), files });
            };
            let path = &files[file_index];
            if view.shape() != dims.as_slice() {
                return Err(WeightsError::TensorShape {
                    path: path.clone(),
                    tensor: name.clone(),
                    expected: dims.clone(),
                    found: view.shape().to_vec(),
                });
            }
            if !matches!(view.dtype(), StDtype::F32 | StDtype::F16 | StDtype::BF16) {
                return Err(WeightsError::UnsupportedDtype {
                    path: path.clone(),
                    tensor: name.clone(),
                    dtype: format!("{:?}", view.dtype()),
                });
            }
            let len = dims.iter().product();
            tensors.insert(name.clone(), HostTensor { shape: dims.clone(), data: vec![0.0; len] });
            sources.insert(name.as_str(), view);
        }

        let mut jobs = Vec::new();
        for (name, tensor) in &mut tensors {
            let view = &sources[name.as_str()];
            let (dtype, data) = (view.dtype(), view.data());
            for (chunk, bytes) in tensor.data.chunks_mut(CHUNK).zip(data.chunks(CHUNK * dtype.bitsize() / 8)) {
                jobs.push((chunk, bytes, dtype));
            }
        }
        run_parallel(jobs, |(out, bytes, dtype)| convert_to_f32(dtype, bytes, out));

        Ok(HostWeights {
            shape,
            rope_theta: config.rope_theta,
            rms_eps: config.rms_norm_eps,
            variant: config.variant,
            rope_scaling: config.rope_scaling,
            tensors,
        })
    }

    /// Writes `dir/config.json` and `dir/model.safetensors` (all tensors in `dtype`, rounded to
    /// nearest even), creating `dir` if needed. The embeddings are written as tied when
    /// `lm_head.weight` is absent. Tensors that are not part of the model are not written.
    pub fn save_safetensors(&self, dir: &Path, dtype: Dtype) -> Result<(), WeightsError> {
        let tied = !self.tensors.contains_key(LM_HEAD);
        let specs = variant_tensor_specs(&self.shape, tied, self.variant);
        let mut checked = Vec::with_capacity(specs.len());
        for (name, dims) in specs {
            let inconsistent = |detail: String| WeightsError::Inconsistent { model: self.shape.name, detail };
            let tensor = self.tensors.get(&name).ok_or_else(|| inconsistent(format!("no tensor `{name}`")))?;
            if tensor.shape != dims || tensor.data.len() != dims.iter().product::<usize>() {
                return Err(inconsistent(format!(
                    "`{name}` has shape {:?} and {} elements, expected {dims:?}",
                    tensor.shape,
                    tensor.data.len()
                )));
            }
            checked.push((name, tensor));
        }
        let encoded = encode_all(dtype, &checked.iter().map(|(_, t)| t.data.as_slice()).collect::<Vec<_>>());
        std::fs::create_dir_all(dir).map_err(|e| WeightsError::io(dir, e))?;
        let st_dtype = match dtype {
            Dtype::F32 => StDtype::F32,
            Dtype::F16 => StDtype::F16,
            Dtype::Bf16 => StDtype::BF16,
        };
        let path = dir.join("model.safetensors");
        let mut views = Vec::with_capacity(encoded.len());
        for ((name, tensor), bytes) in checked.iter().zip(&encoded) {
            let view = TensorView::new(st_dtype, tensor.shape.clone(), bytes)
                .map_err(|source| WeightsError::Safetensors { path: path.clone(), source })?;
            views.push((name.as_str(), view));
        }
        let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
        safetensors::serialize_to_file(views, Some(metadata), &path).map_err(|source| match source {
            safetensors::SafeTensorError::IoError(e) => WeightsError::io(&path, e),
            source => WeightsError::Safetensors { path: path.clone(), source },
        })?;
        let config = HfConfig {
            variant: self.variant,
            rope_scaling: self.rope_scaling,
            ..HfConfig::from_shape(&self.shape, self.rope_theta, self.rms_eps, tied)
        };
        let config_path = dir.join("config.json");
        let text = serde_json::to_string_pretty(&config.to_json(dtype))
            .map_err(|source| WeightsError::Json { path: config_path.clone(), source })?;
        std::fs::write(&config_path, text + "\n").map_err(|e| WeightsError::io(&config_path, e))
    }

    /// The output projection `[vocab, hidden]`: `lm_head.weight`, or the token embedding when
    /// the embeddings are tied.
    ///
    /// # Panics
    /// If neither tensor is present (weights from [`random`](Self::random) or
    /// [`load`](Self::load) always have them).
    pub fn lm_head(&self) -> &HostTensor {
        self.tensors
            .get(LM_HEAD)
            .or_else(|| self.tensors.get(EMBED_TOKENS))
            .expect("HostWeights without lm_head.weight or model.embed_tokens.weight")
    }

    /// Parameters held (the tied output projection counts once).
    pub fn num_params(&self) -> usize {
        self.tensors.values().map(|t| t.data.len()).sum()
    }
}

/// The RoPE base of random weights: Llama 3's for its shapes, the classic 10000 for the rest.
fn random_rope_theta(name: &str) -> f32 {
    match name {
        "llama-1b" | "llama-8b" => 500_000.0,
        _ => 10_000.0,
    }
}

/// The safetensors files of a checkpoint: those its index names, else every `*.safetensors`,
/// sorted.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, WeightsError> {
    let index_path = dir.join("model.safetensors.index.json");
    if index_path.exists() {
        #[derive(serde::Deserialize)]
        struct Index {
            weight_map: HashMap<String, String>,
        }
        let text = std::fs::read_to_string(&index_path).map_err(|e| WeightsError::io(&index_path, e))?;
        let index: Index =
            serde_json::from_str(&text).map_err(|source| WeightsError::Json { path: index_path.clone(), source })?;
        let names: BTreeSet<String> = index.weight_map.into_values().collect();
        let mut files = Vec::with_capacity(names.len());
        for file in names {
            let path = dir.join(&file);
            if !path.is_file() {
                return Err(WeightsError::Index { path: index_path, file });
            }
            files.push(path);
        }
        if files.is_empty() {
            return Err(WeightsError::NoWeightFiles { dir: dir.to_owned() });
        }
        return Ok(files);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| WeightsError::io(dir, e))? {
        let path = entry.map_err(|e| WeightsError::io(dir, e))?.path();
        if path.extension().is_some_and(|ext| ext == "safetensors") && path.is_file() {
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(WeightsError::NoWeightFiles { dir: dir.to_owned() });
    }
    files.sort();
    Ok(files)
}

/// Decodes little-endian F32, F16 or BF16 elements (`bytes` holds exactly `out.len()` of them).
fn convert_to_f32(dtype: StDtype, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        StDtype::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.as_chunks::<4>().0) {
                *o = f32::from_le_bytes(*b);
            }
        }
        StDtype::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.as_chunks::<2>().0) {
                *o = half::f16::from_le_bytes(*b).to_f32();
            }
        }
        StDtype::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.as_chunks::<2>().0) {
                *o = half::bf16::from_le_bytes(*b).to_f32();
            }
        }
        // `load` refuses every other dtype before converting.
        other => unreachable!("convert_to_f32({other:?})"),
    }
}

/// Encodes tensors as little-endian `dtype` elements (round to nearest even), on all cores.
fn encode_all(dtype: Dtype, tensors: &[&[f32]]) -> Vec<Vec<u8>> {
    let size = dtype.size_bytes();
    let mut out: Vec<Vec<u8>> = tensors.iter().map(|t| vec![0; t.len() * size]).collect();
    let mut jobs = Vec::new();
    for (data, bytes) in tensors.iter().zip(&mut out) {
        jobs.extend(data.chunks(CHUNK).zip(bytes.chunks_mut(CHUNK * size)));
    }
    run_parallel(jobs, |(data, bytes)| match dtype {
        Dtype::F32 => {
            for (b, x) in bytes.as_chunks_mut::<4>().0.iter_mut().zip(data) {
                *b = x.to_le_bytes();
            }
        }
        Dtype::F16 => {
            for (b, &x) in bytes.as_chunks_mut::<2>().0.iter_mut().zip(data) {
                *b = half::f16::from_f32(x).to_le_bytes();
            }
        }
        Dtype::Bf16 => {
            for (b, &x) in bytes.as_chunks_mut::<2>().0.iter_mut().zip(data) {
                *b = half::bf16::from_f32(x).to_le_bytes();
            }
        }
    });
    out
}

/// Runs `f` on every job, on up to `available_parallelism` scoped threads.
fn run_parallel<J: Send>(jobs: Vec<J>, f: impl Fn(J) + Sync) {
    let threads = std::thread::available_parallelism().map_or(1, NonZeroUsize::get).min(jobs.len());
    if threads <= 1 {
        jobs.into_iter().for_each(f);
        return;
    }
    let queue = Mutex::new(jobs.into_iter());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    // The lock is never held across `f`, so a panicking job cannot poison it.
                    let job = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
                    match job {
                        Some(job) => f(job),
                        None => break,
                    }
                }
            });
        }
    });
}

/// Fills `out` uniformly in `[-scale, scale)` from a splitmix64 stream seeded with `seed`.
fn fill_uniform(out: &mut [f32], seed: u64, scale: f32) {
    for (i, x) in (1u64..).zip(out) {
        // The i-th splitmix64 state, computed directly so that elements are independent (and the
        // loop vectorizes); 24 random bits give [0, 1) exactly in f32.
        let bits = splitmix64(seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        let unit = (bits >> 40) as f32 * (1.0 / (1u32 << 24) as f32);
        *x = (2.0 * unit - 1.0) * scale;
    }
}

/// The splitmix64 output function (Steele, Lea and Flood 2014).
fn splitmix64(x: u64) -> u64 {
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 64-bit FNV-1a: a stable hash of tensor names (unlike `DefaultHasher`, fixed across Rust
/// versions).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xCBF2_9CE4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3))
}

#[cfg(test)]
mod tests;
