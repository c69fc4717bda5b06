//! The G3 store against the `foyer` hybrid cache, storing the same block images on the same file system.
//!
//! For each image size (1 MiB and 4 MiB) both sides hold one pass of images (256 MiB by default) and are
//! measured writing all of them and then reading all of them back, in GB/s of image bytes. Both use
//! `O_DIRECT` files in two subdirectories of one temporary directory, created under `$DYNAMO_BENCH_DIR`
//! (default: the system temp dir), and io_uring at queue depth 32 on one ring thread.
//!
//! **G3** (ours): a [`HostPool`] holds the sealed images plus room for the reads in flight; a write pass
//! is `G3Store::write` of every image with 32 in flight (`buffer_unordered`), a read pass is
//! `G3Store::read` of every image into a fresh pool slot, 32 in flight — each read verified (header
//! checksum, block hash, payload checksum) before it counts. Between write passes the blocks are
//! removed (untimed) so that the next pass writes them again into the preallocated file.
//!
//! **foyer** (the peer): a `HybridCache<u64, Bytes>` whose values are the very same image bytes (a
//! `Bytes` clone per insert, so no copy is added on our side of foyer's API). How it is set up, and why:
//! - *memory tier of one image* (`memory(image)`, one shard, weighed by value length), so that reads
//!   cannot be served from memory; the memory tier is also cleared (untimed) before each read pass.
//! - *write on insertion* (`HybridCachePolicy::WriteOnInsertion`): every insert is queued for disk at
//!   once rather than when memory evicts it.
//! - *flushed before it counts*: `HybridCache::insert` only queues the entry; a write pass inserts every
//!   image and then awaits `HybridCache::storage().wait()`, which pushes a marker through each flusher's
//!   queue and resolves only after every batch queued before it has been written to the device (and any
//!   reclaim has finished). The pass is timed from the first insert to that point. Then (untimed) every
//!   key of the pass must be in foyer's index — after `wait` only entries that reached the device are.
//! - *nothing dropped*: foyer is a lossy cache by design — an entry is dropped when the submit queue is
//!   over its threshold, or when its flusher's buffer is full while the previous batch is still being
//!   written. So the submit-queue threshold is two passes and each of the 2 flushers gets a buffer of a
//!   whole pass (plus a block): foyer's best case, fewest and largest writes, at the cost of ~1 GiB of
//!   buffers that a deployment would not spend (with the 16 MiB default, a burst that outruns the disk
//!   loses images: 8 of 64 in a 64 MiB trial pass here).
//! - *direct I/O*: `FsDeviceBuilder::with_direct(true)` opens each of its partition files with
//!   `O_DIRECT | O_NOATIME`, bypassing the page cache as G3 does.
//! - *I/O engine*: `UringIoEngineConfig` with one thread and an I/O depth of 32 (foyer's io_uring engine
//!   does not register buffers; G3 registers its pool).
//! - *block engine*: 16 MiB blocks (foyer's default) and a device of four passes, so that each write
//!   pass lands on fresh keys and foyer's FIFO reclaim recycles old blocks in the background, as it
//!   would in service. A read pass reads the keys of the last write pass
//!   through `HybridCache::get` (32 in flight); each must hit, and `disk_read_bytes` must grow by at least
//!   the pass's bytes, which proves the reads came from the device.
//!
//! Criterion groups `g3_vs_foyer/{write,read}/{1,4}MiB` time the passes with `iter_custom`. After them a
//! table is printed from the same process: best of three passes per cell, G3 and foyer passes interleaved,
//! with the ratio G3 ÷ foyer throughput (above 1: G3 is faster).
//!
//! Run with `cargo bench -p dynamo-benches --features peers --bench g3_vs_foyer`; set
//! `DYNAMO_BENCH_DIR` to put the files on the disk under test, and `DYNAMO_BENCH_PASS_MIB` to change the
//! bytes per pass.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, SamplingMode, Throughput};
use dynamo_tiering::block::{BlockHash, BlockLayout, HEADER_LEN, ImageSpec, RetentionMeta, Salt, payload_mut, seal};
use dynamo_tiering::g2::{HostPool, HostPoolOptions, MlockPolicy, SlotRef};
use dynamo_tiering::g3::superblock::file_bytes;
use dynamo_tiering::g3::{EngineChoice, G3Options, G3Store, WriteOutcome};
use dynamo_tiering::io::uring::{UringEngine, UringOptions};
use foyer::{
    BlockEngineConfig, DeviceBuilder, FsDeviceBuilder, HybridCache, HybridCacheBuilder, HybridCachePolicy,
    IoEngineConfig, UringIoEngineConfig,
};
use futures::{StreamExt, stream};
use tokio::runtime::Runtime;

const MIB: usize = 1 << 20;
const IMAGE_SIZES: [usize; 2] = [MIB, 4 * MIB];
const QUEUE_DEPTH: usize = 32;
const DEFAULT_PASS_MIB: usize = 256;
const WARM_UP: Duration = Duration::from_secs(1);
const MEASUREMENT: Duration = Duration::from_secs(3);
/// Passes per cell of the final table; the best one counts.
const TABLE_REPS: usize = 3;
const FOYER_BLOCK: usize = 16 * MIB;
const FOYER_FLUSHERS: usize = 2;
/// foyer's device holds this many passes, so fresh keys per pass never wait on a full device for long.
const FOYER_PASSES_ON_DEVICE: usize = 4;

fn pass_bytes() -> usize {
    std::env::var("DYNAMO_BENCH_PASS_MIB").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(DEFAULT_PASS_MIB) * MIB
}

fn bench_root() -> PathBuf {
    std::env::var_os("DYNAMO_BENCH_DIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir)
}

/// Whether criterion was asked only to smoke-test or list the benches (`--test`, `--list`).
fn quick_mode() -> bool {
    std::env::args().any(|a| a == "--test" || a == "--list")
}

fn size_label(image_bytes: usize) -> String {
    format!("{}MiB", image_bytes / MIB)
}

fn yes_no(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

fn gbps(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e9
}

/// Fills `buf` with pseudo-random bytes (splitmix64) seeded by `seed`, so every image is distinct.
fn fill(buf: &mut [u8], seed: u64) {
    let mut state = seed;
    for chunk in buf.chunks_mut(8) {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
    }
}

/// What is timed: one pass over every image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Write,
    Read,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Write => "write",
            Op::Read => "read",
        }
    }
}

/// A store under test. A read pass reads what the last write pass wrote.
trait Side {
    /// Whether a write pass has run, so that there is something to read.
    fn has_written(&self) -> bool;
    async fn write_pass(&mut self) -> Duration;
    async fn read_pass(&mut self) -> Duration;

    async fn pass(&mut self, op: Op) -> Duration {
        match op {
            Op::Write => self.write_pass().await,
            Op::Read => self.read_pass().await,
        }
    }
}

/// Runs `iters` passes and returns their total time (what `iter_custom` wants). Reads are preceded by an
/// untimed write pass when none has run (a filter such as `-- read` skips the write benches).
fn run_passes(rt: &Runtime, side: &mut impl Side, op: Op, iters: u64) -> Duration {
    rt.block_on(async {
        if op == Op::Read && !side.has_written() {
            side.write_pass().await;
        }
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            total += side.pass(op).await;
        }
        total
    })
}

/// Our side: a G3 store on one `O_DIRECT` file and the G2 pool its images live in.
struct Ours {
    store: G3Store,
    pool: HostPool,
    images: Vec<(BlockHash, SlotRef)>,
    image_bytes: usize,
    resident: bool,
    /// Whether io_uring took the pool as fixed buffers.
    fixed_buffers: bool,
}

impl Ours {
    fn describe(&self) -> String {
        format!(
            "G3 {}: engine {}, fixed buffers {}, pool mlocked {}",
            size_label(self.image_bytes),
            self.store.engine_name(),
            yes_no(self.fixed_buffers),
            yes_no(self.pool.is_locked())
        )
    }

    fn open(dir: &Path, image_bytes: usize, count: usize) -> Self {
        let layout = BlockLayout::opaque(image_bytes - HEADER_LEN);
        assert_eq!(layout.image_bytes(), image_bytes, "an image fills its slot exactly");
        // The sealed images, plus the reads in flight and the results not yet dropped.
        let slots = u32::try_from(count + 2 * QUEUE_DEPTH).expect("slot count fits u32");
        let pool = HostPool::new(HostPoolOptions { slot_bytes: image_bytes, slots, mlock: MlockPolicy::Try })
            .expect("G2 pool");
        let options = G3Options {
            format_foreign: false,
            paths: vec![dir.join("g3.dat")],
            capacity_per_path: file_bytes(count as u64 + 1, image_bytes as u64),
            slot_bytes: image_bytes,
            direct_io: true,
            engine: EngineChoice::Uring(UringOptions {
                queue_depth: QUEUE_DEPTH as u32,
                threads: 1,
                register_buffers: true,
            }),
        };
        let (store, _recovery) = G3Store::open(&options, &pool).expect("open G3 store");
        // The store hides its engine; a probe engine over the same pool says whether the kernel accepted the
        // pool as fixed buffers (it may refuse under a low memlock limit, and the store then uses plain I/O).
        let EngineChoice::Uring(uring) = options.engine else { unreachable!("the bench opens G3 on io_uring") };
        let probe = Arc::new(File::create(dir.join("probe")).expect("probe file"));
        let fixed_buffers = UringEngine::new(&[probe], Some(&pool), uring).is_ok_and(|e| e.uses_fixed_buffers());
        let _ = std::fs::remove_file(dir.join("probe"));
        let images = (0..count as u64)
            .map(|i| {
                let hash = BlockHash(0xB10C_0000_0000_0000_0000_0000_0000_0000 | u128::from(i));
                let mut slot = pool.try_alloc().expect("a pool slot per image");
                fill(payload_mut(slot.as_mut_slice(), &layout), i);
                let spec = ImageSpec {
                    hash,
                    parent: None,
                    salt: Salt(7),
                    layout,
                    token_count: 1,
                    retention: RetentionMeta::default(),
                };
                seal(slot.as_mut_slice(), &spec);
                (hash, slot.freeze())
            })
            .collect();
        Self { store, pool, images, image_bytes, resident: false, fixed_buffers }
    }
}

impl Side for Ours {
    fn has_written(&self) -> bool {
        self.resident
    }

    /// Writes every image (32 in flight); returns the time from the first submission to the last completion.
    async fn write_pass(&mut self) -> Duration {
        if self.resident {
            for (hash, _) in &self.images {
                self.store.remove(*hash);
            }
        }
        let store = &self.store;
        let start = Instant::now();
        let written = stream::iter(self.images.iter().map(|(_, slot)| slot.clone()))
            .map(|slot| store.write(slot))
            .buffer_unordered(QUEUE_DEPTH)
            .fold(0usize, |n, outcome| async move {
                assert_eq!(outcome.expect("G3 write"), WriteOutcome::Written);
                n + 1
            })
            .await;
        let elapsed = start.elapsed();
        assert_eq!(written, self.images.len());
        self.resident = true;
        elapsed
    }

    /// Reads and verifies every image (32 in flight) into fresh pool slots.
    async fn read_pass(&mut self) -> Duration {
        assert!(self.resident, "read pass before any write pass");
        let (store, pool, image_bytes) = (&self.store, &self.pool, self.image_bytes);
        let start = Instant::now();
        let read = stream::iter(self.images.iter().map(|(hash, _)| *hash))
            .map(|hash| async move {
                let dst = pool.try_alloc().expect("a free pool slot to read into");
                store.read(hash, dst).await.expect("G3 read")
            })
            .buffer_unordered(QUEUE_DEPTH)
            .fold(0usize, |n, slot| async move {
                assert_eq!(slot.as_slice().len(), image_bytes);
                n + 1
            })
            .await;
        let elapsed = start.elapsed();
        assert_eq!(read, self.images.len());
        elapsed
    }
}

/// The peer: a foyer hybrid cache with a one-image memory tier over an `O_DIRECT` directory device.
struct Peer {
    cache: HybridCache<u64, Bytes>,
    values: Vec<Bytes>,
    image_bytes: usize,
    next_key: u64,
    resident: Option<u64>,
}

impl Peer {
    async fn open(dir: &Path, image_bytes: usize, values: Vec<Bytes>) -> Self {
        let pass = values.len() * image_bytes;
        let device = FsDeviceBuilder::new(dir)
            .with_capacity((FOYER_PASSES_ON_DEVICE * pass).next_multiple_of(FOYER_BLOCK))
            .with_direct(true)
            .build()
            .expect("foyer device");
        // foyer converts only its psync config with `Into`; the io_uring one is passed as a trait object.
        let io_engine: Box<dyn IoEngineConfig> =
            Box::new(UringIoEngineConfig::new().with_threads(1).with_io_depth(QUEUE_DEPTH));
        let cache = HybridCacheBuilder::new()
            .with_name("g3-vs-foyer")
            .with_policy(HybridCachePolicy::WriteOnInsertion)
            .with_flush_on_close(false)
            .memory(image_bytes)
            .with_shards(1)
            .with_weighter(|_: &u64, value: &Bytes| value.len())
            .storage()
            .with_io_engine_config(io_engine)
            .with_engine_config(
                BlockEngineConfig::new(device)
                    .with_block_size(FOYER_BLOCK)
                    .with_flushers(FOYER_FLUSHERS)
                    .with_buffer_pool_size(FOYER_FLUSHERS * (pass + FOYER_BLOCK))
                    .with_submit_queue_size_threshold(2 * pass),
            )
            .build()
            .await
            .expect("foyer hybrid cache");
        Self { cache, values, image_bytes, next_key: 0, resident: None }
    }

    fn pass_bytes(&self) -> usize {
        self.values.len() * self.image_bytes
    }
}

impl Side for Peer {
    fn has_written(&self) -> bool {
        self.resident.is_some()
    }

    /// Inserts every image under fresh keys and waits until foyer has written them all to the device.
    async fn write_pass(&mut self) -> Duration {
        let first = self.next_key;
        self.next_key += self.values.len() as u64;
        let start = Instant::now();
        for (key, value) in (first..).zip(&self.values) {
            drop(self.cache.insert(key, value.clone()));
        }
        self.cache.storage().wait().await;
        let elapsed = start.elapsed();
        // After `wait`, an entry is in foyer's index only if it reached the device; one it dropped is not.
        let dropped = (first..self.next_key).filter(|key| !self.cache.storage().may_contains(key)).count();
        assert_eq!(dropped, 0, "foyer dropped {dropped} of {} images", self.values.len());
        self.resident = Some(first);
        elapsed
    }

    /// Gets every image of the last write pass (32 in flight) with the memory tier emptied first.
    async fn read_pass(&mut self) -> Duration {
        let first = self.resident.expect("read pass before any write pass");
        self.cache.memory().clear();
        let (cache, image_bytes) = (&self.cache, self.image_bytes);
        let stats = self.cache.statistics().clone();
        let before = stats.disk_read_bytes();
        let start = Instant::now();
        let read = stream::iter(first..first + self.values.len() as u64)
            .map(|key| async move { cache.get(&key).await.expect("foyer get").expect("foyer lost an image") })
            .buffer_unordered(QUEUE_DEPTH)
            .fold(0usize, |n, entry| async move {
                assert_eq!(entry.value().len(), image_bytes);
                n + 1
            })
            .await;
        let elapsed = start.elapsed();
        assert_eq!(read, self.values.len());
        let from_disk = stats.disk_read_bytes() - before;
        assert!(
            from_disk >= self.pass_bytes(),
            "foyer read {from_disk} B from disk for a {} B pass",
            self.pass_bytes()
        );
        elapsed
    }
}

/// One line of the final table.
struct Row {
    image_bytes: usize,
    op: &'static str,
    ours: f64,
    peer: f64,
}

fn main() {
    let pass = pass_bytes();
    let rt = Runtime::new().expect("tokio runtime");
    let root = tempfile::Builder::new().prefix("g3-vs-foyer-").tempdir_in(bench_root()).expect("bench directory");
    let mut c =
        Criterion::default().warm_up_time(WARM_UP).measurement_time(MEASUREMENT).sample_size(10).configure_from_args();
    let mut rows = Vec::new();
    let mut setups = Vec::new();

    for image_bytes in IMAGE_SIZES {
        let label = size_label(image_bytes);
        let count = pass / image_bytes;
        let g3_dir = root.path().join("g3").join(&label);
        let foyer_dir = root.path().join("foyer").join(&label);
        let mut ours = Ours::open(&g3_dir, image_bytes, count);
        let values = ours.images.iter().map(|(_, slot)| Bytes::copy_from_slice(slot.as_slice())).collect();
        let mut peer = rt.block_on(Peer::open(&foyer_dir, image_bytes, values));
        setups.push(ours.describe());
        let bytes = (count * image_bytes) as u64;

        for op in [Op::Write, Op::Read] {
            let mut group = c.benchmark_group(format!("g3_vs_foyer/{}/{label}", op.name()));
            group.throughput(Throughput::Bytes(bytes)).sampling_mode(SamplingMode::Flat);
            group.bench_function("g3", |b| b.iter_custom(|iters| run_passes(&rt, &mut ours, op, iters)));
            group.bench_function("foyer", |b| b.iter_custom(|iters| run_passes(&rt, &mut peer, op, iters)));
            group.finish();
        }
        if !quick_mode() {
            // Writes first (a read pass reads the last write pass), G3 and foyer passes interleaved.
            for op in [Op::Write, Op::Read] {
                let (mut ours_best, mut peer_best) = (Duration::MAX, Duration::MAX);
                for _ in 0..TABLE_REPS {
                    ours_best = ours_best.min(run_passes(&rt, &mut ours, op, 1));
                    peer_best = peer_best.min(run_passes(&rt, &mut peer, op, 1));
                }
                rows.push(Row {
                    image_bytes,
                    op: op.name(),
                    ours: gbps(bytes as usize, ours_best),
                    peer: gbps(bytes as usize, peer_best),
                });
            }
        }
        rt.block_on(peer.cache.close()).expect("close foyer");
        drop(peer);
        drop(ours);
        let _ = std::fs::remove_dir_all(&g3_dir);
        let _ = std::fs::remove_dir_all(&foyer_dir);
    }
    c.final_summary();

    if quick_mode() {
        return;
    }
    println!();
    println!(
        "g3_vs_foyer: {} MiB per pass, queue depth {QUEUE_DEPTH}, O_DIRECT under {}, best of {TABLE_REPS} interleaved passes",
        pass / MIB,
        bench_root().display()
    );
    for setup in &setups {
        println!("{setup}");
    }
    println!("{:>6}  {:>5}  {:>8}  {:>10}  {:>8}", "image", "op", "G3 GB/s", "foyer GB/s", "G3/foyer");
    for row in &rows {
        println!(
            "{:>6}  {:>5}  {:>8.2}  {:>10.2}  {:>8.2}",
            size_label(row.image_bytes),
            row.op,
            row.ours,
            row.peer,
            row.ours / row.peer
        );
    }
}
