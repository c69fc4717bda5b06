//! Hashers of the index's maps.
//!
//! A [`BlockHash`](dynamo_tiering::block::BlockHash) is already the output of xxh3-128, uniformly
//! distributed, so hashing it again only costs time: the block maps use its low 64 bits directly.
//! The small maps keyed by source or location (looked up once per event) use [`Fx`], a
//! multiply-rotate hash: their keys are a few small integers chosen by us, not by a client, so
//! SipHash's flooding resistance buys nothing there.

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

/// Builds [`Fx`] hashers.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct FxBuild;

impl BuildHasher for FxBuild {
    type Hasher = Fx;

    fn build_hasher(&self) -> Fx {
        Fx(0)
    }
}

/// The rustc "Fx" hash: per word, rotate, xor, multiply.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Fx(u64);

impl Fx {
    const K: u64 = 0xf135_7aea_2e62_a9c5;

    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(Self::K);
    }
}

impl Hasher for Fx {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, value: u8) {
        self.add(u64::from(value));
    }

    fn write_u16(&mut self, value: u16) {
        self.add(u64::from(value));
    }

    fn write_u32(&mut self, value: u32) {
        self.add(u64::from(value));
    }

    fn write_u64(&mut self, value: u64) {
        self.add(value);
    }

    fn write_usize(&mut self, value: usize) {
        self.add(value as u64);
    }

    fn finish(&self) -> u64 {
        // The high bits pick the control byte in hashbrown; fold them down as well.
        self.0.rotate_left(26)
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
