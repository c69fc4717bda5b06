//! Applying KV events on threads of the index's own, off the threads that produce them.
//!
//! A KV event is produced where blocks move: on an engine's thread, in a store actor, or on the
//! connection of a peer node. Applying it there makes that thread pay for the index (a shard's
//! write lock and a cache miss per block) in the middle of work that has its own deadline.
//! [`IndexWriter`] takes events through a queue instead and applies them on `threads` writer
//! threads, while lookups go on in parallel on the threads that route. Each source's events go
//! to one writer (by the source's shard), so they are applied in the order they were sent; a
//! writer applies what has queued up in runs of up to [`RUN`] events per lock acquisition.
//!
//! What a lookup sees: every event sent before it *and applied* — the queue adds a delay of a
//! few microseconds between a block moving and the index knowing. [`IndexWriter::flush`] waits
//! until everything sent so far is applied (tests, and shutdown).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, TryRecvError};

use super::{Applied, KvEvent, PrefixIndex};

/// The most events a writer applies under one lock acquisition: long enough to amortize the
/// lock, short enough that a lookup waits a few microseconds at most.
pub(crate) const RUN: usize = 8;

/// How many events may wait per writer before [`IndexWriter::send`] blocks (back-pressure: a
/// producer faster than the index is slowed down rather than growing the queue without bound).
pub(crate) const QUEUE: usize = 1 << 16;

/// Called on a writer thread with every event and what the index did with it.
pub type OnApplied = Arc<dyn Fn(&KvEvent, Applied) + Send + Sync>;

/// One writer thread's queue and progress.
#[derive(Debug)]
struct Lane {
    tx: Sender<KvEvent>,
    /// Events sent to this lane.
    sent: AtomicU64,
    /// Events this lane's thread has applied.
    applied: Arc<AtomicU64>,
}

/// Writer threads applying events to a [`PrefixIndex`]; see the module docs.
pub struct IndexWriter {
    index: Arc<PrefixIndex>,
    lanes: Vec<Lane>,
    threads: Vec<JoinHandle<()>>,
    /// Woken each time a writer has applied all that was queued to it.
    progress: Arc<tokio::sync::Notify>,
}

impl std::fmt::Debug for IndexWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexWriter").field("lanes", &self.lanes).finish_non_exhaustive()
    }
}

impl IndexWriter {
    /// Starts `threads` writer threads (at least 1) for `index`; `on_applied`, if given, hears of
    /// every event applied (metrics, logging a gap).
    pub fn spawn(index: Arc<PrefixIndex>, threads: usize, on_applied: Option<OnApplied>) -> std::io::Result<Self> {
        let mut lanes = Vec::new();
        let mut handles = Vec::new();
        let progress = Arc::new(tokio::sync::Notify::new());
        for k in 0..threads.max(1) {
            let (tx, rx) = crossbeam_channel::bounded(QUEUE);
            let applied = Arc::new(AtomicU64::new(0));
            let (thread_index, thread_applied, thread_hook) = (index.clone(), applied.clone(), on_applied.clone());
            let thread_progress = progress.clone();
            let handle = std::thread::Builder::new().name(format!("index-writer-{k}")).spawn(move || {
                write_loop(&thread_index, &rx, &thread_applied, thread_hook.as_ref(), &thread_progress)
            })?;
            lanes.push(Lane { tx, sent: AtomicU64::new(0), applied });
            handles.push(handle);
        }
        Ok(Self { index, lanes, threads: handles, progress })
    }

    /// The index it writes.
    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.index
    }

    /// Queues `event`. Events of one source must be sent in order (from one thread, or under the
    /// lock that numbers them); they are applied in that order.
    pub fn send(&self, event: KvEvent) {
        let lane = &self.lanes[self.index.shard_index(event.source) % self.lanes.len()];
        lane.sent.fetch_add(1, Ordering::Relaxed);
        // Sending fails only once the writer thread is gone (it panicked): the index will miss
        // this source's events from here on, so say so.
        if lane.tx.send(event).is_err() {
            tracing::error!("the index writer thread is gone; a KV event was dropped");
        }
    }

    /// Whether every event sent so far has been applied (or its writer thread is gone).
    pub fn caught_up(&self) -> bool {
        self.lanes.iter().zip(&self.threads).all(|(lane, thread)| {
            lane.applied.load(Ordering::Acquire) >= lane.sent.load(Ordering::Relaxed) || thread.is_finished()
        })
    }

    /// Waits until every event sent so far is applied, or `within` passed (what a routing
    /// decision waits for before it reads the index). It sleeps between the writers' progress
    /// notifications: the task's thread is free for other work meanwhile.
    pub async fn catch_up(&self, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let progressed = self.progress.notified();
            tokio::pin!(progressed);
            // Registered before the check, so progress made between the two is not missed.
            progressed.as_mut().enable();
            if self.caught_up() || tokio::time::timeout_at(deadline, progressed).await.is_err() {
                return;
            }
        }
    }

    /// Waits until every event sent before this call is applied (or its writer thread is gone:
    /// a thread that panicked applies nothing more, and waiting for it would never end). Blocks
    /// the calling thread: not for an actor's handler (the scheduler waits with [`Self::caught_up`]).
    pub fn flush(&self) {
        for (lane, thread) in self.lanes.iter().zip(&self.threads) {
            let target = lane.sent.load(Ordering::Relaxed);
            let mut spins = 0u32;
            while lane.applied.load(Ordering::Acquire) < target && !thread.is_finished() {
                spins += 1;
                if spins < 256 {
                    std::hint::spin_loop();
                } else if spins < 1024 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        }
    }
}

impl Drop for IndexWriter {
    /// Applies what is queued, then stops the writer threads.
    fn drop(&mut self) {
        // Closing the channels ends each thread's loop once its queue is empty.
        self.lanes.clear();
        for handle in self.threads.drain(..) {
            let _ = handle.join();
        }
    }
}

/// One writer thread: waits for an event, then applies it and whatever queued behind it.
fn write_loop(
    index: &PrefixIndex,
    rx: &Receiver<KvEvent>,
    applied: &AtomicU64,
    on_applied: Option<&OnApplied>,
    progress: &tokio::sync::Notify,
) {
    let mut run = Vec::with_capacity(RUN);
    let mut outcomes = Vec::with_capacity(RUN);
    while let Ok(first) = rx.recv() {
        run.push(first);
        loop {
            while run.len() < RUN {
                match rx.try_recv() {
                    Ok(event) => run.push(event),
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            }
            index.apply_run(&run, &mut outcomes);
            if let Some(hook) = on_applied {
                for (event, &outcome) in run.iter().zip(&outcomes) {
                    hook(event, outcome);
                }
            }
            applied.fetch_add(run.len() as u64, Ordering::Release);
            let full = run.len() == RUN;
            run.clear();
            if !full {
                break;
            }
        }
        // The queue is drained: whoever waits for the index to catch up looks again.
        progress.notify_waiters();
    }
    progress.notify_waiters();
}
