//! The serving side's holds, sans I/O: what a peer has pinned, until when.
//!
//! A hold keeps its blocks' slot handles (`T`, a [`crate::g2::SlotRef`] on a node) alive so their
//! images stay put while the reader fetches them. It ends by release, or by its TTL when the
//! reader crashed or went silent: [`HoldTable::expire`] drops those and counts them, so no peer can
//! pin memory forever (NVIDIA Dynamo's remote holds never expire). Every limit is per peer: holds
//! open, blocks pinned, the TTL granted.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::block::BlockHash;

/// What one peer may pin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HoldLimits {
    /// Holds open at once.
    pub max_holds: usize,
    /// Blocks pinned across its holds.
    pub max_blocks: usize,
    /// The longest TTL granted, whatever the peer asks.
    pub max_ttl: Duration,
}

impl Default for HoldLimits {
    fn default() -> Self {
        Self { max_holds: 64, max_blocks: 16_384, max_ttl: Duration::from_secs(10) }
    }
}

/// A hold refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HoldError {
    /// The peer has as many holds open as it may.
    #[error("{0} holds open: the limit")]
    TooManyHolds(usize),
    /// The hold would pin more blocks than the peer may.
    #[error("{pinned} blocks pinned and {asked} more asked: over the limit of {max}")]
    TooManyBlocks {
        /// Pinned now.
        pinned: usize,
        /// In the new hold.
        asked: usize,
        /// The limit.
        max: usize,
    },
}

struct Hold<T> {
    blocks: Vec<(BlockHash, T)>,
    expires: Instant,
}

/// One peer's holds.
pub struct HoldTable<T> {
    limits: HoldLimits,
    holds: HashMap<u64, Hold<T>>,
    next_id: u64,
    pinned: usize,
    expired: u64,
}

impl<T> std::fmt::Debug for HoldTable<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HoldTable")
            .field("limits", &self.limits)
            .field("holds", &self.holds.len())
            .field("pinned", &self.pinned)
            .field("expired", &self.expired)
            .finish()
    }
}

impl<T: Clone> HoldTable<T> {
    /// An empty table enforcing `limits`.
    pub fn new(limits: HoldLimits) -> Self {
        Self { limits, holds: HashMap::new(), next_id: 1, pinned: 0, expired: 0 }
    }

    /// Opens a hold on resident blocks (the caller resolved the peer's hashes in its registry and
    /// passes the handles of those it found). Returns the hold's id and the TTL granted.
    pub fn open(
        &mut self,
        blocks: Vec<(BlockHash, T)>,
        ttl: Duration,
        now: Instant,
    ) -> Result<(u64, Duration), HoldError> {
        if self.holds.len() >= self.limits.max_holds {
            return Err(HoldError::TooManyHolds(self.holds.len()));
        }
        if self.pinned + blocks.len() > self.limits.max_blocks {
            return Err(HoldError::TooManyBlocks {
                pinned: self.pinned,
                asked: blocks.len(),
                max: self.limits.max_blocks,
            });
        }
        let ttl = ttl.min(self.limits.max_ttl);
        let id = self.next_id;
        self.next_id += 1;
        self.pinned += blocks.len();
        self.holds.insert(id, Hold { blocks, expires: now + ttl });
        Ok((id, ttl))
    }

    /// The handle of a held block, for a fetch; `None` if the hold is unknown or expired, or does
    /// not hold that block. A fetch extends nothing: the TTL bounds the whole exchange.
    pub fn get(&self, hold_id: u64, hash: BlockHash, now: Instant) -> Option<T> {
        let hold = self.holds.get(&hold_id).filter(|h| h.expires > now)?;
        hold.blocks.iter().find(|(h, _)| *h == hash).map(|(_, t)| t.clone())
    }

    /// Ends a hold; whether it was open.
    pub fn release(&mut self, hold_id: u64) -> bool {
        match self.holds.remove(&hold_id) {
            Some(hold) => {
                self.pinned -= hold.blocks.len();
                true
            }
            None => false,
        }
    }

    /// Drops every hold past its TTL; how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let before = self.holds.len();
        let mut unpinned = 0;
        self.holds.retain(|_, h| {
            let keep = h.expires > now;
            if !keep {
                unpinned += h.blocks.len();
            }
            keep
        });
        self.pinned -= unpinned;
        let dropped = before - self.holds.len();
        self.expired += dropped as u64;
        dropped
    }

    /// Drops every hold (the peer disconnected).
    pub fn clear(&mut self) {
        self.holds.clear();
        self.pinned = 0;
    }

    /// Holds open.
    pub fn open_holds(&self) -> usize {
        self.holds.len()
    }

    /// Blocks pinned.
    pub fn pinned_blocks(&self) -> usize {
        self.pinned
    }

    /// Holds that ran out since the table was made.
    pub fn expired_total(&self) -> u64 {
        self.expired
    }

    /// When the next hold runs out, for the caller's timer.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.holds.values().map(|h| h.expires).min()
    }
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use super::*;

    fn blocks(n: u128, handle: &Rc<()>) -> Vec<(BlockHash, Rc<()>)> {
        (0..n).map(|i| (BlockHash(i), handle.clone())).collect()
    }

    #[test]
    fn holds_pin_until_released_or_expired_and_expiry_is_counted() {
        let limits = HoldLimits { max_holds: 4, max_blocks: 100, max_ttl: Duration::from_secs(10) };
        let mut table = HoldTable::new(limits);
        let handle = Rc::new(());
        let t0 = Instant::now();
        let (a, ttl) = table.open(blocks(3, &handle), Duration::from_secs(60), t0).unwrap();
        assert_eq!(ttl, Duration::from_secs(10), "the TTL is capped");
        let (b, _) = table.open(blocks(2, &handle), Duration::from_secs(1), t0).unwrap();
        assert_eq!(Rc::strong_count(&handle), 6, "the table keeps the handles alive");
        assert_eq!(table.pinned_blocks(), 5);
        assert!(table.get(a, BlockHash(2), t0).is_some());
        assert!(table.get(a, BlockHash(7), t0).is_none(), "not in the hold");
        assert_eq!(table.next_expiry(), Some(t0 + Duration::from_secs(1)));

        // The reader of b went silent: its hold runs out, is counted, and lets its blocks go.
        let later = t0 + Duration::from_secs(2);
        assert!(table.get(b, BlockHash(0), later).is_none(), "an expired hold serves nothing");
        assert_eq!(table.expire(later), 1);
        assert_eq!(table.expired_total(), 1);
        assert_eq!(Rc::strong_count(&handle), 4);
        assert!(table.release(a));
        assert!(!table.release(a), "released once");
        assert_eq!((table.open_holds(), table.pinned_blocks()), (0, 0));
        assert_eq!(Rc::strong_count(&handle), 1);
    }

    #[test]
    fn a_peer_cannot_pin_past_its_limits() {
        let limits = HoldLimits { max_holds: 2, max_blocks: 5, max_ttl: Duration::from_secs(10) };
        let mut table = HoldTable::new(limits);
        let handle = Rc::new(());
        let now = Instant::now();
        table.open(blocks(3, &handle), Duration::from_secs(5), now).unwrap();
        assert_eq!(
            table.open(blocks(3, &handle), Duration::from_secs(5), now).unwrap_err(),
            HoldError::TooManyBlocks { pinned: 3, asked: 3, max: 5 }
        );
        table.open(blocks(2, &handle), Duration::from_secs(5), now).unwrap();
        assert_eq!(table.open(vec![], Duration::from_secs(5), now).unwrap_err(), HoldError::TooManyHolds(2));
        table.clear();
        assert_eq!(Rc::strong_count(&handle), 1);
        assert!(table.open(blocks(5, &handle), Duration::from_secs(5), now).is_ok());
    }
}
