//! # dynamo-tests
//!
//! Integration, end-to-end and fault-injection tests of dynamo-node. Each file under `tests/` is
//! named `<area>_<topic>.rs` and exercises the public API of one or more crates as a user of them
//! would: real files with real io_uring, the real `dynamo-node` binary for the CLI, fault-injecting
//! engines for failures. Shared helpers live here.

use std::path::PathBuf;

/// Where the `dynamo-node` binary of this build is.
pub fn node_binary() -> PathBuf {
    let mut dir = std::env::current_exe().expect("test executable path");
    dir.pop();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join("dynamo-node")
}
