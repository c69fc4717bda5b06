//! The HTTP APIs in front of a [`Generator`]: OpenAI Chat Completions, Completions and Responses,
//! and Anthropic Messages, over one representation.
//!
//! Each protocol (one folder each: `openai/`, `anthropic/`) contributes two conversions: its wire
//! request → [`ir::Conversation`], and the answer's [`ir::Output`] events and [`ApiError`]s → its
//! wire format. Between them everything is shared: lowering to the chat template and tokens
//! (`lower`), token-identical replay of generated turns ([`replay`]), and the answer
//! (detokenization, stop strings, parsers, usage: `answer`).
//!
//! Routes ([`router`]):
//!
//! | route | |
//! |---|---|
//! | `POST /v1/chat/completions` | messages → chat template ([`template`]) → tokens with regions → generation |
//! | `POST /v1/completions` | a text or token-id prompt → generation |
//! | `POST /v1/responses` | OpenAI Responses, with stored responses and `previous_response_id` |
//! | `GET`, `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` | stored responses |
//! | `POST /v1/messages` | Anthropic Messages |
//! | `POST /v1/messages/count_tokens` | the prompt's real token count, through the same lowering |
//! | `GET /v1/models` | [`Generator::models`] (Anthropic's shape when `anthropic-version` is sent) |
//! | `GET /health` | `{"status": "ok"}` |
//!
//! A chat answer is split into reasoning, text and tool calls by the configured [`parsers`]
//! (`frontend.reasoning_parser`, `frontend.tool_call_parser`). The server under the routes is the
//! frontend's own ([`server`]: header and body timeouts, a connection cap), and on a loopback
//! address a request must name the node by a loopback `Host` (and `Origin`). Requests are parsed,
//! rendered and tokenized on the blocking pool.
//!
//! Both OpenAI generation routes answer with one JSON body, or with server-sent events (`stream: true`):
//! `data: {chunk}\n\n` per piece of text, a last chunk with the `finish_reason`, a `usage` chunk
//! when `stream_options.include_usage` is set, then `data: [DONE]`. `usage` reports
//! `prompt_tokens_details.cached_tokens` from [`GenerateEvent::Started`]. Text is streamed as soon
//! as it is complete UTF-8 ([`detok`]) and never shows part of a stop string.
//!
//! The first event of a generation is awaited before the response starts, so an error at
//! admission (overload, unknown model, prompt too long) is an HTTP status even for a streaming
//! request; an error after that ends the stream with a `data: {"error": …}` event. Errors have
//! the OpenAI shape ([`error`]): 400 `invalid_request_error` for malformed JSON, missing or
//! mistyped fields and over-long prompts; 404 `model_not_found`; 413 for a body over
//! `frontend.max_body`; 429 with `Retry-After` when the generator is overloaded; 504 when
//! `frontend.request_timeout` passes; 500 otherwise.
//!
//! Special-token strings (the tokenizer's, the template's BOS and EOS) in chat messages are
//! escaped before rendering ([`template::escape_special_tokens`]), so a message cannot forge the
//! template's structure; a legacy completion's prompt is the client's own and is not escaped.
//!
//! With `[frontend.auth]` keys, every route but `/health` needs an API key ([`auth`]); the key
//! names the request's [`Tenant`], whose blocks, sessions, replay handles and stored responses no
//! other tenant sees. The session of a request is the first session header it sends
//! (`x-claude-code-session-id`, Codex's `session-id`, `x-session-id`, `x-dynamo-session-id`), else
//! the session in Anthropic's `metadata.user_id`, else `prompt_cache_key`, else `user`, kept as a
//! digest under its tenant ([`Tenant::session_key`]). The
//! `nvext` object (agent hints) is parsed into [`AgentHints`].

mod answer;
mod anthropic;
pub mod auth;
pub mod detok;
pub mod error;
pub mod generate;
mod guard;
mod http;
pub mod ir;
mod lower;
pub mod openai;
pub mod parsers;
pub mod replay;
pub mod request_id;
pub mod server;
pub mod template;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use dynamo_config::FrontendSection;

pub use auth::{Tenant, constant_time_eq};
pub use error::ApiError;
pub use generate::{AgentHints, FinishReason, GenerateError, GenerateEvent, GenerateRequest, Generator, RegionRanges};
pub use http::session_key;
pub use template::{ChatTemplate, TemplateError, TemplateMessage};

use crate::tokenizer::Tokenizer;

/// What the handlers share: the generator, the tokenizer and chat template of the served model,
/// and the `[frontend]` limits. Cheap to clone.
#[derive(Clone)]
pub struct FrontendState {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    generator: Arc<dyn Generator>,
    tokenizer: Tokenizer,
    template: Arc<ChatTemplate>,
    stop_token_ids: Vec<u32>,
    /// Special-token strings escaped in chat messages: the tokenizer's, BOS and EOS.
    specials: Vec<String>,
    /// Ids of the special tokens left out of an answer's text (as `transformers` decodes with
    /// `skip_special_tokens`): every special token but the markers the configured reasoning and
    /// tool-call parsers read (which they remove themselves). Usage still counts them.
    hidden_ids: Arc<[u32]>,
    max_body: usize,
    default_max_tokens: usize,
    request_timeout: Duration,
    body_timeout: Duration,
    /// `frontend.max_prompt_tokens`; 0 for the generator's context.
    max_prompt_tokens: usize,
    /// Longest token of the tokenizer in bytes: a text of `n` bytes has at least
    /// `n / max_token_bytes` tokens, which refuses an over-long prompt before tokenizing it.
    max_token_bytes: usize,
    /// Rendering and tokenizing run on the blocking pool, this many at a time.
    preparing: Arc<tokio::sync::Semaphore>,
    /// Each client's share of `preparing`.
    preparing_by_client: Arc<http::ClientPermits>,
    /// `frontend.max_prompt_bytes`.
    max_prompt_bytes: usize,
    limits: server::ServerLimits,
    allowed_hosts: Vec<String>,
    /// `[frontend.auth]`: the API keys and their tenants.
    keys: Arc<auth::Keys>,
    /// `frontend.cache_min_tokens`.
    cache_min_tokens: usize,
    /// `frontend.reasoning_parser` (checked at start: [`check_parsers`]).
    reasoning: Option<parsers::ReasoningKind>,
    /// `frontend.tool_call_parser`.
    tools: Option<parsers::ToolFormat>,
    /// `frontend.strip_anthropic_preamble`.
    strip_anthropic_preamble: bool,
    /// `frontend.messages_temperature`: Anthropic Messages' temperature when a request sends none.
    messages_temperature: f32,
    /// The model's sampling defaults (its `generation_config.json`), for what a request leaves
    /// unset.
    sampling_defaults: ir::SamplingRequest,
    /// The scripted engine's answers, by turn ([`FrontendState::with_script`]).
    script: Option<Arc<Vec<String>>>,
    /// Generated turns, for token-identical replay.
    replay: Arc<replay::ReplayStore>,
    /// Stored Responses.
    responses: Arc<openai::store::ResponseStore>,
    /// The text of the end-of-turn tokens (the stop tokens, and the template's EOS): where a
    /// rendered assistant turn's generated part ends.
    end_markers: Vec<String>,
    /// `[recording]`: answered requests go to the traffic recording.
    recorder: Option<Arc<crate::recording::Recorder>>,
}

/// The ids of the special tokens an answer's text leaves out: each of `specials` that the
/// tokenizer encodes as one token, unless its text is part of a marker the parsers read.
fn hidden_special_ids(
    tokenizer: &Tokenizer,
    specials: &[String],
    reasoning: Option<parsers::ReasoningKind>,
    tools: Option<parsers::ToolFormat>,
) -> Arc<[u32]> {
    let mut markers: Vec<&str> = reasoning.into_iter().flat_map(parsers::ReasoningKind::markers).collect();
    markers.extend(tools.map(parsers::ToolFormat::markers).unwrap_or_default());
    let mut ids: Vec<u32> = specials
        .iter()
        .filter(|s| !markers.iter().any(|m| m.contains(s.as_str())))
        .filter_map(|s| match tokenizer.encode(s).ok()?[..] {
            [id] => Some(id),
            _ => None,
        })
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids.into()
}

impl fmt::Debug for FrontendState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FrontendState")
            .field("models", &self.inner.generator.models())
            .field("tokenizer", &self.inner.tokenizer)
            .field("stop_token_ids", &self.inner.stop_token_ids)
            .field("max_body", &self.inner.max_body)
            .finish_non_exhaustive()
    }
}

impl FrontendState {
    /// The state for `generator`, with limits from `config`. The stop tokens are the template's
    /// EOS and `<|endoftext|>`, each where the tokenizer encodes it as one token.
    pub fn new(
        generator: Arc<dyn Generator>,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        config: &FrontendSection,
    ) -> FrontendState {
        let mut stop_token_ids = Vec::new();
        let stops = template.stop_strings().iter().map(String::as_str);
        for candidate in [template.eos_token(), "<|endoftext|>"].into_iter().chain(stops) {
            if let Ok(ids) = tokenizer.encode(candidate)
                && let [id] = ids[..]
                && !candidate.is_empty()
                && !stop_token_ids.contains(&id)
            {
                stop_token_ids.push(id);
            }
        }
        let mut specials = tokenizer.special_tokens();
        for token in [template.bos_token(), template.eos_token()] {
            if !token.is_empty() && !specials.iter().any(|s| s == token) {
                specials.push(token.to_owned());
            }
        }
        let reasoning = config.reasoning_parser.as_deref().and_then(parsers::ReasoningKind::from_name);
        let tools = config.tool_call_parser.as_deref().and_then(parsers::ToolFormat::from_name);
        let hidden_ids = hidden_special_ids(&tokenizer, &specials, reasoning, tools);
        let preparers = std::thread::available_parallelism().map_or(2, |n| n.get());
        FrontendState {
            inner: Arc::new(Inner {
                generator,
                specials,
                hidden_ids,
                max_token_bytes: tokenizer.max_token_bytes().max(1),
                tokenizer,
                template: Arc::new(template),
                stop_token_ids,
                max_body: usize::try_from(config.max_body.0).unwrap_or(usize::MAX),
                default_max_tokens: config.default_max_tokens.max(1),
                request_timeout: config.request_timeout.0,
                body_timeout: config.body_timeout.0,
                max_prompt_tokens: config.max_prompt_tokens,
                preparing: Arc::new(tokio::sync::Semaphore::new(preparers)),
                preparing_by_client: Arc::new(http::ClientPermits::new((preparers / 2).max(1))),
                max_prompt_bytes: usize::try_from(config.max_prompt_bytes.as_u64()).unwrap_or(usize::MAX),
                limits: server::ServerLimits {
                    header_timeout: config.header_timeout.0,
                    write_timeout: config.write_timeout.0,
                    max_connections: config.max_connections,
                    max_per_client: config.max_connections_per_client,
                },
                allowed_hosts: config.allowed_hosts.clone(),
                keys: Arc::new(auth::Keys::new(&config.auth)),
                cache_min_tokens: config.cache_min_tokens,
                reasoning,
                tools,
                strip_anthropic_preamble: config.strip_anthropic_preamble,
                messages_temperature: config.messages_temperature,
                sampling_defaults: ir::SamplingRequest::unset(1.0),
                script: None,
                replay: Arc::new(replay::ReplayStore::new(config.replay_tokens, config.replay_ttl.0)),
                responses: Arc::new(openai::store::ResponseStore::new(
                    config.responses_store,
                    usize::try_from(config.responses_store_bytes.as_u64()).unwrap_or(usize::MAX),
                    config.auth.keys.iter().map(|k| &k.tenant).collect::<std::collections::HashSet<_>>().len(),
                    config.responses_ttl.0,
                )),
                end_markers: Vec::new(),
                recorder: None,
            }),
        }
        .with_end_markers()
    }

    /// The model's sampling defaults, for what a request leaves unset (vLLM's
    /// `--generation-config auto`).
    pub fn with_sampling_defaults(mut self, defaults: ir::SamplingRequest) -> FrontendState {
        Arc::make_mut(&mut self.inner).sampling_defaults = defaults;
        self
    }

    /// Replaces the stop tokens sent with every request (and dropped from the answer's text).
    pub fn with_stop_token_ids(mut self, ids: Vec<u32>) -> FrontendState {
        Arc::make_mut(&mut self.inner).stop_token_ids = ids;
        self.with_end_markers()
    }

    fn with_end_markers(mut self) -> FrontendState {
        let inner = Arc::make_mut(&mut self.inner);
        let mut markers: Vec<String> =
            inner.stop_token_ids.iter().filter_map(|&id| inner.tokenizer.decode(&[id]).ok()).collect();
        markers.push(inner.template.eos_token().to_owned());
        markers.retain(|m| !m.is_empty());
        markers.dedup();
        inner.end_markers = markers;
        self
    }

    /// Answers every request with `answers[turn % answers.len()]` (`turn`: the assistant
    /// messages the request carries), tokenized and computed by the engine instead of sampled: the
    /// scripted engine (`engine.kind = "scripted"`).
    pub fn with_script(mut self, answers: Vec<String>) -> FrontendState {
        Arc::make_mut(&mut self.inner).script = (!answers.is_empty()).then(|| Arc::new(answers));
        self
    }

    /// Records every answered request with `recorder` (`[recording]`).
    pub fn with_recorder(mut self, recorder: Arc<crate::recording::Recorder>) -> FrontendState {
        Arc::make_mut(&mut self.inner).recorder = Some(recorder);
        self
    }

    /// The stop tokens sent with every request.
    pub fn stop_token_ids(&self) -> &[u32] {
        &self.inner.stop_token_ids
    }
}

/// The API a request came in through: the `api` label of `dynamo_node_requests_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Route {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    ChatCompletions,
    /// `GET /v1/models`.
    Models,
    /// `POST /v1/messages` and `/v1/messages/count_tokens` (Anthropic).
    Messages,
    /// `/v1/responses` and the stored responses under it.
    Responses,
}

impl Route {
    /// Every route, in declaration order.
    pub const ALL: [Route; 5] =
        [Route::Completions, Route::ChatCompletions, Route::Models, Route::Messages, Route::Responses];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Route::Completions => "completions",
            Route::ChatCompletions => "chat_completions",
            Route::Models => "models",
            Route::Messages => "messages",
            Route::Responses => "responses",
        }
    }

    /// Counts one answered request of this route by HTTP status.
    pub fn count(self, status: u16) {
        crate::metrics::record_request(self.label(), status, None);
    }
}

/// Refuses parser names that are not ones `frontend.reasoning_parser` and
/// `frontend.tool_call_parser` take, listing those.
pub fn check_parsers(config: &FrontendSection) -> Result<(), String> {
    if let Some(name) = config.reasoning_parser.as_deref()
        && parsers::ReasoningKind::from_name(name).is_none()
    {
        return Err(format!(
            "frontend.reasoning_parser: unknown parser `{}`; expected one of {}",
            error::clip(name, 64),
            parsers::ReasoningKind::NAMES.join(", ")
        ));
    }
    if let Some(name) = config.tool_call_parser.as_deref()
        && parsers::ToolFormat::from_name(name).is_none()
    {
        return Err(format!(
            "frontend.tool_call_parser: unknown parser `{}`; expected one of {}",
            error::clip(name, 64),
            parsers::ToolFormat::NAMES.join(", ")
        ));
    }
    Ok(())
}

/// The API's routes over `state`, with the body limit of `frontend.max_body`. With
/// `loopback_only`, requests must name the node by a loopback `Host` (or one of
/// `frontend.allowed_hosts`), and so must a browser's `Origin`.
pub fn router(state: FrontendState, loopback_only: bool) -> Router {
    let max_body = state.inner.max_body;
    let hosts = Arc::new(guard::HostGuard::new(loopback_only, &state.inner.allowed_hosts));
    let keys = state.inner.keys.clone();
    Router::new()
        .route("/v1/chat/completions", post(openai::chat::chat_completions))
        .route("/v1/completions", post(openai::chat::completions))
        .route("/v1/responses", post(openai::responses::create))
        .route("/v1/responses/{id}", get(openai::responses::retrieve).delete(openai::responses::delete))
        .route("/v1/responses/{id}/input_items", get(openai::responses::input_items))
        .route("/v1/models", get(http::models))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/health", get(http::health))
        .fallback(http::not_found)
        .method_not_allowed_fallback(http::method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn_with_state(keys, auth::check_key))
        .layer(axum::middleware::from_fn_with_state(hosts, guard::check_host))
        .layer(axum::middleware::from_fn(request_id::assign))
        .with_state(state)
}

/// Serves [`router`]`(state)` on `listener` until `shutdown` completes, then stops accepting
/// connections and returns once the requests in flight have finished (streams included);
/// dropping the future closes every connection at once. The connection limits are the
/// `[frontend]` ones ([`server`]); on a loopback address the `Host` check applies.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: FrontendState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let loopback = server::is_loopback(listener.local_addr()?);
    let mut limits = state.inner.limits;
    limits.max_connections = server::connection_limit(limits.max_connections);
    server::serve(listener, router(state, loopback), limits, shutdown).await
}
