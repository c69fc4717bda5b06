//! The route handlers: request → [`GenerateRequest`] → JSON body or SSE stream.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use dynamo_config::RegionKind;
use futures::stream::BoxStream;
use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::time::Instant;

use super::FrontendState;
use super::detok::{IncrementalDecoder, StopMatcher};
use super::error::ApiError;
use super::generate::{FinishReason, GenerateError, GenerateEvent, GenerateRequest};
use super::parsers::{AnswerParser, Segment, ToolCall};
use super::protocol::{ChatCompletionRequest, CompletionRequest, MessageContent, Prompt, StopStrings};
use super::template::{TemplateError, TemplateMessage, escape_special_tokens, tokenize_pieces};
use crate::metrics;

/// Which API a request came through: decides the shape of the answer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Api {
    Chat,
    Completion,
}

/// Everything the generic part of a generation route needs.
struct Prepared {
    api: Api,
    request: GenerateRequest,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    /// Splits a chat answer into reasoning, text and tool calls (`frontend.reasoning_parser`,
    /// `frontend.tool_call_parser`); none for a plain answer.
    parser: Option<AnswerParser>,
}

pub(super) async fn health() -> impl IntoResponse {
    axum::Json(json!({"status": "ok"}))
}

pub(super) async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        code: Some("unknown_url"),
        ..ApiError::invalid("Unknown request URL; see /v1/models, /v1/chat/completions, /v1/completions.", None)
    }
}

pub(super) async fn models(State(state): State<FrontendState>, headers: HeaderMap) -> Response {
    super::Route::Models.count(200);
    if headers.contains_key("anthropic-version") {
        return super::anthropic::models(&state);
    }
    let data: Vec<Value> = state
        .inner
        .generator
        .models()
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "dynamo-node"}))
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

pub(super) async fn method_not_allowed() -> ApiError {
    ApiError::status(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "This route does not take that method: generation routes take POST, /v1/models and /health GET.",
    )
}

pub(super) async fn chat_completions(State(state): State<FrontendState>, headers: HeaderMap, body: Body) -> Response {
    let arrived = Instant::now();
    let response = match prepare_off_thread(&state, headers, body, prepare_chat).await {
        Ok(prepared) => run(state, prepared, arrived).await,
        Err(e) => e.into_response(),
    };
    counted(super::Route::ChatCompletions, response)
}

pub(super) async fn completions(State(state): State<FrontendState>, headers: HeaderMap, body: Body) -> Response {
    let arrived = Instant::now();
    let response = match prepare_off_thread(&state, headers, body, prepare_completion).await {
        Ok(prepared) => run(state, prepared, arrived).await,
        Err(e) => e.into_response(),
    };
    counted(super::Route::Completions, response)
}

/// Counts an answered request by API and HTTP status (a stream counts once its headers go out).
fn counted(route: super::Route, response: Response) -> Response {
    route.count(response.status().as_u16());
    response
}

/// Reads the body (JSON only, within `frontend.body_timeout` and `frontend.max_body`), then
/// parses it as `T` and turns it into a generation with `prepare` on the blocking pool, a few
/// at a time: rendering and tokenizing a long conversation never holds an async thread.
pub(super) async fn prepare_off_thread<T, P, F>(
    state: &FrontendState,
    headers: HeaderMap,
    body: Body,
    prepare: F,
) -> Result<P, ApiError>
where
    T: serde::de::DeserializeOwned + Send + 'static,
    P: Send + 'static,
    F: FnOnce(&FrontendState, &HeaderMap, T) -> Result<P, ApiError> + Send + 'static,
{
    let bytes = read_body(state, &headers, body).await?;
    let _permit = state.inner.preparing.clone().acquire_owned().await.map_err(|_| ApiError::internal("closed"))?;
    let state = state.clone();
    tokio::task::spawn_blocking(move || parse::<T>(&bytes).and_then(|req| prepare(&state, &headers, req)))
        .await
        .map_err(|e| ApiError::internal(format!("preparing the request failed: {e}")))?
}

/// The body of a JSON request: 415 unless `Content-Type` is JSON, 413 over `frontend.max_body`,
/// 408 when it does not arrive within `frontend.body_timeout`.
async fn read_body(state: &FrontendState, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let inner = &state.inner;
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let essence = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    if essence != "application/json" && !(essence.starts_with("application/") && essence.ends_with("+json")) {
        return Err(ApiError::status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            format!(
                "The request body must be JSON, sent with `Content-Type: application/json` (got `{}`).",
                super::error::clip(content_type, 64)
            ),
        ));
    }
    let too_large = || {
        ApiError::status(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            format!("The request body is too large: this server accepts at most {} bytes.", inner.max_body),
        )
    };
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > inner.max_body as u64) {
        return Err(too_large());
    }
    let read = async {
        let mut stream = body.into_data_stream();
        let mut buf = Vec::with_capacity(declared.unwrap_or(0).min(inner.max_body as u64) as usize);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| ApiError::invalid(format!("Could not read the request body: {e}"), None))?;
            if buf.len() + chunk.len() > inner.max_body {
                return Err(too_large());
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(buf))
    };
    tokio::time::timeout(inner.body_timeout, read).await.unwrap_or_else(|_| {
        Err(ApiError::status(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            format!("The request body did not arrive within {:?}.", inner.body_timeout),
        ))
    })
}

/// The body as `T`: 400 for anything that is not a valid `T`.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let kind = match e.classify() {
            serde_json::error::Category::Data => "The request body does not match the API",
            _ => "The request body is not valid JSON",
        };
        // A mistyped field's message quotes its value, which may be megabytes long.
        ApiError::invalid(super::error::clip(&format!("{kind}: {e}"), 1024), None)
    })
}

pub(super) fn check_model(state: &FrontendState, model: &str) -> Result<(), ApiError> {
    if state.inner.generator.models().iter().any(|m| m == model) {
        Ok(())
    } else {
        Err(ApiError::model_not_found(model))
    }
}

fn check_sampling(temperature: Option<f32>, n: Option<usize>) -> Result<f32, ApiError> {
    let temperature = temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            format!("Invalid 'temperature': {temperature} is not between 0 and 2."),
            Some("temperature"),
        ));
    }
    if n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("Only n = 1 is supported.", Some("n")));
    }
    Ok(temperature)
}

fn check_stop(stop: Option<StopStrings>) -> Result<Vec<String>, ApiError> {
    let stop = stop.map(StopStrings::into_vec).unwrap_or_default();
    if stop.len() > 4 {
        return Err(ApiError::invalid("At most 4 stop sequences are supported.", Some("stop")));
    }
    Ok(stop)
}

/// The conversation of a request: the `x-session-id` header, else the `user` field, as its
/// [`session_key`].
pub(super) fn session_id(headers: &HeaderMap, user: Option<String>) -> Option<String> {
    match headers.get("x-session-id").map(|v| v.as_bytes()).filter(|v| !v.is_empty()) {
        Some(header) => Some(session_key(header)),
        None => user.filter(|u| !u.is_empty()).map(|u| session_key(u.as_bytes())),
    }
}

/// The key a client's session id is kept under: a fixed-size digest (32 hex digits of xxh3-128),
/// since the id is the client's choice and may be megabytes long.
pub fn session_key(raw: &[u8]) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(raw))
}

/// Refuses a prompt of `tokens` tokens that the context cannot take with room for one generated
/// token, or that is longer than `frontend.max_prompt_tokens`.
fn check_prompt(state: &FrontendState, tokens: usize, param: &str) -> Result<(), ApiError> {
    let context = state.inner.generator.max_context();
    if tokens >= context {
        return Err(ApiError::context_length(tokens, context, param));
    }
    let max = state.inner.max_prompt_tokens;
    if max > 0 && tokens > max {
        return Err(ApiError {
            message: format!(
                "This server accepts prompts of at most {max} tokens. However, your prompt resulted in {tokens} \
                 tokens. Please reduce the length of the prompt."
            ),
            ..ApiError::context_length(tokens, max, param)
        });
    }
    Ok(())
}

/// Checks the prompt's length and settles `max_tokens` (clamped to what the context leaves).
pub(super) fn fit(
    state: &FrontendState,
    prompt: usize,
    max_tokens: Option<usize>,
    param: &str,
) -> Result<usize, ApiError> {
    check_prompt(state, prompt, param)?;
    let wanted = max_tokens.unwrap_or(state.inner.default_max_tokens);
    if wanted == 0 {
        return Err(ApiError::invalid("Invalid 'max_tokens': must be at least 1.", Some("max_tokens")));
    }
    Ok(wanted.min(state.inner.generator.max_context() - prompt))
}

/// Refuses, before any rendering or tokenizing, a prompt whose text is sure to be too long:
/// `bytes` of text make at least `bytes / max_token_bytes` tokens, and every message at least one.
pub(super) fn precheck(state: &FrontendState, messages: usize, text_bytes: usize, param: &str) -> Result<(), ApiError> {
    check_prompt(state, (text_bytes / state.inner.max_token_bytes).max(messages), param)
}

pub(super) fn request_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    format!("{prefix}-{nanos:016x}{:06x}", NEXT.fetch_add(1, Ordering::Relaxed) & 0xff_ffff)
}

fn prepare_chat(state: &FrontendState, headers: &HeaderMap, req: ChatCompletionRequest) -> Result<Prepared, ApiError> {
    check_model(state, &req.model)?;
    let temperature = check_sampling(req.temperature, req.n)?;
    let stop = check_stop(req.stop)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid("'messages' must contain at least one message.", Some("messages")));
    }
    let text_bytes: usize = req.messages.iter().map(|m| m.content.as_ref().map_or(0, MessageContent::text_bytes)).sum();
    precheck(state, req.messages.len(), text_bytes, "messages")?;
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.into_iter().enumerate() {
        if !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant" | "tool") {
            return Err(ApiError::invalid(
                format!(
                    "Invalid 'messages[{i}].role': `{}` (expected system, developer, user, assistant or tool).",
                    m.role
                ),
                Some(&format!("messages[{i}].role")),
            ));
        }
        let content = match m.content {
            None => None,
            Some(MessageContent::Text(text)) => Some(text),
            Some(MessageContent::Parts(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.into_iter().enumerate() {
                    match (part.kind.as_str(), part.text) {
                        ("text", Some(t)) => text.push_str(&t),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                format!(
                                    "Unsupported content part `{kind}`: only `text` parts with a `text` field are supported."
                                ),
                                Some(&format!("messages[{i}].content[{j}]")),
                            ));
                        }
                    }
                }
                Some(text)
            }
        };
        if content.is_none() && !(m.role == "assistant" && m.tool_calls.is_some()) {
            return Err(ApiError::invalid(
                format!("'messages[{i}].content' is required for a `{}` message.", m.role),
                Some(&format!("messages[{i}].content")),
            ));
        }
        let escape = |text: String| escape_special_tokens(&text, &state.inner.specials).into_owned();
        messages.push(TemplateMessage {
            role: m.role,
            content: content.map(escape),
            name: m.name.map(escape),
            tool_calls: m.tool_calls,
            tool_call_id: m.tool_call_id,
            reasoning_content: None,
        });
    }
    let Lowered { prompt, regions, parser } = lower(state, &messages, req.tools.as_deref())?;
    let forced = scripted(state, messages.iter().filter(|m| m.role == "assistant").count())?;
    let inner = &state.inner;
    let max_tokens = fit(state, prompt.len(), req.max_completion_tokens.or(req.max_tokens), "messages")?;
    Ok(Prepared {
        api: Api::Chat,
        request: GenerateRequest {
            request_id: request_id("chatcmpl"),
            model: req.model,
            prompt,
            regions,
            max_tokens,
            temperature,
            seed: req.seed,
            stop_token_ids: inner.stop_token_ids.clone(),
            session_id: session_id(headers, req.user),
            hints: req.nvext.unwrap_or_default(),
            forced,
        },
        stop,
        stream: req.stream,
        include_usage: req.stream_options.is_some_and(|o| o.include_usage),
        parser,
    })
}

/// The scripted answer of a request at `turn`, tokenized; `None` when the engine is not scripted.
pub(super) fn scripted(state: &FrontendState, turn: usize) -> Result<Option<Vec<u32>>, ApiError> {
    let Some(script) = &state.inner.script else { return Ok(None) };
    let text = &script[turn % script.len()];
    state.inner.tokenizer.encode(text).map(Some).map_err(|e| ApiError::internal(e.to_string()))
}

/// A conversation rendered and tokenized: the prompt, its regions, and the parser of its answer.
pub(super) struct Lowered {
    pub(super) prompt: Vec<u32>,
    pub(super) regions: super::generate::RegionRanges,
    pub(super) parser: Option<AnswerParser>,
}

/// Renders `messages` (and `tools`) with the chat template and tokenizes them, piece by piece;
/// the answer's parser starts inside reasoning when the generation prompt opened a block.
pub(super) fn lower(
    state: &FrontendState,
    messages: &[TemplateMessage],
    tools: Option<&[Value]>,
) -> Result<Lowered, ApiError> {
    let inner = &state.inner;
    let pieces = inner.template.render_regions(messages, tools).map_err(|e| match e {
        TemplateError::Render(message) => ApiError::invalid(message, Some("messages")),
        other => ApiError::internal(other.to_string()),
    })?;
    let (prompt, regions) =
        tokenize_pieces(&inner.tokenizer, &pieces).map_err(|e| ApiError::internal(e.to_string()))?;
    let generation_prompt = pieces.last().map_or("", |(text, _)| text.as_str());
    let parser = (inner.reasoning.is_some() || inner.tools.is_some()).then(|| {
        let in_reasoning = inner.reasoning.is_some_and(|kind| kind.starts_in_reasoning(generation_prompt));
        AnswerParser::new(inner.reasoning, inner.tools, in_reasoning)
    });
    Ok(Lowered { prompt, regions, parser })
}

fn prepare_completion(
    state: &FrontendState,
    headers: &HeaderMap,
    req: CompletionRequest,
) -> Result<Prepared, ApiError> {
    check_model(state, &req.model)?;
    let temperature = check_sampling(req.temperature, req.n)?;
    let stop = check_stop(req.stop)?;
    let inner = &state.inner;
    let one = |n: usize| {
        if n == 1 {
            Ok(())
        } else {
            Err(ApiError::invalid("Only one prompt per request is supported.", Some("prompt")))
        }
    };
    let text_bytes = match &req.prompt {
        Prompt::Text(text) => text.len(),
        Prompt::Texts(texts) => texts.iter().map(String::len).sum(),
        Prompt::Tokens(_) | Prompt::TokenLists(_) => 0,
    };
    precheck(state, 1, text_bytes, "prompt")?;
    let prompt = match req.prompt {
        Prompt::Text(text) => inner.tokenizer.encode(&text).map_err(|e| ApiError::internal(e.to_string()))?,
        Prompt::Texts(mut texts) => {
            one(texts.len())?;
            inner.tokenizer.encode(&texts.remove(0)).map_err(|e| ApiError::internal(e.to_string()))?
        }
        Prompt::Tokens(ids) => ids,
        Prompt::TokenLists(mut lists) => {
            one(lists.len())?;
            lists.remove(0)
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("'prompt' must not be empty.", Some("prompt")));
    }
    let vocab = inner.tokenizer.vocab_size();
    if let Some(id) = prompt.iter().find(|&&id| id as usize >= vocab) {
        return Err(ApiError::invalid(
            format!("Invalid 'prompt': token id {id} is not in the vocabulary ({vocab} ids)."),
            Some("prompt"),
        ));
    }
    let max_tokens = fit(state, prompt.len(), req.max_tokens, "prompt")?;
    let regions = vec![(0..prompt.len(), RegionKind::Conversation)];
    Ok(Prepared {
        api: Api::Completion,
        request: GenerateRequest {
            request_id: request_id("cmpl"),
            model: req.model,
            prompt,
            regions,
            max_tokens,
            temperature,
            seed: req.seed,
            stop_token_ids: inner.stop_token_ids.clone(),
            session_id: session_id(headers, req.user),
            hints: req.nvext.unwrap_or_default(),
            forced: scripted(state, 0)?,
        },
        stop,
        stream: req.stream,
        include_usage: req.stream_options.is_some_and(|o| o.include_usage),
        parser: None,
    })
}

/// Turns generation events into text: detokenization, stop strings, usage.
pub(super) struct Answer {
    api: Api,
    pub(super) id: String,
    model: String,
    created: u64,
    pub(super) prompt_tokens: usize,
    pub(super) cached_tokens: usize,
    pub(super) completion_tokens: usize,
    decoder: IncrementalDecoder,
    pub(super) stop: StopMatcher,
    deadline: Instant,
    /// When the request arrived: the time to first token counts from here.
    arrived: Instant,
    /// When the last token came, for the inter-token latency.
    last_token: Option<Instant>,
    events: BoxStream<'static, Result<GenerateEvent, GenerateError>>,
    parser: Option<AnswerParser>,
    /// Tool calls said so far (their `index` in the stream).
    calls: usize,
}

/// A whole chat answer, as its segments sum up.
#[derive(Default)]
pub(super) struct Reply {
    pub(super) reasoning: String,
    pub(super) text: String,
    pub(super) calls: Vec<ToolCall>,
}

impl Reply {
    pub(super) fn add(&mut self, segment: Segment) {
        match segment {
            Segment::Thinking(t) => self.reasoning.push_str(&t),
            Segment::Text(t) => self.text.push_str(&t),
            Segment::ToolCall(c) => self.calls.push(c),
        }
    }
}

impl Answer {
    /// Starts `request`'s generation for an answer in `api`'s shape.
    pub(super) fn start(
        state: &FrontendState,
        api: Api,
        request: GenerateRequest,
        stop: Vec<String>,
        parser: Option<AnswerParser>,
        arrived: Instant,
    ) -> Answer {
        let inner = &state.inner;
        let created = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        Answer {
            api,
            id: request.request_id.clone(),
            model: request.model.clone(),
            created,
            prompt_tokens: request.prompt.len(),
            cached_tokens: 0,
            completion_tokens: 0,
            decoder: IncrementalDecoder::new(inner.tokenizer.clone(), request.stop_token_ids.iter().copied()),
            stop: StopMatcher::new(stop),
            deadline: arrived + inner.request_timeout,
            arrived,
            last_token: None,
            events: inner.generator.generate(request),
            parser,
            calls: 0,
        }
    }

    /// Waits for admission (the prompt is in the cache or computed): its cached tokens are
    /// noted; an event that came instead of `Started` is handed back.
    pub(super) async fn admit(&mut self) -> Result<Option<GenerateEvent>, ApiError> {
        match self.next_event().await? {
            GenerateEvent::Started { cached_tokens } => {
                self.cached_tokens = cached_tokens.min(self.prompt_tokens);
                Ok(None)
            }
            other => Ok(Some(other)),
        }
    }

    /// The next event (`pending`'s, if admission handed one back) applied: what it completes of
    /// the answer, and the finish reason once the answer is over.
    pub(super) async fn step(
        &mut self,
        pending: &mut Option<GenerateEvent>,
    ) -> Result<(Vec<Segment>, Option<FinishReason>), ApiError> {
        let event = match pending.take() {
            Some(event) => event,
            None => self.next_event().await?,
        };
        self.apply(event)
    }

    /// The next event, or a timeout / internal error.
    pub(super) async fn next_event(&mut self) -> Result<GenerateEvent, ApiError> {
        match tokio::time::timeout_at(self.deadline, self.events.next()).await {
            Err(_) => Err(ApiError {
                status: StatusCode::GATEWAY_TIMEOUT,
                kind: "timeout",
                code: Some("request_timeout"),
                ..ApiError::internal("The request did not finish within the server's request timeout.")
            }),
            Ok(None) => Err(ApiError::internal("the generator ended the stream before the answer finished")),
            Ok(Some(event)) => event.map_err(ApiError::from),
        }
    }

    /// Applies one event: what it completes of the answer, and the finish reason once the
    /// answer is over (a stop that ends an answer with tool calls is `tool_calls`).
    pub(super) fn apply(&mut self, event: GenerateEvent) -> Result<(Vec<Segment>, Option<FinishReason>), ApiError> {
        let (text, done) = self.apply_text(event)?;
        let mut segments = Vec::new();
        match &mut self.parser {
            None if text.is_empty() => {}
            None => segments.push(Segment::Text(text)),
            Some(parser) => {
                parser.push(&text, &mut segments);
                if done.is_some() {
                    parser.finish(&mut segments);
                }
            }
        }
        self.calls += segments.iter().filter(|s| matches!(s, Segment::ToolCall(_))).count();
        let done =
            done.map(
                |reason| if reason == FinishReason::Stop && self.calls > 0 { FinishReason::ToolCalls } else { reason },
            );
        Ok((segments, done))
    }

    /// [`Answer::apply`] before the parser: detokenized text with stop strings applied.
    fn apply_text(&mut self, event: GenerateEvent) -> Result<(String, Option<FinishReason>), ApiError> {
        let internal = |e: crate::tokenizer::TokenizerError| ApiError::internal(e.to_string());
        match event {
            GenerateEvent::Started { .. } => Ok((String::new(), None)),
            GenerateEvent::Token { id } => {
                self.completion_tokens += 1;
                let now = Instant::now();
                match self.last_token.replace(now) {
                    None => metrics::record_ttft(now - self.arrived),
                    Some(previous) => metrics::record_inter_token(now - previous),
                }
                let piece = self.decoder.push(id).map_err(internal)?;
                let (text, stopped) = self.stop.push(&piece);
                Ok((text, stopped.then_some(FinishReason::Stop)))
            }
            GenerateEvent::Finished { reason } => {
                let piece = self.decoder.flush().map_err(internal)?;
                let (mut text, stopped) = self.stop.push(&piece);
                if stopped {
                    return Ok((text, Some(FinishReason::Stop)));
                }
                text.push_str(&self.stop.finish());
                Ok((text, Some(reason)))
            }
        }
    }

    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    fn envelope(&self, object: &str, choices: Value) -> Value {
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices})
    }

    /// The whole answer of a non-streaming request.
    fn body(&self, reply: Reply, reason: FinishReason) -> Value {
        let mut body = match self.api {
            Api::Chat => {
                let mut message = json!({"role": "assistant", "content": reply.text});
                if !reply.reasoning.is_empty() {
                    message["reasoning_content"] = json!(reply.reasoning);
                }
                if !reply.calls.is_empty() {
                    if reply.text.is_empty() {
                        message["content"] = Value::Null;
                    }
                    let calls: Vec<Value> =
                        reply.calls.iter().enumerate().map(|(i, c)| self.tool_call(i, c, false)).collect();
                    message["tool_calls"] = json!(calls);
                }
                self.envelope(
                    "chat.completion",
                    json!([{"index": 0, "message": message, "logprobs": null, "finish_reason": reason.as_str()}]),
                )
            }
            Api::Completion => self.envelope(
                "text_completion",
                json!([{"index": 0, "text": reply.text, "logprobs": null, "finish_reason": reason.as_str()}]),
            ),
        };
        body["usage"] = self.usage();
        body
    }

    /// A tool call as the chat API writes it (`index` only in a stream's delta). Its id is the
    /// model's own where its format has one, else the answer's id and the call's index.
    fn tool_call(&self, index: usize, call: &ToolCall, streamed: bool) -> Value {
        let id = call.id.clone().unwrap_or_else(|| format!("call_{}_{index}", self.id.trim_start_matches("chatcmpl-")));
        let mut value = json!({"id": id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}});
        if streamed {
            value["index"] = json!(index);
        }
        value
    }

    /// The SSE chunk of one segment of a chat answer (`index`: the call's, for a tool call).
    fn segment_chunk(&self, segment: &Segment, index: usize) -> Value {
        let delta = match segment {
            Segment::Text(t) if self.api == Api::Completion => return self.chunk(false, t, None),
            Segment::Text(t) => json!({"content": t}),
            Segment::Thinking(t) => json!({"reasoning_content": t}),
            Segment::ToolCall(c) => json!({"tool_calls": [self.tool_call(index, c, true)]}),
        };
        self.envelope(
            "chat.completion.chunk",
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}]),
        )
    }

    /// One SSE chunk: the assistant role (chat, first chunk), text, or the finish reason.
    fn chunk(&self, role: bool, text: &str, reason: Option<FinishReason>) -> Value {
        let reason = reason.map(FinishReason::as_str);
        match self.api {
            Api::Chat => {
                let delta = if role {
                    json!({"role": "assistant", "content": ""})
                } else if text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                self.envelope(
                    "chat.completion.chunk",
                    json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": reason}]),
                )
            }
            Api::Completion => self.envelope(
                "text_completion",
                json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": reason}]),
            ),
        }
    }

    /// The last chunk of `stream_options.include_usage`: no choices, the usage.
    fn usage_chunk(&self) -> Value {
        let object = if self.api == Api::Chat { "chat.completion.chunk" } else { "text_completion" };
        let mut chunk = self.envelope(object, json!([]));
        chunk["usage"] = self.usage();
        chunk
    }
}

fn sse(data: &Value) -> Bytes {
    Bytes::from(format!("data: {data}\n\n"))
}

/// Starts the generation, waits for admission, then answers with JSON or SSE.
async fn run(state: FrontendState, prepared: Prepared, arrived: Instant) -> Response {
    let Prepared { api, request, stop, stream, include_usage, parser } = prepared;
    let mut answer = Answer::start(&state, api, request, stop, parser, arrived);
    // Admission: an error here is an HTTP status, even for a streaming request.
    let mut pending = match answer.admit().await {
        Err(e) => return e.into_response(),
        Ok(pending) => pending,
    };
    if !stream {
        let mut reply = Reply::default();
        let reason = loop {
            match answer.step(&mut pending).await {
                Err(e) => return e.into_response(),
                Ok((segments, done)) => {
                    segments.into_iter().for_each(|s| reply.add(s));
                    if let Some(reason) = done {
                        break reason;
                    }
                }
            }
        };
        // Dropping `answer` here cancels a generation that a stop string ended early.
        return axum::Json(answer.body(reply, reason)).into_response();
    }

    let (mut tx, rx) = futures::channel::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(16);
    tokio::spawn(async move {
        if api == Api::Chat && tx.send(Ok(sse(&answer.chunk(true, "", None)))).await.is_err() {
            return;
        }
        loop {
            let (segments, done) = match answer.step(&mut pending).await {
                Ok(step) => step,
                Err(e) => {
                    tracing::warn!(request = %answer.id, error = %e.message, "generation failed mid-stream");
                    let _ = tx.send(Ok(sse(&e.body()))).await;
                    return;
                }
            };
            // A send fails when the client has gone: returning drops the generation (cancels it).
            let first_call = answer.calls - segments.iter().filter(|s| matches!(s, Segment::ToolCall(_))).count();
            let mut call = first_call;
            for segment in &segments {
                let chunk = answer.segment_chunk(segment, call);
                call += usize::from(matches!(segment, Segment::ToolCall(_)));
                if tx.send(Ok(sse(&chunk))).await.is_err() {
                    return;
                }
            }
            if let Some(reason) = done {
                let mut tail = vec![sse(&answer.chunk(false, "", Some(reason)))];
                if include_usage {
                    tail.push(sse(&answer.usage_chunk()));
                }
                tail.push(Bytes::from_static(b"data: [DONE]\n\n"));
                for bytes in tail {
                    if tx.send(Ok(bytes)).await.is_err() {
                        return;
                    }
                }
                return;
            }
        }
    });
    event_stream(rx)
}

/// A server-sent-event response whose frames come from `rx`.
pub(super) fn event_stream(rx: futures::channel::mpsc::Receiver<Result<Bytes, std::convert::Infallible>>) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::HeaderName::from_static("x-accel-buffering"), "no"),
        ],
        Body::from_stream(rx),
    )
        .into_response()
}
