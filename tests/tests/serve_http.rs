//! The node as a client sees it: the real `dynamo-node` binary on its default configuration,
//! driven over HTTP. Turn 2 of a conversation lands on the other worker and loads turn 1's prefix
//! from G2 instead of recomputing it (`cached_tokens`, `dynamo_node_kv_hit_tokens_total{tier="g2"}`),
//! with the same greedy answer as a fresh node that recomputed everything; bad requests get the
//! OpenAI error shape.

use dynamo_tests::Node;
use serde_json::{Value, json};

fn start() -> Node {
    Node::start()
}

fn start_in(dir: std::sync::Arc<tempfile::TempDir>) -> Node {
    Node::start_in(dir, "")
}

fn start_with(dir: std::sync::Arc<tempfile::TempDir>, toml: &str) -> Node {
    Node::start_in(dir, toml)
}

fn conversation(turns: &[(&str, String)]) -> Value {
    let messages: Vec<Value> = turns.iter().map(|(role, content)| json!({"role": role, "content": content})).collect();
    json!({"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_two_loads_turn_one_from_g2_with_the_same_answer() {
    // Round-robin sends turn 2 to the other worker, whose G1 does not have turn 1.
    let node =
        start_with(std::sync::Arc::new(tempfile::tempdir().expect("tempdir")), "[router]\npolicy = \"round_robin\"\n");
    let history: String = (0..180).map(|i| format!("file{i}.rs ")).collect();
    let turn1 = vec![("system", "You are a coding agent.".to_string()), ("user", history)];
    let (status, first) = node.chat(conversation(&turn1)).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let answer = first["choices"][0]["message"]["content"].as_str().expect("content").to_string();

    let mut turn2 = turn1.clone();
    turn2.push(("assistant", answer));
    turn2.push(("user", "Now run the tests.".to_string()));
    let (status, second) = node.chat(conversation(&turn2)).await;
    assert_eq!(status, 200, "{second}");
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens");
    let prompt = second["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    assert!(cached >= 128 && cached < prompt, "turn 1's blocks are reused: {cached} of {prompt}");
    let g2_hits = node.metric("dynamo_node_kv_hit_tokens_total{tier=\"g2\"}").await;
    assert_eq!(g2_hits as u64, cached, "the other worker loaded them from G2");

    // A fresh node computes turn 2 from scratch: the same greedy answer.
    let fresh = start();
    let (_, recomputed) = fresh.chat(conversation(&turn2)).await;
    assert_eq!(recomputed["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(second["choices"][0]["message"], recomputed["choices"][0]["message"]);

    // Bad requests get the OpenAI error shape.
    let (status, err) = node.chat(json!({"model": "tiny", "messages": "not a list"})).await;
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["type"], "invalid_request_error");
    let (status, err) = node.chat(json!({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(status, 404, "{err}");

    assert_eq!(fresh.stop(), 0);
    assert_eq!(node.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_serves_the_prefix_it_wrote_to_g3() {
    let node = start();
    let history: String = (0..150).map(|i| format!("crate{i}::module ")).collect();
    let turn1 = vec![("system", "You review Rust code.".to_string()), ("user", history)];
    let (status, first) = node.chat(conversation(&turn1)).await;
    assert_eq!(status, 200, "{first}");
    let answer = first["choices"][0]["message"]["content"].as_str().expect("content").to_string();
    let dir = node.dir.clone();
    assert_eq!(node.stop(), 0, "SIGTERM flushes the write-through");

    let restarted = start_in(dir);
    let mut turn2 = turn1.clone();
    turn2.push(("assistant", answer));
    turn2.push(("user", "Any unsafe code?".to_string()));
    let (status, second) = restarted.chat(conversation(&turn2)).await;
    assert_eq!(status, 200, "{second}");
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens");
    assert!(cached >= 128, "the prefix came back from G3 after the restart: {cached}");
    let g3_hits = restarted.metric("dynamo_node_kv_hit_tokens_total{tier=\"g3\"}").await;
    assert_eq!(g3_hits as u64, cached, "loaded from G3, verified");

    let fresh = start();
    let (_, recomputed) = fresh.chat(conversation(&turn2)).await;
    assert_eq!(second["choices"][0]["message"], recomputed["choices"][0]["message"]);
    assert_eq!(fresh.stop(), 0);
    assert_eq!(restarted.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_during_write_through_serves_only_verified_blocks() {
    let mut node = start();
    let history: String = (0..400).map(|i| format!("line {i}: let x{i} = {i};\n")).collect();
    let turn1 = vec![("system", "You are a coding agent.".to_string()), ("user", history)];
    let (status, first) = node.chat(conversation(&turn1)).await;
    assert_eq!(status, 200, "{first}");
    let answer = first["choices"][0]["message"]["content"].as_str().expect("content").to_string();
    // SIGKILL right after the answer, while write-through to G3 is still running.
    node.child.kill().expect("kill -9");
    node.child.wait().expect("reap");
    let dir = node.dir.clone();

    let restarted = start_in(dir);
    let mut turn2 = turn1.clone();
    turn2.push(("assistant", answer));
    turn2.push(("user", "Continue.".to_string()));
    let (status, second) = restarted.chat(conversation(&turn2)).await;
    assert_eq!(status, 200, "{second}");
    let fresh = start();
    let (_, recomputed) = fresh.chat(conversation(&turn2)).await;
    assert_eq!(
        second["choices"][0]["message"], recomputed["choices"][0]["message"],
        "whatever survived the kill was verified before use: the answer is the recomputed one"
    );
    assert_eq!(fresh.stop(), 0);
    assert_eq!(restarted.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_aware_routing_sends_turn_two_to_the_worker_that_holds_turn_one() {
    let node = start();
    let history: String = (0..120).map(|i| format!("module{i}.py ")).collect();
    let turn1 = vec![("system", "You are a coding agent.".to_string()), ("user", history)];
    let (status, first) = node.chat(conversation(&turn1)).await;
    assert_eq!(status, 200, "{first}");
    let answer = first["choices"][0]["message"]["content"].as_str().expect("content").to_string();
    let mut turn2 = turn1.clone();
    turn2.push(("assistant", answer));
    turn2.push(("user", "Now fix the failing test.".to_string()));
    // Without a session id, only the index knows where turn 1 is; ask three times.
    for _ in 0..3 {
        let (status, second) = node.chat(conversation(&turn2)).await;
        assert_eq!(status, 200, "{second}");
        let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens");
        assert!(cached >= 128, "turn 1's blocks are reused: {cached}");
    }
    assert_eq!(node.metric("dynamo_node_kv_hit_tokens_total{tier=\"g2\"}").await, 0.0, "never loaded: always G1");
    assert!(node.metric("dynamo_node_kv_hit_tokens_total{tier=\"g1\"}").await > 0.0);
    let predicted = node.metric("dynamo_node_router_predicted_cached_tokens_total").await;
    let actual = node.metric("dynamo_node_router_actual_cached_tokens_total").await;
    assert!(predicted > 0.0 && predicted == actual, "the router predicted the cache exactly: {predicted} vs {actual}");
    assert!(node.metric("dynamo_node_index_events_total{kind=\"stored\",result=\"applied\"}").await > 0.0);
    assert_eq!(node.metric("dynamo_node_router_decision_seconds_count").await, 4.0);
    assert_eq!(node.metric("dynamo_node_router_wait_seconds_count").await, 4.0, "each request joined a queue once");

    // A speculative prefill (nvext) warms the cache and generates nothing; the real call that
    // follows finds its prompt cached.
    let tools: String = (0..100).map(|i| format!("tool{i}(path) ")).collect();
    let turn = vec![("system", tools), ("user", "List the repository.".to_string())];
    let mut warm = conversation(&turn);
    warm["nvext"] = json!({"speculative_prefill": true, "priority": 2});
    let (status, warmed) = node.chat(warm).await;
    assert_eq!(status, 200, "{warmed}");
    assert_eq!(warmed["usage"]["completion_tokens"], 0, "{warmed}");
    assert_eq!(warmed["choices"][0]["message"]["content"], "", "{warmed}");
    let (status, real) = node.chat(conversation(&turn)).await;
    assert_eq!(status, 200, "{real}");
    let cached = real["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens");
    let prompt = real["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    assert_eq!(cached, (prompt - 1) / 32 * 32, "every complete block was prefilled ahead: {real}");
    assert_eq!(node.stop(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_panic_fails_its_request_and_the_node_goes_on() {
    // The test-only fail point (feature `failpoints`): the first request admitted panics its worker.
    let dir = std::sync::Arc::new(tempfile::tempdir().expect("tempdir"));
    let mut cmd = Node::command(&dir, "");
    cmd.env("FAILPOINTS", "worker-admit=1*panic(injected worker panic)");
    let node = Node::start_command(cmd, dir);
    let hello = || vec![("user", "hello".to_string())];
    let (status, err) = node.chat(conversation(&hello())).await;
    assert_eq!(status, 500, "{err}");
    assert_eq!(err["error"]["type"], "server_error", "{err}");
    assert!(err["error"]["message"].as_str().expect("message").contains("restarted"), "{err}");
    // Both workers keep serving (one of them was restarted).
    for _ in 0..3 {
        let (status, ok) = node.chat(conversation(&hello())).await;
        assert_eq!(status, 200, "{ok}");
    }
    assert_eq!(node.metric("dynamo_node_worker_restarts_total").await, 1.0);
    assert_eq!(node.stop(), 0);
}
