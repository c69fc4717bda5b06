//! Our parsers against `dynamo-parsers` 11.0.1: where the two agree on the spec's vectors, where
//! they differ (and which is right by the model's format), and MB/s on long streams.
//!
//! Run: `cd benches/peers/parsers && cargo run --release` (`PASSES=N` for more timing passes).
//!
//! Dynamo's reasoning parsers stream (`parse_reasoning_streaming_incremental`); its tool-call
//! parsers here are batch (`detect_and_parse_tool_call`: its streaming "jail" lives in
//! `dynamo-llm`, not in this crate). So the reasoning rows compare streaming with streaming and
//! the tool rows batch with batch; ours streaming the same tool text is a row of its own.

#![allow(dead_code, unreachable_pub)]

#[path = "../../../../runtime/src/frontend/parsers/mod.rs"]
mod parsers;

use std::time::Instant;

use dynamo_parsers::reasoning::{ReasoningParser as _, ReasoningParserType};
use parsers::{AnswerParser, ReasoningKind, Segment, ToolFormat};
use serde_json::Value;

/// What one parser made of an answer: all thinking, all text, and the calls (name, arguments).
#[derive(Debug, Default, PartialEq)]
struct Outcome {
    thinking: String,
    text: String,
    calls: Vec<(String, Value)>,
}

/// Our parser's segments for `chunks`: what the throughput rows time.
fn segments(reasoning: Option<&str>, tools: Option<&str>, chunks: &[&str]) -> Vec<Segment> {
    let mut parser =
        AnswerParser::new(reasoning.and_then(ReasoningKind::from_name), tools.and_then(ToolFormat::from_name), false);
    let mut out = Vec::new();
    for chunk in chunks {
        parser.push(chunk, &mut out);
    }
    parser.finish(&mut out);
    out
}

fn ours(reasoning: Option<&str>, tools: Option<&str>, in_reasoning: bool, chunks: &[&str]) -> Outcome {
    let mut parser = AnswerParser::new(
        reasoning.and_then(ReasoningKind::from_name),
        tools.and_then(ToolFormat::from_name),
        in_reasoning,
    );
    let mut segments = Vec::new();
    for chunk in chunks {
        parser.push(chunk, &mut segments);
    }
    parser.finish(&mut segments);
    let mut out = Outcome::default();
    for s in segments {
        match s {
            Segment::Thinking(t) => out.thinking.push_str(&t),
            Segment::Text(t) => out.text.push_str(&t),
            Segment::ToolCall(c) => out.calls.push((c.name, serde_json::from_str(&c.arguments).unwrap_or(Value::Null))),
            // A streamed call's pieces: the complete call that follows carries all of them.
            Segment::ToolCallStart { .. } | Segment::ToolCallArgs(_) => {}
        }
    }
    out
}

fn reasoning_type(name: &str) -> ReasoningParserType {
    match name {
        "deepseek_r1" => ReasoningParserType::DeepseekR1,
        "kimi_k25" => ReasoningParserType::KimiK25,
        "kimi" => ReasoningParserType::Kimi,
        "mistral" => ReasoningParserType::Mistral,
        "granite" => ReasoningParserType::Granite,
        "gpt_oss" => ReasoningParserType::GptOss,
        "basic" => ReasoningParserType::Basic,
        _ => ReasoningParserType::Qwen,
    }
}

fn theirs(rt: &tokio::runtime::Runtime, reasoning: Option<&str>, tools: Option<&str>, in_reasoning: bool, chunks: &[&str]) -> Outcome {
    let mut out = Outcome::default();
    let mut normal = String::new();
    match reasoning {
        Some(name) => {
            let mut p = reasoning_type(name).get_reasoning_parser();
            if in_reasoning {
                p.set_in_reasoning(true);
            }
            for chunk in chunks {
                let r = p.parse_reasoning_streaming_incremental(chunk, &[]);
                out.thinking.push_str(&r.reasoning_text);
                normal.push_str(&r.normal_text);
            }
            let r = p.finish_reasoning_stream();
            out.thinking.push_str(&r.reasoning_text);
            normal.push_str(&r.normal_text);
        }
        None => normal = chunks.concat(),
    }
    match tools {
        Some(name) => match rt.block_on(dynamo_parsers::tool_calling::detect_and_parse_tool_call(&normal, Some(name), None)) {
            Ok((calls, text)) => {
                out.text = text.unwrap_or_default();
                out.calls = calls
                    .into_iter()
                    .map(|c| (c.function.name, serde_json::from_str(&c.function.arguments).unwrap_or(Value::Null)))
                    .collect();
            }
            Err(e) => out.text = format!("(error: {e})"),
        },
        None => out.text = normal,
    }
    out
}

/// The spec's vectors (`shared/research/agentic-frontend.md` §4.4) and ours: reasoning parser,
/// tool parser, starts in reasoning, the answer.
const VECTORS: &[(&str, Option<&str>, Option<&str>, bool, &str)] = &[
    ("1", Some("qwen3"), None, false, "<think>\nList files.\n</think>\n\nI'll look."),
    ("2", Some("deepseek_r1"), None, true, "Need weather.</think>It is sunny."),
    ("3", Some("kimi_k25"), None, true, "<think>reasoning here</think>Hello!"),
    ("4", Some("qwen3"), Some("hermes"), true, "plan think</think>\n<tool_call>\n{\"name\": \"ls\", \"arguments\": {}}\n</tool_call>"),
    ("5", Some("qwen3"), Some("hermes"), false, "<think>r1</think><tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call><think>r2</think><tool_call>{\"name\":\"b\",\"arguments\":{}}</tool_call>"),
    ("6", None, Some("hermes"), false, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"SF\"}}\n</tool_call>"),
    ("7", None, Some("qwen3_coder"), false, "<tool_call>\n<function=execute_bash>\n<parameter=command>\npwd && ls\n</parameter>\n</function>\n</tool_call>"),
    ("8", None, Some("qwen3_coder"), false, "I'll help you with that. <tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n</parameter>\n</function>\n</tool_call> Let me check that for you."),
    ("9", None, Some("qwen3_coder"), false, "<tool_call>\n<function=run_query>\n<parameter=sql>\nSELECT * FROM users\n</tool_call>"),
    ("10", None, Some("glm47"), false, "I'll check the weather for you. <tool_call>get_weather<arg_key>location</arg_key><arg_value>Paris</arg_value></tool_call>"),
    ("11", None, Some("kimi_k2"), false, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"location\":\"NYC\"}<|tool_call_end|><|tool_calls_section_end|>"),
    ("12", None, Some("kimi_k2"), false, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"location\":\"NYC\"}<|tool_call_end|>"),
    ("13", Some("gpt_oss"), Some("harmony"), false, "<|channel|>analysis<|message|>Need to use function get_current_weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_current_weather <|constrain|>json<|message|>{\"location\":\"San Francisco\"}<|call|>"),
    ("15", None, Some("deepseek_v3_1"), false, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_current_weather<｜tool▁sep｜>{\"location\": \"Tokyo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ("16", None, Some("pythonic"), false, "Hey yo ! [foo(a=1, b=2), bar(x=3)] Hey yo"),
    ("17", None, Some("llama3_json"), false, "<|python_tag|>{\"name\": \"search\", \"parameters\": {\"query\": \"rust\"}}"),
    ("18", None, Some("hermes"), false, "Use the <tool> tag, and 1 < 2."),
    ("19a", Some("mistral"), None, true, "[THINK]p[/THINK]a"),
    ("19b", Some("kimi"), None, false, "◁think▷p◁/think▷a"),
    ("19c", Some("granite"), None, false, "Here is my thought process: p Here is my response: a"),
    ("m1", None, Some("mistral"), false, "[TOOL_CALLS]get_weather{\"city\": \"Paris\"}"),
    ("m2", None, Some("mistral"), false, "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}}]"),
    ("p1", None, Some("phi4"), false, "functools[{\"name\": \"f\", \"arguments\": {\"x\": 1}}]"),
    ("j1", None, Some("jamba"), false, "<tool_calls>[{\"name\": \"f\", \"arguments\": {}}]</tool_calls>"),
    ("n1", None, Some("nemotron_deci"), false, "<TOOLCALL>[{\"name\": \"f\", \"arguments\": {}}]</TOOLCALL>"),
    ("x1", None, Some("minimax_m2"), false, "<minimax:tool_call><invoke name=\"f\"><parameter name=\"k\">v</parameter></invoke></minimax:tool_call>"),
    ("split", Some("qwen3"), Some("hermes"), true, "plan think<<|SPLIT|>/think>\n<tool_call>\n{\"name\": \"ls\", \"arguments\": {}}\n</tool_call>"),
];

/// A `text` split into chunks of about `n` bytes, on character boundaries.
fn chunked(text: &str, n: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < text.len() {
        let mut end = (start + n).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        out.push(&text[start..end]);
        start = end;
    }
    out
}

fn best_of(passes: usize, mut f: impl FnMut()) -> f64 {
    (0..passes)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    println!("## Vectors: ours vs dynamo-parsers 11.0.1 (thinking / text / calls)\n");
    println!("Fed whole (one chunk), and a character at a time (what a detokenizer may hand over for");
    println!("multi-byte characters and split markers). `split` feeds `plan think<` then the rest.\n");
    println!("| # | parsers | whole: agree | characters: agree | ours | theirs, whole | theirs, characters |");
    println!("|---|---|---|---|---|---|---|");
    let (mut agree_whole, mut agree_chars) = (0, 0);
    // Dynamo trims the text it returns beside tool calls; compare without the ends' spaces.
    let same = |a: &Outcome, b: &Outcome| a.thinking.trim() == b.thinking.trim() && a.text.trim() == b.text.trim() && a.calls == b.calls;
    for &(id, reasoning, tools, in_reasoning, input) in VECTORS {
        let (whole, chars): (Vec<String>, Vec<String>) = if input.contains("<|SPLIT|>") {
            let parts: Vec<String> = input.split("<|SPLIT|>").map(str::to_owned).collect();
            (parts.clone(), parts)
        } else {
            (vec![input.to_owned()], input.chars().map(String::from).collect())
        };
        let whole: Vec<&str> = whole.iter().map(String::as_str).collect();
        let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
        let a = ours(reasoning, tools, in_reasoning, &whole);
        assert_eq!(a, ours(reasoning, tools, in_reasoning, &chars), "ours is the same for any chunking");
        let b_whole = theirs(&rt, reasoning, tools, in_reasoning, &whole);
        let b_chars = theirs(&rt, reasoning, tools, in_reasoning, &chars);
        let (w, c) = (same(&a, &b_whole), same(&a, &b_chars));
        agree_whole += usize::from(w);
        agree_chars += usize::from(c);
        let names = format!("{} + {}", reasoning.unwrap_or("-"), tools.unwrap_or("-"));
        let mark = |ok: bool| if ok { "yes" } else { "**no**" };
        let chars_col = if b_chars == b_whole { "(same)".to_owned() } else { format!("{b_chars:?}") };
        println!("| {id} | {names} | {} | {} | {a:?} | {b_whole:?} | {chars_col} |", mark(w), mark(c));
    }
    println!("\nAgree: {agree_whole} of {n} fed whole, {agree_chars} of {n} a character at a time.\n", n = VECTORS.len());

    let passes: usize = std::env::var("PASSES").ok().and_then(|p| p.parse().ok()).unwrap_or(5);
    println!("## Throughput (best of {passes} passes, MB/s of answer text)\n");
    println!("| stream | ours | dynamo-parsers | ours ÷ theirs |");
    println!("|---|---|---|---|");

    // Reasoning, streamed in 4-byte pieces (about a token each): 4 MiB of think / answer turns.
    let turn = format!("<think>{}</think>{}", "Let me look at the files first. ".repeat(12), "Here is the plan: edit main.rs. ".repeat(18));
    let reasoning_text = turn.repeat((4 << 20) / turn.len());
    let pieces = chunked(&reasoning_text, 4);
    let mb = reasoning_text.len() as f64 / 1e6;
    let ours_s = best_of(passes, || {
        let mut p = AnswerParser::new(Some(ReasoningKind::Think), None, false);
        let mut out = Vec::new();
        for piece in &pieces {
            p.push(piece, &mut out);
            out.clear();
        }
        p.finish(&mut out);
    });
    let theirs_s = best_of(passes, || {
        let mut p = ReasoningParserType::Qwen.get_reasoning_parser();
        for piece in &pieces {
            std::hint::black_box(p.parse_reasoning_streaming_incremental(piece, &[]));
        }
        std::hint::black_box(p.finish_reasoning_stream());
    });
    println!("| qwen3 reasoning, 4-byte pieces | {:.1} | {:.1} | {:.2}× |", mb / ours_s, mb / theirs_s, theirs_s / ours_s);

    // Tool calls, batch: 1 MiB of text with a Hermes call every ~1 KiB.
    let unit = format!(
        "{}<tool_call>\n{{\"name\": \"read_file\", \"arguments\": {{\"path\": \"src/main.rs\", \"lines\": [1, 200]}}}}\n</tool_call>",
        "I will read the file and then decide what to change next. ".repeat(15)
    );
    let tool_text = unit.repeat((1 << 20) / unit.len());
    let mb = tool_text.len() as f64 / 1e6;
    // Each side timed on its own output: our segments (text and calls), their calls and text.
    let ours_s = best_of(passes, || {
        std::hint::black_box(segments(None, Some("hermes"), &[&tool_text]));
    });
    let theirs_s = best_of(passes, || {
        std::hint::black_box(rt.block_on(dynamo_parsers::tool_calling::detect_and_parse_tool_call(&tool_text, Some("hermes"), None)).ok());
    });
    println!("| hermes tool calls, batch | {:.1} | {:.1} | {:.2}× |", mb / ours_s, mb / theirs_s, theirs_s / ours_s);
    let pieces = chunked(&tool_text, 4);
    let ours_stream_s = best_of(passes, || {
        std::hint::black_box(segments(None, Some("hermes"), &pieces));
    });
    println!("| hermes tool calls, ours streamed in 4-byte pieces | {:.1} | (batch only here) | |", mb / ours_stream_s);
}
