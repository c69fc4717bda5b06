//! Shared fixtures for tests of this crate and of the crates above it.

use crate::block::{BlockHash, BlockLayout, ImageSpec, RetentionMeta, Salt, payload_mut, seal};
use crate::g2::{HostPool, HostPoolOptions, MlockPolicy, SlotRef};

/// A pool of `slots` slots sized for opaque images of `payload` bytes.
pub fn pool_for(payload: usize, slots: u32) -> HostPool {
    let layout = BlockLayout::opaque(payload);
    HostPool::new(HostPoolOptions { slot_bytes: layout.image_bytes(), slots, mlock: MlockPolicy::Try }).expect("pool")
}

/// Deterministic payload bytes for a block hash.
pub fn payload_byte(hash: BlockHash, i: usize) -> u8 {
    let x = (hash.0 as u64) ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x ^ (x >> 29)) as u8
}

/// Seals an opaque image of `payload` bytes for `hash` into a fresh slot of `pool`.
pub fn image(pool: &HostPool, hash: BlockHash, parent: Option<BlockHash>, payload: usize) -> SlotRef {
    let layout = BlockLayout::opaque(payload);
    let mut slot = pool.try_alloc().expect("a free slot for the test image");
    for (i, b) in payload_mut(slot.as_mut_slice(), &layout).iter_mut().enumerate() {
        *b = payload_byte(hash, i);
    }
    seal(
        slot.as_mut_slice(),
        &ImageSpec { hash, parent, salt: Salt(7), layout, token_count: 1, retention: RetentionMeta::default() },
    );
    slot.freeze()
}
