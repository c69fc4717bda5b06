//! A real client: the official OpenAI Python SDK (`tests/sdk/openai_client.py`) against the
//! frontend served in-process with the fake generator of `support/frontend.rs`.
//!
//! The SDK's Python is `$DYNAMO_SDK_PYTHON`, else `python3` when it can `import openai`. The test
//! is ignored by default because it needs that SDK; `.ci/run` installs it in a venv and runs the
//! test with `--run-ignored only`. Run without an SDK, it fails (it never passes silently).

#[path = "support/frontend.rs"]
mod support;

use std::path::PathBuf;
use std::process::Command;

use dynamo_config::FrontendSection;
use support::Server;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the openai Python SDK: .ci/run installs it"]
async fn the_openai_python_sdk_talks_to_the_frontend() {
    let python = support::sdk_python("openai");
    let mut server = Server::start(FrontendSection::default()).await;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("sdk/openai_client.py");
    let base = server.url("/v1");
    let output = tokio::task::spawn_blocking(move || Command::new(&python).arg(script).arg(base).output())
        .await
        .unwrap()
        .expect("run the SDK script");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "the SDK script failed:\n{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "ok", "{stderr}");
    server.stop().await.unwrap();
}
