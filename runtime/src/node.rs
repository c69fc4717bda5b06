//! The node process: [`start`] brings a node up from its resolved configuration — its tiers and
//! actor tree through the node builder ([`Serving`]), the HTTP frontend on `frontend.http`, and
//! the outer ring ([`crate::outer`]) — and returns a [`NodeHandle`], whose [`NodeHandle::stop`] takes it
//! down within `node.shutdown_grace`. [`run`] is `serve`: start, wait for SIGINT or SIGTERM, stop.
//! `bench serve` starts and stops its in-process node the same way.
//!
//! Modules depend one way: `node` → [`crate::serving`] (the actor tree and the frontend's
//! generator) → [`crate::plan`] (the resolved configuration) → [`crate::frontend`] →
//! [`crate::metrics`], which imports none of them.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use dynamo_actors::builder::NodeStores;
use dynamo_actors::ring::{Phase, Ring};
use dynamo_config::NodeConfig;

use crate::frontend::FrontendState;
use crate::metrics::{MetricsHandle, TierSources};
use crate::plan::{ResolvedTiers, scripted_answers};
use crate::recording::Recorder;
use crate::serving::Serving;

/// A change to the frontend's state before it serves.
type FrontendHook = Box<dyn FnOnce(FrontendState) -> FrontendState + Send>;

/// How [`start`] brings a node up, besides its configuration.
pub struct Launch {
    announce: bool,
    metrics: MetricsHandle,
    frontend: Option<FrontendHook>,
}

impl Launch {
    /// Prints each step on stdout, as `serve` does, and publishes the tiers to `metrics` when it
    /// is installed.
    pub fn announced(metrics: MetricsHandle) -> Self {
        Self { announce: true, metrics, frontend: None }
    }

    /// Prints nothing and publishes no tier metrics: a node inside another program (a bench).
    pub fn quiet() -> Self {
        Self { announce: false, metrics: MetricsHandle::disabled(), frontend: None }
    }

    /// Passes the frontend's state through `hook` before it serves (`bench serve` drops the stop
    /// tokens).
    pub fn with_frontend(mut self, hook: impl FnOnce(FrontendState) -> FrontendState + Send + 'static) -> Self {
        self.frontend = Some(Box::new(hook));
        self
    }
}

impl std::fmt::Debug for Launch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launch")
            .field("announce", &self.announce)
            .field("metrics", &self.metrics)
            .field("frontend", &self.frontend.is_some())
            .finish()
    }
}

/// A node serving its API.
#[derive(Debug)]
pub struct NodeHandle {
    serving: Serving,
    addr: SocketAddr,
    vocab: usize,
    grace: Duration,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
    /// The outer ring ([`crate::outer`]), supervised and stopped in its order.
    ring: Ring,
    g4_addr: Option<SocketAddr>,
}

impl NodeHandle {
    /// The address the API is served on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The actor tree and what it measured at start-up.
    pub fn serving(&self) -> &Serving {
        &self.serving
    }

    /// Where the G4 block server listens, when `tiers.g4.enabled`.
    pub fn g4_addr(&self) -> Option<SocketAddr> {
        self.g4_addr
    }

    /// Token ids the frontend's tokenizer has.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Stops the node within `node.shutdown_grace`: the API stops accepting, requests in flight
    /// get most of the grace and are then cancelled, and the workers flush write-through in the
    /// rest. Errors if the HTTP server failed (the node is stopped all the same).
    pub async fn stop(self) -> anyhow::Result<()> {
        let NodeHandle { serving, grace, stop, mut server, mut ring, .. } = self;
        ring.stop(Phase::Outside).await;
        let _ = stop.send(());
        let deadline = tokio::time::Instant::now() + grace;
        let drain = grace - (grace / 4).min(Duration::from_secs(5));
        let served = match tokio::time::timeout(drain, &mut server).await {
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(e))) => Err(anyhow::Error::new(e).context("the HTTP server stopped with an error")),
            Ok(Err(e)) => Err(anyhow::Error::new(e).context("the HTTP server task failed")),
            Err(_) => {
                // Closing the connections drops their streams, which cancels their requests: a
                // worker stops within one prefill pass or one token, and skips what is queued.
                tracing::warn!(?grace, "requests still running near the end of the shutdown grace; cancelling them");
                server.abort();
                let _ = server.await;
                Ok(())
            }
        };
        // Every response is over: the leases are saved, the recording gets its last lines and
        // its file is closed.
        ring.stop(Phase::Inside).await;
        // The workers finish what they hold and flush their G3 writes before they exit. A write
        // still in flight at the deadline is abandoned: its slot was never acknowledged, and the
        // next start's scan verifies every slot.
        let deadline = deadline.max(tokio::time::Instant::now() + Duration::from_secs(1));
        if tokio::time::timeout_at(deadline, serving.shutdown()).await.is_err() {
            tracing::warn!(?grace, "the workers did not stop within the shutdown grace; exiting without them");
        }
        served
    }
}

/// Starts a node on `plan` (resolved from `cfg`): binds `frontend.http` (an address in use fails
/// at once, before the tiers are built), opens the stores, starts the actor tree, and serves the
/// API.
pub async fn start(cfg: &NodeConfig, plan: ResolvedTiers, launch: Launch) -> anyhow::Result<NodeHandle> {
    let Launch { announce, metrics, frontend } = launch;
    let listener = tokio::net::TcpListener::bind(&cfg.frontend.http)
        .await
        .with_context(|| format!("cannot serve the API on {} (frontend.http, --http)", cfg.frontend.http))?;
    let addr = listener.local_addr()?;
    if announce {
        print!("{}", plan.render());
        if let Some(warning) = plan.slot_warning() {
            tracing::warn!("{warning}");
        }
    }
    let (open_cfg, open_plan) = (cfg.clone(), plan.clone());
    let stores =
        tokio::task::spawn_blocking(move || Serving::open(&open_cfg, &open_plan)).await.context("start-up task")??;
    if announce {
        if let Some(line) = recovery_line(&stores) {
            println!("{line}");
        }
        if let Some(pool) = stores.g2_pool()
            && !pool.is_locked()
        {
            println!("G2 is not locked in RAM (mlock refused); see the warning above");
        }
    }
    let poll = metrics.is_enabled().then(|| tier_sources(&plan, &stores));
    let serving = Serving::start(cfg, &plan, stores).await?;
    if announce {
        if cfg.engine.kind == dynamo_config::EngineKind::Vllm {
            let urls = cfg.engine.vllm.engine_urls();
            let how = if cfg.engine.vllm.launches() { "launched" } else { "attached" };
            println!("actor tree up: {} worker(s) in front of vLLM ({how}) at {}", urls.len(), urls.join(", "));
        } else {
            println!(
                "actor tree up: {} worker(s), prefill measured at {:.0} tokens/s per worker",
                cfg.engine.workers.max(1),
                serving.prefill_tokens_per_s
            );
        }
    }
    let (state, vocab) = match frontend_state(cfg, &serving, announce).await {
        Ok(built) => built,
        Err(e) => return Err(unwind(serving, e).await),
    };
    let recorder = match cfg.recording.enabled.then(|| Recorder::start(&cfg.recording, &cfg.node.data_dir)) {
        None => None,
        Some(Ok(recorder)) => Some(recorder),
        Some(Err(e)) => {
            let e = anyhow::Error::new(e).context("cannot start the traffic recording (recording.dir)");
            return Err(unwind(serving, e).await);
        }
    };
    let state = match &recorder {
        Some(recorder) => state.with_recorder(recorder.clone()),
        None => state,
    };
    let (stages, started) = match crate::outer::stages(cfg, &plan, &serving, poll, recorder.clone()).await {
        Ok(built) => built,
        Err(e) => {
            if let Some(recorder) = recorder {
                let _ = tokio::task::spawn_blocking(move || recorder.finish()).await;
            }
            return Err(unwind(serving, e).await);
        }
    };
    let ring = match stages.start().await {
        Ok(ring) => ring,
        Err(e) => return Err(unwind(serving, anyhow::anyhow!("{}", e.reason).context(e.stage)).await),
    };
    let state = match frontend {
        Some(hook) => hook(state),
        None => state,
    };
    let keys = cfg.frontend.auth.keys.len();
    if keys == 0 && !crate::frontend::server::is_loopback(addr) {
        tracing::warn!(
            %addr,
            "the API listens beyond loopback without [frontend.auth] keys: anyone who reaches it is served, \
             and every client shares one cache namespace"
        );
    }
    if cfg.metrics.bearer_token.is_none() && metrics.listen().is_some_and(|a| !crate::frontend::server::is_loopback(a))
    {
        tracing::warn!("metrics listen beyond loopback without metrics.bearer_token");
    }
    if announce {
        println!("{}", metrics.line());
        if let Some(recorder) = &recorder {
            println!(
                "recording traffic to {} ({}); replay it with `dynamo-node bench replay --trace FILE`",
                recorder.dir().display(),
                recorder.format()
            );
        }
        if keys > 0 {
            println!("API keys: {keys} ([frontend.auth]); requests without one get 401");
        }
        if let Some(g4_addr) = started.g4_addr {
            println!(
                "G4 block server on {g4_addr} (cluster {:?}): G2 blocks for peers that prove the cluster secret",
                cfg.tiers.g4.cluster
            );
            if started.etcd_membership {
                println!(
                    "G4 peers: from etcd at {} (registered as {:?})",
                    cfg.cluster.etcd_endpoints.join(", "),
                    cfg.node.name
                );
            } else if !cfg.tiers.g4.peers.is_empty() {
                println!(
                    "G4 peers: {} (loading their blocks when cheaper than recomputing)",
                    cfg.tiers.g4.peers.join(", ")
                );
            }
        }
        if cfg.engine_endpoint.enabled {
            println!(
                "engine endpoint on {}: vLLM instances store into and load from G2 (plug-in: runtime/python/dynamo_node_vllm)",
                endpoint_socket(cfg).display()
            );
        }
        println!("serving the OpenAI API on http://{addr}/v1");
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(crate::frontend::serve(listener, state, async move {
        let _ = stopped.await;
    }));
    let grace = cfg.node.shutdown_grace.as_duration();
    Ok(NodeHandle { serving, addr, vocab, grace, stop, server, ring, g4_addr: started.g4_addr })
}

/// The engine endpoint's socket: `engine_endpoint.socket`, under `node.data_dir` when relative.
pub fn endpoint_socket(cfg: &NodeConfig) -> std::path::PathBuf {
    cfg.node.data_dir.join(&cfg.engine_endpoint.socket)
}

/// A start that failed at `e` after the actor tree was up: the tree stops.
async fn unwind(serving: Serving, e: anyhow::Error) -> anyhow::Error {
    serving.shutdown().await;
    e
}

/// Runs the node until SIGINT or SIGTERM.
pub async fn run(cfg: NodeConfig) -> anyhow::Result<()> {
    // Handlers go in first: a signal that arrives while the tiers are being built still stops the
    // node cleanly instead of killing it.
    let shutdown = ShutdownSignals::install()?;
    let plan = ResolvedTiers::resolve(&cfg)?;
    // Before the tiers are built: an address in use fails the start at once.
    let metrics =
        crate::metrics::install(&cfg.metrics, &crate::frontend::Route::ALL.map(crate::frontend::Route::label))?;
    let node = start(&cfg, plan, Launch::announced(metrics)).await?;
    println!("ready; stop with Ctrl-C (SIGINT) or SIGTERM");
    shutdown.wait().await;
    println!("shutting down");
    if let Err(e) = node.stop().await {
        tracing::warn!(error = %format!("{e:#}"), "the HTTP server did not stop cleanly");
    }
    println!("stopped");
    Ok(())
}

/// The frontend over `serving`: the configured tokenizer and template, and the scripted answers
/// of `engine.kind = "scripted"`; with the number of token ids the tokenizer has.
async fn frontend_state(cfg: &NodeConfig, serving: &Serving, announce: bool) -> anyhow::Result<(FrontendState, usize)> {
    let (tokenizer, template) = frontend_parts(cfg)?;
    let vocab = tokenizer.vocab_size();
    let generator = serving.generator(Arc::new(tokenizer.decodable())).await?;
    let end_of_turn = template_end_of_turn(&tokenizer, &template);
    let origin = template.origin().to_owned();
    let mut state = FrontendState::new(Arc::new(generator), tokenizer, template, &cfg.frontend);
    if let Some(dir) = &cfg.model.path {
        let generation = crate::checkpoint::read_generation(dir)?;
        let mut stops = state.stop_token_ids().to_vec();
        for id in generation.eos_token_ids.into_iter().chain(end_of_turn) {
            if !stops.contains(&id) {
                stops.push(id);
            }
        }
        state = state.with_stop_token_ids(stops).with_sampling_defaults(generation.sampling);
    }
    if announce {
        println!("chat template: {origin}; stop tokens {:?}", state.stop_token_ids());
    }
    if let Some(answers) = scripted_answers(cfg)? {
        if announce {
            println!(
                "engine scripted: {} answer(s) from {}",
                answers.len(),
                cfg.engine.script.as_deref().unwrap_or(Path::new("")).display()
            );
        }
        state = state.with_script(answers);
    }
    Ok((state, vocab))
}

/// One line on what G3 found at start-up.
fn recovery_line(stores: &NodeStores) -> Option<String> {
    let store = stores.g3_store()?;
    let recovery = stores.recovery();
    Some(format!(
        "G3 recovered {} block(s) of {} slots via {}; {} invalid slot(s) dropped, {} file(s) formatted",
        recovery.blocks.len(),
        store.capacity_slots(),
        store.engine_name(),
        recovery.invalid_slots,
        recovery.formatted_files,
    ))
}

/// What the tier poller reads: the open stores, and G1 as planned.
fn tier_sources(plan: &ResolvedTiers, stores: &NodeStores) -> TierSources {
    TierSources {
        g1_capacity: plan.g1.blocks * plan.workers as u64,
        g2: stores.g2_pool().cloned(),
        g2_registry: stores.g2_registry().cloned(),
        g3: stores.g3_store().cloned(),
        g3_registry: stores.g3_registry().cloned(),
        leases: Some(stores.leases().clone()),
    }
}

/// The tokenizer and chat template the frontend uses: the model directory's own when it has
/// them (or the files `model.tokenizer` / `model.chat_template` name; `model.chat_template` may
/// also name one of this project's family templates, [`ChatTemplate::names`]), else the
/// built-in ones.
fn frontend_parts(cfg: &NodeConfig) -> anyhow::Result<(crate::tokenizer::Tokenizer, crate::frontend::ChatTemplate)> {
    use crate::frontend::ChatTemplate;
    use crate::tokenizer::Tokenizer;
    let tokenizer = match (&cfg.model.tokenizer, &cfg.model.path) {
        (Some(file), _) => Tokenizer::from_file(file).with_context(|| format!("loading {}", file.display()))?,
        (None, Some(dir)) if dir.join("tokenizer.json").exists() => {
            Tokenizer::from_dir(dir).with_context(|| format!("loading the tokenizer of {}", dir.display()))?
        }
        _ => Tokenizer::builtin(),
    };
    let named = cfg.model.chat_template.as_deref().and_then(|t| t.to_str()).and_then(ChatTemplate::named);
    let template = match (&cfg.model.chat_template, &cfg.model.path) {
        (Some(_), _) if named.is_some() => named.expect("checked"),
        (Some(file), _) => {
            let src = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
            ChatTemplate::new(&src, "", "")
                .with_context(|| format!("parsing {}", file.display()))?
                .with_origin(file.display().to_string())
        }
        (None, Some(dir)) => match ChatTemplate::from_model_dir(dir)
            .with_context(|| format!("reading the chat template of {}", dir.display()))?
        {
            Some(template) => template,
            None => {
                let warning = format!(
                    "WARNING: {} ships no chat template (no chat_template.jinja, chat_template.json or \
                     `chat_template` in tokenizer_config.json); prompts use the built-in llama3 template, which \
                     is wrong for other families: name the right one with model.chat_template (a file, or one of \
                     {})",
                    dir.display(),
                    ChatTemplate::names().join(", ")
                );
                tracing::warn!("{warning}");
                eprintln!("{warning}");
                ChatTemplate::builtin()
            }
        },
        (None, None) => ChatTemplate::builtin(),
    };
    Ok((tokenizer, template))
}

/// The end-of-turn tokens a chat template writes, which its model samples to end an answer: the
/// known markers of the families (Llama 3's `<|eot_id|>` and `<|eom_id|>`, ChatML's `<|im_end|>`,
/// Gemma's `<end_of_turn>`, Phi's `<|end|>`, …) that the template's text names and the tokenizer
/// has as one special token.
fn template_end_of_turn(tokenizer: &crate::tokenizer::Tokenizer, template: &crate::frontend::ChatTemplate) -> Vec<u32> {
    const MARKERS: [&str; 8] = [
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<end_of_turn>",
        "<|end|>",
        "<|endoftext|>",
        "<|return|>",
        "<|call|>",
    ];
    let specials = tokenizer.special_tokens();
    MARKERS
        .iter()
        .filter(|m| template.source().contains(*m) && specials.iter().any(|s| s == *m))
        .filter_map(|m| match tokenizer.encode(m).ok()?[..] {
            [id] => Some(id),
            _ => None,
        })
        .collect()
}

/// SIGTERM and SIGINT, listened for from the moment they are installed.
struct ShutdownSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
        })
    }

    async fn wait(mut self) {
        tokio::select! {
            _ = self.term.recv() => tracing::info!("SIGTERM received"),
            _ = self.int.recv() => tracing::info!("SIGINT received"),
        }
    }
}
