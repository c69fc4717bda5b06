//! The TCP transport of the block-serving protocol: one authenticated connection, its server side
//! (answering holds and fetches from a [`BlockSource`]) and its client side.
//!
//! Every connection opens with the handshake of [`super::auth`]; after it each frame is followed
//! by its 32-byte MAC under the session key and the frame's sequence number in its direction, so
//! a forged, replayed, reordered or reflected frame ends the connection. Frames are read into a
//! buffer that grows only to the length a checked header announced (reads are cancel-safe, so a
//! server can wait for a frame and for its holds' expiry at once). The reader verifies every image
//! against the hash it asked for and the image's checksums; an image that fails is dropped and
//! reported, never returned as data.
//!
//! Sockets get `TCP_NODELAY`, keepalive and `TCP_USER_TIMEOUT`, so a silent partition ends a
//! connection in seconds rather than the kernel's default quarter of an hour.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::auth::{
    AuthError, ClientHandshake, ClusterSecret, Direction, FrameHasher, PeerIdentity, ServerHandshake, Session,
};
use super::feed::{Feed, FeedChange, Subscription};
use super::holds::{HoldError, HoldLimits, HoldTable};
use super::tls::Tls;
use super::transport::RemoteAccess;
use super::wire::{
    FRAME_HEADER_LEN, Frame, FrameHeader, HeldBlock, HeldPlace, Integrity, Message, RdmaEndpoint, RefusalCode,
    WireError, WireLimits, image_frame_prefix,
};
use crate::block::{BlockHash, HEADER_LEN, ImageError, PayloadChecksum, verify_image_digested};
use crate::g2::SlotMut;

const MAC_LEN: usize = 32;

/// An image moves through the socket this many bytes at a time, and each piece is digested
/// (checksum, MAC) just after it is written or read, while it is in cache:
/// digesting a 2 MiB image read back from memory costs more than the copy itself.
const IMAGE_PIECE: usize = 256 << 10;

/// The digests of an image frame's image, taken as its bytes land: the payload's checksum (the
/// xxh3-64 of every byte after the image header) and, when image frames carry one, the frame's MAC.
struct ImageDigest {
    payload: PayloadChecksum,
    mac: Option<FrameHasher>,
    /// Bytes of the image digested so far.
    done: usize,
}

impl ImageDigest {
    /// Digests what landed since the last call: `image` is every byte of the image read so far.
    fn advance(&mut self, image: &[u8]) {
        if let Some(mac) = &mut self.mac {
            mac.update(&image[self.done..]);
        }
        let payload_from = self.done.max(HEADER_LEN);
        if image.len() > payload_from {
            self.payload.update(&image[payload_from..]);
        }
        self.done = image.len();
    }
}

/// Where a server finds the sealed images of its resident blocks.
pub trait BlockSource {
    /// A handle that keeps one image in place while held (a G2 slot reference on a node).
    type Handle: AsRef<[u8]> + Clone;

    /// The sealed image of `hash` if the block is resident; `None` otherwise.
    fn resolve(&self, hash: BlockHash) -> Option<Self::Handle>;

    /// `bytes` of an image were sent to a peer (for metrics that count as bytes go).
    fn sent(&self, _bytes: usize) {}

    /// Makes resident, before a hold resolves them, those of `hashes` that are not but can be
    /// (on a node: blocks in G3, read into G2 slots). By default there is nothing to bring in.
    fn stage<'a>(&'a self, _hashes: &'a [BlockHash]) -> futures::future::BoxFuture<'a, ()> {
        Box::pin(std::future::ready(()))
    }

    /// The feed of what it can serve, for peers that subscribe; `None` refuses subscriptions.
    fn feed(&self) -> Option<&Feed> {
        None
    }
}

/// Why a connection ended other than by a clean goodbye.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// The socket failed.
    #[error("peer i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The peer closed the connection.
    #[error("the peer closed the connection")]
    Closed,
    /// A frame broke the protocol or a limit.
    #[error("peer sent a bad frame: {0}")]
    Wire(#[from] WireError),
    /// The handshake failed.
    #[error("peer authentication failed: {0}")]
    Auth(#[from] AuthError),
    /// A frame's MAC did not verify.
    #[error("a frame failed its MAC")]
    BadMac,
    /// The peer refused, and why.
    #[error("peer refused ({code:?}): {text}")]
    Refused {
        /// Its code.
        code: RefusalCode,
        /// Its reason.
        text: String,
    },
    /// A message that has no place at this point of the exchange.
    #[error("unexpected {0} from the peer")]
    Unexpected(&'static str),
    /// A per-peer limit.
    #[error("peer over its limit: {0}")]
    Limit(#[from] HoldError),
    /// Nothing came within the deadline.
    #[error("peer timed out ({0})")]
    Timeout(&'static str),
    /// A feed subscriber fell further behind than the feed buffers; it must subscribe again.
    #[error("the feed subscriber fell behind")]
    Lagged,
    /// An RDMA read or its setup failed.
    #[error("RDMA: {0}")]
    Rdma(String),
    /// The TLS handshake failed (no certificate, one the cluster CA did not sign, one for
    /// another name, or no TLS at all on the other side).
    #[error("TLS: {0}")]
    Tls(String),
}

impl PeerError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            PeerError::Io(_) => "io",
            PeerError::Closed => "closed",
            PeerError::Wire(e) => e.kind(),
            PeerError::Auth(e) => e.kind(),
            PeerError::BadMac => "bad_mac",
            PeerError::Refused { .. } => "refused",
            PeerError::Unexpected(_) => "unexpected",
            PeerError::Limit(_) => "limit",
            PeerError::Timeout(_) => "timeout",
            PeerError::Lagged => "lagged",
            PeerError::Rdma(_) => "rdma",
            PeerError::Tls(_) => "tls",
        }
    }

    fn refusal(&self) -> Option<(RefusalCode, String)> {
        let code = match self {
            PeerError::Wire(_) | PeerError::BadMac | PeerError::Unexpected(_) => RefusalCode::Protocol,
            PeerError::Auth(AuthError::Version(_)) => RefusalCode::Version,
            PeerError::Auth(AuthError::Cluster(_)) => RefusalCode::Cluster,
            PeerError::Auth(_) => RefusalCode::Auth,
            PeerError::Limit(_) => RefusalCode::Limit,
            _ => return None,
        };
        Some((code, self.to_string()))
    }
}

/// Sets the options every peer socket gets: no Nagle delay, keepalive probes, and a user timeout
/// after which unacknowledged data ends the connection.
pub fn tune_socket(stream: &TcpStream, user_timeout: Duration) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let fd = stream.as_raw_fd();
    let idle = (user_timeout.as_secs() / 3).max(1) as libc::c_int;
    let set = |level: libc::c_int, name: libc::c_int, value: libc::c_int| -> std::io::Result<()> {
        // SAFETY: `fd` is the open socket `stream` owns for the whole call, and the option value
        // is a c_int on the stack whose size is the length passed.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, idle)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, idle)?;
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3)?;
    set(libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, user_timeout.as_millis().min(i32::MAX as u128) as libc::c_int)
}

/// What [`Conn::recv`] does next.
enum Step {
    /// A frame is complete.
    Frame(Frame),
    /// Read until the frame buffer holds this many bytes.
    Buf(usize),
    /// Read until the image buffer holds this many bytes.
    Image(usize),
    /// Read until the caller's slot holds this many bytes.
    Slot(usize),
}

/// Where a reader puts an image frame's image: a slot of the caller's (a G2 slot), or `None` to
/// read it into the connection's own buffer.
type SlotAlloc<'a> = &'a mut (dyn FnMut() -> Option<SlotMut> + Send);

/// What a connection runs on: a TCP stream, or TLS over one.
trait PeerStream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> PeerStream for T {}

/// One side of a connection: framing, and the MACs once the handshake is done.
struct Conn {
    stream: Box<dyn PeerStream>,
    limits: WireLimits,
    buf: Vec<u8>,
    /// The image of an image frame being read.
    image: Vec<u8>,
    /// The image of an image frame being read into a caller's slot, and the bytes in it so far.
    slot_image: Option<(SlotMut, usize)>,
    /// The digests of the image frame being read, once its destination is chosen.
    digest: Option<ImageDigest>,
    /// The payload checksum of the last image frame's image, taken as it was read.
    image_checksum: u64,
    /// The last image frame's image, when it went into a caller's slot (its frame then carries
    /// an empty image): the slot and the image's length.
    landed: Option<(SlotMut, usize)>,
    session: Option<Session>,
    /// Whether image frames carry a MAC ([`Integrity::Mac`]).
    mac_images: bool,
    sending: Direction,
    seq_out: u64,
    seq_in: u64,
}

impl Conn {
    fn new(stream: Box<dyn PeerStream>, limits: WireLimits, integrity: Integrity, sending: Direction) -> Self {
        Self {
            stream,
            limits,
            buf: Vec::new(),
            image: Vec::new(),
            slot_image: None,
            digest: None,
            image_checksum: 0,
            landed: None,
            session: None,
            mac_images: integrity == Integrity::Mac,
            sending,
            seq_out: 0,
            seq_in: 0,
        }
    }

    /// The session, if image frames carry a MAC under it.
    fn image_session(&self) -> Option<&Session> {
        self.session.as_ref().filter(|_| self.mac_images)
    }

    fn receiving(&self) -> Direction {
        match self.sending {
            Direction::ToServer => Direction::ToClient,
            Direction::ToClient => Direction::ToServer,
        }
    }

    fn trailer(&self) -> usize {
        if self.session.is_some() { MAC_LEN } else { 0 }
    }

    /// What the next frame needs read, or the frame. An image goes into a slot from `alloc` when
    /// it gives one large enough.
    fn step(&mut self, alloc: SlotAlloc<'_>) -> Result<Step, PeerError> {
        let Some(h) = self.buf.get(..FRAME_HEADER_LEN) else { return Ok(Step::Buf(FRAME_HEADER_LEN)) };
        let header = FrameHeader::parse(h.try_into().expect("header bytes"), &self.limits)?;
        if header.is_image() && header.len >= 16 {
            let trailer = if self.image_session().is_some() { MAC_LEN } else { 0 };
            // The image goes straight into a buffer of its own: no copy out of the frame buffer.
            let prefix = FRAME_HEADER_LEN + 16;
            let image_len = header.len as usize - 16;
            if self.buf.len() < prefix {
                return Ok(Step::Buf(prefix));
            }
            if self.digest.is_none() {
                // Once per frame: a slot of the caller's if it has one that fits, else our buffer.
                if image_len > 0
                    && let Some(slot) = alloc()
                    && slot.as_slice().len() >= image_len
                {
                    self.slot_image = Some((slot, 0));
                }
                let mac = self.image_session().map(|session| {
                    let mut mac = session.frame_hasher(self.receiving(), self.seq_in);
                    mac.update(&self.buf[..prefix]);
                    mac
                });
                self.digest = Some(ImageDigest { payload: PayloadChecksum::default(), mac, done: 0 });
            }
            match &self.slot_image {
                Some((_, filled)) if *filled < image_len => return Ok(Step::Slot(image_len)),
                Some(_) => {}
                None if self.image.len() < image_len => {
                    self.image.reserve_exact(image_len - self.image.len());
                    return Ok(Step::Image(image_len));
                }
                None => {}
            }
            if self.buf.len() < prefix + trailer {
                return Ok(Step::Buf(prefix + trailer));
            }
            let mut digest = self.digest.take().expect("an image frame's digests");
            // Whatever the reads left undigested (nothing, unless one was cancelled mid-way).
            digest.advance(match &self.slot_image {
                Some((slot, _)) => &slot.as_slice()[..image_len],
                None => &self.image[..],
            });
            if let Some(mac) = digest.mac.take() {
                let sent: [u8; MAC_LEN] = self.buf[prefix..prefix + MAC_LEN].try_into().expect("MAC bytes");
                if !mac.verify(&sent) {
                    return Err(PeerError::BadMac);
                }
            }
            self.image_checksum = digest.payload.digest();
            let hash = BlockHash::from_le_bytes(self.buf[FRAME_HEADER_LEN..prefix].try_into().expect("hash bytes"));
            self.buf.clear();
            self.seq_in += 1;
            let image = match self.slot_image.take() {
                Some((slot, _)) => {
                    self.landed = Some((slot, image_len));
                    Vec::new()
                }
                None => std::mem::take(&mut self.image),
            };
            return Ok(Step::Frame(Frame { req_id: header.req_id, message: Message::Image { hash, image } }));
        }
        let trailer = self.trailer();
        let end = FRAME_HEADER_LEN + header.len as usize + trailer;
        if self.buf.len() < end {
            return Ok(Step::Buf(end));
        }
        let frame_end = end - trailer;
        if let Some(session) = &self.session {
            let mac: [u8; MAC_LEN] = self.buf[frame_end..end].try_into().expect("MAC bytes");
            if !session.verify_frame(self.receiving(), self.seq_in, &[&self.buf[..frame_end]], &mac) {
                return Err(PeerError::BadMac);
            }
        }
        let frame = header.decode_body(&self.buf[FRAME_HEADER_LEN..frame_end], &self.limits)?;
        self.buf.drain(..end);
        self.seq_in += 1;
        if let Message::Refused { code, text } = frame.message {
            return Err(PeerError::Refused { code, text });
        }
        Ok(Step::Frame(frame))
    }

    /// The next frame. Cancel-safe: bytes read stay in the buffers for the next call, and no read
    /// goes past the frame a checked header announced.
    async fn recv(&mut self) -> Result<Frame, PeerError> {
        self.recv_with(&mut || None).await
    }

    /// [`Conn::recv`], reading an image frame's image into a slot from `alloc` when it gives one
    /// (then [`Conn::landed`] holds it and the frame's image is empty).
    async fn recv_with(&mut self, alloc: SlotAlloc<'_>) -> Result<Frame, PeerError> {
        loop {
            match self.step(alloc)? {
                Step::Frame(frame) => return Ok(frame),
                Step::Buf(want) => {
                    let target = &mut self.buf;
                    if target.len() < want {
                        target.reserve_exact(want - target.len());
                    }
                    let n = (&mut self.stream)
                        .take((want - target.len()) as u64)
                        .read_buf(target)
                        .await
                        .map_err(read_error)?;
                    if n == 0 {
                        return Err(PeerError::Closed);
                    }
                }
                Step::Image(want) => {
                    let piece = (want - self.image.len()).min(IMAGE_PIECE);
                    let n =
                        (&mut self.stream).take(piece as u64).read_buf(&mut self.image).await.map_err(read_error)?;
                    if n == 0 {
                        return Err(PeerError::Closed);
                    }
                    self.digest.as_mut().expect("an image frame's digests").advance(&self.image);
                }
                Step::Slot(want) => {
                    let (slot, filled) = self.slot_image.as_mut().expect("an image in a slot");
                    let end = want.min(*filled + IMAGE_PIECE);
                    let n = self.stream.read(&mut slot.as_mut_slice()[*filled..end]).await.map_err(read_error)?;
                    if n == 0 {
                        return Err(PeerError::Closed);
                    }
                    *filled += n;
                    self.digest.as_mut().expect("an image frame's digests").advance(&slot.as_slice()[..*filled]);
                }
            }
        }
    }

    async fn send(&mut self, req_id: u64, message: Message) -> Result<(), PeerError> {
        let mut bytes = Frame { req_id, message }.to_bytes();
        if let Some(session) = &self.session {
            let mac = session.frame_mac(self.sending, self.seq_out, &[&bytes]);
            bytes.extend_from_slice(&mac);
        }
        self.seq_out += 1;
        self.stream.write_all(&bytes).await?;
        // TLS holds records that did not fit the socket until a flush (plain TCP holds nothing).
        self.stream.flush().await?;
        Ok(())
    }

    /// An image frame written from the caller's slot, not copied into a frame first.
    async fn send_image(&mut self, req_id: u64, hash: BlockHash, image: &[u8]) -> Result<(), PeerError> {
        let prefix = image_frame_prefix(req_id, hash, image.len());
        let mut mac = self.image_session().map(|session| {
            let mut mac = session.frame_hasher(self.sending, self.seq_out);
            mac.update(&prefix);
            mac
        });
        self.seq_out += 1;
        self.stream.write_all(&prefix).await?;
        match &mut mac {
            // Each piece is MACed just after the socket copied it, while it is in cache: it is read
            // from memory once, by the copy (which reads cold memory faster than the MAC does).
            Some(mac) => {
                for piece in image.chunks(IMAGE_PIECE) {
                    self.stream.write_all(piece).await?;
                    mac.update(piece);
                }
            }
            None => self.stream.write_all(image).await?,
        }
        if let Some(mac) = mac {
            self.stream.write_all(&mac.finish()).await?;
        }
        self.stream.flush().await?;
        Ok(())
    }

    /// Gives an image frame's buffer back for the next image (its pages are already faulted in).
    fn reuse_image_buffer(&mut self, mut image: Vec<u8>) {
        if self.image.is_empty() && image.capacity() > self.image.capacity() {
            image.clear();
            self.image = image;
        }
    }

    /// Tells the peer why the connection ends, if it is worth telling; errors are moot by then.
    async fn refuse(&mut self, error: &PeerError) {
        if let Some((code, text)) = error.refusal() {
            let _ = self.send(0, Message::Refused { code, text }).await;
        }
    }
}

/// What a server allows its peers.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The cluster secret.
    pub secret: ClusterSecret,
    /// This node.
    pub me: PeerIdentity,
    /// Frame limits.
    pub wire: WireLimits,
    /// How image frames are protected; a client of another mode is refused.
    pub integrity: Integrity,
    /// Hold limits per peer.
    pub holds: HoldLimits,
    /// The handshake must finish within this.
    pub handshake_timeout: Duration,
    /// A connection silent for this long is closed (its holds with it).
    pub idle_timeout: Duration,
    /// Lets peers read held images with RDMA; `None` declines RDMA (lanes carry frames).
    pub rdma: Option<Arc<dyn RemoteAccess>>,
    /// Mutual TLS under the protocol; `None` serves plain TCP.
    pub tls: Option<Arc<Tls>>,
}

/// What a connection did, when it ended cleanly.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServedPeer {
    /// The peer, as authenticated.
    pub peer: Option<PeerIdentity>,
    /// Holds opened.
    pub holds: u64,
    /// Holds that ran out before their release.
    pub expired_holds: u64,
    /// Images sent.
    pub images: u64,
    /// Image bytes sent.
    pub image_bytes: u64,
}

/// Serves one peer's connection until it says goodbye, breaks the protocol or goes silent. The
/// holds it opened end with it.
pub async fn serve_peer<S: BlockSource>(
    stream: TcpStream,
    config: &ServerConfig,
    source: &S,
) -> Result<ServedPeer, PeerError> {
    let mut served = ServedPeer::default();
    serve_peer_into(stream, config, source, &mut served).await.map(|()| served)
}

/// [`serve_peer`], with what the connection did left in `served` however it ended.
pub async fn serve_peer_into<S: BlockSource>(
    stream: TcpStream,
    config: &ServerConfig,
    source: &S,
    served: &mut ServedPeer,
) -> Result<(), PeerError> {
    tune_socket(&stream, config.idle_timeout)?;
    // One deadline for TLS and the protocol's handshake together: a peer that has proved nothing
    // holds a connection for `handshake_timeout` at most.
    let deadline = tokio::time::Instant::now() + config.handshake_timeout;
    let (stream, certificate): (Box<dyn PeerStream>, _) = match &config.tls {
        Some(tls) => {
            let stream = tokio::time::timeout_at(deadline, tls.accept(stream))
                .await
                .map_err(|_| PeerError::Timeout("TLS handshake"))?
                .map_err(tls_error)?;
            let certificate = super::tls::peer_certificate(stream.get_ref().1);
            (Box::new(stream), certificate)
        }
        None => (Box::new(stream), None),
    };
    let mut conn = Conn::new(stream, config.wire, config.integrity, Direction::ToClient);
    let result = async {
        let session = tokio::time::timeout_at(deadline, server_handshake(&mut conn, config))
            .await
            .map_err(|_| PeerError::Timeout("handshake"))??;
        bind_certificate(config.tls.is_some(), certificate.as_ref(), &session.peer)?;
        served.peer = Some(session.peer.clone());
        conn.session = Some(session);
        serve_frames(&mut conn, config, source, served).await
    }
    .await;
    match result {
        Ok(()) => {
            // A clean end says so (TLS sends its close_notify); the peer may be gone already.
            let _ = conn.stream.shutdown().await;
            Ok(())
        }
        Err(e) => {
            conn.refuse(&e).await;
            Err(e)
        }
    }
}

/// Under TLS, the peer's certificate must name the node the peer proved the secret as.
fn bind_certificate(
    tls: bool,
    certificate: Option<&rustls::pki_types::CertificateDer<'static>>,
    peer: &PeerIdentity,
) -> Result<(), PeerError> {
    if !tls {
        return Ok(());
    }
    let certificate = certificate.ok_or_else(|| PeerError::Tls("the peer showed no certificate".into()))?;
    super::tls::certificate_names_node(certificate, &peer.node).map_err(PeerError::Tls)
}

/// A failed TLS handshake: the TLS layer's own refusals (certificates, protocol) are `Tls`; a
/// socket that failed under it is plain I/O.
fn tls_error(e: std::io::Error) -> PeerError {
    match e.kind() {
        std::io::ErrorKind::InvalidData | std::io::ErrorKind::InvalidInput => PeerError::Tls(e.to_string()),
        std::io::ErrorKind::UnexpectedEof => PeerError::Closed,
        _ => PeerError::Io(e),
    }
}

/// A read that failed: a stream that ended mid-way (as TLS reports a peer gone without its
/// close_notify) is a closed connection, like a plain socket's end.
fn read_error(e: std::io::Error) -> PeerError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof { PeerError::Closed } else { PeerError::Io(e) }
}

async fn server_handshake(conn: &mut Conn, config: &ServerConfig) -> Result<Session, PeerError> {
    let hello = conn.recv().await?;
    let nonce = super::auth::fresh_nonce();
    let (pending, challenge) =
        ServerHandshake::respond(config.secret.clone(), &config.me, &hello.message, nonce, config.integrity)?;
    conn.send(hello.req_id, challenge).await?;
    let proof = conn.recv().await?;
    Ok(pending.on_proof(&proof.message)?)
}

async fn serve_frames<S: BlockSource>(
    conn: &mut Conn,
    config: &ServerConfig,
    source: &S,
    served: &mut ServedPeer,
) -> Result<(), PeerError> {
    let mut holds: HoldTable<S::Handle> = HoldTable::new(config.holds);
    // The queue pair a peer's RDMA reads come through, while the connection lasts.
    let mut rdma: Option<(Arc<dyn RemoteAccess>, Box<dyn Send + Sync>)> = None;
    let result = async {
        loop {
            let idle = tokio::time::Instant::now() + config.idle_timeout;
            let expiry = holds.next_expiry().map(tokio::time::Instant::from_std);
            let frame = tokio::select! {
                frame = conn.recv() => frame?,
                _ = tokio::time::sleep_until(expiry.unwrap_or(idle)), if expiry.is_some_and(|e| e < idle) => {
                    holds.expire(Instant::now());
                    continue;
                }
                _ = tokio::time::sleep_until(idle) => return Err(PeerError::Timeout("idle")),
            };
            let now = Instant::now();
            holds.expire(now);
            match frame.message {
                Message::Hold { hashes, ttl_ms } => {
                    let found = resolve_for_hold(source, &hashes).await;
                    let blocks = hashes
                        .iter()
                        .zip(&found)
                        .map(|(&hash, f)| HeldBlock { hash, image_len: f.as_ref().map(|s| s.as_ref().len() as u32) })
                        .collect();
                    let found = hashes.iter().zip(found).filter_map(|(&h, f)| f.map(|f| (h, f))).collect();
                    let (hold_id, ttl) = holds.open(found, Duration::from_millis(ttl_ms.into()), now)?;
                    served.holds += 1;
                    let ttl_ms = ttl.as_millis() as u32;
                    conn.send(frame.req_id, Message::Held { hold_id, ttl_ms, blocks }).await?;
                }
                Message::RdmaConnect { endpoint } => {
                    let answer = match &config.rdma {
                        None => Err("this node serves no RDMA".to_string()),
                        Some(access) => access.accept(&endpoint).map(|accepted| {
                            rdma = Some((access.clone(), accepted.keep));
                            (accepted.endpoint, accepted.rkey)
                        }),
                    };
                    let message = match answer {
                        Ok((endpoint, rkey)) => Message::RdmaAccept { endpoint, rkey },
                        Err(text) => Message::RdmaDecline { text },
                    };
                    conn.send(frame.req_id, message).await?;
                }
                Message::HoldAt { hashes, ttl_ms } => {
                    // Places only for a peer whose queue pair this connection accepted.
                    let Some((access, _)) = &rdma else { return Err(PeerError::Unexpected("hold_at")) };
                    let found = resolve_for_hold(source, &hashes).await;
                    // An image outside the registered region cannot be read remotely: not held.
                    let placed: Vec<Option<(S::Handle, u64)>> = found
                        .into_iter()
                        .map(|f| f.and_then(|f| access.place(f.as_ref()).map(|addr| (f, addr))))
                        .collect();
                    let blocks = hashes
                        .iter()
                        .zip(&placed)
                        .map(|(&hash, p)| HeldPlace {
                            hash,
                            place: p.as_ref().map(|(f, addr)| (*addr, f.as_ref().len() as u32)),
                        })
                        .collect();
                    let found = hashes.iter().zip(placed).filter_map(|(&h, p)| p.map(|(f, _)| (h, f))).collect();
                    let (hold_id, ttl) = holds.open(found, Duration::from_millis(ttl_ms.into()), now)?;
                    served.holds += 1;
                    let ttl_ms = ttl.as_millis() as u32;
                    conn.send(frame.req_id, Message::HeldAt { hold_id, ttl_ms, blocks }).await?;
                }
                Message::Fetch { hold_id, hashes } => {
                    // One image frame per hash asked, in order; an empty one for a block not (or no
                    // longer) held.
                    for hash in hashes {
                        match holds.get(hold_id, hash, now) {
                            Some(slot) => {
                                conn.send_image(frame.req_id, hash, slot.as_ref()).await?;
                                served.images += 1;
                                served.image_bytes += slot.as_ref().len() as u64;
                                source.sent(slot.as_ref().len());
                            }
                            None => conn.send_image(frame.req_id, hash, &[]).await?,
                        }
                    }
                }
                Message::Release { hold_id } => {
                    holds.release(hold_id);
                }
                Message::Ping { nonce } => conn.send(frame.req_id, Message::Pong { nonce }).await?,
                Message::Goodbye => return Ok(()),
                Message::Subscribe => {
                    let feed = source.feed().ok_or(PeerError::Unexpected("subscribe"))?;
                    // The connection is a feed from now on: its holds go.
                    holds.clear();
                    return serve_feed(conn, config, feed).await;
                }
                other => return Err(PeerError::Unexpected(other.name())),
            }
        }
    }
    .await;
    served.expired_holds = holds.expired_total();
    // The queue pair closes before the holds' slots go back to the pool.
    drop(rdma);
    drop(holds);
    result
}

/// The handles of `hashes` for a hold, `None` for blocks that are not resident. What is resident
/// is taken first, so bringing the rest in cannot push it out.
async fn resolve_for_hold<S: BlockSource>(source: &S, hashes: &[BlockHash]) -> Vec<Option<S::Handle>> {
    let mut found: Vec<Option<S::Handle>> = hashes.iter().map(|&h| source.resolve(h)).collect();
    let missing: Vec<BlockHash> = hashes.iter().zip(&found).filter(|(_, f)| f.is_none()).map(|(&h, _)| h).collect();
    if !missing.is_empty() {
        source.stage(&missing).await;
        for (&h, f) in hashes.iter().zip(found.iter_mut()) {
            if f.is_none() {
                *f = source.resolve(h);
            }
        }
    }
    found
}

/// Sends a subscriber the snapshot, then every change, while answering its pings.
async fn serve_feed(conn: &mut Conn, config: &ServerConfig, feed: &Feed) -> Result<(), PeerError> {
    use tokio::sync::broadcast::error::RecvError;
    let Subscription { snapshot, seq, mut changes } = feed.subscribe();
    for chunk in snapshot.chunks(config.wire.max_hashes.max(1) as usize) {
        conn.send(0, Message::Snapshot { blocks: chunk.to_vec() }).await?;
    }
    conn.send(0, Message::Synced { seq }).await?;
    let mut idle = tokio::time::Instant::now() + config.idle_timeout;
    loop {
        tokio::select! {
            change = changes.recv() => {
                let event = match change {
                    Ok(event) => event,
                    Err(RecvError::Lagged(_)) => return Err(PeerError::Lagged),
                    Err(RecvError::Closed) => return Ok(()),
                };
                let message = match event.change {
                    FeedChange::Stored { parent, hashes } => {
                        Message::Stored { seq: event.seq, parent, hashes: hashes.to_vec() }
                    }
                    FeedChange::Removed { hashes } => Message::Removed { seq: event.seq, hashes: hashes.to_vec() },
                };
                conn.send(0, message).await?;
            }
            frame = conn.recv() => {
                let frame = frame?;
                idle = tokio::time::Instant::now() + config.idle_timeout;
                match frame.message {
                    Message::Ping { nonce } => conn.send(frame.req_id, Message::Pong { nonce }).await?,
                    Message::Goodbye => return Ok(()),
                    other => return Err(PeerError::Unexpected(other.name())),
                }
            }
            _ = tokio::time::sleep_until(idle) => return Err(PeerError::Timeout("idle")),
        }
    }
}

/// How a client connects.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// The cluster secret.
    pub secret: ClusterSecret,
    /// This node.
    pub me: PeerIdentity,
    /// Frame limits for what the server sends.
    pub wire: WireLimits,
    /// How image frames are protected (the server must use the same mode).
    pub integrity: Integrity,
    /// Connecting and the handshake must finish within this.
    pub connect_timeout: Duration,
    /// Each request's answer must come within this.
    pub request_timeout: Duration,
    /// Mutual TLS under the protocol (the server must use it too); `None` connects plain TCP.
    pub tls: Option<Arc<Tls>>,
}

/// A hold granted by a server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    /// Names it in fetches and the release.
    pub hold_id: u64,
    /// How long the server keeps it.
    pub ttl: Duration,
    /// Per hash asked, whether the server holds it and its image's length.
    pub blocks: Vec<HeldBlock>,
}

/// One block of a fetch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fetched {
    /// The image, verified against the hash asked for and its checksums.
    Verified(Vec<u8>),
    /// The server no longer held it (the hold ran out).
    Missing,
    /// The image failed verification and was dropped.
    Rejected(ImageError),
}

/// One block of [`PeerClient::fetch_each`]: like [`Fetched`], with the image borrowed.
#[derive(Debug, PartialEq, Eq)]
pub enum FetchedRef<'a> {
    /// The image, verified against the hash asked for and its checksums.
    Verified(&'a [u8]),
    /// The server no longer held it (the hold ran out).
    Missing,
    /// The image failed verification and was dropped.
    Rejected(ImageError),
}

/// One block of [`PeerClient::fetch_into`].
#[derive(Debug)]
pub enum FetchedSlot {
    /// The image, verified, in the caller's slot: its first `len` bytes.
    Verified {
        /// The slot.
        slot: SlotMut,
        /// Bytes of the image.
        len: usize,
    },
    /// Verified, but the caller had no slot for it.
    NoRoom,
    /// The server no longer held it (the hold ran out).
    Missing,
    /// The image failed verification and was dropped.
    Rejected(ImageError),
}

/// The client side of one authenticated connection.
pub struct PeerClient {
    conn: Conn,
    peer: PeerIdentity,
    next_req: u64,
    request_timeout: Duration,
}

impl std::fmt::Debug for PeerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerClient").field("peer", &self.peer).finish_non_exhaustive()
    }
}

impl PeerClient {
    /// Connects and authenticates; with TLS, the server's certificate must name `addr`'s IP.
    pub async fn connect(addr: std::net::SocketAddr, config: &ClientConfig) -> Result<Self, PeerError> {
        Self::connect_to(addr, &addr.ip().to_string(), config).await
    }

    /// Connects to `addr`, which `host` (a DNS name or an IP address) resolved to, and
    /// authenticates; with TLS, the server's certificate must name `host`.
    pub async fn connect_to(addr: std::net::SocketAddr, host: &str, config: &ClientConfig) -> Result<Self, PeerError> {
        tokio::time::timeout(config.connect_timeout, async {
            let stream = TcpStream::connect(addr).await?;
            tune_socket(&stream, config.request_timeout.max(Duration::from_secs(1)))?;
            let (stream, certificate): (Box<dyn PeerStream>, _) = match &config.tls {
                Some(tls) => {
                    let stream = tls.connect(host, stream).await.map_err(tls_error)?;
                    let certificate = super::tls::peer_certificate(stream.get_ref().1);
                    (Box::new(stream), certificate)
                }
                None => (Box::new(stream), None),
            };
            let mut conn = Conn::new(stream, config.wire, config.integrity, Direction::ToServer);
            let (pending, hello) =
                ClientHandshake::start(config.secret.clone(), &config.me, super::auth::fresh_nonce(), config.integrity);
            conn.send(1, hello).await?;
            let challenge = conn.recv().await?;
            let (session, proof) = match pending.on_challenge(&challenge.message) {
                Ok(done) => done,
                Err(e) => {
                    let e = PeerError::Auth(e);
                    conn.refuse(&e).await;
                    return Err(e);
                }
            };
            conn.send(1, proof).await?;
            bind_certificate(config.tls.is_some(), certificate.as_ref(), &session.peer)?;
            let peer = session.peer.clone();
            conn.session = Some(session);
            Ok(Self { conn, peer, next_req: 2, request_timeout: config.request_timeout })
        })
        .await
        .map_err(|_| PeerError::Timeout("connect"))?
    }

    /// The server, as it proved itself.
    pub fn peer(&self) -> &PeerIdentity {
        &self.peer
    }

    async fn answer(&mut self, req_id: u64) -> Result<Message, PeerError> {
        self.answer_with(req_id, &mut || None).await
    }

    async fn answer_with(&mut self, req_id: u64, alloc: SlotAlloc<'_>) -> Result<Message, PeerError> {
        let frame = tokio::time::timeout(self.request_timeout, self.conn.recv_with(alloc))
            .await
            .map_err(|_| PeerError::Timeout("request"))??;
        if frame.req_id != req_id {
            return Err(PeerError::Unexpected("answer to another request"));
        }
        Ok(frame.message)
    }

    fn request_id(&mut self) -> u64 {
        self.next_req += 1;
        self.next_req
    }

    /// Asks the server to pin `hashes` for `ttl`.
    pub async fn hold(&mut self, hashes: &[BlockHash], ttl: Duration) -> Result<Held, PeerError> {
        let req = self.request_id();
        let ttl_ms = ttl.as_millis().min(u32::MAX as u128) as u32;
        self.conn.send(req, Message::Hold { hashes: hashes.to_vec(), ttl_ms }).await?;
        match self.answer(req).await? {
            // One answer per hash, each naming the hash asked in its place: a server cannot answer
            // for one block with another.
            Message::Held { hold_id, ttl_ms, blocks }
                if blocks.len() == hashes.len() && blocks.iter().zip(hashes).all(|(b, h)| b.hash == *h) =>
            {
                Ok(Held { hold_id, ttl: Duration::from_millis(ttl_ms.into()), blocks })
            }
            other => Err(PeerError::Unexpected(other.name())),
        }
    }

    /// Fetches held blocks; each image is verified against the hash asked for before it is returned.
    pub async fn fetch(&mut self, hold_id: u64, hashes: &[BlockHash]) -> Result<Vec<(BlockHash, Fetched)>, PeerError> {
        let mut out = Vec::with_capacity(hashes.len());
        self.fetch_each(hold_id, hashes, |hash, fetched| {
            out.push((
                hash,
                match fetched {
                    FetchedRef::Verified(image) => Fetched::Verified(image.to_vec()),
                    FetchedRef::Missing => Fetched::Missing,
                    FetchedRef::Rejected(e) => Fetched::Rejected(e),
                },
            ))
        })
        .await?;
        Ok(out)
    }

    /// Fetches held blocks and hands each to `each`, in the order asked, once verified against the
    /// hash asked for: the image is borrowed from the connection's buffer, which the next image
    /// reuses, so a caller that copies it where it belongs (a G2 slot) allocates nothing per image.
    pub async fn fetch_each(
        &mut self,
        hold_id: u64,
        hashes: &[BlockHash],
        mut each: impl FnMut(BlockHash, FetchedRef<'_>),
    ) -> Result<(), PeerError> {
        let req = self.request_id();
        self.conn.send(req, Message::Fetch { hold_id, hashes: hashes.to_vec() }).await?;
        for &asked in hashes {
            let Message::Image { hash, image } = self.answer(req).await? else {
                return Err(PeerError::Unexpected("a frame other than an image"));
            };
            if hash != asked {
                each(asked, FetchedRef::Rejected(ImageError::HashMismatch { expected: asked, found: hash }));
            } else if image.is_empty() {
                each(asked, FetchedRef::Missing);
            } else {
                match verify_image_digested(&image, asked, self.conn.image_checksum) {
                    Ok(_) => each(asked, FetchedRef::Verified(&image)),
                    Err(e) => each(asked, FetchedRef::Rejected(e)),
                }
            }
            self.conn.reuse_image_buffer(image);
        }
        Ok(())
    }

    /// Fetches held blocks straight into slots from `alloc` (G2 slots on a node: the bytes are
    /// read from the socket into the slot, not copied after), and hands each to `each`, in the
    /// order asked, once verified against the hash asked for. An image `alloc` had no slot for is
    /// read and verified all the same, and reported [`FetchedSlot::NoRoom`].
    pub async fn fetch_into(
        &mut self,
        hold_id: u64,
        hashes: &[BlockHash],
        mut alloc: impl FnMut() -> Option<SlotMut> + Send,
        mut each: impl FnMut(BlockHash, FetchedSlot),
    ) -> Result<(), PeerError> {
        let req = self.request_id();
        self.conn.send(req, Message::Fetch { hold_id, hashes: hashes.to_vec() }).await?;
        for &asked in hashes {
            let Message::Image { hash, image } = self.answer_with(req, &mut alloc).await? else {
                return Err(PeerError::Unexpected("a frame other than an image"));
            };
            let landed = self.conn.landed.take();
            let fetched = if hash != asked {
                FetchedSlot::Rejected(ImageError::HashMismatch { expected: asked, found: hash })
            } else if let Some((slot, len)) = landed {
                match verify_image_digested(&slot.as_slice()[..len], asked, self.conn.image_checksum) {
                    Ok(_) => FetchedSlot::Verified { slot, len },
                    Err(e) => FetchedSlot::Rejected(e),
                }
            } else if image.is_empty() {
                FetchedSlot::Missing
            } else {
                match verify_image_digested(&image, asked, self.conn.image_checksum) {
                    Ok(_) => FetchedSlot::NoRoom,
                    Err(e) => FetchedSlot::Rejected(e),
                }
            };
            self.conn.reuse_image_buffer(image);
            each(asked, fetched);
        }
        Ok(())
    }

    /// Offers the server this connection's RDMA queue pair: the server's queue pair and remote
    /// key if it accepts, its reason if it declines (the connection goes on either way).
    pub async fn rdma_connect(
        &mut self,
        endpoint: RdmaEndpoint,
    ) -> Result<Result<(RdmaEndpoint, u32), String>, PeerError> {
        let req = self.request_id();
        self.conn.send(req, Message::RdmaConnect { endpoint }).await?;
        match self.answer(req).await? {
            Message::RdmaAccept { endpoint, rkey } => Ok(Ok((endpoint, rkey))),
            Message::RdmaDecline { text } => Ok(Err(text)),
            other => Err(PeerError::Unexpected(other.name())),
        }
    }

    /// Like [`PeerClient::hold`], answered with where each held image lies in the server's
    /// registered region (only after [`PeerClient::rdma_connect`] was accepted).
    pub async fn hold_at(
        &mut self,
        hashes: &[BlockHash],
        ttl: Duration,
    ) -> Result<(u64, Duration, Vec<HeldPlace>), PeerError> {
        let req = self.request_id();
        let ttl_ms = ttl.as_millis().min(u32::MAX as u128) as u32;
        self.conn.send(req, Message::HoldAt { hashes: hashes.to_vec(), ttl_ms }).await?;
        match self.answer(req).await? {
            Message::HeldAt { hold_id, ttl_ms, blocks }
                if blocks.len() == hashes.len() && blocks.iter().zip(hashes).all(|(b, h)| b.hash == *h) =>
            {
                Ok((hold_id, Duration::from_millis(ttl_ms.into()), blocks))
            }
            other => Err(PeerError::Unexpected(other.name())),
        }
    }

    /// Unpins a hold.
    pub async fn release(&mut self, hold_id: u64) -> Result<(), PeerError> {
        let req = self.request_id();
        self.conn.send(req, Message::Release { hold_id }).await
    }

    /// A round trip.
    pub async fn ping(&mut self) -> Result<Duration, PeerError> {
        let req = self.request_id();
        let started = Instant::now();
        self.conn.send(req, Message::Ping { nonce: req }).await?;
        match self.answer(req).await? {
            Message::Pong { nonce } if nonce == req => Ok(started.elapsed()),
            other => Err(PeerError::Unexpected(other.name())),
        }
    }

    /// Ends the connection cleanly.
    pub async fn goodbye(mut self) -> Result<(), PeerError> {
        self.conn.send(0, Message::Goodbye).await?;
        self.conn.stream.shutdown().await?;
        Ok(())
    }

    /// Turns the connection into a feed of what the server can serve: a snapshot, then its
    /// changes. The connection is pinged every `keepalive`, and a server silent for three of
    /// them ends it.
    pub async fn subscribe(mut self, keepalive: Duration) -> Result<FeedClient, PeerError> {
        let req = self.request_id();
        self.conn.send(req, Message::Subscribe).await?;
        let next_ping = tokio::time::Instant::now() + keepalive;
        Ok(FeedClient { conn: self.conn, peer: self.peer, keepalive, next_ping, unanswered: None, pings: 0 })
    }
}

/// The subscriber's side of a feed connection ([`PeerClient::subscribe`]).
pub struct FeedClient {
    conn: Conn,
    peer: PeerIdentity,
    keepalive: Duration,
    next_ping: tokio::time::Instant,
    /// When the oldest ping that no frame has followed yet was sent.
    unanswered: Option<tokio::time::Instant>,
    pings: u64,
}

impl std::fmt::Debug for FeedClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FeedClient").field("peer", &self.peer).finish_non_exhaustive()
    }
}

impl FeedClient {
    /// The server, as it proved itself.
    pub fn peer(&self) -> &PeerIdentity {
        &self.peer
    }

    /// The next feed message: [`Message::Snapshot`] parts and [`Message::Synced`] first, then
    /// [`Message::Stored`] and [`Message::Removed`]. Pings are sent while it waits; a ping left
    /// unanswered (no frame at all) for three keepalive periods ends the feed.
    pub async fn next(&mut self) -> Result<Message, PeerError> {
        loop {
            let silent_at = self.unanswered.map(|since| since + self.keepalive * 3);
            let wake = silent_at.map_or(self.next_ping, |s| s.min(self.next_ping));
            tokio::select! {
                // Frames already in first: a caller that was away is not a silent server.
                biased;
                frame = self.conn.recv() => {
                    self.unanswered = None;
                    match frame?.message {
                        Message::Pong { .. } => {}
                        message @ (Message::Snapshot { .. }
                        | Message::Synced { .. }
                        | Message::Stored { .. }
                        | Message::Removed { .. }) => return Ok(message),
                        Message::Goodbye => return Err(PeerError::Closed),
                        other => return Err(PeerError::Unexpected(other.name())),
                    }
                }
                _ = tokio::time::sleep_until(wake) => {
                    let now = tokio::time::Instant::now();
                    if silent_at.is_some_and(|s| now >= s) {
                        return Err(PeerError::Timeout("feed"));
                    }
                    if now >= self.next_ping {
                        self.pings += 1;
                        let nonce = self.pings;
                        self.conn.send(0, Message::Ping { nonce }).await?;
                        self.unanswered.get_or_insert(now);
                        self.next_ping = now + self.keepalive;
                    }
                }
            }
        }
    }
}
