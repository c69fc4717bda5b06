//! `[cluster]`: how a node finds the other nodes it shares KV with over G4.

use serde::{Deserialize, Serialize};

use crate::HumanDuration;

config_enum! {
    /// Where a node learns who its peers are.
    #[derive(Default)]
    pub enum MembershipKind ("membership") {
        /// The peers are `tiers.g4.peers`, fixed at start.
        #[default]
        Static = "static",
        /// Every node registers in etcd under a lease and watches the others come and go.
        Etcd = "etcd",
    }
}

/// `[cluster]`: membership. With `"etcd"`, each node registers its G4 address under
/// `<etcd_prefix>/<tiers.g4.cluster>/nodes/<node.name>`, bound to a lease it keeps alive; the
/// registration's revision is the node's epoch. A node whose lease ran out (paused, partitioned)
/// registers again with a new epoch, and its peers drop what they knew of the old one. With etcd
/// unreachable a node keeps its last view of the cluster and goes on serving.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterSection {
    /// `"static"` or `"etcd"`. Default `"static"`.
    pub membership: MembershipKind,
    /// etcd's client URLs. Default `["http://127.0.0.1:2379"]`.
    pub etcd_endpoints: Vec<String>,
    /// Key prefix of the registrations. Default `"/dynamo-node"`.
    pub etcd_prefix: String,
    /// The registration's lease: a node unheard of this long leaves the cluster. Whole
    /// seconds, at least 2. Default `"5s"`.
    pub lease_ttl: HumanDuration,
    /// The G4 address peers dial, `host:port`. Unset: the address the block server bound
    /// (`tiers.g4.listen` must then name a specific address, not `0.0.0.0`).
    pub advertise: Option<String>,
}

impl Default for ClusterSection {
    fn default() -> Self {
        ClusterSection {
            membership: MembershipKind::Static,
            etcd_endpoints: vec!["http://127.0.0.1:2379".to_owned()],
            etcd_prefix: "/dynamo-node".to_owned(),
            lease_ttl: HumanDuration::secs(5),
            advertise: None,
        }
    }
}
