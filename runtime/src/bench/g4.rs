//! `dynamo-node bench g4`: the block-serving protocol over TCP against a plain socket copy of the
//! same bytes, measured in the same run.
//!
//! A server in this process holds `--blocks` sealed images of `--block-kib` each as resident
//! blocks; a client authenticates, then holds, fetches and releases them `--batch` at a time,
//! verifying every image (hash, header and payload checksums) and every frame's MAC, as a node
//! loading a peer's prefix does. The protocol runs twice: with every image frame MACed
//! (`tiers.g4.integrity = "mac"`) and with images verified by their checksums only
//! (`"checksum"`); each reads its images straight into slots of a pinned host pool, as a node
//! reads them into G2 slots.
//!
//! Two peers measure what the link gives with no protocol at all, the same bytes written by one
//! socket and read by another:
//! - iperf's way, every read into one reused buffer, which stays in cache;
//! - each image read into a slot of its own from a pool like the protocol's, so the bytes land in
//!   as much memory as the protocol's do. On a machine where both ends share the cores and the
//!   memory bus this is the copy the protocol cannot avoid: a node keeps what it loads.
//!
//! Each is run `--passes` times and the median counts; the report gives GB/s for each and the
//! protocol's ratio to both. Everything runs in this process over loopback, over `--lanes`
//! connections side by side.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use clap::Args;
use dynamo_tiering::block::{BlockHash, BlockLayout, HEADER_LEN, ImageSpec, RetentionMeta, Salt, seal};
use dynamo_tiering::g2::{HostPool, HostPoolOptions, MlockPolicy, align_up};
use dynamo_tiering::g4::auth::{ClusterSecret, PeerIdentity};
use dynamo_tiering::g4::holds::HoldLimits;
use dynamo_tiering::g4::tcp::{BlockSource, ClientConfig, FetchedSlot, PeerClient, ServerConfig, serve_peer};
use dynamo_tiering::g4::tls::Tls;
use dynamo_tiering::g4::wire::{Integrity, WireLimits};
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
    /// Connections side by side (a node's `tiers.g4.lanes`); the plain copy uses as many.
    #[arg(long, default_value_t = 1)]
    pub lanes: usize,
    /// Also run under mutual TLS (with `integrity = "checksum"`: TLS authenticates every byte),
    /// with the certificates in this directory: `ca.pem`, and `node-a` and `node-b` `.pem`/`.key`
    /// for 127.0.0.1 and their own names (`tests/fixtures/g4-tls` has test ones).
    #[arg(long)]
    pub tls: Option<std::path::PathBuf>,
}

/// What the bench measured.
#[derive(Debug, Clone)]
pub struct G4Report {
    /// Image bytes moved per pass.
    pub bytes: u64,
    /// Connections side by side.
    pub lanes: usize,
    /// The protocol's median GB/s with every image frame MACed (`integrity = "mac"`).
    pub mac_gbps: f64,
    /// The protocol's median GB/s with images verified by checksums only (`"checksum"`).
    pub checksum_gbps: f64,
    /// The protocol's median GB/s under mutual TLS, images verified by checksums, with `--tls`.
    pub tls_gbps: Option<f64>,
    /// The plain copy's median GB/s, read into one reused buffer (iperf's way).
    pub plain_gbps: f64,
    /// The plain copy's median GB/s, each image read into a pool slot of its own (where the
    /// protocol's land).
    pub plain_slots_gbps: f64,
    /// The protocol's round trip, for a ping.
    pub ping: Duration,
}

impl fmt::Display for G4Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "G4 over {} TCP connection(s) on loopback, {:.0} MiB per pass",
            self.lanes,
            self.bytes as f64 / (1 << 20) as f64
        )?;
        writeln!(
            f,
            "  integrity \"mac\" (auth, holds, every frame MACed, images verified): {:.2} GB/s",
            self.mac_gbps
        )?;
        writeln!(
            f,
            "  integrity \"checksum\" (auth, control frames MACed, images verified): {:.2} GB/s",
            self.checksum_gbps
        )?;
        if let Some(tls) = self.tls_gbps {
            writeln!(f, "  mutual TLS 1.3 (integrity \"checksum\" inside, images verified): {tls:.2} GB/s")?;
        }
        writeln!(f, "  plain socket copy of the same bytes, into one reused buffer: {:.2} GB/s", self.plain_gbps)?;
        writeln!(
            f,
            "  plain socket copy of the same bytes, each into a pool slot of its own: {:.2} GB/s",
            self.plain_slots_gbps
        )?;
        for (peer, gbps) in [("plain", self.plain_gbps), ("plain into slots", self.plain_slots_gbps)] {
            write!(f, "  ratio to {peer}: mac {:.2}, checksum {:.2}", self.mac_gbps / gbps, self.checksum_gbps / gbps)?;
            match self.tls_gbps {
                Some(tls) => writeln!(f, ", tls {:.2}", tls / gbps)?,
                None => writeln!(f)?,
            }
        }
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
    ensure!(
        args.blocks > 0 && args.batch > 0 && args.passes > 0 && args.lanes > 0,
        "--blocks, --batch, --passes and --lanes must be positive"
    );
    let payload = args.block_kib << 10;
    let layout = BlockLayout::opaque(payload);
    ensure!(layout.payload_bytes() == payload, "--block-kib {} is not a representable block size", args.block_kib);
    let hashes: Vec<BlockHash> = (1..=args.blocks as u128).map(|i| BlockHash(i * 0x9e37_79b9_7f4a_7c15)).collect();
    let images: HashMap<BlockHash, Arc<Vec<u8>>> = hashes.iter().map(|&h| (h, Arc::new(sealed(h, payload)))).collect();
    let bytes: u64 = images.values().map(|i| i.len() as u64).sum();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async move {
        let mut protocol = Vec::new();
        let mut ping = Duration::ZERO;
        for integrity in [Integrity::Mac, Integrity::Checksum] {
            let (gbps, rtt) = protocol_passes(args, integrity, None, &hashes, &images, payload, bytes).await?;
            protocol.push(gbps);
            if integrity == Integrity::Mac {
                ping = rtt;
            }
        }
        let tls_gbps = match &args.tls {
            Some(dir) => {
                let tls = |node: &str| {
                    Tls::from_files(
                        &dir.join(format!("{node}.pem")),
                        &dir.join(format!("{node}.key")),
                        &dir.join("ca.pem"),
                    )
                    .map(Arc::new)
                    .with_context(|| format!("--tls {}", dir.display()))
                };
                let pair = (tls("node-a")?, tls("node-b")?);
                let tls = Some(pair);
                Some(protocol_passes(args, Integrity::Checksum, tls, &hashes, &images, payload, bytes).await?.0)
            }
            None => None,
        };
        let plain = plain_passes(args, &hashes, &images, None).await?;
        let plain_slots = plain_passes(args, &hashes, &images, Some(landing_pool(args, payload)?)).await?;
        Ok(G4Report {
            bytes,
            lanes: args.lanes,
            mac_gbps: protocol[0],
            checksum_gbps: protocol[1],
            tls_gbps,
            plain_gbps: plain,
            plain_slots_gbps: plain_slots,
            ping,
        })
    })
}

/// The protocol's median GB/s over `args.passes` passes, with images protected by `integrity`
/// (under `tls`, the server's and the client's, when given), and a ping's round trip.
async fn protocol_passes(
    args: &BenchG4Args,
    integrity: Integrity,
    tls: Option<(Arc<Tls>, Arc<Tls>)>,
    hashes: &[BlockHash],
    images: &HashMap<BlockHash, Arc<Vec<u8>>>,
    payload: usize,
    bytes: u64,
) -> anyhow::Result<(f64, Duration)> {
    let secret = ClusterSecret::from_bytes(bench_secret());
    let server = Arc::new(ServerConfig {
        secret: secret.clone(),
        // Named as the `--tls` certificates name them: under TLS a peer checks the two agree.
        me: PeerIdentity { cluster: "bench".into(), node: "node-a".into(), epoch: 1 },
        wire: WireLimits { max_frame: (HEADER_LEN + payload + 64) as u32, max_hashes: args.batch as u32 },
        integrity,
        holds: HoldLimits { max_holds: 4, max_blocks: args.batch * 4, max_ttl: Duration::from_secs(10) },
        handshake_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(30),
        rdma: None,
        tls: tls.as_ref().map(|(server, _)| server.clone()),
    });
    let client = ClientConfig {
        secret,
        me: PeerIdentity { cluster: "bench".into(), node: "node-b".into(), epoch: 1 },
        wire: server.wire,
        integrity,
        connect_timeout: Duration::from_secs(5),
        request_timeout: Duration::from_secs(30),
        tls: tls.map(|(_, client)| client),
    };
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let source = Arc::new(Resident(images.clone()));
    let lanes = args.lanes;
    let served = tokio::spawn(async move {
        let mut conns = Vec::new();
        for _ in 0..lanes {
            let (stream, _) = listener.accept().await?;
            let (server, source) = (server.clone(), source.clone());
            conns.push(tokio::spawn(async move { serve_peer(stream, &server, &*source).await }));
        }
        for conn in conns {
            conn.await??;
        }
        anyhow::Ok(())
    });
    let mut peers = Vec::new();
    for _ in 0..lanes {
        peers.push(PeerClient::connect(addr, &client).await.context("connect to the bench server")?);
    }
    let ping = peers[0].ping().await?;
    // Each lane takes every `lanes`-th batch; images are read straight into slots of a pinned
    // host pool, as a node's are into G2 slots, and the slots go back to the pool once counted.
    let pool = landing_pool(args, payload)?;
    let batches: Vec<Vec<BlockHash>> = hashes.chunks(args.batch).map(<[BlockHash]>::to_vec).collect();
    let mut passes = Vec::new();
    for _ in 0..args.passes {
        let started = Instant::now();
        let mut tasks = Vec::new();
        for (lane, mut peer) in std::mem::take(&mut peers).into_iter().enumerate() {
            let mine: Vec<Vec<BlockHash>> = batches.iter().skip(lane).step_by(lanes).cloned().collect();
            let pool = pool.clone();
            tasks.push(tokio::spawn(async move {
                let mut verified = 0u64;
                let mut failed = None;
                for chunk in &mine {
                    let held = peer.hold(chunk, Duration::from_secs(10)).await?;
                    peer.fetch_into(
                        held.hold_id,
                        chunk,
                        || pool.try_alloc(),
                        |hash, fetched| match fetched {
                            FetchedSlot::Verified { len, .. } => verified += len as u64,
                            other => failed = Some(format!("block {hash}: {other:?}")),
                        },
                    )
                    .await?;
                    peer.release(held.hold_id).await?;
                }
                if let Some(failed) = failed {
                    anyhow::bail!(failed);
                }
                anyhow::Ok((peer, verified))
            }));
        }
        let mut verified = 0;
        for task in tasks {
            let (peer, moved) = task.await??;
            peers.push(peer);
            verified += moved;
        }
        ensure!(verified == bytes, "moved {verified} of {bytes} bytes");
        passes.push(bytes as f64 / started.elapsed().as_secs_f64() / 1e9);
    }
    for peer in peers {
        peer.goodbye().await?;
    }
    served.await??;
    Ok((median(passes), ping))
}

/// Where images land: a pinned host pool of two batches' slots per lane, handed out in turn as
/// a node's G2 hands out free slots.
fn landing_pool(args: &BenchG4Args, payload: usize) -> anyhow::Result<HostPool> {
    let slots = (args.batch * args.lanes * 2) as u64;
    Ok(HostPool::new(HostPoolOptions::with_capacity(
        slots * align_up(HEADER_LEN + payload) as u64,
        HEADER_LEN + payload,
        MlockPolicy::Try,
    ))?)
}

/// The same bytes over plain sockets (as many as lanes), each image read into one reused buffer
/// or, given a pool, into a slot of its own: the plain copy's median GB/s.
async fn plain_passes(
    args: &BenchG4Args,
    hashes: &[BlockHash],
    images: &HashMap<BlockHash, Arc<Vec<u8>>>,
    landing: Option<HostPool>,
) -> anyhow::Result<f64> {
    let bytes: u64 = hashes.iter().map(|h| images[h].len() as u64).sum();
    let image_len = images.values().next().map_or(0, |i| i.len());
    let mut passes = Vec::new();
    let batches: Vec<Vec<Arc<Vec<u8>>>> =
        hashes.chunks(args.batch).map(|c| c.iter().map(|h| images[h].clone()).collect()).collect();
    for _ in 0..args.passes {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let mut writers = Vec::new();
        let mut readers = Vec::new();
        for lane in 0..args.lanes {
            let send: Vec<Arc<Vec<u8>>> =
                batches.iter().skip(lane).step_by(args.lanes).flat_map(|b| b.iter().cloned()).collect();
            let count = send.len();
            let stream = tokio::net::TcpStream::connect(addr).await?;
            let (mut accepted, _) = listener.accept().await?;
            accepted.set_nodelay(true)?;
            writers.push(async move {
                for image in &send {
                    accepted.write_all(image).await?;
                }
                anyhow::Ok(())
            });
            readers.push((stream, count));
        }
        let started = Instant::now();
        let mut tasks = Vec::new();
        for writer in writers {
            tasks.push(tokio::spawn(writer));
        }
        for (mut stream, count) in readers {
            let landing = landing.clone();
            tasks.push(tokio::spawn(async move {
                let mut buf = vec![0u8; image_len];
                for _ in 0..count {
                    match &landing {
                        Some(pool) => {
                            let mut slot = pool.try_alloc().context("a free slot in the landing pool")?;
                            stream.read_exact(&mut slot.as_mut_slice()[..image_len]).await?;
                        }
                        None => {
                            stream.read_exact(&mut buf).await?;
                        }
                    }
                }
                anyhow::Ok(())
            }));
        }
        for task in tasks {
            task.await??;
        }
        passes.push(bytes as f64 / started.elapsed().as_secs_f64() / 1e9);
    }
    Ok(median(passes))
}

/// A fixed secret: the bench authenticates as real peers do, against itself.
fn bench_secret() -> [u8; 32] {
    *blake3::hash(b"dynamo-node bench g4").as_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_run_moves_every_byte_in_each_mode_tls_included() {
        let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/g4-tls");
        let args = BenchG4Args { block_kib: 64, blocks: 16, batch: 4, passes: 1, lanes: 2, tls: Some(fixtures) };
        let report = run(&args).expect("the bench runs");
        assert_eq!(report.bytes, 16 * (HEADER_LEN as u64 + (64 << 10)));
        for gbps in [
            report.mac_gbps,
            report.checksum_gbps,
            report.tls_gbps.expect("--tls ran"),
            report.plain_gbps,
            report.plain_slots_gbps,
        ] {
            assert!(gbps.is_finite() && gbps > 0.0, "{report}");
        }
        assert!(report.to_string().contains("tls "), "{report}");
    }
}
