//! `[blocks]`: the unit of KV sharing.

use serde::{Deserialize, Serialize};

/// `[blocks]`: the unit of KV sharing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BlocksSection {
    /// Tokens per KV block, `1..=4096`; a power of two is recommended. Only complete blocks are
    /// shared and written through. Default `32`.
    pub block_size: usize,
}

impl Default for BlocksSection {
    fn default() -> Self {
        BlocksSection { block_size: 32 }
    }
}
