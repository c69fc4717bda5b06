//! # dynamo-actors
//!
//! The actors of a node (DESIGN.md §5), on `ractor` and `tokio`, one module per actor with
//! `pub type XRef = ActorRef<XMsg>` and the reply contract of every message in its doc:
//!
//! - **NodeSupervisor** — the root; spawns and links the others with a restart policy per child
//!   (a crashed worker restarts and reports its G1 blocks removed; a failed G3 store degrades the
//!   node to G1+G2; the node never exits because one child did).
//! - **SessionActor** — one per conversation: regions, holds across tool-call gaps, cache-control
//!   TTLs, agent hints, sticky-worker preference.
//! - **SchedulerActor** — the global prefix index, the TTFT cost model, the priority queue.
//! - **WorkerActor** — one per engine instance: the engine, its G1 pool, onboarding and
//!   write-through.
//! - **Tier store actors** — the node's G2 and G3 stores; their I/O runs on the engines' own
//!   threads, never inside a handler.
//! - **PeerLink actors** — one per remote node.
//!
//! What is here today is the synchronous core those actors will own:
//! - [`index`] — [`index::PrefixIndex`]: the global prefix index fed by [`index::KvEvent`]s
//!   (per-source sequence numbers, gap detection and resync, approximate mode), answering per
//!   location and tier the longest cached prefix of a request.
//! - [`worker`] — [`worker::Worker`]: one engine and its G1 pool; reuse of G1-resident prefixes,
//!   onboarding from G2/G3 (verified), prefill, decode, and write-through of every completed block.
//! - [`tiers`] — [`tiers::NodeTiers`]: the G2 and G3 tiers the workers of a node share, with
//!   admission that evicts by policy.

pub mod index;
pub mod tiers;
pub mod worker;
