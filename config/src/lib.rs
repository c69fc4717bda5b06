//! The configuration of a dynamo-node: one TOML file for the whole node.
//!
//! # Architecture
//!
//! **Schema.** [`NodeConfig`] is the whole file, one section per struct in [`schema`]
//! (`[node]`, `[model]`, `[engine]`, `[blocks]`, `[tiers.g1]`…`[tiers.g4]`, `[retention.*]`,
//! `[router]`, `[frontend]`, `[metrics]`), including sections that other crates implement, so an
//! operator sees one file. Every struct is `#[serde(default, deny_unknown_fields)]` and has a
//! `Default` holding the documented default; the doc comment of each field is that key's
//! documentation. Sizes are [`ByteSize`] (`"64GiB"`), durations [`HumanDuration`] (`"30s"`),
//! choices small enums written in lowercase. [`EXAMPLE_TOML`] sets every key to its default with
//! a comment; a test keeps it complete and equal to `NodeConfig::default()`. [`DEFAULT_TOML`] is
//! the shorter file `dynamo-node config default` prints.
//!
//! **Parse with spans.** [`NodeConfig::parse`] parses the source once into toml's spanned
//! document tree and deserializes from it, so a syntax error, an unknown key (often a typo) or a
//! value of the wrong type carries a byte span. The span is mapped to a line and column and, by
//! walking the tree, to the dotted key path (`tiers.g2.capacity`).
//!
//! **Validate.** [`NodeConfig::validate`] checks what types cannot: ranges, watermarks, socket
//! addresses, that each tier holds at least one KV block of the configured model. It collects
//! every problem, each naming its key path, with a message that says how to fix it. `parse` maps
//! each path back to the key's position in the file (or `1:1` and "(default)" when the key is
//! absent and its default is what does not fit).
//!
//! **Errors.** Everything surfaces as one [`ConfigError`], displayed as
//! `ORIGIN:LINE:COL: `KEY.PATH`: message` — e.g.
//! ``node.toml:12:1: `tiers.g2.capcity`: unknown key; expected one of enabled, capacity, …`` —
//! with a stable [`ConfigError::kind`] for metrics.
//!
//! The [`Calibration`] file of the simulated engine and the cost model (measured bandwidths and
//! prefill times, `calibration/h200.toml` embedded as the default) goes through the same
//! machinery. [`ModelShape`] describes the named model shapes and sizes their KV.

#![warn(missing_docs)]

#[macro_use]
mod macros;

mod calibration;
mod duration;
mod error;
mod located;
mod model;
mod region;
pub mod schema;
mod size;
mod validate;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use calibration::{Calibration, ComputeCalibration, DiskCalibration, LinkCalibration, PrefillCalibration};
pub use duration::HumanDuration;
pub use error::{ConfigError, Location, Problem, ValueParseError};
pub use model::{Dtype, ModelShape};
pub use region::RegionKind;
pub use schema::*;
pub use size::ByteSize;

/// The defaults, as `dynamo-node config default` prints them: the commonly tuned keys, with
/// comments. Parses to [`NodeConfig::default`].
pub const DEFAULT_TOML: &str = include_str!("../default.toml");

/// Every key of every section, set to its default, each with a comment.
pub const EXAMPLE_TOML: &str = include_str!("../example.toml");

/// The configuration of one node: the whole TOML file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// `[node]`: identity, data directory, logging, shutdown.
    pub node: NodeSection,
    /// `[model]`: which model the workers serve.
    pub model: ModelSection,
    /// `[engine]`: the engine each worker runs, and how many workers.
    pub engine: EngineSection,
    /// `[blocks]`: the unit of KV sharing.
    pub blocks: BlocksSection,
    /// `[tiers.*]`: capacities, eviction and I/O of the four KV tiers.
    pub tiers: TiersSection,
    /// `[retention.*]`: priority, hold and deepest tier per region.
    pub retention: RetentionSection,
    /// `[router]`: worker choice and queue order.
    pub router: RouterSection,
    /// `[frontend]`: the HTTP API.
    pub frontend: FrontendSection,
    /// `[metrics]`: the Prometheus exporter.
    pub metrics: MetricsSection,
    /// `[recording]`: the traffic recorder.
    pub recording: RecordingSection,
    /// `[cluster]`: how the node finds its G4 peers.
    pub cluster: ClusterSection,
    /// `[engine_endpoint]`: external engines (vLLM) using the node's tiers.
    pub engine_endpoint: EngineEndpointSection,
}

impl NodeConfig {
    /// Parses and validates `src`. `origin` (usually the file name) prefixes error locations.
    pub fn parse(src: &str, origin: &str) -> Result<NodeConfig, ConfigError> {
        let (config, source) = located::parse::<NodeConfig>(src, origin)?;
        match config.validate() {
            Ok(()) => Ok(config),
            Err(ConfigError::Invalid(problems)) => Err(ConfigError::Invalid(source.locate(problems))),
            Err(other) => Err(other),
        }
    }

    /// Reads, parses and validates the file at `path`.
    pub fn load(path: &Path) -> Result<NodeConfig, ConfigError> {
        let src = std::fs::read_to_string(path).map_err(|source| ConfigError::Io { path: path.to_owned(), source })?;
        Self::parse(&src, &path.display().to_string())
    }

    /// The configuration of [`DEFAULT_TOML`] (equal to [`NodeConfig::default`]).
    pub fn embedded_default() -> NodeConfig {
        // A test parses DEFAULT_TOML, so this cannot fail in a tested build.
        Self::parse(DEFAULT_TOML, "default.toml").unwrap_or_else(|e| panic!("embedded default.toml is invalid: {e}"))
    }

    /// The named shape of the model, when the model is not loaded from `model.path` (whose
    /// shape is only known once its `config.json` is read).
    pub fn model_shape(&self) -> Option<ModelShape> {
        match self.model.path {
            Some(_) => None,
            None => ModelShape::named(&self.model.name),
        }
    }

    /// Bytes of K and V in one block (`block_size` tokens), or `None` when the model comes from
    /// a path and its shape is not known yet.
    pub fn kv_bytes_per_block(&self) -> Option<u64> {
        let shape = self.model_shape()?;
        Some(shape.kv_bytes_per_token(self.model.dtype) * self.blocks.block_size as u64)
    }

    /// The G3 store paths, with the empty default resolved to `<node.data_dir>/g3/store.0`.
    pub fn g3_paths(&self) -> Vec<PathBuf> {
        if self.tiers.g3.paths.is_empty() {
            vec![self.node.data_dir.join("g3").join("store.0")]
        } else {
            self.tiers.g3.paths.clone()
        }
    }

    /// The calibration named by `engine.calibration`, or the embedded H200 one.
    pub fn calibration(&self) -> Result<Calibration, ConfigError> {
        match &self.engine.calibration {
            Some(path) => Calibration::load(path),
            None => Ok(Calibration::h200()),
        }
    }

    /// The configuration as TOML; parses back to an equal configuration.
    ///
    /// # Panics
    ///
    /// If an integer is above `i64::MAX`, which TOML cannot represent (and [`validate`]
    /// rejects for `model.seed`).
    ///
    /// [`validate`]: NodeConfig::validate
    pub fn to_toml_string(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| panic!("configuration does not serialize: {e}"))
    }
}

#[cfg(test)]
mod tests;
