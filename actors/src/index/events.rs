//! KV events: every placement change of a block, as a source reports it to the prefix index.
//!
//! A *source* is one worker's G1 or one node's shared stores (G2/G3). Each source numbers its
//! events `1, 2, 3, …` within an *epoch*; a restarted source starts a new, larger epoch at 1.
//! The index detects duplicates, gaps and restarts from `(epoch, seq)` alone (DESIGN.md §6).
//!
//! On the wire an event is bincode 2 with the standard (varint) configuration; block hashes are
//! written as 16 raw little-endian bytes, so a `Stored` event of 32 hashes takes about 530 bytes.

use bincode::de::Decoder;
use bincode::enc::Encoder;
use bincode::error::{DecodeError, EncodeError};
use bincode::{Decode, Encode};
use dynamo_config::TierName;
use dynamo_tiering::block::BlockHash;

/// Who reports an event: one worker (its G1), or the node-shared stores of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Encode, Decode)]
pub struct SourceId {
    /// The node, unique in the cluster.
    pub node: u16,
    /// The worker within its node, or [`SourceId::NODE_STORE`].
    pub worker: u16,
}

impl SourceId {
    /// The `worker` value that names a node's shared stores (G2, G3) rather than one worker.
    pub const NODE_STORE: u16 = u16::MAX;

    /// Worker `worker` of node `node`.
    pub const fn worker(node: u16, worker: u16) -> Self {
        Self { node, worker }
    }

    /// The shared stores of node `node`.
    pub const fn node_store(node: u16) -> Self {
        Self { node, worker: Self::NODE_STORE }
    }

    /// Whether this source is a node's shared stores.
    pub const fn is_node_store(self) -> bool {
        self.worker == Self::NODE_STORE
    }

    /// The first `worker` value that names an external engine (a vLLM instance using the node's
    /// tiers through its engine endpoint) rather than one of the node's workers.
    pub const EXTERNAL_BASE: u16 = 0x8000;

    /// External engine `engine` of node `node` (its G1, as its own KV events report it).
    pub const fn external(node: u16, engine: u32) -> Self {
        let engine = if engine > (Self::NODE_STORE - Self::EXTERNAL_BASE - 1) as u32 {
            (Self::NODE_STORE - Self::EXTERNAL_BASE - 1) as u32
        } else {
            engine
        };
        Self { node, worker: Self::EXTERNAL_BASE + engine as u16 }
    }

    /// The external engine this source names, if it names one.
    pub const fn external_engine(self) -> Option<u32> {
        if self.worker >= Self::EXTERNAL_BASE && self.worker != Self::NODE_STORE {
            Some((self.worker - Self::EXTERNAL_BASE) as u32)
        } else {
            None
        }
    }
}

/// One placement change reported by a source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvent {
    /// The reporting source.
    pub source: SourceId,
    /// The source's incarnation; a restarted source reports a larger epoch and restarts `seq` at 1.
    pub epoch: u64,
    /// Per-source, per-epoch sequence number, starting at 1 and increasing by one per event.
    pub seq: u64,
    /// What changed.
    pub kind: KvEventKind,
}

/// What a [`KvEvent`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEventKind {
    /// `hashes` are now held in `tier`. They form one chain: the parent of `hashes[0]` is
    /// `parent` (`None` for the first block of a sequence) and the parent of `hashes[i]` is
    /// `hashes[i - 1]`.
    Stored {
        /// The blocks, in prefix order.
        hashes: Vec<BlockHash>,
        /// The parent of `hashes[0]`, `None` if it is the first block of its sequence.
        parent: Option<BlockHash>,
        /// Where they are now held.
        tier: TierName,
    },
    /// `hashes` are no longer held in `tier` (evicted or failed verification).
    Removed {
        /// The blocks, in any order.
        hashes: Vec<BlockHash>,
        /// Where they were held.
        tier: TierName,
    },
    /// Everything this source held is gone (a worker restarted with an empty G1, a store was wiped).
    Cleared,
}

impl KvEventKind {
    /// A stable name, usable as a metric label.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Stored { .. } => "stored",
            Self::Removed { .. } => "removed",
            Self::Cleared => "cleared",
        }
    }
}

/// Why bytes did not decode into a [`KvEvent`].
#[derive(Debug, thiserror::Error)]
#[error("malformed KV event: {0}")]
pub struct EventDecodeError(#[from] DecodeError);

impl KvEvent {
    /// The compact wire form (bincode 2, standard configuration).
    pub fn encode_to_vec(&self) -> Vec<u8> {
        // Encoding into a Vec cannot fail: every field has a fixed or length-prefixed form.
        bincode::encode_to_vec(self, bincode::config::standard()).expect("encoding a KV event into a Vec never fails")
    }

    /// Decodes one event from the front of `bytes`; returns it and the number of bytes it took.
    pub fn decode_from_slice(bytes: &[u8]) -> Result<(Self, usize), EventDecodeError> {
        Ok(bincode::decode_from_slice(bytes, bincode::config::standard())?)
    }
}

const TAG_STORED: u8 = 0;
const TAG_REMOVED: u8 = 1;
const TAG_CLEARED: u8 = 2;

fn encode_tier<E: Encoder>(tier: TierName, e: &mut E) -> Result<(), EncodeError> {
    let index = TierName::ALL.iter().position(|t| *t == tier).expect("every tier is in ALL");
    (index as u8).encode(e)
}

fn decode_tier<D: Decoder>(d: &mut D) -> Result<TierName, DecodeError> {
    let index = u8::decode(d)?;
    TierName::ALL.get(usize::from(index)).copied().ok_or(DecodeError::UnexpectedVariant {
        type_name: "TierName",
        allowed: &bincode::error::AllowedEnumVariants::Range { min: 0, max: 3 },
        found: u32::from(index),
    })
}

fn encode_hashes<E: Encoder>(hashes: &[BlockHash], e: &mut E) -> Result<(), EncodeError> {
    hashes.len().encode(e)?;
    hashes.iter().try_for_each(|h| h.to_le_bytes().encode(e))
}

fn decode_hashes<D: Decoder>(d: &mut D) -> Result<Vec<BlockHash>, DecodeError> {
    let len = usize::decode(d)?;
    // Cap the up-front allocation: a corrupt length must not allocate gigabytes before the
    // reader runs out of bytes.
    let mut hashes = Vec::with_capacity(len.min(4096));
    for _ in 0..len {
        hashes.push(BlockHash::from_le_bytes(<[u8; 16]>::decode(d)?));
    }
    Ok(hashes)
}

impl Encode for KvEvent {
    fn encode<E: Encoder>(&self, e: &mut E) -> Result<(), EncodeError> {
        self.source.encode(e)?;
        self.epoch.encode(e)?;
        self.seq.encode(e)?;
        match &self.kind {
            KvEventKind::Stored { hashes, parent, tier } => {
                TAG_STORED.encode(e)?;
                encode_tier(*tier, e)?;
                parent.map(BlockHash::to_le_bytes).encode(e)?;
                encode_hashes(hashes, e)
            }
            KvEventKind::Removed { hashes, tier } => {
                TAG_REMOVED.encode(e)?;
                encode_tier(*tier, e)?;
                encode_hashes(hashes, e)
            }
            KvEventKind::Cleared => TAG_CLEARED.encode(e),
        }
    }
}

impl<Context> Decode<Context> for KvEvent {
    fn decode<D: Decoder<Context = Context>>(d: &mut D) -> Result<Self, DecodeError> {
        let source = SourceId::decode(d)?;
        let epoch = u64::decode(d)?;
        let seq = u64::decode(d)?;
        let kind = match u8::decode(d)? {
            TAG_STORED => {
                let tier = decode_tier(d)?;
                let parent = Option::<[u8; 16]>::decode(d)?.map(BlockHash::from_le_bytes);
                KvEventKind::Stored { hashes: decode_hashes(d)?, parent, tier }
            }
            TAG_REMOVED => {
                let tier = decode_tier(d)?;
                KvEventKind::Removed { hashes: decode_hashes(d)?, tier }
            }
            TAG_CLEARED => KvEventKind::Cleared,
            found => {
                return Err(DecodeError::UnexpectedVariant {
                    type_name: "KvEventKind",
                    allowed: &bincode::error::AllowedEnumVariants::Range { min: 0, max: 2 },
                    found: u32::from(found),
                });
            }
        };
        Ok(Self { source, epoch, seq, kind })
    }
}

bincode::impl_borrow_decode!(KvEvent);

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(n: u128) -> Vec<BlockHash> {
        // Large, random-looking values: the worst case for a varint encoding.
        (0..n).map(|i| BlockHash((u128::MAX / 3).wrapping_mul(i + 1) ^ 0x5a5a)).collect()
    }

    #[test]
    fn every_kind_roundtrips() {
        let events = [
            KvEvent {
                source: SourceId::worker(3, 7),
                epoch: 2,
                seq: 1,
                kind: KvEventKind::Stored { hashes: hashes(5), parent: Some(BlockHash(42)), tier: TierName::G1 },
            },
            KvEvent {
                source: SourceId::node_store(3),
                epoch: u64::MAX,
                seq: 1 << 40,
                kind: KvEventKind::Stored { hashes: hashes(1), parent: None, tier: TierName::G3 },
            },
            KvEvent {
                source: SourceId::node_store(0),
                epoch: 1,
                seq: 9,
                kind: KvEventKind::Removed { hashes: hashes(3), tier: TierName::G2 },
            },
            KvEvent { source: SourceId::worker(0, 0), epoch: 1, seq: 2, kind: KvEventKind::Cleared },
        ];
        for event in events {
            let bytes = event.encode_to_vec();
            let (decoded, used) = KvEvent::decode_from_slice(&bytes).unwrap();
            assert_eq!(decoded, event);
            assert_eq!(used, bytes.len());
        }
    }

    #[test]
    fn a_stored_event_of_32_blocks_is_compact() {
        let event = KvEvent {
            source: SourceId::worker(1000, 63),
            epoch: 1_700_000_000,
            seq: 123_456_789,
            kind: KvEventKind::Stored { hashes: hashes(32), parent: Some(BlockHash(u128::MAX)), tier: TierName::G2 },
        };
        let len = event.encode_to_vec().len();
        // 32 × 16 hash bytes + 16 parent bytes + a few bytes of header.
        assert!(len < 560, "{len} bytes");
        assert!(len >= 32 * 16 + 16);
    }

    #[test]
    fn truncated_and_corrupt_bytes_are_errors() {
        let event = KvEvent {
            source: SourceId::worker(1, 2),
            epoch: 1,
            seq: 1,
            kind: KvEventKind::Removed { hashes: hashes(4), tier: TierName::G1 },
        };
        let bytes = event.encode_to_vec();
        for cut in 0..bytes.len() {
            assert!(KvEvent::decode_from_slice(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad_tag = bytes.clone();
        // Small varints take one byte each: node, worker, epoch, seq, then the kind tag.
        bad_tag[4] = 9;
        assert!(KvEvent::decode_from_slice(&bad_tag).is_err());
        let mut bad_tier = bytes;
        bad_tier[5] = 4;
        assert!(KvEvent::decode_from_slice(&bad_tier).is_err());
    }
}
