//! The one interface to the tiers below G1: [`TierStore`].
//!
//! An engine (the reference worker, the simulated one) and the node's other users of the tiers
//! (the engine endpoint, G4's block server) ask the same things of what lies below G1: does a
//! tier hold a block, bring blocks from G3 into G2, where does a block that landed in G1 go
//! next and may the disk take it now, hold and promote a block at a turn's end. Each rule behind
//! those answers is written here once, over two implementations: the node's real tiers
//! ([`NodeTiers`]: a host pool, a disk, peers) and the simulated node's
//! ([`SimNode`](crate::worker::simulated::SimNode): registries and timed links).
//!
//! [`NodeTiers`]: crate::tiers::NodeTiers

use std::future::Future;

use dynamo_config::{RegionKind, TierName};
use dynamo_tiering::block::BlockHash;
use dynamo_tiering::g3::G3Error;
use dynamo_tiering::pipeline::{Landed, Pipeline, Presence, Targets};
use dynamo_tiering::registry::{BlockMeta, Millis};

use crate::leases::LeasedTiers;

/// Why a block was not brought from G3 into G2.
#[derive(Debug)]
pub enum ReadMiss {
    /// The node has no G3 now (none configured, or degraded).
    Unavailable,
    /// G2 had no slot to read it into (everything there is held or in use).
    NoSlot,
    /// G3 could not give it. The store already counted the failure toward its health and
    /// forgot the block (every reader's one rule), corrupt or not.
    Failed(G3Error),
}

impl ReadMiss {
    /// Whether the block's bytes were there but failed verification.
    pub fn is_corrupt(&self) -> bool {
        matches!(self, ReadMiss::Failed(G3Error::Corrupt { .. }))
    }
}

/// The tiers below G1 as everything above them uses them. See the module doc.
pub trait TierStore: LeasedTiers {
    /// A block's bytes in G2: a slot of the host pool on a node; nothing in a simulation.
    type Image: Send + 'static;
    /// A place in G3's write backlog: dropping it (when the write is done) ends it.
    type WriteTicket: Send + 'static;

    /// The pipeline's policy over this store's retention and write-through.
    fn pipeline(&self) -> Pipeline<'_>;

    /// Whether `tier` holds `hash` and can give it now (a G3 that is degraded holds nothing),
    /// without counting a use. Only the node's own tiers ([`TierName::NODE`]) hold blocks here.
    fn contains(&self, tier: TierName, hash: BlockHash) -> bool;

    /// Counts a use, in every tier below G1 that holds them, of blocks an engine reused in its
    /// own G1: without it, G2's recency would see only the blocks that hop workers, and drop a
    /// sticky conversation's just before G1 does.
    fn reused(&self, hashes: &[BlockHash], now: Millis);

    /// Gives `hash` in G2 the eviction priority `priority`.
    fn promote(&self, hash: BlockHash, priority: u8);

    /// Keeps `hash` in G2 until `until`.
    fn hold(&self, hash: BlockHash, until: Millis);

    /// The node's one backlog rule: a place in G3's write backlog for one block, or `None` when
    /// the disk's writes are too far behind to take it (counted as skipped). A `leased` block
    /// goes anyway: G3 is where its lease pins it.
    fn begin_g3_write(&self, leased: bool) -> Option<Self::WriteTicket>;

    /// Brings `hashes` from G3 into G2, all in flight together: one result per hash, in order.
    /// A block that comes back is verified; one that fails is forgotten by G3 ([`ReadMiss`]).
    fn read_into_g2(
        &self,
        hashes: &[BlockHash],
        now: Millis,
    ) -> impl Future<Output = Vec<Result<Self::Image, ReadMiss>>> + Send;

    /// What the tiers below G1 hold of `hash` now.
    fn presence(&self, hash: BlockHash) -> Presence {
        Presence { g2: self.contains(TierName::G2, hash), g3: self.contains(TierName::G3, hash) }
    }

    /// The retention of a block of `region` after `parent`.
    fn meta(&self, parent: Option<BlockHash>, region: RegionKind) -> BlockMeta {
        self.pipeline().meta(parent, region)
    }

    /// Where a block of `region` that `landed` in G1 goes below it: the pipeline's targets for
    /// what the tiers hold of it now.
    fn write_targets(&self, hash: BlockHash, region: RegionKind, landed: Landed) -> Targets {
        self.pipeline().write_targets(region, landed, self.presence(hash))
    }

    /// A place in G3's write backlog for `hash` ([`Self::begin_g3_write`]; leased if the lease
    /// book says so now).
    fn g3_write(&self, hash: BlockHash, now: Millis) -> Option<Self::WriteTicket> {
        self.begin_g3_write(self.book().until(hash, now).is_some())
    }
}
