//! Operator-facing benchmarks, run from the `dynamo-node bench` subcommands.

pub mod replay;
pub mod storage;
