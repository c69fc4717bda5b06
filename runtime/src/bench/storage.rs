//! `dynamo-node bench storage`: G3 throughput against `fio` on the same device.
//!
//! For each block size and queue depth it writes `--total` bytes of sealed block images through a
//! fresh [`G3Store`] (the real store: io_uring with the G2 pool as fixed buffers, `O_DIRECT`), reads
//! them all back (each read verified: header, hash, payload checksum), and in the same run has fio
//! do the same sequential write and read on the same file system with the same block size, queue
//! depth, `O_DIRECT` and io_uring (fixed buffers, registered files). Repetitions interleave ours and
//! fio's, alternating which goes first, so drift on a shared device hits both; throughputs are
//! medians, and the ratio is the median of the per-repetition ratios (with their range).
//!
//! Image sealing (payload checksums) happens before the timed write, as it does in the node, where
//! the producer seals an image once and every tier reuses it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use dynamo_config::ByteSize;
use dynamo_tiering::block::{BlockHash, BlockLayout, HEADER_LEN, ImageSpec, RetentionMeta, Salt, payload_mut, seal};
use dynamo_tiering::g2::{HostPool, HostPoolOptions, MlockPolicy, SLOT_ALIGN};
use dynamo_tiering::g3::superblock::file_bytes;
use dynamo_tiering::g3::{EngineChoice, G3Options, G3Store, free_bytes};
use dynamo_tiering::io::uring::UringOptions;
use futures::StreamExt;
use serde::Serialize;

/// Options of `bench storage`.
#[derive(Debug, Args)]
pub struct StorageArgs {
    /// Directory on the device to measure (files are created there and removed afterwards).
    #[arg(long, value_name = "DIR")]
    pub dir: PathBuf,
    /// Block image sizes, comma-separated (each a multiple of 4 KiB).
    #[arg(long, value_delimiter = ',', default_value = "1MiB,4MiB", value_parser = parse_size)]
    pub block_size: Vec<ByteSize>,
    /// Queue depths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "32")]
    pub queue_depth: Vec<u32>,
    /// Bytes written and read per measurement.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub total: ByteSize,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Use the pread/pwrite engine instead of io_uring.
    #[arg(long)]
    pub psync: bool,
    /// Skip fio even when it is installed.
    #[arg(long)]
    pub no_fio: bool,
    /// Also write the rows as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

fn parse_size(s: &str) -> Result<ByteSize, String> {
    s.parse::<ByteSize>().map_err(|e| e.to_string())
}

/// One measured row.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Row {
    /// "write" or "read".
    pub op: &'static str,
    /// Bytes per block image.
    pub block_bytes: u64,
    /// Operations in flight.
    pub queue_depth: u32,
    /// The G3 store, GB/s (10^9 B/s).
    pub ours_gb_s: f64,
    /// fio, GB/s; `None` without fio.
    pub fio_gb_s: Option<f64>,
    /// ours / fio: the median of the per-repetition ratios.
    pub ratio: Option<f64>,
    /// Smallest per-repetition ratio.
    pub ratio_min: Option<f64>,
    /// Largest per-repetition ratio.
    pub ratio_max: Option<f64>,
}

#[derive(Serialize)]
struct Report<'a> {
    rows: &'a [Row],
    engine: &'static str,
    fio: Option<String>,
    dir: String,
}

/// Runs the benchmark and returns the printed report.
pub fn run(args: &StorageArgs) -> anyhow::Result<String> {
    if args.repeat == 0 {
        bail!("--repeat must be at least 1");
    }
    for bs in &args.block_size {
        let b = bs.as_u64();
        if b < 8192 || b % SLOT_ALIGN as u64 != 0 || b > 256 << 20 {
            bail!("--block-size {bs}: use a multiple of 4KiB between 8KiB and 256MiB");
        }
        if args.total.as_u64() < b {
            bail!("--total {} is smaller than --block-size {bs}", args.total);
        }
    }
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    let work = tempfile::Builder::new().prefix("dynamo-bench-storage-").tempdir_in(&args.dir)?;
    let fio = if args.no_fio { None } else { fio_version() };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut rows = Vec::new();
    for bs in &args.block_size {
        for &qd in &args.queue_depth {
            let (mut ow, mut or, mut fw, mut fr) = (vec![], vec![], vec![], vec![]);
            let (bytes, total) = (bs.as_u64(), args.total.as_u64());
            for rep in 0..args.repeat {
                // Alternate who goes first (ABBA) so drift on a shared device hits both alike.
                let fio_first = fio.is_some() && rep % 2 == 1;
                if fio_first {
                    fw.push(run_fio(work.path(), "write", bytes, qd, total)?);
                    fr.push(run_fio(work.path(), "read", bytes, qd, total)?);
                }
                let (w, r) = runtime.block_on(ours(work.path(), bytes as usize, qd, total, args.psync))?;
                ow.push(w);
                or.push(r);
                if fio.is_some() && !fio_first {
                    fw.push(run_fio(work.path(), "write", bytes, qd, total)?);
                    fr.push(run_fio(work.path(), "read", bytes, qd, total)?);
                }
            }
            for (op, ours, fio) in [("write", ow, fw), ("read", or, fr)] {
                // The ratio is the median of the per-repetition ratios: each pair ran back to
                // back, so it cancels slow drift that a ratio of two medians would not.
                let ratios: Vec<f64> = ours.iter().zip(&fio).map(|(o, f)| o / f).collect();
                let lo = ratios.iter().copied().reduce(f64::min);
                let hi = ratios.iter().copied().reduce(f64::max);
                rows.push(Row {
                    op,
                    block_bytes: bytes,
                    queue_depth: qd,
                    ours_gb_s: median(ours),
                    fio_gb_s: (!fio.is_empty()).then(|| median(fio)),
                    ratio: (!ratios.is_empty()).then(|| median(ratios)),
                    ratio_min: lo,
                    ratio_max: hi,
                });
            }
        }
    }
    let engine = if args.psync { "psync" } else { "uring" };
    if let Some(path) = &args.json {
        let report = Report { rows: &rows, engine, fio: fio.clone(), dir: args.dir.display().to_string() };
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(render(&rows, fio.as_deref(), engine, &args.dir))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

/// Writes then reads `total` bytes of images through a fresh store; returns (write, read) GB/s.
async fn ours(dir: &Path, block_bytes: usize, qd: u32, total: u64, psync: bool) -> anyhow::Result<(f64, f64)> {
    let n = (total / block_bytes as u64) as usize;
    let path = dir.join("ours").join("store.0");
    let _ = std::fs::remove_file(&path);
    let layout = BlockLayout::opaque_at_most(block_bytes - HEADER_LEN);
    let pool = HostPool::new(HostPoolOptions {
        slot_bytes: block_bytes,
        slots: (n + qd as usize + 1) as u32,
        mlock: MlockPolicy::Try,
    })?;
    let engine = if psync {
        EngineChoice::Psync { threads: qd as usize }
    } else {
        EngineChoice::Uring(UringOptions { queue_depth: qd, threads: 1, register_buffers: true })
    };
    let options = G3Options {
        format_foreign: false,
        paths: vec![path.clone()],
        capacity_per_path: file_bytes(n as u64, block_bytes as u64),
        slot_bytes: block_bytes,
        direct_io: true,
        engine,
    };
    let (store, _) = G3Store::open(&options, &pool)?;
    let store = Arc::new(store);
    let hashes: Vec<BlockHash> = (0..n as u128).map(|i| BlockHash(0x5eed_0000_0000_0000 ^ (i * 0x9E37_79B9))).collect();
    let mut images = Vec::with_capacity(n);
    for (i, &hash) in hashes.iter().enumerate() {
        let mut slot = pool.try_alloc().context("pool sized for every image")?;
        fill(payload_mut(slot.as_mut_slice(), &layout), i as u64);
        let spec = ImageSpec {
            hash,
            parent: i.checked_sub(1).map(|p| hashes[p]),
            salt: Salt(1),
            layout,
            token_count: 1,
            retention: RetentionMeta::default(),
        };
        seal(slot.as_mut_slice(), &spec);
        images.push(slot.freeze());
    }

    let start = Instant::now();
    let results: Vec<_> = futures::stream::iter(images.into_iter().map(|img| {
        let store = store.clone();
        async move { store.write(img).await }
    }))
    .buffer_unordered(qd as usize)
    .collect()
    .await;
    let write_s = start.elapsed().as_secs_f64();
    for r in results {
        r.context("G3 write failed during the benchmark")?;
    }

    let start = Instant::now();
    let results: Vec<_> = futures::stream::iter(hashes.iter().map(|&hash| {
        let (store, pool) = (store.clone(), pool.clone());
        async move {
            let dst = pool.try_alloc().expect("pool sized for the queue depth");
            store.read(hash, dst).await.map(drop).map_err(|f| f.error)
        }
    }))
    .buffer_unordered(qd as usize)
    .collect()
    .await;
    let read_s = start.elapsed().as_secs_f64();
    for r in results {
        r.context("G3 read failed during the benchmark")?;
    }
    drop(store);
    let _ = std::fs::remove_file(&path);
    let bytes = (n * block_bytes) as f64;
    Ok((bytes / write_s / 1e9, bytes / read_s / 1e9))
}

/// Fills a payload with cheap, non-repeating bytes (compressing or deduplicating devices cannot
/// shortcut it).
fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let bytes = x.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

fn fio_version() -> Option<String> {
    let out = Command::new("fio").arg("--version").output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Runs fio once; returns GB/s.
fn run_fio(dir: &Path, rw: &str, block_bytes: u64, qd: u32, total: u64) -> anyhow::Result<f64> {
    let file = dir.join("fio").join("data");
    std::fs::create_dir_all(file.parent().expect("has a parent"))?;
    if rw == "write" {
        let _ = std::fs::remove_file(&file);
    }
    let size = (total / block_bytes) * block_bytes;
    let out = Command::new("fio")
        .args([
            "--name=dynamo-g3",
            &format!("--filename={}", file.display()),
            &format!("--rw={rw}"),
            &format!("--bs={block_bytes}"),
            &format!("--size={size}"),
            &format!("--iodepth={qd}"),
            "--ioengine=io_uring",
            "--fixedbufs=1",
            "--registerfiles=1",
            "--direct=1",
            "--numjobs=1",
            "--output-format=json",
        ])
        .output()
        .context("running fio")?;
    if !out.status.success() {
        bail!("fio failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // fio may print notes before the JSON document.
    let json = &text[text.find('{').context("fio printed no JSON")?..];
    let v: serde_json::Value = serde_json::from_str(json).context("parsing fio's JSON")?;
    let bw = v["jobs"][0][rw]["bw_bytes"].as_f64().context("fio JSON without bw_bytes")?;
    Ok(bw / 1e9)
}

fn render(rows: &[Row], fio: Option<&str>, engine: &str, dir: &Path) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "G3 store ({engine}, O_DIRECT, verified reads) vs {} on {}",
        fio.unwrap_or("no fio"),
        dir.display()
    );
    let _ = writeln!(
        out,
        "{:<6} {:>8} {:>4} {:>10} {:>10} {:>9} {:>11}",
        "op", "block", "qd", "ours GB/s", "fio GB/s", "ours/fio", "range"
    );
    for r in rows {
        let f = r.fio_gb_s.map(|f| format!("{f:.3}")).unwrap_or_else(|| "-".into());
        let ratio = r.ratio.map(|x| format!("{x:.3}")).unwrap_or_else(|| "-".into());
        let range = match (r.ratio_min, r.ratio_max) {
            (Some(lo), Some(hi)) => format!("{lo:.2}-{hi:.2}"),
            _ => "-".into(),
        };
        let _ = writeln!(
            out,
            "{:<6} {:>8} {:>4} {:>10.3} {:>10} {:>9} {:>11}",
            r.op,
            ByteSize(r.block_bytes).to_string(),
            r.queue_depth,
            r.ours_gb_s,
            f,
            ratio,
            range
        );
    }
    if fio.is_none() {
        let _ = writeln!(out, "fio is not installed (Debian: apt-get install fio): no comparison in this run");
    }
    if let Some(best) = rows.iter().filter(|r| r.op == "read").max_by(|a, b| a.ours_gb_s.total_cmp(&b.ours_gb_s)) {
        let write = rows
            .iter()
            .find(|r| r.op == "write" && r.block_bytes == best.block_bytes && r.queue_depth == best.queue_depth)
            .map(|r| r.ours_gb_s)
            .unwrap_or(0.0);
        let free = free_bytes(dir).map(|b| ByteSize((b / 10 * 8) >> 30 << 30));
        let _ = writeln!(
            out,
            "\n# Suggested for this device (best read: {} images, queue depth {}):",
            ByteSize(best.block_bytes),
            best.queue_depth
        );
        let _ = writeln!(out, "[tiers.g3]");
        let _ = writeln!(out, "paths = [{:?}]", dir.join("g3").join("store.0").display().to_string());
        if let Some(free) = free.filter(|f| f.as_u64() > 0) {
            let _ = writeln!(out, "capacity_per_path = \"{free}\"   # 80% of the space free now");
        }
        let _ = writeln!(out, "io_engine = \"{engine}\"");
        let _ = writeln!(out, "queue_depth = {}", best.queue_depth);
        let _ = writeln!(out, "direct_io = true");
        let _ = writeln!(out, "read_gb_s = {:.2}    # measured; the router's cost model uses it", best.ours_gb_s);
        let _ = writeln!(out, "write_gb_s = {write:.2}");
    }
    out
}
