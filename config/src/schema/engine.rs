//! `[engine]`: the engine each worker runs, and how many workers.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::HumanDuration;

config_enum! {
    /// Which engine a worker runs.
    #[derive(Default)]
    pub enum EngineKind ("engine kind") {
        /// The reference transformer: real math on CPU or CUDA.
        #[default]
        Reference = "reference",
        /// No math; timing from the calibration, KV bytes derived from block hashes. It computes
        /// no tokens, so it serves nothing: `bench replay --engine simulated` runs it, and a
        /// configuration naming it is refused with that said.
        Simulated = "simulated",
        /// The reference transformer computing every prompt and answer token as usual, but the
        /// answer's tokens are `engine.script`'s for the turn instead of sampled: end-to-end
        /// agent-loop tests through the real tokenizer, template, parsers, worker, tiers and
        /// APIs without trained weights. Never the default.
        Scripted = "scripted",
        /// vLLM engines the node forwards token ids to (`[engine.vllm]`): the node keeps
        /// tokenization, templates, parsers, sessions, routing and every API's shape; each engine
        /// computes and samples. One worker per engine.
        Vllm = "vllm",
    }
}

config_enum! {
    /// Where the engine computes.
    #[derive(Default)]
    pub enum DeviceKind ("device") {
        /// CUDA when a GPU is present and the binary has CUDA support, else the CPU.
        #[default]
        Auto = "auto",
        /// The CPU.
        Cpu = "cpu",
        /// CUDA; start-up fails if no GPU is usable.
        Cuda = "cuda",
    }
}

/// `[engine]`: the engine each worker runs, and how many workers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineSection {
    /// `"reference"` (real model), `"scripted"` (the real model answering from `script`) or
    /// `"vllm"` (vLLM engines, `[engine.vllm]`); `"simulated"` is refused (it is `bench
    /// replay`'s). Default `"reference"`.
    pub kind: EngineKind,
    /// `"auto"`, `"cpu"` or `"cuda"`. Default `"auto"`.
    pub device: DeviceKind,
    /// Number of workers (one per GPU; CPU workers share the cores). Default `2`.
    pub workers: usize,
    /// Most tokens (prefill + decode) in one engine step. Default `2048`.
    pub max_batch_tokens: usize,
    /// Most requests one worker runs at once (its batch: each step computes the next token of
    /// every one of them, plus prefill chunks). Default `64`.
    pub max_running_requests: usize,
    /// Admission bound: requests queued per worker before new ones are shed with an
    /// "overloaded" error. Default `64`.
    pub max_queued_requests: usize,
    /// Calibration file (format of `calibration/h200.toml`): the host link's and the disk's
    /// rates the cost model starts from until the node has timed its own. Default: none (loads
    /// are taken until timed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calibration: Option<PathBuf>,
    /// The answers of `kind = "scripted"`: a JSON array of strings, the one for a request being
    /// its turn (the number of assistant messages it carries) modulo their count. Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub script: Option<PathBuf>,
    /// `[engine.vllm]`: the vLLM engines of `kind = "vllm"`.
    pub vllm: VllmSection,
}

/// `[engine.vllm]`: the vLLM engines a node of `engine.kind = "vllm"` forwards to, one worker
/// each. The node reads the same checkpoint (`model.path`: tokenizer, chat template, stop
/// tokens, vocabulary) and checks at start that every engine serves it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VllmSection {
    /// Engines to attach to, `http://host:port` each (started with `--enable-scale-out` or
    /// `--tokens-only`, which mount `/inference/v1/generate`). Default: none.
    pub urls: Vec<String>,
    /// The bearer key the engines were started with (`--api-key`). Default: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    /// Longest a request may take on an engine, first byte to last; past it the request ends
    /// with an error and is aborted in the engine. Default `"10m"`.
    pub request_timeout: HumanDuration,
    /// Longest the node waits at start for each engine to answer `/health`. Default `"120s"`.
    pub start_timeout: HumanDuration,
    /// How often each engine's own load (`/metrics`: requests running and waiting, KV cache in
    /// use) is read for the router; `"0s"` = never (the router then knows only what the node
    /// sent). Default `"250ms"`.
    pub load_interval: HumanDuration,
    /// `[engine.vllm.launch]`: engines the node starts itself instead of attaching to `urls`.
    pub launch: LaunchSection,
}

/// `[engine.vllm.launch]`: engines the node starts, one per entry of `devices`, each a process
/// group of its own that the node supervises (restarted with backoff when it exits, stopped with
/// the node), its output logged as the node's under `engine = N`. The node appends the model
/// (`model.path`), the address, its block size and the flags a worker needs; with `connector`,
/// the node's KV connector too, so the engines store into and load from G2, G3 and G4.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LaunchSection {
    /// One engine per entry: the value of `device_env` it starts with (a GPU's index, or a
    /// list such as `"0,1"` for an engine spanning two). Default: none (attach to `urls`).
    pub devices: Vec<String>,
    /// The program and its first arguments that serve one engine; the node appends
    /// `model.path` and its flags. Default `["vllm", "serve"]`.
    pub command: Vec<String>,
    /// More arguments for every engine (`--dtype`, `--gpu-memory-utilization`, …), after the
    /// node's. Default: none.
    pub args: Vec<String>,
    /// The environment variable each engine's entry of `devices` is set in. Default
    /// `"CUDA_VISIBLE_DEVICES"` (`"VLLM_CPU_OMP_THREADS_BIND"` for vLLM on CPU cores).
    pub device_env: String,
    /// More environment for every engine. Default: none.
    pub env: std::collections::BTreeMap<String, String>,
    /// The address the engines listen on. Default `"127.0.0.1"`.
    pub host: String,
    /// Engine `i` serves HTTP on `port + 2i` and publishes its KV events on `port + 2i + 1`.
    /// Default `8100`.
    pub port: u16,
    /// Configure the node's KV connector in every engine (vLLM's `OffloadingConnector` with the
    /// node's plug-in, over `engine_endpoint`'s socket, which must be enabled). Default `true`.
    pub connector: bool,
}

impl Default for LaunchSection {
    fn default() -> Self {
        LaunchSection {
            devices: Vec::new(),
            command: vec!["vllm".into(), "serve".into()],
            args: Vec::new(),
            device_env: "CUDA_VISIBLE_DEVICES".into(),
            env: std::collections::BTreeMap::new(),
            host: "127.0.0.1".into(),
            port: 8100,
            connector: true,
        }
    }
}

impl VllmSection {
    /// Whether the node launches its engines (`launch.devices`) rather than attaching to `urls`.
    pub fn launches(&self) -> bool {
        !self.launch.devices.is_empty()
    }

    /// The engines' URLs: `urls`, or those of the engines it launches.
    pub fn engine_urls(&self) -> Vec<String> {
        if !self.launches() {
            return self.urls.iter().map(|u| u.trim_end_matches('/').to_owned()).collect();
        }
        let launch = &self.launch;
        (0..launch.devices.len()).map(|i| format!("http://{}:{}", launch.host, launch.port as usize + 2 * i)).collect()
    }
}

impl Default for VllmSection {
    fn default() -> Self {
        VllmSection {
            urls: Vec::new(),
            api_key: None,
            request_timeout: HumanDuration::secs(600),
            start_timeout: HumanDuration::secs(120),
            load_interval: HumanDuration::millis(250),
            launch: LaunchSection::default(),
        }
    }
}

impl Default for EngineSection {
    fn default() -> Self {
        EngineSection {
            kind: EngineKind::Reference,
            device: DeviceKind::Auto,
            workers: 2,
            max_batch_tokens: 2048,
            max_running_requests: 64,
            max_queued_requests: 64,
            calibration: None,
            script: None,
            vllm: VllmSection::default(),
        }
    }
}
