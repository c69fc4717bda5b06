//! A worker whose engine is a vLLM server: the node sends a prompt's token ids with the request's
//! sampling, stop tokens and limits to `POST /inference/v1/generate` (mounted by vLLM's
//! `--enable-scale-out` or `--tokens-only`) and streams the token ids back into the same events
//! the reference worker produces, so every API, parser, session and lease above the worker works
//! unchanged.
//!
//! vLLM batches and schedules by itself, so this engine runs each request as a task of its own on
//! the worker's thread and never steps ([`Engine::runs_in_background`]). What it knows of vLLM
//! (verified against vLLM 0.32 in `../shared/research/engine-workers.md`):
//! - `max_tokens` left out means the whole context: it is always sent.
//! - The stop token ends `token_ids` (as here: the caller sees it, the answer does not keep it).
//! - `cached_tokens` comes only in the usage chunk of `stream_options.include_usage`, after the
//!   last token: it is the request's outcome, not its `Prefilled` event.
//! - A request is aborted by closing its connection (vLLM's `with_cancellation` ends it within a
//!   step); dropping the request's task does that.
//! - On `--tokens-only` one id outside the vocabulary kills the engine: none is ever sent.
//! - Lower `priority` runs first under `--scheduling-policy priority`; the node's is the opposite.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use std::collections::HashMap;

use dynamo_config::{PerTier, RegionKind};
use dynamo_tiering::block::{BlockHash, BlockHasher, Namespace, Salt};
use dynamo_tiering::pipeline::region_of;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::Notify;
use tokio::task::JoinSet;

use super::{Engine, EngineReport, Finish, GenOutcome, LocalFuture, Ticket, WorkerError, WorkerEvent};
use crate::engine_names::{EngineNames, NodeName};
use crate::telemetry;
use crate::tiers::{BlockSite, KvObserver};
use crate::vllm_events::{self, RawEvent, Update};

/// One vLLM engine as a worker sees it.
#[derive(Clone, Debug)]
pub struct VllmTarget {
    /// `http://host:port`.
    pub url: String,
    /// The bearer key it was started with, if any.
    pub api_key: Option<String>,
    /// Longest a request may take there.
    pub request_timeout: Duration,
    /// Ids below this are in the model's vocabulary; no other is sent.
    pub vocab: usize,
    /// Most requests in flight to it at once (`engine.max_running_requests`).
    pub max_running: usize,
    /// Where it publishes its KV events (`tcp://host:port`), when it does: what it holds in G1
    /// then enters the node's prefix index under the node's names, for KV-aware routing.
    pub kv_events: Option<String>,
    /// How often its `/metrics` are read for its own report of its load (zero: never).
    pub load_interval: Duration,
}

/// How the node names blocks, and where changes of the engines' G1 go: what turns an engine's
/// KV events into the prefix index's.
#[derive(Clone, Debug)]
pub struct Naming {
    /// The node's salt (a tenant's namespace narrows it).
    pub salt: Salt,
    /// Tokens per block; an engine's blocks of another size are not followed.
    pub block_tokens: usize,
    /// The node's KV observer.
    pub observer: Arc<dyn KvObserver>,
    /// Where the node's names of the engine's blocks go, so that what the engine stores through
    /// the engine endpoint is found by the router too (with `engine_endpoint`).
    pub engine_names: Option<Arc<EngineNames>>,
}

/// The engine of a worker in front of one vLLM engine.
pub struct VllmEngine {
    id: usize,
    target: Arc<VllmTarget>,
    /// What marks the engine down, and probes it until it is back.
    down: Arc<Down>,
    /// Stops following the engine's KV events and its load (when the worker goes).
    stop: tokio::sync::watch::Sender<bool>,
    client: reqwest::Client,
    running: Arc<AtomicUsize>,
    ended: Arc<Notify>,
    tasks: JoinSet<()>,
    requests: u64,
    /// Where the regions of its requests' blocks go (with the engine endpoint).
    engine_names: Option<Arc<EngineNames>>,
}

impl std::fmt::Debug for VllmEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VllmEngine").field("id", &self.id).field("url", &self.target.url).finish()
    }
}

impl VllmEngine {
    /// Worker `id`'s engine, forwarding to `target`; its KV events, if it publishes them, go to
    /// `naming`'s observer as this worker's G1. Call it inside the worker's runtime.
    pub fn new(id: usize, target: Arc<VllmTarget>, naming: Naming) -> Result<Self, WorkerError> {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true)
            .build()
            .map_err(|e| WorkerError::Engine(format!("cannot build the HTTP client: {e}")))?;
        let down = Arc::new(Down {
            id,
            client: client.clone(),
            target: target.clone(),
            observer: naming.observer.clone(),
            probing: std::sync::atomic::AtomicBool::new(false),
        });
        telemetry::set_engine_up(&target.url, true);
        let engine_names = naming.engine_names.clone();
        let (stop, _) = tokio::sync::watch::channel(false);
        if let Some(endpoint) = target.kv_events.clone() {
            tokio::spawn(follow_g1(id, endpoint, naming, stop.subscribe()));
        }
        Ok(Self {
            id,
            target,
            down,
            stop,
            client,
            running: Arc::new(AtomicUsize::new(0)),
            ended: Arc::new(Notify::new()),
            tasks: JoinSet::new(),
            requests: 0,
            engine_names,
        })
    }
}

impl Drop for VllmEngine {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// Follows worker `id`'s engine's KV events at `endpoint` into `naming`'s observer until
/// `stop`; then (and on any gap) the worker's G1 is reported cleared.
async fn follow_g1(id: usize, endpoint: String, naming: Naming, mut stop: tokio::sync::watch::Receiver<bool>) {
    let site = BlockSite::G1 { worker: id };
    let observer = naming.observer.clone();
    let mut names = Names::new(naming.salt, naming.block_tokens);
    let label = format!("worker {id}");
    vllm_events::follow(&endpoint, &label, &mut stop, |update| match update {
        Update::Events(events) => {
            for event in events {
                match event {
                    RawEvent::Stored { hashes, parent, token_ids, block_size, cache_salt, .. } => {
                        match names.stored(&hashes, parent, &token_ids, block_size, cache_salt.as_deref()) {
                            Some((parent, named)) => {
                                observer.stored(site, parent, &named);
                                if let Some(engine_names) = &naming.engine_names {
                                    let parents = std::iter::once(parent).chain(named.iter().copied().map(Some));
                                    for ((&theirs, &hash), parent) in hashes.iter().zip(&named).zip(parents) {
                                        engine_names.named(theirs, NodeName { hash, parent });
                                    }
                                }
                            }
                            None => telemetry::record_engine_kv_events(&label, "unnamed", 1),
                        }
                    }
                    RawEvent::Removed { hashes, .. } => {
                        let gone = names.removed(&hashes);
                        if !gone.is_empty() {
                            observer.removed(site, &gone);
                        }
                    }
                    RawEvent::Cleared => {
                        names.clear();
                        observer.cleared(id);
                    }
                }
            }
            if names.len() > MAX_NAMES {
                // More blocks than any engine holds: events were lost somewhere. Start over.
                names.clear();
                observer.cleared(id);
            }
        }
        Update::Gap => {
            telemetry::record_engine_kv_events(&label, "gap", 1);
            names.clear();
            observer.cleared(id);
        }
        Update::Malformed(why) => {
            tracing::debug!(worker = id, why, "KV events: a batch did not decode");
            telemetry::record_engine_kv_events(&label, "malformed", 1);
        }
    })
    .await;
    observer.cleared(id);
}

/// Most blocks of one engine's G1 the node keeps names for.
const MAX_NAMES: usize = 1 << 22;

/// An engine's names of the blocks in its G1 (the low 64 bits of vLLM's hashes) and the node's
/// names of the same blocks: the node's hash of the same tokens after the same parent, under the
/// salt of the request's namespace (the `cache_salt` the node sent, on a sequence's first block).
/// Under the node's names the router finds them from a prompt. vLLM stores and removes one block
/// many times (requests that filled identical blocks of their own): each is counted, and leaves
/// the index only with its last copy.
#[derive(Debug)]
struct Names {
    salt: Salt,
    block_tokens: usize,
    known: HashMap<u64, Known>,
}

#[derive(Clone, Copy, Debug)]
struct Known {
    hash: BlockHash,
    /// The salt its sequence hashes under.
    salt: Salt,
    copies: u32,
}

impl Names {
    fn new(salt: Salt, block_tokens: usize) -> Self {
        Self { salt, block_tokens, known: HashMap::new() }
    }

    fn len(&self) -> usize {
        self.known.len()
    }

    fn clear(&mut self) {
        self.known.clear();
    }

    /// The node's names of a `BlockStored` event's parent and blocks; `None` when the node cannot
    /// name them: blocks of another size, no tokens, a parent it never saw (its events were
    /// lost), or a salt the node did not send.
    fn stored(
        &mut self,
        hashes: &[u64],
        parent: Option<u64>,
        token_ids: &[u32],
        block_size: usize,
        cache_salt: Option<&str>,
    ) -> Option<(Option<BlockHash>, Vec<BlockHash>)> {
        if block_size != self.block_tokens || token_ids.len() != hashes.len() * block_size {
            return None;
        }
        let (mut previous, salt) = match parent {
            Some(parent) => {
                let known = self.known.get(&parent)?;
                (Some(known.hash), known.salt)
            }
            None => match cache_salt {
                None => (None, self.salt),
                Some(hex) => (None, self.salt.within(Some(Namespace::from_hex(hex)?))),
            },
        };
        let parent_name = previous;
        let mut hasher = BlockHasher::new(salt, block_size);
        let mut named = Vec::with_capacity(hashes.len());
        for (&theirs, tokens) in hashes.iter().zip(token_ids.chunks(block_size)) {
            let hash = hasher.hash_block(previous, tokens);
            self.known.entry(theirs).and_modify(|k| k.copies += 1).or_insert(Known { hash, salt, copies: 1 });
            named.push(hash);
            previous = Some(hash);
        }
        Some((parent_name, named))
    }

    /// The node's names of the blocks whose last copy `hashes` removed.
    fn removed(&mut self, hashes: &[u64]) -> Vec<BlockHash> {
        let mut gone = Vec::new();
        for theirs in hashes {
            if let Some(known) = self.known.get_mut(theirs) {
                known.copies -= 1;
                if known.copies == 0 {
                    gone.push(known.hash);
                    self.known.remove(theirs);
                }
            }
        }
        gone
    }
}

impl Engine for VllmEngine {
    fn admit(&mut self, ticket: Ticket) -> LocalFuture<'_, ()> {
        self.requests += 1;
        // What the engine stores of this prompt through the connector takes its regions.
        if let (Some(names), Some(hashes)) = (&self.engine_names, &ticket.req.hashes)
            && ticket.req.regions.iter().any(|(_, region)| *region != RegionKind::Conversation)
        {
            let b = hashes.block_tokens.max(1);
            let regions = &ticket.req.regions;
            names.regions(hashes.hashes.iter().enumerate().filter_map(|(i, &hash)| {
                let region = region_of(regions, i * b);
                (region != RegionKind::Conversation).then_some((hash, region))
            }));
        }
        // Unique per engine, across restarts of this worker too (vLLM does not refuse a
        // duplicate id, and one abort would end both).
        let request_id = format!("dn-{}-{}-{}", self.id, crate::worker::unix_millis(), self.requests);
        let (client, target, down) = (self.client.clone(), self.target.clone(), self.down.clone());
        let (running, ended) = (self.running.clone(), self.ended.clone());
        running.fetch_add(1, Ordering::Relaxed);
        let span = ticket.span.clone();
        self.tasks.spawn(tracing::Instrument::instrument(
            async move {
                forward(&client, &target, ticket, &request_id, Some(&down)).await;
                running.fetch_sub(1, Ordering::Relaxed);
                ended.notify_one();
            },
            span,
        ));
        Box::pin(async {})
    }

    fn has_room(&self) -> bool {
        self.running.load(Ordering::Relaxed) < self.target.max_running
    }

    fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }

    /// Waits until a request ends (cancel-safe: the worker drops it when a request is queued).
    fn step(&mut self) -> LocalFuture<'_, ()> {
        Box::pin(async move {
            // Reap what ended, so the set does not grow with the worker's uptime.
            while self.tasks.try_join_next().is_some() {}
            if self.running() > 0 {
                self.ended.notified().await;
            }
        })
    }

    fn runs_in_background(&self) -> bool {
        true
    }

    /// Reads the engine's own load from its `/metrics` every `load_interval` into `load`, for
    /// the router, until the worker goes; while the engine does not answer it reports nothing.
    /// An engine that refuses the connection is down (its process is gone): its worker is marked
    /// down at once, before a request finds out.
    fn watch_load(&mut self, load: Arc<super::WorkerLoad>) {
        let interval = self.target.load_interval;
        if interval.is_zero() {
            return;
        }
        let (client, target, down) = (self.client.clone(), self.target.clone(), self.down.clone());
        let mut stop = self.stop.subscribe();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stop.changed() => break,
                    _ = tick.tick() => {}
                }
                let report = match engine_report(&client, &target, interval.max(Duration::from_secs(1))).await {
                    Ok(report) => report,
                    Err(e) if e.is_connect() => {
                        if !load.is_down() {
                            down.mark(load.clone(), "its /metrics refused the connection");
                        }
                        None
                    }
                    Err(_) => None,
                };
                telemetry::set_engine_load(&target.url, report.as_ref());
                load.report(report);
            }
            load.report(None);
        });
    }

    /// Dropping a request's task drops its ticket (answered "restarting") and closes its
    /// connection, which aborts it in vLLM.
    fn reset(&mut self, _why: &str) -> usize {
        self.tasks.abort_all();
        0
    }

    fn flush(&mut self) -> LocalFuture<'_, ()> {
        Box::pin(async move { while self.tasks.join_next().await.is_some() {} })
    }
}

/// Most bytes of an engine's `/metrics` read (vLLM's are tens of kilobytes): the rest is not.
const MAX_METRICS: usize = 4 << 20;

/// The engine's report of its own load, from its `/metrics` (`None`: its metrics hold none in
/// their first [`MAX_METRICS`] bytes).
async fn engine_report(
    client: &reqwest::Client,
    target: &VllmTarget,
    timeout: Duration,
) -> Result<Option<EngineReport>, reqwest::Error> {
    let mut request = client.get(format!("{}/metrics", target.url)).timeout(timeout);
    if let Some(key) = &target.api_key {
        request = request.bearer_auth(key);
    }
    let mut response = request.send().await?.error_for_status()?;
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        let room = MAX_METRICS - body.len();
        body.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if body.len() == MAX_METRICS {
            break;
        }
    }
    Ok(crate::vllm_metrics::report(&String::from_utf8_lossy(&body)))
}

/// The body of `POST /inference/v1/generate` for `ticket`'s request.
fn generate_body(ticket: &Ticket, request_id: &str) -> Value {
    let req = &ticket.req;
    let s = req.sampling;
    let mut sampling = json!({
        // A prefill alone (`max_tokens` 0, which vLLM refuses) is a one-token request whose
        // token is not shown.
        "max_tokens": req.max_tokens.max(1),
        "temperature": s.temperature,
        "top_p": s.top_p,
        // vLLM's "all" is -1 (0 is refused); the node's is 0.
        "top_k": if s.top_k == 0 { -1 } else { i64::from(s.top_k) },
        "repetition_penalty": s.repetition_penalty,
        "stop_token_ids": req.stop_tokens,
        "detokenize": false,
        "skip_special_tokens": false,
    });
    if let Some(seed) = req.seed.filter(|_| s.temperature > 0.0) {
        sampling["seed"] = json!(seed);
    }
    let mut body = json!({
        "request_id": request_id,
        "token_ids": req.prompt,
        "sampling_params": sampling,
        "stream": true,
        "stream_options": {"include_usage": true},
        // vLLM runs lower values first; the node's higher.
        "priority": -i64::from(ticket.priority),
    });
    // The tenant's namespace is the engine's cache salt too: no tenant hits another's prefix
    // in the engine's own cache either.
    if let Some(namespace) = req.namespace {
        body["cache_salt"] = json!(namespace.to_hex());
    }
    body
}

/// What the stream said so far.
#[derive(Default)]
struct Streamed {
    tokens: Vec<u32>,
    finish: Option<Finish>,
    cached_tokens: Option<usize>,
    prefilled: bool,
    stopped_by_caller: bool,
}

/// Serves `ticket` on the engine: the request, its stream, the outcome.
async fn forward(
    client: &reqwest::Client,
    target: &VllmTarget,
    mut ticket: Ticket,
    request_id: &str,
    down: Option<&Arc<Down>>,
) {
    if ticket.req.prompt.is_empty() {
        return ticket.finish(Err(WorkerError::EmptyPrompt));
    }
    if let Some(&id) = ticket.req.prompt.iter().find(|&&id| id as usize >= target.vocab) {
        return ticket.finish(Err(WorkerError::OutOfVocabulary { id, vocab: target.vocab }));
    }
    let started = tokio::time::Instant::now();
    let mut post =
        client.post(format!("{}/inference/v1/generate", target.url)).json(&generate_body(&ticket, request_id));
    if let Some(key) = &target.api_key {
        post = post.bearer_auth(key);
    }
    let mut streamed = Streamed::default();
    let mut ttft = Duration::ZERO;
    let run = async {
        let response = post.send().await.map_err(|e| unreachable(target, &e))?;
        let status = response.status();
        if !status.is_success() {
            let text = response.text().await.unwrap_or_default();
            return Err(refused(target, status, &text));
        }
        let mut body = response.bytes_stream();
        let mut lines = LineBuffer::default();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| unreachable(target, &e))?;
            for line in lines.push(&chunk)? {
                let Some(data) = line.strip_prefix("data:").map(str::trim) else { continue };
                if data == "[DONE]" {
                    return Ok(());
                }
                let value: Value = serde_json::from_str(data)
                    .map_err(|e| WorkerError::Engine(format!("{}: an unreadable stream chunk ({e})", target.url)))?;
                if !apply(&value, &mut ticket, &mut streamed, target, &mut ttft, started)? {
                    // The caller went away: dropping the stream closes the connection, and vLLM
                    // aborts the request.
                    streamed.stopped_by_caller = true;
                    return Ok(());
                }
            }
        }
        Err(WorkerError::EngineDown(format!("{}: the stream ended before [DONE]", target.url)))
    };
    let result = match tokio::time::timeout(target.request_timeout, run).await {
        Ok(result) => result,
        Err(_) => Err(WorkerError::Engine(format!(
            "{}: no answer within engine.vllm.request_timeout ({:?}); aborted",
            target.url, target.request_timeout
        ))),
    };
    match result {
        Ok(()) => {
            let cached_tokens = streamed.cached_tokens.unwrap_or(0).min(ticket.req.prompt.len());
            let finish = match streamed.finish {
                Some(finish) => finish,
                None if streamed.stopped_by_caller => Finish::Stop,
                None => {
                    return ticket.finish(Err(WorkerError::EngineDown(format!(
                        "{}: the stream ended without a finish reason",
                        target.url
                    ))));
                }
            };
            // vLLM counts what its prefix cache held, from the engine's G1 or loaded through its
            // KV connector; the node cannot tell those apart here, so G1 has them.
            let hit_tokens = PerTier { g1: cached_tokens, ..PerTier::default() };
            telemetry::record_engine_request(&target.url, ticket.req.prompt.len(), cached_tokens, ttft);
            let prefill_tokens = ticket.req.prompt.len() - cached_tokens;
            ticket.finish(Ok(GenOutcome {
                tokens: streamed.tokens,
                cached_tokens,
                hit_tokens,
                prefill_tokens,
                finish,
                ttft,
                corrupt_blocks: 0,
            }));
        }
        Err(e) => {
            telemetry::record_engine_error(&target.url, e.kind());
            if let (WorkerError::EngineDown(why), Some(down), Some(load)) = (&e, down, ticket.worker_load()) {
                down.mark(load.clone(), why);
            }
            ticket.finish(Err(e));
        }
    }
}

/// An engine that stopped answering: its worker is marked down (the router sends it nothing while
/// another worker is up), what the index held of its G1 is dropped (an engine that restarts
/// starts empty), and `/health` is probed every second until it answers; then it is up again.
struct Down {
    id: usize,
    client: reqwest::Client,
    target: Arc<VllmTarget>,
    observer: Arc<dyn KvObserver>,
    probing: std::sync::atomic::AtomicBool,
}

impl Down {
    fn mark(self: &Arc<Self>, load: Arc<super::WorkerLoad>, why: &str) {
        if load.set_down(true) {
            tracing::warn!(worker = self.id, url = %self.target.url, why, "the engine is down; routing around it until it is healthy");
            telemetry::set_engine_up(&self.target.url, false);
            self.observer.cleared(self.id);
        }
        if self.probing.swap(true, Ordering::Relaxed) {
            return;
        }
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let mut probe = this.client.get(format!("{}/health", this.target.url)).timeout(Duration::from_secs(2));
                if let Some(key) = &this.target.api_key {
                    probe = probe.bearer_auth(key);
                }
                if probe.send().await.is_ok_and(|r| r.status().is_success()) {
                    break;
                }
            }
            load.set_down(false);
            this.probing.store(false, Ordering::Relaxed);
            telemetry::set_engine_up(&this.target.url, true);
            tracing::info!(worker = this.id, url = %this.target.url, "the engine is healthy again");
        });
    }
}

/// Takes one stream chunk into `ticket` and `streamed`; false once the caller stopped listening.
fn apply(
    chunk: &Value,
    ticket: &mut Ticket,
    streamed: &mut Streamed,
    target: &VllmTarget,
    ttft: &mut Duration,
    started: tokio::time::Instant,
) -> Result<bool, WorkerError> {
    if let Some(error) = chunk.get("error") {
        let message = error.get("message").and_then(Value::as_str).unwrap_or("an error without a message");
        // An engine that failed mid-stream (its EngineCore died) reports it in the stream.
        return Err(WorkerError::EngineDown(format!("{}: {message}", target.url)));
    }
    if let Some(cached) = chunk.pointer("/usage/prompt_tokens_details/cached_tokens").and_then(Value::as_u64) {
        streamed.cached_tokens = Some(cached as usize);
    }
    let Some(choice) = chunk.get("choices").and_then(Value::as_array).and_then(|c| c.first()) else {
        return Ok(true);
    };
    let ids = choice.get("token_ids").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    for id in ids {
        let id = id
            .as_u64()
            .and_then(|id| u32::try_from(id).ok())
            .ok_or_else(|| WorkerError::Engine(format!("{}: a token id that is not one ({id})", target.url)))?;
        if !streamed.prefilled {
            streamed.prefilled = true;
            *ttft = started.elapsed();
            // What vLLM's cache gave is known only at the end (the outcome carries it); until
            // then the router's prediction stands for it (what the engine's KV events and the
            // tiers showed), so that a stream's first usage (Anthropic's `message_start`) is
            // near what its last says.
            let cached_tokens = ticket.predicted_cached().unwrap_or(0).min(ticket.req.prompt.len());
            if !ticket.event(WorkerEvent::Prefilled { cached_tokens, hit_tokens: PerTier::default() }) {
                return Ok(false);
            }
        }
        if ticket.req.max_tokens == 0 {
            // A prefill alone: its one token is the engine's, not the caller's.
            streamed.finish = Some(Finish::Length);
            continue;
        }
        let stop = ticket.req.stop_tokens.contains(&id);
        if !stop {
            streamed.tokens.push(id);
        }
        if !ticket.event(WorkerEvent::Token(id)) {
            return Ok(false);
        }
        if stop {
            streamed.finish = Some(Finish::Stop);
        }
    }
    match choice.get("finish_reason").and_then(Value::as_str) {
        None => {}
        Some("length") => streamed.finish = Some(Finish::Length),
        Some("stop" | "abort") => streamed.finish = streamed.finish.or(Some(Finish::Stop)),
        Some(other) => {
            return Err(WorkerError::Engine(format!("{}: finished with \"{other}\"", target.url)));
        }
    }
    Ok(true)
}

/// The engine could not be reached or its connection broke: the request may be retried.
fn unreachable(target: &VllmTarget, e: &reqwest::Error) -> WorkerError {
    WorkerError::EngineDown(format!("{}: {e}", target.url))
}

/// The engine answered with an error status.
fn refused(target: &VllmTarget, status: reqwest::StatusCode, body: &str) -> WorkerError {
    let message = serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message").or_else(|| v.get("message")).or_else(|| v.get("detail")).map(|m| match m {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
        })
        .unwrap_or_else(|| body.chars().take(300).collect());
    let message = format!("{} answered {status}: {message}", target.url);
    if status == reqwest::StatusCode::SERVICE_UNAVAILABLE || status.is_server_error() {
        WorkerError::EngineDown(message)
    } else {
        WorkerError::Engine(message)
    }
}

/// Most bytes of one SSE line: a chunk is one step's tokens, far below this.
const MAX_LINE: usize = 1 << 20;

/// Splits a byte stream into its lines.
#[derive(Default)]
struct LineBuffer {
    partial: Vec<u8>,
}

impl LineBuffer {
    fn push(&mut self, bytes: &[u8]) -> Result<Vec<String>, WorkerError> {
        let mut lines = Vec::new();
        for &b in bytes {
            if b == b'\n' {
                let line = std::mem::take(&mut self.partial);
                lines.push(String::from_utf8_lossy(&line).trim_end_matches('\r').to_owned());
            } else {
                self.partial.push(b);
                if self.partial.len() > MAX_LINE {
                    return Err(WorkerError::Engine(format!("a stream line over {MAX_LINE} bytes")));
                }
            }
        }
        Ok(lines)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::{GenRequest, JobEvent};
    use dynamo_kernels::sampling::Sampling;
    use dynamo_tiering::block::Namespace;
    use tokio::sync::mpsc;

    fn ticket(req: GenRequest) -> (Ticket, mpsc::UnboundedReceiver<JobEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Ticket::local(req, tx), rx)
    }

    fn target() -> VllmTarget {
        VllmTarget {
            url: "http://engine".into(),
            api_key: None,
            request_timeout: Duration::from_secs(1),
            vocab: 512,
            max_running: 4,
            kv_events: None,
            load_interval: Duration::ZERO,
        }
    }

    /// An engine whose `/metrics` never ends: what it sends first is read, the rest is not.
    #[tokio::test]
    async fn an_engines_metrics_are_read_to_a_bound() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let Ok((mut socket, _)) = listener.accept().await else { return };
            let mut request = [0u8; 4096];
            let _ = socket.read(&mut request).await;
            let chunk = |s: &str| format!("{:x}\r\n{s}\r\n", s.len());
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n";
            let gauges = chunk("vllm:num_requests_running 1\nvllm:num_requests_waiting 2\n");
            let _ = socket.write_all(format!("{head}{gauges}").as_bytes()).await;
            let junk = chunk(&"# more\n".repeat(4096));
            while socket.write_all(junk.as_bytes()).await.is_ok() {}
        });
        // A reader that did not stop would run into the timeout, an error.
        let target = VllmTarget { url, ..target() };
        let report = engine_report(&reqwest::Client::new(), &target, Duration::from_secs(20)).await.unwrap();
        assert_eq!(report.map(|r| (r.running, r.waiting)), Some((1, 2)));
    }

    #[test]
    fn the_body_always_carries_max_tokens_the_stop_ids_and_vllms_own_conventions() {
        let mut req = GenRequest::greedy(vec![0, 4, 401], 8);
        req.stop_tokens = vec![1, 6];
        req.namespace = Namespace::new("tenant-a", "");
        let (mut t, _rx) = ticket(req);
        t.priority = 3;
        let body = generate_body(&t, "dn-1");
        assert_eq!(body["token_ids"], json!([0, 4, 401]));
        assert_eq!(body["sampling_params"]["max_tokens"], 8);
        assert_eq!(body["sampling_params"]["stop_token_ids"], json!([1, 6]));
        assert_eq!(body["sampling_params"]["top_k"], -1, "the node's 0 (all) is vLLM's -1");
        assert_eq!(body["sampling_params"]["detokenize"], false);
        assert_eq!(body["priority"], -3, "vLLM runs lower first");
        assert_eq!(body["stream_options"]["include_usage"], true, "cached_tokens comes only in the usage chunk");
        assert_eq!(body["cache_salt"].as_str().map(str::len), Some(32), "the tenant's namespace salts vLLM's cache");
        assert!(body["sampling_params"].get("seed").is_none(), "greedy needs no seed");

        let mut req = GenRequest::greedy(vec![5], 2);
        req.sampling = Sampling::temperature(0.7);
        let (t, _rx) = ticket(req.clone());
        let body = generate_body(&t, "dn-2");
        assert!(body["sampling_params"].get("seed").is_none(), "no seed asked: the engine's own generator");
        req.seed = Some(42);
        let (t, _rx) = ticket(req);
        let body = generate_body(&t, "dn-2");
        assert_eq!(body["sampling_params"]["seed"], 42);
        assert!(body.get("cache_salt").is_none(), "the shared namespace has no salt");
    }

    #[test]
    fn tokens_flow_as_events_the_stop_token_is_shown_not_kept_and_usage_comes_last() {
        let mut req = GenRequest::greedy(vec![0, 4], 8);
        req.stop_tokens = vec![6];
        let (mut t, mut rx) = ticket(req);
        let (mut s, mut ttft, started) = (Streamed::default(), Duration::ZERO, tokio::time::Instant::now());
        let chunks = [
            json!({"choices":[{"index":0,"finish_reason":null,"token_ids":[182]}]}),
            json!({"choices":[{"index":0,"finish_reason":"stop","stop_reason":6,"token_ids":[375, 6]}]}),
            json!({"usage":{"prompt_tokens":2,"prompt_tokens_details":{"cached_tokens":0}},"choices":[]}),
        ];
        for chunk in &chunks {
            assert!(apply(chunk, &mut t, &mut s, &target(), &mut ttft, started).unwrap());
        }
        assert_eq!((s.tokens.as_slice(), s.finish, s.cached_tokens), (&[182, 375][..], Some(Finish::Stop), Some(0)));
        let mut events = Vec::new();
        while let Ok(JobEvent::Event(e)) = rx.try_recv() {
            events.push(e);
        }
        assert!(matches!(events[0], WorkerEvent::Prefilled { .. }));
        assert_eq!(events[1..], [WorkerEvent::Token(182), WorkerEvent::Token(375), WorkerEvent::Token(6)]);
    }

    #[test]
    fn a_prefill_alone_is_a_one_token_request_whose_token_is_not_shown() {
        let (mut t, mut rx) = ticket(GenRequest::greedy(vec![0, 4], 0));
        assert_eq!(generate_body(&t, "dn-4")["sampling_params"]["max_tokens"], 1, "vLLM refuses 0");
        let (mut s, mut ttft, started) = (Streamed::default(), Duration::ZERO, tokio::time::Instant::now());
        let chunk = json!({"choices":[{"finish_reason":"length","token_ids":[182]}]});
        assert!(apply(&chunk, &mut t, &mut s, &target(), &mut ttft, started).unwrap());
        assert_eq!((s.tokens.len(), s.finish), (0, Some(Finish::Length)));
        assert!(matches!(rx.try_recv(), Ok(JobEvent::Event(WorkerEvent::Prefilled { .. }))));
        assert!(rx.try_recv().is_err(), "no token event");
    }

    #[test]
    fn an_error_in_the_stream_is_the_engine_going_down_and_an_unknown_finish_is_an_error() {
        let (mut t, _rx) = ticket(GenRequest::greedy(vec![0], 4));
        let (mut s, mut ttft, started) = (Streamed::default(), Duration::ZERO, tokio::time::Instant::now());
        let dead =
            json!({"error":{"message":"EngineCore encountered an issue.","type":"InternalServerError","code":500}});
        let err = apply(&dead, &mut t, &mut s, &target(), &mut ttft, started).unwrap_err();
        assert!(matches!(&err, WorkerError::EngineDown(m) if m.contains("EngineCore")), "{err}");
        let odd = json!({"choices":[{"finish_reason":"repetition","token_ids":[]}]});
        assert!(matches!(apply(&odd, &mut t, &mut s, &target(), &mut ttft, started), Err(WorkerError::Engine(_))));
    }

    #[tokio::test]
    async fn an_id_outside_the_vocabulary_is_never_sent() {
        let (t, mut rx) = ticket(GenRequest::greedy(vec![3, 512], 4));
        // The URL is unreachable: had the request been sent, the error would say so.
        forward(&reqwest::Client::new(), &target(), t, "dn-3", None).await;
        match rx.recv().await {
            Some(JobEvent::Failed(WorkerError::OutOfVocabulary { id: 512, vocab: 512 })) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_engines_blocks_take_the_names_the_router_computes_from_the_prompt() {
        let node = Salt(77);
        let mut names = Names::new(node, 2);
        let prompt = [10, 11, 12, 13, 14, 15];
        let expected = BlockHasher::new(node, 2).hash_sequence(&prompt);
        // The prompt's first two blocks, then its third after them.
        let (parent, first) = names.stored(&[901, 902], None, &prompt[..4], 2, None).unwrap();
        assert_eq!((parent, first.as_slice()), (None, &expected[..2]));
        let (parent, third) = names.stored(&[903], Some(902), &prompt[4..], 2, None).unwrap();
        assert_eq!((parent, third.as_slice()), (Some(expected[1]), &expected[2..]));

        // A tenant's blocks hash under its namespace, which the node sent as the cache salt.
        let ns = Namespace::new("tenant-a", "").unwrap();
        let salted = BlockHasher::new(node.within(Some(ns)), 2).hash_sequence(&prompt[..2]);
        let (_, named) = names.stored(&[801], None, &prompt[..2], 2, Some(&ns.to_hex())).unwrap();
        assert_eq!(named, salted);
        assert_ne!(named[0], expected[0], "no tenant's block takes another's name");

        // A block stored twice leaves with its second removal.
        names.stored(&[901], None, &prompt[..2], 2, None).unwrap();
        assert!(names.removed(&[901]).is_empty(), "one copy is still there");
        assert_eq!(names.removed(&[901]), vec![expected[0]]);

        // What the node cannot name is left out.
        assert!(names.stored(&[1], Some(999), &prompt[..2], 2, None).is_none(), "an unknown parent");
        assert!(names.stored(&[1], None, &prompt[..4], 4, None).is_none(), "blocks of another size");
        assert!(names.stored(&[1], None, &prompt[..2], 2, Some("not ours")).is_none(), "a salt the node never sent");
    }

    #[test]
    fn lines_split_across_chunks_join_and_a_line_without_end_is_bounded() {
        let mut lines = LineBuffer::default();
        assert!(lines.push(b"data: {\"a\"").unwrap().is_empty());
        assert_eq!(lines.push(b":1}\r\n\ndata: [DONE]\n").unwrap(), ["data: {\"a\":1}", "", "data: [DONE]"]);
        let long = vec![b'x'; MAX_LINE + 1];
        assert!(lines.push(&long).is_err());
    }
}
