//! The feed of a server's servable blocks over real TCP: a subscriber gets a snapshot stamped with
//! the feed's sequence number and then every change, numbered on from it; a subscriber too slow for
//! the feed's buffer is cut off (it resubscribes from a fresh snapshot); a server without a feed
//! refuses subscriptions.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dynamo_tiering::block::BlockHash;
use dynamo_tiering::g4::auth::{ClusterSecret, PeerIdentity};
use dynamo_tiering::g4::feed::Feed;
use dynamo_tiering::g4::holds::HoldLimits;
use dynamo_tiering::g4::tcp::{BlockSource, ClientConfig, PeerClient, PeerError, ServerConfig, serve_peer};
use dynamo_tiering::g4::wire::{Integrity, Message, WireLimits};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// No resident images, only a feed (or none).
struct FeedOnly(Option<Arc<Feed>>);

impl BlockSource for FeedOnly {
    type Handle = Vec<u8>;
    fn resolve(&self, _hash: BlockHash) -> Option<Vec<u8>> {
        None
    }
    fn feed(&self) -> Option<&Feed> {
        self.0.as_deref()
    }
}

fn identity(node: &str) -> PeerIdentity {
    PeerIdentity { cluster: "test".into(), node: node.into(), epoch: 7 }
}

async fn serve_one(source: FeedOnly, wire: WireLimits) -> (SocketAddr, JoinHandle<Result<(), PeerError>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ServerConfig {
        secret: ClusterSecret::from_bytes([9; 32]),
        me: identity("server"),
        wire,
        integrity: Integrity::Mac,
        holds: HoldLimits::default(),
        handshake_timeout: Duration::from_secs(2),
        idle_timeout: Duration::from_secs(10),
        rdma: None,
        tls: None,
    };
    let task = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        serve_peer(stream, &config, &source).await.map(|_| ())
    });
    (addr, task)
}

async fn connect(addr: SocketAddr) -> PeerClient {
    let config = ClientConfig {
        secret: ClusterSecret::from_bytes([9; 32]),
        me: identity("client"),
        wire: WireLimits::default(),
        integrity: Integrity::Mac,
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
        tls: None,
    };
    PeerClient::connect(addr, &config).await.expect("authenticated")
}

#[tokio::test]
async fn a_subscriber_gets_the_snapshot_in_parts_then_every_change_in_order() {
    let feed = Arc::new(Feed::new(64));
    let h = BlockHash;
    feed.stored(None, &[h(1), h(2), h(3)]);
    feed.removed(&[h(3)]);
    // Two hashes a frame: the snapshot of two blocks comes in one part, more would come in several.
    let wire = WireLimits { max_hashes: 2, ..WireLimits::default() };
    let (addr, server) = serve_one(FeedOnly(Some(feed.clone())), wire).await;
    let mut sub = connect(addr).await.subscribe(Duration::from_millis(50)).await.unwrap();
    assert_eq!(sub.peer().epoch, 7);

    let mut snapshot = Vec::new();
    let synced = loop {
        match sub.next().await.unwrap() {
            Message::Snapshot { blocks } => {
                assert!(blocks.len() <= 2);
                snapshot.extend(blocks);
            }
            Message::Synced { seq } => break seq,
            other => panic!("{other:?} before the snapshot ended"),
        }
    };
    snapshot.sort();
    assert_eq!(snapshot, vec![(h(1), None), (h(2), Some(h(1)))]);
    assert_eq!(synced, 2, "the snapshot reflects both changes so far");

    // Changes after the snapshot, numbered on; the keepalive pings in between are answered and
    // never surface as feed messages.
    tokio::time::sleep(Duration::from_millis(200)).await;
    feed.stored(Some(h(2)), &[h(4), h(5)]);
    feed.removed(&[h(1)]);
    assert_eq!(sub.next().await.unwrap(), Message::Stored { seq: 3, parent: Some(h(2)), hashes: vec![h(4), h(5)] });
    assert_eq!(sub.next().await.unwrap(), Message::Removed { seq: 4, hashes: vec![h(1)] });
    drop(sub);
    assert!(server.await.unwrap().is_err(), "the subscriber left without a goodbye");
}

#[tokio::test]
async fn a_subscriber_slower_than_the_buffer_is_cut_off() {
    let feed = Arc::new(Feed::new(4));
    let (addr, server) = serve_one(FeedOnly(Some(feed.clone())), WireLimits::default()).await;
    let mut sub = connect(addr).await.subscribe(Duration::from_secs(1)).await.unwrap();
    assert_eq!(sub.next().await.unwrap(), Message::Synced { seq: 0 });
    // More changes at once than the feed buffers, faster than one connection sends them.
    for i in 0..10_000 {
        feed.stored(None, &[BlockHash(i)]);
    }
    let ended = server.await.unwrap();
    assert!(matches!(ended, Err(PeerError::Lagged)), "{ended:?}");
    // The subscriber sees its feed end, after whatever was sent before the cut.
    let mut seen = 0;
    let end = loop {
        match sub.next().await {
            Ok(Message::Stored { seq, .. }) => {
                seen += 1;
                assert_eq!(seq, seen, "in order, no gap");
            }
            Ok(other) => panic!("{other:?}"),
            Err(e) => break e,
        }
    };
    assert!(seen < 10_000, "cut off before the end: {seen}");
    assert!(matches!(end, PeerError::Closed | PeerError::Io(_) | PeerError::Refused { .. }), "{end:?}");
}

#[tokio::test]
async fn a_server_without_a_feed_refuses_subscriptions() {
    let (addr, server) = serve_one(FeedOnly(None), WireLimits::default()).await;
    let mut sub = connect(addr).await.subscribe(Duration::from_secs(1)).await.unwrap();
    let ended = server.await.unwrap();
    assert!(matches!(ended, Err(PeerError::Unexpected("subscribe"))), "{ended:?}");
    assert!(sub.next().await.is_err());
}

/// A forwarder that passes bytes both ways until `mute` is set, then holds the connection open and
/// passes nothing: a partition that no socket notices.
async fn muting_forwarder(to: SocketAddr, mute: Arc<std::sync::atomic::AtomicBool>) -> (SocketAddr, JoinHandle<()>) {
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let (client, _) = listener.accept().await.unwrap();
        let server = tokio::net::TcpStream::connect(to).await.unwrap();
        let (cr, cw) = client.into_split();
        let (sr, sw) = server.into_split();
        let pass = |mut from: tokio::net::tcp::OwnedReadHalf,
                    mut to: tokio::net::tcp::OwnedWriteHalf,
                    mute: Arc<std::sync::atomic::AtomicBool>| async move {
            let mut buf = vec![0u8; 4096];
            while let Ok(n) = from.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                if !mute.load(Ordering::Relaxed) {
                    to.write_all(&buf[..n]).await.unwrap();
                }
            }
            // Held open, silent, until the test ends.
            std::future::pending::<()>().await;
        };
        let _up = tokio::spawn(pass(cr, sw, mute.clone()));
        pass(sr, cw, mute).await;
    });
    (addr, task)
}

#[tokio::test]
async fn a_silent_server_ends_the_feed_after_three_unanswered_heartbeats() {
    let feed = Arc::new(Feed::new(64));
    let (server_addr, _server) = serve_one(FeedOnly(Some(feed.clone())), WireLimits::default()).await;
    let mute = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (addr, _forwarder) = muting_forwarder(server_addr, mute.clone()).await;
    let keepalive = Duration::from_millis(50);
    let mut sub = connect(addr).await.subscribe(keepalive).await.unwrap();
    assert_eq!(sub.next().await.unwrap(), Message::Synced { seq: 0 });
    mute.store(true, std::sync::atomic::Ordering::Relaxed);
    let started = tokio::time::Instant::now();
    let ended = sub.next().await;
    assert!(matches!(ended, Err(PeerError::Timeout("feed"))), "{ended:?}");
    let waited = started.elapsed();
    assert!(waited >= keepalive * 3 && waited < keepalive * 10, "{waited:?}");
}
