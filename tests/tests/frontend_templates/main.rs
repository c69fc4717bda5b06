//! The token-identity matrix over real HTTP: every family template (`ChatTemplate::named`) × every
//! API (Chat Completions, Anthropic Messages, OpenAI Responses) × agent-loop scenario.
//!
//! Each family gets its own tokenizer, built here in the `tokenizers` JSON format (a byte-level
//! BPE of the 256 byte characters, no merges, and the family's special tokens from
//! `templates/FAMILIES.md` as added tokens), and a scripted fake model that answers every request
//! with the next answer of the scenario, written exactly as that family's model writes it after
//! the generation prompt (thinking, text and tool calls in the family's format, stop token
//! included). The test drives each scenario as the API's real client does: it sends the request,
//! echoes the assistant turn back as the official SDK would (Chat: the returned message, with
//! and without `reasoning_content`; Messages: the content blocks with their thinking signatures;
//! Responses: stateless with the output items and `encrypted_content`, or `previous_response_id`
//! with the response stored), adds the tool results or the new input, and sends the next turn.
//!
//! For every transition N → N+1 it checks that prompt N+1 starts with prompt N followed by the
//! ids generated for turn N (without the stop id), except where the family's template drops
//! history reasoning on purpose (FAMILIES.md's "history thinking"): there it checks that the
//! prefix *does* break. The kwargs that keep history reasoning (Chat's `chat_template_kwargs`)
//! turn those misses into full prefixes. Finally, for one conversation per family, Anthropic's
//! usage adds up to what `/v1/messages/count_tokens` counts and to the prompt the model saw.

use std::collections::{BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};

use dynamo_config::FrontendSection;
use dynamo_node::frontend::{
    ChatTemplate, FinishReason, FrontendState, GenerateError, GenerateEvent, GenerateRequest, Generator, serve,
};
use dynamo_node::tokenizer::Tokenizer;
use futures::StreamExt;
use futures::stream::BoxStream;
use serde_json::{Value, json};

mod families;

use families::*;

/// The model name the fake serves.
const MODEL: &str = "family";
/// The session every request names (`x-session-id`; Claude Code's header for Messages).
const SESSION: &str = "frontend-templates";
/// The leading system prompt of every conversation.
const SYSTEM: &str = "You are a coding agent.";
/// Claude Code's kind of reminder, sent beside tool results.
const REMINDER: &str = "<system-reminder>Stay on task.</system-reminder>";
/// An inline system message, sent after tool results.
const INLINE_SYSTEM: &str = "Answer in one sentence.";

// ---------------------------------------------------------------------------------------------
// The families.
// ---------------------------------------------------------------------------------------------

/// How a family's model writes an answer after the generation prompt (FAMILIES.md, "What the
/// model generates").
#[derive(Clone, Copy, Debug, PartialEq)]
enum Format {
    /// `<think>\n…\n</think>\n\n` text, Hermes `<tool_call>` JSON calls, then `eos` (Qwen3; the
    /// built-in Llama-3 template served with Hermes-style answers).
    Hermes {
        /// The end-of-turn token.
        eos: &'static str,
    },
    /// DeepSeek-R1: starts in reasoning, `…\n</think>\n\n` text, V3 calls, `<｜end▁of▁sentence｜>`.
    DeepseekR1,
    /// gpt-oss harmony: an analysis message, then a commentary preamble and one call (stops at
    /// `<|call|>`), or a final message (stops at `<|return|>`).
    GptOss,
    /// Nemotron 3: starts in reasoning, `…</think>` text, qwen3_coder XML calls, `<|im_end|>`.
    Nemotron,
    /// GLM-4.7: starts in reasoning, `…</think>` text, `<arg_key>` calls, then the next role
    /// token (`<|observation|>` after calls, `<|user|>` after an answer).
    Glm47,
    /// Kimi-K2-Instruct: no reasoning, text, a tool-call section with `functions.NAME:IDX` ids,
    /// `<|im_end|>`.
    KimiK2,
}

/// What a family's template does with the reasoning of earlier turns, that is where the prompt
/// prefix breaks on purpose (FAMILIES.md's "history thinking" column).
#[derive(Clone, Copy, Debug, PartialEq)]
enum History {
    /// Every turn keeps its reasoning: no transition misses.
    Kept,
    /// Reasoning is dropped once a new user query arrives (Qwen3, Nemotron's
    /// `truncate_history_thinking`, GLM's `clear_thinking`).
    DroppedAtNewQuery,
    /// Every earlier turn's reasoning is dropped, tool loops included (DeepSeek-R1).
    DroppedAlways,
    /// Reasoning is dropped once the model has given a final answer (gpt-oss).
    DroppedAfterAnswer,
}

/// One generation the fake served: the prompt it saw and the ids it answered.
#[derive(Clone, Debug)]
struct Generation {
    /// The prompt's ids.
    prompt: Vec<u32>,
    /// The answer's ids, its stop token last.
    answer: Vec<u32>,
    /// The request's stop ids.
    stop_ids: Vec<u32>,
}

impl Generation {
    /// The stop id the answer ended with, if it did.
    fn stop(&self) -> Option<u32> {
        self.answer.last().copied().filter(|id| self.stop_ids.contains(id))
    }

    /// The generated ids without a trailing stop id: what the next prompt must continue with.
    fn generated(&self) -> &[u32] {
        match self.answer.split_last() {
            Some((last, rest)) if self.stop_ids.contains(last) => rest,
            _ => &self.answer,
        }
    }
}

/// A fake [`Generator`] that answers each request with the next answer of its script, a token
/// at a time (`Started { cached_tokens: 0 }`, a `Token` per id, `Finished { reason: Stop }`),
/// and records every request's prompt.
#[derive(Debug)]
struct ScriptedModel {
    script: Mutex<VecDeque<Vec<u32>>>,
    seen: Mutex<Vec<Generation>>,
}

impl ScriptedModel {
    /// A model answering `answers` in order.
    fn new(answers: Vec<Vec<u32>>) -> ScriptedModel {
        ScriptedModel { script: Mutex::new(answers.into()), seen: Mutex::new(Vec::new()) }
    }

    /// The generations served so far.
    fn seen(&self) -> Vec<Generation> {
        self.seen.lock().unwrap().clone()
    }
}

impl Generator for ScriptedModel {
    fn models(&self) -> Vec<String> {
        vec![MODEL.to_owned()]
    }

    fn max_context(&self) -> usize {
        1 << 16
    }

    fn generate(&self, req: GenerateRequest) -> BoxStream<'static, Result<GenerateEvent, GenerateError>> {
        let answer = self.script.lock().unwrap().pop_front().expect("a scripted answer for every request");
        assert!(answer.len() <= req.max_tokens, "the answer fits max_tokens");
        self.seen.lock().unwrap().push(Generation {
            prompt: req.prompt.clone(),
            answer: answer.clone(),
            stop_ids: req.stop_token_ids.clone(),
        });
        let mut events = vec![GenerateEvent::Started { cached_tokens: 0, leased_tokens: (0, 0) }];
        events.extend(answer.into_iter().map(|id| GenerateEvent::Token { id }));
        events.push(GenerateEvent::Finished { reason: FinishReason::Stop, cached_tokens: 0 });
        futures::stream::iter(events.into_iter().map(Ok)).boxed()
    }
}

/// A frontend serving a [`ScriptedModel`] with a family's tokenizer, template and parsers on
/// 127.0.0.1 (a free port); stopped when dropped.
#[derive(Debug)]
struct Served {
    base: String,
    model: Arc<ScriptedModel>,
    http: reqwest::Client,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Served {
    /// Serves `family` answering `answers` in order, with replay on (the default).
    async fn start(family: &Family, tokenizer: &Tokenizer, answers: &[String]) -> Served {
        Served::start_with(family, tokenizer, answers, FrontendSection::default().replay_tokens).await
    }

    /// [`start`](Self::start) keeping at most `replay_tokens` generated ids for replay (0: off).
    async fn start_with(family: &Family, tokenizer: &Tokenizer, answers: &[String], replay_tokens: usize) -> Served {
        let ids = answers.iter().map(|a| tokenizer.encode(a).unwrap()).collect();
        let model = Arc::new(ScriptedModel::new(ids));
        let config = FrontendSection {
            reasoning_parser: family.reasoning_parser.map(str::to_owned),
            tool_call_parser: Some(family.tool_call_parser.to_owned()),
            default_max_tokens: 4096,
            replay_tokens,
            ..FrontendSection::default()
        };
        let template = ChatTemplate::named(family.template).unwrap();
        let state = FrontendState::new(model.clone(), tokenizer.clone(), template, &config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve(listener, state, async move {
            let _ = rx.await;
        }));
        Served { base, model, http: reqwest::Client::new(), shutdown: Some(tx) }
    }

    /// POSTs `body` to `path` with the session headers; requires a 200 and returns the JSON.
    async fn post(&self, path: &str, body: &Value) -> Value {
        let response = self
            .http
            .post(format!("{}{path}", self.base))
            .header("x-session-id", SESSION)
            .header("x-claude-code-session-id", SESSION)
            .json(body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        assert_eq!(status, 200, "{path}: {text}\nrequest: {body}");
        serde_json::from_str(&text).unwrap()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Scenarios and what the model answers in them.
// ---------------------------------------------------------------------------------------------

/// A tool call the model makes: the tool and its string arguments, in the order it writes them.
#[derive(Clone, Copy, Debug)]
struct Call {
    /// The tool.
    name: &'static str,
    /// Its arguments (all strings, which every format writes alike).
    args: &'static [(&'static str, &'static str)],
}

/// `ls {"path": "."}`.
const LS: Call = Call { name: "ls", args: &[("path", ".")] };
/// `cat {"file": "a.rs", "encoding": "utf-8"}`: two arguments, not in sorted order.
const CAT: Call = Call { name: "cat", args: &[("file", "a.rs"), ("encoding", "utf-8")] };

impl Call {
    /// The arguments as the model writes JSON (Python's spacing).
    fn json(&self) -> String {
        let fields: Vec<String> = self.args.iter().map(|(k, v)| format!("{}: {}", json!(k), json!(v))).collect();
        format!("{{{}}}", fields.join(", "))
    }

    /// What the tool returns.
    fn result(&self) -> &'static str {
        match self.name {
            "ls" => "a.rs\nb.rs",
            _ => "fn main() {}",
        }
    }
}

/// One answer of the model, before its family's format is applied.
#[derive(Clone, Debug)]
struct Reply {
    /// The reasoning (Kimi-K2-Instruct writes none).
    thinking: &'static str,
    /// The text (gpt-oss: the commentary preamble of a calling turn).
    text: &'static str,
    /// The calls; none for a final answer.
    calls: Vec<Call>,
}

/// What the client adds before a request.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Input {
    /// A user query.
    Query(&'static str),
    /// The results of the previous answer's calls, with a reminder beside them and/or an inline
    /// system message after them.
    Results { reminder: bool, system: bool },
}

/// One request of a scenario: the client's new input and the model's answer to it.
#[derive(Clone, Debug)]
struct Step {
    input: Input,
    reply: Reply,
}

/// An agent-loop scenario: its name and its requests.
#[derive(Clone, Debug)]
struct Scenario {
    name: &'static str,
    steps: Vec<Step>,
}

/// The first query of every scenario.
const QUERY: Input = Input::Query("List the files.");
/// Tool results alone.
const RESULTS: Input = Input::Results { reminder: false, system: false };

/// A reply that calls `calls`.
fn calling(thinking: &'static str, text: &'static str, calls: &[Call]) -> Reply {
    Reply { thinking, text, calls: calls.to_vec() }
}

/// A final answer.
fn answering(thinking: &'static str, text: &'static str) -> Reply {
    Reply { thinking, text, calls: Vec::new() }
}

/// The scenarios `family` is tested on: plain answers; one call and its result; two parallel
/// calls (where the format allows them); think/tool/think/tool; a result with a reminder beside
/// it; a new user query after a tool loop; an inline system message after a result.
fn scenarios(family: &Family) -> Vec<Scenario> {
    let step = |input, reply| Step { input, reply };
    let first_call = || calling("The user wants the files listed; call ls.", "I'll list them.", &[LS]);
    let summary = || answering("The listing answers it.", "There are two files: a.rs and b.rs.");
    let mut all = vec![
        Scenario {
            name: "plain",
            steps: vec![
                step(Input::Query("Hello!"), answering("A greeting; answer briefly.", "Hello! How can I help?")),
                step(
                    Input::Query("Tell me a joke."),
                    answering("They want a joke.", "A crab never shares: shellfish."),
                ),
            ],
        },
        Scenario { name: "one_call", steps: vec![step(QUERY, first_call()), step(RESULTS, summary())] },
        Scenario {
            name: "think_tool_think_tool",
            steps: vec![
                step(QUERY, first_call()),
                step(RESULTS, calling("a.rs is there; read it.", "Reading a.rs.", &[CAT])),
                step(RESULTS, answering("It is an empty main.", "a.rs holds an empty main.")),
            ],
        },
        Scenario {
            name: "reminder",
            steps: vec![step(QUERY, first_call()), step(Input::Results { reminder: true, system: false }, summary())],
        },
        Scenario {
            name: "tool_then_new_query",
            steps: vec![
                step(QUERY, first_call()),
                step(RESULTS, summary()),
                step(Input::Query("Which one is bigger?"), answering("Compare the sizes.", "They are the same size.")),
            ],
        },
        Scenario {
            name: "inline_system",
            steps: vec![step(QUERY, first_call()), step(Input::Results { reminder: false, system: true }, summary())],
        },
    ];
    if family.parallel_calls {
        let both = calling("List the files and read a.rs at once.", "Both at once.", &[LS, CAT]);
        all.insert(2, Scenario { name: "parallel_calls", steps: vec![step(QUERY, both), step(RESULTS, summary())] });
    }
    all
}

/// What `format`'s model writes for `reply` after the generation prompt, stop token included.
/// `call_index` numbers Kimi's call ids across the conversation.
fn model_output(format: Format, reply: &Reply, call_index: &mut usize) -> String {
    let Reply { thinking, text, calls } = reply;
    match format {
        Format::Hermes { eos } => {
            let mut out = format!("<think>\n{thinking}\n</think>\n\n{text}");
            for (i, call) in calls.iter().enumerate() {
                if !text.is_empty() || i > 0 {
                    out.push('\n');
                }
                out += &format!(
                    "<tool_call>\n{{\"name\": \"{}\", \"arguments\": {}}}\n</tool_call>",
                    call.name,
                    call.json()
                );
            }
            out + eos
        }
        Format::DeepseekR1 => {
            let mut out = format!("{thinking}\n</think>\n\n{text}");
            if !calls.is_empty() {
                let each: Vec<String> = calls
                    .iter()
                    .map(|c| {
                        format!(
                            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{}\n```json\n{}\n```<｜tool▁call▁end｜>",
                            c.name,
                            c.json()
                        )
                    })
                    .collect();
                out += &format!("<｜tool▁calls▁begin｜>{}<｜tool▁calls▁end｜>", each.join("\n"));
            }
            out + "<｜end▁of▁sentence｜>"
        }
        Format::GptOss => {
            let analysis = format!("<|channel|>analysis<|message|>{thinking}<|end|>");
            match calls.as_slice() {
                [] => format!("{analysis}<|start|>assistant<|channel|>final<|message|>{text}<|return|>"),
                [call] => {
                    let preamble = format!("<|start|>assistant<|channel|>commentary<|message|>{text}<|end|>");
                    let name = call.name;
                    let args = call.json();
                    format!(
                        "{analysis}{preamble}<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}<|call|>"
                    )
                }
                _ => panic!("gpt-oss makes one call per turn"),
            }
        }
        Format::Nemotron => {
            let mut out = format!("{thinking}</think>{text}");
            if !calls.is_empty() {
                out.push('\n');
            }
            for call in calls {
                out += &format!("<tool_call>\n<function={}>\n", call.name);
                for (k, v) in call.args {
                    out += &format!("<parameter={k}>\n{v}\n</parameter>\n");
                }
                out += "</function>\n</tool_call>\n";
            }
            out + "<|im_end|>"
        }
        Format::Glm47 => {
            let mut out = format!("{thinking}</think>{text}");
            for call in calls {
                out += &format!("<tool_call>{}", call.name);
                for (k, v) in call.args {
                    out += &format!("<arg_key>{k}</arg_key><arg_value>{v}</arg_value>");
                }
                out += "</tool_call>";
            }
            out + if calls.is_empty() { "<|user|>" } else { "<|observation|>" }
        }
        Format::KimiK2 => {
            let mut out = text.to_string();
            if !calls.is_empty() {
                out += "<|tool_calls_section_begin|>";
                for call in calls {
                    out += &format!(
                        "<|tool_call_begin|>functions.{}:{call_index}<|tool_call_argument_begin|>{}<|tool_call_end|>",
                        call.name,
                        call.json()
                    );
                    *call_index += 1;
                }
                out += "<|tool_calls_section_end|>";
            }
            out + "<|im_end|>"
        }
    }
}

/// The answers of `scenario` in `family`'s format, in order.
fn script(family: &Family, scenario: &Scenario) -> Vec<String> {
    let mut call_index = 0;
    scenario.steps.iter().map(|s| model_output(family.format, &s.reply, &mut call_index)).collect()
}

// ---------------------------------------------------------------------------------------------
// The clients.
// ---------------------------------------------------------------------------------------------

/// How a conversation is driven: which API, and how its client echoes the assistant turn.
#[derive(Clone, Debug, PartialEq)]
enum Client {
    /// Chat Completions: the returned message echoed, with its `reasoning_content` or without it
    /// (as most clients do), optionally with `chat_template_kwargs`.
    Chat { echo_reasoning: bool, kwargs: Option<(&'static str, bool)> },
    /// Anthropic Messages: the content blocks as returned, thinking and signature included.
    Messages,
    /// Responses, stateless (`store: false`, `include: ["reasoning.encrypted_content"]`): the
    /// output items echoed in the next input.
    ResponsesStateless,
    /// Responses with the response stored: the next request names it in
    /// `previous_response_id` and sends only the new items.
    ResponsesStored,
}

impl Client {
    /// A short label for reports.
    fn label(&self) -> String {
        match self {
            Client::Chat { echo_reasoning: true, kwargs: None } => "chat".into(),
            Client::Chat { echo_reasoning: false, kwargs: None } => "chat(no reasoning_content)".into(),
            Client::Chat { echo_reasoning, kwargs: Some((k, v)) } => {
                let echo = if *echo_reasoning { "" } else { ", no reasoning_content" };
                format!("chat({k}={v}{echo})")
            }
            Client::Messages => "messages".into(),
            Client::ResponsesStateless => "responses(store=false)".into(),
            Client::ResponsesStored => "responses(previous_response_id)".into(),
        }
    }

    /// The route it posts to.
    fn path(&self) -> &'static str {
        match self {
            Client::Chat { .. } => "/v1/chat/completions",
            Client::Messages => "/v1/messages",
            Client::ResponsesStateless | Client::ResponsesStored => "/v1/responses",
        }
    }

    /// The clients every family is driven with, and the Chat clients with the kwargs that keep
    /// history reasoning where the family has them.
    fn all(family: &Family) -> Vec<Client> {
        let mut clients = vec![
            Client::Chat { echo_reasoning: true, kwargs: None },
            Client::Chat { echo_reasoning: false, kwargs: None },
            Client::Messages,
            Client::ResponsesStateless,
            Client::ResponsesStored,
        ];
        if let Some(kwargs) = family.keep_reasoning {
            clients.push(Client::Chat { echo_reasoning: true, kwargs: Some(kwargs) });
            clients.push(Client::Chat { echo_reasoning: false, kwargs: Some(kwargs) });
        }
        clients
    }
}

/// The tools, in the shape each API sends them.
fn tools(client: &Client) -> Value {
    let schema = |props: &[&str]| {
        let properties: serde_json::Map<String, Value> =
            props.iter().map(|p| ((*p).to_owned(), json!({"type": "string"}))).collect();
        json!({"type": "object", "properties": properties, "required": props})
    };
    let defs = [
        ("ls", "List the files in a directory.", schema(&["path"])),
        ("cat", "Read a file.", schema(&["file", "encoding"])),
    ];
    let tools: Vec<Value> = defs
        .into_iter()
        .map(|(name, description, parameters)| match client {
            Client::Chat { .. } => json!({"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}),
            Client::Messages => json!({"name": name, "description": description, "input_schema": parameters}),
            Client::ResponsesStateless | Client::ResponsesStored => {
                json!({"type": "function", "name": name, "description": description, "parameters": parameters})
            }
        })
        .collect();
    json!(tools)
}

/// One conversation as a client keeps it: what it sends next, and the calls of the last answer.
#[derive(Debug)]
struct Conversation {
    client: Client,
    /// Chat's messages, Messages' messages, or Responses' input items (for a stored response:
    /// only the items since it).
    items: Vec<Value>,
    /// The stored response to continue.
    previous: Option<String>,
    /// The last answer's calls: id and tool.
    calls: Vec<(String, String)>,
}

impl Conversation {
    /// A conversation of `client` with the leading system prompt (Chat's first message,
    /// Messages' `system`, a Responses developer item).
    fn new(client: Client) -> Conversation {
        let items = match client {
            Client::Chat { .. } => vec![json!({"role": "system", "content": SYSTEM})],
            Client::Messages => Vec::new(),
            Client::ResponsesStateless | Client::ResponsesStored => {
                vec![json!({"role": "developer", "content": SYSTEM})]
            }
        };
        Conversation { client, items, previous: None, calls: Vec::new() }
    }

    /// Adds the client's new input: a user query, or the results of the last answer's calls with
    /// a reminder beside them (Messages: a text block next to the results; Chat: appended to the
    /// last tool message; Responses: a user message after the outputs) and an inline system
    /// message after them (Chat and Messages: `system`; Responses: `developer`).
    fn add(&mut self, input: Input) {
        let user_text =
            |text: &str| json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]});
        let (reminder, system) = match input {
            Input::Query(query) => {
                self.items.push(match self.client {
                    Client::Chat { .. } | Client::Messages => json!({"role": "user", "content": query}),
                    Client::ResponsesStateless | Client::ResponsesStored => user_text(query),
                });
                return;
            }
            Input::Results { reminder, system } => (reminder, system),
        };
        assert!(!self.calls.is_empty(), "results answer calls");
        let result = |name: &str| if name == "ls" { LS.result() } else { CAT.result() };
        match self.client {
            Client::Chat { .. } => {
                for (id, name) in &self.calls {
                    self.items.push(json!({"role": "tool", "tool_call_id": id, "content": result(name)}));
                }
                if reminder {
                    let last = self.items.last_mut().unwrap();
                    last["content"] = json!(format!("{}\n\n{REMINDER}", last["content"].as_str().unwrap()));
                }
                if system {
                    self.items.push(json!({"role": "system", "content": INLINE_SYSTEM}));
                }
            }
            Client::Messages => {
                let mut content: Vec<Value> = self
                    .calls
                    .iter()
                    .map(|(id, name)| json!({"type": "tool_result", "tool_use_id": id, "content": result(name)}))
                    .collect();
                if reminder {
                    content.push(json!({"type": "text", "text": REMINDER}));
                }
                self.items.push(json!({"role": "user", "content": content}));
                if system {
                    self.items.push(json!({"role": "system", "content": INLINE_SYSTEM}));
                }
            }
            Client::ResponsesStateless | Client::ResponsesStored => {
                for (id, name) in &self.calls {
                    self.items.push(json!({"type": "function_call_output", "call_id": id, "output": result(name)}));
                }
                if reminder {
                    self.items.push(user_text(REMINDER));
                }
                if system {
                    self.items.push(json!({"type": "message", "role": "developer", "content": [{"type": "input_text", "text": INLINE_SYSTEM}]}));
                }
            }
        }
    }

    /// The next request's body.
    fn body(&self) -> Value {
        let tools = tools(&self.client);
        match &self.client {
            Client::Chat { kwargs, .. } => {
                let mut body = json!({"model": MODEL, "messages": self.items, "tools": tools});
                if let Some((k, v)) = kwargs {
                    let mut kwargs = serde_json::Map::new();
                    kwargs.insert((*k).to_owned(), json!(v));
                    body["chat_template_kwargs"] = Value::Object(kwargs);
                }
                body
            }
            Client::Messages => {
                json!({"model": MODEL, "max_tokens": 4096, "system": SYSTEM, "tools": tools, "messages": self.items})
            }
            Client::ResponsesStateless => json!({"model": MODEL, "input": self.items, "tools": tools, "store": false,
                                                 "include": ["reasoning.encrypted_content"]}),
            Client::ResponsesStored => {
                let mut body = json!({"model": MODEL, "input": self.items, "tools": tools, "store": true});
                if let Some(id) = &self.previous {
                    body["previous_response_id"] = json!(id);
                }
                body
            }
        }
    }

    /// Takes the answer in as the official SDK hands it back: Chat's message (without
    /// `reasoning_content` when the client drops it), Messages' content blocks, Responses' output
    /// items (or, stored, only the response id). Returns the answer's calls.
    fn echo(&mut self, response: &Value) -> &[(String, String)] {
        self.calls = match &self.client {
            Client::Chat { echo_reasoning, .. } => {
                let mut message = response["choices"][0]["message"].clone();
                if !echo_reasoning {
                    message.as_object_mut().unwrap().remove("reasoning_content");
                }
                let calls = message["tool_calls"].as_array().cloned().unwrap_or_default();
                self.items.push(message);
                calls.iter().map(|c| (text(&c["id"]), text(&c["function"]["name"]))).collect()
            }
            Client::Messages => {
                let content = response["content"].clone();
                self.items.push(json!({"role": "assistant", "content": content}));
                let blocks = content.as_array().unwrap();
                blocks.iter().filter(|b| b["type"] == "tool_use").map(|b| (text(&b["id"]), text(&b["name"]))).collect()
            }
            Client::ResponsesStateless | Client::ResponsesStored => {
                let output = response["output"].as_array().unwrap().clone();
                if self.client == Client::ResponsesStored {
                    self.previous = Some(text(&response["id"]));
                    self.items.clear();
                } else {
                    self.items.extend(output.iter().cloned());
                }
                let calls = output.iter().filter(|i| i["type"] == "function_call");
                calls.map(|i| (text(&i["call_id"]), text(&i["name"]))).collect()
            }
        };
        &self.calls
    }
}

/// The reasoning and the text of an answer as `client`'s API returns them (Chat's
/// `reasoning_content` and `content`, Messages' thinking and text blocks, Responses' reasoning
/// and message items), each trimmed.
fn answer_parts(client: &Client, response: &Value) -> (String, String) {
    let texts = |items: &[Value], kind: &str, field: &str| -> String {
        items.iter().filter(|i| i["type"] == kind).map(|i| i[field].as_str().unwrap_or_default()).collect()
    };
    let (reasoning, text) = match client {
        Client::Chat { .. } => {
            let message = &response["choices"][0]["message"];
            let field = |key: &str| message[key].as_str().unwrap_or_default().to_owned();
            (field("reasoning_content"), field("content"))
        }
        Client::Messages => {
            let blocks = response["content"].as_array().unwrap();
            (texts(blocks, "thinking", "thinking"), texts(blocks, "text", "text"))
        }
        Client::ResponsesStateless | Client::ResponsesStored => {
            let items = response["output"].as_array().unwrap();
            let parts = |kind: &str| -> Vec<Value> {
                let of_kind = items.iter().filter(|i| i["type"] == kind);
                of_kind.flat_map(|i| i["content"].as_array().unwrap().clone()).collect()
            };
            (texts(&parts("reasoning"), "reasoning_text", "text"), texts(&parts("message"), "output_text", "text"))
        }
    };
    (reasoning.trim().to_owned(), text.trim().to_owned())
}

/// A JSON string's text.
fn text(value: &Value) -> String {
    value.as_str().unwrap_or_else(|| panic!("not a string: {value}")).to_owned()
}

// ---------------------------------------------------------------------------------------------
// The matrix.
// ---------------------------------------------------------------------------------------------

/// Whether the transition into `next` after the answer `previous` keeps the full prefix, as
/// `family`'s template documents it (FAMILIES.md); with the kwargs that keep history reasoning,
/// always.
fn expected_full(family: &Family, client: &Client, previous: &Reply, next: Input) -> bool {
    if matches!(client, Client::Chat { kwargs: Some(_), .. }) {
        return true;
    }
    let reasoned = !previous.thinking.is_empty() && family.format != Format::KimiK2;
    match family.history {
        History::Kept => true,
        History::DroppedAtNewQuery => !(reasoned && matches!(next, Input::Query(_))),
        History::DroppedAlways => !reasoned,
        History::DroppedAfterAnswer => !previous.calls.is_empty(),
    }
}

/// One transition N → N+1 of one conversation, checked.
#[derive(Debug)]
struct Transition {
    /// `scenario client`.
    cell: String,
    /// N+1.
    step: usize,
    /// What the documented table says.
    expected_full: bool,
    /// What the prompts show.
    full: bool,
    /// Where the prompts part, when they do.
    divergence: Option<String>,
    /// A full prefix that does not go on with the end token the model sampled: how.
    end_token: Option<String>,
}

impl Transition {
    /// Whether it is what FAMILIES.md documents.
    fn as_documented(&self) -> bool {
        self.full == self.expected_full && self.end_token.is_none()
    }
}

/// Whether `next` starts with `prompt` followed by `generated`; where they part otherwise.
fn continues(tokenizer: &Tokenizer, prompt: &[u32], generated: &[u32], next: &[u32]) -> Result<(), String> {
    let expected: Vec<u32> = prompt.iter().chain(generated).copied().collect();
    if next.len() > expected.len() && next[..expected.len()] == expected[..] {
        return Ok(());
    }
    let at = expected.iter().zip(next).take_while(|(a, b)| a == b).count();
    let window = |ids: &[u32]| {
        let (lo, mid, hi) = (at.saturating_sub(30).min(ids.len()), at.min(ids.len()), (at + 30).min(ids.len()));
        let decode = |range: &[u32]| tokenizer.decode(range).unwrap();
        format!("{:?} ⟦HERE⟧ {:?}", decode(&ids[lo..mid]), decode(&ids[mid..hi]))
    };
    Err(format!(
        "first divergent index {at} (prompt N is {} ids, + answer N = {}; prompt N+1 is {} ids)\n      prompt N + answer N: {}\n      prompt N+1:          {}",
        prompt.len(),
        expected.len(),
        next.len(),
        window(&expected),
        window(next)
    ))
}

/// Drives `scenario` through `client` against `family`'s template and checks every transition.
async fn run_cell(family: &Family, tokenizer: &Tokenizer, scenario: &Scenario, client: &Client) -> Vec<Transition> {
    let served = Served::start(family, tokenizer, &script(family, scenario)).await;
    let mut conversation = Conversation::new(client.clone());
    for step in &scenario.steps {
        conversation.add(step.input);
        let response = served.post(client.path(), &conversation.body()).await;
        // The answer was read as the model meant it: its reasoning, its text, its calls.
        let what = format!("{} {} {}", family.template, scenario.name, client.label());
        let thinking = if family.format == Format::KimiK2 { "" } else { step.reply.thinking };
        let parts = answer_parts(client, &response);
        assert_eq!(parts, (thinking.to_owned(), step.reply.text.to_owned()), "{what}: reasoning, text\n{response}");
        let calls = conversation.echo(&response);
        let names: Vec<&str> = calls.iter().map(|(_, name)| name.as_str()).collect();
        let wanted: Vec<&str> = step.reply.calls.iter().map(|c| c.name).collect();
        assert_eq!(names, wanted, "{what}: the calls\n{response}");
    }
    let seen = served.model.seen();
    assert_eq!(seen.len(), scenario.steps.len());
    (1..seen.len())
        .map(|n| {
            let (before, after) = (&seen[n - 1], &seen[n]);
            let checked = continues(tokenizer, &before.prompt, before.generated(), &after.prompt);
            // A full prefix goes on with the token the model ended its turn with, written by the
            // template (GLM's next role token, gpt-oss's `<|call|>`, everyone else's EOS).
            let end = after.prompt.get(before.prompt.len() + before.generated().len()).copied();
            let end_token = match (&checked, before.stop()) {
                (Ok(()), Some(stop)) if end != Some(stop) => Some(format!(
                    "the turn goes on with {:?} where the model ended it with {:?}",
                    tokenizer.decode(&end.into_iter().collect::<Vec<_>>()).unwrap(),
                    tokenizer.decode(&[stop]).unwrap()
                )),
                _ => None,
            };
            Transition {
                cell: format!("{} {}", scenario.name, client.label()),
                step: n,
                expected_full: expected_full(family, client, &scenario.steps[n - 1].reply, scenario.steps[n].input),
                full: checked.is_ok(),
                divergence: checked.err(),
                end_token,
            }
        })
        .collect()
}

/// For one conversation (a tool loop, then a new query) through Anthropic Messages: every
/// answer's `input_tokens + cache_read_input_tokens + cache_creation_input_tokens` is what
/// `/v1/messages/count_tokens` counts for the same body, and the length of the prompt the model
/// saw.
async fn check_usage(family: &Family, tokenizer: &Tokenizer) {
    let scenario = scenarios(family).into_iter().find(|s| s.name == "tool_then_new_query").unwrap();
    let served = Served::start(family, tokenizer, &script(family, &scenario)).await;
    let mut conversation = Conversation::new(Client::Messages);
    for (n, step) in scenario.steps.iter().enumerate() {
        conversation.add(step.input);
        let body = conversation.body();
        let counted = served.post("/v1/messages/count_tokens", &body).await["input_tokens"].as_u64().unwrap();
        let response = served.post("/v1/messages", &body).await;
        let usage = &response["usage"];
        let total = ["input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"]
            .iter()
            .map(|k| usage[k].as_u64().unwrap())
            .sum::<u64>();
        let prompt = served.model.seen()[n].prompt.len() as u64;
        assert_eq!((total, counted), (prompt, prompt), "{} turn {n}: usage, count_tokens, prompt", family.template);
        conversation.echo(&response);
    }
}

/// Runs `name`'s whole matrix: the tokenizer, every scenario × client, and usage. Prints every
/// cell; fails listing each transition that is not what FAMILIES.md documents (a full prefix
/// that broke, with where, or a documented miss that did not happen).
async fn check_family(name: &str) {
    let family = family(name);
    let tokenizer = family_tokenizer(family);
    let mut wrong = Vec::new();
    let mut report = Vec::new();
    for scenario in scenarios(family) {
        for client in Client::all(family) {
            let transitions = run_cell(family, &tokenizer, &scenario, &client).await;
            let marks: Vec<String> = transitions
                .iter()
                .map(|t| {
                    let seen = if t.full { "full" } else { "miss" };
                    match (t.as_documented(), t.expected_full) {
                        (true, _) => seen.to_owned(),
                        (false, true) => format!("{seen} (WRONG: expected full)"),
                        (false, false) => format!("{seen} (WRONG: expected miss)"),
                    }
                })
                .collect();
            report.push(format!("  {:<58} {}", format!("{} {}", scenario.name, client.label()), marks.join(", ")));
            wrong.extend(transitions.into_iter().filter(|t| !t.as_documented()));
        }
    }
    check_usage(family, &tokenizer).await;
    println!("{name}:\n{}", report.join("\n"));
    let failures: Vec<String> = wrong
        .iter()
        .map(|t| {
            let at = format!("{name} {} transition {}→{}", t.cell, t.step - 1, t.step);
            match (&t.divergence, &t.end_token) {
                (Some(d), _) => format!("{at}: the prefix broke\n    {d}"),
                (None, Some(e)) => format!("{at}: {e}"),
                (None, None) => format!("{at}: a documented miss kept the prefix"),
            }
        })
        .collect();
    assert!(failures.is_empty(), "{} transitions are not as documented:\n{}", failures.len(), failures.join("\n"));
}

/// The control: with replay off, the built-in template re-renders a Hermes answer differently
/// (its call as bare `{"name": …, "arguments": "…"}` JSON, no `<tool_call>` tags), and the check
/// sees the prefix break there.
#[tokio::test]
async fn without_replay_the_prefix_breaks() {
    let family = family("llama3");
    let tokenizer = family_tokenizer(family);
    let scenario = scenarios(family).into_iter().find(|s| s.name == "one_call").unwrap();
    let served = Served::start_with(family, &tokenizer, &script(family, &scenario), 0).await;
    let mut conversation = Conversation::new(Client::Chat { echo_reasoning: true, kwargs: None });
    for step in &scenario.steps {
        conversation.add(step.input);
        let response = served.post("/v1/chat/completions", &conversation.body()).await;
        conversation.echo(&response);
    }
    let seen = served.model.seen();
    let broke = continues(&tokenizer, &seen[0].prompt, seen[0].generated(), &seen[1].prompt).unwrap_err();
    let rendered = broke.lines().last().unwrap();
    assert!(rendered.contains("⟦HERE⟧ \"{\\\"name\\\": \\\"ls\\\""), "{broke}");
}

/// The table covers exactly the templates `ChatTemplate::named` knows.
#[test]
fn every_family_template_is_in_the_matrix() {
    let known: BTreeSet<&str> = ChatTemplate::names().into_iter().collect();
    let tested: BTreeSet<&str> = FAMILIES.iter().map(|f| f.template).collect();
    assert_eq!(known, tested);
}

/// The `qwen3` rows of the matrix.
#[tokio::test]
async fn qwen3() {
    check_family("qwen3").await;
}

/// The `qwen3_preserve` rows of the matrix.
#[tokio::test]
async fn qwen3_preserve() {
    check_family("qwen3_preserve").await;
}

/// The `deepseek_r1` rows of the matrix.
#[tokio::test]
async fn deepseek_r1() {
    check_family("deepseek_r1").await;
}

/// The `gpt_oss` rows of the matrix.
#[tokio::test]
async fn gpt_oss() {
    check_family("gpt_oss").await;
}

/// The `nemotron` rows of the matrix.
#[tokio::test]
async fn nemotron() {
    check_family("nemotron").await;
}

/// The `glm47` rows of the matrix.
#[tokio::test]
async fn glm47() {
    check_family("glm47").await;
}

/// The `kimi_k2` rows of the matrix.
#[tokio::test]
async fn kimi_k2() {
    check_family("kimi_k2").await;
}

/// The `llama3` rows of the matrix.
#[tokio::test]
async fn llama3() {
    check_family("llama3").await;
}
