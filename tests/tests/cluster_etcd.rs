//! Membership on a real etcd (Debian's `etcd-server` 3.4): nodes register under a lease, find each
//! other by watching, and share KV over G4. A node paused past its lease (SIGSTOP) leaves its
//! peers' view, so requests there recompute at once instead of waiting on it; resumed (SIGCONT),
//! it registers again under a new epoch and is loaded from again. With etcd gone, nodes keep their
//! last view and go on serving.
//!
//! Ignored by the plain test command (it needs the `etcd` binary); `.ci/run` installs
//! `etcd-server` and runs it.

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dynamo_tests::{Etcd, Node, free_port};

fn config(dir: &tempfile::TempDir, name: &str, etcd: &str) -> String {
    let secret = dir.path().join("g4.secret");
    std::fs::write(&secret, [0x17; 32]).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    format!(
        "[node]\nname = \"{name}\"\n\n[tiers.g3]\ncapacity_per_path = \"64MiB\"\n\n[tiers.g4]\nenabled = true\n\
         listen = \"127.0.0.1:0\"\ncluster = \"test\"\nsecret_file = \"{}\"\nheartbeat = \"200ms\"\n\n\
         [cluster]\nmembership = \"etcd\"\netcd_endpoints = [\"{etcd}\"]\nlease_ttl = \"2s\"\n",
        secret.display()
    )
}

const G4_HITS: &str = "dynamo_node_kv_hit_tokens_total{tier=\"g4\"}";

#[tokio::test]
#[ignore = "needs etcd (Debian's etcd-server); .ci/run installs it and runs this test"]
async fn nodes_find_each_other_in_etcd_and_a_paused_node_returns_under_a_new_epoch() {
    let etcd = Etcd::start(&[], "127.0.0.1", free_port(), free_port()).await;
    let (dir_a, dir_b) = (Arc::new(tempfile::tempdir().unwrap()), Arc::new(tempfile::tempdir().unwrap()));
    let a = Node::start_in(dir_a.clone(), &config(&dir_a, "node-a", &etcd.url));
    let b = Node::start_in(dir_b.clone(), &config(&dir_b, "node-b", &etcd.url));
    let limit = Duration::from_secs(15);
    for node in [&a, &b] {
        let members = node.wait_for_metric("dynamo_node_cluster_members", limit, |v| v == 1.0).await;
        assert_eq!(members, 1.0, "each node sees the other");
    }
    let epoch = a.metric("dynamo_node_cluster_epoch").await;
    assert!(epoch > 0.0);

    // A computes; B loads A's prefix over G4, with A's answer.
    let (a_alpha, blocks, _) = a.greedy_topic("alpha").await;
    let (a_beta, _, _) = a.greedy_topic("beta").await;
    b.wait_for_metric("dynamo_node_index_blocks", limit, |v| v >= 2.0 * blocks).await;
    let (b_alpha, _, cached) = b.greedy_topic("alpha").await;
    assert_eq!(b_alpha, a_alpha);
    let hits = b.metric(G4_HITS).await;
    assert!(cached > 0 && hits == cached as f64, "cached {cached}, G4 hits {hits}");

    // A is paused past its lease: B's view drops it, and B recomputes at once rather than wait on
    // a node that cannot answer.
    a.signal(libc::SIGSTOP);
    let members = b.wait_for_metric("dynamo_node_cluster_members", limit, |v| v == 0.0).await;
    assert_eq!(members, 0.0, "the paused node left B's view");
    let started = Instant::now();
    let (b_beta, _, cached) = b.greedy_topic("beta").await;
    assert_eq!(b_beta, a_beta, "recomputed, the same tokens");
    assert_eq!(cached, 0);
    assert_eq!(b.metric(G4_HITS).await, hits, "no hit from a node out of the view");
    assert!(started.elapsed() < Duration::from_secs(10), "not held up by the paused node");

    // Resumed, A registers again under a new epoch, and B loads from it again.
    a.signal(libc::SIGCONT);
    let registrations = a.wait_for_metric("dynamo_node_cluster_registrations_total", limit, |v| v >= 2.0).await;
    assert!(registrations >= 2.0, "A registered again");
    assert!(a.metric("dynamo_node_cluster_epoch").await > epoch, "under a new epoch");
    let members = b.wait_for_metric("dynamo_node_cluster_members", limit, |v| v == 1.0).await;
    assert_eq!(members, 1.0, "A is back in B's view");
    let known = b.metric("dynamo_node_index_blocks").await;
    let (a_gamma, _, _) = a.greedy_topic("gamma").await;
    // B's feed from A's new epoch brings A's new blocks shortly after A answers.
    b.wait_for_metric("dynamo_node_index_blocks", limit, |v| v >= known + blocks).await;
    let (b_gamma, _, cached) = b.greedy_topic("gamma").await;
    assert_eq!(b_gamma, a_gamma);
    assert!(cached > 0 && b.metric(G4_HITS).await > hits, "loaded from A's new epoch");

    // etcd goes away: the nodes keep their view and serve.
    drop(etcd);
    let up = b.wait_for_metric("dynamo_node_cluster_etcd_up", limit, |v| v == 0.0).await;
    assert_eq!(up, 0.0, "B noticed etcd is gone");
    assert_eq!(b.metric("dynamo_node_cluster_members").await, 1.0, "and kept its view");
    let (again, _, _) = b.greedy_topic("alpha").await;
    assert_eq!(again, a_alpha);
    assert_eq!(b.stop(), 0);
    assert_eq!(a.stop(), 0);
}

/// A binary built without the `etcd` feature (the default: it needs protoc) refuses etcd
/// membership at start, saying how to get it, rather than running without peers.
#[cfg(not(feature = "etcd"))]
#[test]
fn without_the_etcd_feature_etcd_membership_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let toml = config(&dir, "node-a", "http://127.0.0.1:9");
    let out = Node::command(&dir, &toml).stdin(std::process::Stdio::null()).output().expect("run the node");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("built with the `etcd` feature"), "{stderr}");
}
