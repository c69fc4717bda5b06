//! Nodes in network namespaces of their own, etcd in a fourth, on one bridge: G4 between hosts as
//! far as one machine can make them. Node B loads what node A computed, and node C what A and B
//! computed. A is cut off twice, silently (no reset, no FIN, no ICMP): once by its link going
//! down, once by iptables dropping everything in and out of its namespace with the link up. Each
//! time B stops asking A within its lease and heartbeats, recomputing at once instead, while A
//! goes on serving its own clients; the partition heals, A registers again under a new epoch and
//! B loads from it again, what A computed while cut off included. Then A's egress is shaped to
//! 4 Mbit/s with tbf: B's fetch runs out of its budget and is recomputed, and the cost model does
//! not try that link again.
//!
//! Ignored by the plain test command: it needs root (namespaces, veth, a bridge, tc, iptables),
//! etcd and the node built with the `etcd` feature; `.ci/run` runs it.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dynamo_tests::{Etcd, Node, node_binary};

/// The hosts, each a namespace `<prefix>-<name>` at 10.79.<n>.<its place + 1>/24 on one bridge:
/// three nodes and etcd.
const HOSTS: [&str; 4] = ["a", "b", "c", "etcd"];

/// The namespaces of [`HOSTS`] on a bridge, which has 10.79.<n>.254 (the test's own address on
/// it); removed on drop.
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
        ip(&["addr", "add", &format!("{}/24", hosts.test_addr()), "dev", &br]);
        for name in HOSTS {
            let ns = hosts.ns(name);
            let (veth, peer) = (hosts.link(name), format!("{}{name}br", hosts.prefix));
            ip(&["netns", "add", &ns]);
            ip(&["link", "add", &veth, "type", "veth", "peer", "name", &peer]);
            ip(&["link", "set", &veth, "netns", &ns]);
            ip(&["link", "set", &peer, "master", &br]);
            ip(&["link", "set", &peer, "up"]);
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", hosts.addr(name)), "dev", &veth]);
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

    fn addr(&self, name: &str) -> String {
        let place = HOSTS.iter().position(|&h| h == name).expect("one of HOSTS");
        format!("10.79.{}.{}", self.subnet, place + 1)
    }

    /// The test's own address, on the bridge: its requests and scrapes come from it.
    fn test_addr(&self) -> String {
        format!("10.79.{}.254", self.subnet)
    }

    /// Host `name`'s own end of its link, inside its namespace.
    fn link(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    fn set_link(&self, name: &str, up: bool) {
        ip(&["-n", &self.ns(name), "link", "set", &self.link(name), if up { "up" } else { "down" }]);
    }

    /// Cuts host `name` off (`true`) or heals it: iptables in its namespace drops every packet in
    /// and out (silently: no reset, no ICMP) but loopback's and the test's own, so the test can
    /// still ask and scrape the host while its peers and etcd cannot reach it. Its link stays up.
    fn set_firewall(&self, name: &str, cut: bool) {
        let test = self.test_addr();
        let rules: [&[&str]; 4] = [
            &["INPUT", "-s", &test, "-j", "ACCEPT"],
            &["INPUT", "!", "-i", "lo", "-j", "DROP"],
            &["OUTPUT", "-d", &test, "-j", "ACCEPT"],
            &["OUTPUT", "!", "-o", "lo", "-j", "DROP"],
        ];
        for rule in rules {
            let out = Command::new("ip")
                .args(["netns", "exec", &self.ns(name), "iptables", if cut { "-A" } else { "-D" }])
                .args(rule)
                .output()
                .expect("ip netns exec iptables");
            assert!(out.status.success(), "iptables {rule:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for name in HOSTS {
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

/// Node `node-<name>` in host `name`'s namespace, its G4 server on port 7100 there.
fn start_node(hosts: &Hosts, name: &str, etcd: &str) -> Node {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let secret = dir.path().join("g4.secret");
    std::fs::write(&secret, [0x29; 32]).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let addr = hosts.addr(name);
    let toml = format!(
        "[node]\nname = \"node-{name}\"\n\n[tiers.g3]\ncapacity_per_path = \"64MiB\"\n\n[tiers.g4]\nenabled = true\n\
         listen = \"{addr}:7100\"\ncluster = \"netns\"\nsecret_file = \"{}\"\nheartbeat = \"500ms\"\n\n\
         [cluster]\nmembership = \"etcd\"\netcd_endpoints = [\"{etcd}\"]\nlease_ttl = \"2s\"\n",
        secret.display()
    );
    let file = dir.path().join("node.toml");
    std::fs::write(&file, toml).unwrap();
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &hosts.ns(name), node_binary().to_str().unwrap(), "serve"])
        .args(["--http", &format!("{addr}:0"), "--metrics", &format!("{addr}:0"), "--data-dir"])
        .arg(dir.path())
        .arg("--config")
        .arg(&file);
    Node::start_command(cmd, dir)
}

const G4_HITS: &str = "dynamo_node_kv_hit_tokens_total{tier=\"g4\"}";
const MEMBERS: &str = "dynamo_node_cluster_members";
const INDEX: &str = "dynamo_node_index_blocks";
const FEED_ENDED: &str = "dynamo_node_peer_feed_ended_total{";

#[tokio::test]
#[ignore = "needs root, network namespaces, etcd and the `etcd` feature; .ci/run runs it"]
async fn nodes_on_separate_hosts_share_kv_survive_silent_partitions_and_avoid_a_slow_link() {
    assert!(can_make_namespaces(), "this test makes network namespaces: run it as root");
    let hosts = Hosts::new();
    let etcd = Etcd::start(&["ip", "netns", "exec", &hosts.ns("etcd")], &hosts.addr("etcd"), 2379, 2380).await;
    let a = start_node(&hosts, "a", &etcd.url);
    let b = start_node(&hosts, "b", &etcd.url);
    let c = start_node(&hosts, "c", &etcd.url);
    let limit = Duration::from_secs(20);
    for node in [&a, &b, &c] {
        assert_eq!(node.wait_for_metric(MEMBERS, limit, |v| v == 2.0).await, 2.0);
    }
    let from_a = format!("peer=\"{}:7100\"", hosts.addr("a"));
    let from_b = format!("peer=\"{}:7100\"", hosts.addr("b"));

    // B loads what A computed, across the bridge.
    let (a_alpha, alpha_blocks, _) = a.greedy_topic("alpha").await;
    let (a_beta, beta_blocks, _) = a.greedy_topic("beta").await;
    b.wait_for_metric(INDEX, limit, |v| v >= alpha_blocks + beta_blocks).await;
    let (b_alpha, _, cached) = b.greedy_topic("alpha").await;
    assert_eq!(b_alpha, a_alpha);
    let hits = b.metric(G4_HITS).await;
    assert!(cached > 0 && hits == cached as f64, "cached {cached}, G4 hits {hits}");

    // The third host: C loads what A computed, and what B computed (only B has it).
    let c_known = c.wait_for_metric(INDEX, limit, |v| v >= alpha_blocks + beta_blocks).await;
    let (b_zeta, zeta_blocks, _) = b.greedy_topic("zeta").await;
    c.wait_for_metric(INDEX, limit, |v| v >= c_known + zeta_blocks).await;
    let (c_alpha, _, c_cached_alpha) = c.greedy_topic("alpha").await;
    assert_eq!(c_alpha, a_alpha);
    let (c_zeta, _, c_cached_zeta) = c.greedy_topic("zeta").await;
    assert_eq!(c_zeta, b_zeta);
    let c_hits = c.metric(G4_HITS).await;
    assert!(c_cached_alpha > 0 && c_cached_zeta > 0, "C cached {c_cached_alpha} and {c_cached_zeta} tokens");
    assert_eq!(c_hits, (c_cached_alpha + c_cached_zeta) as f64, "all of C's cached tokens came from its peers");
    let c_from_b = c.metric_sum("dynamo_node_peer_fetched_blocks_total{", &from_b).await;
    assert!(c_from_b >= (c_cached_zeta / 32) as f64, "B's blocks came from B: {c_from_b}");

    // A's link goes down without a word. B drops A (feed heartbeats, then A's lease) and answers
    // from its own compute at once.
    let epoch = a.metric("dynamo_node_cluster_epoch").await;
    hosts.set_link("a", false);
    let ended = b.wait_for_sum(FEED_ENDED, &from_a, limit, |v| v >= 1.0).await;
    assert!(ended >= 1.0, "B's feed from A ended");
    assert_eq!(b.wait_for_metric(MEMBERS, limit, |v| v == 1.0).await, 1.0, "A left B's view with its lease");
    let started = Instant::now();
    let (b_beta, _, cached) = b.greedy_topic("beta").await;
    assert_eq!(b_beta, a_beta);
    assert_eq!(cached, 0);
    assert_eq!(b.metric(G4_HITS).await, hits, "nothing from a partitioned node");
    assert!(started.elapsed() < Duration::from_secs(5), "not held up: {:?}", started.elapsed());

    // The link heals: A registers again under a new epoch, and B loads from it again.
    hosts.set_link("a", true);
    assert_eq!(b.wait_for_metric(MEMBERS, limit, |v| v == 2.0).await, 2.0, "A is back in B's view");
    let new_epoch = a.metric("dynamo_node_cluster_epoch").await;
    assert!(new_epoch > epoch, "under a new epoch");
    let known = b.metric(INDEX).await;
    let (a_gamma, gamma_blocks, _) = a.greedy_topic("gamma").await;
    b.wait_for_metric(INDEX, limit, |v| v >= known + gamma_blocks).await;
    let (b_gamma, _, cached) = b.greedy_topic("gamma").await;
    assert_eq!(b_gamma, a_gamma);
    let hits_after_heal = b.metric(G4_HITS).await;
    assert!(cached > 0 && hits_after_heal > hits, "loaded from A's new epoch");

    // iptables in A's namespace drops everything from and to its peers and etcd, its link up. B
    // drops A as before and recomputes what A computed just before the cut; A, cut off, goes on
    // answering its own clients (the test's requests still reach it).
    let known = b.metric(INDEX).await;
    let (a_eta, eta_blocks, _) = a.greedy_topic("eta").await;
    b.wait_for_metric(INDEX, limit, |v| v >= known + eta_blocks).await;
    let ended = b.metric_sum(FEED_ENDED, &from_a).await;
    hosts.set_firewall("a", true);
    let now = b.wait_for_sum(FEED_ENDED, &from_a, limit, |v| v > ended).await;
    assert!(now > ended, "B's feed from A ended again");
    assert_eq!(b.wait_for_metric(MEMBERS, limit, |v| v == 1.0).await, 1.0, "A left B's view again");
    let started = Instant::now();
    let (b_eta, _, cached) = b.greedy_topic("eta").await;
    assert_eq!(b_eta, a_eta);
    assert_eq!(cached, 0);
    assert_eq!(b.metric(G4_HITS).await, hits_after_heal, "nothing from a node behind a firewall");
    assert!(started.elapsed() < Duration::from_secs(5), "not held up: {:?}", started.elapsed());
    let (a_theta, theta_blocks, _) = a.greedy_topic("theta").await;
    assert_eq!(c.wait_for_metric(MEMBERS, limit, |v| v == 1.0).await, 1.0, "C lost A too");

    // The rules go: A registers under yet another epoch, and B loads from A what A computed
    // while cut off (it comes with A's new feed's snapshot).
    let known = b.metric(INDEX).await;
    hosts.set_firewall("a", false);
    assert_eq!(b.wait_for_metric(MEMBERS, limit, |v| v == 2.0).await, 2.0, "A is back in B's view");
    assert!(a.metric("dynamo_node_cluster_epoch").await > new_epoch, "under a new epoch");
    b.wait_for_metric(INDEX, limit, |v| v >= known + theta_blocks).await;
    let (b_theta, _, cached) = b.greedy_topic("theta").await;
    assert_eq!(b_theta, a_theta);
    let hits = b.metric(G4_HITS).await;
    assert!(cached > 0 && hits == hits_after_heal + cached as f64, "loaded from A after the firewall: {cached}");
    // After the heal every index equals its peers' truth: what B and C hold for A is the set A's
    // feed offers, in number and in the digest of the set (which tells apart sets of one size).
    let truth = a.metric("dynamo_node_peer_servable_blocks").await;
    let truth_digest = a.metric("dynamo_node_peer_servable_digest").await;
    assert!(truth > 0.0 && truth_digest != 0.0, "A offers blocks");
    for (name, node) in [("B", &b), ("C", &c)] {
        let series = format!("dynamo_node_peer_index_blocks{{{from_a}}}");
        let held = node.wait_for_metric(&series, limit, |v| v == truth).await;
        assert_eq!(held, truth, "{name}'s index holds as many blocks as A offers");
        let series = format!("dynamo_node_peer_index_digest{{{from_a}}}");
        let digest = node.wait_for_metric(&series, limit, |v| v == truth_digest).await;
        assert_eq!(digest, truth_digest, "{name}'s index holds the very blocks A offers");
    }

    // A's egress shaped to 4 Mbit/s: B's next fetch runs past its budget and is recomputed, and
    // the cost model then leaves that link alone.
    let shaped = Command::new("ip")
        .args(["netns", "exec", &hosts.ns("a"), "tc", "qdisc", "add", "dev", &hosts.link("a")])
        .args(["root", "tbf", "rate", "4mbit", "burst", "16kb", "latency", "400ms"])
        .status()
        .expect("tc");
    assert!(shaped.success(), "tc tbf");
    let known = b.metric(INDEX).await;
    let (a_delta, delta_blocks, _) = a.greedy_topic("delta").await;
    let (a_eps, eps_blocks, _) = a.greedy_topic("epsilon").await;
    b.wait_for_metric(INDEX, limit, |v| v >= known + delta_blocks + eps_blocks).await;
    let deadlines = b.metric_sum("dynamo_node_peer_fetches_total{", "outcome=\"deadline\"").await;
    let (b_delta, _, _) = b.greedy_topic("delta").await;
    assert_eq!(b_delta, a_delta);
    assert_eq!(b.metric(G4_HITS).await, hits, "nothing loaded over the slow link");
    let after = b.metric_sum("dynamo_node_peer_fetches_total{", "outcome=\"deadline\"").await;
    assert_eq!(after, deadlines + 1.0, "the fetch ran out of its budget");
    let fetches = b.metric_sum("dynamo_node_peer_fetches_total{", "").await;
    let (b_eps, _, _) = b.greedy_topic("epsilon").await;
    assert_eq!(b_eps, a_eps);
    assert_eq!(b.metric_sum("dynamo_node_peer_fetches_total{", "").await, fetches, "the slow link is not tried again");
    drop((a, b, c));
}
