//! gpt-oss harmony: an answer is a sequence of messages, each a header and a body,
//! `<|start|>assistant<|channel|>CHANNEL[ to=functions.NAME][ <|constrain|>json]<|message|>BODY<|end|>`
//! (a tool call ends with `<|call|>`, the last message may end with `<|return|>`). The `analysis`
//! channel is reasoning (text when the gpt_oss reasoning parser is off); `final` and `commentary`
//! are text; a message with a recipient is a tool call, on any channel.

use super::scan::{Scan, scan};
use super::{Segment, ToolCall, push_segment, push_text, push_thinking};

/// Where a header starts.
const HEADER_STARTS: [&str; 2] = ["<|start|>", "<|channel|>"];
/// Where a body ends (`<|start|>`: the next message, its end left out).
const BODY_ENDS: [&str; 4] = ["<|end|>", "<|call|>", "<|return|>", "<|start|>"];
const MESSAGE: &str = "<|message|>";

#[derive(Debug)]
pub(super) struct HarmonyParser {
    /// `analysis` is thinking (else text).
    reasoning: bool,
    state: State,
    buf: String,
}

#[derive(Debug)]
enum State {
    /// Between messages: text outside any header is text.
    Between,
    /// Reading a header (kept in `buf` until `<|message|>`).
    Header,
    /// In a body.
    Body(Route),
}

#[derive(Debug)]
enum Route {
    Thinking,
    Text,
    /// A call to `name`; its arguments so far, and how much of them was said (once the body
    /// shows a JSON object, the arguments stream: the call's name is said, then the arguments
    /// without their surrounding whitespace as they arrive).
    Call {
        name: String,
        arguments: String,
        said: Option<usize>,
    },
}

impl HarmonyParser {
    pub(super) fn new(reasoning: bool) -> HarmonyParser {
        HarmonyParser { reasoning, state: State::Between, buf: String::new() }
    }

    pub(super) fn push(&mut self, text: &str, out: &mut Vec<Segment>) {
        super::in_slices(text, |slice| {
            self.buf.push_str(slice);
            self.drain(out, false);
        });
    }

    pub(super) fn finish(&mut self, out: &mut Vec<Segment>) {
        self.drain(out, true);
    }

    fn route(&self, header: &str) -> Route {
        let word = |after: &str| -> Option<String> {
            let at = header.find(after)? + after.len();
            let rest = header[at..].trim_start();
            let end = rest.find(|c: char| c.is_whitespace() || c == '<').unwrap_or(rest.len());
            Some(rest[..end].to_owned()).filter(|w| !w.is_empty())
        };
        if let Some(recipient) = word("to=") {
            let name = recipient.strip_prefix("functions.").unwrap_or(&recipient).to_owned();
            return Route::Call { name, arguments: String::new(), said: None };
        }
        match word("<|channel|>").as_deref() {
            Some("analysis") if self.reasoning => Route::Thinking,
            _ => Route::Text,
        }
    }

    fn drain(&mut self, out: &mut Vec<Segment>, end: bool) {
        loop {
            match &mut self.state {
                State::Between => match scan(&self.buf, &HEADER_STARTS) {
                    Scan::Found { at, .. } => {
                        push_text(out, &self.buf[..at]);
                        self.buf.drain(..at);
                        self.state = State::Header;
                    }
                    Scan::Partial { safe } => {
                        let upto = if end { self.buf.len() } else { safe };
                        push_text(out, &self.buf[..upto]);
                        self.buf.drain(..upto);
                        return;
                    }
                },
                State::Header => match self.buf.find(MESSAGE) {
                    Some(at) => {
                        let route = self.route(&self.buf[..at]);
                        self.buf.drain(..at + MESSAGE.len());
                        self.state = State::Body(route);
                    }
                    None if end => {
                        // An unfinished header is said as the text it was.
                        push_text(out, &self.buf);
                        self.buf.clear();
                        return;
                    }
                    None => return,
                },
                State::Body(route) => {
                    let (upto, done) = match scan(&self.buf, &BODY_ENDS) {
                        Scan::Found { at, marker } => {
                            let consumed =
                                if BODY_ENDS[marker] == "<|start|>" { at } else { at + BODY_ENDS[marker].len() };
                            (at, Some(consumed))
                        }
                        Scan::Partial { safe } => {
                            (if end { self.buf.len() } else { safe }, end.then_some(self.buf.len()))
                        }
                    };
                    let content = &self.buf[..upto];
                    match route {
                        Route::Thinking => push_thinking(out, content),
                        Route::Text => push_text(out, content),
                        Route::Call { name, arguments, said } => {
                            arguments.push_str(content);
                            let lead = arguments.len() - arguments.trim_start().len();
                            if said.is_none() && arguments[lead..].starts_with('{') {
                                push_segment(out, Segment::ToolCallStart { id: None, name: name.clone() });
                                *said = Some(lead);
                            }
                            if let Some(said) = said {
                                let visible = arguments.trim_end().len();
                                if visible > *said {
                                    push_segment(out, Segment::ToolCallArgs(arguments[*said..visible].to_owned()));
                                    *said = visible;
                                }
                            }
                        }
                    }
                    match done {
                        Some(consumed) => {
                            if let Route::Call { name, arguments, said } = route {
                                let arguments = arguments.trim();
                                // A call whose arguments streamed stays a call.
                                if said.is_some() || super::json::is_json_object(arguments) {
                                    let call =
                                        ToolCall { id: None, name: name.clone(), arguments: arguments.to_owned() };
                                    push_segment(out, Segment::ToolCall(call));
                                } else {
                                    push_text(out, arguments);
                                }
                            }
                            self.buf.drain(..consumed);
                            self.state = State::Between;
                            if end && self.buf.is_empty() {
                                return;
                            }
                        }
                        None => {
                            self.buf.drain(..upto);
                            return;
                        }
                    }
                }
            }
        }
    }
}
