//! Blocks of engines outside the node (a vLLM instance through its KV connector): how they are
//! named, and the frames of the engine endpoint's protocol, sans I/O.
//!
//! An external engine names its blocks with its own keys (vLLM: the block's hash, then its KV
//! group as 4 big-endian bytes) and describes its byte layout when it registers. The node derives
//! a [`Salt`] from that description and stores a block under [`ForeignEngine::block_hash`] of its
//! whole key, in a namespace of its own: a block of another model, dtype, layout, block size or
//! parallelism never matches, and a foreign block can never be confused with the node's own
//! (whose hashes are chained token hashes under the node's salt).
//!
//! vLLM's KV events carry only the low 64 bits of each block hash. The global prefix index keys
//! an engine's G1 by [`ForeignEngine::event_hash`] of those: good enough for routing (a collision
//! costs a misrouted request), never used to name stored bytes.
//!
//! The protocol is documented in `runtime/python/README.md`; this module is its one codec.

use xxhash_rust::xxh3::xxh3_128;

use crate::block::{BlockHash, Salt};
use crate::bytes::{ByteReader, ReadError};

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u16 = 1;
/// Largest frame body accepted, in bytes.
pub const MAX_FRAME: usize = 16 << 20;
/// Longest key accepted, in bytes.
pub const MAX_KEY: usize = 64;
/// Most keys one request may carry: its reply (5 bytes a key at most) stays far inside
/// [`MAX_FRAME`], and one request cannot hold a connection's thread for long.
pub const MAX_KEYS: usize = 1 << 16;

/// Who is registering: the engine's scheduler (lookups, stores, loads) or one of its workers
/// (which only maps the region and copies).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The scheduler-side manager.
    Manager,
    /// A worker process.
    Worker,
}

/// What an engine says about itself when it registers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// Protocol version the client speaks.
    pub version: u16,
    /// Manager or worker.
    pub role: Role,
    /// The engine's own id (vLLM's `engine_id`); names it in metrics and logs.
    pub engine_id: String,
    /// Model name.
    pub model: String,
    /// KV dtype.
    pub dtype: String,
    /// Whatever else fixes the byte layout of a block, as the engine describes it.
    pub layout: String,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Ranks that each hold a stripe of every block.
    pub world_size: u32,
    /// This process's rank (0 for the manager).
    pub rank: u32,
    /// Bytes of one block over all ranks.
    pub block_bytes: u64,
    /// The engine's KV event publisher (ZMQ), empty for none.
    pub kv_events: String,
    /// The retention region of the engine's blocks (`system`, `conversation`, …), empty for the
    /// node's `engine_endpoint.region`.
    pub region: String,
}

/// An engine's identity as the node uses it: its salt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ForeignEngine {
    /// Salt of every block the engine names.
    pub salt: Salt,
}

impl ForeignEngine {
    /// The identity of engines registering `r`'s description (the engine id, the rank, the event
    /// endpoint and the region do not matter: two instances of one model share blocks).
    pub fn of(r: &Registration) -> Self {
        let mut buf = Vec::with_capacity(64 + r.model.len() + r.dtype.len() + r.layout.len());
        buf.extend_from_slice(b"dynamo-node/foreign/1");
        for field in [&r.model, &r.dtype, &r.layout] {
            buf.extend_from_slice(&(field.len() as u64).to_le_bytes());
            buf.extend_from_slice(field.as_bytes());
        }
        buf.extend_from_slice(&r.block_tokens.to_le_bytes());
        buf.extend_from_slice(&r.world_size.to_le_bytes());
        buf.extend_from_slice(&r.block_bytes.to_le_bytes());
        Self { salt: Salt(xxh3_128(&buf)) }
    }

    /// The node's name for the block the engine calls `key`.
    pub fn block_hash(&self, key: &[u8]) -> BlockHash {
        let mut buf = Vec::with_capacity(24 + key.len());
        buf.extend_from_slice(b"key\0");
        buf.extend_from_slice(&self.salt.0.to_le_bytes());
        buf.extend_from_slice(key);
        BlockHash(xxh3_128(&buf))
    }

    /// The index's name for the block of KV group `group` whose hash has `low64` as its low 64
    /// bits (as the engine's KV events report it).
    pub fn event_hash(&self, group: u32, low64: u64) -> BlockHash {
        let mut buf = [0u8; 32];
        buf[..4].copy_from_slice(b"evt\0");
        buf[4..20].copy_from_slice(&self.salt.0.to_le_bytes());
        buf[20..24].copy_from_slice(&group.to_le_bytes());
        buf[24..].copy_from_slice(&low64.to_le_bytes());
        BlockHash(xxh3_128(&buf))
    }

    /// The event name of the block an engine stored under `key` (a vLLM `OffloadKey`: hash bytes,
    /// then the group as 4 big-endian bytes), so that stores and events agree.
    pub fn event_hash_of_key(&self, key: &[u8]) -> Option<BlockHash> {
        let (hash, group) = key.split_at_checked(key.len().checked_sub(4)?)?;
        let group = u32::from_be_bytes(group.try_into().ok()?);
        let low = hash.get(hash.len().checked_sub(8)?..)?;
        Some(self.event_hash(group, u64::from_be_bytes(low.try_into().ok()?)))
    }
}

/// What a lookup found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Found {
    /// Not held anywhere the engine can load from.
    Miss = 0,
    /// In G2, verified, pinned for the asker.
    Hit = 1,
    /// In G3, being read into G2: ask again.
    Pending = 2,
}

/// Where a prefix is held, as the global prefix index says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Located {
    /// 0 an external engine's G1, 1 the node's G2, 2 its G3, 3 a node worker's G1.
    pub kind: u8,
    /// The engine or worker index (0 for G2 and G3).
    pub id: u32,
    /// Leading blocks of the chain held there.
    pub blocks: u32,
}

/// A request from an engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Register (the first request of every connection).
    Register(Registration),
    /// Where are these blocks?
    Lookup(Vec<Vec<u8>>),
    /// Slots to write these blocks into.
    PrepareStore(Vec<Vec<u8>>),
    /// The writes of a prepared store are done (or failed).
    CompleteStore {
        /// Whether the engine wrote the payloads.
        success: bool,
        /// The blocks.
        keys: Vec<Vec<u8>>,
    },
    /// Pin these blocks and say where they are.
    PrepareLoad(Vec<Vec<u8>>),
    /// Unpin them.
    CompleteLoad(Vec<Vec<u8>>),
    /// What happened to this engine's blocks since the last call.
    TakeEvents,
    /// The index's view of a chain of event hashes `(group, low64)`.
    Locate(Vec<(u32, u64)>),
}

/// The node's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// Registered; the region's fd travels with this frame.
    Registered {
        /// Changes when the node restarts.
        region_id: u64,
        /// Bytes to map.
        region_bytes: u64,
        /// Slots in the region.
        slots: u32,
        /// Bytes per slot.
        slot_bytes: u64,
        /// Where a block's payload starts in its slot.
        payload_offset: u32,
        /// The engine's index on this node.
        engine: u32,
        /// Its salt.
        salt: Salt,
    },
    /// Per key, what a lookup found, and for a hit its (pinned) slot, else −1.
    Looked(Vec<(Found, i32)>),
    /// Per key: a slot to write, −1 already stored, −2 no room.
    StoreSlots(Vec<i32>),
    /// Blocks stored.
    Stored(u32),
    /// Per key: a slot to read, −1 not available.
    LoadSlots(Vec<i32>),
    /// Pins released.
    Released(u32),
    /// `(removed, key)` per event.
    Events(Vec<(bool, Vec<u8>)>),
    /// The index's view.
    Located(Vec<Located>),
    /// The request failed.
    Error {
        /// [`ErrorCode`].
        code: ErrorCode,
        /// What went wrong, for the engine's log.
        message: String,
    },
}

/// Why a request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum ErrorCode {
    /// The frame did not decode; the node closes the connection.
    Malformed = 1,
    /// The connection has not registered yet.
    NotRegistered = 2,
    /// The node will not do it (too large a block, too many engines, a second registration).
    Refused = 3,
    /// Another protocol version.
    Version = 4,
    /// The node failed.
    Internal = 5,
}

/// Why a frame did not decode.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed engine frame: {0}")]
pub struct WireError(pub String);

/// The engine endpoint's view of a [`ByteReader`]: every error names the field being read.
struct Reader<'a>(ByteReader<'a>);

/// `e`, met reading `what`, as this protocol's error.
fn malformed(what: &str, e: ReadError) -> WireError {
    WireError(match e {
        ReadError::Short { needed, left } => format!("{what}: needs {needed} bytes, {left} left"),
        ReadError::TooMany { n, max } => format!("{what}: {n} is more than {max}"),
        ReadError::NotUtf8 => format!("{what}: not UTF-8"),
        ReadError::Trailing(n) => format!("{n} trailing bytes"),
    })
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self(ByteReader::new(buf))
    }
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], WireError> {
        self.0.take(n).map_err(|e| malformed(what, e))
    }
    fn u8(&mut self, what: &str) -> Result<u8, WireError> {
        self.0.u8().map_err(|e| malformed(what, e))
    }
    fn u16(&mut self, what: &str) -> Result<u16, WireError> {
        self.0.u16().map_err(|e| malformed(what, e))
    }
    fn u32(&mut self, what: &str) -> Result<u32, WireError> {
        self.0.u32().map_err(|e| malformed(what, e))
    }
    fn u64(&mut self, what: &str) -> Result<u64, WireError> {
        self.0.u64().map_err(|e| malformed(what, e))
    }
    fn u128(&mut self, what: &str) -> Result<u128, WireError> {
        self.0.u128().map_err(|e| malformed(what, e))
    }
    fn str(&mut self, what: &str) -> Result<String, WireError> {
        self.0.str16(u16::MAX as usize).map_err(|e| malformed(what, e))
    }
    /// A count of items at least `each` bytes long, checked against what is left.
    fn count(&mut self, each: usize, what: &str) -> Result<usize, WireError> {
        self.0.count32(each, u64::MAX).map_err(|e| match e {
            ReadError::Short { needed, left } if needed > 0 => {
                WireError(format!("{what}: {} items cannot fit in {left} bytes", needed / each.max(1)))
            }
            e => malformed(what, e),
        })
    }
    fn key(&mut self) -> Result<Vec<u8>, WireError> {
        let n = self.u8("key length")? as usize;
        if n == 0 || n > MAX_KEY {
            return Err(WireError(format!("key length {n} is outside 1..={MAX_KEY}")));
        }
        Ok(self.take(n, "key")?.to_vec())
    }
    fn keys(&mut self) -> Result<Vec<Vec<u8>>, WireError> {
        let n = self.count(2, "keys")?;
        if n > MAX_KEYS {
            return Err(WireError(format!("{n} keys in one request; at most {MAX_KEYS} (split it)")));
        }
        (0..n).map(|_| self.key()).collect()
    }
    fn end(self) -> Result<(), WireError> {
        self.0.finish().map_err(|e| malformed("frame", e))
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let s = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s);
}

fn put_keys(out: &mut Vec<u8>, keys: &[Vec<u8>]) {
    out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for key in keys {
        out.push(key.len() as u8);
        out.extend_from_slice(key);
    }
}

/// Starts a frame of `op`: the length is patched by [`finish`].
fn start(op: u8) -> Vec<u8> {
    let mut out = vec![0; 4];
    out.push(op);
    out
}

fn finish(mut out: Vec<u8>) -> Vec<u8> {
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
    out
}

impl Request {
    /// Decodes a frame body (`op` and what follows, without the length).
    pub fn decode(body: &[u8]) -> Result<Request, WireError> {
        let (&op, rest) = body.split_first().ok_or_else(|| WireError("empty frame".into()))?;
        let mut r = Reader::new(rest);
        let request = match op {
            0x01 => {
                let version = r.u16("version")?;
                let role = match r.u8("role")? {
                    0 => Role::Manager,
                    1 => Role::Worker,
                    other => return Err(WireError(format!("role {other} is neither 0 (manager) nor 1 (worker)"))),
                };
                Request::Register(Registration {
                    version,
                    role,
                    engine_id: r.str("engine_id")?,
                    model: r.str("model")?,
                    dtype: r.str("dtype")?,
                    layout: r.str("layout")?,
                    block_tokens: r.u32("block_tokens")?,
                    world_size: r.u32("world_size")?,
                    rank: r.u32("rank")?,
                    block_bytes: r.u64("block_bytes")?,
                    kv_events: r.str("kv_events")?,
                    region: r.str("region")?,
                })
            }
            0x02 => Request::Lookup(r.keys()?),
            0x03 => Request::PrepareStore(r.keys()?),
            0x04 => {
                let success = r.u8("success")? != 0;
                Request::CompleteStore { success, keys: r.keys()? }
            }
            0x05 => Request::PrepareLoad(r.keys()?),
            0x06 => Request::CompleteLoad(r.keys()?),
            0x07 => Request::TakeEvents,
            0x08 => {
                let n = r.count(12, "chain")?;
                if n > MAX_KEYS {
                    return Err(WireError(format!("a chain of {n} blocks; at most {MAX_KEYS}")));
                }
                Request::Locate((0..n).map(|_| Ok((r.u32("group")?, r.u64("hash")?))).collect::<Result<_, _>>()?)
            }
            other => return Err(WireError(format!("unknown op 0x{other:02x}"))),
        };
        r.end()?;
        Ok(request)
    }

    /// The whole frame, length first (what a client sends).
    pub fn encode(&self) -> Vec<u8> {
        let out = match self {
            Request::Register(g) => {
                let mut out = start(0x01);
                out.extend_from_slice(&g.version.to_le_bytes());
                out.push(match g.role {
                    Role::Manager => 0,
                    Role::Worker => 1,
                });
                for s in [&g.engine_id, &g.model, &g.dtype, &g.layout] {
                    put_str(&mut out, s);
                }
                for v in [g.block_tokens, g.world_size, g.rank] {
                    out.extend_from_slice(&v.to_le_bytes());
                }
                out.extend_from_slice(&g.block_bytes.to_le_bytes());
                put_str(&mut out, &g.kv_events);
                put_str(&mut out, &g.region);
                out
            }
            Request::Lookup(keys) => with_keys(0x02, keys),
            Request::PrepareStore(keys) => with_keys(0x03, keys),
            Request::CompleteStore { success, keys } => {
                let mut out = start(0x04);
                out.push(u8::from(*success));
                put_keys(&mut out, keys);
                out
            }
            Request::PrepareLoad(keys) => with_keys(0x05, keys),
            Request::CompleteLoad(keys) => with_keys(0x06, keys),
            Request::TakeEvents => start(0x07),
            Request::Locate(chain) => {
                let mut out = start(0x08);
                out.extend_from_slice(&(chain.len() as u32).to_le_bytes());
                for (group, hash) in chain {
                    out.extend_from_slice(&group.to_le_bytes());
                    out.extend_from_slice(&hash.to_le_bytes());
                }
                out
            }
        };
        finish(out)
    }
}

fn with_keys(op: u8, keys: &[Vec<u8>]) -> Vec<u8> {
    let mut out = start(op);
    put_keys(&mut out, keys);
    out
}

impl Reply {
    /// The whole frame, length first (what the node sends).
    pub fn encode(&self) -> Vec<u8> {
        let out = match self {
            Reply::Registered { region_id, region_bytes, slots, slot_bytes, payload_offset, engine, salt } => {
                let mut out = start(0x81);
                out.extend_from_slice(&region_id.to_le_bytes());
                out.extend_from_slice(&region_bytes.to_le_bytes());
                out.extend_from_slice(&slots.to_le_bytes());
                out.extend_from_slice(&slot_bytes.to_le_bytes());
                out.extend_from_slice(&payload_offset.to_le_bytes());
                out.extend_from_slice(&engine.to_le_bytes());
                out.extend_from_slice(&salt.0.to_le_bytes());
                out
            }
            Reply::Looked(found) => {
                let mut out = start(0x82);
                out.extend_from_slice(&(found.len() as u32).to_le_bytes());
                for &(f, slot) in found {
                    out.push(f as u8);
                    out.extend_from_slice(&slot.to_le_bytes());
                }
                out
            }
            Reply::StoreSlots(slots) => with_slots(0x83, slots),
            Reply::Stored(n) => with_count(0x84, *n),
            Reply::LoadSlots(slots) => with_slots(0x85, slots),
            Reply::Released(n) => with_count(0x86, *n),
            Reply::Events(events) => {
                let mut out = start(0x87);
                out.extend_from_slice(&(events.len() as u32).to_le_bytes());
                for (removed, key) in events {
                    out.push(u8::from(*removed));
                    out.push(key.len() as u8);
                    out.extend_from_slice(key);
                }
                out
            }
            Reply::Located(found) => {
                let mut out = start(0x88);
                out.extend_from_slice(&(found.len() as u32).to_le_bytes());
                for l in found {
                    out.push(l.kind);
                    out.extend_from_slice(&l.id.to_le_bytes());
                    out.extend_from_slice(&l.blocks.to_le_bytes());
                }
                out
            }
            Reply::Error { code, message } => {
                let mut out = start(0xFF);
                out.extend_from_slice(&(*code as u16).to_le_bytes());
                put_str(&mut out, message);
                out
            }
        };
        finish(out)
    }

    /// Decodes a frame body (what a client receives).
    pub fn decode(body: &[u8]) -> Result<Reply, WireError> {
        let (&op, rest) = body.split_first().ok_or_else(|| WireError("empty frame".into()))?;
        let mut r = Reader::new(rest);
        let slots = |r: &mut Reader<'_>| -> Result<Vec<i32>, WireError> {
            let n = r.count(4, "slots")?;
            (0..n).map(|_| r.u32("slot").map(|v| v as i32)).collect()
        };
        let reply = match op {
            0x81 => Reply::Registered {
                region_id: r.u64("region_id")?,
                region_bytes: r.u64("region_bytes")?,
                slots: r.u32("slots")?,
                slot_bytes: r.u64("slot_bytes")?,
                payload_offset: r.u32("payload_offset")?,
                engine: r.u32("engine")?,
                salt: Salt(r.u128("salt")?),
            },
            0x82 => {
                let n = r.count(5, "found")?;
                Reply::Looked(
                    (0..n)
                        .map(|_| {
                            let found = match r.u8("found")? {
                                0 => Found::Miss,
                                1 => Found::Hit,
                                2 => Found::Pending,
                                other => return Err(WireError(format!("lookup answer {other}"))),
                            };
                            Ok((found, r.u32("slot")? as i32))
                        })
                        .collect::<Result<_, _>>()?,
                )
            }
            0x83 => Reply::StoreSlots(slots(&mut r)?),
            0x84 => Reply::Stored(r.u32("stored")?),
            0x85 => Reply::LoadSlots(slots(&mut r)?),
            0x86 => Reply::Released(r.u32("released")?),
            0x87 => {
                let n = r.count(3, "events")?;
                Reply::Events((0..n).map(|_| Ok((r.u8("kind")? != 0, r.key()?))).collect::<Result<_, WireError>>()?)
            }
            0x88 => {
                let n = r.count(9, "locations")?;
                Reply::Located(
                    (0..n)
                        .map(|_| Ok(Located { kind: r.u8("kind")?, id: r.u32("id")?, blocks: r.u32("blocks")? }))
                        .collect::<Result<_, WireError>>()?,
                )
            }
            0xFF => {
                let code = match r.u16("code")? {
                    1 => ErrorCode::Malformed,
                    2 => ErrorCode::NotRegistered,
                    3 => ErrorCode::Refused,
                    4 => ErrorCode::Version,
                    _ => ErrorCode::Internal,
                };
                Reply::Error { code, message: r.str("message")? }
            }
            other => return Err(WireError(format!("unknown reply op 0x{other:02x}"))),
        };
        r.end()?;
        Ok(reply)
    }
}

fn with_slots(op: u8, slots: &[i32]) -> Vec<u8> {
    let mut out = start(op);
    out.extend_from_slice(&(slots.len() as u32).to_le_bytes());
    for s in slots {
        out.extend_from_slice(&s.to_le_bytes());
    }
    out
}

fn with_count(op: u8, n: u32) -> Vec<u8> {
    let mut out = start(op);
    out.extend_from_slice(&n.to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registration() -> Registration {
        Registration {
            version: PROTOCOL_VERSION,
            role: Role::Manager,
            engine_id: "vllm-a".into(),
            model: "tiny".into(),
            dtype: "bfloat16".into(),
            layout: "direct;bpc=1".into(),
            block_tokens: 128,
            world_size: 1,
            rank: 0,
            block_bytes: 65536,
            kv_events: "tcp://127.0.0.1:5557".into(),
            region: String::new(),
        }
    }

    #[test]
    fn every_request_round_trips() {
        let key = |b: u8| vec![b; 36];
        for request in [
            Request::Register(registration()),
            Request::Lookup(vec![key(1), key(2)]),
            Request::PrepareStore(vec![key(3)]),
            Request::CompleteStore { success: true, keys: vec![key(4)] },
            Request::PrepareLoad(vec![]),
            Request::CompleteLoad(vec![key(5)]),
            Request::TakeEvents,
            Request::Locate(vec![(0, 7), (1, u64::MAX)]),
        ] {
            let frame = request.encode();
            assert_eq!(u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize, frame.len() - 4);
            assert_eq!(Request::decode(&frame[4..]).unwrap(), request);
        }
    }

    #[test]
    fn every_reply_round_trips() {
        for reply in [
            Reply::Registered {
                region_id: 9,
                region_bytes: 1 << 20,
                slots: 16,
                slot_bytes: 65536,
                payload_offset: 128,
                engine: 2,
                salt: Salt(77),
            },
            Reply::Looked(vec![(Found::Miss, -1), (Found::Hit, 7), (Found::Pending, -1)]),
            Reply::StoreSlots(vec![3, -1, -2]),
            Reply::Stored(2),
            Reply::LoadSlots(vec![-1, 5]),
            Reply::Released(1),
            Reply::Events(vec![(false, vec![1; 36]), (true, vec![2; 8])]),
            Reply::Located(vec![Located { kind: 0, id: 1, blocks: 4 }]),
            Reply::Error { code: ErrorCode::Refused, message: "too big".into() },
        ] {
            let frame = reply.encode();
            assert_eq!(Reply::decode(&frame[4..]).unwrap(), reply);
        }
    }

    #[test]
    fn malformed_frames_are_errors_not_panics() {
        let frame = Request::Lookup(vec![vec![1; 36]]).encode();
        for cut in 4..frame.len() {
            assert!(Request::decode(&frame[4..cut]).is_err(), "truncated at {cut}");
        }
        assert!(Request::decode(&[]).is_err());
        assert!(Request::decode(&[0x42]).is_err(), "unknown op");
        // A count that cannot fit is refused before anything is allocated.
        let mut huge = vec![0x02];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(Request::decode(&huge).unwrap_err().0.contains("cannot fit"));
        // Keys of length 0 or over the limit.
        assert!(Request::decode(&[0x02, 1, 0, 0, 0, 0]).is_err());
        let mut long = vec![0x02, 1, 0, 0, 0, 65];
        long.extend_from_slice(&[0; 65]);
        assert!(Request::decode(&long).is_err());
        let mut trailing = Request::TakeEvents.encode()[4..].to_vec();
        trailing.push(0);
        assert!(Request::decode(&trailing).is_err(), "trailing bytes");
    }

    #[test]
    fn identity_depends_on_the_layout_not_on_the_instance() {
        let a = ForeignEngine::of(&registration());
        let b = ForeignEngine::of(&Registration {
            engine_id: "vllm-b".into(),
            rank: 0,
            role: Role::Worker,
            kv_events: String::new(),
            ..registration()
        });
        assert_eq!(a, b, "another instance of the same model and layout shares blocks");
        for other in [
            Registration { model: "other".into(), ..registration() },
            Registration { dtype: "float16".into(), ..registration() },
            Registration { layout: "canonical".into(), ..registration() },
            Registration { block_tokens: 64, ..registration() },
            Registration { world_size: 2, ..registration() },
            Registration { block_bytes: 131072, ..registration() },
        ] {
            assert_ne!(ForeignEngine::of(&other), a, "{other:?}");
        }
        let key = [7u8; 36];
        assert_ne!(
            a.block_hash(&key),
            ForeignEngine::of(&Registration { world_size: 2, ..registration() }).block_hash(&key)
        );
        assert_ne!(a.block_hash(&key), a.block_hash(&[8u8; 36]));
    }

    #[test]
    fn a_stored_key_and_its_kv_event_name_the_same_block_in_the_index() {
        let engine = ForeignEngine::of(&registration());
        let mut key = vec![0u8; 32];
        key[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        key.extend_from_slice(&3u32.to_be_bytes());
        assert_eq!(engine.event_hash_of_key(&key), Some(engine.event_hash(3, 0x0102_0304_0506_0708)));
        assert_eq!(engine.event_hash_of_key(&[1, 2, 3]), None, "too short to hold a group and a hash");
    }
}
