//! The node's metrics as every crate records them: every name the node exports and the typed
//! functions that record them. The exporter and the tier poller live in the runtime.
//!
//! Metrics go through the [`metrics`] facade to a global `metrics_exporter_prometheus` recorder
//! that serves `GET /metrics` on `metrics.listen`. Every histogram is a true Prometheus histogram
//! with the buckets of `metrics.latency_buckets_seconds` (the exporter's default summaries lose
//! samples between scrapes). Names follow DESIGN.md §8: prefix `dynamo_node_`, the unit in the
//! name, counters end in `_total`, and every label value comes from a small closed set — tiers
//! from [`Tier`] (`g1`..`g4`), regions from [`RegionKind::as_str`], error kinds from the library
//! crates' `kind()`, APIs from the frontend's routes (`dynamo_node::frontend::Route`), HTTP status codes.
//!
//! Call sites never spell a name: they call the functions below (`record_*` add to counters and
//! histograms, `set_*` and `publish_*` set gauges or mirror a monotonic source with
//! `Counter::absolute`). A counter is either incremented here or mirrored from a source, never
//! both. Without an installed recorder every function is a cheap no-op.
//!
//! | name | type | labels | meaning |
//! |---|---|---|---|
//! | `dynamo_node_build_info` | gauge | `version` | always 1 |
//! | `dynamo_node_start_time_seconds` | gauge | | when the node started (Unix seconds; a change is a restart) |
//! | `dynamo_node_kv_blocks` | gauge | `tier` | blocks resident in the tier |
//! | `dynamo_node_kv_leased_blocks` | gauge | `tier` | blocks under a live lease (`cache_control`) |
//! | `dynamo_node_kv_held_blocks` | gauge | `tier` | unreferenced blocks kept by an active hold |
//! | `dynamo_node_kv_lease_expiries_total` | counter | `tier` | leases that ran out |
//! | `dynamo_node_kv_lease_degradations_total` | counter | `tier` | leases dropped to plain retention by the lease budget (the lowest tier's; there the tenant holding the most gives way first) |
//! | `dynamo_node_kv_capacity_blocks` | gauge | `tier` | blocks the tier can hold (G1: all workers) |
//! | `dynamo_node_kv_prompt_tokens_total` | counter | | prompt tokens of admitted requests |
//! | `dynamo_node_kv_hit_tokens_total` | counter | `tier` | prompt tokens whose KV came from the tier instead of being computed |
//! | `dynamo_node_prefill_tokens_total` | counter | | prompt tokens computed by prefill |
//! | `dynamo_node_kv_transfer_bytes_total` | counter | `src`, `dst` | bytes moved between tiers |
//! | `dynamo_node_kv_transfer_seconds` | histogram | `src`, `dst` | duration of one batched transfer |
//! | `dynamo_node_kv_evictions_total` | counter | `tier`, `region` | blocks evicted by the tier's policy (mirrors the registry) |
//! | `dynamo_node_kv_corrupt_blocks_total` | counter | `tier` | reads that failed verification, and G3 slots whose header failed the start-up scan (G3: mirrors the store) |
//! | `dynamo_node_kv_tier_writes_total` | counter | `tier` | block images written (mirrors the store) |
//! | `dynamo_node_kv_tier_write_bytes_total` | counter | `tier` | bytes written (mirrors the store) |
//! | `dynamo_node_kv_tier_duplicate_writes_total` | counter | `tier` | writes skipped, block already present |
//! | `dynamo_node_kv_tier_reads_total` | counter | `tier` | block images read and verified |
//! | `dynamo_node_kv_tier_read_bytes_total` | counter | `tier` | bytes read |
//! | `dynamo_node_kv_tier_io_errors_total` | counter | `tier`, `op` | failed reads/writes counted by the store (`op`: `read`, `write`) |
//! | `dynamo_node_tier_errors_total` | counter | `tier`, `kind` | errors seen by the node, by the crate error's `kind()` |
//! | `dynamo_node_io_inflight` | gauge | `tier` | I/O operations submitted and not completed |
//! | `dynamo_node_tier_degraded` | gauge | `tier` | 1 while the node runs without the tier after a failure |
//! | `dynamo_node_requests_total` | counter | `api`, `status` | requests answered, by HTTP status |
//! | `dynamo_node_request_ttft_seconds` | histogram | | time to first token |
//! | `dynamo_node_inter_token_seconds` | histogram | | time between streamed tokens |
//! | `dynamo_node_kv_write_through_lag_seconds` | histogram | `tier` | block completion in G1 to the tier's acknowledgment |
//! | `dynamo_node_kv_write_through_skipped_total` | counter | `tier` | blocks kept above a tier whose writes were too far behind, or that had no room for them |
//! | `dynamo_node_worker_restarts_total` | counter | | workers restarted by the supervisor |
//! | `dynamo_node_router_decision_seconds` | histogram | | time to choose a worker |
//! | `dynamo_node_router_wait_seconds` | histogram | | time a request waited at the router (working-set admission, late binding) before joining a worker's queue |
//! | `dynamo_node_index_events_total` | counter | `kind`, `result` | KV events offered to the prefix index |
//! | `dynamo_node_index_blocks` | gauge | | distinct blocks in the prefix index |
//! | `dynamo_node_index_resyncs_total` | counter | | index sources resynchronised after a gap |
//! | `dynamo_node_router_predicted_cached_tokens_total` | counter | | cached tokens the router predicted |
//! | `dynamo_node_router_actual_cached_tokens_total` | counter | | cached tokens found, for predicted requests |
//! | `dynamo_node_router_mispredictions_total` | counter | | requests whose prediction was off |
//! | `dynamo_node_requests_cancelled_total` | counter | `stage` | requests stopped because nobody waited for them (`queued`, `prefill`, `decode`) |
//! | `dynamo_node_http_connections` | gauge | | HTTP connections open |
//! | `dynamo_node_http_connections_refused_total` | counter | `reason` | connections the node closed: `limit`, `client_limit`, `idle_closed`, `accept_error`, `header_timeout` |
//! | `dynamo_node_anthropic_preambles_stripped_total` | counter | | Claude Code billing headers dropped from system text |
//! | `dynamo_node_replayed_turns_total` | counter | | echoed assistant turns whose generated tokens were spliced into the prompt |
//! | `dynamo_node_auth_failures_total` | counter | `endpoint` | requests refused 401 for a missing or unknown key: `api`, `metrics` |
//! | `dynamo_node_recorded_requests_total` | counter | | requests written to the traffic recording |
//! | `dynamo_node_recording_dropped_total` | counter | `reason` | requests the recording lost: `queue_full`, `write_error` |
//! | `dynamo_node_peer_connections_total` | counter | `outcome` | G4 peer connections served, by how they ended: `goodbye`, or the error's kind (`bad_mac`, `too_large`, `timeout`, `limit`, …) |
//! | `dynamo_node_peer_served_bytes_total` | counter | | block-image bytes sent to peers |
//! | `dynamo_node_peer_expired_holds_total` | counter | | peer holds that ran out before their release |
//! | `dynamo_node_peer_fetches_total` | counter | `peer`, `transport`, `outcome` | fetches from a peer: `ok`, or the error's kind (`deadline`, `closed`, `bad_mac`, …) |
//! | `dynamo_node_peer_fetch_seconds` | histogram | `peer`, `transport` | one fetch from a peer: hold, images, release |
//! | `dynamo_node_peer_fetched_blocks_total` | counter | `peer`, `transport`, `outcome` | blocks asked of a peer: `verified`, `missing`, `rejected` (failed verification, dropped), `skipped` (past a block that did not arrive) |
//! | `dynamo_node_peer_fetched_bytes_total` | counter | `peer`, `transport` | verified image bytes fetched from a peer |
//! | `dynamo_node_peer_index_blocks` | gauge | `peer` | blocks this node's index holds for a peer, as the peer's feed left it (0 while the feed is down) |
//! | `dynamo_node_peer_servable_blocks` | gauge | | blocks this node's feed offers its peers (in G2 or G3); a vLLM engine's block counts twice, under its key and its name |
//! | `dynamo_node_peer_index_digest` | gauge | `peer` | 52 bits of the digest of the set of blocks the index holds for a peer ([`SetDigest`]) |
//! | `dynamo_node_peer_servable_digest` | gauge | | 52 bits of the digest of the set of blocks this node's feed offers: a peer's index of this node is right when the two agree |
//! | `dynamo_node_peer_rdma` | gauge | | 1 when this node's lanes may use RDMA (`tiers.g4.transport = "rdma"` and a device opened), 0 when they use TCP only |
//! | `dynamo_node_peer_feed_ended_total` | counter | `peer`, `reason` | feeds from a peer that ended (its blocks left the index at once): the error's kind (`timeout`, `closed`, …), or `peer_left` when membership dropped the peer |
//! | `dynamo_node_cluster_members` | gauge | | peers in this node's view of the cluster (etcd membership) |
//! | `dynamo_node_cluster_etcd_up` | gauge | | 1 while registered in etcd and following it |
//! | `dynamo_node_cluster_registrations_total` | counter | | registrations in etcd (more than one: re-registered under a new epoch) |
//! | `dynamo_node_cluster_epoch` | gauge | | the revision of the node's current registration |
//! | `dynamo_node_engines_registered` | gauge | | external engines (vLLM) with a live connection to the engine endpoint; the `engine` label of the series below is an engine's index on the node (the smallest free when it registered, so fewer than `engine_endpoint.max_engines` values; the log line "engine registered" maps ids to indices) |
//! | `dynamo_node_engine_lookups_total` | counter | `engine`, `result` | an external engine's block lookups: `hit` (in G2, verified), `pending` (being read from G3), `miss` |
//! | `dynamo_node_engine_blocks_total` | counter | `engine`, `op` | an external engine's blocks: `stored`, `loaded`, `promoted` (G3 → G2), `fetched` (from a peer node, G4 → G2), `missing` and `fetch_failed` (a peer's fetch that did not land), `no_room`, `no_workers` (a store refused while a rank had no worker registered), `corrupt` (failed verification, dropped), `read_failed` |
//! | `dynamo_node_engine_g2_blocks` | gauge | `engine` | blocks the engine stored that G2 still holds |
//! | `dynamo_node_engine_g1_blocks` | gauge | `engine` | blocks the prefix index holds in the engine's G1, from its KV events |
//! | `dynamo_node_engine_kv_events_total` | counter | `engine`, `kind` | the engine's KV events applied to the index (`stored`, `removed`, `cleared`), and `gap`s and `malformed` batches |

use std::sync::atomic::Ordering;
use std::time::Duration;

use dynamo_config::RegionKind;
use dynamo_tiering::block::SetDigest;
use dynamo_tiering::g3::G3Stats;
use dynamo_tiering::registry::RegistryStats;
use metrics::{Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};

use dynamo_config::TierName;

/// Every metric name, in one place.
pub mod names {
    /// Gauge `{version}`, always 1.
    pub const BUILD_INFO: &str = "dynamo_node_build_info";
    /// Gauge: when the node started, in seconds since the Unix epoch (a change is a restart).
    pub const START_TIME_SECONDS: &str = "dynamo_node_start_time_seconds";
    /// Gauge `{tier}`.
    pub const KV_BLOCKS: &str = "dynamo_node_kv_blocks";
    /// Gauge: blocks under a live lease (`cache_control`), per tier (any state).
    pub const KV_LEASED_BLOCKS: &str = "dynamo_node_kv_leased_blocks";
    /// Gauge: unreferenced blocks kept by an active hold (a turn's context across a tool-call
    /// gap), per tier.
    pub const KV_HELD_BLOCKS: &str = "dynamo_node_kv_held_blocks";
    /// Counter: leases that ran out, per tier.
    pub const KV_LEASE_EXPIRIES: &str = "dynamo_node_kv_lease_expiries_total";
    /// Counter: leases dropped to plain retention by the tier's lease budget, per tier.
    pub const KV_LEASE_DEGRADATIONS: &str = "dynamo_node_kv_lease_degradations_total";
    /// Gauge `{tier}`.
    pub const KV_CAPACITY_BLOCKS: &str = "dynamo_node_kv_capacity_blocks";
    /// Counter.
    pub const KV_PROMPT_TOKENS: &str = "dynamo_node_kv_prompt_tokens_total";
    /// Counter `{tier}`.
    pub const KV_HIT_TOKENS: &str = "dynamo_node_kv_hit_tokens_total";
    /// Counter.
    pub const PREFILL_TOKENS: &str = "dynamo_node_prefill_tokens_total";
    /// Counter `{src,dst}`.
    pub const KV_TRANSFER_BYTES: &str = "dynamo_node_kv_transfer_bytes_total";
    /// Histogram `{src,dst}`.
    pub const KV_TRANSFER_SECONDS: &str = "dynamo_node_kv_transfer_seconds";
    /// Counter `{tier,region}`.
    pub const KV_EVICTIONS: &str = "dynamo_node_kv_evictions_total";
    /// Counter `{tier}`.
    pub const KV_CORRUPT_BLOCKS: &str = "dynamo_node_kv_corrupt_blocks_total";
    /// Counter `{tier}`.
    pub const KV_TIER_WRITES: &str = "dynamo_node_kv_tier_writes_total";
    /// Counter `{tier}`.
    pub const KV_TIER_WRITE_BYTES: &str = "dynamo_node_kv_tier_write_bytes_total";
    /// Counter `{tier}`.
    pub const KV_TIER_DUPLICATE_WRITES: &str = "dynamo_node_kv_tier_duplicate_writes_total";
    /// Counter `{tier}`.
    pub const KV_TIER_READS: &str = "dynamo_node_kv_tier_reads_total";
    /// Counter `{tier}`.
    pub const KV_TIER_READ_BYTES: &str = "dynamo_node_kv_tier_read_bytes_total";
    /// Counter `{tier,op}`.
    pub const KV_TIER_IO_ERRORS: &str = "dynamo_node_kv_tier_io_errors_total";
    /// Counter `{tier,kind}`.
    pub const TIER_ERRORS: &str = "dynamo_node_tier_errors_total";
    /// Gauge `{tier}`.
    pub const IO_INFLIGHT: &str = "dynamo_node_io_inflight";
    /// Gauge `{tier}`, 0 or 1.
    pub const TIER_DEGRADED: &str = "dynamo_node_tier_degraded";
    /// Counter `{api,status}`.
    pub const REQUESTS: &str = "dynamo_node_requests_total";
    /// Histogram.
    pub const REQUEST_TTFT_SECONDS: &str = "dynamo_node_request_ttft_seconds";
    /// Histogram.
    pub const INTER_TOKEN_SECONDS: &str = "dynamo_node_inter_token_seconds";
    /// Counter.
    pub const WORKER_RESTARTS: &str = "dynamo_node_worker_restarts_total";
    /// Counter, by `part`.
    pub const RING_RESTARTS: &str = "dynamo_node_ring_restarts_total";
    /// Counter.
    pub const PREEMPTIONS: &str = "dynamo_node_preemptions_total";
    /// Histogram `{tier}`.
    pub const WRITE_THROUGH_LAG_SECONDS: &str = "dynamo_node_kv_write_through_lag_seconds";
    /// Counter `{tier}`.
    pub const WRITE_THROUGH_SKIPPED: &str = "dynamo_node_kv_write_through_skipped_total";
    /// Histogram.
    pub const ROUTER_DECISION_SECONDS: &str = "dynamo_node_router_decision_seconds";
    /// Histogram: time from a request reaching the router to its joining a worker's queue.
    pub const ROUTER_WAIT_SECONDS: &str = "dynamo_node_router_wait_seconds";
    /// Counter `{kind,result}`.
    pub const INDEX_EVENTS: &str = "dynamo_node_index_events_total";
    /// Gauge.
    pub const ROUTER_WAITING: &str = "dynamo_node_router_waiting_requests";
    /// Gauge.
    pub const ROUTER_HELD: &str = "dynamo_node_router_held_requests";
    /// Gauge.
    pub const ROUTER_WORKING_SET_SESSIONS: &str = "dynamo_node_router_working_set_sessions";
    /// Gauge.
    pub const ROUTER_WORKING_SET_TOKENS: &str = "dynamo_node_router_working_set_tokens";
    /// Gauge.
    pub const ROUTER_WORKING_SET_CAPACITY: &str = "dynamo_node_router_working_set_capacity_tokens";
    /// Gauge.
    pub const INDEX_BLOCKS: &str = "dynamo_node_index_blocks";
    /// Counter.
    pub const INDEX_RESYNCS: &str = "dynamo_node_index_resyncs_total";
    /// Counter.
    pub const ROUTER_PREDICTED_CACHED_TOKENS: &str = "dynamo_node_router_predicted_cached_tokens_total";
    /// Counter.
    pub const ROUTER_ACTUAL_CACHED_TOKENS: &str = "dynamo_node_router_actual_cached_tokens_total";
    /// Counter.
    pub const ROUTER_MISPREDICTIONS: &str = "dynamo_node_router_mispredictions_total";
    /// Counter `{stage}`: requests stopped because nobody waited for them any more (the client
    /// went away, the request timed out, the node shut down): `queued` before they started,
    /// `prefill` between two prefill passes, `decode` between two tokens.
    pub const REQUESTS_CANCELLED: &str = "dynamo_node_requests_cancelled_total";
    /// Gauge: HTTP connections open.
    pub const HTTP_CONNECTIONS: &str = "dynamo_node_http_connections";
    /// Counter `{reason}`: HTTP connections closed by the node: `limit` (refused at
    /// `frontend.max_connections`), `accept_error` (the OS refused, e.g. out of file descriptors),
    /// `header_timeout` (no complete request head within `frontend.header_timeout`).
    pub const HTTP_CONNECTIONS_REFUSED: &str = "dynamo_node_http_connections_refused_total";
    /// Counter: Claude Code billing headers (`x-anthropic-billing-header`) dropped from system text
    /// (`frontend.strip_anthropic_preamble`).
    pub const PREAMBLES_STRIPPED: &str = "dynamo_node_anthropic_preambles_stripped_total";
    /// Counter: echoed assistant turns whose generated token ids were spliced into the prompt
    /// instead of the template's re-rendering (`frontend.replay_tokens`).
    pub const REPLAYED_TURNS: &str = "dynamo_node_replayed_turns_total";
    /// Counter: requests written to the traffic recording (`[recording]`).
    pub const RECORDED_REQUESTS: &str = "dynamo_node_recorded_requests_total";
    /// Counter `{reason}`: requests the recording lost (`queue_full`, `write_error`).
    pub const RECORDING_DROPPED: &str = "dynamo_node_recording_dropped_total";
    /// Counter: requests refused with 401 (missing or unknown API key or metrics token), by
    /// `endpoint` (`api`, `metrics`).
    pub const AUTH_FAILURES: &str = "dynamo_node_auth_failures_total";

    /// Counter `{outcome}`: G4 peer connections served, by how they ended (`goodbye`, or the
    /// error's kind).
    pub const PEER_CONNECTIONS: &str = "dynamo_node_peer_connections_total";
    /// Counter: block-image bytes sent to peers.
    pub const PEER_SERVED_BYTES: &str = "dynamo_node_peer_served_bytes_total";
    /// Counter: peer holds that ran out before their release.
    pub const PEER_EXPIRED_HOLDS: &str = "dynamo_node_peer_expired_holds_total";
    /// Counter `{peer, transport, outcome}`: fetches from peers, by how they ended.
    pub const PEER_FETCHES: &str = "dynamo_node_peer_fetches_total";
    /// Histogram `{peer, transport}`: time of one fetch (hold, images, release).
    pub const PEER_FETCH_SECONDS: &str = "dynamo_node_peer_fetch_seconds";
    /// Counter `{peer, transport, outcome}`: blocks asked of peers: `verified`, `missing`,
    /// `rejected` (failed verification, dropped).
    pub const PEER_FETCHED_BLOCKS: &str = "dynamo_node_peer_fetched_blocks_total";
    /// Counter `{peer, transport}`: verified image bytes fetched from peers.
    pub const PEER_FETCHED_BYTES: &str = "dynamo_node_peer_fetched_bytes_total";
    /// Counter `{peer, reason}`: feeds from peers that ended (their blocks left the index).
    pub const PEER_FEED_ENDED: &str = "dynamo_node_peer_feed_ended_total";
    /// Gauge: blocks the index holds for a peer.
    pub const PEER_INDEX_BLOCKS: &str = "dynamo_node_peer_index_blocks";
    /// Gauge: blocks this node's feed offers.
    pub const PEER_SERVABLE_BLOCKS: &str = "dynamo_node_peer_servable_blocks";
    /// Gauge: 52 bits of the digest of the set of blocks the index holds for a peer.
    pub const PEER_INDEX_DIGEST: &str = "dynamo_node_peer_index_digest";
    /// Gauge: 52 bits of the digest of the set of blocks this node's feed offers.
    pub const PEER_SERVABLE_DIGEST: &str = "dynamo_node_peer_servable_digest";
    /// Gauge: whether this node's lanes may use RDMA.
    pub const PEER_RDMA: &str = "dynamo_node_peer_rdma";
    /// Gauge: external engines with a live connection.
    pub const ENGINES_REGISTERED: &str = "dynamo_node_engines_registered";
    /// Counter `{engine, result}`: an external engine's lookups.
    pub const ENGINE_LOOKUPS: &str = "dynamo_node_engine_lookups_total";
    /// Counter `{engine, op}`: an external engine's blocks stored, loaded, promoted, refused.
    pub const ENGINE_BLOCKS: &str = "dynamo_node_engine_blocks_total";
    /// Gauge `{engine}`: blocks the engine stored that G2 still holds.
    pub const ENGINE_G2_BLOCKS: &str = "dynamo_node_engine_g2_blocks";
    /// Gauge `{engine}`: blocks the index holds in the engine's G1.
    pub const ENGINE_G1_BLOCKS: &str = "dynamo_node_engine_g1_blocks";
    /// Counter `{engine, kind}`: the engine's KV events.
    pub const ENGINE_KV_EVENTS: &str = "dynamo_node_engine_kv_events_total";
    /// Gauge, by `engine` (its URL): 1 while a vLLM worker's engine answers, 0 while it is down.
    pub const ENGINE_UP: &str = "dynamo_node_engine_up";
    /// Counter, by `engine` (its URL) and `kind`: requests a forwarding worker's engine failed.
    pub const ENGINE_REQUEST_ERRORS: &str = "dynamo_node_engine_request_errors_total";
    /// Counter, by `engine` (its URL): requests a forwarding worker's engine served.
    pub const ENGINE_REQUESTS: &str = "dynamo_node_engine_requests_total";
    /// Counter, by `engine` and `kind` (`prompt`, `cached`): the prompt tokens a forwarding
    /// worker sent its engine, and those the engine found cached (its G1, or loaded through the
    /// KV connector).
    pub const ENGINE_PROMPT_TOKENS: &str = "dynamo_node_engine_prompt_tokens_total";
    /// Histogram, by `engine`: seconds from sending a request to the engine to its first token.
    pub const ENGINE_TTFT_SECONDS: &str = "dynamo_node_engine_ttft_seconds";
    /// Gauge, by `engine` and `state` (`running`, `waiting`): requests there, as the engine last
    /// reported them (its own metrics, `engine.vllm.load_interval`), whoever sent them.
    pub const ENGINE_REPORTED_REQUESTS: &str = "dynamo_node_engine_reported_requests";
    /// Gauge, by `engine`: the share of its KV cache in use, as the engine last reported it.
    pub const ENGINE_KV_USAGE: &str = "dynamo_node_engine_kv_usage_ratio";
    /// Gauge: peers in this node's view of the cluster (etcd membership).
    pub const CLUSTER_MEMBERS: &str = "dynamo_node_cluster_members";
    /// Gauge: 1 while the node is registered in etcd and following it, 0 otherwise.
    pub const CLUSTER_ETCD_UP: &str = "dynamo_node_cluster_etcd_up";
    /// Counter: registrations of this node in etcd (more than one: its lease ran out, or etcd
    /// was lost, and it registered again under a new epoch).
    pub const CLUSTER_REGISTRATIONS: &str = "dynamo_node_cluster_registrations_total";
    /// Gauge: this node's epoch, the revision of its current registration.
    pub const CLUSTER_EPOCH: &str = "dynamo_node_cluster_epoch";

    /// Every histogram: each gets the configured buckets.
    pub const HISTOGRAMS: [&str; 7] = [
        KV_TRANSFER_SECONDS,
        PEER_FETCH_SECONDS,
        REQUEST_TTFT_SECONDS,
        INTER_TOKEN_SECONDS,
        WRITE_THROUGH_LAG_SECONDS,
        ROUTER_DECISION_SECONDS,
        ROUTER_WAIT_SECONDS,
    ];
}

/// Registers help text and units of every metric with the current recorder.
pub fn describe() {
    use names::*;
    describe_gauge!(BUILD_INFO, "Build information; always 1.");
    describe_gauge!(START_TIME_SECONDS, Unit::Seconds, "When the node started, in seconds since the Unix epoch.");
    describe_counter!(REQUESTS_CANCELLED, Unit::Count, "Requests stopped because nobody waited for them, by stage.");
    describe_gauge!(HTTP_CONNECTIONS, Unit::Count, "HTTP connections open.");
    describe_counter!(PREAMBLES_STRIPPED, Unit::Count, "Claude Code billing headers dropped from system text.");
    describe_counter!(REPLAYED_TURNS, Unit::Count, "Echoed assistant turns replayed from their generated tokens.");
    describe_counter!(RECORDED_REQUESTS, Unit::Count, "Requests written to the traffic recording.");
    describe_counter!(RECORDING_DROPPED, Unit::Count, "Requests the traffic recording lost, by reason.");
    describe_counter!(PEER_CONNECTIONS, Unit::Count, "G4 peer connections served, by how they ended.");
    describe_counter!(PEER_SERVED_BYTES, Unit::Bytes, "Block-image bytes sent to peers.");
    describe_counter!(PEER_FETCHES, Unit::Count, "Fetches from peers, by how they ended.");
    describe_histogram!(PEER_FETCH_SECONDS, Unit::Seconds, "Time of one fetch from a peer: hold, images, release.");
    describe_counter!(PEER_FETCHED_BLOCKS, Unit::Count, "Blocks asked of peers: verified, missing or rejected.");
    describe_counter!(PEER_FETCHED_BYTES, Unit::Bytes, "Verified block-image bytes fetched from peers.");
    describe_counter!(PEER_FEED_ENDED, Unit::Count, "Feeds from peers that ended; their blocks left the index.");
    describe_gauge!(PEER_INDEX_BLOCKS, "Blocks this node's index holds for a peer, as its feed left them.");
    describe_gauge!(
        PEER_SERVABLE_BLOCKS,
        "Blocks this node's feed offers its peers (in G2 or G3); a vLLM engine's block counts under its key and its name."
    );
    describe_gauge!(
        PEER_INDEX_DIGEST,
        "Digest (52 bits) of the set of blocks this node's index holds for a peer: equal to the peer's \
         dynamo_node_peer_servable_digest when the index is right."
    );
    describe_gauge!(PEER_SERVABLE_DIGEST, "Digest (52 bits) of the set of blocks this node's feed offers its peers.");
    describe_gauge!(PEER_RDMA, "1 when this node's G4 lanes may use RDMA, 0 when they use TCP only.");
    describe_gauge!(ENGINES_REGISTERED, Unit::Count, "External engines with a live connection to the engine endpoint.");
    describe_counter!(ENGINE_LOOKUPS, Unit::Count, "An external engine's block lookups, by result.");
    describe_counter!(
        ENGINE_BLOCKS,
        Unit::Count,
        "An external engine's blocks stored, loaded, promoted from G3, refused."
    );
    describe_gauge!(ENGINE_G2_BLOCKS, Unit::Count, "Blocks an external engine stored that G2 still holds.");
    describe_gauge!(ENGINE_G1_BLOCKS, Unit::Count, "Blocks the prefix index holds in an external engine's G1.");
    describe_counter!(
        ENGINE_KV_EVENTS,
        Unit::Count,
        "An external engine's KV events applied to the index, gaps, malformed batches."
    );
    describe_gauge!(CLUSTER_MEMBERS, Unit::Count, "Peers in this node's view of the cluster.");
    describe_gauge!(CLUSTER_ETCD_UP, Unit::Count, "1 while registered in etcd and following it.");
    describe_counter!(CLUSTER_REGISTRATIONS, Unit::Count, "Registrations of this node in etcd.");
    describe_gauge!(CLUSTER_EPOCH, Unit::Count, "This node's epoch: the revision of its registration.");
    describe_counter!(PEER_EXPIRED_HOLDS, Unit::Count, "Peer holds that ran out before their release.");
    describe_counter!(AUTH_FAILURES, Unit::Count, "Requests refused for a missing or unknown key, by endpoint.");
    describe_counter!(HTTP_CONNECTIONS_REFUSED, Unit::Count, "HTTP connections closed by the node, by reason.");
    describe_gauge!(ENGINE_UP, "1 while a vLLM worker's engine answers, 0 while it is down, by engine URL.");
    describe_counter!(
        ENGINE_REQUEST_ERRORS,
        Unit::Count,
        "Requests a vLLM engine refused, broke or did not answer in time, by engine and kind."
    );
    describe_counter!(ENGINE_REQUESTS, Unit::Count, "Requests a vLLM engine served, by engine.");
    describe_gauge!(
        ENGINE_REPORTED_REQUESTS,
        Unit::Count,
        "Requests running and waiting in a vLLM engine as it last reported them, by engine and state."
    );
    describe_gauge!(ENGINE_KV_USAGE, "The share of a vLLM engine's KV cache in use as it last reported it, by engine.");
    describe_counter!(
        ENGINE_PROMPT_TOKENS,
        Unit::Count,
        "Prompt tokens sent to a vLLM engine, and those it found cached, by engine and kind."
    );
    describe_histogram!(
        ENGINE_TTFT_SECONDS,
        Unit::Seconds,
        "Time from sending a request to a vLLM engine to its first token, by engine."
    );
    describe_counter!(WORKER_RESTARTS, Unit::Count, "Workers restarted after a panic (their G1 blocks are dropped).");
    describe_counter!(
        RING_RESTARTS,
        Unit::Count,
        "Parts of the node's outer ring (endpoint, G4 server, membership, poller, lease saver) that stopped on their own, by part."
    );
    describe_counter!(
        PREEMPTIONS,
        Unit::Count,
        "Running requests that yielded their G1 pages to others (they resume by loading their blocks back)."
    );
    describe_gauge!(KV_BLOCKS, Unit::Count, "KV blocks resident in the tier.");
    describe_gauge!(KV_LEASED_BLOCKS, Unit::Count, "KV blocks under a live lease (cache_control), per tier.");
    describe_gauge!(KV_HELD_BLOCKS, Unit::Count, "Unreferenced KV blocks kept by an active hold, per tier.");
    describe_counter!(KV_LEASE_EXPIRIES, Unit::Count, "Leases that ran out, per tier.");
    describe_counter!(KV_LEASE_DEGRADATIONS, Unit::Count, "Leases dropped to plain retention by the lease budget.");
    describe_gauge!(KV_CAPACITY_BLOCKS, Unit::Count, "KV blocks the tier can hold (G1: summed over workers).");
    describe_counter!(KV_PROMPT_TOKENS, Unit::Count, "Prompt tokens of admitted requests.");
    describe_counter!(
        KV_HIT_TOKENS,
        Unit::Count,
        "Prompt tokens whose KV came from the tier instead of being computed."
    );
    describe_counter!(PREFILL_TOKENS, Unit::Count, "Prompt tokens computed by prefill.");
    describe_counter!(KV_TRANSFER_BYTES, Unit::Bytes, "Bytes of KV moved from tier src to tier dst.");
    describe_histogram!(KV_TRANSFER_SECONDS, Unit::Seconds, "Duration of one batched KV transfer from src to dst.");
    describe_counter!(KV_EVICTIONS, Unit::Count, "Blocks evicted by the tier's policy, by retention region.");
    describe_counter!(KV_CORRUPT_BLOCKS, Unit::Count, "Block reads that failed verification.");
    describe_counter!(KV_TIER_WRITES, Unit::Count, "Block images written to the tier's store.");
    describe_counter!(KV_TIER_WRITE_BYTES, Unit::Bytes, "Bytes written to the tier's store.");
    describe_counter!(KV_TIER_DUPLICATE_WRITES, Unit::Count, "Writes skipped because the block was present.");
    describe_counter!(KV_TIER_READS, Unit::Count, "Block images read from the tier's store and verified.");
    describe_counter!(KV_TIER_READ_BYTES, Unit::Bytes, "Bytes read from the tier's store.");
    describe_counter!(KV_TIER_IO_ERRORS, Unit::Count, "Reads or writes (op) the tier's store failed.");
    describe_counter!(TIER_ERRORS, Unit::Count, "Errors of a tier seen by the node, by error kind.");
    describe_gauge!(IO_INFLIGHT, Unit::Count, "I/O operations submitted to the tier and not yet completed.");
    describe_gauge!(TIER_DEGRADED, "1 while the node runs without the tier after a failure, else 0.");
    describe_counter!(REQUESTS, Unit::Count, "Requests answered, by API and HTTP status.");
    describe_histogram!(REQUEST_TTFT_SECONDS, Unit::Seconds, "Time from request arrival to the first token.");
    describe_histogram!(INTER_TOKEN_SECONDS, Unit::Seconds, "Time between consecutive generated tokens.");
    describe_counter!(
        WRITE_THROUGH_SKIPPED,
        Unit::Count,
        "Blocks write-through did not take to the tier because its writes were too far behind."
    );
    describe_histogram!(ROUTER_DECISION_SECONDS, Unit::Seconds, "Time the router took to choose a worker.");
    describe_histogram!(
        ROUTER_WAIT_SECONDS,
        Unit::Seconds,
        "Time a request waited at the router (working-set admission, late binding) before joining a worker's queue."
    );
    describe_counter!(INDEX_EVENTS, Unit::Count, "KV events offered to the global prefix index, by kind and result.");
    describe_gauge!(INDEX_BLOCKS, Unit::Count, "Distinct blocks in the global prefix index.");
    describe_gauge!(
        ROUTER_WAITING,
        Unit::Count,
        "Sessions' turns waiting at the KV-aware router for the working set to have room."
    );
    describe_gauge!(
        ROUTER_HELD,
        Unit::Count,
        "Requests held at the KV-aware router while every worker has more than router.late_binding of prefill ahead."
    );
    describe_gauge!(
        ROUTER_WORKING_SET_SESSIONS,
        Unit::Count,
        "Sessions in the KV-aware router's line (a turn waiting, or routed within router.session_gap)."
    );
    describe_gauge!(
        ROUTER_WORKING_SET_TOKENS,
        Unit::Count,
        "Context tokens of their own of the sessions in the KV-aware router's line."
    );
    describe_gauge!(
        ROUTER_WORKING_SET_CAPACITY,
        Unit::Count,
        "Context tokens the KV-aware router's line may hold now: router.working_set of G1 and G2, less what measured thrashing took (0: admission off)."
    );
    describe_counter!(INDEX_RESYNCS, Unit::Count, "Sources of the global prefix index resynchronised after a gap.");
    describe_counter!(
        ROUTER_PREDICTED_CACHED_TOKENS,
        Unit::Count,
        "Prompt tokens the router expected to be cached on the chosen worker."
    );
    describe_counter!(
        ROUTER_ACTUAL_CACHED_TOKENS,
        Unit::Count,
        "Prompt tokens that were cached on the chosen worker, for requests the router predicted."
    );
    describe_counter!(
        ROUTER_MISPREDICTIONS,
        Unit::Count,
        "Requests whose cached tokens differed from the router's prediction."
    );
    describe_histogram!(
        WRITE_THROUGH_LAG_SECONDS,
        Unit::Seconds,
        "Time from a block's completion in G1 to its acknowledgment by the tier."
    );
}

/// Creates the series whose label values are known up front, at zero, so that a scrape lists them
/// (and a `rate()` has a starting point) before the first event.
pub fn register_known_series() {
    use names::*;
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    counter!(KV_PROMPT_TOKENS).increment(0);
    counter!(PREFILL_TOKENS).increment(0);
    for endpoint in ["api", "metrics"] {
        counter!(AUTH_FAILURES, "endpoint" => endpoint).increment(0);
    }
    for &tier in TierName::ALL {
        counter!(KV_HIT_TOKENS, "tier" => tier.as_str()).increment(0);
    }
    // Every transfer path's series exists from start-up (at zero); [`record_transfer`] accepts any
    // pair.
    for (src, dst) in TierName::transfer_paths() {
        counter!(KV_TRANSFER_BYTES, "src" => src.as_str(), "dst" => dst.as_str()).increment(0);
        let _ = histogram!(KV_TRANSFER_SECONDS, "src" => src.as_str(), "dst" => dst.as_str());
    }
    let _ = histogram!(REQUEST_TTFT_SECONDS);
    let _ = histogram!(INTER_TOKEN_SECONDS);
    for tier in TierName::NODE {
        let _ = histogram!(WRITE_THROUGH_LAG_SECONDS, "tier" => tier.as_str());
    }
    let _ = histogram!(ROUTER_DECISION_SECONDS);
    let _ = histogram!(ROUTER_WAIT_SECONDS);
    gauge!(INDEX_BLOCKS).set(0.0);
    gauge!(ROUTER_WAITING).set(0.0);
    gauge!(ROUTER_HELD).set(0.0);
    gauge!(ROUTER_WORKING_SET_SESSIONS).set(0.0);
    gauge!(ROUTER_WORKING_SET_TOKENS).set(0.0);
    gauge!(ROUTER_WORKING_SET_CAPACITY).set(0.0);
    counter!(ROUTER_PREDICTED_CACHED_TOKENS).increment(0);
    counter!(ROUTER_ACTUAL_CACHED_TOKENS).increment(0);
    for stage in ["queued", "prefill", "decode"] {
        counter!(REQUESTS_CANCELLED, "stage" => stage).increment(0);
    }
    gauge!(HTTP_CONNECTIONS).set(0.0);
    counter!(PREAMBLES_STRIPPED).increment(0);
    counter!(REPLAYED_TURNS).increment(0);
    counter!(WORKER_RESTARTS).increment(0);
    counter!(PREEMPTIONS).increment(0);
    counter!(ROUTER_MISPREDICTIONS).increment(0);
    for tier in TierName::NODE {
        counter!(WRITE_THROUGH_SKIPPED, "tier" => tier.as_str()).increment(0);
    }
    let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    gauge!(START_TIME_SECONDS).set(started.as_secs_f64());
    for reason in ["limit", "accept_error", "header_timeout"] {
        counter!(HTTP_CONNECTIONS_REFUSED, "reason" => reason).increment(0);
    }
}

/// A request was stopped at `stage` (`queued`, `prefill` or `decode`) because nobody waits for it.
pub fn record_cancelled(stage: &'static str) {
    counter!(names::REQUESTS_CANCELLED, "stage" => stage).increment(1);
}

/// A G4 peer connection ended (`outcome`: `goodbye` or the error's kind), having let `expired`
/// holds run out.
pub fn record_peer_connection(outcome: &'static str, expired: u64) {
    counter!(names::PEER_CONNECTIONS, "outcome" => outcome).increment(1);
    counter!(names::PEER_EXPIRED_HOLDS).increment(expired);
}

/// `bytes` of a block image were sent to a peer.
pub fn record_peer_served(bytes: u64) {
    counter!(names::PEER_SERVED_BYTES).increment(bytes);
}

/// A fetch from the peer at `peer` over `transport` (`tcp`, `rdma`) ended (`outcome`: `ok`, or
/// the error's kind) after `elapsed`.
pub fn record_peer_fetch(peer: &str, transport: &'static str, outcome: &'static str, elapsed: std::time::Duration) {
    counter!(names::PEER_FETCHES, "peer" => peer.to_owned(), "transport" => transport, "outcome" => outcome)
        .increment(1);
    histogram!(names::PEER_FETCH_SECONDS, "peer" => peer.to_owned(), "transport" => transport)
        .record(elapsed.as_secs_f64());
}

/// One block of a fetch from `peer` over `transport` (`outcome`: `verified`, `missing`,
/// `rejected` — failed verification and was dropped), of `bytes` image bytes.
pub fn record_peer_block(peer: &str, transport: &'static str, outcome: &'static str, bytes: u64) {
    counter!(names::PEER_FETCHED_BLOCKS, "peer" => peer.to_owned(), "transport" => transport, "outcome" => outcome)
        .increment(1);
    counter!(names::PEER_FETCHED_BYTES, "peer" => peer.to_owned(), "transport" => transport).increment(bytes);
}

/// The index holds `blocks` blocks for `peer`, a set of digest `digest`.
pub fn set_peer_index_blocks(peer: &str, blocks: u64, digest: SetDigest) {
    gauge!(names::PEER_INDEX_BLOCKS, "peer" => peer.to_owned()).set(blocks as f64);
    gauge!(names::PEER_INDEX_DIGEST, "peer" => peer.to_owned()).set(digest.gauge());
}

/// This node's feed offers `blocks` blocks, a set of digest `digest`.
pub fn set_peer_servable_blocks(blocks: usize, digest: SetDigest) {
    gauge!(names::PEER_SERVABLE_BLOCKS).set(blocks as f64);
    gauge!(names::PEER_SERVABLE_DIGEST).set(digest.gauge());
}

/// Whether this node's G4 lanes may use RDMA.
pub fn set_peer_rdma(available: bool) {
    gauge!(names::PEER_RDMA).set(if available { 1.0 } else { 0.0 });
}

/// `engines` external engines have a live connection.
pub fn set_engines_registered(engines: usize) {
    gauge!(names::ENGINES_REGISTERED).set(engines as f64);
}

/// An external engine's lookup answered `found`.
pub fn record_engine_lookup(engine: &str, found: dynamo_tiering::foreign::Found) {
    use dynamo_tiering::foreign::Found;
    let result = match found {
        Found::Hit => "hit",
        Found::Miss => "miss",
        Found::Pending => "pending",
    };
    counter!(names::ENGINE_LOOKUPS, "engine" => engine.to_owned(), "result" => result).increment(1);
}

/// `n` of an external engine's blocks went through `op`.
pub fn record_engine_blocks(engine: &str, op: &'static str, n: u64) {
    if n > 0 {
        counter!(names::ENGINE_BLOCKS, "engine" => engine.to_owned(), "op" => op).increment(n);
    }
}

/// G2 holds `blocks` of the blocks `engine` stored.
pub fn set_engine_g2_blocks(engine: &str, blocks: usize) {
    gauge!(names::ENGINE_G2_BLOCKS, "engine" => engine.to_owned()).set(blocks as f64);
}

/// The index holds `blocks` in `engine`'s G1.
pub fn set_engine_g1_blocks(engine: &str, blocks: u64) {
    gauge!(names::ENGINE_G1_BLOCKS, "engine" => engine.to_owned()).set(blocks as f64);
}

/// `n` of an external engine's KV events of `kind`.
pub fn record_engine_kv_events(engine: &str, kind: &'static str, n: u64) {
    counter!(names::ENGINE_KV_EVENTS, "engine" => engine.to_owned(), "kind" => kind).increment(n);
}

/// The feed from `peer` ended (`reason`: the error's kind); its blocks left the index.
pub fn record_peer_feed_ended(peer: &str, reason: &'static str) {
    counter!(names::PEER_FEED_ENDED, "peer" => peer.to_owned(), "reason" => reason).increment(1);
}

/// The cluster view holds `members` peers.
pub fn set_cluster_members(members: usize) {
    gauge!(names::CLUSTER_MEMBERS).set(members as f64);
}

/// Whether the node is registered in etcd and following it.
pub fn set_cluster_etcd_up(up: bool) {
    gauge!(names::CLUSTER_ETCD_UP).set(if up { 1.0 } else { 0.0 });
}

/// The node registered in etcd under `epoch`.
pub fn record_cluster_registration(epoch: i64) {
    counter!(names::CLUSTER_REGISTRATIONS).increment(1);
    gauge!(names::CLUSTER_EPOCH).set(epoch as f64);
}

/// A block read from `tier` failed verification and was dropped (tiers whose store keeps no
/// count of its own: G4).
pub fn record_corrupt_block(tier: TierName) {
    counter!(names::KV_CORRUPT_BLOCKS, "tier" => tier.as_str()).increment(1);
}

/// A Claude Code billing header was dropped from a request's system text.
pub fn record_preamble_stripped() {
    counter!(names::PREAMBLES_STRIPPED).increment(1);
}

/// `n` requests written to the traffic recording.
pub fn record_recorded(n: u64) {
    counter!(names::RECORDED_REQUESTS).increment(n);
}

/// `n` requests the traffic recording lost (`reason`: `queue_full`, `write_error`).
pub fn record_recording_dropped(reason: &'static str, n: u64) {
    counter!(names::RECORDING_DROPPED, "reason" => reason).increment(n);
}

/// `turns` echoed assistant turns replayed from their generated tokens.
pub fn record_replayed_turns(turns: usize) {
    counter!(names::REPLAYED_TURNS).increment(turns as u64);
}

/// HTTP connections open now.
pub fn set_http_connections(open: usize) {
    gauge!(names::HTTP_CONNECTIONS).set(open as f64);
}

/// The node closed an HTTP connection for `reason` (`limit`, `accept_error`, `header_timeout`).
pub fn record_connection_refused(reason: &'static str) {
    counter!(names::HTTP_CONNECTIONS_REFUSED, "reason" => reason).increment(1);
}

/// Records one routing decision's duration.
pub fn record_router_decision(elapsed: Duration) {
    histogram!(names::ROUTER_DECISION_SECONDS).record(elapsed.as_secs_f64());
}

/// Records how long a request waited at the router before it joined a worker's queue.
pub fn record_router_wait(waited: Duration) {
    histogram!(names::ROUTER_WAIT_SECONDS).record(waited.as_secs_f64());
}

/// Sets how many requests wait at the router for the working set.
pub fn set_router_waiting(requests: usize) {
    gauge!(names::ROUTER_WAITING).set(requests as f64);
}

/// Sets how many requests late binding holds at the router.
pub fn set_router_held(requests: usize) {
    gauge!(names::ROUTER_HELD).set(requests as f64);
}

/// Sets the working set's sessions, their tokens and the tokens it may hold (`None`: admission off).
pub fn set_working_set(sessions: usize, tokens: usize, capacity: Option<usize>) {
    gauge!(names::ROUTER_WORKING_SET_SESSIONS).set(sessions as f64);
    gauge!(names::ROUTER_WORKING_SET_TOKENS).set(tokens as f64);
    gauge!(names::ROUTER_WORKING_SET_CAPACITY).set(capacity.unwrap_or(0) as f64);
}

/// Counts one KV event offered to the index: its kind and what the index did with it.
pub fn record_index_event(kind: &'static str, result: &'static str) {
    counter!(names::INDEX_EVENTS, "kind" => kind, "result" => result).increment(1);
}

/// Sets the index's size and mirrors its resync count.
pub fn publish_index(blocks: u64, resyncs: u64) {
    gauge!(names::INDEX_BLOCKS).set(blocks as f64);
    counter!(names::INDEX_RESYNCS).absolute(resyncs);
}

/// Compares the router's prediction of a request's cached tokens with what the worker found.
pub fn record_prediction(predicted: u64, actual: u64) {
    counter!(names::ROUTER_PREDICTED_CACHED_TOKENS).increment(predicted);
    counter!(names::ROUTER_ACTUAL_CACHED_TOKENS).increment(actual);
    if predicted != actual {
        counter!(names::ROUTER_MISPREDICTIONS).increment(1);
    }
}

/// Counts a block write-through left above `tier` because that tier's writes were behind.
pub fn record_write_skipped(tier: TierName) {
    counter!(names::WRITE_THROUGH_SKIPPED, "tier" => tier.as_str()).increment(1);
}

/// Counts `n` blocks write-through left above `tier` because it had no room for them.
pub fn record_writes_skipped(tier: TierName, n: u64) {
    counter!(names::WRITE_THROUGH_SKIPPED, "tier" => tier.as_str()).increment(n);
}

/// Records how long a completed block took to be acknowledged by `tier` (write-through lag).
pub fn record_write_lag(tier: TierName, lag: Duration) {
    histogram!(names::WRITE_THROUGH_LAG_SECONDS, "tier" => tier.as_str()).record(lag.as_secs_f64());
}

/// Sets the tier's resident blocks.
pub fn set_tier_blocks(tier: TierName, blocks: u64) {
    gauge!(names::KV_BLOCKS, "tier" => tier.as_str()).set(blocks as f64);
}

/// Sets the tier's capacity in blocks.
pub fn set_tier_capacity(tier: TierName, blocks: u64) {
    gauge!(names::KV_CAPACITY_BLOCKS, "tier" => tier.as_str()).set(blocks as f64);
}

/// Counts an admitted request's prompt: all its tokens, and those prefill must compute.
pub fn record_prompt(prompt_tokens: u64, prefill_tokens: u64) {
    counter!(names::KV_PROMPT_TOKENS).increment(prompt_tokens);
    counter!(names::PREFILL_TOKENS).increment(prefill_tokens);
}

/// Counts prompt tokens whose KV was reused from `tier` instead of computed.
pub fn record_hit_tokens(tier: TierName, tokens: u64) {
    counter!(names::KV_HIT_TOKENS, "tier" => tier.as_str()).increment(tokens);
}

/// Counts one batched transfer of `bytes` from `src` to `dst` that took `elapsed`.
pub fn record_transfer(src: TierName, dst: TierName, bytes: u64, elapsed: Duration) {
    counter!(names::KV_TRANSFER_BYTES, "src" => src.as_str(), "dst" => dst.as_str()).increment(bytes);
    histogram!(names::KV_TRANSFER_SECONDS, "src" => src.as_str(), "dst" => dst.as_str()).record(elapsed.as_secs_f64());
}

/// Counts an error of `tier`; `kind` is the library error's `kind()`.
pub fn record_tier_error(tier: TierName, kind: &'static str) {
    counter!(names::TIER_ERRORS, "tier" => tier.as_str(), "kind" => kind).increment(1);
}

/// Sets the tier's in-flight I/O operations.
pub fn set_io_inflight(tier: TierName, ops: u64) {
    gauge!(names::IO_INFLIGHT, "tier" => tier.as_str()).set(ops as f64);
}

/// Sets whether the engine at `engine` (a URL) answers.
pub fn set_engine_up(engine: &str, up: bool) {
    gauge!(names::ENGINE_UP, "engine" => engine.to_owned()).set(if up { 1.0 } else { 0.0 });
}

/// The engine at `engine` (a URL) reported this load (`None`: it reported nothing; the gauges
/// fall to 0).
pub fn set_engine_load(engine: &str, report: Option<&crate::worker::EngineReport>) {
    let report = report.copied().unwrap_or_default();
    gauge!(names::ENGINE_REPORTED_REQUESTS, "engine" => engine.to_owned(), "state" => "running")
        .set(report.running as f64);
    gauge!(names::ENGINE_REPORTED_REQUESTS, "engine" => engine.to_owned(), "state" => "waiting")
        .set(report.waiting as f64);
    gauge!(names::ENGINE_KV_USAGE, "engine" => engine.to_owned()).set(report.kv_usage);
}

/// Counts a request the engine at `engine` (a URL) served: its `prompt` tokens, the `cached`
/// ones, and its time to the first token.
pub fn record_engine_request(engine: &str, prompt: usize, cached: usize, ttft: Duration) {
    counter!(names::ENGINE_REQUESTS, "engine" => engine.to_owned()).increment(1);
    counter!(names::ENGINE_PROMPT_TOKENS, "engine" => engine.to_owned(), "kind" => "prompt").increment(prompt as u64);
    counter!(names::ENGINE_PROMPT_TOKENS, "engine" => engine.to_owned(), "kind" => "cached").increment(cached as u64);
    histogram!(names::ENGINE_TTFT_SECONDS, "engine" => engine.to_owned()).record(ttft.as_secs_f64());
}

/// Counts a request that the engine at `engine` (a URL) failed, by the error's kind.
pub fn record_engine_error(engine: &str, kind: &'static str) {
    counter!(names::ENGINE_REQUEST_ERRORS, "engine" => engine.to_owned(), "kind" => kind).increment(1);
}

/// Counts a part of the outer ring that stopped on its own (restarted or not, by its policy).
pub fn record_ring_restart(part: &'static str) {
    counter!(names::RING_RESTARTS, "part" => part).increment(1);
}

/// Counts one worker restarted after a panic, and the G1 blocks it dropped as evictions.
pub fn record_worker_restart(g1_blocks_removed: u64) {
    counter!(names::WORKER_RESTARTS).increment(1);
    counter!(names::KV_EVICTIONS, "tier" => TierName::G1.as_str(), "region" => "restart").increment(g1_blocks_removed);
}

/// Counts one running request preempted out of G1.
pub fn record_preemption() {
    counter!(names::PREEMPTIONS).increment(1);
}

/// Marks the tier degraded (the node runs without it) or healthy.
pub fn set_tier_degraded(tier: TierName, degraded: bool) {
    gauge!(names::TIER_DEGRADED, "tier" => tier.as_str()).set(if degraded { 1.0 } else { 0.0 });
}

/// Counts a request refused 401 at `endpoint` (`api` or `metrics`).
pub fn record_auth_failure(endpoint: &'static str) {
    counter!(names::AUTH_FAILURES, "endpoint" => endpoint).increment(1);
}

/// Counts one answered request of the API labelled `api` (the frontend's routes name theirs),
/// with its time to first token when it produced one.
pub fn record_request(api: &'static str, status: u16, ttft: Option<Duration>) {
    counter!(names::REQUESTS, "api" => api, "status" => status.to_string()).increment(1);
    if let Some(ttft) = ttft {
        histogram!(names::REQUEST_TTFT_SECONDS).record(ttft.as_secs_f64());
    }
}

/// Creates the `dynamo_node_requests_total{api, status="200"}` series of `apis` at zero.
pub fn register_request_series(apis: &[&'static str]) {
    for &api in apis {
        counter!(names::REQUESTS, "api" => api, "status" => "200").increment(0);
    }
}

/// Records one request's time to first token, from its arrival.
pub fn record_ttft(ttft: Duration) {
    histogram!(names::REQUEST_TTFT_SECONDS).record(ttft.as_secs_f64());
}

/// Records the gap between two consecutive generated tokens.
pub fn record_inter_token(gap: Duration) {
    histogram!(names::INTER_TOKEN_SECONDS).record(gap.as_secs_f64());
}

/// Publishes a registry snapshot: resident blocks, capacity, and per-region evictions (mirrored).
pub fn publish_registry(tier: TierName, stats: &RegistryStats) {
    set_tier_blocks(tier, stats.total().resident as u64);
    set_tier_capacity(tier, stats.capacity as u64);
    for (region, s) in &stats.regions {
        publish_evictions(tier, *region, s.evictions_total);
    }
    let t = tier.as_str();
    gauge!(names::KV_LEASED_BLOCKS, "tier" => t).set(stats.leases.live as f64);
    gauge!(names::KV_HELD_BLOCKS, "tier" => t).set(stats.total().held as f64);
    counter!(names::KV_LEASE_EXPIRIES, "tier" => t).absolute(stats.leases.expiries_total);
    counter!(names::KV_LEASE_DEGRADATIONS, "tier" => t).absolute(stats.leases.degradations_total);
}

fn publish_evictions(tier: TierName, region: RegionKind, total: u64) {
    counter!(names::KV_EVICTIONS, "tier" => tier.as_str(), "region" => region.as_str()).absolute(total);
}

/// Mirrors a block store's monotonic counters.
pub fn publish_store_stats(tier: TierName, stats: &G3Stats) {
    use names::*;
    let t = tier.as_str();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    counter!(KV_TIER_WRITES, "tier" => t).absolute(load(&stats.writes));
    counter!(KV_TIER_WRITE_BYTES, "tier" => t).absolute(load(&stats.write_bytes));
    counter!(KV_TIER_DUPLICATE_WRITES, "tier" => t).absolute(load(&stats.duplicate_writes));
    counter!(KV_TIER_READS, "tier" => t).absolute(load(&stats.reads));
    counter!(KV_TIER_READ_BYTES, "tier" => t).absolute(load(&stats.read_bytes));
    counter!(KV_TIER_IO_ERRORS, "tier" => t, "op" => "write").absolute(load(&stats.write_errors));
    counter!(KV_TIER_IO_ERRORS, "tier" => t, "op" => "read").absolute(load(&stats.read_errors));
    counter!(KV_CORRUPT_BLOCKS, "tier" => t).absolute(load(&stats.corrupt));
}
