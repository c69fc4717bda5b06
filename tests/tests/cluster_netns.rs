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
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dynamo_tests::{Etcd, Node, node_binary};

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

const G4_HITS: &str = "dynamo_node_kv_hit_tokens_total{tier=\"g4\"}";

#[tokio::test]
#[ignore = "needs root, network namespaces, etcd and the `etcd` feature; .ci/run runs it"]
async fn nodes_on_separate_hosts_share_kv_survive_a_silent_partition_and_avoid_a_slow_link() {
    assert!(can_make_namespaces(), "this test makes network namespaces: run it as root");
    let hosts = Hosts::new();
    let etcd_ns = hosts.ns("c");
    let etcd = Etcd::start(&["ip", "netns", "exec", &etcd_ns], &hosts.addr(2), 2379, 2380).await;
    let etcd_guard = etcd;
    let etcd = etcd_guard.url.clone();
    let a = start_node(&hosts, 0, "node-a", &etcd);
    let b = start_node(&hosts, 1, "node-b", &etcd);
    let limit = Duration::from_secs(20);
    for node in [&a, &b] {
        assert_eq!(node.wait_for_metric("dynamo_node_cluster_members", limit, |v| v == 1.0).await, 1.0);
    }

    // B loads what A computed, across the bridge.
    let (a_alpha, blocks, _) = a.greedy_topic("alpha").await;
    let (a_beta, _, _) = a.greedy_topic("beta").await;
    b.wait_for_metric("dynamo_node_index_blocks", limit, |v| v >= 2.0 * blocks).await;
    let (b_alpha, _, cached) = b.greedy_topic("alpha").await;
    assert_eq!(b_alpha, a_alpha);
    let hits = b.metric(G4_HITS).await;
    assert!(cached > 0 && hits == cached as f64, "cached {cached}, G4 hits {hits}");

    // A's link goes down without a word. B drops A (feed heartbeats, then A's lease) and answers
    // from its own compute at once.
    let epoch = a.metric("dynamo_node_cluster_epoch").await;
    hosts.set_link("a", false);
    let ended = b.wait_for_metric("dynamo_node_peer_feed_ended_total", limit, |v| v >= 1.0).await;
    assert!(ended >= 1.0, "B's feed from A ended");
    let members = b.wait_for_metric("dynamo_node_cluster_members", limit, |v| v == 0.0).await;
    assert_eq!(members, 0.0, "A left B's view with its lease");
    let started = Instant::now();
    let (b_beta, _, cached) = b.greedy_topic("beta").await;
    assert_eq!(b_beta, a_beta);
    assert_eq!(cached, 0);
    assert_eq!(b.metric(G4_HITS).await, hits, "nothing from a partitioned node");
    assert!(started.elapsed() < Duration::from_secs(5), "not held up: {:?}", started.elapsed());

    // The link heals: A registers again under a new epoch, and B loads from it again.
    hosts.set_link("a", true);
    let members = b.wait_for_metric("dynamo_node_cluster_members", limit, |v| v == 1.0).await;
    assert_eq!(members, 1.0, "A is back in B's view");
    assert!(a.metric("dynamo_node_cluster_epoch").await > epoch, "under a new epoch");
    let known = b.metric("dynamo_node_index_blocks").await;
    let (a_gamma, _, _) = a.greedy_topic("gamma").await;
    b.wait_for_metric("dynamo_node_index_blocks", limit, |v| v >= known + blocks).await;
    let (b_gamma, _, cached) = b.greedy_topic("gamma").await;
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
    let (a_delta, _, _) = a.greedy_topic("delta").await;
    let (a_eps, _, _) = a.greedy_topic("epsilon").await;
    b.wait_for_metric("dynamo_node_index_blocks", limit, |v| v >= known + 3.0 * blocks).await;
    let deadlines = b.metric_sum("dynamo_node_peer_fetches_total{", "outcome=\"deadline\"").await;
    let (b_delta, _, _) = b.greedy_topic("delta").await;
    assert_eq!(b_delta, a_delta);
    assert_eq!(b.metric(G4_HITS).await, hits_after_heal, "nothing loaded over the slow link");
    let after = b.metric_sum("dynamo_node_peer_fetches_total{", "outcome=\"deadline\"").await;
    assert_eq!(after, deadlines + 1.0, "the fetch ran out of its budget");
    let fetches = b.metric_sum("dynamo_node_peer_fetches_total{", "").await;
    let (b_eps, _, _) = b.greedy_topic("epsilon").await;
    assert_eq!(b_eps, a_eps);
    assert_eq!(b.metric_sum("dynamo_node_peer_fetches_total{", "").await, fetches, "the slow link is not tried again");
    drop((a, b));
}
