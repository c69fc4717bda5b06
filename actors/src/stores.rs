//! The tier store actors: the node's G2 and G3 stores.
//!
//! Their I/O runs on the stores' own threads (the io_uring rings of G3); these actors own what
//! needs a single mind over time:
//! - **Background reclaim between the watermarks**: when a tier's occupancy passes its
//!   `high_watermark`, it evicts by policy down to `low_watermark`, so the hot path (a worker
//!   needing a slot) rarely has to evict inline.
//! - **G3 health**: workers report every G3 I/O outcome in [`G3Health`]; a run of disk failures
//!   (I/O errors or a full device) degrades the node to G1+G2 (reads and writes skip G3, with a
//!   log line and `dynamo_node_tier_degraded{tier="g3"} 1`). While degraded, the actor probes
//!   the disk with a real sealed write and verified read; when the probe passes, G3 is back.
//!
//! [`G3Health`]: crate::tiers::G3Health

use std::sync::Arc;
use std::time::Duration;

use dynamo_config::RegionKind;
use dynamo_tiering::block::{BlockHash, ImageSpec, RetentionMeta, seal};
use dynamo_tiering::g3::G3Error;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::telemetry;
use crate::tiers::NodeTiers;
use crate::worker::unix_millis;
use dynamo_config::TierName;

/// Occupancy bounds of a tier, as fractions of its capacity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Watermarks {
    /// Reclaim starts above this.
    pub high: f64,
    /// Reclaim stops at this.
    pub low: f64,
}

impl Watermarks {
    fn reclaim_target(&self, len: usize, capacity: usize) -> Option<usize> {
        let high = (capacity as f64 * self.high).floor() as usize;
        (len > high).then(|| (capacity as f64 * self.low).floor() as usize)
    }
}

/// What a store actor starts from.
#[derive(Clone, Debug)]
pub struct StoreArgs {
    /// The node's tiers.
    pub tiers: Arc<NodeTiers>,
    /// Reclaim bounds.
    pub watermarks: Watermarks,
    /// How often it checks occupancy (and, for G3, health).
    pub period: Duration,
    /// G3 only: disk failures in a row that degrade the node.
    pub failures_to_degrade: u32,
}

/// Messages of both store actors.
#[derive(Debug)]
pub enum StoreMsg {
    /// No reply: the periodic check (sent by the actor's own timer).
    Tick,
    /// Reply: the store's status. Always answered.
    Status(RpcReplyPort<StoreStatus>),
}

/// What [`StoreMsg::Status`] answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreStatus {
    /// Blocks resident.
    pub blocks: usize,
    /// Blocks evicted by background reclaim so far.
    pub reclaimed: u64,
    /// Whether the node runs without this tier now.
    pub degraded: bool,
    /// Times the tier was degraded, and recovered.
    pub degradations: u64,
    /// Probes that passed and brought the tier back.
    pub recoveries: u64,
}

/// A reference to a store actor.
pub type StoreRef = ActorRef<StoreMsg>;

/// The G2 store actor.
#[derive(Debug)]
pub struct G2StoreActor;

/// The G3 store actor.
#[derive(Debug)]
pub struct G3StoreActor;

/// A store actor's state.
#[derive(Debug)]
pub struct StoreState {
    args: StoreArgs,
    status: StoreStatus,
    probes: u64,
}

fn start(myself: &StoreRef, args: StoreArgs) -> StoreState {
    myself.send_interval(args.period, || StoreMsg::Tick);
    StoreState {
        args,
        status: StoreStatus { blocks: 0, reclaimed: 0, degraded: false, degradations: 0, recoveries: 0 },
        probes: 0,
    }
}

impl Actor for G2StoreActor {
    type Msg = StoreMsg;
    type State = StoreState;
    type Arguments = StoreArgs;

    async fn pre_start(&self, myself: StoreRef, args: StoreArgs) -> Result<StoreState, ActorProcessingErr> {
        if args.tiers.g2.is_none() {
            return Err("the G2 store actor needs G2".into());
        }
        Ok(start(&myself, args))
    }

    async fn handle(&self, _: StoreRef, msg: StoreMsg, state: &mut StoreState) -> Result<(), ActorProcessingErr> {
        let g2 = state.args.tiers.g2.as_ref().expect("checked at start");
        match msg {
            StoreMsg::Tick => {
                if let Some(target) = state.args.watermarks.reclaim_target(g2.len(), g2.capacity()) {
                    state.status.reclaimed += g2.evict_to(target, unix_millis()) as u64;
                }
            }
            StoreMsg::Status(reply) => {
                state.status.blocks = g2.len();
                let _ = reply.send(state.status.clone());
            }
        }
        Ok(())
    }
}

impl Actor for G3StoreActor {
    type Msg = StoreMsg;
    type State = StoreState;
    type Arguments = StoreArgs;

    async fn pre_start(&self, myself: StoreRef, args: StoreArgs) -> Result<StoreState, ActorProcessingErr> {
        if args.tiers.g3.is_none() || args.tiers.g2.is_none() {
            return Err("the G3 store actor needs G2 and G3".into());
        }
        let degraded = args.tiers.g3.as_ref().is_some_and(|g3| g3.health.is_degraded());
        telemetry::set_tier_degraded(TierName::G3, degraded);
        Ok(start(&myself, args))
    }

    async fn handle(&self, _: StoreRef, msg: StoreMsg, state: &mut StoreState) -> Result<(), ActorProcessingErr> {
        let tiers = state.args.tiers.clone();
        let g3 = tiers.g3.as_ref().expect("checked at start");
        match msg {
            StoreMsg::Tick => {
                if !g3.health.is_degraded() && g3.health.consecutive_failures() >= state.args.failures_to_degrade {
                    g3.health.set_degraded(true);
                    state.status.degradations += 1;
                    telemetry::set_tier_degraded(TierName::G3, true);
                    tracing::error!(
                        failures = g3.health.consecutive_failures(),
                        last_error = g3.health.last_error().as_deref().unwrap_or("?"),
                        "G3 is failing; the node runs on G1+G2 until the disk answers again"
                    );
                } else if g3.health.is_degraded() {
                    match probe(&tiers, state.probes).await {
                        Ok(()) => {
                            g3.health.set_degraded(false);
                            state.status.recoveries += 1;
                            telemetry::set_tier_degraded(TierName::G3, false);
                            tracing::info!("G3 answers again (probe written and read back verified); back on G1+G2+G3");
                        }
                        Err(e) => tracing::debug!(error = %e, "G3 probe failed; staying on G1+G2"),
                    }
                    state.probes += 1;
                }
                let (len, capacity) = g3.occupancy();
                if let Some(target) = state.args.watermarks.reclaim_target(len, capacity) {
                    state.status.reclaimed += g3.evict_to(target, unix_millis()) as u64;
                }
            }
            StoreMsg::Status(reply) => {
                state.status.blocks = g3.store.len();
                state.status.degraded = g3.health.is_degraded();
                let _ = reply.send(state.status.clone());
            }
        }
        Ok(())
    }
}

/// Writes a sealed probe image to G3, reads it back verified, and removes it.
async fn probe(tiers: &NodeTiers, n: u64) -> Result<(), String> {
    let (Some(g2), Some(g3)) = (&tiers.g2, &tiers.g3) else { return Err("no G3".into()) };
    let now = unix_millis();
    // A hash no real block has: hashes of real blocks are salted xxh3 over tokens.
    let hash = BlockHash(u128::from_le_bytes(*b"dynamo-g3-probe\0") ^ u128::from(n));
    let mut slot = g2.alloc(now).ok_or("no free G2 slot for the probe")?;
    seal(
        slot.as_mut_slice(),
        &ImageSpec {
            hash,
            parent: None,
            salt: tiers.salt,
            layout: tiers.layout,
            token_count: tiers.block_tokens as u16,
            retention: RetentionMeta {
                region: RegionKind::Reasoning,
                priority: 0,
                retain_until_ms: 0,
                last_access_ms: now,
                access_count: 0,
            },
        },
    );
    let image = slot.freeze();
    let written = g3.store.write(image).await;
    match written {
        Ok(_) => {}
        // A full store answered: the disk works, there is just no room for a probe.
        Err(G3Error::Full { .. }) => return Ok(()),
        Err(e) => return Err(e.to_string()),
    }
    let dst = g2.alloc(now);
    let result = match dst {
        Some(dst) => g3.store.read(hash, dst).await.map(drop).map_err(|f| f.error.to_string()),
        None => Ok(()),
    };
    g3.store.remove(hash);
    result
}
