//! The real agent CLIs against the real `dynamo-node` binary with the scripted engine: Claude Code
//! (`@anthropic-ai/claude-code`, over Anthropic Messages) runs a multi-turn `claude -p … -c`
//! session and Codex (`@openai/codex`, over OpenAI Responses) a multi-turn `codex exec … resume
//! --last` session; from turn 2 on, each turn must read at least 80% of its prompt from the cache
//! (`tests/cli/claude_code_session.py`, `tests/cli/codex_session.py`).
//!
//! The CLIs are native binaries from npm: `$CLAUDE_BIN` and `$CODEX_BIN`, which `.ci/run` installs
//! and sets. The tests are ignored by default for that reason; run without the binaries they fail
//! (they never pass silently).

use std::path::PathBuf;
use std::process::Command;

/// Runs `tests/cli/SCRIPT --BIN_FLAG $ENV --node <dynamo-node> --turns TURNS` and checks it passed.
fn run_session(script: &str, flag: &str, env: &str, turns: u32) {
    let cli = std::env::var_os(env).unwrap_or_else(|| panic!("${env} must name the CLI binary (.ci/run installs it)"));
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cli").join(script);
    let output = Command::new("python3")
        .arg(&script)
        .arg(flag)
        .arg(&cli)
        .arg("--node")
        .arg(dynamo_tests::node_binary())
        .args(["--turns", &turns.to_string()])
        .output()
        .expect("run the session script");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}\n{stderr}");
    assert!(output.status.success(), "{} failed:\n{stdout}\n{stderr}", script.display());
    let turns_seen = stdout.lines().filter(|l| l.starts_with('{') && l.contains("\"ok\": true")).count();
    assert_eq!(turns_seen, turns as usize, "one passing JSON line per turn:\n{stdout}");
}

#[test]
#[ignore = "needs the Claude Code CLI: .ci/run installs it and sets $CLAUDE_BIN"]
fn claude_code_runs_a_session_from_the_cache() {
    run_session("claude_code_session.py", "--claude", "CLAUDE_BIN", 3);
}

#[test]
#[ignore = "needs the Codex CLI: .ci/run installs it and sets $CODEX_BIN"]
fn codex_runs_a_session_from_the_cache() {
    run_session("codex_session.py", "--codex", "CODEX_BIN", 3);
}
