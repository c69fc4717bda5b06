//! Opening a store together with its registry: what a restarted node knows about G3.
//!
//! [`G3Store::open`] rebuilds the store's own index (`hash → slot`) from the slot headers;
//! [`G3Store::open_recovered`] also rebuilds the tier's [`TierRegistry`] from them (parent,
//! region, priority and hold travel in every header), so eviction and retention pick up where
//! the previous incarnation left them. Every recovered block is verified again when it is read.

use crate::block::ImageHeader;
use crate::g2::HostPool;
use crate::registry::{BlockMeta, Millis, PolicyKind, TierRegistry};

use super::{G3Error, G3Options, G3Store, Recovery};

/// A store opened with its registry rebuilt from what it found.
#[derive(Debug)]
pub struct Recovered {
    /// The store.
    pub store: G3Store,
    /// One entry per recovered block, sized to the store's slots.
    pub registry: TierRegistry,
    /// What the scan found (the recovered headers, invalid slots, formatted files).
    pub recovery: Recovery,
}

impl G3Store {
    /// [`G3Store::open`], then a registry of [`G3Store::capacity_slots`] blocks evicting by
    /// `policy`, holding every recovered block with the retention metadata of its header, at
    /// clock `now` (milliseconds since the Unix epoch, the clock of header deadlines). Blocks
    /// while it scans.
    pub fn open_recovered(
        options: &G3Options,
        pool: &HostPool,
        policy: PolicyKind,
        now: Millis,
    ) -> Result<Recovered, G3Error> {
        let (store, recovery) = Self::open(options, pool)?;
        let registry = registry_of(&recovery.blocks, store.capacity_slots() as usize, policy, now)?;
        Ok(Recovered { store, registry, recovery })
    }
}

/// A registry of `capacity` blocks holding `blocks`, in the order given.
fn registry_of(
    blocks: &[ImageHeader],
    capacity: usize,
    policy: PolicyKind,
    now: Millis,
) -> Result<TierRegistry, G3Error> {
    let mut registry = TierRegistry::new(capacity, policy);
    for header in blocks {
        let meta = BlockMeta {
            parent: header.parent,
            region: header.retention.region,
            priority: header.retention.priority,
            retain_until: header.retention.retain_until_ms,
        };
        registry
            .insert(header.hash, meta, now)
            .map_err(|source| G3Error::Unregistered { hash: header.hash, source })?;
    }
    Ok(registry)
}

#[cfg(test)]
mod tests {
    use dynamo_config::RegionKind;

    use super::*;
    use crate::block::{BlockHash, BlockLayout, ImageSpec, RetentionMeta, Salt, seal};
    use crate::g2::align_up;
    use crate::g3::EngineChoice;
    use crate::g3::superblock::file_bytes;
    use crate::test_utils::pool_for;

    const PAYLOAD: usize = 3000;

    fn options(dir: &tempfile::TempDir) -> G3Options {
        let slot_bytes = align_up(BlockLayout::opaque(PAYLOAD).image_bytes());
        G3Options {
            paths: vec![dir.path().join("g3.data")],
            capacity_per_path: file_bytes(8, slot_bytes as u64),
            slot_bytes,
            direct_io: false,
            engine: EngineChoice::Psync { threads: 2 },
            format_foreign: false,
        }
    }

    fn retained(region: RegionKind, priority: u8, retain_until_ms: u64) -> RetentionMeta {
        RetentionMeta { region, priority, retain_until_ms, ..RetentionMeta::default() }
    }

    #[tokio::test]
    async fn a_reopened_store_brings_back_its_blocks_with_their_retention_in_the_registry() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool_for(PAYLOAD, 8);
        let layout = BlockLayout::opaque(PAYLOAD);
        let chain = [
            (BlockHash(1), None, retained(RegionKind::System, 90, 0)),
            (BlockHash(2), Some(BlockHash(1)), retained(RegionKind::Conversation, 60, 5_000)),
        ];
        {
            let fresh = G3Store::open_recovered(&options(&dir), &pool, PolicyKind::Lru, 1_000).unwrap();
            assert_eq!(fresh.registry.len(), 0);
            assert_eq!(fresh.registry.capacity(), fresh.store.capacity_slots() as usize);
            assert_eq!(fresh.recovery.formatted_files, 1);
            for (hash, parent, retention) in chain {
                let mut slot = pool.try_alloc().unwrap();
                seal(
                    slot.as_mut_slice(),
                    &ImageSpec { hash, parent, salt: Salt(7), layout, token_count: 1, retention },
                );
                fresh.store.write(slot.freeze()).await.unwrap();
            }
        }
        let again = G3Store::open_recovered(&options(&dir), &pool, PolicyKind::Lfu, 2_000).unwrap();
        assert_eq!((again.recovery.blocks.len(), again.registry.len(), again.store.len()), (2, 2, 2));
        for (hash, parent, retention) in chain {
            let entry = again.registry.meta(hash).expect("recovered into the registry");
            assert_eq!(
                (entry.parent, entry.region, entry.priority, entry.retain_until),
                (parent, retention.region, retention.priority, retention.retain_until_ms)
            );
        }
        // The chain is rebuilt too: leaf-first eviction takes the child before its parent.
        let mut registry = again.registry;
        assert_eq!(registry.meta(BlockHash(1)).map(|e| e.resident_children), Some(1));
        assert_eq!(registry.evict(1, 6_000).first().map(|e| e.hash), Some(BlockHash(2)));
    }

    /// A file formatted by version 1 (slots right after the 4 KiB superblock) keeps its layout and
    /// its blocks: they are recovered, read back verified, and a block written now lands beside
    /// them, still found after another reopen.
    #[tokio::test]
    async fn a_store_of_the_first_layout_reopens_with_its_blocks() {
        use crate::g3::superblock::SUPERBLOCK_LEN;
        use crate::test_utils::image;
        use std::os::unix::fs::FileExt;

        let dir = tempfile::tempdir().unwrap();
        let pool = pool_for(PAYLOAD, 8);
        let mut opts = options(&dir);
        let slot_bytes = opts.slot_bytes as u64;
        opts.capacity_per_path = SUPERBLOCK_LEN + 8 * slot_bytes;
        let file = std::fs::File::create(&opts.paths[0]).unwrap();
        file.set_len(opts.capacity_per_path).unwrap();
        let mut head = vec![0u8; SUPERBLOCK_LEN as usize];
        head[0..8].copy_from_slice(b"DYNKVG3S");
        head[8..12].copy_from_slice(&1u32.to_le_bytes());
        head[16..24].copy_from_slice(&slot_bytes.to_le_bytes());
        head[24..32].copy_from_slice(&8u64.to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64(&head[..32]);
        head[32..40].copy_from_slice(&sum.to_le_bytes());
        file.write_all_at(&head, 0).unwrap();
        for i in 0..2u64 {
            let slot = image(&pool, BlockHash(10 + i as u128), None, PAYLOAD);
            file.write_all_at(slot.as_slice(), SUPERBLOCK_LEN + i * slot_bytes).unwrap();
        }
        drop(file);

        {
            let old = G3Store::open_recovered(&opts, &pool, PolicyKind::Lru, 1_000).unwrap();
            assert_eq!((old.recovery.formatted_files, old.recovery.blocks.len()), (0, 2));
            assert_eq!(old.store.capacity_slots(), 8, "the first layout's slots, all of them");
            for hash in [BlockHash(10), BlockHash(11)] {
                old.store.read(hash, pool.try_alloc().unwrap()).await.expect("verified where version 1 put it");
            }
            old.store.write(image(&pool, BlockHash(12), None, PAYLOAD)).await.unwrap();
        }
        let again = G3Store::open_recovered(&opts, &pool, PolicyKind::Lru, 2_000).unwrap();
        assert_eq!(again.recovery.blocks.len(), 3);
        again.store.read(BlockHash(12), pool.try_alloc().unwrap()).await.expect("the new block");
    }
}
