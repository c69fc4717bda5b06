//! Operator-facing benchmarks, run from the `dynamo-node bench` subcommands.

pub mod cached_ttft;
pub mod g4;
pub mod preempt;
pub mod replay;
pub mod serve;
pub mod storage;
