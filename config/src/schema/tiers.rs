//! `[tiers.g1]` … `[tiers.g4]`: capacities, eviction and I/O of the four KV tiers.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{ByteSize, HumanDuration};

config_enum! {
    /// One of the four tiers, fastest first (`G1 < G2 < G3 < G4`).
    #[derive(PartialOrd, Ord)]
    pub enum TierName ("tier") {
        /// GPU memory (host memory when the engine runs on the CPU).
        G1 = "g1",
        /// Pinned host memory.
        G2 = "g2",
        /// Local NVMe.
        G3 = "g3",
        /// Other nodes' G2/G3.
        G4 = "g4",
    }
}

impl TierName {
    /// The tier every transfer passes through: blocks are written down from G1 through it, and
    /// loaded up into G1 from it (a G3 read or a peer's image lands there first).
    pub const STAGING: TierName = TierName::G2;
    /// The node's own tiers below G1: what write-through fills and a node's store actors keep.
    pub const NODE: [TierName; 2] = [TierName::G2, TierName::G3];

    /// Every path a block moves along, `(from, to)`: to and from [`Self::STAGING`], for every
    /// other tier.
    pub fn transfer_paths() -> impl Iterator<Item = (TierName, TierName)> {
        Self::ALL.iter().filter(|&&t| t != Self::STAGING).flat_map(|&t| [(t, Self::STAGING), (Self::STAGING, t)])
    }
}

/// One figure per tier, by name: `hits.g2`, or `hits[tier]` for a [`TierName`] known at run
/// time. What the node counts per tier (hit tokens, bytes, blocks) is one of these, never a
/// positional array.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PerTier<T> {
    /// The worker's own G1.
    pub g1: T,
    /// The node's G2.
    pub g2: T,
    /// The node's G3.
    pub g3: T,
    /// Other nodes' tiers.
    pub g4: T,
}

impl<T> PerTier<T> {
    /// Each tier with its figure, fastest first.
    pub fn iter(&self) -> impl Iterator<Item = (TierName, &T)> {
        [(TierName::G1, &self.g1), (TierName::G2, &self.g2), (TierName::G3, &self.g3), (TierName::G4, &self.g4)]
            .into_iter()
    }
}

impl<T: Copy + std::iter::Sum<T>> PerTier<T> {
    /// The figures of every tier together.
    pub fn total(&self) -> T {
        [self.g1, self.g2, self.g3, self.g4].into_iter().sum()
    }
}

impl<T> std::ops::Index<TierName> for PerTier<T> {
    type Output = T;

    fn index(&self, tier: TierName) -> &T {
        match tier {
            TierName::G1 => &self.g1,
            TierName::G2 => &self.g2,
            TierName::G3 => &self.g3,
            TierName::G4 => &self.g4,
        }
    }
}

impl<T> std::ops::IndexMut<TierName> for PerTier<T> {
    fn index_mut(&mut self, tier: TierName) -> &mut T {
        match tier {
            TierName::G1 => &mut self.g1,
            TierName::G2 => &mut self.g2,
            TierName::G3 => &mut self.g3,
            TierName::G4 => &mut self.g4,
        }
    }
}

config_enum! {
    /// Eviction policy of a tier. Both are priority-aware: lower priority and expired holds go
    /// first; the policy orders blocks within a priority.
    #[derive(Default)]
    pub enum EvictionPolicyKind ("eviction policy") {
        /// Least recently used first.
        #[default]
        Lru = "lru",
        /// Least frequently used first (ties by recency).
        Lfu = "lfu",
    }
}

config_enum! {
    /// How the G3 store does I/O.
    #[derive(Default)]
    pub enum IoEngineKind ("io engine") {
        /// io_uring on a dedicated thread.
        #[default]
        Uring = "uring",
        /// `pread`/`pwrite` on a thread pool (portable fallback).
        Psync = "psync",
    }
}

config_enum! {
    /// Whether the G2 pool is locked into RAM.
    #[derive(Default)]
    pub enum MlockMode ("mlock mode") {
        /// Never lock.
        Off = "off",
        /// Lock; if the limit (`ulimit -l`) forbids it, warn and continue unlocked.
        #[default]
        Try = "try",
        /// Lock or fail start-up.
        Require = "require",
    }
}

config_enum! {
    /// Transport between nodes.
    #[derive(Default)]
    pub enum Transport ("transport") {
        /// TCP, always available.
        #[default]
        Tcp = "tcp",
        /// RDMA verbs, reading the peer's registered G2 (needs the `rdma` cargo feature).
        Rdma = "rdma",
    }
}

config_enum! {
    /// How G4 image frames are protected on the wire.
    #[derive(Default)]
    pub enum G4Integrity ("integrity") {
        /// Every frame, images included, carries a MAC under the session key.
        #[default]
        Mac = "mac",
        /// Control frames carry a MAC; images are verified by hash and checksums only (trusted
        /// networks: catches accidents, not an attacker on the path).
        Checksum = "checksum",
    }
}

/// `[tiers]`: one table per tier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TiersSection {
    /// Fraction of G2's and G3's blocks that leases (`cache_control`) may pin, in `[0, 1]`; past
    /// it the lease that ends soonest falls back to plain retention (counted in
    /// `dynamo_node_kv_lease_degradations_total`). Default `0.5`.
    pub lease_budget: f64,
    /// `[tiers.g1]`: the paged KV pool each worker's engine reads.
    pub g1: G1Config,
    /// `[tiers.g2]`: the node's pinned host memory pool.
    pub g2: G2Config,
    /// `[tiers.g3]`: the node's NVMe store.
    pub g3: G3Config,
    /// `[tiers.g4]`: blocks served to and loaded from other nodes.
    pub g4: G4Config,
}

impl Default for TiersSection {
    fn default() -> Self {
        TiersSection {
            lease_budget: 0.5,
            g1: G1Config::default(),
            g2: G2Config::default(),
            g3: G3Config::default(),
            g4: G4Config::default(),
        }
    }
}

/// `[tiers.g1]`: the paged KV pool each worker's engine reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct G1Config {
    /// KV pool size per worker. `0` derives it from `gpu_memory_fraction` on a GPU (not allowed
    /// with `engine.device = "cpu"`). Default `"256MiB"`.
    pub capacity: ByteSize,
    /// With `capacity = 0`: the fraction of GPU memory the worker may use in total (weights,
    /// activations, KV), in `(0, 1]`. Default `0.85`.
    pub gpu_memory_fraction: f64,
    /// `"lru"` or `"lfu"`, both priority-aware: which page a worker frees when it needs one (G1
    /// is freed on demand, a page at a time, never ahead). Default `"lru"`.
    pub eviction: EvictionPolicyKind,
}

impl Default for G1Config {
    fn default() -> Self {
        G1Config { capacity: ByteSize::mib(256), gpu_memory_fraction: 0.85, eviction: EvictionPolicyKind::Lru }
    }
}

/// `[tiers.g2]`: the node's pinned host memory pool, shared by its workers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct G2Config {
    /// Whether the tier exists. Default `true`.
    pub enabled: bool,
    /// Pool size for the whole node. Default `"256MiB"`.
    pub capacity: ByteSize,
    /// `"off"`, `"try"` (warn if `ulimit -l` forbids it) or `"require"`. Default `"try"`.
    pub mlock: MlockMode,
    /// `"lru"` or `"lfu"`, both priority-aware. Default `"lru"`.
    pub eviction: EvictionPolicyKind,
    /// Occupancy fraction at which eviction starts, in `(0, 1]`. Default `0.95`.
    pub high_watermark: f64,
    /// Occupancy fraction eviction brings the tier back to, in `(0, high_watermark]`.
    /// Default `0.90`.
    pub low_watermark: f64,
    /// Write-through G1 → G2 flushes a batch at this many blocks (or after `write_batch_delay`).
    /// Default `32`.
    pub write_batch_blocks: usize,
    /// Longest a completed block waits for its G2 batch to fill. Default `"2ms"`.
    pub write_batch_delay: HumanDuration,
}

impl Default for G2Config {
    fn default() -> Self {
        G2Config {
            enabled: true,
            capacity: ByteSize::mib(256),
            mlock: MlockMode::Try,
            eviction: EvictionPolicyKind::Lru,
            high_watermark: 0.95,
            low_watermark: 0.90,
            write_batch_blocks: 32,
            write_batch_delay: HumanDuration::millis(2),
        }
    }
}

/// `[tiers.g3]`: the node's NVMe store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct G3Config {
    /// Whether the tier exists. Default `true`.
    pub enabled: bool,
    /// Store files or raw block devices, one slot file per path. Default: empty, meaning
    /// `<node.data_dir>/g3/store.0`.
    pub paths: Vec<PathBuf>,
    /// Size of each path's store. Default `"2GiB"`.
    pub capacity_per_path: ByteSize,
    /// `"uring"` (io_uring) or `"psync"`. Default `"uring"`.
    pub io_engine: IoEngineKind,
    /// io_uring submission queue depth, `1..=4096`. Default `32`.
    pub queue_depth: u32,
    /// I/O threads (one ring each). Default `1`.
    pub io_threads: usize,
    /// Register G2 buffers with io_uring (fixed buffers). Default `true`.
    pub register_buffers: bool,
    /// Open with `O_DIRECT` (bypass the page cache; needs a filesystem that supports it).
    /// Default `true`.
    pub direct_io: bool,
    /// Format a path that already holds data other than a G3 store (a file in use, a device with a
    /// file system). Off, such a path is refused at start. Default `false`.
    pub format_foreign: bool,
    /// `"lru"` or `"lfu"`, both priority-aware. Default `"lfu"`.
    pub eviction: EvictionPolicyKind,
    /// Occupancy fraction at which eviction starts, in `(0, 1]`. Default `0.95`.
    pub high_watermark: f64,
    /// Occupancy fraction eviction brings the tier back to, in `(0, high_watermark]`.
    /// Default `0.90`.
    pub low_watermark: f64,
    /// Write-through G2 → G3 flushes a batch at this many blocks (or after `write_batch_delay`).
    /// Default `64`.
    pub write_batch_blocks: usize,
    /// Longest a block waits for its G3 batch to fill. Default `"10ms"`.
    pub write_batch_delay: HumanDuration,
    /// Read bandwidth in GB/s for the cost model. Default: none (timed on the node's own reads).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_gb_s: Option<f64>,
    /// Write bandwidth in GB/s: G3's write-through may fall one second of it behind before blocks
    /// stay in G2 only. Default: none (timed on the node's own writes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub write_gb_s: Option<f64>,
}

impl Default for G3Config {
    fn default() -> Self {
        G3Config {
            enabled: true,
            paths: Vec::new(),
            capacity_per_path: ByteSize::gib(2),
            io_engine: IoEngineKind::Uring,
            queue_depth: 32,
            io_threads: 1,
            register_buffers: true,
            direct_io: true,
            format_foreign: false,
            eviction: EvictionPolicyKind::Lfu,
            high_watermark: 0.95,
            low_watermark: 0.90,
            write_batch_blocks: 64,
            write_batch_delay: HumanDuration::millis(10),
            read_gb_s: None,
            write_gb_s: None,
        }
    }
}

/// `[tiers.g4]`: blocks served to and loaded from other nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct G4Config {
    /// Whether this node serves and fetches blocks over the network. Default `false`.
    pub enabled: bool,
    /// `"tcp"`, or `"rdma"`: lanes read peers' images with one-sided RDMA reads where both nodes
    /// have a device, and use TCP otherwise (a binary built without the `rdma` feature, or a
    /// machine without a device, says so at start). Default `"tcp"`.
    pub transport: Transport,
    /// The RDMA device to use (`mlx5_0`); the first one when unset.
    pub rdma_device: Option<String>,
    /// Index of the RDMA port's GID to address by (RoCE v2 often needs other than 0). Default `0`.
    pub rdma_gid_index: u8,
    /// `"mac"`: every image frame carries a MAC (safe on any network); `"checksum"`: images are
    /// verified by hash and checksums only (a trusted network; saves hashing every byte on both
    /// ends). Every node of a cluster must use the same. Default `"mac"`.
    pub integrity: G4Integrity,
    /// Address the block server listens on, `ip:port`. Default `"127.0.0.1:7100"`.
    pub listen: String,
    /// Peers' block-server addresses, `host:port`. Default `[]`.
    pub peers: Vec<String>,
    /// A remote block request that takes longer fails and the blocks are recomputed.
    /// Default `"2s"`.
    pub request_timeout: HumanDuration,
    /// The least time a fetch from a peer is given before its blocks are recomputed instead.
    /// Each fetch gets twice what recomputing its blocks would take (by the cost model), at least
    /// this and at most `request_timeout`: raise it where a peer's reads from disk or a loaded
    /// link should be waited for rather than raced. Default `"50ms"`.
    pub min_fetch_budget: HumanDuration,
    /// Most requests in flight per peer. Default `64`.
    pub max_inflight: usize,
    /// Connections per peer that carry block fetches, side by side. Default `2`.
    pub lanes: usize,
    /// Each peer's feed of its blocks is pinged this often; a peer silent for three
    /// heartbeats is taken as gone and its blocks leave the index. Default `"1s"`.
    pub heartbeat: HumanDuration,
    /// The cluster's name: peers of another cluster are refused. Default `"dynamo"`.
    pub cluster: String,
    /// The cluster's shared secret (32 bytes, or 64 hex digits; readable by its owner only),
    /// with which peers authenticate each other. Required when G4 is enabled.
    pub secret_file: Option<PathBuf>,
    /// Mutual TLS for every G4 connection, for networks where someone on the path may read or
    /// rewrite traffic: this node's certificate chain (PEM). Set with `tls_key` and `tls_ca`, or
    /// not at all. Default unset (plain TCP under the secret's MACs).
    pub tls_cert: Option<PathBuf>,
    /// This node's private key (PEM: PKCS#8, SEC1 or PKCS#1), for `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// The cluster CA (PEM): peers must show a certificate it signed, and a server's must name
    /// the host a node dials.
    pub tls_ca: Option<PathBuf>,
    /// The longest a peer's hold pins this node's blocks without a fetch or release.
    /// Default `"10s"`.
    pub hold_ttl: HumanDuration,
    /// Most holds one peer may have open. Default `64`.
    pub max_holds_per_peer: usize,
    /// Write every block asked of a peer to `<node.data_dir>/g4-history.jsonl`: when, which
    /// peer and epoch, the hash, what became of it and the digest of what was loaded. Default
    /// `false`.
    pub history: bool,
}

impl Default for G4Config {
    fn default() -> Self {
        G4Config {
            enabled: false,
            transport: Transport::Tcp,
            rdma_device: None,
            rdma_gid_index: 0,
            integrity: G4Integrity::Mac,
            listen: "127.0.0.1:7100".to_owned(),
            peers: Vec::new(),
            request_timeout: HumanDuration::secs(2),
            min_fetch_budget: HumanDuration::millis(50),
            max_inflight: 64,
            lanes: 2,
            heartbeat: HumanDuration::secs(1),
            cluster: "dynamo".to_owned(),
            secret_file: None,
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            hold_ttl: HumanDuration::secs(10),
            max_holds_per_peer: 64,
            history: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier_names_order_and_parse() {
        assert!(TierName::G1 < TierName::G2 && TierName::G3 < TierName::G4);
        assert_eq!("g3".parse::<TierName>(), Ok(TierName::G3));
        assert_eq!(TierName::G4.as_str(), "g4");
        let err = "g5".parse::<TierName>().unwrap_err().to_string();
        assert_eq!(err, "unknown tier `g5`: expected one of g1, g2, g3, g4");
    }
}
