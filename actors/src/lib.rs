//! # dynamo-actors
//!
//! The actors of a node (DESIGN.md §5), on `ractor` and `tokio`, one module per actor with
//! `pub type XRef = ActorRef<XMsg>` and the reply contract of every message in its doc:
//!
//! - [`supervisor`] — **NodeSupervisor**, the root: spawns and links the others with a restart
//!   policy per child (a crashed worker restarts and reports its G1 blocks removed; a failed G3
//!   store degrades the node to G1+G2; the node never exits because one child did).
//! - [`session`] — **SessionActor**, one per conversation: turns, the sticky-worker preference,
//!   the idle timeout.
//! - [`scheduler`] — **SchedulerActor**: bounded admission (a full node answers "overloaded" at
//!   once), late binding, sessions and their leases; the worker order comes from a [`routing`]
//!   policy (one file per policy behind one trait).
//! - [`worker`] — **WorkerActor**, one per engine instance: the engine on its own thread, its G1
//!   pool, onboarding and write-through ([`worker::Worker`] is the engine loop it drives).
//! - [`endpoint`] — **EngineEndpoint**: external engines (vLLM through its KV connector) on a
//!   Unix socket — lookups, stores into and loads from the shared G2, their KV events into the index.
//! - [`stores`] — the **G2 and G3 store actors**: background reclaim between the watermarks, G3
//!   health (degrade to G1+G2 and recover by probing).
//!
//! Shared pieces that are not actors:
//! - [`builder`] — [`builder::NodeBuilder`]: the one staged builder of a node (index and KV
//!   events → stores opened from their plan, G3's registry recovered → tiers with the node's one
//!   cost model → engines → the running actor tree's handles), used by every entry point.
//! - [`index`] — [`index::PrefixIndex`]: the global prefix index fed by [`index::KvEvent`]s
//!   (per-source sequence numbers, gap detection and resync, approximate mode), answering per
//!   location and tier the longest cached prefix of a request.
//! - [`tiers`] — [`tiers::NodeTiers`]: the G2 and G3 tiers the workers of a node share, with
//!   admission that evicts by policy, G3 health, and the [`tiers::KvObserver`] that turns every
//!   change of where blocks are into KV events.
//! - [`publisher`] — [`publisher::KvPublisher`]: the node's KV observer, sequencing events per
//!   source into the index.
//! - [`cost`] — [`cost::CostModel`]: estimated time to first token per worker.
//! - [`telemetry`] — every metric name and the functions that record them.
//!
//! Blocking work never runs inside a handler: engines run on their workers' threads, G3 I/O on
//! the store's ring threads.

pub mod admission;
pub mod builder;
pub mod cost;
pub mod endpoint;
pub mod engine_names;
pub mod index;
pub mod leases;
pub mod peer;
pub mod publisher;
pub mod ring;
pub mod routing;
pub mod scheduler;
pub mod session;
pub mod stores;
pub mod supervisor;
pub mod telemetry;
pub mod tier_store;
pub mod tiers;
pub mod vllm_events;
pub mod vllm_metrics;
pub mod worker;
