//! The router's view of the node's one cost model ([`dynamo_tiering::cost`], DESIGN.md §6): the
//! estimated time to first token of a request on each worker, from what the prefix index says
//! each of the worker's tiers holds.

pub use dynamo_tiering::cost::{BytesPerSec, CostModel, Estimate, Prefill, PrefixBlocks, Queued};

use crate::index::WorkerPrefix;

impl From<WorkerPrefix> for PrefixBlocks {
    /// The worker's G1 is the longer of what its KV events report and what recent routing
    /// implies (approximate mode).
    fn from(p: WorkerPrefix) -> Self {
        PrefixBlocks { g1: p.tiers.g1.max(p.g1_approximate), ..p.tiers }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_approximate_g1_counts_where_it_reaches_further() {
        let p = WorkerPrefix { tiers: PrefixBlocks { g1: 2, g2: 7, g3: 1, g4: 9 }, g1_approximate: 5 };
        assert_eq!(PrefixBlocks::from(p), PrefixBlocks { g1: 5, g2: 7, g3: 1, g4: 9 });
    }
}
