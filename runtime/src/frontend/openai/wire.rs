//! The OpenAI Chat Completions and Completions request bodies the frontend accepts. Unknown fields are ignored (clients send many
//! that do not apply here); fields of the wrong type are 400 errors.

use serde::Deserialize;

use crate::frontend::generate::AgentHints;

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatCompletionRequest {
    /// The model.
    pub model: String,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Tool definitions, rendered by the chat template.
    #[serde(default)]
    pub tools: Option<Vec<serde_json::Value>>,
    /// `none`, `auto`, `required`, or `{"type": "function", "function": {"name": …}}`.
    #[serde(default)]
    pub tool_choice: Option<ToolChoiceWire>,
    /// Whether the model may call several tools at once.
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// Deprecated alias of `max_completion_tokens`.
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// Most tokens to generate.
    #[serde(default)]
    pub max_completion_tokens: Option<usize>,
    /// Sampling temperature, 0..=2; 0 is greedy. Default: the model's, else 1.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling, in (0, 1]. Default: the model's, else 1.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Top-k sampling (vLLM's extension); 0 or -1 keeps all. Default: the model's, else all.
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Repetition penalty (vLLM's extension), above 0. Default: the model's, else 1 (none).
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// Sampler seed.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<StopStrings>,
    /// Number of choices; only 1 is supported.
    #[serde(default)]
    pub n: Option<usize>,
    /// Stream server-sent events.
    #[serde(default, deserialize_with = "crate::frontend::http::null_as_default")]
    pub stream: bool,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// End-user id; the session id when no session header is sent.
    #[serde(default)]
    pub user: Option<String>,
    /// OpenAI's `prompt_cache_key`: names the session when no session header is sent.
    #[serde(default)]
    pub prompt_cache_key: Option<String>,
    /// OpenAI's `prompt_cache_retention`: `"24h"` leases the prompt for a day after each use;
    /// `"in_memory"` is the node's plain retention.
    #[serde(default)]
    pub prompt_cache_retention: Option<String>,
    /// vLLM's `cache_salt`: the request's blocks are shared only with requests of the same salt.
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// Agent hints.
    #[serde(default)]
    pub nvext: Option<AgentHints>,
    /// vLLM's `return_token_ids`: the response carries the prompt's ids (`prompt_token_ids`) and
    /// the answer's (`choices[].token_ids`, end-of-turn token included). Non-streaming only.
    #[serde(default)]
    pub return_token_ids: Option<bool>,
    /// Arguments for the chat template (`enable_thinking`, `preserve_thinking`, …), as vLLM
    /// and SGLang take them.
    #[serde(default)]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// `low`, `medium` or `high`: the template's `reasoning_effort` (gpt-oss).
    #[serde(default)]
    pub reasoning_effort: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    /// The model.
    pub model: String,
    /// The prompt: text, or token ids (a one-element list of either is accepted too).
    pub prompt: Prompt,
    /// Most tokens to generate.
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// Sampling temperature, 0..=2; 0 is greedy. Default: the model's, else 1.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling, in (0, 1]. Default: the model's, else 1.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Top-k sampling (vLLM's extension); 0 or -1 keeps all. Default: the model's, else all.
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Repetition penalty (vLLM's extension), above 0. Default: the model's, else 1 (none).
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// Sampler seed.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<StopStrings>,
    /// Number of choices; only 1 is supported.
    #[serde(default)]
    pub n: Option<usize>,
    /// Stream server-sent events.
    #[serde(default, deserialize_with = "crate::frontend::http::null_as_default")]
    pub stream: bool,
    /// Streaming options.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// End-user id; the session id when no session header is sent.
    #[serde(default)]
    pub user: Option<String>,
    /// vLLM's `cache_salt`: the request's blocks are shared only with requests of the same salt.
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// OpenAI's `prompt_cache_retention`: `"24h"` leases the prompt for a day after each use.
    #[serde(default)]
    pub prompt_cache_retention: Option<String>,
    /// Agent hints.
    #[serde(default)]
    pub nvext: Option<AgentHints>,
}

/// A completion prompt.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// A batch of texts (only one is supported).
    Texts(Vec<String>),
    /// A batch of token lists (only one is supported).
    TokenLists(Vec<Vec<u32>>),
}

/// `stop`: one string or a list.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum StopStrings {
    /// One string.
    One(String),
    /// Up to four strings.
    Many(Vec<String>),
}

impl StopStrings {
    /// The non-empty strings.
    pub fn into_vec(self) -> Vec<String> {
        let all = match self {
            StopStrings::One(s) => vec![s],
            StopStrings::Many(v) => v,
        };
        all.into_iter().filter(|s| !s.is_empty()).collect()
    }
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and no choices) before `[DONE]`.
    #[serde(default, deserialize_with = "crate::frontend::http::null_as_default")]
    pub include_usage: bool,
}

/// One chat message.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Text, or a list of `{"type": "text", "text": …}` parts; absent or null for an assistant
    /// turn that only calls tools.
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// The participant's name.
    #[serde(default)]
    pub name: Option<String>,
    /// An assistant turn's tool calls.
    #[serde(default)]
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` message answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// An assistant turn's reasoning, as this node sent it.
    #[serde(default)]
    pub reasoning_content: Option<String>,
}

/// `tool_choice`: a mode, or a named function (Chat nests the name in `function`, Responses
/// does not).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum ToolChoiceWire {
    /// `none`, `auto` or `required`.
    Mode(String),
    /// A named function.
    Function(NamedTool),
}

/// `{"type": "function", "function": {"name": …}}` or `{"type": "function", "name": …}`.
#[derive(Clone, Debug, Deserialize)]
pub struct NamedTool {
    /// Responses' form.
    #[serde(default)]
    pub name: Option<String>,
    /// Chat's form.
    #[serde(default)]
    pub function: Option<NamedFunction>,
}

/// The function of a [`NamedTool`].
#[derive(Clone, Debug, Deserialize)]
pub struct NamedFunction {
    /// Its name.
    pub name: String,
}

/// Message content.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts.
    Parts(Vec<ContentPart>),
}

impl MessageContent {
    /// Bytes of text it holds.
    pub fn text_bytes(&self) -> usize {
        match self {
            MessageContent::Text(text) => text.len(),
            MessageContent::Parts(parts) => parts.iter().map(|p| p.text.as_ref().map_or(0, String::len)).sum(),
        }
    }
}

/// A content part: only `text` parts are supported.
#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    /// `text` (others are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// The lease `prompt_cache_retention` asks for: `"24h"` a day; `"in_memory"` (or nothing) none
/// beyond plain retention; anything else is refused.
pub(crate) fn retention_mark(
    value: Option<&str>,
) -> Result<Option<crate::frontend::ir::CacheMark>, crate::frontend::ApiError> {
    match value {
        None | Some("in_memory") => Ok(None),
        Some("24h") => Ok(Some(crate::frontend::ir::CacheMark::OneDay)),
        Some(other) => Err(crate::frontend::ApiError::invalid(
            format!(
                "Invalid 'prompt_cache_retention': `{}` is not one of in_memory, 24h.",
                crate::frontend::error::clip(other, 64)
            ),
            Some("prompt_cache_retention"),
        )),
    }
}
