//! The contract between the frontend and the generation backend.
//!
//! The frontend turns an API request into a [`GenerateRequest`] (token ids, with the retention
//! region of every token range) and hands it to a [`Generator`]; the generator answers with a
//! stream of [`GenerateEvent`]s: one [`GenerateEvent::Started`] once the prompt is admitted (with
//! the number of prompt tokens whose KV was found cached), then one [`GenerateEvent::Token`] per
//! generated token, then one [`GenerateEvent::Finished`]. An error may end the stream at any point;
//! an error before `Started` (overload, unknown model, prompt too long) becomes an HTTP error
//! status, a later one ends the response (an SSE error event when streaming).
//!
//! Dropping the stream cancels the request: the frontend drops it when the client goes away or
//! when a stop string ends the answer early, so a generator must release what the request held
//! when its stream is dropped.

use std::ops::Range;
use std::time::Duration;

use dynamo_config::RegionKind;
use futures::stream::BoxStream;

/// Agent hints of a request (the `nvext` object of the API). The frontend only parses them;
/// the session and scheduler actors decide what they mean.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default)]
pub struct AgentHints {
    /// Scheduling priority; higher is more urgent.
    pub priority: Option<i32>,
    /// How many tokens the caller expects the answer to have.
    pub expected_output_tokens: Option<usize>,
    /// Prefill the prompt into the cache without generating (a warm-up for the next call).
    pub speculative_prefill: Option<bool>,
    /// Keep the whole prompt cached after each use: a lease for clients whose API has no
    /// breakpoints (Chat Completions, Responses), in Anthropic's `cache_control` shape, as
    /// NVIDIA Dynamo's `nvext.cache_control` had it.
    pub cache_control: Option<CacheControlHint>,
    /// NVIDIA Dynamo's agent hints (`nvext.agent_hints`), under Dynamo's own names, so a harness
    /// written for Dynamo works unchanged.
    pub agent_hints: Option<DynamoAgentHints>,
}

/// `nvext.agent_hints`, NVIDIA Dynamo's agent hints v1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default)]
pub struct DynamoAgentHints {
    /// Request priority; higher goes first (as `nvext.priority`, which wins when both are set).
    pub priority: Option<i32>,
    /// The answer's expected length in tokens (as `nvext.expected_output_tokens`).
    pub osl: Option<usize>,
    /// Once this answer is done, prefill the next turn's prefix (the prompt and this answer's
    /// tokens, which the node replays into the next prompt as they were) on the same engine, so
    /// the next call finds it cached. Unlike `nvext.speculative_prefill`, the request itself is
    /// answered as usual.
    pub speculative_prefill: Option<bool>,
    /// A strict queue tier: a higher tier always runs before a lower one, whatever the queue
    /// policy says within a tier.
    pub strict_priority: Option<i32>,
}

impl AgentHints {
    /// The priority, from `nvext.priority` or else `nvext.agent_hints.priority`.
    pub fn priority(&self) -> Option<i32> {
        self.priority.or(self.agent_hints.and_then(|h| h.priority))
    }

    /// The expected answer length, from `nvext.expected_output_tokens` or else
    /// `nvext.agent_hints.osl`.
    pub fn expected_output_tokens(&self) -> Option<usize> {
        self.expected_output_tokens.or(self.agent_hints.and_then(|h| h.osl))
    }

    /// The strict queue tier (0 without one).
    pub fn strict_priority(&self) -> i32 {
        self.agent_hints.and_then(|h| h.strict_priority).unwrap_or(0)
    }

    /// Whether the next turn's prefix is to be prefilled once this answer is done.
    pub fn warm_next_turn(&self) -> bool {
        self.agent_hints.and_then(|h| h.speculative_prefill).unwrap_or(false)
    }
}

/// `nvext.cache_control`: `{"type": "ephemeral", "ttl": "5m" | "1h"}` (`ttl` defaults to 5m).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct CacheControlHint {
    /// Always `ephemeral`.
    #[serde(rename = "type")]
    pub kind: Ephemeral,
    /// How long the lease lives after each use.
    #[serde(default)]
    pub ttl: HintTtl,
}

/// The one `cache_control` type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Ephemeral {
    /// `"ephemeral"`.
    Ephemeral,
}

/// The TTL of an `nvext.cache_control` lease.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub enum HintTtl {
    /// `"5m"`.
    #[default]
    #[serde(rename = "5m")]
    FiveMinutes,
    /// `"1h"`.
    #[serde(rename = "1h")]
    OneHour,
}

/// Token ranges of a prompt by region, in order, covering the whole prompt without overlap.
pub type RegionRanges = Vec<(Range<usize>, RegionKind)>;

/// One generation request: a tokenized prompt and how to continue it.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateRequest {
    /// Unique per request (`chatcmpl-…` / `cmpl-…`); the `id` of the API response.
    pub response_id: String,
    /// The request's id in logs and in the `x-request-id` response header (the client's own when
    /// it sent one): the session, scheduler and worker log under it.
    pub request_id: std::sync::Arc<str>,
    /// The model named by the client (one of [`Generator::models`]).
    pub model: String,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Token ranges of `prompt` by region, in order, covering the whole prompt without overlap.
    pub regions: RegionRanges,
    /// Most tokens to generate (at least 1; never more than `max_context - prompt.len()`).
    pub max_tokens: usize,
    /// How to pick each token (temperature 0 is greedy).
    pub sampling: dynamo_kernels::sampling::Sampling,
    /// Seed of the sampler, for reproducible sampling.
    pub seed: Option<u64>,
    /// Generation finishes with [`FinishReason::Stop`] after emitting one of these.
    pub stop_token_ids: Vec<u32>,
    /// The conversation this request continues, as its tenant's session key (the session headers
    /// agents send, else the body's `metadata.user_id`, `prompt_cache_key` or `user`).
    pub session_id: Option<String>,
    /// Whose request it is: its blocks are cached under the tenant's own namespace.
    pub tenant: super::Tenant,
    /// The request's `cache_salt` (vLLM's field): narrows the tenant's namespace further.
    pub cache_salt: Option<String>,
    /// Prefixes of the prompt to keep (`cache_control` breakpoints), at most four, each its
    /// length in tokens and how long it lives after each use.
    pub cache_leases: Vec<(usize, Duration)>,
    /// Agent hints (`nvext`).
    pub hints: AgentHints,
    /// The answer's tokens when the engine is scripted (`engine.kind = "scripted"`): computed,
    /// not sampled.
    pub forced: Option<Vec<u32>>,
}

/// What a generation stream reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GenerateEvent {
    /// The prompt was admitted; `cached_tokens` of its tokens were served from the KV cache.
    Started {
        /// Prompt tokens whose KV was loaded instead of computed.
        cached_tokens: usize,
        /// Prompt tokens its leases newly cover, for leases under an hour and of an hour or more.
        leased_tokens: (usize, usize),
    },
    /// One generated token.
    Token {
        /// Its id.
        id: u32,
    },
    /// Generation is over; nothing follows.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Prompt tokens whose KV was loaded instead of computed, as the engine finally counted
        /// them: the same as [`GenerateEvent::Started`]'s, except from an engine that reports it
        /// only at the end (vLLM).
        cached_tokens: usize,
    },
}

/// Why generation finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// A stop token was generated (or a stop string matched).
    Stop,
    /// The answer ended after calling tools (a stop, once the tool parser found calls).
    ToolCalls,
}

impl FinishReason {
    /// The API's `finish_reason`: `length`, `stop` or `tool_calls`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// Why a generation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GenerateError {
    /// The node is saturated; the client should retry after the given time (HTTP 429).
    #[error("the server is overloaded; retry in {}s", retry_after.as_secs().max(1))]
    Overloaded {
        /// When to retry.
        retry_after: Duration,
    },
    /// No such model (HTTP 404).
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    /// The prompt does not fit the model's context (HTTP 400).
    #[error("the prompt has {tokens} tokens, more than the model's context of {limit} tokens allows")]
    PromptTooLong {
        /// Prompt tokens.
        tokens: usize,
        /// The limit.
        limit: usize,
    },
    /// The node cannot take the request right now (a worker restarting, shutdown); the client
    /// should retry after the given time (HTTP 503).
    #[error("the service is unavailable: {message}")]
    Unavailable {
        /// Why.
        message: String,
        /// When to retry.
        retry_after: Duration,
    },
    /// Anything else (HTTP 500).
    #[error("internal error: {0}")]
    Internal(String),
}

impl GenerateError {
    /// A stable label for metrics: `overloaded`, `model_not_found`, `prompt_too_long`, `unavailable` or
    /// `internal`.
    pub fn kind(&self) -> &'static str {
        match self {
            GenerateError::Overloaded { .. } => "overloaded",
            GenerateError::ModelNotFound(_) => "model_not_found",
            GenerateError::PromptTooLong { .. } => "prompt_too_long",
            GenerateError::Unavailable { .. } => "unavailable",
            GenerateError::Internal(_) => "internal",
        }
    }
}

/// A generation backend: the actor tree in the node, a fake in tests.
pub trait Generator: Send + Sync + 'static {
    /// The models served, as clients name them.
    fn models(&self) -> Vec<String>;
    /// Most tokens (prompt + generated) of one request.
    fn max_context(&self) -> usize;
    /// Starts a generation; see the module doc for the event contract. Dropping the stream
    /// cancels the request.
    fn generate(&self, req: GenerateRequest) -> BoxStream<'static, Result<GenerateEvent, GenerateError>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamos_agent_hints_are_read_under_dynamos_names_and_nvexts_own_win() {
        let hints: AgentHints = serde_json::from_value(serde_json::json!({
            "agent_hints": {"priority": 5, "osl": 1024, "speculative_prefill": true, "strict_priority": 1}
        }))
        .unwrap();
        assert_eq!(hints.priority(), Some(5));
        assert_eq!(hints.expected_output_tokens(), Some(1024));
        assert_eq!(hints.strict_priority(), 1);
        assert!(hints.warm_next_turn());
        assert_eq!(hints.speculative_prefill, None, "Dynamo's speculative prefill answers the request as usual");
        let both: AgentHints =
            serde_json::from_value(serde_json::json!({"priority": -1, "agent_hints": {"priority": 5}})).unwrap();
        assert_eq!(both.priority(), Some(-1));
        assert_eq!(AgentHints::default().strict_priority(), 0);
    }
}
