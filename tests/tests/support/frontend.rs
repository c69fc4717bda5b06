//! A deterministic fake [`Generator`] and an in-process server for the frontend tests.
//!
//! Models: `fake` (and `fake-2`) answer [`ANSWER`] a token at a time, report half the prompt as
//! cached, and stop with `length` at `max_tokens`; `slow` does the same with 30 ms between events;
//! `overloaded`, `vanishing` (listed, but the generator says it does not exist), `too-long` and
//! `broken` fail at admission with the matching [`GenerateError`]; `midstream` fails after two
//! tokens; `agent` answers [`AGENT_ANSWER`] (reasoning, text, two tool calls); `parrot` answers
//! whatever its prompt holds between the last `<<say>>` and `<</say>>` (a test writes the model's
//! output, hostile or not). The last request of every model is kept for inspection.

#![allow(dead_code, unreachable_pub)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dynamo_config::FrontendSection;
use dynamo_node::frontend::{
    ChatTemplate, FinishReason, FrontendState, GenerateError, GenerateEvent, GenerateRequest, Generator, serve,
};
use dynamo_node::tokenizer::Tokenizer;
use futures::StreamExt;
use futures::stream::BoxStream;

/// What the fake generator answers: a split 4-byte character included.
pub const ANSWER: &str = "Hello, world! 🦀 done.";
/// What the `agent` model answers: reasoning, text and two tool calls in Qwen3 / Hermes form.
pub const AGENT_ANSWER: &str = "<think>\nList the files first.\n</think>\n\nLet me look.<tool_call>\n{\"name\": \"ls\", \"arguments\": {\"path\": \".\"}}\n</tool_call><tool_call>\n{\"name\": \"cat\", \"arguments\": {\"file\": \"a.rs\", \"lines\": [1, 20]}}\n</tool_call>";
/// The fake's context.
pub const MAX_CONTEXT: usize = 1024;

#[derive(Debug)]
pub struct FakeGenerator {
    tokenizer: Tokenizer,
    answer: Vec<u32>,
    agent: Vec<u32>,
    pub last: Mutex<Option<GenerateRequest>>,
}

impl FakeGenerator {
    pub fn new() -> FakeGenerator {
        let t = Tokenizer::builtin();
        FakeGenerator {
            answer: t.encode(ANSWER).unwrap(),
            agent: t.encode(AGENT_ANSWER).unwrap(),
            tokenizer: t,
            last: Mutex::new(None),
        }
    }

    pub fn last(&self) -> GenerateRequest {
        self.last.lock().unwrap().clone().expect("a request reached the generator")
    }
}

impl Generator for FakeGenerator {
    fn models(&self) -> Vec<String> {
        ["fake", "fake-2", "slow", "overloaded", "vanishing", "too-long", "broken", "midstream", "agent", "parrot"]
            .map(String::from)
            .to_vec()
    }

    fn max_context(&self) -> usize {
        MAX_CONTEXT
    }

    fn generate(&self, req: GenerateRequest) -> BoxStream<'static, Result<GenerateEvent, GenerateError>> {
        *self.last.lock().unwrap() = Some(req.clone());
        let fail = |e: GenerateError| futures::stream::iter([Err(e)]).boxed();
        match req.model.as_str() {
            "overloaded" => return fail(GenerateError::Overloaded { retry_after: Duration::from_millis(2500) }),
            "vanishing" => return fail(GenerateError::ModelNotFound(req.model.clone())),
            "too-long" => return fail(GenerateError::PromptTooLong { tokens: req.prompt.len(), limit: 4 }),
            "broken" => return fail(GenerateError::Internal("the worker crashed".into())),
            _ => {}
        }
        let mut events =
            vec![Ok(GenerateEvent::Started { cached_tokens: req.prompt.len() / 2, leased_tokens: (0, 0) })];
        let said;
        let answer = match req.model.as_str() {
            "agent" => &self.agent,
            "parrot" => {
                let prompt = self.tokenizer.decode(&req.prompt).unwrap_or_default();
                let start = prompt.rfind("<<say>>").map_or(0, |i| i + "<<say>>".len());
                let end = prompt[start..].find("<</say>>").map_or(prompt.len(), |i| start + i);
                said = self.tokenizer.encode(&prompt[start..end]).unwrap();
                &said
            }
            _ => &self.answer,
        };
        let n = answer.len().min(req.max_tokens);
        events.extend(answer[..n].iter().map(|&id| Ok(GenerateEvent::Token { id })));
        if req.model == "midstream" {
            events.truncate(3);
            events.push(Err(GenerateError::Internal("the worker crashed mid-answer".into())));
        } else {
            let reason = if n < answer.len() { FinishReason::Length } else { FinishReason::Stop };
            if reason == FinishReason::Stop {
                events.push(Ok(GenerateEvent::Token { id: req.stop_token_ids[0] }));
            }
            events.push(Ok(GenerateEvent::Finished { reason, cached_tokens: req.prompt.len() / 2 }));
        }
        let stream = futures::stream::iter(events);
        if req.model == "slow" {
            stream
                .then(|e| async move {
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    e
                })
                .boxed()
        } else {
            stream.boxed()
        }
    }
}

/// A frontend serving a [`FakeGenerator`] on 127.0.0.1 (a free port).
pub struct Server {
    pub base: String,
    pub fake: Arc<FakeGenerator>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl Server {
    pub async fn start(config: FrontendSection) -> Server {
        let fake = Arc::new(FakeGenerator::new());
        let state = FrontendState::new(fake.clone(), Tokenizer::builtin(), ChatTemplate::builtin(), &config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, state, async move {
            let _ = rx.await;
        }));
        Server { base, fake, shutdown: Some(tx), task: Some(task) }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Asks the server to stop; returns what `serve` returned once in-flight requests drained.
    pub async fn stop(&mut self) -> std::io::Result<()> {
        let _ = self.shutdown.take().expect("running").send(());
        self.task.take().expect("running").await.expect("serve task")
    }
}

/// The Python with the official SDK `module` installed: `$DYNAMO_SDK_PYTHON` (`.ci/run` sets it),
/// else `python3` if it can import it; fails otherwise (an SDK test never passes silently).
pub fn sdk_python(module: &str) -> std::path::PathBuf {
    if let Some(python) = std::env::var_os("DYNAMO_SDK_PYTHON") {
        return python.into();
    }
    let found = std::process::Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(found, "the {module} Python SDK is not installed: set DYNAMO_SDK_PYTHON (.ci/run installs it)");
    "python3".into()
}

/// Runs the SDK script `tests/sdk/NAME` with `module`'s Python against `server` (`base` is the
/// URL the script gets), and requires it to print `ok`.
pub async fn run_sdk_script(module: &str, name: &str, base: String) {
    let python = sdk_python(module);
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("sdk").join(name);
    let output =
        tokio::task::spawn_blocking(move || std::process::Command::new(&python).arg(script).arg(base).output())
            .await
            .unwrap()
            .expect("run the SDK script");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "the SDK script failed:\n{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "ok", "{stderr}");
}
