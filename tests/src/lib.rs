//! # dynamo-tests
//!
//! Integration, end-to-end and fault-injection tests of dynamo-node. Each file under `tests/` is
//! named `<area>_<topic>.rs` and exercises the public API of one or more crates as a user of them
//! would: real files with real io_uring, the real `dynamo-node` binary for the CLI, fault-injecting
//! engines for failures. Shared helpers live here.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::{Arc, OnceLock};

use serde_json::Value;

pub mod vllm;

/// The `dynamo-node` binary of this build (with the test-only `failpoints` feature), built first if
/// needed.
///
/// Cargo builds a dependency's library for an integration test but not its binaries, so a test
/// run straight after an edit could otherwise start a stale `dynamo-node`. The first call in a test
/// process runs `cargo build --bin dynamo-node` for the profile the tests were built with (a no-op
/// when it is fresh); a failure to build fails the test with cargo's output.
pub fn node_binary() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let mut dir = std::env::current_exe().expect("test executable path");
            dir.pop();
            if dir.ends_with("deps") {
                dir.pop();
            }
            let profile = dir.file_name().and_then(|p| p.to_str()).unwrap_or("debug").to_string();
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut cmd = Command::new(cargo);
            // With the test-only failpoints and the replay's virtual clock, as the tests' own build
            // of the library has them.
            let features =
                if cfg!(feature = "etcd") { "failpoints,virtual-time,etcd" } else { "failpoints,virtual-time" };
            cmd.args(["build", "--quiet", "-p", "dynamo-node", "--bin", "dynamo-node", "--features", features])
                .current_dir(env!("CARGO_MANIFEST_DIR"));
            if profile != "debug" {
                cmd.args(["--profile", if profile == "release" { "release" } else { &profile }]);
            }
            if let Some(target) = dir.parent() {
                cmd.env("CARGO_TARGET_DIR", target);
            }
            let out = cmd.output().expect("run cargo to build dynamo-node");
            assert!(out.status.success(), "building dynamo-node failed:\n{}", String::from_utf8_lossy(&out.stderr));
            dir.join("dynamo-node")
        })
        .clone()
}

/// Starts `cmd` (a `dynamo-node serve` command line) with piped stdout, reads its start-up lines
/// up to and including the `ready` line, and keeps draining stdout afterwards so the node never
/// blocks on a full pipe. Panics with the lines seen if the node exits first or is not ready in
/// two minutes.
pub fn spawn_until_ready(cmd: Command) -> (std::process::Child, Vec<String>) {
    // stderr goes to a file, so a node that dies before it is ready says why in the panic.
    static SPAWNED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SPAWNED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let stderr_path = std::env::temp_dir().join(format!("dynamo-node-test-{}-{n}.stderr", std::process::id()));
    let spawned = spawn_logging_until_ready(cmd, &stderr_path);
    let _ = std::fs::remove_file(&stderr_path);
    spawned
}

/// [`spawn_until_ready`] with the node's stderr (its log) written to `stderr_path`, which is kept.
pub fn spawn_logging_until_ready(
    mut cmd: Command,
    stderr_path: &std::path::Path,
) -> (std::process::Child, Vec<String>) {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    use std::time::{Duration, Instant};

    let stderr = std::fs::File::create(stderr_path).expect("stderr file");
    let mut child = cmd.stdout(Stdio::piped()).stderr(stderr).spawn().expect("spawn dynamo-node");
    let mut reader = BufReader::new(child.stdout.take().expect("stdout"));
    let mut lines = Vec::new();
    // Generous: a node that launches vLLM engines waits for them (30-50 s each here).
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let mut line = String::new();
        let n = reader.read_line(&mut line).expect("read stdout");
        if n == 0 {
            let stderr = std::fs::read_to_string(stderr_path).unwrap_or_default();
            let status = child.wait().map(|s| format!("{s:?}")).unwrap_or_else(|e| e.to_string());
            panic!("dynamo-node exited ({status}) before it was ready; output: {lines:#?}\nstderr:\n{stderr}");
        }
        let ready = line.starts_with("ready");
        lines.push(line.trim_end().to_string());
        if ready {
            break;
        }
        assert!(Instant::now() < deadline, "not ready within 300 s; output: {lines:#?}");
    }
    std::thread::spawn(move || for _ in reader.lines() {});
    (child, lines)
}

/// A single-member etcd (Debian's `etcd-server`) for the membership tests; killed when dropped.
#[derive(Debug)]
pub struct Etcd {
    child: Child,
    /// Its client URL, `http://IP:PORT`.
    pub url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Etcd {
    /// Starts etcd serving clients on `ip:client_port` (peers on `ip:peer_port`), run through
    /// `wrapper` (e.g. `ip netns exec NS`; empty for none), and waits until it is healthy.
    pub async fn start(wrapper: &[&str], ip: &str, client_port: u16, peer_port: u16) -> Etcd {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("http://{ip}:{client_port}");
        let peer = format!("http://{ip}:{peer_port}");
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg("etcd");
                cmd
            }
            None => Command::new("etcd"),
        };
        cmd.args(["--name", "t", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &url, "--advertise-client-urls", &url])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("t={peer}"), "--log-level", "error"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        let child = cmd.spawn().expect("etcd (apt-get install etcd-server)");
        let etcd = Etcd { child, url, _dir: dir };
        let started = std::time::Instant::now();
        loop {
            if let Ok(resp) = reqwest::get(format!("{}/health", etcd.url)).await
                && resp.text().await.is_ok_and(|t| t.contains("true"))
            {
                return etcd;
            }
            assert!(started.elapsed() < std::time::Duration::from_secs(20), "etcd not healthy in 20 s");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
}

/// A loopback port free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// A prompt of 120 numbered lines about `topic` (some 1,300 tokens: 40-odd blocks).
pub fn long_prompt(topic: &str) -> String {
    (0..120).map(|i| format!("{topic} line {i}; ")).collect()
}

/// A running `dynamo-node serve` on its defaults plus a config file, with the API and metrics on
/// free loopback ports; killed when dropped.
#[derive(Debug)]
pub struct Node {
    /// The process.
    pub child: Child,
    /// `http://ADDR/v1`.
    pub api: String,
    /// `ADDR` of `/metrics`.
    pub metrics: String,
    /// Its data directory.
    pub dir: Arc<tempfile::TempDir>,
    /// What it printed on stdout up to `ready`.
    pub announced: Vec<String>,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Node {
    /// A node on the embedded defaults in a fresh data directory.
    pub fn start() -> Node {
        Self::start_in(Arc::new(tempfile::tempdir().expect("tempdir")), "")
    }

    /// A node on its defaults plus `toml` (a config file written into `dir`, unless empty).
    pub fn start_in(dir: Arc<tempfile::TempDir>, toml: &str) -> Node {
        let (child, lines) = spawn_until_ready(Self::command(&dir, toml));
        Self::started(child, &lines, dir)
    }

    /// [`Node::start_in`], with the node's log (stderr) kept in `log` inside `dir`.
    pub fn start_logging(dir: Arc<tempfile::TempDir>, toml: &str, log: &str) -> Node {
        let (child, lines) = spawn_logging_until_ready(Self::command(&dir, toml), &dir.path().join(log));
        Self::started(child, &lines, dir)
    }

    /// Runs `cmd` (from [`Node::command`], with whatever the caller added: an environment
    /// variable, a wrapper) until it is ready.
    pub fn start_command(cmd: Command, dir: Arc<tempfile::TempDir>) -> Node {
        let (child, lines) = spawn_until_ready(cmd);
        Self::started(child, &lines, dir)
    }

    fn started(child: Child, lines: &[String], dir: Arc<tempfile::TempDir>) -> Node {
        let api = lines
            .iter()
            .find_map(|l| l.strip_prefix("serving the OpenAI API on "))
            .expect("the API address is printed")
            .to_string();
        let metrics = lines
            .iter()
            .find_map(|l| l.strip_prefix("metrics on http://").and_then(|l| l.strip_suffix("/metrics")))
            .expect("the metrics address is printed")
            .to_string();
        Node { child, api, metrics, dir, announced: lines.to_vec() }
    }

    /// The command line [`Node::start_in`] runs (port 0 for both listeners: the node prints the
    /// addresses it bound, so there is no race for a "free" port).
    pub fn command(dir: &tempfile::TempDir, toml: &str) -> Command {
        let mut cmd = Command::new(node_binary());
        cmd.args(["serve", "--http", "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--data-dir"]).arg(dir.path());
        if !toml.is_empty() {
            let file = dir.path().join("node.toml");
            std::fs::write(&file, toml).expect("write config");
            cmd.arg("--config").arg(file);
        }
        cmd
    }

    /// `host:port` of the API.
    pub fn addr(&self) -> &str {
        self.api.trim_start_matches("http://").trim_end_matches("/v1")
    }

    /// POSTs `body` to `/v1/chat/completions`; the status and the JSON answer.
    pub async fn chat(&self, body: Value) -> (u16, Value) {
        let resp = reqwest::Client::new()
            .post(format!("{}/chat/completions", self.api))
            .json(&body)
            .send()
            .await
            .expect("request");
        let status = resp.status().as_u16();
        (status, resp.json().await.expect("json body"))
    }

    /// The value of the first scraped series starting with `series` (0 when absent).
    pub async fn metric(&self, series: &str) -> f64 {
        let text =
            reqwest::get(format!("http://{}/metrics", self.metrics)).await.expect("scrape").text().await.expect("body");
        text.lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }

    /// The sum of every series of `prefix` (a metric name and `{`) whose labels contain `label`.
    pub async fn metric_sum(&self, prefix: &str, label: &str) -> f64 {
        let text =
            reqwest::get(format!("http://{}/metrics", self.metrics)).await.expect("scrape").text().await.expect("body");
        text.lines()
            .filter(|l| l.starts_with(prefix) && l.contains(label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Polls [`Node::metric`] of `series` until `done` holds for it, for `limit` at most; its last
    /// value.
    pub async fn wait_for_metric(&self, series: &str, limit: std::time::Duration, done: impl Fn(f64) -> bool) -> f64 {
        let started = std::time::Instant::now();
        loop {
            let value = self.metric(series).await;
            if done(value) || started.elapsed() > limit {
                return value;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// Polls [`Node::metric_sum`] of `prefix` and `label` until `done` holds for it, for `limit`
    /// at most; its last value.
    pub async fn wait_for_sum(
        &self,
        prefix: &str,
        label: &str,
        limit: std::time::Duration,
        done: impl Fn(f64) -> bool,
    ) -> f64 {
        let started = std::time::Instant::now();
        loop {
            let value = self.metric_sum(prefix, label).await;
            if done(value) || started.elapsed() > limit {
                return value;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// [`Node::greedy`] for [`long_prompt`]`(topic)`, with the prompt's complete blocks (of 32
    /// tokens) instead of its tokens.
    pub async fn greedy_topic(&self, topic: &str) -> (String, f64, u64) {
        let (text, prompt_tokens, cached) = self.greedy(&long_prompt(topic)).await;
        (text, (prompt_tokens / 32) as f64, cached)
    }

    /// A greedy chat completion of 12 tokens for `prompt`: the answer, the prompt's tokens and
    /// how many of them were cached.
    pub async fn greedy(&self, prompt: &str) -> (String, u64, u64) {
        let body = serde_json::json!({
            "model": "tiny",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 12,
            "temperature": 0
        });
        let (status, body) = self.chat(body).await;
        assert_eq!(status, 200, "{body}");
        let text = body["choices"][0]["message"]["content"].as_str().expect("content").to_owned();
        let usage = &body["usage"];
        let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
        (text, usage["prompt_tokens"].as_u64().expect("prompt_tokens"), cached)
    }

    /// Sends SIGTERM, waits, and returns the exit code.
    pub fn stop(mut self) -> i32 {
        self.signal(libc::SIGTERM);
        let status = self.child.wait().expect("wait");
        status.code().expect("exited on its own")
    }

    /// Sends `signal` to the node.
    pub fn signal(&self, signal: i32) {
        // SAFETY: signalling our own child, whose pid is valid until we wait on it.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, signal) }, 0);
    }

    /// The node's resident set size in bytes (`/proc/PID/status`).
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).expect("proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect("VmRSS")
            * 1024
    }
}
