//! A request's run through an engine's batch, the same on every engine: its block chain, how far
//! its KV is computed, the events it reports, the token it emits after each step and the outcome
//! it ends with. The reference worker and the simulated engine keep their own G1 pages beside it
//! and choose each token their own way (sampling the logits, or a seeded generator); the rest is
//! this.

use std::ops::Range;

use dynamo_config::{PerTier, RegionKind};
use dynamo_tiering::block::{BlockHash, BlockHasher, Salt};
use dynamo_tiering::pipeline;
use tokio::time::Instant;

use super::{Finish, GenOutcome, GenRequest, Ticket, WorkerError, WorkerEvent, batch};

/// A request in an engine's batch.
#[derive(Debug)]
pub(super) struct Run {
    pub(super) ticket: Ticket,
    /// Its admission's order (the latest admitted yields first among equal priorities).
    pub(super) order: u64,
    /// The hashes of its complete blocks: the prompt's, then the generated ones as their KV
    /// completes.
    pub(super) chain: Vec<BlockHash>,
    /// Complete blocks of the prompt.
    pub(super) prompt_blocks: usize,
    /// The prompt, then the generated tokens.
    pub(super) tokens: Vec<u32>,
    /// Tokens whose KV is in the engine's G1: the next step computes from here.
    pub(super) computed: usize,
    pub(super) outcome: GenOutcome,
    /// What its time to first token counts from.
    pub(super) start: Instant,
    /// Whether the prompt has been prefilled (and reported).
    pub(super) prefilled: bool,
    /// Whether its cached prefix was looked up once (its hits are known).
    pub(super) onboarded: bool,
    /// What its blocks hash under: the node's salt within the request's namespace.
    salt: Salt,
}

/// What a run does after a step computed for it.
pub(super) enum After {
    /// Its prompt is not all in yet.
    Prefilling,
    /// It ends.
    End(Result<Finish, WorkerError>),
    /// Its token number `n` (from 0) is to be chosen and emitted ([`Run::emit`]).
    Token(usize),
}

impl Run {
    /// The run of `ticket`, admitted `order`-th, its prompt hashed in blocks of `block_tokens`
    /// under the node's salt `node` within the request's namespace (or as the router hashed it
    /// already).
    pub(super) fn new(ticket: Ticket, order: u64, node: Salt, block_tokens: usize, start: Instant) -> Self {
        let salt = ticket.req.salt(node);
        let chain = ticket.req.block_hashes(salt, block_tokens);
        let req = &ticket.req;
        let len = req.prompt.len();
        Self {
            order,
            prompt_blocks: chain.len(),
            chain,
            tokens: req.prompt.clone(),
            computed: 0,
            outcome: GenOutcome {
                tokens: Vec::with_capacity(req.max_tokens.min(1 << 16)),
                cached_tokens: 0,
                hit_tokens: PerTier::default(),
                prefill_tokens: len,
                finish: Finish::Length,
                ttft: std::time::Duration::ZERO,
                corrupt_blocks: 0,
            },
            start,
            prefilled: false,
            onboarded: false,
            salt,
            ticket,
        }
    }

    /// The request.
    pub(super) fn req(&self) -> &GenRequest {
        &self.ticket.req
    }

    /// The region of block `i`: the prompt's regions for its blocks, generated after them.
    pub(super) fn region(&self, i: usize, block_tokens: usize) -> RegionKind {
        if i < self.prompt_blocks {
            pipeline::region_of(&self.req().regions, i * block_tokens)
        } else {
            RegionKind::Generated
        }
    }

    /// Tokens waiting for their KV.
    pub(super) fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// What the batch policy plans with.
    pub(super) fn member(&self) -> batch::Member {
        batch::Member {
            pending: self.pending(),
            computed: self.computed,
            priority: self.ticket.priority,
            order: self.order,
            closed: self.ticket.is_closed(),
        }
    }

    /// Its cached prefix is in G1 (everything before `computed`), found per tier as `hits`: what it reports, counted at its first lookup only (not on a resume).
    pub(super) fn count_hits(&mut self, hits: PerTier<usize>) {
        let cached = self.computed;
        if !self.onboarded {
            self.onboarded = true;
            self.outcome.hit_tokens = hits;
            self.outcome.cached_tokens = cached;
            self.outcome.prefill_tokens = self.tokens.len() - cached;
        }
    }

    /// Counts `take` more tokens computed and answers the blocks that completed with them; a
    /// generated block gets its hash now.
    pub(super) fn advance_by(&mut self, take: usize, block_tokens: usize) -> Range<usize> {
        let b = block_tokens;
        let before = self.computed;
        self.computed += take;
        for i in before / b..self.computed / b {
            if i == self.chain.len() {
                let parent = self.chain.last().copied();
                let hash = BlockHasher::new(self.salt, b).hash_block(parent, &self.tokens[i * b..(i + 1) * b]);
                self.chain.push(hash);
            }
        }
        before / b..self.computed / b
    }

    /// After a step computed for it: reports a prefill pass (a caller that went away stops it
    /// between passes), then the prefill's result once its prompt is in; answers whether it
    /// goes on prefilling, ends, or emits its next token.
    pub(super) fn after_step(&mut self) -> After {
        if self.computed < self.tokens.len() {
            if !self.prefilled && !self.ticket.event(WorkerEvent::Computed { tokens: self.computed }) {
                self.outcome.prefill_tokens = self.computed - self.outcome.cached_tokens;
                return After::End(Ok(Finish::Stop));
            }
            return After::Prefilling;
        }
        if !self.prefilled {
            self.prefilled = true;
            let (cached_tokens, hit_tokens) = (self.outcome.cached_tokens, self.outcome.hit_tokens);
            if !self.ticket.event(WorkerEvent::Prefilled { cached_tokens, hit_tokens }) {
                return After::End(Ok(Finish::Stop));
            }
        }
        let n = self.outcome.tokens.len();
        if n >= self.req().max_tokens { After::End(Ok(Finish::Length)) } else { After::Token(n) }
    }

    /// Emits token number `n`: the forced one when the request has its answer already, else
    /// what `choose` picks. A stop token, the end of a forced answer, `max_tokens` or a caller
    /// that went away end the run (`Some`).
    pub(super) fn emit(
        &mut self,
        n: usize,
        choose: impl FnOnce(&GenRequest, &[u32]) -> u32,
    ) -> Option<Result<Finish, WorkerError>> {
        let req = &self.ticket.req;
        let token = match &req.forced {
            Some(forced) => match forced.get(n) {
                Some(&token) => token,
                None => return Some(Ok(Finish::Stop)),
            },
            None => choose(req, &self.tokens),
        };
        if n == 0 {
            self.outcome.ttft = self.start.elapsed();
        }
        if req.stop_tokens.contains(&token) {
            // The caller sees the end-of-turn token (it counts in the answer's usage, and vLLM's
            // `token_ids` end with it); the sequence does not keep it.
            self.ticket.event(WorkerEvent::Token(token));
            return Some(Ok(Finish::Stop));
        }
        let max_tokens = req.max_tokens;
        self.outcome.tokens.push(token);
        self.tokens.push(token);
        if !self.ticket.event(WorkerEvent::Token(token)) {
            return Some(Ok(Finish::Stop));
        }
        (self.outcome.tokens.len() == max_tokens).then_some(Ok(Finish::Length))
    }

    /// Answers the caller: the outcome, or the error.
    pub(super) fn finish(self, end: Result<Finish, WorkerError>) {
        let Run { ticket, mut outcome, prefilled, computed, .. } = self;
        if !prefilled {
            // Stopped before its prompt was in: only what was computed counts.
            outcome.prefill_tokens = computed.saturating_sub(outcome.cached_tokens);
        }
        ticket.finish(end.map(|finish| {
            outcome.finish = finish;
            outcome
        }));
    }
}
