//! The history of a node's remote loads (`tiers.g4.history`): one JSON line per block asked of a
//! peer, for audits and for the checkers of the fault tests.
//!
//! A line: `{"t0_ms":…,"t1_ms":…,"budget_ms":…,"peer":"10.0.0.3:7100","epoch":…,"hash":"<32 hex>",
//! "outcome":"verified","digest":"<16 hex>"}`. `t0_ms`/`t1_ms` are the fetch's start and end (Unix
//! milliseconds), `budget_ms` the time it was given, `epoch` the peer's as it proved it, `outcome`
//! `verified`, `missing`, `rejected`, `skipped`, `no_room` or the fetch's error kind (`deadline`,
//! `closed`, …), and `digest` the xxh3-64 of the verified image (verified blocks only). Lines go to a
//! writer thread through a bounded queue; a full queue drops the line and counts it, never slows a
//! load.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};

use dynamo_tiering::block::BlockHash;

/// Lines queued for the writer at most.
const QUEUE: usize = 16 * 1024;

/// An open history file.
#[derive(Debug)]
pub struct LoadHistory {
    lines: SyncSender<String>,
    dropped: AtomicU64,
}

/// One block of one fetch.
#[derive(Clone, Copy, Debug)]
pub struct HistoryEntry<'a> {
    /// When the fetch started, Unix milliseconds.
    pub t0_ms: u64,
    /// When it ended.
    pub t1_ms: u64,
    /// The time it was given.
    pub budget_ms: u64,
    /// The peer's address.
    pub peer: &'a str,
    /// The peer's epoch.
    pub epoch: u64,
    /// The block.
    pub hash: BlockHash,
    /// What became of it.
    pub outcome: &'a str,
    /// The xxh3-64 of the verified image.
    pub digest: Option<u64>,
}

impl LoadHistory {
    /// Appends to the file at `path` (created if absent) from a writer thread of its own.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        let (lines, rx) = sync_channel::<String>(QUEUE);
        std::thread::Builder::new().name("g4-history".into()).spawn(move || {
            let mut out = std::io::BufWriter::new(file);
            while let Ok(line) = rx.recv() {
                let _ = out.write_all(line.as_bytes());
                // Whatever else is queued goes in the same write; then the file is current.
                while let Ok(line) = rx.try_recv() {
                    let _ = out.write_all(line.as_bytes());
                }
                let _ = out.flush();
            }
        })?;
        Ok(Self { lines, dropped: AtomicU64::new(0) })
    }

    /// Queues `entry`'s line.
    pub fn record(&self, entry: &HistoryEntry<'_>) {
        let digest = entry.digest.map_or_else(String::new, |d| format!(",\"digest\":\"{d:016x}\""));
        let line = format!(
            "{{\"t0_ms\":{},\"t1_ms\":{},\"budget_ms\":{},\"peer\":{:?},\"epoch\":{},\"hash\":\"{}\",\"outcome\":{:?}{digest}}}\n",
            entry.t0_ms, entry.t1_ms, entry.budget_ms, entry.peer, entry.epoch, entry.hash, entry.outcome
        );
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.lines.try_send(line) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Lines lost to a full queue.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_entry_is_one_json_line_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.jsonl");
        let history = LoadHistory::open(&path).unwrap();
        let entry = HistoryEntry {
            t0_ms: 10,
            t1_ms: 12,
            budget_ms: 50,
            peer: "10.0.0.3:7100",
            epoch: 7,
            hash: BlockHash(0xab),
            outcome: "verified",
            digest: Some(0xfeed),
        };
        history.record(&entry);
        history.record(&HistoryEntry { outcome: "deadline", digest: None, ..entry });
        drop(history);
        let mut text = String::new();
        for _ in 0..100 {
            text = std::fs::read_to_string(&path).unwrap();
            if text.lines().count() == 2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "{\"t0_ms\":10,\"t1_ms\":12,\"budget_ms\":50,\"peer\":\"10.0.0.3:7100\",\"epoch\":7,\
                 \"hash\":\"000000000000000000000000000000ab\",\"outcome\":\"verified\",\"digest\":\"000000000000feed\"}",
                "{\"t0_ms\":10,\"t1_ms\":12,\"budget_ms\":50,\"peer\":\"10.0.0.3:7100\",\"epoch\":7,\
                 \"hash\":\"000000000000000000000000000000ab\",\"outcome\":\"deadline\"}",
            ]
        );
    }
}
