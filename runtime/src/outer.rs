//! The node's outer ring as stages of [`dynamo_actors::ring`]: what runs around the actor tree
//! and the API, each with its restart policy. They start in this order, and within each phase
//! stop in the reverse one:
//!
//! | stage | phase | restart | why |
//! |---|---|---|---|
//! | `tier_poller` | inside | backoff | a gauge publisher; a new one picks up where it left off |
//! | `recorder` | inside | never | its writer thread counts what it cannot write; a new file mid-run would split the recording |
//! | `lease_saver` | inside | backoff | saves every 10 s while leases change, and once more when it stops |
//! | `block_server` | outside | backoff | serves G2 to peers; it binds the address it had |
//! | `peer_links` | outside | never | each link reconnects by itself; stopping closes them all |
//! | `membership` | outside | backoff | follows etcd (`cluster.membership = "etcd"`) and registers again |
//! | `engine_endpoint` | outside | backoff | binds its socket again; engines reconnect |
//!
//! The outside phase stops before the API stops accepting (the endpoint, membership, the links,
//! then the block server: engines and peers stop finding the node); the inside phase once every
//! response is over (the lease saver's last save, the recorder's last lines, the poller).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use dynamo_actors::endpoint::{EndpointArgs, EngineEndpoint};
use dynamo_actors::peer::{BlockServer, LoadHistory, connect_peers, link_config, open_rdma, tls};
use dynamo_actors::ring::{Phase, Restart, RingBuilder, Running, Stage};
use dynamo_config::{MembershipKind, NodeConfig};

#[cfg(feature = "etcd")]
use crate::cluster::{Membership, Registration};
use crate::metrics::TierSources;
use crate::plan::ResolvedTiers;
use crate::recording::Recorder;
use crate::serving::{Serving, save_leases, save_leases_periodically};

/// How often the tiers' gauges and mirrored counters are published.
const TIER_POLL_PERIOD: std::time::Duration = std::time::Duration::from_secs(1);

/// What the ring's stages tell the rest of the node.
#[derive(Debug, Default)]
pub struct Started {
    /// Where the G4 block server listens (shared: a restart binds the same address).
    pub g4_addr: Option<SocketAddr>,
    /// Whether G4's peers come from etcd.
    pub etcd_membership: bool,
}

/// The ring's stages for `cfg`: the poller when `poll` (metrics are on) with `sources`, the
/// recorder's end when it records, the lease saver when leases are saved, and G4 and the engine
/// endpoint when they are enabled. G4's block server is bound here, so its address is known
/// (and a bind that fails fails the start) before the ring starts.
pub async fn stages(
    cfg: &NodeConfig,
    plan: &ResolvedTiers,
    serving: &Serving,
    poll: Option<TierSources>,
    recorder: Option<Arc<Recorder>>,
) -> anyhow::Result<(RingBuilder, Started)> {
    let mut ring = RingBuilder::new();
    let mut started = Started::default();
    if let Some(sources) = poll {
        ring = ring.stage(Stage::new("tier_poller", Phase::Inside, Restart::BACKOFF, move || {
            let sources = sources.clone();
            async move { Ok(Running::task(crate::metrics::spawn_tier_poller(sources, TIER_POLL_PERIOD))) }
        }));
    }
    if let Some(recorder) = recorder {
        ring = ring.stage(Stage::new("recorder", Phase::Inside, Restart::Never, move || {
            let recorder = recorder.clone();
            async move {
                Ok(Running::untasked(move || {
                    Box::pin(async move {
                        let _ = tokio::task::spawn_blocking(move || recorder.finish()).await;
                    })
                }))
            }
        }));
    }
    if let Some(path) = serving.lease_file.clone() {
        let tiers = serving.tiers.clone();
        ring = ring.stage(Stage::new("lease_saver", Phase::Inside, Restart::BACKOFF, move || {
            let (tiers, path) = (tiers.clone(), path.clone());
            async move {
                let task = save_leases_periodically(tiers.clone(), path.clone());
                let abort = task.abort_handle();
                // Saved once more as it stops, before the tree does: the sessions' ends released
                // their leases, and a restart should find what the clients leased.
                let stop = move || -> dynamo_actors::ring::BoxFuture<()> {
                    Box::pin(async move {
                        abort.abort();
                        let _ = tokio::task::spawn_blocking(move || save_leases(&tiers, &path)).await;
                    })
                };
                Ok(Running { task, stop: Box::new(stop) })
            }
        }));
    }
    if cfg.tiers.g4.enabled {
        ring = g4_stages(cfg, plan, serving, ring, &mut started).await.context("cannot start G4 (tiers.g4)")?;
    }
    if cfg.engine_endpoint.enabled {
        let args = EndpointArgs {
            socket: crate::node::endpoint_socket(cfg),
            tiers: serving.tiers.clone(),
            index: serving.node.index.clone(),
            node: 0,
            max_block_bytes: cfg.engine_endpoint.max_block_bytes.as_u64(),
            region: cfg.engine_endpoint.region,
            max_engines: cfg.engine_endpoint.max_engines,
        };
        ring = ring.stage(Stage::new("engine_endpoint", Phase::Outside, Restart::BACKOFF, move || {
            let args = args.clone();
            async move {
                let (endpoint, task) = ractor::Actor::spawn(None, EngineEndpoint, args)
                    .await
                    .map_err(|e| format!("cannot start the engine endpoint (engine_endpoint): {e}"))?;
                let stop = move || -> dynamo_actors::ring::BoxFuture<()> {
                    Box::pin(async move {
                        let _ = endpoint.stop_and_wait(None, None).await;
                    })
                };
                Ok(Running { task, stop: Box::new(stop) })
            }
        }));
    }
    Ok((ring, started))
}

/// G4's stages: the block server (bound now), the peer links, and etcd membership when asked for.
async fn g4_stages(
    cfg: &NodeConfig,
    plan: &ResolvedTiers,
    serving: &Serving,
    mut ring: RingBuilder,
    started: &mut Started,
) -> anyhow::Result<RingBuilder> {
    // Until membership gives one, the epoch is the start time: a restarted node is a new epoch.
    let epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let max_image = serving.tiers.layout.image_bytes();
    let rdma = open_rdma(&cfg.tiers.g4, &serving.tiers);
    // Read once, for both ends of every connection.
    let tls = tls(&cfg.tiers.g4)?;
    let tiers = serving.tiers.clone();
    let first =
        BlockServer::start(&cfg.tiers.g4, &cfg.node.name, epoch, max_image, tiers, rdma.clone(), tls.clone()).await?;
    let addr = first.local_addr();
    started.g4_addr = Some(addr);
    let mut links = link_config(&cfg.tiers.g4, &cfg.node.name, epoch, max_image)?;
    links.rdma = rdma.clone();
    links.client.tls = tls.clone();
    if cfg.tiers.g4.history {
        let path = cfg.node.data_dir.join("g4-history.jsonl");
        let history = LoadHistory::open(&path)
            .with_context(|| format!("cannot open the G4 history {} (tiers.g4.history)", path.display()))?;
        links.history = Some(Arc::new(history));
    }
    // The server bound above runs first; a restart binds the address it had.
    let mut g4 = cfg.tiers.g4.clone();
    g4.listen = addr.to_string();
    let (node, tiers, server_rdma) = (cfg.node.name.clone(), serving.tiers.clone(), rdma.clone());
    let first = Mutex::new(Some(first));
    ring = ring.stage(Stage::new("block_server", Phase::Outside, Restart::BACKOFF, move || {
        let bound = first.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        let (g4, node, tiers, rdma, tls) = (g4.clone(), node.clone(), tiers.clone(), server_rdma.clone(), tls.clone());
        async move {
            let mut server = match bound {
                Some(server) => server,
                None => BlockServer::start(&g4, &node, epoch, max_image, tiers, rdma, tls)
                    .await
                    .map_err(|e| format!("G4 block server on {}: {e}", g4.listen))?,
            };
            // Dropping the server (when the ring aborts this task) stops it.
            Ok(Running::task(tokio::spawn(async move { server.wait().await })))
        }
    }));
    let Some(g4) = serving.tiers.g4.clone() else { return Ok(ring) };
    let (section, remote) = (cfg.tiers.g4.clone(), g4.remote.clone());
    let static_links = (cfg.cluster.membership == MembershipKind::Static).then(|| links.clone());
    ring = ring.stage(Stage::new("peer_links", Phase::Outside, Restart::Never, move || {
        let (section, remote, links) = (section.clone(), remote.clone(), static_links.clone());
        async move {
            // Static peers are linked now; etcd's as membership finds them.
            if let Some(links) = &links {
                connect_peers(&section, links, &remote);
            }
            Ok(Running::untasked(move || Box::pin(async move { remote.shutdown() })))
        }
    }));
    match cfg.cluster.membership {
        MembershipKind::Static => {}
        #[cfg(not(feature = "etcd"))]
        MembershipKind::Etcd => {
            let _ = plan; // what a registration in etcd would tell peers
            anyhow::bail!(
                "cluster.membership = \"etcd\" needs a binary built with the `etcd` feature \
                 (`cargo build --release -p dynamo-node --features etcd`, which needs protoc)"
            )
        }
        #[cfg(feature = "etcd")]
        MembershipKind::Etcd => {
            started.etcd_membership = true;
            let me = Registration {
                addr: cfg.cluster.advertise.clone().unwrap_or_else(|| addr.to_string()),
                transports: std::iter::once("tcp").chain(rdma.as_ref().map(|_| "rdma")).map(str::to_owned).collect(),
                g2_bytes: plan.g2.as_ref().map_or(0, |(g2, _)| g2.capacity),
                g3_bytes: plan.g3.as_ref().map_or(0, |g3| g3.capacity_per_path * g3.paths.len() as u64),
                protocol: dynamo_tiering::g4::wire::PROTOCOL_VERSION,
            };
            let (section, cluster, name) = (cfg.cluster.clone(), cfg.tiers.g4.cluster.clone(), cfg.node.name.clone());
            let remote = g4.remote.clone();
            ring = ring.stage(Stage::new("membership", Phase::Outside, Restart::BACKOFF, move || {
                let mut membership =
                    Membership::start_etcd(&section, &cluster, &name, me.clone(), remote.clone(), links.clone());
                async move { Ok(Running::task(tokio::spawn(async move { membership.wait().await }))) }
            }));
        }
    }
    Ok(ring)
}
