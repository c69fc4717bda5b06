//! Answer → Anthropic Messages: the message body, or its SSE stream (`message_start` with the
//! exact usage before the first token, a `ping`, `content_block_start` / `_delta` / `_stop` per
//! block in generation order, `message_delta` with the stop reason, `message_stop`; a `ping`
//! whenever the answer is silent for 5 s; `event: error` when the generation fails mid-stream).

use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use futures::SinkExt;
use serde_json::{Value, json};
use tokio::time::Instant;
use tracing::Instrument;

use crate::frontend::FrontendState;
use crate::frontend::answer::{Answer, Done};
use crate::frontend::generate::{FinishReason, GenerateRequest};
use crate::frontend::http::{event_stream, named_event as event, send_all};
use crate::frontend::ir::{BlockKind, Conversation, Finish, Output, Usage};
use crate::frontend::lower::Tail;

/// A streamed answer silent this long gets a `ping` event.
const PING_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// A request ready to generate.
pub(super) struct Prepared {
    pub(super) request: GenerateRequest,
    pub(super) tail: Tail,
    pub(super) conversation: Conversation,
}

/// `stop_reason` and `stop_sequence`.
fn stop_reason(finish: &Finish) -> (&'static str, Value) {
    match finish.reason {
        FinishReason::Length => ("max_tokens", Value::Null),
        FinishReason::ToolCalls => ("tool_use", Value::Null),
        FinishReason::Stop => match &finish.stop_sequence {
            Some(stop) => ("stop_sequence", json!(stop)),
            None => ("end_turn", Value::Null),
        },
    }
}

/// Usage as Anthropic defines it: `input_tokens` are the prompt tokens neither read from the
/// cache nor newly written to it (leased by this request's `cache_control`), so
/// `input + cache_creation + cache_read` is the prompt.
fn usage(usage: Usage) -> Value {
    let creation = usage.cache_creation_5m + usage.cache_creation_1h;
    json!({
        "input_tokens": usage.prompt_tokens - usage.cached_tokens - creation,
        "cache_creation_input_tokens": creation,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation": {
            "ephemeral_5m_input_tokens": usage.cache_creation_5m,
            "ephemeral_1h_input_tokens": usage.cache_creation_1h,
        },
        "output_tokens": usage.completion_tokens,
    })
}

/// The message id of a request id (`msg-…` → `msg_…`).
fn message_id(id: &str) -> String {
    format!("msg_{}", id.trim_start_matches("msg-"))
}

/// A tool call's input: its arguments as JSON (`{}` when the model wrote something else, or
/// nested deeper than `serde_json`'s 128 levels).
fn input(arguments: &str) -> Value {
    serde_json::from_str(arguments).ok().filter(Value::is_object).unwrap_or_else(|| json!({}))
}

pub(super) async fn run(state: &FrontendState, prepared: Prepared, arrived: Instant) -> Response {
    let Prepared { request, tail, conversation } = prepared;
    let omit = conversation.thinking.omit_text;
    let model = conversation.model;
    let mut answer = Answer::start(state, request, tail, conversation.stop, "toolu", arrived);
    if let Err(e) = answer.admit().await {
        return e.anthropic_response();
    }
    let id = message_id(&answer.id);
    if !conversation.stream {
        let finish = match answer.complete().await {
            Ok(finish) => finish,
            Err(e) => return e.anthropic_response(),
        };
        let content: Vec<Value> = answer
            .blocks()
            .iter()
            .map(|block| match block {
                Done::Thinking { text, handle } => {
                    json!({"type": "thinking", "thinking": if omit { "" } else { text }, "signature": handle})
                }
                Done::Text(text) => json!({"type": "text", "text": text}),
                Done::ToolCall { id, name, arguments } => {
                    json!({"type": "tool_use", "id": id, "name": name, "input": input(arguments)})
                }
            })
            .collect();
        let (stop_reason, stop_sequence) = stop_reason(&finish);
        return axum::Json(json!({
            "id": id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage(answer.usage()),
        }))
        .into_response();
    }

    let (mut tx, rx) = futures::channel::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(16);
    tokio::spawn(async move {
        let mut start = json!({"id": id, "type": "message", "role": "assistant", "model": model, "content": [],
                               "stop_reason": null, "stop_sequence": null, "usage": usage(answer.usage())});
        start["usage"]["output_tokens"] = json!(0);
        if tx.send(Ok(event("message_start", &json!({"type": "message_start", "message": start})))).await.is_err() {
            return;
        }
        let ping = || event("ping", &json!({"type": "ping"}));
        if tx.send(Ok(ping())).await.is_err() {
            return;
        }
        let mut kinds: Vec<BlockKind> = Vec::new();
        // A tool call's arguments as the model writes them, sent whole at the call's end as the
        // same object the non-streamed answer gives: what a model writes need not be JSON, and
        // an SDK parses `partial_json` as it comes.
        let mut arguments: Vec<String> = Vec::new();
        loop {
            // A `ping` whenever the answer is silent for a while, as Anthropic's API sends them;
            // `step` only awaits the next generation event, so a timeout loses nothing.
            let step = match tokio::time::timeout(PING_EVERY, answer.step()).await {
                Err(_) => {
                    if tx.send(Ok(ping())).await.is_err() {
                        return;
                    }
                    continue;
                }
                Ok(Ok(step)) => step,
                Ok(Err(e)) => {
                    let _ = tx.send(Ok(event("error", &e.anthropic_body()))).await;
                    return;
                }
            };
            let mut frames = Vec::new();
            for output in step.outputs {
                match output {
                    Output::Start { index, kind } => {
                        let block = match &kind {
                            BlockKind::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                            BlockKind::Text => json!({"type": "text", "text": ""}),
                            BlockKind::ToolCall { id, name } => {
                                json!({"type": "tool_use", "id": id, "name": name, "input": {}})
                            }
                        };
                        kinds.push(kind);
                        arguments.push(String::new());
                        frames.push(event(
                            "content_block_start",
                            &json!({"type": "content_block_start", "index": index, "content_block": block}),
                        ));
                    }
                    Output::Delta { index, text } => {
                        let delta = match &kinds[index] {
                            BlockKind::Thinking if omit => continue,
                            BlockKind::Thinking => json!({"type": "thinking_delta", "thinking": text}),
                            BlockKind::Text => json!({"type": "text_delta", "text": text}),
                            BlockKind::ToolCall { .. } => {
                                arguments[index].push_str(&text);
                                continue;
                            }
                        };
                        frames.push(event(
                            "content_block_delta",
                            &json!({"type": "content_block_delta", "index": index, "delta": delta}),
                        ));
                    }
                    Output::Stop { index, handle, .. } => {
                        if matches!(kinds[index], BlockKind::ToolCall { .. }) {
                            let whole = input(&std::mem::take(&mut arguments[index])).to_string();
                            let delta = json!({"type": "input_json_delta", "partial_json": whole});
                            frames.push(event(
                                "content_block_delta",
                                &json!({"type": "content_block_delta", "index": index, "delta": delta}),
                            ));
                        }
                        if let Some(signature) = handle {
                            let delta = json!({"type": "signature_delta", "signature": signature});
                            frames.push(event(
                                "content_block_delta",
                                &json!({"type": "content_block_delta", "index": index, "delta": delta}),
                            ));
                        }
                        frames
                            .push(event("content_block_stop", &json!({"type": "content_block_stop", "index": index})));
                    }
                }
            }
            let done = step.finish.is_some();
            if let Some(finish) = step.finish {
                let (stop_reason, stop_sequence) = stop_reason(&finish);
                frames.push(event(
                    "message_delta",
                    &json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                            // Cumulative, as Anthropic's API sends it: an engine that counts its cache
                            // hits only at the end (vLLM) has its final count here.
                            "usage": usage(answer.usage())}),
                ));
                frames.push(event("message_stop", &json!({"type": "message_stop"})));
            }
            if !send_all(&mut tx, frames).await || done {
                return;
            }
        }
    }.in_current_span());
    event_stream(rx)
}
