//! Engines the node launches run under `dynamo-node engine-guard`: an engine that exits is
//! started again, and the engine's whole process tree ends when the node stops it, or when the
//! node itself dies. Stand-in engines (`sh`) keep these fast; `tests/tests/vllm_workers.rs`
//! launches real vLLM.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dynamo_config::NodeConfig;
use dynamo_node::vllm::launch::Launched;

fn guard() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_dynamo-node"))
}

/// One engine, run as `sh -c SCRIPT` (the node's flags become the script's `$0`, `$1`, …).
fn config(dir: &Path, script: &str) -> NodeConfig {
    let text = format!(
        "[model]\npath = \"/models/tiny\"\n[engine]\nkind = \"vllm\"\n[engine.vllm.launch]\ndevices = [\"0\"]\n\
         connector = false\ncommand = [\"sh\", \"-c\", {script:?}]\n"
    );
    let mut cfg = NodeConfig::parse(&text, "test.toml").unwrap();
    cfg.node.data_dir = dir.to_owned();
    cfg
}

fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

/// The pid a stand-in engine wrote to `file`, once it has.
async fn pid_in(file: &Path) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(pid) = std::fs::read_to_string(file).ok().and_then(|t| t.trim().parse().ok()) {
            return pid;
        }
        assert!(Instant::now() < deadline, "the stand-in engine did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn until_dead(pid: i32, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while alive(pid) {
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_exits_is_started_again_and_stopping_ends_it() {
    let dir = tempfile::tempdir().unwrap();
    let starts = dir.path().join("starts");
    let cfg = config(dir.path(), &format!("echo started >> {}; sleep 0.2", starts.display()));
    let launched = Launched::start(&cfg, 32, &guard()).await.unwrap();
    let count = || std::fs::read_to_string(&starts).unwrap_or_default().lines().count();
    let deadline = Instant::now() + Duration::from_secs(20);
    while count() < 2 {
        assert!(Instant::now() < deadline, "the engine was not started again: {} start(s)", count());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    launched.stop().await;
    let stopped = count();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(count(), stopped, "nothing is started after the stop");
}

/// The engine starts a child of its own (as vLLM's API server starts its engine core): stopping
/// the engine ends the child too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_ends_the_engines_whole_process_tree() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("child.pid");
    let cfg = config(dir.path(), &format!("sleep 300 & echo $! > {}; wait", file.display()));
    let launched = Launched::start(&cfg, 32, &guard()).await.unwrap();
    let child = pid_in(&file).await;
    assert!(alive(child));
    launched.stop().await;
    until_dead(child, "the engine's child outlived the stop").await;
}

/// An engine that ignores SIGTERM is killed, with its child, once the grace is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_ignores_sigterm_is_killed_after_the_grace() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("child.pid");
    let cfg = config(dir.path(), &stubborn(dir.path(), &file));
    let launched = Launched::start(&cfg, 32, &guard()).await.unwrap();
    let child = pid_in(&file).await;
    launched.stop().await;
    until_dead(child, "an engine that ignores SIGTERM outlived the stop").await;
}

/// A script, run as `sh SCRIPT`, that ignores SIGTERM (and so does its child) and writes its
/// child's pid to `file`.
fn stubborn(dir: &Path, file: &Path) -> String {
    let script = dir.join("stubborn.sh");
    std::fs::write(
        &script,
        format!("trap '' TERM\nsleep 300 &\necho $! > {}\nwhile :; do wait; done\n", file.display()),
    )
    .unwrap();
    format!("exec sh {}", script.display())
}

/// When the process that launched the engine dies outright (SIGKILL, no stop), the engine's
/// whole tree ends, even one that ignores SIGTERM, and even though the guard's stderr (a pipe
/// to the node) is closed by then. A shell stands in for the node.
#[test]
fn the_engines_tree_ends_when_the_node_is_killed_outright() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("child.pid");
    // node (sh) → guard → engine (sh) → child (sleep); `; true` keeps the shell from exec'ing
    // the guard, so the shell stays its parent.
    let node = format!(
        "{} engine-guard --parent $$ --grace 1s -- sh -c '{}'; true",
        guard().display(),
        stubborn(dir.path(), &file)
    );
    let mut node =
        std::process::Command::new("sh").args(["-c", &node]).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let child = runtime.block_on(pid_in(&file));
    assert!(alive(child));
    node.kill().unwrap();
    drop(node.stderr.take());
    let _ = node.wait();
    runtime.block_on(until_dead(child, "the engine's child outlived the node"));
}
