//! What a node can serve to its peers, as a numbered feed of changes with snapshots.
//!
//! A node's [`Feed`] is told every block its block server can answer from (its G2) as it comes
//! and goes, in the order its tiers report them. A peer that subscribes gets a snapshot of what is
//! servable now, stamped with the feed's sequence number, and then every later change numbered
//! from there on: the snapshot-plus-deltas shape of the prefix index's own resync, so a subscriber
//! that misses a change (a gap, a dropped connection, a subscriber too slow for the feed's buffer)
//! simply subscribes again and starts from a fresh snapshot.
//!
//! A block is servable while the node's G2 or its G3 holds it (a G3 block is read into G2 when a
//! peer holds it). The feed keeps the set of servable blocks with their parents and tiers itself
//! (about 40 bytes a block), so a snapshot is consistent with its sequence number by construction:
//! both are taken under the lock that orders the changes; and a block that moves between the
//! tiers (evicted from G2, still in G3) changes nothing a subscriber sees.

use std::collections::HashMap;
use std::sync::Arc;

use dynamo_config::TierName;
use parking_lot::Mutex;
use tokio::sync::broadcast;

use crate::block::{BlockHash, SetDigest};

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

/// The bit of `tier` among a block's servable tiers: the node's own tiers below G1
/// ([`TierName::NODE`]: G2 is served at once, G3 read into G2 when a peer holds it); `None` for
/// the others, which no peer is served from.
fn servable_bit(tier: TierName) -> Option<u8> {
    TierName::NODE.iter().position(|&t| t == tier).map(|i| 1 << i)
}

#[derive(Debug, Default)]
struct Inner {
    seq: u64,
    /// Servable blocks: parent, and the tiers holding them (bits of [`servable_bit`]).
    blocks: HashMap<BlockHash, (Option<BlockHash>, u8)>,
    /// The digest of `blocks`' keys.
    digest: SetDigest,
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

    /// `hashes`, one chain after `parent`, are now in G2.
    pub fn stored(&self, parent: Option<BlockHash>, hashes: &[BlockHash]) {
        self.stored_in(TierName::G2, parent, hashes);
    }

    /// `hashes` are no longer in G2.
    pub fn removed(&self, hashes: &[BlockHash]) {
        self.removed_from(TierName::G2, hashes);
    }

    /// `hashes`, one chain after `parent`, are now in `tier`. Those that were not servable
    /// before become so: one change per run of them (a run's parent is the block before it), at
    /// most [`MAX_CHANGE_HASHES`] blocks a change, so each fits one frame.
    pub fn stored_in(&self, tier: TierName, parent: Option<BlockHash>, hashes: &[BlockHash]) {
        let Some(bit) = servable_bit(tier) else { return };
        let mut inner = self.inner.lock();
        let mut p = parent;
        let mut run: Vec<BlockHash> = Vec::new();
        let mut run_parent = parent;
        for &h in hashes {
            let entry = inner.blocks.entry(h).or_insert((p, 0));
            let new = entry.1 == 0;
            entry.1 |= bit;
            if new {
                inner.digest.insert(h);
            }
            if new && run.len() < MAX_CHANGE_HASHES {
                if run.is_empty() {
                    run_parent = p;
                }
                run.push(h);
            } else if !run.is_empty() {
                let hashes = std::mem::take(&mut run).into();
                self.emit(&mut inner, FeedChange::Stored { parent: run_parent, hashes });
                if new {
                    run_parent = p;
                    run.push(h);
                }
            }
            p = Some(h);
        }
        if !run.is_empty() {
            self.emit(&mut inner, FeedChange::Stored { parent: run_parent, hashes: run.into() });
        }
    }

    /// `hashes` are no longer in `tier`; those no tier holds now are no longer servable.
    pub fn removed_from(&self, tier: TierName, hashes: &[BlockHash]) {
        let Some(bit) = servable_bit(tier) else { return };
        let mut inner = self.inner.lock();
        let mut gone = Vec::new();
        for h in hashes {
            if let Some(entry) = inner.blocks.get_mut(h) {
                entry.1 &= !bit;
                if entry.1 == 0 {
                    inner.blocks.remove(h);
                    inner.digest.remove(*h);
                    gone.push(*h);
                }
            }
        }
        for chunk in gone.chunks(MAX_CHANGE_HASHES) {
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
        let snapshot = inner.blocks.iter().map(|(&h, &(p, _))| (h, p)).collect();
        Subscription { snapshot, seq: inner.seq, changes }
    }

    /// Servable blocks now.
    pub fn len(&self) -> usize {
        self.inner.lock().blocks.len()
    }

    /// The digest of the servable blocks' set: a peer's index of this node is right when its
    /// digest is this one.
    pub fn digest(&self) -> SetDigest {
        self.inner.lock().digest
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
        feed.removed(&[h(77)]);
        assert_eq!(first.changes.try_recv().unwrap().seq, 2);
        let removed = first.changes.try_recv().unwrap();
        assert_eq!(removed, FeedEvent { seq: 3, change: FeedChange::Removed { hashes: vec![h(1)].into() } });
        assert!(first.changes.try_recv().is_err(), "an empty change is not sent, nor one of unknown blocks");

        // A later subscriber's snapshot is the same set, at the later number.
        let second = feed.subscribe();
        let mut snapshot = second.snapshot;
        snapshot.sort();
        assert_eq!(second.seq, 3);
        assert_eq!(snapshot, vec![(h(2), Some(h(1))), (h(3), Some(h(2)))]);
        assert_eq!(feed.len(), 2);
    }

    /// The digest of a set built from scratch.
    fn digest_of(hashes: impl IntoIterator<Item = BlockHash>) -> SetDigest {
        let mut digest = SetDigest::default();
        hashes.into_iter().for_each(|h| digest.insert(h));
        digest
    }

    #[test]
    fn the_digest_follows_the_servable_set_and_tells_sets_of_one_size_apart() {
        let feed = Feed::new(64);
        let h = |i: u128| BlockHash(i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835));
        assert_eq!(feed.digest(), SetDigest::default());
        feed.stored_in(TierName::G3, None, &[h(1), h(2), h(3)]);
        feed.stored_in(TierName::G2, Some(h(1)), &[h(2), h(3), h(4)]);
        feed.removed_from(TierName::G2, &[h(2), h(4)]);
        feed.removed(&[h(99)]);
        assert_eq!(feed.digest(), digest_of([h(3), h(1), h(2)]), "order-free, each block once");
        let other = digest_of([h(1), h(2), h(5)]);
        assert_ne!(feed.digest(), other, "same size, another set");
        assert_ne!(feed.digest().gauge(), other.gauge(), "and the gauge's 52 bits tell them apart");
        feed.removed_from(TierName::G3, &[h(1), h(2), h(3)]);
        assert_eq!((feed.len(), feed.digest()), (1, digest_of([h(3)])), "3 is still in G2");
        feed.removed(&[h(3)]);
        assert_eq!((feed.len(), feed.digest()), (0, SetDigest::default()));
        feed.stored_in(TierName::G1, None, &[h(7)]);
        feed.stored_in(TierName::G4, None, &[h(8)]);
        assert_eq!(feed.len(), 0, "no peer is served from a worker's G1 or from another node");
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
    fn a_block_in_either_tier_is_servable_and_moving_between_them_changes_nothing() {
        let feed = Feed::new(16);
        let h = BlockHash;
        let mut sub = feed.subscribe();
        feed.stored_in(TierName::G3, None, &[h(1), h(2), h(3)]);
        // G2 takes blocks 2..4: only 4 is new, its parent 3.
        feed.stored_in(TierName::G2, Some(h(1)), &[h(2), h(3), h(4)]);
        // G2 drops 2 and 4: 2 is still in G3, 4 goes.
        feed.removed_from(TierName::G2, &[h(2), h(4)]);
        let changes: Vec<FeedChange> = std::iter::from_fn(|| sub.changes.try_recv().ok()).map(|e| e.change).collect();
        assert_eq!(
            changes,
            vec![
                FeedChange::Stored { parent: None, hashes: vec![h(1), h(2), h(3)].into() },
                FeedChange::Stored { parent: Some(h(3)), hashes: vec![h(4)].into() },
                FeedChange::Removed { hashes: vec![h(4)].into() },
            ]
        );
        assert_eq!(feed.len(), 3);
        // New blocks between known ones come as separate runs, each after its own parent.
        feed.stored_in(TierName::G2, None, &[h(1), h(10), h(2), h(11)]);
        let changes: Vec<FeedChange> = std::iter::from_fn(|| sub.changes.try_recv().ok()).map(|e| e.change).collect();
        assert_eq!(
            changes,
            vec![
                FeedChange::Stored { parent: Some(h(1)), hashes: vec![h(10)].into() },
                FeedChange::Stored { parent: Some(h(2)), hashes: vec![h(11)].into() },
            ]
        );
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
