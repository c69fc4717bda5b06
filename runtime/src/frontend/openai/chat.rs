//! `POST /v1/chat/completions` and `POST /v1/completions`.
//!
//! Chat request → [`Conversation`]: every message is a turn in place (`system` and `developer`
//! included); an assistant message's `reasoning_content` is its thinking and its `tool_calls`
//! its tool uses (arguments kept as the JSON text the client sent); a `tool` message is a tool
//! result. `tool_choice` (`none`, `auto`, `required`, or a named function) decides which tools the
//! template offers.
//!
//! Answer → Chat: `content`, `reasoning_content`, `tool_calls` (`finish_reason: "tool_calls"`);
//! streamed, one `delta` per piece of text or reasoning, and per tool call a delta with its
//! `index`, `id` and name, then deltas of its arguments as they stream; then the chunk with the
//! finish reason, a `usage` chunk when `stream_options.include_usage` is set, and `data: [DONE]`.

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use dynamo_config::RegionKind;
use futures::SinkExt;
use serde_json::{Value, json};
use tokio::time::Instant;
use tracing::Instrument;

use super::wire::{ChatCompletionRequest, CompletionRequest, MessageContent, Prompt, StopStrings, ToolChoiceWire};
use crate::frontend::FrontendState;
use crate::frontend::answer::{Answer, Done};
use crate::frontend::auth::Caller;
use crate::frontend::error::ApiError;
use crate::frontend::generate::{FinishReason, GenerateRequest};
use crate::frontend::http::{
    SessionFields, counted, event_stream, object_id, prepare_off_thread, send_all, session_id,
};
use crate::frontend::ir::{
    Block, BlockKind, Conversation, Output, Role, SamplingRequest, ToolChoice, ToolDef, Turn, Usage,
};
use crate::frontend::lower::{self, Tail};

/// Which of the two routes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Api {
    Chat,
    Completion,
}

/// A request ready to generate.
struct Prepared {
    api: Api,
    request: GenerateRequest,
    tail: Tail,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    /// vLLM's `return_token_ids`: the prompt's ids, to answer with.
    prompt_token_ids: Option<Vec<u32>>,
}

pub(crate) async fn chat_completions(State(state): State<FrontendState>, caller: Caller, body: Body) -> Response {
    let arrived = Instant::now();
    let response = match prepare_off_thread(&state, caller, body, prepare_chat).await {
        Ok(prepared) => run(state, prepared, arrived).await,
        Err(e) => e.into_response(),
    };
    counted(crate::frontend::Route::ChatCompletions, response)
}

pub(crate) async fn completions(State(state): State<FrontendState>, caller: Caller, body: Body) -> Response {
    let arrived = Instant::now();
    let response = match prepare_off_thread(&state, caller, body, prepare_completion).await {
        Ok(prepared) => run(state, prepared, arrived).await,
        Err(e) => e.into_response(),
    };
    counted(crate::frontend::Route::Completions, response)
}

/// Temperature 0..=2, top-p in (0, 1], a repetition penalty above 0 and `n` = 1; what the
/// request leaves unset is the model's default, else OpenAI's (temperature 1).
pub(super) fn check_sampling(
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    repetition_penalty: Option<f32>,
    n: Option<usize>,
) -> Result<SamplingRequest, ApiError> {
    if let Some(temperature) = temperature
        && !(0.0..=2.0).contains(&temperature)
    {
        return Err(ApiError::invalid(
            format!("Invalid 'temperature': {temperature} is not between 0 and 2."),
            Some("temperature"),
        ));
    }
    if n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("Only n = 1 is supported.", Some("n")));
    }
    SamplingRequest::check(temperature, top_p, top_k, repetition_penalty, 1.0)
        .map_err(|(message, param)| ApiError::invalid(message, Some(param)))
}

fn check_stop(stop: Option<StopStrings>) -> Result<Vec<String>, ApiError> {
    let stop = stop.map(StopStrings::into_vec).unwrap_or_default();
    if stop.len() > 4 {
        return Err(ApiError::invalid("At most 4 stop sequences are supported.", Some("stop")));
    }
    Ok(stop)
}

/// `tool_choice` against the tools offered: a named tool must be one of them.
pub(super) fn tool_choice(choice: Option<ToolChoiceWire>, tools: &[ToolDef]) -> Result<ToolChoice, ApiError> {
    let choice = match choice {
        None => return Ok(ToolChoice::Auto),
        Some(ToolChoiceWire::Mode(mode)) => match mode.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    format!(
                        "Invalid 'tool_choice': `{}` (expected none, auto, required or a function).",
                        crate::frontend::error::clip(other, 64)
                    ),
                    Some("tool_choice"),
                ));
            }
        },
        Some(ToolChoiceWire::Function(named)) => {
            let name = named.function.map(|f| f.name).or(named.name).unwrap_or_default();
            ToolChoice::Named(name)
        }
    };
    if let ToolChoice::Named(name) = &choice
        && !tools.iter().any(|t| &t.name == name)
    {
        return Err(ApiError::invalid(
            format!("Invalid 'tool_choice': no tool named `{}` in 'tools'.", crate::frontend::error::clip(name, 64)),
            Some("tool_choice"),
        ));
    }
    Ok(choice)
}

/// OpenAI `tools` (`{"type": "function", "function": {…}}`); other tool types are left out.
pub(super) fn function_tools(tools: Option<Vec<Value>>) -> Vec<ToolDef> {
    tools
        .into_iter()
        .flatten()
        .filter(|t| t["type"] == "function" || t.get("type").is_none())
        .filter_map(|t| {
            let f = t.get("function").unwrap_or(&t);
            Some(ToolDef {
                name: f["name"].as_str()?.to_owned(),
                description: f["description"].as_str().map(str::to_owned),
                parameters: f.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object"})),
            })
        })
        .collect()
}

/// The chat request as a [`Conversation`].
fn conversation(caller: &Caller, req: ChatCompletionRequest) -> Result<Conversation, ApiError> {
    let sampling = check_sampling(req.temperature, req.top_p, req.top_k, req.repetition_penalty, req.n)?;
    let stop = check_stop(req.stop)?;
    let tools = function_tools(req.tools);
    let tool_choice = tool_choice(req.tool_choice, &tools)?;
    let mut turns = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.into_iter().enumerate() {
        let at = |field: &str| format!("messages[{i}].{field}");
        let role = match m.role.as_str() {
            "system" => Role::System,
            "developer" => Role::Developer,
            "user" | "tool" => Role::User,
            "assistant" => Role::Assistant,
            other => {
                return Err(ApiError::invalid(
                    format!(
                        "Invalid 'messages[{i}].role': `{}` (expected system, developer, user, assistant or tool).",
                        crate::frontend::error::clip(other, 64)
                    ),
                    Some(&at("role")),
                ));
            }
        };
        let mut blocks = Vec::new();
        if let Some(reasoning) = m.reasoning_content.filter(|r| !r.is_empty()) {
            blocks.push(Block::Thinking { text: reasoning, handle: None });
        }
        let mut text = None;
        match m.content {
            None => {}
            Some(MessageContent::Text(t)) => text = Some(t),
            Some(MessageContent::Parts(parts)) => {
                let mut joined = String::new();
                for (j, part) in parts.into_iter().enumerate() {
                    match (part.kind.as_str(), part.text) {
                        ("text", Some(t)) => joined.push_str(&t),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                format!(
                                    "Unsupported content part `{}`: only `text` parts with a `text` field are supported.",
                                    crate::frontend::error::clip(kind, 64)
                                ),
                                Some(&format!("messages[{i}].content[{j}]")),
                            ));
                        }
                    }
                }
                text = Some(joined);
            }
        }
        let calls = match m.tool_calls {
            Some(Value::Array(calls)) if role == Role::Assistant => calls,
            _ => Vec::new(),
        };
        if text.is_none() && calls.is_empty() {
            return Err(ApiError::invalid(
                format!("'messages[{i}].content' is required for a `{}` message.", m.role),
                Some(&at("content")),
            ));
        }
        if m.role == "tool" {
            blocks.push(Block::ToolResult {
                call_id: m.tool_call_id.unwrap_or_default(),
                content: text.unwrap_or_default(),
                is_error: false,
                cache: None,
            });
        } else if let Some(text) = text {
            blocks.push(Block::text(text));
        }
        for call in calls {
            blocks.push(Block::ToolUse {
                id: call["id"].as_str().unwrap_or_default().to_owned(),
                name: call["function"]["name"].as_str().unwrap_or_default().to_owned(),
                arguments: call["function"].get("arguments").cloned().unwrap_or_else(|| json!("{}")),
            });
        }
        turns.push(Turn { role, blocks, name: m.name });
    }
    Ok(Conversation {
        model: req.model,
        system: Vec::new(),
        turns,
        tools,
        tool_choice,
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        thinking: Default::default(),
        template_kwargs: {
            let mut kwargs = req.chat_template_kwargs.unwrap_or_default();
            if let Some(effort) = req.reasoning_effort {
                kwargs.entry("reasoning_effort").or_insert(effort.into());
            }
            kwargs
        },
        sampling,
        seed: req.seed,
        stop,
        max_tokens: req.max_completion_tokens.or(req.max_tokens),
        hints: req.nvext.unwrap_or_default(),
        session: session_id(
            caller,
            SessionFields {
                prompt_cache_key: req.prompt_cache_key.as_deref(),
                user: req.user.as_deref(),
                ..Default::default()
            },
        ),
        tenant: caller.tenant.clone(),
        cache: super::wire::retention_mark(req.prompt_cache_retention.as_deref())?,
        cache_salt: req.cache_salt,
        stream: req.stream,
    })
}

fn prepare_chat(state: &FrontendState, caller: &Caller, req: ChatCompletionRequest) -> Result<Prepared, ApiError> {
    lower::check_model(state, &req.model)?;
    let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let return_token_ids = req.return_token_ids == Some(true);
    if return_token_ids && req.stream {
        return Err(ApiError::invalid("return_token_ids is served without streaming only.", Some("return_token_ids")));
    }
    let mut conversation = conversation(caller, req)?;
    lower::strip_preamble(state, &mut conversation);
    let lowered = lower::lower(state, &conversation)?;
    let (request, tail) =
        lower::generate_request(state, &conversation, lowered, object_id("chatcmpl"), caller.request_id.clone())?;
    Ok(Prepared {
        api: Api::Chat,
        prompt_token_ids: return_token_ids.then(|| request.prompt.clone()),
        request,
        tail,
        stop: conversation.stop,
        stream: conversation.stream,
        include_usage,
    })
}

fn prepare_completion(state: &FrontendState, caller: &Caller, req: CompletionRequest) -> Result<Prepared, ApiError> {
    lower::check_model(state, &req.model)?;
    let sampling = check_sampling(req.temperature, req.top_p, req.top_k, req.repetition_penalty, req.n)?;
    let stop = check_stop(req.stop)?;
    let retention = super::wire::retention_mark(req.prompt_cache_retention.as_deref())?;
    let inner = &state.inner;
    let internal = |e: crate::tokenizer::TokenizerError| ApiError::internal(e.to_string());
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
    lower::precheck(state, 1, text_bytes, "prompt")?;
    if let Prompt::Text(text) = &req.prompt
        && lower::suspect(state, 0, text.len())
    {
        lower::count_within(state, text, 0, lower::prompt_limit(state), "prompt")?;
    }
    let prompt = match req.prompt {
        Prompt::Text(text) => inner.tokenizer.encode(&text).map_err(internal)?,
        Prompt::Texts(mut texts) => {
            one(texts.len())?;
            inner.tokenizer.encode(&texts.remove(0)).map_err(internal)?
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
    let max_tokens = lower::fit(state, prompt.len(), req.max_tokens, "prompt")?;
    let regions = vec![(0..prompt.len(), RegionKind::Conversation)];
    // `prompt_cache_retention: "24h"` leases the whole prompt, as on the chat routes.
    let cache_leases = retention
        .filter(|_| prompt.len() >= inner.cache_min_tokens)
        .map(|mark| (prompt.len(), mark.ttl()))
        .into_iter()
        .collect();
    Ok(Prepared {
        api: Api::Completion,
        prompt_token_ids: None,
        request: GenerateRequest {
            response_id: object_id("cmpl"),
            request_id: caller.request_id.clone(),
            model: req.model,
            prompt,
            regions,
            max_tokens,
            sampling: sampling.resolve(&inner.sampling_defaults),
            seed: req.seed,
            stop_token_ids: inner.stop_token_ids.clone(),
            session_id: session_id(caller, SessionFields { user: req.user.as_deref(), ..Default::default() }),
            tenant: caller.tenant.clone(),
            cache_salt: req.cache_salt,
            cache_leases,
            hints: req.nvext.unwrap_or_default(),
            forced: lower::scripted(state, 0)?,
        },
        tail: Tail::default(),
        stop,
        stream: req.stream,
        include_usage: req.stream_options.is_some_and(|o| o.include_usage),
    })
}

/// OpenAI's `usage` object.
fn usage(usage: Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    })
}

/// Renders an answer in Chat Completions' or Completions' shape.
struct Render<'a> {
    api: Api,
    answer: &'a Answer,
}

impl Render<'_> {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.api, chunk) {
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Completion, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        let a = self.answer;
        json!({"id": a.id, "object": self.object(chunk), "created": a.created, "model": a.model, "choices": choices})
    }

    /// A tool call as the chat API writes it (`index` only in a stream's delta).
    fn tool_call(id: &str, name: &str, arguments: &str, index: Option<usize>) -> Value {
        let mut value = json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}});
        if let Some(index) = index {
            value["index"] = json!(index);
        }
        value
    }

    /// The whole answer of a non-streaming request.
    fn body(&self, reason: FinishReason) -> Value {
        let blocks = self.answer.blocks();
        let (mut reasoning, mut text, mut calls) = (String::new(), String::new(), Vec::new());
        for block in blocks {
            match block {
                Done::Thinking { text: t, .. } => reasoning.push_str(t),
                Done::Text(t) => text.push_str(t),
                Done::ToolCall { id, name, arguments } => calls.push(Self::tool_call(id, name, arguments, None)),
            }
        }
        let choice = match self.api {
            Api::Chat => {
                let mut message = json!({"role": "assistant", "content": text});
                if !reasoning.is_empty() {
                    message["reasoning_content"] = json!(reasoning);
                }
                if !calls.is_empty() {
                    if text.is_empty() {
                        message["content"] = Value::Null;
                    }
                    message["tool_calls"] = json!(calls);
                }
                json!({"index": 0, "message": message, "logprobs": null, "finish_reason": reason.as_str()})
            }
            Api::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": reason.as_str()})
            }
        };
        let mut body = self.envelope(false, json!([choice]));
        body["usage"] = usage(self.answer.usage());
        body
    }

    /// One streamed chunk: a delta (chat) or text (completions), with the finish reason at the end.
    fn chunk(&self, delta: Value, reason: Option<FinishReason>) -> Value {
        let reason = reason.map(FinishReason::as_str);
        let choice = match self.api {
            Api::Chat => json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": reason}),
            Api::Completion => {
                json!({"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")), "logprobs": null,
                       "finish_reason": reason})
            }
        };
        self.envelope(true, json!([choice]))
    }

    /// The last chunk of `stream_options.include_usage`: no choices, the usage.
    fn usage_chunk(&self) -> Value {
        let mut chunk = self.envelope(true, json!([]));
        chunk["usage"] = usage(self.answer.usage());
        chunk
    }
}

fn sse(data: &Value) -> Bytes {
    Bytes::from(format!("data: {data}\n\n"))
}

/// Starts the generation, waits for admission, then answers with JSON or SSE.
async fn run(state: FrontendState, prepared: Prepared, arrived: Instant) -> Response {
    let Prepared { api, request, tail, stop, stream, include_usage, prompt_token_ids } = prepared;
    let mut answer = Answer::start(&state, request, tail, stop, "call", arrived);
    // Admission: an error here is an HTTP status, even for a streaming request.
    if let Err(e) = answer.admit().await {
        return e.into_response();
    }
    if !stream {
        // Dropping `answer` after this cancels a generation that a stop string ended early.
        return match answer.complete().await {
            Ok(finish) => {
                let mut body = Render { api, answer: &answer }.body(finish.reason);
                if let Some(prompt) = prompt_token_ids {
                    body["prompt_token_ids"] = json!(prompt);
                    body["choices"][0]["token_ids"] = json!(answer.token_ids());
                }
                axum::Json(body).into_response()
            }
            Err(e) => e.into_response(),
        };
    }

    let (mut tx, rx) = futures::channel::mpsc::channel::<Result<Bytes, std::convert::Infallible>>(16);
    tokio::spawn(
        async move {
            if api == Api::Chat {
                let first = Render { api, answer: &answer }.chunk(json!({"role": "assistant", "content": ""}), None);
                if tx.send(Ok(sse(&first))).await.is_err() {
                    return;
                }
            }
            // The kind of every block, by index; tool calls are numbered among themselves.
            let mut kinds: Vec<BlockKind> = Vec::new();
            // The block index of each tool call: calls are numbered among themselves.
            let mut calls: Vec<usize> = Vec::new();
            loop {
                let step = match answer.step().await {
                    Ok(step) => step,
                    Err(e) => {
                        tracing::warn!(request = %answer.id, error = %e, "generation failed mid-stream");
                        let _ = tx.send(Ok(sse(&e.openai_body()))).await;
                        return;
                    }
                };
                let (frames, done) = {
                    let render = Render { api, answer: &answer };
                    let mut frames = Vec::new();
                    for output in step.outputs {
                        let delta = match output {
                            // A call: its id and name first, then its arguments as they stream.
                            Output::Start { kind, .. } => {
                                let delta = match &kind {
                                    BlockKind::ToolCall { id, name } => {
                                        calls.push(kinds.len());
                                        json!({"tool_calls": [Render::tool_call(id, name, "", Some(calls.len() - 1))]})
                                    }
                                    _ => Value::Null,
                                };
                                kinds.push(kind);
                                if delta.is_null() {
                                    continue;
                                }
                                delta
                            }
                            Output::Delta { index, text } => match &kinds[index] {
                                BlockKind::Thinking => json!({"reasoning_content": text}),
                                BlockKind::Text => json!({"content": text}),
                                BlockKind::ToolCall { .. } => {
                                    let call = calls.iter().position(|&i| i == index).expect("a started call");
                                    json!({"tool_calls": [{"index": call, "function": {"arguments": text}}]})
                                }
                            },
                            Output::Stop { .. } => continue,
                        };
                        frames.push(sse(&render.chunk(delta, None)));
                    }
                    let done = step.finish.is_some();
                    if let Some(finish) = step.finish {
                        frames.push(sse(&render.chunk(json!({}), Some(finish.reason))));
                        if include_usage {
                            frames.push(sse(&render.usage_chunk()));
                        }
                        frames.push(Bytes::from_static(b"data: [DONE]\n\n"));
                    }
                    (frames, done)
                };
                if !send_all(&mut tx, frames).await || done {
                    return;
                }
            }
        }
        .in_current_span(),
    );
    event_stream(rx)
}
