//! `cache_control` leases and their sessions, on the real `dynamo-node` binary over real HTTP:
//! a leased system prompt survives a flood that evicts an unleased one of the same priority
//! (pinned in G3, the lowest tier; demoted out of G1 and G2) and is read back on the next
//! request with `cache_read_input_tokens`; usage splits the prompt exactly into input, cache
//! creation and cache reads; and when the session that holds the lease goes idle, the lease
//! ends in the tiers.

use std::time::{Duration, Instant};

use dynamo_tests::Node;
use serde_json::{Value, json};

/// Small tiers so that a dozen prompts overflow all three: G1 64 blocks per worker, G2 ~113,
/// G3 ~226 (tiny model, 32-token blocks). Sessions end after 2 s idle.
const CONFIG: &str = "[frontend]\nsession_idle_timeout = \"2s\"\ncache_min_tokens = 64\n\n\
                      [tiers.g1]\ncapacity = \"2MiB\"\n\n[tiers.g2]\ncapacity = \"4MiB\"\n\n\
                      [tiers.g3]\ncapacity_per_path = \"8MiB\"\n";

/// A system prompt of about 700 tokens, different for every `tag`.
fn system_prompt(tag: &str) -> String {
    (0..200).map(|i| format!("{tag}-rule{i} ")).collect()
}

fn message(system: &str, leased: bool, user: &str) -> Value {
    let mut block = json!({"type": "text", "text": system});
    if leased {
        block["cache_control"] = json!({"type": "ephemeral"});
    }
    json!({
        "model": "tiny",
        "max_tokens": 2,
        "system": [block],
        "messages": [{"role": "user", "content": user}],
    })
}

async fn post(node: &Node, path: &str, session: Option<&str>, body: &Value) -> Value {
    let mut req =
        reqwest::Client::new().post(format!("{}{path}", node.api)).header("anthropic-version", "2023-06-01").json(body);
    if let Some(id) = session {
        req = req.header("x-claude-code-session-id", id);
    }
    let resp = req.send().await.expect("request");
    let status = resp.status();
    let value: Value = resp.json().await.expect("json");
    assert!(status.is_success(), "{status}: {value}");
    value
}

fn usage(answer: &Value, field: &str) -> u64 {
    answer["usage"][field].as_u64().unwrap_or_else(|| panic!("usage.{field} in {answer}"))
}

/// Waits until `series` satisfies `ok` (the tiers are published once a second).
async fn wait_for(node: &Node, series: &str, ok: impl Fn(f64) -> bool) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = node.metric(series).await;
        if ok(v) || Instant::now() > deadline {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_system_prompt_survives_an_eviction_flood_and_its_lease_ends_with_its_session() {
    let node = Node::start_in(std::sync::Arc::new(tempfile::tempdir().expect("tempdir")), CONFIG);
    let (leased, unleased) = (system_prompt("leased"), system_prompt("plain"));

    // The leased prompt's first request writes it to the cache: input + creation + read = prompt.
    let first = post(&node, "/messages", Some("agent-1"), &message(&leased, true, "hello")).await;
    let total = post(&node, "/messages/count_tokens", None, &message(&leased, true, "hello")).await["input_tokens"]
        .as_u64()
        .expect("count");
    let created = usage(&first, "cache_creation_input_tokens");
    assert!(created >= 512 && created.is_multiple_of(32), "the system prompt's blocks are leased: {first}");
    assert_eq!(usage(&first, "cache_read_input_tokens"), 0);
    assert_eq!(first["usage"]["cache_creation"]["ephemeral_5m_input_tokens"].as_u64(), Some(created));
    assert_eq!(usage(&first, "input_tokens") + created, total, "the prompt, split exactly: {first}");
    // The same priority without a lease.
    post(&node, "/messages", None, &message(&unleased, false, "hello")).await;
    let leased_g3 = wait_for(&node, "dynamo_node_kv_leased_blocks{tier=\"g3\"}", |v| v * 32.0 >= created as f64).await;
    assert!(leased_g3 * 32.0 >= created as f64, "the lease reaches G3 with the write-through: {leased_g3}");

    // A flood of other system prompts (the same priority, no lease) overflows G1, G2 and G3.
    for i in 0..20 {
        post(&node, "/messages", None, &message(&system_prompt(&format!("flood{i}")), false, "go")).await;
        // Keep the session alive through the flood.
        if i % 4 == 0 {
            post(&node, "/messages", Some("agent-1"), &message("short", false, "ping")).await;
        }
    }
    let evicted = wait_for(&node, "dynamo_node_kv_evictions_total{tier=\"g3\",region=\"system\"}", |v| v > 0.0).await;
    let g3 = node.metric("dynamo_node_kv_blocks{tier=\"g3\"}").await;
    assert!(evicted > 0.0, "the flood evicted system blocks from G3 ({g3} resident)");

    // The unleased prompt was dropped; the leased one comes back, from the lowest tier if need be.
    let plain = post(&node, "/messages", None, &message(&unleased, false, "again")).await;
    let back = post(&node, "/messages", Some("agent-1"), &message(&leased, true, "again")).await;
    let read = usage(&back, "cache_read_input_tokens");
    assert!(read >= created, "the leased prompt is read back whole: {read} of {created} ({back})");
    assert_eq!(usage(&back, "cache_creation_input_tokens"), 0, "a refresh writes nothing new");
    assert!(usage(&plain, "cache_read_input_tokens") < read, "the unleased prompt was evicted: {plain}");

    // The session goes idle; its lease ends in every tier.
    let after = wait_for(&node, "dynamo_node_kv_leased_blocks{tier=\"g3\"}", |v| v == 0.0).await;
    assert_eq!(after, 0.0, "the idle session released its lease");
    assert_eq!(node.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_outlasts_a_restart_of_the_node_where_g3_kept_its_blocks() {
    // Sessions live long here: the lease must come back from the saved file, not from a session.
    let config = CONFIG.replace("session_idle_timeout = \"2s\"", "session_idle_timeout = \"10m\"");
    let dir = std::sync::Arc::new(tempfile::tempdir().expect("tempdir"));
    let node = Node::start_in(dir.clone(), &config);
    let leased = system_prompt("kept");
    let first = post(&node, "/messages", Some("agent-2"), &message(&leased, true, "hello")).await;
    let created = usage(&first, "cache_creation_input_tokens");
    assert!(created >= 512, "{first}");
    let before = wait_for(&node, "dynamo_node_kv_leased_blocks{tier=\"g3\"}", |v| v * 32.0 >= created as f64).await;
    assert!(before * 32.0 >= created as f64, "leased in G3: {before}");
    assert_eq!(node.stop(), 0);
    assert!(dir.path().join("leases.bin").exists(), "saved at shutdown");

    // The restarted node pins the recovered blocks again, before any request asks.
    let node = Node::start_in(dir.clone(), &config);
    let after = wait_for(&node, "dynamo_node_kv_leased_blocks{tier=\"g3\"}", |v| v >= before).await;
    assert_eq!(after, before, "every leased block is leased again");
    // A flood that fills every tier does not take it; the next request reads it back whole.
    for i in 0..20 {
        post(&node, "/messages", None, &message(&system_prompt(&format!("flood{i}")), false, "go")).await;
    }
    let evicted = wait_for(&node, "dynamo_node_kv_evictions_total{tier=\"g3\",region=\"system\"}", |v| v > 0.0).await;
    assert!(evicted > 0.0, "the flood evicted system blocks from G3");
    let back = post(&node, "/messages", Some("agent-3"), &message(&leased, true, "again")).await;
    assert!(usage(&back, "cache_read_input_tokens") >= created, "read back after the restart: {back}");
    assert_eq!(usage(&back, "cache_creation_input_tokens"), 0, "still leased: nothing newly created");

    // A damaged file is refused whole, and the node starts without it.
    assert_eq!(node.stop(), 0);
    let file = dir.path().join("leases.bin");
    let mut bytes = std::fs::read(&file).expect("saved");
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&file, bytes).expect("write");
    let node = Node::start_in(dir.clone(), &config);
    // The tiers are published once a second: two publications later.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let resident = node.metric("dynamo_node_kv_blocks{tier=\"g3\"}").await;
    assert!(resident > 0.0, "G3 recovered its blocks");
    let leased_now = node.metric("dynamo_node_kv_leased_blocks{tier=\"g3\"}").await;
    assert_eq!(leased_now, 0.0, "a file that fails its checksum restores nothing");
    assert_eq!(node.stop(), 0);
}
