//! A real client: the official Anthropic Python SDK (`tests/sdk/anthropic_client.py`) against the
//! frontend served in-process with the fake generator of `support/frontend.rs`, with the qwen3
//! reasoning and hermes tool-call parsers.
//!
//! The SDK's Python is `$DYNAMO_SDK_PYTHON`, else `python3` when it can `import anthropic`. The
//! test is ignored by default because it needs that SDK; `.ci/run` installs it in a venv and runs
//! the test with `--run-ignored only`. Run without an SDK, it fails (it never passes silently).

#[path = "support/frontend.rs"]
mod support;

use dynamo_config::FrontendSection;
use support::Server;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the anthropic Python SDK: .ci/run installs it"]
async fn the_anthropic_python_sdk_talks_to_the_frontend() {
    let config = FrontendSection {
        reasoning_parser: Some("qwen3".into()),
        tool_call_parser: Some("hermes".into()),
        ..FrontendSection::default()
    };
    let mut server = Server::start(config).await;
    support::run_sdk_script("anthropic", "anthropic_client.py", server.url("")).await;
    server.stop().await.unwrap();
}
