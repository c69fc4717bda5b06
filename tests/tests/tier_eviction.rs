//! The registry driving a real G3 store: admission evicts by policy and the store frees exactly
//! the victims, so the store never holds more than its capacity; system prompts and held
//! conversation context survive pressure while reasoning goes first; every block the registry
//! still lists reads back verified.

use dynamo_config::RegionKind;
use dynamo_tiering::block::{BlockHash, HEADER_LEN};
use dynamo_tiering::g2::HostPool;
use dynamo_tiering::g3::superblock::file_bytes;
use dynamo_tiering::g3::{EngineChoice, G3Options, G3Store};
use dynamo_tiering::io::uring::UringOptions;
use dynamo_tiering::registry::{Admission, BlockMeta, Millis, PolicyKind, RegistryError, TierRegistry};
use dynamo_tiering::test_utils::{image, pool_for};

const PAYLOAD: usize = 16 * 1024 - HEADER_LEN;
const SLOTS: u64 = 12;

struct Tier {
    registry: TierRegistry,
    store: G3Store,
    pool: HostPool,
    admitted: Vec<BlockHash>,
}

impl Tier {
    fn open(dir: &std::path::Path, policy: PolicyKind) -> Self {
        let pool = pool_for(PAYLOAD, 32);
        let options = G3Options {
            format_foreign: false,
            paths: vec![dir.join("store.0")],
            capacity_per_path: file_bytes(SLOTS, 16 * 1024),
            slot_bytes: 16 * 1024,
            direct_io: true,
            engine: EngineChoice::Uring(UringOptions { queue_depth: 4, threads: 1, register_buffers: true }),
        };
        let (store, _) = G3Store::open(&options, &pool).expect("open");
        Self { registry: TierRegistry::new(store.capacity_slots() as usize, policy), store, pool, admitted: Vec::new() }
    }

    /// Admits one block: evict by policy, free the victims' slots, write the image.
    async fn admit(&mut self, hash: BlockHash, meta: BlockMeta, now: Millis) -> Result<(), RegistryError> {
        self.admitted.push(hash);
        match self.registry.insert(hash, meta, now)? {
            Admission::AlreadyPresent => {}
            Admission::Inserted { evicted } => {
                for victim in evicted {
                    assert!(self.store.remove(victim.hash), "a victim the registry named was in the store");
                }
                self.store.write(image(&self.pool, hash, meta.parent, PAYLOAD)).await.expect("write");
            }
        }
        assert_eq!(self.store.len(), self.registry.len(), "store and registry agree");
        assert!(self.store.len() as u64 <= SLOTS);
        Ok(())
    }

    /// A chain of `n` blocks under `root`, all in one region.
    async fn chain(&mut self, root: u128, n: u128, region: RegionKind, priority: u8, hold: Millis, now: Millis) {
        let mut parent = None;
        for i in 0..n {
            let hash = BlockHash(root << 16 | i);
            let meta = BlockMeta { parent, region, priority, retain_until: hold };
            self.admit(hash, meta, now).await.expect("admitted");
            parent = Some(hash);
        }
    }

    async fn all_resident_read_back(&self) {
        let resident: Vec<_> = self.admitted.iter().filter(|h| self.registry.contains(**h)).collect();
        assert_eq!(resident.len(), self.registry.len());
        for &hash in resident {
            {
                let dst = self.pool.try_alloc().expect("slot");
                assert!(self.store.read(hash, dst).await.is_ok(), "{hash} is listed but does not read back");
            }
        }
    }
}

#[tokio::test]
async fn retention_survives_pressure_on_a_real_store() {
    for policy in [PolicyKind::Lru, PolicyKind::Lfu] {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut tier = Tier::open(dir.path(), policy);
        // A shared system prompt (priority 90), a session's context held for 30 s (60), and its
        // reasoning (10).
        tier.chain(1, 3, RegionKind::System, 90, 0, 1_000).await;
        tier.chain(2, 3, RegionKind::Conversation, 60, 31_000, 1_000).await;
        tier.chain(3, 3, RegionKind::Reasoning, 10, 0, 1_000).await;
        // Pressure: other sessions' tool results keep arriving inside the hold window.
        for s in 0..6u128 {
            tier.chain(10 + s, 2, RegionKind::ToolResult, 50, 0, 2_000 + s as Millis).await;
        }
        for i in 0..3u128 {
            assert!(tier.registry.contains(BlockHash(1 << 16 | i)), "{policy:?}: system prompt evicted");
            assert!(tier.registry.contains(BlockHash(2 << 16 | i)), "{policy:?}: held context evicted");
            assert!(!tier.registry.contains(BlockHash(3 << 16 | i)), "{policy:?}: reasoning outlived tool results");
        }
        tier.all_resident_read_back().await;

        // After the hold expires, the context is an ordinary priority-60 block and loses to
        // newer tool results only once those outrank it — they don't (50 < 60), so the tool
        // results churn among themselves and the context stays.
        for s in 0..4u128 {
            tier.chain(30 + s, 2, RegionKind::ToolResult, 50, 0, 40_000 + s as Millis).await;
        }
        assert!(tier.registry.contains(BlockHash(2 << 16)), "{policy:?}: context outranks tool results");

        // A burst of higher-priority tools definitions pushes it out, tail first (leaf-first).
        tier.chain(50, 7, RegionKind::Tools, 90, 0, 41_000).await;
        let left: Vec<bool> = (0..3u128).map(|i| tier.registry.contains(BlockHash(2 << 16 | i))).collect();
        assert!(left.windows(2).all(|w| w[0] >= w[1]), "{policy:?}: a parent went before its child: {left:?}");
        tier.all_resident_read_back().await;
    }
}

#[tokio::test]
async fn a_tier_of_pinned_blocks_refuses_admission_and_loses_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut tier = Tier::open(dir.path(), PolicyKind::Lru);
    for i in 0..SLOTS as u128 {
        let meta = BlockMeta { parent: None, region: RegionKind::Conversation, priority: 60, retain_until: 0 };
        tier.admit(BlockHash(i), meta, 1).await.expect("fits");
        tier.registry.acquire(BlockHash(i), 1).expect("pin");
    }
    let meta = BlockMeta { parent: None, region: RegionKind::System, priority: 100, retain_until: 0 };
    let err = tier.admit(BlockHash(999), meta, 2).await.expect_err("nothing evictable");
    assert_eq!(err.kind(), "full");
    assert_eq!(tier.store.len() as u64, SLOTS);
    tier.all_resident_read_back().await;
}
