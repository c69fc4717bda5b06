//! Recorded traffic: what the node served, as a trace `bench replay` reads back, so "what would
//! twice the G2 have given us last Tuesday?" is one command over last Tuesday's file.
//!
//! Each answered request becomes one JSON line once its response is over: its arrival, its
//! session, its input and output lengths and its prompt's *hash ids*, one per
//! [`TRACE_BLOCK_TOKENS`] tokens, where an id names the whole prefix up to the end of its block
//! (equal ids, equal prefixes), as in the Mooncake and aiperf traces. Neither text nor token ids
//! are written. An id is a keyed BLAKE3 hash of the tenant's namespace and the prefix's tokens,
//! under a random key drawn for each file and never written anywhere: within a file equal prefixes
//! give equal ids (the structure a replay needs), across files nothing can be compared, and no id
//! can be tested against a guessed prompt.
//!
//! Two formats (`recording.format`):
//! - `aiperf_agentic`: sessions. A session's first request in a file is written in full with its
//!   `timestamp` (milliseconds since the file began); a later one that extends the session's
//!   previous prompt is written as what it adds beyond that prompt and the answer the replay will
//!   generate in its place, with the `delay` since the previous request finished. A request that
//!   does not extend its session's previous prompt (a compaction, a fork) starts a new session.
//! - `mooncake`: every prompt whole, at its `timestamp`.
//!
//! A file is closed past `recording.max_file_size` or `recording.rotate_every`, and at most
//! `recording.max_files` are kept (the oldest are deleted, but only once the new file holds
//! lines: a file that could not be written never costs an old one). Each file is a whole trace: its
//! sessions start in it. Lines are written by a thread of their own behind a queue bounded in
//! tokens; when the queue is full or the disk refuses a write, every line lost is counted
//! (`dynamo_node_recording_dropped_total`), the file is cut back to its last whole line and kept,
//! and serving goes on.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dynamo_config::{RecordingFormat, RecordingSection};
use serde_json::json;

use crate::metrics;

/// Tokens one hash id stands for (what `bench replay` expands an id to).
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// Prompt tokens waiting for the writer at most (64 MiB of ids); past it, lines are dropped.
const MAX_QUEUED_TOKENS: usize = 16 << 20;

/// Sessions a file follows at most; past it, the least recently served half are forgotten (their
/// next requests start new sessions).
const MAX_SESSIONS: usize = 100_000;

/// Lines buffered before they are written out (one write per batch otherwise).
const FLUSH_BYTES: usize = 1 << 20;

/// Ids are kept below 2^53, so every JSON reader holds them exactly.
const ID_MASK: u64 = (1 << 53) - 1;

/// One request the node answered.
#[derive(Clone, Debug)]
pub struct Served {
    /// When it arrived.
    pub arrived: Instant,
    /// When its response ended.
    pub done: Instant,
    /// Its session key (already distinct per tenant), if it named a session.
    pub session: Option<String>,
    /// Its cache namespace (tenant and `cache_salt`): equal prompts of two namespaces share no id.
    pub namespace: String,
    /// Its prompt.
    pub prompt: Vec<u32>,
    /// Tokens it generated.
    pub output_tokens: usize,
}

/// The recorder: hands [`Served`] requests to its writer thread.
#[derive(Debug)]
pub struct Recorder {
    dir: PathBuf,
    format: RecordingFormat,
    tx: Mutex<Option<crossbeam_channel::Sender<Served>>>,
    queued_tokens: Arc<AtomicUsize>,
    tally: Arc<Tally>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// Lines written and lost since the recorder started (the metrics count them too).
#[derive(Debug, Default)]
struct Tally {
    written: AtomicU64,
    lost: AtomicU64,
}

impl Tally {
    fn written(&self, n: u64) {
        self.written.fetch_add(n, Ordering::Relaxed);
        metrics::record_recorded(n);
    }

    fn lost(&self, reason: &'static str, n: u64) {
        self.lost.fetch_add(n, Ordering::Relaxed);
        metrics::record_recording_dropped(reason, n);
    }
}

/// How the writer creates a file (a test makes every file refuse writes).
type Create = fn(&Path) -> io::Result<File>;

impl Recorder {
    /// Starts recording into `section.dir` (under `data_dir` when relative), creating it.
    pub fn start(section: &RecordingSection, data_dir: &Path) -> io::Result<Arc<Recorder>> {
        Self::start_with(section, data_dir, |path| File::create_new(path))
    }

    fn start_with(section: &RecordingSection, data_dir: &Path, create: Create) -> io::Result<Arc<Recorder>> {
        let dir = if section.dir.is_absolute() { section.dir.clone() } else { data_dir.join(&section.dir) };
        std::fs::create_dir_all(&dir)?;
        let (tx, rx) = crossbeam_channel::unbounded();
        let queued_tokens = Arc::new(AtomicUsize::new(0));
        let tally = Arc::new(Tally::default());
        let writer = Writer {
            create,
            tally: tally.clone(),
            dir: dir.clone(),
            format: section.format,
            max_file_size: section.max_file_size.as_u64(),
            rotate_every: section.rotate_every.0,
            max_files: section.max_files.max(1),
            file: None,
            sessions: HashMap::new(),
            anonymous: 0,
            warned: false,
        };
        let queued = queued_tokens.clone();
        let thread = std::thread::Builder::new().name("recorder".into()).spawn(move || writer.run(rx, &queued))?;
        metrics::record_recorded(0);
        for reason in ["queue_full", "write_error"] {
            metrics::record_recording_dropped(reason, 0);
        }
        Ok(Arc::new(Recorder {
            dir,
            format: section.format,
            tx: Mutex::new(Some(tx)),
            queued_tokens,
            tally,
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// Where the files go.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The format they are written in.
    pub fn format(&self) -> RecordingFormat {
        self.format
    }

    /// Queues `served` for the writer; drops it (counted) when the queue is full or the recorder
    /// has finished. Never blocks.
    pub fn record(&self, served: Served) {
        let tokens = served.prompt.len().max(1);
        if self.queued_tokens.fetch_add(tokens, Ordering::Relaxed) + tokens > MAX_QUEUED_TOKENS {
            self.queued_tokens.fetch_sub(tokens, Ordering::Relaxed);
            self.tally.lost("queue_full", 1);
            return;
        }
        let tx = self.tx.lock().unwrap_or_else(PoisonError::into_inner);
        let sent = tx.as_ref().is_some_and(|tx| tx.send(served).is_ok());
        if !sent {
            self.queued_tokens.fetch_sub(tokens, Ordering::Relaxed);
            self.tally.lost("queue_full", 1);
        }
    }

    /// Lines written and lines lost so far.
    pub fn tally(&self) -> (u64, u64) {
        (self.tally.written.load(Ordering::Relaxed), self.tally.lost.load(Ordering::Relaxed))
    }

    /// Writes what is queued, closes the file and stops the writer. Later records are dropped.
    pub fn finish(&self) {
        drop(self.tx.lock().unwrap_or_else(PoisonError::into_inner).take());
        if let Some(thread) = self.thread.lock().unwrap_or_else(PoisonError::into_inner).take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.finish();
    }
}

/// The file being written.
struct Open {
    path: PathBuf,
    file: File,
    /// Bytes of whole lines in the file.
    written: u64,
    /// Lines not yet written out, and how many.
    pending: Vec<u8>,
    pending_lines: u64,
    opened: Instant,
    /// The file's key: ids and session names are keyed with it.
    key: [u8; 32],
    /// The oldest recordings were deleted for it (once it held lines).
    pruned: bool,
}

/// What a file knows of one session: its last prompt, to tell whether the next one extends it.
#[derive(Clone)]
struct Followed {
    /// The session's name in the file.
    name: String,
    prompt_len: usize,
    /// Keyed digest of the namespace and the whole last prompt.
    digest: blake3::Hash,
    output_tokens: usize,
    done: Instant,
    /// Sessions started for it in this file after the first (forks).
    forks: u32,
}

struct Writer {
    create: Create,
    tally: Arc<Tally>,
    dir: PathBuf,
    format: RecordingFormat,
    max_file_size: u64,
    rotate_every: Duration,
    max_files: usize,
    file: Option<Open>,
    sessions: HashMap<String, Followed>,
    /// Requests without a session, each a session of its own.
    anonymous: u64,
    /// A write error was logged for the current file.
    warned: bool,
}

impl Writer {
    fn run(mut self, rx: crossbeam_channel::Receiver<Served>, queued: &AtomicUsize) {
        while let Ok(first) = rx.recv() {
            let mut batch = vec![first];
            batch.extend(rx.try_iter().take(255));
            for served in batch {
                queued.fetch_sub(served.prompt.len().max(1), Ordering::Relaxed);
                if let Err(e) = self.write(&served) {
                    self.tally.lost("write_error", 1);
                    self.warn(&e);
                }
            }
            self.flush();
        }
        self.close();
    }

    /// A failed write, logged once until a write succeeds again.
    fn warn(&mut self, e: &io::Error) {
        if !self.warned {
            self.warned = true;
            let path = self.file.as_ref().map(|f| f.path.display().to_string()).unwrap_or_default();
            tracing::warn!(error = %e, %path, "cannot write the traffic recording; requests go unrecorded meanwhile");
        }
    }

    /// Writes the pending lines out. When the disk refuses them, every one of them is counted
    /// lost, the file is cut back to its last whole line and kept (the next lines go to it), and
    /// the sessions start over (a lost line may have been one a later line builds on).
    fn flush(&mut self) {
        let Some(open) = &mut self.file else { return };
        if open.pending.is_empty() {
            return;
        }
        let lines = std::mem::take(&mut open.pending_lines);
        match open.file.write_all(&open.pending) {
            Ok(()) => {
                open.written += open.pending.len() as u64;
                open.pending.clear();
                self.tally.written(lines);
                self.warned = false;
                if !open.pruned {
                    open.pruned = true;
                    let path = open.path.clone();
                    self.prune(&path);
                }
            }
            Err(e) => {
                open.pending.clear();
                let _ = open.file.set_len(open.written);
                let _ = open.file.seek(SeekFrom::Start(open.written));
                self.tally.lost("write_error", lines);
                self.sessions.clear();
                self.warn(&e);
            }
        }
    }

    /// Writes what is pending and closes the file; a file that never held a line is removed.
    fn close(&mut self) {
        self.flush();
        if let Some(open) = self.file.take()
            && open.written == 0
        {
            let _ = std::fs::remove_file(&open.path);
        }
    }

    fn write(&mut self, served: &Served) -> io::Result<()> {
        let rotate = self.file.as_ref().is_some_and(|f| {
            f.written + f.pending.len() as u64 >= self.max_file_size || f.opened.elapsed() >= self.rotate_every
        });
        if rotate {
            self.close();
        }
        if self.file.is_none() {
            self.file = Some(self.open()?);
            self.sessions.clear();
        }
        let line = self.line(served);
        let mut bytes = serde_json::to_vec(&line).map_err(io::Error::other)?;
        bytes.push(b'\n');
        let open = self.file.as_mut().expect("opened above");
        open.pending.extend_from_slice(&bytes);
        open.pending_lines += 1;
        if open.pending.len() >= FLUSH_BYTES {
            self.flush();
        }
        Ok(())
    }

    /// A new file with a new key. The oldest files go beyond `max_files` once it holds lines.
    fn open(&mut self) -> io::Result<Open> {
        let ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
        let mut path = self.dir.join(format!("traffic-{ms:013}.jsonl"));
        let mut n = 1;
        while path.exists() {
            path = self.dir.join(format!("traffic-{ms:013}-{n}.jsonl"));
            n += 1;
        }
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).map_err(|e| io::Error::other(format!("no randomness for the file's key: {e}")))?;
        let file = (self.create)(&path)?;
        Ok(Open {
            path,
            file,
            written: 0,
            pending: Vec::new(),
            pending_lines: 0,
            opened: Instant::now(),
            key,
            pruned: false,
        })
    }

    /// Deletes the oldest recordings so that `max_files` remain, `keep` (the new one) among them.
    fn prune(&self, keep: &Path) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else { return };
        let mut files: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("traffic-") && n.ends_with(".jsonl"))
            })
            .filter(|p| p != keep)
            .collect();
        // Names hold the opening time, zero-padded: they sort by age.
        files.sort();
        let excess = (files.len() + 1).saturating_sub(self.max_files);
        for old in files.into_iter().take(excess) {
            if let Err(e) = std::fs::remove_file(&old) {
                tracing::warn!(error = %e, path = %old.display(), "cannot delete an old traffic recording");
            }
        }
    }

    fn line(&mut self, served: &Served) -> serde_json::Value {
        let open = self.file.as_ref().expect("a file is open");
        let key = open.key;
        let since_open = |at: Instant| at.saturating_duration_since(open.opened).as_secs_f64() * 1e3;
        let timestamp = (since_open(served.arrived) * 1e3).round() / 1e3;
        let prompt = &served.prompt;
        if self.format == RecordingFormat::Mooncake {
            let (ids, _) = Prefixes::new(&key, &served.namespace).ids(prompt, 0);
            return json!({
                "timestamp": timestamp, "input_length": prompt.len(), "output_length": served.output_tokens,
                "hash_ids": ids,
            });
        }
        // Does it extend its session's last prompt? Then it is that session's next turn.
        let previous = served.session.as_ref().and_then(|s| self.sessions.get(s)).cloned();
        let mut prefixes = Prefixes::new(&key, &served.namespace);
        let extends = previous.as_ref().is_some_and(|p| {
            p.prompt_len < prompt.len() && {
                prefixes.feed(&prompt[..p.prompt_len]);
                prefixes.digest() == p.digest
            }
        });
        let (line, name, forks, digest) = match previous {
            Some(p) if extends => {
                // The replay generates the previous answer itself: what follows it is new.
                let start = p.prompt_len + p.output_tokens.min(prompt.len() - p.prompt_len);
                let (ids, digest) = prefixes.ids(prompt, start);
                let delay = (served.arrived.saturating_duration_since(p.done).as_secs_f64() * 1e6).round() / 1e3;
                let line = json!({
                    "session_id": p.name, "delay": delay, "input_length": prompt.len() - start,
                    "output_length": served.output_tokens, "hash_ids": ids,
                });
                (line, p.name, p.forks, digest)
            }
            previous => {
                let (name, forks) = match (&served.session, previous) {
                    // A fork of a session this file follows: a new session beside it.
                    (Some(_), Some(p)) => {
                        let base = p.name.split('-').next().unwrap_or_default().to_owned();
                        (format!("{base}-{}", p.forks + 1), p.forks + 1)
                    }
                    (Some(session), None) => (session_name(&key, session), 0),
                    (None, _) => {
                        self.anonymous += 1;
                        (format!("r{}", self.anonymous), 0)
                    }
                };
                let (ids, digest) = Prefixes::new(&key, &served.namespace).ids(prompt, 0);
                let line = json!({
                    "session_id": name, "timestamp": timestamp, "input_length": prompt.len(),
                    "output_length": served.output_tokens, "hash_ids": ids,
                });
                (line, name, forks, digest)
            }
        };
        if let Some(session) = &served.session {
            let followed = Followed {
                name,
                prompt_len: prompt.len(),
                digest,
                output_tokens: served.output_tokens,
                done: served.done,
                forks,
            };
            self.follow(session.clone(), followed);
        }
        line
    }

    fn follow(&mut self, session: String, followed: Followed) {
        if self.sessions.len() >= MAX_SESSIONS && !self.sessions.contains_key(&session) {
            let mut done: Vec<Instant> = self.sessions.values().map(|f| f.done).collect();
            done.sort_unstable();
            let cutoff = done[done.len() / 2];
            self.sessions.retain(|_, f| f.done > cutoff);
        }
        self.sessions.insert(session, followed);
    }
}

/// A session's name in a file: 16 hex digits of its key, keyed with the file's key.
fn session_name(key: &[u8; 32], session: &str) -> String {
    let h = blake3::Hasher::new_keyed(key).update(b"session\0").update(session.as_bytes()).finalize();
    let b = h.as_bytes();
    format!("s{:016x}", u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
}

/// A keyed hash over a namespace and then a prompt's tokens, read at prefix ends.
struct Prefixes {
    hasher: blake3::Hasher,
    fed: usize,
}

impl Prefixes {
    fn new(key: &[u8; 32], namespace: &str) -> Self {
        let mut hasher = blake3::Hasher::new_keyed(key);
        hasher.update(b"prefix\0").update(namespace.as_bytes()).update(b"\0");
        Prefixes { hasher, fed: 0 }
    }

    /// Feeds `tokens` (the prompt's next ones).
    fn feed(&mut self, tokens: &[u32]) {
        let mut bytes = [0u8; 4 * 256];
        for chunk in tokens.chunks(256) {
            for (slot, t) in bytes.chunks_exact_mut(4).zip(chunk) {
                slot.copy_from_slice(&t.to_le_bytes());
            }
            self.hasher.update(&bytes[..4 * chunk.len()]);
        }
        self.fed += tokens.len();
    }

    /// The digest of what was fed.
    fn digest(&self) -> blake3::Hash {
        self.hasher.finalize()
    }

    /// The ids of `prompt`'s blocks from `start` ([`TRACE_BLOCK_TOKENS`] each, the last one
    /// partial), each naming the prefix up to its end; what was fed must be `prompt[..fed]`
    /// with `fed <= start`. Also the digest of the whole prompt.
    fn ids(mut self, prompt: &[u32], start: usize) -> (Vec<u64>, blake3::Hash) {
        debug_assert!(self.fed <= start && start <= prompt.len());
        self.feed(&prompt[self.fed..start]);
        let mut ids = Vec::with_capacity((prompt.len() - start).div_ceil(TRACE_BLOCK_TOKENS));
        for block in prompt[start..].chunks(TRACE_BLOCK_TOKENS) {
            self.feed(block);
            let b = self.digest();
            let b = b.as_bytes();
            ids.push(u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) & ID_MASK);
        }
        (ids, self.digest())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(dir: &Path, format: RecordingFormat) -> RecordingSection {
        RecordingSection { enabled: true, dir: dir.to_owned(), format, ..RecordingSection::default() }
    }

    fn lines(dir: &Path) -> Vec<Vec<serde_json::Value>> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        files.sort();
        files
            .iter()
            .map(|f| std::fs::read_to_string(f).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect())
            .collect()
    }

    fn served(session: Option<&str>, prompt: Vec<u32>, output_tokens: usize, at: Instant) -> Served {
        Served {
            arrived: at,
            done: at + Duration::from_millis(100),
            session: session.map(str::to_owned),
            namespace: String::new(),
            prompt,
            output_tokens,
        }
    }

    fn tokens(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| seed.wrapping_mul(7919) ^ i).collect()
    }

    #[test]
    fn sessions_are_a_first_turn_then_what_each_turn_adds_with_shared_prefixes_sharing_ids() {
        let dir = tempfile::tempdir().unwrap();
        let recorder = Recorder::start(&section(dir.path(), RecordingFormat::AiperfAgentic), Path::new("/")).unwrap();
        let system = tokens(1, 1024);
        let t0 = Instant::now();
        let first_a = [system.clone(), tokens(2, 300)].concat();
        recorder.record(served(Some("a"), first_a.clone(), 50, t0));
        let first_b = [system.clone(), tokens(3, 700)].concat();
        recorder.record(served(Some("b"), first_b, 20, t0));
        // Turn 2 of a: its prompt, then the answer (50 tokens) and 600 new ones.
        let second_a = [first_a.clone(), tokens(4, 650)].concat();
        recorder.record(served(Some("a"), second_a.clone(), 10, t0 + Duration::from_millis(400)));
        // a compacted: a prompt that does not extend the last one starts a new session.
        recorder.record(served(Some("a"), tokens(5, 100), 5, t0 + Duration::from_millis(900)));
        recorder.record(served(None, tokens(6, 10), 1, t0));
        recorder.finish();

        let files = lines(dir.path());
        assert_eq!(files.len(), 1);
        let l = &files[0];
        assert_eq!(l.len(), 5);
        let ids = |v: &serde_json::Value| -> Vec<u64> {
            v["hash_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
        };
        assert_eq!((l[0]["input_length"].as_u64(), l[0]["output_length"].as_u64()), (Some(1324), Some(50)));
        assert_eq!(ids(&l[0]).len(), 3);
        assert_eq!(ids(&l[0])[..2], ids(&l[1])[..2], "the shared system prompt has the same ids in both sessions");
        assert_ne!(ids(&l[0])[2], ids(&l[1])[2]);
        assert_ne!(l[0]["session_id"], l[1]["session_id"]);
        assert!(l[0].get("timestamp").is_some() && l[0].get("delay").is_none());

        assert_eq!(l[2]["session_id"], l[0]["session_id"], "the second turn continues the session");
        assert_eq!(l[2]["input_length"], 600, "beyond the last prompt and the answer the replay generates");
        assert_eq!(ids(&l[2]).len(), 2);
        assert_eq!(l[2]["delay"], 300.0, "from the previous turn's end to this arrival");
        assert!(l[2].get("timestamp").is_none());

        assert_ne!(l[3]["session_id"], l[0]["session_id"], "a prompt that does not extend the last starts anew");
        assert_eq!(l[3]["input_length"], 100);
        assert!(l[3].get("timestamp").is_some());
        assert!(l[4]["session_id"].as_str().unwrap().starts_with('r'));
        for line in l {
            assert!(ids(line).iter().all(|&id| id <= ID_MASK));
        }
    }

    #[test]
    fn each_file_has_its_own_key_and_old_files_are_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = section(dir.path(), RecordingFormat::Mooncake);
        cfg.max_file_size = dynamo_config::ByteSize(4096);
        cfg.max_files = 3;
        let recorder = Recorder::start(&cfg, Path::new("/")).unwrap();
        let prompt = tokens(9, 20 * TRACE_BLOCK_TOKENS);
        // Each line holds 20 ids of up to 16 digits: a few lines fill a 4 KiB file.
        for _ in 0..40 {
            recorder.record(served(None, prompt.clone(), 3, Instant::now()));
        }
        recorder.finish();
        let files = lines(dir.path());
        assert_eq!(files.len(), 3, "rotated, and only the newest three kept");
        let first_ids: Vec<&serde_json::Value> = files.iter().map(|f| &f[0]["hash_ids"]).collect();
        assert_eq!(files[1][0]["hash_ids"], files[1][1]["hash_ids"], "within a file, one prompt has one set of ids");
        assert_ne!(first_ids[1], first_ids[2], "across files the same prompt has other ids");
        for f in &files {
            assert!(f.iter().all(|l| l["input_length"] == 20 * TRACE_BLOCK_TOKENS && l.get("session_id").is_none()));
        }
    }

    #[test]
    fn namespaces_never_share_ids() {
        let key = [7u8; 32];
        let prompt = tokens(1, 2 * TRACE_BLOCK_TOKENS);
        let (a, _) = Prefixes::new(&key, "tenant-a").ids(&prompt, 0);
        let (b, _) = Prefixes::new(&key, "tenant-b").ids(&prompt, 0);
        let (a2, _) = Prefixes::new(&key, "tenant-a").ids(&prompt, 0);
        assert_eq!(a, a2);
        assert!(a.iter().all(|id| !b.contains(id)));
    }

    #[test]
    fn a_full_queue_drops_instead_of_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let recorder = Recorder::start(&section(dir.path(), RecordingFormat::Mooncake), Path::new("/")).unwrap();
        recorder.finish();
        // Finished: nothing is written, nothing waits.
        recorder.record(served(None, tokens(1, 10), 1, Instant::now()));
        assert_eq!(recorder.queued_tokens.load(Ordering::Relaxed), 0);
        assert!(lines(dir.path()).is_empty());
    }

    /// A disk that refuses every write (`/dev/full`): every line is counted lost, none is counted
    /// written, the recordings already there are all kept (none is pruned for a file that holds
    /// nothing), and no empty file is left behind.
    #[test]
    fn a_full_disk_loses_lines_counted_and_deletes_no_recording() {
        let dir = tempfile::tempdir().unwrap();
        let old: Vec<PathBuf> = (1..=3).map(|n| dir.path().join(format!("traffic-{n:013}.jsonl"))).collect();
        for path in &old {
            std::fs::write(path, "{\"timestamp\":0}\n").unwrap();
        }
        let mut cfg = section(dir.path(), RecordingFormat::Mooncake);
        cfg.max_files = 3;
        cfg.max_file_size = dynamo_config::ByteSize(4096);
        let full: Create = |_| File::options().write(true).open("/dev/full");
        let recorder = Recorder::start_with(&cfg, Path::new("/"), full).unwrap();
        let prompt = tokens(3, 20 * TRACE_BLOCK_TOKENS);
        for _ in 0..40 {
            recorder.record(served(None, prompt.clone(), 3, Instant::now()));
        }
        recorder.finish();
        assert_eq!(recorder.tally(), (0, 40), "every line lost is counted, one by one");
        for path in &old {
            assert_eq!(std::fs::read_to_string(path).unwrap(), "{\"timestamp\":0}\n", "{} kept whole", path.display());
        }
        assert_eq!(lines(dir.path()).len(), 3, "no new, empty file");
    }

    /// A writable disk: every line counted written, and the old recordings pruned only for a
    /// file that holds lines.
    #[test]
    fn written_lines_are_counted_and_prune_waits_for_a_file_with_lines() {
        let dir = tempfile::tempdir().unwrap();
        let old = dir.path().join(format!("traffic-{:013}.jsonl", 1));
        std::fs::write(&old, "{\"timestamp\":0}\n").unwrap();
        let mut cfg = section(dir.path(), RecordingFormat::Mooncake);
        cfg.max_files = 1;
        let recorder = Recorder::start(&cfg, Path::new("/")).unwrap();
        assert!(old.exists(), "nothing written yet: the old recording stays");
        for _ in 0..5 {
            recorder.record(served(None, tokens(4, 3 * TRACE_BLOCK_TOKENS), 3, Instant::now()));
        }
        recorder.finish();
        assert_eq!(recorder.tally(), (5, 0));
        assert!(!old.exists(), "pruned once the new file held lines");
        let files = lines(dir.path());
        assert_eq!(files.len(), 1);
        assert_eq!(files[0].len(), 5, "every line in the one file kept");
    }
}
