//! The command line.
//!
//! ```text
//! dynamo-node [serve] [--config FILE] [--data-dir DIR] [--http ADDR] [--metrics ADDR]
//! dynamo-node config default             print the embedded default configuration
//! dynamo-node config check FILE          validate FILE; errors as FILE:LINE:COL: `key`: message
//! dynamo-node bench storage --dir DIR    G3 throughput against fio on the same device
//! dynamo-node bench serve [--model M]    tokens/s through the HTTP API at 1, 4, 16, 64 streams
//! dynamo-node bench preempt             resuming a preempted request: load its blocks vs recompute
//! dynamo-node gpu-check [--device N]     CUDA kernels vs the CPU backend, KV copy bandwidth
//! ```
//!
//! Exit codes: 0 success, 1 runtime failure (for `gpu-check`: a kernel mismatch), 2 invalid
//! configuration or usage, 3 no usable CUDA device (`gpu-check`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use dynamo_config::{ConfigError, DEFAULT_TOML, NodeConfig};

use crate::bench::storage::StorageArgs;

/// dynamo-node: KV-cache-aware LLM serving for agentic workloads.
#[derive(Debug, Parser)]
#[command(name = "dynamo-node", version, about, args_conflicts_with_subcommands = true)]
pub struct Cli {
    /// What to do; `serve` when omitted.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Options of `serve`, accepted without the subcommand too.
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the node (the default).
    Serve(ServeArgs),
    /// Inspect or validate configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Benchmarks for operators.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Check the CUDA backend on this machine's GPU: every kernel against the CPU backend, and the
    /// KV gather/scatter bandwidth against plain copies. Exit 0 when every kernel matches, 1 when
    /// one does not, 3 when there is no usable CUDA device.
    GpuCheck(GpuCheckArgs),
    /// What the node runs each engine it launches under (`[engine.vllm.launch]`): the engine's
    /// whole process tree ends with the node, however the node ends. Not for operators.
    #[command(hide = true)]
    EngineGuard(EngineGuardArgs),
}

/// `engine-guard` options.
#[derive(Debug, Args)]
pub struct EngineGuardArgs {
    /// The node's pid: the guard exits at once if its parent is already another process.
    #[arg(long)]
    pub parent: u32,
    /// How long the engine has to exit after SIGTERM before its process group is killed.
    #[arg(long, value_parser = humantime_duration)]
    pub grace: std::time::Duration,
    /// The engine's program and arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
    pub command: Vec<String>,
}

fn humantime_duration(text: &str) -> Result<std::time::Duration, String> {
    text.parse::<dynamo_config::HumanDuration>().map(|d| d.as_duration()).map_err(|e| e.to_string())
}

/// `gpu-check` options.
#[derive(Debug, Args)]
pub struct GpuCheckArgs {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Seed of the random kernel inputs.
    #[arg(long, default_value_t = 0x5eed)]
    pub seed: u64,
    /// MiB moved per bandwidth measurement.
    #[arg(long, default_value_t = 256)]
    pub bandwidth_mib: usize,
    /// Skip the reference-engine prefill table (llama-1b and llama-8b at 2K/8K/32K tokens).
    #[arg(long)]
    pub no_prefill: bool,
    /// Skip the end-to-end section: TTFT of one prompt cold and with its prefix in G1, G2, G3
    /// or computed by another worker, through the node's worker loop on the device.
    #[arg(long)]
    pub no_e2e: bool,
    /// The end-to-end section's model shape.
    #[arg(long, default_value = "llama-8b")]
    pub e2e_model: String,
    /// The end-to-end section's prompt length in tokens.
    #[arg(long, default_value_t = 32 * 1024)]
    pub e2e_prompt_tokens: usize,
    /// Runs per end-to-end scenario (the median counts).
    #[arg(long, default_value_t = 3)]
    pub e2e_runs: usize,
    /// Directory for the end-to-end section's G3 file (on the disk to measure).
    #[arg(long, default_value = "/tmp/dynamo-node-gpu-check")]
    pub e2e_dir: PathBuf,
}

/// `serve` options; each flag overrides its key in the configuration file.
#[derive(Debug, Args, Default)]
pub struct ServeArgs {
    /// Configuration file (TOML); the embedded default when omitted.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Overrides `node.data_dir`.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Overrides `frontend.http`.
    #[arg(long, value_name = "ADDR")]
    pub http: Option<SocketAddr>,
    /// Overrides `metrics.listen`.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<SocketAddr>,
    /// Overrides `frontend.reasoning_parser` (`qwen3`, `deepseek_r1`, `gpt_oss`, …).
    #[arg(long, value_name = "NAME")]
    pub reasoning_parser: Option<String>,
    /// Overrides `frontend.tool_call_parser` (`hermes`, `qwen3_coder`, `llama3_json`, …).
    #[arg(long, value_name = "NAME")]
    pub tool_call_parser: Option<String>,
    /// Overrides `frontend.strip_anthropic_preamble` (NVIDIA Dynamo's flag): drop Claude Code's
    /// per-request billing-header line from system text. `--strip-anthropic-preamble=false`
    /// or `--no-strip-anthropic-preamble` keeps it.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub strip_anthropic_preamble: Option<bool>,
    /// Keeps Claude Code's billing-header line (`frontend.strip_anthropic_preamble = false`).
    #[arg(long, conflicts_with = "strip_anthropic_preamble")]
    pub no_strip_anthropic_preamble: bool,
}

/// `config` subcommands.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Print the embedded default configuration.
    Default,
    /// Validate a configuration file: exit 0 when valid, 2 with FILE:LINE:COL and the key otherwise.
    Check {
        /// The file to check.
        file: PathBuf,
    },
}

/// `bench` subcommands.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Write and read block images through the G3 store and compare with fio on the same device.
    Storage(StorageArgs),
    /// Replay a request trace through the node's actors with simulated engines, in virtual time,
    /// one run per routing policy.
    Replay(crate::bench::replay::ReplayArgs),
    /// Generated tokens per second through the real HTTP API of a node started in this process,
    /// at several numbers of concurrent streams, against the memory-bandwidth bound of decode.
    Serve(crate::bench::serve::BenchServeArgs),
    /// A burst that overflows G1: the request that yields resumes by loading its blocks back or by
    /// recomputing them; time to its next token either way.
    Preempt(crate::bench::preempt::BenchPreemptArgs),
    /// The block-serving protocol (G4) over TCP on loopback against a plain socket copy of the
    /// same bytes.
    G4(crate::bench::g4::BenchG4Args),
}

/// Parses the command line and runs it.
pub fn main() -> ExitCode {
    // A test build sets the fail points FAILPOINTS names (`failpoints` feature only).
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let cli = Cli::parse();
    match cli.command {
        None => serve(cli.serve),
        Some(Command::Serve(args)) => serve(args),
        Some(Command::Config(ConfigCommand::Default)) => {
            print!("{DEFAULT_TOML}");
            ExitCode::SUCCESS
        }
        Some(Command::Config(ConfigCommand::Check { file })) => match NodeConfig::load(&file) {
            // What `serve` checks on this machine before it builds anything, too.
            Ok(cfg) => match crate::plan::ResolvedTiers::resolve(&cfg) {
                Ok(_) => {
                    println!("{}: ok", file.display());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("{}: {}", file.display(), error_chain(&e));
                    ExitCode::from(2)
                }
            },
            Err(e) => config_error(&e),
        },
        Some(Command::Bench(BenchCommand::Storage(args))) => {
            report(crate::bench::storage::run(&args).map(|table| print!("{table}")))
        }
        Some(Command::Bench(BenchCommand::Replay(args))) => {
            report(crate::bench::replay::run(&args).map(|table| print!("{table}")))
        }
        Some(Command::Bench(BenchCommand::Serve(args))) => {
            report(crate::bench::serve::run(&args).map(|table| print!("{table}")))
        }
        Some(Command::Bench(BenchCommand::Preempt(args))) => {
            report(crate::bench::preempt::run(&args).map(|table| print!("{table}")))
        }
        Some(Command::Bench(BenchCommand::G4(args))) => {
            report(crate::bench::g4::run(&args).map(|table| print!("{table}")))
        }
        Some(Command::GpuCheck(args)) => gpu_check(&args),
        Some(Command::EngineGuard(args)) => {
            let (program, rest) = args.command.split_first().expect("clap requires the command");
            crate::vllm::guard::run(args.parent, args.grace, program, rest)
        }
    }
}

fn gpu_check(args: &GpuCheckArgs) -> ExitCode {
    use dynamo_kernels::cuda::check::{GpuCheckOptions, ReferencePrefill, gpu_check};
    let timer = ReferencePrefill::new(args.device, 32);
    let opts = GpuCheckOptions {
        ordinal: args.device,
        seed: args.seed,
        bandwidth_bytes: args.bandwidth_mib.max(1) << 20,
        prefill: (!args.no_prefill).then_some(&timer as &dyn dynamo_kernels::cuda::check::PrefillTimer),
        ..Default::default()
    };
    match gpu_check(&opts) {
        Ok(report) => {
            print!("{report}");
            let e2e_ok = args.no_e2e || cached_prefix_ttft(args);
            if report.all_passed() && e2e_ok { ExitCode::SUCCESS } else { ExitCode::FAILURE }
        }
        Err(e @ dynamo_kernels::KernelError::CudaUnavailable(_)) => {
            eprintln!("no usable CUDA device: {e}");
            ExitCode::from(3)
        }
        Err(e) => {
            eprintln!("error: gpu-check could not start: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The end-to-end section on the CUDA device; prints its table. False if it could not run.
fn cached_prefix_ttft(args: &GpuCheckArgs) -> bool {
    use crate::bench::cached_ttft::{CachedTtftOptions, run};
    use dynamo_kernels::cuda::check::pinned_copy_time;
    use dynamo_kernels::cuda::{CudaBackend, HostRegistration};
    use dynamo_tiering::g2::HostPool;

    let Some(shape) = dynamo_config::ModelShape::named(&args.e2e_model) else {
        eprintln!("error: --e2e-model {:?} is not a known shape", args.e2e_model);
        return false;
    };
    let opts = CachedTtftOptions {
        shape,
        dtype: dynamo_config::Dtype::Bf16,
        block_tokens: 32,
        prompt_tokens: args.e2e_prompt_tokens,
        runs: args.e2e_runs,
        dir: args.e2e_dir.clone(),
        seed: args.seed,
        // Loads are weighed against this device's prefill rate, measured first.
        prefill_tokens_per_s: None,
    };
    let ordinal = args.device;
    let make = || CudaBackend::new(ordinal).map_err(anyhow::Error::from);
    let prepare = |cuda: &CudaBackend, pool: &HostPool| {
        let (ptr, len) = pool.region();
        // SAFETY: the pool's mapping lives as long as the node the harness builds, and the
        // registration is dropped before the node (the harness keeps it in front of the tiers).
        unsafe { cuda.register_host(ptr, len) }.map_err(anyhow::Error::from)
    };
    let copy = |bytes: usize| {
        let cuda = CudaBackend::new(ordinal).ok()?;
        pinned_copy_time(&cuda, bytes, 5).ok()
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the end-to-end section: {e}");
            return false;
        }
    };
    println!("\n# End to end: one CUDA worker pair, {} shape", shape.name);
    let share = |registration: &HostRegistration, cuda: &CudaBackend| registration.share(cuda);
    match runtime.block_on(run(&make, &prepare, &share, &copy, &opts)) {
        Ok(report) => {
            print!("{report}");
            true
        }
        Err(e) => {
            eprintln!("error: the end-to-end section failed: {}", error_chain(&e));
            false
        }
    }
}

fn config_error(e: &ConfigError) -> ExitCode {
    eprintln!("{e}");
    ExitCode::from(2)
}

fn report(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// `e` and its causes, `: `-separated, each said once: an error that names its source in its
/// own message (as many do, `std::io::Error`'s wrappers among them) would otherwise print the
/// OS error twice.
fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// Loads the configuration `serve` would run with: the file (or the embedded default) with the
/// command-line overrides applied, validated again after them.
pub fn serve_config(args: &ServeArgs) -> Result<NodeConfig, ConfigError> {
    let mut cfg = match &args.config {
        Some(path) => NodeConfig::load(path)?,
        None => NodeConfig::embedded_default(),
    };
    if let Some(dir) = &args.data_dir {
        cfg.node.data_dir = dir.clone();
    }
    if let Some(addr) = args.http {
        cfg.frontend.http = addr.to_string();
    }
    if let Some(addr) = args.metrics {
        cfg.metrics.listen = addr.to_string();
    }
    if let Some(name) = &args.reasoning_parser {
        cfg.frontend.reasoning_parser = Some(name.clone());
    }
    if let Some(name) = &args.tool_call_parser {
        cfg.frontend.tool_call_parser = Some(name.clone());
    }
    if let Some(strip) = args.strip_anthropic_preamble {
        cfg.frontend.strip_anthropic_preamble = strip;
    }
    if args.no_strip_anthropic_preamble {
        cfg.frontend.strip_anthropic_preamble = false;
    }
    cfg.validate()?;
    Ok(cfg)
}

fn serve(args: ServeArgs) -> ExitCode {
    let cfg = match serve_config(&args) {
        Ok(cfg) => cfg,
        Err(e) => return config_error(&e),
    };
    crate::logging::init(&cfg.node);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("dynamo-node").build() {
        Ok(rt) => rt,
        Err(e) => return report(Err(e.into())),
    };
    let result = runtime.block_on(crate::node::run(cfg));
    // A request still being prepared on the blocking pool must not hold the exit.
    runtime.shutdown_timeout(Duration::from_millis(500));
    report(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that names its OS error in its own message, wrapped in context: the OS error
    /// is printed once.
    #[test]
    fn an_error_chain_says_each_cause_once() {
        let os = std::io::Error::from_raw_os_error(libc::ENOSPC);
        #[derive(Debug, thiserror::Error)]
        #[error("G3 file /x: {source}")]
        struct Named {
            source: std::io::Error,
        }
        let e = anyhow::Error::new(Named { source: os }).context("opening the G3 store");
        let text = error_chain(&e);
        assert_eq!(text.matches("os error 28").count(), 1, "{text}");
        assert!(text.starts_with("opening the G3 store: G3 file /x: "), "{text}");
        assert_eq!(format!("{e:#}").matches("os error 28").count(), 2, "anyhow's own form says it twice");
    }

    /// NVIDIA Dynamo's `--strip-anthropic-preamble` sets the key, and the command line can turn
    /// it off as well (`=false` or `--no-strip-anthropic-preamble`); without a flag the file's
    /// value stands.
    #[test]
    fn the_preamble_flag_overrides_the_key_both_ways() {
        let strip = |args: &[&str]| {
            let cli = Cli::try_parse_from([&["dynamo-node", "serve"], args].concat()).expect("parses");
            let Some(Command::Serve(serve)) = cli.command else { panic!("serve") };
            serve_config(&serve).expect("valid").frontend.strip_anthropic_preamble
        };
        assert!(strip(&[]), "on by default");
        assert!(strip(&["--strip-anthropic-preamble"]));
        assert!(strip(&["--strip-anthropic-preamble=true"]));
        assert!(!strip(&["--strip-anthropic-preamble=false"]));
        assert!(!strip(&["--no-strip-anthropic-preamble"]));
        let both = ["dynamo-node", "serve", "--strip-anthropic-preamble", "--no-strip-anthropic-preamble"];
        assert!(Cli::try_parse_from(both).is_err(), "the two flags conflict");
    }
}
