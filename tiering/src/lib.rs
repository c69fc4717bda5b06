//! # dynamo-tiering
//!
//! Everything about KV blocks below the engine, with no actors and no clocks of its own:
//!
//! - [`block`] — what a block is: the salted, chained 128-bit [`block::BlockHash`] that names a
//!   block and its whole prefix, and the self-describing *block image* (header + payload, both
//!   checksummed) that G2, G3 and the wire carry.
//! - [`bytes`] — the one bounds-checked reader of wire fields that both codecs decode with.
//! - [`foreign`] — blocks of external engines (vLLM): their names under a salt of their own, and
//!   the frames of the engine endpoint's protocol.
//! - [`g2`] — the node's host-memory tier: one page-aligned, `mlock`ed mapping carved into
//!   image slots, a lock-free slot allocator, and typed slot handles (exclusive [`g2::SlotMut`] →
//!   shared, refcounted [`g2::SlotRef`]).
//! - [`io`] — the [`io::IoEngine`] trait and its engines: io_uring with registered buffers (the hot
//!   path), portable `pread`/`pwrite`, a fault-injecting wrapper, and a simulated disk.
//! - [`g3`] — the NVMe tier: `O_DIRECT` files or devices in fixed 4 KiB-aligned slots, every read
//!   verified, headers rebuilt into an index by a tokio-uring scan on restart.
//! - [`g4`] — the block-serving protocol between nodes: frames, the peers' mutual authentication,
//!   and the serving side's expiring holds (sans I/O), and the TCP, TLS and RDMA transports that
//!   carry them.
//! - [`registry`] — per-tier bookkeeping: residency, refcounts, holds, leaf-first eviction under a
//!   priority-aware LRU or aged-LFU policy, checked by property tests against a reference model.
//! - [`transfer`] — simulated copy links: the time block images take to cross the host link in
//!   the simulated engine.
//!
//! Layering: this crate depends on `dynamo-config` and `dynamo-kernels` only. Stores decide
//! nothing about which blocks to keep — that is the registry's job — and nothing here spawns a task
//! on a runtime it does not own: blocking and ring-driven work runs on dedicated threads that the
//! engines start and join.
//!
//! Time-dependent parts (the simulated engines, latency injection) use tokio's clock, so they run
//! in virtual time under `tokio::time::pause`.

pub mod block;
pub mod bytes;
pub mod cost;
pub mod foreign;
pub mod g2;
pub mod g3;
pub mod g4;
pub mod io;
pub mod pipeline;
pub mod registry;
pub mod transfer;

#[cfg(any(test, feature = "test-utils"))]
pub mod test_utils;
