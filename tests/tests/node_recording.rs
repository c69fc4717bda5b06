//! Recorded traffic: a node with `[recording]` on writes what it served as a trace, and
//! `dynamo-node bench replay` reads that trace back with the sessions, lengths and shared
//! prefixes the traffic had (and never its text).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dynamo_tests::{Node, node_binary};
use serde_json::{Value, json};

const CONFIG: &str = r#"
[recording]
enabled = true
"#;

/// A system prompt of a few thousand tokens, shared by both sessions.
fn system_prompt() -> String {
    (0..300).map(|i| format!("Rule {i}: read the file before editing it. ")).collect()
}

/// One chat turn of `session`; its answer and usage.
async fn turn(node: &Node, session: &str, messages: &[Value]) -> (String, Value) {
    let resp = reqwest::Client::new()
        .post(format!("{}/chat/completions", node.api))
        .header("x-session-id", session)
        .json(&json!({"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}))
        .send()
        .await
        .expect("chat");
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.expect("json");
    let answer = body["choices"][0]["message"]["content"].as_str().expect("text").to_owned();
    (answer, body["usage"].clone())
}

fn ids(line: &Value) -> Vec<u64> {
    line["hash_ids"].as_array().expect("hash_ids").iter().map(|id| id.as_u64().expect("an integer id")).collect()
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_session_replays_with_its_turns_lengths_and_shared_prefix() {
    let dir = Arc::new(tempfile::tempdir().expect("tempdir"));
    let node = Node::start_in(dir.clone(), CONFIG);
    let system = system_prompt();

    // Session a: three turns, each carrying the whole conversation, as agents send them.
    let mut messages = vec![json!({"role": "system", "content": system}), json!({"role": "user", "content": "list"})];
    let mut usages = Vec::new();
    for next in ["open main.rs", "run the tests"] {
        let (answer, usage) = turn(&node, "rec-a", &messages).await;
        usages.push(usage);
        messages.push(json!({"role": "assistant", "content": answer}));
        messages.push(json!({"role": "user", "content": next}));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (_, usage) = turn(&node, "rec-a", &messages).await;
    usages.push(usage);
    // Session b: one turn on the same system prompt.
    let b = [json!({"role": "system", "content": system}), json!({"role": "user", "content": "grep TODO"})];
    let (_, usage_b) = turn(&node, "rec-b", &b).await;

    // Lines are written once each response is over, by the recorder's own thread.
    let mut recorded = 0.0;
    for _ in 0..100 {
        recorded = node.metric("dynamo_node_recorded_requests_total").await;
        if recorded >= 4.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(recorded, 4.0, "four requests recorded");
    assert_eq!(node.stop(), 0);

    let files: Vec<PathBuf> =
        std::fs::read_dir(dir.path().join("traffic")).expect("the recording dir").map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let text = std::fs::read_to_string(&files[0]).expect("the recording");
    assert!(!text.contains("Rule") && !text.contains("main.rs"), "no text is recorded");
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).expect("one JSON object per line")).collect();
    assert_eq!(lines.len(), 4, "{text}");

    // Session a: its first turn whole, then each turn as what it adds beyond the last prompt and
    // the answer the replay will generate itself.
    let (a, b_line) = (&lines[..3], &lines[3]);
    assert!(a.iter().all(|l| l["session_id"] == a[0]["session_id"]), "one session: {text}");
    assert_ne!(b_line["session_id"], a[0]["session_id"]);
    let prompt = |i: usize| n(&usages[i]["prompt_tokens"]);
    let completion = |i: usize| n(&usages[i]["completion_tokens"]);
    assert_eq!(n(&a[0]["input_length"]), prompt(0));
    assert!(prompt(0) > 2 * 512, "the system prompt spans whole trace blocks: {}", prompt(0));
    for (i, line) in a.iter().enumerate().skip(1) {
        assert_eq!(n(&line["input_length"]), prompt(i) - prompt(i - 1) - completion(i - 1), "turn {i}: {text}");
        assert!(line.get("timestamp").is_none());
        assert!(line["delay"].as_f64().is_some_and(|d| d >= 150.0), "the think time between turns: {text}");
        assert_eq!(ids(line).len() as u64, n(&line["input_length"]).div_ceil(512));
    }
    let all_usages: Vec<&Value> = usages.iter().chain([&usage_b]).collect();
    for (l, usage) in lines.iter().zip(&all_usages) {
        assert_eq!(n(&l["output_length"]), n(&usage["completion_tokens"]));
    }
    assert_eq!(n(&b_line["input_length"]), n(&usage_b["prompt_tokens"]));
    // Both sessions begin with the system prompt's whole blocks, under the same ids.
    let (ids_a, ids_b) = (ids(&a[0]), ids(b_line));
    let shared = ids_a.iter().zip(&ids_b).take_while(|(x, y)| x == y).count();
    assert!(shared >= 2 && shared < ids_a.len().min(ids_b.len()), "shared ids: {ids_a:?} / {ids_b:?}");

    // The file is a trace: the replay reads it back whole.
    let report = dir.path().join("replay.json");
    let out = std::process::Command::new(node_binary())
        .args(["bench", "replay", "--trace"])
        .arg(&files[0])
        .arg("--json")
        .arg(&report)
        .output()
        .expect("run bench replay");
    assert!(out.status.success(), "bench replay failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&report).expect("the report")).expect("json");
    assert_eq!(report["sessions"], 2, "{report}");
    assert_eq!(report["requests"], 4, "{report}");
    let kv = report["policies"].as_array().and_then(|p| p.first()).expect("a policy");
    assert!(kv["hit_rate"].as_f64().is_some_and(|h| h > 0.3), "the replay reuses the recorded prefixes: {kv}");
}
