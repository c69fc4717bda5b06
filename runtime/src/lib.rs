//! # dynamo-node
//!
//! The node: the command line, configuration loading, logging, the tokio runtime, and the
//! assembly of the tiers (and, as later work lands, the actor tree, the HTTP frontend, the
//! Prometheus exporter, cluster membership and the trace-replay driver).
//!
//! - [`cli`] — `dynamo-node [serve]`, `config default|check`, `bench storage`; exit codes and error
//!   printing.
//! - [`plan`] — resolves a [`dynamo_config::NodeConfig`] on this machine into what the node will
//!   run (slot sizes, block counts, files, where the engines run) and into the store plan the node
//!   builder ([`dynamo_actors::builder`]) opens.
//! - [`serving`] — the actor tree over the node's tiers, assembled by the node builder with the
//!   reference engines, and the frontend's [`frontend::Generator`] on top of it.
//! - [`node`] — starts a node (tiers, actor tree, metrics poller, HTTP frontend) and stops it
//!   within its shutdown grace; `serve` runs one until SIGINT/SIGTERM.
//! - [`bench`] — operator-facing benchmarks; `bench storage` measures G3 against `fio` on the
//!   same device and suggests a `[tiers.g3]` section.
//! - [`logging`] — `tracing` set up from `[node]` (text or JSON to stderr).
//! - [`metrics`] — every Prometheus metric name with typed recording functions, the `/metrics`
//!   exporter on `metrics.listen`, and the poller that publishes the tiers' gauges and counters.
//! - [`recording`] — recorded traffic: each answered request as a line of a trace `bench replay`
//!   reads back (`[recording]`).
//! - [`frontend`] — the OpenAI-compatible HTTP API (`/v1/chat/completions`, `/v1/completions`,
//!   `/v1/models`, `/health`) in front of a [`frontend::Generator`]: chat templates, regions,
//!   streaming, errors in the OpenAI shape.
//! - [`tokenizer`] — text ↔ token ids: a checkpoint's `tokenizer.json`, or the built-in o200k BPE
//!   for models with random weights.
//!
//! Binaries and tests use `anyhow` here; the library crates below keep typed errors.

pub mod bench;
pub mod checkpoint;
pub mod cli;
#[cfg(feature = "etcd")]
pub mod cluster;
pub mod frontend;
pub mod logging;
pub mod metrics;
pub mod node;
pub mod plan;
pub mod recording;
pub mod serving;
pub mod tokenizer;
