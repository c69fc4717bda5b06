//! Workers sharing a node's G2 and G3: a prefix computed by worker A is loaded by worker B from
//! G2 (or, when G2 is too small, from G3, verified) instead of recomputed, with the same greedy
//! output as a worker that recomputed everything; a prefix already in a worker's G1 is reused in
//! place; a corrupted G3 slot is detected, dropped and recomputed with the output unchanged.
//! Workers on a backend whose copies finish later than they start (as on a CUDA copy stream) keep
//! every copy's buffers and pages until it ends, and answer the same.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dynamo_actors::cost::{BytesPerSec, CostModel, Prefill};
use dynamo_actors::stores::{G3StoreActor, StoreArgs, StoreMsg, StoreStatus, Watermarks};
use dynamo_actors::tiers::{BlockSite, G2Tier, G3Tier, KvObserver, NoObserver, NodeTiers, WriteBatch};
use dynamo_actors::worker::{Engine, GenOutcome, GenRequest, JobEvent, Resume, Ticket, Worker, WorkerEvent};
use dynamo_config::{Dtype, ModelShape, PerTier, RegionKind, RetentionSection, TierName};
use dynamo_kernels::kv_layout::{HostKvPool, PagedLayout};
use dynamo_kernels::model::{HostWeights, Llama};
use dynamo_kernels::{AttentionSpec, Backend, CpuBackend, KernelError, SeqBatch};
use dynamo_tiering::block::{BlockHash, BlockHasher, BlockLayout, HEADER_LEN, Salt, SaltInputs, verify_image};
use dynamo_tiering::cost::LINK_SAMPLE_BYTES;
use dynamo_tiering::g2::{HostPool, HostPoolOptions, MlockPolicy, align_up};
use dynamo_tiering::g3::superblock::{data_offset, file_bytes};
use dynamo_tiering::g3::{EngineChoice, G3Options, G3Store};
use dynamo_tiering::io::faulty::{FaultPlan, FaultyEngine};
use dynamo_tiering::io::uring::UringOptions;
use dynamo_tiering::registry::{PolicyKind, TierRegistry};

const B: usize = 16;

struct Node {
    tiers: Arc<NodeTiers>,
    weights: Arc<HostWeights>,
    g3_path: std::path::PathBuf,
    faults: Option<Arc<FaultyEngine>>,
    _dir: tempfile::TempDir,
}

fn node(g2_slots: u32) -> Node {
    node_with(g2_slots, Arc::new(NoObserver), false)
}

/// A node whose G3 reports to `observer`, with its I/O engine behind a [`FaultyEngine`] when
/// `faulty` (reachable as `Node::faults`).
fn node_with(g2_slots: u32, observer: Arc<dyn KvObserver>, faulty: bool) -> Node {
    // G2 keeps a few slots of headroom for in-flight loads and gathers.
    let sizes =
        Sizes { g2_slots, g2_blocks: g2_slots.saturating_sub(4) as usize, g3_slots: 64, g3_policy: PolicyKind::Lfu };
    node_sized(sizes, observer, faulty)
}

/// The tiers' sizes of a test node.
struct Sizes {
    /// Slots of the G2 pool.
    g2_slots: u32,
    /// Blocks G2's registry keeps.
    g2_blocks: usize,
    /// Slots of the G3 store.
    g3_slots: u64,
    /// G3's eviction policy.
    g3_policy: PolicyKind,
}

fn node_sized(sizes: Sizes, observer: Arc<dyn KvObserver>, faulty: bool) -> Node {
    let Sizes { g2_slots, g2_blocks, g3_slots, g3_policy } = sizes;
    let shape = ModelShape::named("tiny").expect("tiny");
    let layout = BlockLayout::for_model(&shape, Dtype::F32, B);
    let slot_bytes = align_up(layout.image_bytes());
    let pool = HostPool::new(HostPoolOptions { slot_bytes, slots: g2_slots, mlock: MlockPolicy::Try }).expect("G2");
    let dir = tempfile::tempdir().expect("tempdir");
    let g3_path = dir.path().join("store.0");
    let options = G3Options {
        format_foreign: false,
        paths: vec![g3_path.clone()],
        capacity_per_path: file_bytes(g3_slots, slot_bytes as u64),
        slot_bytes,
        direct_io: true,
        engine: EngineChoice::Uring(UringOptions { queue_depth: 8, threads: 1, register_buffers: true }),
    };
    let mut faults = None;
    let (store, _) = G3Store::open_wrapped(&options, &pool, |inner| {
        if !faulty {
            return inner;
        }
        let engine = Arc::new(FaultyEngine::new(inner, FaultPlan::default()));
        faults = Some(engine.clone());
        engine
    })
    .expect("G3");
    let store = Arc::new(store);
    let g3_registry = TierRegistry::new(store.capacity_slots() as usize, g3_policy);
    let g2_registry = TierRegistry::new(g2_blocks, PolicyKind::Lru);
    let tiers = NodeTiers {
        block_tokens: B,
        salt: Salt::derive(&SaltInputs { model: "tiny/seed-9", ..Default::default() }),
        layout,
        retention: RetentionSection::default(),
        g2: Some(G2Tier::new(pool, Arc::new(Mutex::new(g2_registry))).with_observer(observer.clone())),
        engines_g2: None,
        g3: Some(G3Tier::new(store, Arc::new(Mutex::new(g3_registry))).with_observer(observer.clone())),
        write_batch: WriteBatch::default(),
        cost: CostModel::unknown(B, layout.image_bytes()),
        measured: Default::default(),
        observer,
        engine_names: None,
        leases: Default::default(),
        g4: None,
    };
    Node { tiers: Arc::new(tiers), weights: Arc::new(HostWeights::random(shape, 9)), g3_path, faults, _dir: dir }
}

impl Node {
    fn worker(&self) -> Worker<CpuBackend> {
        self.worker_on(CpuBackend::default())
    }

    fn worker_on<E: Backend>(&self, backend: E) -> Worker<E> {
        self.worker_with_pages(backend, 32)
    }

    fn worker_with_pages<E: Backend>(&self, backend: E, pages: usize) -> Worker<E> {
        let model = Llama::new(backend, self.weights.as_ref()).expect("model");
        Worker::new(model, self.tiers.clone(), pages, PolicyKind::Lru).expect("worker")
    }
}

/// The CPU backend with an emulated copy engine that behaves as a CUDA copy stream may: a started
/// copy has not happened when its start call returns, and `copies_done` answers false until the
/// copies are waited for.
/// - A started gather reads the pages at once (the stream reads them behind the compute before
///   it) but writes its output buffers only when waited for; until then they hold a poison byte.
/// - A started scatter lands in the pool at the next `kv_write` (as the compute stream waits for a
///   layer's copies before it writes or reads that layer), from the payloads as they are then.
/// - A write into a block that a gather still reads, a payload that changed before its scatter
///   landed, or attention over a pool with a scatter still pending is recorded as a violation;
///   so is waiting for a scatter before any compute made it land (the emulation has no pool
///   there to land it in).
/// - While `fail_scatters` is set, starting a scatter fails.
#[derive(Debug, Default)]
struct EmulatedCopyEngine {
    cpu: CpuBackend,
    state: Mutex<CopyEngineState>,
    fail_scatters: std::sync::atomic::AtomicBool,
}

#[derive(Debug, Default)]
struct CopyEngineState {
    /// Blocks that a gather in flight reads.
    gathering: HashSet<u32>,
    /// The started scatter not landed yet.
    scatter: Option<PendingScatter>,
    violations: Vec<String>,
}

/// A started scatter: target blocks, payload addresses (address, length) and the bytes they held.
#[derive(Debug)]
struct PendingScatter {
    blocks: Vec<u32>,
    payloads: Vec<(usize, usize)>,
    bytes: Vec<Vec<u8>>,
}

/// A copy in flight on the emulated engine.
#[derive(Debug)]
enum EmulatedCopies {
    /// The blocks read, their bytes, and the output buffers (address, length) still to fill.
    Gather(Vec<u32>, Vec<Vec<u8>>, Vec<(usize, usize)>),
    Scatter,
}

const POISON: u8 = 0xA5;

impl EmulatedCopyEngine {
    fn violations(&self) -> Vec<String> {
        self.state.lock().unwrap().violations.clone()
    }

    /// Lands the pending scatter in `kv`, as the device would before compute touches the pool.
    fn land_scatter(&self, kv: &mut HostKvPool) {
        let mut state = self.state.lock().unwrap();
        let Some(PendingScatter { blocks, payloads, bytes }) = state.scatter.take() else { return };
        // SAFETY: the worker keeps the payloads' images until the copies are waited for, which the
        // violation check below and the answers of the test hold it to.
        let now: Vec<&[u8]> =
            payloads.iter().map(|&(ptr, len)| unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }).collect();
        if now.iter().zip(&bytes).any(|(now, then)| now != &then.as_slice()) {
            state.violations.push("a payload changed before its scatter landed".into());
        }
        kv.scatter(&blocks, &now).expect("scatter");
    }
}

impl Backend for EmulatedCopyEngine {
    type Buf = Vec<f32>;
    type Weight = <CpuBackend as Backend>::Weight;
    type Kv = HostKvPool;
    type Copies = EmulatedCopies;

    fn name(&self) -> &'static str {
        "cpu+emulated-copy-engine"
    }
    fn kv_elem_bytes(&self) -> usize {
        self.cpu.kv_elem_bytes()
    }
    fn weight(&self, data: &[f32], rows: usize, cols: usize) -> Result<Self::Weight, KernelError> {
        self.cpu.weight(data, rows, cols)
    }
    fn zeros(&self, len: usize) -> Result<Vec<f32>, KernelError> {
        self.cpu.zeros(len)
    }
    fn upload(&self, data: &[f32]) -> Result<Vec<f32>, KernelError> {
        self.cpu.upload(data)
    }
    fn download(&self, buf: &Vec<f32>, out: &mut [f32]) -> Result<(), KernelError> {
        self.cpu.download(buf, out)
    }
    fn embed(&self, table: &Self::Weight, tokens: &[u32], out: &mut Vec<f32>) -> Result<(), KernelError> {
        self.cpu.embed(table, tokens, out)
    }
    fn rmsnorm(
        &self,
        x: &Vec<f32>,
        w: &Self::Weight,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Vec<f32>,
    ) -> Result<(), KernelError> {
        self.cpu.rmsnorm(x, w, rows, dim, eps, out)
    }
    fn matmul(&self, x: &Vec<f32>, rows: usize, w: &Self::Weight, out: &mut Vec<f32>) -> Result<(), KernelError> {
        self.cpu.matmul(x, rows, w, out)
    }
    fn rope(
        &self,
        x: &mut Vec<f32>,
        rows: usize,
        heads: usize,
        head_dim: usize,
        positions: &[u32],
        inv_freq: &[f32],
    ) -> Result<(), KernelError> {
        self.cpu.rope(x, rows, heads, head_dim, positions, inv_freq)
    }
    fn swiglu(&self, gate: &Vec<f32>, up: &Vec<f32>, len: usize, out: &mut Vec<f32>) -> Result<(), KernelError> {
        self.cpu.swiglu(gate, up, len, out)
    }
    fn add_assign(&self, x: &mut Vec<f32>, y: &Vec<f32>, len: usize) -> Result<(), KernelError> {
        self.cpu.add_assign(x, y, len)
    }
    fn add_bias(&self, x: &mut Vec<f32>, bias: &Self::Weight, rows: usize, cols: usize) -> Result<(), KernelError> {
        self.cpu.add_bias(x, bias, rows, cols)
    }
    fn kv_pool(&self, layout: PagedLayout, num_blocks: usize) -> Result<HostKvPool, KernelError> {
        self.cpu.kv_pool(layout, num_blocks)
    }
    fn kv_write(
        &self,
        kv: &mut HostKvPool,
        layer: usize,
        k: &Vec<f32>,
        v: &Vec<f32>,
        slots: &[u32],
    ) -> Result<(), KernelError> {
        self.land_scatter(kv);
        let b = kv.layout().block_tokens as u32;
        let mut state = self.state.lock().unwrap();
        if let Some(s) = slots.iter().find(|&&s| state.gathering.contains(&(s / b))) {
            let block = s / b;
            state.violations.push(format!("kv_write into block {block} while a gather reads it"));
        }
        drop(state);
        self.cpu.kv_write(kv, layer, k, v, slots)
    }
    fn attention_batch(
        &self,
        q: &Vec<f32>,
        kv: &HostKvPool,
        layer: usize,
        spec: AttentionSpec,
        seqs: SeqBatch<'_>,
        positions: &[u32],
        out: &mut Vec<f32>,
    ) -> Result<(), KernelError> {
        let mut state = self.state.lock().unwrap();
        if state.scatter.is_some() {
            state.violations.push("attention before the started scatter landed".into());
        }
        drop(state);
        self.cpu.attention_batch(q, kv, layer, spec, seqs, positions, out)
    }
    fn kv_gather(&self, kv: &HostKvPool, blocks: &[u32], out: &mut [&mut [u8]]) -> Result<(), KernelError> {
        self.cpu.kv_gather(kv, blocks, out)
    }
    fn kv_scatter(&self, kv: &mut HostKvPool, blocks: &[u32], payloads: &[&[u8]]) -> Result<(), KernelError> {
        self.land_scatter(kv);
        self.cpu.kv_scatter(kv, blocks, payloads)
    }
    unsafe fn kv_gather_start(
        &self,
        kv: &HostKvPool,
        blocks: &[u32],
        out: &mut [&mut [u8]],
    ) -> Result<EmulatedCopies, KernelError> {
        let mut read: Vec<Vec<u8>> = out.iter().map(|o| vec![0; o.len()]).collect();
        let mut views: Vec<&mut [u8]> = read.iter_mut().map(|r| r.as_mut_slice()).collect();
        self.cpu.kv_gather(kv, blocks, &mut views)?;
        for o in out.iter_mut() {
            o.fill(POISON);
        }
        self.state.lock().unwrap().gathering.extend(blocks);
        let outs = out.iter_mut().map(|o| (o.as_mut_ptr() as usize, o.len())).collect();
        Ok(EmulatedCopies::Gather(blocks.to_vec(), read, outs))
    }
    unsafe fn kv_scatter_start(
        &self,
        kv: &mut HostKvPool,
        blocks: &[u32],
        payloads: &[&[u8]],
    ) -> Result<EmulatedCopies, KernelError> {
        if self.fail_scatters.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(KernelError::CudaUnavailable("emulated: the copy engine failed".into()));
        }
        self.land_scatter(kv);
        let at = payloads.iter().map(|p| (p.as_ptr() as usize, p.len())).collect();
        let bytes = payloads.iter().map(|p| p.to_vec()).collect();
        self.state.lock().unwrap().scatter = Some(PendingScatter { blocks: blocks.to_vec(), payloads: at, bytes });
        Ok(EmulatedCopies::Scatter)
    }
    fn copies_done(&self, _: &EmulatedCopies) -> Result<bool, KernelError> {
        Ok(false)
    }
    fn copies_wait(&self, copies: EmulatedCopies) -> Result<Duration, KernelError> {
        let mut state = self.state.lock().unwrap();
        match copies {
            EmulatedCopies::Gather(blocks, read, outs) => {
                for b in &blocks {
                    state.gathering.remove(b);
                }
                for ((ptr, len), bytes) in outs.into_iter().zip(read) {
                    // SAFETY: the worker keeps the output buffers (its G2 slots) until this wait,
                    // as `kv_gather_start` requires.
                    unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) }.copy_from_slice(&bytes);
                }
            }
            EmulatedCopies::Scatter => {
                if state.scatter.is_some() {
                    state.violations.push("a scatter waited for before any compute made it land".into());
                    state.scatter = None;
                }
            }
        }
        Ok(Duration::from_micros(50))
    }
}

/// Records every KV event, in order.
#[derive(Debug, Default)]
struct Recorder {
    events: Mutex<Vec<(BlockSite, &'static str, Vec<BlockHash>)>>,
}

impl Recorder {
    fn stored(&self, site: BlockSite) -> Vec<BlockHash> {
        let events = self.events.lock().unwrap();
        events.iter().filter(|(s, kind, _)| *s == site && *kind == "stored").flat_map(|(_, _, h)| h.clone()).collect()
    }

    fn kinds(&self, site: BlockSite) -> Vec<&'static str> {
        self.events.lock().unwrap().iter().filter(|(s, ..)| *s == site).map(|(_, k, _)| *k).collect()
    }
}

impl KvObserver for Recorder {
    fn stored(&self, site: BlockSite, _: Option<BlockHash>, hashes: &[BlockHash]) {
        self.events.lock().unwrap().push((site, "stored", hashes.to_vec()));
    }
    fn removed(&self, site: BlockSite, hashes: &[BlockHash]) {
        self.events.lock().unwrap().push((site, "removed", hashes.to_vec()));
    }
    fn cleared(&self, worker: usize) {
        self.events.lock().unwrap().push((BlockSite::G1 { worker }, "cleared", vec![]));
    }
}

fn request(prompt: Vec<u32>) -> GenRequest {
    GenRequest { regions: vec![(0..B, RegionKind::System)], ..GenRequest::greedy(prompt, 6) }
}

fn turn(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7919 + seed * 104_729 + 11) % 199_000).collect()
}

async fn run<E: Backend>(worker: &mut Worker<E>, req: &GenRequest) -> GenOutcome {
    let mut streamed = Vec::new();
    let mut prefilled = None;
    let outcome = worker
        .generate(req, &mut |event| {
            match event {
                WorkerEvent::Prefilled { cached_tokens, .. } => prefilled = Some(cached_tokens),
                WorkerEvent::Token(t) => {
                    assert!(prefilled.is_some(), "tokens come after the prefill event");
                    streamed.push(t);
                }
                WorkerEvent::Computed { .. } => assert!(prefilled.is_none(), "passes come before the prefill event"),
            }
            true
        })
        .await
        .expect("generate");
    assert_eq!(streamed, outcome.tokens, "the stream is the outcome");
    assert_eq!(prefilled, Some(outcome.cached_tokens));
    outcome
}

/// The output of a fresh node that computes everything.
async fn recomputed(req: &GenRequest) -> Vec<u32> {
    let fresh = node(16);
    let mut w = fresh.worker();
    let out = run(&mut w, req).await;
    assert_eq!(out.cached_tokens, 0);
    out.tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_b_loads_worker_a_prefix_from_g2() {
    let n = node(32);
    let (mut a, mut b) = (n.worker(), n.worker());
    let first = turn(3 * B + 9, 1);
    let out_a = run(&mut a, &request(first.clone())).await;
    assert_eq!(out_a.cached_tokens, 0);
    assert_eq!(out_a.prefill_tokens, first.len());

    // Turn 2 carries turn 1, its answer, and new input, and lands on worker B.
    let mut second = first.clone();
    second.extend(&out_a.tokens);
    second.extend(turn(20, 2));
    let req = request(second);
    let out_b = run(&mut b, &req).await;
    assert_eq!(
        out_b.hit_tokens,
        PerTier { g2: 3 * B, ..PerTier::default() },
        "the 3 complete prompt blocks come from G2"
    );
    let measured = n.tiers.measured.g2_load.get().expect("the G2 → G1 load was timed");
    assert!(measured.get().is_finite() && measured.get() > 0.0, "{measured:?}");
    assert!(n.tiers.measured.wants_load_sample(), "a load this small does not measure the link for good");
    // The cost model (the router's and the workers' one) takes it where no G2 rate is
    // configured, and keeps a configured one.
    let base = CostModel { prefill: Prefill::rate(1000.0), ..CostModel::unknown(B, 4096) };
    assert_eq!(base.measured(&n.tiers.measured).g2_read, Some(measured));
    assert_eq!(n.tiers.cost_now().g2_read, Some(measured));
    let configured = CostModel { g2_read: BytesPerSec::new(5e9), ..base };
    assert_eq!(configured.measured(&n.tiers.measured).g2_read, BytesPerSec::new(5e9));
    assert_eq!(out_b.cached_tokens, 3 * B);
    assert_eq!(out_b.tokens, recomputed(&req).await, "same greedy output as recomputing everything");

    // The same request again on B: now its own G1 has the prefix.
    let again = run(&mut b, &req).await;
    assert_eq!(again.hit_tokens.g1, (req.prompt.len() - 1) / B * B, "reused in place from G1");
    assert_eq!(again.tokens, out_b.tokens);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_computed_in_chunks_answers_as_one_pass_does() {
    let req = request(turn(3 * B + 9, 5));
    let n = node(16);
    // Chunks of 7 tokens: none of them ends on a block boundary.
    let mut chunked = n.worker().with_prefill_chunk(7);
    let out = run(&mut chunked, &req).await;
    assert_eq!(out.prefill_tokens, req.prompt.len());
    assert_eq!(out.tokens, recomputed(&req).await, "same greedy output as one forward pass");
    // Its blocks are the same blocks: another worker loads them from G2 and answers the same.
    let loaded = run(&mut n.worker(), &req).await;
    assert_eq!(loaded.cached_tokens, 3 * B);
    assert_eq!(loaded.tokens, out.tokens);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_that_finish_later_than_they_start_keep_their_buffers_and_answers() {
    let n = node(32);
    let first = turn(4 * B + 9, 7);
    let req = request(first.clone());
    // Passes of 20 tokens, so gathers are in flight while later passes compute.
    let mut a = n.worker_on(EmulatedCopyEngine::default()).with_prefill_chunk(20);
    let out_a = run(&mut a, &req).await;
    assert_eq!(out_a.tokens, recomputed(&req).await, "same greedy output as one pass on the CPU");
    assert_eq!(a.model().backend().violations(), Vec::<String>::new());
    // The turn ended with every prompt block sealed in G2 over the bytes the gather delivered.
    let g2 = n.tiers.g2.as_ref().expect("G2");
    let hashes = BlockHasher::new(n.tiers.salt, B).hash_sequence(&first);
    assert_eq!(hashes.len(), 4);
    for &hash in &hashes {
        let image = g2.get(hash, 0).expect("in G2 at the turn's end");
        assert!(!image.as_slice()[HEADER_LEN..].iter().all(|&b| b == POISON));
        verify_image(image.as_slice(), hash).expect("sealed after its bytes arrived");
    }

    // Worker C, on the same emulated engine, loads the prefix from G2 with a scatter that lands
    // only when its first pass writes the pool, and answers as recomputing does. (The link counts
    // as measured, so the load overlaps the pass instead of running alone to be timed.)
    n.tiers.measured.observe_load(LINK_SAMPLE_BYTES, Duration::from_millis(1));
    assert!(!n.tiers.measured.wants_load_sample());
    let mut second = first.clone();
    second.extend(&out_a.tokens);
    second.extend(turn(12, 8));
    let req2 = request(second);
    let mut c = n.worker_on(EmulatedCopyEngine::default()).with_prefill_chunk(20);
    let out_c = run(&mut c, &req2).await;
    assert_eq!(out_c.hit_tokens.g2, 4 * B, "the prompt's blocks come from G2");
    assert_eq!(out_c.tokens, recomputed(&req2).await);
    assert_eq!(c.model().backend().violations(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_load_leaves_no_block_in_g1_over_pages_it_never_filled() {
    let n = node(32);
    let req = request(turn(4 * B + 9, 9));
    let want = run(&mut n.worker(), &req).await.tokens;
    let hashes = BlockHasher::new(n.tiers.salt, B).hash_sequence(&req.prompt);
    // The link counts as measured, so loads overlap the first pass (the emulation lands a scatter
    // at a pass's first write).
    n.tiers.measured.observe_load(LINK_SAMPLE_BYTES, Duration::from_millis(1));

    let mut d = n.worker_on(EmulatedCopyEngine::default());
    d.model().backend().fail_scatters.store(true, std::sync::atomic::Ordering::Relaxed);
    let failed = d.generate(&req, &mut |_| true).await;
    assert!(failed.is_err(), "the load's failure fails the request");
    assert!(hashes.iter().all(|&h| !d.holds(h)), "no block stays registered over an unfilled page");
    // With the engine healed, the same worker loads the prefix again and answers right.
    d.model().backend().fail_scatters.store(false, std::sync::atomic::Ordering::Relaxed);
    let out = run(&mut d, &req).await;
    assert_eq!(out.hit_tokens, PerTier { g2: 4 * B, ..PerTier::default() });
    assert_eq!(out.tokens, want);
    assert_eq!(d.model().backend().violations(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_come_back_from_g3_when_g2_is_too_small() {
    let n = node(8); // 4 usable G2 blocks: the prefix does not stay in G2
    let (mut a, mut b) = (n.worker(), n.worker());
    let first = turn(6 * B + 3, 3);
    run(&mut a, &request(first.clone())).await;
    a.flush().await;
    // Push the prefix out of G2 with another conversation.
    run(&mut a, &request(turn(6 * B + 3, 4))).await;
    a.flush().await;
    let req = request(first.iter().copied().chain(turn(5, 5)).collect());
    let out = run(&mut b, &req).await;
    assert!(out.hit_tokens.g3 > 0, "some of the prefix came from G3: {:?}", out.hit_tokens);
    assert_eq!(out.cached_tokens, 6 * B);
    assert_eq!(out.corrupt_blocks, 0);
    assert_eq!(out.tokens, recomputed(&req).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_g3_block_is_detected_and_recomputed() {
    let n = node(8);
    let (mut a, mut b) = (n.worker(), n.worker());
    // Tool results (no hold, one priority), so the second conversation pushes the first out of G2.
    let plain =
        |prompt: Vec<u32>| GenRequest { regions: vec![(0..prompt.len(), RegionKind::ToolResult)], ..request(prompt) };
    let first = turn(4 * B + 1, 6);
    run(&mut a, &plain(first.clone())).await;
    a.flush().await;
    run(&mut a, &plain(turn(6 * B + 3, 7))).await;
    a.flush().await;

    // Flip a payload byte of the prefix's first block on disk (found by its header).
    let hash = BlockHasher::new(n.tiers.salt, B).hash_sequence(&first)[0];
    let bytes = std::fs::read(&n.g3_path).expect("read store");
    let slot_bytes = align_up(n.tiers.layout.image_bytes());
    let start = data_offset(slot_bytes as u64) as usize;
    let slot = (0..(bytes.len() - start) / slot_bytes)
        .find(|s| {
            let at = start + s * slot_bytes;
            bytes[at + 16..at + 32] == hash.to_le_bytes()
        })
        .expect("the block is on disk");
    let mut f = std::fs::OpenOptions::new().write(true).open(&n.g3_path).expect("open");
    use std::io::{Seek, SeekFrom, Write};
    let at = (start + slot * slot_bytes + HEADER_LEN + 999) as u64;
    f.seek(SeekFrom::Start(at)).expect("seek");
    f.write_all(&[bytes[at as usize] ^ 0xFF]).expect("flip");
    f.sync_all().expect("sync");
    drop(f);

    let req = plain(first.iter().copied().chain(turn(3, 8)).collect());
    let out = run(&mut b, &req).await;
    assert_eq!(out.corrupt_blocks, 1, "the flipped block was read from G3 and caught: {out:?}");
    assert_eq!(out.cached_tokens, 0, "the prefix ends at the corrupt block");
    assert_eq!(out.tokens, recomputed(&req).await, "output unchanged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tier_acknowledges_blocks_as_kv_events() {
    let recorder = Arc::new(Recorder::default());
    let n = node_with(32, recorder.clone(), false);
    let (mut a, mut b) = (n.worker().with_id(0), n.worker().with_id(1));
    let first = turn(3 * B + 9, 11);
    let prefix = BlockHasher::new(n.tiers.salt, B).hash_sequence(&first);
    assert_eq!(prefix.len(), 3);
    run(&mut a, &request(first.clone())).await;
    a.flush().await;
    assert_eq!(recorder.stored(BlockSite::G1 { worker: 0 }), prefix, "G1 of worker 0, in prefix order");
    assert_eq!(recorder.stored(BlockSite::Node(TierName::G2)), prefix, "gathered to G2");
    assert_eq!(recorder.stored(BlockSite::Node(TierName::G3)), prefix, "acknowledged by G3 once written");

    // Worker 1 loads the prefix from G2: its G1 now has it too; G2 and G3 are not written again.
    let second: Vec<u32> = first.iter().copied().chain(turn(B, 12)).collect();
    run(&mut b, &request(second)).await;
    b.flush().await;
    assert_eq!(recorder.stored(BlockSite::G1 { worker: 1 })[..3], prefix[..]);
    assert_eq!(recorder.stored(BlockSite::Node(TierName::G3)).len(), 4, "only the new block reached G3");

    // A restarted worker reports its G1 cleared.
    assert_eq!(a.reset(), 3, "worker 0 held the three prompt blocks");
    assert_eq!(recorder.kinds(BlockSite::G1 { worker: 0 }).last(), Some(&"cleared"));
}

async fn g3_status(actor: &ractor::ActorRef<StoreMsg>) -> StoreStatus {
    actor.call(StoreMsg::Status, None).await.expect("call").expect("answer")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_disk_degrades_the_node_to_g1_g2_and_a_probe_brings_g3_back() {
    let n = node_with(32, Arc::new(NoObserver), true);
    let faults = n.faults.clone().expect("faulty engine");
    let args = StoreArgs {
        tiers: n.tiers.clone(),
        watermarks: Watermarks { high: 0.95, low: 0.9 },
        period: std::time::Duration::from_millis(20),
        failures_to_degrade: 2,
    };
    let (actor, handle) = ractor::Actor::spawn(None, G3StoreActor, args).await.expect("G3 store actor");
    let mut w = n.worker();
    let g3 = n.tiers.g3.as_ref().expect("G3");

    // The disk fills up: write-through fails, the actor degrades the node.
    faults.set_plan(FaultPlan { fail_writes: Some(libc::ENOSPC), ..FaultPlan::default() });
    let req = request(turn(4 * B + 1, 21));
    let out = run(&mut w, &req).await;
    w.flush().await;
    assert_eq!(out.tokens, recomputed(&req).await, "serving goes on while G3 fails");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !g3_status(&actor).await.degraded {
        assert!(std::time::Instant::now() < deadline, "G3 never degraded");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(!g3.usable());
    assert_eq!(g3.store.len(), 0);

    // Degraded: requests skip G3 entirely, the probes keep failing.
    let injected = faults.injected_total();
    run(&mut w, &request(turn(3 * B + 1, 22))).await;
    w.flush().await;
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let status = g3_status(&actor).await;
    assert!(status.degraded && status.recoveries == 0, "{status:?}");
    assert!(faults.injected_total() > injected, "the probes still try the disk");
    assert_eq!(g3.store.len(), 0, "nothing was written while degraded");

    // The disk heals: a probe passes and write-through reaches G3 again.
    faults.set_plan(FaultPlan::default());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while g3_status(&actor).await.degraded {
        assert!(std::time::Instant::now() < deadline, "G3 never came back");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let status = g3_status(&actor).await;
    assert_eq!((status.degradations, status.recoveries), (1, 1), "{status:?}");
    assert!(g3.usable());
    run(&mut w, &request(turn(3 * B + 1, 23))).await;
    w.flush().await;
    assert_eq!(g3.store.len(), 3, "the new turn's blocks are on disk");
    actor.stop(None);
    handle.await.expect("actor stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_disk_gets_a_bounded_backlog_and_the_rest_stays_in_g2() {
    let mut n = node_with(64, Arc::new(NoObserver), true);
    // One block per G3 batch, and a disk said to write four blocks a second (`tiers.g3.write_gb_s`):
    // a second of backlog is five blocks in flight. Each write takes 4 s, far longer than the
    // prompt's prefill on any machine, so none lands (and frees room) before all are handed over.
    let tiers = Arc::get_mut(&mut n.tiers).expect("not shared yet");
    tiers.write_batch.g3_blocks = 1;
    let slot = tiers.g3.as_ref().expect("G3").store.slot_bytes();
    tiers.g3 = tiers.g3.take().map(|g3| g3.with_write_rate(BytesPerSec::new(4.0 * slot as f64)));
    n.faults
        .as_ref()
        .expect("faulty")
        .set_plan(FaultPlan { write_latency: std::time::Duration::from_secs(4), ..FaultPlan::default() });
    let mut w = n.worker();
    let prompt = turn(14 * B + 1, 31);
    let out = run(&mut w, &request(prompt.clone())).await;
    w.flush().await;
    let g3 = n.tiers.g3.as_ref().expect("G3");
    let g2 = n.tiers.g2.as_ref().expect("G2");
    let hashes = BlockHasher::new(n.tiers.salt, B).hash_sequence(&prompt);
    assert_eq!(hashes.len(), 14);
    let on_disk = hashes.iter().filter(|h| g3.store.contains(**h)).count();
    assert!((1..=5).contains(&on_disk), "the disk took at most the bounded backlog: {on_disk} of 14");
    assert!(hashes.iter().all(|h| g2.contains(*h)), "every block is in G2 all the same");
    assert_eq!(out.tokens, recomputed(&request(prompt)).await);
}

/// Answering false at a prefill pass stops the request there: no further pass runs, and only
/// the tokens computed count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_prefill_stops_at_the_next_pass() {
    let n = node(16);
    let mut w = n.worker().with_prefill_chunk(B);
    let req = request(turn(8 * B + 3, 11));
    let mut passes = Vec::new();
    let out = w
        .generate(&req, &mut |event| match event {
            WorkerEvent::Computed { tokens } => {
                passes.push(tokens);
                passes.len() < 2
            }
            other => panic!("nothing after the cancelled pass: {other:?}"),
        })
        .await
        .expect("generate");
    assert_eq!(passes, [B, 2 * B], "the request stopped at the second pass boundary");
    assert_eq!(out.prefill_tokens, 2 * B, "only what was computed counts");
    assert!(out.tokens.is_empty());
    // The worker serves the next request normally, reusing the two blocks it computed.
    let next = run(&mut w, &req).await;
    assert_eq!(next.hit_tokens.g1, 2 * B);
    assert_eq!(next.tokens, recomputed(&req).await);
}

/// A `max_tokens` far beyond what the answer uses takes G1 pages only as decode reaches them:
/// the blocks of earlier requests are not evicted to reserve the whole context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_max_tokens_reserves_nothing_ahead() {
    let n = node(16);
    // 32 G1 pages of 16 tokens.
    let mut w = n.worker();
    let first = request(turn(4 * B + 1, 12));
    run(&mut w, &first).await;
    let resident = w.resident_blocks();
    assert!(resident >= 4, "{resident}");
    let prompt = turn(2 * B, 13);
    let greedy = GenRequest::greedy(prompt.clone(), 32 * B - prompt.len());
    let mut seen = 0;
    w.generate(&greedy, &mut |event| {
        if let WorkerEvent::Token(_) = event {
            seen += 1;
        }
        seen < 3
    })
    .await
    .expect("generate");
    assert!(w.resident_blocks() >= resident, "the first request's blocks stay in G1");
    assert!(w.holds(BlockHasher::new(n.tiers.salt, B).hash_sequence(&first.prompt)[0]));
}

/// Sampling never picks an id outside the request's allowed set (the tokenizer's decodable
/// ids), greedy or at a high temperature, even where the model favours those ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_stays_inside_the_decodable_ids() {
    use dynamo_kernels::sampling::{Sampling, TokenSet};
    let n = node(16);
    let mut w = n.worker();
    let prompt = turn(B + 5, 14);
    let free = run(&mut w, &GenRequest::greedy(prompt.clone(), 8)).await.tokens;
    // Forbid what the unrestricted greedy answer used: every step must pick something else.
    let banned: HashSet<u32> = free.iter().copied().collect();
    let vocab = w.model().shape().vocab;
    let allowed = Arc::new(TokenSet::from_fn(vocab - 7, |id| !banned.contains(&id)));
    for sampling in [Sampling::GREEDY, Sampling::temperature(2.0)] {
        for seed in 0..4 {
            let req = GenRequest {
                allowed: Some(allowed.clone()),
                sampling,
                seed: Some(seed),
                ..GenRequest::greedy(prompt.clone(), 8)
            };
            let out = run(&mut w, &req).await;
            assert_eq!(out.tokens.len(), 8);
            assert!(out.tokens.iter().all(|&t| allowed.contains(t)), "{sampling:?} seed {seed}: {:?}", out.tokens);
        }
    }
}

/// Admits every request at once, runs steps until all have ended, and answers each outcome and
/// the number of steps taken.
async fn serve_batch<E: Engine + ?Sized>(w: &mut E, reqs: &[GenRequest]) -> (Vec<GenOutcome>, usize) {
    let mut answers = Vec::new();
    for req in reqs {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        Engine::admit(w, Ticket::local(req.clone(), tx)).await;
        answers.push(rx);
    }
    let mut steps = 0;
    while Engine::running(w) > 0 {
        Engine::step(w).await;
        steps += 1;
        assert!(steps < 10_000, "the batch makes progress");
    }
    let outcomes = answers
        .into_iter()
        .map(|mut rx| {
            let mut streamed = Vec::new();
            loop {
                match rx.try_recv().expect("every request is answered") {
                    JobEvent::Event(WorkerEvent::Token(t)) => streamed.push(t),
                    JobEvent::Event(_) => {}
                    JobEvent::Done(outcome) => {
                        assert_eq!(streamed, outcome.tokens, "the stream is the outcome");
                        return outcome;
                    }
                    JobEvent::Failed(e) => panic!("request failed: {e}"),
                }
            }
        })
        .collect();
    (outcomes, steps)
}

/// Requests of every kind served together — prompts of several lengths computed in chunks
/// alongside the others' decode steps, greedy and seeded temperature sampling, short and long
/// answers — get exactly the tokens each gets alone on a fresh node, in far fewer steps than
/// one at a time would take.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_answers_every_request_as_it_would_be_answered_alone() {
    let n = node(64);
    let mut w = n.worker().with_prefill_chunk(3 * B);
    let reqs: Vec<GenRequest> = (0..6u32)
        .map(|i| {
            let mut req = GenRequest::greedy(turn(B / 2 + i as usize * 11, 40 + i), 4 + 3 * i as usize);
            if i % 2 == 1 {
                req.sampling = dynamo_kernels::sampling::Sampling::temperature(0.9);
                req.seed = Some(u64::from(i) * 77);
            }
            req
        })
        .collect();
    let (outcomes, steps) = serve_batch(&mut w, &reqs).await;
    let generated: usize = outcomes.iter().map(|o| o.tokens.len()).sum();
    for (req, out) in reqs.iter().zip(&outcomes) {
        assert_eq!(out.tokens.len(), req.max_tokens);
        assert_eq!(out.tokens, recomputed(req).await, "a request's tokens do not depend on its batch mates");
    }
    assert!(steps * 2 < generated, "{steps} steps for {generated} tokens: decodes share steps");
}

/// A burst that overflows G1: the lowest-priority request yields its pages, its blocks go to G2
/// (write-through), and it resumes by loading them back instead of recomputing them — with the
/// same answer either way, and the same as alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_that_overflows_g1_preempts_into_g2_and_resumes_by_loading() {
    // 8 G1 pages of 16 tokens: three prompts of 2 pages fit, but their answers reach a third and
    // a fourth page each (12): one request yields while decoding.
    let reqs: Vec<GenRequest> = (0..3u32).map(|i| GenRequest::greedy(turn(2 * B - 1, 60 + i), B + 2)).collect();
    let mut alone = Vec::new();
    for req in &reqs {
        alone.push(recomputed(req).await);
    }
    for resume in [Resume::Load, Resume::Recompute] {
        let n = node(128);
        let mut w = n.worker_with_pages(CpuBackend::default(), 8).with_resume(resume);
        let (outcomes, _) = serve_batch(&mut w, &reqs).await;
        for (out, want) in outcomes.iter().zip(&alone) {
            assert_eq!(&out.tokens, want, "{resume:?}: preemption changes no token");
        }
        let stats = w.preemption_stats().clone();
        println!("{resume:?}: {stats:?}");
        assert!(stats.preempted >= 1, "{resume:?}: G1 overflowed: {stats:?}");
        assert_eq!(stats.resume_latency.len(), stats.preempted, "every preempted request came back: {stats:?}");
        match resume {
            Resume::Load => assert!(stats.resumed_cached_tokens >= B, "resumed by loading: {stats:?}"),
            Resume::Recompute => assert_eq!(stats.resumed_cached_tokens, 0, "recomputed: {stats:?}"),
        }
    }
}

/// The simulated engine runs the reference worker's batch policy, not a model of it: the same
/// burst over a G1 of the same size, with the same step budget, takes as many steps, preempts as
/// often and reports the same hits per request (the resumed ones loading their blocks back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulated_engine_batches_and_preempts_as_the_reference_worker_does() {
    use dynamo_actors::worker::DEFAULT_MAX_RUNNING;
    use dynamo_actors::worker::simulated::{SimNode, SimTiming, SimulatedEngine, WriteThrough};
    use dynamo_config::Calibration;

    // 10 G1 pages of 16 tokens, a budget of 3 blocks per step: prompts of 1 to 3 pages computed
    // in chunks beside the others' decodes, answers long enough to overflow G1.
    let reqs: Vec<GenRequest> =
        (0..4u32).map(|i| GenRequest::greedy(turn((i as usize + 1) * B - 3, 80 + i), B + 3)).collect();
    let n = node(128);
    let mut w = n.worker_with_pages(CpuBackend::default(), 10).with_prefill_chunk(3 * B);
    let (reference, reference_steps) = serve_batch(&mut w, &reqs).await;

    let cal = Calibration::h200();
    let prefill = cal.prefill_for("llama-8b").expect("calibrated").clone();
    let timing = SimTiming::from_calibration(&cal, prefill, 0.001, n.tiers.layout.image_bytes() as u64);
    let mut sim = SimNode::new(
        B,
        n.tiers.salt,
        RetentionSection::default(),
        timing,
        WriteThrough::G2G3,
        124,
        64,
        PolicyKind::Lru,
        Arc::new(NoObserver),
    );
    sim.cost = n.tiers.cost.clone();
    let sim = Arc::new(sim);
    let engine = SimulatedEngine::new(0, sim.clone(), 10, PolicyKind::Lru, tokio::time::Instant::now());
    let mut engine = engine.with_batch(3 * B, DEFAULT_MAX_RUNNING);
    let (simulated, simulated_steps) = serve_batch(&mut engine, &reqs).await;

    let preempted = w.preemption_stats().preempted;
    println!("{reference_steps} steps, {preempted} preempted: {:?}", w.preemption_stats());
    assert!(preempted >= 1, "the burst overflows G1: {:?}", w.preemption_stats());
    assert_eq!(sim.stats.preemptions.load(std::sync::atomic::Ordering::Relaxed), preempted as u64);
    assert_eq!(simulated_steps, reference_steps, "the same plan, step by step");
    for (i, (r, s)) in reference.iter().zip(&simulated).enumerate() {
        assert_eq!(r.tokens.len(), s.tokens.len(), "request {i}");
        assert_eq!((r.hit_tokens, r.cached_tokens), (s.hit_tokens, s.cached_tokens), "request {i}");
    }
}

/// A small agentic trace: sessions opening with the same system prompt, each turn resending the
/// conversation so far (its answers included) plus new input, the turns of a session moving
/// between two workers. Answers `(session, turn, worker, new input tokens, answer tokens)` in the
/// order served.
fn equality_trace() -> Vec<(u32, u32, usize, usize, usize)> {
    let mut trace = Vec::new();
    for turn in 0..3u32 {
        for session in 0..3u32 {
            let worker = ((session + turn) % 2) as usize;
            trace.push((session, turn, worker, if turn == 0 { 2 * B + 5 } else { 12 }, 10));
        }
    }
    trace
}

/// Two workers sharing G2 and G3, as a replay drives them.
trait Pair {
    /// Serves `req` on worker `w`.
    async fn serve(&mut self, w: usize, req: &GenRequest) -> GenOutcome;
    /// Waits until every write-through has landed.
    async fn flush(&mut self);
}

impl Pair for [Worker<CpuBackend>; 2] {
    async fn serve(&mut self, w: usize, req: &GenRequest) -> GenOutcome {
        self[w].generate(req, &mut |_| true).await.expect("generate")
    }
    async fn flush(&mut self) {
        for w in self {
            w.flush().await;
        }
    }
}

impl Pair for [dynamo_actors::worker::simulated::SimulatedEngine; 2] {
    async fn serve(&mut self, w: usize, req: &GenRequest) -> GenOutcome {
        self[w].generate(req, &mut |_| true).await.expect("generate")
    }
    async fn flush(&mut self) {
        for e in self {
            dynamo_actors::worker::Engine::flush(e).await;
        }
    }
}

/// Replays [`equality_trace`] on `pair`, every write-through landing before the next request, and
/// answers each request's hit tokens per tier, in order.
async fn replay_hits(pair: &mut impl Pair) -> Vec<PerTier<usize>> {
    let system = turn(2 * B, 70);
    let mut history: Vec<Vec<u32>> = vec![system.clone(); 3];
    let mut hits = Vec::new();
    for (session, k, worker, input, answer) in equality_trace() {
        let conversation = &mut history[session as usize];
        conversation.extend(turn(input, 100 + session * 10 + k));
        let regions = vec![(0..2 * B, RegionKind::System)];
        let req = GenRequest { regions, ..GenRequest::greedy(conversation.clone(), answer) };
        let out = pair.serve(worker, &req).await;
        assert_eq!(out.tokens.len(), answer, "every answer has its full length");
        conversation.extend(&out.tokens);
        hits.push(out.hit_tokens);
        pair.flush().await;
    }
    hits
}

/// The simulated engine and the reference engine drive the same pipeline: replaying the same
/// trace over tiers of the same sizes, every request gets the same hit tokens from the same
/// tiers — G1 reuse, G2 loads across workers, and G3 loads once G2 has evicted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulated_and_the_reference_engine_hit_the_same_tiers_on_a_replay() {
    use dynamo_actors::worker::simulated::{SimNode, SimTiming, SimulatedEngine, WriteThrough};
    use dynamo_config::Calibration;

    // G2 keeps 6 blocks (its pool has room to spare, so only the registry evicts); G3 keeps all.
    let sizes = Sizes { g2_slots: 64, g2_blocks: 6, g3_slots: 128, g3_policy: PolicyKind::Lru };
    let n = node_sized(sizes, Arc::new(NoObserver), false);
    let mut workers =
        [n.worker_with_pages(CpuBackend::default(), 128), n.worker_with_pages(CpuBackend::default(), 128)];
    let reference = replay_hits(&mut workers).await;

    // The same sizes on a simulated node, deciding with the same (unmeasured) cost model.
    let cal = Calibration::h200();
    let prefill = cal.prefill_for("llama-8b").expect("calibrated").clone();
    let timing = SimTiming::from_calibration(&cal, prefill, 0.005, n.tiers.layout.image_bytes() as u64);
    let retention = RetentionSection::default();
    let mut sim = SimNode::new(
        B,
        n.tiers.salt,
        retention,
        timing,
        WriteThrough::G2G3,
        6,
        128,
        PolicyKind::Lru,
        Arc::new(NoObserver),
    );
    sim.cost = n.tiers.cost.clone();
    let sim = Arc::new(sim);
    let epoch = tokio::time::Instant::now();
    let mut engines = [
        SimulatedEngine::new(0, sim.clone(), 128, PolicyKind::Lru, epoch),
        SimulatedEngine::new(1, sim.clone(), 128, PolicyKind::Lru, epoch),
    ];
    let simulated = tokio::task::LocalSet::new().run_until(replay_hits(&mut engines)).await;

    for (i, (r, s)) in reference.iter().zip(&simulated).enumerate() {
        assert_eq!(r, s, "request {i} ({:?}): reference {r:?}, simulated {s:?}", equality_trace()[i]);
    }
    let total = |tier: TierName| reference.iter().map(|h| h[tier]).sum::<usize>();
    assert!(
        total(TierName::G1) > 0 && total(TierName::G2) > 0 && total(TierName::G3) > 0,
        "the trace exercises G1, G2 and G3: {reference:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_reused_in_g1_stays_recent_in_g2() {
    // G2 keeps 6 blocks: two prompts of 3.
    let sizes = Sizes { g2_slots: 10, g2_blocks: 6, g3_slots: 64, g3_policy: PolicyKind::Lru };
    let n = node_sized(sizes, Arc::new(NoObserver), false);
    let (mut a, mut b) = (n.worker(), n.worker());
    // System blocks: no hold at the turn's end, so recency alone decides.
    let prompt = |seed| GenRequest {
        regions: vec![(0..4 * B, RegionKind::System)],
        ..GenRequest::greedy(turn(3 * B + 9, seed), 6)
    };
    let blocks =
        |req: &GenRequest| BlockHasher::new(req.salt(n.tiers.salt), B).hash_sequence(&req.prompt)[..3].to_vec();
    let in_g2 = |hashes: &[BlockHash]| hashes.iter().filter(|h| n.tiers.g2.as_ref().unwrap().contains(**h)).count();
    let (first, second, third) = (prompt(1), prompt(2), prompt(3));
    run(&mut a, &first).await;
    a.flush().await;
    // Recency is kept in milliseconds: each phase in a later one.
    tokio::time::sleep(Duration::from_millis(3)).await;
    run(&mut b, &second).await;
    b.flush().await;
    // Recency is kept in milliseconds: each phase in a later one.
    tokio::time::sleep(Duration::from_millis(3)).await;
    assert_eq!((in_g2(&blocks(&first)), in_g2(&blocks(&second))), (3, 3), "both written through");
    // The first prompt again on its worker: reused in place, which is a use of its G2 copies.
    let again = run(&mut a, &first).await;
    a.flush().await;
    // Recency is kept in milliseconds: each phase in a later one.
    tokio::time::sleep(Duration::from_millis(3)).await;
    assert_eq!(again.hit_tokens.g1, 3 * B, "reused from G1");
    // A third prompt needs room in G2: the least recently used blocks go, the second's.
    run(&mut b, &third).await;
    b.flush().await;
    // Recency is kept in milliseconds: each phase in a later one.
    tokio::time::sleep(Duration::from_millis(3)).await;
    assert_eq!(in_g2(&blocks(&first)), 3, "the reused prefix kept its G2 copies");
    assert_eq!(in_g2(&blocks(&second)), 0, "the prompt used longest ago made room");
    assert_eq!(in_g2(&blocks(&third)), 3);
}
