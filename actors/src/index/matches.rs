//! The answer of a prefix lookup, and its per-worker view for the cost model.

use std::collections::HashMap;

use dynamo_config::{PerTier, TierName};

use super::events::SourceId;
use super::hasher::FxBuild;
use super::store::LocId;

/// Where blocks are held: one source's tier. A worker's G1 fed by
/// [`record_routing`](super::PrefixIndex::record_routing) is a separate, *approximate* location.
///
/// Eight-byte aligned, so that copying one into a lookup's answer is one move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(align(8))]
pub struct Location {
    /// The source that reports (or, if approximate, is assumed to hold) the blocks.
    pub source: SourceId,
    /// The tier.
    pub tier: TierName,
    /// Inferred from routing decisions rather than reported by KV events.
    pub approximate: bool,
}

/// One location's longest cached prefix of a query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocationMatch {
    /// Where.
    pub location: Location,
    /// How many leading blocks of the query it holds contiguously from block 0 (at least 1).
    pub blocks: usize,
}

/// How much of a query a given worker can get from each tier, in blocks from block 0.
///
/// The tiers nest in the cost model: blocks `[0, g1)` are reused in place, `[g1, max(g1, g2))`
/// load from G2, then G3, then G4; each length is that tier's own longest prefix, so a later
/// tier only contributes where it reaches further.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorkerPrefix {
    /// Each tier's own longest prefix: the worker's G1 as its KV events report it, its node's G2
    /// and G3, and the best G2 or G3 of any other node (G4, reached through a peer link).
    pub tiers: PerTier<usize>,
    /// The worker's own G1, as inferred from requests recently routed to it (approximate mode).
    pub g1_approximate: usize,
}

/// The result of [`PrefixIndex::find_matches`](super::PrefixIndex::find_matches), reusable
/// across lookups so a hot loop allocates nothing.
#[derive(Debug, Default)]
pub struct Matches {
    pub(crate) results: Vec<LocationMatch>,
    /// Scratch of the lookup: locations still matching, split at each probe.
    pub(crate) alive: Vec<LocId>,
    /// Locations that are not prefix-closed, searched one by one.
    pub(crate) walk: Vec<LocId>,
    /// Per location id: set tags and prefix lengths (see [`Marks`]).
    pub(crate) marks: Marks,
}

/// Scratch of the lookup indexed by location id, sized to the store's locations: which subset of
/// the candidates a location is in (a tag, fresh per subset, so no clearing between lookups), and
/// the prefix length found for it.
#[derive(Debug, Default)]
pub(crate) struct Marks {
    pub(crate) tag: Vec<u32>,
    pub(crate) len: Vec<u32>,
    last: u32,
}

impl Marks {
    /// Makes room for location ids below `locations`.
    pub(crate) fn prepare(&mut self, locations: usize) {
        if self.tag.len() < locations {
            self.tag.resize(locations, 0);
            self.len.resize(locations, 0);
        }
    }

    /// A tag no location carries.
    pub(crate) fn fresh(&mut self) -> u32 {
        if self.last == u32::MAX {
            self.tag.fill(0);
            self.last = 0;
        }
        self.last += 1;
        self.last
    }

    /// Whether `loc` carries `tag`.
    #[inline]
    pub(crate) fn has(&self, loc: LocId, tag: u32) -> bool {
        self.tag[loc as usize] == tag
    }
}

impl Matches {
    /// An empty result.
    pub fn new() -> Self {
        Self::default()
    }

    /// Clears the lookup scratch, not the results.
    pub(crate) fn clear_scratch(&mut self) {
        self.alive.clear();
        self.walk.clear();
    }

    /// Every location holding at least the first block of the query, with its prefix length.
    pub fn locations(&self) -> &[LocationMatch] {
        &self.results
    }

    /// The prefix length `location` holds (0 if none).
    pub fn blocks_at(&self, location: Location) -> usize {
        self.results.iter().find(|m| m.location == location).map_or(0, |m| m.blocks)
    }

    /// The longest prefix any location holds.
    pub fn longest(&self) -> usize {
        self.results.iter().map(|m| m.blocks).max().unwrap_or(0)
    }

    /// What `worker` (a worker source, not a node store) can reuse or load, tier by tier.
    pub fn for_worker(&self, worker: SourceId) -> WorkerPrefix {
        let mut view = WorkerPrefix::default();
        for m in &self.results {
            let Location { source, tier, approximate } = m.location;
            let slot = match (tier, approximate) {
                (TierName::G1, false) if source == worker => &mut view.tiers.g1,
                (TierName::G1, true) if source == worker => &mut view.g1_approximate,
                (TierName::G2 | TierName::G3, false) if source.node != worker.node => &mut view.tiers.g4,
                (TierName::G2 | TierName::G3, false) if source.is_node_store() => &mut view.tiers[tier],
                _ => continue,
            };
            *slot = (*slot).max(m.blocks);
        }
        view
    }
}

/// Every worker's [`WorkerPrefix`] for one lookup, built in one pass over its answer
/// ([`Matches::views`]), so that ranking `W` workers costs `O(answer + W)` rather than the
/// `O(answer × W)` of calling [`Matches::for_worker`] per worker. Reusable across lookups.
#[derive(Debug, Default)]
pub struct WorkerViews {
    /// A worker's own G1: exact and approximate.
    workers: HashMap<SourceId, (usize, usize), FxBuild>,
    /// A node's stores: G2, G3, and the best G2 or G3 of any of its sources (what another node
    /// would load over a peer link).
    nodes: HashMap<u16, (usize, usize, usize), FxBuild>,
    /// The two nodes with the longest such prefix, best first: G4 for a worker is the best of
    /// them that is not its own node.
    far: [(u16, usize); 2],
}

impl WorkerViews {
    /// What `worker` can reuse or load, tier by tier: equal to [`Matches::for_worker`].
    pub fn for_worker(&self, worker: SourceId) -> WorkerPrefix {
        let (g1, g1_approximate) = self.workers.get(&worker).copied().unwrap_or_default();
        let (g2, g3, _) = self.nodes.get(&worker.node).copied().unwrap_or_default();
        let g4 = self.far.iter().find(|(node, _)| *node != worker.node).map_or(0, |&(_, blocks)| blocks);
        WorkerPrefix { tiers: PerTier { g1, g2, g3, g4 }, g1_approximate }
    }

    /// The node other than `node` whose G2 or G3 holds the longest prefix, and its length in
    /// blocks (what a worker of `node` would load over a peer link).
    pub fn best_other_node(&self, node: u16) -> Option<(u16, usize)> {
        self.far.iter().copied().find(|&(n, blocks)| n != node && blocks > 0)
    }

    fn clear(&mut self) {
        self.workers.clear();
        self.nodes.clear();
        self.far = [(0, 0); 2];
    }
}

impl Matches {
    /// Fills `views` with every worker's view of this answer (see [`WorkerViews`]).
    pub fn views(&self, views: &mut WorkerViews) {
        views.clear();
        for m in &self.results {
            let Location { source, tier, approximate } = m.location;
            match (tier, approximate) {
                (TierName::G1, approximate) => {
                    let own = views.workers.entry(source).or_default();
                    let slot = if approximate { &mut own.1 } else { &mut own.0 };
                    *slot = (*slot).max(m.blocks);
                }
                (TierName::G2 | TierName::G3, false) => {
                    let node = views.nodes.entry(source.node).or_default();
                    if source.is_node_store() {
                        let slot = if tier == TierName::G2 { &mut node.0 } else { &mut node.1 };
                        *slot = (*slot).max(m.blocks);
                    }
                    node.2 = node.2.max(m.blocks);
                }
                _ => {}
            }
        }
        // The two best nodes for G4 (distinct nodes, best first).
        for (&node, &(_, _, far)) in &views.nodes {
            if far > views.far[0].1 {
                views.far[1] = views.far[0];
                views.far[0] = (node, far);
            } else if far > views.far[1].1 {
                views.far[1] = (node, far);
            }
        }
    }
}
