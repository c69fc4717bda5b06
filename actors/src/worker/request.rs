//! What a worker is asked and what it answers: requests, events, outcomes and errors, shared by
//! every engine kind.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dynamo_config::{PerTier, RegionKind};
use dynamo_kernels::model::ModelError;
use dynamo_kernels::sampling::{Sampling, TokenSet};
use dynamo_tiering::block::{BlockHash, BlockHasher, Namespace, Salt};
use dynamo_tiering::registry::Millis;

/// One generation request, already tokenized.
#[derive(Clone, Debug, PartialEq)]
pub struct GenRequest {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Token ranges by region; tokens outside every range count as conversation.
    pub regions: Vec<(Range<usize>, RegionKind)>,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// How to sample.
    pub sampling: Sampling,
    /// Seed of temperature sampling, when the client gave one. Without, the node's own engines
    /// sample from seed 0, and a vLLM engine from its own generator (a per-request seed makes
    /// vLLM for CPU fail on a prompt it prefills in chunks).
    pub seed: Option<u64>,
    /// Tokens that end generation: emitted as the last token event, not kept in the sequence.
    pub stop_tokens: Vec<u32>,
    /// Sample only these ids (those the tokenizer can decode: its vocabulary may be smaller
    /// than the model's and have gaps); `None` for the model's whole vocabulary.
    pub allowed: Option<Arc<TokenSet>>,
    /// The answer's tokens, computed as usual but not sampled (the scripted engine); generation
    /// stops when they run out.
    pub forced: Option<Arc<[u32]>>,
    /// The prompt's block hashes, when the router computed them already (the worker computes
    /// them otherwise).
    pub hashes: Option<Arc<PromptHashes>>,
    /// The cache namespace of its tenant (and `cache_salt`): its blocks hash under the node's
    /// salt [`within`](Salt::within) it. `None`: the shared namespace.
    pub namespace: Option<Namespace>,
    /// Prefixes of the prompt the client asked to keep (`cache_control` breakpoints), at most
    /// four; the scheduler leases their complete blocks to the request's session.
    pub leases: Vec<LeaseRequest>,
    /// The id its log lines carry (the frontend's request id); `None` for the node's own work.
    pub request_id: Option<Arc<str>>,
}

/// One prefix of a prompt to keep: its first `tokens` tokens, for `ttl` after each use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseRequest {
    /// Prompt tokens the lease covers (its complete blocks are leased).
    pub tokens: usize,
    /// How long it lives after its last use.
    pub ttl: std::time::Duration,
}

/// The hashes of a prompt's complete blocks, computed once per request (by the router, which
/// looks them up in the prefix index) and carried to the worker, with what they were computed
/// under: a worker uses them only if its blocks are named the same way.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptHashes {
    /// The salt they were hashed with.
    pub salt: Salt,
    /// Tokens per block.
    pub block_tokens: usize,
    /// One per complete block of the prompt.
    pub hashes: Arc<[BlockHash]>,
}

impl GenRequest {
    /// Greedy decoding of at most `max_tokens` after `prompt`: no regions (all conversation), no
    /// stop tokens, the whole vocabulary.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt,
            regions: vec![],
            max_tokens,
            sampling: Sampling::GREEDY,
            seed: None,
            stop_tokens: vec![],
            allowed: None,
            forced: None,
            hashes: None,
            namespace: None,
            leases: Vec::new(),
            request_id: None,
        }
    }

    /// Its id in logs: the request id, or `-` for the node's own work.
    pub fn log_id(&self) -> &str {
        self.request_id.as_deref().unwrap_or("-")
    }

    /// The salt its blocks hash under on a node whose blocks hash under `node`.
    pub fn salt(&self, node: Salt) -> Salt {
        node.within(self.namespace)
    }

    /// The prompt's block hashes under `salt` at `block_tokens` per block: the ones it carries
    /// when they were computed that way, else computed now.
    pub fn block_hashes(&self, salt: Salt, block_tokens: usize) -> Vec<BlockHash> {
        match &self.hashes {
            Some(h)
                if h.salt == salt
                    && h.block_tokens == block_tokens
                    && h.hashes.len() == self.prompt.len() / block_tokens =>
            {
                h.hashes.to_vec()
            }
            _ => BlockHasher::new(salt, block_tokens).hash_sequence(&self.prompt),
        }
    }
}

/// What a request reports while it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerEvent {
    /// The prompt is in G1: `cached_tokens` were reused or loaded instead of computed.
    Prefilled {
        /// Prompt tokens not computed.
        cached_tokens: usize,
        /// Of those, per tier.
        hit_tokens: PerTier<usize>,
    },
    /// A prefill pass ended with the prompt's first `tokens` tokens in G1. Answering false
    /// cancels the request before its next pass (a client that went away, a request past its
    /// deadline, a node shutting down): a long prompt stops within one pass.
    Computed {
        /// Prompt tokens in G1 so far.
        tokens: usize,
    },
    /// A generated token.
    Token(u32),
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// `max_tokens` reached.
    Length,
    /// A stop token was sampled, or the caller stopped.
    Stop,
}

/// What a request did.
#[derive(Clone, Debug, PartialEq)]
pub struct GenOutcome {
    /// Generated tokens.
    pub tokens: Vec<u32>,
    /// Prompt tokens whose KV was not computed: reused in G1 or loaded from G2/G3.
    pub cached_tokens: usize,
    /// Of those, per tier.
    pub hit_tokens: PerTier<usize>,
    /// Prompt tokens computed.
    pub prefill_tokens: usize,
    /// Why it ended.
    pub finish: Finish,
    /// Time to the first generated token.
    pub ttft: Duration,
    /// G3 blocks that failed verification during onboarding (dropped and recomputed).
    pub corrupt_blocks: usize,
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The prompt is empty.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// Prompt plus `max_tokens` do not fit this worker's G1.
    #[error(
        "prompt of {prompt} tokens plus {max_tokens} to generate needs {needed} KV blocks; this worker holds {capacity}"
    )]
    TooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Tokens to generate.
        max_tokens: usize,
        /// Blocks needed.
        needed: usize,
        /// Blocks in G1.
        capacity: usize,
    },
    /// G1 has no free page and nothing evictable (every block is in use).
    #[error("no free KV block in G1: every block is in use")]
    Overloaded,
    /// The engine failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The worker panicked while serving the request; it was restarted (its G1 blocks dropped).
    #[error("the worker failed while serving this request and was restarted: {0}")]
    Panicked(String),
    /// The worker restarted before this queued request started; it may be retried.
    #[error("the worker restarted before this request started; retry it")]
    Restarting,
    /// The engine step this request was part of failed (a kernel or copy error).
    #[error("the engine step failed: {0}")]
    Step(String),
    /// The engine this worker forwards to refused or broke the request.
    #[error("the engine failed: {0}")]
    Engine(String),
    /// The engine this worker forwards to is down or unreachable; the request may be retried.
    #[error("the engine is unavailable: {0}")]
    EngineDown(String),
    /// A prompt token id the model's vocabulary lacks (never sent to an engine).
    #[error("token id {id} is outside the model's vocabulary of {vocab}")]
    OutOfVocabulary {
        /// The id.
        id: u32,
        /// The vocabulary's size.
        vocab: usize,
    },
}

impl WorkerError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            WorkerError::EmptyPrompt => "empty_prompt",
            WorkerError::TooLong { .. } => "too_long",
            WorkerError::Overloaded => "overloaded",
            WorkerError::Model(e) => e.kind(),
            WorkerError::Panicked(_) => "panicked",
            WorkerError::Restarting => "restarting",
            WorkerError::Step(_) => "engine_step",
            WorkerError::Engine(_) => "engine",
            WorkerError::EngineDown(_) => "engine_down",
            WorkerError::OutOfVocabulary { .. } => "out_of_vocabulary",
        }
    }
}

/// Milliseconds since the Unix epoch: the clock of holds and retention.
pub fn unix_millis() -> Millis {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}
