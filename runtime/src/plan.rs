//! What the node will run: its configuration resolved on this machine.
//!
//! [`ResolvedTiers::resolve`] turns the operator's sizes into what the node will actually run:
//! the block layout and image size of the model, slot sizes, block counts per tier, the G3 files
//! and engine, and where the engines run ([`EngineDevice`]). [`ResolvedTiers::store_plan`] is
//! what the node builder ([`dynamo_actors::builder`]) opens: the G2 pool and the G3 store, whose
//! registry is rebuilt from what it recovered, so a restarted node knows every block it had
//! written — each of them verified again when it is read.

use std::fmt::{self, Write as _};
use std::path::PathBuf;

use anyhow::{Context, bail};
use dynamo_actors::builder::{self, StorePlan};
use dynamo_actors::stores::Watermarks;
use dynamo_config::{ByteSize, DeviceKind, Dtype, IoEngineKind, ModelShape, NodeConfig, TiersSection};
use dynamo_kernels::KernelError;
use dynamo_kernels::cuda::DeviceInfo;
use dynamo_kernels::model::weights::read_hf_config;
use dynamo_tiering::block::BlockLayout;
use dynamo_tiering::g2::{HostPoolOptions, MlockPolicy, align_up};
use dynamo_tiering::g3::{EngineChoice, G3Options};
use dynamo_tiering::io::uring::UringOptions;
use dynamo_tiering::registry::PolicyKind;

/// One memory tier's plan.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryTierPlan {
    /// Bytes configured.
    pub capacity: u64,
    /// Block images that fit.
    pub blocks: u64,
    /// Eviction policy.
    pub policy: PolicyKind,
}

/// The G3 plan.
#[derive(Clone, Debug, PartialEq)]
pub struct G3Plan {
    /// Files or devices.
    pub paths: Vec<PathBuf>,
    /// Bytes per file.
    pub capacity_per_path: u64,
    /// Slots per file.
    pub slots_per_path: u64,
    /// The engine and its settings.
    pub engine: EngineChoice,
    /// `O_DIRECT`.
    pub direct_io: bool,
    /// Eviction policy.
    pub policy: PolicyKind,
    /// `tiers.g3.format_foreign`.
    pub format_foreign: bool,
}

/// Where the engines run: `engine.device` resolved against what the machine has.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineDevice {
    /// The reference engine on the CPU backend; G1 in host memory.
    Cpu,
    /// The reference engine on CUDA: worker `i` on device `i % device_count`, G1 in its memory.
    Cuda(DeviceInfo),
}

impl EngineDevice {
    /// The device ordinal of worker `worker` (CUDA only).
    pub fn ordinal_of(&self, worker: usize) -> Option<usize> {
        match self {
            Self::Cpu => None,
            Self::Cuda(info) => Some(worker % info.device_count.max(1)),
        }
    }
}

impl fmt::Display for EngineDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(info) => write!(f, "cuda ({info})"),
        }
    }
}

/// Device memory a CUDA worker needs besides its weights, activations and G1: the context,
/// cuBLAS's workspace and the backend's staging buffers.
pub const CUDA_WORKER_OVERHEAD: u64 = 1 << 30;

/// Decides where the engines run. `probe` reports the first CUDA device (or why there is none);
/// it is only called when `engine.device` is `"cuda"` or `"auto"`.
fn resolve_device(
    cfg: &NodeConfig,
    probe: &dyn Fn() -> Result<DeviceInfo, KernelError>,
) -> anyhow::Result<EngineDevice> {
    let bf16 = cfg.model.dtype == Dtype::Bf16;
    match cfg.engine.device {
        DeviceKind::Cpu => Ok(EngineDevice::Cpu),
        DeviceKind::Cuda => {
            let info = probe().context("engine.device = \"cuda\" but no CUDA device is usable")?;
            if !bf16 {
                bail!(
                    "engine.device = \"cuda\" keeps weights and KV in bf16, but model.dtype = \"{}\"; set model.dtype = \"bf16\"",
                    cfg.model.dtype
                );
            }
            Ok(EngineDevice::Cuda(info))
        }
        DeviceKind::Auto => match probe() {
            Ok(info) if bf16 => Ok(EngineDevice::Cuda(info)),
            Ok(info) => {
                tracing::info!(
                    device = %info,
                    dtype = %cfg.model.dtype,
                    "a GPU is present, but the CUDA engine keeps bf16 and model.dtype is not; running on the CPU"
                );
                Ok(EngineDevice::Cpu)
            }
            Err(e) => {
                tracing::debug!(reason = %e, "no usable CUDA device; running on the CPU");
                Ok(EngineDevice::Cpu)
            }
        },
    }
}

/// G1 bytes per worker on a CUDA device: `tiers.g1.capacity`, or with 0 what is left of
/// `gpu_memory_fraction` of the device (at most what is free) shared by the workers on it, after
/// each one's weights, activations for `engine.max_batch_tokens` tokens and
/// [`CUDA_WORKER_OVERHEAD`]. Fails with the numbers when the workers would not fit.
pub fn g1_bytes_on_device(cfg: &NodeConfig, shape: &ModelShape, info: &DeviceInfo) -> anyhow::Result<u64> {
    let workers = cfg.engine.workers.max(1);
    let per_device = workers.div_ceil(info.device_count.max(1)) as u64;
    let fraction = cfg.tiers.g1.gpu_memory_fraction;
    let usable = ((info.total_memory as f64 * fraction) as u64).min(info.free_memory as u64);
    let weights = dynamo_kernels::model::weight_bytes(shape);
    let activations = dynamo_kernels::model::forward_bytes(shape, cfg.engine.max_batch_tokens.max(1));
    let fixed = weights + activations + CUDA_WORKER_OVERHEAD;
    let configured = cfg.tiers.g1.capacity.as_u64();
    let share = usable / per_device;
    let explain = || {
        format!(
            "{} has {} free of {}; each of its {per_device} worker(s) needs {} of weights, {} of activations \
             (engine.max_batch_tokens = {}) and {} of overhead",
            info.name,
            ByteSize(info.free_memory as u64),
            ByteSize(info.total_memory as u64),
            ByteSize(weights),
            ByteSize(activations),
            cfg.engine.max_batch_tokens,
            ByteSize(CUDA_WORKER_OVERHEAD),
        )
    };
    if configured > 0 {
        let free_share = info.free_memory as u64 / per_device;
        if configured + fixed > free_share {
            bail!("tiers.g1.capacity = {} does not fit: {}", ByteSize(configured), explain());
        }
        return Ok(configured);
    }
    match share.checked_sub(fixed) {
        Some(left) if left > 0 => Ok(left),
        _ => bail!(
            "tiers.g1.capacity = 0 leaves no G1: gpu_memory_fraction = {fraction} gives each worker {}; {}",
            ByteSize(share),
            explain()
        ),
    }
}

/// What the node will run, derived from its configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct ResolvedTiers {
    /// Node name.
    pub node: String,
    /// Model shape.
    pub shape: ModelShape,
    /// KV element type.
    pub dtype: dynamo_config::Dtype,
    /// Tokens per block.
    pub block_tokens: usize,
    /// Layout of one block's KV.
    pub layout: BlockLayout,
    /// Header + payload bytes of one image.
    pub image_bytes: usize,
    /// Bytes per G2/G3 slot (image rounded up to 4 KiB).
    pub slot_bytes: usize,
    /// Engine workers (each with its own G1).
    pub workers: usize,
    /// With `engine.kind = "vllm"`: the engines the workers forward to (their G1 is theirs).
    pub vllm: Vec<String>,
    /// Where the engines run.
    pub device: EngineDevice,
    /// G1, per worker.
    pub g1: MemoryTierPlan,
    /// G2, shared by the workers.
    pub g2: Option<(MemoryTierPlan, MlockPolicy)>,
    /// G3.
    pub g3: Option<G3Plan>,
    /// G4: transport and peers, when enabled.
    pub g4: Option<(String, String, Vec<String>)>,
    /// The engines' share of G2 (`engine_endpoint.g2_share` of `tiers.g2.capacity`, taken out of
    /// `g2`): shared memory the external engines map, holding only their blocks.
    pub engines_g2: Option<MemoryTierPlan>,
}

/// G4's secret file and TLS files, loaded as the block server and the peer links load them.
fn check_g4_files(cfg: &NodeConfig) -> anyhow::Result<()> {
    let g4 = &cfg.tiers.g4;
    if !g4.enabled {
        return Ok(());
    }
    if let Some(path) = &g4.secret_file {
        dynamo_tiering::g4::auth::ClusterSecret::from_file(path).context("tiers.g4.secret_file")?;
    }
    dynamo_actors::peer::tls(g4)?;
    Ok(())
}

impl ResolvedTiers {
    /// Resolves a validated configuration on this machine (probing for a GPU when
    /// `engine.device` allows one).
    pub fn resolve(cfg: &NodeConfig) -> anyhow::Result<Self> {
        Self::resolve_with(cfg, &dynamo_kernels::cuda::probe)
    }

    /// [`ResolvedTiers::resolve`] with `probe` reporting the CUDA device.
    pub fn resolve_with(cfg: &NodeConfig, probe: &dyn Fn() -> Result<DeviceInfo, KernelError>) -> anyhow::Result<Self> {
        crate::frontend::check_parsers(&cfg.frontend).map_err(anyhow::Error::msg)?;
        scripted_answers(cfg)?;
        let shape = match cfg.model_shape() {
            Some(shape) => shape,
            None => {
                let dir =
                    cfg.model.path.as_deref().context("model.name is not a known shape and model.path is unset")?;
                read_hf_config(dir)?.shape_for_dir(dir)
            }
        };
        let block_tokens = cfg.blocks.block_size;
        let layout = BlockLayout::for_model(&shape, cfg.model.dtype, block_tokens);
        let image_bytes = layout.image_bytes();
        // External engines' blocks share G3's slots with the node's own, and G3 reads land in
        // either G2, so with the endpoint on every slot holds the largest block an engine may
        // register.
        let foreign_image = dynamo_tiering::block::HEADER_LEN as u64 + cfg.engine_endpoint.max_block_bytes.as_u64();
        let slot_bytes = match cfg.engine_endpoint.enabled {
            true => align_up(image_bytes.max(foreign_image as usize)),
            false => align_up(image_bytes),
        };
        let vllm = match cfg.engine.kind {
            dynamo_config::EngineKind::Vllm => cfg.engine.vllm.engine_urls(),
            _ => Vec::new(),
        };
        // The node computes nothing in front of vLLM: its engines have the devices.
        let device = if vllm.is_empty() { resolve_device(cfg, probe)? } else { EngineDevice::Cpu };
        // G1 holds the paged layout, which has no header or alignment padding.
        let g1_block_bytes = layout.payload_bytes() as u64;
        let g1_capacity = match &device {
            EngineDevice::Cpu if cfg.tiers.g1.capacity.as_u64() == 0 => bail!(
                "tiers.g1.capacity = 0 derives G1 from GPU memory, but the engines run on the CPU \
                 (no usable CUDA device, or model.dtype is not bf16); set a size such as \"256MiB\""
            ),
            EngineDevice::Cpu => cfg.tiers.g1.capacity.as_u64(),
            EngineDevice::Cuda(info) => g1_bytes_on_device(cfg, &shape, info)?,
        };
        let g1 = MemoryTierPlan {
            capacity: g1_capacity,
            blocks: g1_capacity / g1_block_bytes,
            policy: cfg.tiers.g1.eviction.into(),
        };
        // With the endpoint on, G2 is two pools: the engines' share, which they map, and the
        // node's own, which no other process maps (an engine can then neither read nor rewrite
        // the node's blocks between their checks and their use).
        let g2_bytes = cfg.tiers.g2.capacity.as_u64();
        let engines_bytes = match cfg.engine_endpoint.enabled {
            true => (g2_bytes as f64 * cfg.engine_endpoint.g2_share) as u64,
            false => 0,
        };
        let g2_tier = |capacity: u64| MemoryTierPlan {
            capacity,
            blocks: capacity / slot_bytes as u64,
            policy: cfg.tiers.g2.eviction.into(),
        };
        let g2 =
            cfg.tiers.g2.enabled.then(|| (g2_tier(g2_bytes - engines_bytes), MlockPolicy::from(cfg.tiers.g2.mlock)));
        let engines_g2 = (cfg.tiers.g2.enabled && engines_bytes > 0).then(|| g2_tier(engines_bytes));
        // G4's secret and TLS files, read as the node will read them, before G3 is formatted
        // (and by `config check`): a secret readable by others, or empty, is refused here
        // rather than after the store is made.
        check_g4_files(cfg)?;
        let g3 = if cfg.tiers.g3.enabled {
            if g2.is_none() {
                bail!(
                    "tiers.g3 is enabled but tiers.g2 is not: G3 reads and writes go through G2 slots; enable tiers.g2"
                );
            }
            let c = &cfg.tiers.g3;
            let engine = match c.io_engine {
                IoEngineKind::Uring => EngineChoice::Uring(UringOptions {
                    queue_depth: c.queue_depth,
                    threads: c.io_threads,
                    register_buffers: c.register_buffers,
                }),
                IoEngineKind::Psync => EngineChoice::Psync { threads: c.queue_depth as usize },
            };
            // What opening the store would refuse, said before anything is built (and by
            // `config check`): a path holding foreign data, a file system without the room.
            for path in cfg.g3_paths() {
                dynamo_tiering::g3::preflight(&path, c.capacity_per_path.as_u64(), c.format_foreign)?;
            }
            let head = dynamo_tiering::g3::superblock::data_offset(slot_bytes as u64);
            let data = c.capacity_per_path.as_u64().saturating_sub(head);
            if data < slot_bytes as u64 {
                bail!(
                    "tiers.g3.capacity_per_path = {} holds no block: a G3 file keeps its first {} for its \
                     header, then slots of {}; raise it to at least {}",
                    c.capacity_per_path,
                    ByteSize(head),
                    ByteSize(slot_bytes as u64),
                    ByteSize(head + slot_bytes as u64),
                );
            }
            Some(G3Plan {
                paths: cfg.g3_paths(),
                capacity_per_path: c.capacity_per_path.as_u64(),
                slots_per_path: data / slot_bytes as u64,
                engine,
                direct_io: c.direct_io,
                policy: c.eviction.into(),
                format_foreign: c.format_foreign,
            })
        } else {
            None
        };
        let g4 = cfg
            .tiers
            .g4
            .enabled
            .then(|| (cfg.tiers.g4.transport.to_string(), cfg.tiers.g4.listen.clone(), cfg.tiers.g4.peers.clone()));
        Ok(Self {
            node: cfg.node.name.clone(),
            shape,
            dtype: cfg.model.dtype,
            block_tokens,
            layout,
            image_bytes,
            slot_bytes,
            workers: if vllm.is_empty() { cfg.engine.workers } else { vllm.len() },
            vllm,
            device,
            g1,
            g2,
            g3,
            g4,
            engines_g2,
        })
    }

    /// What the node builder opens: the G2 pool (its registry keeping all but
    /// [`builder::g2_reserve`] slots) and the G3 store, with the watermarks of `tiers`.
    pub fn store_plan(&self, tiers: &TiersSection) -> anyhow::Result<StorePlan> {
        let watermarks = Watermarks { high: tiers.g2.high_watermark, low: tiers.g2.low_watermark };
        let g2_plan = |plan: &MemoryTierPlan, mlock: MlockPolicy| -> anyhow::Result<builder::G2Plan> {
            let slots = u32::try_from(plan.blocks).context("tiers.g2.capacity holds more than 2^32 slots")?;
            let pool = HostPoolOptions { slot_bytes: self.slot_bytes, slots, mlock };
            Ok(builder::G2Plan::new(pool, plan.policy, watermarks))
        };
        let g2 = self.g2.as_ref().map(|(plan, mlock)| g2_plan(plan, *mlock)).transpose()?;
        let engines_g2 = match (&self.engines_g2, &self.g2) {
            (Some(plan), Some((_, mlock))) => Some(g2_plan(plan, *mlock)?.shared()),
            _ => None,
        };
        let g3 = self.g3.as_ref().map(|plan| builder::G3Plan {
            options: G3Options {
                format_foreign: plan.format_foreign,
                paths: plan.paths.clone(),
                capacity_per_path: plan.capacity_per_path,
                slot_bytes: self.slot_bytes,
                direct_io: plan.direct_io,
                engine: plan.engine,
            },
            policy: plan.policy,
            watermarks: Watermarks { high: tiers.g3.high_watermark, low: tiers.g3.low_watermark },
        });
        Ok(StorePlan { g2, engines_g2, g3, lease_budget: tiers.lease_budget })
    }

    /// What slots sized for external engines' blocks cost the node's own, when that is more than
    /// twice their image: G2 and G3 hold that many times fewer of the node's blocks.
    pub fn slot_warning(&self) -> Option<String> {
        let ratio = self.slot_bytes / self.image_bytes.max(1);
        (self.engines_g2.is_some() && ratio >= 2).then(|| {
            format!(
                "engine_endpoint.max_block_bytes makes every G2 and G3 slot {} for the node's own images of {}: \
                 G2 and G3 hold {ratio}× fewer of the node's blocks than their capacity allows; set \
                 engine_endpoint.max_block_bytes to the engines' block size",
                ByteSize(self.slot_bytes as u64),
                ByteSize(self.image_bytes as u64),
            )
        })
    }

    /// A table for operators: one line per tier.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "node {:?}: model {} ({}), {} tokens per block, {} of KV per block, image {} in {} slots",
            self.node,
            self.shape.name,
            self.dtype,
            self.block_tokens,
            ByteSize(self.layout.payload_bytes() as u64),
            ByteSize(self.image_bytes as u64),
            ByteSize(self.slot_bytes as u64),
        );
        if let Some(warning) = self.slot_warning() {
            let _ = writeln!(out, "WARNING: {warning}");
        }
        if self.vllm.is_empty() {
            let _ = writeln!(out, "engines: {} × reference on {}", self.workers, self.device);
        } else {
            let _ = writeln!(out, "engines: {} × vLLM at {} (G1 is theirs)", self.workers, self.vllm.join(", "));
        }
        let _ = writeln!(out, "{:<4} {:<44} {:>10} {:>9} {:<6}", "tier", "medium", "capacity", "blocks", "policy");
        let policy = |p: PolicyKind| if p == PolicyKind::Lru { "lru" } else { "lfu" };
        let _ = writeln!(
            out,
            "{:<4} {:<44} {:>10} {:>9} {:<6}",
            "G1",
            format!(
                "{} memory, per worker × {}",
                match self.device {
                    EngineDevice::Cpu => "host",
                    EngineDevice::Cuda(_) => "device",
                },
                self.workers
            ),
            ByteSize(self.g1.capacity).to_string(),
            self.g1.blocks,
            policy(self.g1.policy)
        );
        match &self.g2 {
            Some((g2, mlock)) => {
                let _ = writeln!(
                    out,
                    "{:<4} {:<44} {:>10} {:>9} {:<6}",
                    "G2",
                    format!("host memory, mlock {mlock:?}").to_lowercase(),
                    ByteSize(g2.capacity).to_string(),
                    g2.blocks,
                    policy(g2.policy)
                );
            }
            None => {
                let _ = writeln!(out, "G2   disabled");
            }
        }
        if let Some(g2) = &self.engines_g2 {
            let _ = writeln!(
                out,
                "{:<4} {:<44} {:>10} {:>9} {:<6}",
                "G2",
                "host memory, shared with external engines",
                ByteSize(g2.capacity).to_string(),
                g2.blocks,
                policy(g2.policy)
            );
        }
        match &self.g3 {
            Some(g3) => {
                let engine = match g3.engine {
                    EngineChoice::Uring(u) => format!("io_uring qd {} × {} thread(s)", u.queue_depth, u.threads),
                    EngineChoice::Psync { threads } => format!("pread/pwrite × {threads} threads"),
                };
                for path in &g3.paths {
                    let _ = writeln!(
                        out,
                        "{:<4} {:<44} {:>10} {:>9} {:<6} {}{}",
                        "G3",
                        path.display().to_string(),
                        ByteSize(g3.capacity_per_path).to_string(),
                        g3.slots_per_path,
                        policy(g3.policy),
                        engine,
                        if g3.direct_io { ", O_DIRECT" } else { "" }
                    );
                }
            }
            None => {
                let _ = writeln!(out, "G3   disabled");
            }
        }
        match &self.g4 {
            Some((transport, listen, peers)) => {
                let _ = writeln!(
                    out,
                    "G4   {transport} on {listen}, {} peer(s) (G2 served to peers; loading from peers is not built yet)",
                    peers.len()
                );
            }
            None => {
                let _ = writeln!(out, "G4   disabled");
            }
        }
        out
    }
}

/// The answers of `engine.kind = "scripted"` (`engine.script`, a JSON array of strings); `None`
/// for the other engines.
pub fn scripted_answers(cfg: &NodeConfig) -> anyhow::Result<Option<Vec<String>>> {
    if cfg.engine.kind != dynamo_config::EngineKind::Scripted {
        return Ok(None);
    }
    let path = cfg.engine.script.as_deref().context("engine.kind = \"scripted\" needs engine.script")?;
    let text = std::fs::read_to_string(path).with_context(|| format!("engine.script: reading {}", path.display()))?;
    let answers: Vec<String> = serde_json::from_str(&text)
        .with_context(|| format!("engine.script: {} is not a JSON array of strings", path.display()))?;
    anyhow::ensure!(!answers.is_empty(), "engine.script: {} holds no answer", path.display());
    Ok(Some(answers))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn h200(free: u64) -> DeviceInfo {
        DeviceInfo {
            ordinal: 0,
            name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            total_memory: (141 * GIB) as usize,
            free_memory: free as usize,
            device_count: 1,
        }
    }

    fn gpu_config(workers: usize, g1: u64) -> NodeConfig {
        let mut cfg = NodeConfig::default();
        cfg.model.name = "llama-8b".into();
        cfg.model.dtype = Dtype::Bf16;
        cfg.engine.device = DeviceKind::Cuda;
        cfg.engine.workers = workers;
        cfg.tiers.g1.capacity = ByteSize(g1);
        cfg
    }

    fn no_gpu() -> Result<DeviceInfo, KernelError> {
        Err(KernelError::CudaUnavailable("libcuda.so.1 not found".into()))
    }

    /// The engine endpoint's default 2 MiB slots for the tiny model's 16 KiB images: the start-up
    /// table says what that costs, loudly; slots sized to the engines' blocks say nothing.
    #[test]
    fn slots_sized_for_engines_are_announced_when_they_cost_the_node() {
        let mut cfg = NodeConfig::embedded_default();
        cfg.engine_endpoint.enabled = true;
        let tiers = ResolvedTiers::resolve_with(&cfg, &no_gpu).unwrap();
        let table = tiers.render();
        let warning = table.lines().find(|l| l.starts_with("WARNING: ")).unwrap_or_else(|| panic!("{table}"));
        assert!(warning.contains("fewer of the node's blocks") && warning.contains("max_block_bytes"), "{warning}");
        cfg.engine_endpoint.max_block_bytes = ByteSize(tiers.image_bytes as u64 - 128);
        let fitted = ResolvedTiers::resolve_with(&cfg, &no_gpu).unwrap();
        assert!(fitted.slot_warning().is_none(), "{}", fitted.render());
        cfg.engine_endpoint.enabled = false;
        assert!(ResolvedTiers::resolve_with(&cfg, &no_gpu).unwrap().slot_warning().is_none());
    }

    /// With the endpoint on, G2 is two pools: `engine_endpoint.g2_share` of it shared with the
    /// engines, the rest the node's own and private; off, all of it is the node's.
    #[test]
    fn the_engines_get_their_share_of_g2_as_a_pool_of_their_own() {
        let mut cfg = NodeConfig::embedded_default();
        cfg.tiers.g2.capacity = ByteSize::mib(64);
        let whole = ResolvedTiers::resolve_with(&cfg, &no_gpu).unwrap();
        assert!(whole.engines_g2.is_none());
        let store = whole.store_plan(&cfg.tiers).unwrap();
        assert!(store.engines_g2.is_none() && !store.g2.as_ref().unwrap().shared);
        cfg.engine_endpoint.enabled = true;
        cfg.engine_endpoint.g2_share = 0.25;
        let split = ResolvedTiers::resolve_with(&cfg, &no_gpu).unwrap();
        let (own, engines) = (&split.g2.as_ref().unwrap().0, split.engines_g2.as_ref().unwrap());
        assert_eq!((own.capacity, engines.capacity), (48 << 20, 16 << 20));
        assert_eq!(engines.blocks, (16 << 20) / split.slot_bytes as u64);
        let store = split.store_plan(&cfg.tiers).unwrap();
        let (own, engines) = (store.g2.unwrap(), store.engines_g2.unwrap());
        assert!(!own.shared && engines.shared, "only the engines' pool is shared memory");
        assert_eq!(engines.pool.slots as u64, split.engines_g2.as_ref().unwrap().blocks);
        assert!(split.render().contains("shared with external engines"), "{}", split.render());
    }

    #[test]
    fn the_weights_of_llama_8b_are_its_published_parameter_count_in_bf16() {
        // Llama 3.1 8B: 8,030,261,248 parameters (untied output head).
        assert_eq!(dynamo_kernels::model::weight_bytes(&ModelShape::LLAMA_8B), 2 * 8_030_261_248);
    }

    #[test]
    fn g1_on_a_gpu_is_what_the_memory_fraction_leaves_after_weights_and_activations() {
        let cfg = gpu_config(2, 0);
        let info = h200(140 * GIB);
        let tiers = ResolvedTiers::resolve_with(&cfg, &|| Ok(info.clone())).unwrap();
        assert_eq!(tiers.device, EngineDevice::Cuda(info.clone()));
        let share = (141.0 * GIB as f64 * cfg.tiers.g1.gpu_memory_fraction) as u64 / 2;
        let weights = dynamo_kernels::model::weight_bytes(&ModelShape::LLAMA_8B);
        let activations = dynamo_kernels::model::forward_bytes(&ModelShape::LLAMA_8B, cfg.engine.max_batch_tokens);
        assert_eq!(tiers.g1.capacity, share - weights - activations - CUDA_WORKER_OVERHEAD);
        // Two workers on an H200 each get room for well over a 32K-token prompt's KV (4 GiB).
        assert!(tiers.g1.blocks * tiers.block_tokens as u64 > 100_000, "{} blocks", tiers.g1.blocks);
        assert_eq!(tiers.g1.blocks, tiers.g1.capacity / tiers.layout.payload_bytes() as u64);
        assert!(tiers.render().contains("cuda (cuda:0 NVIDIA H200"), "{}", tiers.render());

        // Less free memory than the fraction allows: what is free counts.
        let busy = ResolvedTiers::resolve_with(&cfg, &|| Ok(h200(60 * GIB))).unwrap();
        assert_eq!(busy.g1.capacity, 30 * GIB - weights - activations - CUDA_WORKER_OVERHEAD);
    }

    #[test]
    fn a_gpu_too_small_for_the_workers_is_refused_with_the_numbers() {
        let err = format!("{:#}", ResolvedTiers::resolve_with(&gpu_config(8, 0), &|| Ok(h200(140 * GIB))).unwrap_err());
        assert!(err.contains("leaves no G1") && err.contains("8 worker(s)") && err.contains("weights"), "{err}");
        let err = format!(
            "{:#}",
            ResolvedTiers::resolve_with(&gpu_config(1, 200 * GIB), &|| Ok(h200(140 * GIB))).unwrap_err()
        );
        assert!(err.contains("does not fit"), "{err}");
        // An explicit size that fits is taken as it is.
        let tiers = ResolvedTiers::resolve_with(&gpu_config(1, 8 * GIB), &|| Ok(h200(140 * GIB))).unwrap();
        assert_eq!(tiers.g1.capacity, 8 * GIB);
    }

    #[test]
    fn a_g3_without_room_for_one_slot_after_its_header_is_refused_with_the_size_it_needs() {
        let mut cfg = NodeConfig::default();
        let slot = ResolvedTiers::resolve_with(&cfg, &no_gpu).unwrap().slot_bytes as u64;
        // One block and the 4 KiB superblock: what the first file format needed.
        cfg.tiers.g3.capacity_per_path = ByteSize(slot + 4096);
        let err = format!("{:#}", ResolvedTiers::resolve_with(&cfg, &no_gpu).unwrap_err());
        assert!(err.contains("holds no block") && err.contains(&ByteSize(2 * slot).to_string()), "{err}");
        cfg.tiers.g3.capacity_per_path = ByteSize(2 * slot);
        assert_eq!(ResolvedTiers::resolve_with(&cfg, &no_gpu).unwrap().g3.expect("g3").slots_per_path, 1);
    }

    #[test]
    fn auto_runs_on_the_cpu_without_a_gpu_or_without_bf16_and_cuda_says_why_it_cannot() {
        let mut cfg = NodeConfig::default();
        assert_eq!(cfg.engine.device, DeviceKind::Auto);
        assert_eq!(ResolvedTiers::resolve_with(&cfg, &no_gpu).unwrap().device, EngineDevice::Cpu);
        // A GPU, but f32 weights (the default): the CUDA engine keeps bf16, so the CPU it is.
        assert_eq!(ResolvedTiers::resolve_with(&cfg, &|| Ok(h200(140 * GIB))).unwrap().device, EngineDevice::Cpu);

        cfg.tiers.g1.capacity = ByteSize(0);
        let err = format!("{:#}", ResolvedTiers::resolve_with(&cfg, &no_gpu).unwrap_err());
        assert!(err.contains("engines run on the CPU"), "{err}");

        let cfg = gpu_config(1, 0);
        let err = format!("{:#}", ResolvedTiers::resolve_with(&cfg, &no_gpu).unwrap_err());
        assert!(err.contains("no CUDA device is usable") && err.contains("libcuda.so.1 not found"), "{err}");
        let mut f32_cfg = gpu_config(1, 0);
        f32_cfg.model.dtype = Dtype::F32;
        let err = format!("{:#}", ResolvedTiers::resolve_with(&f32_cfg, &|| Ok(h200(140 * GIB))).unwrap_err());
        assert!(err.contains("model.dtype = \"bf16\""), "{err}");
    }

    #[test]
    fn engine_device_cuda_on_this_machine_runs_on_its_gpu_or_says_why_not() {
        let cfg = gpu_config(1, 0);
        match dynamo_kernels::cuda::probe() {
            Ok(info) => {
                let tiers = ResolvedTiers::resolve(&cfg).unwrap();
                assert_eq!(tiers.device, EngineDevice::Cuda(info));
                assert!(tiers.g1.blocks > 0);
            }
            Err(reason) => {
                let err = format!("{:#}", ResolvedTiers::resolve(&cfg).unwrap_err());
                assert!(err.contains("no CUDA device is usable") && err.contains(&reason.to_string()), "{err}");
            }
        }
    }

    #[test]
    fn the_store_plan_is_what_the_tiers_resolved_to() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = NodeConfig::default();
        cfg.node.data_dir = dir.path().to_owned();
        let tiers = ResolvedTiers::resolve_with(&cfg, &no_gpu).unwrap();
        let plan = tiers.store_plan(&cfg.tiers).unwrap();
        let (g2, g3) = (plan.g2.expect("G2"), plan.g3.expect("G3"));
        let (g2_plan, _) = tiers.g2.as_ref().unwrap();
        assert_eq!((g2.pool.slots as u64, g2.pool.slot_bytes), (g2_plan.blocks, tiers.slot_bytes));
        assert_eq!(g2.resident, g2_plan.blocks as usize - builder::g2_reserve(g2_plan.blocks as usize));
        assert_eq!(g2.watermarks, Watermarks { high: cfg.tiers.g2.high_watermark, low: cfg.tiers.g2.low_watermark });
        assert_eq!(g3.options.paths, cfg.g3_paths());
        assert_eq!(g3.options.slot_bytes, tiers.slot_bytes);
        assert_eq!(g3.watermarks.high, cfg.tiers.g3.high_watermark);

        cfg.tiers.g3.enabled = false;
        cfg.tiers.g2.enabled = false;
        let none = ResolvedTiers::resolve_with(&cfg, &no_gpu).unwrap().store_plan(&cfg.tiers).unwrap();
        assert_eq!(none, StorePlan { lease_budget: cfg.tiers.lease_budget, ..StorePlan::default() });
        assert_eq!(plan.lease_budget, 0.5);
    }

    #[test]
    fn workers_spread_over_the_devices() {
        let info = DeviceInfo { device_count: 2, ..h200(140 * GIB) };
        let device = EngineDevice::Cuda(info);
        assert_eq!((0..4).map(|w| device.ordinal_of(w)).collect::<Vec<_>>(), [Some(0), Some(1), Some(0), Some(1)]);
        assert_eq!(EngineDevice::Cpu.ordinal_of(0), None);
    }

    #[test]
    fn a_checkpoint_shape_comes_from_its_config_json() {
        let dir = tempfile::tempdir().unwrap();
        let config = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
            "vocab_size": 128256, "rope_theta": 500000.0, "tie_word_embeddings": true}"#;
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        let mut cfg = NodeConfig::default();
        cfg.model.name = "my-llama".into();
        cfg.model.path = Some(dir.path().to_owned());
        let tiers = ResolvedTiers::resolve(&cfg).unwrap();
        assert_eq!(tiers.shape, ModelShape { name: tiers.shape.name, ..ModelShape::LLAMA_1B });
        assert_eq!(tiers.shape.name, dir.path().display().to_string());

        std::fs::remove_file(dir.path().join("config.json")).unwrap();
        let err = format!("{:#}", ResolvedTiers::resolve(&cfg).unwrap_err());
        assert!(err.contains("config.json"), "{err}");
    }
}
