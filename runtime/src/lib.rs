//! # dynamo-node
//!
//! The node: the command line, configuration loading, logging, the tokio runtime, and the
//! assembly of the tiers (and, as later work lands, the actor tree, the HTTP frontend, the
//! Prometheus exporter, cluster membership and the trace-replay driver).
//!
//! - [`cli`] — `dynamo-node [serve]`, `config default|check`, `bench storage`; exit codes and error
//!   printing.
//! - [`node`] — resolves a [`dynamo_config::NodeConfig`] into concrete tiers (slot sizes, block
//!   counts, files), builds G2 and G3, rebuilds the G3 registry from what the store recovered,
//!   prints the resolved tiers, and runs until SIGINT/SIGTERM.
//! - [`bench`] — operator-facing benchmarks; `bench storage` measures G3 against `fio` on the
//!   same device and suggests a `[tiers.g3]` section.
//! - [`logging`] — `tracing` set up from `[node]` (text or JSON to stderr).
//! - [`metrics`] — every Prometheus metric name with typed recording functions, the `/metrics`
//!   exporter on `metrics.listen`, and the poller that publishes the tiers' gauges and counters.
//! - [`frontend`] — the OpenAI-compatible HTTP API (`/v1/chat/completions`, `/v1/completions`,
//!   `/v1/models`, `/health`) in front of a [`frontend::Generator`]: chat templates, regions,
//!   streaming, errors in the OpenAI shape.
//! - [`tokenizer`] — text ↔ token ids: a checkpoint's `tokenizer.json`, or the built-in o200k BPE
//!   for models with random weights.
//!
//! Binaries and tests use `anyhow` here; the library crates below keep typed errors.

pub mod bench;
pub mod cli;
pub mod frontend;
pub mod logging;
pub mod metrics;
pub mod node;
pub mod serving;
pub mod tokenizer;
