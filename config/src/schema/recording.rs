//! `[recording]`: the traffic recorder.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{ByteSize, HumanDuration};

config_enum! {
    /// The format a recording is written in: one of the two `bench replay` reads.
    #[derive(Default)]
    pub enum RecordingFormat ("recording format") {
        /// aiperf's agentic sessions: a session's first request in full, each later one as the
        /// tokens it adds and the think time before it.
        #[default]
        AiperfAgentic = "aiperf_agentic",
        /// Mooncake: every request's whole prompt at its arrival time.
        Mooncake = "mooncake",
    }
}

/// `[recording]`: the node records what it served as a trace that `bench replay` reads back.
/// Per request it writes the arrival, the session, the input and output lengths and the prompt's
/// block hash ids (one per 512 tokens), never text or token ids; every file is salted with its
/// own random key, so ids say nothing across files.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RecordingSection {
    /// Record the traffic served. Default `false`.
    pub enabled: bool,
    /// Where the recordings go; a relative path is under `node.data_dir`. Default `"traffic"`.
    pub dir: PathBuf,
    /// `"aiperf_agentic"` or `"mooncake"`. Default `"aiperf_agentic"`.
    pub format: RecordingFormat,
    /// A file past this size is closed and a new one begun. Default `"64MiB"`.
    pub max_file_size: ByteSize,
    /// A file older than this is closed and a new one begun. Default `"1h"`.
    pub rotate_every: HumanDuration,
    /// Files kept (the one being written included); the oldest go first. Default `24`.
    pub max_files: usize,
}

impl Default for RecordingSection {
    fn default() -> Self {
        RecordingSection {
            enabled: false,
            dir: PathBuf::from("traffic"),
            format: RecordingFormat::AiperfAgentic,
            max_file_size: ByteSize::mib(64),
            rotate_every: HumanDuration::mins(60),
            max_files: 24,
        }
    }
}
