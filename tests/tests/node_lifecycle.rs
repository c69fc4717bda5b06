//! The `dynamo-node` daemon as an operator runs it: start on the embedded defaults (with a
//! private data directory), print the resolved tiers, stop cleanly on SIGTERM and SIGINT, and find
//! its G3 store again on restart.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use dynamo_tests::{node_binary, spawn_until_ready};

struct Running {
    child: Child,
    lines: Vec<String>,
}

fn start(data_dir: &std::path::Path, extra: &[&str]) -> Running {
    let mut cmd = Command::new(node_binary());
    // Ephemeral ports: tests run in parallel, and the default ports may be taken.
    cmd.args(extra).args(["--metrics", "127.0.0.1:0", "--http", "127.0.0.1:0"]).arg("--data-dir").arg(data_dir);
    let (child, lines) = spawn_until_ready(cmd);
    Running { child, lines }
}

fn stop(mut running: Running, signal: i32) -> i32 {
    // SAFETY: sending a signal to our own child process, whose pid is valid until we wait on it.
    let rc = unsafe { libc::kill(running.child.id() as i32, signal) };
    assert_eq!(rc, 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = running.child.try_wait().expect("wait") {
            use std::os::unix::process::ExitStatusExt;
            return status.code().unwrap_or_else(|| panic!("killed by signal {:?} (sent {signal})", status.signal()));
        }
        assert!(Instant::now() < deadline, "no exit within 30 s of the signal");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn starts_on_the_embedded_defaults_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = start(dir.path(), &[]);
    let text = node.lines.join("\n");
    for needle in ["model tiny", "G1 ", "G2 ", "G3 ", "G4   disabled", "io_uring qd 32"] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
    assert!(text.contains(&dir.path().join("g3/store.0").display().to_string()), "G3 path resolved under the data dir");
    assert!(dir.path().join("g3/store.0").exists(), "the G3 file was created");
    assert_eq!(stop(node, libc::SIGTERM), 0);
}

#[test]
fn stops_cleanly_on_sigint_and_reopens_its_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let first = start(dir.path(), &["serve"]);
    assert!(first.lines.iter().any(|l| l.contains("1 file(s) formatted")), "{:#?}", first.lines);
    assert_eq!(stop(first, libc::SIGINT), 0);
    let second = start(dir.path(), &["serve"]);
    assert!(
        second.lines.iter().any(|l| l.contains("0 file(s) formatted")),
        "the store is reopened, not reformatted: {:#?}",
        second.lines
    );
    assert_eq!(stop(second, libc::SIGTERM), 0);
}

#[test]
fn a_config_file_and_flags_override_the_defaults() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("node.toml");
    std::fs::write(&cfg, "[tiers.g3]\nio_engine = \"psync\"\nqueue_depth = 4\n[tiers.g2]\ncapacity = \"64MiB\"\n")
        .expect("write");
    let node = start(dir.path(), &["--config", cfg.to_str().expect("utf-8")]);
    let text = node.lines.join("\n");
    assert!(text.contains("pread/pwrite × 4 threads"), "{text}");
    assert!(text.contains("64MiB"), "{text}");
    assert_eq!(stop(node, libc::SIGTERM), 0);
}

#[test]
fn an_invalid_override_is_a_config_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("node.toml");
    std::fs::write(&cfg, "[engine]\nworkers = 0\n").expect("write");
    let out = Command::new(node_binary()).arg("--config").arg(&cfg).output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("engine.workers"));
}
