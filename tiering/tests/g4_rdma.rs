//! The RDMA transport (feature `rdma`). Every builder compiles it; a machine without RDMA devices
//! (CI's, and ours) checks that the node says so and leaves its lanes to TCP. A machine with a
//! device runs the ignored loopback test: one node's lane reads another's held images by RDMA.
#![cfg(feature = "rdma")]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use dynamo_tiering::block::{BlockHash, BlockLayout, HEADER_LEN, ImageSpec, RetentionMeta, Salt, seal};
use dynamo_tiering::g2::{HostPool, HostPoolOptions, MlockPolicy, SlotRef};
use dynamo_tiering::g4::auth::{ClusterSecret, PeerIdentity};
use dynamo_tiering::g4::holds::HoldLimits;
use dynamo_tiering::g4::tcp::{BlockSource, ClientConfig, FetchedSlot, ServerConfig, serve_peer};
use dynamo_tiering::g4::transport::{RdmaNode, RdmaOptions, RdmaUnavailable, Transport, connect_lane};
use dynamo_tiering::g4::wire::{Integrity, WireLimits};

fn has_rdma_devices() -> bool {
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

fn pool() -> HostPool {
    HostPool::new(HostPoolOptions::with_capacity(4 << 20, 64 << 10, MlockPolicy::Off)).unwrap()
}

#[test]
fn a_node_opens_its_rdma_device_or_says_it_has_none() {
    let pool = pool();
    match RdmaNode::open(&pool, &RdmaOptions::default()) {
        Ok(node) => assert!(has_rdma_devices(), "opened {} without /sys/class/infiniband", node.device()),
        Err(RdmaUnavailable::NoDevice(_)) => assert!(!has_rdma_devices(), "devices are there, none was found"),
        Err(e) => assert!(has_rdma_devices(), "no devices, yet: {e}"),
    }
    let named = RdmaOptions { device: Some("no-such-device".into()), gid_index: 0 };
    let err = RdmaNode::open(&pool, &named).unwrap_err();
    assert!(matches!(err, RdmaUnavailable::NoDevice(_)), "{err}");
}

/// Sealed images in a server's G2 slots.
struct Slots(HashMap<BlockHash, SlotRef>);

#[derive(Clone)]
struct Image(SlotRef, usize);

impl AsRef<[u8]> for Image {
    fn as_ref(&self) -> &[u8] {
        &self.0.as_slice()[..self.1]
    }
}

impl BlockSource for Slots {
    type Handle = Image;
    fn resolve(&self, hash: BlockHash) -> Option<Image> {
        self.0.get(&hash).map(|s| Image(s.clone(), HEADER_LEN + 4096))
    }
}

fn seal_into(pool: &HostPool, hash: u128) -> SlotRef {
    let mut slot = pool.try_alloc().unwrap();
    let buf = &mut slot.as_mut_slice()[..HEADER_LEN + 4096];
    buf[HEADER_LEN..].fill(hash as u8);
    let spec = ImageSpec {
        hash: BlockHash(hash),
        parent: None,
        salt: Salt(0),
        layout: BlockLayout::opaque(4096),
        token_count: 1,
        retention: RetentionMeta::default(),
    };
    seal(buf, &spec);
    slot.freeze()
}

#[tokio::test]
#[ignore = "needs an RDMA device (/sys/class/infiniband); no machine of ours has one"]
async fn a_lane_reads_held_images_by_rdma_and_verifies_them() {
    assert!(has_rdma_devices(), "this test needs an RDMA device");
    let (server_pool, client_pool) = (pool(), pool());
    let server_rdma = RdmaNode::open(&server_pool, &RdmaOptions::default()).unwrap();
    let client_rdma = RdmaNode::open(&client_pool, &RdmaOptions::default()).unwrap();
    let slots = Slots((1..=3).map(|h| (BlockHash(h), seal_into(&server_pool, h))).collect());
    let secret = ClusterSecret::from_bytes([7; 32]);
    let config = ServerConfig {
        secret: secret.clone(),
        me: PeerIdentity { cluster: "test".into(), node: "server".into(), epoch: 1 },
        wire: WireLimits::default(),
        integrity: Integrity::Checksum,
        holds: HoldLimits::default(),
        handshake_timeout: Duration::from_secs(2),
        idle_timeout: Duration::from_secs(10),
        rdma: Some(server_rdma),
        tls: None,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        serve_peer(stream, &config, &slots).await
    });
    let client = ClientConfig {
        secret,
        me: PeerIdentity { cluster: "test".into(), node: "client".into(), epoch: 1 },
        wire: WireLimits::default(),
        integrity: Integrity::Checksum,
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
        tls: None,
    };
    let mut lane = connect_lane(addr, "127.0.0.1", &client, Some(&client_rdma)).await.unwrap();
    assert_eq!(lane.transport(), Transport::Rdma);
    let asked = [BlockHash(1), BlockHash(2), BlockHash(3), BlockHash(4)];
    let held = lane.hold(&asked, Duration::from_secs(5)).await.unwrap();
    assert_eq!(held.blocks[3].image_len, None);
    let mut verified = Vec::new();
    lane.fetch_into(held.hold_id, &asked[..3], &mut || client_pool.try_alloc(), &mut |hash, fetched| match fetched {
        FetchedSlot::Verified { slot, len } => verified.push((hash, slot.as_slice()[HEADER_LEN..len].to_vec())),
        other => panic!("{hash}: {other:?}"),
    })
    .await
    .unwrap();
    let expected: Vec<_> = (1..=3u128).map(|h| (BlockHash(h), vec![h as u8; 4096])).collect();
    assert_eq!(verified, expected);
    lane.release(held.hold_id).await.unwrap();
}
