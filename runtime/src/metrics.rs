//! Prometheus metrics: the exporter and the poller that mirrors the tiers' own counters. The names
//! and the functions that record them are [`dynamo_actors::telemetry`], re-exported here.
//!
//! Metrics go through the [`metrics`] facade to a global [`metrics_exporter_prometheus`] recorder
//! that serves `GET /metrics` on `metrics.listen`. Every histogram is a true Prometheus histogram
//! with the buckets of `metrics.latency_buckets_seconds` (the exporter's default summaries lose
//! samples between scrapes).

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context, bail};
use dynamo_config::{MetricsSection, TierName};
use dynamo_tiering::g2::HostPool;
use dynamo_tiering::g3::G3Store;
use dynamo_tiering::registry::TierRegistry;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

pub use dynamo_actors::telemetry::*;

static INSTALLED: AtomicBool = AtomicBool::new(false);

/// What [`install`] set up: the exporter's address and a handle that renders what it serves, or
/// nothing when `metrics.enabled = false`.
#[derive(Clone)]
pub struct MetricsHandle {
    exporter: Option<(SocketAddr, PrometheusHandle)>,
}

impl MetricsHandle {
    /// A handle for a node without metrics.
    pub fn disabled() -> Self {
        Self { exporter: None }
    }

    /// Whether an exporter is installed.
    pub fn is_enabled(&self) -> bool {
        self.exporter.is_some()
    }

    /// The address `/metrics` is served on.
    pub fn listen(&self) -> Option<SocketAddr> {
        self.exporter.as_ref().map(|(addr, _)| *addr)
    }

    /// The exposition text a scrape would get now.
    pub fn render(&self) -> Option<String> {
        self.exporter.as_ref().map(|(_, handle)| handle.render())
    }

    /// The start-up line: `metrics on http://ADDR/metrics` or `metrics disabled`.
    pub fn line(&self) -> String {
        match self.listen() {
            Some(addr) => format!("metrics on http://{addr}/metrics"),
            None => "metrics disabled".to_owned(),
        }
    }
}

impl fmt::Debug for MetricsHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MetricsHandle").field("listen", &self.listen()).finish()
    }
}

/// Installs the global recorder and serves `/metrics` on `cfg.listen`, every histogram bucketed by
/// `cfg.latency_buckets_seconds`; registers the descriptions, the known series and a request
/// series for each of `apis` (the frontend's route labels). With `cfg.enabled = false` it
/// installs nothing and returns [`MetricsHandle::disabled`].
///
/// Call it once per process, inside a tokio runtime (the listener runs on it). Errors: the address
/// does not parse or cannot be bound (in use, not local), the buckets are empty, no runtime, or a
/// recorder is already installed.
pub fn install(cfg: &MetricsSection, apis: &[&'static str]) -> anyhow::Result<MetricsHandle> {
    if !cfg.enabled {
        return Ok(MetricsHandle::disabled());
    }
    let addr: SocketAddr =
        cfg.listen.parse().with_context(|| format!("metrics.listen = {:?} is not an ip:port", cfg.listen))?;
    let runtime = tokio::runtime::Handle::try_current().context("metrics::install needs a tokio runtime")?;
    if INSTALLED.swap(true, Ordering::SeqCst) {
        bail!("the metrics recorder is already installed in this process");
    }
    // The node serves the exposition itself on a listener it bound, so `:0` reports the port the
    // kernel chose (the exporter's own listener does not say).
    let result = (|| {
        let listener = std::net::TcpListener::bind(addr)
            .with_context(|| format!("cannot serve metrics on {addr} (metrics.listen, --metrics)"))?;
        listener.set_nonblocking(true)?;
        let bound = listener.local_addr()?;
        let recorder = PrometheusBuilder::new()
            .set_buckets(&cfg.latency_buckets_seconds)
            .context("metrics.latency_buckets_seconds")?
            .build_recorder();
        let handle = recorder.handle();
        metrics::set_global_recorder(recorder).context("installing the metrics recorder")?;
        let listener = {
            let _guard = runtime.enter();
            tokio::net::TcpListener::from_std(listener)?
        };
        let served = handle.clone();
        let token: Option<Arc<[u8]>> = cfg.bearer_token.as_deref().map(|t| t.as_bytes().into());
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move |headers: axum::http::HeaderMap| {
                let handle = served.clone();
                let token = token.clone();
                async move { exposition(&handle, token.as_deref(), &headers) }
            }),
        );
        runtime.spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!("the metrics endpoint on {bound} stopped: {e}");
            }
        });
        let upkeep = handle.clone();
        runtime.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                upkeep.run_upkeep();
            }
        });
        Ok((bound, handle))
    })();
    let (addr, handle) = match result {
        Ok(bound) => bound,
        Err(e) => {
            INSTALLED.store(false, Ordering::SeqCst);
            return Err(e);
        }
    };
    describe();
    register_known_series();
    register_request_series(apis);
    Ok(MetricsHandle { exporter: Some((addr, handle)) })
}

/// A scrape's answer: the exposition, or 401 when `token` is set and the request does not carry it
/// as `Authorization: Bearer TOKEN` (compared in constant time).
fn exposition(
    handle: &PrometheusHandle,
    token: Option<&[u8]>,
    headers: &axum::http::HeaderMap,
) -> axum::response::Response {
    use axum::http::{StatusCode, header};
    use axum::response::IntoResponse;
    if let Some(token) = token {
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().split_at_checked(7))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case(b"bearer "))
            .map(|(_, credentials)| credentials);
        if !presented.is_some_and(|p| crate::frontend::constant_time_eq(token, p)) {
            record_auth_failure("metrics");
            return (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                "metrics need `Authorization: Bearer TOKEN` (metrics.bearer_token)\n",
            )
                .into_response();
        }
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], handle.render()).into_response()
}

/// What the tier poller reads: shared handles to the node's tiers.
#[derive(Clone, Debug)]
pub struct TierSources {
    /// G1 capacity in blocks, summed over workers.
    pub g1_capacity: u64,
    /// The G2 pool.
    pub g2: Option<HostPool>,
    /// G2 bookkeeping.
    pub g2_registry: Option<Arc<Mutex<TierRegistry>>>,
    /// The G3 store.
    pub g3: Option<Arc<G3Store>>,
    /// G3 bookkeeping.
    pub g3_registry: Option<Arc<Mutex<TierRegistry>>>,
    /// The node's leases: what gave way to the lease budget there is counted as the lowest
    /// tier's degradations.
    pub leases: Option<Arc<dynamo_actors::leases::LeaseBook>>,
}

impl TierSources {
    /// Publishes one snapshot: capacities, resident blocks, evictions, G3 in-flight I/O and the
    /// G3 store's counters.
    pub fn publish(&self) {
        set_tier_capacity(TierName::G1, self.g1_capacity);
        let book_degraded = self.leases.as_ref().map_or(0, |book| book.degraded());
        if let Some(registry) = &self.g2_registry {
            let mut stats = registry.lock().unwrap_or_else(PoisonError::into_inner).stats();
            if self.g3_registry.is_none() {
                stats.leases.degradations_total += book_degraded;
            }
            publish_registry(TierName::G2, &stats);
        }
        if let Some(pool) = &self.g2 {
            set_tier_capacity(TierName::G2, u64::from(pool.slots()));
        }
        if let Some(registry) = &self.g3_registry {
            let mut stats = registry.lock().unwrap_or_else(PoisonError::into_inner).stats();
            stats.leases.degradations_total += book_degraded;
            publish_registry(TierName::G3, &stats);
        }
        if let Some(store) = &self.g3 {
            // The store is the truth on what G3 holds; the registry may lag it.
            set_tier_blocks(TierName::G3, store.len() as u64);
            set_tier_capacity(TierName::G3, store.capacity_slots());
            set_io_inflight(TierName::G3, store.in_flight() as u64);
            publish_store_stats(TierName::G3, store.stats());
        }
    }
}

/// Publishes `sources` now, marks the present tiers healthy, and then every `period` on a tokio
/// task until the handle is aborted.
pub fn spawn_tier_poller(sources: TierSources, period: Duration) -> tokio::task::JoinHandle<()> {
    sources.publish();
    if sources.g2.is_some() {
        set_tier_degraded(TierName::G2, false);
    }
    if sources.g3.is_some() {
        set_tier_degraded(TierName::G3, false);
    }
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            sources.publish();
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dynamo_config::RegionKind;
    use dynamo_tiering::g3::G3Stats;
    use dynamo_tiering::registry::PolicyKind;

    fn render_with(buckets: &[f64], f: impl FnOnce()) -> String {
        let recorder = PrometheusBuilder::new().set_buckets(buckets).unwrap().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe();
            f();
        });
        handle.render()
    }

    #[test]
    fn helpers_write_the_documented_names_and_labels() {
        let text = render_with(&[0.01, 0.1, 1.0], || {
            register_known_series();
            record_transfer(TierName::G3, TierName::G2, 4096, Duration::from_millis(5));
            record_transfer(TierName::G3, TierName::G2, 4096, Duration::from_millis(50));
            record_request("chat_completions", 429, None);
            record_request("completions", 200, Some(Duration::from_millis(20)));
            record_prompt(100, 36);
            record_hit_tokens(TierName::G2, 64);
            record_tier_error(TierName::G3, "no_space");
            set_tier_degraded(TierName::G3, true);
            set_io_inflight(TierName::G3, 3);
            record_inter_token(Duration::from_millis(2));
        });
        for needle in [
            "# TYPE dynamo_node_kv_transfer_seconds histogram",
            "dynamo_node_kv_transfer_bytes_total{src=\"g3\",dst=\"g2\"} 8192",
            "dynamo_node_kv_transfer_seconds_bucket{src=\"g3\",dst=\"g2\",le=\"0.01\"} 1",
            "dynamo_node_kv_transfer_seconds_bucket{src=\"g3\",dst=\"g2\",le=\"0.1\"} 2",
            "dynamo_node_kv_transfer_seconds_count{src=\"g3\",dst=\"g2\"} 2",
            "dynamo_node_kv_transfer_bytes_total{src=\"g1\",dst=\"g2\"} 0",
            "dynamo_node_requests_total{api=\"chat_completions\",status=\"429\"} 1",
            "dynamo_node_requests_total{api=\"completions\",status=\"200\"} 1",
            "dynamo_node_request_ttft_seconds_bucket{le=\"0.1\"} 1",
            "dynamo_node_request_ttft_seconds_count 1",
            "dynamo_node_kv_prompt_tokens_total 100",
            "dynamo_node_prefill_tokens_total 36",
            "dynamo_node_kv_hit_tokens_total{tier=\"g2\"} 64",
            "dynamo_node_kv_hit_tokens_total{tier=\"g4\"} 0",
            "dynamo_node_tier_errors_total{tier=\"g3\",kind=\"no_space\"} 1",
            "dynamo_node_tier_degraded{tier=\"g3\"} 1",
            "dynamo_node_io_inflight{tier=\"g3\"} 3",
            "dynamo_node_inter_token_seconds_bucket{le=\"0.01\"} 1",
            "# HELP dynamo_node_request_ttft_seconds Time from request arrival to the first token.",
            "dynamo_node_build_info{version=\"",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
        }
        assert!(!text.contains("quantile="), "histograms, not summaries:\n{text}");
    }

    #[test]
    fn registry_evictions_are_mirrored_per_region() {
        let mut registry = TierRegistry::new(2, PolicyKind::Lru);
        let meta = |region| dynamo_tiering::registry::BlockMeta { parent: None, region, priority: 0, retain_until: 0 };
        for (i, region) in [RegionKind::System, RegionKind::Reasoning, RegionKind::Reasoning].into_iter().enumerate() {
            registry.insert(dynamo_tiering::block::BlockHash(i as u128 + 1), meta(region), 0).unwrap();
        }
        let stats = registry.stats();
        let text = render_with(&[1.0], || {
            publish_registry(TierName::G2, &stats);
            // A second snapshot of the same source does not double the counter.
            publish_registry(TierName::G2, &stats);
        });
        let evicted = stats.total().evictions_total;
        assert_eq!(evicted, 1, "{stats:?}");
        let system = stats.region(RegionKind::System).evictions_total;
        for needle in [
            format!("dynamo_node_kv_evictions_total{{tier=\"g2\",region=\"system\"}} {system}"),
            "dynamo_node_kv_blocks{tier=\"g2\"} 2".to_owned(),
            "dynamo_node_kv_capacity_blocks{tier=\"g2\"} 2".to_owned(),
            "# TYPE dynamo_node_kv_evictions_total counter".to_owned(),
        ] {
            assert!(text.contains(&needle), "missing {needle:?} in:\n{text}");
        }
    }

    #[test]
    fn store_counters_are_mirrored_not_added() {
        let stats = G3Stats::default();
        stats.writes.store(7, Ordering::Relaxed);
        stats.write_bytes.store(7 * 4096, Ordering::Relaxed);
        stats.corrupt.store(2, Ordering::Relaxed);
        stats.read_errors.store(1, Ordering::Relaxed);
        let text = render_with(&[1.0], || {
            publish_store_stats(TierName::G3, &stats);
            publish_store_stats(TierName::G3, &stats);
        });
        for needle in [
            "dynamo_node_kv_tier_writes_total{tier=\"g3\"} 7",
            "dynamo_node_kv_tier_write_bytes_total{tier=\"g3\"} 28672",
            "dynamo_node_kv_corrupt_blocks_total{tier=\"g3\"} 2",
            "dynamo_node_kv_tier_io_errors_total{tier=\"g3\",op=\"read\"} 1",
            "dynamo_node_kv_tier_io_errors_total{tier=\"g3\",op=\"write\"} 0",
        ] {
            assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
        }
    }

    #[test]
    fn disabled_metrics_install_nothing() {
        let cfg = MetricsSection { enabled: false, ..MetricsSection::default() };
        let handle = install(&cfg, &[]).unwrap();
        assert!(!handle.is_enabled());
        assert_eq!(handle.line(), "metrics disabled");
        assert!(handle.render().is_none());
    }
}
