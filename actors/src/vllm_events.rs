//! vLLM's KV events, as both of the node's users of them read them: the engine endpoint (engines
//! that use the node as their KV tier) and the workers in front of vLLM engines.
//!
//! vLLM publishes multipart messages `[topic, seq (8 bytes, big-endian), msgpack(EventBatch)]`;
//! a batch is the array `[ts, events, data_parallel_rank?]` and each event a map tagged by
//! `"type"`: `BlockStored {block_hashes, parent_block_hash, token_ids, block_size, extra_keys,
//! medium, group_idx, …}`, `BlockRemoved {block_hashes, medium, group_idx, …}` or
//! `AllBlocksCleared`. Hashes are the low 64 bits of vLLM's block hash (an integer), or its bytes
//! when integer hashes are off. `seq` restarts at 0 with the publisher's process.
//!
//! Only G1 (`medium` "GPU", or none) is read: what the engine offloads to the node, the node
//! reports itself. [`follow`] keeps one subscription alive and hands each batch, or a gap in the
//! sequence numbers, to its caller.

use std::time::Duration;

use rmpv::Value;
use zeromq::{Socket, SocketRecv, SubSocket};

/// One G1 event of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RawEvent {
    /// Blocks now in the engine's G1, in prefix order.
    Stored {
        /// The low 64 bits of each block's hash.
        hashes: Vec<u64>,
        /// The block before the first one (`None`: the first is a sequence's first block).
        parent: Option<u64>,
        /// Every block's tokens, one block after another (empty when the engine sent none).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: usize,
        /// The first block's `cache_salt`, when it had one.
        cache_salt: Option<String>,
        /// The KV cache group.
        group: u32,
    },
    /// Blocks no longer in the engine's G1.
    Removed {
        /// The low 64 bits of each block's hash.
        hashes: Vec<u64>,
        /// The KV cache group.
        group: u32,
    },
    /// Everything left the engine's G1.
    Cleared,
}

/// What [`follow`] hands on.
#[derive(Debug)]
pub enum Update {
    /// A batch's G1 events, in order.
    Events(Vec<RawEvent>),
    /// Batches were lost (a gap in the sequence, or the publisher restarted): what was known of
    /// the engine's G1 is stale.
    Gap,
    /// A message that did not decode (counted, skipped).
    Malformed(&'static str),
}

/// Follows the publisher at `endpoint` until `stop` becomes true, handing every update to `on`;
/// reconnects (after a second) when it cannot connect or the subscription fails.
pub async fn follow(
    endpoint: &str,
    id: &str,
    stop: &mut tokio::sync::watch::Receiver<bool>,
    mut on: impl FnMut(Update),
) {
    'connect: loop {
        if *stop.borrow() {
            return;
        }
        let mut socket = SubSocket::new();
        let connected = tokio::select! {
            _ = stop.changed() => return,
            c = socket.connect(endpoint) => c,
        };
        if let Err(e) = connected.map(|_| ()) {
            tracing::debug!(engine = %id, endpoint, error = %e, "KV events: cannot connect yet");
            tokio::select! {
                _ = stop.changed() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => continue 'connect,
            }
        }
        if let Err(e) = socket.subscribe("").await {
            tracing::warn!(engine = %id, error = %e, "KV events: cannot subscribe");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue 'connect;
        }
        tracing::info!(engine = %id, endpoint, "following the engine's KV events");
        let mut last: Option<u64> = None;
        loop {
            let message = tokio::select! {
                _ = stop.changed() => return,
                m = socket.recv() => m,
            };
            let message = match message {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(engine = %id, error = %e, "KV events: the subscription failed; reconnecting");
                    // What came between the two subscriptions is lost.
                    on(Update::Gap);
                    continue 'connect;
                }
            };
            let frames = message.into_vec();
            let [_, seq_bytes, payload] = frames.as_slice() else {
                on(Update::Malformed("not three frames"));
                continue;
            };
            let Ok(seq) = <[u8; 8]>::try_from(seq_bytes.as_ref()).map(u64::from_be_bytes) else {
                on(Update::Malformed("a sequence number that is not 8 bytes"));
                continue;
            };
            if last.is_some_and(|l| seq != l.wrapping_add(1)) {
                tracing::warn!(engine = %id, after = ?last, got = seq, "KV events: a gap");
                on(Update::Gap);
            }
            last = Some(seq);
            match decode(payload) {
                Ok(events) => on(Update::Events(events)),
                Err(why) => on(Update::Malformed(why)),
            }
        }
    }
}

/// The G1 events of one msgpack `EventBatch`.
pub fn decode(payload: &[u8]) -> Result<Vec<RawEvent>, &'static str> {
    let batch = rmpv::decode::read_value(&mut &payload[..]).map_err(|_| "not msgpack")?;
    let Value::Array(fields) = batch else { return Err("a batch is not an array") };
    let Some(Value::Array(events)) = fields.get(1) else { return Err("a batch has no event list") };
    let mut out = Vec::with_capacity(events.len());
    for event in events {
        let Value::Map(entries) = event else { return Err("an event is not a map") };
        let field = |name: &str| entries.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v);
        let group = field("group_idx").and_then(Value::as_u64).unwrap_or(0) as u32;
        let on_g1 = field("medium").is_none_or(|m| m.is_nil() || m.as_str() == Some("GPU"));
        let hashes = |v: Option<&Value>| -> Result<Vec<u64>, &'static str> {
            let Some(Value::Array(items)) = v else { return Err("block_hashes is not an array") };
            items.iter().map(|h| low64(h).ok_or("a block hash is not an integer or bytes")).collect()
        };
        match field("type").and_then(Value::as_str) {
            Some("BlockStored") if on_g1 => {
                let token_ids = match field("token_ids") {
                    Some(Value::Array(ids)) => ids
                        .iter()
                        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or("a token id is not one"))
                        .collect::<Result<_, _>>()?,
                    _ => Vec::new(),
                };
                // `extra_keys` has one entry per block; the first block's carries the salt.
                let cache_salt = match field("extra_keys") {
                    Some(Value::Array(keys)) => match keys.first() {
                        Some(Value::Array(first)) => first.iter().find_map(|k| k.as_str().map(str::to_owned)),
                        _ => None,
                    },
                    _ => None,
                };
                out.push(RawEvent::Stored {
                    hashes: hashes(field("block_hashes"))?,
                    parent: field("parent_block_hash").and_then(low64),
                    token_ids,
                    block_size: field("block_size").and_then(Value::as_u64).unwrap_or(0) as usize,
                    cache_salt,
                    group,
                });
            }
            Some("BlockRemoved") if on_g1 => {
                out.push(RawEvent::Removed { hashes: hashes(field("block_hashes"))?, group })
            }
            Some("AllBlocksCleared") => out.push(RawEvent::Cleared),
            // Offloaded copies (the node reports its own), and event kinds this build does not know.
            Some(_) => {}
            None => return Err("an event has no type"),
        }
    }
    Ok(out)
}

/// The low 64 bits of a block hash as vLLM publishes it: an integer, or big-endian bytes.
fn low64(value: &Value) -> Option<u64> {
    match value {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|v| v as u64)),
        Value::Binary(bytes) if bytes.len() >= 8 => {
            Some(u64::from_be_bytes(bytes[bytes.len() - 8..].try_into().expect("8 bytes")))
        }
        _ => None,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn map(entries: Vec<(&str, Value)>) -> Value {
        Value::Map(entries.into_iter().map(|(k, v)| (Value::from(k), v)).collect())
    }

    pub(crate) fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    #[test]
    fn a_batch_gives_its_g1_events_with_tokens_and_the_first_blocks_salt() {
        let ids = |v: &[u64]| Value::Array(v.iter().map(|&i| Value::from(i)).collect());
        let batch = Value::Array(vec![
            Value::F64(1.5),
            Value::Array(vec![
                map(vec![
                    ("type", "BlockStored".into()),
                    ("block_hashes", ids(&[11, u64::MAX])),
                    ("parent_block_hash", Value::Nil),
                    ("token_ids", ids(&[1, 2, 3, 4])),
                    ("block_size", 2.into()),
                    ("extra_keys", Value::Array(vec![Value::Array(vec!["salty".into()]), Value::Nil])),
                    ("medium", "GPU".into()),
                    ("group_idx", 0.into()),
                ]),
                map(vec![
                    ("type", "BlockStored".into()),
                    ("block_hashes", ids(&[12])),
                    ("parent_block_hash", Value::from(11u64)),
                    ("medium", "CPU".into()),
                ]),
                map(vec![
                    ("type", "BlockRemoved".into()),
                    ("block_hashes", Value::Array(vec![Value::Binary(vec![0, 0, 0, 0, 0, 0, 0, 0, 0, 11])])),
                    ("medium", "GPU".into()),
                ]),
                map(vec![("type", "AllBlocksCleared".into())]),
            ]),
        ]);
        assert_eq!(
            decode(&encode(&batch)).unwrap(),
            vec![
                RawEvent::Stored {
                    hashes: vec![11, u64::MAX],
                    parent: None,
                    token_ids: vec![1, 2, 3, 4],
                    block_size: 2,
                    cache_salt: Some("salty".into()),
                    group: 0,
                },
                RawEvent::Removed { hashes: vec![11], group: 0 },
                RawEvent::Cleared,
            ],
            "the offloaded (CPU) copy is left out"
        );
    }

    #[test]
    fn malformed_batches_are_errors() {
        assert!(decode(b"\xc1").is_err(), "not msgpack");
        assert!(decode(&encode(&Value::from(3))).is_err());
        let no_type =
            Value::Array(vec![Value::F64(0.0), Value::Array(vec![map(vec![("block_hashes", Value::Array(vec![]))])])]);
        assert!(decode(&encode(&no_type)).is_err());
        let bad_hash = Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![map(vec![
                ("type", "BlockStored".into()),
                ("block_hashes", Value::Array(vec!["x".into()])),
            ])]),
        ]);
        assert!(decode(&encode(&bad_hash)).is_err());
    }
}
