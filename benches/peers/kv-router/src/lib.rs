//! # kv-router-peer-bench
//!
//! dynamo-node's prefix-index replay harness (`benches/src/index_workload.rs` and
//! `benches/src/index_replay.rs` of the main workspace, included by path) with NVIDIA Dynamo's
//! `dynamo-kv-router` 1.6.1 indexes plugged in as rows ([`dynamo`]). The bench
//! `index_vs_kv_router` prints them side by side with ours:
//!
//! `cd benches/peers/kv-router && cargo bench --bench index_vs_kv_router`

#[allow(unreachable_pub, dead_code)]
#[path = "../../../src/index_workload.rs"]
pub mod index_workload;

#[allow(unreachable_pub, dead_code)]
#[path = "../../../src/index_replay.rs"]
pub mod index_replay;

#[allow(unreachable_pub, dead_code)]
#[path = "../../../src/index_ours.rs"]
pub mod index_ours;

pub mod dynamo;
