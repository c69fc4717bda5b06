//! Reasoning parsers: thinking between an open and a close marker, text outside, any number of
//! times (a model may think, answer, call a tool and think again).

use super::scan::{Scan, scan};
use super::{Segment, push_text, push_thinking};

/// A reasoning format, by Dynamo's parser names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningKind {
    /// `<think>` … `</think>` (`basic`, `qwen3`, `nemotron_deci`, `glm45`, and the families whose
    /// templates open the block in the prompt: `deepseek_r1`, `step3`, `nemotron_nano`,
    /// `nemotron3`).
    Think,
    /// `<think>` … `</think>`, where Kimi K2.5's tool-call section also ends the reasoning.
    KimiK25,
    /// `◁think▷` … `◁/think▷`.
    Kimi,
    /// `[THINK]` … `[/THINK]`.
    Mistral,
    /// `Here is my thought process:` … `Here is my response:` (or `Here's`).
    Granite,
    /// gpt-oss harmony channels: `analysis` is reasoning (parsed with the harmony tool format).
    GptOss,
}

impl ReasoningKind {
    /// Every name `frontend.reasoning_parser` takes.
    pub const NAMES: [&'static str; 13] = [
        "basic",
        "qwen3",
        "nemotron_deci",
        "glm45",
        "deepseek_r1",
        "step3",
        "nemotron_nano",
        "nemotron3",
        "kimi",
        "kimi_k25",
        "mistral",
        "granite",
        "gpt_oss",
    ];

    /// The format a parser name stands for.
    pub fn from_name(name: &str) -> Option<ReasoningKind> {
        Some(match name {
            "basic" | "qwen3" | "nemotron_deci" | "glm45" | "deepseek_r1" | "step3" | "nemotron_nano" | "nemotron3" => {
                ReasoningKind::Think
            }
            "kimi_k25" => ReasoningKind::KimiK25,
            "kimi" => ReasoningKind::Kimi,
            "mistral" => ReasoningKind::Mistral,
            "granite" => ReasoningKind::Granite,
            "gpt_oss" => ReasoningKind::GptOss,
            _ => return None,
        })
    }

    /// Every marker this parser reads in an answer: what must stay in the decoded text for it
    /// (a special token whose text is part of one is not dropped from the answer).
    pub fn markers(self) -> impl Iterator<Item = &'static str> {
        [self.open(), self.close(), self.close_kept()].into_iter().flatten().copied()
    }

    fn open(self) -> &'static [&'static str] {
        match self {
            ReasoningKind::Think | ReasoningKind::KimiK25 => &["<think>"],
            ReasoningKind::Kimi => &["◁think▷"],
            ReasoningKind::Mistral => &["[THINK]"],
            ReasoningKind::Granite => &["Here is my thought process:", "Here's my thought process:"],
            ReasoningKind::GptOss => &["<|channel|>analysis<|message|>"],
        }
    }

    /// Markers that end the reasoning and are consumed with it.
    fn close(self) -> &'static [&'static str] {
        match self {
            ReasoningKind::Think | ReasoningKind::KimiK25 => &["</think>"],
            ReasoningKind::Kimi => &["◁/think▷"],
            ReasoningKind::Mistral => &["[/THINK]"],
            ReasoningKind::Granite => &[
                "Here is my response:",
                " Here is my response:",
                "\nHere is my response:",
                "Here's my response:",
                " Here's my response:",
                "\nHere's my response:",
            ],
            ReasoningKind::GptOss => &["<|end|>"],
        }
    }

    /// Markers that end the reasoning and stay in the text (for the tool parser).
    fn close_kept(self) -> &'static [&'static str] {
        match self {
            ReasoningKind::KimiK25 => &["<|tool_calls_section_begin|>", "<|tool_call_section_begin|>"],
            _ => &[],
        }
    }

    /// Whitespace right after a marker belongs to neither side (Granite's phrases are written
    /// as prose with a space after them).
    fn skips_space_after_markers(self) -> bool {
        self == ReasoningKind::Granite
    }

    /// Whether an answer to `prompt` starts inside reasoning: the prompt's last open marker comes
    /// after its last close marker (a template that appends `<think>` to the generation header).
    pub fn starts_in_reasoning(self, prompt: &str) -> bool {
        let last = |markers: &[&str]| markers.iter().filter_map(|m| prompt.rfind(m)).max();
        match (last(self.open()), last(self.close())) {
            (Some(open), Some(close)) => open > close,
            (Some(_), None) => true,
            _ => false,
        }
    }
}

/// A streaming reasoning parser.
#[derive(Debug)]
pub struct ReasoningParser {
    kind: ReasoningKind,
    in_reasoning: bool,
    /// In reasoning, and nothing of it seen yet: an open marker here is the block's own (a
    /// template that opened the block may still see the model write `<think>`).
    at_block_start: bool,
    /// Whitespace after a marker is dropped ([`ReasoningKind::skips_space_after_markers`]).
    skipping_space: bool,
    buf: String,
}

impl ReasoningParser {
    /// A parser for `kind`, starting inside reasoning when `in_reasoning`.
    pub fn new(kind: ReasoningKind, in_reasoning: bool) -> ReasoningParser {
        ReasoningParser { kind, in_reasoning, at_block_start: in_reasoning, skipping_space: false, buf: String::new() }
    }

    /// Parses `text`, appending thinking and text to `out`.
    pub fn push(&mut self, text: &str, out: &mut Vec<Segment>) {
        super::in_slices(text, |slice| {
            self.buf.push_str(slice);
            self.drain(out, false);
        });
    }

    /// Flushes what was held back.
    pub fn finish(&mut self, out: &mut Vec<Segment>) {
        self.drain(out, true);
    }

    fn drain(&mut self, out: &mut Vec<Segment>, end: bool) {
        loop {
            if self.skipping_space {
                let kept = self.buf.trim_start_matches([' ', '\t']).len();
                self.buf.drain(..self.buf.len() - kept);
                if self.buf.is_empty() && !end {
                    return;
                }
                self.skipping_space = false;
            }
            if self.in_reasoning && self.at_block_start {
                // A redundant open marker at the very start of a block the prompt opened.
                let open = self.kind.open();
                let lead = self.buf.len() - self.buf.trim_start().len();
                let rest = &self.buf[lead..];
                if let Some(m) = open.iter().find(|m| rest.starts_with(**m)) {
                    self.buf.drain(..lead + m.len());
                    self.at_block_start = false;
                    self.skipping_space = self.kind.skips_space_after_markers();
                    continue;
                }
                if !end && open.iter().any(|m| m.starts_with(rest)) {
                    return;
                }
                self.at_block_start = false;
            }
            if self.in_reasoning {
                let close = self.kind.close();
                let kept = self.kind.close_kept();
                let markers: Vec<&str> = close.iter().chain(kept).copied().collect();
                match scan(&self.buf, &markers) {
                    Scan::Found { at, marker } => {
                        push_thinking(out, &self.buf[..at]);
                        let consumed = if marker < close.len() { at + markers[marker].len() } else { at };
                        self.buf.drain(..consumed);
                        self.in_reasoning = false;
                        self.skipping_space = self.kind.skips_space_after_markers();
                    }
                    Scan::Partial { safe } => {
                        let emit = if end { self.buf.len() } else { safe };
                        push_thinking(out, &self.buf[..emit]);
                        self.buf.drain(..emit);
                        return;
                    }
                }
            } else {
                match scan(&self.buf, self.kind.open()) {
                    Scan::Found { at, marker } => {
                        push_text(out, &self.buf[..at]);
                        self.buf.drain(..at + self.kind.open()[marker].len());
                        self.in_reasoning = true;
                        self.skipping_space = self.kind.skips_space_after_markers();
                    }
                    Scan::Partial { safe } => {
                        let emit = if end { self.buf.len() } else { safe };
                        push_text(out, &self.buf[..emit]);
                        self.buf.drain(..emit);
                        return;
                    }
                }
            }
        }
    }
}
