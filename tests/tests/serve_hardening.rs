//! The real binary against a hostile-but-fair client and a careless operator (issue 14): a
//! client that hangs up or times out stops its prefill within one pass; SIGTERM during a long
//! prefill exits within the grace; megabyte session keys leave memory bounded; a slow or silent
//! connection is cut off; connections past the cap get a 503; long conversations render off the
//! async threads; a G3 path holding foreign data is refused and a G3 that does not fit leaves the
//! disk as it was.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dynamo_tests::Node;
use serde_json::{Value, json};

/// One worker computing prompts in passes of 256 tokens: a long prompt is many passes.
const ONE_WORKER: &str = "[engine]\nworkers = 1\nmax_batch_tokens = 256\n";

/// A completion prompt of about `words * 2.7` tokens.
fn long_prompt(words: usize) -> String {
    (0..words).map(|i| format!("x{i} ")).collect()
}

fn completion(prompt: &str, max_tokens: usize) -> Value {
    json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}

async fn post(node: &Node, path: &str, body: &Value, timeout: Duration) -> Result<(u16, Value), reqwest::Error> {
    let response =
        reqwest::Client::new().post(format!("{}{path}", node.api)).json(body).timeout(timeout).send().await?;
    let status = response.status().as_u16();
    Ok((status, response.json().await?))
}

fn start(toml: &str) -> Node {
    Node::start_in(Arc::new(tempfile::tempdir().expect("tempdir")), toml)
}

/// A client that hangs up and a request past `frontend.request_timeout` both stop their
/// prefill at the next pass: the worker is free for the next request at once, and only what was
/// computed counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_prefill_frees_its_worker_within_one_pass() {
    let node = start(&format!("{ONE_WORKER}[frontend]\nrequest_timeout = \"3s\"\n"));
    // About 40K tokens: minutes of prefill on this machine, 256 tokens a pass.
    let prompt = long_prompt(15_000);
    let hung_up = post(&node, "/completions", &completion(&prompt, 4), Duration::from_millis(1500)).await;
    assert!(hung_up.as_ref().is_err_and(|e| e.is_timeout()), "the client gave up: {hung_up:?}");
    let started = Instant::now();
    let (status, short) =
        post(&node, "/completions", &completion("hello", 2), Duration::from_secs(60)).await.expect("short");
    assert_eq!(status, 200, "{short}");
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(15), "the next request waited {waited:?} behind an abandoned prefill");

    // Past the request timeout: 504, and the prefill stops too.
    let (status, timed_out) =
        post(&node, "/completions", &completion(&prompt, 4), Duration::from_secs(60)).await.expect("timed out");
    assert_eq!(status, 504, "{timed_out}");
    let started = Instant::now();
    let (status, _) = post(&node, "/completions", &completion("hello", 2), Duration::from_secs(60)).await.unwrap();
    assert_eq!(status, 200);
    assert!(started.elapsed() < Duration::from_secs(15), "{:?}", started.elapsed());

    assert_eq!(node.metric("dynamo_node_requests_cancelled_total{stage=\"prefill\"}").await, 2.0);
    let computed = node.metric("dynamo_node_prefill_tokens_total").await;
    let prompts = node.metric("dynamo_node_kv_prompt_tokens_total").await;
    assert!(computed < prompts / 2.0, "only the passes run count: {computed} of {prompts} prompt tokens");
    assert_eq!(node.stop(), 0);
}

/// SIGTERM two seconds into a long prefill: the node exits cleanly within `node.shutdown_grace`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_long_prefill_exits_within_the_grace() {
    let mut node = start(&format!("{ONE_WORKER}[node]\nshutdown_grace = \"4s\"\n"));
    let api = node.api.clone();
    let request = tokio::spawn(async move {
        reqwest::Client::new()
            .post(format!("{api}/completions"))
            .json(&completion(&long_prompt(15_000), 4))
            .send()
            .await
            .map(|r| r.status().as_u16())
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    let signalled = Instant::now();
    node.signal(libc::SIGTERM);
    let code = tokio::task::spawn_blocking(move || {
        let status = node.child.wait().expect("wait");
        (status, node)
    });
    let (status, _node) = tokio::time::timeout(Duration::from_secs(30), code).await.expect("exited").expect("join");
    let took = signalled.elapsed();
    assert_eq!(status.code(), Some(0), "clean exit");
    assert!(took < Duration::from_millis(5000), "exited {took:?} after SIGTERM, against a 4 s grace");
    // The request in flight got an answer or a closed connection, not a hang.
    let answered = tokio::time::timeout(Duration::from_secs(5), request).await.expect("request ended");
    assert!(answered.is_ok(), "{answered:?}");
}

/// 40 requests with an 8 MB `user` each (a client-chosen session key): the node keeps a digest
/// of each, not the key, so its memory does not grow with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_session_keys_leave_memory_bounded() {
    let node = start("[frontend]\nmax_sessions = 16\n");
    let (status, _) =
        node.chat(json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})).await;
    assert_eq!(status, 200);
    let before = node.rss_bytes();
    for i in 0..40u8 {
        let user = String::from(char::from(b'a' + i % 26)).repeat(8 << 20);
        let body =
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "user": user});
        let (status, answer) = node.chat(body).await;
        assert_eq!(status, 200, "{answer}");
    }
    let grown = node.rss_bytes().saturating_sub(before);
    assert!(grown < 200 << 20, "RSS grew {} MiB over 40 requests of 8 MB session keys", grown >> 20);
    assert_eq!(node.stop(), 0);
}

/// Two requests of 8,000 messages each render and tokenize off the async threads, in linear
/// time, while `/health` keeps answering (they are then refused for length).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_conversations_do_not_freeze_the_api() {
    let node = start("[frontend]\nmax_prompt_tokens = 20000\n");
    let messages: Vec<Value> = (0..8000)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "tool" }, "content": format!("w{i}")}))
        .collect();
    let body = json!({"model": "tiny", "messages": messages, "max_tokens": 1});
    let started = Instant::now();
    let heavy: Vec<_> = (0..2)
        .map(|_| {
            let api = node.api.clone();
            let body = body.clone();
            tokio::spawn(async move {
                let r = reqwest::Client::new().post(format!("{api}/chat/completions")).json(&body).send().await;
                let r = r.expect("request");
                (r.status().as_u16(), r.json::<Value>().await.expect("json"))
            })
        })
        .collect();
    let health = format!("{}/health", node.api.trim_end_matches("/v1"));
    let mut latencies = Vec::new();
    while !heavy.iter().all(|h| h.is_finished()) && latencies.len() < 50 {
        let t = Instant::now();
        let ok = reqwest::get(&health).await.expect("health").status();
        latencies.push(t.elapsed());
        assert_eq!(ok, 200);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for h in heavy {
        let (status, answer) = h.await.expect("join");
        assert_eq!(status, 400, "{answer}");
        assert_eq!(answer["error"]["code"], "context_length_exceeded", "{answer}");
    }
    assert!(started.elapsed() < Duration::from_secs(30), "rendering took {:?}", started.elapsed());
    latencies.sort();
    let median = latencies[latencies.len() / 2];
    assert!(median < Duration::from_millis(100), "/health took {median:?} (median) while they rendered: {latencies:?}");
    assert_eq!(node.stop(), 0);
}

/// Reads from `stream` until the server closes it or `limit` passes; whether it closed.
fn closed_within(stream: &mut TcpStream, limit: Duration) -> bool {
    stream.set_read_timeout(Some(Duration::from_millis(200))).expect("timeout");
    let deadline = Instant::now() + limit;
    let mut buf = [0u8; 1024];
    while Instant::now() < deadline {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return true,
        }
    }
    false
}

/// A silent connection, and one that sends a header line every half second, are closed at
/// `frontend.header_timeout`, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_silent_connections_are_cut_off() {
    let node = start("[frontend]\nheader_timeout = \"2s\"\n");
    let addr = node.addr().to_string();
    let (silent, trickle) = tokio::task::spawn_blocking(move || {
        let mut silent = TcpStream::connect(&addr).expect("connect");
        let opened = Instant::now();
        assert!(closed_within(&mut silent, Duration::from_secs(8)), "a silent connection stays open");
        let silent_after = opened.elapsed();

        let mut trickle = TcpStream::connect(&addr).expect("connect");
        trickle.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n").expect("write");
        let opened = Instant::now();
        let mut closed = false;
        for i in 0..16 {
            std::thread::sleep(Duration::from_millis(500));
            if trickle.write_all(format!("x-slow-{i}: 1\r\n").as_bytes()).is_err() {
                closed = true;
                break;
            }
        }
        assert!(closed || closed_within(&mut trickle, Duration::from_secs(1)), "a trickling client stays connected");
        (silent_after, opened.elapsed())
    })
    .await
    .expect("join");
    assert!(silent >= Duration::from_millis(1500) && silent < Duration::from_secs(5), "{silent:?}");
    assert!(trickle < Duration::from_secs(6), "{trickle:?}");
    assert!(node.metric("dynamo_node_http_connections_refused_total{reason=\"header_timeout\"}").await >= 2.0);
    // An ordinary client is unaffected.
    let (status, _) =
        node.chat(json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})).await;
    assert_eq!(status, 200);
    assert_eq!(node.stop(), 0);
}

/// A connection with a request in flight: a head whose body has not arrived (the handler waits on
/// it for `frontend.body_timeout`).
fn busy_connection(addr: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n\
              content-length: 1000\r\n\r\n{\"model\"",
        )
        .expect("write");
    stream
}

/// The first response on `stream` (read until it closes or 5 s pass).
fn answer_of(mut stream: TcpStream) -> String {
    stream.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer
}

/// `/health` from another client address (127.0.0.2; loopback takes any 127/8 address).
async fn health_from_another_client(node: &Node) -> u16 {
    let client = reqwest::Client::builder()
        .local_address(std::net::IpAddr::from([127, 0, 0, 2]))
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client");
    client.get(format!("http://{}/health", node.addr())).send().await.expect("request").status().as_u16()
}

/// At `frontend.max_connections`, a newcomer is served by closing an idle connection (one that
/// never sent a request), so one client re-opening idle sockets cannot hold every slot (it once
/// left a second client 503 on 38 of 40 tries). Only when every connection has a request in
/// flight is the newcomer answered 503 in the API's shape, and counted; once they close, clients
/// are served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_close_an_idle_one_or_get_a_503() {
    let node = start("[frontend]\nmax_connections = 3\nheader_timeout = \"30s\"\n");
    let addr = node.addr().to_string();
    let idle: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(&addr).expect("connect")).collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..5 {
        assert_eq!(health_from_another_client(&node).await, 200, "an idle connection made room");
    }
    assert!(node.metric("dynamo_node_http_connections_refused_total{reason=\"idle_closed\"}").await >= 1.0);
    drop(idle);
    tokio::time::sleep(Duration::from_millis(300)).await;

    let busy_addr = addr.clone();
    let answer = tokio::task::spawn_blocking(move || {
        let busy: Vec<TcpStream> = (0..3).map(|_| busy_connection(&busy_addr)).collect();
        std::thread::sleep(Duration::from_millis(300));
        let answer = answer_of(TcpStream::connect(&busy_addr).expect("connect"));
        drop(busy);
        answer
    })
    .await
    .expect("join");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer:?}");
    let body: Value = serde_json::from_str(answer.split_once("\r\n\r\n").expect("head").1).expect("JSON body");
    assert_eq!(body["error"]["code"], "unavailable", "{body}");
    assert!(answer.to_ascii_lowercase().contains("retry-after: 1"), "{answer}");
    assert_eq!(node.metric("dynamo_node_http_connections_refused_total{reason=\"limit\"}").await, 1.0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, _) =
        node.chat(json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})).await;
    assert_eq!(status, 200);
    assert_eq!(node.stop(), 0);
}

/// One client address holds at most `frontend.max_connections_per_client`: past it, its own idle
/// connection makes room, and with none idle it is answered 503 (`client_limit`) while another
/// client is still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_holds_at_most_its_share_of_connections() {
    let node = start("[frontend]\nmax_connections = 16\nmax_connections_per_client = 2\nheader_timeout = \"30s\"\n");
    let addr = node.addr().to_string();
    let busy_addr = addr.clone();
    let (answer, busy) = tokio::task::spawn_blocking(move || {
        let busy: Vec<TcpStream> = (0..2).map(|_| busy_connection(&busy_addr)).collect();
        std::thread::sleep(Duration::from_millis(300));
        (answer_of(TcpStream::connect(&busy_addr).expect("connect")), busy)
    })
    .await
    .expect("join");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer:?}");
    assert_eq!(node.metric("dynamo_node_http_connections_refused_total{reason=\"client_limit\"}").await, 1.0);
    assert_eq!(health_from_another_client(&node).await, 200, "another client is served");
    drop(busy);
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Its own idle connections make room for its next request.
    let idle: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(&addr).expect("connect")).collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, _) =
        node.chat(json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})).await;
    assert_eq!(status, 200);
    drop(idle);
    assert_eq!(node.stop(), 0);
}

/// Runs `config check` on `config`.
fn config_check(config: &std::path::Path) -> std::process::Output {
    std::process::Command::new(dynamo_tests::node_binary())
        .args(["config", "check"])
        .arg(config)
        .output()
        .expect("config check")
}

/// Runs `serve` with `config` on `data` to its end (a start that fails).
fn serve_once(data: &std::path::Path, config: &std::path::Path) -> std::process::Output {
    std::process::Command::new(dynamo_tests::node_binary())
        .args(["serve", "--http", "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .arg("--config")
        .arg(config)
        .output()
        .expect("serve")
}

/// A G4 secret that `serve` refuses — readable by others, or empty — is refused by `config
/// check` too, and by `serve` before G3 is formatted: no store is left behind.
#[test]
fn a_bad_g4_secret_is_refused_before_anything_is_made() {
    use std::os::unix::fs::PermissionsExt;
    for (what, bytes, mode) in [("readable by others", vec![7u8; 32], 0o644), ("empty", Vec::new(), 0o600)] {
        let dir = tempfile::tempdir().expect("tempdir");
        let secret = dir.path().join("g4.secret");
        std::fs::write(&secret, &bytes).expect("write");
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(mode)).expect("chmod");
        let data = dir.path().join("data");
        let config = dir.path().join("node.toml");
        let toml = format!(
            "[tiers.g4]\nenabled = true\nlisten = \"127.0.0.1:0\"\nsecret_file = \"{}\"\n\n\
             [tiers.g3]\ncapacity_per_path = \"64MiB\"\n",
            secret.display()
        );
        std::fs::write(&config, &toml).expect("write config");
        let check = config_check(&config);
        let said = String::from_utf8_lossy(&check.stderr);
        assert_eq!(check.status.code(), Some(2), "{what}: config check passed it: {said}");
        assert!(said.contains("secret"), "{what}: {said}");
        let served = serve_once(&data, &config);
        assert_ne!(served.status.code(), Some(0), "{what}");
        let g3 = data.join("g3");
        assert!(
            !g3.exists(),
            "{what}: serve formatted G3 before refusing the secret: {:?}",
            std::fs::read_dir(&g3).ok()
        );
    }
}

/// A text file named as the G3 path: `config check` and `serve` refuse it, naming it, and leave
/// it as it was; `tiers.g3.format_foreign = true` formats it.
#[test]
fn a_foreign_file_is_refused_as_a_g3_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let notes = dir.path().join("notes.txt");
    let text = "my notes, not a cache\n".repeat(1000);
    std::fs::write(&notes, &text).expect("write");
    let config = dir.path().join("node.toml");
    let toml = format!("[tiers.g3]\npaths = [\"{}\"]\ncapacity_per_path = \"64MiB\"\n", notes.display());
    std::fs::write(&config, &toml).expect("write config");

    let check = config_check(&config);
    let stderr = String::from_utf8_lossy(&check.stderr);
    assert_eq!(check.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("notes.txt") && stderr.contains("not a dynamo-node G3 store"), "{stderr}");

    let serve = serve_once(dir.path(), &config);
    let stderr = String::from_utf8_lossy(&serve.stderr);
    assert_eq!(serve.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("format_foreign"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&notes).expect("read"), text, "the file is untouched");

    std::fs::write(&config, format!("{toml}format_foreign = true\n")).expect("write config");
    let node =
        Node::start_in(Arc::new(tempfile::tempdir().expect("tempdir")), &std::fs::read_to_string(&config).unwrap());
    assert_eq!(node.stop(), 0);
    assert_ne!(std::fs::read(&notes).expect("read")[..8], text.as_bytes()[..8], "formatted when asked");
}

/// A G3 larger than its file system's free space: the start fails naming both sizes, and leaves
/// no file or directory behind.
#[test]
fn a_g3_that_does_not_fit_leaves_the_disk_as_it_was() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("node.toml");
    std::fs::write(&config, "[tiers.g3]\ncapacity_per_path = \"100000TiB\"\n").expect("write config");
    let data = dir.path().join("data");
    let out = serve_once(&data, &config);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("needs") && stderr.contains("free"), "{stderr}");
    assert_eq!(stderr.matches("os error").count(), 0, "{stderr}");
    assert!(!data.join("g3").exists(), "no G3 file or directory is left behind");

    // The case, where this test runs as root: a 2 GiB G3 on a 64 MiB file system.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("not root: the 64 MiB tmpfs case is not run");
        return;
    }
    let small = dir.path().join("small");
    std::fs::create_dir(&small).expect("mkdir");
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64m", "tmpfs"])
        .arg(&small)
        .status()
        .expect("mount");
    assert!(mounted.success(), "root can mount a tmpfs");
    let free_before = dynamo_tiering::g3::free_bytes(&small).expect("statvfs");
    let store = small.join("g3/store.0");
    let toml =
        format!("[tiers.g3]\npaths = [\"{}\"]\ncapacity_per_path = \"2GiB\"\ndirect_io = false\n", store.display());
    std::fs::write(&config, toml).expect("write config");
    let out = serve_once(&data, &config);
    let free_after = dynamo_tiering::g3::free_bytes(&small).expect("statvfs");
    let left: Vec<_> = std::fs::read_dir(&small).expect("list").collect();
    let _ = std::process::Command::new("umount").arg(&small).status();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("2.0 GiB") && stderr.contains("64.0 MiB"), "names the size and the free space: {stderr}");
    assert_eq!(free_after, free_before, "the free space is as it was");
    assert!(left.is_empty(), "nothing is left on the file system: {left:?}");
}

/// A full node's 429 says when to come back from what its queue holds (the cost model's time
/// per queued request), not a constant second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_node_says_when_to_retry_from_its_queue() {
    // A batch of one: one request runs, then one waits, and the queue is full.
    let node = start(&format!("{ONE_WORKER}max_queued_requests = 1\nmax_running_requests = 1\n"));
    let prompt = long_prompt(8_000);
    let mut busy = Vec::new();
    for _ in 0..2 {
        let api = node.api.clone();
        let body = completion(&prompt, 4);
        busy.push(tokio::spawn(async move {
            let client = reqwest::Client::new();
            let _ = client.post(format!("{api}/completions")).json(&body).timeout(Duration::from_secs(20)).send().await;
        }));
        tokio::time::sleep(Duration::from_millis(1000)).await;
    }
    let response = reqwest::Client::new()
        .post(format!("{}/completions", node.api))
        .json(&completion("hello", 1))
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 429);
    let retry_after: u64 = response.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    let body: Value = response.json().await.expect("json");
    assert_eq!(body["error"]["code"], "overloaded", "{body}");
    // Two prompts of ~22K tokens at this machine's measured prefill rate: seconds, not one.
    println!("Retry-After: {retry_after} s");
    assert!(retry_after > 1, "Retry-After: {retry_after}");
    for b in busy {
        b.abort();
    }
    assert_eq!(node.stop(), 0);
}
