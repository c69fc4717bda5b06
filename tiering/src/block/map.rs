//! Maps keyed by [`BlockHash`]: the registries, the G3 slot map, the G2 slot map, the lease
//! book and a worker's G1 table all look blocks up by hash on every request.
//!
//! A block hash is already the output of xxh3-128, so SipHash (std's default) over it is mostly
//! wasted time: it was a seventh of a simulated replay's CPU. It is not a secret either: anyone
//! who knows the model's salt can compute hashes offline and choose token blocks whose hashes
//! share their low bits, so a map that used those bits directly could be flooded into linear
//! probing by a client. [`BlockHashBuild`] takes the middle course of ahash: one folded 64×64
//! multiply of the two halves, each xored with a per-process random key first, then a second
//! fold with a constant, so every output bit depends on every input bit and on a key no client
//! sees.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

use super::BlockHash;

/// A map keyed by block hash, hashed by [`BlockHashBuild`].
pub type BlockMap<V> = HashMap<BlockHash, V, BlockHashBuild>;

/// Builds [`BlockHashHasher`]s under this process's key.
#[derive(Clone, Copy, Debug)]
pub struct BlockHashBuild {
    keys: (u64, u64),
}

impl Default for BlockHashBuild {
    fn default() -> Self {
        static KEYS: OnceLock<(u64, u64)> = OnceLock::new();
        let keys = *KEYS.get_or_init(|| {
            // std's RandomState draws its keys from the OS once per process.
            let state = std::collections::hash_map::RandomState::new();
            (state.hash_one(0x6b65_7930_u64), state.hash_one(0x6b65_7931_u64))
        });
        Self { keys }
    }
}

impl BuildHasher for BlockHashBuild {
    type Hasher = BlockHashHasher;

    fn build_hasher(&self) -> BlockHashHasher {
        BlockHashHasher { keys: self.keys, state: 0 }
    }
}

/// Folds a `u128` into 64 bits with one keyed multiply. Other input (never written by
/// `BlockHash`) is absorbed word by word through the same fold, so the hasher stays correct for
/// any key type.
#[derive(Clone, Copy, Debug)]
pub struct BlockHashHasher {
    keys: (u64, u64),
    state: u64,
}

/// The high and low halves of a 64×64 → 128-bit product, xored.
fn folded_multiply(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

impl BlockHashHasher {
    fn absorb(&mut self, lo: u64, hi: u64) {
        self.state = folded_multiply(lo ^ self.keys.0 ^ self.state, hi ^ self.keys.1);
    }
}

impl Hasher for BlockHashHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.absorb(u64::from_le_bytes(word), chunk.len() as u64);
        }
    }

    fn write_u128(&mut self, value: u128) {
        self.absorb(value as u64, (value >> 64) as u64);
    }

    fn finish(&self) -> u64 {
        // One more fold with an odd constant: a key whose lanes have many trailing zeros would
        // otherwise leave the low bits (the ones a table uses) to few input bits.
        folded_multiply(self.state, 0x9e37_79b9_7f4a_7c15)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_that_share_their_low_bits_still_spread_over_the_buckets() {
        let build = BlockHashBuild::default();
        // 4096 hashes equal in their low 64 bits (what a flooding client would craft), and 4096
        // equal in their high 64 bits: both land in many distinct buckets of a 1024-bucket table.
        for spread in [|i: u128| (i << 64) | 0xdead_beef, |i: u128| (0xfeed_u128 << 64) | i] {
            let buckets: std::collections::HashSet<u64> =
                (0..4096u128).map(|i| build.hash_one(BlockHash(spread(i))) & 1023).collect();
            // Uniform hashing fills about 1005 (1024 × (1 − e^−4)), give or take a few.
            assert!(buckets.len() > 960, "only {} of 1024 buckets used", buckets.len());
        }
        // One process, one key: equal blocks hash equally, and maps work.
        assert_eq!(build.hash_one(BlockHash(7)), BlockHashBuild::default().hash_one(BlockHash(7)));
        let mut map: BlockMap<u32> = BlockMap::default();
        map.insert(BlockHash(1), 1);
        map.insert(BlockHash(1 << 64), 2);
        assert_eq!((map.get(&BlockHash(1)), map.get(&BlockHash(1 << 64))), (Some(&1), Some(&2)));
    }
}
