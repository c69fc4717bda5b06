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
//! 2. prefill the rest; register every newly completed block in G1 and write it through: gathered
//!    into a sealed image in a G2 slot, admitted to G2, and written to G3 in the background, as far
//!    down as its region's retention policy allows.
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
use dynamo_kernels::sampling::{Sampling, SeededRng, sample};
use dynamo_tiering::block::{BlockHash, BlockHasher, HEADER_LEN, ImageSpec, RetentionMeta, payload_mut, seal};
use dynamo_tiering::g2::SlotRef;
use dynamo_tiering::registry::{Admission, Millis, PolicyKind, TierRegistry};
use tokio::task::JoinSet;

use crate::tiers::NodeTiers;

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
    /// Sample only among token ids below this (the tokenizer's vocabulary, when the model's is
    /// larger); 0 for the whole vocabulary.
    pub vocab_limit: usize,
}

/// What a request reports while it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkerEvent {
    /// The prompt is in G1: `cached_tokens` were reused or loaded instead of computed.
    Prefilled {
        /// Prompt tokens not computed.
        cached_tokens: usize,
        /// Of those, per tier: g1, g2, g3.
        hit_tokens: [usize; 3],
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
    /// Of those, per tier: g1, g2, g3.
    pub hit_tokens: [usize; 3],
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
    /// The worker panicked while serving the request; it was reset (its G1 blocks dropped).
    #[error("the worker failed while serving this request and was restarted: {0}")]
    Panicked(String),
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
        }
    }
}

/// With the `failpoints` feature, a request for exactly this many tokens panics the worker (tests
/// of supervision only; never compiled into a release build without the feature).
#[cfg(feature = "failpoints")]
pub const FAILPOINT_PANIC_MAX_TOKENS: usize = 31_337;

fn unix_millis() -> Millis {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// One engine with its G1 pool.
pub struct Worker<B: Backend> {
    model: Llama<B>,
    kv: B::Kv,
    tiers: Arc<NodeTiers>,
    pages: usize,
    policy: PolicyKind,
    free: Vec<u32>,
    by_hash: HashMap<BlockHash, u32>,
    registry: TierRegistry,
    writes: JoinSet<()>,
}

impl<B: Backend> std::fmt::Debug for Worker<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("model", &self.model).field("pages", &self.pages).finish()
    }
}

/// Where a block of the request's sequence lives in G1.
struct SeqBlock {
    page: u32,
    /// Registered in G1 and referenced by this request.
    registered: Option<BlockHash>,
}

impl<B: Backend> Worker<B> {
    /// A worker with `pages` G1 blocks evicted by `policy`.
    pub fn new(model: Llama<B>, tiers: Arc<NodeTiers>, pages: usize, policy: PolicyKind) -> Result<Self, WorkerError> {
        let kv = model.kv_pool(tiers.block_tokens, pages)?;
        Ok(Self {
            model,
            kv,
            tiers,
            pages,
            policy,
            free: (0..pages as u32).rev().collect(),
            by_hash: HashMap::new(),
            registry: TierRegistry::new(pages, policy),
            writes: JoinSet::new(),
        })
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
    /// registered blocks were dropped, to be reported removed.
    pub fn reset(&mut self) -> usize {
        let dropped = self.by_hash.len();
        self.free = (0..self.pages as u32).rev().collect();
        self.by_hash.clear();
        self.registry = TierRegistry::new(self.pages, self.policy);
        dropped
    }

    /// Waits for every background G3 write started so far.
    pub async fn flush(&mut self) {
        while self.writes.join_next().await.is_some() {}
    }

    fn alloc_page(&mut self, now: Millis) -> Result<u32, WorkerError> {
        if let Some(page) = self.free.pop() {
            return Ok(page);
        }
        let victim = self.registry.evict(1, now).pop().ok_or(WorkerError::Overloaded)?;
        Ok(self.by_hash.remove(&victim.hash).expect("a registered block has a page"))
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
        let mut seq: Vec<SeqBlock> = Vec::with_capacity(needed);
        let mut outcome = GenOutcome {
            tokens: Vec::new(),
            cached_tokens: 0,
            hit_tokens: [0; 3],
            prefill_tokens: 0,
            finish: Finish::Length,
            ttft: Duration::ZERO,
            corrupt_blocks: 0,
        };
        let result = self.run(req, &hashes, &mut seq, &mut outcome, now, start_time, on_event).await;
        // Release the request's references whatever happened; private pages go back to the pool.
        let end = unix_millis();
        for (i, block) in seq.iter().enumerate() {
            match block.registered {
                Some(hash) => {
                    let _ = self.registry.release(hash);
                    let region = if i < hashes.len() { Self::region_of(req, i * b) } else { RegionKind::Generated };
                    let hold = self.tiers.retention.policy(region).hold.as_duration().as_millis() as u64;
                    if hold > 0 {
                        let _ = self.registry.hold(hash, end + hold);
                        if let Some(g2) = &self.tiers.g2 {
                            g2.hold(hash, end + hold);
                        }
                    }
                }
                None => self.free.push(block.page),
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
        let cap = (len - 1) / b;
        for (i, &hash) in hashes.iter().enumerate().take(cap) {
            if let Some(&page) = self.by_hash.get(&hash) {
                self.registry.acquire(hash, now).expect("resident");
                seq.push(SeqBlock { page, registered: Some(hash) });
                outcome.hit_tokens[0] += b;
                continue;
            }
            let Some((image, tier)) = self.find_below(hash, now, outcome).await else { break };
            let page = self.alloc_page(now)?;
            let payload = &image.as_slice()[HEADER_LEN..HEADER_LEN + self.tiers.layout.payload_bytes()];
            self.model.backend().kv_scatter(&mut self.kv, &[page], &[payload]).map_err(ModelError::from)?;
            seq.push(SeqBlock { page, registered: None });
            self.register(seq.len() - 1, seq, hashes, Self::region_of(req, i * b), now, Some(image));
            outcome.hit_tokens[tier] += b;
        }
        let cached = seq.len() * b;
        outcome.cached_tokens = cached;
        outcome.prefill_tokens = len - cached;

        // 2. Pages for the rest of the prompt and the generation, then prefill.
        let total_blocks = (len + req.max_tokens).div_ceil(b);
        while seq.len() < total_blocks {
            let page = self.alloc_page(now)?;
            seq.push(SeqBlock { page, registered: None });
        }
        let table: Vec<u32> = seq.iter().map(|s| s.page).collect();
        let mut logits = self.model.forward(&mut self.kv, &req.prompt[cached..], cached, &table, b)?;
        for i in cached / b..hashes.len() {
            self.register(i, seq, hashes, Self::region_of(req, i * b), now, None);
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
            let allowed = if req.vocab_limit == 0 { &logits[..] } else { &logits[..req.vocab_limit.min(logits.len())] };
            let token = sample(allowed, req.sampling, &mut rng);
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
            logits = self.model.forward(&mut self.kv, &[token], pos, &table, b)?;
            // A generated block completes: it gets an identity and is written through.
            if tokens_so_far.len().is_multiple_of(b) {
                let i = tokens_so_far.len() / b - 1;
                let parent = chain.last().copied();
                let hash = BlockHasher::new(self.tiers.salt, b).hash_block(parent, &tokens_so_far[i * b..(i + 1) * b]);
                chain.push(hash);
                self.register(i, seq, &chain, RegionKind::Generated, unix_millis(), None);
            }
        }
        Ok(())
    }

    /// Looks a block up in G2, then G3 (loading it into a verified G2 slot). Returns the image and
    /// the tier index (1: G2, 2: G3).
    async fn find_below(&mut self, hash: BlockHash, now: Millis, outcome: &mut GenOutcome) -> Option<(SlotRef, usize)> {
        let g2 = self.tiers.g2.as_ref()?;
        if let Some(slot) = g2.get(hash, now) {
            return Some((slot, 1));
        }
        let g3 = self.tiers.g3.as_ref()?;
        if !g3.store.contains(hash) {
            return None;
        }
        let dst = g2.alloc(now)?;
        match g3.store.read(hash, dst).await {
            Ok(image) => Some((image, 2)),
            Err(failure) => {
                if failure.error.kind() == "corrupt" {
                    outcome.corrupt_blocks += 1;
                }
                g3.forget(hash);
                None
            }
        }
    }

    /// Registers complete block `i` of the sequence in G1 (referenced by this request) and writes
    /// it through to G2 and G3. `image` is the block's image when it was just loaded from below.
    fn register(
        &mut self,
        i: usize,
        seq: &mut [SeqBlock],
        hashes: &[BlockHash],
        region: RegionKind,
        now: Millis,
        image: Option<SlotRef>,
    ) {
        let hash = hashes[i];
        let parent = i.checked_sub(1).map(|p| hashes[p]);
        let meta = self.tiers.meta(parent, region);
        match self.registry.insert(hash, meta, now) {
            Ok(Admission::Inserted { evicted }) => {
                for victim in evicted {
                    if let Some(page) = self.by_hash.remove(&victim.hash) {
                        self.free.push(page);
                    }
                }
                self.by_hash.insert(hash, seq[i].page);
                self.registry.acquire(hash, now).expect("just inserted");
                seq[i].registered = Some(hash);
            }
            // Present already (another sequence computed it meanwhile) or G1 refused: the page stays
            // private to this request.
            Ok(Admission::AlreadyPresent) | Err(_) => {}
        }
        self.write_through(hash, parent, seq[i].page, region, now, image);
    }

    fn write_through(
        &mut self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        page: u32,
        region: RegionKind,
        now: Millis,
        loaded: Option<SlotRef>,
    ) {
        let tiers = self.tiers.clone();
        let Some(g2) = tiers.g2.as_ref().filter(|_| tiers.reaches(region, TierName::G2)) else { return };
        let meta = tiers.meta(parent, region);
        let image = match loaded {
            Some(image) => image,
            None => {
                if g2.contains(hash) {
                    return;
                }
                let Some(mut slot) = g2.alloc(now) else { return };
                let payload = payload_mut(slot.as_mut_slice(), &tiers.layout);
                if self.model.backend().kv_gather(&self.kv, &[page], &mut [payload]).is_err() {
                    return;
                }
                let policy = tiers.retention.policy(region);
                let spec = ImageSpec {
                    hash,
                    parent,
                    salt: tiers.salt,
                    layout: tiers.layout,
                    token_count: tiers.block_tokens as u16,
                    retention: RetentionMeta {
                        region,
                        priority: policy.priority,
                        retain_until_ms: 0,
                        last_access_ms: now,
                        access_count: 1,
                    },
                };
                seal(slot.as_mut_slice(), &spec);
                slot.freeze()
            }
        };
        g2.admit(hash, meta, image.clone(), now);
        let Some(g3) = tiers.g3.as_ref().filter(|_| tiers.reaches(region, TierName::G3)) else { return };
        if g3.store.contains(hash) || !g3.reserve(hash, meta, now) {
            return;
        }
        let tiers = tiers.clone();
        self.writes.spawn(async move {
            let g3 = tiers.g3.as_ref().expect("checked above");
            if let Err(e) = g3.store.write(image).await {
                tracing::warn!(%hash, error = %e, "G3 write-through failed; the block stays in G1/G2 only");
                g3.forget(hash);
            }
        });
        // Reap finished writes so the set does not grow with the node's uptime.
        while self.writes.try_join_next().is_some() {}
    }
}
