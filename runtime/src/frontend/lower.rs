//! [`Conversation`] → prompt tokens: the checks every API shares, the template messages, the
//! render, and the tokens with their regions, kept turns spliced in ([`replay`](super::replay)).
//!
//! Lowering to template messages:
//! - the leading system blocks are one `system` message; inline system and developer turns stay
//!   where they are (moving them would change every earlier byte of the prompt);
//! - a user turn's tool results are `tool` messages, and text beside them is folded into the last
//!   of them instead of opening a user turn (a new "user query" would make templates such as
//!   Qwen3's drop the reasoning of the whole tool loop);
//! - an assistant turn's reasoning is its `reasoning_content`, its calls its `tool_calls` (the
//!   arguments as an object, keys in the client's order, as `transformers` passes them; text
//!   that is not a JSON object verbatim);
//! - every client string is escaped ([`escape_special_tokens`]);
//! - `tool_choice: none` offers no tools; a named choice offers only that one.

use serde_json::{Value, json};

use super::FrontendState;
use super::error::ApiError;
use super::generate::{GenerateRequest, HintTtl, RegionRanges};
use super::ir::{Block, CacheMark, Conversation, Role, ToolChoice};
use super::parsers::AnswerParser;
use super::replay::{Kept, turn_key};
use super::template::{Owner, Piece, TemplateError, TemplateMessage, escape_special_tokens};

/// A conversation rendered and tokenized.
#[derive(Debug)]
pub(super) struct Lowered {
    /// The prompt.
    pub(super) prompt: Vec<u32>,
    /// The region of every token range.
    pub(super) regions: RegionRanges,
    /// The cache breakpoints: each the prompt's length up to it, and its mark.
    pub(super) breakpoints: Vec<(usize, CacheMark)>,
    /// What the answer needs of the lowering.
    pub(super) tail: Tail,
}

/// What an [`Answer`](super::answer::Answer) needs of its prompt's lowering.
#[derive(Debug, Default)]
pub(super) struct Tail {
    /// The parser of the answer; none for a plain answer.
    pub(super) parser: Option<AnswerParser>,
    /// The generation prompt's text, which the answer is kept for replay with; none for a
    /// prompt that is not a chat (a legacy completion).
    pub(super) generation_prompt: Option<String>,
    /// At most one tool call (`parallel_tool_calls: false`, Anthropic's
    /// `disable_parallel_tool_use`): the answer ends where a second one would begin.
    pub(super) single_call: bool,
    /// Keep special tokens in the answer's text: the tool-call parser reads the answer of a
    /// request that offers tools, and formats write their calls in special tokens beyond the
    /// markers it names (GLM's `<arg_key>`), as vLLM's tool parsers turn
    /// `skip_special_tokens` off.
    pub(super) keep_specials: bool,
}

/// Drops Claude Code's billing header from `conversation`'s system text, in every API, unless
/// `frontend.strip_anthropic_preamble` is off.
pub(super) fn strip_preamble(state: &FrontendState, conversation: &mut Conversation) {
    if state.inner.strip_anthropic_preamble {
        for _ in 0..conversation.strip_billing_header() {
            crate::metrics::record_preamble_stripped();
        }
    }
}

/// Refuses a model this node does not serve.
pub(super) fn check_model(state: &FrontendState, model: &str) -> Result<(), ApiError> {
    if state.inner.generator.models().iter().any(|m| m == model) {
        Ok(())
    } else {
        Err(ApiError::model_not_found(model))
    }
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
        return Err(ApiError::ContextLength { tokens, limit: max, param: param.to_owned(), server_limit: true });
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
/// more than `frontend.max_prompt_bytes`, or `bytes` of text that make at least
/// `bytes / max_token_bytes` tokens (and every message at least one) past the limit.
pub(super) fn precheck(state: &FrontendState, messages: usize, text_bytes: usize, param: &str) -> Result<(), ApiError> {
    let max = state.inner.max_prompt_bytes;
    if text_bytes > max {
        return Err(ApiError::invalid(
            format!(
                "The prompt's text is {text_bytes} bytes; this server takes at most {max} (frontend.max_prompt_bytes)."
            ),
            Some(param),
        ));
    }
    check_prompt(state, (text_bytes / state.inner.max_token_bytes).max(messages), param)
}

/// The most prompt tokens accepted: the context (less one generated token) or
/// `frontend.max_prompt_tokens`, whichever is lower.
pub(super) fn prompt_limit(state: &FrontendState) -> usize {
    let context = state.inner.generator.max_context().saturating_sub(1);
    match state.inner.max_prompt_tokens {
        0 => context,
        max => max.min(context),
    }
}

/// Bytes of text tokenized at a time while a prompt's length is still being found out.
const COUNT_CHUNK: usize = 64 << 10;

/// Bytes per token past which a text is counted in chunks before it is tokenized whole: text
/// runs 3 to 5 bytes a token, so a piece of more than 8 bytes for every token the prompt may
/// still take is almost surely too long, and one within it is tokenized once, not twice.
const SUSPECT_BYTES_PER_TOKEN: usize = 8;

/// Whether a text of `bytes` after `have` prompt tokens is counted in chunks first
/// ([`count_within`]).
pub(super) fn suspect(state: &FrontendState, have: usize, bytes: usize) -> bool {
    bytes > COUNT_CHUNK.max(prompt_limit(state).saturating_sub(have).saturating_mul(SUSPECT_BYTES_PER_TOKEN))
}

/// `text` as it is tokenized in [`COUNT_CHUNK`]s, refusing it as soon as it is sure to be longer
/// than `limit` tokens (or the client is gone): a 30 MiB message costs a chunk past the limit,
/// not its whole tokenization. Chunks end before whitespace, where the pre-tokenizer splits
/// anyway; a boundary may still move a token, so each chunk counts one token fewer.
pub(super) fn count_within(
    state: &FrontendState,
    text: &str,
    have: usize,
    limit: usize,
    param: &str,
) -> Result<(), ApiError> {
    let tokenizer = &state.inner.tokenizer;
    let mut counted = have;
    let mut rest = text;
    while !rest.is_empty() {
        if super::http::client_gone() {
            return Err(ApiError::internal("the client went away while its prompt was tokenized"));
        }
        let mut end = rest.len().min(COUNT_CHUNK);
        while !rest.is_char_boundary(end) {
            end += 1;
        }
        if end < rest.len()
            && let Some(space) = rest[..end].rfind(char::is_whitespace).filter(|&at| at > 0)
        {
            end = space;
        }
        let n = tokenizer.encode(&rest[..end]).map_err(|e| ApiError::internal(e.to_string()))?.len();
        counted += n.saturating_sub(1);
        if counted > limit {
            return Err(ApiError::ContextLength {
                tokens: counted,
                limit,
                param: param.to_owned(),
                server_limit: state.inner.max_prompt_tokens > 0,
            });
        }
        rest = &rest[end..];
    }
    Ok(())
}

/// The scripted answer of a request at `turn`, tokenized; `None` when the engine is not scripted.
pub(super) fn scripted(state: &FrontendState, turn: usize) -> Result<Option<Vec<u32>>, ApiError> {
    let Some(script) = &state.inner.script else { return Ok(None) };
    let text = &script[turn % script.len()];
    state.inner.tokenizer.encode(text).map(Some).map_err(|e| ApiError::internal(e.to_string()))
}

/// The generation of `conversation` lowered to `lowered`, with `max_tokens` settled.
pub(super) fn generate_request(
    state: &FrontendState,
    conversation: &Conversation,
    lowered: Lowered,
    response_id: String,
    request_id: std::sync::Arc<str>,
) -> Result<(GenerateRequest, Tail), ApiError> {
    let max_tokens = fit(state, lowered.prompt.len(), conversation.max_tokens, "messages")?;
    let request = GenerateRequest {
        response_id,
        request_id,
        model: conversation.model.clone(),
        prompt: lowered.prompt,
        regions: lowered.regions,
        max_tokens,
        sampling: conversation.sampling.resolve(&state.inner.sampling_defaults),
        seed: conversation.seed,
        stop_token_ids: state.inner.stop_token_ids.clone(),
        session_id: conversation.session.clone(),
        tenant: conversation.tenant.clone(),
        cache_salt: conversation.cache_salt.clone(),
        cache_leases: lowered
            .breakpoints
            .iter()
            .filter(|(tokens, _)| *tokens >= state.inner.cache_min_tokens)
            .map(|&(tokens, mark)| (tokens, mark.ttl()))
            .collect(),
        hints: conversation.hints.clone(),
        forced: scripted(state, conversation.assistant_turns())?,
    };
    Ok((request, lowered.tail))
}

/// Renders and tokenizes `conversation`; kept turns are restored and spliced in.
pub(super) fn lower(state: &FrontendState, conversation: &Conversation) -> Result<Lowered, ApiError> {
    let inner = &state.inner;
    if conversation.turns.is_empty() {
        return Err(ApiError::invalid("'messages' must contain at least one message.", Some("messages")));
    }
    precheck(state, conversation.turns.len(), conversation.text_bytes(), "messages")?;
    let TemplateMessages { messages, kept, marks } = template_messages(state, conversation)?;
    let tools = template_tools(conversation);
    let mut kwargs = conversation.template_kwargs.clone();
    if let Some(enabled) = conversation.thinking.enabled {
        kwargs.entry("enable_thinking").or_insert(enabled.into());
    }
    let pieces = inner.template.render_pieces(&messages, tools.as_deref(), &kwargs).map_err(|e| match e {
        TemplateError::Render(message) => ApiError::invalid(message, Some("messages")),
        other => ApiError::internal(other.to_string()),
    })?;
    let Tokenized { ids: prompt, regions, spliced, ends } = tokenize(state, &pieces, &kept)?;
    // An agent's `nvext.cache_control` marks the whole prompt, as a top-level breakpoint does;
    // with both, the longer TTL wins.
    let hinted = conversation.hints.cache_control.map(|c| match c.ttl {
        HintTtl::FiveMinutes => CacheMark::FiveMinutes,
        HintTtl::OneHour => CacheMark::OneHour,
    });
    let breakpoints = breakpoints(&marks, &ends, conversation.cache.max(hinted));
    if spliced > 0 {
        crate::metrics::record_replayed_turns(spliced);
    }
    let generation_prompt = match pieces.last() {
        Some(piece) if piece.owner == Owner::Generation => piece.text.clone(),
        _ => String::new(),
    };
    let parser = (inner.reasoning.is_some() || inner.tools.is_some()).then(|| {
        let in_reasoning = inner.reasoning.is_some_and(|kind| kind.starts_in_reasoning(&generation_prompt));
        // Calls only to the tools the request offers (and the choice allows).
        let offered = match &conversation.tool_choice {
            ToolChoice::None => Default::default(),
            ToolChoice::Named(name) => std::iter::once(name.clone()).collect(),
            ToolChoice::Auto | ToolChoice::Required => conversation.tools.iter().map(|t| t.name.clone()).collect(),
        };
        AnswerParser::new(inner.reasoning, inner.tools, in_reasoning).offering(std::sync::Arc::new(offered))
    });
    Ok(Lowered {
        prompt,
        regions,
        breakpoints,
        tail: Tail {
            parser,
            generation_prompt: Some(generation_prompt),
            single_call: !conversation.parallel_tool_calls,
            keep_specials: inner.tools.is_some()
                && !conversation.tools.is_empty()
                && conversation.tool_choice != ToolChoice::None,
        },
    })
}

/// Tools in the shape chat templates read (`{"type": "function", "function": {…}}`), as the
/// tool choice allows them.
fn template_tools(conversation: &Conversation) -> Option<Vec<Value>> {
    let offered = conversation.tools.iter().filter(|t| match &conversation.tool_choice {
        ToolChoice::None => false,
        ToolChoice::Named(name) => &t.name == name,
        ToolChoice::Auto | ToolChoice::Required => true,
    });
    let tools: Vec<Value> = offered
        .map(|t| {
            // vLLM's order (its `FunctionDefinition`): name, description, parameters.
            let mut function = json!({"name": t.name});
            if let Some(description) = &t.description {
                function["description"] = json!(description);
            }
            function["parameters"] = t.parameters.clone();
            json!({"type": "function", "function": function})
        })
        .collect();
    (!tools.is_empty()).then_some(tools)
}

/// Where the prompt's cache breakpoints end: each marked message's end (a message past the
/// template's exact cuts ends its lease at the last earlier message that has an end of its own),
/// and the whole conversation's end for a mark on the request; the strongest mark per position.
fn breakpoints(
    marks: &[Option<CacheMark>],
    ends: &[Option<usize>],
    whole: Option<CacheMark>,
) -> Vec<(usize, CacheMark)> {
    let end_of = |m: usize| ends.iter().take(m + 1).rev().find_map(|e| *e);
    let mut out: Vec<(usize, CacheMark)> = Vec::new();
    let marked = marks.iter().enumerate().filter_map(|(m, mark)| Some((end_of(m)?, (*mark)?)));
    let last = marks.len().checked_sub(1).and_then(end_of);
    for (end, mark) in marked.chain(whole.and_then(|mark| Some((last?, mark)))) {
        match out.iter_mut().find(|(e, _)| *e == end) {
            Some((_, strongest)) => *strongest = (*strongest).max(mark),
            None => out.push((end, mark)),
        }
    }
    out.sort_unstable();
    out
}

/// The conversation as template messages, with the kept turn of each assistant message that
/// has one (its reasoning restored when the client sent none back), and the cache mark of each:
/// a turn's strongest block mark goes on the last message it rendered into.
fn template_messages(state: &FrontendState, conversation: &Conversation) -> Result<TemplateMessages, ApiError> {
    let inner = &state.inner;
    let escape = |text: &str| escape_special_tokens(text, &inner.specials).into_owned();
    let unnamed = conversation.tenant.unnamed_session();
    let session = conversation.session.as_deref().unwrap_or(&unnamed);
    let mut out = Vec::with_capacity(conversation.turns.len() + 1);
    let mut kept = Vec::with_capacity(conversation.turns.len() + 1);
    let mut marks: Vec<Option<CacheMark>> = Vec::with_capacity(conversation.turns.len() + 1);
    let system = texts(&conversation.system);
    if !system.is_empty() {
        out.push(TemplateMessage {
            role: "system".into(),
            content: Some(escape(&system.join("\n"))),
            ..Default::default()
        });
        kept.push(None);
        marks.push(strongest_mark(&conversation.system));
    }
    for (i, turn) in conversation.turns.iter().enumerate() {
        let rendered = out.len();
        let mark = strongest_mark(&turn.blocks);
        let name = turn.name.as_deref().map(escape);
        match turn.role {
            Role::System | Role::Developer => {
                let text = texts(&turn.blocks).join("\n");
                out.push(TemplateMessage {
                    role: turn.role.as_str().into(),
                    content: Some(escape(&text)),
                    name,
                    ..Default::default()
                });
                kept.push(None);
            }
            Role::User => {
                let mut text = String::new();
                let mut results = false;
                for (j, block) in turn.blocks.iter().enumerate() {
                    match block {
                        Block::Text { text: t, .. } => text.push_str(t),
                        Block::ToolResult { call_id, content, .. } => {
                            results = true;
                            out.push(TemplateMessage {
                                role: "tool".into(),
                                content: Some(escape(content)),
                                tool_call_id: Some(call_id.clone()),
                                ..Default::default()
                            });
                            kept.push(None);
                        }
                        Block::Image => {
                            return Err(ApiError::invalid(
                                format!(
                                    "messages[{i}].content[{j}]: this model reads text only; images are not supported"
                                ),
                                Some("messages"),
                            ));
                        }
                        Block::Thinking { .. } | Block::ToolUse { .. } => {}
                    }
                }
                match out.last_mut() {
                    // Only tool results: they are the turn's messages.
                    _ if results && text.is_empty() => {}
                    // Text beside tool results (Claude Code's reminders) belongs to the last of them.
                    Some(last) if results && last.role == "tool" => {
                        let content = last.content.get_or_insert_with(String::new);
                        content.push('\n');
                        content.push_str(&escape(&text));
                    }
                    _ => {
                        out.push(TemplateMessage {
                            role: "user".into(),
                            content: Some(escape(&text)),
                            name,
                            ..Default::default()
                        });
                        kept.push(None);
                    }
                }
            }
            Role::Assistant => {
                let text = texts(&turn.blocks).concat();
                let mut echoed = Vec::new();
                let mut calls = Vec::new();
                let mut call_args = Vec::new();
                for block in &turn.blocks {
                    match block {
                        Block::Thinking { text, handle } => echoed.push((text.clone(), handle.clone())),
                        Block::ToolUse { id, name, arguments } => {
                            call_args.push((name.as_str(), arguments));
                            // Templates read arguments as an object (`transformers` passes
                            // dicts); JSON text that is not an object stays text.
                            let arguments = match arguments {
                                Value::String(raw) => match serde_json::from_str::<Value>(&escape(raw)) {
                                    Ok(object @ Value::Object(_)) => object,
                                    _ => Value::String(escape(raw)),
                                },
                                other => other.clone(),
                            };
                            calls.push(json!({"id": id, "type": "function",
                                              "function": {"name": escape(name), "arguments": arguments}}));
                        }
                        _ => {}
                    }
                }
                let found = inner
                    .replay
                    .enabled()
                    .then(|| inner.replay.find(session, turn_key(&text, call_args.iter().copied())))
                    .flatten()
                    .filter(|k| k.accepts(&echoed))
                    // Without a session, turns are shared by content alone: a turn's reasoning is
                    // restored only for a client that shows it had it (its text or its handle).
                    .filter(|k| {
                        conversation.session.is_some()
                            || k.thinking.is_empty()
                            || echoed.iter().any(|(text, handle)| !text.is_empty() || handle.is_some())
                    });
                let reasoning: String = match &found {
                    Some(k) => k.thinking.concat(),
                    None => echoed.iter().map(|(t, _)| t.as_str()).collect(),
                };
                out.push(TemplateMessage {
                    role: "assistant".into(),
                    // A turn of tool calls alone has empty content, not none, as vLLM renders
                    // it: real templates test `'</think>' in message.content` (Qwen3).
                    content: Some(escape(&text)),
                    reasoning_content: (!reasoning.is_empty()).then(|| escape(&reasoning)),
                    name,
                    tool_calls: (!calls.is_empty()).then_some(Value::Array(calls)),
                    tool_call_id: None,
                });
                kept.push(found);
            }
        }
        marks.resize(out.len(), None);
        if let Some(mark) = mark
            && out.len() > rendered
        {
            marks[out.len() - 1] = Some(marks[out.len() - 1].map_or(mark, |m| m.max(mark)));
        }
    }
    marks.resize(out.len(), None);
    Ok(TemplateMessages { messages: out, kept, marks })
}

/// A conversation as the template's messages.
struct TemplateMessages {
    messages: Vec<TemplateMessage>,
    /// Each message's kept turn (assistant messages the node generated).
    kept: Vec<Option<Kept>>,
    /// Each message's cache mark.
    marks: Vec<Option<CacheMark>>,
}

/// A rendered prompt as tokens.
struct Tokenized {
    ids: Vec<u32>,
    /// The token range of every region, adjacent ranges of one region merged.
    regions: RegionRanges,
    /// Kept turns spliced in.
    spliced: usize,
    /// Where each message rendered on its own ends in `ids`.
    ends: Vec<Option<usize>>,
}

/// The strongest cache mark among `blocks`.
fn strongest_mark(blocks: &[Block]) -> Option<CacheMark> {
    blocks.iter().filter_map(Block::cache_mark).max()
}

fn texts(blocks: &[Block]) -> Vec<&str> {
    blocks
        .iter()
        .filter_map(|b| match b {
            Block::Text { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

/// Tokenizes the rendered prompt. A message is tokenized on its own where the next one starts
/// with a special token of the tokenizer (as real templates' turns do), so that a turn's tokens
/// never depend on what follows it and the next request of a conversation re-renders a
/// token-identical prefix; anywhere else, pieces are tokenized together, as `transformers`
/// tokenizes the whole text (the edge of the tool definitions inside a message, a turn that
/// starts with text, where a SentencePiece tokenizer would add a leading space). The built-in
/// o200k tokenizer has no special tokens for the built-in template's markup: its messages are
/// always tokenized on their own. The pieces of an assistant message with a kept turn become
/// that turn's ids ([`splice`]). Each token belongs to the piece its text starts in. Returns the ids, the
/// token range of every region (adjacent ranges of one region merged), how many turns were
/// spliced, and where each message rendered on its own ends in the ids.
fn tokenize(state: &FrontendState, pieces: &[Piece], kept: &[Option<Kept>]) -> Result<Tokenized, ApiError> {
    // The ids of each piece; `None` for pieces of text still to tokenize.
    let mut spans: Vec<Option<Vec<u32>>> = vec![None; pieces.len()];
    let mut spliced = 0;
    let mut i = 0;
    while i < pieces.len() {
        let piece = &pieces[i];
        // The pieces of one message: more than one where the tool definitions split it.
        let mut end = i + 1;
        while end < pieces.len() && pieces[end].owner == piece.owner {
            end += 1;
        }
        let group = &pieces[i..end];
        let turn = match piece.owner {
            Owner::Message(m) => kept.get(m).and_then(Option::as_ref),
            _ => None,
        };
        if let Some(turn) = turn.filter(|_| group.iter().all(|p| p.region == piece.region)) {
            let text: String = group.iter().map(|p| p.text.as_str()).collect();
            if let Some(tokens) = splice(state, &text, turn)? {
                // The whole message's ids go to its first piece.
                spans[i] = Some(tokens);
                for span in &mut spans[i + 1..end] {
                    *span = Some(Vec::new());
                }
                spliced += 1;
            }
        }
        i = end;
    }
    let mut ids = Vec::new();
    let mut regions: RegionRanges = Vec::new();
    let mut ends: Vec<Option<usize>> = Vec::new();
    let mut i = 0;
    while i < pieces.len() {
        // A run of pieces to tokenize together, or one spliced piece.
        let counts: Vec<usize> = match spans[i].take() {
            Some(tokens) => {
                let n = tokens.len();
                ids.extend(tokens);
                vec![n]
            }
            None => {
                let mut run = 1;
                while i + run < pieces.len() && spans[i + run].is_none() && joins(state, &pieces[i + run - 1..=i + run])
                {
                    run += 1;
                }
                tokenize_run(state, &pieces[i..i + run], &mut ids)?
            }
        };
        let mut at = ids.len() - counts.iter().sum::<usize>();
        for (piece, n) in pieces[i..i + counts.len()].iter().zip(counts.iter().copied()) {
            let (start, end) = (at, at + n);
            at = end;
            if let Owner::Message(m) = piece.owner {
                if ends.len() <= m {
                    ends.resize(m + 1, None);
                }
                ends[m] = Some(end);
            }
            if end == start {
                continue;
            }
            match regions.last_mut() {
                Some((range, last)) if *last == piece.region && range.end == start => range.end = end,
                _ => regions.push((start..end, piece.region)),
            }
        }
        i += counts.len();
    }
    Ok(Tokenized { ids, regions, spliced, ends })
}

/// Whether the two pieces of `pair` are tokenized together ([`tokenize`]).
fn joins(state: &FrontendState, pair: &[Piece]) -> bool {
    let [left, right] = pair else { return false };
    left.owner == right.owner
        || !state.inner.tokenizer.is_builtin()
            && !state.inner.specials.iter().any(|s| right.text.starts_with(s.as_str()))
}

/// Tokenizes `run`'s texts as one text onto `ids` (a long text counted in chunks first, so that
/// past the prompt limit it stops there); answers how many tokens each piece starts.
fn tokenize_run(state: &FrontendState, run: &[Piece], ids: &mut Vec<u32>) -> Result<Vec<usize>, ApiError> {
    let internal = |e: crate::tokenizer::TokenizerError| ApiError::internal(e.to_string());
    let text: String = run.iter().map(|p| p.text.as_str()).collect();
    if suspect(state, ids.len(), text.len()) {
        count_within(state, &text, ids.len(), prompt_limit(state), "messages")?;
    }
    let (tokens, starts) = state.inner.tokenizer.encode_with_starts(&text).map_err(internal)?;
    let mut counts = vec![0usize; run.len()];
    let mut piece = 0;
    let mut piece_end = run.first().map_or(0, |p| p.text.len());
    for &start in &starts {
        while start >= piece_end && piece + 1 < run.len() {
            piece += 1;
            piece_end += run[piece].text.len();
        }
        counts[piece] += 1;
    }
    ids.extend(tokens);
    if ids.len() > prompt_limit(state) {
        check_prompt(state, ids.len(), "messages")?;
    }
    Ok(counts)
}

/// The ids of an assistant message rendered as `rendered`, from its kept turn: the generation
/// prompt's ids, the generated ids, then the ids of what the template writes from the
/// end-of-turn token on. `None` (render it instead) unless `rendered` starts with the generation
/// prompt, holds an end-of-turn token, and keeps the turn's reasoning: a template that drops
/// history reasoning (Qwen3 after a new user query, DeepSeek-R1 always) is obeyed, and the
/// prompt leaves the cache there, as that template has it.
fn splice(state: &FrontendState, rendered: &str, turn: &Kept) -> Result<Option<Vec<u32>>, ApiError> {
    let inner = &state.inner;
    let internal = |e: crate::tokenizer::TokenizerError| ApiError::internal(e.to_string());
    let Some(body) = rendered.strip_prefix(turn.generation_prompt.as_str()) else { return Ok(None) };
    // Where the generated part ends: the end-of-turn token the template writes, or, for
    // templates whose turns end where the next message begins (GLM's `<|observation|>`), the
    // end of the message.
    let end = inner.end_markers.iter().filter_map(|marker| body.rfind(marker.as_str())).max().unwrap_or(body.len());
    if !turn.thinking.iter().all(|t| body[..end].contains(t.trim())) {
        return Ok(None);
    }
    let mut ids = inner.tokenizer.encode(&turn.generation_prompt).map_err(internal)?;
    ids.extend_from_slice(&turn.tokens);
    ids.extend(inner.tokenizer.encode(&body[end..]).map_err(internal)?);
    Ok(Some(ids))
}
