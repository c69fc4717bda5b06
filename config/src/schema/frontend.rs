//! `[frontend]`: the HTTP API.

use serde::{Deserialize, Serialize};

use crate::{ByteSize, HumanDuration};

/// `[frontend]`: the HTTP API (OpenAI chat and Responses, Anthropic Messages).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FrontendSection {
    /// Listen address, `ip:port`. Default `"127.0.0.1:8000"`.
    pub http: String,
    /// Largest request body accepted. Default `"32MiB"`.
    pub max_body: ByteSize,
    /// A request that has not finished by then is cancelled. Default `"600s"`.
    pub request_timeout: HumanDuration,
    /// A session without requests for this long ends and releases its holds. Default `"10m"`.
    pub session_idle_timeout: HumanDuration,
    /// `max_tokens` of a request that does not set one. Default `512`.
    pub default_max_tokens: usize,
    /// Longest prompt accepted, in tokens; `0` means the model's context (what G1 holds). A
    /// longer prompt is refused with `context_length_exceeded` before it is queued. Default `0`.
    pub max_prompt_tokens: usize,
    /// Most bytes of text a prompt may carry (messages, system text, tools): a request over it is
    /// refused from its size, before it is rendered or tokenized. Default `"8MiB"`.
    pub max_prompt_bytes: ByteSize,
    /// Conversations (sessions) tracked at once; past it the idlest is forgotten. Default `16384`.
    pub max_sessions: usize,
    /// A connection must send a complete request head within this long of opening, or of the
    /// end of its previous response (an idle keep-alive connection is closed after it too).
    /// Default `"15s"`.
    pub header_timeout: HumanDuration,
    /// A request body must arrive within this long of its head (HTTP 408 otherwise). Default `"30s"`.
    pub body_timeout: HumanDuration,
    /// A response write that makes no progress for this long (a client that stopped reading)
    /// closes the connection, which cancels its request. Default `"60s"`.
    pub write_timeout: HumanDuration,
    /// HTTP connections open at once; more are answered 503 and closed, with a log line and
    /// `dynamo_node_http_connections_refused_total`. Capped below the process's file limit.
    /// Default `1024`.
    pub max_connections: usize,
    /// HTTP connections one client address may hold open at once. At this cap, or at
    /// `max_connections`, the node closes an idle connection (no request in flight: one that never
    /// sent a request first, then the oldest) of that client (or, at `max_connections`, of the
    /// client holding the most) to make room, and answers 503 only when none is idle. Default `256`.
    pub max_connections_per_client: usize,
    /// On a loopback address, requests must name the node by a loopback `Host` (`localhost`,
    /// `127.0.0.1`, `[::1]`) or one of these, and a browser's `Origin` must be one of them too,
    /// so a web page cannot drive a local node (DNS rebinding, cross-site requests). Ignored on
    /// other addresses. Default `[]`.
    pub allowed_hosts: Vec<String>,
    /// How chat answers are split into reasoning and text, by Dynamo's parser names (`qwen3`,
    /// `deepseek_r1`, `gpt_oss`, …; `dynamo-node config check` lists them). Default: none.
    pub reasoning_parser: Option<String>,
    /// How chat answers are read for tool calls (`hermes`, `qwen3_coder`, `llama3_json`, …).
    /// Default: none.
    pub tool_call_parser: Option<String>,
    /// Drop Claude Code's `x-anthropic-billing-header: …` system text, which changes on every
    /// request, before rendering (so a session's prompts share their prefix). Default `true`.
    pub strip_anthropic_preamble: bool,
    /// Anthropic Messages' temperature when a request sends none (the `anthropic` SDK sends no
    /// sampling parameters); the API's own default. Default `1.0`.
    pub messages_temperature: f32,
    /// Generated turns kept (per session) for token-identical replay, in tokens: when a later
    /// request echoes one of them, its generated token ids are spliced into the prompt instead of
    /// the template's re-rendering. `0` turns replay off. Default `4194304` (16 MiB of ids).
    pub replay_tokens: usize,
    /// A kept turn is forgotten after this long. Default `"1h"`.
    pub replay_ttl: HumanDuration,
    /// Responses kept for `previous_response_id` and `GET /v1/responses/{id}` (`store: true`,
    /// the Responses API's default); past it the oldest is forgotten. `0` stores none. Default `1024`.
    pub responses_store: usize,
    /// Bytes the stored responses may keep in all: their objects, input items and conversations
    /// (a continuation shares its history, not a copy). With keys, each tenant gets an equal share
    /// of this and of `responses_store`, and its own oldest go past it. Default `"256MiB"`.
    pub responses_store_bytes: ByteSize,
    /// A stored response is forgotten after this long. Default `"24h"`.
    pub responses_ttl: HumanDuration,
    /// A cache breakpoint (`cache_control`, `prompt_cache_retention`) covering fewer prompt tokens
    /// than this is ignored: the prefix is kept by plain retention, not leased (Anthropic's
    /// minimum cacheable prompt). Default `1024`.
    pub cache_min_tokens: usize,
    /// `[frontend.auth]`: API keys and the tenants they name. Default: none (every request is
    /// served, in one shared cache namespace).
    pub auth: AuthSection,
}

/// `[frontend.auth]`: who may call the API, and whose cache a request uses.
///
/// With no keys every request is served and all of them share one cache namespace; the node warns
/// at start when it listens beyond loopback like that. With keys, every API route needs one
/// (`Authorization: Bearer KEY`, as the OpenAI SDK sends it, or `x-api-key: KEY`, as the Anthropic
/// SDK does), and each tenant's blocks are hashed under a salt of its own, so no tenant can reuse,
/// or probe, another's cached prefix.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthSection {
    /// The accepted keys, each naming its tenant: `[[frontend.auth.keys]]` tables of `key` and
    /// `tenant`. Several keys may name one tenant (key rotation). Default: none.
    pub keys: Vec<ApiKey>,
}

/// One accepted API key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    /// The key as clients send it.
    pub key: String,
    /// The tenant it names: requests with this key share one cache namespace.
    pub tenant: String,
}

impl Default for FrontendSection {
    fn default() -> Self {
        FrontendSection {
            http: "127.0.0.1:8000".to_owned(),
            max_body: ByteSize::mib(32),
            request_timeout: HumanDuration::secs(600),
            session_idle_timeout: HumanDuration::mins(10),
            default_max_tokens: 512,
            max_prompt_tokens: 0,
            max_prompt_bytes: ByteSize::mib(8),
            max_sessions: 16_384,
            header_timeout: HumanDuration::secs(15),
            body_timeout: HumanDuration::secs(30),
            write_timeout: HumanDuration::secs(60),
            max_connections: 1024,
            max_connections_per_client: 256,
            allowed_hosts: Vec::new(),
            reasoning_parser: None,
            tool_call_parser: None,
            strip_anthropic_preamble: true,
            messages_temperature: 1.0,
            replay_tokens: 4 << 20,
            replay_ttl: HumanDuration::mins(60),
            responses_store: 1024,
            responses_store_bytes: ByteSize::mib(256),
            responses_ttl: HumanDuration::mins(24 * 60),
            cache_min_tokens: 1024,
            auth: AuthSection::default(),
        }
    }
}
