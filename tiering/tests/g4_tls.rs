//! Mutual TLS under the block-serving protocol, on loopback with the test CA's certificates
//! (`tests/fixtures/g4-tls`): nodes of the cluster CA hold and fetch as always; a client without
//! TLS, one whose certificate another CA signed, and a server whose certificate names another
//! host are all refused before a byte of the protocol; a node whose certificate is the cluster's
//! but names another node than the one it claims to be is refused after the handshake.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dynamo_tiering::block::BlockHash;
use dynamo_tiering::g4::auth::ClusterSecret;
use dynamo_tiering::g4::holds::HoldLimits;
use dynamo_tiering::g4::tcp::{ClientConfig, Fetched, PeerClient, PeerError, ServerConfig, serve_peer};
use dynamo_tiering::g4::tls::{Tls, TlsCrypto, TlsError};
use dynamo_tiering::g4::wire::{Integrity, WireLimits};
use tokio::net::TcpListener;

mod support;
use support::{Blocks, identity, sealed_with};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/g4-tls").join(name)
}

/// `node`'s TLS, trusting `ca`.
fn tls(node: &str, ca: &str) -> Option<Arc<Tls>> {
    let tls = Tls::from_files(&fixture(&format!("{node}.pem")), &fixture(&format!("{node}.key")), &fixture(ca));
    Some(Arc::new(tls.expect("the test certificates load")))
}

fn sealed(hash: u128) -> Vec<u8> {
    // Block 100 and up are large: a fetch of many fills the socket's buffers.
    let payload = if hash >= 100 { 512 << 10 } else { 4096 };
    sealed_with(hash, payload, |_| hash as u8)
}

/// A server with `tls` for as many connections as come; each one's outcome goes to the channel.
async fn server(tls: Option<Arc<Tls>>) -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<Result<(), PeerError>>) {
    server_named("node-a", tls).await
}

/// [`server`], claiming to be `node`.
async fn server_named(
    node: &str,
    tls: Option<Arc<Tls>>,
) -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<Result<(), PeerError>>) {
    let config = ServerConfig {
        secret: ClusterSecret::from_bytes([9; 32]),
        me: identity(node),
        wire: WireLimits::default(),
        integrity: Integrity::Checksum,
        holds: HoldLimits::default(),
        handshake_timeout: Duration::from_secs(2),
        idle_timeout: Duration::from_secs(10),
        rdma: None,
        tls,
    };
    let hashes = [1, 2].into_iter().chain(100..164);
    let blocks = Arc::new(Blocks(hashes.map(|h| (BlockHash(h), Arc::new(sealed(h)))).collect()));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let config = Arc::new(config);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (config, blocks, tx) = (config.clone(), blocks.clone(), tx.clone());
            tokio::spawn(async move {
                let _ = tx.send(serve_peer(stream, &config, &*blocks).await.map(|_| ()));
            });
        }
    });
    (addr, rx)
}

fn client(tls: Option<Arc<Tls>>) -> ClientConfig {
    client_named("node-b", tls)
}

/// [`client`], claiming to be `node`.
fn client_named(node: &str, tls: Option<Arc<Tls>>) -> ClientConfig {
    ClientConfig {
        secret: ClusterSecret::from_bytes([9; 32]),
        me: identity(node),
        wire: WireLimits::default(),
        integrity: Integrity::Checksum,
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
        tls,
    }
}

#[tokio::test]
async fn nodes_of_the_cluster_ca_hold_and_fetch_over_mutual_tls() {
    let (addr, mut outcomes) = server(tls("node-a", "ca.pem")).await;
    // By IP and by name: the certificate names both.
    for host in ["127.0.0.1", "localhost"] {
        let mut peer = PeerClient::connect_to(addr, host, &client(tls("node-b", "ca.pem"))).await.expect(host);
        assert_eq!(peer.peer().node, "node-a");
        let held = peer.hold(&[BlockHash(1), BlockHash(2)], Duration::from_secs(5)).await.unwrap();
        let fetched = peer.fetch(held.hold_id, &[BlockHash(1), BlockHash(2)]).await.unwrap();
        assert_eq!(fetched[0].1, Fetched::Verified(sealed(1)));
        assert_eq!(fetched[1].1, Fetched::Verified(sealed(2)));
        // 32 MiB in one fetch: every TLS record reaches the socket, none waits in a buffer.
        let large: Vec<BlockHash> = (100..164).map(BlockHash).collect();
        let held = peer.hold(&large, Duration::from_secs(5)).await.unwrap();
        let fetched = peer.fetch(held.hold_id, &large).await.unwrap();
        assert!(fetched.iter().all(|(h, f)| *f == Fetched::Verified(sealed(h.0))), "every large image arrives");
        peer.goodbye().await.unwrap();
        assert!(outcomes.recv().await.unwrap().is_ok(), "a clean goodbye");
    }
}

/// A node on Graviola's cryptography and one on RustCrypto's (a CPU without AES-NI, or another
/// architecture) share blocks, whichever of them serves.
#[tokio::test]
#[ignore = "needs a CPU that runs Graviola (x86-64: AES-NI, PCLMULQDQ, AVX2, BMI1, ADX; arm64: AES, PMULL, SHA-2); .ci/run runs it"]
async fn nodes_on_either_cryptography_interoperate() {
    assert_eq!(dynamo_tiering::g4::tls::crypto(), TlsCrypto::Graviola, "this CPU cannot run Graviola's cryptography");
    let on = |node: &str, crypto| {
        let (cert, key) = (fixture(&format!("{node}.pem")), fixture(&format!("{node}.key")));
        Some(Arc::new(
            Tls::from_files_with(&cert, &key, &fixture("ca.pem"), crypto).expect("the test certificates load"),
        ))
    };
    for (server_side, client_side) in
        [(TlsCrypto::Graviola, TlsCrypto::RustCrypto), (TlsCrypto::RustCrypto, TlsCrypto::Graviola)]
    {
        let (addr, mut outcomes) = server(on("node-a", server_side)).await;
        let mut peer = PeerClient::connect(addr, &client(on("node-b", client_side))).await.expect("connect");
        let large: Vec<BlockHash> = (100..116).map(BlockHash).collect();
        let held = peer.hold(&large, Duration::from_secs(5)).await.unwrap();
        let fetched = peer.fetch(held.hold_id, &large).await.unwrap();
        assert!(
            fetched.iter().all(|(h, f)| *f == Fetched::Verified(sealed(h.0))),
            "server {server_side:?}, client {client_side:?}"
        );
        peer.goodbye().await.unwrap();
        assert!(outcomes.recv().await.unwrap().is_ok(), "a clean goodbye");
    }
}

#[tokio::test]
async fn peers_without_a_certificate_of_the_cluster_ca_are_refused() {
    let (addr, mut outcomes) = server(tls("node-a", "ca.pem")).await;
    let refused_by_server = |outcome: Result<(), PeerError>| matches!(outcome, Err(PeerError::Tls(_)));

    // No TLS at all: the server's TLS handshake fails on the plain Hello.
    assert!(PeerClient::connect(addr, &client(None)).await.is_err());
    let outcome = outcomes.recv().await.unwrap();
    assert!(refused_by_server(outcome), "a plain-TCP client is refused");

    // A certificate another CA signed (the client trusts the server: only the server can refuse).
    let rogue = PeerClient::connect(addr, &client(tls("rogue", "ca.pem"))).await;
    assert!(rogue.is_err(), "a rogue certificate is refused");
    let outcome = outcomes.recv().await.unwrap();
    assert!(refused_by_server(outcome), "the server refuses the rogue certificate");

    // A client that trusts another CA refuses the server's certificate itself.
    let err = PeerClient::connect(addr, &client(tls("node-b", "other-ca.pem"))).await.unwrap_err();
    assert!(matches!(err, PeerError::Tls(_)), "{err}");
}

#[tokio::test]
async fn a_server_whose_certificate_names_another_host_is_refused() {
    let (addr, _outcomes) = server(tls("elsewhere", "ca.pem")).await;
    let err = PeerClient::connect(addr, &client(tls("node-b", "ca.pem"))).await.unwrap_err();
    assert!(matches!(err, PeerError::Tls(ref why) if why.contains("not valid for name")), "{err}");
}

/// Whether a server refuses `client`: the server checks the client's name after the client's
/// last handshake frame, so the client learns of it on its first request at the latest.
async fn refused(addr: SocketAddr, client: &ClientConfig) -> bool {
    match PeerClient::connect(addr, client).await {
        Err(_) => true,
        Ok(mut peer) => peer.ping().await.is_err(),
    }
}

#[tokio::test]
async fn a_node_whose_certificate_names_another_node_than_it_claims_is_refused() {
    // A client with node-b's certificate that claims to be node-c: the server refuses it.
    let (addr, mut outcomes) = server(tls("node-a", "ca.pem")).await;
    assert!(refused(addr, &client_named("node-c", tls("node-b", "ca.pem"))).await);
    let outcome = outcomes.recv().await.unwrap();
    assert!(matches!(outcome, Err(PeerError::Tls(ref why)) if why.contains("\"node-c\"")), "{outcome:?}");

    // A server with node-a's certificate that claims to be node-b: the client refuses it.
    let (addr, _outcomes) = server_named("node-b", tls("node-a", "ca.pem")).await;
    let err = PeerClient::connect(addr, &client(tls("node-b", "ca.pem"))).await.unwrap_err();
    assert!(matches!(err, PeerError::Tls(ref why) if why.contains("\"node-b\"")), "{err}");

    // A name that is no DNS name cannot be in a certificate.
    let (addr, mut outcomes) = server(tls("node-a", "ca.pem")).await;
    assert!(refused(addr, &client_named("node b!", tls("node-b", "ca.pem"))).await);
    let outcome = outcomes.recv().await.unwrap();
    assert!(matches!(outcome, Err(PeerError::Tls(ref why)) if why.contains("not a DNS name")), "{outcome:?}");

    // Named as their certificates name them, the same two connect.
    let (addr, _outcomes) = server(tls("node-a", "ca.pem")).await;
    let peer = PeerClient::connect(addr, &client(tls("node-b", "ca.pem"))).await.expect("names agree");
    assert_eq!(peer.peer().node, "node-a");
}

#[test]
fn files_that_are_not_what_they_should_be_are_named_in_the_error() {
    let err = Tls::from_files(&fixture("ca.pem"), &fixture("no-such.key"), &fixture("ca.pem")).unwrap_err();
    assert!(matches!(err, TlsError::File { ref path, .. } if path.ends_with("no-such.key")), "{err}");
    // A key where the CA should be: no certificate in it.
    let err = Tls::from_files(&fixture("node-a.pem"), &fixture("node-a.key"), &fixture("node-a.key")).unwrap_err();
    assert!(matches!(err, TlsError::File { ref path, .. } if path.ends_with("node-a.key")), "{err}");
    // An RSA key is refused, by name.
    let err = Tls::from_files(&fixture("rsa.pem"), &fixture("rsa.key"), &fixture("rsa.pem")).unwrap_err();
    assert!(
        matches!(err, TlsError::File { ref path, ref what } if path.ends_with("rsa.key") && what.contains("RSA")),
        "{err}"
    );
}
