//! The CUDA backend: [`CudaBackend`] implements [`Backend`] on one NVIDIA GPU through `cudarc` with
//! dynamic loading, so the crate builds without a CUDA toolkit and finds the driver, NVRTC and cuBLAS
//! at run time ([`loader`]). Nothing here panics when they are missing: [`probe`] and
//! [`CudaBackend::new`] answer [`KernelError::CudaUnavailable`] with the reason.
//!
//! - Activations ([`Backend::Buf`]) are `f32` device slices; weights are bf16 device matrices
//!   ([`CudaWeight`], converted on upload with round-to-nearest-even); the paged KV pool
//!   ([`CudaKv`]) keeps per layer one K and one V bf16 array `[num_blocks, B, kv_heads, head_dim]`.
//! - The kernels are the CUDA C files in `kernels/cuda/`, compiled with NVRTC for the device's own
//!   architecture (`sm_XY`) once per process ([`loader::compiled_sources`]).
//! - `matmul` is `cublasGemmEx` with bf16 inputs and f32 accumulation and output; the activation is
//!   converted to bf16 in a scratch buffer first.
//! - Attention runs on the tensor cores (`attention_mma.cu`: bf16 Q and softmax weights, f32
//!   accumulation, FlashAttention-2's tiling) for head dims 64 and 128 on sm_80 and later, once a
//!   start-up check has found it within bf16 rounding of the fp32 kernel (`attention.cu`) on this
//!   device; otherwise, and for other head dims, the fp32 kernel serves.
//!   [`CudaBackend::attention_kernel`] says which and why; `DYNAMO_CUDA_ATTENTION=fp32` keeps the
//!   tensor-core kernel off.
//! - Every call is queued on the backend's compute stream; `download` and the gather/scatter calls
//!   wait for it, so results are visible to the host when they return.
//! - Gathers and scatters started with `kv_gather_start` / `kv_scatter_start` run on streams of
//!   their own, behind an event recorded on the compute stream, and return at once:
//!   - a started scatter (a prefix loading into G1) is on the critical path of the pass that
//!     follows it, so its **load** stream has the compute stream's (highest) priority, and its
//!     copy kernels share the SMs with compute instead of waiting for compute's gaps. It launches
//!     layer by layer (a few layers per launch when the batch is small) and records an event per
//!     launch; the compute stream waits for a layer's event (on the device) before its first
//!     `kv_write` or `attention` on that layer, so a prefix's first layers are attended to while
//!     the later ones are still crossing the link;
//!   - a started gather (write-through to G2) is background work: its **store** stream has the
//!     lowest priority, and it also waits for the load stream, so it never reads a page still
//!     loading.
//!
//!   [`CudaCopies`] holds the start and end events, which time the copies on their stream (with
//!   whatever compute ran alongside).
//!
//! **Gather/scatter and host memory.** `kv_gather` / `kv_scatter` move many blocks per launch. When
//! every payload lies inside host memory registered with [`CudaBackend::register_host`] (the G2 pool
//! registers its whole mapping once, `cuMemHostRegister` with `DEVICEMAP`), one kernel reads the
//! pages and writes the payloads straight into host memory over PCIe (and the reverse): no staging,
//! no extra copy. Any other host buffer goes through a bounce path: the kernel packs the pages into
//! a device staging buffer, one DMA copies it into a pinned staging buffer (`cuMemHostAlloc`, not
//! write-combined, so the CPU reads it at full speed) and the CPU copies the payloads out.
//!
//! Determinism: the attention kernel and the element-wise kernels give each row a value independent
//! of the rows launched with it. cuBLAS may pick a different GEMM algorithm for a different number
//! of rows, so on CUDA the per-row contract of [`Backend`] holds to rounding, not bitwise.

pub mod check;
mod copies;
pub mod loader;

use copies::*;
pub use copies::{CudaCopies, HostRegistration};

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};

use crate::backend::{AttentionSpec, Backend, KernelError, SeqBatch};
use crate::kv_layout::{LayoutError, PagedLayout};

/// Every kernel entry point in `kernels/cuda/*.cu`.
pub const KERNEL_NAMES: &[&str] = &[
    "embed_bf16",
    "swiglu_f32",
    "add_assign_f32",
    "add_bias_f32",
    "f32_to_bf16_kernel",
    "rmsnorm_f32",
    "rope_f32",
    "attention_paged",
    "attention_mma_d64",
    "attention_mma_d128",
    "kv_write_bf16",
    "kv_gather_pages",
    "kv_scatter_pages",
    "argmax_rows",
];

/// What [`probe`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Marketing name, e.g. "NVIDIA H200".
    pub name: String,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_memory: usize,
    /// Device memory free when probed (other processes' and contexts' use excluded), in bytes.
    pub free_memory: usize,
    /// Devices visible to the driver.
    pub device_count: usize,
}

impl DeviceInfo {
    /// The NVRTC target, e.g. `sm_90`.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.compute_capability.0, self.compute_capability.1)
    }
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cuda:{} {} ({}, {:.1} GiB, {} device(s) visible)",
            self.ordinal,
            self.name,
            self.arch(),
            self.total_memory as f64 / (1u64 << 30) as f64,
            self.device_count
        )
    }
}

fn driver_err(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> KernelError {
    move |e| KernelError::Cuda { op, detail: format!("{e:?}") }
}

/// Detects the first CUDA device: driver library, a visible device, its name, architecture and
/// memory. Never panics; without a usable device the error says why.
pub fn probe() -> Result<DeviceInfo, KernelError> {
    probe_ordinal(0)
}

/// [`probe`] for device `ordinal`.
pub fn probe_ordinal(ordinal: usize) -> Result<DeviceInfo, KernelError> {
    loader::require_library(loader::DRIVER)?;
    loader::guarded("CUDA driver", || {
        let count = CudaContext::device_count()
            .map_err(|e| KernelError::CudaUnavailable(format!("the CUDA driver failed to initialise: {e:?}")))?;
        if count <= 0 {
            return Err(KernelError::CudaUnavailable("the CUDA driver is installed but sees no device".into()));
        }
        if ordinal >= count as usize {
            return Err(KernelError::CudaUnavailable(format!("no device cuda:{ordinal}; {count} visible")));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| KernelError::CudaUnavailable(format!("cannot create a context on cuda:{ordinal}: {e:?}")))?;
        let (free_memory, _) = ctx.mem_get_info().map_err(driver_err("cuMemGetInfo"))?;
        Ok(DeviceInfo {
            ordinal,
            name: ctx.name().map_err(driver_err("cuDeviceGetName"))?,
            compute_capability: ctx.compute_capability().map_err(driver_err("cuDeviceGetAttribute"))?,
            total_memory: ctx.total_mem().map_err(driver_err("cuDeviceTotalMem"))?,
            free_memory,
            device_count: count as usize,
        })
    })
}

/// The loaded kernels of one context.
#[derive(Debug)]
struct Kernels {
    embed: CudaFunction,
    swiglu: CudaFunction,
    add_assign: CudaFunction,
    add_bias: CudaFunction,
    to_bf16: CudaFunction,
    rmsnorm: CudaFunction,
    rope: CudaFunction,
    attention: CudaFunction,
    /// `attention_mma_d64`, `attention_mma_d128`.
    attention_mma: [CudaFunction; 2],
    kv_write: CudaFunction,
    gather: CudaFunction,
    scatter: CudaFunction,
    argmax: CudaFunction,
}

impl Kernels {
    fn load(ctx: &Arc<CudaContext>, arch: &str) -> Result<Self, KernelError> {
        let sources = loader::compiled_sources(arch)?;
        let mut modules = Vec::new();
        for (name, ptx) in sources {
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
                .map_err(|e| KernelError::Cuda { op: "cuModuleLoadData", detail: format!("{name}: {e:?}") })?;
            modules.push((name, module));
        }
        let get = |file: &str, func: &str| -> Result<CudaFunction, KernelError> {
            let (_, module) = modules.iter().find(|(n, _)| *n == file).expect("every source is compiled");
            module
                .load_function(func)
                .map_err(|e| KernelError::Cuda { op: "cuModuleGetFunction", detail: format!("{func}: {e:?}") })
        };
        Ok(Self {
            embed: get("elementwise.cu", "embed_bf16")?,
            swiglu: get("elementwise.cu", "swiglu_f32")?,
            add_assign: get("elementwise.cu", "add_assign_f32")?,
            add_bias: get("elementwise.cu", "add_bias_f32")?,
            to_bf16: get("elementwise.cu", "f32_to_bf16_kernel")?,
            rmsnorm: get("norm_rope.cu", "rmsnorm_f32")?,
            rope: get("norm_rope.cu", "rope_f32")?,
            attention: get("attention.cu", "attention_paged")?,
            attention_mma: [
                get("attention_mma.cu", "attention_mma_d64")?,
                get("attention_mma.cu", "attention_mma_d128")?,
            ],
            kv_write: get("kv_copy.cu", "kv_write_bf16")?,
            gather: get("kv_copy.cu", "kv_gather_pages")?,
            scatter: get("kv_copy.cu", "kv_scatter_pages")?,
            argmax: get("sampling.cu", "argmax_rows")?,
        })
    }
}

/// A bf16 weight matrix `[rows, cols]` (a vector has `rows = 1`) in device memory.
#[derive(Debug)]
pub struct CudaWeight {
    data: CudaSlice<u16>,
    rows: usize,
    cols: usize,
}

impl CudaWeight {
    /// Rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// The paged G1 pool on the device: per layer one K and one V bf16 array of `num_blocks` pages.
#[derive(Debug)]
pub struct CudaKv {
    layout: PagedLayout,
    num_blocks: usize,
    k: Vec<CudaSlice<u16>>,
    v: Vec<CudaSlice<u16>>,
    /// Device addresses of the arrays in payload order `[layer][k|v]`, for the gather/scatter kernels.
    pages: CudaSlice<u64>,
    /// Per layer, the end of the last started scatter's copies of that layer's pages (on the load
    /// stream), until compute has been made to wait for it.
    loading: Vec<Option<Arc<CudaEvent>>>,
}

impl CudaKv {
    /// The layout (`elem_bytes = 2`).
    pub fn layout(&self) -> PagedLayout {
        self.layout
    }

    /// Pages per layer.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
}

/// How far (scaled, as [`check::difference`]) the tensor-core attention may be from the fp32
/// kernel in its start-up check.
const MMA_CHECK_TOLERANCE: f64 = check::TOL_ATTENTION_BF16;

/// Dynamic shared memory of the tensor-core attention at `head_dim`: two buffers of one K and one V
/// tile of 64 keys, rows padded by 8 bf16.
fn mma_smem_bytes(head_dim: usize) -> usize {
    2 * 2 * 64 * (head_dim + 8) * 2
}

/// The environment variable that, set to `fp32`, keeps the tensor-core attention off.
pub const MMA_ATTENTION_ENV: &str = "DYNAMO_CUDA_ATTENTION";

/// The CUDA backend on one device. See the module documentation.
pub struct CudaBackend {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    /// The compute stream (the highest priority of the context).
    stream: Arc<CudaStream>,
    /// The stream of started scatters (the compute stream's priority).
    load: Arc<CudaStream>,
    /// The stream of started gathers (the lowest priority).
    store: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: Kernels,
    max_smem_optin: usize,
    /// Whether `attention` runs on the tensor cores (see [`CudaBackend::attention_kernel`]).
    mma_attention: std::sync::atomic::AtomicBool,
    /// Why the tensor-core attention is off, when it is.
    mma_off: Option<String>,
    /// bf16 copy of the GEMM's activation.
    x_bf16: Mutex<Option<CudaSlice<u16>>>,
    staging: Mutex<Staging>,
    regions: Arc<Mutex<Vec<Region>>>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend").field("device", &self.info).finish()
    }
}

fn grid_1d(n: usize, threads: u32) -> LaunchConfig {
    let blocks = n.div_ceil(threads as usize).clamp(1, 65_535 * 16) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

fn check_len(op: &'static str, what: &str, have: usize, need: usize) -> Result<(), KernelError> {
    if have < need {
        return Err(KernelError::shape(op, format!("{what} has {have} elements, needs {need}")));
    }
    Ok(())
}

impl CudaBackend {
    /// Opens device `ordinal`: context, stream, cuBLAS, and the kernels compiled for its architecture.
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        let info = probe_ordinal(ordinal)?;
        loader::require_library(loader::NVRTC)?;
        loader::require_library(loader::CUBLAS)?;
        loader::guarded("CUDA backend", || {
            let ctx = CudaContext::new(ordinal).map_err(driver_err("cuDevicePrimaryCtxRetain"))?;
            // The compute, load and store streams are ordered by explicit events (see the module
            // documentation), so cudarc's per-allocation events would only cost time.
            // SAFETY: no allocation of this context exists yet, so none is tracked half-way.
            unsafe { ctx.disable_event_tracking() };
            ctx.bind_to_thread().map_err(driver_err("cuCtxSetCurrent"))?;
            let (least, greatest) = cudarc::driver::result::stream::get_priority_range()
                .map_err(driver_err("cuCtxGetStreamPriorityRange"))?;
            let stream = ctx.new_stream_with_priority(greatest).map_err(driver_err("cuStreamCreateWithPriority"))?;
            let load = ctx.new_stream_with_priority(greatest).map_err(driver_err("cuStreamCreateWithPriority"))?;
            let store = ctx.new_stream_with_priority(least).map_err(driver_err("cuStreamCreateWithPriority"))?;
            let blas = CudaBlas::new(stream.clone())
                .map_err(|e| KernelError::CudaUnavailable(format!("cuBLAS failed to initialise: {e:?}")))?;
            let kernels = Kernels::load(&ctx, &info.arch())?;
            let max_smem_optin = ctx
                .attribute(
                    cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                )
                .map_err(driver_err("cuDeviceGetAttribute"))? as usize;
            let mut backend = Self {
                info,
                ctx,
                stream,
                load,
                store,
                blas,
                kernels,
                max_smem_optin,
                mma_attention: std::sync::atomic::AtomicBool::new(false),
                mma_off: None,
                x_bf16: Mutex::new(None),
                staging: Mutex::new(Staging::default()),
                regions: Arc::new(Mutex::new(Vec::new())),
            };
            backend.mma_off = backend.enable_mma_attention().map_err(|e| KernelError::Cuda {
                op: "attention self-check",
                detail: format!("{e} ({MMA_ATTENTION_ENV}=fp32 skips the tensor-core attention and its check)"),
            })?;
            Ok(backend)
        })
    }

    /// Which attention kernel runs, and why the tensor-core one does not when it does not.
    pub fn attention_kernel(&self) -> String {
        match &self.mma_off {
            None if self.mma_attention.load(Ordering::Relaxed) => {
                "tensor cores (mma.sync bf16) for head_dim 64 and 128, fp32 otherwise".into()
            }
            None => "fp32 (the tensor-core kernel is switched off)".into(),
            Some(why) => format!("fp32 (the tensor-core kernel is off: {why})"),
        }
    }

    /// Whether the tensor-core attention serves (for head dims 64 and 128).
    pub fn mma_attention_on(&self) -> bool {
        self.mma_off.is_none() && self.mma_attention.load(Ordering::Relaxed)
    }

    /// Switches the tensor-core attention on or off (gpu-check compares both kernels); it cannot be
    /// switched on where its start-up check kept it off.
    pub fn set_mma_attention(&self, on: bool) -> Result<(), String> {
        if let (true, Some(why)) = (on, &self.mma_off) {
            return Err(why.clone());
        }
        self.mma_attention.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// Turns the tensor-core attention on once it has matched the fp32 kernel on this device for
    /// both head dims it serves: nothing serves from it before. `Ok(Some(why))` when it stays off;
    /// an error when the device failed the check itself.
    fn enable_mma_attention(&self) -> Result<Option<String>, KernelError> {
        if std::env::var(MMA_ATTENTION_ENV).is_ok_and(|v| v == "fp32") {
            return Ok(Some(format!("{MMA_ATTENTION_ENV}=fp32")));
        }
        if self.info.compute_capability.0 < 8 {
            return Ok(Some(format!("{} has no bf16 mma.sync (sm_80 and later)", self.info.arch())));
        }
        for (func, head_dim) in self.kernels.attention_mma.iter().zip([64, 128]) {
            let bytes = mma_smem_bytes(head_dim);
            if bytes > self.max_smem_optin {
                return Ok(Some(format!(
                    "it needs {bytes} B of shared memory, the device allows {}",
                    self.max_smem_optin
                )));
            }
            if bytes > 48 * 1024 {
                func.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
                .map_err(driver_err("cuFuncSetAttribute"))?;
            }
        }
        for head_dim in [64, 128] {
            let rel = self.attention_agreement(head_dim)?;
            // A layout or masking error is off by O(1); bf16 Q and P by about 1e-3.
            if rel.is_nan() || rel > MMA_CHECK_TOLERANCE {
                return Ok(Some(format!(
                    "head_dim {head_dim}: it differs from the fp32 kernel by {rel:.2e} (scaled), over {MMA_CHECK_TOLERANCE}"
                )));
            }
        }
        self.mma_attention.store(true, Ordering::Relaxed);
        Ok(None)
    }

    /// The largest scaled difference between the tensor-core and the fp32 attention kernels on a
    /// seeded case of `head_dim`: 37 query rows after a 113-token prefix, 8 heads over 2 KV heads,
    /// pages in reverse order, three key tiles of which the last is partial.
    fn attention_agreement(&self, head_dim: usize) -> Result<f64, KernelError> {
        let (ctx, rows, b) = (150usize, 37usize, 16usize);
        let spec = AttentionSpec { heads: 8, kv_heads: 2, head_dim, block_tokens: b };
        let layout = PagedLayout { layers: 1, block_tokens: b, kv_heads: 2, head_dim, elem_bytes: 2 };
        let blocks = ctx.div_ceil(b) + 3;
        let table: Vec<u32> = (0..blocks as u32).rev().collect();
        let slots: Vec<u32> = (0..ctx).map(|p| table[p / b] * b as u32 + (p % b) as u32).collect();
        let mut rng = crate::sampling::SeededRng::new(0x5e1f ^ head_dim as u64);
        let mut random = |n: usize, scale: f32| -> Vec<f32> {
            (0..n).map(|_| (rng.next_f64() * 2.0 - 1.0) as f32 * scale).collect()
        };
        let mut kv = self.kv_pool(layout, blocks)?;
        let (k, v) = (self.upload(&random(ctx * 2 * head_dim, 2.0))?, self.upload(&random(ctx * 2 * head_dim, 2.0))?);
        self.kv_write(&mut kv, 0, &k, &v, &slots)?;
        let q = self.upload(&random(rows * spec.heads * head_dim, 2.0))?;
        let positions: Vec<u32> = ((ctx - rows) as u32..ctx as u32).collect();
        let mut outs = Vec::new();
        for mma in [false, true] {
            self.mma_attention.store(mma, Ordering::Relaxed);
            let mut out = self.upload(&vec![f32::NAN; rows * spec.heads * head_dim])?;
            let ran = self.attention(&q, &kv, 0, spec, &table, &positions, &mut out);
            self.mma_attention.store(false, Ordering::Relaxed);
            ran?;
            let mut host = vec![0.0; rows * spec.heads * head_dim];
            self.download(&out, &mut host)?;
            outs.push(host);
        }
        Ok(check::difference(&outs[1], &outs[0]).1)
    }

    /// The device.
    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }

    /// The stream every call is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Waits until every call queued on the compute stream has finished.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        self.stream.synchronize().map_err(driver_err("cuStreamSynchronize"))
    }

    /// Makes the compute stream wait (on the device) for the started scatter of `layer`, if any.
    fn wait_loaded(&self, kv: &CudaKv, layer: usize) -> Result<(), KernelError> {
        match &kv.loading[layer] {
            Some(event) => self.stream.wait(event).map_err(driver_err("cuStreamWaitEvent")),
            None => Ok(()),
        }
    }

    /// [`Self::wait_loaded`] for every layer, forgetting the events (`kv` is exclusively ours).
    fn wait_all_loaded(&self, kv: &mut CudaKv) -> Result<(), KernelError> {
        for event in kv.loading.iter_mut().filter_map(Option::take) {
            self.stream.wait(&event).map_err(driver_err("cuStreamWaitEvent"))?;
        }
        Ok(())
    }

    fn upload_u32(&self, op: &'static str, data: &[u32]) -> Result<CudaSlice<u32>, KernelError> {
        self.stream.clone_htod(data).map_err(|e| KernelError::Cuda { op, detail: format!("upload: {e:?}") })
    }

    /// The launch of `attention_paged` over `n_qv` query vectors: 16 per block of 4 warps, keys in
    /// tiles of 32, the shared memory opted into where it exceeds 48 KiB.
    fn fp32_attention_config(&self, n_qv: usize, spec: AttentionSpec) -> Result<LaunchConfig, KernelError> {
        const QV_PER_CTA: usize = 16;
        const KT: usize = 32;
        let smem = ((2 * KT * (spec.head_dim + 1) + QV_PER_CTA * spec.head_dim) * 4) as u32;
        if smem as usize > 48 * 1024 {
            if smem as usize > self.max_smem_optin {
                return Err(KernelError::shape(
                    "attention",
                    format!("head_dim {} needs {smem} B of shared memory", spec.head_dim),
                ));
            }
            self.kernels
                .attention
                .set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .map_err(driver_err("cuFuncSetAttribute"))?;
        }
        Ok(LaunchConfig {
            grid_dim: (n_qv.div_ceil(QV_PER_CTA) as u32, spec.kv_heads as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem,
        })
    }

    /// Greedy sampling: the index of the largest logit of each of `rows` rows of `vocab` logits.
    pub fn argmax(&self, logits: &CudaSlice<f32>, rows: usize, vocab: usize) -> Result<Vec<u32>, KernelError> {
        check_len("argmax", "logits", logits.len(), rows * vocab)?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let mut out = self.stream.alloc_zeros::<u32>(rows).map_err(driver_err("alloc"))?;
        let (r, v) = (rows as i32, vocab as i32);
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream.launch_builder(&self.kernels.argmax);
        b.arg(logits).arg(&mut out).arg(&r).arg(&v);
        // SAFETY: argmax_rows(const float*, unsigned*, int, int): logits holds rows × vocab (checked),
        // out holds rows.
        unsafe { b.launch(cfg) }.map_err(driver_err("argmax_rows"))?;
        self.stream.clone_dtoh(&out).map_err(driver_err("download"))
    }

    /// `bf16(x)` for the first `len` elements of `x`, into `out`.
    pub fn to_bf16(&self, x: &CudaSlice<f32>, len: usize, out: &mut CudaSlice<u16>) -> Result<(), KernelError> {
        check_len("to_bf16", "x", x.len(), len)?;
        check_len("to_bf16", "out", out.len(), len)?;
        let n = len as i64;
        let mut b = self.stream.launch_builder(&self.kernels.to_bf16);
        b.arg(x).arg(out).arg(&n);
        // SAFETY: f32_to_bf16_kernel(const float*, bf16*, long long): both hold `len` (checked).
        unsafe { b.launch(grid_1d(len, 256)) }.map_err(driver_err("f32_to_bf16"))?;
        Ok(())
    }

    /// Downloads `layer`'s K (`v = false`) or V page of `block` as f32 (for comparisons with the CPU).
    pub fn kv_page_f32(&self, kv: &CudaKv, layer: usize, v: bool, block: u32) -> Result<Vec<f32>, KernelError> {
        if layer >= kv.layout.layers || block as usize >= kv.num_blocks {
            return Err(KernelError::index("kv_page_f32", format!("layer {layer} block {block}")));
        }
        self.wait_loaded(kv, layer)?;
        let elems = kv.layout.page_bytes() / 2;
        let array = if v { &kv.v[layer] } else { &kv.k[layer] };
        let page = array.slice(block as usize * elems..(block as usize + 1) * elems);
        let raw = self.stream.clone_dtoh(&page).map_err(driver_err("download"))?;
        Ok(raw.into_iter().map(|b| half::bf16::from_bits(b).to_f32()).collect())
    }
}

impl Backend for CudaBackend {
    type Buf = CudaSlice<f32>;
    type Weight = CudaWeight;
    type Kv = CudaKv;
    type Copies = CudaCopies;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn kv_elem_bytes(&self) -> usize {
        2
    }

    fn weight(&self, data: &[f32], rows: usize, cols: usize) -> Result<CudaWeight, KernelError> {
        if data.len() != rows * cols {
            return Err(KernelError::shape("weight", format!("{} values for {rows} × {cols}", data.len())));
        }
        let bits: Vec<u16> = data.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
        let data = self.stream.clone_htod(&bits).map_err(|_| KernelError::OutOfMemory { bytes: bits.len() * 2 })?;
        Ok(CudaWeight { data, rows, cols })
    }

    fn zeros(&self, len: usize) -> Result<CudaSlice<f32>, KernelError> {
        self.stream.alloc_zeros::<f32>(len).map_err(|_| KernelError::OutOfMemory { bytes: len * 4 })
    }

    fn upload(&self, data: &[f32]) -> Result<CudaSlice<f32>, KernelError> {
        self.stream.clone_htod(data).map_err(|_| KernelError::OutOfMemory { bytes: data.len() * 4 })
    }

    fn download(&self, buf: &CudaSlice<f32>, out: &mut [f32]) -> Result<(), KernelError> {
        check_len("download", "buffer", buf.len(), out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        self.stream.memcpy_dtoh(&buf.slice(..out.len()), out).map_err(driver_err("cuMemcpyDtoH"))?;
        self.synchronize()
    }

    fn embed(&self, table: &CudaWeight, tokens: &[u32], out: &mut CudaSlice<f32>) -> Result<(), KernelError> {
        let dim = table.cols;
        check_len("embed", "out", out.len(), tokens.len() * dim)?;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= table.rows) {
            return Err(KernelError::index("embed", format!("token {t} outside a vocabulary of {}", table.rows)));
        }
        if tokens.is_empty() {
            return Ok(());
        }
        let d_tokens = self.upload_u32("embed", tokens)?;
        let (n, d) = (tokens.len() as i32, dim as i32);
        let cfg = LaunchConfig { grid_dim: (tokens.len() as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream.launch_builder(&self.kernels.embed);
        b.arg(&table.data).arg(&d_tokens).arg(out).arg(&n).arg(&d);
        // SAFETY: embed_bf16(const bf16*, const unsigned*, float*, int, int): every token < rows
        // (checked), out holds tokens × dim (checked).
        unsafe { b.launch(cfg) }.map_err(driver_err("embed_bf16"))?;
        Ok(())
    }

    fn rmsnorm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaWeight,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        if w.rows * w.cols != dim {
            return Err(KernelError::shape("rmsnorm", format!("weight {}×{} for dim {dim}", w.rows, w.cols)));
        }
        check_len("rmsnorm", "x", x.len(), rows * dim)?;
        check_len("rmsnorm", "out", out.len(), rows * dim)?;
        if rows == 0 {
            return Ok(());
        }
        let (r, d) = (rows as i32, dim as i32);
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream.launch_builder(&self.kernels.rmsnorm);
        b.arg(x).arg(&w.data).arg(out).arg(&r).arg(&d).arg(&eps);
        // SAFETY: rmsnorm_f32(const float*, const bf16*, float*, int, int, float): x and out hold
        // rows × dim, w holds dim (checked).
        unsafe { b.launch(cfg) }.map_err(driver_err("rmsnorm_f32"))?;
        Ok(())
    }

    fn matmul(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        w: &CudaWeight,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
        let (n, k) = (w.rows, w.cols);
        check_len("matmul", "x", x.len(), rows * k)?;
        check_len("matmul", "out", out.len(), rows * n)?;
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let mut scratch = self.x_bf16.lock().unwrap_or_else(|e| e.into_inner());
        if scratch.as_ref().is_none_or(|s| s.len() < rows * k) {
            *scratch = None;
            // SAFETY: the scratch is fully written by the conversion below before cuBLAS reads it.
            let s = unsafe { self.stream.alloc::<u16>(rows * k) }
                .map_err(|_| KernelError::OutOfMemory { bytes: rows * k * 2 })?;
            *scratch = Some(s);
        }
        let xb = scratch.as_mut().expect("allocated above");
        self.to_bf16(x, rows * k, xb)?;
        // Row-major y[rows, n] = x[rows, k] · W[n, k]ᵀ is column-major C[n, rows] = Wᵀ · X with W seen
        // as a column-major k × n matrix (lda = k) and X as k × rows (ldb = k).
        let alpha = 1.0f32;
        let beta = 0.0f32;
        let (a_ptr, _ra) = w.data.device_ptr(&self.stream);
        let (b_ptr, _rb) = xb.device_ptr(&self.stream);
        let (c_ptr, _rc) = out.device_ptr_mut(&self.stream);
        // SAFETY: A holds n × k bf16, B holds at least rows × k bf16, C holds at least rows × n f32
        // (checked above); the handle is bound to this backend's stream; alpha/beta are host f32 as
        // the default pointer mode and CUBLAS_COMPUTE_32F expect.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                rows as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                a_ptr as *const _,
                cudaDataType::CUDA_R_16BF,
                k as i32,
                b_ptr as *const _,
                cudaDataType::CUDA_R_16BF,
                k as i32,
                (&beta as *const f32).cast(),
                c_ptr as *mut _,
                cudaDataType::CUDA_R_32F,
                n as i32,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| KernelError::Cuda { op: "cublasGemmEx", detail: format!("{e:?}") })
    }

    fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        rows: usize,
        heads: usize,
        head_dim: usize,
        positions: &[u32],
        inv_freq: &[f32],
    ) -> Result<(), KernelError> {
        if !head_dim.is_multiple_of(2) || positions.len() != rows || inv_freq.len() != head_dim / 2 {
            return Err(KernelError::shape(
                "rope",
                format!(
                    "head_dim {head_dim}, {} positions for {rows} rows, {} frequencies",
                    positions.len(),
                    inv_freq.len()
                ),
            ));
        }
        check_len("rope", "x", x.len(), rows * heads * head_dim)?;
        if rows * heads * head_dim == 0 {
            return Ok(());
        }
        let d_pos = self.upload_u32("rope", positions)?;
        let d_freq = self
            .stream
            .clone_htod(inv_freq)
            .map_err(|e| KernelError::Cuda { op: "rope", detail: format!("upload: {e:?}") })?;
        let (r, h, d) = (rows as i32, heads as i32, head_dim as i32);
        let mut b = self.stream.launch_builder(&self.kernels.rope);
        b.arg(x).arg(&d_pos).arg(&d_freq).arg(&r).arg(&h).arg(&d);
        // SAFETY: rope_f32(float*, const unsigned*, const float*, int, int, int): x holds rows ×
        // heads × head_dim, positions holds rows, inv_freq head_dim / 2 (checked).
        unsafe { b.launch(grid_1d(rows * heads * head_dim / 2, 256)) }.map_err(driver_err("rope_f32"))?;
        Ok(())
    }

    fn swiglu(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        len: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        check_len("swiglu", "gate", gate.len(), len)?;
        check_len("swiglu", "up", up.len(), len)?;
        check_len("swiglu", "out", out.len(), len)?;
        if len == 0 {
            return Ok(());
        }
        let n = len as i64;
        let mut b = self.stream.launch_builder(&self.kernels.swiglu);
        b.arg(gate).arg(up).arg(out).arg(&n);
        // SAFETY: swiglu_f32(const float*, const float*, float*, long long): all hold `len` (checked).
        unsafe { b.launch(grid_1d(len, 256)) }.map_err(driver_err("swiglu_f32"))?;
        Ok(())
    }

    fn gather_rows(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        width: usize,
        picks: &[usize],
    ) -> Result<CudaSlice<f32>, KernelError> {
        if let Some(&row) = picks.iter().find(|&&r| r >= rows) {
            return Err(KernelError::index("gather_rows", format!("row {row} of {rows}")));
        }
        check_len("gather_rows", "x", x.len(), rows * width)?;
        let mut out = self.zeros(picks.len() * width)?;
        for (i, &row) in picks.iter().enumerate() {
            self.stream
                .memcpy_dtod(&x.slice(row * width..(row + 1) * width), &mut out.slice_mut(i * width..(i + 1) * width))
                .map_err(driver_err("cuMemcpyDtoD"))?;
        }
        Ok(out)
    }

    fn add_bias(&self, x: &mut CudaSlice<f32>, bias: &CudaWeight, rows: usize, cols: usize) -> Result<(), KernelError> {
        check_len("add_bias", "x", x.len(), rows * cols)?;
        if bias.rows * bias.cols != cols {
            return Err(KernelError::shape("add_bias", format!("bias {}×{} for {cols} columns", bias.rows, bias.cols)));
        }
        if rows * cols == 0 {
            return Ok(());
        }
        let (n, c) = ((rows * cols) as i64, i32::try_from(cols).map_err(|_| KernelError::shape("add_bias", "cols"))?);
        let mut b = self.stream.launch_builder(&self.kernels.add_bias);
        b.arg(x).arg(&bias.data).arg(&n).arg(&c);
        // SAFETY: add_bias_f32(float*, const bf16*, long long, int): x holds rows × cols and the
        // bias cols elements (checked); cols > 0.
        unsafe { b.launch(grid_1d(rows * cols, 256)) }.map_err(driver_err("add_bias_f32"))?;
        Ok(())
    }

    fn add_assign(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, len: usize) -> Result<(), KernelError> {
        check_len("add_assign", "x", x.len(), len)?;
        check_len("add_assign", "y", y.len(), len)?;
        if len == 0 {
            return Ok(());
        }
        let n = len as i64;
        let mut b = self.stream.launch_builder(&self.kernels.add_assign);
        b.arg(x).arg(y).arg(&n);
        // SAFETY: add_assign_f32(float*, const float*, long long): both hold `len` (checked).
        unsafe { b.launch(grid_1d(len, 256)) }.map_err(driver_err("add_assign_f32"))?;
        Ok(())
    }

    fn kv_pool(&self, layout: PagedLayout, num_blocks: usize) -> Result<CudaKv, KernelError> {
        let layout = PagedLayout { elem_bytes: 2, ..layout };
        let elems = layout.page_bytes() / 2 * num_blocks;
        let alloc = || self.stream.alloc_zeros::<u16>(elems).map_err(|_| KernelError::OutOfMemory { bytes: elems * 2 });
        let mut k = Vec::with_capacity(layout.layers);
        let mut v = Vec::with_capacity(layout.layers);
        for _ in 0..layout.layers {
            k.push(alloc()?);
            v.push(alloc()?);
        }
        let mut addrs = Vec::with_capacity(layout.layers * 2);
        for layer in 0..layout.layers {
            for array in [&k[layer], &v[layer]] {
                let (ptr, _sync) = array.device_ptr(&self.stream);
                addrs.push(ptr);
            }
        }
        let pages = self.stream.clone_htod(&addrs).map_err(driver_err("upload"))?;
        Ok(CudaKv { layout, num_blocks, k, v, pages, loading: (0..layout.layers).map(|_| None).collect() })
    }

    fn kv_write(
        &self,
        kv: &mut CudaKv,
        layer: usize,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slots: &[u32],
    ) -> Result<(), KernelError> {
        if layer >= kv.layout.layers {
            return Err(KernelError::index("kv_write", format!("layer {layer} of {}", kv.layout.layers)));
        }
        let row_elems = kv.layout.kv_heads * kv.layout.head_dim;
        check_len("kv_write", "k", k.len(), slots.len() * row_elems)?;
        check_len("kv_write", "v", v.len(), slots.len() * row_elems)?;
        let capacity = kv.num_blocks * kv.layout.block_tokens;
        if let Some(&s) = slots.iter().find(|&&s| s as usize >= capacity) {
            return Err(KernelError::index("kv_write", format!("slot {s} outside a pool of {capacity} token slots")));
        }
        if slots.is_empty() {
            return Ok(());
        }
        if let Some(event) = kv.loading[layer].take() {
            self.stream.wait(&event).map_err(driver_err("cuStreamWaitEvent"))?;
        }
        let d_slots = self.upload_u32("kv_write", slots)?;
        let (rows, re) = (slots.len() as i32, row_elems as i32);
        let (k_pages, v_pages) = (&mut kv.k[layer], &mut kv.v[layer]);
        let mut b = self.stream.launch_builder(&self.kernels.kv_write);
        b.arg(k).arg(v).arg(k_pages).arg(v_pages).arg(&d_slots).arg(&rows).arg(&re);
        // SAFETY: kv_write_bf16(const float*, const float*, bf16*, bf16*, const unsigned*, int, int):
        // k and v hold rows × row_elems, every slot < num_blocks × B (checked) and each page array
        // holds num_blocks × B × row_elems.
        unsafe { b.launch(grid_1d(slots.len() * row_elems, 256)) }.map_err(driver_err("kv_write_bf16"))?;
        Ok(())
    }

    fn attention_batch(
        &self,
        q: &CudaSlice<f32>,
        kv: &CudaKv,
        layer: usize,
        spec: AttentionSpec,
        seqs: SeqBatch<'_>,
        positions: &[u32],
        out: &mut CudaSlice<f32>,
    ) -> Result<(), KernelError> {
        let l = kv.layout;
        if layer >= l.layers {
            return Err(KernelError::index("attention", format!("layer {layer} of {}", l.layers)));
        }
        if spec.kv_heads != l.kv_heads || spec.head_dim != l.head_dim || spec.block_tokens != l.block_tokens {
            return Err(KernelError::shape("attention", format!("{spec:?} against pool layout {l:?}")));
        }
        if spec.kv_heads == 0 || !spec.heads.is_multiple_of(spec.kv_heads) || spec.head_dim == 0 || spec.head_dim > 256
        {
            return Err(KernelError::shape(
                "attention",
                format!("heads {} / kv_heads {} / head_dim {} (at most 256)", spec.heads, spec.kv_heads, spec.head_dim),
            ));
        }
        let rows = positions.len();
        let width = spec.heads * spec.head_dim;
        check_len("attention", "q", q.len(), rows * width)?;
        check_len("attention", "out", out.len(), rows * width)?;
        seqs.check("attention", positions, spec.block_tokens, kv.num_blocks)?;
        if rows == 0 {
            return Ok(());
        }
        // The grid covers the longest sequence's rows; each sequence is one z slice.
        let longest = (0..seqs.len()).map(|s| seqs.rows(s).len()).max().unwrap_or(0);
        let n_seqs = seqs.len() as u32;
        let group = spec.heads / spec.kv_heads;
        let mma = match spec.head_dim {
            64 if self.mma_attention.load(Ordering::Relaxed) => Some(&self.kernels.attention_mma[0]),
            128 if self.mma_attention.load(Ordering::Relaxed) => Some(&self.kernels.attention_mma[1]),
            _ => None,
        };
        let (func, cfg, name) = match mma {
            // 64 query vectors (4 warps of 16) per block.
            Some(func) => {
                let ctas_x = (longest * group).div_ceil(64) as u32;
                let cfg = LaunchConfig {
                    grid_dim: (ctas_x, spec.kv_heads as u32, n_seqs),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: mma_smem_bytes(spec.head_dim) as u32,
                };
                (func, cfg, "attention_mma")
            }
            None => {
                let mut cfg = self.fp32_attention_config(longest * group, spec)?;
                cfg.grid_dim.2 = n_seqs;
                (&self.kernels.attention, cfg, "attention_paged")
            }
        };
        self.wait_loaded(kv, layer)?;
        let tables_len = *seqs.table_starts.last().unwrap_or(&0) as usize;
        let d_table = self.upload_u32("attention", &seqs.tables[..tables_len])?;
        let d_pos = self.upload_u32("attention", positions)?;
        let d_rows = self.upload_u32("attention", seqs.row_starts)?;
        let d_tables = self.upload_u32("attention", seqs.table_starts)?;
        let scale = 1.0 / (spec.head_dim as f32).sqrt();
        let (r, h, kvh, hd, bt) =
            (longest as i32, spec.heads as i32, spec.kv_heads as i32, spec.head_dim as i32, spec.block_tokens as i32);
        let mut b = self.stream.launch_builder(func);
        b.arg(q)
            .arg(&kv.k[layer])
            .arg(&kv.v[layer])
            .arg(&d_table)
            .arg(&d_pos)
            .arg(&d_rows)
            .arg(&d_tables)
            .arg(out)
            .arg(&r)
            .arg(&h)
            .arg(&kvh)
            .arg(&hd)
            .arg(&bt)
            .arg(&scale);
        // SAFETY: attention_paged and attention_mma_d{64,128} take (const float*, const bf16*,
        // const bf16*, const unsigned* × 4, float*, int × 5, float): q and out hold rows × heads ×
        // head_dim; the row and table offsets have one entry per z slice plus one and index inside
        // positions and the tables, each sequence's table covers its largest position with in-range
        // block ids (checked by `SeqBatch::check`); head_dim ≤ 256 (and is the mma entry point's
        // own), and the dynamic shared memory matches the kernel's layout (opted into at start for
        // the mma kernels).
        unsafe { b.launch(cfg) }.map_err(driver_err(name))?;
        Ok(())
    }

    fn kv_gather(&self, kv: &CudaKv, blocks: &[u32], out: &mut [&mut [u8]]) -> Result<(), KernelError> {
        Self::check_batch(kv, blocks, out.iter().map(|p| p.len()), out.len())?;
        let payload = kv.layout.payload_bytes();
        for layer in 0..kv.layout.layers {
            self.wait_loaded(kv, layer)?;
        }
        if let Some(addrs) = self.mapped_addresses(out.iter().map(|p| p.as_ptr() as usize), payload) {
            self.copy_pages(true, kv, blocks, &addrs)?;
            return self.synchronize();
        }
        let per_round = (STAGING_BYTES / payload).max(1);
        for (chunk, outs) in blocks.chunks(per_round).zip(out.chunks_mut(per_round)) {
            let bytes = chunk.len() * payload;
            self.with_staging(bytes, |dev, host| {
                let (base, _s) = dev.device_ptr(&self.stream);
                let addrs: Vec<u64> = (0..chunk.len()).map(|i| base + (i * payload) as u64).collect();
                self.copy_pages(true, kv, chunk, &addrs)?;
                // SAFETY: `host` is pinned memory of at least `bytes` that no copy is using (the
                // previous round was synchronised).
                let staged = unsafe { std::slice::from_raw_parts_mut(host.ptr, bytes) };
                // SAFETY: the device staging holds `bytes` written by the kernel queued before on the
                // same stream; `staged` is pinned, so the copy may run asynchronously until the sync.
                unsafe { cudarc::driver::result::memcpy_dtoh_async(staged, base, self.stream.cu_stream()) }
                    .map_err(driver_err("cuMemcpyDtoHAsync"))?;
                self.synchronize()?;
                // SAFETY: the copy above has completed (synchronised) and wrote `bytes` bytes.
                let staged = unsafe { std::slice::from_raw_parts(host.ptr, bytes) };
                for (o, src) in outs.iter_mut().zip(staged.chunks_exact(payload)) {
                    o.copy_from_slice(src);
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    fn kv_scatter(&self, kv: &mut CudaKv, blocks: &[u32], payloads: &[&[u8]]) -> Result<(), KernelError> {
        Self::check_batch(kv, blocks, payloads.iter().map(|p| p.len()), payloads.len())?;
        Self::check_distinct(blocks)?;
        let payload = kv.layout.payload_bytes();
        self.wait_all_loaded(kv)?;
        if let Some(addrs) = self.mapped_addresses(payloads.iter().map(|p| p.as_ptr() as usize), payload) {
            self.copy_pages(false, kv, blocks, &addrs)?;
            return self.synchronize();
        }
        let per_round = (STAGING_BYTES / payload).max(1);
        for (chunk, ins) in blocks.chunks(per_round).zip(payloads.chunks(per_round)) {
            let bytes = chunk.len() * payload;
            self.with_staging(bytes, |dev, host| {
                // SAFETY: `host` is pinned memory of at least `bytes` that no copy is using (the
                // previous round was synchronised).
                let staged = unsafe { std::slice::from_raw_parts_mut(host.ptr, bytes) };
                for (src, dst) in ins.iter().zip(staged.chunks_exact_mut(payload)) {
                    dst.copy_from_slice(src);
                }
                let (base, _s) = dev.device_ptr_mut(&self.stream);
                // SAFETY: copies `bytes` from pinned host memory into the device staging of at least `bytes`.
                unsafe { cudarc::driver::result::memcpy_htod_async(base, &*staged, self.stream.cu_stream()) }
                    .map_err(driver_err("cuMemcpyHtoDAsync"))?;
                let addrs: Vec<u64> = (0..chunk.len()).map(|i| base + (i * payload) as u64).collect();
                self.copy_pages(false, kv, chunk, &addrs)?;
                self.synchronize()
            })?;
        }
        Ok(())
    }

    unsafe fn kv_gather_start(
        &self,
        kv: &CudaKv,
        blocks: &[u32],
        out: &mut [&mut [u8]],
    ) -> Result<CudaCopies, KernelError> {
        let Some(addrs) = self.started_batch(kv, blocks, out.iter().map(|p| (p.as_ptr() as usize, p.len())))? else {
            return CudaCopies::timed(|| self.kv_gather(kv, blocks, out));
        };
        // Behind the load stream too: a page is never gathered while a started scatter writes it.
        self.start_copies(&self.store, &[&self.load], kv, blocks, &addrs, |jobs| {
            self.launch_pages(&self.store, true, kv, jobs, 0..kv.layout.layers * 2)
        })
    }

    unsafe fn kv_scatter_start(
        &self,
        kv: &mut CudaKv,
        blocks: &[u32],
        payloads: &[&[u8]],
    ) -> Result<CudaCopies, KernelError> {
        let at = payloads.iter().map(|p| (p.as_ptr() as usize, p.len()));
        let Some(addrs) = self.started_batch(kv, blocks, at)? else {
            return CudaCopies::timed(|| self.kv_scatter(kv, blocks, payloads));
        };
        Self::check_distinct(blocks)?;
        // Enough layers per launch that one launch has SCATTER_LAUNCH_CTAS pages to copy.
        let layers = kv.layout.layers;
        let per_launch = SCATTER_LAUNCH_CTAS.div_ceil(2 * blocks.len()).clamp(1, layers);
        let mut ends = Vec::with_capacity(layers.div_ceil(per_launch));
        let copies = self.start_copies(&self.load, &[], kv, blocks, &addrs, |jobs| {
            for first in (0..layers).step_by(per_launch) {
                let last = (first + per_launch).min(layers);
                self.launch_pages(&self.load, false, kv, jobs, 2 * first..2 * last)?;
                ends.push(Arc::new(self.load.record_event(None).map_err(driver_err("cuEventRecord"))?));
            }
            Ok(())
        })?;
        for (layer, slot) in kv.loading.iter_mut().enumerate() {
            *slot = Some(ends[layer / per_launch].clone());
        }
        Ok(copies)
    }

    fn copies_done(&self, copies: &CudaCopies) -> Result<bool, KernelError> {
        match &copies.queued {
            Some((_, end)) => end.try_is_complete().map_err(driver_err("cuEventQuery")),
            None => Ok(true),
        }
    }

    fn copies_wait(&self, copies: CudaCopies) -> Result<Duration, KernelError> {
        // The events stay in `copies` until this returns, so on an error its drop still waits.
        match &copies.queued {
            Some((start, end)) => {
                let ms = start.elapsed_ms(end).map_err(driver_err("cuEventElapsedTime"))?;
                Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
            }
            None => Ok(copies.finished),
        }
    }
}
