//! G4, the loading side: one [`PeerLink`] per remote node, and the [`RemoteTier`] that holds them.
//!
//! A link keeps two kinds of authenticated connections to its peer's block server:
//! - **the feed**: it subscribes to what the peer can serve (a snapshot, then numbered changes)
//!   and applies it to this node's prefix index as the peer's G2, so the router prices loading a
//!   prefix from the peer and the workers know whom to ask. A gap, a silent peer (three missed
//!   heartbeats), a broken frame or a closed connection drops the peer's blocks from the index at
//!   once and resubscribes with backoff: the index never routes on what a lost peer said.
//! - **lanes**: `tiers.g4.lanes` connections that carry fetches, each a hold, a fetch of the held
//!   blocks and a release, under the caller's deadline. A lane whose request fails or runs past
//!   its deadline drops its connection (its holds end with it on the server) and reconnects for
//!   the next fetch.
//!
//! Every image a lane returns was verified by the transport against the hash asked for and its
//! checksums; the worker still treats a peer as a hint and recomputes whatever does not arrive.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::time::{Duration, Instant};

use dynamo_config::TierName;
use dynamo_tiering::block::BlockHash;
use dynamo_tiering::block::ImageError;
use dynamo_tiering::cost::{BytesPerSec, CostModel, G4_RATE_MAX_AGE, MeasuredBandwidth};
use dynamo_tiering::g2::{SlotMut, SlotRef};
use dynamo_tiering::g4::tcp::{ClientConfig, FetchedSlot, PeerClient, PeerError};
use dynamo_tiering::g4::transport::{Lane, RdmaNode, Transport, connect_lane};
use dynamo_tiering::g4::wire::{Message, WireError};
use parking_lot::{Mutex, RwLock};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::history::{HistoryEntry, LoadHistory};
use crate::index::{Applied, KvEvent, KvEventKind, Location, Matches, PrefixIndex, SnapshotRun, SourceId, WorkerViews};
use crate::telemetry;

/// How a node's links connect and fetch.
#[derive(Clone, Debug)]
pub struct LinkConfig {
    /// Secret, identity, frame limits and timeouts of every connection.
    pub client: ClientConfig,
    /// Connections that carry fetches, per peer.
    pub lanes: usize,
    /// Fetches queued for the lanes at most; more wait to be queued (within their deadline).
    pub max_inflight: usize,
    /// How long a peer keeps a fetch's blocks pinned at most.
    pub hold_ttl: Duration,
    /// The least time a fetch is given (`tiers.g4.min_fetch_budget`).
    pub min_fetch_budget: Duration,
    /// The feed connection is pinged this often; three missed answers end it.
    pub heartbeat: Duration,
    /// Most blocks a peer's snapshot may list.
    pub max_snapshot_blocks: usize,
    /// Where every block asked of a peer is written down (`tiers.g4.history`).
    pub history: Option<Arc<LoadHistory>>,
    /// This node's RDMA, when it has a device (`tiers.g4.transport = "rdma"`): lanes to peers that
    /// accept it read images by RDMA; `None` keeps every lane on TCP.
    pub rdma: Option<Arc<RdmaNode>>,
}

/// Why a fetch from a peer failed as a whole.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The connection or the protocol failed.
    #[error(transparent)]
    Peer(#[from] PeerError),
    /// The fetch did not finish within its deadline.
    #[error("the fetch ran past its deadline")]
    Deadline,
    /// The link is shutting down.
    #[error("the peer link is closed")]
    Closed,
}

impl FetchError {
    /// A stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            FetchError::Peer(e) => e.kind(),
            FetchError::Deadline => "deadline",
            FetchError::Closed => "link_closed",
        }
    }
}

/// Where fetched images go: a fresh slot of the caller's (a G2 slot) for each, into which the
/// image is read straight from the socket; `None` when there is no room.
pub type Land = Box<dyn FnMut() -> Option<SlotMut> + Send>;

/// What became of one block of a fetch.
#[derive(Debug)]
pub enum Arrival {
    /// Verified, in the caller's slot.
    Landed {
        /// The slot.
        slot: SlotRef,
        /// Bytes of the image in it.
        bytes: usize,
        /// The image's xxh3-64, when the link keeps a history.
        digest: Option<u64>,
    },
    /// Verified, but the caller had no slot for it.
    NoRoom,
    /// The peer no longer held it.
    Missing,
    /// It failed verification and was dropped.
    Rejected(ImageError),
    /// Not landed: an earlier block of the fetch did not arrive, so the prefix ends before it.
    Skipped,
}

/// What became of each block of a fetch, or why the fetch failed as a whole.
type Fetched = Result<Vec<(BlockHash, Arrival)>, FetchError>;

/// One fetch, as a lane takes it.
struct FetchJob {
    hashes: Vec<BlockHash>,
    deadline: tokio::time::Instant,
    land: Land,
    /// The outcome, and what carried it (the lane's transport).
    reply: oneshot::Sender<(Fetched, Transport)>,
}

/// What the link's tasks share.
#[derive(Debug)]
struct LinkState {
    /// The peer's number in this node's index.
    node: u16,
    /// Where its block server listens.
    addr: String,
    /// Its name, once it proved it.
    name: Mutex<Option<String>>,
    /// Its epoch, as it proved it on the last connection.
    epoch: std::sync::atomic::AtomicU64,
    /// Whether the index holds the peer's current snapshot and changes.
    synced: AtomicBool,
    /// Whether the lanes' last connection came up as RDMA (else TCP).
    rdma: AtomicBool,
    /// RDMA fetches that failed in a row; past [`RDMA_STRIKES`] the link's lanes use TCP.
    rdma_failures: std::sync::atomic::AtomicU32,
    /// The link's rate as real fetches measured it.
    measured: MeasuredBandwidth,
    /// Taken around every change the feed makes to the index; `true` once the link is stopped,
    /// after which the feed changes nothing (a task that is being aborted may still be between
    /// two awaits).
    stopped: Mutex<bool>,
    config: LinkConfig,
}

impl LinkState {
    /// Reports how many blocks the index holds for the peer (after a change the link made).
    fn report_held(&self, index: &PrefixIndex) {
        let location = Location { source: SourceId::node_store(self.node), tier: TierName::G2, approximate: false };
        let (blocks, digest) = index.held_set(location);
        telemetry::set_peer_index_blocks(&self.addr, blocks, digest);
    }

    /// Runs `change` on the index unless the link is stopped; whether it ran.
    fn index_change(&self, change: impl FnOnce()) -> bool {
        let stopped = self.stopped.lock();
        if *stopped {
            return false;
        }
        change();
        true
    }
}

/// The link to one remote node: its feed and its lanes.
#[derive(Debug)]
pub struct PeerLink {
    state: Arc<LinkState>,
    jobs: mpsc::Sender<FetchJob>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for FetchJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FetchJob").field("blocks", &self.hashes.len()).finish_non_exhaustive()
    }
}

impl PeerLink {
    /// Starts the feed and the lanes to the block server at `addr`, on the current runtime.
    fn start(node: u16, addr: String, config: LinkConfig, index: Arc<PrefixIndex>) -> Self {
        let lanes = config.lanes.max(1);
        let state = Arc::new(LinkState {
            node,
            addr,
            name: Mutex::new(None),
            epoch: std::sync::atomic::AtomicU64::new(0),
            synced: AtomicBool::new(false),
            rdma: AtomicBool::new(false),
            rdma_failures: std::sync::atomic::AtomicU32::new(0),
            measured: MeasuredBandwidth::default(),
            stopped: Mutex::new(false),
            config,
        });
        let (jobs, rx) = mpsc::channel(state.config.max_inflight.max(1));
        let rx = Arc::new(tokio::sync::Mutex::new(rx));
        let mut tasks = vec![tokio::spawn(follow_feed(state.clone(), index))];
        tasks.extend((0..lanes).map(|_| tokio::spawn(lane(state.clone(), rx.clone()))));
        Self { state, jobs, tasks }
    }

    /// The peer's number in this node's index.
    pub fn node(&self) -> u16 {
        self.state.node
    }

    /// Where its block server listens.
    pub fn addr(&self) -> &str {
        &self.state.addr
    }

    /// Its name, once a connection authenticated it.
    pub fn name(&self) -> Option<String> {
        self.state.name.lock().clone()
    }

    /// What real fetches measured of this link (fed by the worker that timed them).
    pub fn measured(&self) -> &MeasuredBandwidth {
        &self.state.measured
    }

    /// This link's rate, if a fetch measured it within [`G4_RATE_MAX_AGE`].
    pub fn rate(&self) -> Option<BytesPerSec> {
        self.state.measured.get_within(G4_RATE_MAX_AGE)
    }

    /// The longest any fetch may take (`tiers.g4.request_timeout`).
    pub fn request_timeout(&self) -> Duration {
        self.state.config.client.request_timeout
    }

    /// The least time any fetch is given (`tiers.g4.min_fetch_budget`).
    pub fn min_fetch_budget(&self) -> Duration {
        self.state.config.min_fetch_budget
    }

    /// What carried the lanes' last connection.
    pub fn transport(&self) -> Transport {
        if self.state.rdma.load(Ordering::Relaxed) { Transport::Rdma } else { Transport::Tcp }
    }

    /// Prices loads from this peer in `cost` at this link's measured rate (through G2, where the
    /// images land), if a fetch measured it recently; otherwise `cost` keeps the node-wide rate.
    pub fn price(&self, cost: &mut CostModel) {
        if let Some(rate) = self.rate() {
            cost.g4_read = Some(cost.g2_read.map_or(rate, |host| rate.then(host)));
        }
    }

    /// Whether the index holds what the peer serves now.
    pub fn is_synced(&self) -> bool {
        self.state.synced.load(Ordering::Relaxed)
    }

    /// Holds, fetches and releases `hashes` on the peer within `deadline`; each verified image is
    /// handed to `land` on the lane (straight from the connection's buffer). Per hash, what
    /// became of it.
    pub async fn fetch(
        &self,
        hashes: Vec<BlockHash>,
        deadline: Instant,
        land: Land,
    ) -> Result<Vec<(BlockHash, Arrival)>, FetchError> {
        let started = Instant::now();
        let budget = deadline.saturating_duration_since(started);
        let asked = if self.state.config.history.is_some() { hashes.clone() } else { Vec::new() };
        let deadline = tokio::time::Instant::from_std(deadline);
        let (reply, answer) = oneshot::channel();
        let mut carried = self.transport();
        let result = tokio::time::timeout_at(deadline, async {
            self.jobs.send(FetchJob { hashes, deadline, land, reply }).await.map_err(|_| FetchError::Closed)?;
            let (result, transport) = answer.await.map_err(|_| FetchError::Closed)?;
            carried = transport;
            result
        })
        .await
        .unwrap_or(Err(FetchError::Deadline));
        let outcome = result.as_ref().map_or_else(|e| e.kind(), |_| "ok");
        let transport = carried.as_str();
        telemetry::record_peer_fetch(&self.state.addr, transport, outcome, started.elapsed());
        if let Ok(blocks) = &result {
            for (_, arrival) in blocks {
                let (outcome, bytes) = match arrival {
                    Arrival::Landed { bytes, .. } => ("verified", *bytes as u64),
                    Arrival::NoRoom => ("verified", 0),
                    Arrival::Missing => ("missing", 0),
                    Arrival::Skipped => ("skipped", 0),
                    Arrival::Rejected(_) => ("rejected", 0),
                };
                telemetry::record_peer_block(&self.state.addr, transport, outcome, bytes);
            }
        }
        if let Some(history) = &self.state.config.history {
            self.write_history(history, &asked, started, budget, &result);
        }
        result
    }

    /// Writes one history line per block asked.
    fn write_history(
        &self,
        history: &LoadHistory,
        asked: &[BlockHash],
        started: Instant,
        budget: Duration,
        result: &Result<Vec<(BlockHash, Arrival)>, FetchError>,
    ) {
        let now_ms = crate::worker::unix_millis();
        let elapsed = started.elapsed().as_millis() as u64;
        let entry = HistoryEntry {
            t0_ms: now_ms.saturating_sub(elapsed),
            t1_ms: now_ms,
            budget_ms: budget.as_millis() as u64,
            peer: &self.state.addr,
            epoch: self.state.epoch.load(Ordering::Relaxed),
            hash: BlockHash(0),
            outcome: "",
            digest: None,
        };
        match result {
            Ok(blocks) => {
                for (hash, arrival) in blocks {
                    let (outcome, digest) = match arrival {
                        Arrival::Landed { digest, .. } => ("verified", *digest),
                        Arrival::NoRoom => ("no_room", None),
                        Arrival::Missing => ("missing", None),
                        Arrival::Skipped => ("skipped", None),
                        Arrival::Rejected(_) => ("rejected", None),
                    };
                    history.record(&HistoryEntry { hash: *hash, outcome, digest, ..entry });
                }
            }
            Err(e) => {
                for &hash in asked {
                    history.record(&HistoryEntry { hash, outcome: e.kind(), ..entry });
                }
            }
        }
    }
}

impl PeerLink {
    /// Stops the feed and the lanes, and drops what the peer served from `index`: from here on
    /// the link changes nothing in the index, whoever still holds it.
    fn stop(&self, index: &PrefixIndex) {
        let mut stopped = self.state.stopped.lock();
        *stopped = true;
        for task in &self.tasks {
            task.abort();
        }
        index.resync(SourceId::node_store(self.state.node), u64::MAX, &[], 0);
        self.state.report_held(index);
        if self.state.synced.swap(false, Ordering::Relaxed) {
            telemetry::record_peer_feed_ended(&self.state.addr, "peer_left");
        }
    }
}

impl Drop for PeerLink {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The address of the peer at `addr` (a `host:port` resolved at each attempt), and its host
/// (the name a TLS certificate must show).
async fn resolve(state: &LinkState) -> Result<(std::net::SocketAddr, &str), PeerError> {
    let addr = tokio::net::lookup_host(&state.addr)
        .await?
        .next()
        .ok_or_else(|| PeerError::Io(std::io::Error::new(std::io::ErrorKind::NotFound, "no address")))?;
    let host = state.addr.rsplit_once(':').map_or(state.addr.as_str(), |(host, _)| host);
    Ok((addr, host))
}

/// Connects to the peer (for the feed).
async fn connect(state: &LinkState) -> Result<PeerClient, PeerError> {
    let (addr, host) = resolve(state).await?;
    let client = PeerClient::connect_to(addr, host, &state.config.client).await?;
    *state.name.lock() = Some(client.peer().node.clone());
    state.epoch.store(client.peer().epoch, Ordering::Relaxed);
    Ok(client)
}

/// RDMA fetches of a link that may fail in a row before its lanes give RDMA up for TCP: queue
/// pairs that connect over a path that cannot carry them fail only at their first read.
const RDMA_STRIKES: u32 = 3;

/// Connects a lane to the peer: RDMA where both ends have it (and it has not failed this link
/// [`RDMA_STRIKES`] times in a row), TCP otherwise.
async fn connect_lane_to(state: &LinkState) -> Result<Box<dyn Lane>, PeerError> {
    let (addr, host) = resolve(state).await?;
    let rdma = state.config.rdma.as_ref().filter(|_| state.rdma_failures.load(Ordering::Relaxed) < RDMA_STRIKES);
    let lane = connect_lane(addr, host, &state.config.client, rdma).await?;
    *state.name.lock() = Some(lane.peer().node.clone());
    state.epoch.store(lane.peer().epoch, Ordering::Relaxed);
    state.rdma.store(lane.transport() == Transport::Rdma, Ordering::Relaxed);
    Ok(lane)
}

/// One lane: takes fetches from the link's queue and carries each out on its connection.
async fn lane(state: Arc<LinkState>, jobs: Arc<tokio::sync::Mutex<mpsc::Receiver<FetchJob>>>) {
    let mut client: Option<Box<dyn Lane>> = None;
    loop {
        let Some(job) = jobs.lock().await.recv().await else { return };
        let FetchJob { hashes, deadline, mut land, reply } = job;
        let digests = state.config.history.is_some();
        if reply.is_closed() {
            continue;
        }
        let carried = |client: &Option<Box<dyn Lane>>| client.as_ref().map_or(Transport::Tcp, |c| c.transport());
        if tokio::time::Instant::now() >= deadline {
            // Expired in the queue: the connection stays as it is for the next one.
            let _ = reply.send((Err(FetchError::Deadline), carried(&client)));
            continue;
        }
        let result = tokio::time::timeout_at(deadline, async {
            // A pooled connection the server closed while idle fails at once: one more try on a
            // fresh one.
            for attempt in 0..2 {
                let reused = client.is_some();
                let c = match &mut client {
                    Some(c) => c,
                    None => client.insert(connect_lane_to(&state).await?),
                };
                match fetch_on(c, &hashes, state.config.hold_ttl, &mut land, digests).await {
                    Err(PeerError::Io(_) | PeerError::Closed) if reused && attempt == 0 => client = None,
                    done => return done,
                }
            }
            unreachable!("the second attempt returns")
        })
        .await;
        let transport = carried(&client);
        if transport == Transport::Rdma {
            match &result {
                Ok(Err(PeerError::Rdma(_)))
                    if state.rdma_failures.fetch_add(1, Ordering::Relaxed) + 1 == RDMA_STRIKES =>
                {
                    tracing::warn!(peer = %state.addr, "G4 RDMA failed {RDMA_STRIKES} fetches in a row: this link uses TCP");
                }
                Ok(Ok(_)) => state.rdma_failures.store(0, Ordering::Relaxed),
                _ => {}
            }
        }
        let result = match result {
            Ok(Ok(blocks)) => Ok(blocks),
            Ok(Err(e)) => {
                client = None;
                Err(FetchError::Peer(e))
            }
            Err(_) => {
                // The connection may be mid-answer: it cannot carry another request.
                client = None;
                Err(FetchError::Deadline)
            }
        };
        let _ = reply.send((result, transport));
    }
}

/// Holds, fetches (landing each verified image where `land` puts it) and releases `hashes`, at
/// most a frame's worth of hashes at a time. Once a block does not arrive, the rest are not
/// landed: the caller's prefix ends there.
async fn fetch_on(
    client: &mut Box<dyn Lane>,
    hashes: &[BlockHash],
    ttl: Duration,
    land: &mut Land,
    digests: bool,
) -> Result<Vec<(BlockHash, Arrival)>, PeerError> {
    const MAX_HOLD: usize = 4096;
    let mut out = Vec::with_capacity(hashes.len());
    let mut cut = false;
    for chunk in hashes.chunks(MAX_HOLD) {
        if cut {
            out.extend(chunk.iter().map(|&h| (h, Arrival::Skipped)));
            continue;
        }
        let held = client.hold(chunk, ttl).await?;
        // Blocks up to the first the peer no longer holds; the rest are past the cut. (The hold
        // answers each hash asked in its place.)
        let present: Vec<BlockHash> =
            chunk.iter().zip(&held.blocks).take_while(|(_, b)| b.image_len.is_some()).map(|(&h, _)| h).collect();
        let mut arrived = Vec::with_capacity(present.len());
        if !present.is_empty() {
            // Past the cut no slot is taken: what arrives there is read and dropped.
            let cut_at = AtomicBool::new(cut);
            client
                .fetch_into(
                    held.hold_id,
                    &present,
                    &mut || if cut_at.load(Ordering::Relaxed) { None } else { land() },
                    &mut |hash, fetched| {
                        let arrival = match fetched {
                            _ if cut_at.load(Ordering::Relaxed) => Arrival::Skipped,
                            FetchedSlot::Verified { slot, len } => {
                                let digest = digests.then(|| xxhash_rust::xxh3::xxh3_64(&slot.as_slice()[..len]));
                                Arrival::Landed { slot: slot.freeze(), bytes: len, digest }
                            }
                            FetchedSlot::NoRoom => Arrival::NoRoom,
                            FetchedSlot::Missing => Arrival::Missing,
                            FetchedSlot::Rejected(e) => Arrival::Rejected(e),
                        };
                        if !matches!(arrival, Arrival::Landed { .. }) {
                            cut_at.store(true, Ordering::Relaxed);
                        }
                        arrived.push((hash, arrival));
                    },
                )
                .await?;
            cut = cut_at.load(Ordering::Relaxed);
        }
        client.release(held.hold_id).await?;
        cut |= present.len() < chunk.len();
        out.extend(arrived);
        out.extend(chunk[present.len()..].iter().map(|&h| (h, Arrival::Missing)));
    }
    Ok(out)
}

/// The feed: keeps the index's view of the peer's G2 equal to the peer's, or empty.
async fn follow_feed(state: Arc<LinkState>, index: Arc<PrefixIndex>) {
    const FIRST_RETRY: Duration = Duration::from_millis(100);
    const LAST_RETRY: Duration = Duration::from_secs(5);
    // A feed that held this long was healthy: the next failure retries at once. One that fails
    // soon after each sync backs off, so a flapping peer cannot make the index take a snapshot
    // and drop it every 100 ms.
    const STABLE: Duration = Duration::from_secs(10);
    let source = SourceId::node_store(state.node);
    let mut retry = FIRST_RETRY;
    loop {
        let mut epoch = None;
        let started = Instant::now();
        let ended = sync(&state, &index, &mut epoch).await;
        if state.synced.swap(false, Ordering::Relaxed) && started.elapsed() >= STABLE {
            retry = FIRST_RETRY;
        }
        // Nothing the peer said can be counted on now: its blocks leave the index at once. A
        // connection that never came up ended no feed: it is a retry, not counted as an end.
        if let Some(epoch) = epoch {
            state.index_change(|| index.resync(source, epoch, &[], 0));
            state.report_held(&index);
            telemetry::record_peer_feed_ended(&state.addr, ended.kind());
            tracing::info!(peer = %state.addr, error = %ended, "G4 feed from peer ended; its blocks left the index");
        } else {
            tracing::debug!(peer = %state.addr, error = %ended, "G4 feed from peer: connecting failed");
        }
        tokio::time::sleep(retry).await;
        retry = (retry * 2).min(LAST_RETRY);
    }
}

/// Subscribes and applies the snapshot and every change, until something goes wrong.
async fn sync(state: &LinkState, index: &PrefixIndex, epoch_out: &mut Option<u64>) -> PeerError {
    let result: Result<(), PeerError> = async {
        let client = connect(state).await?;
        let epoch = client.peer().epoch;
        *epoch_out = Some(epoch);
        let mut feed = client.subscribe(state.config.heartbeat).await?;
        let source = SourceId::node_store(state.node);
        let mut snapshot: Vec<SnapshotRun> = Vec::new();
        loop {
            match feed.next().await? {
                Message::Snapshot { blocks } => {
                    if snapshot.len() + blocks.len() > state.config.max_snapshot_blocks {
                        return Err(PeerError::Wire(WireError::TooMany {
                            what: "snapshot blocks",
                            n: (snapshot.len() + blocks.len()) as u64,
                            max: state.config.max_snapshot_blocks as u64,
                        }));
                    }
                    snapshot.extend(blocks.into_iter().map(|(hash, parent)| SnapshotRun {
                        tier: TierName::G2,
                        parent,
                        hashes: vec![hash],
                    }));
                }
                Message::Synced { seq } => {
                    if !state.index_change(|| index.resync(source, epoch, &snapshot, seq)) {
                        return Err(PeerError::Closed);
                    }
                    state.synced.store(true, Ordering::Relaxed);
                    state.report_held(index);
                    tracing::info!(peer = %state.addr, blocks = snapshot.len(), "G4 feed synced");
                    break;
                }
                other => return Err(PeerError::Unexpected(other.name())),
            }
        }
        // What the peer has said it holds since the snapshot, counted as it goes: one peer never
        // fills more of the index than a snapshot may.
        let mut held = snapshot.len();
        drop(snapshot);
        loop {
            let kind = match feed.next().await? {
                Message::Stored { seq, parent, hashes } => {
                    held += hashes.len();
                    (seq, KvEventKind::Stored { hashes, parent, tier: TierName::G2 })
                }
                // Removals are not counted down (a peer could remove what it never stored): the
                // count only grows, and past the bound a fresh snapshot counts anew.
                Message::Removed { seq, hashes } => (seq, KvEventKind::Removed { hashes, tier: TierName::G2 }),
                other => return Err(PeerError::Unexpected(other.name())),
            };
            if held > state.config.max_snapshot_blocks {
                // Resubscribing takes a fresh snapshot, itself within the bound.
                return Err(PeerError::Wire(WireError::TooMany {
                    what: "blocks held by one peer",
                    n: held as u64,
                    max: state.config.max_snapshot_blocks as u64,
                }));
            }
            let event = KvEvent { source, epoch, seq: kind.0, kind: kind.1 };
            let mut applied = Applied::Stale;
            if !state.index_change(|| applied = index.apply(&event)) {
                return Err(PeerError::Closed);
            }
            telemetry::record_index_event(event.kind.as_str(), applied.as_str());
            state.report_held(index);
            match applied {
                Applied::Applied | Applied::Stale => {}
                // The peer skipped a number: resubscribe from a snapshot.
                _ => return Err(PeerError::Unexpected("an out-of-sequence change")),
            }
        }
    }
    .await;
    match result {
        Ok(()) => PeerError::Closed,
        Err(e) => e,
    }
}

/// The remote nodes this node loads from: their links, and where in the index their blocks are.
#[derive(Debug)]
pub struct RemoteTier {
    index: Arc<PrefixIndex>,
    /// This node's own number in the index.
    own_node: u16,
    links: RwLock<HashMap<u16, Arc<PeerLink>>>,
    next_node: AtomicU16,
}

impl RemoteTier {
    /// No peers yet; this node is `own_node` in `index`.
    pub fn new(index: Arc<PrefixIndex>, own_node: u16) -> Self {
        Self { index, own_node, links: RwLock::new(HashMap::new()), next_node: AtomicU16::new(own_node + 1) }
    }

    /// Starts a link to the block server at `addr`, on the current runtime.
    pub fn connect(&self, addr: String, config: LinkConfig) -> Arc<PeerLink> {
        let mut links = self.links.write();
        // A number no live link and not this node has (numbers of stopped links come round
        // again after 65,535 links).
        let node = loop {
            let node = self.next_node.fetch_add(1, Ordering::Relaxed);
            if node != SourceId::NODE_STORE && node != self.own_node && !links.contains_key(&node) {
                break node;
            }
        };
        let link = Arc::new(PeerLink::start(node, addr, config, self.index.clone()));
        links.insert(node, link.clone());
        link
    }

    /// Stops the link to `node` and drops its blocks from the index.
    pub fn disconnect(&self, node: u16) {
        if let Some(link) = self.links.write().remove(&node) {
            link.stop(&self.index);
        }
    }

    /// The link to `node`, if there is one.
    pub fn link(&self, node: u16) -> Option<Arc<PeerLink>> {
        self.links.read().get(&node).cloned()
    }

    /// Every link.
    pub fn links(&self) -> Vec<Arc<PeerLink>> {
        self.links.read().values().cloned().collect()
    }

    /// The peer that holds the longest prefix of `hashes`, and how many blocks of it, if any
    /// peer holds the first block.
    pub fn locate(&self, hashes: &[BlockHash]) -> Option<(Arc<PeerLink>, usize)> {
        if hashes.is_empty() || self.links.read().is_empty() {
            return None;
        }
        let mut matches = Matches::default();
        self.index.find_matches(hashes, &mut matches);
        let mut views = WorkerViews::default();
        matches.views(&mut views);
        let (node, blocks) = views.best_other_node(self.own_node)?;
        let link = self.links.read().get(&node).cloned()?;
        link.is_synced().then_some((link, blocks))
    }

    /// Stops every link.
    pub fn shutdown(&self) {
        let nodes: Vec<u16> = self.links.read().keys().copied().collect();
        for node in nodes {
            self.disconnect(node);
        }
    }
}
