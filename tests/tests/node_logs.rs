//! Logs that follow a request: the real binary with `node.log_format = "json"` writes one JSON
//! object per line, and every line a request causes — in the frontend, its session, the
//! scheduler and the worker — carries the request's id, the client's own or the node's.

use std::collections::BTreeSet;
use std::sync::Arc;

use dynamo_tests::Node;
use serde_json::{Value, json};

const CONFIG: &str = r#"
[node]
log_format = "json"
log_level = "info,dynamo_actors=debug,dynamo_node=debug"
"#;

/// Every request id a log line names: its current span's and those of the spans around it.
fn request_ids(line: &Value) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    let spans = line["spans"].as_array().into_iter().flatten().chain(std::iter::once(&line["span"]));
    for span in spans {
        if let Some(id) = span["request_id"].as_str() {
            ids.insert(id.to_owned());
        }
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_layer_logs_a_request_under_its_id_one_json_object_per_line() {
    let dir = Arc::new(tempfile::tempdir().expect("tempdir"));
    let node = Node::start_logging(dir.clone(), CONFIG, "node.log");
    let client = reqwest::Client::new();

    // A client's own id comes back in both headers the SDKs read, and names the request.
    let chat = client
        .post(format!("{}/chat/completions", node.api))
        .header("x-request-id", "client-id-7")
        .header("x-session-id", "logs-session")
        .json(&json!({"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}))
        .send()
        .await
        .expect("chat");
    assert_eq!(chat.status(), 200);
    assert_eq!(chat.headers()["x-request-id"], "client-id-7");
    assert_eq!(chat.headers()["request-id"], "client-id-7");
    let body: Value = chat.json().await.expect("json");
    assert!(body["id"].as_str().is_some_and(|id| id.starts_with("chatcmpl-")), "the object id is the API's: {body}");

    // Without one, the node makes one; the Anthropic SDK reads it from `request-id`.
    let messages = client
        .post(format!("{}/messages", node.api))
        .header("anthropic-version", "2023-06-01")
        .json(&json!({"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .expect("messages");
    assert_eq!(messages.status(), 200);
    let made = messages.headers()["request-id"].to_str().expect("ascii").to_owned();
    assert!(made.starts_with("req_"), "{made}");
    assert_eq!(messages.headers()["x-request-id"], made.as_str());

    // A refusal has an id too, and its line says why.
    let bad = client
        .post(format!("{}/chat/completions", node.api))
        .header("x-request-id", "bad-body-1")
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("bad");
    assert_eq!(bad.status(), 400);
    assert_eq!(bad.headers()["x-request-id"], "bad-body-1");

    assert_eq!(node.stop(), 0);
    let log = std::fs::read_to_string(dir.path().join("node.log")).expect("the log");
    let lines: Vec<Value> = log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not one JSON object per line ({e}): {l}")))
        .collect();
    assert!(!lines.is_empty(), "the node logged nothing");
    for line in &lines {
        for key in ["timestamp", "level", "fields", "target"] {
            assert!(line.get(key).is_some(), "no {key}: {line}");
        }
    }
    let of = |id: &str| lines.iter().filter(|l| request_ids(l).contains(id)).collect::<Vec<_>>();

    let chat_lines = of("client-id-7");
    let targets: BTreeSet<&str> = chat_lines.iter().filter_map(|l| l["target"].as_str()).collect();
    for layer in
        ["dynamo_node::frontend", "dynamo_actors::session", "dynamo_actors::scheduler", "dynamo_actors::worker"]
    {
        assert!(
            targets.iter().any(|t| t.starts_with(layer)),
            "nothing from {layer} under the request's id: {targets:?}"
        );
    }
    let finished = chat_lines
        .iter()
        .find(|l| l["fields"]["message"] == "request finished")
        .expect("a closing line for the request");
    assert_eq!(finished["fields"]["completion_tokens"], 4);
    assert_eq!(finished["fields"]["outcome"], "length");
    assert!(finished["fields"]["prompt_tokens"].as_u64().is_some_and(|n| n > 0));
    assert_eq!(finished["fields"]["id"], body["id"], "the closing line names the response object");

    let made_lines = of(&made);
    assert!(made_lines.iter().any(|l| l["target"].as_str().is_some_and(|t| t.starts_with("dynamo_actors::worker"))));
    assert!(made_lines.iter().any(|l| l["fields"]["message"] == "request finished"));

    let refused = of("bad-body-1");
    assert!(
        refused.iter().any(|l| l["fields"]["message"] == "request refused" && l["fields"]["status"] == 400),
        "{refused:?}"
    );
}
