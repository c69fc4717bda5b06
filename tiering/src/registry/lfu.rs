//! Priority-aware least-frequently-used eviction with time-based aging.
//!
//! See [`LfuPolicy`] for the aging rule.

use super::Millis;
use super::policy::{Candidate, EvictionPolicy, KeyedSet};
use crate::block::BlockHash;

/// Default half-life of an access count: one minute of idleness halves a block's aged count.
pub const DEFAULT_HALF_LIFE_MS: Millis = 60_000;

/// The order key of [`LfuPolicy`]: `(priority, score, last_access, seq)`, smallest evicted first.
pub type LfuKey = (u8, u128, Millis, u64);

/// Evicts the lowest priority first and, within a priority, the lowest aged access count, then
/// the least recently accessed block. A B-tree over [`LfuKey`]: `O(log n)` per operation.
///
/// # Aging rule
///
/// Plain LFU keeps a block that was hot once forever. Here a block's **aged count** at time `t` is
///
/// ```text
/// aged(t) = access_count / 2^((t - last_access) / half_life)
/// ```
///
/// — its access count halves for every `half_life` it stays idle — and the policy evicts the
/// lowest aged count first. Every block ages at the same rate, so comparing aged counts at any
/// common instant `t` is the same as comparing
///
/// ```text
/// score = log2(access_count) * half_life + last_access
/// ```
///
/// which does not depend on `t`: the order never goes stale and needs no periodic re-keying or
/// scan. `log2` is taken in sixteenths (the integer part plus the next four bits of the count, a
/// piecewise-linear approximation), so the score is exact integer arithmetic.
///
/// In words: a block accessed `c` times ranks like a once-accessed block touched `log2(c)`
/// half-lives later. A once-hot block with `2^k` accesses loses its advantage after about `k`
/// half-lives of idleness; counts saturate at `u32::MAX`, so no block is ever worth more than 32
/// half-lives of recency. Among blocks accessed once the policy is exactly LRU. (The rule treats
/// all `c` accesses as if they happened at the last one, so it favours steadily used blocks a
/// little more than a true exponentially-decayed sum would; that is the price of needing no
/// per-block decay state beyond the count and the last access, which the registry keeps anyway.)
///
/// Ties in score go to the least recently accessed block, then to the lower [`Candidate::seq`].
#[derive(Debug)]
pub struct LfuPolicy {
    half_life: Millis,
    set: KeyedSet<LfuKey>,
}

impl LfuPolicy {
    /// An empty policy with [`DEFAULT_HALF_LIFE_MS`].
    pub fn new() -> Self {
        Self::with_half_life(DEFAULT_HALF_LIFE_MS)
    }

    /// An empty policy whose access counts halve every `half_life` ms of idleness. A half-life of
    /// 0 disables frequency altogether (the policy degenerates to priority-aware LRU).
    pub fn with_half_life(half_life: Millis) -> Self {
        Self { half_life, set: KeyedSet::new() }
    }

    /// The half-life this policy ages counts with.
    pub fn half_life(&self) -> Millis {
        self.half_life
    }

    /// The order key of a candidate under half-life `half_life`.
    pub fn key_with(half_life: Millis, candidate: &Candidate) -> LfuKey {
        (
            candidate.priority,
            score(half_life, candidate.access_count, candidate.last_access),
            candidate.last_access,
            candidate.seq,
        )
    }

    fn key(&self, candidate: &Candidate) -> LfuKey {
        Self::key_with(self.half_life, candidate)
    }
}

impl Default for LfuPolicy {
    fn default() -> Self {
        Self::new()
    }
}

/// `log2(count)` in sixteenths: `16 * floor(log2 c)` plus the four bits below the leading one.
/// Monotone non-decreasing in `count`; `log2_q4(1) == 0`, `log2_q4(2) == 16`, `log2_q4(3) == 24`.
/// A count of 0 is treated as 1.
pub fn log2_q4(count: u32) -> u32 {
    let c = count.max(1);
    let int = c.ilog2();
    let frac = if int >= 4 { (c >> (int - 4)) & 0xF } else { (c << (4 - int)) & 0xF };
    16 * int + frac
}

/// The time-invariant aging score, in sixteenths of a millisecond:
/// `16 * last_access + half_life * log2_q4(count)`. Lower is evicted first.
pub fn score(half_life: Millis, count: u32, last_access: Millis) -> u128 {
    16 * u128::from(last_access) + u128::from(half_life) * u128::from(log2_q4(count))
}

impl EvictionPolicy for LfuPolicy {
    fn insert(&mut self, hash: BlockHash, candidate: Candidate) {
        let key = self.key(&candidate);
        self.set.insert(hash, key);
    }
    fn remove(&mut self, hash: BlockHash) {
        self.set.remove(hash);
    }
    fn access(&mut self, hash: BlockHash, candidate: Candidate) {
        let key = self.key(&candidate);
        self.set.rekey(hash, key);
    }
    fn victim(&self) -> Option<BlockHash> {
        self.set.first()
    }
    fn pop(&mut self) -> Option<BlockHash> {
        self.set.pop_first()
    }
    fn len(&self) -> usize {
        self.set.len()
    }
    fn contains(&self, hash: BlockHash) -> bool {
        self.set.contains(hash)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log2_q4_is_monotone_and_exact_on_powers_of_two() {
        let mut prev = 0;
        for c in 1..5000u32 {
            let v = log2_q4(c);
            assert!(v >= prev, "log2_q4 not monotone at {c}");
            prev = v;
        }
        for k in 0..32 {
            assert_eq!(log2_q4(1 << k), 16 * k);
        }
        assert_eq!(log2_q4(3), 24);
        assert_eq!(log2_q4(0), 0);
        assert_eq!(log2_q4(u32::MAX), 16 * 31 + 15);
    }

    #[test]
    fn once_hot_block_loses_to_fresh_block_after_enough_half_lives() {
        let h = 1_000;
        // 1024 accesses at t = 0 are worth 10 half-lives of recency.
        let hot = score(h, 1024, 0);
        assert!(hot > score(h, 1, 9_999));
        assert_eq!(hot, score(h, 1, 10_000));
        assert!(hot < score(h, 1, 10_001));
    }

    #[test]
    fn zero_half_life_is_lru() {
        assert!(score(0, 1_000_000, 5) < score(0, 1, 6));
    }
}
