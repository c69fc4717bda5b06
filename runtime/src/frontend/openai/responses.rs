//! OpenAI Responses: `POST /v1/responses` (JSON or SSE), `GET` and `DELETE /v1/responses/{id}`,
//! `GET /v1/responses/{id}/input_items`.
//!
//! Request → [`Conversation`]: `instructions` is the leading system text; `input` is a string
//! (one user message) or items: messages (`user`, `system`, `developer`, `assistant`), and the
//! assistant side of earlier turns (`reasoning`, `function_call`, assistant messages), which are
//! gathered into one assistant turn as they were generated, and `function_call_output`s, which
//! are tool results (a user message right after them is text beside them, as in Anthropic's
//! tool-result turns, not a new query). Item types this node does not serve (hosted tools' calls, references) are
//! left out, and so are tools other than `function` tools (Codex sends `web_search` and
//! namespaces). `prompt_cache_key`, then the `session-id` header, names the session.
//!
//! `store` (default true) keeps the response ([`store`](super::store)); `previous_response_id`
//! continues a stored one: its whole conversation comes first (its `instructions` do not carry
//! over, as OpenAI documents). Stateless clients that resend everything (Codex: `store: false`,
//! `include: ["reasoning.encrypted_content"]`) get each reasoning item's replay handle as its
//! `encrypted_content`, and the turn is replayed token for token when it comes back.
//!
//! Answer → Responses: output items in generation order (`reasoning`, `function_call`,
//! `message`), `status: "incomplete"` with `incomplete_details.reason: "max_output_tokens"` on a
//! length stop. Streamed: `response.created`, `response.in_progress`, then per item
//! `output_item.added`, its content part and deltas, their `done` events and `output_item.done`,
//! and `response.completed` (or `response.incomplete`, or `response.failed` when generation
//! fails mid-stream), every event with its `sequence_number`.

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use futures::SinkExt;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::time::Instant;
use tracing::Instrument;

use super::chat::{check_sampling, function_tools, tool_choice};
use super::store::History;
use super::wire::ToolChoiceWire;
use crate::frontend::FrontendState;
use crate::frontend::answer::{Answer, Done};
use crate::frontend::auth::Caller;
use crate::frontend::error::{ApiError, clip};
use crate::frontend::generate::{AgentHints, FinishReason, GenerateRequest};
use crate::frontend::http::{
    SessionFields, counted, event_stream, named_event, object_id, prepare_off_thread, send_all, session_id,
};
use crate::frontend::ir::{Block, BlockKind, Conversation, Finish, Output, Role, Turn, Usage};
use crate::frontend::lower::{self, Tail};
use crate::frontend::replay::HANDLE_PREFIX;

/// A `POST /v1/responses` body. Fields this node does not use are accepted and ignored.
#[derive(Debug, Deserialize)]
pub(crate) struct ResponsesRequest {
    model: String,
    #[serde(default)]
    input: Option<Input>,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    max_output_tokens: Option<usize>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default, deserialize_with = "crate::frontend::http::null_as_default")]
    stream: bool,
    #[serde(default)]
    include: Option<Vec<String>>,
    #[serde(default)]
    prompt_cache_key: Option<String>,
    #[serde(default)]
    prompt_cache_retention: Option<String>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    reasoning: Option<Value>,
    #[serde(default)]
    background: Option<bool>,
    #[serde(default)]
    conversation: Option<Value>,
    #[serde(default)]
    metadata: Option<Value>,
    #[serde(default)]
    text: Option<Value>,
    #[serde(default)]
    truncation: Option<String>,
    #[serde(default)]
    nvext: Option<AgentHints>,
}

/// `input`: a string, or items.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Items(Vec<Value>),
}

/// What the answer echoes of its request.
#[derive(Debug)]
struct Echo {
    id: String,
    created_at: u64,
    model: String,
    instructions: Value,
    max_output_tokens: Value,
    parallel_tool_calls: bool,
    previous_response_id: Value,
    reasoning: Value,
    store: bool,
    temperature: f32,
    text: Value,
    tool_choice: Value,
    tools: Value,
    top_p: Value,
    truncation: String,
    metadata: Value,
    user: Value,
    /// `include` asks for `reasoning.encrypted_content`.
    encrypted: bool,
}

/// A request ready to generate.
struct Prepared {
    request: GenerateRequest,
    tail: Tail,
    conversation: Conversation,
    echo: Echo,
    /// The input items as stored (with ids).
    input_items: Vec<Value>,
    /// The stored conversation it continues, and how many of its turns that is.
    parent: Option<std::sync::Arc<History>>,
    inherited: usize,
}

/// Text of a message's content: a string, or parts (`input_text`, `output_text`, `text`,
/// `refusal`); an image part is an [`Block::Image`].
fn content_blocks(content: &Value) -> Vec<Block> {
    match content {
        Value::String(text) => vec![Block::text(text.clone())],
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| match part["type"].as_str() {
                Some("input_text" | "output_text" | "text") => Some(Block::text(part["text"].as_str()?.to_owned())),
                Some("refusal") => Some(Block::text(part["refusal"].as_str()?.to_owned())),
                Some("input_image") => Some(Block::Image),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// Appends `block` to the turn of `role` at the end of `turns`, opening one if the last turn is
/// another role's (a generated turn's items arrive one by one).
fn append(turns: &mut Vec<Turn>, role: Role, block: Block) {
    match turns.last_mut() {
        Some(last) if last.role == role => last.blocks.push(block),
        _ => turns.push(Turn::new(role, vec![block])),
    }
}

/// Whether `turn` is tool outputs (with any text folded beside them).
fn holds_results(turn: &Turn) -> bool {
    turn.blocks.iter().any(|b| matches!(b, Block::ToolResult { .. }))
}

/// The input items as turns.
fn turns(items: &[Value]) -> Result<Vec<Turn>, ApiError> {
    let mut turns: Vec<Turn> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let kind = item["type"].as_str().unwrap_or(if item.get("role").is_some() { "message" } else { "" });
        let text = |key: &str| item[key].as_str().unwrap_or_default().to_owned();
        match kind {
            "message" => {
                let role = match item["role"].as_str() {
                    Some("user") => Role::User,
                    Some("assistant") => Role::Assistant,
                    Some("system") => Role::System,
                    Some("developer") => Role::Developer,
                    other => {
                        return Err(ApiError::invalid(
                            format!(
                                "Invalid 'input[{i}].role': `{}` (expected user, assistant, system or developer).",
                                clip(other.unwrap_or(""), 64)
                            ),
                            Some(&format!("input[{i}].role")),
                        ));
                    }
                };
                let blocks = content_blocks(&item["content"]);
                match turns.last_mut() {
                    _ if role == Role::Assistant => {
                        blocks.into_iter().for_each(|b| append(&mut turns, Role::Assistant, b))
                    }
                    // A user message right after tool outputs is text beside them (a reminder, a
                    // steer), as Anthropic sends it in the results' own turn: folded into the
                    // last result, not a new user query.
                    Some(last) if role == Role::User && last.role == Role::User && holds_results(last) => {
                        last.blocks.extend(blocks)
                    }
                    _ => turns.push(Turn::new(role, blocks)),
                }
            }
            "function_call" => append(
                &mut turns,
                Role::Assistant,
                Block::ToolUse {
                    id: text("call_id"),
                    name: text("name"),
                    arguments: Value::String(item["arguments"].as_str().unwrap_or("{}").to_owned()),
                },
            ),
            "reasoning" => {
                let parts = |key: &str| -> String {
                    item[key].as_array().into_iter().flatten().filter_map(|p| p["text"].as_str()).collect()
                };
                let content = parts("content");
                let handle = item["encrypted_content"].as_str().filter(|h| !h.is_empty()).map(str::to_owned);
                let text = if content.is_empty() && handle.is_none() { parts("summary") } else { content };
                append(&mut turns, Role::Assistant, Block::Thinking { text, handle });
            }
            "function_call_output" => {
                let content = match &item["output"] {
                    Value::String(s) => s.clone(),
                    parts @ Value::Array(_) => content_blocks(parts)
                        .into_iter()
                        .filter_map(|b| match b {
                            Block::Text { text, .. } => Some(text),
                            _ => None,
                        })
                        .collect::<Vec<_>>()
                        .join("\n"),
                    _ => String::new(),
                };
                let result = Block::ToolResult { call_id: text("call_id"), content, is_error: false, cache: None };
                match turns.last_mut() {
                    Some(last)
                        if last.role == Role::User
                            && last.blocks.iter().all(|b| matches!(b, Block::ToolResult { .. })) =>
                    {
                        last.blocks.push(result)
                    }
                    _ => turns.push(Turn::new(Role::User, vec![result])),
                }
            }
            // Item references, hosted tools' calls and their outputs: not served here.
            _ => {}
        }
    }
    Ok(turns)
}

/// Longest id a request may carry (`previous_response_id`, an item's `id` or `call_id`).
const MAX_ID_BYTES: usize = 512;
/// Bytes of input items this node keeps without serving them (hosted tools' calls, references).
const MAX_UNSERVED_BYTES: usize = 1 << 20;
/// OpenAI's `metadata` limits: 16 pairs, keys of 64 characters, string values of 512.
const MAX_METADATA_PAIRS: usize = 16;
const MAX_METADATA_KEY: usize = 64;
const MAX_METADATA_VALUE: usize = 512;

/// Item types turned into the conversation; the others are kept (listed by `/input_items`) only.
const SERVED_ITEMS: [&str; 4] = ["message", "function_call", "reasoning", "function_call_output"];

/// Refuses what the store would keep without bound: ids over [`MAX_ID_BYTES`], `metadata` past
/// OpenAI's limits, unserved items over [`MAX_UNSERVED_BYTES`] in all.
fn check_kept(req: &ResponsesRequest) -> Result<(), ApiError> {
    let too_long = |param: String| {
        Err(ApiError::invalid(format!("Invalid '{param}': longer than {MAX_ID_BYTES} characters."), Some(&param)))
    };
    if req.previous_response_id.as_ref().is_some_and(|id| id.len() > MAX_ID_BYTES) {
        return too_long("previous_response_id".into());
    }
    if let Some(Input::Items(items)) = &req.input {
        let mut unserved = 0;
        for (i, item) in items.iter().enumerate() {
            for key in ["id", "call_id"] {
                if item[key].as_str().is_some_and(|id| id.len() > MAX_ID_BYTES) {
                    return too_long(format!("input[{i}].{key}"));
                }
            }
            let kind = item["type"].as_str().unwrap_or("message");
            if !SERVED_ITEMS.contains(&kind) {
                unserved += super::store::json_bytes(item);
            }
        }
        if unserved > MAX_UNSERVED_BYTES {
            return Err(ApiError::invalid(
                format!(
                    "'input' holds {unserved} bytes of items this server does not serve (at most {MAX_UNSERVED_BYTES})."
                ),
                Some("input"),
            ));
        }
    }
    if let Some(metadata) = &req.metadata {
        let invalid = |message: String| Err(ApiError::invalid(message, Some("metadata")));
        let Some(pairs) = metadata.as_object() else {
            return if metadata.is_null() { Ok(()) } else { invalid("Invalid 'metadata': expected an object.".into()) };
        };
        if pairs.len() > MAX_METADATA_PAIRS {
            return invalid(format!("Invalid 'metadata': {} pairs, at most {MAX_METADATA_PAIRS}.", pairs.len()));
        }
        for (key, value) in pairs {
            if key.chars().count() > MAX_METADATA_KEY {
                return invalid(format!("Invalid 'metadata': a key longer than {MAX_METADATA_KEY} characters."));
            }
            match value.as_str() {
                Some(v) if v.chars().count() <= MAX_METADATA_VALUE => {}
                Some(_) => {
                    return invalid(format!(
                        "Invalid 'metadata.{}': longer than {MAX_METADATA_VALUE} characters.",
                        clip(key, 64)
                    ));
                }
                None => return invalid(format!("Invalid 'metadata.{}': expected a string.", clip(key, 64))),
            }
        }
    }
    Ok(())
}

/// The JSON type of `value`, as an error names it.
fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The input items with ids, as `/input_items` lists them.
fn listed_items(input: &Option<Input>, response_id: &str) -> Vec<Value> {
    let items = match input {
        None => Vec::new(),
        Some(Input::Text(text)) => {
            vec![json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})]
        }
        Some(Input::Items(items)) => items.clone(),
    };
    let suffix = response_id.trim_start_matches("resp_");
    items
        .into_iter()
        .enumerate()
        .map(|(i, mut item)| {
            if item.get("type").is_none() {
                item["type"] = json!("message");
            }
            if item.get("id").is_none_or(Value::is_null) {
                item["id"] = json!(format!("item_{suffix}_{i}"));
            }
            item
        })
        .collect()
}

fn prepare(state: &FrontendState, caller: &Caller, req: ResponsesRequest) -> Result<Prepared, ApiError> {
    lower::check_model(state, &req.model)?;
    if req.background == Some(true) {
        return Err(ApiError::Unsupported {
            message: "Background responses are not supported by this server.".into(),
            param: "background".into(),
        });
    }
    if req.conversation.is_some() {
        return Err(ApiError::Unsupported {
            message: "The Conversations API is not supported by this server; use previous_response_id.".into(),
            param: "conversation".into(),
        });
    }
    if let Some(Input::Items(items)) = &req.input
        && let Some(i) = items.iter().position(|item| !item.is_object())
    {
        return Err(ApiError::invalid(
            format!("Invalid 'input[{i}]': expected an object (an input item), got {}.", json_kind(&items[i])),
            Some(&format!("input[{i}]")),
        ));
    }
    check_kept(&req)?;
    let store = req.store.unwrap_or(true);
    let store_enabled = state.inner.responses.enabled();
    let previous = match &req.previous_response_id {
        None => None,
        Some(_) if !store => {
            return Err(ApiError::invalid(
                "'previous_response_id' cannot be used with 'store: false': the previous response is not kept.",
                Some("previous_response_id"),
            ));
        }
        Some(id) => Some(state.inner.responses.get(&caller.tenant, id).ok_or_else(|| ApiError::NotFound {
            code: "previous_response_not_found",
            message: format!("Previous response with id '{}' not found.", clip(id, 128)),
            param: Some("previous_response_id".into()),
        })?),
    };
    let sampling = check_sampling(req.temperature, req.top_p, None, None, None)?;
    let tools = function_tools(req.tools.clone());
    let choice: Option<ToolChoiceWire> = match &req.tool_choice {
        None => None,
        // Hosted tool choices (`{"type": "web_search"}`) are not served: let the model decide.
        Some(Value::Object(o)) if o.get("type").is_some_and(|t| t != "function") => None,
        Some(v) => Some(
            serde_json::from_value(v.clone())
                .map_err(|_| ApiError::invalid("Invalid 'tool_choice'.", Some("tool_choice")))?,
        ),
    };
    let tool_choice = tool_choice(choice, &tools)?;
    let id = object_id("resp").replacen('-', "_", 1);
    let items = listed_items(&req.input, &id);
    let parent = previous.as_ref().map(|p| p.history.clone());
    let mut conversation_turns = parent.as_ref().map(|h| h.turns()).unwrap_or_default();
    let inherited = conversation_turns.len();
    conversation_turns.extend(match &req.input {
        None => Vec::new(),
        Some(Input::Text(text)) => vec![Turn::new(Role::User, vec![Block::text(text.clone())])],
        Some(Input::Items(items)) => turns(items)?,
    });
    let fields = SessionFields {
        prompt_cache_key: req.prompt_cache_key.as_deref(),
        user: req.user.as_deref(),
        ..Default::default()
    };
    let session = session_id(caller, fields).or_else(|| previous.as_ref().and_then(|p| p.session.clone()));
    let mut conversation = Conversation {
        model: req.model.clone(),
        system: req.instructions.iter().map(|i| Block::text(i.clone())).collect(),
        turns: conversation_turns,
        tools,
        tool_choice,
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        thinking: Default::default(),
        template_kwargs: req
            .reasoning
            .as_ref()
            .and_then(|r| r["effort"].as_str())
            .map(|effort| [("reasoning_effort".to_owned(), Value::from(effort))].into_iter().collect())
            .unwrap_or_default(),
        sampling,
        seed: None,
        stop: Vec::new(),
        max_tokens: req.max_output_tokens,
        hints: req.nvext.unwrap_or_default(),
        session,
        tenant: caller.tenant.clone(),
        cache: super::wire::retention_mark(req.prompt_cache_retention.as_deref())?,
        cache_salt: None,
        stream: req.stream,
    };
    lower::strip_preamble(state, &mut conversation);
    if conversation.turns.is_empty() {
        return Err(ApiError::invalid("'input' must contain at least one item.", Some("input")));
    }
    let lowered = lower::lower(state, &conversation)?;
    let (mut request, tail) =
        lower::generate_request(state, &conversation, lowered, id.clone(), caller.request_id.clone())?;
    request.max_tokens = request.max_tokens.max(1);
    let echo = Echo {
        id,
        created_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        model: req.model,
        instructions: json!(req.instructions),
        max_output_tokens: json!(req.max_output_tokens),
        parallel_tool_calls: conversation.parallel_tool_calls,
        previous_response_id: json!(req.previous_response_id),
        reasoning: req.reasoning.unwrap_or_else(|| json!({"effort": null, "summary": null})),
        store: store && store_enabled,
        temperature: request.sampling.temperature,
        text: req.text.unwrap_or_else(|| json!({"format": {"type": "text"}})),
        tool_choice: req.tool_choice.unwrap_or_else(|| json!("auto")),
        tools: json!(req.tools.unwrap_or_default()),
        top_p: json!(request.sampling.top_p),
        truncation: req.truncation.unwrap_or_else(|| "disabled".into()),
        metadata: req.metadata.unwrap_or_else(|| json!({})),
        user: json!(req.user),
        encrypted: req.include.iter().flatten().any(|i| i == "reasoning.encrypted_content"),
    };
    Ok(Prepared { request, tail, conversation, echo, input_items: items, parent, inherited })
}

pub(crate) async fn create(State(state): State<FrontendState>, caller: Caller, body: Body) -> Response {
    let arrived = Instant::now();
    let response = match prepare_off_thread(&state, caller, body, prepare).await {
        Ok(prepared) => run(state, prepared, arrived).await,
        Err(e) => e.into_response(),
    };
    counted(crate::frontend::Route::Responses, response)
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        code: "response_not_found",
        message: format!("Response with id '{}' not found.", clip(id, 128)),
        param: Some("response_id".into()),
    }
}

pub(crate) async fn retrieve(State(state): State<FrontendState>, caller: Caller, Path(id): Path<String>) -> Response {
    let response = match state.inner.responses.get(&caller.tenant, &id) {
        Some(stored) => axum::Json(stored.response.clone()).into_response(),
        None => not_found(&id).into_response(),
    };
    counted(crate::frontend::Route::Responses, response)
}

pub(crate) async fn delete(State(state): State<FrontendState>, caller: Caller, Path(id): Path<String>) -> Response {
    let response = if state.inner.responses.remove(&caller.tenant, &id) {
        axum::Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
    } else {
        not_found(&id).into_response()
    };
    counted(crate::frontend::Route::Responses, response)
}

/// `?order=asc|desc` (default `desc`, as OpenAI's), `limit` (1..=100, default 20), `after`.
#[derive(Debug, Deserialize)]
pub(crate) struct ListQuery {
    #[serde(default)]
    order: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    after: Option<String>,
}

pub(crate) async fn input_items(
    State(state): State<FrontendState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<ListQuery>,
) -> Response {
    let response = match state.inner.responses.get(&caller.tenant, &id) {
        None => not_found(&id).into_response(),
        Some(stored) => {
            let mut items: Vec<&Value> = stored.input_items.iter().collect();
            if query.order.as_deref() != Some("asc") {
                items.reverse();
            }
            if let Some(after) = &query.after
                && let Some(at) = items.iter().position(|i| i["id"] == after.as_str())
            {
                items.drain(..=at);
            }
            let limit = query.limit.unwrap_or(20).clamp(1, 100);
            let has_more = items.len() > limit;
            items.truncate(limit);
            let first = items.first().map(|i| i["id"].clone()).unwrap_or(Value::Null);
            let last = items.last().map(|i| i["id"].clone()).unwrap_or(Value::Null);
            axum::Json(
                json!({"object": "list", "data": items, "first_id": first, "last_id": last, "has_more": has_more}),
            )
            .into_response()
        }
    };
    counted(crate::frontend::Route::Responses, response)
}

/// Item ids: `rs_…`, `msg_…`, `fc_…` with the response's unique part and the item's index.
fn item_id(echo: &Echo, kind: &BlockKind, index: usize) -> String {
    let prefix = match kind {
        BlockKind::Thinking => "rs",
        BlockKind::Text => "msg",
        BlockKind::ToolCall { .. } => "fc",
    };
    format!("{prefix}_{}_{index}", echo.id.trim_start_matches("resp_"))
}

/// A finished output item.
fn item(echo: &Echo, index: usize, block: &Done) -> Value {
    match block {
        Done::Thinking { text, handle } => json!({
            "type": "reasoning", "id": item_id(echo, &BlockKind::Thinking, index), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": if echo.encrypted { json!(handle) } else { Value::Null },
            "status": "completed",
        }),
        Done::Text(text) => json!({
            "type": "message", "id": item_id(echo, &BlockKind::Text, index), "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        }),
        Done::ToolCall { id, name, arguments } => json!({
            "type": "function_call", "id": item_id(echo, &BlockKind::ToolCall { id: id.clone(), name: name.clone() }, index),
            "call_id": id, "name": name, "arguments": arguments, "status": "completed",
        }),
    }
}

/// The response object.
fn response_object(
    echo: &Echo,
    status: &str,
    output: Vec<Value>,
    usage: Option<Usage>,
    finish: Option<&Finish>,
) -> Value {
    let incomplete = finish
        .filter(|f| f.reason == FinishReason::Length)
        .map(|_| json!({"reason": "max_output_tokens"}))
        .unwrap_or(Value::Null);
    let usage = usage.map(|u| {
        json!({
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        })
    });
    json!({
        "id": echo.id, "object": "response", "created_at": echo.created_at, "status": status,
        "error": null, "incomplete_details": incomplete, "instructions": echo.instructions,
        "max_output_tokens": echo.max_output_tokens, "model": echo.model, "output": output,
        "parallel_tool_calls": echo.parallel_tool_calls, "previous_response_id": echo.previous_response_id,
        "reasoning": echo.reasoning, "store": echo.store, "temperature": echo.temperature, "text": echo.text,
        "tool_choice": echo.tool_choice, "tools": echo.tools, "top_p": echo.top_p, "truncation": echo.truncation,
        "usage": usage, "user": echo.user, "metadata": echo.metadata,
    })
}

/// The answer as an assistant turn, for a later request that continues it.
fn output_turn(blocks: &[Done]) -> Turn {
    let blocks = blocks
        .iter()
        .map(|b| match b {
            Done::Thinking { text, handle } => Block::Thinking { text: text.clone(), handle: Some(handle.clone()) },
            Done::Text(text) => Block::text(text.clone()),
            Done::ToolCall { id, name, arguments } => {
                Block::ToolUse { id: id.clone(), name: name.clone(), arguments: Value::String(arguments.clone()) }
            }
        })
        .collect();
    Turn::new(Role::Assistant, blocks)
}

/// The finished response: its object, stored when `store` is on.
fn finish_response(state: &FrontendState, prepared: Finished, answer: &Answer, finish: &Finish) -> Value {
    let Finished { echo, conversation, input_items, parent, inherited } = prepared;
    let output: Vec<Value> = answer.blocks().iter().enumerate().map(|(i, b)| item(&echo, i, b)).collect();
    let status = if finish.reason == FinishReason::Length { "incomplete" } else { "completed" };
    let object = response_object(&echo, status, output, Some(answer.usage()), Some(finish));
    if echo.store {
        // Only the turns this request added: the history before them is shared, not copied.
        let mut turns = conversation.turns;
        let mut added = turns.split_off(inherited.min(turns.len()));
        added.push(output_turn(answer.blocks()));
        let store = &state.inner.responses;
        let history = store.history(&conversation.tenant, parent, added);
        store.insert(echo.id.clone(), object.clone(), input_items, history, conversation.session, conversation.tenant);
    }
    object
}

/// What is left of a [`Prepared`] once its generation started.
struct Finished {
    echo: Echo,
    conversation: Conversation,
    input_items: Vec<Value>,
    parent: Option<std::sync::Arc<History>>,
    inherited: usize,
}

async fn run(state: FrontendState, prepared: Prepared, arrived: Instant) -> Response {
    let Prepared { request, tail, conversation, echo, input_items, parent, inherited } = prepared;
    let mut answer = Answer::start(&state, request, tail, Vec::new(), "call", arrived);
    if let Err(e) = answer.admit().await {
        return e.into_response();
    }
    let stream = conversation.stream;
    let rest = Finished { echo, conversation, input_items, parent, inherited };
    if !stream {
        return match answer.complete().await {
            Ok(finish) => axum::Json(finish_response(&state, rest, &answer, &finish)).into_response(),
            Err(e) => e.into_response(),
        };
    }

    let (mut tx, rx) = futures::channel::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(16);
    tokio::spawn(
        async move {
            let mut events = Events { sequence: 0 };
            let created = response_object(&rest.echo, "in_progress", Vec::new(), None, None);
            let opening = [
                events.frame("response.created", json!({"response": created})),
                events.frame("response.in_progress", json!({"response": created})),
            ];
            for frame in opening {
                if tx.send(Ok(frame)).await.is_err() {
                    return;
                }
            }
            let mut kinds: Vec<BlockKind> = Vec::new();
            loop {
                let step = match answer.step().await {
                    Ok(step) => step,
                    Err(e) => {
                        let mut failed = response_object(&rest.echo, "failed", Vec::new(), Some(answer.usage()), None);
                        failed["error"] = json!({"code": e.code().unwrap_or("server_error"), "message": e.message()});
                        let _ = tx.send(Ok(events.frame("response.failed", json!({"response": failed})))).await;
                        return;
                    }
                };
                let mut frames = Vec::new();
                for output in step.outputs {
                    events.output(&rest.echo, output, &mut kinds, &mut frames);
                }
                if let Some(finish) = step.finish {
                    let incomplete = finish.reason == FinishReason::Length;
                    let object = finish_response(&state, rest, &answer, &finish);
                    let name = if incomplete { "response.incomplete" } else { "response.completed" };
                    frames.push(events.frame(name, json!({"response": object})));
                    send_all(&mut tx, frames).await;
                    return;
                }
                if !send_all(&mut tx, frames).await {
                    return;
                }
            }
        }
        .in_current_span(),
    );
    event_stream(rx)
}

/// The stream's events, numbered.
struct Events {
    sequence: u64,
}

impl Events {
    /// `event: NAME` with `data` (its `type` and `sequence_number` added).
    fn frame(&mut self, name: &str, mut data: Value) -> Bytes {
        data["type"] = json!(name);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        named_event(name, &data)
    }

    /// The events of one output event.
    fn output(&mut self, echo: &Echo, output: Output, kinds: &mut Vec<BlockKind>, frames: &mut Vec<Bytes>) {
        match output {
            Output::Start { index, kind } => {
                let item_id = item_id(echo, &kind, index);
                let (item, part) = match &kind {
                    BlockKind::Thinking => (
                        json!({"type": "reasoning", "id": item_id, "summary": [], "status": "in_progress"}),
                        Some(json!({"type": "reasoning_text", "text": ""})),
                    ),
                    BlockKind::Text => (
                        json!({"type": "message", "id": item_id, "role": "assistant", "status": "in_progress", "content": []}),
                        Some(json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []})),
                    ),
                    BlockKind::ToolCall { id, name } => (
                        json!({"type": "function_call", "id": item_id, "call_id": id, "name": name, "arguments": "",
                               "status": "in_progress"}),
                        None,
                    ),
                };
                frames.push(self.frame("response.output_item.added", json!({"output_index": index, "item": item})));
                if let Some(part) = part {
                    frames.push(self.frame(
                        "response.content_part.added",
                        json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": part}),
                    ));
                }
                kinds.push(kind);
            }
            Output::Delta { index, text } => {
                let kind = &kinds[index];
                let item_id = item_id(echo, kind, index);
                let (name, data) = match kind {
                    BlockKind::Thinking => (
                        "response.reasoning_text.delta",
                        json!({"item_id": item_id, "output_index": index, "content_index": 0, "delta": text}),
                    ),
                    BlockKind::Text => (
                        "response.output_text.delta",
                        json!({"item_id": item_id, "output_index": index, "content_index": 0, "delta": text,
                               "logprobs": []}),
                    ),
                    BlockKind::ToolCall { .. } => (
                        "response.function_call_arguments.delta",
                        json!({"item_id": item_id, "output_index": index, "delta": text}),
                    ),
                };
                frames.push(self.frame(name, data));
            }
            Output::Stop { index, text, handle } => {
                let kind = kinds[index].clone();
                let item_id = item_id(echo, &kind, index);
                let done = match &kind {
                    BlockKind::Thinking => {
                        Done::Thinking { text: text.clone(), handle: handle.unwrap_or_else(|| HANDLE_PREFIX.into()) }
                    }
                    BlockKind::Text => Done::Text(text.clone()),
                    BlockKind::ToolCall { id, name } => {
                        Done::ToolCall { id: id.clone(), name: name.clone(), arguments: text.clone() }
                    }
                };
                match &kind {
                    BlockKind::Thinking => {
                        let part = json!({"type": "reasoning_text", "text": text});
                        frames.push(self.frame(
                            "response.reasoning_text.done",
                            json!({"item_id": item_id, "output_index": index, "content_index": 0, "text": text}),
                        ));
                        frames.push(self.frame(
                            "response.content_part.done",
                            json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": part}),
                        ));
                    }
                    BlockKind::Text => {
                        let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []});
                        frames.push(self.frame(
                            "response.output_text.done",
                            json!({"item_id": item_id, "output_index": index, "content_index": 0, "text": text,
                                   "logprobs": []}),
                        ));
                        frames.push(self.frame(
                            "response.content_part.done",
                            json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": part}),
                        ));
                    }
                    BlockKind::ToolCall { name, .. } => frames.push(self.frame(
                        "response.function_call_arguments.done",
                        json!({"item_id": item_id, "output_index": index, "arguments": text, "name": name}),
                    )),
                }
                frames.push(self.frame(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item(echo, index, &done)}),
                ));
            }
        }
    }
}
