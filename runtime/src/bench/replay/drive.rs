//! The drivers: one run of a policy over a trace, with the simulated engines or the reference
//! ones, sessions paced as the trace says.

use super::*;

pub(super) fn replay_one(trace: &Trace, setup: &Shared, policy: Policy, label: &str) -> anyhow::Result<Outcome> {
    let local = tokio::task::LocalSet::new();
    let wall = WallInstant::now();
    let mut outcome = match setup.engine {
        ReplayEngine::Simulated => {
            let runtime = virtual_clock()?;
            // The whole node runs on this thread: a recorder local to it sees this run's decisions.
            let decisions = Arc::new(Decisions::default());
            let recorder = DecisionRecorder(decisions.clone());
            let mut outcome = metrics::with_local_recorder(&recorder, || {
                local.block_on(&runtime, drive(trace, setup, policy, label))
            })?;
            outcome.decisions_s = std::mem::take(&mut *decisions.0.lock().unwrap_or_else(|e| e.into_inner()));
            outcome.decisions_s.sort_by(f64::total_cmp);
            outcome
        }
        ReplayEngine::Reference => {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            local.block_on(&runtime, drive_reference(trace, setup, policy, label))?
        }
    };
    outcome.wall = wall.elapsed();
    Ok(outcome)
}

/// A runtime on a paused clock: time jumps to the next timer whenever every task waits, so the
/// simulated engines' compute and transfers take no wall time.
#[cfg(any(test, feature = "virtual-time"))]
fn virtual_clock() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build()?)
}

/// Without `virtual-time` the daemon has no paused clock (tokio's `test-util`) to offer.
#[cfg(not(any(test, feature = "virtual-time")))]
fn virtual_clock() -> anyhow::Result<tokio::runtime::Runtime> {
    anyhow::bail!(
        "`bench replay --engine simulated` runs the node on a virtual clock, which this build leaves \
         out of the daemon; build it in with `cargo run --release -p dynamo-node --features \
         virtual-time -- bench replay ...`, or replay on this machine's CPU in real time with \
         `--engine reference`"
    )
}

/// The wall time of every routing decision of a run, in seconds.
#[derive(Debug, Default)]
pub(super) struct Decisions(std::sync::Mutex<Vec<f64>>);

impl metrics::HistogramFn for Decisions {
    fn record(&self, value: f64) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(value);
    }
}

/// Keeps `dynamo_node_router_decision_seconds` (what the scheduler records of each decision, in
/// wall time) and drops every other metric.
pub(super) struct DecisionRecorder(Arc<Decisions>);

impl metrics::Recorder for DecisionRecorder {
    fn describe_counter(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_gauge(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_histogram(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}

    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::noop()
    }

    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }

    fn register_histogram(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        if key.name() == names::ROUTER_DECISION_SECONDS {
            metrics::Histogram::from_arc(self.0.clone())
        } else {
            metrics::Histogram::noop()
        }
    }
}

/// A progress line on stderr while a long replay runs (only on a terminal).
pub(super) struct Progress {
    pub(super) label: String,
    pub(super) total: usize,
    pub(super) done: std::cell::Cell<usize>,
    pub(super) shown: std::cell::Cell<usize>,
    pub(super) tty: bool,
}

impl Progress {
    pub(super) fn tick(&self) {
        let done = self.done.get() + 1;
        self.done.set(done);
        let pct = done * 100 / self.total.max(1);
        if self.tty && pct != self.shown.get() {
            self.shown.set(pct);
            let bar: String = (0..40).map(|i| if i * 100 < pct * 40 { '#' } else { '.' }).collect();
            eprint!("\r{} [{bar}] {done}/{} requests", self.label, self.total);
            if done == self.total {
                eprintln!();
            }
        }
    }
}

pub(super) async fn drive(trace: &Trace, setup: &Shared, policy: Policy, label: &str) -> anyhow::Result<Outcome> {
    let (spawner, spawn_loop) = local_spawner();
    tokio::task::spawn_local(spawn_loop);
    let salt = Salt(0x7265_706c_6179);
    // Events applied where published, under a constant epoch: the replay is deterministic in
    // virtual time.
    let builder = NodeBuilder::new(IndexConfig { max_blocks: 64 << 20, ..IndexConfig::default() }).with_epoch(1);
    let retention = match policy.eviction {
        Eviction::Retention => setup.retention.clone(),
        Eviction::PlainLru => plain_lru(),
    };
    // One simulated node per `--nodes`, each with its G2/G3 and its KV events (node id n) into
    // the one index; every node can load from the others' G2 (G4).
    let epoch = Instant::now();
    let book = Arc::new(LeaseBook::default());
    let nodes: Vec<Arc<SimNode>> = (0..setup.nodes)
        .map(|n| {
            let publisher: Arc<dyn KvObserver> = builder.publisher(n as u16);
            Arc::new(
                SimNode::new(
                    setup.block_tokens,
                    salt,
                    retention.clone(),
                    setup.timing.clone(),
                    policy.write_through,
                    setup.blocks(setup.g2),
                    setup.blocks(setup.g3),
                    PolicyKind::Lru,
                    publisher,
                )
                .with_leases(book.clone(), epoch, setup.config.tiers.lease_budget),
            )
        })
        .collect();
    if policy.g4 {
        SimNode::connect(&nodes);
    }
    let g1_blocks = setup.blocks(setup.g1);
    let factory_nodes = nodes.clone();
    let per_node = setup.workers;
    // Each simulated worker batches as the reference worker does, within the configured
    // `engine.max_batch_tokens` and `engine.max_running_requests`.
    let (batch_tokens, max_running) = (setup.config.engine.max_batch_tokens, setup.config.engine.max_running_requests);
    let factory: EngineFactory = Arc::new(move |id| {
        let node = factory_nodes[id / per_node].clone();
        let engine = SimulatedEngine::new(id, node, g1_blocks, PolicyKind::Lru, epoch);
        Ok(Box::new(engine.with_batch(batch_tokens, max_running)) as Box<dyn Engine>)
    });
    // The router ranks workers with the same cost model the simulated workers decide with.
    let mut cost = setup.timing.cost_model(setup.block_tokens);
    if !policy.g4 {
        // Without G4 no load from another node is ever worth it: the router counts none.
        cost.g4_read = dynamo_tiering::cost::BytesPerSec::new(1.0);
    }
    // Working-set admission counts the nodes' G2 beside the workers' G1.
    let g2_blocks = match policy.write_through {
        WriteThrough::Off => 0,
        _ => setup.blocks(setup.g2) * setup.nodes,
    };
    let routing = Routing { salt, block_tokens: setup.block_tokens, cost, g2_blocks };
    let engines = EngineSet {
        workers: setup.workers * setup.nodes,
        factory,
        host: EngineHost::Local(spawner),
        queue_bound: 1 << 16,
        queue_policy: setup.config.router.queue_policy,
    };
    let scheduling = Scheduling {
        policy: policy.routing,
        session_idle_timeout: Duration::from_secs(600),
        max_sessions: usize::MAX,
        seed: 42,
        sticky_bonus: setup.sticky_bonus,
        temperature: setup.temperature,
        workers_per_node: setup.workers,
        admission: Scheduling::from_config(&setup.config).admission,
    };
    // The scheduler grants `cache_control` leases in the nodes' tiers (one book for all).
    let leases: Arc<dyn LeasedTiers> = nodes[0].clone();
    let node = builder
        .simulated(routing)
        .leases(leases)
        .engines(engines)
        .spawn(scheduling)
        .await
        .context("starting the simulated node")?;
    let scheduler = node.scheduler.clone();
    let start = Instant::now();
    // Occupancy over virtual time, sampled every 10 virtual seconds.
    let sampled = nodes.clone();
    let timeline = Rc::new(std::cell::RefCell::new(Vec::new()));
    let samples_out = timeline.clone();
    let sampler = tokio::task::spawn_local(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            tick.tick().await;
            let mut sample = Occupancy { at_s: start.elapsed().as_secs_f64(), ..Occupancy::default() };
            for node in &sampled {
                let (g2, g3) = node.resident();
                sample.g1 += node.stats.g1_resident.load(Ordering::Relaxed);
                sample.g2 += g2;
                sample.g3 += g3;
            }
            samples_out.borrow_mut().push(sample);
        }
    });
    let min_lease = setup.config.frontend.cache_min_tokens;
    let bound = BoundHashing { block_tokens: setup.block_tokens, salt };
    let (samples, prompts) = run_sessions(trace, &scheduler, start, label, policy, min_lease, bound).await?;
    let virtual_time = start.elapsed();
    sampler.abort();
    node.shutdown().await;
    let load = |f: &dyn Fn(&SimNode) -> &std::sync::atomic::AtomicU64| -> u64 {
        nodes.iter().map(|n| f(n).load(Ordering::Relaxed)).sum()
    };
    let acks = load(&|n| &n.stats.g3_acks).max(1) as f64;
    let mut evictions: [BTreeMap<RegionKind, u64>; 3] = Default::default();
    for node in &nodes {
        let [g2, g3] = node.evictions();
        for (tier, by_region) in
            [node.stats.g1_evictions.lock().expect("stats").clone(), g2, g3].into_iter().enumerate()
        {
            for (region, n) in by_region {
                *evictions[tier].entry(region).or_default() += n;
            }
        }
    }
    let lag_max = nodes.iter().map(|n| n.stats.g3_lag_us_max.load(Ordering::Relaxed)).max().unwrap_or(0);
    let timeline = timeline.borrow().clone();
    Ok(Outcome {
        policy,
        samples,
        wall: Duration::ZERO,
        virtual_time,
        bound_hit_rate: bound_hit_rate(prompts, setup.block_tokens),
        bytes: [
            load(&|n| &n.stats.g2_to_g1_bytes),
            load(&|n| &n.stats.g3_to_g1_bytes),
            load(&|n| &n.stats.g1_to_g2_bytes),
            load(&|n| &n.stats.g2_to_g3_bytes),
            load(&|n| &n.stats.g4_to_g1_bytes),
        ],
        g3_skipped: load(&|n| &n.stats.g3_skipped),
        preempted: load(&|n| &n.stats.preemptions),
        queue_ms: load(&|n| &n.stats.queue_us_sum) as f64 / load(&|n| &n.stats.prefills).max(1) as f64 / 1e3,
        evictions,
        lag_ms: (load(&|n| &n.stats.g3_lag_us_sum) as f64 / acks / 1e3, lag_max as f64 / 1e3),
        timeline,
        capacity: None,
        decisions_s: Vec::new(),
    })
}

/// Replays on the real node: the reference engine on this machine's CPU over real G1/G2/G3 (in a
/// scratch data directory), with the same actors, in real time. Link bytes, evictions and the
/// occupancy timeline are the simulator's counters and are not reported here (the node's
/// Prometheus metrics carry them).
pub(super) async fn drive_reference(
    trace: &Trace,
    setup: &Shared,
    policy: Policy,
    label: &str,
) -> anyhow::Result<Outcome> {
    let mut cfg = setup.config.clone();
    let dir = std::env::temp_dir().join(format!("dynamo-replay-{}-{}", std::process::id(), label.len()));
    let _ = std::fs::remove_dir_all(&dir);
    cfg.node.data_dir = dir.clone();
    cfg.engine.workers = setup.workers;
    cfg.engine.max_queued_requests = 1 << 16;
    cfg.router.policy = policy.routing;
    cfg.retention = match policy.eviction {
        Eviction::Retention => setup.retention.clone(),
        Eviction::PlainLru => plain_lru(),
    };
    match policy.write_through {
        WriteThrough::Off => {
            cfg.tiers.g2.enabled = false;
            cfg.tiers.g3.enabled = false;
        }
        WriteThrough::G2 => cfg.tiers.g3.enabled = false,
        WriteThrough::G2G3 => {}
    }
    let plan = crate::plan::ResolvedTiers::resolve(&cfg)?;
    let (open_cfg, open_plan) = (cfg.clone(), plan.clone());
    let stores = tokio::task::spawn_blocking(move || Serving::open(&open_cfg, &open_plan)).await??;
    let serving = Serving::start(&cfg, &plan, stores).await?;
    let scheduler = serving.node.current_scheduler().await?;
    let start = Instant::now();
    let bound = BoundHashing { block_tokens: cfg.blocks.block_size, salt: Salt(0) };
    let (samples, prompts) =
        run_sessions(trace, &scheduler, start, label, policy, cfg.frontend.cache_min_tokens, bound).await?;
    let elapsed = start.elapsed();
    serving.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Outcome {
        policy,
        samples,
        wall: Duration::ZERO,
        virtual_time: elapsed,
        bound_hit_rate: bound_hit_rate(prompts, cfg.blocks.block_size),
        bytes: [0; 5],
        g3_skipped: 0,
        preempted: 0,
        queue_ms: 0.0,
        evictions: Default::default(),
        lag_ms: (0.0, 0.0),
        timeline: Vec::new(),
        capacity: None,
        decisions_s: Vec::new(),
    })
}

/// One request as the bound sees it: when it arrived, its prompt length, and the whole sequence
/// after it (prompt and answer: the answer's blocks are computed, so an infinite cache has them),
/// as the first `n` block hashes of a chain. A session's sequences are prefixes of its final
/// history, so its turns share one chain; tokens are not kept (an 800-session trace's prompts
/// add up to billions of them).
pub(super) type Turned = (Instant, usize, Rc<[BlockHash]>, usize);

/// What each session task of a run goes by.
#[derive(Clone, Copy)]
pub(super) struct SessionRules {
    pub(super) policy: Policy,
    pub(super) min_lease: usize,
    pub(super) bound: BoundHashing,
}

/// What the infinite-cache bound hashes with.
#[derive(Clone, Copy)]
pub(super) struct BoundHashing {
    pub(super) block_tokens: usize,
    pub(super) salt: Salt,
}

/// The hit rate of an infinite cache: every block ever computed — prompts and answers — stays,
/// in arrival order.
pub(super) fn bound_hit_rate(mut turns: Vec<Turned>, b: usize) -> f64 {
    turns.sort_by_key(|(at, ..)| *at);
    let mut seen = HashSet::new();
    let (mut hit, mut total) = (0usize, 0usize);
    for (_, prompt, chain, blocks) in turns {
        let hashes = &chain[..blocks];
        let cap = prompt.saturating_sub(1) / b;
        hit += hashes.iter().take(cap).take_while(|h| seen.contains(*h)).count() * b;
        total += prompt;
        seen.extend(hashes.iter().copied());
    }
    hit as f64 / total.max(1) as f64
}

pub(super) type SessionResult = anyhow::Result<(Vec<Sample>, Vec<Turned>)>;

/// Runs every session of `trace` against `scheduler` (one local task each, from `start`) and
/// collects what each request did.
pub(super) async fn run_sessions(
    trace: &Trace,
    scheduler: &SchedulerRef,
    start: Instant,
    label: &str,
    policy: Policy,
    min_lease: usize,
    bound: BoundHashing,
) -> SessionResult {
    let progress = Rc::new(Progress {
        label: label.to_string(),
        total: trace.requests,
        done: Default::default(),
        shown: Default::default(),
        tty: std::io::stderr().is_terminal(),
    });
    let mut tasks = tokio::task::JoinSet::new();
    for (s, turns) in trace.sessions.iter().enumerate() {
        let session = run_session(
            s,
            turns.clone(),
            scheduler.clone(),
            start,
            progress.clone(),
            SessionRules { policy, min_lease, bound },
        );
        tasks.spawn_local(session);
    }
    let mut samples = Vec::with_capacity(trace.requests);
    let mut prompts = Vec::with_capacity(trace.requests);
    while let Some(done) = tasks.join_next().await {
        let (s, p) = done.context("a session task failed")??;
        samples.extend(s);
        prompts.extend(p);
    }
    Ok((samples, prompts))
}

pub(super) async fn run_session(
    session: usize,
    turns: Vec<Turn>,
    scheduler: SchedulerRef,
    start: Instant,
    progress: Rc<Progress>,
    rules: SessionRules,
) -> SessionResult {
    let SessionRules { policy, min_lease, bound } = rules;
    let preamble_kept = policy.preamble_kept;
    let hints = Hints {
        priority: if policy.priorities && high_priority(session) { HIGH_PRIORITY } else { 0 },
        ..Hints::default()
    };
    let mut samples = Vec::with_capacity(turns.len());
    let mut prompts = Vec::with_capacity(turns.len());
    let mut history: Vec<u32> = Vec::new();
    let mut hasher = BlockHasher::new(bound.salt, bound.block_tokens);
    let mut sequences = Vec::new();
    let mut system = 0;
    let id = format!("session-{session}");
    for (k, turn) in turns.into_iter().enumerate() {
        if k == 0 {
            tokio::time::sleep_until(start + Duration::from_secs_f64(turn.at_ms / 1e3)).await;
            system = turn.system_tokens;
        } else {
            tokio::time::sleep(Duration::from_secs_f64(turn.delay_ms / 1e3)).await;
        }
        history.extend(&turn.new_tokens);
        // A billing header left in: tokens of this request's own before everything else.
        let preamble: Vec<u32> = if preamble_kept {
            let mut state = ((session as u64) << 20 | k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xb111;
            (0..PREAMBLE_TOKENS)
                .map(|_| {
                    state = splitmix(state);
                    (state % 120_000) as u32 + 256
                })
                .collect()
        } else {
            Vec::new()
        };
        let prompt = [preamble.as_slice(), history.as_slice()].concat();
        let system = system + preamble.len();
        let mut regions = vec![(0..system, RegionKind::System)];
        regions.push((system..prompt.len(), RegionKind::Conversation));
        let prompt_len = prompt.len();
        // `cache_control` on the system prompt, as an agent marks it, when long enough to count.
        let mut leases = Vec::new();
        if policy.leased != Leased::No && system >= min_lease.max(1) {
            leases.push(LeaseRequest { tokens: system, ttl: LEASE_TTL });
        }
        if policy.leased == Leased::Conversation && prompt.len() >= min_lease.max(1) {
            leases.push(LeaseRequest { tokens: prompt.len(), ttl: LEASE_TTL });
        }
        let req = GenRequest {
            regions,
            leases,
            seed: Some((session as u64) << 20 | k as u64),
            ..GenRequest::greedy(prompt, turn.output_length)
        };
        let submitted_at = Instant::now();
        let submitted = match scheduler
            .call(|reply| SchedulerMsg::Submit { req: Box::new(req), session: Some(id.clone()), hints, reply }, None)
            .await?
        {
            CallResult::Success(Ok(s)) => s,
            CallResult::Success(Err(e)) => bail!("request refused: {e}"),
            _ => bail!("the scheduler did not answer"),
        };
        let mut events = submitted.events;
        let mut sample = Sample { prompt: prompt_len, high: high_priority(session), system, ..Sample::default() };
        while let Some(event) = events.recv().await {
            match event {
                JobEvent::Event(WorkerEvent::Prefilled { hit_tokens, .. }) => {
                    sample.ttft = submitted_at.elapsed();
                    sample.hit = hit_tokens;
                }
                JobEvent::Event(WorkerEvent::Token(t)) => {
                    history.push(t);
                    sample.output += 1;
                }
                JobEvent::Event(WorkerEvent::Computed { .. }) => {}
                JobEvent::Done(_) => break,
                JobEvent::Failed(e) => bail!("request failed: {e}"),
            }
        }
        sample.done_at = start.elapsed();
        if preamble_kept {
            // Each sequence starts with tokens of its own: a chain of its own.
            let sequence = [preamble.as_slice(), history.as_slice()].concat();
            let chain: Rc<[BlockHash]> = hasher.hash_sequence(&sequence).into();
            prompts.push((submitted_at, sample.prompt, chain.clone(), chain.len()));
        } else {
            sequences.push((submitted_at, sample.prompt, history.len() / bound.block_tokens));
        }
        samples.push(sample);
        progress.tick();
    }
    if !sequences.is_empty() {
        let chain: Rc<[BlockHash]> = hasher.hash_sequence(&history).into();
        prompts.extend(sequences.into_iter().map(|(at, prompt, blocks)| (at, prompt, chain.clone(), blocks)));
    }
    Ok((samples, prompts))
}
