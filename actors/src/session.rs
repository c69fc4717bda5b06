//! The SessionActor: one per conversation, on the request path (frontend → session → scheduler).
//!
//! Every request that names a session reaches its actor first ([`SessionMsg::Submit`]); the
//! session adds what it knows — the worker that served its last turn (the scheduler's soft
//! preference for the next) and who it is (the owner of its leases) — and hands the request to
//! the scheduler to be routed ([`SchedulerMsg::Route`]). The scheduler answers the client
//! directly and tells the session where the turn went and which block chains it leased
//! ([`SessionMsg::Routed`]).
//!
//! The session owns its leases: the `cache_control` prefixes its requests asked to keep. They end
//! at their TTL on their own (the tiers' registries expire them), and all of them end when the
//! session does: after `frontend.session_idle_timeout` without a request, or when the scheduler
//! ends it to stay under `frontend.max_sessions`. Holds of a turn's context are deadlines in the
//! registries (`retention.conversation.hold` after the turn) and expire by themselves.

use std::time::{Duration, Instant};

use dynamo_config::RegionKind;
use dynamo_tiering::block::BlockHash;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::leases::{LeaseOwner, LeasedTiers, Lessee};
use crate::scheduler::{Hints, SchedulerMsg, SchedulerRef, SessionTurn, SubmitError, Submitted};
use crate::worker::GenRequest;

/// Lease chains one session keeps at once (a conversation needs a handful: its system prompt and
/// its latest breakpoints).
pub const MAX_CHAINS: usize = 32;

/// The SessionActor.
#[derive(Debug)]
pub struct SessionActor;

/// A reference to a SessionActor.
pub type SessionRef = ActorRef<SessionMsg>;

/// What a session starts from.
#[derive(Clone, Debug)]
pub struct SessionArgs {
    /// The session id.
    pub id: String,
    /// The session ends after this long without a request.
    pub idle_timeout: Duration,
    /// The scheduler its requests go to.
    pub scheduler: SchedulerRef,
    /// Where its leases are released (none on a node without leases).
    pub leasing: Option<std::sync::Arc<dyn LeasedTiers>>,
    /// Its tenant (a digest of the tenant's name; 0 for the shared tenant).
    pub tenant: u64,
}

/// A block chain a session leases, as the scheduler granted it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeasedChain {
    /// Its blocks, in prefix order, with their regions.
    pub blocks: Vec<(BlockHash, RegionKind)>,
}

/// A session's state.
#[derive(Debug)]
pub struct SessionState {
    id: String,
    lessee: Lessee,
    idle_timeout: Duration,
    scheduler: SchedulerRef,
    leasing: Option<std::sync::Arc<dyn LeasedTiers>>,
    turns: u64,
    last_worker: Option<usize>,
    last_request: Instant,
    prompt_tokens: usize,
    /// Its leases, longest chain per first block (a longer chain of the same prefix covers a
    /// shorter one).
    leases: Vec<LeasedChain>,
}

/// What a session knows, as [`SessionMsg::Info`] answers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionInfo {
    /// Turns routed so far.
    pub turns: u64,
    /// The worker of the last turn.
    pub last_worker: Option<usize>,
    /// The last turn's prompt length.
    pub prompt_tokens: usize,
    /// Blocks it leases (summed over its chains).
    pub leased_blocks: usize,
}

/// Messages of the SessionActor.
#[derive(Debug)]
pub enum SessionMsg {
    /// A request of this session, to be routed; `reply` gets the scheduler's answer.
    Submit {
        /// The request.
        req: Box<GenRequest>,
        /// Agent hints.
        hints: Hints,
        /// Where the answer goes.
        reply: RpcReplyPort<Result<Submitted, SubmitError>>,
    },
    /// No reply: a turn of `prompt_tokens` was routed to `worker`, leasing `leased`.
    Routed {
        /// The worker.
        worker: usize,
        /// Its prompt length.
        prompt_tokens: usize,
        /// The chains it leased for this session.
        leased: Vec<LeasedChain>,
    },
    /// Reply: what the session knows. Always answered.
    Info(RpcReplyPort<SessionInfo>),
    /// No reply: the idle check (sent by the session's own timer).
    Tick,
}

/// A lease owner of its own for every session actor started (0 is for requests without a
/// session): a conversation whose actor ended and started again never shares, or releases, the
/// leases of its earlier incarnation.
fn next_lease_owner() -> LeaseOwner {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Actor for SessionActor {
    type Msg = SessionMsg;
    type State = SessionState;
    type Arguments = SessionArgs;

    async fn pre_start(&self, myself: SessionRef, args: SessionArgs) -> Result<SessionState, ActorProcessingErr> {
        // Check a few times per timeout, so a session ends at most a quarter late.
        let period = (args.idle_timeout / 4).max(Duration::from_millis(10));
        myself.send_interval(period, || SessionMsg::Tick);
        Ok(SessionState {
            lessee: Lessee { owner: next_lease_owner(), tenant: args.tenant },
            id: args.id,
            idle_timeout: args.idle_timeout,
            scheduler: args.scheduler,
            leasing: args.leasing,
            turns: 0,
            last_worker: None,
            last_request: Instant::now(),
            prompt_tokens: 0,
            leases: Vec::new(),
        })
    }

    async fn handle(
        &self,
        myself: SessionRef,
        msg: SessionMsg,
        state: &mut SessionState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SessionMsg::Submit { req, hints, reply } => {
                let span = tracing::info_span!("session", request_id = req.log_id(), session = %state.id);
                let _in = span.enter();
                tracing::debug!(turn = state.turns + 1, sticky_worker = ?state.last_worker, "turn");
                state.last_request = Instant::now();
                let turn = SessionTurn { actor: myself, lessee: state.lessee, sticky: state.last_worker };
                if let Err(e) = state.scheduler.cast(SchedulerMsg::Route { req, session: Some(turn), hints, reply }) {
                    // The scheduler is gone (the node is stopping); the reply port drops with the
                    // message, and the caller sees the call fail.
                    tracing::debug!(session = %state.id, error = %e, "the scheduler is gone");
                }
            }
            SessionMsg::Routed { worker, prompt_tokens, leased } => {
                state.turns += 1;
                state.last_worker = Some(worker);
                state.prompt_tokens = prompt_tokens;
                for chain in leased {
                    state.keep(chain);
                }
            }
            SessionMsg::Info(reply) => {
                let _ = reply.send(SessionInfo {
                    turns: state.turns,
                    last_worker: state.last_worker,
                    prompt_tokens: state.prompt_tokens,
                    leased_blocks: state.leases.iter().map(|c| c.blocks.len()).sum(),
                });
            }
            SessionMsg::Tick => {
                if state.last_request.elapsed() >= state.idle_timeout {
                    tracing::debug!(session = %state.id, turns = state.turns, "session idle; ending it");
                    // Drained, not stopped: a request already in the mailbox is still routed (and
                    // its leases released, since this actor no longer takes their `Routed`).
                    let _ = myself.drain();
                }
            }
        }
        Ok(())
    }

    async fn post_stop(&self, _: SessionRef, state: &mut SessionState) -> Result<(), ActorProcessingErr> {
        // However it ends (idle, the session cap, the node stopping), its leases end with it.
        if let Some(tiers) = &state.leasing {
            let now = tiers.now();
            for chain in state.leases.drain(..) {
                tiers.unlease(state.lessee, &chain.blocks, now);
            }
        }
        Ok(())
    }
}

impl SessionState {
    /// Keeps `chain` among the session's leases: a chain that extends one it has replaces it, and
    /// one that another covers adds nothing (hashes are chained: equal blocks at one position
    /// mean equal prefixes). Past [`MAX_CHAINS`] the oldest chain's lease ends.
    fn keep(&mut self, chain: LeasedChain) {
        let Some(&last) = chain.blocks.last() else { return };
        let covers = |long: &LeasedChain, short_len: usize, short_last: (BlockHash, RegionKind)| {
            long.blocks.len() >= short_len && long.blocks[short_len - 1] == short_last
        };
        if self.leases.iter().any(|c| covers(c, chain.blocks.len(), last)) {
            return;
        }
        self.leases.retain(|c| !covers(&chain, c.blocks.len(), *c.blocks.last().expect("kept chains are non-empty")));
        self.leases.push(chain);
        if self.leases.len() > MAX_CHAINS {
            let oldest = self.leases.remove(0);
            // Only the blocks no kept chain shares (they all may start with one system prompt).
            let kept: std::collections::HashSet<BlockHash> =
                self.leases.iter().flat_map(|c| c.blocks.iter().map(|&(h, _)| h)).collect();
            let only: Vec<(BlockHash, RegionKind)> =
                oldest.blocks.into_iter().filter(|(h, _)| !kept.contains(h)).collect();
            if let Some(tiers) = &self.leasing {
                tiers.unlease(self.lessee, &only, tiers.now());
            }
        }
    }
}
