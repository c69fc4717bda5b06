//! `dynamo-node bench g4`: the block-serving protocol over one TCP connection against a plain
//! socket copy of the same bytes, measured in the same run.
//!
//! A server in this process holds `--blocks` sealed images of `--block-kib` each as resident
//! blocks; a client authenticates, then holds, fetches and releases them `--batch` at a time,
//! verifying every image (hash, header and payload checksums) and every frame's MAC, as a node
//! loading a peer's prefix does. The peer is what the link gives with no protocol at all: the
//! same bytes written by one socket and read by another into a reused buffer. Each is run
//! `--passes` times and the median counts; the report gives GB/s for both and their ratio. Both
//! sides run in this process over loopback, one connection (lanes are to come).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use clap::Args;
use dynamo_tiering::block::{BlockHash, BlockLayout, HEADER_LEN, ImageSpec, RetentionMeta, Salt, seal};
use dynamo_tiering::g4::auth::{ClusterSecret, PeerIdentity};
use dynamo_tiering::g4::holds::HoldLimits;
use dynamo_tiering::g4::tcp::{BlockSource, ClientConfig, Fetched, PeerClient, ServerConfig, serve_peer};
use dynamo_tiering::g4::wire::WireLimits;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Options of `bench g4`.
#[derive(Debug, Clone, Args)]
pub struct BenchG4Args {
    /// Bytes of each block's payload, in KiB (a 32-token block of Llama 3 8B in bf16 is 4096).
    #[arg(long, default_value_t = 2048)]
    pub block_kib: usize,
    /// Blocks moved per pass.
    #[arg(long, default_value_t = 256)]
    pub blocks: usize,
    /// Blocks per hold and fetch.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Passes of each side; the median counts.
    #[arg(long, default_value_t = 3)]
    pub passes: usize,
}

/// What the bench measured.
#[derive(Debug, Clone)]
pub struct G4Report {
    /// Image bytes moved per pass.
    pub bytes: u64,
    /// The protocol's median GB/s.
    pub protocol_gbps: f64,
    /// The plain copy's median GB/s.
    pub plain_gbps: f64,
    /// The protocol's round trip, for a ping.
    pub ping: Duration,
}

impl fmt::Display for G4Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "G4 over one TCP connection on loopback, {:.0} MiB per pass",
            self.bytes as f64 / (1 << 20) as f64
        )?;
        writeln!(f, "  protocol (auth, holds, MACs, verified images): {:.2} GB/s", self.protocol_gbps)?;
        writeln!(f, "  plain socket copy of the same bytes:          {:.2} GB/s", self.plain_gbps)?;
        writeln!(f, "  ratio protocol / plain: {:.2}", self.protocol_gbps / self.plain_gbps)?;
        writeln!(f, "  ping round trip: {:.0} us", self.ping.as_secs_f64() * 1e6)
    }
}

struct Resident(HashMap<BlockHash, Arc<Vec<u8>>>);

#[derive(Clone)]
struct Image(Arc<Vec<u8>>);

impl AsRef<[u8]> for Image {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl BlockSource for Resident {
    type Handle = Image;
    fn resolve(&self, hash: BlockHash) -> Option<Image> {
        self.0.get(&hash).cloned().map(Image)
    }
}

fn sealed(hash: BlockHash, payload: usize) -> Vec<u8> {
    let mut buf = vec![0u8; HEADER_LEN + payload];
    let mut x = hash.0 as u64 | 1;
    for chunk in buf[HEADER_LEN..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    let spec = ImageSpec {
        hash,
        parent: None,
        salt: Salt(0),
        layout: BlockLayout::opaque(payload),
        token_count: 32,
        retention: RetentionMeta::default(),
    };
    seal(&mut buf, &spec);
    buf
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the bench.
pub fn run(args: &BenchG4Args) -> anyhow::Result<G4Report> {
    ensure!(args.blocks > 0 && args.batch > 0 && args.passes > 0, "--blocks, --batch and --passes must be positive");
    let payload = args.block_kib << 10;
    let layout = BlockLayout::opaque(payload);
    ensure!(layout.payload_bytes() == payload, "--block-kib {} is not a representable block size", args.block_kib);
    let hashes: Vec<BlockHash> = (1..=args.blocks as u128).map(|i| BlockHash(i * 0x9e37_79b9_7f4a_7c15)).collect();
    let images: HashMap<BlockHash, Arc<Vec<u8>>> = hashes.iter().map(|&h| (h, Arc::new(sealed(h, payload)))).collect();
    let bytes: u64 = images.values().map(|i| i.len() as u64).sum();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async move {
        let secret = ClusterSecret::from_bytes(bench_secret());
        let server = ServerConfig {
            secret: secret.clone(),
            me: PeerIdentity { cluster: "bench".into(), node: "server".into(), epoch: 1 },
            wire: WireLimits { max_frame: (HEADER_LEN + payload + 64) as u32, max_hashes: args.batch as u32 },
            holds: HoldLimits { max_holds: 4, max_blocks: args.batch * 4, max_ttl: Duration::from_secs(10) },
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
        };
        let client = ClientConfig {
            secret,
            me: PeerIdentity { cluster: "bench".into(), node: "client".into(), epoch: 1 },
            wire: server.wire,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
        };
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let source = Arc::new(Resident(images.clone()));
        let served = tokio::spawn(async move {
            let (stream, _) = listener.accept().await?;
            serve_peer(stream, &server, &*source).await.map_err(anyhow::Error::from)
        });
        let mut peer = PeerClient::connect(addr, &client).await.context("connect to the bench server")?;
        let ping = peer.ping().await?;
        let mut protocol = Vec::new();
        for _ in 0..args.passes {
            let started = Instant::now();
            let mut verified = 0u64;
            for chunk in hashes.chunks(args.batch) {
                let held = peer.hold(chunk, Duration::from_secs(10)).await?;
                for (hash, fetched) in peer.fetch(held.hold_id, chunk).await? {
                    match fetched {
                        Fetched::Verified(image) => verified += image.len() as u64,
                        other => anyhow::bail!("block {hash}: {other:?}"),
                    }
                }
                peer.release(held.hold_id).await?;
            }
            ensure!(verified == bytes, "moved {verified} of {bytes} bytes");
            protocol.push(bytes as f64 / started.elapsed().as_secs_f64() / 1e9);
        }
        peer.goodbye().await?;
        served.await??;

        // The same bytes over a plain socket, read into one reused buffer.
        let mut plain = Vec::new();
        let ordered: Vec<Arc<Vec<u8>>> = hashes.iter().map(|h| images[h].clone()).collect();
        for _ in 0..args.passes {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            let send = ordered.clone();
            let writer = tokio::spawn(async move {
                let (mut stream, _) = listener.accept().await?;
                stream.set_nodelay(true)?;
                for image in &send {
                    stream.write_all(image).await?;
                }
                anyhow::Ok(())
            });
            let mut stream = tokio::net::TcpStream::connect(addr).await?;
            let mut buf = vec![0u8; HEADER_LEN + payload];
            let started = Instant::now();
            for _ in 0..ordered.len() {
                stream.read_exact(&mut buf).await?;
            }
            plain.push(bytes as f64 / started.elapsed().as_secs_f64() / 1e9);
            writer.await??;
        }
        Ok(G4Report { bytes, protocol_gbps: median(protocol), plain_gbps: median(plain), ping })
    })
}

/// A fixed secret: the bench authenticates as real peers do, against itself.
fn bench_secret() -> [u8; 32] {
    *blake3::hash(b"dynamo-node bench g4").as_bytes()
}
