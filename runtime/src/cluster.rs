//! Cluster membership on etcd (DESIGN.md §10): who this node's G4 peers are.
//!
//! The node registers `<prefix>/<cluster>/nodes/<name>` = its G4 address and sizes (JSON) under a
//! lease of `cluster.lease_ttl`, kept alive every third of it. The revision of that write is the
//! registration's *epoch*. It watches the same prefix: a peer's registration starts a
//! [`PeerLink`](dynamo_actors::peer::PeerLink) to it, a newer registration of the same peer (a new
//! epoch: it restarted, or its lease ran out while it was paused or cut off) replaces the link,
//! and a deletion (its lease expired, it left) stops the link; stopping a link drops the peer's
//! blocks from the index at once.
//!
//! When etcd cannot be reached the node keeps its last view and serves on; it retries with
//! backoff, and on reconnecting it reconciles its view with what etcd holds then. When its own
//! lease has run out it registers again, under a new epoch.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use dynamo_actors::peer::{LinkConfig, RemoteTier};
use dynamo_actors::telemetry;
use dynamo_config::ClusterSection;
use etcd_client::{Client, ConnectOptions, EventType, GetOptions, KeyValue, PutOptions, WatchOptions};
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

/// What a node publishes about itself.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Registration {
    /// The G4 block server's address, `host:port`.
    pub addr: String,
    /// Transports it serves: `"tcp"`.
    pub transports: Vec<String>,
    /// Bytes of its G2.
    pub g2_bytes: u64,
    /// Bytes of its G3.
    pub g3_bytes: u64,
    /// The block protocol version it speaks.
    pub protocol: u16,
}

/// The running membership task.
#[derive(Debug)]
pub struct Membership {
    task: JoinHandle<()>,
}

impl Membership {
    /// Registers this node as `name` with `me` and follows the other registrations of
    /// `cluster` in etcd, starting and stopping links in `remote` with `links`.
    pub fn start_etcd(
        section: &ClusterSection,
        cluster: &str,
        name: &str,
        me: Registration,
        remote: Arc<RemoteTier>,
        links: LinkConfig,
    ) -> Self {
        let follower = Follower {
            endpoints: section.etcd_endpoints.clone(),
            prefix: format!("{}/{cluster}/nodes/", section.etcd_prefix.trim_end_matches('/')),
            name: name.to_owned(),
            me,
            ttl: section.lease_ttl.as_duration(),
            remote,
            links,
            view: HashMap::new(),
            lease: None,
        };
        Self { task: tokio::spawn(follower.run()) }
    }

    /// Waits until following stops (stopped, or the task failed).
    pub async fn wait(&mut self) {
        let _ = (&mut self.task).await;
    }

    /// Stops following (the registration then expires with its lease).
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A peer in the view: its registration's revision and its link's node number.
#[derive(Clone, Copy, Debug)]
struct Member {
    epoch: i64,
    node: u16,
}

struct Follower {
    endpoints: Vec<String>,
    prefix: String,
    name: String,
    me: Registration,
    ttl: Duration,
    remote: Arc<RemoteTier>,
    links: LinkConfig,
    /// Peers by name.
    view: HashMap<String, Member>,
    /// The lease of this node's registration, kept across interruptions of etcd: a registration
    /// that outlived one is kept, with its epoch, so peers see no restart.
    lease: Option<i64>,
}

impl Follower {
    async fn run(mut self) {
        const FIRST_RETRY: Duration = Duration::from_millis(200);
        let mut retry = FIRST_RETRY;
        loop {
            let started = std::time::Instant::now();
            let ended = self.session().await;
            telemetry::set_cluster_etcd_up(false);
            tracing::warn!(error = %format!("{ended:#}"), members = self.view.len(),
                "etcd membership interrupted; keeping the last view of the cluster");
            if started.elapsed() > self.ttl {
                retry = FIRST_RETRY;
            }
            tokio::time::sleep(retry).await;
            retry = (retry * 2).min(self.ttl.max(FIRST_RETRY));
        }
    }

    /// One connection to etcd: register, reconcile the view, then keep the lease alive and follow
    /// the watch until something fails. Returns why it ended.
    async fn session(&mut self) -> anyhow::Error {
        match self.try_session().await {
            Ok(()) => anyhow::anyhow!("the watch ended"),
            Err(e) => e,
        }
    }

    async fn try_session(&mut self) -> anyhow::Result<()> {
        let options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(self.ttl.max(Duration::from_secs(2)))
            .with_keep_alive(self.ttl / 3, self.ttl / 3);
        let mut client = Client::connect(&self.endpoints, Some(options)).await.context("connecting to etcd")?;
        let key = format!("{}{}", self.prefix, self.name);
        let (lease, epoch) = match self.still_registered(&mut client, &key).await? {
            Some(kept) => kept,
            None => {
                let ttl_secs = self.ttl.as_secs().max(2) as i64;
                let lease = client.lease_grant(ttl_secs, None).await.context("granting the registration's lease")?.id();
                let value = serde_json::to_vec(&self.me).context("the registration")?;
                let put = client.put(key.as_bytes(), value, Some(PutOptions::new().with_lease(lease))).await?;
                let epoch = put.header().map_or(0, |h| h.revision());
                self.lease = Some(lease);
                telemetry::record_cluster_registration(epoch);
                tracing::info!(key, epoch, lease, "registered in etcd");
                (lease, epoch)
            }
        };
        telemetry::set_cluster_etcd_up(true);
        tracing::debug!(epoch, lease, "following the cluster in etcd");
        let (mut keeper, mut kept) = client.lease_keep_alive(lease).await.context("keeping the lease alive")?;

        let current = client.get(self.prefix.as_bytes(), Some(GetOptions::new().with_prefix())).await?;
        let revision = current.header().map_or(0, |h| h.revision());
        let present: HashMap<String, &KeyValue> = current
            .kvs()
            .iter()
            .filter_map(|kv| Some((kv.key_str().ok()?.strip_prefix(&self.prefix)?.to_owned(), kv)))
            .collect();
        let gone: Vec<String> = self.view.keys().filter(|name| !present.contains_key(*name)).cloned().collect();
        for name in gone {
            self.leave(&name);
        }
        for (name, kv) in present {
            self.join(&name, kv);
        }

        let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
        let mut watch = client.watch(self.prefix.as_bytes(), Some(options)).await.context("watching the cluster")?;
        let mut tick = tokio::time::interval(self.ttl / 3);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => keeper.keep_alive().await.context("sending a lease keep-alive")?,
                answer = kept.message() => match answer.context("the lease keep-alive stream")? {
                    Some(answer) if answer.ttl() > 0 => {}
                    // Paused or cut off past the TTL: peers dropped this node; register anew.
                    _ => anyhow::bail!("the registration's lease expired"),
                },
                message = watch.message() => {
                    let Some(message) = message.context("the watch stream")? else { return Ok(()) };
                    if message.canceled() {
                        anyhow::bail!("etcd cancelled the watch (compacted at {})", message.compact_revision());
                    }
                    for event in message.events() {
                        let Some(kv) = event.kv() else { continue };
                        let Some(name) = kv.key_str().ok().and_then(|k| k.strip_prefix(&self.prefix)) else { continue };
                        let name = name.to_owned();
                        match event.event_type() {
                            EventType::Put => self.join(&name, kv),
                            EventType::Delete => self.leave(&name),
                        }
                    }
                }
            }
        }
    }

    /// This node's registration from before an interruption, if it outlived it: its lease and
    /// epoch.
    async fn still_registered(&mut self, client: &mut Client, key: &str) -> anyhow::Result<Option<(i64, i64)>> {
        let Some(lease) = self.lease else { return Ok(None) };
        let alive = client.lease_time_to_live(lease, None).await.context("asking after the lease")?.ttl() > 0;
        let current = client.get(key.as_bytes(), None).await.context("reading the registration")?;
        let kept = current.kvs().first().filter(|kv| alive && kv.lease() == lease).map(|kv| (lease, kv.mod_revision()));
        match kept {
            Some((_, epoch)) => tracing::info!(key, epoch, lease, "still registered in etcd"),
            None => self.lease = None,
        }
        Ok(kept)
    }

    /// `name` is registered as `kv`: a new peer, or a new epoch of a known one, gets a new link.
    fn join(&mut self, name: &str, kv: &KeyValue) {
        if name == self.name {
            return;
        }
        let epoch = kv.mod_revision();
        if self.view.get(name).is_some_and(|m| m.epoch == epoch) {
            return;
        }
        let registration: Registration = match serde_json::from_slice(kv.value()) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(peer = name, error = %e, "ignoring an unreadable registration");
                return;
            }
        };
        if let Some(old) = self.view.remove(name) {
            tracing::info!(peer = name, old = old.epoch, new = epoch, "peer registered again; replacing its link");
            self.remote.disconnect(old.node);
        }
        let link = self.remote.connect(registration.addr.clone(), self.links.clone());
        tracing::info!(peer = name, addr = registration.addr, epoch, "peer joined");
        self.view.insert(name.to_owned(), Member { epoch, node: link.node() });
        telemetry::set_cluster_members(self.view.len());
    }

    /// `name` left (or its lease expired): its link stops and its blocks leave the index.
    fn leave(&mut self, name: &str) {
        if let Some(member) = self.view.remove(name) {
            tracing::info!(peer = name, epoch = member.epoch, "peer left");
            self.remote.disconnect(member.node);
            telemetry::set_cluster_members(self.view.len());
        }
    }
}
