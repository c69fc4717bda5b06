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

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dynamo_config::{PerTier, RegionKind, TierName};
use dynamo_kernels::Backend;
use dynamo_kernels::model::{Chunk, Llama, ModelError};
use dynamo_kernels::sampling::{SeededRng, sample_in};
use dynamo_tiering::block::{
    BlockHash, BlockMap, HEADER_LEN, ImageHeader, ImageSpec, RetentionMeta, payload_mut, seal,
};
use dynamo_tiering::g2::{SlotMut, SlotRef};
use dynamo_tiering::pipeline::{self, Landed};
use dynamo_tiering::registry::{Admission, Millis, PolicyKind, TierRegistry};
use futures::FutureExt;
use tokio::task::JoinSet;

use super::engine_core::{Driver, EngineCore, Sequence, end_block};
use super::run::{After, Run};
use super::{Finish, GenOutcome, GenRequest, Ticket, WorkerError, WorkerEvent, batch, unix_millis};

use crate::leases::LeasedTiers;
use crate::peer::{Arrival, FetchError, Land};
use crate::telemetry::{
    record_corrupt_block, record_preemption, record_tier_error, record_transfer, record_write_lag,
    record_writes_skipped,
};
use crate::tier_store::TierStore;
use crate::tiers::{BlockSite, NodeTiers, WriteTicket};

mod onboard;
mod write_through;

use write_through::*;

/// Requests one worker runs at once unless configured (`engine.max_running_requests`).
pub const DEFAULT_MAX_RUNNING: usize = 64;

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
    /// How a preempted request comes back.
    resume: Resume,
    /// Its batch: the requests running and waiting for room, and what each step does.
    core: EngineCore<Seq>,
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

impl Sequence for Seq {
    fn run(&self) -> &Run {
        &self.run
    }
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

/// The reference worker drives the engine core: its pages are real G1 pages, and a request's end
/// writes its turn through.
impl<B: Backend> Driver<Seq> for Worker<B> {
    fn core(&mut self) -> &mut EngineCore<Seq> {
        &mut self.core
    }

    fn grow(&mut self, seq: &mut Seq, blocks: usize) -> bool {
        while seq.blocks.len() < blocks {
            match self.alloc_page(unix_millis()) {
                Ok(page) => seq.blocks.push(SeqBlock { page, registered: None }),
                Err(_) => return false,
            }
        }
        true
    }

    fn preempt(&mut self, seq: &mut Seq) {
        Worker::preempt(self, seq);
    }

    fn release(&mut self, seq: &mut Seq) {
        Worker::release(self, seq);
    }

    fn end(&mut self, seq: Seq, end: Result<Finish, WorkerError>) {
        Worker::end(self, seq, end);
    }
}

impl<B: Backend> Worker<B> {
    /// A worker with `pages` G1 blocks evicted by `policy`.
    pub fn new(model: Llama<B>, tiers: Arc<NodeTiers>, pages: usize, policy: PolicyKind) -> Result<Self, WorkerError> {
        let block_tokens = tiers.block_tokens;
        let kv = model.kv_pool(block_tokens, pages)?;
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
            resume: Resume::Load,
            core: EngineCore::new(block_tokens),
            stats: PreemptionStats::default(),
        })
    }

    /// Computes at most `tokens` tokens per step (`engine.max_batch_tokens`): the decode tokens of
    /// every running request, then prefill chunks of the others within what is left. A long
    /// prompt is computed over several steps, each attending to the KV the ones before it wrote:
    /// what bounds a step's activation memory whatever the prompts' lengths. By default a step
    /// takes everything.
    pub fn with_prefill_chunk(mut self, tokens: usize) -> Self {
        self.core.set_budget(tokens);
        self
    }

    /// Runs at most `requests` requests at once (`engine.max_running_requests`).
    pub fn with_max_running(mut self, requests: usize) -> Self {
        self.core.set_max_running(requests);
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
        self.core.len()
    }

    /// Whether another request may join the batch now: below the limit, and nobody waits to
    /// resume.
    pub fn has_room(&self) -> bool {
        self.core.has_room()
    }

    /// Fails every request in the batch with [`WorkerError::Panicked`]`(why)` (their pages are
    /// not given back: a [`Self::reset`] follows).
    pub fn abort(&mut self, why: &str) {
        for seq in self.core.drain() {
            seq.run.ticket.finish(Err(WorkerError::Panicked(why.to_string())));
        }
    }

    /// Forgets everything in G1, as a restarted worker would: every page is free again and no
    /// block is resident (after a panic, the pool's contents cannot be trusted). Requests still
    /// in the batch are answered "restarting". Returns how many registered blocks were dropped;
    /// they are reported cleared.
    pub fn reset(&mut self) -> usize {
        self.core.drain().for_each(drop);
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
        let tiers = self.tiers.clone();
        let start = tokio::time::Instant::now();
        let Some(run) = self.core.admit(ticket, &tiers.pipeline(), self.pages, tiers.salt, start) else { return };
        let blocks = Vec::with_capacity(run.tokens.len().div_ceil(tiers.block_tokens) + 1);
        let rng = SeededRng::new(run.req().seed.unwrap_or(0));
        let mut seq = Seq { run, blocks, rng, preempted_at: None };
        // Without room in G1 beside the batch for its prompt, it waits for some (before any later
        // request), rather than fail for want of a page.
        let shared = batch::shared_prefix(&self.registry, &seq.run.chain);
        if !self.core.may_enter(&seq.run, shared, self.available_pages()) {
            return self.wait_for_room(seq);
        }
        // A panic from here on finds the request in the batch, where the restart fails it.
        let onboarded = AssertUnwindSafe(async {
            // Supervision's tests panic here (`FAILPOINTS=worker-admit=1*panic`).
            fail::fail_point!("worker-admit");
            self.onboard(&mut seq, true).await
        })
        .catch_unwind()
        .await;
        match onboarded {
            Ok(loaded) => {
                self.entered(seq, loaded);
            }
            Err(panic) => {
                self.core.keep_for_restart(seq);
                std::panic::resume_unwind(panic);
            }
        }
    }

    /// Ends the request admitted last at once (its caller stopped listening).
    pub fn cancel_last(&mut self) {
        Driver::cancel_last(self);
    }

    /// One engine step: preempted (or waiting) requests resume when G1 has room for them; requests whose
    /// caller went away end; then one forward pass computes the pending decode token of every
    /// running request and prefill chunks of the others (in priority, then arrival order) within
    /// the step's token budget. A request that needs a G1 page when none is free makes the
    /// lowest-priority request yield its pages ([`Self::preempt`]). Each request then reports
    /// what the step did for it, and those that finished leave the batch.
    pub async fn step(&mut self) {
        self.resume_preempted().await;
        let b = self.tiers.block_tokens;
        let mut step = self.core.begin_step();
        step.plan(self);
        let (plan, running) = (std::mem::take(&mut step.chunks), &mut step.running);
        let mut ended = Vec::new();
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
        let load_failed = self.finish_loads(running);
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
        for (i, end) in ended {
            step.ended(i, end);
        }
        for (seq, end) in self.core.end_step(step) {
            self.end(seq, end);
        }
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
        loop {
            let (registry, available) = (&self.registry, self.available_pages());
            let Some(mut seq) = self.core.next_to_resume(|chain| batch::shared_prefix(registry, chain), available)
            else {
                return;
            };
            // A request that waited for room since its admission is onboarded for the first time.
            let first = !seq.run.onboarded;
            if let Some((_, resumed)) = &mut seq.preempted_at {
                *resumed = Some(Instant::now());
            }
            let loaded = match self.resume {
                Resume::Recompute if !first => Ok(()),
                _ => self.onboard(&mut seq, first).await,
            };
            if loaded.is_ok() && !first {
                self.stats.resumed_cached_tokens += seq.run.computed;
                self.stats.resumed_computed_tokens += seq.run.tokens.len() - seq.run.computed;
            }
            if !self.entered(seq, loaded) {
                return;
            }
        }
    }

    /// G1 pages a newcomer may take: free ones, and those holding a block nobody references
    /// (interior ones too: their chains are evicted tail first).
    fn available_pages(&self) -> usize {
        let blocks = self.registry.stats().total();
        self.free.len() + blocks.evictable + blocks.held + blocks.interior
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
        let now = unix_millis();
        let tiers = self.tiers.clone();
        for (i, block) in std::mem::take(&mut seq.blocks).into_iter().enumerate() {
            let Some(hash) = block.registered else {
                self.free_page(block.page);
                continue;
            };
            end_block(&*tiers, &mut self.registry, &seq.run, i, hash, now);
        }
        seq.run.finish(end);
    }
}

#[cfg(test)]
mod tests {
    use super::onboard::fetch_budget;
    use super::*;
    use crate::worker::PromptHashes;
    use dynamo_tiering::block::{BlockHasher, Salt};

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
