//! The EngineEndpoint (DESIGN.md §5, §7): engines outside the node — a vLLM instance through the
//! `dynamo_node_vllm` plug-in loaded by its `OffloadingConnector` — use the node's tiers as their
//! KV tier over a Unix socket.
//!
//! The engines' G2 ([`NodeTiers::engines_g2`](crate::tiers::NodeTiers::engines_g2)) is one shared-memory region
//! ([`HostPool::shared`](dynamo_tiering::g2::HostPool::shared)) that every engine process maps
//! (the fd travels with the REGISTER reply); the node's own G2 is another pool, which no engine
//! maps. An engine writes a
//! block's payload straight into a slot the node handed it, and the node seals it — checksums the
//! payload, writes the image header in front — admits it to G2 under the engine's own key (in a
//! namespace of its salt, [`ForeignEngine`]) and writes it through to G3. Loads go the other way:
//! the node pins a verified slot and the engine copies out of it. A block in G3 only is read back
//! into G2, verified, before any lookup answers *hit*; meanwhile the answer is *pending*. The
//! protocol is in `runtime/python/README.md`; the codec in [`dynamo_tiering::foreign`].
//!
//! Connections are tasks; what they share is the [`Core`]. The actor owns the listening socket,
//! and stopping it stops every connection and removes the socket file. Each engine that names a
//! KV event publisher is followed by [`events`], which feeds its G1 into the global prefix index.
//!
//! Trust: a process that can connect maps the engines' whole G2 — every engine's blocks, though
//! none of the node's own — so the socket is created `0600` (owner only); widen it deliberately,
//! if at all. Every image in it is tagged under a key only the node holds when it is admitted
//! and checked on every lookup and load, so an engine that rewrites another's block is caught.

mod events;
mod fd;

pub use fd::recvmsg_with_fd;

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dynamo_config::{RegionKind, TierName};
use dynamo_tiering::block::{BlockHash, BlockLayout, HEADER_LEN, ImageSpec, RetentionMeta, seal, verify_image};
use dynamo_tiering::foreign::{
    ErrorCode, ForeignEngine, Found, Located, MAX_FRAME, PROTOCOL_VERSION, Registration, Reply, Request, Role,
};
use dynamo_tiering::g2::{SlotMut, SlotRef};
use dynamo_tiering::pipeline::Landed;
use dynamo_tiering::registry::BlockMeta;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinSet;

use crate::engine_names::engine_hash_of_key;
use crate::index::{Location, Matches, PrefixIndex, SourceId};
use crate::peer::{Arrival, Land, PeerLink};
use crate::telemetry;
use crate::tier_store::{ReadMiss, TierStore};
use crate::tiers::NodeTiers;
use crate::worker::unix_millis;

/// How long a hit stays pinned for the connection that looked it up.
const HIT_PIN: Duration = Duration::from_secs(10);
/// How often at most a connection's stored blocks are checked for removal from G2.
const REMOVAL_SCAN: Duration = Duration::from_millis(250);
/// Longest engine id accepted.
const MAX_ENGINE_ID: usize = 128;
/// Most connections at once (an engine opens one per process: its manager and each worker).
const MAX_CONNECTIONS: usize = 512;

/// What the endpoint needs from the node.
#[derive(Clone, Debug)]
pub struct EndpointArgs {
    /// The socket's path.
    pub socket: PathBuf,
    /// The node's tiers (G2 must be a shared pool).
    pub tiers: Arc<NodeTiers>,
    /// The global prefix index, which engines' KV events feed.
    pub index: Arc<PrefixIndex>,
    /// This node's id in the index.
    pub node: u16,
    /// Largest block an engine may register.
    pub max_block_bytes: u64,
    /// Retention region of the engines' blocks.
    pub region: RegionKind,
    /// Most engines registered at once.
    pub max_engines: usize,
}

/// Messages of the [`EngineEndpoint`].
#[derive(Debug)]
pub enum EndpointMsg {
    /// The engines registered now. Replies with one entry per engine with a live connection.
    Engines(RpcReplyPort<Vec<EngineStatus>>),
}

/// One registered engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineStatus {
    /// Its id (vLLM's `engine_id`).
    pub id: String,
    /// Its index on this node: its source in the prefix index and its `engine` metric label (the
    /// smallest index free when it registered).
    pub index: u32,
    /// Open connections (its manager and workers).
    pub connections: usize,
}

/// The actor: owns the socket and the connections' tasks.
#[derive(Debug)]
pub struct EngineEndpoint;

/// Its state.
#[derive(Debug)]
pub struct EndpointState {
    core: Arc<Core>,
    accept: tokio::task::JoinHandle<()>,
}

/// `EngineEndpoint`'s handle.
pub type EndpointRef = ActorRef<EndpointMsg>;

impl Actor for EngineEndpoint {
    type Msg = EndpointMsg;
    type State = EndpointState;
    type Arguments = EndpointArgs;

    async fn pre_start(&self, _: ActorRef<Self::Msg>, args: EndpointArgs) -> Result<Self::State, ActorProcessingErr> {
        let listener = bind(&args.socket)?;
        let core = Arc::new(Core::new(args)?);
        let accept = tokio::spawn(accept_loop(listener, core.clone()));
        Ok(EndpointState { core, accept })
    }

    async fn handle(
        &self,
        _: ActorRef<Self::Msg>,
        msg: EndpointMsg,
        state: &mut EndpointState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            EndpointMsg::Engines(reply) => {
                let _ = reply.send(state.core.engine_status());
            }
        }
        Ok(())
    }

    async fn post_stop(&self, _: ActorRef<Self::Msg>, state: &mut EndpointState) -> Result<(), ActorProcessingErr> {
        state.accept.abort();
        let _ = std::fs::remove_file(&state.core.socket);
        state.core.stop_followers();
        Ok(())
    }
}

/// Binds the socket, replacing a stale socket file (one nobody answers on) and refusing to touch
/// anything else at that path.
fn bind(path: &std::path::Path) -> Result<UnixListener, ActorProcessingErr> {
    use std::os::unix::fs::FileTypeExt;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(format!("engine_endpoint.socket {} exists and is not a socket", path.display()).into());
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(format!("engine_endpoint.socket {} is in use by another process", path.display()).into());
        }
        std::fs::remove_file(path)?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let listener = UnixListener::bind(path)
        .map_err(|e| format!("cannot listen on engine_endpoint.socket {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

async fn accept_loop(listener: UnixListener, core: Arc<Core>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((mut stream, _)) if connections.len() >= MAX_CONNECTIONS => {
                    let refusal = error(ErrorCode::Refused, format!("{MAX_CONNECTIONS} connections are open"));
                    tokio::spawn(async move { let _ = send(&mut stream, refusal).await; });
                }
                Ok((stream, _)) => {
                    connections.spawn(Connection::new(core.clone()).serve(stream));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "engine endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// One registered engine, over all its connections.
#[derive(Debug)]
struct EngineEntry {
    index: u32,
    /// G2 slots its connections hold for stores not yet completed.
    storing: Arc<AtomicUsize>,
    identity: ForeignEngine,
    connections: usize,
    /// Worker connections per rank: stores need every rank's worker to write its share.
    workers: Vec<usize>,
    /// Stops the follower of its KV events, if any.
    follower: Option<tokio::sync::watch::Sender<bool>>,
}

/// What the connections share.
#[derive(Debug)]
pub struct Core {
    socket: PathBuf,
    tiers: Arc<NodeTiers>,
    index: Arc<PrefixIndex>,
    node: u16,
    region_id: u64,
    max_block_bytes: u64,
    region: RegionKind,
    max_engines: usize,
    engines: Mutex<HashMap<String, EngineEntry>>,
    /// Blocks being read from G3 into G2.
    promoting: Mutex<std::collections::HashSet<BlockHash>>,
    /// G2 slots every engine together holds for stores not yet completed.
    storing: Arc<AtomicUsize>,
}

impl Core {
    fn new(args: EndpointArgs) -> Result<Self, ActorProcessingErr> {
        let g2 = args
            .tiers
            .engines_g2
            .as_ref()
            .ok_or("the engine endpoint needs the engines' G2 (engine_endpoint.g2_share of tiers.g2)")?;
        if g2.pool.share_fd().is_none() {
            return Err("the engine endpoint needs G2 to be a shared pool".into());
        }
        // A region id that differs between runs (and between nodes on one host).
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let mut seed = nanos.to_le_bytes().to_vec();
        seed.extend_from_slice(&std::process::id().to_le_bytes());
        seed.extend_from_slice(&(g2.pool.region().0 as usize).to_le_bytes());
        let region_id = xxhash_rust::xxh3::xxh3_64(&seed);
        Ok(Core {
            socket: args.socket,
            tiers: args.tiers,
            index: args.index,
            node: args.node,
            region_id,
            max_block_bytes: args.max_block_bytes,
            region: args.region,
            max_engines: args.max_engines,
            engines: Mutex::new(HashMap::new()),
            promoting: Mutex::new(Default::default()),
            storing: Arc::default(),
        })
    }

    fn engine_status(&self) -> Vec<EngineStatus> {
        let engines = self.engines.lock().expect("engines lock");
        let mut all: Vec<EngineStatus> = engines
            .iter()
            .map(|(id, e)| EngineStatus { id: id.clone(), index: e.index, connections: e.connections })
            .collect();
        all.sort_by_key(|e| e.index);
        all
    }

    fn stop_followers(&self) {
        for entry in self.engines.lock().expect("engines lock").values_mut() {
            if let Some(stop) = entry.follower.take() {
                let _ = stop.send(true);
            }
        }
    }

    /// The source of engine `index`'s G1 in the prefix index.
    fn source(&self, index: u32) -> SourceId {
        SourceId::external(self.node, index)
    }

    /// Registers one connection of engine `r.engine_id`.
    fn register(&self, r: &Registration) -> Result<(u32, ForeignEngine, Arc<AtomicUsize>), (ErrorCode, String)> {
        let refuse = |message: String| Err((ErrorCode::Refused, message));
        if r.version != PROTOCOL_VERSION {
            return Err((
                ErrorCode::Version,
                format!("protocol version {} is not {PROTOCOL_VERSION}, the one this node speaks", r.version),
            ));
        }
        if r.engine_id.is_empty() || r.engine_id.len() > MAX_ENGINE_ID {
            return refuse(format!("engine_id must be 1 to {MAX_ENGINE_ID} bytes"));
        }
        if r.world_size == 0 || r.rank >= r.world_size {
            return refuse(format!("rank {} of world_size {} is not a rank", r.rank, r.world_size));
        }
        if r.block_bytes == 0 || r.block_bytes > self.max_block_bytes {
            return refuse(format!(
                "a block of {} bytes does not fit: this node's slots hold blocks of up to {} bytes \
                 (raise engine_endpoint.max_block_bytes)",
                r.block_bytes, self.max_block_bytes
            ));
        }
        if !r.block_bytes.is_multiple_of(r.world_size as u64) {
            return refuse(format!("block_bytes {} is not split evenly over {} ranks", r.block_bytes, r.world_size));
        }
        if BlockLayout::try_opaque(r.block_bytes as usize).is_none() {
            return refuse(format!("block_bytes {} cannot be described by a block image header", r.block_bytes));
        }
        let identity = ForeignEngine::of(r);
        let mut engines = self.engines.lock().expect("engines lock");
        // Every entry has a live connection: the last one to close removes it.
        let active = engines.len();
        let entry = match engines.get_mut(&r.engine_id) {
            Some(entry) if entry.identity != identity => {
                return refuse(format!(
                    "engine {:?} is registered with another model or layout; use another engine_id",
                    r.engine_id
                ));
            }
            Some(entry) => entry,
            None if active >= self.max_engines => {
                return refuse(format!("{active} engines are registered, engine_endpoint.max_engines"));
            }
            None => {
                // The smallest index no engine uses: indices (and the metrics labelled by them)
                // stay below max_engines however many engines come and go.
                let index = (0..).find(|i| engines.values().all(|e| e.index != *i)).expect("a free index");
                engines.entry(r.engine_id.clone()).or_insert(EngineEntry {
                    index,
                    storing: Arc::default(),
                    identity,
                    connections: 0,
                    workers: vec![0; r.world_size as usize],
                    follower: None,
                })
            }
        };
        entry.connections += 1;
        if r.role == Role::Worker {
            entry.workers[r.rank as usize] += 1;
        }
        if r.role == Role::Manager && !r.kv_events.is_empty() && entry.follower.is_none() {
            let (stop, stopped) = tokio::sync::watch::channel(false);
            tokio::spawn(events::follow(events::Follow {
                endpoint: r.kv_events.clone(),
                engine: entry.index.to_string(),
                id: r.engine_id.clone(),
                identity,
                source: self.source(entry.index),
                index: self.index.clone(),
                stop: stopped,
            }));
            entry.follower = Some(stop);
        }
        let (index, storing) = (entry.index, entry.storing.clone());
        let registered = engines.len();
        drop(engines);
        telemetry::set_engines_registered(registered);
        Ok((index, identity, storing))
    }

    /// A connection of `engine_id` (a worker of `rank`, or its manager) closed.
    fn unregister(&self, engine_id: &str, role: Role, rank: u32) {
        let mut engines = self.engines.lock().expect("engines lock");
        if let Some(entry) = engines.get_mut(engine_id) {
            entry.connections = entry.connections.saturating_sub(1);
            if role == Role::Worker
                && let Some(workers) = entry.workers.get_mut(rank as usize)
            {
                *workers = workers.saturating_sub(1);
            }
            if entry.connections == 0 {
                if let Some(stop) = entry.follower.take() {
                    let _ = stop.send(true);
                }
                engines.remove(engine_id);
            }
        }
        let registered = engines.len();
        drop(engines);
        telemetry::set_engines_registered(registered);
    }

    /// Whether every rank of `engine_id` has a worker registered (so stores can be written).
    fn workers_ready(&self, engine_id: &str) -> bool {
        let engines = self.engines.lock().expect("engines lock");
        engines.get(engine_id).is_some_and(|e| e.workers.iter().all(|&n| n > 0))
    }

    /// Reads `hash` from G3 into G2 in the background (into a slot taken now), unless that is
    /// already under way. Returns false when G2 has no slot for it: the caller answers *miss*
    /// rather than *pending*, so an engine never waits on a prefix G2 cannot hold at once.
    fn promote(self: &Arc<Self>, hash: BlockHash, engine: Arc<str>, region: RegionKind) -> bool {
        let Some(g2) = self.tiers.engines_g2.as_ref() else { return false };
        let mut promoting = self.promoting.lock().expect("promoting lock");
        if promoting.contains(&hash) {
            return true;
        }
        let Some(dst) = g2.alloc(unix_millis()) else {
            telemetry::record_engine_blocks(&engine, "no_room", 1);
            return false;
        };
        promoting.insert(hash);
        drop(promoting);
        let core = self.clone();
        tokio::spawn(async move {
            let outcome = core.read_from_g3(hash, dst, region).await;
            telemetry::record_engine_blocks(&engine, outcome, 1);
            core.promoting.lock().expect("promoting lock").remove(&hash);
        });
        true
    }

    /// Whether a peer node holds `hash` (its feed says so): if it does, the block joins
    /// `remote`'s fetch from that peer and the lookup answers *pending*.
    fn fetch_from_peer(&self, hash: BlockHash, remote: &mut RemoteFetches) -> bool {
        let Some(g4) = self.tiers.g4.as_ref() else { return false };
        // One look under the lock: two lookups of one block start one fetch.
        let mut promoting = self.promoting.lock().expect("promoting lock");
        if promoting.contains(&hash) {
            return true;
        }
        let Some((link, _)) = g4.remote.locate(std::slice::from_ref(&hash)) else { return false };
        promoting.insert(hash);
        remote.entry(Arc::as_ptr(&link) as usize).or_insert_with(|| (link, Vec::new())).1.push(hash);
        true
    }

    /// Fetches each peer's share of `remote` into G2 (one hold-fetch-release per peer), verified
    /// by the link as it lands; what lands is admitted to G2, where the next lookup finds it.
    fn start_fetches(self: &Arc<Self>, remote: RemoteFetches, engine: Arc<str>, region: RegionKind) {
        for (_, (link, hashes)) in remote {
            let core = self.clone();
            let engine = engine.clone();
            tokio::spawn(async move {
                let now = unix_millis();
                let landing = core.tiers.clone();
                let land: Land = Box::new(move || landing.engines_g2.as_ref()?.alloc(now));
                let deadline = Instant::now() + link.request_timeout();
                let started = Instant::now();
                let g2 = core.tiers.engines_g2.as_ref().expect("checked at start");
                let mut bytes = 0;
                match link.fetch(hashes.clone(), deadline, land).await {
                    Ok(arrivals) => {
                        for (hash, arrival) in arrivals {
                            let outcome = match arrival {
                                Arrival::Landed { slot, bytes: landed, .. } => {
                                    bytes += landed;
                                    g2.admit(hash, core.tiers.meta(None, region), slot, now);
                                    "fetched"
                                }
                                Arrival::Rejected(e) => {
                                    telemetry::record_tier_error(TierName::G4, e.kind());
                                    "corrupt"
                                }
                                Arrival::NoRoom => "no_room",
                                Arrival::Missing | Arrival::Skipped => "missing",
                            };
                            telemetry::record_engine_blocks(&engine, outcome, 1);
                        }
                    }
                    Err(e) => {
                        tracing::debug!(peer = link.addr(), error = %e, "an engine's fetch from a peer failed");
                        telemetry::record_tier_error(TierName::G4, e.kind());
                        telemetry::record_engine_blocks(&engine, "fetch_failed", hashes.len() as u64);
                    }
                }
                if bytes > 0 {
                    telemetry::record_transfer(TierName::G4, TierName::G2, bytes as u64, started.elapsed());
                }
                let mut promoting = core.promoting.lock().expect("promoting lock");
                for hash in &hashes {
                    promoting.remove(hash);
                }
            });
        }
    }

    async fn read_from_g3(&self, hash: BlockHash, dst: SlotMut, region: RegionKind) -> &'static str {
        let Some(g2) = self.tiers.engines_g2.as_ref() else { return "no_g3" };
        let read = self.tiers.read_slots(vec![(hash, Some(dst))]).await.pop().expect("one read, one result");
        match read {
            Ok(image) => {
                g2.admit(hash, self.tiers.meta(None, region), image, unix_millis());
                "promoted"
            }
            Err(ReadMiss::Unavailable) => "no_g3",
            Err(miss) if miss.is_corrupt() => "corrupt",
            Err(_) => "read_failed",
        }
    }

    /// Writes a sealed block through to G3 (if its region reaches G3 and G3 lacks it), in the
    /// background, under the node's one backlog rule, shared with its workers: the disk is one.
    fn write_through(&self, hash: BlockHash, image: SlotRef, now: u64, region: RegionKind) {
        if !self.tiers.write_targets(hash, region, Landed::Computed).g3 {
            return;
        }
        let Some(backlog) = self.tiers.g3_write(hash, now) else { return };
        let Some(g3) = self.tiers.g3.as_ref() else { return };
        if !g3.reserve(hash, self.tiers.meta(None, region), now) {
            return;
        }
        let tiers = self.tiers.clone();
        tokio::spawn(async move {
            let g3 = tiers.g3.as_ref().expect("checked above");
            let started = Instant::now();
            if g3.write(hash, None, image).await {
                let (bytes, elapsed) = (g3.store.slot_bytes(), started.elapsed());
                telemetry::record_transfer(TierName::G2, TierName::G3, bytes as u64, elapsed);
                tiers.measured.g3_write.observe(bytes, elapsed);
            }
            drop(backlog);
        });
    }
}

/// Blocks to fetch from peers, per link (keyed by the link's address).
type RemoteFetches = HashMap<usize, (Arc<PeerLink>, Vec<BlockHash>)>;

/// A registered connection's engine.
#[derive(Debug)]
struct Registered {
    engine_id: Arc<str>,
    /// The engine's index as a metric label (`engine`): bounded by `max_engines`, unlike ids.
    label: Arc<str>,
    identity: ForeignEngine,
    role: Role,
    rank: u32,
    /// The retention region of its blocks.
    region: RegionKind,
    block_bytes: u64,
    block_tokens: u32,
    /// Its engine's slots held for stores (every connection of the engine shares it).
    storing: Arc<AtomicUsize>,
}

/// One engine process's connection.
struct Connection {
    core: Arc<Core>,
    registered: Option<Registered>,
    /// Hits pinned for this connection, until loaded or expired.
    hits: HashMap<BlockHash, (SlotRef, Instant)>,
    /// Blocks being loaded: their pinned images (one per PREPARE_LOAD), and when each was
    /// handed out.
    loading: HashMap<BlockHash, Vec<(SlotRef, Instant)>>,
    /// Slots handed out for stores, not yet completed.
    storing: HashMap<BlockHash, SlotMut>,
    /// Blocks this connection stored, by key, until G2 drops them (for removal events).
    stored: HashMap<BlockHash, Vec<u8>>,
    events: Vec<(bool, Vec<u8>)>,
    last_scan: Instant,
}

impl Connection {
    fn new(core: Arc<Core>) -> Self {
        Connection {
            core,
            registered: None,
            hits: HashMap::new(),
            loading: HashMap::new(),
            storing: HashMap::new(),
            stored: HashMap::new(),
            events: Vec::new(),
            last_scan: Instant::now(),
        }
    }

    async fn serve(self, mut stream: UnixStream) {
        let mut conn = self;
        let mut body = Vec::new();
        loop {
            let mut len = [0u8; 4];
            if stream.read_exact(&mut len).await.is_err() {
                break;
            }
            let len = u32::from_le_bytes(len) as usize;
            if len == 0 || len > MAX_FRAME {
                let _ = send(&mut stream, malformed(format!("frame of {len} bytes is outside 1..={MAX_FRAME}"))).await;
                break;
            }
            body.resize(len, 0);
            if stream.read_exact(&mut body).await.is_err() {
                break;
            }
            let request = match Request::decode(&body) {
                Ok(request) => request,
                Err(e) => {
                    let _ = send(&mut stream, malformed(e.to_string())).await;
                    break;
                }
            };
            let registering = matches!(request, Request::Register(_));
            // A request of many keys runs on a blocking thread: a lookup of 64K keys must not
            // hold an async worker (and `/health` with it).
            let reply;
            (conn, reply) = if keys_of(&request) > INLINE_KEYS {
                match tokio::task::spawn_blocking(move || {
                    let reply = conn.answer(request);
                    (conn, reply)
                })
                .await
                {
                    Ok(done) => done,
                    Err(_) => return,
                }
            } else {
                let reply = conn.answer(request);
                (conn, reply)
            };
            let sent = match (&reply, registering) {
                (Reply::Registered { .. }, true) => {
                    let g2 = conn.core.tiers.engines_g2.as_ref().expect("checked at start");
                    let fd = g2.pool.share_fd().expect("checked at start");
                    written_in_time(fd::send_with_fd(&mut stream, &reply.encode(), fd)).await
                }
                _ => send(&mut stream, reply).await,
            };
            if sent.is_err() {
                break;
            }
        }
        conn.release_store_slots(conn.storing.len());
        if let Some(r) = &conn.registered {
            conn.core.unregister(&r.engine_id, r.role, r.rank);
            telemetry::set_engine_g2_blocks(&r.label, 0);
        }
    }

    fn answer(&mut self, request: Request) -> Reply {
        let Request::Register(registration) = request else {
            if self.registered.is_none() {
                return error(ErrorCode::NotRegistered, "register first (op 0x01)");
            }
            return self.serve_registered(request);
        };
        if self.registered.is_some() {
            return error(ErrorCode::Refused, "this connection is registered already");
        }
        let region = match registration.region.as_str() {
            "" => self.core.region,
            named => match named.parse::<RegionKind>() {
                Ok(region) => region,
                Err(e) => return error(ErrorCode::Refused, format!("region: {e}")),
            },
        };
        match self.core.register(&registration) {
            Ok((index, identity, storing)) => {
                let g2 = self.core.tiers.engines_g2.as_ref().expect("checked at start");
                let (_, region_bytes) = g2.pool.region();
                tracing::info!(
                    engine = %registration.engine_id,
                    index,
                    role = ?registration.role,
                    rank = registration.rank,
                    block_bytes = registration.block_bytes,
                    "engine registered"
                );
                self.registered = Some(Registered {
                    engine_id: registration.engine_id.as_str().into(),
                    label: index.to_string().into(),
                    identity,
                    role: registration.role,
                    rank: registration.rank,
                    region,
                    block_bytes: registration.block_bytes,
                    block_tokens: registration.block_tokens,
                    storing,
                });
                Reply::Registered {
                    region_id: self.core.region_id,
                    region_bytes: region_bytes as u64,
                    slots: g2.pool.slots(),
                    slot_bytes: g2.pool.slot_bytes() as u64,
                    payload_offset: HEADER_LEN as u32,
                    engine: index,
                    salt: identity.salt,
                }
            }
            Err((code, message)) => error(code, message),
        }
    }

    fn serve_registered(&mut self, request: Request) -> Reply {
        let now = Instant::now();
        self.hits.retain(|_, (_, at)| now.duration_since(*at) < HIT_PIN);
        let r = self.registered.as_ref().expect("checked by the caller");
        if r.role == Role::Worker && !matches!(request, Request::Locate(_)) {
            return error(
                ErrorCode::Refused,
                "a worker connection only maps the region; the manager looks up, stores and loads",
            );
        }
        match request {
            Request::Register(_) => unreachable!("handled by the caller"),
            Request::Lookup(keys) => {
                let mut remote = RemoteFetches::default();
                let found = keys.iter().map(|key| self.lookup(key, now, &mut remote)).collect();
                let (_, engine) = self.identity();
                self.core.start_fetches(remote, engine, self.region());
                Reply::Looked(found)
            }
            Request::PrepareStore(keys) => {
                if !self.core.workers_ready(&r.engine_id) {
                    telemetry::record_engine_blocks(&r.label, "no_workers", keys.len() as u64);
                    return Reply::StoreSlots(vec![-2; keys.len()]);
                }
                Reply::StoreSlots(keys.iter().map(|key| self.prepare_store(key)).collect())
            }
            Request::CompleteStore { success, keys } => Reply::Stored(self.complete_store(success, &keys)),
            Request::PrepareLoad(keys) => Reply::LoadSlots(keys.iter().map(|key| self.prepare_load(key)).collect()),
            Request::CompleteLoad(keys) => Reply::Released(self.complete_load(&keys)),
            Request::TakeEvents => Reply::Events(self.take_events(now)),
            Request::Locate(chain) => Reply::Located(self.locate(&chain)),
        }
    }

    fn identity(&self) -> (ForeignEngine, Arc<str>) {
        let r = self.registered.as_ref().expect("registered");
        (r.identity, r.label.clone())
    }

    /// The retention region of this connection's engine's blocks.
    fn region(&self) -> RegionKind {
        self.registered.as_ref().map_or(self.core.region, |r| r.region)
    }

    /// The verified G2 image of `hash`, if resident. An image that fails verification is
    /// dropped from G2 (and counted): it is never handed to an engine.
    fn verified(&self, hash: BlockHash, engine: &str) -> Option<SlotRef> {
        let g2 = self.core.tiers.engines_g2.as_ref()?;
        let image = g2.get(hash, unix_millis())?;
        match verify_image(image.as_slice(), hash) {
            Ok(_) => Some(image),
            Err(e) => {
                tracing::warn!(%hash, engine, error = %e, "an engine's block failed verification in G2; dropped");
                telemetry::record_tier_error(TierName::G2, e.kind());
                telemetry::record_engine_blocks(engine, "corrupt", 1);
                g2.forget(hash);
                None
            }
        }
    }

    fn lookup(&mut self, key: &[u8], now: Instant, remote: &mut RemoteFetches) -> (Found, i32) {
        let (identity, engine) = self.identity();
        let hash = identity.block_hash(key);
        let pinned = match self.hits.get(&hash) {
            Some((image, _)) => Some(image.index() as i32),
            None => self.verified(hash, &engine).map(|image| {
                let slot = image.index() as i32;
                self.hits.insert(hash, (image, now));
                slot
            }),
        };
        let answer = match pinned {
            Some(slot) => (Found::Hit, slot),
            None if self.core.tiers.contains(TierName::G3, hash)
                && self.core.promote(hash, engine.clone(), self.region()) =>
            {
                (Found::Pending, -1)
            }
            None if self.core.fetch_from_peer(hash, remote) => (Found::Pending, -1),
            None => (Found::Miss, -1),
        };
        telemetry::record_engine_lookup(&engine, answer.0);
        answer
    }

    fn prepare_store(&mut self, key: &[u8]) -> i32 {
        let (identity, engine) = self.identity();
        let hash = identity.block_hash(key);
        let g2 = self.core.tiers.engines_g2.as_ref().expect("checked at start");
        if self.storing.contains_key(&hash) || g2.contains(hash) {
            return -1;
        }
        // Engines cannot take their G2 from each other (the node's own G2 is another pool):
        // slots held for stores not yet completed are capped per engine (all its connections
        // together) at half the pool, and for every engine together at three quarters, so reads
        // back from G3 and G4 keep a quarter (at least 16 slots each way).
        let slots = g2.pool.slots() as usize;
        let r = self.registered.as_ref().expect("registered");
        if !take_one(&r.storing, (slots / 2).max(16)) {
            telemetry::record_engine_blocks(&engine, "no_room", 1);
            return -2;
        }
        if !take_one(&self.core.storing, (slots * 3 / 4).max(16)) {
            r.storing.fetch_sub(1, Ordering::AcqRel);
            telemetry::record_engine_blocks(&engine, "no_room", 1);
            return -2;
        }
        match g2.alloc(unix_millis()) {
            Some(slot) => {
                let index = slot.index() as i32;
                self.storing.insert(hash, slot);
                index
            }
            None => {
                self.release_store_slots(1);
                telemetry::record_engine_blocks(&engine, "no_room", 1);
                -2
            }
        }
    }

    /// `n` slots held for stores were completed or given back.
    fn release_store_slots(&self, n: usize) {
        if let Some(r) = &self.registered {
            r.storing.fetch_sub(n, Ordering::AcqRel);
            self.core.storing.fetch_sub(n, Ordering::AcqRel);
        }
    }

    fn complete_store(&mut self, success: bool, keys: &[Vec<u8>]) -> u32 {
        let (identity, engine) = self.identity();
        let r = self.registered.as_ref().expect("registered");
        let layout = BlockLayout::try_opaque(r.block_bytes as usize).expect("checked at registration");
        let token_count = r.block_tokens.min(u16::MAX as u32) as u16;
        let g2 = self.core.tiers.engines_g2.as_ref().expect("checked at start");
        let now = unix_millis();
        let mut stored = 0;
        let names = self.core.tiers.engine_names.as_ref();
        for key in keys {
            let hash = identity.block_hash(key);
            let Some(mut slot) = self.storing.remove(&hash) else { continue };
            self.release_store_slots(1);
            if !success {
                continue;
            }
            // Its node name (if its engine's worker knows it) is reported with it, for the
            // router; by that name it takes the region its request gave it and the hold of a
            // lease the node's book has on it.
            if let (Some(names), Some(theirs)) = (names, engine_hash_of_key(key)) {
                names.storing(hash, theirs);
            }
            let (region, retain_until) = match names.and_then(|n| n.retention(hash)) {
                Some((name, given)) => {
                    (given.unwrap_or(r.region), self.core.tiers.leases.until(name, now).unwrap_or(0))
                }
                None => (r.region, 0),
            };
            let priority = self.core.tiers.retention.policy(region).priority;
            let spec = ImageSpec {
                hash,
                parent: None,
                salt: identity.salt,
                layout,
                token_count,
                retention: RetentionMeta {
                    region,
                    priority,
                    retain_until_ms: retain_until,
                    last_access_ms: now,
                    access_count: 0,
                },
            };
            seal(slot.as_mut_slice(), &spec);
            let image = slot.freeze();
            let meta = BlockMeta { retain_until, ..self.core.tiers.meta(None, region) };
            let admitted = g2.admit(hash, meta, image.clone(), now);
            if let Some(names) = names {
                names.settle(hash);
            }
            if admitted {
                stored += 1;
                self.stored.insert(hash, key.clone());
                self.events.push((false, key.clone()));
                self.core.write_through(hash, image, now, region);
            }
        }
        telemetry::record_engine_blocks(&engine, "stored", stored as u64);
        // An engine that never takes its events still cannot grow this beyond what G2 holds.
        if self.stored.len() > 2 * g2.pool.slots() as usize {
            self.scan_removals();
        }
        telemetry::set_engine_g2_blocks(&engine, self.stored.len());
        stored
    }

    fn prepare_load(&mut self, key: &[u8]) -> i32 {
        let (identity, engine) = self.identity();
        let hash = identity.block_hash(key);
        let image = match self.hits.remove(&hash) {
            Some((image, _)) => Some(image),
            None => self.verified(hash, &engine),
        };
        match image {
            Some(image) => {
                let index = image.index() as i32;
                self.loading.entry(hash).or_default().push((image, Instant::now()));
                index
            }
            None => -1,
        }
    }

    /// The engine copied these blocks out of G2: their pins go, and the load is timed for the
    /// router (from the first block handed out to now: the load as the engine sees it, its
    /// scheduling included), which prices a load into an engine at that rate.
    fn complete_load(&mut self, keys: &[Vec<u8>]) -> u32 {
        let (identity, engine) = self.identity();
        let mut released = 0;
        let mut first: Option<Instant> = None;
        for key in keys {
            let hash = identity.block_hash(key);
            if let Some(pins) = self.loading.get_mut(&hash)
                && let Some((_, since)) = pins.pop()
            {
                first = Some(first.map_or(since, |f| f.min(since)));
                released += 1;
                if pins.is_empty() {
                    self.loading.remove(&hash);
                }
            }
        }
        telemetry::record_engine_blocks(&engine, "loaded", released as u64);
        if let (Some(first), Some(r)) = (first, &self.registered) {
            self.core.tiers.measured.observe_load(released as usize * r.block_bytes as usize, first.elapsed());
        }
        released
    }

    fn take_events(&mut self, now: Instant) -> Vec<(bool, Vec<u8>)> {
        if now.duration_since(self.last_scan) >= REMOVAL_SCAN {
            self.last_scan = now;
            self.scan_removals();
        }
        std::mem::take(&mut self.events)
    }

    /// Turns the blocks this connection stored that G2 no longer holds into removal events.
    fn scan_removals(&mut self) {
        let g2 = self.core.tiers.engines_g2.as_ref().expect("checked at start");
        let events = &mut self.events;
        self.stored.retain(|&hash, key| {
            let resident = g2.contains(hash);
            if !resident {
                events.push((true, key.clone()));
            }
            resident
        });
        let (_, engine) = self.identity();
        telemetry::set_engine_g2_blocks(&engine, self.stored.len());
    }

    fn locate(&self, chain: &[(u32, u64)]) -> Vec<Located> {
        let (identity, _) = self.identity();
        let hashes: Vec<BlockHash> = chain.iter().map(|&(group, low)| identity.event_hash(group, low)).collect();
        let mut matches = Matches::new();
        self.core.index.find_matches(&hashes, &mut matches);
        matches
            .locations()
            .iter()
            .filter(|m| !m.location.approximate)
            .map(|m| {
                let Location { source, tier, .. } = m.location;
                let (kind, id) = match (source.external_engine(), tier) {
                    (Some(engine), _) => (0, engine),
                    (None, TierName::G2) => (1, 0),
                    (None, TierName::G3) => (2, 0),
                    (None, _) => (3, source.worker as u32),
                };
                Located { kind, id, blocks: m.blocks as u32 }
            })
            .collect()
    }
}

fn error(code: ErrorCode, message: impl Into<String>) -> Reply {
    Reply::Error { code, message: message.into() }
}

fn malformed(message: String) -> Reply {
    error(ErrorCode::Malformed, message)
}

async fn send(stream: &mut UnixStream, reply: Reply) -> std::io::Result<()> {
    written_in_time(stream.write_all(&reply.encode())).await
}

/// How long a reply may wait for its engine to read it: past it the connection closes (an engine
/// that stops reading cannot keep its replies, and what they pin, in memory).
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// `write` unless it has not finished within [`WRITE_TIMEOUT`].
async fn written_in_time(write: impl Future<Output = std::io::Result<()>>) -> std::io::Result<()> {
    tokio::time::timeout(WRITE_TIMEOUT, write).await.unwrap_or_else(|_| {
        Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the engine read nothing of its reply in 10 s"))
    })
}

/// Keys a request carries.
fn keys_of(request: &Request) -> usize {
    match request {
        Request::Lookup(keys)
        | Request::PrepareStore(keys)
        | Request::PrepareLoad(keys)
        | Request::CompleteLoad(keys) => keys.len(),
        Request::CompleteStore { keys, .. } => keys.len(),
        Request::Locate(chain) => chain.len(),
        _ => 0,
    }
}

/// Requests of more keys than this are answered on a blocking thread.
const INLINE_KEYS: usize = 1024;

/// Takes one of `held`'s at most `cap` units; whether there was room.
fn take_one(held: &AtomicUsize, cap: usize) -> bool {
    held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < cap).then_some(n + 1)).is_ok()
}
