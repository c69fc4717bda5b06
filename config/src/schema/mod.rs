//! The sections of the node's TOML file, one file per section (`[tiers.*]` share one).
//!
//! Every struct is `#[serde(default, deny_unknown_fields)]`: a missing key takes the default
//! written in its doc comment, an unknown key is an error.

mod blocks;
mod cluster;
mod endpoint;
mod engine;
mod frontend;
mod metrics;
mod model;
mod node;
mod recording;
mod retention;
mod router;
mod tiers;

pub use blocks::BlocksSection;
pub use cluster::{ClusterSection, MembershipKind};
pub use endpoint::EngineEndpointSection;
pub use engine::{DeviceKind, EngineKind, EngineSection, LaunchSection, VllmSection};
pub use frontend::{ApiKey, AuthSection, FrontendSection};
pub use metrics::MetricsSection;
pub use model::ModelSection;
pub use node::{LogFormat, NodeSection};
pub use recording::{RecordingFormat, RecordingSection};
pub use retention::{RegionPolicy, RetentionSection};
pub use router::{QueuePolicy, RouterSection, RoutingPolicy};
pub use tiers::{
    EvictionPolicyKind, G1Config, G2Config, G3Config, G4Config, G4Integrity, IoEngineKind, MlockMode, PerTier,
    TierName, TiersSection, Transport,
};
