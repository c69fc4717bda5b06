//! The SessionActor: one per conversation (the `x-session-id` header, else the request's `user`).
//!
//! It counts the conversation's turns, remembers the worker that served the last one (the
//! scheduler's soft preference for the next), and ends after `frontend.session_idle_timeout`
//! without a turn. Holds on the conversation's blocks are deadlines in the tiers' registries (a
//! turn's context is held `retention.conversation.hold` after it ends), so they expire on their
//! own; the session is where longer, hint-set TTLs will be released when it ends.

use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

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
    /// The session ends after this long without a turn.
    pub idle_timeout: Duration,
}

/// A session's state.
#[derive(Debug)]
pub struct SessionState {
    id: String,
    idle_timeout: Duration,
    turns: u64,
    last_worker: Option<usize>,
    last_turn: Instant,
    prompt_tokens: usize,
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
}

/// Messages of the SessionActor.
#[derive(Debug)]
pub enum SessionMsg {
    /// No reply: a turn of `prompt_tokens` was routed to `worker`.
    Turn {
        /// The worker.
        worker: usize,
        /// Its prompt length.
        prompt_tokens: usize,
    },
    /// Reply: what the session knows. Always answered.
    Info(RpcReplyPort<SessionInfo>),
    /// No reply: the idle check (sent by the session's own timer).
    Tick,
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
            id: args.id,
            idle_timeout: args.idle_timeout,
            turns: 0,
            last_worker: None,
            last_turn: Instant::now(),
            prompt_tokens: 0,
        })
    }

    async fn handle(
        &self,
        myself: SessionRef,
        msg: SessionMsg,
        state: &mut SessionState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SessionMsg::Turn { worker, prompt_tokens } => {
                state.turns += 1;
                state.last_worker = Some(worker);
                state.prompt_tokens = prompt_tokens;
                state.last_turn = Instant::now();
            }
            SessionMsg::Info(reply) => {
                let _ = reply.send(SessionInfo {
                    turns: state.turns,
                    last_worker: state.last_worker,
                    prompt_tokens: state.prompt_tokens,
                });
            }
            SessionMsg::Tick => {
                if state.last_turn.elapsed() >= state.idle_timeout {
                    tracing::debug!(session = %state.id, turns = state.turns, "session idle; ending it");
                    myself.stop(Some("idle".into()));
                }
            }
        }
        Ok(())
    }
}
