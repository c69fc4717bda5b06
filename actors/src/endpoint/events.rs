//! Following an engine's own KV events (vLLM's ZMQ publisher) into the global prefix index, so
//! that the index knows what every engine holds in its G1 as well as what the node holds.
//!
//! vLLM publishes multipart messages `[topic, seq (8 bytes, big-endian), msgpack(EventBatch)]`;
//! a batch is the array `[ts, events, data_parallel_rank?]` and each event a map tagged by
//! `"type"`: `BlockStored {block_hashes, parent_block_hash, medium, group_idx, …}`,
//! `BlockRemoved {block_hashes, medium, group_idx, …}` or `AllBlocksCleared`. Hashes are the
//! low 64 bits of vLLM's block hash (an integer), or its bytes when integer hashes are off.
//!
//! Only G1 (`medium` "GPU", or none) is followed: what the engine offloads to the node, the node
//! reports itself. Each engine is one index source with an epoch per subscription; a gap in the
//! publisher's sequence numbers clears the engine's G1 from the index (it comes back as the engine
//! stores blocks again) rather than leave the index wrong.

use std::sync::Arc;
use std::time::Duration;

use dynamo_config::TierName;
use dynamo_tiering::block::BlockHash;
use dynamo_tiering::foreign::ForeignEngine;
use rmpv::Value;
use zeromq::{Socket, SocketRecv, SubSocket};

use crate::index::{KvEvent, KvEventKind, Location, PrefixIndex, SourceId};
use crate::telemetry;

/// One engine's event stream, and where it goes.
pub(super) struct Follow {
    /// The publisher, e.g. `tcp://127.0.0.1:5557`.
    pub endpoint: String,
    /// The engine's metric label (its index).
    pub engine: String,
    /// The engine's id, for logs.
    pub id: String,
    /// Its identity (names its blocks in the index).
    pub identity: ForeignEngine,
    /// Its source in the index.
    pub source: SourceId,
    /// The index.
    pub index: Arc<PrefixIndex>,
    /// Becomes true when the engine's last connection closed.
    pub stop: tokio::sync::watch::Receiver<bool>,
}

/// Follows `f` until it is stopped; then the engine's G1 leaves the index.
pub(super) async fn follow(mut f: Follow) {
    let epoch = crate::worker::unix_millis().max(1);
    let mut seq = 0u64;
    let mut apply = |f: &Follow, kind: KvEventKind| {
        seq += 1;
        let label = kind.as_str();
        f.index.apply(&KvEvent { source: f.source, epoch, seq, kind });
        telemetry::record_engine_kv_events(&f.engine, label, 1);
    };
    'connect: loop {
        let mut socket = SubSocket::new();
        let connected = tokio::select! {
            _ = f.stop.changed() => break 'connect,
            c = socket.connect(&f.endpoint) => c,
        };
        if let Err(e) = connected.map(|_| ()) {
            tracing::debug!(engine = %f.id, endpoint = %f.endpoint, error = %e, "KV events: cannot connect yet");
            tokio::select! {
                _ = f.stop.changed() => break 'connect,
                _ = tokio::time::sleep(Duration::from_secs(1)) => continue 'connect,
            }
        }
        if let Err(e) = socket.subscribe("").await {
            tracing::warn!(engine = %f.id, error = %e, "KV events: cannot subscribe");
            continue 'connect;
        }
        tracing::info!(engine = %f.id, endpoint = %f.endpoint, "following the engine's KV events");
        let mut last: Option<u64> = None;
        loop {
            let message = tokio::select! {
                _ = f.stop.changed() => break 'connect,
                m = socket.recv() => m,
            };
            let message = match message {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(engine = %f.id, error = %e, "KV events: the subscription failed; reconnecting");
                    continue 'connect;
                }
            };
            let frames = message.into_vec();
            let [_, seq_bytes, payload] = frames.as_slice() else {
                telemetry::record_engine_kv_events(&f.engine, "malformed", 1);
                continue;
            };
            let Ok(remote) = <[u8; 8]>::try_from(seq_bytes.as_ref()).map(u64::from_be_bytes) else {
                telemetry::record_engine_kv_events(&f.engine, "malformed", 1);
                continue;
            };
            if last.is_some_and(|l| remote != l.wrapping_add(1)) {
                tracing::warn!(engine = %f.id, after = ?last, got = remote, "KV events: a gap; the engine's G1 leaves the index");
                telemetry::record_engine_kv_events(&f.engine, "gap", 1);
                apply(&f, KvEventKind::Cleared);
            }
            last = Some(remote);
            match decode_batch(payload, &f.identity) {
                Ok(kinds) => {
                    for kind in kinds {
                        apply(&f, kind);
                    }
                }
                Err(why) => {
                    tracing::debug!(engine = %f.id, why, "KV events: a batch did not decode");
                    telemetry::record_engine_kv_events(&f.engine, "malformed", 1);
                }
            }
            let held = f.index.held_count(Location { source: f.source, tier: TierName::G1, approximate: false });
            telemetry::set_engine_g1_blocks(&f.engine, held);
        }
    }
    apply(&f, KvEventKind::Cleared);
    telemetry::set_engine_g1_blocks(&f.engine, 0);
}

/// The index events of one msgpack `EventBatch`, G1 only.
pub(super) fn decode_batch(payload: &[u8], identity: &ForeignEngine) -> Result<Vec<KvEventKind>, &'static str> {
    let batch = rmpv::decode::read_value(&mut &payload[..]).map_err(|_| "not msgpack")?;
    let Value::Array(fields) = batch else { return Err("a batch is not an array") };
    let Some(Value::Array(events)) = fields.get(1) else { return Err("a batch has no event list") };
    let mut out = Vec::with_capacity(events.len());
    for event in events {
        let Value::Map(entries) = event else { return Err("an event is not a map") };
        let field = |name: &str| entries.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v);
        let group = field("group_idx").and_then(Value::as_u64).unwrap_or(0) as u32;
        let on_g1 = field("medium").is_none_or(|m| m.is_nil() || m.as_str() == Some("GPU"));
        let hashes = |v: Option<&Value>| -> Result<Vec<BlockHash>, &'static str> {
            let Some(Value::Array(items)) = v else { return Err("block_hashes is not an array") };
            items
                .iter()
                .map(|h| {
                    low64(h).map(|low| identity.event_hash(group, low)).ok_or("a block hash is not an integer or bytes")
                })
                .collect()
        };
        match field("type").and_then(Value::as_str) {
            Some("BlockStored") if on_g1 => {
                let parent = field("parent_block_hash").and_then(low64).map(|low| identity.event_hash(group, low));
                out.push(KvEventKind::Stored { hashes: hashes(field("block_hashes"))?, parent, tier: TierName::G1 });
            }
            Some("BlockRemoved") if on_g1 => {
                out.push(KvEventKind::Removed { hashes: hashes(field("block_hashes"))?, tier: TierName::G1 });
            }
            Some("AllBlocksCleared") => out.push(KvEventKind::Cleared),
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
mod tests {
    use super::*;
    use dynamo_tiering::block::Salt;

    fn map(entries: Vec<(&str, Value)>) -> Value {
        Value::Map(entries.into_iter().map(|(k, v)| (Value::from(k), v)).collect())
    }

    fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    #[test]
    fn a_vllm_batch_becomes_g1_events_under_the_engines_names() {
        let identity = ForeignEngine { salt: Salt(5) };
        let batch = Value::Array(vec![
            Value::F64(1.5),
            Value::Array(vec![
                map(vec![
                    ("type", "BlockStored".into()),
                    ("block_hashes", Value::Array(vec![Value::from(11u64), Value::from(u64::MAX)])),
                    ("parent_block_hash", Value::Nil),
                    ("token_ids", Value::Array(vec![])),
                    ("block_size", 128.into()),
                    ("medium", "GPU".into()),
                    ("group_idx", 0.into()),
                ]),
                // What the node stores reports itself: the connector's CPU events are skipped.
                map(vec![
                    ("type", "BlockStored".into()),
                    ("block_hashes", Value::Array(vec![Value::from(12u64)])),
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
        let kinds = decode_batch(&encode(&batch), &identity).unwrap();
        let h = |low| identity.event_hash(0, low);
        assert_eq!(
            kinds,
            vec![
                KvEventKind::Stored { hashes: vec![h(11), h(u64::MAX)], parent: None, tier: TierName::G1 },
                KvEventKind::Removed { hashes: vec![h(11)], tier: TierName::G1 },
                KvEventKind::Cleared,
            ]
        );
    }

    #[test]
    fn malformed_batches_are_errors() {
        let identity = ForeignEngine { salt: Salt(5) };
        assert!(decode_batch(b"\xc1", &identity).is_err(), "not msgpack");
        assert!(decode_batch(&encode(&Value::from(3)), &identity).is_err());
        let no_type =
            Value::Array(vec![Value::F64(0.0), Value::Array(vec![map(vec![("block_hashes", Value::Array(vec![]))])])]);
        assert!(decode_batch(&encode(&no_type), &identity).is_err());
        let bad_hash = Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![map(vec![
                ("type", "BlockStored".into()),
                ("block_hashes", Value::Array(vec!["x".into()])),
            ])]),
        ]);
        assert!(decode_batch(&encode(&bad_hash), &identity).is_err());
    }
}
