//! A PeerLink against a real block server on loopback: its feed keeps the index's view of the
//! peer equal to what the peer can serve (snapshot, then changes), `locate` finds the peer's
//! prefix only while the feed is in sync, a peer that claims more blocks than the link allows is
//! cut off, and a stopped link takes the peer's blocks out of the index for good.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dynamo_actors::index::{IndexConfig, Location, PrefixIndex, SourceId};
use dynamo_actors::peer::{LinkConfig, RemoteTier};
use dynamo_config::TierName;
use dynamo_tiering::block::BlockHash;
use dynamo_tiering::g4::auth::{ClusterSecret, PeerIdentity};
use dynamo_tiering::g4::feed::Feed;
use dynamo_tiering::g4::holds::HoldLimits;
use dynamo_tiering::g4::tcp::{BlockSource, ClientConfig, ServerConfig, serve_peer};
use dynamo_tiering::g4::wire::{Integrity, WireLimits};
use tokio::net::TcpListener;

struct FeedOnly(Arc<Feed>);

impl BlockSource for FeedOnly {
    type Handle = Vec<u8>;
    fn resolve(&self, _hash: BlockHash) -> Option<Vec<u8>> {
        None
    }
    fn feed(&self) -> Option<&Feed> {
        Some(&self.0)
    }
}

fn identity(node: &str) -> PeerIdentity {
    PeerIdentity { cluster: "test".into(), node: node.into(), epoch: 3 }
}

/// A block server answering every connection from `feed`.
async fn server(feed: Arc<Feed>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let config = Arc::new(ServerConfig {
        secret: ClusterSecret::from_bytes([4; 32]),
        me: identity("peer"),
        wire: WireLimits::default(),
        integrity: Integrity::Mac,
        holds: HoldLimits::default(),
        handshake_timeout: Duration::from_secs(2),
        idle_timeout: Duration::from_secs(10),
        rdma: None,
        tls: None,
    });
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (config, source) = (config.clone(), FeedOnly(feed.clone()));
            tokio::spawn(async move { serve_peer(stream, &config, &source).await });
        }
    });
    addr
}

fn link_config(max_snapshot_blocks: usize) -> LinkConfig {
    LinkConfig {
        client: ClientConfig {
            secret: ClusterSecret::from_bytes([4; 32]),
            me: identity("me"),
            wire: WireLimits::default(),
            integrity: Integrity::Mac,
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(2),
            tls: None,
        },
        lanes: 1,
        max_inflight: 4,
        hold_ttl: Duration::from_secs(5),
        min_fetch_budget: Duration::from_millis(50),
        heartbeat: Duration::from_millis(100),
        max_snapshot_blocks,
        rdma: None,
        history: None,
    }
}

/// Polls `done` for up to 5 s.
async fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(5) {
        if done() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    done()
}

fn chain(from: u128, n: u128) -> Vec<BlockHash> {
    (from..from + n).map(|i| BlockHash(i * 0x1_0000_0001)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_follows_the_peer_and_forgets_it_when_the_link_stops() {
    let feed = Arc::new(Feed::new(1024));
    let blocks = chain(1, 8);
    feed.stored(None, &blocks[..5]);
    let addr = server(feed.clone()).await;
    let index = Arc::new(PrefixIndex::new(IndexConfig::default()));
    let remote = RemoteTier::new(index.clone(), 0);
    let link = remote.connect(addr, link_config(1 << 20));

    // The snapshot: the peer holds the first five blocks of the chain.
    assert!(eventually(|| remote.locate(&blocks).is_some_and(|(_, n)| n == 5)).await, "synced from the snapshot");
    let held = || {
        let source = SourceId::node_store(link.node());
        index.held_count(Location { source, tier: TierName::G2, approximate: false })
    };
    assert_eq!(held(), 5, "the index holds what the peer's feed offers");
    assert_eq!(link.name().as_deref(), Some("peer"));
    // A change after it: three more.
    feed.stored(Some(blocks[4]), &blocks[5..]);
    assert!(eventually(|| remote.locate(&blocks).is_some_and(|(_, n)| n == 8)).await, "a stored change");
    // An eviction in the middle cuts the prefix there.
    feed.removed(&[blocks[3]]);
    assert!(eventually(|| remote.locate(&blocks).is_some_and(|(_, n)| n == 3)).await, "a removed change");
    assert_eq!(held() as usize, feed.len(), "seven of eight: equal to the peer's truth");

    // Stopped: the peer's blocks leave the index, and stay gone though the peer goes on.
    remote.disconnect(link.node());
    assert!(remote.locate(&blocks).is_none());
    assert_eq!(index.stats().blocks, 0, "nothing of the peer is left");
    feed.stored(None, &chain(100, 4));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(index.stats().blocks, 0, "a stopped link changes nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_claims_more_blocks_than_allowed_is_cut_off() {
    let feed = Arc::new(Feed::new(1024));
    let blocks = chain(1, 4);
    feed.stored(None, &blocks);
    let addr = server(feed.clone()).await;
    let index = Arc::new(PrefixIndex::new(IndexConfig::default()));
    let remote = RemoteTier::new(index.clone(), 0);
    let _link = remote.connect(addr, link_config(6));
    assert!(eventually(|| remote.locate(&blocks).is_some()).await, "four blocks are within the bound");
    // Three more make seven: over the bound of six, the feed is dropped and the blocks with it;
    // the link resubscribes, and the fresh snapshot (seven blocks) is refused as well.
    feed.stored(None, &chain(50, 3));
    assert!(eventually(|| remote.locate(&blocks).is_none()).await, "cut off over the bound");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(remote.locate(&blocks).is_none(), "and kept off while the peer claims too much");
    // Back within the bound, the peer is followed again.
    feed.removed(&chain(50, 3));
    assert!(eventually(|| remote.locate(&blocks).is_some()).await, "followed again within the bound");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_from_a_peer_is_priced_at_that_links_own_rate() {
    use dynamo_tiering::cost::{BytesPerSec, CostModel};
    let index = Arc::new(PrefixIndex::new(IndexConfig::default()));
    let remote = RemoteTier::new(index, 0);
    // Two peers (nothing listens: pricing needs only what fetches measured).
    let (near, far) =
        (remote.connect("127.0.0.1:9".into(), link_config(16)), remote.connect("127.0.0.1:9".into(), link_config(16)));
    near.measured().observe(8 << 30, Duration::from_secs(1));
    far.measured().observe(8 << 20, Duration::from_secs(1));
    let mut cost = CostModel::unknown(16, 1 << 20);
    cost.g2_read = BytesPerSec::new(16e9);
    let node_wide = BytesPerSec::new(1e9);
    cost.g4_read = node_wide;

    let mut via_near = cost.clone();
    remote.link(near.node()).expect("a link to the near peer").price(&mut via_near);
    let expected = BytesPerSec::new(8.0 * (1u64 << 30) as f64).unwrap().then(cost.g2_read.unwrap());
    assert!((via_near.g4_read.unwrap().get() - expected.get()).abs() < 1.0, "{:?}", via_near.g4_read);
    let mut via_far = cost.clone();
    remote.link(far.node()).expect("a link to the far peer").price(&mut via_far);
    assert!(via_far.g4_read.unwrap().get() < 1e7, "the slow link's rate: {:?}", via_far.g4_read);

    // A link no fetch measured leaves the node-wide rate.
    let unmeasured = remote.connect("127.0.0.1:9".into(), link_config(16));
    let mut via_new = cost.clone();
    unmeasured.price(&mut via_new);
    assert_eq!(via_new.g4_read, node_wide);
    remote.shutdown();
}
