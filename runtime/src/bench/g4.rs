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
//! The sides run in rounds, one pass of each in turn, `--passes` rounds: a slow spell of a shared
//! machine then slows a round's sides alike. The report gives each side's median GB/s, and the
//! protocol's ratio to both peers as the median of the ratios taken within each round. Everything
//! runs in this process over loopback, over `--lanes` connections side by side.

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
    /// Rounds of one pass of each side; the medians count.
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
    /// The median over passes of each pass's ratio to the plain copy of the same round: mac,
    /// checksum, and TLS when run.
    pub to_plain: Ratios,
    /// The same against the plain copy into pool slots.
    pub to_plain_slots: Ratios,
    /// The protocol's round trip, for a ping.
    pub ping: Duration,
}

/// The protocol's ratios to one peer, each the median of per-round ratios.
#[derive(Debug, Clone, Copy)]
pub struct Ratios {
    /// `integrity = "mac"`.
    pub mac: f64,
    /// `integrity = "checksum"`.
    pub checksum: f64,
    /// Mutual TLS, when run.
    pub tls: Option<f64>,
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
        for (peer, ratios) in [("plain", self.to_plain), ("plain into slots", self.to_plain_slots)] {
            write!(f, "  ratio to {peer}: mac {:.2}, checksum {:.2}", ratios.mac, ratios.checksum)?;
            match ratios.tls {
                Some(tls) => writeln!(f, ", tls {tls:.2}")?,
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
    // Each end on a runtime of its own, as two nodes would be: the reading end here, the serving
    // end (protocol servers, plain writers) on `serving`, so neither end's tasks queue behind the
    // other's on one worker.
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let serving_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("g4-bench-server")
        .enable_all()
        .build()?;
    let serving = serving_runtime.handle();
    runtime.block_on(async move {
        // One landing pool for every side that keeps its images, so each lands in the same memory.
        let pool = landing_pool(args, payload)?;
        let mut rigs = Vec::new();
        for integrity in [Integrity::Mac, Integrity::Checksum] {
            rigs.push(ProtocolRig::start(serving, args, integrity, None, &images, payload).await?);
        }
        if let Some(dir) = &args.tls {
            let tls = |node: &str| {
                Tls::from_files(&dir.join(format!("{node}.pem")), &dir.join(format!("{node}.key")), &dir.join("ca.pem"))
                    .map(Arc::new)
                    .with_context(|| format!("--tls {}", dir.display()))
            };
            let pair = (tls("node-a")?, tls("node-b")?);
            rigs.push(ProtocolRig::start(serving, args, Integrity::Checksum, Some(pair), &images, payload).await?);
        }
        let ping = rigs[0].peers[0].ping().await?;
        // Rounds: one pass of every side in turn, so that a slow spell of this shared machine
        // slows a round's sides alike; each ratio is taken within its round.
        let mut rounds: Vec<Vec<f64>> = Vec::new();
        for _ in 0..args.passes {
            let mut round = Vec::new();
            for rig in &mut rigs {
                round.push(rig.pass(&hashes, args, &pool, bytes).await?);
            }
            round.push(plain_pass(serving, args, &hashes, &images, None).await?);
            round.push(plain_pass(serving, args, &hashes, &images, Some(&pool)).await?);
            rounds.push(round);
        }
        for rig in rigs {
            rig.finish().await?;
        }
        let side = |i: usize| median(rounds.iter().map(|r| r[i]).collect());
        let ratio = |i: usize, peer: usize| median(rounds.iter().map(|r| r[i] / r[peer]).collect());
        let (plain, slots) = (rounds[0].len() - 2, rounds[0].len() - 1);
        let tls = args.tls.is_some().then_some(2);
        let ratios = |peer| Ratios { mac: ratio(0, peer), checksum: ratio(1, peer), tls: tls.map(|i| ratio(i, peer)) };
        Ok(G4Report {
            bytes,
            lanes: args.lanes,
            mac_gbps: side(0),
            checksum_gbps: side(1),
            tls_gbps: tls.map(side),
            plain_gbps: side(plain),
            plain_slots_gbps: side(slots),
            to_plain: ratios(plain),
            to_plain_slots: ratios(slots),
            ping,
        })
    })
}

/// A bench server and `lanes` authenticated clients of it, kept across passes.
struct ProtocolRig {
    peers: Vec<PeerClient>,
    served: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl ProtocolRig {
    /// Serves `images` with images protected by `integrity` (under `tls`, the server's and the
    /// client's, when given), and connects a client per lane.
    async fn start(
        serving: &tokio::runtime::Handle,
        args: &BenchG4Args,
        integrity: Integrity,
        tls: Option<(Arc<Tls>, Arc<Tls>)>,
        images: &HashMap<BlockHash, Arc<Vec<u8>>>,
        payload: usize,
    ) -> anyhow::Result<Self> {
        let secret = ClusterSecret::from_bytes(bench_secret());
        let server = Arc::new(ServerConfig {
            secret: secret.clone(),
            // Named as the `--tls` certificates name them: under TLS a peer checks the two agree.
            me: PeerIdentity { cluster: "bench".into(), node: "node-a".into(), epoch: 1 },
            wire: WireLimits { max_frame: (HEADER_LEN + payload + 64) as u32, max_hashes: args.batch as u32 },
            integrity,
            holds: HoldLimits { max_holds: 4, max_blocks: args.batch * 4, max_ttl: Duration::from_secs(10) },
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
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
        let listener = serving.spawn(TcpListener::bind("127.0.0.1:0")).await??;
        let addr = listener.local_addr()?;
        let source = Arc::new(Resident(images.clone()));
        let lanes = args.lanes;
        let served = serving.spawn(async move {
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
        Ok(Self { peers, served })
    }

    /// One pass over every block: GB/s. Each lane takes every `lanes`-th batch; images are read
    /// straight into slots of `pool`, as a node's are into G2 slots, and the slots go back to the
    /// pool once counted.
    async fn pass(
        &mut self,
        hashes: &[BlockHash],
        args: &BenchG4Args,
        pool: &HostPool,
        bytes: u64,
    ) -> anyhow::Result<f64> {
        let lanes = self.peers.len();
        let batches: Vec<Vec<BlockHash>> = hashes.chunks(args.batch).map(<[BlockHash]>::to_vec).collect();
        let started = Instant::now();
        let mut tasks = Vec::new();
        for (lane, mut peer) in std::mem::take(&mut self.peers).into_iter().enumerate() {
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
            self.peers.push(peer);
            verified += moved;
        }
        ensure!(verified == bytes, "moved {verified} of {bytes} bytes");
        Ok(bytes as f64 / started.elapsed().as_secs_f64() / 1e9)
    }

    /// Says goodbye on every lane and waits for the server to end.
    async fn finish(self) -> anyhow::Result<()> {
        for peer in self.peers {
            peer.goodbye().await?;
        }
        self.served.await?
    }
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
/// or, given a pool, into a slot of its own: one pass, in GB/s.
async fn plain_pass(
    serving: &tokio::runtime::Handle,
    args: &BenchG4Args,
    hashes: &[BlockHash],
    images: &HashMap<BlockHash, Arc<Vec<u8>>>,
    landing: Option<&HostPool>,
) -> anyhow::Result<f64> {
    let bytes: u64 = hashes.iter().map(|h| images[h].len() as u64).sum();
    let image_len = images.values().next().map_or(0, |i| i.len());
    let batches: Vec<Vec<Arc<Vec<u8>>>> =
        hashes.chunks(args.batch).map(|c| c.iter().map(|h| images[h].clone()).collect()).collect();
    let listener = serving.spawn(TcpListener::bind("127.0.0.1:0")).await??;
    let addr = listener.local_addr()?;
    // The serving end accepts every lane, then writes once told to go.
    let (go, going) = tokio::sync::watch::channel(false);
    let lanes = args.lanes;
    let sends: Vec<Vec<Arc<Vec<u8>>>> = (0..lanes)
        .map(|lane| batches.iter().skip(lane).step_by(lanes).flat_map(|b| b.iter().cloned()).collect())
        .collect();
    let counts: Vec<usize> = sends.iter().map(Vec::len).collect();
    let writers = serving.spawn(async move {
        let mut writers = Vec::new();
        for send in sends {
            let (mut accepted, _) = listener.accept().await?;
            accepted.set_nodelay(true)?;
            let mut going = going.clone();
            writers.push(tokio::spawn(async move {
                going.wait_for(|&go| go).await?;
                for image in &send {
                    accepted.write_all(image).await?;
                }
                anyhow::Ok(())
            }));
        }
        for writer in writers {
            writer.await??;
        }
        anyhow::Ok(())
    });
    let mut streams = Vec::new();
    for _ in 0..lanes {
        streams.push(tokio::net::TcpStream::connect(addr).await?);
    }
    let started = Instant::now();
    go.send(true)?;
    let mut readers = Vec::new();
    for (mut stream, count) in streams.into_iter().zip(counts) {
        let landing = landing.cloned();
        readers.push(tokio::spawn(async move {
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
    for reader in readers {
        reader.await??;
    }
    writers.await??;
    Ok(bytes as f64 / started.elapsed().as_secs_f64() / 1e9)
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
