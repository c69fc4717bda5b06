//! Reasoning and tool-call parsers: a model's generated text → thinking, text and tool calls, in
//! generation order, streamed.
//!
//! An [`AnswerParser`] is fed the answer's text as the detokenizer completes it
//! ([`push`](AnswerParser::push)) and says what each piece is ([`Segment`]); at the end of the
//! stream [`finish`](AnswerParser::finish) flushes what it held back. The reasoning parser runs
//! first and the tool parser reads what it leaves as text, except for formats where the two are
//! one grammar (gpt-oss's harmony channels), which have one parser for both.
//!
//! The rules every parser keeps, whatever the chunking of its input:
//! - **The same segments for every chunking.** A suffix that may begin a marker is held back, even
//!   a single byte (`"…think<"` + `"/think>"` must end the reasoning), and flushed at the end if it
//!   turned out not to be one. The tests feed every vector whole, split at every character, and in
//!   random chunks, and require the same segments each time.
//! - **Nothing is lost.** Marker text never leaks into text or thinking, and text that looked like
//!   the start of a tool call but does not parse as one comes out as text, byte for byte.
//! - **Raw bytes.** Thinking and text keep their whitespace (a replay must reproduce them); the
//!   arguments of a tool call are the JSON the model wrote (or, for formats that write arguments as
//!   tagged values, a JSON object built from them in their order).
//! - **The start state is the prompt's.** A prompt whose generation header ends inside an open
//!   reasoning marker (a template that appends `<think>`) starts the answer in reasoning
//!   ([`ReasoningKind::starts_in_reasoning`]); the parser's name does not decide it.
//!
//! Names follow NVIDIA Dynamo's (`frontend.reasoning_parser`, `frontend.tool_call_parser`):
//! [`ReasoningKind::NAMES`] and [`ToolFormat::NAMES`].

mod harmony;
mod json;
mod reasoning;
mod scan;
mod tools;

#[cfg(test)]
mod tests;

pub(crate) use json::python_json;
pub use reasoning::{ReasoningKind, ReasoningParser};
pub use tools::{ToolFormat, ToolParser};

/// One piece of an answer, in generation order. Consecutive pieces of one kind continue each
/// other (an API opens a new block only when the kind changes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Segment {
    /// Reasoning text.
    Thinking(String),
    /// Answer text.
    Text(String),
    /// A tool call begins whose arguments will stream ([`Segment::ToolCallArgs`]) before the
    /// call completes ([`Segment::ToolCall`], with the whole arguments): formats whose arguments
    /// are a JSON object after the name (Hermes, Kimi-K2, DeepSeek-V3.1, harmony) say the name
    /// as soon as it is read.
    ToolCallStart {
        /// The model's own id for the call, where its format has one.
        id: Option<String>,
        /// The tool.
        name: String,
    },
    /// More of the arguments of the call that started.
    ToolCallArgs(String),
    /// A complete tool call (after a [`Segment::ToolCallStart`], its arguments continue what
    /// was streamed).
    ToolCall(ToolCall),
}

/// A tool call the model made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// The model's own id for it, where its format has one (Kimi's `functions.f:0`).
    pub id: Option<String>,
    /// The tool.
    pub name: String,
    /// Its arguments: a JSON object, as text.
    pub arguments: String,
}

/// The reasoning parser, the tool parser, or both, over one answer.
#[derive(Debug)]
pub struct AnswerParser {
    inner: Inner,
    /// What the reasoning parser emitted this push, before the tool parser reads its text.
    scratch: Vec<Segment>,
    /// The tools the request offered ([`AnswerParser::offering`]); `None` takes every name.
    offered: Option<std::sync::Arc<std::collections::HashSet<String>>>,
    /// A call to a tool not offered, held to be said as text: its name and arguments so far.
    refused: Option<(String, String)>,
}

#[derive(Debug)]
enum Inner {
    /// Reasoning (optional) then tools (optional) on its text.
    Chain { reasoning: Option<ReasoningParser>, tools: Option<ToolParser> },
    /// gpt-oss harmony: channels carry reasoning, text and tool calls.
    Harmony(harmony::HarmonyParser),
}

impl AnswerParser {
    /// Parses with `reasoning` and `tools` (either may be absent); `in_reasoning` says whether the
    /// answer starts inside a reasoning block (see [`ReasoningKind::starts_in_reasoning`]).
    pub fn new(reasoning: Option<ReasoningKind>, tools: Option<ToolFormat>, in_reasoning: bool) -> AnswerParser {
        let inner = if reasoning == Some(ReasoningKind::GptOss) || tools == Some(ToolFormat::Harmony) {
            Inner::Harmony(harmony::HarmonyParser::new(reasoning == Some(ReasoningKind::GptOss)))
        } else {
            Inner::Chain {
                reasoning: reasoning.map(|kind| ReasoningParser::new(kind, in_reasoning)),
                tools: tools.map(ToolParser::new),
            }
        };
        AnswerParser { inner, scratch: Vec::new(), offered: None, refused: None }
    }

    /// Takes as tool calls only calls to `tools` (the request's offer; empty when it offered
    /// none): a call to any other tool, or whose name holds a control or bidirectional-override
    /// character, stays in the answer as the text of a JSON object of its name and arguments.
    pub fn offering(mut self, tools: std::sync::Arc<std::collections::HashSet<String>>) -> AnswerParser {
        self.offered = Some(tools);
        self
    }

    /// Whether a call to `name` is a call.
    fn takes(&self, name: &str) -> bool {
        let hostile =
            name.chars().any(|c| c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'));
        !hostile && self.offered.as_ref().is_none_or(|offered| offered.contains(name))
    }

    /// Turns the calls the request did not offer, among `out[from..]`, into text.
    fn screen(&mut self, out: &mut Vec<Segment>, from: usize) {
        if self.offered.is_none()
            && self.refused.is_none()
            && !out[from..].iter().any(|s| matches!(s, Segment::ToolCallStart { .. } | Segment::ToolCall(_)))
        {
            return;
        }
        let fresh: Vec<Segment> = out.drain(from..).collect();
        for segment in fresh {
            match segment {
                Segment::ToolCallStart { name, .. } if !self.takes(&name) => self.refused = Some((name, String::new())),
                Segment::ToolCallArgs(args) if self.refused.is_some() => {
                    self.refused.as_mut().expect("checked").1.push_str(&args);
                }
                Segment::ToolCall(call) if self.refused.is_some() || !self.takes(&call.name) => {
                    self.refused = None;
                    let arguments = serde_json::from_str::<serde_json::Value>(&call.arguments)
                        .unwrap_or(serde_json::Value::String(call.arguments));
                    let text = serde_json::json!({"name": call.name, "arguments": arguments}).to_string();
                    push_segment(out, Segment::Text(text));
                }
                other => push_segment(out, other),
            }
        }
    }

    /// Parses the next `text` of the answer, appending what it can say now to `out`.
    pub fn push(&mut self, text: &str, out: &mut Vec<Segment>) {
        let from = out.len();
        self.parse(text, out);
        self.screen(out, from);
    }

    fn parse(&mut self, text: &str, out: &mut Vec<Segment>) {
        match &mut self.inner {
            Inner::Harmony(h) => h.push(text, out),
            Inner::Chain { reasoning: None, tools: None } => push_text(out, text),
            Inner::Chain { reasoning: None, tools: Some(tools) } => tools.push(text, out),
            Inner::Chain { reasoning: Some(reasoning), tools } => {
                reasoning.push(text, &mut self.scratch);
                route(&mut self.scratch, tools.as_mut(), out, false);
            }
        }
    }

    /// The end of the answer: everything held back, as what it turned out to be.
    pub fn finish(&mut self, out: &mut Vec<Segment>) {
        let from = out.len();
        self.end(out);
        self.screen(out, from);
        // A refused call the answer ended inside: what it said, as text.
        if let Some((name, args)) = self.refused.take() {
            push_segment(out, Segment::Text(serde_json::json!({"name": name, "arguments": args}).to_string()));
        }
    }

    fn end(&mut self, out: &mut Vec<Segment>) {
        match &mut self.inner {
            Inner::Harmony(h) => h.finish(out),
            Inner::Chain { reasoning: None, tools: None } => {}
            Inner::Chain { reasoning: None, tools: Some(tools) } => tools.finish(out),
            Inner::Chain { reasoning: Some(reasoning), tools } => {
                reasoning.finish(&mut self.scratch);
                route(&mut self.scratch, tools.as_mut(), out, true);
            }
        }
    }
}

/// Hands the reasoning parser's text to the tool parser; thinking goes straight out.
fn route(from: &mut Vec<Segment>, mut tools: Option<&mut ToolParser>, out: &mut Vec<Segment>, finish: bool) {
    for segment in from.drain(..) {
        match (segment, tools.as_deref_mut()) {
            (Segment::Text(text), Some(tools)) => tools.push(&text, out),
            (other, _) => push_segment(out, other),
        }
    }
    if finish && let Some(tools) = tools {
        tools.finish(out);
    }
}

/// Bytes a parser takes in at a time: a long push is fed in slices, so that saying what the
/// buffer's front holds stays cheap (the result is the same for any chunking).
const SLICE: usize = 4096;

/// Calls `f` on `text` in slices of about [`SLICE`] bytes, cut on character boundaries.
fn in_slices(text: &str, mut f: impl FnMut(&str)) {
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + SLICE).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        f(&text[start..end]);
        start = end;
    }
}

/// Appends `text` as text, continuing a text segment at the end of `out`.
fn push_text(out: &mut Vec<Segment>, text: &str) {
    match out.last_mut() {
        _ if text.is_empty() => {}
        Some(Segment::Text(last)) => last.push_str(text),
        _ => out.push(Segment::Text(text.to_owned())),
    }
}

/// Appends `text` as thinking, continuing a thinking segment at the end of `out`.
fn push_thinking(out: &mut Vec<Segment>, text: &str) {
    match out.last_mut() {
        _ if text.is_empty() => {}
        Some(Segment::Thinking(last)) => last.push_str(text),
        _ => out.push(Segment::Thinking(text.to_owned())),
    }
}

/// Appends `segment`, merged into the last one when both are text or both thinking; empty text
/// and thinking are dropped.
pub(crate) fn push_segment(out: &mut Vec<Segment>, segment: Segment) {
    match (out.last_mut(), segment) {
        (_, Segment::Text(t) | Segment::Thinking(t) | Segment::ToolCallArgs(t)) if t.is_empty() => {}
        (Some(Segment::Text(last)), Segment::Text(t)) => last.push_str(&t),
        (Some(Segment::ToolCallArgs(last)), Segment::ToolCallArgs(t)) => last.push_str(&t),
        (Some(Segment::Thinking(last)), Segment::Thinking(t)) => last.push_str(&t),
        (_, segment) => out.push(segment),
    }
}
