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

fn sdk_python() -> PathBuf {
    if let Some(python) = std::env::var_os("DYNAMO_SDK_PYTHON") {
        return python.into();
    }
    let found = Command::new("python3").args(["-c", "import openai"]).output().is_ok_and(|o| o.status.success());
    assert!(found, "the OpenAI Python SDK is not installed: set DYNAMO_SDK_PYTHON (.ci/run installs it)");
    "python3".into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the openai Python SDK: .ci/run installs it"]
async fn the_openai_python_sdk_talks_to_the_frontend() {
    let python = sdk_python();
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
