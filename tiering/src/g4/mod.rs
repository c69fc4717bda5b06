//! G4: the block-serving protocol between nodes (DESIGN.md §10). `wire`, `auth`, `holds` and
//! `feed` are sans I/O (bytes and state in, bytes and decisions out); `tcp`, `tls`, `rdma` and
//! `transport` put them on sockets and queue pairs.
//!
//! - [`wire`] — framed, versioned messages; every length and count is checked before anything is
//!   allocated for it; requests name block hashes, never addresses.
//! - [`auth`] — the mutual challenge-response on the cluster secret that opens every connection,
//!   and the session key that authenticates the frames after it.
//! - [`holds`] — the serving side's holds on its resident blocks, with a TTL and per-peer limits.
//! - [`feed`] — what a node can serve, as numbered changes after a snapshot, for peers' indexes.
//! - [`tcp`] — the TCP transport: one authenticated connection with MACed frames, its server
//!   (holds and fetches answered from a [`tcp::BlockSource`]) and its client.
//! - [`tls`] — mutual TLS under the protocol, for untrusted networks.
//! - [`transport`] — a lane of a link, TCP or RDMA, behind one trait.
//! - `rdma` (feature `rdma`) — one-sided RDMA reads of a peer's held images into local G2.
//!
//! The PeerLink actors (`dynamo_actors::peer`) drive these; the reader verifies every image it receives ([`crate::block::verify_image`]) before it is used, so
//! safety never rests on a hold or on the peer.

pub mod auth;
pub mod feed;
pub mod holds;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod tcp;
pub mod tls;
pub mod transport;
pub mod wire;
