//! The block-serving protocol over real TCP on loopback: a reader holds, fetches and verifies
//! sealed images from a server's resident blocks; corrupt images are dropped, not returned; wrong
//! secrets, hostile bytes, floods and silent readers end the way the protocol says.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dynamo_tiering::block::{BlockHash, HEADER_LEN, ImageError};
use dynamo_tiering::g2::{HostPool, HostPoolOptions, MlockPolicy};
use dynamo_tiering::g4::auth::ClusterSecret;
use dynamo_tiering::g4::holds::HoldLimits;
use dynamo_tiering::g4::tcp::{
    ClientConfig, Fetched, FetchedSlot, PeerClient, PeerError, ServedPeer, ServerConfig, serve_peer,
};
use dynamo_tiering::g4::transport::{Accepted, Lane, RemoteAccess, Transport};
#[cfg(not(feature = "rdma"))]
use dynamo_tiering::g4::transport::{RdmaNode, RdmaOptions, RdmaUnavailable};
use dynamo_tiering::g4::wire::{Integrity, RdmaEndpoint, RefusalCode, WireLimits};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

mod support;
use support::{Blocks, identity, sealed_with};

fn sealed(hash: u128, payload_bytes: usize) -> Vec<u8> {
    sealed_with(hash, payload_bytes, |i| (i as u128 ^ hash) as u8)
}

fn server_config(secret: u8, holds: HoldLimits) -> ServerConfig {
    ServerConfig {
        secret: ClusterSecret::from_bytes([secret; 32]),
        me: identity("server"),
        wire: WireLimits::default(),
        integrity: Integrity::Mac,
        holds,
        handshake_timeout: Duration::from_secs(2),
        idle_timeout: Duration::from_secs(10),
        rdma: None,
        tls: None,
    }
}

fn client_config(secret: u8) -> ClientConfig {
    ClientConfig {
        secret: ClusterSecret::from_bytes([secret; 32]),
        me: identity("client"),
        wire: WireLimits::default(),
        integrity: Integrity::Mac,
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
        tls: None,
    }
}

/// A server for one connection; its outcome comes back through the handle.
async fn serve_one(config: ServerConfig, blocks: Blocks) -> (SocketAddr, JoinHandle<Result<ServedPeer, PeerError>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        serve_peer(stream, &config, &blocks).await
    });
    (addr, task)
}

fn resident(hashes: &[u128], payload: usize) -> Blocks {
    Blocks(hashes.iter().map(|&h| (BlockHash(h), Arc::new(sealed(h, payload)))).collect())
}

#[tokio::test]
async fn a_reader_holds_fetches_verified_images_and_releases() {
    let (addr, server) = serve_one(server_config(1, HoldLimits::default()), resident(&[1, 2, 3], 64 << 10)).await;
    let mut client = PeerClient::connect(addr, &client_config(1)).await.expect("connect");
    assert_eq!(client.peer().node, "server");
    assert!(client.ping().await.unwrap() < Duration::from_secs(1));

    let asked = [BlockHash(1), BlockHash(9), BlockHash(2), BlockHash(3)];
    let held = client.hold(&asked, Duration::from_secs(5)).await.unwrap();
    let lens: Vec<Option<u32>> = held.blocks.iter().map(|b| b.image_len).collect();
    let len = (HEADER_LEN + (64 << 10)) as u32;
    assert_eq!(lens, [Some(len), None, Some(len), Some(len)], "block 9 is not resident");

    let fetched = client.fetch(held.hold_id, &[BlockHash(1), BlockHash(2), BlockHash(3), BlockHash(9)]).await.unwrap();
    for (hash, outcome) in &fetched[..3] {
        assert_eq!(outcome, &Fetched::Verified(sealed(hash.0, 64 << 10)), "{hash}");
    }
    assert_eq!(fetched[3].1, Fetched::Missing);
    client.release(held.hold_id).await.unwrap();
    let after = client.fetch(held.hold_id, &[BlockHash(1)]).await.unwrap();
    assert_eq!(after[0].1, Fetched::Missing, "a released hold serves nothing");
    client.goodbye().await.unwrap();

    let served = server.await.unwrap().expect("a clean goodbye");
    assert_eq!(served.peer.unwrap().node, "client");
    assert_eq!((served.holds, served.images, served.expired_holds), (1, 3, 0));
    assert_eq!(served.image_bytes, 3 * len as u64);
}

#[tokio::test]
async fn a_corrupt_or_misnamed_image_is_dropped_not_returned() {
    let mut blocks = resident(&[1, 2], 4096);
    // Block 1's slot had a byte flipped after sealing; block 2's slot holds block 3's image.
    let mut bad = sealed(1, 4096);
    bad[HEADER_LEN + 100] ^= 0x40;
    blocks.0.insert(BlockHash(1), Arc::new(bad));
    blocks.0.insert(BlockHash(2), Arc::new(sealed(3, 4096)));
    let (addr, _server) = serve_one(server_config(1, HoldLimits::default()), blocks).await;
    let mut client = PeerClient::connect(addr, &client_config(1)).await.unwrap();
    let held = client.hold(&[BlockHash(1), BlockHash(2)], Duration::from_secs(5)).await.unwrap();
    let fetched = client.fetch(held.hold_id, &[BlockHash(1), BlockHash(2)]).await.unwrap();
    assert_eq!(fetched[0].1, Fetched::Rejected(ImageError::PayloadChecksum));
    assert_eq!(
        fetched[1].1,
        Fetched::Rejected(ImageError::HashMismatch { expected: BlockHash(2), found: BlockHash(3) })
    );
}

#[tokio::test]
async fn a_wrong_secret_is_refused_on_both_sides() {
    let (addr, server) = serve_one(server_config(1, HoldLimits::default()), resident(&[1], 64)).await;
    let err = PeerClient::connect(addr, &client_config(2)).await.unwrap_err();
    // The client finds that the server's MAC does not prove the secret it knows.
    assert_eq!(err.kind(), "bad_mac", "{err}");
    let served = server.await.unwrap().unwrap_err();
    assert!(matches!(served, PeerError::Refused { code: RefusalCode::Auth, .. } | PeerError::Closed), "{served}");
}

#[tokio::test]
async fn hostile_bytes_end_the_connection_without_allocating_for_them() {
    // A header announcing 4 GiB.
    let (addr, server) = serve_one(server_config(1, HoldLimits::default()), resident(&[1], 64)).await;
    let mut raw = TcpStream::connect(addr).await.unwrap();
    let mut header = [0u8; 13];
    header[..4].copy_from_slice(&u32::MAX.to_le_bytes());
    header[4] = 1;
    raw.write_all(&header).await.unwrap();
    let err = server.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), "too_large", "{err}");
    let mut answer = Vec::new();
    raw.read_to_end(&mut answer).await.unwrap();
    assert_eq!(answer[4], 4, "a Refused frame, then the close");

    // Garbage: its first four bytes read as a length over the limit.
    let (addr, server) = serve_one(server_config(1, HoldLimits::default()), resident(&[1], 64)).await;
    let mut raw = TcpStream::connect(addr).await.unwrap();
    raw.write_all(&[0xAB; 64]).await.unwrap();
    assert_eq!(server.await.unwrap().unwrap_err().kind(), "too_large");

    // A short frame of a kind no build knows, and a Hello whose body ends inside a field.
    for (frame, kind) in [(&[8u8, 0, 0, 0, 0xAB][..], "unknown_kind"), (&[3, 0, 0, 0, 1][..], "truncated")] {
        let (addr, server) = serve_one(server_config(1, HoldLimits::default()), resident(&[1], 64)).await;
        let mut raw = TcpStream::connect(addr).await.unwrap();
        raw.write_all(frame).await.unwrap();
        raw.write_all(&[0; 8 + 8]).await.unwrap();
        assert_eq!(server.await.unwrap().unwrap_err().kind(), kind);
    }

    // Nothing at all: the handshake times out.
    let mut config = server_config(1, HoldLimits::default());
    config.handshake_timeout = Duration::from_millis(200);
    let (addr, server) = serve_one(config, resident(&[1], 64)).await;
    let _silent = TcpStream::connect(addr).await.unwrap();
    assert_eq!(server.await.unwrap().unwrap_err().kind(), "timeout");
}

#[tokio::test]
async fn a_hold_flood_is_refused_and_a_silent_readers_holds_expire() {
    let limits = HoldLimits { max_holds: 3, max_blocks: 100, max_ttl: Duration::from_millis(300) };
    let (addr, server) = serve_one(server_config(1, limits), resident(&[1, 2], 64)).await;
    let mut client = PeerClient::connect(addr, &client_config(1)).await.unwrap();
    let first = client.hold(&[BlockHash(1)], Duration::from_secs(60)).await.unwrap();
    assert_eq!(first.ttl, Duration::from_millis(300), "the server caps the TTL");
    // The reader goes quiet past the TTL: the server lets the hold go on its own timer.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(client.fetch(first.hold_id, &[BlockHash(1)]).await.unwrap()[0].1, Fetched::Missing);
    for _ in 0..3 {
        client.hold(&[BlockHash(2)], Duration::from_secs(60)).await.unwrap();
    }
    let err = client.hold(&[BlockHash(2)], Duration::from_secs(60)).await.unwrap_err();
    assert!(matches!(err, PeerError::Refused { code: RefusalCode::Limit, .. }), "{err}");
    let err = server.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), "limit");
}

#[tokio::test]
async fn checksum_integrity_moves_verified_images_and_still_rejects_corrupt_ones() {
    let mut blocks = resident(&[1, 2], 8 << 10);
    let mut bad = sealed(2, 8 << 10);
    bad[HEADER_LEN + 7] ^= 0x01;
    blocks.0.insert(BlockHash(2), Arc::new(bad));
    let server = ServerConfig { integrity: Integrity::Checksum, ..server_config(1, HoldLimits::default()) };
    let (addr, served) = serve_one(server, blocks).await;
    let client = ClientConfig { integrity: Integrity::Checksum, ..client_config(1) };
    let mut peer = PeerClient::connect(addr, &client).await.expect("both sides agree");
    let held = peer.hold(&[BlockHash(1), BlockHash(2)], Duration::from_secs(5)).await.unwrap();
    let fetched = peer.fetch(held.hold_id, &[BlockHash(1), BlockHash(2)]).await.unwrap();
    assert_eq!(fetched[0].1, Fetched::Verified(sealed(1, 8 << 10)));
    assert_eq!(fetched[1].1, Fetched::Rejected(ImageError::PayloadChecksum), "no MAC, still verified");
    // Control frames keep their MACs: the connection goes on.
    assert!(peer.ping().await.is_ok());
    peer.goodbye().await.unwrap();
    assert_eq!(served.await.unwrap().unwrap().images, 2);
}

/// A payload larger than the pieces an image is read and digested in (256 KiB), and not a
/// multiple of them.
const LARGE: usize = (1 << 20) + 4096 + 64;

/// Fetches blocks 1 and 2 (block 2 with a byte flipped late in its payload) both ways, into a
/// caller's slots and into the connection's buffer, under `integrity`.
async fn fetch_large(integrity: Integrity) {
    let mut blocks = resident(&[1, 2], LARGE);
    let mut bad = sealed(2, LARGE);
    bad[HEADER_LEN + LARGE - 5000] ^= 0x10;
    blocks.0.insert(BlockHash(2), Arc::new(bad));
    let server = ServerConfig { integrity, ..server_config(1, HoldLimits::default()) };
    let (addr, served) = serve_one(server, blocks).await;
    let mut peer = PeerClient::connect(addr, &ClientConfig { integrity, ..client_config(1) }).await.unwrap();
    let asked = [BlockHash(1), BlockHash(2)];
    let held = peer.hold(&asked, Duration::from_secs(5)).await.unwrap();

    let fetched = peer.fetch(held.hold_id, &asked).await.unwrap();
    assert_eq!(fetched[0].1, Fetched::Verified(sealed(1, LARGE)), "{integrity:?}");
    assert_eq!(fetched[1].1, Fetched::Rejected(ImageError::PayloadChecksum), "{integrity:?}");

    let slot_bytes = dynamo_tiering::g2::align_up(HEADER_LEN + LARGE);
    let pool = HostPool::new(HostPoolOptions { slot_bytes, slots: 2, mlock: MlockPolicy::Off }).unwrap();
    let mut outcomes = Vec::new();
    peer.fetch_into(
        held.hold_id,
        &asked,
        || pool.try_alloc(),
        |hash, fetched| match fetched {
            FetchedSlot::Verified { slot, len } => {
                assert_eq!(slot.as_slice()[..len], sealed(hash.0, LARGE)[..], "{integrity:?}");
                outcomes.push("verified".to_string());
            }
            other => outcomes.push(format!("{other:?}")),
        },
    )
    .await
    .unwrap();
    assert_eq!(outcomes, ["verified".to_string(), format!("{:?}", FetchedSlot::Rejected(ImageError::PayloadChecksum))]);
    peer.goodbye().await.unwrap();
    assert_eq!(served.await.unwrap().unwrap().images, 4);
}

#[tokio::test]
async fn images_larger_than_a_read_piece_are_verified_whole_in_either_mode() {
    fetch_large(Integrity::Mac).await;
    fetch_large(Integrity::Checksum).await;
}

/// A forwarder between a client and `server` that flips one bit of the server's bytes: the one
/// at offset `flip_at` of its stream.
async fn flipping_forwarder(server: SocketAddr, flip_at: usize) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (client, _) = listener.accept().await.unwrap();
        let upstream = TcpStream::connect(server).await.unwrap();
        let (mut client_read, mut client_write) = client.into_split();
        let (mut server_read, mut server_write) = upstream.into_split();
        tokio::spawn(async move { tokio::io::copy(&mut client_read, &mut server_write).await });
        let mut seen = 0usize;
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if (seen..seen + n).contains(&flip_at) {
                buf[flip_at - seen] ^= 0x08;
            }
            seen += n;
            if client_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    });
    addr
}

#[tokio::test]
async fn a_bit_flipped_on_the_wire_late_in_a_large_image_is_caught_in_either_mode() {
    for integrity in [Integrity::Mac, Integrity::Checksum] {
        let server = ServerConfig { integrity, ..server_config(1, HoldLimits::default()) };
        let (addr, _served) = serve_one(server, resident(&[1], LARGE)).await;
        // Past the handshake and the Held answer, three quarters into the image.
        let forwarder = flipping_forwarder(addr, LARGE * 3 / 4).await;
        let mut peer = PeerClient::connect(forwarder, &ClientConfig { integrity, ..client_config(1) }).await.unwrap();
        let held = peer.hold(&[BlockHash(1)], Duration::from_secs(5)).await.unwrap();
        let fetched = peer.fetch(held.hold_id, &[BlockHash(1)]).await;
        match integrity {
            Integrity::Mac => assert_eq!(fetched.unwrap_err().kind(), "bad_mac"),
            Integrity::Checksum => {
                assert_eq!(fetched.unwrap()[0].1, Fetched::Rejected(ImageError::PayloadChecksum))
            }
        }
    }
}

#[tokio::test]
async fn a_client_of_another_integrity_mode_is_refused() {
    let (addr, served) = serve_one(server_config(1, HoldLimits::default()), resident(&[1], 64)).await;
    let client = ClientConfig { integrity: Integrity::Checksum, ..client_config(1) };
    assert!(PeerClient::connect(addr, &client).await.is_err());
    let err = served.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), "integrity", "{err}");
}

/// A server's side of RDMA without a device: grants a made-up queue pair and places only the
/// images it was told are registered, and counts the queue pairs it closed.
#[derive(Debug, Default)]
struct FakeAccess {
    registered: Vec<(usize, usize)>,
    closed: Arc<std::sync::atomic::AtomicUsize>,
}

struct Closes(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for Closes {
    fn drop(&mut self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl RemoteAccess for FakeAccess {
    fn accept(&self, peer: &RdmaEndpoint) -> Result<Accepted, String> {
        let endpoint = RdmaEndpoint { qpn: peer.qpn + 1, ..*peer };
        Ok(Accepted { endpoint, rkey: 0x5eed, keep: Box::new(Closes(self.closed.clone())) })
    }

    fn place(&self, image: &[u8]) -> Option<u64> {
        let at = image.as_ptr() as usize;
        self.registered.iter().any(|&(start, len)| at == start && image.len() == len).then_some(at as u64)
    }
}

#[tokio::test]
async fn rdma_places_are_given_only_on_a_connection_whose_queue_pair_was_accepted() {
    let blocks = resident(&[1, 2, 3], 4096);
    let image = |h: u128| blocks.0[&BlockHash(h)].clone();
    // Blocks 1 and 3 lie in the "registered region"; block 2 does not, so it cannot be read remotely.
    let access = FakeAccess {
        registered: [1, 3].iter().map(|&h| (image(h).as_ptr() as usize, image(h).len())).collect(),
        closed: Arc::default(),
    };
    let (place_1, place_3) = (image(1).as_ptr() as u64, image(3).as_ptr() as u64);
    let closed = access.closed.clone();
    let config = ServerConfig { rdma: Some(Arc::new(access)), ..server_config(1, HoldLimits::default()) };

    // Asking for places before the queue pair is accepted breaks the protocol.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let blocks = Arc::new(blocks);
    let server = {
        let (config, blocks) = (config.clone(), blocks.clone());
        tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for _ in 0..2 {
                let (stream, _) = listener.accept().await.unwrap();
                outcomes.push(serve_peer(stream, &config, &*blocks).await);
            }
            outcomes
        })
    };
    let mut early = PeerClient::connect(addr, &client_config(1)).await.unwrap();
    let refused = early.hold_at(&[BlockHash(1)], Duration::from_secs(5)).await.unwrap_err();
    assert!(matches!(refused, PeerError::Refused { code: RefusalCode::Protocol, .. }), "{refused}");

    let mut client = PeerClient::connect(addr, &client_config(1)).await.unwrap();
    let mine = RdmaEndpoint { lid: 7, gid: [2; 16], qpn: 100, psn: 5, mtu: 5, rd_atomic: 16 };
    let (theirs, rkey) = client.rdma_connect(mine).await.unwrap().expect("accepted");
    assert_eq!((theirs.qpn, rkey), (101, 0x5eed));
    let asked = [BlockHash(1), BlockHash(2), BlockHash(3), BlockHash(9)];
    let (hold_id, _, places) = client.hold_at(&asked, Duration::from_secs(5)).await.unwrap();
    let places: Vec<_> = places.iter().map(|p| (p.hash, p.place)).collect();
    let len = (HEADER_LEN + 4096) as u32;
    assert_eq!(
        places,
        [
            (BlockHash(1), Some((place_1, len))),
            (BlockHash(2), None),
            (BlockHash(3), Some((place_3, len))),
            (BlockHash(9), None)
        ]
    );
    client.release(hold_id).await.unwrap();
    client.goodbye().await.unwrap();

    let outcomes = server.await.unwrap();
    assert!(matches!(outcomes[0], Err(PeerError::Unexpected("hold_at"))), "{:?}", outcomes[0]);
    assert_eq!(outcomes[1].as_ref().expect("a clean goodbye").holds, 1);
    assert_eq!(closed.load(std::sync::atomic::Ordering::SeqCst), 1, "the queue pair closes with its connection");
}

#[tokio::test]
async fn a_server_without_rdma_declines_and_the_lane_carries_frames() {
    let (addr, _server) = serve_one(server_config(1, HoldLimits::default()), resident(&[1, 2], 4096)).await;
    let mut client = PeerClient::connect(addr, &client_config(1)).await.unwrap();
    let declined = client.rdma_connect(RdmaEndpoint::default()).await.unwrap();
    assert!(declined.is_err_and(|why| why.contains("no RDMA")));
    // The same connection, as a TCP lane through the transport trait.
    let mut lane: Box<dyn Lane> = Box::new(client);
    assert_eq!(lane.transport(), Transport::Tcp);
    let pool = HostPool::new(HostPoolOptions::with_capacity(64 << 10, 8192, MlockPolicy::Off)).unwrap();
    let held = lane.hold(&[BlockHash(1), BlockHash(2)], Duration::from_secs(5)).await.unwrap();
    let mut landed = Vec::new();
    lane.fetch_into(held.hold_id, &[BlockHash(1), BlockHash(2)], &mut || pool.try_alloc(), &mut |hash, fetched| {
        landed.push(match fetched {
            FetchedSlot::Verified { slot, len } => (hash, slot.as_slice()[..len].to_vec()),
            other => panic!("{hash}: {other:?}"),
        })
    })
    .await
    .unwrap();
    assert_eq!(landed, [(BlockHash(1), sealed(1, 4096)), (BlockHash(2), sealed(2, 4096))]);
    lane.release(held.hold_id).await.unwrap();
}

#[cfg(not(feature = "rdma"))]
#[test]
fn a_build_without_the_rdma_feature_has_no_rdma() {
    let pool = HostPool::new(HostPoolOptions::with_capacity(64 << 10, 8192, MlockPolicy::Off)).unwrap();
    let err = RdmaNode::open(&pool, &RdmaOptions::default()).unwrap_err();
    assert!(matches!(err, RdmaUnavailable::NotBuilt), "{err}");
}
