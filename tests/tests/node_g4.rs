//! G4's serving side on the real binary: a node with `tiers.g4` enabled serves the blocks it
//! computed, from G2, to a peer that proves the cluster secret, and to no one else.
//!
//! The test finds the node's block hashes where an operator could: in the G3 store, whose slots
//! hold the same sealed images that G2 holds. It holds and fetches them over the protocol, and
//! the images it receives are verified and equal, byte for byte, to the ones on disk.
//!
//! The node asks for `transport = "rdma"` on a machine (and a build) without RDMA: it says so at
//! start, declines a peer's queue pair, and serves over TCP all the same.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::Duration;

use dynamo_tests::Node;
use dynamo_tiering::block::image::MAGIC;
use dynamo_tiering::block::{BlockHash, ImageHeader};
use dynamo_tiering::g4::auth::{ClusterSecret, PeerIdentity};
use dynamo_tiering::g4::tcp::{ClientConfig, Fetched, PeerClient};
use dynamo_tiering::g4::wire::{Integrity, RdmaEndpoint, WireLimits};
use serde_json::json;
use tokio::io::AsyncWriteExt;

/// The address the node printed for its block server.
fn g4_addr(node: &Node) -> SocketAddr {
    node.announced
        .iter()
        .find_map(|l| l.strip_prefix("G4 block server on "))
        .and_then(|l| l.split_whitespace().next())
        .expect("the G4 address is printed")
        .parse()
        .unwrap()
}

fn client(secret: [u8; 32]) -> ClientConfig {
    ClientConfig {
        secret: ClusterSecret::from_bytes(secret),
        me: PeerIdentity { cluster: "test".into(), node: "reader".into(), epoch: 1 },
        wire: WireLimits::default(),
        integrity: Integrity::Mac,
        connect_timeout: Duration::from_secs(5),
        request_timeout: Duration::from_secs(5),
        tls: None,
    }
}

/// Every sealed image in the G3 store file: (hash, image bytes).
fn images_on_disk(path: &std::path::Path) -> Vec<(BlockHash, Vec<u8>)> {
    let data = std::fs::read(path).expect("the G3 store");
    let mut out = Vec::new();
    for at in (0..data.len()).step_by(4096) {
        if data[at..].starts_with(&MAGIC)
            && let Ok(header) = ImageHeader::decode_header_only(&data[at..])
        {
            out.push((header.hash, data[at..at + header.image_bytes()].to_vec()));
        }
    }
    out
}

#[tokio::test]
async fn a_node_serves_its_blocks_to_a_peer_with_the_secret_and_to_no_one_else() {
    let dir = Arc::new(tempfile::tempdir().expect("tempdir"));
    let secret = [0x5a; 32];
    let secret_file = dir.path().join("g4.secret");
    std::fs::write(&secret_file, secret).unwrap();
    std::fs::set_permissions(&secret_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let config = format!(
        "[tiers.g3]\ncapacity_per_path = \"64MiB\"\n\n[tiers.g4]\nenabled = true\nlisten = \"127.0.0.1:0\"\n\
         cluster = \"test\"\nsecret_file = \"{}\"\ntransport = \"rdma\"\n",
        secret_file.display()
    );
    let node = Node::start_logging(dir.clone(), &config, "node.log");
    let log = std::fs::read_to_string(dir.path().join("node.log")).unwrap();
    assert!(log.contains("tiers.g4.transport = \"rdma\"") && log.contains("G4 uses TCP"), "{log}");
    assert_eq!(node.metric("dynamo_node_peer_rdma").await, 0.0);
    let g4 = g4_addr(&node);

    // A prompt of some blocks, computed once and written through to G2 and G3.
    let prompt: String = (0..200).map(|i| format!("line {i} of the file; ")).collect();
    let (status, _) =
        node.chat(json!({"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2})).await;
    assert_eq!(status, 200);
    let mut on_disk = Vec::new();
    for _ in 0..100 {
        on_disk = images_on_disk(&dir.path().join("g3").join("store.0"));
        if on_disk.len() >= 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(on_disk.len() >= 4, "blocks written through to G3: {}", on_disk.len());
    let hashes: Vec<BlockHash> = on_disk.iter().map(|(h, _)| *h).collect();

    // A peer with the secret holds and fetches them: verified, and the very images on disk. Its
    // queue pair is declined first: the node has no RDMA.
    let mut peer = PeerClient::connect(g4, &client(secret)).await.expect("authenticated");
    assert_eq!(peer.peer().cluster, "test");
    let declined = peer.rdma_connect(RdmaEndpoint::default()).await.unwrap();
    assert!(declined.is_err(), "{declined:?}");
    let unknown = BlockHash(12345);
    let asked: Vec<BlockHash> = hashes.iter().copied().chain([unknown]).collect();
    let held = peer.hold(&asked, Duration::from_secs(5)).await.unwrap();
    assert!(held.blocks[..hashes.len()].iter().all(|b| b.image_len.is_some()), "resident in G2: {held:?}");
    assert_eq!(held.blocks[hashes.len()].image_len, None, "a block the node never computed");
    let fetched = peer.fetch(held.hold_id, &hashes).await.unwrap();
    for ((hash, outcome), (_, image)) in fetched.iter().zip(&on_disk) {
        assert_eq!(outcome, &Fetched::Verified(image.clone()), "block {hash}");
    }
    peer.release(held.hold_id).await.unwrap();
    peer.goodbye().await.unwrap();

    // Without the secret nothing is served; neither is a peer that sends garbage.
    assert!(PeerClient::connect(g4, &client([0x11; 32])).await.is_err());
    let mut raw = tokio::net::TcpStream::connect(g4).await.unwrap();
    raw.write_all(&[0xff; 32]).await.unwrap();

    let mut outcomes = (0.0, 0.0, 0.0);
    for _ in 0..50 {
        outcomes = (
            node.metric("dynamo_node_peer_connections_total{outcome=\"goodbye\"}").await,
            node.metric("dynamo_node_peer_connections_total{outcome=\"refused\"}").await,
            node.metric("dynamo_node_peer_connections_total{outcome=\"too_large\"}").await,
        );
        if outcomes == (1.0, 1.0, 1.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(outcomes, (1.0, 1.0, 1.0), "goodbye, refused (wrong secret), too_large (garbage)");
    let served = node.metric("dynamo_node_peer_served_bytes_total").await;
    let expected: usize = on_disk.iter().map(|(_, image)| image.len()).sum();
    assert_eq!(served, expected as f64);
    assert_eq!(node.stop(), 0);
}

#[tokio::test]
async fn hostile_peers_are_disconnected_and_the_nodes_memory_stays_flat() {
    let dir = Arc::new(tempfile::tempdir().expect("tempdir"));
    let secret = [0x3c; 32];
    let secret_file = dir.path().join("g4.secret");
    std::fs::write(&secret_file, secret).unwrap();
    std::fs::set_permissions(&secret_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let config = format!(
        "[tiers.g4]\nenabled = true\nlisten = \"127.0.0.1:0\"\ncluster = \"test\"\nsecret_file = \"{}\"\n",
        secret_file.display()
    );
    let node = Node::start_in(dir.clone(), &config);
    let g4 = g4_addr(&node);
    let (status, _) = node
        .chat(json!({"model": "tiny", "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2}))
        .await;
    assert_eq!(status, 200);
    let before = node.rss_bytes();

    const EACH: usize = 100;
    // Headers announcing 4 GiB frames, and garbage.
    let mut header = [0u8; 13];
    header[..4].copy_from_slice(&u32::MAX.to_le_bytes());
    header[4] = 1;
    for bytes in [&header[..], &[0xA5; 64 << 10][..]] {
        let mut conns = Vec::new();
        for _ in 0..EACH {
            let mut raw = tokio::net::TcpStream::connect(g4).await.unwrap();
            let _ = raw.write_all(bytes).await;
            conns.push(raw);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The wrong secret.
    for _ in 0..EACH {
        assert!(PeerClient::connect(g4, &client([0x11; 32])).await.is_err());
    }
    // An authenticated peer that opens holds (of 4096 hashes each) until it is refused.
    let mut flood = PeerClient::connect(g4, &client(secret)).await.expect("authenticated");
    let hashes: Vec<BlockHash> = (0..4096u128).map(BlockHash).collect();
    let mut granted = 0;
    while flood.hold(&hashes, Duration::from_secs(10)).await.is_ok() {
        granted += 1;
        assert!(granted <= 64, "holds past tiers.g4.max_holds_per_peer");
    }

    let outcomes = [("too_large", 2 * EACH as u64), ("refused", EACH as u64), ("limit", 1)];
    for (outcome, n) in outcomes {
        let series = format!("dynamo_node_peer_connections_total{{outcome=\"{outcome}\"}}");
        let seen = node.wait_for_metric(&series, Duration::from_secs(20), |v| v >= n as f64).await;
        assert_eq!(seen, n as f64, "{outcome}");
    }
    let grown = node.rss_bytes().saturating_sub(before);
    eprintln!("the node's RSS grew by {} KiB under {} hostile connections", grown >> 10, 3 * EACH + 1);
    assert!(grown < 48 << 20, "the node's memory grew by {} MiB under hostile peers", grown >> 20);
    // And it serves on.
    let (status, _) = node
        .chat(json!({"model": "tiny", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2}))
        .await;
    assert_eq!(status, 200);
    let mut peer = PeerClient::connect(g4, &client(secret)).await.expect("a good peer is still served");
    peer.ping().await.unwrap();
    assert_eq!(node.stop(), 0);
}
