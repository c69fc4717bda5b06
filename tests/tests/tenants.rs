//! Tenants, as clients see them on the real `dynamo-node` binary: `[frontend.auth]` keys name
//! tenants; a tenant's prompt gives another tenant zero cached tokens while the same tenant shares
//! it across sessions; a request's `cache_salt` narrows its tenant's namespace; a missing or wrong
//! key is 401 in each API's own error shape; stored responses answer only their tenant; and the
//! metrics endpoint can require its own token.

use dynamo_tests::Node;
use serde_json::{Value, json};

const KEY_A: &str = "sk-tenant-a-0123456789abcdef";
const KEY_A2: &str = "sk-tenant-a-rotated-0123456789";
const KEY_B: &str = "sk-tenant-b-0123456789abcdef";
const METRICS_TOKEN: &str = "scrape-0123456789abcdef";

fn config() -> String {
    format!(
        "[router]\npolicy = \"round_robin\"\n\n\
         [metrics]\nbearer_token = \"{METRICS_TOKEN}\"\n\n\
         [[frontend.auth.keys]]\nkey = \"{KEY_A}\"\ntenant = \"a\"\n\n\
         [[frontend.auth.keys]]\nkey = \"{KEY_A2}\"\ntenant = \"a\"\n\n\
         [[frontend.auth.keys]]\nkey = \"{KEY_B}\"\ntenant = \"b\"\n"
    )
}

async fn post(node: &Node, path: &str, headers: &[(&str, &str)], body: &Value) -> (u16, Value) {
    let mut req = reqwest::Client::new().post(format!("{}{path}", node.api)).json(body);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let resp = req.send().await.expect("request");
    let status = resp.status().as_u16();
    (status, resp.json().await.expect("json body"))
}

fn chat(prompt: &str, extra: Value) -> Value {
    let mut body = json!({
        "model": "tiny",
        "messages": [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": prompt}],
        "max_tokens": 2,
        "temperature": 0,
    });
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    body
}

fn cached(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens")
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_never_share_blocks_and_wrong_keys_are_refused_in_each_apis_shape() {
    let node = Node::start_in(std::sync::Arc::new(tempfile::tempdir().expect("tempdir")), &config());
    let history: String = (0..120).map(|i| format!("src/module{i}.rs ")).collect();
    let (auth_a, auth_a2, auth_b) = (bearer(KEY_A), bearer(KEY_A2), bearer(KEY_B));

    // Tenant A computes the prompt, in one session.
    let (status, first) = post(
        &node,
        "/chat/completions",
        &[("authorization", &auth_a), ("x-session-id", "s1")],
        &chat(&history, json!({})),
    )
    .await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(cached(&first), 0);

    // Tenant B sends the same prompt: nothing of A's is visible to it.
    let (status, probe) = post(
        &node,
        "/chat/completions",
        &[("authorization", &auth_b), ("x-session-id", "s1")],
        &chat(&history, json!({})),
    )
    .await;
    assert_eq!(status, 200, "{probe}");
    assert_eq!(cached(&probe), 0, "tenant B sees none of tenant A's blocks");

    // Tenant A again, in another session and with its other key: the prefix is shared.
    let (status, again) = post(
        &node,
        "/chat/completions",
        &[("authorization", &auth_a2), ("x-session-id", "s2")],
        &chat(&history, json!({})),
    )
    .await;
    assert_eq!(status, 200, "{again}");
    assert!(cached(&again) >= 128, "the same tenant shares across sessions: {again}");

    // A cache_salt narrows tenant A's namespace: the same prompt under a new salt is computed.
    let salted = chat(&history, json!({"cache_salt": "project-x"}));
    let (_, salted_first) = post(&node, "/chat/completions", &[("authorization", &auth_a)], &salted).await;
    assert_eq!(cached(&salted_first), 0, "{salted_first}");
    let (_, salted_again) = post(&node, "/chat/completions", &[("authorization", &auth_a)], &salted).await;
    assert!(cached(&salted_again) >= 128, "the same salt shares: {salted_again}");

    // Missing and wrong keys: 401 in OpenAI's shape on OpenAI routes ...
    for headers in [vec![], vec![("authorization", "Bearer sk-not-a-key-0123456789")]] {
        let (status, err) = post(&node, "/chat/completions", &headers, &chat("hi", json!({}))).await;
        assert_eq!(status, 401, "{err}");
        assert_eq!(err["error"]["code"], "invalid_api_key", "{err}");
        assert_eq!(err["error"]["type"], "invalid_request_error", "{err}");
        let (status, err) = post(&node, "/responses", &headers, &json!({"model": "tiny", "input": "hi"})).await;
        assert_eq!(status, 401, "{err}");
        assert_eq!(err["error"]["code"], "invalid_api_key", "{err}");
    }
    // ... and Anthropic's on the Messages API.
    let message = json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    let (status, err) = post(
        &node,
        "/messages",
        &[("x-api-key", "sk-wrong-0123456789abcdef"), ("anthropic-version", "2023-06-01")],
        &message,
    )
    .await;
    assert_eq!(status, 401, "{err}");
    assert_eq!(err["type"], "error", "{err}");
    assert_eq!(err["error"]["type"], "authentication_error", "{err}");
    let (status, ok) =
        post(&node, "/messages", &[("x-api-key", KEY_B), ("anthropic-version", "2023-06-01")], &message).await;
    assert_eq!(status, 200, "the Anthropic SDK's x-api-key header authenticates: {ok}");

    // A stored response answers only its tenant.
    let (status, stored) = post(
        &node,
        "/responses",
        &[("authorization", &auth_a)],
        &json!({"model": "tiny", "input": "hi", "max_output_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200, "{stored}");
    let id = stored["id"].as_str().expect("response id");
    let client = reqwest::Client::new();
    let get = |auth: String| client.get(format!("{}/responses/{id}", node.api)).header("authorization", auth).send();
    assert_eq!(get(auth_a.clone()).await.expect("get").status(), 200);
    assert_eq!(get(auth_b.clone()).await.expect("get").status(), 404, "another tenant's response is not found");
    let continued = json!({"model": "tiny", "input": "more", "previous_response_id": id, "max_output_tokens": 2});
    let (status, err) = post(&node, "/responses", &[("authorization", &auth_b)], &continued).await;
    assert_eq!(status, 404, "tenant B cannot continue tenant A's response: {err}");

    // /health needs no key; /metrics needs its own token.
    let health = client.get(format!("http://{}/health", node.addr())).send().await.expect("health");
    assert_eq!(health.status(), 200);
    let metrics = format!("http://{}/metrics", node.metrics);
    assert_eq!(client.get(&metrics).send().await.expect("scrape").status(), 401);
    assert_eq!(client.get(&metrics).header("authorization", &auth_a).send().await.expect("scrape").status(), 401);
    let scrape = client.get(&metrics).header("authorization", bearer(METRICS_TOKEN)).send().await.expect("scrape");
    assert_eq!(scrape.status(), 200);
    let text = scrape.text().await.expect("exposition");
    let failures = |endpoint: &str| {
        let series = format!("dynamo_node_auth_failures_total{{endpoint=\"{endpoint}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(series.as_str())).and_then(|v| v.parse::<f64>().ok())
    };
    assert_eq!(failures("api"), Some(5.0), "every refused API request is counted:\n{text}");
    assert_eq!(failures("metrics"), Some(2.0));

    assert_eq!(node.stop(), 0);
}

/// At `frontend.max_sessions`, a new session ends one of the tenant holding the most: tenant a
/// opening session after session ends its own, and tenant b's session — and the lease it holds
/// in the tiers — lives on (it once went from 57 leased G3 blocks to 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_sessions_never_end_anothers() {
    let config = format!(
        "[frontend]\nmax_sessions = 3\ncache_min_tokens = 64\n\n\
         [[frontend.auth.keys]]\nkey = \"{KEY_A}\"\ntenant = \"a\"\n\n\
         [[frontend.auth.keys]]\nkey = \"{KEY_B}\"\ntenant = \"b\"\n"
    );
    let node = Node::start_in(std::sync::Arc::new(tempfile::tempdir().expect("tempdir")), &config);
    let system: String = (0..200).map(|i| format!("b-rule{i} ")).collect();
    let leased = json!({
        "model": "tiny", "max_tokens": 2,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [{"role": "user", "content": "hello"}],
    });
    let (status, answer) = post(
        &node,
        "/messages",
        &[("x-api-key", KEY_B), ("anthropic-version", "2023-06-01"), ("x-claude-code-session-id", "b-1")],
        &leased,
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let series = "dynamo_node_kv_leased_blocks{tier=\"g3\"}";
    let wait = |want: fn(f64) -> bool| {
        let node = &node;
        async move {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            loop {
                let v = node.metric(series).await;
                if want(v) || std::time::Instant::now() > deadline {
                    return v;
                }
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
    };
    let before = wait(|v| v > 0.0).await;
    assert!(before > 0.0, "b's lease is in G3");
    let auth_a = bearer(KEY_A);
    for i in 0..6 {
        let session = format!("a-{i}");
        let (status, answer) = post(
            &node,
            "/chat/completions",
            &[("authorization", &auth_a), ("x-session-id", &session)],
            &chat(&format!("task {i}"), json!({})),
        )
        .await;
        assert_eq!(status, 200, "{answer}");
    }
    // Two publications later: b's lease is still there.
    tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
    assert_eq!(node.metric(series).await, before, "b's session and lease live on");
    assert_eq!(node.stop(), 0);
}
