//! Anthropic Messages: `POST /v1/messages` (JSON or SSE), `POST /v1/messages/count_tokens`, and
//! `GET /v1/models` in Anthropic's shape. A query string (`?beta=true`) is ignored.
//!
//! Request → [`Conversation`]: `system` (a string or text blocks) is the leading system text;
//! `messages` may hold `user`, `assistant` and inline `system` turns; `thinking`, `tool_use` and
//! `tool_result` blocks are typed blocks with their `cache_control` marks; unknown block types
//! are ignored. With `frontend.strip_anthropic_preamble` (on by default), Claude Code's
//! `x-anthropic-billing-header: …` system text, which changes on every request, is dropped
//! first, so a session's prompts keep a common prefix (and `count_tokens` agrees with them).
//!
//! Answer → Messages ([`render`]): content blocks in generation order, `thinking` blocks with a
//! non-empty `signature` (the turn's replay handle; with `thinking.display: "omitted"` the text
//! is left out), `tool_use` blocks with the parsed input, and usage as Anthropic defines it.
//!
//! The session is the first session header sent (Claude Code's `x-claude-code-session-id` among
//! them), else the session id in `metadata.user_id` (Claude Code's JSON form or its older
//! `user_…_session_…` form), as [`session_id`] reads them.

mod render;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::FrontendState;
use super::auth::Caller;
use super::error::ApiError;
use super::http::{SessionFields, object_id, prepare_off_thread, session_id};
use super::ir::{Block, CacheMark, Conversation, Role, SamplingRequest, Thinking, ToolChoice, ToolDef, Turn};
use super::lower;

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
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    thinking: Option<Value>,
    #[serde(default)]
    stop_sequences: Option<Vec<String>>,
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default, deserialize_with = "crate::frontend::http::null_as_default")]
    stream: bool,
    #[serde(default)]
    metadata: Option<Metadata>,
    /// vLLM's `cache_salt`, taken here too: the request's blocks are shared only with requests
    /// of the same salt.
    #[serde(default)]
    cache_salt: Option<String>,
    /// The automatic breakpoint: the whole prompt is cached.
    #[serde(default)]
    cache_control: Option<Value>,
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
struct Metadata {
    #[serde(default)]
    user_id: Option<String>,
}

/// The text of a `text` block.
fn block_text(block: &Value) -> Option<&str> {
    (block["type"] == "text").then(|| block["text"].as_str()).flatten()
}

/// Blocks a request may mark with `cache_control` (Anthropic's limit).
const MAX_CACHE_BREAKPOINTS: usize = 4;

/// A block's `cache_control`.
fn cache_mark(block: &Value) -> Option<CacheMark> {
    block.get("cache_control").filter(|c| !c.is_null()).map(mark_of)
}

/// Refuses a `cache_control` Anthropic refuses: not an object, a `type` other than `ephemeral`, a
/// `ttl` other than `5m` or `1h` (`at` names where, as Anthropic's errors do).
fn check_cache_control(control: &Value, at: &str) -> Result<(), ApiError> {
    if control.is_null() {
        return Ok(());
    }
    let Some(object) = control.as_object() else {
        return Err(ApiError::invalid(format!("{at}: Input should be a valid dictionary"), Some("cache_control")));
    };
    if object.get("type").and_then(Value::as_str) != Some("ephemeral") {
        return Err(ApiError::invalid(format!("{at}.type: Input should be 'ephemeral'"), Some("cache_control")));
    }
    match object.get("ttl") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(ttl)) if ttl == "5m" || ttl == "1h" => Ok(()),
        Some(_) => {
            Err(ApiError::invalid(format!("{at}.ephemeral.ttl: Input should be '5m' or '1h'"), Some("cache_control")))
        }
    }
}

/// Every `cache_control` of the request, checked before anything is built from it: the top-level
/// one, the system blocks', the messages' blocks' (a tool result's inner blocks too), the tools'.
fn check_cache_controls(req: &MessagesRequest) -> Result<(), ApiError> {
    let blocks_of = |content: &Content, at: &str| -> Result<(), ApiError> {
        let Content::Blocks(blocks) = content else { return Ok(()) };
        for (j, block) in blocks.iter().enumerate() {
            if let Some(control) = block.get("cache_control") {
                check_cache_control(control, &format!("{at}.{j}.cache_control"))?;
            }
            for (k, inner) in block["content"].as_array().into_iter().flatten().enumerate() {
                if let Some(control) = inner.get("cache_control") {
                    check_cache_control(control, &format!("{at}.{j}.content.{k}.cache_control"))?;
                }
            }
        }
        Ok(())
    };
    if let Some(control) = &req.cache_control {
        check_cache_control(control, "cache_control")?;
    }
    if let Some(system) = &req.system {
        blocks_of(system, "system")?;
    }
    for (i, m) in req.messages.iter().enumerate() {
        blocks_of(&m.content, &format!("messages.{i}.content"))?;
    }
    for (i, tool) in req.tools.iter().flatten().enumerate() {
        if let Some(control) = tool.get("cache_control") {
            check_cache_control(control, &format!("tools.{i}.cache_control"))?;
        }
    }
    Ok(())
}

/// `thinking`: `enabled` (with an integer `budget_tokens`), `disabled` or `adaptive`, as
/// Anthropic accepts it.
fn check_thinking(thinking: &Value) -> Result<(), ApiError> {
    let invalid = |message: String| Err(ApiError::invalid(message, Some("thinking")));
    match thinking["type"].as_str() {
        Some("enabled") => match thinking.get("budget_tokens") {
            None | Some(Value::Null) => invalid("thinking.enabled.budget_tokens: Field required".into()),
            Some(budget) if budget.as_u64().is_none() => {
                invalid("thinking.enabled.budget_tokens: Input should be a valid integer".into())
            }
            Some(_) => Ok(()),
        },
        Some("disabled" | "adaptive") => Ok(()),
        Some(other) => invalid(format!(
            "thinking: Input tag '{}' found using 'type' does not match any of the expected tags: 'enabled', 'disabled', 'adaptive'",
            super::error::clip(other, 64)
        )),
        None => invalid("thinking.type: Field required".into()),
    }
}

/// The mark of a `cache_control` object: `ttl: "1h"`, else five minutes.
fn mark_of(control: &Value) -> CacheMark {
    match control.get("ttl").and_then(Value::as_str) {
        Some("1h") => CacheMark::OneHour,
        _ => CacheMark::FiveMinutes,
    }
}

/// `system` (or an inline system turn) as text blocks.
fn system_blocks(content: &Content) -> Vec<Block> {
    match content {
        Content::Text(text) if text.is_empty() => Vec::new(),
        Content::Text(text) => vec![Block::text(text.clone())],
        Content::Blocks(blocks) => blocks
            .iter()
            .filter_map(|b| Some(Block::Text { text: block_text(b)?.to_owned(), cache: cache_mark(b) }))
            .collect(),
    }
}

/// A message's blocks as IR blocks.
fn blocks(i: usize, content: &Content) -> Result<Vec<Block>, ApiError> {
    let raw = match content {
        Content::Text(text) => return Ok(vec![Block::text(text.clone())]),
        Content::Blocks(raw) => raw,
    };
    let mut out = Vec::with_capacity(raw.len());
    for (j, block) in raw.iter().enumerate() {
        let text = |key: &str| block[key].as_str().unwrap_or_default().to_owned();
        match block["type"].as_str() {
            Some("text") => out.push(Block::Text { text: text("text"), cache: cache_mark(block) }),
            Some("thinking") => out.push(Block::Thinking {
                text: text("thinking"),
                handle: block["signature"].as_str().filter(|s| !s.is_empty()).map(str::to_owned),
            }),
            Some("redacted_thinking") => {
                out.push(Block::Thinking { text: String::new(), handle: Some(text("data")) });
            }
            Some("tool_use") => out.push(Block::ToolUse {
                id: text("id"),
                name: text("name"),
                arguments: block.get("input").cloned().unwrap_or_else(|| json!({})),
            }),
            Some("tool_result") => {
                let content = match &block["content"] {
                    Value::String(s) => s.clone(),
                    Value::Array(parts) => parts.iter().filter_map(block_text).collect::<Vec<_>>().join("\n"),
                    _ => String::new(),
                };
                out.push(Block::ToolResult {
                    call_id: text("tool_use_id"),
                    content,
                    is_error: block["is_error"].as_bool().unwrap_or(false),
                    cache: cache_mark(block),
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
    Ok(out)
}

/// `tools`: custom tools (with an `input_schema`); Anthropic's server tools are left out.
fn tools(tools: Option<Vec<Value>>) -> Vec<ToolDef> {
    tools
        .into_iter()
        .flatten()
        .filter(|t| t.get("type").is_none_or(|k| k == "custom"))
        .filter_map(|t| {
            Some(ToolDef {
                name: t["name"].as_str()?.to_owned(),
                description: t["description"].as_str().map(str::to_owned),
                parameters: t.get("input_schema").cloned().unwrap_or_else(|| json!({"type": "object"})),
            })
        })
        .collect()
}

/// `tool_choice`: `auto`, `any` (a call is expected), `tool` (that one), `none`.
fn tool_choice(choice: Option<&Value>, tools: &[ToolDef]) -> Result<ToolChoice, ApiError> {
    let Some(choice) = choice else { return Ok(ToolChoice::Auto) };
    match choice["type"].as_str() {
        Some("auto") | None => Ok(ToolChoice::Auto),
        Some("any") => Ok(ToolChoice::Required),
        Some("none") => Ok(ToolChoice::None),
        Some("tool") => {
            let name = choice["name"].as_str().unwrap_or_default();
            if tools.iter().any(|t| t.name == name) {
                Ok(ToolChoice::Named(name.to_owned()))
            } else {
                Err(ApiError::invalid(
                    format!("tool_choice.name: no tool named `{}`", super::error::clip(name, 64)),
                    Some("tool_choice"),
                ))
            }
        }
        Some(other) => Err(ApiError::invalid(
            format!("tool_choice.type: `{}` is not auto, any, tool or none", super::error::clip(other, 64)),
            Some("tool_choice"),
        )),
    }
}

/// The request as a [`Conversation`].
fn conversation(
    state: &FrontendState,
    caller: &Caller,
    req: MessagesRequest,
    count_only: bool,
) -> Result<Conversation, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::invalid("messages: at least one message is required", Some("messages")));
    }
    let max_tokens = match (req.max_tokens, count_only) {
        (Some(0), false) => return Err(ApiError::invalid("max_tokens: must be at least 1", Some("max_tokens"))),
        (None, false) => return Err(ApiError::invalid("max_tokens: Field required", Some("max_tokens"))),
        (n, _) => n,
    };
    check_cache_controls(&req)?;
    if let Some(thinking) = &req.thinking {
        check_thinking(thinking)?;
    }
    if let Some(temperature) = req.temperature
        && !(0.0..=1.0).contains(&temperature)
    {
        return Err(ApiError::invalid("temperature: must be between 0 and 1", Some("temperature")));
    }
    let sampling =
        SamplingRequest::check(req.temperature, req.top_p, req.top_k, None, state.inner.messages_temperature)
            .map_err(|(message, param)| ApiError::invalid(message, Some(param)))?;
    let system = req.system.as_ref().map(system_blocks).unwrap_or_default();
    let mut turns = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        let role = match m.role.as_str() {
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "system" => Role::System,
            other => {
                return Err(ApiError::invalid(
                    format!("messages.{i}.role: `{}` is not user, assistant or system", super::error::clip(other, 64)),
                    Some("messages"),
                ));
            }
        };
        let blocks = if role == Role::System { system_blocks(&m.content) } else { blocks(i, &m.content)? };
        turns.push(Turn::new(role, blocks));
    }
    let tools = tools(req.tools);
    let tool_choice = tool_choice(req.tool_choice.as_ref(), &tools)?;
    let thinking = match &req.thinking {
        Some(t) => Thinking {
            enabled: match t["type"].as_str() {
                Some("disabled") => Some(false),
                Some("enabled" | "adaptive") => Some(true),
                _ => None,
            },
            omit_text: t["display"] == "omitted",
        },
        None => Thinking::default(),
    };
    let marked =
        system.iter().chain(turns.iter().flat_map(|t| t.blocks.iter())).filter(|b| b.cache_mark().is_some()).count();
    if marked > MAX_CACHE_BREAKPOINTS {
        return Err(ApiError::invalid(
            format!("A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. Found {marked}."),
            Some("messages"),
        ));
    }
    let user_id = req.metadata.as_ref().and_then(|m| m.user_id.as_deref());
    let session = session_id(caller, SessionFields { metadata_user_id: user_id, ..Default::default() });
    let mut conversation = Conversation {
        model: req.model,
        system,
        turns,
        tools,
        tool_choice,
        parallel_tool_calls: req.tool_choice.as_ref().is_none_or(|c| c["disable_parallel_tool_use"] != true),
        thinking,
        template_kwargs: Default::default(),
        sampling,
        seed: None,
        stop: req.stop_sequences.unwrap_or_default(),
        max_tokens,
        hints: Default::default(),
        session,
        tenant: caller.tenant.clone(),
        cache: req.cache_control.as_ref().map(mark_of),
        cache_salt: req.cache_salt,
        stream: req.stream,
    };
    lower::strip_preamble(state, &mut conversation);
    Ok(conversation)
}

pub(super) async fn count_tokens(State(state): State<FrontendState>, caller: Caller, body: Body) -> Response {
    let counted = prepare_off_thread(&state, caller, body, |state, caller, req: MessagesRequest| {
        lower::check_model(state, &req.model)?;
        let conversation = conversation(state, caller, req, true)?;
        Ok(lower::lower(state, &conversation)?.prompt.len())
    })
    .await;
    let response = match counted {
        Ok(tokens) => axum::Json(json!({"input_tokens": tokens})).into_response(),
        Err(e) => e.anthropic_response(),
    };
    super::Route::Messages.count(response.status().as_u16());
    response
}

pub(super) async fn messages(State(state): State<FrontendState>, caller: Caller, body: Body) -> Response {
    let arrived = Instant::now();
    let prepared = prepare_off_thread(&state, caller, body, |state, caller, req: MessagesRequest| {
        lower::check_model(state, &req.model)?;
        let conversation = conversation(state, caller, req, false)?;
        let lowered = lower::lower(state, &conversation)?;
        let (request, tail) =
            lower::generate_request(state, &conversation, lowered, object_id("msg"), caller.request_id.clone())?;
        Ok(render::Prepared { request, tail, conversation })
    })
    .await;
    let response = match prepared {
        Ok(prepared) => render::run(&state, prepared, arrived).await,
        Err(e) => e.anthropic_response(),
    };
    super::Route::Messages.count(response.status().as_u16());
    response
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
