//! A generation's events → the answer's [`Output`] events, whichever API renders them.
//!
//! [`Answer`] detokenizes ([`detok`](super::detok)), applies stop strings, splits the text into
//! reasoning, text and tool calls ([`parsers`](super::parsers)), and numbers the blocks in the
//! order they open. It also counts usage and time-to-first-token, and, once the answer is over,
//! keeps the turn for replay ([`replay`](super::replay)).

use std::time::{SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use futures::stream::BoxStream;
use serde_json::Value;
use tokio::time::Instant;

use super::FrontendState;
use super::detok::{IncrementalDecoder, StopMatcher};
use super::error::ApiError;
use super::generate::{FinishReason, GenerateError, GenerateEvent, GenerateRequest};
use super::ir::{BlockKind, Finish, Output, Usage};
use super::lower::Tail;
use super::parsers::{AnswerParser, Segment, ToolCall};
use super::replay::{self, Kept};
use crate::metrics;
use crate::recording::Served;

/// A finished block of the answer.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Done {
    /// Reasoning, with its replay handle.
    Thinking {
        /// The text.
        text: String,
        /// The `signature` / `encrypted_content` to send.
        handle: String,
    },
    /// Text.
    Text(String),
    /// A tool call.
    ToolCall {
        /// Its id.
        id: String,
        /// The tool.
        name: String,
        /// The arguments, as JSON text.
        arguments: String,
    },
}

/// What one step of the answer produced.
#[derive(Debug, Default)]
pub(super) struct Step {
    /// Output events, in order.
    pub(super) outputs: Vec<Output>,
    /// Set once the answer is over.
    pub(super) finish: Option<Finish>,
}

/// One answer in progress.
pub(super) struct Answer {
    /// The request's id.
    pub(super) id: String,
    /// The model, as the client named it.
    pub(super) model: String,
    /// Unix seconds when it started.
    pub(super) created: u64,
    usage: Usage,
    decoder: IncrementalDecoder,
    stop: StopMatcher,
    deadline: Instant,
    /// When the request arrived: the time to first token counts from here.
    arrived: Instant,
    /// When the last token came, for the inter-token latency.
    last_token: Option<Instant>,
    events: BoxStream<'static, Result<GenerateEvent, GenerateError>>,
    /// An event that admission read and handed on.
    pending: Option<GenerateEvent>,
    parser: Option<AnswerParser>,
    blocks: Blocks,
    /// The generated ids, kept for replay (end-of-turn tokens left out: the template writes the
    /// end of a turn).
    generated: Vec<u32>,
    /// Every generated id, end-of-turn tokens included (vLLM's `token_ids`).
    token_ids: Vec<u32>,
    stop_token_ids: Vec<u32>,
    /// The session and generation prompt the turn is kept under; none when replay is off.
    replay: Option<(String, String)>,
    /// End the answer where a second tool call would begin.
    single_call: bool,
    state: FrontendState,
    /// The request's span (its id): the closing log line is written in it.
    span: tracing::Span,
    /// When the first token came.
    first_token: Option<Instant>,
    /// How the answer ended: a finish reason, or the error that ended it.
    outcome: Option<&'static str>,
    /// What the traffic recording needs of the request, when recording is on.
    recorded: Option<Recorded>,
    /// The prompt was admitted: the request is served (and recorded) from here.
    admitted: bool,
    /// Prompt tokens its leases newly cover, under an hour and of an hour or more.
    leased_tokens: (usize, usize),
}

/// A request as the traffic recording sees it.
struct Recorded {
    prompt: Vec<u32>,
    session: Option<String>,
    namespace: String,
}

impl Drop for Answer {
    /// One line per request, when its response is over (or the client went away).
    fn drop(&mut self) {
        let u = self.usage;
        let ms = |d: std::time::Duration| (d.as_secs_f64() * 1e6).round() / 1e3;
        self.span.in_scope(|| {
            tracing::info!(
                id = %self.id,
                model = %self.model,
                prompt_tokens = u.prompt_tokens,
                cached_tokens = u.cached_tokens,
                completion_tokens = u.completion_tokens,
                ttft_ms = self.first_token.map(|t| ms(t - self.arrived)),
                duration_ms = ms(self.arrived.elapsed()),
                outcome = self.outcome.unwrap_or("cancelled"),
                "request finished"
            );
        });
        if let (Some(recorder), Some(recorded), true) =
            (&self.state.inner.recorder, self.recorded.take(), self.admitted)
        {
            recorder.record(Served {
                arrived: self.arrived.into_std(),
                done: std::time::Instant::now(),
                session: recorded.session,
                namespace: recorded.namespace,
                prompt: recorded.prompt,
                output_tokens: u.completion_tokens,
            });
        }
    }
}

impl Answer {
    /// Starts `request`'s generation (`tail`: what its lowering left for the answer). Tool-call
    /// ids the model does not give are `{call_prefix}_{id}_{n}`.
    pub(super) fn start(
        state: &FrontendState,
        request: GenerateRequest,
        tail: Tail,
        stop: Vec<String>,
        call_prefix: &'static str,
        arrived: Instant,
    ) -> Answer {
        let inner = &state.inner;
        let created = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let replay = tail
            .generation_prompt
            .filter(|_| inner.replay.enabled())
            .map(|prompt| (request.session_id.clone().unwrap_or_else(|| request.tenant.unnamed_session()), prompt));
        let stop_token_ids = request.stop_token_ids.clone();
        let recorded = inner.recorder.as_ref().map(|_| Recorded {
            prompt: request.prompt.clone(),
            session: request.session_id.clone(),
            namespace: format!(
                "{}\0{}",
                request.tenant.name().unwrap_or_default(),
                request.cache_salt.as_deref().unwrap_or_default()
            ),
        });
        let suffix = request.response_id.split_once('-').map_or(request.response_id.as_str(), |(_, s)| s).to_owned();
        Answer {
            id: request.response_id.clone(),
            model: request.model.clone(),
            created,
            usage: Usage { prompt_tokens: request.prompt.len(), ..Usage::default() },
            decoder: IncrementalDecoder::new(
                inner.tokenizer.clone(),
                request.stop_token_ids.iter().chain(inner.hidden_ids.iter().filter(|_| !tail.keep_specials)).copied(),
            ),
            stop: StopMatcher::new(stop),
            deadline: arrived + inner.request_timeout,
            arrived,
            last_token: None,
            events: inner.generator.generate(request),
            pending: None,
            parser: tail.parser,
            blocks: Blocks { call_prefix, suffix, ..Blocks::default() },
            generated: Vec::new(),
            token_ids: Vec::new(),
            stop_token_ids,
            replay,
            single_call: tail.single_call,
            state: state.clone(),
            span: tracing::Span::current(),
            first_token: None,
            outcome: None,
            recorded,
            admitted: false,
            leased_tokens: (0, 0),
        }
    }

    /// Waits for admission (the prompt is in the cache or computed) and notes its cached tokens.
    pub(super) async fn admit(&mut self) -> Result<(), ApiError> {
        let event = self.next_event().await?;
        self.admitted = true;
        match event {
            GenerateEvent::Started { cached_tokens, leased_tokens } => {
                self.leased_tokens = leased_tokens;
                self.cached(cached_tokens);
            }
            other => self.pending = Some(other),
        }
        Ok(())
    }

    /// Takes `cached_tokens` as the prompt tokens the cache served.
    fn cached(&mut self, cached_tokens: usize) {
        let (short, long) = self.leased_tokens;
        let u = &mut self.usage;
        u.cached_tokens = cached_tokens.min(u.prompt_tokens);
        // What the cache wrote for this request: newly leased tokens it computed (a block it found
        // cached was read, not written), so the three parts add up to the prompt.
        let computed = u.prompt_tokens - u.cached_tokens;
        u.cache_creation_5m = short.min(computed);
        u.cache_creation_1h = long.min(computed - u.cache_creation_5m);
    }

    /// Usage so far.
    pub(super) fn usage(&self) -> Usage {
        self.usage
    }

    /// The blocks finished so far, in order.
    pub(super) fn blocks(&self) -> &[Done] {
        &self.blocks.done
    }

    /// Runs the answer to its end, for a non-streaming response.
    pub(super) async fn complete(&mut self) -> Result<Finish, ApiError> {
        loop {
            if let Some(finish) = self.step().await?.finish {
                return Ok(finish);
            }
        }
    }

    /// The next event applied: what it adds to the answer, and its finish once it is over (a
    /// stop that ends an answer with tool calls is `tool_calls`).
    pub(super) async fn step(&mut self) -> Result<Step, ApiError> {
        let event = match self.pending.take() {
            Some(event) => event,
            None => self.next_event().await?,
        };
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
        // With one call allowed, the answer ends where a second one begins (what came after
        // the first was generated but is not the answer: the turn is not kept for replay).
        let cut = if self.single_call { self.second_call(&segments) } else { None };
        let (done, keep) = match cut {
            Some(at) => {
                segments.truncate(at);
                (Some(FinishReason::Stop), false)
            }
            None => (done, self.stop.matched().is_none()),
        };
        let mut step = Step::default();
        for segment in segments {
            self.blocks.add(segment, &mut step.outputs);
        }
        if let Some(mut reason) = done {
            self.blocks.close(&mut step.outputs);
            if reason == FinishReason::Stop && self.blocks.calls > 0 {
                reason = FinishReason::ToolCalls;
            }
            let stop_sequence = self.stop.matched().map(str::to_owned);
            self.outcome = Some(match reason {
                FinishReason::Stop => "stop",
                FinishReason::Length => "length",
                FinishReason::ToolCalls => "tool_calls",
            });
            self.finished(keep);
            step.finish = Some(Finish { reason, stop_sequence });
        }
        Ok(step)
    }

    /// Where in `segments` a second tool call of the answer begins, if one does.
    fn second_call(&self, segments: &[Segment]) -> Option<usize> {
        let mut seen = self.blocks.calls > 0 || self.blocks.call.is_some();
        let mut open = self.blocks.call.is_some();
        for (i, segment) in segments.iter().enumerate() {
            let begins = match segment {
                Segment::ToolCallStart { .. } => {
                    open = true;
                    true
                }
                Segment::ToolCall(_) => !std::mem::replace(&mut open, false),
                _ => false,
            };
            if begins && std::mem::replace(&mut seen, true) {
                return Some(i);
            }
        }
        None
    }

    /// Counts the reasoning tokens and keeps the turn for replay (unless a stop string cut it:
    /// then the generated ids hold more than the answer).
    fn finished(&mut self, keep: bool) {
        let reasoning: String = self
            .blocks
            .done
            .iter()
            .filter_map(|b| match b {
                Done::Thinking { text, .. } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        if !reasoning.is_empty() {
            self.usage.reasoning_tokens = self
                .state
                .inner
                .tokenizer
                .encode(&reasoning)
                .map_or(0, |ids| ids.len())
                .min(self.usage.completion_tokens);
        }
        let Some((session, generation_prompt)) = self.replay.take().filter(|_| keep) else { return };
        let mut text = String::new();
        let mut thinking = Vec::new();
        let mut calls: Vec<(String, Value)> = Vec::new();
        for block in &self.blocks.done {
            match block {
                Done::Thinking { text: t, .. } => thinking.push(t.clone()),
                Done::Text(t) => text.push_str(t),
                Done::ToolCall { name, arguments, .. } => calls.push((name.clone(), Value::String(arguments.clone()))),
            }
        }
        let key = replay::turn_key(&text, calls.iter().map(|(n, a)| (n.as_str(), a)));
        let tokens = std::mem::take(&mut self.generated);
        self.state.inner.replay.keep(&session, key, Kept { generation_prompt, tokens, thinking });
    }

    /// Every id generated so far, end-of-turn tokens included.
    pub(super) fn token_ids(&self) -> &[u32] {
        &self.token_ids
    }

    /// The next event, or a timeout / internal error.
    async fn next_event(&mut self) -> Result<GenerateEvent, ApiError> {
        let next = match tokio::time::timeout_at(self.deadline, self.events.next()).await {
            Err(_) => Err(ApiError::Timeout),
            Ok(None) => Err(ApiError::internal("the generator ended the stream before the answer finished")),
            Ok(Some(event)) => event.map_err(ApiError::from),
        };
        if let Err(e) = &next {
            self.outcome = Some(e.code().unwrap_or("invalid_request"));
        }
        next
    }

    /// One event before the parser: detokenized text with stop strings applied.
    fn apply_text(&mut self, event: GenerateEvent) -> Result<(String, Option<FinishReason>), ApiError> {
        let internal = |e: crate::tokenizer::TokenizerError| ApiError::internal(e.to_string());
        match event {
            GenerateEvent::Started { .. } => Ok((String::new(), None)),
            GenerateEvent::Token { id } => {
                self.usage.completion_tokens += 1;
                self.token_ids.push(id);
                if !self.stop_token_ids.contains(&id) {
                    self.generated.push(id);
                }
                let now = Instant::now();
                match self.last_token.replace(now) {
                    None => {
                        self.first_token = Some(now);
                        metrics::record_ttft(now - self.arrived)
                    }
                    Some(previous) => metrics::record_inter_token(now - previous),
                }
                let piece = self.decoder.push(id).map_err(internal)?;
                let (text, stopped) = self.stop.push(&piece);
                Ok((text, stopped.then_some(FinishReason::Stop)))
            }
            GenerateEvent::Finished { reason, cached_tokens } => {
                if cached_tokens != self.usage.cached_tokens {
                    self.cached(cached_tokens);
                }
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
}

/// The answer's blocks: one open at a time, numbered in the order they open.
#[derive(Debug, Default)]
struct Blocks {
    /// The open text or thinking block: its kind, index and text so far.
    open: Option<(BlockKind, usize, String)>,
    next: usize,
    calls: usize,
    call_prefix: &'static str,
    /// The request id's unique part, which call ids are made from.
    suffix: String,
    /// The tool call whose arguments are streaming: its index, id, name and arguments so far.
    call: Option<(usize, String, String, String)>,
    done: Vec<Done>,
}

/// Whether a text block opening after `previous` starts at its first visible character: text
/// after reasoning or a tool call does (the `\n\n` after `</think>` is the template's layout,
/// not the answer; the APIs never send a text block of whitespace alone).
fn trims_leading_space(previous: Option<&Done>) -> bool {
    matches!(previous, Some(Done::Thinking { .. } | Done::ToolCall { .. }))
}

impl Blocks {
    fn add(&mut self, segment: Segment, out: &mut Vec<Output>) {
        let (kind, text) = match segment {
            Segment::Thinking(t) => (BlockKind::Thinking, t),
            Segment::Text(t) => (BlockKind::Text, t),
            Segment::ToolCallStart { id, name } => return self.start_call(id, name, out),
            Segment::ToolCallArgs(t) => {
                if let Some((index, _, _, sent)) = &mut self.call {
                    sent.push_str(&t);
                    out.push(Output::Delta { index: *index, text: t });
                }
                return;
            }
            Segment::ToolCall(call) => return self.call(call, out),
        };
        if self.open.as_ref().is_some_and(|(open, _, _)| *open != kind) {
            self.close(out);
        }
        let text = match kind {
            BlockKind::Text if self.open.is_none() && trims_leading_space(self.done.last()) => {
                text.trim_start().to_owned()
            }
            _ => text,
        };
        if text.is_empty() {
            return;
        }
        let (_, index, so_far) = self.open.get_or_insert_with(|| {
            let index = self.next;
            self.next += 1;
            out.push(Output::Start { index, kind: kind.clone() });
            (kind, index, String::new())
        });
        so_far.push_str(&text);
        out.push(Output::Delta { index: *index, text });
    }

    /// Opens a tool-call block whose arguments stream.
    fn start_call(&mut self, id: Option<String>, name: String, out: &mut Vec<Output>) {
        self.close(out);
        let id = id.unwrap_or_else(|| format!("{}_{}_{}", self.call_prefix, self.suffix, self.calls));
        let index = self.next;
        self.next += 1;
        out.push(Output::Start { index, kind: BlockKind::ToolCall { id: id.clone(), name: name.clone() } });
        self.call = Some((index, id, name, String::new()));
    }

    /// A complete call: it closes the call that streamed (its arguments continue what was
    /// said), or is a block of its own.
    fn call(&mut self, call: ToolCall, out: &mut Vec<Output>) {
        if let Some((index, id, name, sent)) = self.call.take() {
            let arguments = match call.arguments.strip_prefix(sent.as_str()) {
                Some(rest) => {
                    if !rest.is_empty() {
                        out.push(Output::Delta { index, text: rest.to_owned() });
                    }
                    call.arguments
                }
                None => sent,
            };
            self.calls += 1;
            out.push(Output::Stop { index, text: arguments.clone(), handle: None });
            self.done.push(Done::ToolCall { id, name, arguments });
            return;
        }
        self.close(out);
        let id = call.id.unwrap_or_else(|| format!("{}_{}_{}", self.call_prefix, self.suffix, self.calls));
        self.calls += 1;
        let index = self.next;
        self.next += 1;
        out.push(Output::Start { index, kind: BlockKind::ToolCall { id: id.clone(), name: call.name.clone() } });
        out.push(Output::Delta { index, text: call.arguments.clone() });
        out.push(Output::Stop { index, text: call.arguments.clone(), handle: None });
        self.done.push(Done::ToolCall { id, name: call.name, arguments: call.arguments });
    }

    /// Closes the open block (a thinking block gets its handle; a streaming call ends with what
    /// was said of it).
    fn close(&mut self, out: &mut Vec<Output>) {
        if let Some((_, _, name, sent)) = &self.call {
            let call = ToolCall { id: None, name: name.clone(), arguments: sent.clone() };
            self.call(call, out);
        }
        if let Some((kind, index, text)) = self.open.take() {
            let handle = (kind == BlockKind::Thinking).then(|| replay::handle(&text));
            out.push(Output::Stop { index, text: text.clone(), handle: handle.clone() });
            self.done.push(match handle {
                Some(handle) => Done::Thinking { text, handle },
                None => Done::Text(text),
            });
        }
    }
}
