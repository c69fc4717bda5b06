//! Peer authentication, sans I/O: a mutual challenge-response on a shared cluster secret.
//!
//! ```text
//! client                                         server
//!   Hello{version, cluster, node, epoch, n_c}  →
//!                                              ←  Challenge{node, epoch, n_s, MAC(K, "server" ‖ T)}
//!   Proof{MAC(K, "client" ‖ T)}                →
//! ```
//!
//! `T`, the transcript, is the Hello's body followed by the server's node, epoch and nonce, so each
//! MAC covers both nonces and both identities: a recorded exchange replays against no other
//! connection, and the distinct labels keep a server's MAC from passing as a client's proof (no
//! reflection). Each side ends with a [`Session`] whose key is derived from the secret and the
//! transcript; it authenticates the frames that follow ([`Session::frame_mac`]).
//!
//! The handshake's MACs are BLAKE3 in keyed mode and the key derivation BLAKE3's `derive_key`: a
//! PRF and a KDF by design, in a crate the node already carries, where HMAC-SHA256 and HKDF would
//! be three more. Frames are MACed with AEGIS-128X4 used as a MAC (RFC 10032), 256-bit tags,
//! under the session's key and a nonce no other frame of the session uses (its direction and
//! sequence number). Frames carry whole KV blocks, so their MAC is paid per byte on both ends:
//! AEGIS runs on the AES instructions, four AES lanes wide in the X4 variant, and `libaegis` picks
//! its code for the CPU at run time (VAES with AVX-512 where there is one, AES-NI or the ARMv8
//! crypto extensions elsewhere). One core of the dev machine MACs 56 GB/s with it, where
//! AEGIS-128L gives 18 and keyed BLAKE3 6.7. Comparisons are constant-time. Image integrity does not rest on this: a reader verifies every block image
//! against its hash and checksums regardless.

use std::path::Path;

use super::wire::{Integrity, Mac, Message, Nonce, PROTOCOL_VERSION};

const KEY_CONTEXT: &str = "dynamo-node g4 session key v2";

/// The cluster's shared secret: 32 bytes, read from a file.
#[derive(Clone)]
pub struct ClusterSecret([u8; 32]);

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

/// A secret file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The file could not be read.
    #[error("cluster secret {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Neither 32 raw bytes nor 64 hex digits.
    #[error("cluster secret {0}: expected 32 bytes or 64 hex digits")]
    Format(String),
    /// Readable by others than its owner.
    #[error("cluster secret {0}: readable by group or others (chmod 600 it)")]
    Permissions(String),
}

impl ClusterSecret {
    /// A secret from its bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// Reads a secret file: 32 raw bytes or 64 hex digits (surrounding whitespace ignored). A file
    /// that group or others can read is refused.
    pub fn from_file(path: &Path) -> Result<Self, SecretError> {
        use std::os::unix::fs::PermissionsExt;
        let shown = path.display().to_string();
        let io = |source| SecretError::Io { path: shown.clone(), source };
        let meta = std::fs::metadata(path).map_err(io)?;
        if meta.permissions().mode() & 0o077 != 0 {
            return Err(SecretError::Permissions(shown));
        }
        let bytes = std::fs::read(path).map_err(io)?;
        if let Ok(raw) = <[u8; 32]>::try_from(bytes.as_slice()) {
            return Ok(Self(raw));
        }
        let text = std::str::from_utf8(&bytes).map_err(|_| SecretError::Format(shown.clone()))?.trim();
        let digits = text.as_bytes();
        if digits.len() != 64 || !digits.iter().all(u8::is_ascii_hexdigit) {
            return Err(SecretError::Format(shown));
        }
        let mut raw = [0u8; 32];
        for (i, pair) in digits.chunks(2).enumerate() {
            raw[i] = u8::from_str_radix(std::str::from_utf8(pair).expect("hex is ASCII"), 16).expect("hex digits");
        }
        Ok(Self(raw))
    }

    fn mac(&self, label: &[u8], transcript: &[u8]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(label);
        h.update(transcript);
        h.finalize()
    }
}

/// One side of a connection as the handshake names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerIdentity {
    /// The cluster's name; peers of another cluster are refused.
    pub cluster: String,
    /// The node's name.
    pub node: String,
    /// The node's membership epoch.
    pub epoch: u64,
}

/// Why a handshake failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The client speaks another protocol version.
    #[error("protocol version {0} (this node speaks {PROTOCOL_VERSION})")]
    Version(u16),
    /// The peer belongs to another cluster.
    #[error("peer of cluster {0:?}")]
    Cluster(String),
    /// The peer's MAC does not prove the secret.
    #[error("the peer does not know the cluster secret")]
    BadMac,
    /// A message the handshake did not expect at this point.
    #[error("unexpected message during the handshake")]
    Unexpected,
    /// The peer protects image frames otherwise ([`Integrity`]).
    #[error("the peer's integrity mode (byte {0}) is not this node's")]
    Integrity(u8),
}

impl AuthError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            AuthError::Version(_) => "version",
            AuthError::Cluster(_) => "cluster",
            AuthError::BadMac => "bad_mac",
            AuthError::Unexpected => "unexpected",
            AuthError::Integrity(_) => "integrity",
        }
    }
}

/// A fresh nonce from the operating system.
pub fn fresh_nonce() -> Nonce {
    let mut n = [0u8; 32];
    getrandom::fill(&mut n).expect("the OS random source");
    n
}

fn server_part(node: &str, epoch: u64, nonce: &Nonce) -> Vec<u8> {
    let mut out = Vec::with_capacity(node.len() + 42);
    out.extend_from_slice(&(node.len() as u16).to_le_bytes());
    out.extend_from_slice(node.as_bytes());
    out.extend_from_slice(&epoch.to_le_bytes());
    out.extend_from_slice(nonce);
    out
}

/// An authenticated connection: who the peer is, and the key for the frames that follow.
#[derive(Clone)]
pub struct Session {
    /// The peer, as it proved itself.
    pub peer: PeerIdentity,
    /// The frames' AEGIS key.
    key: [u8; 16],
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("peer", &self.peer).finish_non_exhaustive()
    }
}

/// The direction a frame travels, so that a frame cannot be reflected back to its sender.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Client to server.
    ToServer,
    /// Server to client.
    ToClient,
}

impl Session {
    fn new(peer: PeerIdentity, secret: &ClusterSecret, transcript: &[u8]) -> Self {
        let mut material = Vec::with_capacity(32 + transcript.len());
        material.extend_from_slice(&secret.0);
        material.extend_from_slice(transcript);
        let derived = blake3::derive_key(KEY_CONTEXT, &material);
        Self { peer, key: derived[..16].try_into().expect("16 of 32 bytes") }
    }

    /// The MAC of the `seq`-th frame sent in `direction`: a replayed, reordered, reflected or
    /// altered frame fails [`Session::verify_frame`].
    /// The frame may come in pieces (`parts`, concatenated): a header and an image slot.
    pub fn frame_mac(&self, direction: Direction, seq: u64, parts: &[&[u8]]) -> Mac {
        self.frame_hasher(direction, seq).update_all(parts).finish()
    }

    /// Whether `mac` is the frame's MAC, compared in constant time.
    pub fn verify_frame(&self, direction: Direction, seq: u64, parts: &[&[u8]], mac: &Mac) -> bool {
        self.frame_hasher(direction, seq).update_all(parts).verify(mac)
    }

    /// [`Session::frame_mac`] taken as the frame's bytes come, so that each piece is MACed while
    /// it is still in cache (a 2 MiB image read back from memory costs more than its MAC).
    pub fn frame_hasher(&self, direction: Direction, seq: u64) -> FrameHasher {
        // The nonce names the frame: no two frames of a session (one key) share one.
        let mut nonce = [0u8; 16];
        nonce[0] = direction as u8;
        nonce[1..9].copy_from_slice(&seq.to_le_bytes());
        FrameHasher(aegis::aegis128x4::Aegis128X4Mac::new_with_nonce(&self.key, &nonce))
    }
}

/// A frame's MAC in the making ([`Session::frame_hasher`]).
#[derive(Clone, Debug)]
pub struct FrameHasher(aegis::aegis128x4::Aegis128X4Mac<32>);

impl FrameHasher {
    /// Adds the frame's next bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    fn update_all(mut self, parts: &[&[u8]]) -> Self {
        for part in parts {
            self.update(part);
        }
        self
    }

    /// The MAC of every byte added.
    pub fn finish(self) -> Mac {
        self.0.finalize()
    }

    /// Whether `mac` is the MAC of every byte added, compared in constant time.
    pub fn verify(self, mac: &Mac) -> bool {
        self.0.verify(mac).is_ok()
    }
}

/// The client's side, between its Hello and the server's Challenge.
#[derive(Debug)]
pub struct ClientHandshake {
    secret: ClusterSecret,
    cluster: String,
    hello_body: Vec<u8>,
}

impl ClientHandshake {
    /// Starts a handshake protecting image frames by `integrity`: the Hello to send.
    pub fn start(secret: ClusterSecret, me: &PeerIdentity, nonce: Nonce, integrity: Integrity) -> (Self, Message) {
        let hello = Message::Hello {
            version: PROTOCOL_VERSION,
            cluster: me.cluster.clone(),
            node: me.node.clone(),
            epoch: me.epoch,
            nonce,
            integrity: integrity.to_byte(),
        };
        (Self { secret, cluster: me.cluster.clone(), hello_body: hello.body() }, hello)
    }

    /// Checks the server's Challenge: the Proof to send and the session.
    pub fn on_challenge(self, challenge: &Message) -> Result<(Session, Message), AuthError> {
        let Message::Challenge { node, epoch, nonce, mac } = challenge else { return Err(AuthError::Unexpected) };
        let mut transcript = self.hello_body;
        transcript.extend_from_slice(&server_part(node, *epoch, nonce));
        if self.secret.mac(b"server", &transcript) != blake3::Hash::from(*mac) {
            return Err(AuthError::BadMac);
        }
        let proof = Message::Proof { mac: *self.secret.mac(b"client", &transcript).as_bytes() };
        let peer = PeerIdentity { cluster: self.cluster, node: node.clone(), epoch: *epoch };
        Ok((Session::new(peer, &self.secret, &transcript), proof))
    }
}

/// The server's side, between its Challenge and the client's Proof.
#[derive(Debug)]
pub struct ServerHandshake {
    secret: ClusterSecret,
    client: PeerIdentity,
    transcript: Vec<u8>,
}

impl ServerHandshake {
    /// Answers a Hello from a client that must protect image frames by `integrity`: the
    /// Challenge to send. A refusal is for a [`Message::Refused`].
    pub fn respond(
        secret: ClusterSecret,
        me: &PeerIdentity,
        hello: &Message,
        nonce: Nonce,
        integrity: Integrity,
    ) -> Result<(Self, Message), AuthError> {
        let Message::Hello { version, cluster, node, epoch, integrity: theirs, .. } = hello else {
            return Err(AuthError::Unexpected);
        };
        if *version != PROTOCOL_VERSION {
            return Err(AuthError::Version(*version));
        }
        if *cluster != me.cluster {
            return Err(AuthError::Cluster(cluster.clone()));
        }
        if Integrity::from_byte(*theirs) != Some(integrity) {
            return Err(AuthError::Integrity(*theirs));
        }
        let mut transcript = hello.body();
        transcript.extend_from_slice(&server_part(&me.node, me.epoch, &nonce));
        let mac = *secret.mac(b"server", &transcript).as_bytes();
        let client = PeerIdentity { cluster: cluster.clone(), node: node.clone(), epoch: *epoch };
        let challenge = Message::Challenge { node: me.node.clone(), epoch: me.epoch, nonce, mac };
        Ok((Self { secret, client, transcript }, challenge))
    }

    /// Checks the client's Proof: the session.
    pub fn on_proof(self, proof: &Message) -> Result<Session, AuthError> {
        let Message::Proof { mac } = proof else { return Err(AuthError::Unexpected) };
        if self.secret.mac(b"client", &self.transcript) != blake3::Hash::from(*mac) {
            return Err(AuthError::BadMac);
        }
        Ok(Session::new(self.client, &self.secret, &self.transcript))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> (PeerIdentity, PeerIdentity) {
        let a = PeerIdentity { cluster: "prod".into(), node: "node-a".into(), epoch: 3 };
        let b = PeerIdentity { cluster: "prod".into(), node: "node-b".into(), epoch: 8 };
        (a, b)
    }

    fn secret(b: u8) -> ClusterSecret {
        ClusterSecret::from_bytes([b; 32])
    }

    #[test]
    fn peers_with_the_secret_agree_on_identities_and_a_session_key() {
        let (a, b) = ids();
        let (client, hello) = ClientHandshake::start(secret(1), &a, [10; 32], Integrity::Mac);
        let (server, challenge) = ServerHandshake::respond(secret(1), &b, &hello, [20; 32], Integrity::Mac).unwrap();
        let (client_session, proof) = client.on_challenge(&challenge).unwrap();
        let server_session = server.on_proof(&proof).unwrap();
        assert_eq!(client_session.peer, b);
        assert_eq!(server_session.peer, a);

        let frame: &[&[u8]] = &[b"a ", b"frame"];
        let mac = client_session.frame_mac(Direction::ToServer, 0, frame);
        assert!(server_session.verify_frame(Direction::ToServer, 0, &[b"a frame"], &mac), "pieces or whole");
        assert!(!server_session.verify_frame(Direction::ToServer, 1, frame, &mac), "replayed at another seq");
        assert!(!server_session.verify_frame(Direction::ToClient, 0, frame, &mac), "reflected");
        assert!(!server_session.verify_frame(Direction::ToServer, 0, &[b"a frame!"], &mac), "altered");
    }

    #[test]
    fn a_wrong_secret_fails_on_either_side() {
        let (a, b) = ids();
        // The server does not know it: the client refuses the challenge.
        let (client, hello) = ClientHandshake::start(secret(1), &a, [10; 32], Integrity::Mac);
        let (_, challenge) = ServerHandshake::respond(secret(2), &b, &hello, [20; 32], Integrity::Mac).unwrap();
        assert_eq!(client.on_challenge(&challenge).unwrap_err(), AuthError::BadMac);
        // The client does not know it: the server refuses the proof.
        let (client, hello) = ClientHandshake::start(secret(2), &a, [10; 32], Integrity::Mac);
        let (server, challenge) = ServerHandshake::respond(secret(1), &b, &hello, [20; 32], Integrity::Mac).unwrap();
        assert_eq!(client.on_challenge(&challenge).unwrap_err(), AuthError::BadMac);
        let forged = Message::Proof { mac: [0; 32] };
        assert_eq!(server.on_proof(&forged).unwrap_err(), AuthError::BadMac);
    }

    #[test]
    fn recorded_and_reflected_answers_do_not_pass() {
        let (a, b) = ids();
        // A challenge recorded from one connection fails a client with a fresh nonce.
        let (_, hello_1) = ClientHandshake::start(secret(1), &a, [10; 32], Integrity::Mac);
        let (_, recorded) = ServerHandshake::respond(secret(1), &b, &hello_1, [20; 32], Integrity::Mac).unwrap();
        let (client_2, _) = ClientHandshake::start(secret(1), &a, [11; 32], Integrity::Mac);
        assert_eq!(client_2.on_challenge(&recorded).unwrap_err(), AuthError::BadMac);
        // The server's own MAC sent back as the proof.
        let (server, challenge) = ServerHandshake::respond(secret(1), &b, &hello_1, [20; 32], Integrity::Mac).unwrap();
        let Message::Challenge { mac, .. } = challenge else { unreachable!() };
        assert_eq!(server.on_proof(&Message::Proof { mac }).unwrap_err(), AuthError::BadMac);
        // A proof recorded from one connection fails a server with a fresh nonce.
        let (client, hello) = ClientHandshake::start(secret(1), &a, [10; 32], Integrity::Mac);
        let (_, challenge) = ServerHandshake::respond(secret(1), &b, &hello, [20; 32], Integrity::Mac).unwrap();
        let (_, proof) = client.on_challenge(&challenge).unwrap();
        let (server_2, _) = ServerHandshake::respond(secret(1), &b, &hello, [21; 32], Integrity::Mac).unwrap();
        assert_eq!(server_2.on_proof(&proof).unwrap_err(), AuthError::BadMac);
    }

    #[test]
    fn another_cluster_or_version_is_refused_before_any_mac() {
        let (a, b) = ids();
        let other = PeerIdentity { cluster: "staging".into(), ..a.clone() };
        let (_, hello) = ClientHandshake::start(secret(1), &other, [10; 32], Integrity::Mac);
        assert_eq!(
            ServerHandshake::respond(secret(1), &b, &hello, [20; 32], Integrity::Mac).unwrap_err(),
            AuthError::Cluster("staging".into())
        );
        let Message::Hello { cluster, node, epoch, nonce, .. } =
            ClientHandshake::start(secret(1), &a, [10; 32], Integrity::Mac).1
        else {
            unreachable!()
        };
        let future =
            Message::Hello { version: 9, cluster: cluster.clone(), node: node.clone(), epoch, nonce, integrity: 0 };
        assert_eq!(
            ServerHandshake::respond(secret(1), &b, &future, [20; 32], Integrity::Mac).unwrap_err(),
            AuthError::Version(9)
        );
        assert_eq!(
            ServerHandshake::respond(secret(1), &b, &Message::Goodbye, [20; 32], Integrity::Mac).unwrap_err(),
            AuthError::Unexpected
        );
        // A client that would not MAC its images is refused by a server that does, and the
        // other way round; an unknown mode byte too.
        let (_, checksum_only) = ClientHandshake::start(secret(1), &a, [10; 32], Integrity::Checksum);
        assert_eq!(
            ServerHandshake::respond(secret(1), &b, &checksum_only, [20; 32], Integrity::Mac).unwrap_err(),
            AuthError::Integrity(1)
        );
        let (_, mac) = ClientHandshake::start(secret(1), &a, [10; 32], Integrity::Mac);
        assert_eq!(
            ServerHandshake::respond(secret(1), &b, &mac, [20; 32], Integrity::Checksum).unwrap_err(),
            AuthError::Integrity(0)
        );
        let odd = Message::Hello { version: PROTOCOL_VERSION, cluster, node, epoch, nonce, integrity: 7 };
        assert_eq!(
            ServerHandshake::respond(secret(1), &b, &odd, [20; 32], Integrity::Mac).unwrap_err(),
            AuthError::Integrity(7)
        );
    }

    #[test]
    fn secret_files_are_raw_or_hex_and_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, bytes: &[u8], mode: u32| {
            let path = dir.path().join(name);
            std::fs::write(&path, bytes).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            path
        };
        let raw = ClusterSecret::from_file(&write("raw", &[7; 32], 0o600)).unwrap();
        let hex = ClusterSecret::from_file(&write("hex", format!("{}\n", "07".repeat(32)).as_bytes(), 0o400)).unwrap();
        assert_eq!(raw.0, hex.0);
        assert!(matches!(ClusterSecret::from_file(&write("open", &[7; 32], 0o644)), Err(SecretError::Permissions(_))));
        assert!(matches!(ClusterSecret::from_file(&write("short", b"abcd", 0o600)), Err(SecretError::Format(_))));
        assert!(matches!(ClusterSecret::from_file(&dir.path().join("none")), Err(SecretError::Io { .. })));
        assert_eq!(format!("{raw:?}"), "ClusterSecret(..)", "never printed");
        // Distinct nonces, from the OS.
        assert_ne!(fresh_nonce(), fresh_nonce());
    }
}
