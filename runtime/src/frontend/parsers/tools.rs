//! Tool-call parsers: the text between a format's start marker and its end (a closing marker, or
//! the end of a JSON value) is held until it is complete, then becomes tool calls, or the text it
//! was if it does not parse. Formats whose arguments are a JSON object after the tool's name
//! (Hermes, Kimi-K2, DeepSeek-V3.1) say a call's name as soon as it is read and stream its
//! arguments as they arrive; such a call, once begun, stays a call.

use serde_json::Value;

use super::json::{
    is_json_object, json_str, loose_value, object_fields, object_text, python_calls, python_list_end, skip_ws,
    value_end,
};
use super::scan::{Scan, held_suffix, scan};
use super::{Segment, ToolCall, push_segment, push_text};

/// A tool-call format, by Dynamo's parser names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>{"name": …, "arguments": …}</tool_call>` (Qwen2.5, Qwen3-Instruct).
    Hermes,
    /// `<tool_call><function=f><parameter=k>v</parameter></function></tool_call>` (Qwen3-Coder,
    /// Nemotron Nano).
    Qwen3Coder,
    /// `<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>` (GLM-4.7).
    Glm47,
    /// `<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{…}<|tool_call_end|>…`.
    KimiK2,
    /// `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{…}\n```<｜tool▁call▁end｜>…`.
    DeepseekV3,
    /// `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{…}<｜tool▁call▁end｜>…`.
    DeepseekV31,
    /// DSML: `<｜DSML｜function_calls><｜DSML｜invoke name="f"><｜DSML｜parameter name="k" string="true">v</｜DSML｜parameter>…`.
    DeepseekV32,
    /// `<|python_tag|>{"name": …, "parameters": …}`, or a bare JSON call opening the answer.
    Llama3Json,
    /// `[TOOL_CALLS][{"name": …, "arguments": …}]`, or the v11 form `[TOOL_CALLS]f{…}`.
    Mistral,
    /// `[f(a=1), g(x=[1, 2])]`, optionally inside `<|python_start|>…<|python_end|>`.
    Pythonic,
    /// gpt-oss harmony (`<|channel|>commentary to=functions.f …<|message|>{…}<|call|>`).
    Harmony,
    /// `<TOOLCALL>[…]</TOOLCALL>`.
    NemotronDeci,
    /// `<tool_calls>[…]</tool_calls>`.
    Jamba,
    /// `functools[…]`.
    Phi4,
    /// `<minimax:tool_call><invoke name="f"><parameter name="k">v</parameter></invoke></minimax:tool_call>`.
    MinimaxM2,
}

/// How a call's text ends once its start marker is seen.
#[derive(Clone, Copy, Debug)]
enum End {
    /// At one of these markers.
    Tags(&'static [&'static str]),
    /// At the end of one JSON value.
    Json,
    /// At the end of JSON objects separated by `;`.
    JsonObjects,
    /// A JSON list, or a name and a JSON object (Mistral v11).
    Mistral,
    /// At the end of a Python list.
    PythonList,
}

impl ToolFormat {
    /// Every name `frontend.tool_call_parser` takes.
    pub const NAMES: [&'static str; 16] = [
        "hermes",
        "qwen3_coder",
        "nemotron_nano",
        "glm47",
        "kimi_k2",
        "deepseek_v3",
        "deepseek_v3_1",
        "deepseek_v3_2",
        "llama3_json",
        "mistral",
        "pythonic",
        "harmony",
        "nemotron_deci",
        "jamba",
        "phi4",
        "minimax_m2",
    ];

    /// The format a parser name stands for.
    pub fn from_name(name: &str) -> Option<ToolFormat> {
        Some(match name {
            "hermes" => ToolFormat::Hermes,
            "qwen3_coder" | "nemotron_nano" => ToolFormat::Qwen3Coder,
            "glm47" => ToolFormat::Glm47,
            "kimi_k2" => ToolFormat::KimiK2,
            "deepseek_v3" => ToolFormat::DeepseekV3,
            "deepseek_v3_1" => ToolFormat::DeepseekV31,
            "deepseek_v3_2" => ToolFormat::DeepseekV32,
            "llama3_json" => ToolFormat::Llama3Json,
            "mistral" => ToolFormat::Mistral,
            "pythonic" => ToolFormat::Pythonic,
            "harmony" => ToolFormat::Harmony,
            "nemotron_deci" => ToolFormat::NemotronDeci,
            "jamba" => ToolFormat::Jamba,
            "phi4" => ToolFormat::Phi4,
            "minimax_m2" => ToolFormat::MinimaxM2,
            _ => return None,
        })
    }

    /// Every marker this parser reads in an answer: what must stay in the decoded text for it
    /// (a special token whose text is part of one is not dropped from the answer).
    pub fn markers(self) -> Vec<&'static str> {
        let mut markers = self.starts().to_vec();
        if let End::Tags(tags) = self.end(0) {
            markers.extend_from_slice(tags);
        }
        if let End::Tags(tags) = self.end(1) {
            markers.extend_from_slice(tags);
        }
        if let Some((start, arguments, end)) = self.call_markers() {
            markers.extend([start, arguments, end]);
        }
        if self == ToolFormat::Harmony {
            markers.extend([
                "<|start|>",
                "<|channel|>",
                "<|message|>",
                "<|constrain|>",
                "<|end|>",
                "<|call|>",
                "<|return|>",
            ]);
        }
        markers
    }

    fn starts(self) -> &'static [&'static str] {
        match self {
            ToolFormat::Hermes | ToolFormat::Qwen3Coder | ToolFormat::Glm47 => &["<tool_call>"],
            ToolFormat::KimiK2 => &["<|tool_calls_section_begin|>", "<|tool_call_section_begin|>"],
            ToolFormat::DeepseekV3 | ToolFormat::DeepseekV31 => &["<｜tool▁calls▁begin｜>"],
            ToolFormat::DeepseekV32 => &["<｜DSML｜function_calls>"],
            ToolFormat::Llama3Json => &["<|python_tag|>"],
            ToolFormat::Mistral => &["[TOOL_CALLS]"],
            ToolFormat::Pythonic => &["<|python_start|>", "["],
            ToolFormat::Harmony => &[],
            ToolFormat::NemotronDeci => &["<TOOLCALL>"],
            ToolFormat::Jamba => &["<tool_calls>"],
            ToolFormat::Phi4 => &["functools"],
            ToolFormat::MinimaxM2 => &["<minimax:tool_call>"],
        }
    }

    fn end(self, start: usize) -> End {
        match self {
            ToolFormat::Hermes | ToolFormat::Qwen3Coder | ToolFormat::Glm47 => End::Tags(&["</tool_call>"]),
            ToolFormat::KimiK2 => End::Tags(&["<|tool_calls_section_end|>", "<|tool_call_section_end|>"]),
            ToolFormat::DeepseekV3 | ToolFormat::DeepseekV31 => End::Tags(&["<｜tool▁calls▁end｜>"]),
            ToolFormat::DeepseekV32 => End::Tags(&["</｜DSML｜function_calls>"]),
            ToolFormat::Llama3Json => End::JsonObjects,
            ToolFormat::Mistral => End::Mistral,
            ToolFormat::Pythonic if start == 0 => End::Tags(&["<|python_end|>"]),
            ToolFormat::Pythonic => End::PythonList,
            ToolFormat::NemotronDeci => End::Tags(&["</TOOLCALL>"]),
            ToolFormat::Jamba => End::Tags(&["</tool_calls>"]),
            ToolFormat::Phi4 => End::Json,
            ToolFormat::MinimaxM2 => End::Tags(&["</minimax:tool_call>"]),
            ToolFormat::Harmony => End::Tags(&[]),
        }
    }

    /// The markers of one call inside a section, for formats whose calls stream one by one:
    /// its start, the start of its arguments (after its name or id), its end.
    fn call_markers(self) -> Option<(&'static str, &'static str, &'static str)> {
        match self {
            ToolFormat::KimiK2 => Some(("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")),
            ToolFormat::DeepseekV31 => Some(("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")),
            _ => None,
        }
    }

    /// Formats whose arguments stream before the call completes: a JSON object after the
    /// tool's name, written as the model writes it (harmony's stream in its own parser, Kimi-K2's
    /// and DeepSeek-V3.1's call by call, [`call_markers`](Self::call_markers)). The others
    /// (parameters as XML or Python, JSON lists) say each call whole once it is complete.
    fn streams_arguments(self) -> bool {
        matches!(self, ToolFormat::Hermes)
    }

    /// Formats whose closing marker a length-stopped answer may never write: what was read is
    /// parsed at the end of the stream.
    fn recovers_unclosed(self) -> bool {
        matches!(self, ToolFormat::KimiK2 | ToolFormat::Qwen3Coder | ToolFormat::DeepseekV31 | ToolFormat::DeepseekV3)
    }

    /// The calls in `body` (the text between the start and the end), or `None` if it is not a
    /// call of this format.
    fn parse(self, body: &str) -> Option<Vec<ToolCall>> {
        let calls = match self {
            ToolFormat::Hermes => hermes_calls(body)?,
            ToolFormat::NemotronDeci | ToolFormat::Jamba | ToolFormat::Phi4 => json_calls(body)?,
            ToolFormat::Llama3Json => {
                let mut calls = Vec::new();
                for part in split_objects(body)? {
                    calls.push(json_call(part)?);
                }
                calls
            }
            ToolFormat::Mistral => mistral_calls(body)?,
            ToolFormat::Pythonic => python_calls(body)?
                .into_iter()
                .map(|(name, arguments)| ToolCall { id: None, name, arguments })
                .collect(),
            ToolFormat::Qwen3Coder => qwen3_coder_calls(body)?,
            ToolFormat::Glm47 => vec![glm47_call(body)?],
            ToolFormat::MinimaxM2 => {
                invoke_calls(body, "<invoke name=\"", "</invoke>", "<parameter name=\"", "</parameter>")?
            }
            ToolFormat::DeepseekV32 => invoke_calls(
                body,
                "<｜DSML｜invoke name=\"",
                "</｜DSML｜invoke>",
                "<｜DSML｜parameter name=\"",
                "</｜DSML｜parameter>",
            )?,
            ToolFormat::KimiK2 => kimi_calls(body)?,
            ToolFormat::DeepseekV3 | ToolFormat::DeepseekV31 => deepseek_calls(body, self == ToolFormat::DeepseekV3)?,
            ToolFormat::Harmony => return None,
        };
        (!calls.is_empty()).then_some(calls)
    }
}

/// A streaming tool-call parser over an answer's text.
#[derive(Debug)]
pub struct ToolParser {
    format: ToolFormat,
    /// Inside a call: which start marker opened it.
    inside: Option<usize>,
    /// Text not yet said: after a start marker, the call's text so far (marker excluded).
    buf: String,
    /// Whether anything but whitespace came before (a bare JSON call must open the answer).
    said_text: bool,
    /// The call being held whose name was said and whose arguments are streaming.
    streaming: Option<Streaming>,
    /// Bytes of a held call's text already searched for its closing marker (searched again
    /// only from there on, so a long call streamed in small pieces is scanned once).
    scanned: usize,
    /// A held section of calls (Kimi-K2, DeepSeek-V3.1) whose calls stream one by one.
    section: Section,
}

/// The calls of a held section said so far ([`ToolFormat::call_markers`]).
#[derive(Debug, Default)]
struct Section {
    /// Where the text after the last completed call starts.
    base: usize,
    /// Calls completed.
    emitted: usize,
    /// The call whose arguments are streaming.
    current: Option<SectionCall>,
}

/// A call of a section, streaming.
#[derive(Debug)]
struct SectionCall {
    id: Option<String>,
    name: String,
    /// Where its arguments start (their first visible character) once known.
    args_at: usize,
    /// Bytes of them said.
    sent: usize,
    /// Bytes after `args_at` searched for the call's end.
    searched: usize,
}

/// A held call whose arguments stream as they arrive ([`ToolFormat::streams_arguments`]).
#[derive(Debug)]
struct Streaming {
    /// The tool.
    name: String,
    /// Where the arguments object starts in the call's text.
    args_at: usize,
    /// Bytes of it said so far.
    sent: usize,
    /// Where the arguments object ends, once it has (the scan runs once over each byte).
    object: ObjectScan,
}

/// An incremental scan for the end of one JSON object.
#[derive(Debug, Default)]
struct ObjectScan {
    /// Bytes scanned.
    at: usize,
    depth: usize,
    in_string: bool,
    escaped: bool,
    /// Its end (one past the closing brace), once seen.
    end: Option<usize>,
}

impl ObjectScan {
    /// Scans on through `text` (the object's text so far, from its `{`); its end once seen.
    fn advance(&mut self, text: &str) -> Option<usize> {
        let b = text.as_bytes();
        while self.end.is_none() && self.at < b.len() {
            let c = b[self.at];
            self.at += 1;
            if self.in_string {
                match (self.escaped, c) {
                    (true, _) => self.escaped = false,
                    (false, b'\\') => self.escaped = true,
                    (false, b'"') => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match c {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        self.end = Some(self.at);
                    }
                }
                _ => {}
            }
        }
        self.end
    }
}

impl ToolParser {
    /// A parser for `format`.
    pub fn new(format: ToolFormat) -> ToolParser {
        ToolParser {
            format,
            inside: None,
            buf: String::new(),
            said_text: false,
            streaming: None,
            scanned: 0,
            section: Section::default(),
        }
    }

    /// Parses `text`, appending text and complete tool calls to `out`.
    pub fn push(&mut self, text: &str, out: &mut Vec<Segment>) {
        let rest = self.push_direct(text, out);
        super::in_slices(rest, |slice| {
            self.buf.push_str(slice);
            self.drain(out, false);
        });
    }

    /// Parses what it can of `text` in place, without buffering it: text up to a start marker,
    /// and calls whose closing marker is in `text` too. Returns the rest, for the buffered path
    /// (which gives the same segments; this only saves copying a long push through the buffer).
    /// Only for formats whose calls open and close with real markers, and while nothing is held.
    fn push_direct<'t>(&mut self, mut text: &'t str, out: &mut Vec<Segment>) -> &'t str {
        let direct = !matches!(self.format, ToolFormat::Pythonic | ToolFormat::Llama3Json);
        let starts = self.format.starts();
        while direct && self.inside.is_none() && self.buf.is_empty() && !text.is_empty() {
            let (at, marker) = match scan(text, starts) {
                Scan::Found { at, marker } => (at, marker),
                Scan::Partial { safe } => {
                    self.said_text |= !text[..safe].trim().is_empty();
                    push_text(out, &text[..safe]);
                    return &text[safe..];
                }
            };
            let End::Tags(tags) = self.format.end(marker) else { return text };
            let body = &text[at + starts[marker].len()..];
            let Scan::Found { at: body_end, marker: tag } = scan(body, tags) else { return text };
            self.said_text |= !text[..at].trim().is_empty();
            push_text(out, &text[..at]);
            let whole = &text[at..at + starts[marker].len() + body_end + tags[tag].len()];
            match self.format.parse(&body[..body_end]) {
                Some(calls) => calls.into_iter().for_each(|c| push_segment(out, Segment::ToolCall(c))),
                None => {
                    self.said_text = true;
                    push_text(out, whole);
                }
            }
            text = &text[at + whole.len()..];
        }
        text
    }

    /// Flushes what was held back: an unfinished call is recovered where the format allows, else
    /// said as the text it was.
    pub fn finish(&mut self, out: &mut Vec<Segment>) {
        self.drain(out, true);
    }

    fn say(&mut self, out: &mut Vec<Segment>, upto: usize) {
        let text = &self.buf[..upto];
        self.said_text |= !text.trim().is_empty();
        push_text(out, text);
        self.buf.drain(..upto);
    }

    fn drain(&mut self, out: &mut Vec<Segment>, end: bool) {
        loop {
            match self.inside {
                None => {
                    let starts = self.format.starts();
                    // A bare JSON call may open a Llama answer.
                    if self.format == ToolFormat::Llama3Json && !self.said_text {
                        let lead = skip_ws(&self.buf, 0);
                        match bare_json_call_start(&self.buf[lead..]) {
                            Some(true) => {
                                self.buf.drain(..lead);
                                self.inside = Some(starts.len());
                                continue;
                            }
                            None if !end => return,
                            _ => {}
                        }
                    }
                    match scan(&self.buf, starts) {
                        Scan::Found { at, marker } => {
                            // Pythonic's bare `[` opens a call list only before `name(`.
                            if self.format == ToolFormat::Pythonic && marker == 1 {
                                match python_call_start(&self.buf[at + 1..]) {
                                    Some(true) => {}
                                    Some(false) => {
                                        self.say(out, at + 1);
                                        continue;
                                    }
                                    None if end => {
                                        self.say(out, self.buf.len());
                                        return;
                                    }
                                    None => {
                                        self.say(out, at);
                                        return;
                                    }
                                }
                                self.say(out, at);
                                self.inside = Some(marker);
                                continue;
                            }
                            self.say(out, at);
                            self.buf.drain(..starts[marker].len());
                            self.inside = Some(marker);
                        }
                        Scan::Partial { safe } => {
                            let upto = if end { self.buf.len() } else { safe };
                            self.say(out, upto);
                            return;
                        }
                    }
                }
                Some(start) => {
                    // The text that opened the call, to give back if it is not one (Pythonic's
                    // bare `[` and Llama's bare `{` stay in the body).
                    let marker = match (self.format, start) {
                        (ToolFormat::Pythonic, 1) => "",
                        _ => self.format.starts().get(start).copied().unwrap_or(""),
                    };
                    let (body_end, resume) = match self.body_end(start, end) {
                        Some(found) => found,
                        None if !end => {
                            self.stream_arguments(out);
                            return;
                        }
                        None => {
                            // The stream ended inside a call.
                            let recovered =
                                self.format.recovers_unclosed().then(|| self.format.parse(&self.buf)).flatten();
                            match recovered {
                                _ if self.section_started() => self.finish_section(recovered, out),
                                Some(calls) => calls.into_iter().for_each(|c| push_segment(out, Segment::ToolCall(c))),
                                // A call whose name was said stays a call, with what came of it.
                                None if self.streaming.is_some() => self.finish_streamed(None, out),
                                None => {
                                    let text = format!("{marker}{}", self.buf);
                                    push_text(out, &text);
                                }
                            }
                            self.buf.clear();
                            self.inside = None;
                            self.scanned = 0;
                            return;
                        }
                    };
                    let parsed = self.format.parse(&self.buf[..body_end]);
                    match parsed {
                        _ if self.section_started() => self.finish_section(parsed, out),
                        _ if self.streaming.is_some() => {
                            let mut calls = parsed.unwrap_or_default().into_iter();
                            let first = calls.next();
                            self.finish_streamed(first, out);
                            calls.for_each(|c| push_segment(out, Segment::ToolCall(c)));
                        }
                        Some(calls) => calls.into_iter().for_each(|c| push_segment(out, Segment::ToolCall(c))),
                        None => {
                            let text = format!("{marker}{}", &self.buf[..resume]);
                            self.said_text |= !text.trim().is_empty();
                            push_text(out, &text);
                        }
                    }
                    self.buf.drain(..resume);
                    self.inside = None;
                    self.scanned = 0;
                }
            }
        }
    }

    /// While a call of a format that streams its arguments is held: says its name once the
    /// call's head is read (`{"name": "f", "arguments": ` before an object), then the arguments
    /// as they arrive, up to the end of the object (a suffix that may begin the closing marker
    /// is held back).
    fn stream_arguments(&mut self, out: &mut Vec<Segment>) {
        if let Some(markers) = self.format.call_markers() {
            return self.stream_section(markers, out);
        }
        if !self.format.streams_arguments() {
            return;
        }
        if self.streaming.is_none() {
            let Some((name, args_at)) = hermes_head(&self.buf) else { return };
            push_segment(out, Segment::ToolCallStart { id: None, name: name.clone() });
            self.streaming = Some(Streaming { name, args_at, sent: 0, object: ObjectScan::default() });
        }
        let Some(streaming) = &mut self.streaming else { return };
        let End::Tags(tags) = self.format.end(0) else { return };
        // Held back: what may begin the closing marker, and the call object's own `}` with the
        // whitespace around it, which may follow the arguments. Only the buffer's end is looked
        // at, so a long call costs the same per piece.
        let safe = &self.buf[..self.buf.len() - held_suffix(&self.buf, tags)];
        let trimmed = safe.trim_end();
        let mut upto = trimmed.strip_suffix('}').map_or(trimmed, str::trim_end).len();
        // Never past the arguments object: what follows it (the rest of the call, or more calls
        // in one tag) is not its arguments.
        if let Some(end) = streaming.object.advance(&self.buf[streaming.args_at..]) {
            upto = upto.min(streaming.args_at + end);
        }
        let from = streaming.args_at + streaming.sent;
        if upto > from {
            push_segment(out, Segment::ToolCallArgs(self.buf[from..upto].to_owned()));
            streaming.sent = upto - streaming.args_at;
        }
    }

    /// The calls of a held section as they arrive: each says its name (and id) once its
    /// arguments begin, then its arguments (without surrounding whitespace; a suffix that may
    /// begin a closing marker is held back), and completes at its own end marker.
    fn stream_section(&mut self, (begin, args, end): (&str, &str, &str), out: &mut Vec<Segment>) {
        let End::Tags(section_ends) = self.format.end(0) else { return };
        loop {
            let section = &mut self.section;
            if section.current.is_none() {
                let rest = &self.buf[section.base..];
                let Some(at) = rest.find(begin) else { return };
                let head_at = at + begin.len();
                let Some(head_len) = rest[head_at..].find(args) else { return };
                let head = rest[head_at..head_at + head_len].trim();
                let (id, name) = match self.format {
                    ToolFormat::KimiK2 => {
                        let bare = head.strip_prefix("functions.").unwrap_or(head);
                        (Some(head.to_owned()), bare.rsplit_once(':').map_or(bare, |(name, _)| name).to_owned())
                    }
                    _ => (None, head.to_owned()),
                };
                push_segment(out, Segment::ToolCallStart { id: id.clone(), name: name.clone() });
                let args_at = section.base + head_at + head_len + args.len();
                section.current = Some(SectionCall { id, name, args_at, sent: 0, searched: 0 });
            }
            let Some(call) = &mut section.current else { return };
            // The arguments start at their first visible character.
            if call.sent == 0 {
                call.args_at = skip_ws(&self.buf, call.args_at);
            }
            let from = call.args_at.min(self.buf.len());
            let search = (from + call.searched.saturating_sub(end.len())).min(self.buf.len());
            let search = (search..=self.buf.len()).find(|&i| self.buf.is_char_boundary(i)).unwrap_or(self.buf.len());
            match self.buf[search..].find(end) {
                Some(e) => {
                    let end_at = search + e;
                    let arguments = self.buf[from..end_at].trim_end().to_owned();
                    let said = call.sent.min(arguments.len());
                    push_segment(out, Segment::ToolCallArgs(arguments[said..].to_owned()));
                    let call = section.current.take().expect("a streaming call");
                    push_segment(out, Segment::ToolCall(ToolCall { id: call.id, name: call.name, arguments }));
                    section.emitted += 1;
                    section.base = end_at + end.len();
                }
                None => {
                    call.searched = self.buf.len() - from;
                    let mut held = held_suffix(&self.buf, &[end]);
                    held = held.max(held_suffix(&self.buf, section_ends));
                    let safe = self.buf[..self.buf.len() - held].trim_end().len();
                    if safe > from + call.sent {
                        push_segment(out, Segment::ToolCallArgs(self.buf[from + call.sent..safe].to_owned()));
                        call.sent = safe - from;
                    }
                    return;
                }
            }
        }
    }

    /// Completes a section whose calls streamed: the parsed calls after those said, the
    /// streaming one completed by its parse when that continues what was said (else as said).
    fn finish_section(&mut self, parsed: Option<Vec<ToolCall>>, out: &mut Vec<Segment>) {
        let section = std::mem::take(&mut self.section);
        let mut rest = parsed.into_iter().flatten().skip(section.emitted);
        if let Some(call) = section.current {
            let said = &self.buf[call.args_at..call.args_at + call.sent];
            let completed = match rest.next() {
                Some(parsed) if parsed.name == call.name && parsed.arguments.starts_with(said) => parsed,
                _ => ToolCall { id: call.id, name: call.name, arguments: said.to_owned() },
            };
            push_segment(out, Segment::ToolCall(completed));
        }
        rest.for_each(|c| push_segment(out, Segment::ToolCall(c)));
    }

    /// Whether a held section has said any of its calls.
    fn section_started(&self) -> bool {
        self.section.emitted > 0 || self.section.current.is_some()
    }

    /// Completes the call whose arguments streamed: `parsed` when it continues what was said,
    /// else the call as said (its name and the arguments streamed: what was said stands).
    fn finish_streamed(&mut self, parsed: Option<ToolCall>, out: &mut Vec<Segment>) {
        let Some(streaming) = self.streaming.take() else { return };
        let said = &self.buf[streaming.args_at..streaming.args_at + streaming.sent];
        let call = match parsed {
            Some(call) if call.name == streaming.name && call.arguments.starts_with(said) => call,
            _ => ToolCall { id: None, name: streaming.name, arguments: said.to_owned() },
        };
        push_segment(out, Segment::ToolCall(call));
    }

    /// Where the call's body ends in `buf` and where the text after it resumes, once complete
    /// (`end`: no more text comes).
    fn body_end(&mut self, start: usize, end: bool) -> Option<(usize, usize)> {
        let buf = &self.buf;
        match self.format.end(start) {
            End::Tags(tags) => {
                let longest = tags.iter().map(|t| t.len()).max().unwrap_or(0);
                let mut from = self.scanned.saturating_sub(longest).min(buf.len());
                while !buf.is_char_boundary(from) {
                    from -= 1;
                }
                loop {
                    match scan(&buf[from..], tags) {
                        Scan::Found { at, marker } => {
                            let (body_end, end) = (from + at, from + at + tags[marker].len());
                            // A Hermes body is JSON: its closing tag inside one of its strings
                            // (an argument that mentions `</tool_call>`) does not close the call;
                            // the scan goes on after it.
                            if self.format == ToolFormat::Hermes && json_string_open(&buf[..body_end]) {
                                from = end;
                                self.scanned = end;
                                continue;
                            }
                            return Some((body_end, end));
                        }
                        Scan::Partial { .. } => {
                            self.scanned = buf.len();
                            return None;
                        }
                    }
                }
            }
            End::Json => value_end(buf, 0).map(|e| (e, e)),
            End::JsonObjects => {
                let mut e = value_end(buf, 0)?;
                loop {
                    let next = skip_ws(buf, e);
                    match buf.as_bytes().get(next) {
                        Some(b';') => e = value_end(buf, next + 1)?,
                        // Undecided until the next character shows whether another call follows.
                        None if !end => return None,
                        None => return Some((e, e)),
                        Some(_) => return Some((e, e)),
                    }
                }
            }
            End::Mistral => {
                let lead = skip_ws(buf, 0);
                if buf.as_bytes().get(lead) == Some(&b'[') {
                    return value_end(buf, lead).map(|e| (e, e));
                }
                let brace = buf.find('{')?;
                value_end(buf, brace).map(|e| (e, e))
            }
            End::PythonList => python_list_end(buf, 0).map(|e| (e, e)),
        }
    }
}

/// Whether `rest` (after `[`) opens a Python call: `name(` after optional whitespace; `None`
/// while it cannot tell.
fn python_call_start(rest: &str) -> Option<bool> {
    let t = rest.trim_start();
    let ident = t.bytes().take_while(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.')).count();
    if ident == t.len() {
        return (t.len() > 64 || t.bytes().next().is_some_and(|b| b.is_ascii_digit())).then_some(false);
    }
    Some(ident > 0 && !t.as_bytes()[0].is_ascii_digit() && t.as_bytes()[ident] == b'(')
}

/// Whether `rest` opens a bare JSON call (`{"name"`, whitespace aside); `None` while it cannot
/// tell.
fn bare_json_call_start(rest: &str) -> Option<bool> {
    const OPEN: &str = "{\"name\"";
    let compact: String = rest.chars().filter(|c| !c.is_whitespace()).take(OPEN.len()).collect();
    if compact.len() == OPEN.len() {
        Some(compact == OPEN)
    } else if !OPEN.starts_with(&compact) || rest.len() > 256 {
        Some(false)
    } else {
        None
    }
}

/// The head of a Hermes call, `{"name": "f", "arguments": ` (or `"parameters"`) before an
/// object: the name and where the object starts; `None` while the head is not all there (or is
/// not this one: then the call is parsed whole when it completes).
fn hermes_head(body: &str) -> Option<(String, usize)> {
    let b = body.as_bytes();
    let mut i = skip_ws(body, 0);
    (b.get(i) == Some(&b'{')).then_some(())?;
    i = skip_ws(body, i + 1);
    let key_end = value_end(body, i)?;
    (json_str(&body[i..key_end])?.as_ref() == "name").then_some(())?;
    i = skip_ws(body, key_end);
    (b.get(i) == Some(&b':')).then_some(())?;
    i = skip_ws(body, i + 1);
    let name_end = value_end(body, i)?;
    let name = json_str(&body[i..name_end])?.into_owned();
    i = skip_ws(body, name_end);
    (b.get(i) == Some(&b',')).then_some(())?;
    i = skip_ws(body, i + 1);
    let key_end = value_end(body, i)?;
    let key = json_str(&body[i..key_end])?;
    (key == "arguments" || key == "parameters").then_some(())?;
    i = skip_ws(body, key_end);
    (b.get(i) == Some(&b':')).then_some(())?;
    i = skip_ws(body, i + 1);
    (b.get(i) == Some(&b'{')).then_some((name, i))
}

/// `{"name": …, "arguments" | "parameters": …}` as a call, its arguments as written.
fn json_call(text: &str) -> Option<ToolCall> {
    let fields = object_fields(text)?;
    let name = fields.iter().find(|(k, _)| k == "name").and_then(|(_, v)| json_str(v))?.into_owned();
    let raw = fields.iter().find(|(k, _)| k == "arguments" || k == "parameters").map(|(_, v)| *v);
    let arguments = match raw {
        None => "{}".to_owned(),
        // Some models write the arguments as a string of JSON.
        Some(raw) if raw.starts_with('"') => {
            let decoded = serde_json::from_str::<String>(raw).ok()?;
            is_json_object(&decoded).then_some(decoded)?
        }
        // The object as a whole was valid JSON: an object value is one.
        Some(raw) if raw.starts_with('{') => raw.to_owned(),
        Some(_) => return None,
    };
    let id = fields.iter().find(|(k, _)| k == "id").and_then(|(_, v)| json_str(v)).map(std::borrow::Cow::into_owned);
    Some(ToolCall { id, name, arguments })
}

/// A Hermes call body: one call object, or (as models write when they mean several calls) a
/// list of them or several objects one after another.
fn hermes_calls(text: &str) -> Option<Vec<ToolCall>> {
    let t = text.trim();
    if t.starts_with('[') {
        return json_calls(t);
    }
    let mut calls = Vec::new();
    let mut i = 0;
    while i < t.len() {
        let e = value_end(t, i)?;
        calls.push(json_call(&t[i..e])?);
        i = skip_ws(t, e);
        if t.as_bytes().get(i) == Some(&b',') {
            i = skip_ws(t, i + 1);
        }
    }
    (!calls.is_empty()).then_some(calls)
}

/// A JSON list of calls (or one call).
fn json_calls(text: &str) -> Option<Vec<ToolCall>> {
    let t = text.trim();
    if !t.starts_with('[') {
        return Some(vec![json_call(t)?]);
    }
    let mut calls = Vec::new();
    let inner = t.strip_prefix('[')?.strip_suffix(']')?;
    let mut i = 0;
    loop {
        i = skip_ws(inner, i);
        if i >= inner.len() {
            break;
        }
        let e = value_end(inner, i)?;
        calls.push(json_call(&inner[i..e])?);
        i = skip_ws(inner, e);
        match inner.as_bytes().get(i) {
            Some(b',') => i += 1,
            None => break,
            _ => return None,
        }
    }
    Some(calls)
}

/// JSON objects separated by `;`.
fn split_objects(text: &str) -> Option<Vec<&str>> {
    let mut parts = Vec::new();
    let mut i = 0;
    loop {
        let start = skip_ws(text, i);
        let e = value_end(text, start)?;
        parts.push(&text[start..e]);
        i = skip_ws(text, e);
        match text.as_bytes().get(i) {
            Some(b';') => i += 1,
            None => return Some(parts),
            _ => return None,
        }
    }
}

/// `[{…}, …]`, or the v11 form `name{…}` (also `name[ARGS]{…}`).
fn mistral_calls(text: &str) -> Option<Vec<ToolCall>> {
    let t = text.trim();
    if t.starts_with('[') {
        return json_calls(t);
    }
    let brace = t.find('{')?;
    let name = t[..brace].trim().trim_end_matches("[ARGS]").trim();
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.')) {
        return None;
    }
    let arguments = t[brace..].to_owned();
    if !is_json_object(&arguments) {
        return None;
    }
    Some(vec![ToolCall { id: None, name: name.to_owned(), arguments }])
}

/// The text between `open` and `close` after `from`, and where it ends; `close` missing takes
/// the rest.
fn between<'a>(text: &'a str, open: &str, close: &str) -> Option<(&'a str, usize)> {
    let start = text.find(open)? + open.len();
    match text[start..].find(close) {
        Some(len) => Some((&text[start..start + len], start + len + close.len())),
        None => Some((&text[start..], text.len())),
    }
}

/// A tagged value without the line breaks the format puts around it.
fn tag_value(v: &str) -> &str {
    let v = v.strip_prefix('\n').unwrap_or(v);
    v.strip_suffix('\n').unwrap_or(v)
}

/// `<function=f><parameter=k>\nv\n</parameter></function>`, any number; a missing
/// `</parameter>` or `</function>` is tolerated. Values are strings (HTML-unescaped).
fn qwen3_coder_calls(body: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = body;
    while let Some(at) = rest.find("<function=") {
        let after = &rest[at + "<function=".len()..];
        let name_end = after.find('>')?;
        let name = after[..name_end].trim().to_owned();
        let body_start = name_end + 1;
        let (function_body, next) = match after[body_start..].find("</function>") {
            Some(e) => (&after[body_start..body_start + e], body_start + e + "</function>".len()),
            None => (&after[body_start..], after.len()),
        };
        let mut args = Vec::new();
        let mut params = function_body;
        while let Some(p) = params.find("<parameter=") {
            let after_p = &params[p + "<parameter=".len()..];
            let key_end = after_p.find('>')?;
            let key = after_p[..key_end].trim().to_owned();
            let value_text = &after_p[key_end + 1..];
            let stop = ["</parameter>", "<parameter="].iter().filter_map(|m| value_text.find(m)).min();
            let value = tag_value(&value_text[..stop.unwrap_or(value_text.len())]);
            args.push((key, Value::String(unescape_html(value))));
            params = match stop {
                Some(s) if value_text[s..].starts_with("</parameter>") => &value_text[s + "</parameter>".len()..],
                Some(s) => &value_text[s..],
                None => "",
            };
        }
        calls.push(ToolCall { id: None, name, arguments: object_text(&args) });
        rest = &after[next..];
    }
    (!calls.is_empty() && !calls.iter().any(|c| c.name.is_empty())).then_some(calls)
}

fn unescape_html(s: &str) -> String {
    s.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&#39;", "'").replace("&amp;", "&")
}

/// `f<arg_key>k</arg_key><arg_value>v</arg_value>…`; JSON-looking values are parsed.
fn glm47_call(body: &str) -> Option<ToolCall> {
    let body = body.trim();
    let name_end = body.find("<arg_key>").unwrap_or(body.len());
    let name = body[..name_end].trim().to_owned();
    if name.is_empty() || name.contains('<') {
        return None;
    }
    let mut args = Vec::new();
    let mut rest = &body[name_end..];
    while rest.contains("<arg_key>") {
        let (key, after_key) = between(rest, "<arg_key>", "</arg_key>")?;
        let (value, after_value) = between(&rest[after_key..], "<arg_value>", "</arg_value>")?;
        args.push((key.trim().to_owned(), loose_value(value)));
        rest = &rest[after_key + after_value..];
    }
    Some(ToolCall { id: None, name, arguments: object_text(&args) })
}

/// `<invoke name="f"><parameter name="k" …>v</parameter></invoke>` (MiniMax, and DeepSeek's
/// DSML with its own tag names). A parameter marked `string="true"` is a string; others are
/// parsed as JSON where they look like it.
fn invoke_calls(body: &str, invoke: &str, invoke_end: &str, param: &str, param_end: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = body;
    while let Some(at) = rest.find(invoke) {
        let after = &rest[at + invoke.len()..];
        let name_end = after.find('"')?;
        let name = after[..name_end].to_owned();
        let open_end = after.find('>')? + 1;
        let (inner, next) = match after[open_end..].find(invoke_end) {
            Some(e) => (&after[open_end..open_end + e], open_end + e + invoke_end.len()),
            None => (&after[open_end..], after.len()),
        };
        let mut args = Vec::new();
        let mut params = inner;
        while let Some(p) = params.find(param) {
            let after_p = &params[p + param.len()..];
            let key_end = after_p.find('"')?;
            let key = after_p[..key_end].to_owned();
            let tag_end = after_p.find('>')? + 1;
            let is_string = after_p[..tag_end].contains("string=\"true\"");
            let value_text = &after_p[tag_end..];
            let stop = value_text.find(param_end).unwrap_or(value_text.len());
            let value = tag_value(&value_text[..stop]);
            args.push((key, if is_string { Value::String(value.to_owned()) } else { loose_value(value) }));
            params = &value_text[(stop + param_end.len()).min(value_text.len())..];
        }
        calls.push(ToolCall { id: None, name, arguments: object_text(&args) });
        rest = &after[next..];
    }
    Some(calls)
}

/// `<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{…}<|tool_call_end|>`, any number;
/// the id is kept, the name is between `functions.` and `:`.
fn kimi_calls(body: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = body;
    while let Some(at) = rest.find("<|tool_call_begin|>") {
        let after = &rest[at + "<|tool_call_begin|>".len()..];
        let (id, args_at) = match after.find("<|tool_call_argument_begin|>") {
            Some(i) => (after[..i].trim(), i + "<|tool_call_argument_begin|>".len()),
            None => return None,
        };
        let (arguments, next) = match after[args_at..].find("<|tool_call_end|>") {
            Some(e) => (after[args_at..args_at + e].trim(), args_at + e + "<|tool_call_end|>".len()),
            None => (after[args_at..].trim(), after.len()),
        };
        if !is_json_object(arguments) {
            return None;
        }
        let bare = id.strip_prefix("functions.").unwrap_or(id);
        let name = bare.rsplit_once(':').map_or(bare, |(name, _)| name).to_owned();
        calls.push(ToolCall { id: Some(id.to_owned()), name, arguments: arguments.to_owned() });
        rest = &after[next..];
    }
    Some(calls)
}

/// DeepSeek V3 (`function<｜tool▁sep｜>f\n```json\n{…}\n```<｜tool▁call▁end｜>`) and V3.1
/// (`f<｜tool▁sep｜>{…}<｜tool▁call▁end｜>`) calls.
fn deepseek_calls(body: &str, v3: bool) -> Option<Vec<ToolCall>> {
    const BEGIN: &str = "<｜tool▁call▁begin｜>";
    const SEP: &str = "<｜tool▁sep｜>";
    const END: &str = "<｜tool▁call▁end｜>";
    let mut calls = Vec::new();
    let mut rest = body;
    while let Some(at) = rest.find(BEGIN) {
        let after = &rest[at + BEGIN.len()..];
        let sep = after.find(SEP)?;
        let (call, next) = match after.find(END) {
            Some(e) => (&after[..e], e + END.len()),
            None => (after, after.len()),
        };
        let head = &call[..sep];
        let tail = &call[sep + SEP.len()..];
        let (name, arguments) = if v3 {
            let (name, json) = tail.split_once('\n')?;
            let json = json.trim().strip_prefix("```json").unwrap_or(json).trim();
            (name.trim(), json.strip_suffix("```").unwrap_or(json).trim())
        } else {
            (head.trim(), tail.trim())
        };
        if !is_json_object(arguments) {
            return None;
        }
        calls.push(ToolCall { id: None, name: name.to_owned(), arguments: arguments.to_owned() });
        rest = &after[next..];
    }
    Some(calls)
}

/// Whether `text`, read as JSON from its start, ends inside a string.
fn json_string_open(text: &str) -> bool {
    let (mut open, mut escaped) = (false, false);
    for &b in text.as_bytes() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if open => escaped = true,
            b'"' => open = !open,
            _ => {}
        }
    }
    open
}
