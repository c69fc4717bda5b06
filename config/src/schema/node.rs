//! `[node]`: identity, data directory, logging, shutdown.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::HumanDuration;

config_enum! {
    /// Format of log lines.
    #[derive(Default)]
    pub enum LogFormat ("log format") {
        /// Human-readable text.
        #[default]
        Text = "text",
        /// One JSON object per line.
        Json = "json",
    }
}

/// `[node]`: identity, data directory, logging, shutdown.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeSection {
    /// Name of this node in the cluster, in logs and as a metric label. Default `"node-0"`.
    pub name: String,
    /// Directory for the node's state; relative paths are relative to the working directory.
    /// The default G3 store lives under it. Default `"dynamo-data"`.
    pub data_dir: PathBuf,
    /// Log line format: `"text"` or `"json"`. Default `"text"`.
    pub log_format: LogFormat,
    /// Log filter, `tracing` env-filter syntax (`"info"`, `"info,dynamo_tiering=debug"`).
    /// Default `"info"`.
    pub log_level: String,
    /// How long shutdown waits for in-flight requests and write-through before it stops
    /// anyway. Default `"30s"`.
    pub shutdown_grace: HumanDuration,
}

impl Default for NodeSection {
    fn default() -> Self {
        NodeSection {
            name: "node-0".to_owned(),
            data_dir: PathBuf::from("dynamo-data"),
            log_format: LogFormat::Text,
            log_level: "info".to_owned(),
            shutdown_grace: HumanDuration::secs(30),
        }
    }
}
