//! Nodes in network namespaces of their own, etcd in a third, on one bridge: G4 between hosts as
//! far as one machine can make them. Node B loads what node A computed; A is cut off (its link
//! goes down, silently: no reset, no FIN) and B stops asking it within its lease and heartbeats,
//! recomputing at once instead; the link comes back, A registers again under a new epoch and B
//! loads from it again. Then A's egress is shaped to 4 Mbit/s with tbf: B's fetch runs out of its
//! budget and is recomputed, and the cost model does not try that link again.
//!
//! Ignored by the plain test command: it needs root (namespaces, veth, a bridge, tc), etcd and the
//! node built with the `etcd` feature; `.ci/run` runs it.

use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dynamo_tests::{Node, node_binary};
use serde_json::json;

/// Namespaces `<prefix>-a`, `-b`, `-c` on a bridge, 10.79.<n>.1..3/24; removed on drop.
struct Hosts {
    prefix: String,
    subnet: u8,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip (iproute2)");
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

impl Hosts {
    fn new() -> Hosts {
        let pid = std::process::id();
        let hosts = Hosts { prefix: format!("dnt{}", pid % 100_000), subnet: (pid % 200) as u8 + 20 };
        let br = hosts.bridge();
        ip(&["link", "add", &br, "type", "bridge"]);
        ip(&["link", "set", &br, "up"]);
        ip(&["addr", "add", &format!("10.79.{}.254/24", hosts.subnet), "dev", &br]);
        for (i, name) in ["a", "b", "c"].iter().enumerate() {
            let ns = hosts.ns(name);
            let (veth, peer) = (format!("{}{name}", hosts.prefix), format!("{}{name}br", hosts.prefix));
            ip(&["netns", "add", &ns]);
            ip(&["link", "add", &veth, "type", "veth", "peer", "name", &peer]);
            ip(&["link", "set", &veth, "netns", &ns]);
            ip(&["link", "set", &peer, "master", &br]);
            ip(&["link", "set", &peer, "up"]);
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", hosts.addr(i)), "dev", &veth]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            ip(&["-n", &ns, "link", "set", &veth, "up"]);
        }
        hosts
    }

    fn bridge(&self) -> String {
        format!("{}br", self.prefix)
    }

    fn ns(&self, name: &str) -> String {
        format!("{}-{name}", self.prefix)
    }

    fn addr(&self, i: usize) -> String {
        format!("10.79.{}.{}", self.subnet, i + 1)
    }

    /// Host `name`'s own end of its link, inside its namespace.
    fn link(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    fn set_link(&self, name: &str, up: bool) {
        ip(&["-n", &self.ns(name), "link", "set", &self.link(name), if up { "up" } else { "down" }]);
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for name in ["a", "b", "c"] {
            let _ = Command::new("ip").args(["netns", "del", &self.ns(name)]).status();
        }
        let _ = Command::new("ip").args(["link", "del", &self.bridge()]).status();
    }
}

/// Whether this process may make namespaces (root, with iproute2 and the kernel's support).
fn can_make_namespaces() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    root && Command::new("ip").args(["netns", "list"]).output().is_ok_and(|o| o.status.success())
}

struct Etcd(Child);

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn start_etcd(hosts: &Hosts, dir: &tempfile::TempDir) -> (Etcd, String) {
    let addr = hosts.addr(2);
    let (url, peer) = (format!("http://{addr}:2379"), format!("http://{addr}:2380"));
    let child = Command::new("ip")
        .args(["netns", "exec", &hosts.ns("c"), "etcd", "--name", "c", "--data-dir"])
        .arg(dir.path().join("etcd"))
        .args(["--listen-client-urls", &url, "--advertise-client-urls", &url])
        .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &format!("c={peer}"), "--log-level", "error"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcd");
    let etcd = Etcd(child);
    let started = Instant::now();
    loop {
        if let Ok(resp) = reqwest::get(format!("{url}/health")).await
            && resp.text().await.is_ok_and(|t| t.contains("true"))
        {
            return (etcd, url);
        }
        assert!(started.elapsed() < Duration::from_secs(20), "etcd not healthy in 20 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn start_node(hosts: &Hosts, host: usize, name: &str, etcd: &str) -> Node {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let secret = dir.path().join("g4.secret");
    std::fs::write(&secret, [0x29; 32]).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let addr = hosts.addr(host);
    let toml = format!(
        "[node]\nname = \"{name}\"\n\n[tiers.g3]\ncapacity_per_path = \"64MiB\"\n\n[tiers.g4]\nenabled = true\n\
         listen = \"{addr}:7100\"\ncluster = \"netns\"\nsecret_file = \"{}\"\nheartbeat = \"500ms\"\n\n\
         [cluster]\nmembership = \"etcd\"\netcd_endpoints = [\"{etcd}\"]\nlease_ttl = \"2s\"\n",
        secret.display()
    );
    let file = dir.path().join("node.toml");
    std::fs::write(&file, toml).unwrap();
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &hosts.ns(["a", "b"][host]), node_binary().to_str().unwrap(), "serve"])
        .args(["--http", &format!("{addr}:0"), "--metrics", &format!("{addr}:0"), "--data-dir"])
        .arg(dir.path())
        .arg("--config")
        .arg(&file);
    Node::start_command(cmd, dir)
}

/// The answer, the prompt's complete blocks, and its cached tokens.
async fn ask(node: &Node, topic: &str) -> (String, f64, u64) {
    let prompt: String = (0..120).map(|i| format!("{topic} line {i}; ")).collect();
    let (status, body) = node
        .chat(json!({"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0}))
        .await;
    assert_eq!(status, 200, "{body}");
    let text = body["choices"][0]["message"]["content"].as_str().expect("content").to_owned();
    let blocks = (body["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens") / 32) as f64;
    (text, blocks, body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0))
}

async fn wait_for(node: &Node, series: &str, limit: Duration, done: impl Fn(f64) -> bool) -> f64 {
    let started = Instant::now();
    loop {
        let value = node.metric(series).await;
        if done(value) || started.elapsed() > limit {
            return value;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn metric_sum(node: &Node, prefix: &str, label: &str) -> f64 {
    let text = reqwest::get(format!("http://{}/metrics", node.metrics)).await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| l.starts_with(prefix) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

const G4_HITS: &str = "dynamo_node_kv_hit_tokens_total{tier=\"g4\"}";

#[tokio::test]
#[ignore = "needs root, network namespaces, etcd and the `etcd` feature; .ci/run runs it"]
async fn nodes_on_separate_hosts_share_kv_survive_a_silent_partition_and_avoid_a_slow_link() {
    assert!(can_make_namespaces(), "this test makes network namespaces: run it as root");
    let hosts = Hosts::new();
    let dir = tempfile::tempdir().unwrap();
    let (_etcd, etcd) = start_etcd(&hosts, &dir).await;
    let a = start_node(&hosts, 0, "node-a", &etcd);
    let b = start_node(&hosts, 1, "node-b", &etcd);
    let limit = Duration::from_secs(20);
    for node in [&a, &b] {
        assert_eq!(wait_for(node, "dynamo_node_cluster_members", limit, |v| v == 1.0).await, 1.0);
    }

    // B loads what A computed, across the bridge.
    let (a_alpha, blocks, _) = ask(&a, "alpha").await;
    let (a_beta, _, _) = ask(&a, "beta").await;
    wait_for(&b, "dynamo_node_index_blocks", limit, |v| v >= 2.0 * blocks).await;
    let (b_alpha, _, cached) = ask(&b, "alpha").await;
    assert_eq!(b_alpha, a_alpha);
    let hits = b.metric(G4_HITS).await;
    assert!(cached > 0 && hits == cached as f64, "cached {cached}, G4 hits {hits}");

    // A's link goes down without a word. B drops A (feed heartbeats, then A's lease) and answers
    // from its own compute at once.
    let epoch = a.metric("dynamo_node_cluster_epoch").await;
    hosts.set_link("a", false);
    let ended = wait_for(&b, "dynamo_node_peer_feed_ended_total", limit, |v| v >= 1.0).await;
    assert!(ended >= 1.0, "B's feed from A ended");
    let members = wait_for(&b, "dynamo_node_cluster_members", limit, |v| v == 0.0).await;
    assert_eq!(members, 0.0, "A left B's view with its lease");
    let started = Instant::now();
    let (b_beta, _, cached) = ask(&b, "beta").await;
    assert_eq!(b_beta, a_beta);
    assert_eq!(cached, 0);
    assert_eq!(b.metric(G4_HITS).await, hits, "nothing from a partitioned node");
    assert!(started.elapsed() < Duration::from_secs(5), "not held up: {:?}", started.elapsed());

    // The link heals: A registers again under a new epoch, and B loads from it again.
    hosts.set_link("a", true);
    let members = wait_for(&b, "dynamo_node_cluster_members", limit, |v| v == 1.0).await;
    assert_eq!(members, 1.0, "A is back in B's view");
    assert!(a.metric("dynamo_node_cluster_epoch").await > epoch, "under a new epoch");
    let known = b.metric("dynamo_node_index_blocks").await;
    let (a_gamma, _, _) = ask(&a, "gamma").await;
    wait_for(&b, "dynamo_node_index_blocks", limit, |v| v >= known + blocks).await;
    let (b_gamma, _, cached) = ask(&b, "gamma").await;
    assert_eq!(b_gamma, a_gamma);
    let hits_after_heal = b.metric(G4_HITS).await;
    assert!(cached > 0 && hits_after_heal > hits, "loaded from A's new epoch");

    // A's egress shaped to 4 Mbit/s: B's next fetch runs past its budget and is recomputed, and
    // the cost model then leaves that link alone.
    let shaped = Command::new("ip")
        .args(["netns", "exec", &hosts.ns("a"), "tc", "qdisc", "add", "dev", &hosts.link("a")])
        .args(["root", "tbf", "rate", "4mbit", "burst", "16kb", "latency", "400ms"])
        .status()
        .expect("tc");
    assert!(shaped.success(), "tc tbf");
    let (a_delta, _, _) = ask(&a, "delta").await;
    let (a_eps, _, _) = ask(&a, "epsilon").await;
    wait_for(&b, "dynamo_node_index_blocks", limit, |v| v >= known + 3.0 * blocks).await;
    let deadlines = metric_sum(&b, "dynamo_node_peer_fetches_total{", "outcome=\"deadline\"").await;
    let (b_delta, _, _) = ask(&b, "delta").await;
    assert_eq!(b_delta, a_delta);
    assert_eq!(b.metric(G4_HITS).await, hits_after_heal, "nothing loaded over the slow link");
    let after = metric_sum(&b, "dynamo_node_peer_fetches_total{", "outcome=\"deadline\"").await;
    assert_eq!(after, deadlines + 1.0, "the fetch ran out of its budget");
    let fetches = metric_sum(&b, "dynamo_node_peer_fetches_total{", "").await;
    let (b_eps, _, _) = ask(&b, "epsilon").await;
    assert_eq!(b_eps, a_eps);
    assert_eq!(
        metric_sum(&b, "dynamo_node_peer_fetches_total{", "").await,
        fetches,
        "the slow link is not tried again"
    );
    drop((a, b));
}
