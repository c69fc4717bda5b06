//! # dynamo-node
//!
//! The node: the command line, configuration loading, logging, the tokio runtime, the assembly
//! of the tiers and the actor tree, the HTTP frontend, the Prometheus exporter, cluster
//! membership, recording, and the benchmarks (the trace-replay driver among them).
//!
//! - [`cli`] — `dynamo-node [serve]`, `config default|check`, `bench …`, `gpu-check`; exit codes
//!   and error printing.
//! - [`plan`] — resolves a [`dynamo_config::NodeConfig`] on this machine into what the node will
//!   run (slot sizes, block counts, files, where the engines run) and into the store plan the node
//!   builder ([`dynamo_actors::builder`]) opens.
//! - [`serving`] — the actor tree over the node's tiers, assembled by the node builder with the
//!   reference engines, and the frontend's [`frontend::Generator`] on top of it.
//! - [`node`] — starts a node (tiers, actor tree, HTTP frontend, outer ring) and stops it within
//!   its shutdown grace; `serve` runs one until SIGINT/SIGTERM.
//! - [`outer`] — the outer ring's stages (metrics poller, recorder, lease saver, G4's block server,
//!   peer links and membership, the engine endpoint), each with its restart policy.
//! - [`checkpoint`] — a `transformers` checkpoint directory: weights, tokenizer, chat template,
//!   generation config.
//! - `cluster` (feature `etcd`) — membership in etcd: nodes find each other's G4 addresses.
//! - [`bench`] — operator-facing benchmarks: `bench storage` (G3 against `fio`), `bench replay`
//!   (the actors over a trace in virtual time), `bench serve`, `bench g4`, cached TTFT and
//!   preemption.
//! - [`logging`] — `tracing` set up from `[node]` (text or JSON to stderr).
//! - [`metrics`] — the `/metrics` exporter on `metrics.listen`, and the poller that publishes the
//!   tiers' gauges and counters (names and labels in `dynamo_actors::telemetry`).
//! - [`recording`] — recorded traffic: each answered request as a line of a trace `bench replay`
//!   reads back (`[recording]`).
//! - [`frontend`] — the agent-facing HTTP APIs in front of a [`frontend::Generator`]: OpenAI Chat
//!   Completions, Completions and Responses, Anthropic Messages; chat templates, regions,
//!   reasoning and tool-call parsers, streaming, errors in each API's shape.
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
pub mod outer;
pub mod plan;
pub mod recording;
pub mod serving;
pub mod tokenizer;
pub mod vllm;
