//! The worker's engine loop: one engine, its G1 pool, onboarding of cached prefixes from G1/G2/G3,
//! continuous batching of the requests in flight, and write-through of every completed block to
//! G2 and G3.
//!
//! This is the synchronous core that the WorkerActor owns, meant to run on the worker's own thread
//! (the forward pass is CPU- or GPU-bound work, never run inside an async handler). G3 writes are
//! spawned on the ambient tokio runtime so decode never waits for the disk; [`Worker::flush`]
//! waits for them.
//!
//! Many requests are in flight at once ([`Worker::admit`], then [`Worker::step`]): each step is
//! one forward pass over the decode token of every running request plus prefill chunks of the
//! others, within `engine.max_batch_tokens` tokens and `engine.max_running_requests` requests,
//! every matrix multiply taking all their rows at once and attention reading each request's own
//! block table. New requests join at the next step; finished ones leave. A request's tokens do
//! not depend on its batch mates (bitwise on the CPU).
//!
//! A request's life:
//! 1. admission: hash the prompt's complete blocks; walk them while each is found in G1 (reused in
//!    place), G2 or G3 (loaded: G3 → a G2 slot, verified → G1 page). A G3 block that fails
//!    verification ends the cached prefix there; the rest is recomputed. At least the last prompt
//!    token is always computed, so the step has its logits.
//! 2. prefill the rest over as many steps as the budget needs; register the blocks each step
//!    completes in G1 and write them through: gathered into a sealed image in a G2 slot, admitted
//!    to G2, and written to G3 in the background, as far down as its region's retention policy
//!    allows.
//! 3. decode, one token per step; generated blocks are registered and written through as they
//!    complete.
//! 4. release the request's G1 references and set the holds of its blocks (conversation context
//!    survives a tool-call gap this way).
//!
//! When G1 has no page left for a step, the lowest-priority request yields: its blocks are
//! written through (most are in G2 already), its pages freed, and it resumes later by loading
//! them back rather than recomputing them ([`Resume`]).
//!
//! Copies between G1 and G2 run on the backend's copy engine where it has one (CUDA streams of
//! their own): a step's gather runs while the next step computes, and a loaded prefix's scatter
//! runs layer by layer ahead of the next step's attention. The worker keeps the copies' buffers
//! (G2 slots and images) until they finish, and no G1 page with a gather in flight is reused
//! before it ends.

use std::ops::Range;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dynamo_config::{RegionKind, TierName};
use dynamo_kernels::Backend;
use dynamo_kernels::model::{Chunk, Llama, ModelError};
use dynamo_kernels::sampling::{Sampling, SeededRng, TokenSet, sample_in};
use dynamo_tiering::block::{
    BlockHash, BlockHasher, BlockMap, HEADER_LEN, ImageHeader, ImageSpec, Namespace, RetentionMeta, Salt, payload_mut,
    seal,
};
use dynamo_tiering::g2::{SlotMut, SlotRef};
use dynamo_tiering::pipeline::{self, Landed, Presence, Refusal};
use dynamo_tiering::registry::{Admission, Millis, PolicyKind, TierRegistry};
use futures::FutureExt;
use tokio::task::JoinSet;

use super::run::{After, Run};
use super::{Ticket, batch};

use crate::leases::LeasedTiers;
use crate::peer::{Arrival, FetchError, Land};
use crate::telemetry::{
    Tier, record_corrupt_block, record_preemption, record_tier_error, record_transfer, record_write_lag,
    record_write_skipped, record_writes_skipped,
};
use crate::tiers::{BlockSite, NodeTiers};

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
    /// Seed of temperature sampling.
    pub seed: u64,
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
            seed: 0,
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
        /// Of those, per tier: g1, g2, g3, g4.
        hit_tokens: [usize; 4],
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
    /// Of those, per tier: g1, g2, g3, g4.
    pub hit_tokens: [usize; 4],
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
        }
    }
}

/// With the `failpoints` feature, a request for exactly this many tokens panics the worker (tests
/// of supervision only; never compiled into a release build without the feature).
#[cfg(feature = "failpoints")]
pub const FAILPOINT_PANIC_MAX_TOKENS: usize = 31_337;

/// Milliseconds since the Unix epoch: the clock of holds and retention.
pub fn unix_millis() -> Millis {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Requests one worker runs at once unless configured (`engine.max_running_requests`).
pub const DEFAULT_MAX_RUNNING: usize = 64;

/// G3 write batches one worker keeps in flight at most; beyond it write-through stops at G2.
pub const MAX_G3_BATCHES_IN_FLIGHT: usize = 8;

/// One engine with its G1 pool, serving many requests at once (continuous batching).
pub struct Worker<B: Backend> {
    id: usize,
    /// G1 → G2 gathers in flight on the copy engine, oldest first. Declared before the pool and
    /// the model, so a dropped worker waits for its copies before the pool goes.
    copying: Vec<Copying<B>>,
    /// G2 → G1 scatters of cached prefixes in flight, until the next step has run.
    loading: Vec<Loading<B>>,
    model: Llama<B>,
    kv: B::Kv,
    tiers: Arc<NodeTiers>,
    pages: usize,
    policy: PolicyKind,
    free: Vec<u32>,
    by_hash: BlockMap<u32>,
    registry: TierRegistry,
    /// Completed blocks waiting for their G1 → G2 gather.
    gathers: Vec<PendingGather>,
    /// Per G1 page, whether a gather in `copying` reads it: such a page is neither freed nor
    /// reused until the gather ends ([`Worker::free_page`], [`Worker::alloc_page`]).
    gathering: Vec<bool>,
    /// Sealed G2 images waiting for their G2 → G3 write.
    g3_batch: Vec<PendingWrite>,
    writes: JoinSet<()>,
    /// Most tokens computed in one step (see [`Worker::with_prefill_chunk`]).
    prefill_chunk: usize,
    /// Most requests in the batch (see [`Worker::with_max_running`]).
    max_running: usize,
    /// How a preempted request comes back.
    resume: Resume,
    /// The requests in the batch, in admission order.
    running: Vec<Seq>,
    /// Requests waiting for room in G1, highest priority first: preempted ones, and admitted ones
    /// whose prompt did not fit beside the batch yet. They come back before any new request is
    /// admitted.
    preempted: Vec<Seq>,
    /// Admissions so far: each request's order.
    admitted: u64,
    stats: PreemptionStats,
}

impl<B: Backend> std::fmt::Debug for Worker<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("id", &self.id).field("model", &self.model).field("pages", &self.pages).finish()
    }
}

/// How a request preempted out of G1 comes back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Resume {
    /// Its blocks are loaded back from where write-through put them (G1 if still resident, G2,
    /// G3), and only the rest is recomputed: the default.
    #[default]
    Load,
    /// Everything is recomputed, as vLLM's default preemption does (the benchmark's comparison).
    Recompute,
}

/// What preemption did on a worker so far.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PreemptionStats {
    /// Requests preempted.
    pub preempted: usize,
    /// Tokens a resumed request did not recompute (loaded or still resident).
    pub resumed_cached_tokens: usize,
    /// Tokens a resumed request recomputed.
    pub resumed_computed_tokens: usize,
    /// For each resumed request, the time from its resumption (G1 had room again) to its next
    /// token: what bringing it back cost.
    pub resume_latency: Vec<Duration>,
    /// For each resumed request, the time from its preemption to its next token (waiting for
    /// room included).
    pub preempted_for: Vec<Duration>,
}

/// Where a block of the request's sequence lives in G1.
struct SeqBlock {
    page: u32,
    /// Registered in G1 and referenced by this request.
    registered: Option<BlockHash>,
}

/// A request this worker serves: its run through the batch, and its G1 pages.
struct Seq {
    run: Run,
    /// Its G1 pages, one per block.
    blocks: Vec<SeqBlock>,
    rng: SeededRng,
    /// When it was preempted and when it resumed, until its next token.
    preempted_at: Option<(Instant, Option<Instant>)>,
}

/// The running requests' G1 pages during a step's plan.
struct StepPages<'a, B: Backend> {
    worker: &'a mut Worker<B>,
    running: &'a mut [Seq],
}

impl<B: Backend> batch::Pages for StepPages<'_, B> {
    fn grow(&mut self, i: usize, blocks: usize) -> bool {
        while self.running[i].blocks.len() < blocks {
            match self.worker.alloc_page(unix_millis()) {
                Ok(page) => self.running[i].blocks.push(SeqBlock { page, registered: None }),
                Err(_) => return false,
            }
        }
        true
    }

    fn preempt(&mut self, i: usize) {
        self.worker.preempt(&mut self.running[i]);
    }
}

/// A completed block whose KV is still only in its G1 page.
struct PendingGather {
    hash: BlockHash,
    parent: Option<BlockHash>,
    page: u32,
    region: RegionKind,
    completed: Instant,
}

/// A G1 → G2 gather in flight: the blocks and the G2 slots their images land in.
struct Copying<B: Backend> {
    /// Declared first so that it drops first: dropping it waits for the copies, and only then may
    /// the slots go back to the pool.
    copies: B::Copies,
    blocks: Vec<PendingGather>,
    slots: Vec<SlotMut>,
}

/// A G2 → G1 scatter in flight, the images it reads, whose sequence it is for and where their
/// blocks are in it.
struct Loading<B: Backend> {
    /// Declared first: dropping it waits for the copies before the images are released.
    copies: B::Copies,
    images: Vec<SlotRef>,
    order: u64,
    blocks: Vec<usize>,
}

/// A block image in G2 on its way to G3.
struct PendingWrite {
    hash: BlockHash,
    parent: Option<BlockHash>,
    image: SlotRef,
    completed: Instant,
}

/// Where a block of the cached prefix comes from.
enum Source {
    /// Resident in this worker's G1 (already acquired).
    G1(u32),
    /// An image in a G2 slot: found in G2, or just read there from G3 or fetched from a peer.
    Image { image: SlotRef, from: pipeline::Source },
    /// In G3, to be read.
    G3,
    /// On the peer the lookup found, to be fetched.
    G4,
}

/// How long a fetch of the blocks covering tokens `[from, to)` may take before it is cancelled
/// and they are recomputed: twice what recomputing them would take by the cost model, at least
/// `floor` (`tiers.g4.min_fetch_budget`), at most `ceiling` (`tiers.g4.request_timeout`).
fn fetch_budget(
    cost: &dynamo_tiering::cost::CostModel,
    from: usize,
    to: usize,
    floor: Duration,
    ceiling: Duration,
) -> Duration {
    let recompute = cost.prefill.as_ref().map(|p| Duration::from_secs_f64(2.0 * p.seconds(from, to)));
    recompute.unwrap_or(ceiling).clamp(floor.min(ceiling), ceiling)
}

/// Whether a verified image of `bytes` from a peer, in `slot`, is of this node's layout: a peer of
/// the same model with another KV dtype or block geometry names its blocks the same (the hash
/// covers the model and the tokens), and its images are not this node's to load.
/// It must also be the block asked for in its place.
fn of_this_layout(tiers: &NodeTiers, slot: &SlotRef, bytes: usize, hash: BlockHash) -> bool {
    bytes == tiers.layout.image_bytes()
        && ImageHeader::decode_header_only(slot.as_slice())
            .is_ok_and(|header| header.layout == tiers.layout && header.hash == hash)
}

/// The real executor's answers while the pipeline plans a prefix: a G1 block found is acquired
/// (its page kept), a G2 image found is taken (so it cannot go before it is loaded).
struct Lookup<'w, B: Backend> {
    worker: &'w mut Worker<B>,
    now: Millis,
    pages: Vec<u32>,
    images: Vec<SlotRef>,
    /// The blocks of the prefix the best peer holds (empty without one).
    remote: &'w [BlockHash],
    /// Blocks asked about so far (each block's first question is `in_g1`).
    asked: usize,
}

impl<B: Backend> pipeline::TierLookup for Lookup<'_, B> {
    fn in_g1(&mut self, hash: BlockHash) -> bool {
        self.asked += 1;
        let Some(&page) = self.worker.by_hash.get(&hash) else { return false };
        self.worker.registry.acquire(hash, self.now).expect("resident");
        self.pages.push(page);
        true
    }

    fn in_g2(&mut self, hash: BlockHash) -> bool {
        let Some(image) = self.worker.tiers.g2.as_ref().and_then(|g2| g2.get(hash, self.now)) else { return false };
        self.images.push(image);
        true
    }

    fn in_g3(&mut self, hash: BlockHash) -> bool {
        let tiers = &self.worker.tiers;
        tiers.g2.is_some() && tiers.g3.as_ref().is_some_and(|g3| g3.usable() && g3.store.contains(hash))
    }

    fn in_g4(&mut self, hash: BlockHash) -> bool {
        // The prefix is asked in order, block by block, from its start: the block asked about is
        // the `asked`-th, and the peer holds it if its prefix reaches that far.
        let at = self.asked.wrapping_sub(1);
        self.worker.tiers.g2.is_some() && self.remote.get(at) == Some(&hash)
    }
}

impl<B: Backend> Worker<B> {
    /// A worker with `pages` G1 blocks evicted by `policy`.
    pub fn new(model: Llama<B>, tiers: Arc<NodeTiers>, pages: usize, policy: PolicyKind) -> Result<Self, WorkerError> {
        let kv = model.kv_pool(tiers.block_tokens, pages)?;
        Ok(Self {
            id: 0,
            copying: Vec::new(),
            loading: Vec::new(),
            model,
            kv,
            tiers,
            pages,
            policy,
            free: (0..pages as u32).rev().collect(),
            by_hash: BlockMap::default(),
            registry: TierRegistry::new(pages, policy),
            gathers: Vec::new(),
            gathering: vec![false; pages],
            g3_batch: Vec::new(),
            writes: JoinSet::new(),
            prefill_chunk: usize::MAX,
            max_running: DEFAULT_MAX_RUNNING,
            resume: Resume::Load,
            running: Vec::new(),
            preempted: Vec::new(),
            admitted: 0,
            stats: PreemptionStats::default(),
        })
    }

    /// Computes at most `tokens` tokens per step (`engine.max_batch_tokens`): the decode tokens of
    /// every running request, then prefill chunks of the others within what is left. A long
    /// prompt is computed over several steps, each attending to the KV the ones before it wrote:
    /// what bounds a step's activation memory whatever the prompts' lengths. By default a step
    /// takes everything.
    pub fn with_prefill_chunk(mut self, tokens: usize) -> Self {
        self.prefill_chunk = tokens.max(1);
        self
    }

    /// Runs at most `requests` requests at once (`engine.max_running_requests`).
    pub fn with_max_running(mut self, requests: usize) -> Self {
        self.max_running = requests.max(1);
        self
    }

    /// How preempted requests come back (by default: by loading their blocks).
    pub fn with_resume(mut self, resume: Resume) -> Self {
        self.resume = resume;
        self
    }

    /// The same worker as worker `id` of its node (the G1 site it reports KV events for).
    pub fn with_id(mut self, id: usize) -> Self {
        self.id = id;
        self
    }

    /// G1 blocks holding a registered (shareable) block.
    pub fn resident_blocks(&self) -> usize {
        self.by_hash.len()
    }

    /// Its G1 in blocks.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Whether `hash` is resident in this worker's G1.
    pub fn holds(&self, hash: BlockHash) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// The model.
    pub fn model(&self) -> &Llama<B> {
        &self.model
    }

    /// What preemption did so far.
    pub fn preemption_stats(&self) -> &PreemptionStats {
        &self.stats
    }

    /// Requests admitted and not finished (running or preempted).
    pub fn running(&self) -> usize {
        self.running.len() + self.preempted.len()
    }

    /// Whether another request may join the batch now: below the limit, and nobody waits to
    /// resume.
    pub fn has_room(&self) -> bool {
        batch::has_room(self.running.len(), self.preempted.len(), self.max_running)
    }

    /// Fails every request in the batch with [`WorkerError::Panicked`]`(why)` (their pages are
    /// not given back: a [`Self::reset`] follows).
    pub fn abort(&mut self, why: &str) {
        for seq in self.running.drain(..).chain(self.preempted.drain(..)) {
            seq.run.ticket.finish(Err(WorkerError::Panicked(why.to_string())));
        }
    }

    /// Forgets everything in G1, as a restarted worker would: every page is free again and no
    /// block is resident (after a panic, the pool's contents cannot be trusted). Requests still
    /// in the batch are answered "restarting". Returns how many registered blocks were dropped;
    /// they are reported cleared.
    pub fn reset(&mut self) -> usize {
        self.running.clear();
        self.preempted.clear();
        let dropped = self.by_hash.len();
        // Dropping the copies in flight waits for them; their images are not trusted either.
        self.loading.clear();
        self.copying.clear();
        self.gathering.fill(false);
        self.free = (0..self.pages as u32).rev().collect();
        self.by_hash.clear();
        self.gathers.clear();
        self.registry = TierRegistry::new(self.pages, self.policy);
        self.tiers.observer.cleared(self.id);
        dropped
    }

    /// Finishes the gathers in flight, sends every pending G3 write and waits for all background
    /// writes started so far.
    pub async fn flush(&mut self) {
        self.finish_gathers(true);
        self.send_g3_batch();
        while self.writes.join_next().await.is_some() {}
    }

    fn site(&self) -> BlockSite {
        BlockSite::G1 { worker: self.id }
    }

    fn alloc_page(&mut self, now: Millis) -> Result<u32, WorkerError> {
        if let Some(page) = self.free.pop() {
            return Ok(page);
        }
        let victim = self.registry.evict(1, now).pop().ok_or(WorkerError::Overloaded)?;
        self.tiers.observer.removed(self.site(), &[victim.hash]);
        let page = self.by_hash.remove(&victim.hash).expect("a registered block has a page");
        self.settle_page(page);
        Ok(page)
    }

    /// Returns `page` to the free list, once no gather reads it.
    fn free_page(&mut self, page: u32) {
        self.settle_page(page);
        self.free.push(page);
    }

    /// Finishes the gathers in flight if one of them reads `page`, which is about to be reused.
    fn settle_page(&mut self, page: u32) {
        if self.gathering[page as usize] {
            self.finish_gathers(true);
        }
    }

    /// Serves one request alone: admits it, then runs steps until it ends; `on_event` sees the
    /// prefill passes, the prefill result and each generated token, and returns false to stop
    /// early (the client went away). Requests admitted before it share its steps.
    pub async fn generate(
        &mut self,
        req: &GenRequest,
        on_event: &mut (dyn FnMut(WorkerEvent) -> bool + Send),
    ) -> Result<GenOutcome, WorkerError> {
        super::serve_alone(self, req, on_event).await
    }

    /// Takes a request into the batch: checks it, hashes its prompt and brings its cached prefix
    /// into G1 (reads from G3 are awaited here); the next step computes the rest. A request that
    /// cannot be served is answered at once.
    pub async fn admit(&mut self, ticket: Ticket) {
        let b = self.tiers.block_tokens;
        let req = &ticket.req;
        let len = req.prompt.len();
        match self.tiers.pipeline().admit(len, req.max_tokens, self.pages) {
            Ok(()) => {}
            Err(Refusal::EmptyPrompt) => return ticket.finish(Err(WorkerError::EmptyPrompt)),
            Err(Refusal::TooLong { needed }) => {
                let (prompt, max_tokens, capacity) = (len, req.max_tokens, self.pages);
                return ticket.finish(Err(WorkerError::TooLong { prompt, max_tokens, needed, capacity }));
            }
        }
        self.admitted += 1;
        let (blocks, rng) = (Vec::with_capacity(len.div_ceil(b) + 1), SeededRng::new(req.seed));
        let start = tokio::time::Instant::now();
        let run = Run::new(ticket, self.admitted, self.tiers.salt, b, start);
        let mut seq = Seq { run, blocks, rng, preempted_at: None };
        // Without room in G1 beside the batch for its prompt, it waits for some (before any later
        // request), rather than fail for want of a page.
        let shared = batch::shared_prefix(&self.registry, &seq.run.chain);
        if !batch::may_resume(len, shared, self.running.len(), self.available_pages(), b) {
            return self.wait_for_room(seq);
        }
        // A panic from here on finds the request in the batch, where the restart fails it.
        let onboarded = AssertUnwindSafe(async {
            #[cfg(feature = "failpoints")]
            if seq.run.req().max_tokens == FAILPOINT_PANIC_MAX_TOKENS {
                panic!("failpoint: injected worker panic");
            }
            self.onboard(&mut seq, true).await
        })
        .catch_unwind()
        .await;
        match onboarded {
            Ok(Ok(())) => self.running.push(seq),
            // The batch took the pages meanwhile: wait for some to come back.
            Ok(Err(WorkerError::Overloaded)) if !self.running.is_empty() => self.wait_for_room(seq),
            Ok(Err(e)) => {
                self.release(&mut seq);
                seq.run.ticket.finish(Err(e));
            }
            Err(panic) => {
                self.running.push(seq);
                std::panic::resume_unwind(panic);
            }
        }
    }

    /// Ends the request admitted last at once (its caller stopped listening).
    pub fn cancel_last(&mut self) {
        let order = self.admitted;
        if let Some(i) = self.running.iter().position(|s| s.run.order == order) {
            let seq = self.running.remove(i);
            self.end(seq, Ok(Finish::Stop));
        } else if let Some(i) = self.preempted.iter().position(|s| s.run.order == order) {
            let seq = self.preempted.remove(i);
            self.end(seq, Ok(Finish::Stop));
        }
    }

    /// One engine step: preempted (or waiting) requests resume when G1 has room for them; requests whose
    /// caller went away end; then one forward pass computes the pending decode token of every
    /// running request and prefill chunks of the others (in priority, then arrival order) within
    /// the step's token budget. A request that needs a G1 page when none is free makes the
    /// lowest-priority request yield its pages ([`Self::preempt`]). Each request then reports
    /// what the step did for it, and those that finished leave the batch.
    pub async fn step(&mut self) {
        self.resume_preempted().await;
        let mut running = std::mem::take(&mut self.running);
        let b = self.tiers.block_tokens;
        let members: Vec<batch::Member> = running.iter().map(|s| s.run.member()).collect();
        let plan =
            batch::plan_step(&members, self.prefill_chunk, b, &mut StepPages { worker: self, running: &mut running });
        let mut ended: Vec<(usize, Result<Finish, WorkerError>)> =
            plan.leaving.iter().map(|&(i, why)| (i, why.end())).collect();
        let (plan, yielded) = (plan.chunks, plan.yielded);
        let tables: Vec<Vec<u32>> =
            plan.iter().map(|&(i, _)| running[i].blocks.iter().map(|s| s.page).collect()).collect();
        let chunks: Vec<Chunk<'_>> = plan
            .iter()
            .zip(&tables)
            .map(|(&(i, take), table)| {
                let s = &running[i].run;
                Chunk { tokens: &s.tokens[s.computed..s.computed + take], start: s.computed, block_table: table }
            })
            .collect();
        let logits =
            if chunks.is_empty() { Ok(None) } else { self.model.forward_batch(&mut self.kv, &chunks, b).map(Some) };
        drop(chunks);
        let load_failed = self.finish_loads(&mut running);
        match logits {
            Ok(logits) => {
                for (&(i, take), logits) in plan.iter().zip(logits.iter().flat_map(|l| l.rows())) {
                    if let Some(e) =
                        load_failed.iter().find(|(order, _)| *order == running[i].run.order).map(|(_, e)| e)
                    {
                        ended.push((i, Err(WorkerError::Step(e.clone()))));
                        continue;
                    }
                    if let Some(end) = self.advance(&mut running[i], take, logits) {
                        ended.push((i, end));
                    }
                }
            }
            Err(e) => {
                let e = e.to_string();
                ended.extend(plan.iter().map(|&(i, _)| (i, Err(WorkerError::Step(e.clone())))));
            }
        }
        self.gather_pending();
        self.maybe_flush_batches();
        // Those that ended leave, and those that yielded wait to resume; the rest stay in order.
        let mut leaving = Vec::new();
        for (seq, fate) in std::mem::take(&mut running).into_iter().zip(batch::fates(members.len(), ended, &yielded)) {
            match fate {
                batch::Fate::Stays => running.push(seq),
                fate => leaving.push((seq, fate)),
            }
        }
        self.running = running;
        for (seq, fate) in leaving {
            match fate {
                batch::Fate::Leaves(end) => self.end(seq, end),
                _ => self.preempted.push(seq),
            }
        }
        self.preempted.sort_by_key(|s| batch::resume_key(s.run.ticket.priority, s.run.order));
    }

    /// What one step's `take` tokens and the logits after them mean for `seq`: the blocks they
    /// complete are registered and written through, and once the prompt is in, a token is
    /// sampled. `Some` when it ends.
    fn advance(&mut self, seq: &mut Seq, take: usize, logits: &[f32]) -> Option<Result<Finish, WorkerError>> {
        let b = self.tiers.block_tokens;
        for i in seq.run.advance_by(take, b) {
            let region = seq.run.region(i, b);
            self.register(i, &mut seq.blocks, &seq.run.chain, region, unix_millis(), true);
        }
        let n = match seq.run.after_step() {
            After::Prefilling => return None,
            After::End(end) => return Some(end),
            After::Token(n) => n,
        };
        if let Some((preempted, resumed)) = seq.preempted_at.take() {
            self.stats.preempted_for.push(preempted.elapsed());
            self.stats.resume_latency.push(resumed.unwrap_or(preempted).elapsed());
        }
        let rng = &mut seq.rng;
        seq.run.emit(n, |req, sequence| sample_in(logits, req.allowed.as_deref(), req.sampling, sequence, rng))
    }

    /// Frees `seq`'s G1 pages for others: its completed blocks are written through first (most
    /// are in G2 already), its references released (the blocks stay in G1 until evicted), its
    /// private pages freed. It resumes from the tiers ([`Self::resume_preempted`]).
    fn preempt(&mut self, seq: &mut Seq) {
        seq.run.ticket.span.in_scope(|| tracing::debug!(computed = seq.run.computed, "preempted"));
        self.gather_pending();
        self.finish_gathers(true);
        self.loading.retain(|l| l.order != seq.run.order);
        self.release(seq);
        seq.run.computed = 0;
        seq.preempted_at = Some((Instant::now(), None));
        self.stats.preempted += 1;
        record_preemption();
    }

    /// Resumes preempted requests, highest priority first, while G1 has room for their blocks
    /// (always the first one when nothing else runs): each brings back what the tiers kept of it
    /// (or, with [`Resume::Recompute`], nothing) and recomputes the rest.
    async fn resume_preempted(&mut self) {
        let b = self.tiers.block_tokens;
        while let Some(first) = self.preempted.first() {
            let shared = batch::shared_prefix(&self.registry, &first.run.chain);
            if !batch::may_resume(first.run.tokens.len(), shared, self.running.len(), self.available_pages(), b) {
                return;
            }
            let mut seq = self.preempted.remove(0);
            // A request that waited for room since its admission is onboarded for the first time.
            let first = !seq.run.onboarded;
            if let Some((_, resumed)) = &mut seq.preempted_at {
                *resumed = Some(Instant::now());
            }
            let loaded = match self.resume {
                Resume::Recompute if !first => Ok(()),
                _ => self.onboard(&mut seq, first).await,
            };
            match loaded {
                Ok(()) => {
                    if !first {
                        self.stats.resumed_cached_tokens += seq.run.computed;
                        self.stats.resumed_computed_tokens += seq.run.tokens.len() - seq.run.computed;
                    }
                    self.running.push(seq);
                }
                Err(WorkerError::Overloaded) if !self.running.is_empty() => return self.wait_for_room(seq),
                Err(e) => {
                    self.release(&mut seq);
                    self.end(seq, Err(e));
                }
            }
        }
    }

    /// G1 pages a newcomer may take: free ones, and those holding a block nobody references
    /// (interior ones too: their chains are evicted tail first).
    fn available_pages(&self) -> usize {
        let blocks = self.registry.stats().total();
        self.free.len() + blocks.evictable + blocks.held + blocks.interior
    }

    /// Puts `seq`, which holds no page, among the requests waiting for room in G1.
    fn wait_for_room(&mut self, mut seq: Seq) {
        self.release(&mut seq);
        self.preempted.push(seq);
        self.preempted.sort_by_key(|s| batch::resume_key(s.run.ticket.priority, s.run.order));
    }

    /// Releases `seq`'s G1 references and frees its private pages.
    fn release(&mut self, seq: &mut Seq) {
        for block in std::mem::take(&mut seq.blocks) {
            match block.registered {
                Some(hash) => drop(self.registry.release(hash)),
                None => self.free_page(block.page),
            }
        }
    }

    /// Ends `seq` and answers its caller. The turn's blocks are in G2 when it ends (the next turn
    /// may be served anywhere) and its G3 batch goes; its G1 references are released and its
    /// private pages freed. The turn's answer becomes conversation context for the next turn (an
    /// agent resends it), so its blocks are promoted to the conversation's priority and hold.
    fn end(&mut self, mut seq: Seq, end: Result<Finish, WorkerError>) {
        self.loading.retain(|l| l.order != seq.run.order);
        self.gather_pending();
        self.finish_gathers(true);
        self.send_g3_batch();
        let b = self.tiers.block_tokens;
        let now = unix_millis();
        let tiers = self.tiers.clone();
        let pipeline = tiers.pipeline();
        for (i, block) in std::mem::take(&mut seq.blocks).into_iter().enumerate() {
            let Some(hash) = block.registered else {
                self.free_page(block.page);
                continue;
            };
            let _ = self.registry.release(hash);
            let fate = pipeline.turn_end(seq.run.region(i, b), i >= seq.run.prompt_blocks, now);
            if let Some(priority) = fate.priority {
                let _ = self.registry.set_priority(hash, priority);
                if let Some(g2) = &tiers.g2 {
                    g2.promote(hash, priority);
                }
            }
            if let Some(until) = fate.hold_until {
                let _ = self.registry.hold(hash, until);
                if let Some(g2) = &tiers.g2 {
                    g2.hold(hash, until);
                }
            }
            // A leased block is held in G1 too: soft there, it is demoted to G2 under pressure.
            if let Some(until) = tiers.leases.g1_hold(hash, now) {
                let _ = self.registry.hold(hash, until);
            }
        }
        seq.run.finish(end);
    }

    /// Finds the cached prefix of `seq`'s tokens and brings it into G1: blocks in this worker's
    /// G1 are reused in place; the rest comes from G2, or from G3 (all of the run's reads in
    /// flight together, each verified) into G2 slots, and then into G1 pages in one batched
    /// scatter, which the next step waits for. A tier is used only while loading from it beats
    /// recomputing; a G3 block that fails ends the prefix there. At least the last token is left
    /// to compute, so the step has its logits. `first`: the request's admission (its hits are
    /// what it reports), not a resume after preemption.
    async fn onboard(&mut self, seq: &mut Seq, first: bool) -> Result<(), WorkerError> {
        let now = unix_millis();
        let b = self.tiers.block_tokens;
        let hashes = seq.run.chain.clone();
        let hashes = hashes.as_slice();
        let mut hits = [0usize; 4];
        let tiers = self.tiers.clone();

        // The plan (the pipeline's): where each block of the prefix comes from. G1 blocks are
        // acquired and G2 images taken as the plan finds them.
        // The peer whose G2 holds the longest prefix (from the index its feed keeps), if any.
        let remote = tiers.g4.as_ref().and_then(|g4| g4.remote.locate(hashes));
        let remote_prefix = remote.as_ref().map_or(&[][..], |(_, blocks)| &hashes[..(*blocks).min(hashes.len())]);
        let mut lookup =
            Lookup { worker: self, now, pages: Vec::new(), images: Vec::new(), remote: remote_prefix, asked: 0 };
        // A load from the peer is priced at that link's own measured rate, where it has one.
        let mut cost = tiers.cost_now();
        if let Some((link, _)) = &remote {
            link.price(&mut cost);
        }
        let sources = tiers.pipeline().plan_prefix(hashes, seq.run.tokens.len(), &cost, &mut lookup);
        let Lookup { mut pages, mut images, .. } = lookup;
        let mut plan: Vec<Source> = Vec::with_capacity(sources.len());
        let (mut pages, mut images) = (pages.drain(..), images.drain(..));
        for source in sources {
            plan.push(match source {
                pipeline::Source::G1 => Source::G1(pages.next().expect("a page per G1 block")),
                pipeline::Source::G2 => {
                    Source::Image { image: images.next().expect("an image per G2 block"), from: pipeline::Source::G2 }
                }
                pipeline::Source::G3 => Source::G3,
                pipeline::Source::G4 => Source::G4,
            });
        }

        // G3 reads, all in flight together.
        let g3_blocks: Vec<usize> = (0..plan.len()).filter(|&i| matches!(plan[i], Source::G3)).collect();
        if let (false, Some(g2), Some(g3)) = (g3_blocks.is_empty(), tiers.g2.as_ref(), tiers.g3.as_ref()) {
            let started = Instant::now();
            let reads = g3_blocks.iter().map(|&i| {
                let dst = g2.alloc(now);
                let hash = hashes[i];
                async move {
                    match dst {
                        Some(dst) => Some(g3.store.read(hash, dst).await),
                        None => None,
                    }
                }
            });
            let results = futures::future::join_all(reads).await;
            let mut read_bytes = 0;
            let mut end = plan.len();
            for (&i, result) in g3_blocks.iter().zip(results) {
                match result {
                    Some(Ok(image)) if i < end => {
                        g3.health.record_ok();
                        read_bytes += g3.store.slot_bytes();
                        plan[i] = Source::Image { image, from: pipeline::Source::G3 };
                    }
                    Some(Ok(_)) => {}
                    Some(Err(failure)) => {
                        if failure.error.kind() == "corrupt" {
                            seq.run.outcome.corrupt_blocks += 1;
                        }
                        g3.health.record_error(&failure.error);
                        record_tier_error(Tier::G3, failure.error.kind());
                        g3.forget(hashes[i]);
                        end = end.min(i);
                    }
                    None => end = end.min(i),
                }
            }
            let elapsed = started.elapsed();
            if read_bytes > 0 {
                record_transfer(Tier::G3, Tier::G2, read_bytes as u64, elapsed);
                tiers.measured.g3_read.observe(read_bytes, elapsed);
            }
            // Blocks past a failure are not part of the prefix: G1 references go back, images drop.
            for (source, &hash) in plan.drain(end..).zip(&hashes[end..]) {
                if let Source::G1(_) = source {
                    let _ = self.registry.release(hash);
                }
            }
        }

        // Peer fetches: one hold-fetch-release on the link, within the cost model's budget.
        let g4_blocks: Vec<usize> = (0..plan.len()).filter(|&i| matches!(plan[i], Source::G4)).collect();
        if let (Some(&first), Some((link, _)), true) = (g4_blocks.first(), remote.as_ref(), tiers.g2.is_some()) {
            let wanted: Vec<BlockHash> = g4_blocks.iter().map(|&i| hashes[i]).collect();
            let started = Instant::now();
            let last = g4_blocks.last().copied().unwrap_or(first);
            let deadline = started
                + fetch_budget(
                    &tiers.cost_now(),
                    first * b,
                    (last + 1) * b,
                    link.min_fetch_budget(),
                    link.request_timeout(),
                );
            let mut end = plan.len();
            let mut fetched_bytes = 0;
            let landing = tiers.clone();
            let land: Land = Box::new(move || landing.g2.as_ref()?.alloc(now));
            match link.fetch(wanted, deadline, land).await {
                Ok(blocks) => {
                    for (&i, (_, arrival)) in g4_blocks.iter().zip(blocks) {
                        let landed = match arrival {
                            Arrival::Landed { slot, bytes, .. } if of_this_layout(&tiers, &slot, bytes, hashes[i]) => {
                                fetched_bytes += bytes;
                                Some(slot)
                            }
                            Arrival::Landed { .. } => None,
                            Arrival::NoRoom | Arrival::Missing | Arrival::Skipped => None,
                            Arrival::Rejected(e) => {
                                // Verified and dropped: never handed to the engine.
                                seq.run.outcome.corrupt_blocks += 1;
                                record_corrupt_block(Tier::G4);
                                record_tier_error(Tier::G4, e.kind());
                                None
                            }
                        };
                        match landed {
                            Some(image) if i < end => plan[i] = Source::Image { image, from: pipeline::Source::G4 },
                            Some(_) => {}
                            None => end = end.min(i),
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(peer = link.addr(), error = %e, "G4 fetch failed; the prefix is recomputed from there");
                    record_tier_error(Tier::G4, e.kind());
                    if matches!(e, FetchError::Deadline) {
                        // The link moved less than this in the time: its rate is at most that, and
                        // the cost model recomputes rather than wait on it again.
                        let wanted = g4_blocks.len() * tiers.layout.image_bytes();
                        tiers.measured.g4_read.cap(wanted, started.elapsed());
                        link.measured().cap(wanted, started.elapsed());
                    }
                    end = first;
                }
            }
            let elapsed = started.elapsed();
            if fetched_bytes > 0 {
                record_transfer(Tier::G4, Tier::G2, fetched_bytes as u64, elapsed);
                // A fetch cut short moved bytes it did not land: its rate says little.
                if end == plan.len() {
                    tiers.measured.g4_read.observe(fetched_bytes, elapsed);
                    link.measured().observe(fetched_bytes, elapsed);
                }
            }
            for (source, &hash) in plan.drain(end..).zip(&hashes[end..]) {
                if let Source::G1(_) = source {
                    let _ = self.registry.release(hash);
                }
            }
        }

        // Into G1: resident blocks in place, loaded images in one scatter.
        let mut loads: Vec<(u32, SlotRef)> = Vec::new();
        let mut loaded: Vec<usize> = Vec::new();
        let reused: Vec<BlockHash> =
            plan.iter().zip(hashes).filter(|(s, _)| matches!(s, Source::G1(_))).map(|(_, h)| *h).collect();
        self.tiers.reused(&reused, now);
        let mut plan = plan.into_iter().enumerate();
        while let Some((i, source)) = plan.next() {
            match source {
                Source::G1(page) => {
                    seq.blocks.push(SeqBlock { page, registered: Some(hashes[i]) });
                    hits[0] += b;
                    self.write_reused(i, hashes, page, seq.run.region(i, b), now);
                }
                Source::Image { image, from } => {
                    let page = match self.alloc_page(now) {
                        Ok(page) => page,
                        Err(e) => {
                            self.forget_loaded(&mut seq.blocks, &loaded);
                            self.release(seq);
                            // The rest of the plan's G1 blocks were acquired by the lookup.
                            for (j, rest) in plan {
                                if let Source::G1(_) = rest {
                                    let _ = self.registry.release(hashes[j]);
                                }
                            }
                            return Err(e);
                        }
                    };
                    seq.blocks.push(SeqBlock { page, registered: None });
                    hits[from.index()] += b;
                    let region = seq.run.region(i, b);
                    self.register(i, &mut seq.blocks, hashes, region, now, false);
                    self.write_loaded(i, hashes, region, image.clone(), from, now);
                    loads.push((page, image));
                    loaded.push(i);
                }
                Source::G3 | Source::G4 => unreachable!("every G3 and G4 block was read or cut off"),
            }
        }
        if !loads.is_empty() {
            let payload = tiers.layout.payload_bytes();
            let pages: Vec<u32> = loads.iter().map(|(p, _)| *p).collect();
            let payloads: Vec<&[u8]> =
                loads.iter().map(|(_, img)| &img.as_slice()[HEADER_LEN..HEADER_LEN + payload]).collect();
            // SAFETY: the payloads lie in the images, which `self.loading` keeps (immutable, and
            // referenced so their slots are not reused) until the copies are finished or dropped.
            let started = unsafe { self.model.backend().kv_scatter_start(&mut self.kv, &pages, &payloads) };
            drop(payloads);
            let copies = match started {
                Ok(copies) => copies,
                Err(e) => {
                    self.forget_loaded(&mut seq.blocks, &loaded);
                    return Err(ModelError::from(e).into());
                }
            };
            let images = loads.into_iter().map(|(_, image)| image).collect();
            let loading = Loading { copies, images, order: seq.run.order, blocks: loaded };
            // Until the link is measured, a load runs alone and is timed.
            if tiers.g2.is_some() && tiers.measured.wants_load_sample() {
                if let Err(e) = self.finish_load(loading, &mut seq.blocks, true) {
                    return Err(WorkerError::Step(e));
                }
            } else {
                self.loading.push(loading);
            }
        }
        seq.run.computed = seq.blocks.len() * b;
        if first {
            seq.run.count_hits(hits);
        }
        Ok(())
    }

    /// Waits for one prefix's scatter (after the next step has queued its compute behind it, or
    /// alone when `sample`: then its time measures the G2 → G1 link) and releases its images.
    /// Blocks whose load failed leave G1; the error says why.
    fn finish_load(&mut self, loading: Loading<B>, seq: &mut [SeqBlock], sample: bool) -> Result<(), String> {
        let Loading { copies, images, blocks, .. } = loading;
        let elapsed = match self.model.backend().copies_wait(copies) {
            Ok(elapsed) => elapsed,
            Err(e) => {
                self.forget_loaded(seq, &blocks);
                return Err(e.to_string());
            }
        };
        let bytes = self.tiers.layout.payload_bytes() * images.len();
        record_transfer(Tier::G2, Tier::G1, bytes as u64, elapsed);
        if sample {
            self.tiers.measured.observe_load(bytes, elapsed);
        }
        Ok(())
    }

    /// Waits for every scatter in flight (once a step has queued its compute behind them);
    /// answers the requests whose load failed, by order, and why.
    fn finish_loads(&mut self, running: &mut [Seq]) -> Vec<(u64, String)> {
        let mut failed = Vec::new();
        for loading in std::mem::take(&mut self.loading) {
            let order = loading.order;
            let Some(seq) = running.iter_mut().find(|s| s.run.order == order) else { continue };
            if let Err(e) = self.finish_load(loading, &mut seq.blocks, false) {
                failed.push((order, e));
            }
        }
        failed
    }

    /// Takes the loaded blocks at `blocks` of the sequence out of G1: their load failed, so their
    /// pages hold no KV. The pages become the request's private ones (freed at its end).
    fn forget_loaded(&mut self, seq: &mut [SeqBlock], blocks: &[usize]) {
        let mut gone = Vec::with_capacity(blocks.len());
        for &i in blocks {
            if let Some(hash) = seq[i].registered.take() {
                let _ = self.registry.release(hash);
                let _ = self.registry.remove(hash);
                self.by_hash.remove(&hash);
                gone.push(hash);
            }
        }
        if !gone.is_empty() {
            self.tiers.observer.removed(self.site(), &gone);
        }
    }

    /// Registers complete block `i` of the sequence in G1 (referenced by this request); a
    /// `computed` block is queued for its gather to G2 (a loaded one has its image already:
    /// [`Self::write_loaded`] handles those).
    fn register(
        &mut self,
        i: usize,
        seq: &mut [SeqBlock],
        hashes: &[BlockHash],
        region: RegionKind,
        now: Millis,
        computed: bool,
    ) {
        let hash = hashes[i];
        let parent = i.checked_sub(1).map(|p| hashes[p]);
        let meta = self.tiers.meta(parent, region);
        match self.registry.insert(hash, meta, now) {
            Ok(Admission::Inserted { evicted }) => {
                let mut gone = Vec::with_capacity(evicted.len());
                for victim in evicted {
                    if let Some(page) = self.by_hash.remove(&victim.hash) {
                        self.free_page(page);
                        gone.push(victim.hash);
                    }
                }
                if !gone.is_empty() {
                    self.tiers.observer.removed(self.site(), &gone);
                }
                self.by_hash.insert(hash, seq[i].page);
                self.registry.acquire(hash, now).expect("just inserted");
                seq[i].registered = Some(hash);
                self.tiers.observer.stored(self.site(), parent, &[hash]);
            }
            // Present already (another sequence computed it meanwhile) or G1 refused: the page stays
            // private to this request.
            Ok(Admission::AlreadyPresent) | Err(_) => {}
        }
        let Some(g2) = self.tiers.g2.as_ref().filter(|_| computed) else { return };
        let present = Presence { g2: g2.contains(hash), g3: false };
        if self.tiers.pipeline().write_targets(region, Landed::Computed, present).g2 {
            self.gathers.push(PendingGather { hash, parent, page: seq[i].page, region, completed: Instant::now() });
        }
    }

    /// What the tiers below hold of `hash` (G2 if present, G3 if present and usable).
    fn presence(&self, hash: BlockHash) -> Presence {
        Presence {
            g2: self.tiers.g2.as_ref().is_some_and(|g2| g2.contains(hash)),
            g3: self.tiers.g3.as_ref().is_some_and(|g3| g3.usable() && g3.store.contains(hash)),
        }
    }

    /// A block reused in place from G1 (in `page`). G2 is inclusive of G1: if G2 lost its copy
    /// while G1 kept the block, it is gathered back as a computed block is (and goes on to G3
    /// from there). If its image is still in G2 and G3 lacks it (its write was skipped while the
    /// disk was behind), it goes to G3 now.
    fn write_reused(&mut self, i: usize, hashes: &[BlockHash], page: u32, region: RegionKind, now: Millis) {
        let tiers = self.tiers.clone();
        let Some(g2) = tiers.g2.as_ref() else { return };
        let targets = tiers.pipeline().write_targets(region, Landed::Reused, self.presence(hashes[i]));
        let parent = i.checked_sub(1).map(|p| hashes[p]);
        if targets.g2 {
            self.gathers.push(PendingGather { hash: hashes[i], parent, page, region, completed: Instant::now() });
            return;
        }
        if !targets.g3 || tiers.g3.is_none() {
            return;
        }
        if let Some(image) = g2.peek(hashes[i]) {
            self.queue_g3(hashes[i], parent, region, image, Instant::now(), now);
        }
    }

    /// A block just loaded from below: G2 keeps the image it came in (a block read from G3 is
    /// admitted to G2), and a block that came from G2 goes on to G3 if G3 lacks it.
    fn write_loaded(
        &mut self,
        i: usize,
        hashes: &[BlockHash],
        region: RegionKind,
        image: SlotRef,
        from: pipeline::Source,
        now: Millis,
    ) {
        let tiers = self.tiers.clone();
        let parent = i.checked_sub(1).map(|p| hashes[p]);
        let targets = tiers.pipeline().write_targets(region, Landed::Loaded(from), self.presence(hashes[i]));
        if let Some(g2) = tiers.g2.as_ref().filter(|_| targets.g2)
            && g2.admit(hashes[i], tiers.meta(parent, region), image.clone(), now)
        {
            tiers.arrived(TierName::G2, hashes[i], region, now);
        }
        if targets.g3 {
            self.queue_g3(hashes[i], parent, region, image, Instant::now(), now);
        }
    }

    /// Starts gathering every pending block from G1 into G2 slots, in one batched copy on the copy
    /// engine; [`Self::finish_gathers`] seals the images, admits them to G2 and queues them for G3.
    fn gather_pending(&mut self) {
        self.finish_gathers(false);
        if self.gathers.is_empty() {
            return;
        }
        let tiers = self.tiers.clone();
        let Some(g2) = tiers.g2.as_ref() else {
            self.gathers.clear();
            return;
        };
        let now = unix_millis();
        let pending = std::mem::take(&mut self.gathers);
        let mut blocks = Vec::with_capacity(pending.len());
        let mut slots = Vec::with_capacity(pending.len());
        // G2 cannot take more once an allocation fails: the rest stays in G1 only, counted.
        let mut skipped = 0;
        for p in pending {
            if g2.contains(p.hash) {
                continue;
            }
            if skipped == 0
                && let Some(slot) = g2.alloc(now)
            {
                slots.push(slot);
                blocks.push(p);
                continue;
            }
            skipped += 1;
        }
        if skipped > 0 {
            record_writes_skipped(Tier::G2, skipped as u64);
        }
        if blocks.is_empty() {
            return;
        }
        let pages: Vec<u32> = blocks.iter().map(|p| p.page).collect();
        let mut payloads: Vec<&mut [u8]> =
            slots.iter_mut().map(|s| payload_mut(s.as_mut_slice(), &tiers.layout)).collect();
        // SAFETY: the slots go into `self.copying` with the copies and nobody else holds them; the
        // pages are marked in `self.gathering`, which keeps them from being freed or reused (and so
        // written) until the copies are finished.
        let started = unsafe { self.model.backend().kv_gather_start(&self.kv, &pages, &mut payloads) };
        drop(payloads);
        match started {
            Ok(copies) => {
                for &page in &pages {
                    self.gathering[page as usize] = true;
                }
                self.copying.push(Copying { copies, blocks, slots });
                // Without a copy engine they are done already.
                self.finish_gathers(false);
            }
            Err(e) => {
                tracing::warn!(error = %e, blocks = blocks.len(), "G1 → G2 gather failed; the blocks stay in G1 only")
            }
        }
    }

    /// Finishes the gathers in flight, oldest first: every one when `wait`, otherwise those done.
    /// Each finished block's image is sealed, admitted to G2 and queued for G3.
    fn finish_gathers(&mut self, wait: bool) {
        while let Some(first) = self.copying.first() {
            if !wait && !self.model.backend().copies_done(&first.copies).unwrap_or(true) {
                return;
            }
            let Copying { copies, blocks, slots } = self.copying.remove(0);
            let waited = self.model.backend().copies_wait(copies);
            for p in &blocks {
                self.gathering[p.page as usize] = false;
            }
            match waited {
                Ok(elapsed) => self.admit_gathered(blocks, slots, elapsed),
                Err(e) => {
                    tracing::warn!(error = %e, blocks = blocks.len(), "G1 → G2 gather failed; the blocks stay in G1 only")
                }
            }
        }
    }

    /// Seals gathered images, admits them to G2 and queues them for G3.
    fn admit_gathered(&mut self, blocks: Vec<PendingGather>, slots: Vec<SlotMut>, elapsed: Duration) {
        let tiers = self.tiers.clone();
        let Some(g2) = tiers.g2.as_ref() else {
            return;
        };
        let now = unix_millis();
        record_transfer(Tier::G1, Tier::G2, (tiers.layout.payload_bytes() * blocks.len()) as u64, elapsed);
        for (p, mut slot) in blocks.into_iter().zip(slots) {
            let policy = tiers.retention.policy(p.region);
            let spec = ImageSpec {
                hash: p.hash,
                parent: p.parent,
                salt: tiers.salt,
                layout: tiers.layout,
                token_count: tiers.block_tokens as u16,
                retention: RetentionMeta {
                    region: p.region,
                    priority: policy.priority,
                    retain_until_ms: 0,
                    last_access_ms: now,
                    access_count: 1,
                },
            };
            seal(slot.as_mut_slice(), &spec);
            let image = slot.freeze();
            if g2.admit(p.hash, tiers.meta(p.parent, p.region), image.clone(), now) {
                tiers.arrived(TierName::G2, p.hash, p.region, now);
            }
            record_write_lag(Tier::G2, p.completed.elapsed());
            self.queue_g3(p.hash, p.parent, p.region, image, p.completed, now);
        }
    }

    /// Queues a sealed image for G3 if its region goes that far and G3 lacks it.
    fn queue_g3(
        &mut self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        region: RegionKind,
        image: SlotRef,
        completed: Instant,
        now: Millis,
    ) {
        let tiers = self.tiers.clone();
        let Some(g3) = tiers.g3.as_ref().filter(|g3| g3.usable()) else {
            return;
        };
        // Whether the block goes to G3 at all is the pipeline's call (the write-through of a
        // computed block decides it here, once its image is sealed in G2).
        let present = Presence { g2: true, g3: g3.store.contains(hash) };
        if !tiers.pipeline().write_targets(region, Landed::Computed, present).g3 {
            return;
        }
        // A disk slower than the write stream must not build an unbounded backlog: with this many
        // batches still in flight the block stays in G2 only (and is counted). A leased block
        // goes anyway: G3 is where its lease pins it.
        while self.writes.try_join_next().is_some() {}
        if self.writes.len() + usize::from(!self.g3_batch.is_empty()) >= MAX_G3_BATCHES_IN_FLIGHT
            && tiers.leases.until(hash, now).is_none()
        {
            record_write_skipped(Tier::G3);
            return;
        }
        if !g3.reserve(hash, tiers.meta(parent, region), now) {
            return;
        }
        tiers.arrived(TierName::G3, hash, region, now);
        self.g3_batch.push(PendingWrite { hash, parent, image, completed });
        if self.g3_batch.len() >= tiers.write_batch.g3_blocks {
            self.send_g3_batch();
        }
    }

    /// Flushes a batch whose oldest block waited past its bound.
    fn maybe_flush_batches(&mut self) {
        self.finish_gathers(false);
        let batch = self.tiers.write_batch;
        if self.gathers.len() >= batch.g2_blocks
            || self.gathers.first().is_some_and(|p| p.completed.elapsed() >= batch.g2_delay)
        {
            self.gather_pending();
        }
        if self.g3_batch.first().is_some_and(|p| p.completed.elapsed() >= batch.g3_delay) {
            self.send_g3_batch();
        }
    }

    /// Writes the pending G3 batch in the background, all of it in flight together; each block is
    /// acknowledged (a KV event) as its write completes.
    fn send_g3_batch(&mut self) {
        if self.g3_batch.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.g3_batch);
        let tiers = self.tiers.clone();
        self.writes.spawn(async move {
            let g3 = tiers.g3.as_ref().expect("a G3 batch needs G3");
            let started = Instant::now();
            let writes = batch.into_iter().map(|w| async move {
                let result = g3.store.write(w.image).await;
                (w.hash, w.parent, w.completed, result)
            });
            let mut bytes = 0u64;
            for (hash, parent, completed, result) in futures::future::join_all(writes).await {
                match result {
                    Ok(_) => {
                        g3.health.record_ok();
                        bytes += g3.store.slot_bytes() as u64;
                        g3.acknowledge(hash, parent);
                        record_write_lag(Tier::G3, completed.elapsed());
                    }
                    Err(e) => {
                        g3.health.record_error(&e);
                        record_tier_error(Tier::G3, e.kind());
                        tracing::warn!(%hash, error = %e, "G3 write-through failed; the block stays in G1/G2 only");
                        g3.forget(hash);
                    }
                }
            }
            if bytes > 0 {
                record_transfer(Tier::G2, Tier::G3, bytes, started.elapsed());
            }
        });
        // Reap finished writes so the set does not grow with the node's uptime.
        while self.writes.try_join_next().is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carried_hashes_are_used_only_when_named_the_workers_way() {
        let prompt: Vec<u32> = (0..70).collect();
        let want = BlockHasher::new(Salt(1), 16).hash_sequence(&prompt);
        let mut req = GenRequest::greedy(prompt.clone(), 1);
        assert_eq!(req.block_hashes(Salt(1), 16), want, "computed when none are carried");
        let wrong = BlockHasher::new(Salt(2), 16).hash_sequence(&prompt);
        req.hashes = Some(Arc::new(PromptHashes { salt: Salt(2), block_tokens: 16, hashes: wrong.clone().into() }));
        assert_eq!(req.block_hashes(Salt(2), 16), wrong, "carried ones are taken as they are");
        assert_eq!(req.block_hashes(Salt(1), 16), want, "another salt: computed again");
        assert_eq!(req.block_hashes(Salt(2), 32), BlockHasher::new(Salt(2), 32).hash_sequence(&prompt));
    }

    /// A fetch gets twice its recompute time, held within `tiers.g4.min_fetch_budget` and
    /// `request_timeout`; with no prefill rate known it gets the whole `request_timeout`.
    #[test]
    fn a_fetch_budget_is_twice_its_recompute_within_the_configured_bounds() {
        use dynamo_tiering::cost::{CostModel, Prefill};
        let ms = Duration::from_millis;
        let cost = CostModel { prefill: Prefill::rate(1_000.0), ..CostModel::unknown(32, 4096) };
        // 100 tokens at 1,000 tokens/s: 0.1 s to recompute, 0.2 s to fetch.
        assert_eq!(fetch_budget(&cost, 0, 100, ms(50), ms(2000)), ms(200));
        assert_eq!(fetch_budget(&cost, 0, 100, ms(500), ms(2000)), ms(500), "raised to the floor");
        assert_eq!(fetch_budget(&cost, 0, 100, ms(50), ms(150)), ms(150), "cut at the ceiling");
        assert_eq!(fetch_budget(&cost, 0, 100, ms(500), ms(150)), ms(150), "the ceiling wins a crossed pair");
        let unknown = CostModel::unknown(32, 4096);
        assert_eq!(fetch_budget(&unknown, 0, 100, ms(50), ms(2000)), ms(2000));
    }
}
