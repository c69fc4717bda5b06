//! `[metrics]`: the Prometheus exporter.

use serde::{Deserialize, Serialize};

/// Default histogram buckets: roughly 1-2.5-5 steps from 100 µs to 60 s.
const DEFAULT_BUCKETS: [f64; 18] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// `[metrics]`: the Prometheus exporter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSection {
    /// Serve `/metrics`. Default `true`.
    pub enabled: bool,
    /// Listen address, `ip:port`. Default `"127.0.0.1:9090"`.
    pub listen: String,
    /// Upper bounds (seconds) of latency histogram buckets, positive and strictly increasing.
    /// Default: 100 µs to 60 s in 1-2.5-5 steps.
    pub latency_buckets_seconds: Vec<f64>,
    /// When set, `/metrics` answers only requests with `Authorization: Bearer TOKEN` (Prometheus:
    /// `authorization: {credentials: TOKEN}` in the scrape config); others get 401. Default: unset.
    pub bearer_token: Option<String>,
}

impl Default for MetricsSection {
    fn default() -> Self {
        MetricsSection {
            enabled: true,
            listen: "127.0.0.1:9090".to_owned(),
            latency_buckets_seconds: DEFAULT_BUCKETS.to_vec(),
            bearer_token: None,
        }
    }
}
