//! G4, the serving side: this node's G2 blocks, answered to authenticated peers over TCP.
//!
//! [`BlockServer`] accepts peer connections on `tiers.g4.listen` and runs the block-serving
//! protocol ([`dynamo_tiering::g4::tcp`]) on each: a peer proves it knows the cluster secret,
//! then holds, fetches and releases blocks by hash. Blocks are served from G2 only, where every
//! resident block is a sealed image in a pinned slot; a hold keeps the slot's reference, so the
//! image stays put until the peer releases it or the hold's TTL runs out, even if G2 evicts the
//! block meanwhile. How each connection ended is counted (`dynamo_node_peer_connections_total`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dynamo_config::{G4Config, G4Integrity, TierName, Transport};
use dynamo_tiering::block::{BlockHash, ImageHeader};
use dynamo_tiering::g2::SlotRef;
use dynamo_tiering::g4::auth::{ClusterSecret, PeerIdentity, SecretError};
use dynamo_tiering::g4::feed::Feed;
use dynamo_tiering::g4::holds::HoldLimits;
use dynamo_tiering::g4::tcp::{BlockSource, ClientConfig, PeerError, ServedPeer, ServerConfig, serve_peer_into};
use dynamo_tiering::g4::tls::{Tls, TlsError};
use dynamo_tiering::g4::transport::{RdmaNode, RdmaOptions, RemoteAccess};
use dynamo_tiering::g4::wire::{Integrity, WireLimits};
use dynamo_tiering::registry::BlockMeta;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::telemetry;
use crate::tier_store::TierStore;
use crate::tiers::NodeTiers;
use crate::worker::unix_millis;

mod history;
mod link;

pub use history::{HistoryEntry, LoadHistory};
pub use link::{Arrival, FetchError, Land, LinkConfig, PeerLink, RemoteTier};

/// Most G3 blocks one hold reads into G2 for a peer.
const MAX_STAGED: usize = 1024;

/// Most peer connections served at once; more wait to be accepted. Each peer keeps its feed and
/// `tiers.g4.lanes` connections open.
const MAX_PEER_CONNECTIONS: usize = 512;

/// The sealed image in a G2 slot, without the slot's padding.
#[derive(Clone, Debug)]
pub struct G2Image {
    slot: SlotRef,
    len: usize,
    /// A copy of the image with one payload byte flipped, served instead: only while the
    /// `g4-serve-corrupt` fail point is on (a peer whose memory went bad; tests of the reader's
    /// verification).
    corrupt: Option<Arc<[u8]>>,
}

impl AsRef<[u8]> for G2Image {
    fn as_ref(&self) -> &[u8] {
        if let Some(corrupt) = &self.corrupt {
            return corrupt;
        }
        &self.slot.as_slice()[..self.len]
    }
}

/// `image` with its last byte flipped, while the `g4-serve-corrupt` fail point is on (with the
/// `failpoints` feature, `FAILPOINTS=g4-serve-corrupt=return`); otherwise nothing.
fn flipped(image: &[u8]) -> Option<Arc<[u8]>> {
    #[cfg(not(feature = "failpoints"))]
    let _ = image;
    fail::fail_point!("g4-serve-corrupt", |_| {
        let mut copy = image.to_vec();
        let last = copy.len() - 1;
        copy[last] ^= 0x40;
        Some(Arc::from(copy))
    });
    None
}

/// The node's G2 and the engines' (the node's own blocks, then external engines' blocks), as the
/// block server reads them.
#[derive(Debug)]
pub struct G2Blocks(pub Arc<NodeTiers>);

impl BlockSource for G2Blocks {
    type Handle = G2Image;

    fn resolve(&self, hash: BlockHash) -> Option<G2Image> {
        let slot = self.0.g2_peek(hash)?;
        // A slot whose header does not decode is not served; the reader would drop it anyway.
        let len = ImageHeader::decode_header_only(slot.as_slice()).ok()?.image_bytes();
        if len > slot.as_slice().len() {
            return None;
        }
        let corrupt = flipped(&slot.as_slice()[..len]);
        Some(G2Image { slot, len, corrupt })
    }

    fn sent(&self, bytes: usize) {
        telemetry::record_peer_served(bytes as u64);
    }

    /// Reads the blocks asked for that are in G3 but not in G2 into G2 slots, in prefix order up
    /// to the first block neither tier has, all in flight together (at most [`MAX_STAGED`] a
    /// hold), verified by the store, and admits them to G2 with the retention their images carry.
    fn stage<'a>(&'a self, hashes: &'a [BlockHash]) -> futures::future::BoxFuture<'a, ()> {
        Box::pin(async move {
            let tiers = &self.0;
            let Some(g2) = tiers.g2.as_ref() else { return };
            let now = unix_millis();
            // In prefix order up to the first block neither tier has: the reader's prefix ends there.
            let wanted: Vec<BlockHash> = hashes
                .iter()
                .copied()
                .filter(|&h| tiers.g2_peek(h).is_none())
                .take_while(|&h| tiers.contains(TierName::G3, h))
                .take(MAX_STAGED)
                .collect();
            for (&hash, read) in wanted.iter().zip(tiers.read_into(g2, &wanted, now).await) {
                // A failed read was counted and forgotten by the read itself.
                let Ok(image) = read else { continue };
                let Ok(header) = ImageHeader::decode_header_only(image.as_slice()) else { continue };
                let meta = BlockMeta {
                    parent: header.parent,
                    region: header.retention.region,
                    priority: header.retention.priority,
                    retain_until: 0,
                };
                g2.admit(hash, meta, image, now);
            }
        })
    }

    fn feed(&self) -> Option<&Feed> {
        self.0.g4.as_ref().map(|g4| &*g4.feed)
    }
}

/// Why the block server could not start.
#[derive(Debug, thiserror::Error)]
pub enum BlockServerError {
    /// The secret file.
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// `tiers.g4.secret_file` is not set.
    #[error("tiers.g4.secret_file is not set")]
    NoSecret,
    /// The listener.
    #[error("G4 listener on {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// `tiers.g4.tls_*`.
    #[error("tiers.g4.tls_*: {0}")]
    Tls(#[from] TlsError),
}

/// This node's mutual TLS, when `tiers.g4.tls_cert`, `tls_key` and `tls_ca` are set.
pub fn tls(g4: &G4Config) -> Result<Option<Arc<Tls>>, BlockServerError> {
    match (&g4.tls_cert, &g4.tls_key, &g4.tls_ca) {
        (Some(cert), Some(key), Some(ca)) => Ok(Some(Arc::new(Tls::from_files(cert, key, ca)?))),
        _ => Ok(None),
    }
}

/// The running block server.
#[derive(Debug)]
pub struct BlockServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
    stop: tokio::sync::watch::Sender<bool>,
}

impl BlockServer {
    /// Binds `tiers.g4.listen` and serves `tiers`' G2 to peers that prove the secret; with
    /// `rdma`, peers that ask may read held images by RDMA; with `tls`, every connection runs
    /// under mutual TLS.
    pub async fn start(
        g4: &G4Config,
        node: &str,
        epoch: u64,
        max_image: usize,
        tiers: Arc<NodeTiers>,
        rdma: Option<Arc<RdmaNode>>,
        tls: Option<Arc<Tls>>,
    ) -> Result<Self, BlockServerError> {
        let secret = ClusterSecret::from_file(g4.secret_file.as_deref().ok_or(BlockServerError::NoSecret)?)?;
        let listener = TcpListener::bind(&g4.listen)
            .await
            .map_err(|source| BlockServerError::Bind { addr: g4.listen.clone(), source })?;
        let addr =
            listener.local_addr().map_err(|source| BlockServerError::Bind { addr: g4.listen.clone(), source })?;
        let config = Arc::new(ServerConfig {
            secret,
            me: PeerIdentity { cluster: g4.cluster.clone(), node: node.to_owned(), epoch },
            wire: wire_limits(max_image),
            integrity: integrity(g4),
            holds: HoldLimits {
                max_holds: g4.max_holds_per_peer,
                max_blocks: g4.max_holds_per_peer * WireLimits::default().max_hashes as usize,
                max_ttl: g4.hold_ttl.as_duration(),
            },
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            rdma: rdma.map(|r| r as Arc<dyn RemoteAccess>),
            tls,
        });
        let source = Arc::new(G2Blocks(tiers));
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(accept(listener, config, source, stopped));
        Ok(Self { addr, task, stop })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits until the server stops accepting (stopped, or its accept loop failed).
    pub async fn wait(&mut self) {
        let _ = (&mut self.task).await;
    }

    /// Stops accepting and closes the connections being served.
    pub fn stop(&self) {
        self.task.abort();
        let _ = self.stop.send(true);
    }
}

impl Drop for BlockServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How this node's links to its peers connect and fetch: as `node` of `epoch`, accepting images
/// of up to `max_image` bytes, under `tiers.g4`'s secret, timeouts and limits (the caller adds its
/// RDMA and TLS, which the block server shares).
pub fn link_config(g4: &G4Config, node: &str, epoch: u64, max_image: usize) -> Result<LinkConfig, BlockServerError> {
    let secret = ClusterSecret::from_file(g4.secret_file.as_deref().ok_or(BlockServerError::NoSecret)?)?;
    let request_timeout = g4.request_timeout.as_duration();
    Ok(LinkConfig {
        client: ClientConfig {
            secret,
            me: PeerIdentity { cluster: g4.cluster.clone(), node: node.to_owned(), epoch },
            wire: wire_limits(max_image),
            integrity: integrity(g4),
            connect_timeout: request_timeout.max(Duration::from_secs(1)),
            request_timeout,
            tls: None,
        },
        lanes: g4.lanes,
        max_inflight: g4.max_inflight,
        hold_ttl: g4.hold_ttl.as_duration(),
        min_fetch_budget: g4.min_fetch_budget.as_duration(),
        heartbeat: g4.heartbeat.as_duration(),
        max_snapshot_blocks: MAX_SNAPSHOT_BLOCKS,
        history: None,
        rdma: None,
    })
}

/// This node's RDMA when `tiers.g4.transport = "rdma"`: its device, with G2 registered. Without
/// a device (or a build without the `rdma` feature) it says so and the node uses TCP.
pub fn open_rdma(g4: &G4Config, tiers: &NodeTiers) -> Option<Arc<RdmaNode>> {
    if g4.transport != Transport::Rdma {
        telemetry::set_peer_rdma(false);
        return None;
    }
    // RDMA reads carry images with no MAC and no TLS: only where the operator said the fabric is
    // trusted (`integrity = "checksum"`) and asked for no TLS.
    if g4.integrity != G4Integrity::Checksum || g4.tls_cert.is_some() {
        tracing::warn!(
            "tiers.g4.transport = \"rdma\" reads images with no MAC and no TLS, so it needs \
             integrity = \"checksum\" and no tls_*: G4 uses TCP"
        );
        telemetry::set_peer_rdma(false);
        return None;
    }
    let Some(g2) = &tiers.g2 else {
        tracing::warn!("tiers.g4.transport = \"rdma\" needs G2 to register: G4 uses TCP");
        telemetry::set_peer_rdma(false);
        return None;
    };
    let options = RdmaOptions { device: g4.rdma_device.clone(), gid_index: g4.rdma_gid_index };
    let rdma = RdmaNode::open(&g2.pool, &options)
        .inspect_err(|e| tracing::warn!("tiers.g4.transport = \"rdma\", but {e}: G4 uses TCP"))
        .ok();
    telemetry::set_peer_rdma(rdma.is_some());
    rdma
}

/// Starts a link to every peer of `tiers.g4.peers` into `remote` (static membership). Returns
/// how many were started.
pub fn connect_peers(g4: &G4Config, config: &LinkConfig, remote: &RemoteTier) -> usize {
    for peer in &g4.peers {
        remote.connect(peer.clone(), config.clone());
    }
    g4.peers.len()
}

/// What a peer may send in one frame: an image of `max_image` bytes, or a full request or
/// snapshot part (4096 hashes, with their parents).
fn wire_limits(max_image: usize) -> WireLimits {
    let limits = WireLimits::default();
    let hashes = limits.max_hashes as usize * 33 + 64;
    WireLimits { max_frame: (max_image + 64).max(hashes).min(u32::MAX as usize) as u32, ..limits }
}

/// `tiers.g4.integrity` as the protocol names it.
fn integrity(g4: &G4Config) -> Integrity {
    match g4.integrity {
        G4Integrity::Mac => Integrity::Mac,
        G4Integrity::Checksum => Integrity::Checksum,
    }
}

/// Most blocks one peer's snapshot may list (4 Mi blocks, 128 GiB of G2 at 32 KiB a block:
/// about 300 MiB while the snapshot is applied).
const MAX_SNAPSHOT_BLOCKS: usize = 4 << 20;

async fn accept(
    listener: TcpListener,
    config: Arc<ServerConfig>,
    source: Arc<G2Blocks>,
    stopped: tokio::sync::watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(MAX_PEER_CONNECTIONS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        let (stream, from) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "G4 accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (config, source, mut stopped) = (config.clone(), source.clone(), stopped.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let mut served = ServedPeer::default();
            // A stopping node closes its peers' connections: its feed ends, so they stop
            // routing to it at once.
            let outcome = tokio::select! {
                outcome = serve_peer_into(stream, &config, &*source, &mut served) => outcome,
                _ = stopped.wait_for(|stopped| *stopped) => Err(PeerError::Closed),
            };
            let peer = served.peer.as_ref().map(|p| p.node.as_str()).unwrap_or("?");
            match &outcome {
                Ok(()) => tracing::debug!(%from, peer, images = served.images, "G4 peer said goodbye"),
                Err(e) => tracing::info!(%from, peer, error = %e, "G4 peer connection ended"),
            }
            let kind = outcome.as_ref().err().map_or("goodbye", |e| e.kind());
            telemetry::record_peer_connection(kind, served.expired_holds);
        });
    }
}
