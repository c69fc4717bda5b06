//! The start-up scan that rebuilds a store's index from slot headers, on tokio-uring.
//!
//! It reads only the first 4 KiB of each slot — the header — with up to [`SCAN_WINDOW`] reads in
//! flight per file, all files at once, on one dedicated thread running a tokio-uring runtime. A
//! header must decode with a valid checksum to count; payloads are verified later, on every read,
//! so a restart costs one small read per slot rather than reading the whole disk.

use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use futures::StreamExt;
use futures::stream::FuturesUnordered;

use crate::block::ImageHeader;
use crate::io::aligned::AlignedBuf;

/// Header reads in flight per file.
pub const SCAN_WINDOW: usize = 64;

/// One file to scan.
#[derive(Clone, Debug)]
pub struct ScanFile {
    /// Path of the file or device.
    pub path: PathBuf,
    /// Slots to read.
    pub slots: u64,
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Where slot 0 starts.
    pub data_offset: u64,
    /// Open with O_DIRECT.
    pub direct: bool,
}

/// A slot whose header decoded.
#[derive(Clone, Copy, Debug)]
pub struct FoundImage {
    /// File index in the scan list.
    pub file: u32,
    /// Slot within the file.
    pub slot: u32,
    /// The header.
    pub header: ImageHeader,
}

/// What the scan saw.
#[derive(Debug, Default)]
pub struct ScanResult {
    /// Slots whose header is valid.
    pub found: Vec<FoundImage>,
    /// Slots that held something that was not a valid header (torn or corrupt writes); empty
    /// (all-zero) slots are not counted.
    pub invalid: u64,
}

/// Scans every file; blocks the calling thread until done.
pub fn scan(files: Vec<ScanFile>) -> io::Result<ScanResult> {
    std::thread::Builder::new()
        .name("g3-scan".into())
        .spawn(move || tokio_uring::start(scan_all(files)))?
        .join()
        .map_err(|_| io::Error::other("G3 scan thread panicked"))?
}

async fn scan_all(files: Vec<ScanFile>) -> io::Result<ScanResult> {
    let per_file = futures::future::join_all(files.into_iter().enumerate().map(|(i, f)| scan_file(i as u32, f))).await;
    let mut out = ScanResult::default();
    for r in per_file {
        let r = r?;
        out.found.extend(r.found);
        out.invalid += r.invalid;
    }
    Ok(out)
}

async fn scan_file(file_index: u32, f: ScanFile) -> io::Result<ScanResult> {
    let mut opts = tokio_uring::fs::OpenOptions::new();
    opts.read(true);
    if f.direct {
        opts.custom_flags(libc::O_DIRECT);
    }
    let file = opts.open(&f.path).await?;
    let mut out = ScanResult::default();
    let mut inflight = FuturesUnordered::new();
    let mut next = 0u64;
    let mut spare: Vec<AlignedBuf> = Vec::new();
    loop {
        while next < f.slots && inflight.len() < SCAN_WINDOW {
            let buf = spare.pop().unwrap_or_else(|| AlignedBuf::new(4096));
            let slot = next;
            let pos = f.data_offset + slot * f.slot_bytes;
            let file = &file;
            inflight.push(async move {
                let (res, buf) = file.read_at(buf, pos).await;
                (slot, res, buf)
            });
            next += 1;
        }
        let Some((slot, res, buf)) = inflight.next().await else { break };
        let n = res?;
        let bytes = &buf.as_slice()[..n];
        match ImageHeader::decode_header_only(bytes) {
            Ok(header) if header.image_bytes() as u64 <= f.slot_bytes => {
                out.found.push(FoundImage { file: file_index, slot: slot as u32, header })
            }
            Ok(_) => out.invalid += 1,
            Err(_) if bytes.iter().all(|&b| b == 0) => {}
            Err(_) => out.invalid += 1,
        }
        spare.push(buf);
    }
    drop(inflight);
    file.close().await?;
    Ok(out)
}
