//! A pass-through hasher for block hashes.
//!
//! A [`BlockHash`](dynamo_tiering::block::BlockHash) is already the output of xxh3-128, uniformly
//! distributed, so hashing it again only costs time: the map uses its low 64 bits directly.

use std::hash::{BuildHasher, Hasher};

/// Builds [`LowBits`] hashers.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct BlockHashBuild;

impl BuildHasher for BlockHashBuild {
    type Hasher = LowBits;

    fn build_hasher(&self) -> LowBits {
        LowBits(0)
    }
}

/// Takes the low 64 bits of a `u128` as the hash. Other input (never written by `BlockHash`) is
/// folded with FNV-1a so the hasher stays correct, if slower, for any key.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct LowBits(u64);

impl Hasher for LowBits {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn write_u128(&mut self, value: u128) {
        self.0 ^= value as u64;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynamo_tiering::block::BlockHash;

    #[test]
    fn a_block_hash_hashes_to_its_low_bits() {
        let h = BlockHash((0xdead_beef_u128 << 64) | 0x0123_4567_89ab_cdef);
        assert_eq!(BlockHashBuild.hash_one(h), 0x0123_4567_89ab_cdef);
    }
}
