//! KV events from a node's tiers into the global prefix index.
//!
//! [`KvPublisher`] is the node's [`KvObserver`]: every change of where blocks are (a worker's G1
//! registering or evicting, G2 admitting or evicting, G3 acknowledging a write or dropping a
//! block) becomes a [`KvEvent`] with its source's next sequence number. One lock orders
//! sequencing and hand-off, so the index sees each source's events in order without gaps; a
//! source that restarts (a new node process) gets a new epoch, so the index drops what its
//! previous incarnation reported.
//!
//! Where the events are applied: [`KvPublisher::new`] applies each at once on the calling thread
//! (deterministic: the simulated replay uses it); [`KvPublisher::with_writer`] hands them to an
//! [`IndexWriter`], so the engine threads that publish most of them never wait on the index. The
//! scheduler then flushes the writer before a routing decision, so a decision still sees every
//! event published before it.

use std::collections::HashMap;
use std::sync::Arc;

use dynamo_config::TierName;
use dynamo_tiering::block::BlockHash;
use dynamo_tiering::g4::feed::Feed;
use parking_lot::Mutex;

use crate::index::{Applied, IndexWriter, KvEvent, KvEventKind, OnApplied, PrefixIndex, SourceId};
use crate::telemetry;
use crate::tiers::{BlockSite, KvObserver};

/// Turns tier changes into sequenced KV events applied to a [`PrefixIndex`].
#[derive(Debug)]
pub struct KvPublisher {
    node: u16,
    epoch: u64,
    index: Arc<PrefixIndex>,
    writer: Option<Arc<IndexWriter>>,
    seqs: Mutex<HashMap<SourceId, u64>>,
    /// What this node's block server tells its peers: G2's changes, in the index's order.
    feed: Option<Arc<Feed>>,
}

impl KvPublisher {
    /// Publishes node `node`'s events into `index`, as incarnation `epoch` (e.g. the start time
    /// in nanoseconds: a restarted node must use a larger one).
    pub fn new(node: u16, epoch: u64, index: Arc<PrefixIndex>) -> Self {
        Self { node, epoch, index, writer: None, seqs: Mutex::new(HashMap::new()), feed: None }
    }

    /// Like [`KvPublisher::new`], but the events are applied by `writer` (which must write
    /// `writer.index()`, and should have been spawned with [`KvPublisher::on_applied`]).
    pub fn with_writer(node: u16, epoch: u64, writer: Arc<IndexWriter>) -> Self {
        Self {
            node,
            epoch,
            index: writer.index().clone(),
            writer: Some(writer),
            seqs: Mutex::new(HashMap::new()),
            feed: None,
        }
    }

    /// Also tells `feed` every change of G2 and G3 (what the block server serves to peers), in
    /// the order the index gets them.
    pub fn with_feed(mut self, feed: Arc<Feed>) -> Self {
        self.feed = Some(feed);
        self
    }

    /// What a writer thread does with each outcome: the metric, and an error log on a gap.
    pub fn on_applied() -> OnApplied {
        Arc::new(|event: &KvEvent, outcome: Applied| record(event, outcome))
    }

    /// The index it feeds.
    pub fn index(&self) -> &Arc<PrefixIndex> {
        &self.index
    }

    /// The source of `site`'s events, its tier, and whether peers are told (the feed).
    fn source(&self, site: BlockSite) -> (SourceId, TierName, bool) {
        match site {
            BlockSite::G1 { worker } => (SourceId::worker(self.node, worker as u16), TierName::G1, false),
            BlockSite::Node(tier) => (SourceId::node_store(self.node), tier, true),
            // Peers learn an engine's blocks under the node's names as well as its own keys: the
            // names are what their routers compute from a prompt (and the salt keeps them apart
            // from any other engine kind's), the keys what their endpoints fetch by.
            BlockSite::Engines(tier) => (SourceId::node_store(self.node), tier, true),
        }
    }

    fn publish(&self, source: SourceId, kind: KvEventKind, feed_peers: bool) {
        let mut seqs = self.seqs.lock();
        if let Some(feed) = &self.feed
            && feed_peers
        {
            // The feed keeps the tiers peers are served from and ignores the others.
            match &kind {
                KvEventKind::Stored { hashes, parent, tier } => feed.stored_in(*tier, *parent, hashes),
                KvEventKind::Removed { hashes, tier } => feed.removed_from(*tier, hashes),
                KvEventKind::Cleared => {}
            }
            telemetry::set_peer_servable_blocks(feed.len(), feed.digest());
        }
        let seq = seqs.entry(source).or_insert(0);
        *seq += 1;
        let event = KvEvent { source, epoch: self.epoch, seq: *seq, kind };
        if let Some(writer) = &self.writer {
            // Sent under the lock that numbered it, so the writer gets each source's events in order.
            writer.send(event);
            return;
        }
        let outcome = self.index.apply(&event);
        drop(seqs);
        record(&event, outcome);
    }
}

/// Records what the index did with `event`.
fn record(event: &KvEvent, outcome: Applied) {
    telemetry::record_index_event(event.kind.as_str(), outcome.as_str());
    if let Applied::Gap { expected, got, .. } = outcome {
        // Cannot happen in-process (sequencing and application are ordered by one lock); if it
        // does, the index refuses this source until a resync, and says so.
        tracing::error!(source = ?event.source, expected, got, "KV event gap in-process; the index awaits a resync");
    }
}

impl KvObserver for KvPublisher {
    fn stored(&self, site: BlockSite, parent: Option<BlockHash>, hashes: &[BlockHash]) {
        let (source, tier, feed) = self.source(site);
        self.publish(source, KvEventKind::Stored { hashes: hashes.to_vec(), parent, tier }, feed);
    }

    fn removed(&self, site: BlockSite, hashes: &[BlockHash]) {
        let (source, tier, feed) = self.source(site);
        self.publish(source, KvEventKind::Removed { hashes: hashes.to_vec(), tier }, feed);
    }

    fn cleared(&self, worker: usize) {
        self.publish(SourceId::worker(self.node, worker as u16), KvEventKind::Cleared, false);
    }
}

#[cfg(test)]
mod tests {
    use dynamo_tiering::block::BlockHash;

    use super::*;
    use crate::engine_names::{EngineNames, NodeName};
    use crate::index::IndexConfig;

    fn h(n: u128) -> BlockHash {
        BlockHash(n | 1 << 100)
    }

    /// What an engine stores reaches the feed twice: under its key (what a peer's endpoint
    /// fetches by) and under the node's name (what a peer's router computes from a prompt). A
    /// worker's G1 never does.
    #[test]
    fn peers_are_fed_an_engines_blocks_under_the_nodes_names_too() {
        let feed = Arc::new(Feed::new(64));
        let index = Arc::new(PrefixIndex::new(IndexConfig::default()));
        let publisher = Arc::new(KvPublisher::new(1, 1, index).with_feed(feed.clone()));
        let names = EngineNames::new(publisher.clone());
        names.named(7, NodeName { hash: h(70), parent: Some(h(60)) });
        names.storing(h(700), 7);
        names.stored(BlockSite::Node(TierName::G2), None, &[h(700)]);
        publisher.stored(BlockSite::G1 { worker: 0 }, None, &[h(1)]);

        let mut fed = feed.subscribe().snapshot;
        fed.sort_by_key(|(hash, _)| hash.0);
        assert_eq!(fed, [(h(70), Some(h(60))), (h(700), None)]);

        names.removed(BlockSite::Node(TierName::G2), &[h(700)]);
        assert_eq!(feed.len(), 0, "both leave with the block");
    }
}
