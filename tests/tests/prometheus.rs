//! The operator's view, on real parts: a real Prometheus (Debian's `prometheus` package) scrapes a
//! real node under load, with the node's recording and alerting rules loaded, and every query of
//! the Grafana dashboard (`config/grafana/dynamo-node.json`) returns data through Prometheus's HTTP
//! API; `promtool` checks the rules, runs their unit tests and lints the node's exposition.
//!
//! Ignored by the plain test command (they need `prometheus` and `promtool` on the PATH, or
//! `DYNAMO_PROMETHEUS` / `DYNAMO_PROMTOOL`); `.ci/run` installs the package and runs them. Run
//! without the tools, they fail saying so: they never pass without having checked anything.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dynamo_tests::Node;
use serde_json::{Value, json};

const IGNORED: &str = "needs prometheus and promtool (Debian's prometheus package); .ci/run installs them";

fn repo_file(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

/// The tool from `var` or the PATH, or a failure that says what is missing.
fn tool(var: &str, name: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(var) {
        return PathBuf::from(path);
    }
    let found = std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|d| d.join(name)).find(|p| p.is_file()));
    found.unwrap_or_else(|| panic!("{name} not found on the PATH (or in {var}): {IGNORED}"))
}

fn promtool(args: &[&str], stdin: Option<&str>) -> (bool, String) {
    let mut child = Command::new(tool("DYNAMO_PROMTOOL", "promtool"))
        .args(args)
        .current_dir(repo_file("config/prometheus"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    {
        use std::io::Write;
        let mut input = child.stdin.take().expect("stdin");
        if let Some(text) = stdin {
            input.write_all(text.as_bytes()).expect("feed promtool");
        }
    }
    let out = child.wait_with_output().expect("promtool output");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
#[ignore = "needs prometheus and promtool (Debian's prometheus package); .ci/run installs them"]
fn the_rules_pass_promtool_check_and_their_unit_tests() {
    let (ok, out) = promtool(&["check", "rules", "dynamo-node-rules.yml"], None);
    assert!(ok, "promtool check rules:\n{out}");
    let (ok, out) = promtool(&["check", "config", "prometheus.yml"], None);
    assert!(ok, "promtool check config:\n{out}");
    let (ok, out) = promtool(&["test", "rules", "dynamo-node-rules.test.yml"], None);
    assert!(ok && out.contains("SUCCESS"), "promtool test rules:\n{out}");
    // Every alert of the rules has a unit test.
    let rules = std::fs::read_to_string(repo_file("config/prometheus/dynamo-node-rules.yml")).expect("rules");
    let tests = std::fs::read_to_string(repo_file("config/prometheus/dynamo-node-rules.test.yml")).expect("tests");
    let alerts: Vec<&str> = rules.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")).collect();
    assert!(alerts.len() >= 7, "{alerts:?}");
    for alert in alerts {
        assert!(
            tests.contains(&format!("alertname: {alert}\n        exp_alerts:\n          -")),
            "no firing case for {alert}"
        );
        assert!(tests.contains(&format!("alertname: {alert}\n        exp_alerts: []")), "no silent case for {alert}");
    }
}

/// A running Prometheus, killed when dropped.
struct Prometheus {
    child: Child,
    url: String,
    dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Scrapes `target` every second, with the node's rules loaded and evaluated every second.
    async fn start(target: &str) -> Prometheus {
        let dir = tempfile::tempdir().expect("tempdir");
        let rules = repo_file("config/prometheus/dynamo-node-rules.yml").canonicalize().expect("rules file");
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\n\
             scrape_configs:\n  - job_name: dynamo-node\n    static_configs:\n      - targets: [\"{target}\"]\n",
            rules.display()
        );
        std::fs::write(dir.path().join("prometheus.yml"), config).expect("write config");
        // A free port: bound and released just before Prometheus binds it.
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log");
        let child = Command::new(tool("DYNAMO_PROMETHEUS", "prometheus"))
            .arg(format!("--config.file={}", dir.path().join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        let prometheus = Prometheus { child, url: format!("http://127.0.0.1:{port}"), dir };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let ready = reqwest::get(format!("{}/-/ready", prometheus.url)).await;
            if ready.is_ok_and(|r| r.status().is_success()) {
                return prometheus;
            }
            assert!(Instant::now() < deadline, "prometheus not ready in 60 s: {}", prometheus.log());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    async fn api(&self, path: &str, query: &[(&str, &str)]) -> Value {
        let resp = reqwest::Client::new()
            .get(format!("{}/api/v1/{path}", self.url))
            .query(query)
            .send()
            .await
            .expect("prometheus API");
        resp.json().await.expect("prometheus JSON")
    }

    /// Evaluates `expr` now: its result, or the error Prometheus gave.
    async fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let answer = self.api("query", &[("query", expr)]).await;
        if answer["status"] != "success" {
            return Err(format!("{}: {}", answer["errorType"], answer["error"]));
        }
        Ok(answer["data"]["result"].as_array().cloned().unwrap_or_default())
    }
}

/// Requests of every API, streamed and not, repeated (so prefixes hit), and a malformed one.
async fn drive(node: &Node, round: usize) {
    let client = reqwest::Client::new();
    let system = "You are a careful coding agent. ".repeat(40);
    let chat = |stream: bool| {
        json!({
            "model": "tiny",
            "max_tokens": 6,
            "stream": stream,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": format!("turn {}", round % 3)},
            ],
        })
    };
    for (path, body) in [
        ("/chat/completions", chat(false)),
        ("/chat/completions", chat(true)),
        (
            "/messages",
            json!({"model": "tiny", "max_tokens": 4, "system": system,
                   "messages": [{"role": "user", "content": "hello"}]}),
        ),
        ("/responses", json!({"model": "tiny", "max_output_tokens": 4, "instructions": system, "input": "hi"})),
    ] {
        let resp = client
            .post(format!("{}{path}", node.api))
            .header("anthropic-version", "2023-06-01")
            .header("x-session-id", format!("dash-{}", round % 2))
            .json(&body)
            .send()
            .await
            .expect("request");
        let status = resp.status();
        let text = resp.text().await.expect("body");
        assert!(status.is_success(), "{path}: {status}: {text}");
    }
    let bad = client
        .post(format!("{}/chat/completions", node.api))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .expect("request");
    assert_eq!(bad.status().as_u16(), 400);
}

/// Every `expr` of the dashboard's panels, with the panel's title.
fn dashboard_queries() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo_file("config/grafana/dynamo-node.json")).expect("dashboard");
    let dashboard: Value = serde_json::from_str(&text).expect("dashboard JSON");
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("a PromQL expr").to_string();
            queries.push((panel["title"].as_str().unwrap_or("?").to_string(), expr));
        }
    }
    queries
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs prometheus and promtool (Debian's prometheus package); .ci/run installs them"]
async fn every_dashboard_query_returns_data_from_a_real_prometheus_scraping_a_real_node() {
    let queries = dashboard_queries();
    assert!(queries.len() >= 40, "{} queries", queries.len());
    let node = Node::start_in(std::sync::Arc::new(tempfile::tempdir().expect("tempdir")), "");
    let prometheus = Prometheus::start(&node.metrics).await;

    // Load over several scrapes, so that every rate has two points to go on.
    let started = Instant::now();
    let mut round = 0;
    while started.elapsed() < Duration::from_secs(8) {
        drive(&node, round).await;
        round += 1;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let up = prometheus.query("up{job=\"dynamo-node\"} == 1").await.expect("up");
        let scrapes = prometheus
            .query("count_over_time(dynamo_node_build_info[1m])")
            .await
            .expect("scrapes")
            .first()
            .and_then(|s| s["value"][1].as_str()?.parse::<f64>().ok())
            .unwrap_or(0.0);
        if !up.is_empty() && scrapes >= 8.0 {
            break;
        }
        assert!(Instant::now() < deadline, "Prometheus did not scrape the node: {}", prometheus.log());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    drive(&node, round).await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    // The instance variable lists the node.
    let instances = prometheus.api("label/instance/values", &[("match[]", "dynamo_node_build_info")]).await;
    assert!(
        instances["data"].as_array().is_some_and(|v| v.iter().any(|i| i == node.metrics.as_str())),
        "label_values(dynamo_node_build_info, instance): {instances}"
    );

    // Every panel query, as Grafana sends it for this instance over the last minute.
    let instance = node.metrics.replace('.', "\\\\.");
    let mut failures = Vec::new();
    for (title, expr) in &queries {
        let expr = expr.replace("$instance", &instance).replace("$__rate_interval", "15s").replace("$__range", "1m");
        match prometheus.query(&expr).await {
            Ok(result) if result.is_empty() => failures.push(format!("{title}: no data from {expr}")),
            Ok(_) => {}
            Err(e) => failures.push(format!("{title}: {e} in {expr}")),
        }
    }
    assert!(failures.is_empty(), "{} of {} queries failed:\n{}", failures.len(), queries.len(), failures.join("\n"));

    // The rules load and evaluate without errors.
    let rules = prometheus.api("rules", &[]).await;
    let groups = rules["data"]["groups"].as_array().expect("rule groups");
    assert_eq!(groups.len(), 2, "{rules}");
    for rule in groups.iter().flat_map(|g| g["rules"].as_array().into_iter().flatten()) {
        assert_ne!(rule["health"], "err", "{rule}");
        assert!(rule["lastError"].as_str().is_none_or(str::is_empty), "{rule}");
    }

    // The exposition itself passes promtool's lint.
    let text =
        reqwest::get(format!("http://{}/metrics", node.metrics)).await.expect("scrape").text().await.expect("body");
    let (ok, out) = promtool(&["check", "metrics"], Some(&text));
    assert!(ok && out.trim().is_empty(), "promtool check metrics:\n{out}");
}
