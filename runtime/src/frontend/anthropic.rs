//! Anthropic Messages: `POST /v1/messages` (JSON or SSE) and `POST /v1/messages/count_tokens`,
//! lowered onto the same chat template, tokenizer, parsers and generator as Chat Completions.
//!
//! Request → template messages: `system` (a string or text blocks) is the system message;
//! `messages` may hold `user`, `assistant` and inline `system` turns; a user turn's `tool_result`
//! blocks become `tool` messages, and text beside them is folded into the last of them (not a
//! new user turn, which would move a template's "last query"); an assistant turn's `thinking`
//! blocks are its `reasoning_content`, its `tool_use` blocks its `tool_calls`. Unknown block types
//! are ignored; images are refused (the served models read text). With
//! `frontend.strip_anthropic_preamble` (on by default), Claude Code's
//! `x-anthropic-billing-header: …` system text, which changes on every request, is dropped before
//! rendering, so a session's prompts keep a common prefix.
//!
//! Answer → Messages: content blocks in generation order (a new block whenever the kind changes),
//! `thinking` blocks with a non-empty `signature`, `tool_use` blocks with the parsed input, and
//! usage as Anthropic defines it: `input_tokens` excludes the `cache_read_input_tokens` found
//! cached. The request's model is echoed verbatim. Errors have Anthropic's shape; a refused
//! admission is 529 `overloaded_error` with `retry-after`, which the SDK retries.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::SinkExt;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::FrontendState;
use super::error::ApiError;
use super::generate::{FinishReason, GenerateRequest};
use super::handlers::{
    Answer, Api, check_model, event_stream, fit, lower, precheck, prepare_off_thread, request_id, scripted, session_key,
};
use super::parsers::Segment;
use super::template::{TemplateMessage, escape_special_tokens};
use crate::metrics;

/// The text block Claude Code puts first in `system`, different on every request.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// A `POST /v1/messages` (or `count_tokens`) body. Fields this node does not use are accepted
/// and ignored.
#[derive(Debug, Deserialize)]
pub(super) struct MessagesRequest {
    model: String,
    max_tokens: Option<usize>,
    messages: Vec<Message>,
    #[serde(default)]
    system: Option<Content>,
    #[serde(default)]
    tools: Option<Vec<Tool>>,
    #[serde(default)]
    stop_sequences: Option<Vec<String>>,
    temperature: Option<f32>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    metadata: Option<Metadata>,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: Content,
}

/// A string, or blocks (kept as JSON: unknown types are ignored, not refused).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Value>),
}

#[derive(Debug, Deserialize)]
struct Tool {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    input_schema: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct Metadata {
    #[serde(default)]
    user_id: Option<String>,
}

/// A request ready to generate.
pub(super) struct Prepared {
    request: GenerateRequest,
    stop: Vec<String>,
    stream: bool,
    parser: Option<super::parsers::AnswerParser>,
}

/// An [`ApiError`] in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`, with
/// Anthropic's status for it (a refused admission is 529).
fn anthropic_error(e: ApiError) -> Response {
    let (status, kind) = match e.status.as_u16() {
        400 | 405 | 415 | 422 => (e.status, "invalid_request_error"),
        401 => (e.status, "authentication_error"),
        403 => (e.status, "permission_error"),
        404 => (e.status, "not_found_error"),
        408 | 504 => (e.status, "timeout_error"),
        413 => (e.status, "request_too_large"),
        429 | 503 => (StatusCode::from_u16(529).expect("529 is a status"), "overloaded_error"),
        _ => (e.status, "api_error"),
    };
    let body = json!({"type": "error", "error": {"type": kind, "message": e.message}});
    let mut response = (status, axum::Json(body)).into_response();
    if let Some(after) = e.retry_after {
        let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
        response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
    }
    response
}

/// The text of a block list's `text` blocks (and of a plain string).
fn block_text(block: &Value) -> Option<&str> {
    (block["type"] == "text").then(|| block["text"].as_str()).flatten()
}

/// `system` as text, without Claude Code's billing header when `strip` (a block that starts with
/// it, or such a line of a string).
fn system_text(content: &Content, strip: bool) -> (String, bool) {
    let mut stripped = false;
    let text = match content {
        Content::Text(text) if strip => {
            let kept: Vec<&str> = text
                .split_inclusive('\n')
                .filter(|line| {
                    let header = line.trim_start().starts_with(BILLING_HEADER);
                    stripped |= header;
                    !header
                })
                .collect();
            kept.concat()
        }
        Content::Text(text) => text.clone(),
        Content::Blocks(blocks) => {
            let texts: Vec<&str> = blocks
                .iter()
                .filter_map(block_text)
                .filter(|t| {
                    let header = strip && t.trim_start().starts_with(BILLING_HEADER);
                    stripped |= header;
                    !header
                })
                .collect();
            texts.join("\n")
        }
    };
    (text, stripped)
}

/// The request's conversation as template messages.
fn template_messages(state: &FrontendState, req: &MessagesRequest) -> Result<Vec<TemplateMessage>, ApiError> {
    let escape = |text: &str| escape_special_tokens(text, &state.inner.specials).into_owned();
    let strip = state.inner.strip_anthropic_preamble;
    let mut out = Vec::with_capacity(req.messages.len() + 1);
    let note_strip = |stripped: bool| {
        if stripped {
            metrics::record_preamble_stripped();
        }
    };
    if let Some(system) = &req.system {
        let (text, stripped) = system_text(system, strip);
        note_strip(stripped);
        if !text.is_empty() {
            out.push(TemplateMessage { role: "system".into(), content: Some(escape(&text)), ..Default::default() });
        }
    }
    for (i, m) in req.messages.iter().enumerate() {
        let blocks: Vec<Value> = match &m.content {
            Content::Text(text) => vec![json!({"type": "text", "text": text})],
            Content::Blocks(blocks) => blocks.clone(),
        };
        match m.role.as_str() {
            "system" => {
                let (text, stripped) = system_text(&Content::Blocks(blocks), strip);
                note_strip(stripped);
                out.push(TemplateMessage { role: "system".into(), content: Some(escape(&text)), ..Default::default() });
            }
            "user" => {
                let mut text = String::new();
                for (j, block) in blocks.iter().enumerate() {
                    match block["type"].as_str() {
                        Some("text") => text.push_str(block["text"].as_str().unwrap_or("")),
                        Some("tool_result") => {
                            let content = match &block["content"] {
                                Value::String(s) => s.clone(),
                                Value::Array(parts) => {
                                    parts.iter().filter_map(block_text).collect::<Vec<_>>().join("\n")
                                }
                                _ => String::new(),
                            };
                            out.push(TemplateMessage {
                                role: "tool".into(),
                                content: Some(escape(&content)),
                                tool_call_id: block["tool_use_id"].as_str().map(str::to_owned),
                                ..Default::default()
                            });
                        }
                        Some("image" | "document") => {
                            return Err(ApiError::invalid(
                                format!(
                                    "messages.{i}.content.{j}: this model reads text only; images and documents are not supported"
                                ),
                                Some("messages"),
                            ));
                        }
                        _ => {}
                    }
                }
                if text.is_empty() {
                    continue;
                }
                // Text beside tool results (Claude Code's reminders) belongs to the last of them.
                match out.last_mut() {
                    Some(last)
                        if last.role == "tool"
                            && matches!(&m.content, Content::Blocks(b) if b.iter().any(|b| b["type"] == "tool_result")) =>
                    {
                        let content = last.content.get_or_insert_with(String::new);
                        content.push('\n');
                        content.push_str(&escape(&text));
                    }
                    _ => out.push(TemplateMessage {
                        role: "user".into(),
                        content: Some(escape(&text)),
                        ..Default::default()
                    }),
                }
            }
            "assistant" => {
                let (mut text, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
                for block in &blocks {
                    match block["type"].as_str() {
                        Some("text") => text.push_str(block["text"].as_str().unwrap_or("")),
                        Some("thinking") => reasoning.push_str(block["thinking"].as_str().unwrap_or("")),
                        Some("tool_use") => calls.push(json!({
                            "id": block["id"],
                            "type": "function",
                            "function": {"name": block["name"], "arguments": block["input"].to_string()},
                        })),
                        _ => {}
                    }
                }
                out.push(TemplateMessage {
                    role: "assistant".into(),
                    content: (!text.is_empty() || calls.is_empty()).then(|| escape(&text)),
                    reasoning_content: (!reasoning.is_empty()).then(|| escape(&reasoning)),
                    tool_calls: (!calls.is_empty()).then_some(Value::Array(calls)),
                    ..Default::default()
                });
            }
            other => {
                return Err(ApiError::invalid(
                    format!("messages.{i}.role: `{}` is not user, assistant or system", super::error::clip(other, 64)),
                    Some("messages"),
                ));
            }
        }
    }
    Ok(out)
}

/// Tools in the shape chat templates read (`{"type": "function", "function": {…}}`).
fn template_tools(req: &MessagesRequest) -> Option<Vec<Value>> {
    let tools = req.tools.as_ref()?;
    Some(
        tools
            .iter()
            .map(|t| {
                json!({"type": "function", "function": {
                    "name": t.name,
                    "description": t.description.clone().unwrap_or_default(),
                    "parameters": t.input_schema.clone().unwrap_or_else(|| json!({"type": "object"})),
                }})
            })
            .collect(),
    )
}

fn prepare(
    state: &FrontendState,
    headers: &HeaderMap,
    req: MessagesRequest,
    count_only: bool,
) -> Result<(Prepared, usize), ApiError> {
    check_model(state, &req.model)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid("messages: at least one message is required", Some("messages")));
    }
    let max_tokens = match (req.max_tokens, count_only) {
        (Some(0), false) => return Err(ApiError::invalid("max_tokens: must be at least 1", Some("max_tokens"))),
        (None, false) => return Err(ApiError::invalid("max_tokens: Field required", Some("max_tokens"))),
        (n, _) => n,
    };
    let temperature = req.temperature.unwrap_or(state.inner.messages_temperature);
    if !(0.0..=1.0).contains(&temperature) {
        return Err(ApiError::invalid("temperature: must be between 0 and 1", Some("temperature")));
    }
    let text_bytes: usize = req
        .messages
        .iter()
        .map(|m| match &m.content {
            Content::Text(t) => t.len(),
            Content::Blocks(b) => b.iter().map(|v| v.to_string().len()).sum(),
        })
        .sum();
    precheck(state, req.messages.len(), text_bytes, "messages")?;
    let messages = template_messages(state, &req)?;
    let tools = template_tools(&req);
    let lowered = lower(state, &messages, tools.as_deref())?;
    let prompt_tokens = lowered.prompt.len();
    let max_tokens = if count_only { 1 } else { fit(state, prompt_tokens, max_tokens, "messages")? };
    let session = headers
        .get("x-claude-code-session-id")
        .map(|v| v.as_bytes().to_vec())
        .or_else(|| req.metadata.as_ref().and_then(|m| m.user_id.clone()).map(String::into_bytes))
        .filter(|k| !k.is_empty())
        .map(|k| session_key(&k));
    let prepared = Prepared {
        request: GenerateRequest {
            request_id: request_id("msg"),
            model: req.model,
            prompt: lowered.prompt,
            regions: lowered.regions,
            max_tokens,
            temperature,
            seed: None,
            stop_token_ids: state.inner.stop_token_ids.clone(),
            session_id: session,
            hints: Default::default(),
            forced: scripted(state, req.messages.iter().filter(|m| m.role == "assistant").count())?,
        },
        stop: req.stop_sequences.unwrap_or_default(),
        stream: req.stream,
        parser: lowered.parser,
    };
    Ok((prepared, prompt_tokens))
}

pub(super) async fn count_tokens(State(state): State<FrontendState>, headers: HeaderMap, body: Body) -> Response {
    let counted = prepare_off_thread(&state, headers, body, |state, headers, req: MessagesRequest| {
        prepare(state, headers, req, true).map(|(_, tokens)| tokens)
    })
    .await;
    let response = match counted {
        Ok(tokens) => axum::Json(json!({"input_tokens": tokens})).into_response(),
        Err(e) => anthropic_error(e),
    };
    super::Route::Messages.count(response.status().as_u16());
    response
}

pub(super) async fn messages(State(state): State<FrontendState>, headers: HeaderMap, body: Body) -> Response {
    let arrived = Instant::now();
    let prepared = prepare_off_thread(&state, headers, body, |state, headers, req: MessagesRequest| {
        prepare(state, headers, req, false).map(|(p, _)| p)
    })
    .await;
    let response = match prepared {
        Ok(prepared) => run(&state, prepared, arrived).await,
        Err(e) => anthropic_error(e),
    };
    super::Route::Messages.count(response.status().as_u16());
    response
}

/// The answer's blocks as Messages content.
struct Blocks {
    /// The answer's id, which tool-use ids are made from.
    id: String,
}

impl Blocks {
    /// A `thinking` block's signature: never empty (Claude Code drops a turn whose thinking has
    /// none); a digest of the text, so a client echoing it back can be recognised.
    fn signature(thinking: &str) -> String {
        format!("dn1.{:032x}", xxhash_rust::xxh3::xxh3_128(thinking.as_bytes()))
    }

    fn tool_use(&self, index: usize, call: &super::parsers::ToolCall) -> Value {
        let input: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!({}));
        let id = call.id.clone().unwrap_or_else(|| format!("toolu_{}_{index}", self.id.trim_start_matches("msg-")));
        json!({"type": "tool_use", "id": id, "name": call.name, "input": input})
    }
}

fn stop_reason(answer: &Answer, reason: FinishReason) -> (&'static str, Value) {
    match reason {
        FinishReason::Length => ("max_tokens", Value::Null),
        FinishReason::ToolCalls => ("tool_use", Value::Null),
        FinishReason::Stop => match answer.stop.matched() {
            Some(stop) => ("stop_sequence", json!(stop)),
            None => ("end_turn", Value::Null),
        },
    }
}

fn usage(answer: &Answer) -> Value {
    json!({
        "input_tokens": answer.prompt_tokens - answer.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": answer.cached_tokens,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
        "output_tokens": answer.completion_tokens,
    })
}

fn message_id(id: &str) -> String {
    format!("msg_{}", id.trim_start_matches("msg-"))
}

async fn run(state: &FrontendState, prepared: Prepared, arrived: Instant) -> Response {
    let Prepared { request, stop, stream, parser } = prepared;
    let model = request.model.clone();
    let mut answer = Answer::start(state, Api::Chat, request, stop, parser, arrived);
    let mut pending = match answer.admit().await {
        Err(e) => return anthropic_error(e),
        Ok(pending) => pending,
    };
    let id = message_id(&answer.id);
    if !stream {
        let mut segments = Vec::new();
        let reason = loop {
            match answer.step(&mut pending).await {
                Err(e) => return anthropic_error(e),
                Ok((more, done)) => {
                    for s in more {
                        super::parsers::push_segment(&mut segments, s);
                    }
                    if let Some(reason) = done {
                        break reason;
                    }
                }
            }
        };
        let blocks = Blocks { id: answer.id.clone() };
        let mut calls = 0;
        let content: Vec<Value> = segments
            .iter()
            .map(|s| match s {
                Segment::Thinking(t) => json!({"type": "thinking", "thinking": t, "signature": Blocks::signature(t)}),
                Segment::Text(t) => json!({"type": "text", "text": t}),
                Segment::ToolCall(c) => {
                    calls += 1;
                    blocks.tool_use(calls - 1, c)
                }
            })
            .collect();
        let (stop_reason, stop_sequence) = stop_reason(&answer, reason);
        return axum::Json(json!({
            "id": id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage(&answer),
        }))
        .into_response();
    }

    let (mut tx, rx) = futures::channel::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(16);
    tokio::spawn(async move {
        let mut stream = Stream { open: None, index: 0, calls: 0, blocks: Blocks { id: answer.id.clone() } };
        let mut start = json!({"id": id, "type": "message", "role": "assistant", "model": model, "content": [],
                               "stop_reason": null, "stop_sequence": null, "usage": usage(&answer)});
        start["usage"]["output_tokens"] = json!(0);
        if tx.send(Ok(event("message_start", &json!({"type": "message_start", "message": start})))).await.is_err() {
            return;
        }
        loop {
            let (segments, done) = match answer.step(&mut pending).await {
                Ok(step) => step,
                Err(e) => {
                    let kind = if e.status.as_u16() == 429 || e.status.as_u16() == 503 {
                        "overloaded_error"
                    } else {
                        "api_error"
                    };
                    let body = json!({"type": "error", "error": {"type": kind, "message": e.message}});
                    let _ = tx.send(Ok(event("error", &body))).await;
                    return;
                }
            };
            let mut frames = Vec::new();
            for segment in segments {
                stream.add(segment, &mut frames);
            }
            if let Some(reason) = done {
                stream.close(&mut frames);
                let (stop_reason, stop_sequence) = stop_reason(&answer, reason);
                frames.push(event(
                    "message_delta",
                    &json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                            "usage": {"output_tokens": answer.completion_tokens}}),
                ));
                frames.push(event("message_stop", &json!({"type": "message_stop"})));
            }
            for frame in frames {
                if tx.send(Ok(frame)).await.is_err() {
                    return;
                }
            }
            if done.is_some() {
                return;
            }
        }
    });
    event_stream(rx)
}

fn event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// The content blocks of a streamed answer: one open at a time, indexed in start order.
struct Stream {
    /// The open block's kind and its text so far (a thinking block's, for its signature).
    open: Option<(Kind, String)>,
    index: usize,
    calls: usize,
    blocks: Blocks,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Thinking,
    Text,
}

impl Stream {
    fn add(&mut self, segment: Segment, frames: &mut Vec<Bytes>) {
        let (kind, text) = match segment {
            Segment::Thinking(t) => (Kind::Thinking, t),
            Segment::Text(t) => (Kind::Text, t),
            Segment::ToolCall(call) => {
                self.close(frames);
                let block = self.blocks.tool_use(self.calls, &call);
                self.calls += 1;
                let input = block["input"].to_string();
                let mut start = block;
                start["input"] = json!({});
                let index = self.index;
                frames.push(event(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": index, "content_block": start}),
                ));
                frames.push(event(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": input}}),
                ));
                frames.push(event("content_block_stop", &json!({"type": "content_block_stop", "index": index})));
                self.index += 1;
                return;
            }
        };
        if self.open.as_ref().is_some_and(|(open, _)| *open != kind) {
            self.close(frames);
        }
        if self.open.is_none() {
            let block = match kind {
                Kind::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                Kind::Text => json!({"type": "text", "text": ""}),
            };
            frames.push(event(
                "content_block_start",
                &json!({"type": "content_block_start", "index": self.index, "content_block": block}),
            ));
            self.open = Some((kind, String::new()));
        }
        let delta = match kind {
            Kind::Thinking => json!({"type": "thinking_delta", "thinking": text}),
            Kind::Text => json!({"type": "text_delta", "text": text}),
        };
        frames.push(event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": self.index, "delta": delta}),
        ));
        if let Some((_, so_far)) = &mut self.open {
            so_far.push_str(&text);
        }
    }

    /// Closes the open block (a thinking block gets its signature first).
    fn close(&mut self, frames: &mut Vec<Bytes>) {
        if let Some((kind, text)) = self.open.take() {
            if kind == Kind::Thinking {
                let delta = json!({"type": "signature_delta", "signature": Blocks::signature(&text)});
                frames.push(event(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": self.index, "delta": delta}),
                ));
            }
            frames.push(event("content_block_stop", &json!({"type": "content_block_stop", "index": self.index})));
            self.index += 1;
        }
    }
}

/// `GET /v1/models` in Anthropic's shape (asked for with an `anthropic-version` header).
pub(super) fn models(state: &FrontendState) -> Response {
    let data: Vec<Value> = state
        .inner
        .generator
        .models()
        .into_iter()
        .map(|id| json!({"type": "model", "id": id, "display_name": id, "created_at": "2026-01-01T00:00:00Z"}))
        .collect();
    let first = data.first().map(|m| m["id"].clone()).unwrap_or(Value::Null);
    let last = data.last().map(|m| m["id"].clone()).unwrap_or(Value::Null);
    axum::Json(json!({"data": data, "has_more": false, "first_id": first, "last_id": last})).into_response()
}
