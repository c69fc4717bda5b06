//! Every vector of the spec (`shared/research/agentic-frontend.md` §4.4) and more, each fed whole,
//! split at every character, one character at a time, and in random chunks: the same segments
//! every time.

use super::*;

fn think(s: &str) -> Segment {
    Segment::Thinking(s.to_owned())
}

fn text(s: &str) -> Segment {
    Segment::Text(s.to_owned())
}

fn call(name: &str, arguments: &str) -> Segment {
    Segment::ToolCall(ToolCall { id: None, name: name.to_owned(), arguments: arguments.to_owned() })
}

/// Consecutive text (or thinking) pieces as one, and a streamed call as the call it completes
/// as: what a client sees as blocks. A streamed call's pieces must add up to its arguments.
fn blocks(segments: Vec<Segment>) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut streamed: Option<(String, String)> = None;
    for s in segments {
        match s {
            Segment::ToolCallStart { name, .. } => {
                assert!(streamed.is_none(), "a call starts while another streams");
                streamed = Some((name, String::new()));
            }
            Segment::ToolCallArgs(t) => streamed.as_mut().expect("arguments of a started call").1.push_str(&t),
            Segment::ToolCall(call) => {
                if let Some((name, args)) = streamed.take() {
                    assert_eq!(call.name, name, "the call that streamed completes");
                    assert!(call.arguments.starts_with(&args), "{:?} continues {args:?}", call.arguments);
                }
                push_segment(&mut out, Segment::ToolCall(call));
            }
            other => {
                assert!(streamed.is_none(), "{other:?} while a call streams");
                push_segment(&mut out, other);
            }
        }
    }
    assert!(streamed.is_none(), "a streamed call completes");
    out
}

fn parse_chunks(make: &dyn Fn() -> AnswerParser, chunks: &[&str]) -> Vec<Segment> {
    let mut parser = make();
    let mut out = Vec::new();
    for chunk in chunks {
        parser.push(chunk, &mut out);
    }
    parser.finish(&mut out);
    blocks(out)
}

/// Splits `s` at character boundaries chosen by `seed`.
fn random_chunks(s: &str, seed: u64) -> Vec<&str> {
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::new();
    let mut start = 0;
    while start < s.len() {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let mut end = (start + 1 + (rng % 9) as usize).min(s.len());
        while !s.is_char_boundary(end) {
            end += 1;
        }
        out.push(&s[start..end]);
        start = end;
    }
    out
}

/// `input` gives `expected` whole, at every split, a character at a time and in random chunks.
fn check(make: &dyn Fn() -> AnswerParser, input: &str, expected: &[Segment]) {
    assert_eq!(parse_chunks(make, &[input]), expected, "whole: {input:?}");
    for (at, _) in input.char_indices().skip(1) {
        let got = parse_chunks(make, &[&input[..at], &input[at..]]);
        assert_eq!(got, expected, "split at {at}: {:?} | {:?}", &input[..at], &input[at..]);
    }
    let chars: Vec<String> = input.chars().map(String::from).collect();
    let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(parse_chunks(make, &chars), expected, "a character at a time: {input:?}");
    for seed in 0..16 {
        let chunks = random_chunks(input, seed);
        assert_eq!(parse_chunks(make, &chunks), expected, "chunks {chunks:?}");
    }
}

fn with(reasoning: Option<&str>, tools: Option<&str>, in_reasoning: bool) -> impl Fn() -> AnswerParser {
    let reasoning = reasoning.map(|n| ReasoningKind::from_name(n).expect("reasoning parser"));
    let tools = tools.map(|n| ToolFormat::from_name(n).expect("tool parser"));
    move || AnswerParser::new(reasoning, tools, in_reasoning)
}

#[test]
fn every_name_is_known() {
    for name in ReasoningKind::NAMES {
        assert!(ReasoningKind::from_name(name).is_some(), "{name}");
    }
    for name in ToolFormat::NAMES {
        assert!(ToolFormat::from_name(name).is_some(), "{name}");
    }
    assert!(ReasoningKind::from_name("nope").is_none() && ToolFormat::from_name("nope").is_none());
}

#[test]
fn think_tags_keep_raw_whitespace_and_interleave() {
    // Vector 1.
    check(
        &with(Some("qwen3"), None, false),
        "<think>\nList files.\n</think>\n\nI'll look.",
        &[think("\nList files.\n"), text("\n\nI'll look.")],
    );
    // Vector 2: the template opened the block.
    check(
        &with(Some("deepseek_r1"), None, true),
        "Need weather.</think>It is sunny.",
        &[think("Need weather."), text("It is sunny.")],
    );
    // A model that writes `<think>` again although the prompt opened it.
    check(&with(Some("deepseek_r1"), None, true), "<think>plan</think>go", &[think("plan"), text("go")]);
    // Think, answer, think again.
    check(
        &with(Some("basic"), None, false),
        "<think>a</think>b<think>c</think>d",
        &[think("a"), text("b"), think("c"), text("d")],
    );
    // No reasoning at all, and an unclosed block at a length stop.
    check(&with(Some("qwen3"), None, false), "just 1 < 2 text", &[text("just 1 < 2 text")]);
    check(&with(Some("qwen3"), None, false), "<think>cut off", &[think("cut off")]);
    // A lone `<` at a chunk's end is held back (PR #10569's failure).
    assert_eq!(
        parse_chunks(&with(Some("qwen3"), None, true), &["plan think<", "/think>done"]),
        [think("plan think"), text("done")]
    );
}

#[test]
fn the_other_reasoning_families() {
    // Vector 3.
    assert_eq!(
        parse_chunks(&with(Some("kimi_k25"), None, true), &["<thi", "nk>reasoning here", "</think>Hello!"]),
        [think("reasoning here"), text("Hello!")]
    );
    check(&with(Some("kimi_k25"), None, true), "<think></think>Hello", &[text("Hello")]);
    // Vector 19.
    check(&with(Some("mistral"), None, true), "[THINK]p[/THINK]a", &[think("p"), text("a")]);
    check(&with(Some("kimi"), None, false), "◁think▷p◁/think▷a", &[think("p"), text("a")]);
    check(
        &with(Some("granite"), None, false),
        "Here is my thought process: p Here is my response: a",
        &[think("p"), text("a")],
    );
    check(
        &with(Some("granite"), None, false),
        "Here's my thought process:\nplan\nHere's my response: ok",
        &[think("\nplan"), text("ok")],
    );
}

#[test]
fn the_start_state_comes_from_the_prompt() {
    let think = ReasoningKind::Think;
    assert!(think.starts_in_reasoning("<|im_start|>assistant\n<think>\n"));
    assert!(!think.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    assert!(!think.starts_in_reasoning("<|im_start|>assistant\n"));
    assert!(ReasoningKind::Mistral.starts_in_reasoning("[INST]hi[/INST][THINK]"));
}

#[test]
fn reasoning_then_tool_calls() {
    // Vector 4: started in reasoning, a split close marker, then a Hermes call.
    let qwen = with(Some("qwen3"), Some("hermes"), true);
    let input = "plan think</think>\n<tool_call>\n{\"name\": \"ls\", \"arguments\": {}}\n</tool_call>";
    check(&qwen, input, &[think("plan think"), text("\n"), call("ls", "{}")]);
    assert_eq!(
        parse_chunks(
            &qwen,
            &["plan think<", "/think>\n<tool_call>\n{\"name\": \"ls\", \"arguments\": {}}\n</tool_call>"]
        ),
        [think("plan think"), text("\n"), call("ls", "{}")]
    );
    // Vector 5: think / tool / think / tool.
    let input = "<think>r1</think><tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call><think>r2</think>\
                 <tool_call>{\"name\":\"b\",\"arguments\":{}}</tool_call>";
    check(
        &with(Some("qwen3"), Some("hermes"), false),
        input,
        &[think("r1"), call("a", "{}"), think("r2"), call("b", "{}")],
    );
    // A tool call in the same chunk as the end of reasoning keeps the reasoning before it.
    assert_eq!(
        parse_chunks(&qwen, &["why</think><tool_call>{\"name\":\"x\",\"arguments\":{\"k\":1}}</tool_call>"]),
        [think("why"), call("x", "{\"k\":1}")]
    );
}

#[test]
fn json_tool_formats() {
    // Vector 6: arguments as the model wrote them, key order and spacing kept.
    check(
        &with(None, Some("hermes"), false),
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"SF\", \"a\": [1, 2]}}\n</tool_call>",
        &[call("get_weather", "{\"city\": \"SF\", \"a\": [1, 2]}")],
    );
    // Vector 18: no call, and nothing hangs at the end.
    check(
        &with(None, Some("hermes"), false),
        "Use the <tool> tag, and 1 < 2.",
        &[text("Use the <tool> tag, and 1 < 2.")],
    );
    // A start marker whose body is not a call is text, byte for byte.
    check(
        &with(None, Some("hermes"), false),
        "a <tool_call>oops</tool_call> b",
        &[text("a <tool_call>oops</tool_call> b")],
    );
    check(
        &with(None, Some("hermes"), false),
        "a <tool_call>{\"name\": \"f\"",
        &[text("a <tool_call>{\"name\": \"f\"")],
    );
    // Parallel calls with text between.
    check(
        &with(None, Some("hermes"), false),
        "x<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>y<tool_call>{\"name\":\"b\",\"arguments\":\"{\\\"q\\\": 1}\"}</tool_call>",
        &[text("x"), call("a", "{}"), text("y"), call("b", "{\"q\": 1}")],
    );
    // Vector 17, and a bare call opening the answer, and `;`-separated calls.
    check(
        &with(None, Some("llama3_json"), false),
        "<|python_tag|>{\"name\": \"search\", \"parameters\": {\"query\": \"rust\"}}",
        &[call("search", "{\"query\": \"rust\"}")],
    );
    check(
        &with(None, Some("llama3_json"), false),
        " {\"name\": \"f\", \"parameters\": {}}; {\"name\": \"g\", \"parameters\": {\"x\": 1}}",
        &[call("f", "{}"), call("g", "{\"x\": 1}")],
    );
    check(
        &with(None, Some("llama3_json"), false),
        "The answer is {\"name\": 1}.",
        &[text("The answer is {\"name\": 1}.")],
    );
    // Mistral, both forms.
    check(
        &with(None, Some("mistral"), false),
        "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"a\": 1}}, {\"name\": \"g\", \"arguments\": {}}]",
        &[call("f", "{\"a\": 1}"), call("g", "{}")],
    );
    check(
        &with(None, Some("mistral"), false),
        "ok[TOOL_CALLS]get_weather{\"city\": \"Paris\"}[TOOL_CALLS]now[ARGS]{}",
        &[text("ok"), call("get_weather", "{\"city\": \"Paris\"}"), call("now", "{}")],
    );
    // The list formats.
    check(
        &with(None, Some("nemotron_deci"), false),
        "<TOOLCALL>[{\"name\": \"f\", \"arguments\": {}}]</TOOLCALL>",
        &[call("f", "{}")],
    );
    check(
        &with(None, Some("jamba"), false),
        "<tool_calls>[{\"name\": \"f\", \"arguments\": {\"x\": \"]\"}}]</tool_calls>",
        &[call("f", "{\"x\": \"]\"}")],
    );
    check(
        &with(None, Some("phi4"), false),
        "functools[{\"name\": \"f\", \"arguments\": {\"x\": \"[\"}}] after",
        &[call("f", "{\"x\": \"[\"}"), text(" after")],
    );
}

#[test]
fn tagged_tool_formats() {
    // Vector 7.
    check(
        &with(None, Some("qwen3_coder"), false),
        "<tool_call>\n<function=execute_bash>\n<parameter=command>\npwd && ls\n</parameter>\n</function>\n</tool_call>",
        &[call("execute_bash", "{\"command\": \"pwd && ls\"}")],
    );
    // Vector 8: the text on both sides is kept as written.
    check(
        &with(None, Some("qwen3_coder"), false),
        "I'll help you with that. <tool_call>\n<function=get_weather>\n<parameter=city>\nDallas\n</parameter>\n</function>\n</tool_call> Let me check that for you.",
        &[
            text("I'll help you with that. "),
            call("get_weather", "{\"city\": \"Dallas\"}"),
            text(" Let me check that for you."),
        ],
    );
    // Vector 9: a missing `</parameter>`. Dynamo (after SGLang) puts `\n</tool_call>` into the
    // value; the call ended at `</tool_call>`, so the value ends there too.
    check(
        &with(None, Some("qwen3_coder"), false),
        "<tool_call>\n<function=run_query>\n<parameter=sql>\nSELECT * FROM users\n</tool_call>",
        &[call("run_query", "{\"sql\": \"SELECT * FROM users\"}")],
    );
    // Cut off by a length stop: what was read is the call.
    check(
        &with(None, Some("qwen3_coder"), false),
        "<tool_call>\n<function=f>\n<parameter=p>\n1 &lt; 2\n",
        &[call("f", "{\"p\": \"1 < 2\"}")],
    );
    // Vector 10.
    check(
        &with(None, Some("glm47"), false),
        "I'll check the weather for you. <tool_call>get_weather<arg_key>location</arg_key><arg_value>Paris</arg_value><arg_key>opts</arg_key><arg_value>{\"a\":1}</arg_value></tool_call>",
        &[
            text("I'll check the weather for you. "),
            call("get_weather", "{\"location\": \"Paris\", \"opts\": {\"a\": 1}}"),
        ],
    );
    check(&with(None, Some("glm47"), false), "<tool_call>now</tool_call>", &[call("now", "{}")]);
    check(
        &with(None, Some("minimax_m2"), false),
        "<minimax:tool_call><invoke name=\"f\"><parameter name=\"k\">v</parameter><parameter name=\"n\">3</parameter></invoke></minimax:tool_call>",
        &[call("f", "{\"k\": \"v\", \"n\": 3}")],
    );
    check(
        &with(None, Some("deepseek_v3_2"), false),
        "<｜DSML｜function_calls><｜DSML｜invoke name=\"f\"><｜DSML｜parameter name=\"k\" string=\"true\">42</｜DSML｜parameter><｜DSML｜parameter name=\"n\" string=\"false\">42</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜function_calls>",
        &[call("f", "{\"k\": \"42\", \"n\": 42}")],
    );
}

#[test]
fn section_tool_formats() {
    // Vectors 11 and 12: Kimi keeps its ids, and a missing section end is recovered.
    let kimi = "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"location\":\"NYC\"}<|tool_call_end|>";
    let expected = [Segment::ToolCall(ToolCall {
        id: Some("functions.get_weather:0".into()),
        name: "get_weather".into(),
        arguments: "{\"location\":\"NYC\"}".into(),
    })];
    check(&with(None, Some("kimi_k2"), false), &format!("{kimi}<|tool_calls_section_end|>"), &expected);
    check(&with(None, Some("kimi_k2"), false), kimi, &expected);
    // Kimi K2.5 ends reasoning at the tool section.
    check(
        &with(Some("kimi_k25"), Some("kimi_k2"), true),
        &format!("need weather{kimi}<|tool_calls_section_end|>"),
        &[think("need weather"), expected[0].clone()],
    );
    // Vector 15.
    check(
        &with(None, Some("deepseek_v3_1"), false),
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_current_weather<｜tool▁sep｜>{\"location\": \"Tokyo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        &[call("get_current_weather", "{\"location\": \"Tokyo\"}")],
    );
    check(
        &with(None, Some("deepseek_v3"), false),
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Rome\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        &[call("get_weather", "{\"city\": \"Rome\"}")],
    );
}

#[test]
fn pythonic_calls() {
    // Vector 16: the trailing text is kept (Dynamo drops it).
    check(
        &with(None, Some("pythonic"), false),
        "Hey yo ! [foo(a=1, b=2), bar(x=3)] Hey yo",
        &[text("Hey yo ! "), call("foo", "{\"a\": 1, \"b\": 2}"), call("bar", "{\"x\": 3}"), text(" Hey yo")],
    );
    check(
        &with(None, Some("pythonic"), false),
        "<|python_start|>[f(s='a]b', l=[1, 2], d={'k': None}, t=True)]<|python_end|>",
        &[call("f", "{\"s\": \"a]b\", \"l\": [1, 2], \"d\": {\"k\": null}, \"t\": true}")],
    );
    // Brackets that are not calls stay text.
    check(
        &with(None, Some("pythonic"), false),
        "a [1, 2] and [link](url) [x]",
        &[text("a [1, 2] and [link](url) [x]")],
    );
}

#[test]
fn harmony_channels() {
    // Vector 13, with and without the gpt_oss reasoning parser.
    let input = "<|channel|>analysis<|message|>Need to use function get_current_weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_current_weather <|constrain|>json<|message|>{\"location\":\"San Francisco\"}<|call|>";
    let weather = call("get_current_weather", "{\"location\":\"San Francisco\"}");
    check(
        &with(Some("gpt_oss"), Some("harmony"), false),
        input,
        &[think("Need to use function get_current_weather."), weather.clone()],
    );
    check(&with(None, Some("harmony"), false), input, &[text("Need to use function get_current_weather."), weather]);
    // Vector 14: a call on the analysis channel.
    check(
        &with(Some("gpt_oss"), None, false),
        "<|channel|>analysis to=functions.grep code<|message|>{\"pattern\":\"foo\"}<|call|>",
        &[call("grep", "{\"pattern\":\"foo\"}")],
    );
    // Reasoning, then the final answer.
    check(
        &with(Some("gpt_oss"), None, false),
        "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>The answer.<|return|>",
        &[think("think"), text("The answer.")],
    );
}

/// Pieces answers are made of: every format's markers, fragments of them, and text that looks
/// like them.
const PIECES: &[&str] = &[
    "<think>",
    "</think>",
    "<",
    "/",
    ">",
    "think",
    "◁think▷",
    "◁/think▷",
    "[THINK]",
    "[/THINK]",
    "Here is my thought process:",
    " Here is my response:",
    "<tool_call>",
    "</tool_call>",
    "{\"name\": \"f\", \"arguments\": {\"a\": 1}}",
    "<function=f>",
    "<parameter=p>",
    "</parameter>",
    "</function>",
    "<arg_key>k</arg_key><arg_value>v</arg_value>",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
    "<|tool_calls_section_end|>",
    "[TOOL_CALLS]",
    "[f(a=1)]",
    "[1, 2]",
    "<|python_tag|>",
    "functools",
    "<|channel|>analysis<|message|>",
    "<|channel|>final<|message|>",
    "<|end|>",
    "<|start|>assistant",
    " to=functions.g",
    "<|call|>",
    "{",
    "}",
    "[",
    "]",
    "\"",
    "hello ",
    "é",
    "🦀",
    "\n",
    " ",
    ";",
];

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]

    /// Any answer, fed in any chunks, gives the same blocks as fed whole, for every parser
    /// pairing; and without a tool parser nothing but markers is lost.
    #[test]
    fn chunking_never_changes_the_blocks(
        picks in proptest::collection::vec(0..PIECES.len(), 0..24),
        seed in 0u64..1000,
        reasoning in proptest::option::of(0..ReasoningKind::NAMES.len()),
        tools in proptest::option::of(0..ToolFormat::NAMES.len()),
        in_reasoning: bool,
    ) {
        let input: String = picks.iter().map(|&i| PIECES[i]).collect();
        let make = with(reasoning.map(|i| ReasoningKind::NAMES[i]), tools.map(|i| ToolFormat::NAMES[i]), in_reasoning);
        let whole = parse_chunks(&make, &[&input]);
        let chunks = random_chunks(&input, seed);
        proptest::prop_assert_eq!(parse_chunks(&make, &chunks), whole.clone(), "chunks {:?}", chunks);
        if reasoning.is_none() && tools.is_none() {
            proptest::prop_assert_eq!(whole, if input.is_empty() { vec![] } else { vec![text(&input)] });
        }
    }
}

/// The arguments said so far by `ToolCallArgs` pieces.
fn streamed_arguments(out: &[Segment]) -> String {
    out.iter()
        .filter_map(|s| match s {
            Segment::ToolCallArgs(t) => Some(t.as_str()),
            _ => None,
        })
        .collect()
}

/// Hermes arguments stream as they arrive: the name is said once the head is read, the
/// arguments piece by piece before the closing tag, and the call completes with all of them.
#[test]
fn hermes_arguments_stream_before_the_call_completes() {
    let input = "Let me look.<tool_call>\n{\"name\": \"write\", \"arguments\": {\"path\": \"a.rs\", \"text\": \"fn main() {}\"}}\n</tool_call>";
    let mut parser = AnswerParser::new(None, Some(ToolFormat::Hermes), false);
    let mut out = Vec::new();
    let close = input.find("</tool_call>").unwrap();
    for (at, c) in input.char_indices() {
        if at == close {
            let streamed = streamed_arguments(&out);
            assert_eq!(streamed, r#"{"path": "a.rs", "text": "fn main() {}"}"#, "all of it before the closing tag");
            assert!(out.iter().any(|s| matches!(s, Segment::ToolCallStart { name, .. } if name == "write")), "{out:?}");
            assert!(!out.iter().any(|s| matches!(s, Segment::ToolCall(_))), "not complete yet");
        }
        parser.push(&c.to_string(), &mut out);
    }
    parser.finish(&mut out);
    assert_eq!(blocks(out), [text("Let me look."), call("write", r#"{"path": "a.rs", "text": "fn main() {}"}"#)]);

    // A call that breaks off after its name still completes, with what came of it.
    let mut parser = AnswerParser::new(None, Some(ToolFormat::Hermes), false);
    let mut out = Vec::new();
    for c in "<tool_call>{\"name\": \"ls\", \"arguments\": {\"pa".chars() {
        parser.push(&c.to_string(), &mut out);
    }
    parser.finish(&mut out);
    assert_eq!(blocks(out), [call("ls", "{\"pa")]);
}

/// Several call objects in one `<tool_call>` (one after another, or as a list) are that many
/// calls, each with its own arguments as JSON; 50 of them once became one call whose arguments
/// were the rest of the text. A call object with more after its arguments streams only them.
#[test]
fn several_objects_in_one_hermes_tag_are_several_calls() {
    let objects: Vec<String> =
        (0..50).map(|i| format!("{{\"name\": \"f{i}\", \"arguments\": {{\"i\": {i}}}}}")).collect();
    let expected: Vec<Segment> = (0..50).map(|i| call(&format!("f{i}"), &format!("{{\"i\": {i}}}"))).collect();
    let hermes = with(None, Some("hermes"), false);
    check(&hermes, &format!("<tool_call>\n{}\n</tool_call>", objects.join("\n")), &expected);
    check(&hermes, &format!("<tool_call>[{}]</tool_call>", objects.join(", ")), &expected);
    for out in [parse_chunks(&hermes, &[&format!("<tool_call>{}</tool_call>", objects[..3].join(""))])] {
        for segment in &out {
            let Segment::ToolCall(c) = segment else { panic!("{segment:?}") };
            serde_json::from_str::<serde_json::Value>(&c.arguments).expect("arguments are JSON");
        }
        assert_eq!(out.len(), 3);
    }
    check(
        &hermes,
        "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"}\"}, \"id\": \"c1\"}</tool_call>",
        &[Segment::ToolCall(ToolCall { id: Some("c1".into()), name: "f".into(), arguments: "{\"a\": \"}\"}".into() })],
    );
}

/// gpt-oss calls stream their arguments too: the body of a message to `functions.f`, without the
/// whitespace around it.
#[test]
fn harmony_arguments_stream_before_the_call_completes() {
    let input = "<|channel|>commentary to=functions.ls <|constrain|>json<|message|> {\"path\": \".\"}\n<|call|>";
    let mut parser = AnswerParser::new(Some(ReasoningKind::GptOss), Some(ToolFormat::Harmony), false);
    let mut out = Vec::new();
    let close = input.find("<|call|>").unwrap();
    for (at, c) in input.char_indices() {
        if at == close {
            let streamed = streamed_arguments(&out);
            assert_eq!(streamed, "{\"path\": \".\"}", "{out:?}");
        }
        parser.push(&c.to_string(), &mut out);
    }
    parser.finish(&mut out);
    assert_eq!(blocks(out), [call("ls", "{\"path\": \".\"}")]);
}

/// A long call streamed in small pieces is scanned once, not once per piece: 256 KiB of
/// arguments in 3-byte pieces parse (a parser that rescans its buffer would take hours here).
#[test]
fn a_long_streamed_call_is_linear() {
    let content = "x".repeat(256 << 10);
    let arguments = format!("{{\"path\": \"big.txt\", \"content\": \"{content}\"}}");
    let input = format!("<tool_call>\n{{\"name\": \"write\", \"arguments\": {arguments}}}\n</tool_call>");
    let mut parser = AnswerParser::new(ReasoningKind::from_name("qwen3"), Some(ToolFormat::Hermes), false);
    let mut out = Vec::new();
    for piece in input.as_bytes().chunks(3) {
        parser.push(std::str::from_utf8(piece).unwrap(), &mut out);
    }
    parser.finish(&mut out);
    assert_eq!(blocks(out), [call("write", &arguments)]);
}

/// Kimi-K2's calls stream one by one inside their section: each says its name and id when its
/// arguments begin, its arguments as they arrive, and completes at its own end marker, before
/// the section closes.
#[test]
fn kimi_calls_stream_one_by_one() {
    let first = "<|tool_call_begin|>functions.ls:0<|tool_call_argument_begin|>{\"path\": \".\"}<|tool_call_end|>";
    let second =
        "<|tool_call_begin|>functions.cat:1<|tool_call_argument_begin|> {\"file\": \"a.rs\"} <|tool_call_end|>";
    let input = format!("<|tool_calls_section_begin|>{first}{second}<|tool_calls_section_end|>");
    let mut parser = AnswerParser::new(None, Some(ToolFormat::KimiK2), false);
    let mut out = Vec::new();
    let second_at = input.find("<|tool_call_begin|>functions.cat").unwrap();
    let close = input.find("<|tool_calls_section_end|>").unwrap();
    for (at, c) in input.char_indices() {
        if at == second_at {
            let done: Vec<&ToolCall> = out
                .iter()
                .filter_map(|s| match s {
                    Segment::ToolCall(c) => Some(c),
                    _ => None,
                })
                .collect();
            assert_eq!(done.len(), 1, "the first call completed at its own end: {out:?}");
            assert_eq!(done[0].id.as_deref(), Some("functions.ls:0"));
        }
        if at == close {
            assert!(
                out.iter().any(|s| matches!(s, Segment::ToolCallStart { id: Some(id), name } if id == "functions.cat:1" && name == "cat")),
                "{out:?}"
            );
        }
        parser.push(&c.to_string(), &mut out);
    }
    parser.finish(&mut out);
    let calls: Vec<ToolCall> = blocks(out)
        .into_iter()
        .filter_map(|s| match s {
            Segment::ToolCall(c) => Some(c),
            _ => None,
        })
        .collect();
    assert_eq!(calls.len(), 2);
    assert_eq!((calls[1].name.as_str(), calls[1].arguments.as_str()), ("cat", "{\"file\": \"a.rs\"}"));
}
