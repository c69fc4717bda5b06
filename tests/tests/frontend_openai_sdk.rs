//! A real client: the official OpenAI Python SDK (`tests/sdk/openai_client.py`) against the
//! frontend served in-process with the fake generator of `support/frontend.rs`.
//!
//! The SDK's Python is `$DYNAMO_SDK_PYTHON`, else `python3` when it can `import openai`. The test
//! is ignored by default because it needs that SDK; `.ci/run` installs it in a venv and runs the
//! test with `--run-ignored only`. Run without an SDK, it fails (it never passes silently).

#[path = "support/frontend.rs"]
mod support;

use dynamo_config::FrontendSection;
use support::Server;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the openai Python SDK: .ci/run installs it"]
async fn the_openai_python_sdk_talks_to_the_frontend() {
    let mut server = Server::start(FrontendSection::default()).await;
    support::run_sdk_script("openai", "openai_client.py", server.url("/v1")).await;
    server.stop().await.unwrap();
}

/// Responses (create, stream, stored responses, previous_response_id, function calls, errors)
/// and Chat Completions with tool calls, through the SDK, with the agent parsers on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the openai Python SDK: .ci/run installs it"]
async fn the_openai_python_sdk_runs_responses_and_tool_calls() {
    let config = FrontendSection {
        reasoning_parser: Some("qwen3".into()),
        tool_call_parser: Some("hermes".into()),
        ..FrontendSection::default()
    };
    let mut server = Server::start(config).await;
    support::run_sdk_script("openai", "openai_agent.py", server.url("/v1")).await;
    server.stop().await.unwrap();
}
