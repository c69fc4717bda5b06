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

/// A 20-turn agent loop through the Anthropic SDK against the real binary with the scripted
/// engine (the real `tiny` model computing every token, its answers the script's), the qwen3 and
/// hermes parsers and a billing header that changes every turn: every turn's tool call parses,
/// and from turn 2 on the prompt is read from the cache up to the previous prompt.
#[test]
#[ignore = "needs the anthropic Python SDK: .ci/run installs it"]
fn an_agent_loop_through_the_real_node_reads_each_turn_from_the_cache() {
    let python = support::sdk_python("anthropic");
    let dir = std::sync::Arc::new(tempfile::tempdir().expect("tempdir"));
    let answers: Vec<String> = (0..20)
        .map(|i| {
            format!(
                "<think>\nI need file {i}.\n</think>\n\nReading it.<tool_call>\n{{\"name\": \"Read\", \"arguments\": {{\"path\": \"src/file_{i}.rs\"}}}}\n</tool_call>"
            )
        })
        .collect();
    let script = dir.path().join("script.json");
    std::fs::write(&script, serde_json::to_string(&answers).unwrap()).unwrap();
    let toml = format!(
        "[engine]\nkind = \"scripted\"\nscript = \"{}\"\n\n[frontend]\nreasoning_parser = \"qwen3\"\ntool_call_parser = \"hermes\"\n",
        script.display()
    );
    let node = dynamo_tests::Node::start_in(dir, &toml);
    let base = node.api.trim_end_matches("/v1").to_string();
    let agent = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("sdk/anthropic_agent_loop.py");
    let output =
        std::process::Command::new(python).arg(agent).arg(base).arg("20").output().expect("run the SDK script");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stderr}");
    assert!(output.status.success(), "the agent loop failed:\n{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "ok", "{stderr}");
    assert_eq!(node.stop(), 0);
}
