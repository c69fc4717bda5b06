//! What a node can serve to its peers, as a numbered feed of changes with snapshots.
//!
//! A node's [`Feed`] is told every block its block server can answer from (its G2) as it comes
//! and goes, in the order its tiers report them. A peer that subscribes gets a snapshot of what is
//! servable now, stamped with the feed's sequence number, and then every later change numbered
//! from there on: the snapshot-plus-deltas shape of the prefix index's own resync, so a subscriber
//! that misses a change (a gap, a dropped connection, a subscriber too slow for the feed's buffer)
//! simply subscribes again and starts from a fresh snapshot.
//!
//! The feed keeps the set of servable blocks with their parents itself (32 bytes a block), so a
//! snapshot is consistent with its sequence number by construction: both are taken under the lock
//! that orders the changes.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::broadcast;

use crate::block::BlockHash;

/// One change of what a node can serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FeedChange {
    /// Blocks became servable, one chain: the parent of `hashes[0]` is `parent`, the parent of
    /// `hashes[i]` is `hashes[i - 1]`.
    Stored {
        /// The parent of `hashes[0]`.
        parent: Option<BlockHash>,
        /// The blocks, in prefix order.
        hashes: Arc<[BlockHash]>,
    },
    /// Blocks are no longer servable.
    Removed {
        /// The blocks.
        hashes: Arc<[BlockHash]>,
    },
}

/// A change and its sequence number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeedEvent {
    /// One more than the previous change's.
    pub seq: u64,
    /// What changed.
    pub change: FeedChange,
}

/// What a subscriber starts from.
#[derive(Debug)]
pub struct Subscription {
    /// Every servable block and its parent, as of `seq`.
    pub snapshot: Vec<(BlockHash, Option<BlockHash>)>,
    /// The sequence number of the last change the snapshot reflects.
    pub seq: u64,
    /// Every change after `seq`, in order. A receiver that falls more than the feed's capacity
    /// behind gets `Lagged` and must subscribe again.
    pub changes: broadcast::Receiver<FeedEvent>,
}

#[derive(Debug, Default)]
struct Inner {
    seq: u64,
    blocks: HashMap<BlockHash, Option<BlockHash>>,
}

/// The servable blocks of one node, and their changes for subscribers.
#[derive(Debug)]
pub struct Feed {
    inner: Mutex<Inner>,
    changes: broadcast::Sender<FeedEvent>,
}

impl Feed {
    /// A feed that buffers up to `capacity` changes for its slowest subscriber.
    pub fn new(capacity: usize) -> Self {
        let (changes, _) = broadcast::channel(capacity.max(1));
        Self { inner: Mutex::new(Inner::default()), changes }
    }

    /// `hashes`, one chain after `parent`, are now servable. A chain longer than
    /// [`MAX_CHANGE_HASHES`] becomes several changes, so each fits one frame.
    pub fn stored(&self, parent: Option<BlockHash>, hashes: &[BlockHash]) {
        let mut inner = self.inner.lock();
        let mut p = parent;
        for chunk in hashes.chunks(MAX_CHANGE_HASHES) {
            let first_parent = p;
            for &h in chunk {
                inner.blocks.insert(h, p);
                p = Some(h);
            }
            self.emit(&mut inner, FeedChange::Stored { parent: first_parent, hashes: chunk.into() });
        }
    }

    /// `hashes` are no longer servable.
    pub fn removed(&self, hashes: &[BlockHash]) {
        let mut inner = self.inner.lock();
        for chunk in hashes.chunks(MAX_CHANGE_HASHES) {
            for h in chunk {
                inner.blocks.remove(h);
            }
            self.emit(&mut inner, FeedChange::Removed { hashes: chunk.into() });
        }
    }

    fn emit(&self, inner: &mut Inner, change: FeedChange) {
        inner.seq += 1;
        // Sent under the lock, so every subscriber sees the changes in sequence order; no
        // subscriber is not an error.
        let _ = self.changes.send(FeedEvent { seq: inner.seq, change });
    }

    /// A snapshot and the changes after it.
    pub fn subscribe(&self) -> Subscription {
        let inner = self.inner.lock();
        let changes = self.changes.subscribe();
        let snapshot = inner.blocks.iter().map(|(&h, &p)| (h, p)).collect();
        Subscription { snapshot, seq: inner.seq, changes }
    }

    /// Servable blocks now.
    pub fn len(&self) -> usize {
        self.inner.lock().blocks.len()
    }

    /// Whether nothing is servable.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Default for Feed {
    fn default() -> Self {
        Self::new(DEFAULT_CAPACITY)
    }
}

/// Most blocks in one change (the wire's default limit of hashes per frame).
pub const MAX_CHANGE_HASHES: usize = 4096;

/// Changes a feed buffers for its slowest subscriber by default.
pub const DEFAULT_CAPACITY: usize = 16 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_and_the_changes_after_it_rebuild_the_servable_set() {
        let feed = Feed::new(64);
        let h = BlockHash;
        feed.stored(None, &[h(1), h(2)]);
        let mut first = feed.subscribe();
        assert_eq!(first.seq, 1);
        let mut snapshot = first.snapshot.clone();
        snapshot.sort();
        assert_eq!(snapshot, vec![(h(1), None), (h(2), Some(h(1)))]);

        feed.stored(Some(h(2)), &[h(3)]);
        feed.removed(&[h(1)]);
        feed.removed(&[]);
        assert_eq!(first.changes.try_recv().unwrap().seq, 2);
        let removed = first.changes.try_recv().unwrap();
        assert_eq!(removed, FeedEvent { seq: 3, change: FeedChange::Removed { hashes: vec![h(1)].into() } });
        assert!(first.changes.try_recv().is_err(), "an empty change is not sent");

        // A later subscriber's snapshot is the same set, at the later number.
        let second = feed.subscribe();
        let mut snapshot = second.snapshot;
        snapshot.sort();
        assert_eq!(second.seq, 3);
        assert_eq!(snapshot, vec![(h(2), Some(h(1))), (h(3), Some(h(2)))]);
        assert_eq!(feed.len(), 2);
    }

    #[test]
    fn a_long_chain_is_several_changes_each_continuing_the_last() {
        let feed = Feed::new(8);
        let mut sub = feed.subscribe();
        let chain: Vec<BlockHash> = (1..=(MAX_CHANGE_HASHES as u128 + 10)).map(BlockHash).collect();
        feed.stored(None, &chain);
        let first = sub.changes.try_recv().unwrap();
        let second = sub.changes.try_recv().unwrap();
        let FeedChange::Stored { parent: None, hashes } = first.change else { panic!("{first:?}") };
        assert_eq!(hashes.len(), MAX_CHANGE_HASHES);
        let last = *hashes.last().unwrap();
        assert_eq!(second.change, FeedChange::Stored { parent: Some(last), hashes: chain[MAX_CHANGE_HASHES..].into() });
        assert_eq!(second.seq, 2);
    }

    #[test]
    fn a_subscriber_that_falls_behind_the_buffer_is_told() {
        let feed = Feed::new(2);
        let mut sub = feed.subscribe();
        for i in 0..5 {
            feed.stored(None, &[BlockHash(i)]);
        }
        assert!(matches!(sub.changes.try_recv(), Err(broadcast::error::TryRecvError::Lagged(_))));
    }
}
