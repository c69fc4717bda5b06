//! How a link's lanes move images: a [`Lane`] is one connection to a peer that holds, fetches and
//! releases blocks. Every lane opens as an authenticated TCP connection; where both ends have
//! RDMA ([`RdmaNode`]) the lane then reads held images with one-sided RDMA reads instead of
//! receiving them as frames. The two are interchangeable per lane: a peer that declines RDMA
//! gets a TCP lane, and the caller cannot tell but by [`Lane::transport`].
//!
//! Whichever carried it, every image is verified against the hash asked for and its checksums
//! before the caller sees it as landed.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use super::auth::PeerIdentity;
use super::tcp::{ClientConfig, FetchedSlot, Held, PeerClient, PeerError};
use super::wire::RdmaEndpoint;
use crate::block::BlockHash;
#[cfg(not(feature = "rdma"))]
use crate::g2::HostPool;
use crate::g2::SlotMut;

/// What carries a lane's images.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// Image frames on the lane's TCP connection.
    Tcp,
    /// One-sided RDMA reads of the peer's held slots; control frames on the TCP connection.
    Rdma,
}

impl Transport {
    /// A stable label for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Rdma => "rdma",
        }
    }
}

/// Hands out a fresh slot to land an image in (a G2 slot on a node), or `None` with no room.
pub type SlotAlloc<'a> = &'a mut (dyn FnMut() -> Option<SlotMut> + Send);

/// Takes each block of a fetch, in the order asked.
pub type OnFetched<'a> = &'a mut (dyn FnMut(BlockHash, FetchedSlot) + Send);

/// One connection to a peer that carries fetches: a hold, fetches of the held blocks, a release.
pub trait Lane: Send + std::fmt::Debug {
    /// What carries its images.
    fn transport(&self) -> Transport;

    /// The peer, as it proved itself.
    fn peer(&self) -> &PeerIdentity;

    /// Asks the peer to pin `hashes` for `ttl`; the answer names each hash asked, in its place.
    fn hold<'a>(&'a mut self, hashes: &'a [BlockHash], ttl: Duration) -> BoxFuture<'a, Result<Held, PeerError>>;

    /// Lands held blocks in slots from `alloc` and hands each to `each`, in the order asked, once
    /// verified against the hash asked for.
    fn fetch_into<'a>(
        &'a mut self,
        hold_id: u64,
        hashes: &'a [BlockHash],
        alloc: SlotAlloc<'a>,
        each: OnFetched<'a>,
    ) -> BoxFuture<'a, Result<(), PeerError>>;

    /// Unpins a hold.
    fn release(&mut self, hold_id: u64) -> BoxFuture<'_, Result<(), PeerError>>;
}

impl Lane for PeerClient {
    fn transport(&self) -> Transport {
        Transport::Tcp
    }

    fn peer(&self) -> &PeerIdentity {
        PeerClient::peer(self)
    }

    fn hold<'a>(&'a mut self, hashes: &'a [BlockHash], ttl: Duration) -> BoxFuture<'a, Result<Held, PeerError>> {
        Box::pin(PeerClient::hold(self, hashes, ttl))
    }

    fn fetch_into<'a>(
        &'a mut self,
        hold_id: u64,
        hashes: &'a [BlockHash],
        alloc: SlotAlloc<'a>,
        each: OnFetched<'a>,
    ) -> BoxFuture<'a, Result<(), PeerError>> {
        Box::pin(PeerClient::fetch_into(self, hold_id, hashes, alloc, each))
    }

    fn release(&mut self, hold_id: u64) -> BoxFuture<'_, Result<(), PeerError>> {
        Box::pin(PeerClient::release(self, hold_id))
    }
}

/// What a server needs to let a peer read its held images with RDMA: implemented by
/// [`RdmaNode`]; a server without one declines RDMA and serves frames.
pub trait RemoteAccess: Send + Sync + std::fmt::Debug {
    /// Connects a queue pair of this node's to the peer's `endpoint` for reads of the registered
    /// region. The error is for the peer's log.
    fn accept(&self, peer: &RdmaEndpoint) -> Result<Accepted, String>;

    /// Where `image` lies in the registered region, if it lies wholly inside it.
    fn place(&self, image: &[u8]) -> Option<u64>;
}

/// A queue pair connected for a peer ([`RemoteAccess::accept`]).
pub struct Accepted {
    /// This side's queue pair, for the peer to connect to.
    pub endpoint: RdmaEndpoint,
    /// The key that lets it read the registered region.
    pub rkey: u32,
    /// Keeps the queue pair open; dropping it (when the connection ends) closes it.
    pub keep: Box<dyn Send + Sync>,
}

impl std::fmt::Debug for Accepted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accepted").field("endpoint", &self.endpoint).finish_non_exhaustive()
    }
}

#[cfg(feature = "rdma")]
pub use super::rdma::RdmaNode;

/// This build has no RDMA (the `rdma` feature is off): no value of this type exists, so an
/// `Option<Arc<RdmaNode>>` is always `None` and every lane is TCP.
#[cfg(not(feature = "rdma"))]
#[derive(Debug)]
pub enum RdmaNode {}

#[cfg(not(feature = "rdma"))]
impl RdmaNode {
    /// Without the `rdma` feature there is never a device.
    pub fn open(_pool: &HostPool, _options: &RdmaOptions) -> Result<Arc<Self>, RdmaUnavailable> {
        Err(RdmaUnavailable::NotBuilt)
    }

    /// Never called: no value exists.
    pub async fn connect_lane(self: &Arc<Self>, client: PeerClient) -> Result<Box<dyn Lane>, PeerError> {
        let _ = client;
        match **self {}
    }
}

#[cfg(not(feature = "rdma"))]
impl RemoteAccess for RdmaNode {
    fn accept(&self, _peer: &RdmaEndpoint) -> Result<Accepted, String> {
        match *self {}
    }

    fn place(&self, _image: &[u8]) -> Option<u64> {
        match *self {}
    }
}

/// Which RDMA device a node uses (on its port 1).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RdmaOptions {
    /// The device's name (`mlx5_0`); the first device when `None`.
    pub device: Option<String>,
    /// Index of the port's GID to address by (RoCE v2 is often not index 0).
    pub gid_index: u8,
}

/// Why a node has no RDMA, and uses TCP.
#[derive(Debug, thiserror::Error)]
pub enum RdmaUnavailable {
    /// The binary was built without the `rdma` feature.
    #[error("this build has no RDMA (built without the `rdma` feature)")]
    NotBuilt,
    /// No device (no `/sys/class/infiniband`, or none by the name asked).
    #[error("no RDMA device{0}")]
    NoDevice(String),
    /// A device is there, but a verb failed.
    #[error("RDMA setup failed: {0}")]
    Setup(String),
}

/// Opens a lane to `addr` (which `host` resolved to): an authenticated TCP connection, turned
/// into an RDMA lane when this node has `rdma` and the peer accepts it. A peer that declines
/// leaves a TCP lane.
pub async fn connect_lane(
    addr: std::net::SocketAddr,
    host: &str,
    config: &ClientConfig,
    rdma: Option<&Arc<RdmaNode>>,
) -> Result<Box<dyn Lane>, PeerError> {
    let client = PeerClient::connect_to(addr, host, config).await?;
    match rdma {
        Some(node) => node.connect_lane(client).await,
        None => Ok(Box::new(client)),
    }
}
