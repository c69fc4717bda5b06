//! `[blocks]`: the unit of KV sharing.

use serde::{Deserialize, Serialize};

config_enum! {
    /// Checksum over a block image's payload.
    #[derive(Default)]
    pub enum ChecksumKind ("checksum") {
        /// xxh3, 64-bit.
        #[default]
        Xxh3_64 = "xxh3",
    }
}

/// `[blocks]`: the unit of KV sharing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BlocksSection {
    /// Tokens per KV block, `1..=4096`; a power of two is recommended. Only complete blocks are
    /// shared and written through. Default `32`.
    pub block_size: usize,
    /// Payload checksum of block images in G2/G3/G4: `"xxh3"`. Default `"xxh3"`.
    pub checksum: ChecksumKind,
}

impl Default for BlocksSection {
    fn default() -> Self {
        BlocksSection { block_size: 32, checksum: ChecksumKind::Xxh3_64 }
    }
}
