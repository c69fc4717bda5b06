//! Mutual TLS for G4 connections (`tiers.g4.tls_cert`, `tls_key`, `tls_ca`): the option for
//! networks where someone on the path may read or rewrite traffic.
//!
//! With it, every connection runs TLS 1.3 before the protocol's own handshake. Each side shows a
//! certificate signed by the cluster's CA: the server requires one from every client, and the
//! client checks that the server's names the host it dialled. The cluster-secret handshake then
//! runs inside TLS as always, so a peer must hold both a CA-signed key and the secret; and each
//! side checks that the other's certificate names (as a DNS name) the node the other claims to
//! be in that handshake ([`certificate_names_node`]), so a node's certificate cannot speak for
//! another node. TLS encrypts everything and authenticates every record, images included.
//!
//! The cryptography is pure Rust, so building it needs no C library: Graviola's
//! (`rustls-graviola`) where the CPU has what it requires (x86-64 with AES-NI, PCLMULQDQ, AVX2,
//! BMI1 and ADX; arm64 with AES, PMULL and SHA-2), RustCrypto's (`rustls-rustcrypto`) elsewhere.
//! RustCrypto's GHASH multiplies one block at a time, and it, not AES, bounded the link; on
//! Graviola's the link moves more than twice as much (see [`provider`]). The two interoperate:
//! both offer TLS 1.3 with AES-GCM and ChaCha20-Poly1305, X25519 and P-256, and ECDSA and Ed25519
//! signatures.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::net::TcpStream;

/// Why the TLS files could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or holds no PEM item of the kind needed.
    #[error("{path}: {what}")]
    File {
        /// The file.
        path: String,
        /// What was wrong with it.
        what: String,
    },
    /// rustls refused the certificates or the key.
    #[error("TLS setup: {0}")]
    Setup(String),
}

/// A node's TLS: its certificate and key, and the cluster CA it trusts, for both sides of a
/// connection.
#[derive(Clone)]
pub struct Tls {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").finish_non_exhaustive()
    }
}

fn file_error(path: &Path, what: impl std::fmt::Display) -> TlsError {
    TlsError::File { path: path.display().to_string(), what: what.to_string() }
}

/// Which cryptography a node's TLS runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsCrypto {
    /// Graviola's (`rustls-graviola`).
    Graviola,
    /// RustCrypto's (`rustls-rustcrypto`).
    RustCrypto,
}

/// Graviola where this CPU has every feature it asserts on first use, RustCrypto elsewhere.
pub fn crypto() -> TlsCrypto {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("aes") && has!("pclmulqdq") && has!("avx") && has!("avx2") && has!("bmi1") && has!("adx") {
            return TlsCrypto::Graviola;
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        use std::arch::is_aarch64_feature_detected as has;
        if has!("neon") && has!("aes") && has!("pmull") && has!("sha2") {
            return TlsCrypto::Graviola;
        }
    }
    TlsCrypto::RustCrypto
}

/// The rustls crypto provider of `crypto` (RustCrypto's where Graviola does not build). On the
/// dev machine (2 cores, both ends of the link), `bench g4 --tls` moved 0.97 GB/s on RustCrypto's,
/// where `polyval`'s one-block GHASH took 17.5% of the samples against 4% for AES, and 2.2 to
/// 2.5 GB/s on Graviola's.
fn provider(crypto: TlsCrypto) -> rustls::crypto::CryptoProvider {
    match crypto {
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        TlsCrypto::Graviola => rustls_graviola::default_provider(),
        _ => rustls_rustcrypto::provider(),
    }
}

impl Tls {
    /// Loads the node's certificate chain (`cert`, PEM), its private key (`key`, PEM: PKCS#8,
    /// SEC1 or PKCS#1) and the cluster CA's certificates (`ca`, PEM).
    pub fn from_files(cert: &Path, key: &Path, ca: &Path) -> Result<Self, TlsError> {
        let crypto = crypto();
        tracing::info!(?crypto, "G4 TLS: the cryptography this CPU runs fastest");
        Self::from_files_with(cert, key, ca, crypto)
    }

    /// [`Tls::from_files`] on the cryptography given (tests run the two against each other).
    /// Graviola where [`crypto`] does not pick it is refused: Graviola would panic on first use.
    pub fn from_files_with(cert: &Path, key: &Path, ca: &Path, crypto: TlsCrypto) -> Result<Self, TlsError> {
        if crypto == TlsCrypto::Graviola && self::crypto() != TlsCrypto::Graviola {
            return Err(TlsError::Setup("this CPU cannot run Graviola's cryptography".into()));
        }
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .map_err(|e| file_error(cert, e))?
            .collect::<Result<_, _>>()
            .map_err(|e| file_error(cert, e))?;
        if chain.is_empty() {
            return Err(file_error(cert, "no certificate in it"));
        }
        let key_file = key;
        let key = PrivateKeyDer::from_pem_file(key).map_err(|e| file_error(key, e))?;
        let mut roots = RootCertStore::empty();
        let cas: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(ca)
            .map_err(|e| file_error(ca, e))?
            .collect::<Result<_, _>>()
            .map_err(|e| file_error(ca, e))?;
        if cas.is_empty() {
            return Err(file_error(ca, "no certificate in it"));
        }
        for c in cas {
            roots.add(c).map_err(|e| file_error(ca, e))?;
        }
        let roots = Arc::new(roots);
        let provider = Arc::new(provider(crypto));
        // ECDSA and Ed25519 only: RustCrypto's RSA is not constant-time (RUSTSEC-2023-0071).
        let signing = provider.key_provider.load_private_key(key.clone_key()).map_err(|e| file_error(key_file, e))?;
        if signing.algorithm() == rustls::SignatureAlgorithm::RSA {
            return Err(file_error(key_file, "an RSA key: use an ECDSA (P-256, P-384) or Ed25519 key"));
        }
        let setup = |e: rustls::Error| TlsError::Setup(e.to_string());

        let clients = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| TlsError::Setup(e.to_string()))?;
        let server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(setup)?
            .with_client_cert_verifier(clients)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(setup)?;
        let client = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(setup)?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(setup)?;
        Ok(Self { server: Arc::new(server), client: Arc::new(client) })
    }

    /// The server's side: requires a client certificate signed by the cluster CA (the client's
    /// end-entity certificate is [`peer_certificate`] of the stream).
    pub async fn accept(&self, stream: TcpStream) -> std::io::Result<tokio_rustls::server::TlsStream<TcpStream>> {
        tokio_rustls::TlsAcceptor::from(self.server.clone()).accept(stream).await
    }

    /// The client's side: the server's certificate must be signed by the cluster CA and name
    /// `host` (a DNS name or an IP address).
    pub async fn connect(
        &self,
        host: &str,
        stream: TcpStream,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let name = ServerName::try_from(host.trim_start_matches('[').trim_end_matches(']').to_owned())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{host:?}: {e}")))?;
        tokio_rustls::TlsConnector::from(self.client.clone()).connect(name, stream).await
    }
}

/// The end-entity certificate the peer of a TLS connection showed (and TLS verified).
pub fn peer_certificate(connection: &rustls::CommonState) -> Option<CertificateDer<'static>> {
    connection.peer_certificates()?.first().map(|c| c.clone().into_owned())
}

/// Whether `cert`, a peer's certificate that TLS verified against the cluster CA, names `node`,
/// the node the peer claims to be in the protocol's handshake, as a DNS name; why not, if not.
pub fn certificate_names_node(cert: &CertificateDer<'_>, node: &str) -> Result<(), String> {
    let name = ServerName::try_from(node).map_err(|_| format!("node name {node:?} is not a DNS name"))?;
    let parsed = rustls::server::ParsedCertificate::try_from(cert).map_err(|e| format!("peer certificate: {e}"))?;
    rustls::client::verify_server_name(&parsed, &name)
        .map_err(|_| format!("the peer's certificate does not name node {node:?}, which the peer claims to be"))
}
