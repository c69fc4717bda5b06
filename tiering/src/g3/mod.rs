//! G3: the node's NVMe tier — block images in fixed-size, 4 KiB-aligned slots of files or raw
//! block devices opened `O_DIRECT`.
//!
//! ```text
//! file:  [superblock 4 KiB … up to the slot size][slot 0][slot 1] … [slot n-1]
//!                                                 slot = align_up(header + payload)
//! ```
//!
//! The store moves images between G2 slots and disk slots through an [`IoEngine`] (io_uring with
//! the G2 pool as fixed buffers by default), keeps an in-memory index `hash → (file, slot)`, and
//! stripes new blocks across files. It decides nothing about *which* blocks to keep: the tier's
//! [`crate::registry::TierRegistry`] chooses victims and the caller [`G3Store::remove`]s them.
//!
//! Every read is verified (magic, header checksum, block hash, payload checksum) before the slot is
//! handed out; a block that fails is counted, dropped from the index, and reported as an error, so
//! the caller recomputes it. A failed write (a full disk, an I/O error) fails that block only.
//!
//! Headers make the store self-describing: on open, a tokio-uring scan ([`scan`]) reads every
//! slot's header and rebuilds the index; what it finds is returned, and
//! [`G3Store::open_recovered`] ([`recover`]) rebuilds the tier's registry from it (retention
//! metadata travels in the header).

pub mod recover;
pub mod scan;
pub mod superblock;

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::block::{BlockHash, BlockMap, ImageError, ImageHeader, verify_image};
use crate::g2::{HostPool, SLOT_ALIGN, SlotMut, SlotRef, align_up};
use crate::io::psync::PsyncEngine;
use crate::io::uring::{UringEngine, UringOptions};
use crate::io::{IoBuf, IoEngine, IoRequest};
use crate::registry::RegistryError;
pub use recover::Recovered;
use superblock::{SUPERBLOCK_LEN, Superblock};

/// Which engine a store drives its files with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineChoice {
    /// io_uring (falls back to psync, with a warning, where io_uring is unavailable).
    Uring(UringOptions),
    /// `pread`/`pwrite` on this many threads.
    Psync {
        /// Threads, i.e. operations in flight.
        threads: usize,
    },
}

/// How a [`G3Store`] is opened.
#[derive(Clone, Debug, PartialEq)]
pub struct G3Options {
    /// Files or block devices. Files are created (with parent directories) and sized.
    pub paths: Vec<PathBuf>,
    /// Bytes per file (ignored for block devices, which use their whole size).
    pub capacity_per_path: u64,
    /// Bytes per slot: at least the largest image, rounded up to 4 KiB.
    pub slot_bytes: usize,
    /// Open with `O_DIRECT` (bypass the page cache).
    pub direct_io: bool,
    /// The I/O engine.
    pub engine: EngineChoice,
    /// Format a path that already holds data other than a G3 store (`tiers.g3.format_foreign`).
    /// Off, such a path is refused ([`G3Error::Foreign`]): a typo in a device path must not
    /// wipe the device.
    pub format_foreign: bool,
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum G3Error {
    /// A file could not be opened or sized.
    #[error("G3 file {path}: {source}")]
    Open {
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The path holds data that is not a G3 store, and formatting it was not asked for.
    #[error(
        "G3 path {path} already holds {bytes} bytes of data that is not a dynamo-node G3 store{}; refusing to \
         format it. Point tiers.g3.paths at a new file, or set tiers.g3.format_foreign = true to overwrite it",
        what.map(|w| format!(" (it looks like {w})")).unwrap_or_default()
    )]
    Foreign {
        /// The path.
        path: PathBuf,
        /// Its size.
        bytes: u64,
        /// What it looks like, when a known signature says.
        what: Option<&'static str>,
    },
    /// The file system has less free space than the file needs.
    #[error(
        "G3 file {path} needs {} more but its file system has {} free; lower tiers.g3.capacity_per_path \
         or free some space",
        human_bytes(*needed),
        human_bytes(*free)
    )]
    NoRoom {
        /// The path.
        path: PathBuf,
        /// Bytes the file still needs.
        needed: u64,
        /// Bytes free on its file system.
        free: u64,
    },
    /// The file system refuses `O_DIRECT` (tmpfs, some overlay file systems).
    #[error(
        "G3 file {path}: the file system does not support O_DIRECT; put G3 on a real disk or set tiers.g3.direct_io = false"
    )]
    DirectIoUnsupported {
        /// The path.
        path: PathBuf,
    },
    /// No free slot: the caller must evict first.
    #[error("G3 is full ({slots} slots)")]
    Full {
        /// Slots in the store.
        slots: u64,
    },
    /// The device has no space left (ENOSPC/EDQUOT).
    #[error("G3 device is out of space: {0}")]
    NoSpace(io::Error),
    /// Any other I/O error.
    #[error("G3 I/O error: {0}")]
    Io(io::Error),
    /// The block read back failed verification; it has been dropped.
    #[error("G3 block {hash} failed verification ({source}); dropped")]
    Corrupt {
        /// The block.
        hash: BlockHash,
        /// What failed.
        source: ImageError,
    },
    /// The block is not in the store.
    #[error("block {0} is not in G3")]
    NotFound(BlockHash),
    /// The image does not fit a slot.
    #[error("image of {image} bytes does not fit a {slot}-byte G3 slot")]
    TooLarge {
        /// Image bytes.
        image: usize,
        /// Slot bytes.
        slot: usize,
    },
    /// The buffer to write is not a sealed image.
    #[error("refusing to write an unsealed image: {0}")]
    NotAnImage(ImageError),
    /// A block recovered on open could not be registered in the tier's registry.
    #[error("rebuilding the G3 registry: recovered block {hash}: {source}")]
    Unregistered {
        /// The block.
        hash: BlockHash,
        /// What the registry said.
        source: RegistryError,
    },
}

impl G3Error {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            G3Error::Open { .. } => "open",
            G3Error::Foreign { .. } => "foreign",
            G3Error::NoRoom { .. } => "no_room",
            G3Error::DirectIoUnsupported { .. } => "direct_io",
            G3Error::Full { .. } => "full",
            G3Error::NoSpace(_) => "no_space",
            G3Error::Io(_) => "io",
            G3Error::Corrupt { .. } => "corrupt",
            G3Error::NotFound(_) => "not_found",
            G3Error::TooLarge { .. } => "too_large",
            G3Error::NotAnImage(_) => "not_an_image",
            G3Error::Unregistered { .. } => "unregistered",
        }
    }

    fn from_io(e: io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT) => G3Error::NoSpace(e),
            _ => G3Error::Io(e),
        }
    }
}

/// A failed read: the error, and the destination slot back when the engine returned it.
#[derive(Debug)]
pub struct ReadFailure {
    /// The destination slot, for reuse.
    pub buf: Option<SlotMut>,
    /// What went wrong.
    pub error: G3Error,
}

/// What a write did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// The image is on disk now.
    Written,
    /// The block was already present (or being written): nothing written.
    AlreadyPresent,
}

/// What the store found when it opened.
#[derive(Debug, Default)]
pub struct Recovery {
    /// Headers of the blocks recovered, for rebuilding the registry.
    pub blocks: Vec<ImageHeader>,
    /// Slots that held something invalid (torn or corrupt), now free.
    pub invalid_slots: u64,
    /// Duplicate images of one block (all but one freed).
    pub duplicates: u64,
    /// Files that were (re)formatted because they were new or had another slot size.
    pub formatted_files: usize,
}

/// Counters of a store (monotonic).
#[derive(Debug, Default)]
pub struct G3Stats {
    /// Images written.
    pub writes: AtomicU64,
    /// Bytes written.
    pub write_bytes: AtomicU64,
    /// Writes that failed (any reason but `Full`).
    pub write_errors: AtomicU64,
    /// Writes skipped because the block was present.
    pub duplicate_writes: AtomicU64,
    /// Images read and verified.
    pub reads: AtomicU64,
    /// Bytes read.
    pub read_bytes: AtomicU64,
    /// Reads that failed with an I/O error.
    pub read_errors: AtomicU64,
    /// Reads that failed verification.
    pub corrupt: AtomicU64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Free,
    Writing(BlockHash),
    Live {
        hash: BlockHash,
        readers: u32,
    },
    /// Removed while being read; freed when the last reader finishes.
    Retired {
        readers: u32,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Loc {
    file: u32,
    slot: u32,
}

#[derive(Debug)]
struct Index {
    map: BlockMap<Loc>,
    slots: Vec<Vec<SlotState>>,
    free: Vec<Vec<u32>>,
    next_file: usize,
    live: usize,
}

impl Index {
    fn alloc(&mut self) -> Option<Loc> {
        let n = self.free.len();
        for i in 0..n {
            let file = (self.next_file + i) % n;
            if let Some(slot) = self.free[file].pop() {
                self.next_file = (file + 1) % n;
                return Some(Loc { file: file as u32, slot });
            }
        }
        None
    }

    fn state(&mut self, loc: Loc) -> &mut SlotState {
        &mut self.slots[loc.file as usize][loc.slot as usize]
    }

    fn free_slot(&mut self, loc: Loc) {
        *self.state(loc) = SlotState::Free;
        self.free[loc.file as usize].push(loc.slot);
    }

    /// Drops `hash` if it still lives at `loc`; frees the slot now or after its readers.
    fn drop_entry(&mut self, hash: BlockHash, loc: Loc) -> bool {
        if self.map.get(&hash) != Some(&loc) {
            return false;
        }
        match *self.state(loc) {
            SlotState::Live { readers, .. } => {
                self.map.remove(&hash);
                self.live -= 1;
                if readers == 0 {
                    self.free_slot(loc);
                } else {
                    *self.state(loc) = SlotState::Retired { readers };
                }
                true
            }
            _ => false,
        }
    }

    fn end_read(&mut self, loc: Loc) {
        match self.state(loc) {
            SlotState::Live { readers, .. } => *readers -= 1,
            SlotState::Retired { readers } => {
                *readers -= 1;
                if *readers == 0 {
                    self.free_slot(loc);
                }
            }
            other => debug_assert!(false, "reader finished on a {other:?} slot"),
        }
    }
}

/// The G3 store. Share it behind an `Arc`; every method takes `&self`.
#[derive(Debug)]
pub struct G3Store {
    engine: Arc<dyn IoEngine>,
    paths: Vec<PathBuf>,
    slot_bytes: usize,
    /// Per file, where its slot 0 starts.
    data_offsets: Vec<u64>,
    total_slots: u64,
    index: Mutex<Index>,
    stats: G3Stats,
    _pool: HostPool,
}

impl G3Store {
    /// Opens (creating and sizing as needed) the store's files, starts its engine, and rebuilds
    /// the index from the slot headers. Blocks while it scans.
    pub fn open(options: &G3Options, pool: &HostPool) -> Result<(Self, Recovery), G3Error> {
        Self::open_wrapped(options, pool, |engine| engine)
    }

    /// Like [`G3Store::open`], with the engine passed through `wrap` (fault injection in tests).
    pub fn open_wrapped(
        options: &G3Options,
        pool: &HostPool,
        wrap: impl FnOnce(Arc<dyn IoEngine>) -> Arc<dyn IoEngine>,
    ) -> Result<(Self, Recovery), G3Error> {
        let slot_bytes = align_up(options.slot_bytes.max(SLOT_ALIGN));
        if pool.slot_bytes() < slot_bytes {
            return Err(G3Error::TooLarge { image: slot_bytes, slot: pool.slot_bytes() });
        }
        let mut recovery = Recovery::default();
        // What this open created, removed again if it fails: a failed start leaves the disk as
        // it found it.
        let mut created = Created::default();
        let opened = Self::open_files(options, &mut created, &mut recovery, slot_bytes);
        let opened = opened
            .and_then(|(files, slots, scan)| Self::finish_open(options, pool, wrap, files, slots, scan, recovery));
        if opened.is_err() {
            created.remove();
        }
        opened
    }

    #[allow(clippy::type_complexity)]
    fn open_files(
        options: &G3Options,
        created: &mut Created,
        recovery: &mut Recovery,
        slot_bytes: usize,
    ) -> Result<(Vec<Arc<File>>, Vec<u32>, Vec<scan::ScanFile>), G3Error> {
        let mut files = Vec::new();
        let mut per_file_slots = Vec::new();
        let mut scan_list = Vec::new();
        for (i, path) in options.paths.iter().enumerate() {
            let (file, bytes) = open_file(path, options, created)?;
            let mut sb = AlignedSuper::new();
            let existing = read_superblock(&file, &mut sb, path)?;
            // A file formatted for this slot size keeps its layout (and its blocks).
            let kept = existing.filter(|old| old.slot_bytes == slot_bytes as u64);
            let data_offset = kept.map_or(superblock::data_offset(slot_bytes as u64), |old| old.data_offset);
            let slots = (bytes.saturating_sub(data_offset) / slot_bytes as u64).min(u32::MAX as u64);
            let wanted = Superblock { slot_bytes: slot_bytes as u64, slots, file_index: i as u32, data_offset };
            let slot_bytes = slot_bytes as u64;
            match kept {
                Some(old) => {
                    scan_list.push(scan::ScanFile {
                        path: path.clone(),
                        slots: old.slots.min(slots),
                        slot_bytes,
                        data_offset,
                        direct: options.direct_io,
                    });
                    if old != wanted {
                        write_superblock(&file, &mut sb, &wanted, path)?;
                    }
                }
                None => {
                    if let Some(old) = existing {
                        tracing::warn!(path = %path.display(), old_slot_bytes = old.slot_bytes, new_slot_bytes = slot_bytes, "G3 file was formatted for another slot size; its blocks are dropped");
                    }
                    write_superblock(&file, &mut sb, &wanted, path)?;
                    recovery.formatted_files += 1;
                    scan_list.push(scan::ScanFile {
                        path: path.clone(),
                        slots: 0,
                        slot_bytes,
                        data_offset,
                        direct: options.direct_io,
                    });
                }
            }
            per_file_slots.push(slots as u32);
            files.push(Arc::new(file));
        }
        Ok((files, per_file_slots, scan_list))
    }

    #[allow(clippy::too_many_arguments)]
    fn finish_open(
        options: &G3Options,
        pool: &HostPool,
        wrap: impl FnOnce(Arc<dyn IoEngine>) -> Arc<dyn IoEngine>,
        files: Vec<Arc<File>>,
        per_file_slots: Vec<u32>,
        scan_list: Vec<scan::ScanFile>,
        mut recovery: Recovery,
    ) -> Result<(Self, Recovery), G3Error> {
        let slot_bytes = align_up(options.slot_bytes.max(SLOT_ALIGN));
        let data_offsets = scan_list.iter().map(|f| f.data_offset).collect();
        let found = scan::scan(scan_list).map_err(|source| G3Error::Open { path: options.paths[0].clone(), source })?;
        let mut index = Index {
            map: BlockMap::default(),
            slots: per_file_slots.iter().map(|&n| vec![SlotState::Free; n as usize]).collect(),
            free: Vec::new(),
            next_file: 0,
            live: 0,
        };
        recovery.invalid_slots = found.invalid;
        for f in found.found {
            let loc = Loc { file: f.file, slot: f.slot };
            if index.map.contains_key(&f.header.hash) {
                recovery.duplicates += 1;
                continue;
            }
            index.map.insert(f.header.hash, loc);
            *index.state(loc) = SlotState::Live { hash: f.header.hash, readers: 0 };
            index.live += 1;
            recovery.blocks.push(f.header);
        }
        // Free lists hold the lowest slots last, so a fresh store fills each file front to back.
        index.free = index
            .slots
            .iter()
            .map(|states| (0..states.len() as u32).rev().filter(|&s| states[s as usize] == SlotState::Free).collect())
            .collect();
        let engine = wrap(make_engine(options.engine, &files, pool)?);
        let total_slots = per_file_slots.iter().map(|&n| n as u64).sum();
        // Slots whose header failed verification at the scan are corrupt blocks dropped too.
        let stats = G3Stats::default();
        stats.corrupt.store(recovery.invalid_slots, Ordering::Relaxed);
        Ok((
            Self {
                engine,
                paths: options.paths.clone(),
                slot_bytes,
                data_offsets,
                total_slots,
                index: Mutex::new(index),
                stats,
                _pool: pool.clone(),
            },
            recovery,
        ))
    }

    /// Writes a sealed image from a G2 slot. A block already present is not written again.
    pub async fn write(&self, image: SlotRef) -> Result<WriteOutcome, G3Error> {
        let header = ImageHeader::decode_header_only(image.as_slice()).map_err(G3Error::NotAnImage)?;
        let len = align_up(header.image_bytes());
        if len > self.slot_bytes {
            return Err(G3Error::TooLarge { image: header.image_bytes(), slot: self.slot_bytes });
        }
        let hash = header.hash;
        let loc = {
            let mut index = self.lock();
            if index.map.contains_key(&hash) {
                self.stats.duplicate_writes.fetch_add(1, Ordering::Relaxed);
                return Ok(WriteOutcome::AlreadyPresent);
            }
            let loc = index.alloc().ok_or(G3Error::Full { slots: self.total_slots })?;
            index.map.insert(hash, loc);
            *index.state(loc) = SlotState::Writing(hash);
            loc
        };
        // If this future is dropped mid-write, the guard gives the slot back; a late write landing
        // in a reused slot is caught by read verification, never served.
        let mut guard = WriteGuard { store: self, hash, loc, armed: true };
        let req = IoRequest { target: loc.file, offset: self.offset(loc), len, buf: IoBuf::Write(image) };
        let result = self.engine.submit(req).await;
        guard.armed = false;
        let mut index = self.lock();
        match result {
            Ok(_) => {
                *index.state(loc) = SlotState::Live { hash, readers: 0 };
                index.live += 1;
                self.stats.writes.fetch_add(1, Ordering::Relaxed);
                self.stats.write_bytes.fetch_add(len as u64, Ordering::Relaxed);
                Ok(WriteOutcome::Written)
            }
            Err(failure) => {
                index.map.remove(&hash);
                index.free_slot(loc);
                self.stats.write_errors.fetch_add(1, Ordering::Relaxed);
                Err(G3Error::from_io(failure.error))
            }
        }
    }

    /// Reads and verifies block `hash` into `dst`. On success the slot holds the verified image.
    /// A block that fails verification or hits an I/O error is dropped from the store.
    pub async fn read(&self, hash: BlockHash, dst: SlotMut) -> Result<SlotRef, ReadFailure> {
        let loc = {
            let mut index = self.lock();
            let loc = index.map.get(&hash).copied();
            match loc.map(|l| (l, index.state(l))) {
                Some((l, SlotState::Live { readers, .. })) => {
                    *readers += 1;
                    l
                }
                _ => return Err(ReadFailure { buf: Some(dst), error: G3Error::NotFound(hash) }),
            }
        };
        let guard = ReadGuard { store: self, loc };
        let req = IoRequest { target: loc.file, offset: self.offset(loc), len: self.slot_bytes, buf: IoBuf::Read(dst) };
        let result = self.engine.submit(req).await;
        drop(guard);
        match result {
            Ok(buf) => {
                let slot = buf.into_read().expect("a read hands back its read buffer");
                match verify_image(slot.as_slice(), hash) {
                    Ok(_) => {
                        self.stats.reads.fetch_add(1, Ordering::Relaxed);
                        self.stats.read_bytes.fetch_add(self.slot_bytes as u64, Ordering::Relaxed);
                        Ok(slot.freeze())
                    }
                    Err(source) => {
                        self.stats.corrupt.fetch_add(1, Ordering::Relaxed);
                        self.lock().drop_entry(hash, loc);
                        tracing::warn!(%hash, error = %source, "G3 block failed verification; dropped");
                        Err(ReadFailure { buf: Some(slot), error: G3Error::Corrupt { hash, source } })
                    }
                }
            }
            Err(failure) => {
                self.stats.read_errors.fetch_add(1, Ordering::Relaxed);
                self.lock().drop_entry(hash, loc);
                tracing::warn!(%hash, error = %failure.error, "G3 read failed; block dropped");
                Err(ReadFailure { buf: failure.buf.and_then(IoBuf::into_read), error: G3Error::from_io(failure.error) })
            }
        }
    }

    /// Drops a block (eviction). Returns whether it was present. A block being read is freed when
    /// its readers finish.
    pub fn remove(&self, hash: BlockHash) -> bool {
        let mut index = self.lock();
        match index.map.get(&hash).copied() {
            Some(loc) => index.drop_entry(hash, loc),
            None => false,
        }
    }

    /// Whether the block is stored (written and not removed).
    pub fn contains(&self, hash: BlockHash) -> bool {
        let mut index = self.lock();
        match index.map.get(&hash).copied() {
            Some(loc) => matches!(index.state(loc), SlotState::Live { .. }),
            None => false,
        }
    }

    /// Blocks stored.
    pub fn len(&self) -> usize {
        self.lock().live
    }

    /// Whether no block is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Slots in all files.
    pub fn capacity_slots(&self) -> u64 {
        self.total_slots
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The engine's name.
    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }

    /// I/Os in flight now.
    pub fn in_flight(&self) -> usize {
        self.engine.in_flight()
    }

    /// The store's counters.
    pub fn stats(&self) -> &G3Stats {
        &self.stats
    }

    /// The files of the store.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    fn offset(&self, loc: Loc) -> u64 {
        self.data_offsets[loc.file as usize] + loc.slot as u64 * self.slot_bytes as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        // The index is updated in small critical sections that cannot panic half-way.
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct WriteGuard<'a> {
    store: &'a G3Store,
    hash: BlockHash,
    loc: Loc,
    armed: bool,
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            let mut index = self.store.lock();
            if index.map.get(&self.hash) == Some(&self.loc) {
                index.map.remove(&self.hash);
                index.free_slot(self.loc);
            }
        }
    }
}

struct ReadGuard<'a> {
    store: &'a G3Store,
    loc: Loc,
}

impl Drop for ReadGuard<'_> {
    fn drop(&mut self) {
        self.store.lock().end_read(self.loc);
    }
}

fn make_engine(choice: EngineChoice, files: &[Arc<File>], pool: &HostPool) -> Result<Arc<dyn IoEngine>, G3Error> {
    let io_err = |source| G3Error::Io(source);
    match choice {
        EngineChoice::Uring(opts) => match UringEngine::new(files, Some(pool), opts) {
            Ok(engine) => Ok(Arc::new(engine)),
            Err(e) => {
                tracing::warn!(error = %e, "io_uring is unavailable; G3 falls back to pread/pwrite");
                Ok(Arc::new(PsyncEngine::new(files, opts.queue_depth as usize).map_err(io_err)?))
            }
        },
        EngineChoice::Psync { threads } => Ok(Arc::new(PsyncEngine::new(files, threads).map_err(io_err)?)),
    }
}

/// Files and directories an open created, to remove when it fails.
#[derive(Debug, Default)]
struct Created {
    files: Vec<PathBuf>,
    /// Deepest last.
    dirs: Vec<PathBuf>,
}

impl Created {
    fn remove(self) {
        for file in &self.files {
            let _ = std::fs::remove_file(file);
        }
        // Only empty directories go: one that holds anything else is not only ours.
        for dir in self.dirs.iter().rev() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// Bytes free for an unprivileged writer on the file system holding `path`.
pub fn free_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a valid NUL-terminated path and `st` points to writable memory of the right type.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    // SAFETY: statvfs returned 0, so it initialised the struct.
    (rc == 0).then(|| unsafe { st.assume_init() }).map(|s| s.f_bavail * s.f_frsize)
}

fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes} B") } else { format!("{value:.1} {} ({bytes} bytes)", UNITS[unit]) }
}

/// Bytes read at each end of a path that has no G3 superblock: every file system, volume manager
/// and partition table in common use keeps its signature there — ext2/3/4 at 1 KiB, XFS, LUKS,
/// squashfs and NTFS at 0, LVM and GPT at 512, ISO 9660 at 32 KiB, btrfs at 64 KiB, ZFS's front
/// labels at 0 and 256 KiB and its back labels in the last 512 KiB, md 0.90 in the last 128 KiB,
/// the GPT backup in the last sector.
const FOREIGN_PROBE: u64 = 1 << 20;

/// Refuses a path that holds data other than a G3 store (unless `format_foreign`): a file or device
/// without a G3 superblock that has a byte other than zero in its first or last MiB, or (a
/// regular file) at the start of any of its data extents.
fn check_not_foreign(path: &Path, bytes: u64, format_foreign: bool) -> Result<(), G3Error> {
    if bytes == 0 || format_foreign {
        return Ok(());
    }
    let open_err = |source| G3Error::Open { path: path.to_path_buf(), source };
    let file = File::open(path).map_err(open_err)?;
    let head = read_at_most(&file, 0, FOREIGN_PROBE.min(bytes)).map_err(open_err)?;
    if Superblock::decode(&head[..head.len().min(SUPERBLOCK_LEN as usize)]).is_some() {
        return Ok(());
    }
    let foreign = |what: Option<&'static str>| G3Error::Foreign { path: path.to_path_buf(), bytes, what };
    if let Some(what) = signature(&head) {
        return Err(foreign(Some(what)));
    }
    let tail_at = bytes.saturating_sub(FOREIGN_PROBE).max(head.len() as u64);
    let tail = read_at_most(&file, tail_at, bytes - tail_at).map_err(open_err)?;
    if head.iter().chain(&tail).any(|&b| b != 0) {
        return Err(foreign(None));
    }
    if file.metadata().map_err(open_err)?.file_type().is_file() {
        // A file's data past its ends: the start of each data extent (at most 1024 of them).
        let mut at = 0;
        for _ in 0..1024 {
            let Some(start) = seek_data(&file, at) else { break };
            if start >= bytes {
                break;
            }
            let piece = read_at_most(&file, start, (64 << 10).min(bytes - start)).map_err(open_err)?;
            if piece.iter().any(|&b| b != 0) {
                return Err(foreign(None));
            }
            at = start + (1 << 20);
        }
    }
    Ok(())
}

/// The name of a well-known signature in the first MiB of a device or file, for the error.
fn signature(head: &[u8]) -> Option<&'static str> {
    let at = |offset: usize, magic: &[u8]| head.get(offset..offset + magic.len()) == Some(magic);
    const KNOWN: &[(usize, &[u8], &str)] = &[
        (0x438, &[0x53, 0xef], "an ext2/3/4 file system"),
        (0, b"XFSB", "an XFS file system"),
        (0x10040, b"_BHRfS_M", "a btrfs file system"),
        (0, b"LUKS\xba\xbe", "a LUKS volume"),
        (512, b"LABELONE", "an LVM physical volume"),
        (512, b"EFI PART", "a GPT partition table"),
        (3, b"NTFS    ", "an NTFS file system"),
        (0, b"hsqs", "a squashfs image"),
        (0x8001, b"CD001", "an ISO 9660 image"),
        (4086, b"SWAPSPACE2", "a swap area"),
        (0x400, &[0x10, 0x20, 0xf5, 0xf2], "an F2FS file system"),
        (4096, &[0xfc, 0x4e, 0x2b, 0xa9], "an md RAID member"),
    ];
    if let Some((_, _, what)) = KNOWN.iter().find(|(offset, magic, _)| at(*offset, magic)) {
        return Some(what);
    }
    // ZFS: an uberblock (magic 0x00bab10c, either byte order) in the first label's ring at 128 KiB.
    let zfs = (128 << 10..256 << 10)
        .step_by(1 << 10)
        .any(|o| at(o, &0x00ba_b10c_u64.to_le_bytes()) || at(o, &0x00ba_b10c_u64.to_be_bytes()));
    zfs.then_some("a ZFS pool member")
}

/// Up to `len` bytes of `file` from `offset` (fewer at its end).
fn read_at_most(file: &File, offset: u64, len: u64) -> io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; len as usize];
    let mut read = 0;
    while read < buf.len() {
        match file.read_at(&mut buf[read..], offset + read as u64) {
            Ok(0) => break,
            Ok(n) => read += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(read);
    Ok(buf)
}

/// The next offset at or after `from` where `file` holds data (`SEEK_DATA`); `None` past the last.
fn seek_data(file: &File, from: u64) -> Option<u64> {
    use std::os::fd::AsRawFd;
    // SAFETY: lseek on an open descriptor this function borrows; it only moves its offset, which
    // nothing else here uses (reads are positioned).
    let at = unsafe { libc::lseek(file.as_raw_fd(), from as libc::off_t, libc::SEEK_DATA) };
    (at >= 0).then_some(at as u64)
}

/// What opening `path` as a G3 file of `capacity` bytes would refuse, checked without writing
/// anything (so `config check` can say it too): a path holding data that is not a G3 store
/// (unless `format_foreign`), or a file system with less free space than the file still needs.
pub fn preflight(path: &Path, capacity: u64, format_foreign: bool) -> Result<(), G3Error> {
    let existing = std::fs::metadata(path).ok();
    let is_device = existing.as_ref().is_some_and(|m| m.file_type().is_block_device());
    if let Some(meta) = &existing {
        let bytes = if is_device { device_bytes(path)? } else { meta.len() };
        check_not_foreign(path, bytes, format_foreign)?;
    }
    if is_device {
        return Ok(());
    }
    // The space still to reserve against what the file system has free.
    use std::os::unix::fs::MetadataExt;
    let bytes = (capacity / SLOT_ALIGN as u64) * SLOT_ALIGN as u64;
    let needed = bytes.saturating_sub(existing.as_ref().map_or(0, |m| m.blocks() * 512));
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    // The nearest directory that exists: the one the file's directories will be made in.
    let on = dir.ancestors().find(|d| d.exists()).unwrap_or(Path::new("."));
    match free_bytes(on) {
        Some(free) if free < needed => Err(G3Error::NoRoom { path: path.to_path_buf(), needed, free }),
        _ => Ok(()),
    }
}

/// Opens (creating, sizing and reserving) a file, or opens a block device; returns it and its
/// size. What it creates is noted in `created`.
fn open_file(path: &Path, options: &G3Options, created: &mut Created) -> Result<(File, u64), G3Error> {
    let err = |source| G3Error::Open { path: path.to_path_buf(), source };
    preflight(path, options.capacity_per_path, options.format_foreign)?;
    let existing = std::fs::metadata(path).ok();
    let is_device = existing.as_ref().is_some_and(|m| m.file_type().is_block_device());
    if !is_device && let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        let mut missing: Vec<PathBuf> = dir.ancestors().take_while(|d| !d.exists()).map(Path::to_path_buf).collect();
        std::fs::create_dir_all(dir).map_err(err)?;
        missing.reverse();
        created.dirs.extend(missing);
    }
    let bytes = (options.capacity_per_path / SLOT_ALIGN as u64) * SLOT_ALIGN as u64;
    let mut opts = OpenOptions::new();
    opts.read(true).write(true).create(!is_device);
    if options.direct_io {
        opts.custom_flags(libc::O_DIRECT);
    }
    let file = match opts.open(path) {
        Ok(f) => f,
        Err(e) if options.direct_io && e.raw_os_error() == Some(libc::EINVAL) => {
            return Err(G3Error::DirectIoUnsupported { path: path.to_path_buf() });
        }
        Err(e) => return Err(err(e)),
    };
    if existing.is_none() {
        created.files.push(path.to_path_buf());
    }
    if is_device {
        return Ok((file, device_bytes(path)?));
    }
    file.set_len(bytes).map_err(err)?;
    // Reserve the space now so a full disk shows at start-up, not as write errors later.
    // SAFETY: fallocate on a descriptor we own, with a valid range; the result is checked.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, bytes as libc::off_t) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EOPNOTSUPP) => {}
            Some(libc::ENOSPC) => {
                let free = free_bytes(path).unwrap_or(0);
                return Err(G3Error::NoRoom { path: path.to_path_buf(), needed: bytes, free });
            }
            _ => return Err(err(e)),
        }
    }
    Ok((file, bytes))
}

/// The size of a block device.
fn device_bytes(path: &Path) -> Result<u64, G3Error> {
    let err = |source| G3Error::Open { path: path.to_path_buf(), source };
    let file = File::open(path).map_err(err)?;
    let mut bytes = 0u64;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points to a live local.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut bytes as *mut u64) };
    if rc != 0 {
        return Err(err(io::Error::last_os_error()));
    }
    Ok(bytes)
}

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

/// A 4 KiB aligned buffer for the superblock.
struct AlignedSuper(crate::io::aligned::AlignedBuf);

impl AlignedSuper {
    fn new() -> Self {
        Self(crate::io::aligned::AlignedBuf::new(SUPERBLOCK_LEN as usize))
    }
}

fn read_superblock(file: &File, buf: &mut AlignedSuper, path: &Path) -> Result<Option<Superblock>, G3Error> {
    use std::os::unix::fs::FileExt;
    match file.read_exact_at(buf.0.as_mut_slice(), 0) {
        Ok(()) => Ok(Superblock::decode(buf.0.as_slice())),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(None),
        Err(source) => Err(G3Error::Open { path: path.to_path_buf(), source }),
    }
}

fn write_superblock(file: &File, buf: &mut AlignedSuper, sb: &Superblock, path: &Path) -> Result<(), G3Error> {
    use std::os::unix::fs::FileExt;
    sb.encode(buf.0.as_mut_slice());
    file.write_all_at(buf.0.as_slice(), 0)
        .and_then(|()| file.sync_data())
        .map_err(|source| G3Error::Open { path: path.to_path_buf(), source })
}
