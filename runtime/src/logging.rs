//! Logging: `tracing` to stderr, text or JSON, filtered by `node.log_level` or `RUST_LOG`.

use dynamo_config::{LogFormat, NodeSection};
use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. `RUST_LOG`, when set, overrides the configured level.
/// Calling it twice is harmless (the second call keeps the first subscriber).
pub fn init(node: &NodeSection) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&node.log_level));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match node.log_format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}
