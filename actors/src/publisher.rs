//! KV events from a node's tiers into the global prefix index.
//!
//! [`KvPublisher`] is the node's [`KvObserver`]: every change of where blocks are (a worker's G1
//! registering or evicting, G2 admitting or evicting, G3 acknowledging a write or dropping a
//! block) becomes a [`KvEvent`] with its source's next sequence number, applied to the index at
//! once. One lock orders sequencing and application, so the index sees each source's events in
//! order without gaps; a source that restarts (a new node process) gets a new epoch, so the
//! index drops what its previous incarnation reported.

use std::collections::HashMap;
use std::sync::Arc;

use dynamo_config::TierName;
use dynamo_tiering::block::BlockHash;
use parking_lot::Mutex;

use crate::index::{Applied, KvEvent, KvEventKind, PrefixIndex, SourceId};
use crate::telemetry;
use crate::tiers::{BlockSite, KvObserver};

/// Turns tier changes into sequenced KV events applied to a [`PrefixIndex`].
#[derive(Debug)]
pub struct KvPublisher {
    node: u16,
    epoch: u64,
    index: Arc<PrefixIndex>,
    seqs: Mutex<HashMap<SourceId, u64>>,
}

impl KvPublisher {
    /// Publishes node `node`'s events into `index`, as incarnation `epoch` (e.g. the start time
    /// in nanoseconds: a restarted node must use a larger one).
    pub fn new(node: u16, epoch: u64, index: Arc<PrefixIndex>) -> Self {
        Self { node, epoch, index, seqs: Mutex::new(HashMap::new()) }
    }

    /// The index it feeds.
    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.index
    }

    fn source(&self, site: BlockSite) -> (SourceId, Option<TierName>) {
        match site {
            BlockSite::G1 { worker } => (SourceId::worker(self.node, worker as u16), Some(TierName::G1)),
            BlockSite::Node(tier) => (SourceId::node_store(self.node), Some(tier)),
        }
    }

    fn publish(&self, source: SourceId, kind: KvEventKind) {
        let kind_label = kind.as_str();
        let mut seqs = self.seqs.lock();
        let seq = seqs.entry(source).or_insert(0);
        *seq += 1;
        let event = KvEvent { source, epoch: self.epoch, seq: *seq, kind };
        let outcome = self.index.apply(&event);
        drop(seqs);
        telemetry::record_index_event(kind_label, outcome.as_str());
        if let Applied::Gap { expected, got, .. } = outcome {
            // Cannot happen in-process (sequencing and application share one lock); if it does,
            // the index refuses this source until a resync, and says so.
            tracing::error!(?source, expected, got, "KV event gap in-process; the index awaits a resync");
        }
    }
}

impl KvObserver for KvPublisher {
    fn stored(&self, site: BlockSite, parent: Option<BlockHash>, hashes: &[BlockHash]) {
        let (source, tier) = self.source(site);
        let tier = tier.expect("every site has a tier");
        self.publish(source, KvEventKind::Stored { hashes: hashes.to_vec(), parent, tier });
    }

    fn removed(&self, site: BlockSite, hashes: &[BlockHash]) {
        let (source, tier) = self.source(site);
        let tier = tier.expect("every site has a tier");
        self.publish(source, KvEventKind::Removed { hashes: hashes.to_vec(), tier });
    }

    fn cleared(&self, worker: usize) {
        self.publish(SourceId::worker(self.node, worker as u16), KvEventKind::Cleared);
    }
}
