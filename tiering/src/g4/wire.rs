//! The block-serving protocol's frames, sans I/O.
//!
//! A frame is `u32 body length ‖ u8 kind ‖ u64 request id ‖ body`, little-endian. The length is
//! checked against [`WireLimits::max_frame`] as soon as the 13-byte header is in, before a byte of
//! the body is awaited or allocated; every count inside a body (hashes, entries, string bytes) is
//! checked against its limit and against the bytes actually present before a vector is sized. A
//! body must be consumed exactly: trailing bytes are an error, not padding.
//!
//! Requests name block hashes, never addresses: a server answers [`Message::Hold`] from its own
//! registry and [`Message::Fetch`] with the sealed images of blocks it holds, and the reader
//! verifies every image ([`crate::block::verify_image`]) before using it. Nothing in a frame can
//! make a server read memory that is not a resident block.

use crate::block::BlockHash;
use crate::bytes::{ByteReader, ReadError};

/// The protocol version a [`Message::Hello`] offers; a server refuses any other. Version 2 added
/// the feed (subscribe, snapshot, changes) and the integrity mode of image frames; version 3 the
/// RDMA handshake and holds that answer with places ([`Message::HoldAt`]); version 4 MACs frames
/// with AEGIS-128X4, where 3 used keyed BLAKE3.
pub const PROTOCOL_VERSION: u16 = 4;

/// How image frames are protected after the handshake; both sides of a connection must agree.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Integrity {
    /// Every frame, images included, carries a MAC under the session key: safe against anyone
    /// on the path. The default.
    #[default]
    Mac,
    /// Control frames carry a MAC; an image frame is checked by the reader against the hash it
    /// asked for and the image's own checksums only. That catches accidents, unauthenticated
    /// peers and stale blocks, not an attacker on the path who rewrites payloads: for trusted
    /// fabrics (as RDMA reads are, which no MAC covers either), where it saves hashing every byte
    /// twice.
    Checksum,
}

impl Integrity {
    /// The byte a Hello carries.
    pub fn to_byte(self) -> u8 {
        match self {
            Integrity::Mac => 0,
            Integrity::Checksum => 1,
        }
    }

    /// The mode a Hello's byte names, if any.
    pub fn from_byte(b: u8) -> Option<Self> {
        match b {
            0 => Some(Integrity::Mac),
            1 => Some(Integrity::Checksum),
            _ => None,
        }
    }
}

/// Bytes of a frame header: body length, kind, request id.
pub const FRAME_HEADER_LEN: usize = 4 + 1 + 8;

/// Longest node or cluster name on the wire.
pub const MAX_NAME_LEN: usize = 255;

/// Longest human-readable text (a refusal's reason) on the wire.
pub const MAX_TEXT_LEN: usize = 1024;

/// What one peer may send in one frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireLimits {
    /// Largest frame body in bytes (an image frame holds one block image).
    pub max_frame: u32,
    /// Most block hashes in one request or answer.
    pub max_hashes: u32,
}

impl Default for WireLimits {
    fn default() -> Self {
        Self { max_frame: 64 << 20, max_hashes: 4096 }
    }
}

/// A nonce of the handshake.
pub type Nonce = [u8; 32];

/// A message authentication code of the handshake.
pub type Mac = [u8; 32];

/// One block of a [`Message::Held`] answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldBlock {
    /// The block asked for.
    pub hash: BlockHash,
    /// Bytes of its sealed image if the server now holds it; `None` if it is not resident.
    pub image_len: Option<u32>,
}

/// One side of an RDMA reliable connection: what the other side's queue pair needs to reach it.
/// Sent only inside an authenticated connection ([`Message::RdmaConnect`], [`Message::RdmaAccept`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RdmaEndpoint {
    /// The port's local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The port's global identifier (RoCE addresses by it).
    pub gid: [u8; 16],
    /// The queue pair's number.
    pub qpn: u32,
    /// The first packet sequence number it sends.
    pub psn: u32,
    /// Its port's active MTU (the verbs enumeration: 1 = 256 bytes … 5 = 4096); the two ends
    /// use the smaller.
    pub mtu: u8,
    /// RDMA reads it takes in flight at once; the two ends use the smaller.
    pub rd_atomic: u8,
}

/// One block of a [`Message::HeldAt`] answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldPlace {
    /// The block asked for.
    pub hash: BlockHash,
    /// Where its sealed image lies in the server's registered region and how long it is, if the
    /// server now holds it; `None` if it does not.
    pub place: Option<(u64, u32)>,
}

/// Every message of the protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Client → server, first: who the client is and its nonce.
    Hello {
        /// The protocol version the client speaks.
        version: u16,
        /// The cluster the client belongs to.
        cluster: String,
        /// The client node's name.
        node: String,
        /// The client node's membership epoch.
        epoch: u64,
        /// Fresh per connection.
        nonce: Nonce,
        /// How image frames are protected ([`Integrity::to_byte`]); the server refuses a mode
        /// other than its own.
        integrity: u8,
    },
    /// Server → client: who the server is, its nonce, and its proof of the secret.
    Challenge {
        /// The server node's name.
        node: String,
        /// The server node's membership epoch.
        epoch: u64,
        /// Fresh per connection.
        nonce: Nonce,
        /// The server's MAC over the transcript.
        mac: Mac,
    },
    /// Client → server: the client's proof of the secret.
    Proof {
        /// The client's MAC over the transcript.
        mac: Mac,
    },
    /// Either side: the connection ends, and why.
    Refused {
        /// A stable code ([`RefusalCode`]).
        code: RefusalCode,
        /// For the operator's log.
        text: String,
    },
    /// Pin these blocks for `ttl_ms`; the answer says which are resident.
    Hold {
        /// The blocks wanted, in prefix order.
        hashes: Vec<BlockHash>,
        /// How long the server keeps them pinned without a fetch or release.
        ttl_ms: u32,
    },
    /// The answer to a hold.
    Held {
        /// Names the hold in fetches and the release.
        hold_id: u64,
        /// The TTL granted (the server may cap the one asked for).
        ttl_ms: u32,
        /// One entry per hash asked for, in order.
        blocks: Vec<HeldBlock>,
    },
    /// Send the images of these held blocks.
    Fetch {
        /// The hold they belong to.
        hold_id: u64,
        /// A subset of the held blocks.
        hashes: Vec<BlockHash>,
    },
    /// One sealed block image, the answer to a fetch (one frame per block).
    Image {
        /// The block it claims to be; the reader verifies it.
        hash: BlockHash,
        /// Header and payload as sealed by the server's tier.
        image: Vec<u8>,
    },
    /// Unpin a hold's blocks.
    Release {
        /// The hold.
        hold_id: u64,
    },
    /// Liveness probe.
    Ping {
        /// Echoed by the pong.
        nonce: u64,
    },
    /// The answer to a ping.
    Pong {
        /// The ping's nonce.
        nonce: u64,
    },
    /// Either side is closing the connection cleanly.
    Goodbye,
    /// Client → server: this connection's lane would read held images with one-sided RDMA reads;
    /// here is the client's queue pair. Answered by [`Message::RdmaAccept`] or
    /// [`Message::RdmaDecline`]; either way the connection goes on.
    RdmaConnect {
        /// The client's queue pair.
        endpoint: RdmaEndpoint,
    },
    /// Server → client: its queue pair, connected to the client's, and the key that lets that
    /// queue pair read the server's registered G2. From here on the client may send
    /// [`Message::HoldAt`].
    RdmaAccept {
        /// The server's queue pair.
        endpoint: RdmaEndpoint,
        /// The remote key of the server's registered region.
        rkey: u32,
    },
    /// Server → client: no RDMA on this connection (the server has no device, or its setup
    /// failed); the lane carries images over TCP.
    RdmaDecline {
        /// For the operator's log.
        text: String,
    },
    /// Like [`Message::Hold`], answered with where each held image lies ([`Message::HeldAt`]);
    /// only on a connection whose RDMA the server accepted.
    HoldAt {
        /// The blocks wanted, in prefix order.
        hashes: Vec<BlockHash>,
        /// How long the server keeps them pinned without a release.
        ttl_ms: u32,
    },
    /// The answer to a [`Message::HoldAt`].
    HeldAt {
        /// Names the hold in the release.
        hold_id: u64,
        /// The TTL granted.
        ttl_ms: u32,
        /// One entry per hash asked for, in order.
        blocks: Vec<HeldPlace>,
    },
    /// Client → server: turn this connection into a feed of the server's servable blocks. The
    /// answer is a snapshot ([`Message::Snapshot`] frames, then [`Message::Synced`]) and then every
    /// change after it ([`Message::Stored`], [`Message::Removed`]), numbered from the snapshot's
    /// sequence number on, under the server's epoch of the handshake.
    Subscribe,
    /// Part of a snapshot: servable blocks and their parents.
    Snapshot {
        /// `(block, parent)`; the parent is `None` for the first block of a sequence.
        blocks: Vec<(BlockHash, Option<BlockHash>)>,
    },
    /// The snapshot is complete: it reflects every change up to and including `seq`.
    Synced {
        /// The feed's sequence number at the snapshot.
        seq: u64,
    },
    /// Blocks became servable: one chain, the parent of `hashes[0]` is `parent` and the parent of
    /// `hashes[i]` is `hashes[i - 1]`.
    Stored {
        /// The change's sequence number (the previous one's plus one).
        seq: u64,
        /// The parent of `hashes[0]`.
        parent: Option<BlockHash>,
        /// The blocks, in prefix order.
        hashes: Vec<BlockHash>,
    },
    /// Blocks are no longer servable.
    Removed {
        /// The change's sequence number.
        seq: u64,
        /// The blocks, in any order.
        hashes: Vec<BlockHash>,
    },
}

/// Why a peer ends a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefusalCode {
    /// The other side speaks another protocol version.
    Version,
    /// Another cluster's node.
    Cluster,
    /// The proof of the secret failed.
    Auth,
    /// A frame broke the protocol or a limit.
    Protocol,
    /// A per-peer limit (holds, bytes in flight) was exceeded.
    Limit,
    /// A hold id that is unknown or expired.
    UnknownHold,
    /// A code this build does not know (a newer peer).
    Other(u8),
}

impl RefusalCode {
    fn to_byte(self) -> u8 {
        match self {
            RefusalCode::Version => 1,
            RefusalCode::Cluster => 2,
            RefusalCode::Auth => 3,
            RefusalCode::Protocol => 4,
            RefusalCode::Limit => 5,
            RefusalCode::UnknownHold => 6,
            RefusalCode::Other(b) => b,
        }
    }

    fn from_byte(b: u8) -> Self {
        match b {
            1 => RefusalCode::Version,
            2 => RefusalCode::Cluster,
            3 => RefusalCode::Auth,
            4 => RefusalCode::Protocol,
            5 => RefusalCode::Limit,
            6 => RefusalCode::UnknownHold,
            other => RefusalCode::Other(other),
        }
    }
}

/// A request id and the message it carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Pairs an answer with its request (0 for unsolicited frames).
    pub req_id: u64,
    /// The message.
    pub message: Message,
}

/// A frame that cannot be accepted; the connection that sent it is closed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The header announces a body longer than the limit.
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    FrameTooLarge {
        /// Announced body length.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// A frame kind this build does not know.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// The body ends inside a field.
    #[error("{0} frame truncated")]
    Truncated(&'static str),
    /// The body goes on after its last field.
    #[error("{0} frame has trailing bytes")]
    TrailingBytes(&'static str),
    /// A count beyond its limit.
    #[error("{what}: {n} exceeds the limit of {max}")]
    TooMany {
        /// What was counted.
        what: &'static str,
        /// The count sent.
        n: u64,
        /// The limit.
        max: u64,
    },
    /// A name or text that is not UTF-8.
    #[error("{0}: not UTF-8")]
    BadString(&'static str),
    /// A flag byte other than 0 or 1.
    #[error("{0} frame has a bad flag byte")]
    BadFlag(&'static str),
}

impl WireError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            WireError::FrameTooLarge { .. } => "too_large",
            WireError::UnknownKind(_) => "unknown_kind",
            WireError::Truncated(_) => "truncated",
            WireError::TrailingBytes(_) => "trailing_bytes",
            WireError::TooMany { .. } => "too_many",
            WireError::BadString(_) => "bad_string",
            WireError::BadFlag(_) => "bad_flag",
        }
    }
}

mod kind {
    pub(super) const HELLO: u8 = 1;
    pub(super) const CHALLENGE: u8 = 2;
    pub(super) const PROOF: u8 = 3;
    pub(super) const REFUSED: u8 = 4;
    pub(super) const HOLD: u8 = 10;
    pub(super) const HELD: u8 = 11;
    pub(super) const FETCH: u8 = 12;
    pub(super) const IMAGE: u8 = 13;
    pub(super) const RELEASE: u8 = 14;
    pub(super) const PING: u8 = 20;
    pub(super) const PONG: u8 = 21;
    pub(super) const GOODBYE: u8 = 22;
    pub(super) const SUBSCRIBE: u8 = 30;
    pub(super) const SNAPSHOT: u8 = 31;
    pub(super) const SYNCED: u8 = 32;
    pub(super) const STORED: u8 = 33;
    pub(super) const REMOVED: u8 = 34;
    pub(super) const RDMA_CONNECT: u8 = 40;
    pub(super) const RDMA_ACCEPT: u8 = 41;
    pub(super) const RDMA_DECLINE: u8 = 42;
    pub(super) const HOLD_AT: u8 = 43;
    pub(super) const HELD_AT: u8 = 44;
}

impl Message {
    fn kind(&self) -> u8 {
        match self {
            Message::Hello { .. } => kind::HELLO,
            Message::Challenge { .. } => kind::CHALLENGE,
            Message::Proof { .. } => kind::PROOF,
            Message::Refused { .. } => kind::REFUSED,
            Message::Hold { .. } => kind::HOLD,
            Message::Held { .. } => kind::HELD,
            Message::Fetch { .. } => kind::FETCH,
            Message::Image { .. } => kind::IMAGE,
            Message::Release { .. } => kind::RELEASE,
            Message::Ping { .. } => kind::PING,
            Message::Pong { .. } => kind::PONG,
            Message::Goodbye => kind::GOODBYE,
            Message::Subscribe => kind::SUBSCRIBE,
            Message::Snapshot { .. } => kind::SNAPSHOT,
            Message::Synced { .. } => kind::SYNCED,
            Message::Stored { .. } => kind::STORED,
            Message::Removed { .. } => kind::REMOVED,
            Message::RdmaConnect { .. } => kind::RDMA_CONNECT,
            Message::RdmaAccept { .. } => kind::RDMA_ACCEPT,
            Message::RdmaDecline { .. } => kind::RDMA_DECLINE,
            Message::HoldAt { .. } => kind::HOLD_AT,
            Message::HeldAt { .. } => kind::HELD_AT,
        }
    }

    /// A stable name of the message's kind, for errors and logs.
    pub fn name(&self) -> &'static str {
        kind_name(self.kind()).unwrap_or("unknown")
    }

    /// The body alone, as the handshake's transcript takes it.
    pub fn body(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_body(&mut out);
        out
    }

    fn encode_body(&self, out: &mut Vec<u8>) {
        fn name(out: &mut Vec<u8>, s: &str, max: usize) {
            let s = &s.as_bytes()[..s.len().min(max)];
            out.extend_from_slice(&(s.len() as u16).to_le_bytes());
            out.extend_from_slice(s);
        }
        fn hashes(out: &mut Vec<u8>, hashes: &[BlockHash]) {
            out.extend_from_slice(&(hashes.len() as u32).to_le_bytes());
            for h in hashes {
                out.extend_from_slice(&h.to_le_bytes());
            }
        }
        // A flag byte, then the hash (zero when absent): every hash value stays representable.
        fn parent(out: &mut Vec<u8>, parent: Option<BlockHash>) {
            out.push(u8::from(parent.is_some()));
            out.extend_from_slice(&parent.unwrap_or(BlockHash(0)).to_le_bytes());
        }
        fn endpoint(out: &mut Vec<u8>, e: &RdmaEndpoint) {
            out.extend_from_slice(&e.lid.to_le_bytes());
            out.extend_from_slice(&e.gid);
            out.extend_from_slice(&e.qpn.to_le_bytes());
            out.extend_from_slice(&e.psn.to_le_bytes());
            out.push(e.mtu);
            out.push(e.rd_atomic);
        }
        match self {
            Message::Hello { version, cluster, node, epoch, nonce, integrity } => {
                out.extend_from_slice(&version.to_le_bytes());
                name(out, cluster, MAX_NAME_LEN);
                name(out, node, MAX_NAME_LEN);
                out.extend_from_slice(&epoch.to_le_bytes());
                out.extend_from_slice(nonce);
                out.push(*integrity);
            }
            Message::Challenge { node, epoch, nonce, mac } => {
                name(out, node, MAX_NAME_LEN);
                out.extend_from_slice(&epoch.to_le_bytes());
                out.extend_from_slice(nonce);
                out.extend_from_slice(mac);
            }
            Message::Proof { mac } => out.extend_from_slice(mac),
            Message::Refused { code, text } => {
                out.push(code.to_byte());
                name(out, text, MAX_TEXT_LEN);
            }
            Message::Hold { hashes: hs, ttl_ms } => {
                out.extend_from_slice(&ttl_ms.to_le_bytes());
                hashes(out, hs);
            }
            Message::Held { hold_id, ttl_ms, blocks } => {
                out.extend_from_slice(&hold_id.to_le_bytes());
                out.extend_from_slice(&ttl_ms.to_le_bytes());
                out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
                for b in blocks {
                    out.extend_from_slice(&b.hash.to_le_bytes());
                    // 0 is no image: a sealed image is never empty.
                    out.extend_from_slice(&b.image_len.unwrap_or(0).to_le_bytes());
                }
            }
            Message::Fetch { hold_id, hashes: hs } => {
                out.extend_from_slice(&hold_id.to_le_bytes());
                hashes(out, hs);
            }
            Message::Image { hash, image } => {
                out.extend_from_slice(&hash.to_le_bytes());
                out.extend_from_slice(image);
            }
            Message::Release { hold_id } => out.extend_from_slice(&hold_id.to_le_bytes()),
            Message::Ping { nonce } | Message::Pong { nonce } => out.extend_from_slice(&nonce.to_le_bytes()),
            Message::Goodbye | Message::Subscribe => {}
            Message::Snapshot { blocks } => {
                out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
                for &(hash, p) in blocks {
                    out.extend_from_slice(&hash.to_le_bytes());
                    parent(out, p);
                }
            }
            Message::Synced { seq } => out.extend_from_slice(&seq.to_le_bytes()),
            Message::Stored { seq, parent: p, hashes: hs } => {
                out.extend_from_slice(&seq.to_le_bytes());
                parent(out, *p);
                hashes(out, hs);
            }
            Message::Removed { seq, hashes: hs } => {
                out.extend_from_slice(&seq.to_le_bytes());
                hashes(out, hs);
            }
            Message::RdmaConnect { endpoint: e } => endpoint(out, e),
            Message::RdmaAccept { endpoint: e, rkey } => {
                endpoint(out, e);
                out.extend_from_slice(&rkey.to_le_bytes());
            }
            Message::RdmaDecline { text } => name(out, text, MAX_TEXT_LEN),
            Message::HoldAt { hashes: hs, ttl_ms } => {
                out.extend_from_slice(&ttl_ms.to_le_bytes());
                hashes(out, hs);
            }
            Message::HeldAt { hold_id, ttl_ms, blocks } => {
                out.extend_from_slice(&hold_id.to_le_bytes());
                out.extend_from_slice(&ttl_ms.to_le_bytes());
                out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
                for b in blocks {
                    out.extend_from_slice(&b.hash.to_le_bytes());
                    // Length 0 is no image: a sealed image is never empty.
                    let (addr, len) = b.place.unwrap_or((0, 0));
                    out.extend_from_slice(&addr.to_le_bytes());
                    out.extend_from_slice(&len.to_le_bytes());
                }
            }
        }
    }
}

impl Frame {
    /// Appends the frame, header and body, to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&[0; FRAME_HEADER_LEN]);
        self.message.encode_body(out);
        let len = (out.len() - start - FRAME_HEADER_LEN) as u32;
        out[start..start + 4].copy_from_slice(&len.to_le_bytes());
        out[start + 4] = self.message.kind();
        out[start + 5..start + FRAME_HEADER_LEN].copy_from_slice(&self.req_id.to_le_bytes());
    }

    /// The frame as bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode(&mut out);
        out
    }
}

/// The header and hash of an image frame whose `image_len` image bytes follow, so that a server
/// sends an image straight from its slot without copying it into a frame.
pub fn image_frame_prefix(req_id: u64, hash: BlockHash, image_len: usize) -> [u8; FRAME_HEADER_LEN + 16] {
    let mut out = [0u8; FRAME_HEADER_LEN + 16];
    out[..4].copy_from_slice(&((16 + image_len) as u32).to_le_bytes());
    out[4] = kind::IMAGE;
    out[5..FRAME_HEADER_LEN].copy_from_slice(&req_id.to_le_bytes());
    out[FRAME_HEADER_LEN..].copy_from_slice(&hash.to_le_bytes());
    out
}

/// A parsed frame header: what a reader needs to read the body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Body bytes that follow.
    pub len: u32,
    /// The frame kind.
    pub kind: u8,
    /// The request id.
    pub req_id: u64,
}

impl FrameHeader {
    /// Parses and checks a header: its length against the limit, its kind against the known kinds.
    pub fn parse(bytes: &[u8; FRAME_HEADER_LEN], limits: &WireLimits) -> Result<Self, WireError> {
        let len = u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"));
        let kind = bytes[4];
        let req_id = u64::from_le_bytes(bytes[5..].try_into().expect("8 bytes"));
        if len > limits.max_frame {
            return Err(WireError::FrameTooLarge { len, max: limits.max_frame });
        }
        if kind_name(kind).is_none() {
            return Err(WireError::UnknownKind(kind));
        }
        Ok(Self { len, kind, req_id })
    }

    /// Whether it starts an image frame: a 16-byte hash, then the image (which a reader may read
    /// straight into a buffer of its own).
    pub fn is_image(&self) -> bool {
        self.kind == kind::IMAGE
    }

    /// Decodes the body this header announced (`body.len()` must be `self.len`).
    pub fn decode_body(&self, body: &[u8], limits: &WireLimits) -> Result<Frame, WireError> {
        debug_assert_eq!(body.len(), self.len as usize);
        let message = decode_message(self.kind, body, limits)?;
        Ok(Frame { req_id: self.req_id, message })
    }
}

/// G4's view of a [`ByteReader`] over the body of a `what` frame: every error names the frame
/// (or the field) being read.
struct Reader<'a> {
    bytes: ByteReader<'a>,
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn new(body: &'a [u8], what: &'static str) -> Self {
        Self { bytes: ByteReader::new(body), what }
    }

    /// `e`, met reading `field` of this frame, as G4's error.
    fn error(&self, field: &'static str, e: ReadError) -> WireError {
        match e {
            ReadError::Short { .. } => WireError::Truncated(self.what),
            ReadError::TooMany { n, max } => WireError::TooMany { what: field, n, max },
            ReadError::NotUtf8 => WireError::BadString(field),
            ReadError::Trailing(_) => WireError::TrailingBytes(self.what),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        self.bytes.take(n).map_err(|e| self.error("", e))
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        self.bytes.array().map_err(|e| self.error("", e))
    }

    fn u16(&mut self) -> Result<u16, WireError> {
        self.bytes.u16().map_err(|e| self.error("", e))
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        self.bytes.u32().map_err(|e| self.error("", e))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        self.bytes.u64().map_err(|e| self.error("", e))
    }

    fn hash(&mut self) -> Result<BlockHash, WireError> {
        self.array().map(BlockHash::from_le_bytes)
    }

    fn string(&mut self, field: &'static str, max: usize) -> Result<String, WireError> {
        self.bytes.str16(max).map_err(|e| self.error(field, e))
    }

    /// A count of `item_len`-byte items, checked against the limit and the bytes present
    /// before anything is allocated for them.
    fn count(&mut self, field: &'static str, item_len: usize, max: u32) -> Result<usize, WireError> {
        self.bytes.count32(item_len, max.into()).map_err(|e| self.error(field, e))
    }

    fn hashes(&mut self, limits: &WireLimits) -> Result<Vec<BlockHash>, WireError> {
        let n = self.count("hashes", 16, limits.max_hashes)?;
        (0..n).map(|_| self.hash()).collect()
    }

    fn parent(&mut self) -> Result<Option<BlockHash>, WireError> {
        let present = self.array::<1>()?[0];
        let hash = self.hash()?;
        match present {
            0 => Ok(None),
            1 => Ok(Some(hash)),
            _ => Err(WireError::BadFlag(self.what)),
        }
    }

    fn endpoint(&mut self) -> Result<RdmaEndpoint, WireError> {
        Ok(RdmaEndpoint {
            lid: self.u16()?,
            gid: self.array()?,
            qpn: self.u32()?,
            psn: self.u32()?,
            mtu: self.array::<1>()?[0],
            rd_atomic: self.array::<1>()?[0],
        })
    }

    fn finish(self) -> Result<(), WireError> {
        let what = self.what;
        self.bytes.finish().map_err(|_| WireError::TrailingBytes(what))
    }
}

/// The name of a frame kind this build knows.
fn kind_name(kind: u8) -> Option<&'static str> {
    Some(match kind {
        kind::HELLO => "hello",
        kind::CHALLENGE => "challenge",
        kind::PROOF => "proof",
        kind::REFUSED => "refused",
        kind::HOLD => "hold",
        kind::HELD => "held",
        kind::FETCH => "fetch",
        kind::IMAGE => "image",
        kind::RELEASE => "release",
        kind::PING => "ping",
        kind::PONG => "pong",
        kind::GOODBYE => "goodbye",
        kind::SUBSCRIBE => "subscribe",
        kind::SNAPSHOT => "snapshot",
        kind::SYNCED => "synced",
        kind::STORED => "stored",
        kind::REMOVED => "removed",
        kind::RDMA_CONNECT => "rdma_connect",
        kind::RDMA_ACCEPT => "rdma_accept",
        kind::RDMA_DECLINE => "rdma_decline",
        kind::HOLD_AT => "hold_at",
        kind::HELD_AT => "held_at",
        _ => return None,
    })
}

fn decode_message(kind: u8, body: &[u8], limits: &WireLimits) -> Result<Message, WireError> {
    let what = kind_name(kind).ok_or(WireError::UnknownKind(kind))?;
    let mut r = Reader::new(body, what);
    let message = match kind {
        kind::HELLO => Message::Hello {
            version: r.u16()?,
            cluster: r.string("cluster", MAX_NAME_LEN)?,
            node: r.string("node", MAX_NAME_LEN)?,
            epoch: r.u64()?,
            nonce: r.array()?,
            integrity: r.array::<1>()?[0],
        },
        kind::CHALLENGE => Message::Challenge {
            node: r.string("node", MAX_NAME_LEN)?,
            epoch: r.u64()?,
            nonce: r.array()?,
            mac: r.array()?,
        },
        kind::PROOF => Message::Proof { mac: r.array()? },
        kind::REFUSED => {
            let code = RefusalCode::from_byte(r.array::<1>()?[0]);
            Message::Refused { code, text: r.string("text", MAX_TEXT_LEN)? }
        }
        kind::HOLD => Message::Hold { ttl_ms: r.u32()?, hashes: r.hashes(limits)? },
        kind::HELD => {
            let hold_id = r.u64()?;
            let ttl_ms = r.u32()?;
            let n = r.count("blocks", 20, limits.max_hashes)?;
            let mut blocks = Vec::with_capacity(n);
            for _ in 0..n {
                let hash = r.hash()?;
                let len = r.u32()?;
                blocks.push(HeldBlock { hash, image_len: (len > 0).then_some(len) });
            }
            Message::Held { hold_id, ttl_ms, blocks }
        }
        kind::FETCH => Message::Fetch { hold_id: r.u64()?, hashes: r.hashes(limits)? },
        kind::IMAGE => {
            let hash = r.hash()?;
            let image = r.take(r.bytes.remaining())?.to_vec();
            Message::Image { hash, image }
        }
        kind::RELEASE => Message::Release { hold_id: r.u64()? },
        kind::PING => Message::Ping { nonce: r.u64()? },
        kind::PONG => Message::Pong { nonce: r.u64()? },
        kind::SUBSCRIBE => Message::Subscribe,
        kind::SNAPSHOT => {
            let n = r.count("blocks", 33, limits.max_hashes)?;
            let mut blocks = Vec::with_capacity(n);
            for _ in 0..n {
                blocks.push((r.hash()?, r.parent()?));
            }
            Message::Snapshot { blocks }
        }
        kind::SYNCED => Message::Synced { seq: r.u64()? },
        kind::STORED => Message::Stored { seq: r.u64()?, parent: r.parent()?, hashes: r.hashes(limits)? },
        kind::REMOVED => Message::Removed { seq: r.u64()?, hashes: r.hashes(limits)? },
        kind::RDMA_CONNECT => Message::RdmaConnect { endpoint: r.endpoint()? },
        kind::RDMA_ACCEPT => Message::RdmaAccept { endpoint: r.endpoint()?, rkey: r.u32()? },
        kind::RDMA_DECLINE => Message::RdmaDecline { text: r.string("text", MAX_TEXT_LEN)? },
        kind::HOLD_AT => Message::HoldAt { ttl_ms: r.u32()?, hashes: r.hashes(limits)? },
        kind::HELD_AT => {
            let hold_id = r.u64()?;
            let ttl_ms = r.u32()?;
            let n = r.count("blocks", 28, limits.max_hashes)?;
            let mut blocks = Vec::with_capacity(n);
            for _ in 0..n {
                let hash = r.hash()?;
                let addr = r.u64()?;
                let len = r.u32()?;
                blocks.push(HeldPlace { hash, place: (len > 0).then_some((addr, len)) });
            }
            Message::HeldAt { hold_id, ttl_ms, blocks }
        }
        _ => Message::Goodbye,
    };
    r.finish()?;
    Ok(message)
}

/// Frames out of a byte stream fed in pieces of any size.
///
/// An over-long header is refused as soon as its 13 bytes are in; the buffer never holds more than
/// one frame's bytes beyond what the caller fed, and after an error the decoder stays failed (the
/// connection is to be closed).
#[derive(Debug)]
pub struct FrameDecoder {
    limits: WireLimits,
    buf: Vec<u8>,
    header: Option<FrameHeader>,
    failed: Option<WireError>,
}

impl FrameDecoder {
    /// A decoder enforcing `limits`.
    pub fn new(limits: WireLimits) -> Self {
        Self { limits, buf: Vec::new(), header: None, failed: None }
    }

    /// Appends received bytes.
    pub fn feed(&mut self, bytes: &[u8]) {
        if self.failed.is_none() {
            self.buf.extend_from_slice(bytes);
        }
    }

    /// Bytes fed and not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next complete frame, `None` until one is in, or the error that ends the stream.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, WireError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let result = self.decode_one();
        if let Err(e) = &result {
            self.failed = Some(e.clone());
            self.buf = Vec::new();
        }
        result
    }

    fn decode_one(&mut self) -> Result<Option<Frame>, WireError> {
        let header = match self.header {
            Some(h) => h,
            None => {
                let Some(bytes) = self.buf.get(..FRAME_HEADER_LEN) else { return Ok(None) };
                let h = FrameHeader::parse(bytes.try_into().expect("header bytes"), &self.limits)?;
                self.header = Some(h);
                h
            }
        };
        let end = FRAME_HEADER_LEN + header.len as usize;
        if self.buf.len() < end {
            return Ok(None);
        }
        let frame = header.decode_body(&self.buf[FRAME_HEADER_LEN..end], &self.limits)?;
        self.buf.drain(..end);
        self.header = None;
        Ok(Some(frame))
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn every_message() -> Vec<Message> {
        let h = |n: u128| BlockHash(n * 0x1234_5678_9abc_def0_1122_3344_5566_7788);
        vec![
            Message::Hello {
                version: 1,
                cluster: "prod".into(),
                node: "node-a".into(),
                epoch: 7,
                nonce: [3; 32],
                integrity: 1,
            },
            Message::Challenge { node: "node-b".into(), epoch: 9, nonce: [4; 32], mac: [5; 32] },
            Message::Proof { mac: [6; 32] },
            Message::Refused { code: RefusalCode::Auth, text: "wrong secret".into() },
            Message::Refused { code: RefusalCode::Other(77), text: String::new() },
            Message::Hold { hashes: vec![h(1), h(2), h(3)], ttl_ms: 5_000 },
            Message::Held {
                hold_id: 42,
                ttl_ms: 2_000,
                blocks: vec![
                    HeldBlock { hash: h(1), image_len: Some(4224) },
                    HeldBlock { hash: h(2), image_len: None },
                ],
            },
            Message::Fetch { hold_id: 42, hashes: vec![h(1)] },
            Message::Image { hash: h(1), image: (0..=255).collect() },
            Message::Release { hold_id: 42 },
            Message::Ping { nonce: 1 },
            Message::Pong { nonce: 1 },
            Message::Goodbye,
            Message::Subscribe,
            Message::Snapshot { blocks: vec![(h(1), None), (h(2), Some(h(1))), (h(3), Some(BlockHash(0)))] },
            Message::Synced { seq: 17 },
            Message::Stored { seq: 18, parent: Some(h(3)), hashes: vec![h(4), h(5)] },
            Message::Stored { seq: 19, parent: None, hashes: vec![h(6)] },
            Message::Removed { seq: 20, hashes: vec![h(1), h(6)] },
            Message::RdmaConnect {
                endpoint: RdmaEndpoint { lid: 3, gid: [9; 16], qpn: 0x12_3456, psn: 77, mtu: 5, rd_atomic: 16 },
            },
            Message::RdmaAccept {
                endpoint: RdmaEndpoint { lid: 0, gid: [1; 16], qpn: 8, psn: 0xff_ffff, mtu: 3, rd_atomic: 1 },
                rkey: 0xdead,
            },
            Message::RdmaDecline { text: "no RDMA device".into() },
            Message::HoldAt { hashes: vec![h(1), h(2)], ttl_ms: 3_000 },
            Message::HeldAt {
                hold_id: 43,
                ttl_ms: 3_000,
                blocks: vec![
                    HeldPlace { hash: h(1), place: Some((0x7f00_0000_1000, 4224)) },
                    HeldPlace { hash: h(2), place: None },
                ],
            },
        ]
    }

    #[test]
    fn every_message_round_trips_fed_whole_and_a_byte_at_a_time() {
        let frames: Vec<Frame> =
            every_message().into_iter().enumerate().map(|(i, message)| Frame { req_id: i as u64, message }).collect();
        let mut stream = Vec::new();
        for f in &frames {
            f.encode(&mut stream);
        }
        let mut whole = FrameDecoder::new(WireLimits::default());
        whole.feed(&stream);
        let mut got = Vec::new();
        while let Some(f) = whole.next_frame().unwrap() {
            got.push(f);
        }
        assert_eq!(got, frames);
        assert_eq!(whole.buffered(), 0);

        let mut trickle = FrameDecoder::new(WireLimits::default());
        let mut got = Vec::new();
        for b in &stream {
            trickle.feed(std::slice::from_ref(b));
            while let Some(f) = trickle.next_frame().unwrap() {
                got.push(f);
            }
        }
        assert_eq!(got, frames);
    }

    #[test]
    fn an_image_sent_from_its_slot_is_the_image_frame() {
        let image: Vec<u8> = (0..100).collect();
        let frame = Frame { req_id: 5, message: Message::Image { hash: BlockHash(9), image: image.clone() } };
        let mut sent = image_frame_prefix(5, BlockHash(9), image.len()).to_vec();
        sent.extend_from_slice(&image);
        assert_eq!(sent, frame.to_bytes());
    }

    #[test]
    fn an_over_long_frame_is_refused_from_its_header_alone() {
        let limits = WireLimits { max_frame: 1024, max_hashes: 16 };
        let mut d = FrameDecoder::new(limits);
        let mut header = [0u8; FRAME_HEADER_LEN];
        header[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        header[4] = kind::IMAGE;
        d.feed(&header);
        assert_eq!(d.next_frame(), Err(WireError::FrameTooLarge { len: u32::MAX, max: 1024 }));
        // The decoder stays failed and keeps nothing of what follows.
        d.feed(&[0; 4096]);
        assert_eq!(d.buffered(), 0);
        assert!(d.next_frame().is_err());
    }

    #[test]
    fn counts_are_checked_against_the_limit_and_the_bytes_present_before_allocating() {
        let limits = WireLimits { max_frame: 1 << 20, max_hashes: 16 };
        let hold = |n: u32, present: usize| {
            let mut body = 100u32.to_le_bytes().to_vec();
            body.extend_from_slice(&n.to_le_bytes());
            body.extend(std::iter::repeat_n(0u8, present * 16));
            let header = FrameHeader { len: body.len() as u32, kind: kind::HOLD, req_id: 1 };
            header.decode_body(&body, &limits)
        };
        assert_eq!(hold(17, 17).unwrap_err(), WireError::TooMany { what: "hashes", n: 17, max: 16 });
        assert_eq!(hold(u32::MAX, 0).unwrap_err(), WireError::TooMany { what: "hashes", n: u32::MAX as u64, max: 16 });
        assert_eq!(hold(16, 3).unwrap_err(), WireError::Truncated("hold"));
        assert!(
            matches!(hold(3, 3).unwrap(), Frame { message: Message::Hold { ref hashes, .. }, .. } if hashes.len() == 3)
        );
        assert_eq!(hold(3, 4).unwrap_err(), WireError::TrailingBytes("hold"));
    }

    #[test]
    fn unknown_kinds_bad_strings_and_long_names_are_errors() {
        let limits = WireLimits::default();
        let mut header = [0u8; FRAME_HEADER_LEN];
        header[4] = 99;
        assert_eq!(FrameHeader::parse(&header, &limits), Err(WireError::UnknownKind(99)));

        let mut body = vec![4u8];
        body.extend_from_slice(&2u16.to_le_bytes());
        body.extend_from_slice(&[0xff, 0xfe]);
        let h = FrameHeader { len: body.len() as u32, kind: kind::REFUSED, req_id: 0 };
        assert_eq!(h.decode_body(&body, &limits), Err(WireError::BadString("text")));

        let mut body = 1u16.to_le_bytes().to_vec();
        body.extend_from_slice(&300u16.to_le_bytes());
        body.extend(std::iter::repeat_n(b'a', 300));
        let h = FrameHeader { len: body.len() as u32, kind: kind::HELLO, req_id: 0 };
        assert_eq!(h.decode_body(&body, &limits), Err(WireError::TooMany { what: "cluster", n: 300, max: 255 }));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_and_never_buffer_past_one_frame(
            bytes in proptest::collection::vec(any::<u8>(), 0..4096),
            cut in 1usize..64,
        ) {
            let limits = WireLimits { max_frame: 2048, max_hashes: 32 };
            let mut d = FrameDecoder::new(limits);
            for piece in bytes.chunks(cut) {
                d.feed(piece);
                while let Ok(Some(_)) = d.next_frame() {}
                prop_assert!(d.buffered() <= FRAME_HEADER_LEN + 2048 + cut);
            }
        }

        #[test]
        fn holds_and_fetches_round_trip(
            hashes in proptest::collection::vec(any::<u128>(), 0..64),
            ttl_ms in any::<u32>(),
            hold_id in any::<u64>(),
            req_id in any::<u64>(),
        ) {
            let hashes: Vec<BlockHash> = hashes.into_iter().map(BlockHash).collect();
            for message in [
                Message::Hold { hashes: hashes.clone(), ttl_ms },
                Message::Fetch { hold_id, hashes: hashes.clone() },
            ] {
                let frame = Frame { req_id, message };
                let mut d = FrameDecoder::new(WireLimits::default());
                d.feed(&frame.to_bytes());
                prop_assert_eq!(d.next_frame().unwrap(), Some(frame));
            }
        }
    }
}
