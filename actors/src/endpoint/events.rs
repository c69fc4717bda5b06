//! Following an engine's own KV events (vLLM's ZMQ publisher) into the global prefix index, so
//! that the index knows what every engine holds in its G1 as well as what the node holds.
//!
//! The events themselves are read by [`crate::vllm_events`].
//!
//! Only G1 (`medium` "GPU", or none) is followed: what the engine offloads to the node, the node
//! reports itself. Each engine is one index source with an epoch per subscription; a gap in the
//! publisher's sequence numbers clears the engine's G1 from the index (it comes back as the engine
//! stores blocks again) rather than leave the index wrong.

use std::sync::Arc;

use dynamo_config::TierName;
use dynamo_tiering::foreign::ForeignEngine;

use crate::index::{KvEvent, KvEventKind, Location, PrefixIndex, SourceId};
use crate::telemetry;
use crate::vllm_events::{self, RawEvent, Update};

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
pub(super) async fn follow(f: Follow) {
    let epoch = crate::worker::unix_millis().max(1);
    let mut seq = 0u64;
    let mut apply = |f: &Follow, kind: KvEventKind| {
        seq += 1;
        let label = kind.as_str();
        f.index.apply(&KvEvent { source: f.source, epoch, seq, kind });
        telemetry::record_engine_kv_events(&f.engine, label, 1);
    };
    let (endpoint, id, mut stop) = (f.endpoint.clone(), f.id.clone(), f.stop.clone());
    vllm_events::follow(&endpoint, &id, &mut stop, |update| {
        match update {
            Update::Events(events) => {
                for kind in events.into_iter().map(|e| to_index(e, &f.identity)) {
                    apply(&f, kind);
                }
            }
            Update::Gap => {
                // The engine's G1 leaves the index until it stores blocks again, rather than
                // leave the index wrong.
                telemetry::record_engine_kv_events(&f.engine, "gap", 1);
                apply(&f, KvEventKind::Cleared);
            }
            Update::Malformed(why) => {
                tracing::debug!(engine = %f.id, why, "KV events: a batch did not decode");
                telemetry::record_engine_kv_events(&f.engine, "malformed", 1);
            }
        }
        let held = f.index.held_count(Location { source: f.source, tier: TierName::G1, approximate: false });
        telemetry::set_engine_g1_blocks(&f.engine, held);
    })
    .await;
    apply(&f, KvEventKind::Cleared);
    telemetry::set_engine_g1_blocks(&f.engine, 0);
}

/// An event of the engine's G1 under the engine's own names.
fn to_index(event: RawEvent, identity: &ForeignEngine) -> KvEventKind {
    match event {
        RawEvent::Stored { hashes, parent, group, .. } => KvEventKind::Stored {
            hashes: hashes.into_iter().map(|low| identity.event_hash(group, low)).collect(),
            parent: parent.map(|low| identity.event_hash(group, low)),
            tier: TierName::G1,
        },
        RawEvent::Removed { hashes, group } => KvEventKind::Removed {
            hashes: hashes.into_iter().map(|low| identity.event_hash(group, low)).collect(),
            tier: TierName::G1,
        },
        RawEvent::Cleared => KvEventKind::Cleared,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vllm_events::tests::{encode, map};
    use dynamo_tiering::block::Salt;
    use rmpv::Value;

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
                    ("medium", "GPU".into()),
                ]),
                map(vec![("type", "BlockRemoved".into()), ("block_hashes", Value::Array(vec![Value::from(11u64)]))]),
                map(vec![("type", "AllBlocksCleared".into())]),
            ]),
        ]);
        let kinds: Vec<KvEventKind> =
            vllm_events::decode(&encode(&batch)).unwrap().into_iter().map(|e| to_index(e, &identity)).collect();
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
}
