//! `/metrics` of a running `dynamo-node` as Prometheus scrapes it: every required name with its
//! HELP and TYPE, tier capacities equal to what the node printed, bucketed histograms; and a
//! metrics address already in use is a clear start-up error.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dynamo_tests::{node_binary, spawn_until_ready};

fn start(data_dir: &std::path::Path, metrics: &str) -> (Child, Vec<String>) {
    let mut cmd = Command::new(node_binary());
    cmd.args(["serve", "--http", "127.0.0.1:0", "--metrics", metrics, "--data-dir"]).arg(data_dir);
    spawn_until_ready(cmd)
}

fn scrape(addr: &str) -> String {
    let mut stream = TcpStream::connect(addr).expect("connect to the metrics listener");
    stream.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read response");
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

fn sample(text: &str, series: &str) -> f64 {
    let line = text
        .lines()
        .find(|l| l.split_once(' ').is_some_and(|(name, _)| name == series))
        .unwrap_or_else(|| panic!("no sample {series} in:\n{text}"));
    line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("bad sample {line}"))
}

fn sigterm(mut child: Child) -> Option<i32> {
    // SAFETY: sending a signal to our own child process, whose pid is valid until we wait on it.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status.code();
        }
        assert!(Instant::now() < deadline, "no exit within 30 s of SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn metrics_are_scraped_with_help_types_tier_capacities_and_buckets() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Port 0: the node binds a free port and says which.
    let (child, lines) = start(dir.path(), "127.0.0.1:0");
    let addr = lines
        .iter()
        .find_map(|l| l.strip_prefix("metrics on http://").and_then(|l| l.strip_suffix("/metrics")))
        .unwrap_or_else(|| panic!("no metrics line in {lines:#?}"))
        .to_string();
    assert!(!addr.ends_with(":0"), "the bound port is printed, not 0: {addr}");

    let text = scrape(&addr);
    for (name, kind) in [
        ("dynamo_node_kv_blocks", "gauge"),
        ("dynamo_node_kv_capacity_blocks", "gauge"),
        ("dynamo_node_kv_prompt_tokens_total", "counter"),
        ("dynamo_node_kv_hit_tokens_total", "counter"),
        ("dynamo_node_kv_transfer_bytes_total", "counter"),
        ("dynamo_node_kv_transfer_seconds", "histogram"),
        ("dynamo_node_kv_evictions_total", "counter"),
        ("dynamo_node_kv_corrupt_blocks_total", "counter"),
        ("dynamo_node_requests_total", "counter"),
        ("dynamo_node_request_ttft_seconds", "histogram"),
        ("dynamo_node_inter_token_seconds", "histogram"),
        ("dynamo_node_prefill_tokens_total", "counter"),
        ("dynamo_node_io_inflight", "gauge"),
        ("dynamo_node_tier_degraded", "gauge"),
        ("dynamo_node_build_info", "gauge"),
        ("dynamo_node_kv_write_through_lag_seconds", "histogram"),
        ("dynamo_node_router_decision_seconds", "histogram"),
        ("dynamo_node_router_wait_seconds", "histogram"),
    ] {
        assert!(text.contains(&format!("# HELP {name} ")), "no HELP for {name} in:\n{text}");
        assert!(text.contains(&format!("# TYPE {name} {kind}\n")), "no TYPE {kind} for {name} in:\n{text}");
    }

    // The capacities the node printed: the G2 row's block column and the G3 recovery line.
    let g2_row = lines.iter().find(|l| l.starts_with("G2 ")).expect("a G2 row");
    let g2_blocks: f64 = g2_row.split_whitespace().rev().nth(1).and_then(|v| v.parse().ok()).expect("G2 blocks");
    let recovery = lines.iter().find(|l| l.starts_with("G3 recovered")).expect("the G3 recovery line");
    let g3_slots: f64 = recovery
        .split_once(" of ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("G3 slots");
    assert_eq!(sample(&text, "dynamo_node_kv_capacity_blocks{tier=\"g2\"}"), g2_blocks);
    assert_eq!(sample(&text, "dynamo_node_kv_capacity_blocks{tier=\"g3\"}"), g3_slots);
    assert_eq!(sample(&text, "dynamo_node_kv_blocks{tier=\"g3\"}"), 0.0, "a fresh store holds nothing");
    assert_eq!(sample(&text, "dynamo_node_tier_degraded{tier=\"g3\"}"), 0.0);
    assert_eq!(sample(&text, "dynamo_node_kv_evictions_total{tier=\"g2\",region=\"reasoning\"}"), 0.0);

    // Histograms are bucketed with the configured bounds, never summaries.
    assert!(text.contains("dynamo_node_request_ttft_seconds_bucket{le=\"0.0001\"} 0"), "{text}");
    assert!(text.contains("dynamo_node_request_ttft_seconds_bucket{le=\"+Inf\"} 0"), "{text}");
    assert!(text.contains("dynamo_node_kv_transfer_seconds_bucket{src=\"g3\",dst=\"g2\",le=\"60\"} 0"), "{text}");
    assert!(!text.contains("quantile="), "{text}");
    assert!(!text.contains("# TYPE dynamo_node_request_ttft_seconds summary"), "{text}");

    assert_eq!(sigterm(child), Some(0));
}

#[test]
fn a_metrics_address_in_use_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let out = Command::new(node_binary())
        .args(["serve", "--http", "127.0.0.1:0", "--metrics", &addr, "--data-dir"])
        .arg(dir.path())
        .output()
        .expect("run dynamo-node");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert!(stderr.contains(&format!("cannot serve metrics on {addr}")), "{stderr}");
    assert!(stderr.contains("in use"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("ready"), "the node must not start");
}

#[test]
fn disabled_metrics_serve_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = dir.path().join("node.toml");
    std::fs::write(&cfg, "[metrics]\nenabled = false\n").expect("write");
    let mut child = Command::new(node_binary())
        .args(["--config", cfg.to_str().expect("utf-8"), "--http", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let mut reader = BufReader::new(child.stdout.take().expect("stdout"));
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        assert!(reader.read_line(&mut line).expect("read") > 0, "exited early: {lines:#?}");
        let ready = line.starts_with("ready");
        lines.push(line.trim_end().to_string());
        if ready {
            break;
        }
    }
    std::thread::spawn(move || for _ in reader.lines() {});
    assert!(lines.iter().any(|l| l == "metrics disabled"), "{lines:#?}");
    assert_eq!(sigterm(child), Some(0));
}
