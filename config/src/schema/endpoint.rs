//! `[engine_endpoint]`: engines outside the node (vLLM instances) using its tiers as their KV tier.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{ByteSize, RegionKind};

/// `[engine_endpoint]`: a Unix socket on which external engines (a vLLM instance through the
/// `dynamo_node_vllm` plug-in) register, look blocks up, and store and load them through a G2
/// they share with the node. Off unless `enabled`. With it on, `g2_share` of G2 becomes a
/// shared-memory region (a `memfd`, still locked) that every registered engine maps and that holds
/// only engines' blocks; the node's own blocks stay in the rest of G2, private to the node, so no
/// engine can read or rewrite them. Every G2/G3 slot is large enough for `max_block_bytes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineEndpointSection {
    /// Whether the endpoint runs. Default `false`.
    pub enabled: bool,
    /// The socket's path; a relative path is under `node.data_dir`. Default `"engines.sock"`.
    pub socket: PathBuf,
    /// The largest block an engine may register (one offloaded block's KV across all its ranks).
    /// G2 and G3 slots grow to hold it plus the image header. Default `"2MiB"`.
    pub max_block_bytes: ByteSize,
    /// The retention region of external engines' blocks: its priority and deepest tier apply.
    /// Default `"conversation"`.
    pub region: RegionKind,
    /// Most engines registered at once (each connection of an engine's processes counts once per
    /// engine). Default `16`.
    pub max_engines: usize,
    /// The fraction of `tiers.g2.capacity` that becomes the engines' shared region; the rest is
    /// the node's own G2, which engines never map. Default `0.5`.
    pub g2_share: f64,
}

impl Default for EngineEndpointSection {
    fn default() -> Self {
        EngineEndpointSection {
            enabled: false,
            socket: PathBuf::from("engines.sock"),
            max_block_bytes: ByteSize::mib(2),
            region: RegionKind::Conversation,
            max_engines: 16,
            g2_share: 0.5,
        }
    }
}
