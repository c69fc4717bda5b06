//! The worker's engine loop: one engine, its G1 pool, onboarding of cached prefixes from G1/G2/G3,
//! prefill of the rest, decode, and write-through of every completed block to G2 and G3.
//!
//! This is the synchronous core that the WorkerActor owns; it takes one request at a time and is
//! meant to run on the worker's own thread (the forward pass is CPU- or GPU-bound work, never run
//! inside an async handler). G3 writes are spawned on the ambient tokio runtime so decode never
//! waits for the disk; [`Worker::flush`] waits for them.
//!
//! A request's life:
//! 1. hash the prompt's complete blocks; walk them while each is found in G1 (reused in place), G2
//!    or G3 (loaded: G3 → a G2 slot, verified → G1 page). A G3 block that fails verification ends
//!    the cached prefix there; the rest is recomputed. At least the last prompt token is always
//!    computed, so the engine has its logits.
//! 2. prefill the rest, in passes of at most `engine.max_batch_tokens`; register the blocks each
//!    pass completes in G1 and write them through: gathered into a sealed image in a G2 slot,
//!    admitted to G2, and written to G3 in the background, as far down as its region's retention
//!    policy allows.
//!
//! Copies between G1 and G2 run on the backend's copy engine where it has one (CUDA streams of their own):
//! a pass's gather runs while the next pass computes, and a loaded prefix's scatter runs layer by
//! layer ahead of the first pass's attention. The worker keeps the copies' buffers (G2 slots and
//! images) until they finish, and no G1 page with a gather in flight is reused before it ends.
//! 3. decode; generated blocks are registered and written through as they complete.
//! 4. release the request's G1 references and set the holds of its blocks (conversation context
//!    survives a tool-call gap this way).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dynamo_config::{RegionKind, TierName};
use dynamo_kernels::Backend;
use dynamo_kernels::model::{Llama, ModelError};
use dynamo_kernels::sampling::{Sampling, SeededRng, TokenSet, sample_in};
use dynamo_tiering::block::{BlockHash, BlockHasher, HEADER_LEN, ImageSpec, RetentionMeta, payload_mut, seal};
use dynamo_tiering::g2::{SlotMut, SlotRef};
use dynamo_tiering::registry::{Admission, Millis, PolicyKind, TierRegistry};
use tokio::task::JoinSet;

use crate::telemetry::{Tier, record_tier_error, record_transfer, record_write_lag, record_write_skipped};
use crate::tiers::{BlockSite, G2Tier, NodeTiers};

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
    /// Tokens that end generation (not emitted).
    pub stop_tokens: Vec<u32>,
    /// Sample only these ids (those the tokenizer can decode: its vocabulary may be smaller
    /// than the model's and have gaps); `None` for the model's whole vocabulary.
    pub allowed: Option<Arc<TokenSet>>,
    /// The answer's tokens, computed as usual but not sampled (the scripted engine); generation
    /// stops when they run out.
    pub forced: Option<Arc<[u32]>>,
}

impl GenRequest {
    /// Greedy decoding of at most `max_tokens` after `prompt`: no regions (all conversation), no
    /// stop tokens, the whole vocabulary.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt,
            regions: vec![],
            max_tokens,
            sampling: Sampling::Greedy,
            seed: 0,
            stop_tokens: vec![],
            allowed: None,
            forced: None,
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

/// G3 write batches one worker keeps in flight at most; beyond it write-through stops at G2.
pub const MAX_G3_BATCHES_IN_FLIGHT: usize = 8;

/// One engine with its G1 pool.
pub struct Worker<B: Backend> {
    id: usize,
    /// G1 → G2 gathers in flight on the copy engine, oldest first. Declared before the pool and
    /// the model, so a dropped worker waits for its copies before the pool goes.
    copying: Vec<Copying<B>>,
    /// The G2 → G1 scatter of the cached prefix in flight, until the first pass has run.
    loading: Option<Loading<B>>,
    model: Llama<B>,
    kv: B::Kv,
    tiers: Arc<NodeTiers>,
    pages: usize,
    policy: PolicyKind,
    free: Vec<u32>,
    by_hash: HashMap<BlockHash, u32>,
    registry: TierRegistry,
    /// Completed blocks waiting for their G1 → G2 gather.
    gathers: Vec<PendingGather>,
    /// Per G1 page, whether a gather in `copying` reads it: such a page is neither freed nor
    /// reused until the gather ends ([`Worker::free_page`], [`Worker::alloc_page`]).
    gathering: Vec<bool>,
    /// Sealed G2 images waiting for their G2 → G3 write.
    g3_batch: Vec<PendingWrite>,
    writes: JoinSet<()>,
    /// Most prompt tokens computed in one forward pass (see [`Worker::with_prefill_chunk`]).
    prefill_chunk: usize,
}

impl<B: Backend> std::fmt::Debug for Worker<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("id", &self.id).field("model", &self.model).field("pages", &self.pages).finish()
    }
}

/// Where a block of the request's sequence lives in G1.
struct SeqBlock {
    page: u32,
    /// Registered in G1 and referenced by this request.
    registered: Option<BlockHash>,
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

/// A G2 → G1 scatter in flight, the images it reads and where their blocks are in the sequence.
struct Loading<B: Backend> {
    /// Declared first: dropping it waits for the copies before the images are released.
    copies: B::Copies,
    images: Vec<SlotRef>,
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
    /// An image in G2 (`from_g3`: just read from G3 into a G2 slot).
    Image { image: SlotRef, from_g3: bool },
    /// In G3, to be read.
    G3,
}

impl<B: Backend> Worker<B> {
    /// A worker with `pages` G1 blocks evicted by `policy`.
    pub fn new(model: Llama<B>, tiers: Arc<NodeTiers>, pages: usize, policy: PolicyKind) -> Result<Self, WorkerError> {
        let kv = model.kv_pool(tiers.block_tokens, pages)?;
        Ok(Self {
            id: 0,
            copying: Vec::new(),
            loading: None,
            model,
            kv,
            tiers,
            pages,
            policy,
            free: (0..pages as u32).rev().collect(),
            by_hash: HashMap::new(),
            registry: TierRegistry::new(pages, policy),
            gathers: Vec::new(),
            gathering: vec![false; pages],
            g3_batch: Vec::new(),
            writes: JoinSet::new(),
            prefill_chunk: usize::MAX,
        })
    }

    /// Computes a prompt in forward passes of at most `tokens` tokens (`engine.max_batch_tokens`),
    /// each attending to the KV the ones before it wrote: what bounds a pass's activation memory
    /// whatever the prompt's length. By default a prompt is one pass.
    pub fn with_prefill_chunk(mut self, tokens: usize) -> Self {
        self.prefill_chunk = tokens.max(1);
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

    /// Whether `hash` is resident in this worker's G1.
    pub fn holds(&self, hash: BlockHash) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// The model.
    pub fn model(&self) -> &Llama<B> {
        &self.model
    }

    /// Forgets everything in G1, as a restarted worker would: every page is free again and no
    /// block is resident (after a panic, the pool's contents cannot be trusted). Returns how many
    /// registered blocks were dropped; they are reported cleared.
    pub fn reset(&mut self) -> usize {
        let dropped = self.by_hash.len();
        // Dropping the copies in flight waits for them; their images are not trusted either.
        self.loading = None;
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

    fn region_of(req: &GenRequest, token: usize) -> RegionKind {
        req.regions.iter().find(|(r, _)| r.contains(&token)).map(|(_, k)| *k).unwrap_or(RegionKind::Conversation)
    }

    /// Serves one request; `on_event` sees the prefill result and then each generated token, and
    /// returns false to stop early (the client went away).
    pub async fn generate(
        &mut self,
        req: &GenRequest,
        on_event: &mut (dyn FnMut(WorkerEvent) -> bool + Send),
    ) -> Result<GenOutcome, WorkerError> {
        let start_time = Instant::now();
        #[cfg(feature = "failpoints")]
        if req.max_tokens == FAILPOINT_PANIC_MAX_TOKENS {
            panic!("failpoint: injected worker panic");
        }
        let b = self.tiers.block_tokens;
        let len = req.prompt.len();
        if len == 0 {
            return Err(WorkerError::EmptyPrompt);
        }
        let needed = (len + req.max_tokens).div_ceil(b);
        if needed > self.pages {
            return Err(WorkerError::TooLong { prompt: len, max_tokens: req.max_tokens, needed, capacity: self.pages });
        }
        let now = unix_millis();
        let mut hasher = BlockHasher::new(self.tiers.salt, b);
        let hashes = hasher.hash_sequence(&req.prompt);
        let mut seq: Vec<SeqBlock> = Vec::with_capacity(len.div_ceil(b) + 1);
        let mut outcome = GenOutcome {
            tokens: Vec::new(),
            cached_tokens: 0,
            hit_tokens: [0; 4],
            prefill_tokens: 0,
            finish: Finish::Length,
            ttft: Duration::ZERO,
            corrupt_blocks: 0,
        };
        let result = self.run(req, &hashes, &mut seq, &mut outcome, now, start_time, on_event).await;
        // A scatter still in flight (the request failed before its first pass) ends here.
        self.loading = None;
        // The turn's blocks are in G2 when it ends (the next turn may be served anywhere), and its
        // G3 batch goes.
        self.gather_pending();
        self.finish_gathers(true);
        self.send_g3_batch();
        // Release the request's references whatever happened; private pages go back to the pool.
        // The turn's answer becomes conversation context for the next turn (an agent resends
        // it), so its blocks are promoted to the conversation's priority and hold.
        let end = unix_millis();
        let conversation = self.tiers.retention.policy(RegionKind::Conversation).priority;
        for (i, block) in seq.iter().enumerate() {
            match block.registered {
                Some(hash) => {
                    let _ = self.registry.release(hash);
                    let region = if i < hashes.len() {
                        Self::region_of(req, i * b)
                    } else {
                        let _ = self.registry.set_priority(hash, conversation);
                        if let Some(g2) = &self.tiers.g2 {
                            g2.promote(hash, conversation);
                        }
                        RegionKind::Conversation
                    };
                    let hold = self.tiers.retention.policy(region).hold.as_duration().as_millis() as u64;
                    if hold > 0 {
                        let _ = self.registry.hold(hash, end + hold);
                        if let Some(g2) = &self.tiers.g2 {
                            g2.hold(hash, end + hold);
                        }
                    }
                }
                None => self.free_page(block.page),
            }
        }
        result.map(|()| outcome)
    }

    #[allow(clippy::too_many_arguments)]
    async fn run(
        &mut self,
        req: &GenRequest,
        hashes: &[BlockHash],
        seq: &mut Vec<SeqBlock>,
        outcome: &mut GenOutcome,
        now: Millis,
        start_time: Instant,
        on_event: &mut (dyn FnMut(WorkerEvent) -> bool + Send),
    ) -> Result<(), WorkerError> {
        let b = self.tiers.block_tokens;
        let len = req.prompt.len();
        // 1. The cached prefix, capped so that the last prompt token is computed.
        self.onboard(req, hashes, seq, outcome, now).await?;
        let cached = seq.len() * b;
        outcome.cached_tokens = cached;
        outcome.prefill_tokens = len - cached;

        // 2. Pages for the rest of the prompt, then prefill. Pages for generated tokens are taken
        // as decode reaches them: a `max_tokens` far beyond what the answer uses reserves nothing.
        while seq.len() < len.div_ceil(b) {
            let page = self.alloc_page(now)?;
            seq.push(SeqBlock { page, registered: None });
        }
        let mut table: Vec<u32> = seq.iter().map(|s| s.page).collect();
        let mut logits = Vec::new();
        let mut pos = cached;
        for chunk in req.prompt[cached..].chunks(self.prefill_chunk) {
            logits = self.model.forward(&mut self.kv, chunk, pos, &table, b)?;
            self.finish_load(seq, false)?;
            // The blocks this pass completed leave for G2 while the next pass computes.
            let done = (pos + chunk.len()) / b;
            for i in pos / b..done.min(hashes.len()) {
                self.register(i, seq, hashes, Self::region_of(req, i * b), now, true);
            }
            self.gather_pending();
            pos += chunk.len();
            if pos < len && !on_event(WorkerEvent::Computed { tokens: pos }) {
                // Cancelled: only what was computed counts.
                outcome.prefill_tokens = pos - cached;
                outcome.finish = Finish::Stop;
                return Ok(());
            }
        }
        if !on_event(WorkerEvent::Prefilled { cached_tokens: cached, hit_tokens: outcome.hit_tokens }) {
            outcome.finish = Finish::Stop;
            return Ok(());
        }

        // 3. Decode.
        let mut rng = SeededRng::new(req.seed);
        let mut tokens_so_far = req.prompt.clone();
        let mut chain: Vec<BlockHash> = hashes.to_vec();
        for step in 0..req.max_tokens {
            let token = match &req.forced {
                Some(forced) => match forced.get(step) {
                    Some(&token) => token,
                    None => {
                        outcome.finish = Finish::Stop;
                        return Ok(());
                    }
                },
                None => sample_in(&logits, req.allowed.as_deref(), req.sampling, &mut rng),
            };
            if step == 0 {
                outcome.ttft = start_time.elapsed();
            }
            if req.stop_tokens.contains(&token) {
                outcome.finish = Finish::Stop;
                return Ok(());
            }
            outcome.tokens.push(token);
            tokens_so_far.push(token);
            if !on_event(WorkerEvent::Token(token)) {
                outcome.finish = Finish::Stop;
                return Ok(());
            }
            if step + 1 == req.max_tokens {
                break;
            }
            let pos = tokens_so_far.len() - 1;
            if pos / b == seq.len() {
                let page = self.alloc_page(unix_millis())?;
                seq.push(SeqBlock { page, registered: None });
                table.push(page);
            }
            logits = self.model.forward(&mut self.kv, &[token], pos, &table, b)?;
            // A generated block completes: it gets an identity and is written through.
            if tokens_so_far.len().is_multiple_of(b) {
                let i = tokens_so_far.len() / b - 1;
                let parent = chain.last().copied();
                let hash = BlockHasher::new(self.tiers.salt, b).hash_block(parent, &tokens_so_far[i * b..(i + 1) * b]);
                chain.push(hash);
                self.register(i, seq, &chain, RegionKind::Generated, unix_millis(), true);
            }
            self.maybe_flush_batches();
        }
        Ok(())
    }

    /// Finds the cached prefix and brings it into G1: blocks in this worker's G1 are reused in
    /// place; the rest comes from G2, or from G3 (all of the run's reads in flight together, each
    /// verified) into G2 slots, and then into G1 pages in one batched scatter. A tier is used
    /// only while loading from it beats recomputing; a G3 block that fails ends the prefix there.
    async fn onboard(
        &mut self,
        req: &GenRequest,
        hashes: &[BlockHash],
        seq: &mut Vec<SeqBlock>,
        outcome: &mut GenOutcome,
        now: Millis,
    ) -> Result<(), WorkerError> {
        let b = self.tiers.block_tokens;
        let cap = (req.prompt.len() - 1) / b;
        let tiers = self.tiers.clone();
        let image_bytes = tiers.layout.payload_bytes() + HEADER_LEN;
        let g2_bw = match tiers.cost.g2_read_bytes_per_s {
            bw if bw > 0.0 => bw,
            _ => tiers.g2.as_ref().and_then(G2Tier::measured_load_bandwidth).unwrap_or(0.0),
        };
        let g2_ok = tiers.cost.load_beats_recompute(image_bytes, g2_bw, b);
        let g3_ok = tiers.g2.is_some()
            && tiers.g3.as_ref().is_some_and(|g3| {
                let bw = match tiers.cost.g3_read_bytes_per_s {
                    bw if bw > 0.0 => bw,
                    _ => g3.measured_read_bandwidth().unwrap_or(0.0),
                };
                g3.usable() && tiers.cost.load_beats_recompute(image_bytes, bw, b)
            });

        // Plan: where each block of the prefix comes from.
        let mut plan: Vec<Source> = Vec::new();
        for &hash in hashes.iter().take(cap) {
            if let Some(&page) = self.by_hash.get(&hash) {
                self.registry.acquire(hash, now).expect("resident");
                plan.push(Source::G1(page));
                continue;
            }
            if g2_ok && let Some(image) = tiers.g2.as_ref().and_then(|g2| g2.get(hash, now)) {
                plan.push(Source::Image { image, from_g3: false });
                continue;
            }
            if g3_ok && tiers.g3.as_ref().is_some_and(|g3| g3.store.contains(hash)) {
                plan.push(Source::G3);
                continue;
            }
            break;
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
                        plan[i] = Source::Image { image, from_g3: true };
                    }
                    Some(Ok(_)) => {}
                    Some(Err(failure)) => {
                        if failure.error.kind() == "corrupt" {
                            outcome.corrupt_blocks += 1;
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
                g3.observe_read(read_bytes, elapsed);
            }
            // Blocks past a failure are not part of the prefix: G1 references go back, images drop.
            for (source, &hash) in plan.drain(end..).zip(&hashes[end..]) {
                if let Source::G1(_) = source {
                    let _ = self.registry.release(hash);
                }
            }
        }

        // Into G1: resident blocks in place, loaded images in one scatter.
        let mut loads: Vec<(u32, SlotRef)> = Vec::new();
        let mut loaded: Vec<usize> = Vec::new();
        for (i, source) in plan.into_iter().enumerate() {
            match source {
                Source::G1(page) => {
                    seq.push(SeqBlock { page, registered: Some(hashes[i]) });
                    outcome.hit_tokens[0] += b;
                }
                Source::Image { image, from_g3 } => {
                    let page = match self.alloc_page(now) {
                        Ok(page) => page,
                        Err(e) => {
                            self.forget_loaded(seq, &loaded);
                            for s in seq.drain(..) {
                                match s.registered {
                                    Some(hash) => drop(self.registry.release(hash)),
                                    None => self.free_page(s.page),
                                }
                            }
                            return Err(e);
                        }
                    };
                    seq.push(SeqBlock { page, registered: None });
                    outcome.hit_tokens[if from_g3 { 2 } else { 1 }] += b;
                    let region = Self::region_of(req, i * b);
                    self.register(i, seq, hashes, region, now, false);
                    self.write_loaded(i, hashes, region, image.clone(), from_g3, now);
                    loads.push((page, image));
                    loaded.push(i);
                }
                Source::G3 => unreachable!("every G3 block was read or cut off"),
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
                    self.forget_loaded(seq, &loaded);
                    return Err(ModelError::from(e).into());
                }
            };
            let images = loads.into_iter().map(|(_, image)| image).collect();
            self.loading = Some(Loading { copies, images, blocks: loaded });
            // Until the link is measured, a load runs alone and is timed.
            if tiers.g2.as_ref().is_some_and(G2Tier::wants_load_sample) {
                self.finish_load(seq, true)?;
            }
        }
        Ok(())
    }

    /// Waits for the prefix's scatter (after the first pass has queued its compute behind it, or
    /// alone when `sample`: then its time measures the G2 → G1 link) and releases its images.
    /// Blocks whose load failed leave G1.
    fn finish_load(&mut self, seq: &mut [SeqBlock], sample: bool) -> Result<(), WorkerError> {
        let Some(Loading { copies, images, blocks }) = self.loading.take() else {
            return Ok(());
        };
        let elapsed = match self.model.backend().copies_wait(copies) {
            Ok(elapsed) => elapsed,
            Err(e) => {
                self.forget_loaded(seq, &blocks);
                return Err(ModelError::from(e).into());
            }
        };
        let bytes = self.tiers.layout.payload_bytes() * images.len();
        record_transfer(Tier::G2, Tier::G1, bytes as u64, elapsed);
        if let Some(g2) = self.tiers.g2.as_ref().filter(|_| sample) {
            g2.observe_load(bytes, elapsed);
        }
        Ok(())
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
        if computed && self.reaches_g2(region) && !self.tiers.g2.as_ref().is_some_and(|g2| g2.contains(hash)) {
            self.gathers.push(PendingGather { hash, parent, page: seq[i].page, region, completed: Instant::now() });
        }
    }

    fn reaches_g2(&self, region: RegionKind) -> bool {
        self.tiers.g2.is_some() && self.tiers.reaches(region, TierName::G2)
    }

    /// A block just loaded from below: G2 keeps the image it came in (a block read from G3 is
    /// admitted to G2), and a block that came from G2 goes on to G3 if G3 lacks it.
    fn write_loaded(
        &mut self,
        i: usize,
        hashes: &[BlockHash],
        region: RegionKind,
        image: SlotRef,
        from_g3: bool,
        now: Millis,
    ) {
        let tiers = self.tiers.clone();
        let parent = i.checked_sub(1).map(|p| hashes[p]);
        if let Some(g2) = tiers.g2.as_ref().filter(|_| from_g3 && tiers.reaches(region, TierName::G2)) {
            g2.admit(hashes[i], tiers.meta(parent, region), image.clone(), now);
        }
        if !from_g3 {
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
        for p in pending {
            if g2.contains(p.hash) {
                continue;
            }
            match g2.alloc(now) {
                Some(slot) => {
                    slots.push(slot);
                    blocks.push(p);
                }
                // G2 cannot take more now; the rest stays in G1 only.
                None => break,
            }
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
            g2.admit(p.hash, tiers.meta(p.parent, p.region), image.clone(), now);
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
        let Some(g3) = tiers.g3.as_ref().filter(|g3| g3.usable() && tiers.reaches(region, TierName::G3)) else {
            return;
        };
        if g3.store.contains(hash) {
            return;
        }
        // A disk slower than the write stream must not build an unbounded backlog: with this many
        // batches still in flight the block stays in G2 only (and is counted).
        while self.writes.try_join_next().is_some() {}
        if self.writes.len() + usize::from(!self.g3_batch.is_empty()) >= MAX_G3_BATCHES_IN_FLIGHT {
            record_write_skipped(Tier::G3);
            return;
        }
        if !g3.reserve(hash, tiers.meta(parent, region), now) {
            return;
        }
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
