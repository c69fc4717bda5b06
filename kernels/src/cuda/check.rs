//! `gpu_check`: every CUDA kernel against the CPU backend, the KV copy paths against plain copies,
//! and (through a caller-supplied hook) reference-model prefill against the PyTorch calibration.
//!
//! Kernel comparisons run both backends on the same fresh random inputs, with every output buffer
//! poisoned (NaN-filled) before the run, so a kernel that skips an element cannot pass. Inputs that
//! the CUDA backend stores as bf16 (weights; K and V where the kernel under test only reads them) are
//! rounded to bf16 before both backends see them, so the comparison measures the kernel, not the
//! storage format; kernels whose job includes a bf16 rounding (the GEMM's activation, `kv_write`)
//! are held to a bf16 tolerance. The error metric is `|cuda - cpu| / max(|cpu|, rms(cpu))` — relative
//! where values are large, scaled by the output's RMS near zero.
//!
//! The comparison bodies are generic over two [`Backend`]s ([`compare_case`]), so the same cases
//! can compare any pair of backends.

use std::fmt;
use std::time::Instant;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};

use super::{CudaBackend, DeviceInfo};
use crate::backend::{AttentionSpec, Backend, KernelError, SeqBatch};
use crate::cpu::CpuBackend;
use crate::kv_layout::PagedLayout;
use crate::model::{HostWeights, Llama};
use crate::sampling::SeededRng;
use dynamo_config::ModelShape;

mod bandwidth;

pub use bandwidth::pinned_copy_time;
use bandwidth::*;

/// Times one prefill of the reference engine on the GPU; supplied by the engine's crate.
pub trait PrefillTimer {
    /// Milliseconds for one forward over `tokens` prompt tokens of `model` ("llama-1b", "llama-8b").
    fn prefill_ms(&self, model: &str, tokens: usize) -> Result<f64, String>;
}

/// What [`gpu_check`] runs.
pub struct GpuCheckOptions<'a> {
    /// Device ordinal.
    pub ordinal: usize,
    /// Seed of the random inputs.
    pub seed: u64,
    /// Bytes moved per bandwidth measurement (rounded to whole blocks).
    pub bandwidth_bytes: usize,
    /// Timed repetitions per bandwidth measurement (the median is reported).
    pub repetitions: usize,
    /// The prefill hook; the prefill table is left out without one.
    pub prefill: Option<&'a dyn PrefillTimer>,
    /// Models and prompt lengths of the prefill table.
    pub prefill_points: Vec<(String, usize)>,
}

impl fmt::Debug for GpuCheckOptions<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuCheckOptions")
            .field("ordinal", &self.ordinal)
            .field("seed", &self.seed)
            .field("bandwidth_bytes", &self.bandwidth_bytes)
            .field("repetitions", &self.repetitions)
            .field("prefill", &self.prefill.is_some())
            .field("prefill_points", &self.prefill_points)
            .finish()
    }
}

impl Default for GpuCheckOptions<'_> {
    fn default() -> Self {
        let mut prefill_points = Vec::new();
        for model in ["llama-1b", "llama-8b"] {
            for tokens in [2048, 8192, 32768] {
                prefill_points.push((model.to_string(), tokens));
            }
        }
        Self { ordinal: 0, seed: 0x5eed, bandwidth_bytes: 256 << 20, repetitions: 5, prefill: None, prefill_points }
    }
}

/// One kernel comparison.
#[derive(Clone, Debug)]
pub struct KernelCheck {
    /// Kernel and case, e.g. "matmul 33x2048x1536".
    pub name: String,
    /// Largest absolute difference.
    pub max_abs: f64,
    /// Largest scaled difference (see the module docs).
    pub max_rel: f64,
    /// The tolerance on `max_rel`.
    pub tolerance: f64,
    /// Whether it passed (`max_rel <= tolerance`, no NaN, no error).
    pub passed: bool,
    /// An error instead of a result.
    pub error: Option<String>,
}

/// One bandwidth measurement next to its baseline.
#[derive(Clone, Debug)]
pub struct BandwidthRow {
    /// What was measured.
    pub path: String,
    /// Bytes moved.
    pub bytes: usize,
    /// GB/s (10⁹ bytes per second).
    pub gb_s: f64,
    /// The baseline: a plain copy of the same bytes.
    pub baseline: String,
    /// Its GB/s.
    pub baseline_gb_s: f64,
}

/// One prefill timing next to PyTorch's.
#[derive(Clone, Debug)]
pub struct PrefillRow {
    /// Model.
    pub model: String,
    /// Prompt tokens.
    pub tokens: usize,
    /// Ours, or why not.
    pub ours_ms: Result<f64, String>,
    /// PyTorch 2.11 on the same GPU (calibration), when measured.
    pub pytorch_ms: Option<f64>,
}

/// The result of [`gpu_check`]; `Display` renders it as text tables.
#[derive(Clone, Debug)]
pub struct GpuCheckReport {
    /// The device.
    pub device: DeviceInfo,
    /// Which attention kernel serves ([`CudaBackend::attention_kernel`]).
    pub attention: String,
    /// Kernel comparisons.
    pub kernels: Vec<KernelCheck>,
    /// Copy-path bandwidths.
    pub bandwidth: Vec<BandwidthRow>,
    /// Why the bandwidth section is incomplete, if it is.
    pub bandwidth_error: Option<String>,
    /// Prefill timings (empty without a hook).
    pub prefill: Vec<PrefillRow>,
}

impl GpuCheckReport {
    /// Whether every kernel comparison passed.
    pub fn all_passed(&self) -> bool {
        !self.kernels.is_empty() && self.kernels.iter().all(|k| k.passed)
    }
}

impl fmt::Display for GpuCheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "device: {}", self.device)?;
        writeln!(f, "attention: {}", self.attention)?;
        writeln!(f)?;
        writeln!(f, "{:<44} {:>12} {:>12} {:>10}  result", "kernel (CUDA vs CPU)", "max abs", "max rel", "tolerance")?;
        for k in &self.kernels {
            match &k.error {
                Some(e) => writeln!(f, "{:<44} {:>12} {:>12} {:>10}  FAIL: {e}", k.name, "-", "-", "-")?,
                None => writeln!(
                    f,
                    "{:<44} {:>12.3e} {:>12.3e} {:>10.1e}  {}",
                    k.name,
                    k.max_abs,
                    k.max_rel,
                    k.tolerance,
                    if k.passed { "pass" } else { "FAIL" }
                )?,
            }
        }
        let failed = self.kernels.iter().filter(|k| !k.passed).count();
        writeln!(f, "{} kernel checks, {failed} failed", self.kernels.len())?;
        writeln!(f)?;
        writeln!(
            f,
            "{:<40} {:>10} {:>9}  {:<36} {:>9} {:>7}",
            "copy path", "MiB", "GB/s", "baseline", "GB/s", "ratio"
        )?;
        for b in &self.bandwidth {
            writeln!(
                f,
                "{:<40} {:>10.1} {:>9.1}  {:<36} {:>9.1} {:>6.2}x",
                b.path,
                b.bytes as f64 / (1 << 20) as f64,
                b.gb_s,
                b.baseline,
                b.baseline_gb_s,
                b.gb_s / b.baseline_gb_s
            )?;
        }
        if let Some(e) = &self.bandwidth_error {
            writeln!(f, "bandwidth measurement stopped: {e}")?;
        }
        if !self.prefill.is_empty() {
            writeln!(f)?;
            writeln!(f, "{:<10} {:>8} {:>14} {:>14} {:>8}", "prefill", "tokens", "ours ms", "PyTorch ms", "ratio")?;
            for p in &self.prefill {
                let torch = p.pytorch_ms.map(|t| format!("{t:.1}")).unwrap_or_else(|| "-".into());
                match &p.ours_ms {
                    Ok(ms) => {
                        let ratio = p.pytorch_ms.map(|t| format!("{:.2}x", ms / t)).unwrap_or_else(|| "-".into());
                        writeln!(f, "{:<10} {:>8} {:>14.1} {:>14} {:>8}", p.model, p.tokens, ms, torch, ratio)?
                    }
                    Err(e) => {
                        writeln!(f, "{:<10} {:>8} {:>14} {:>14} {:>8}  ({e})", p.model, p.tokens, "error", torch, "-")?
                    }
                }
            }
        }
        Ok(())
    }
}

/// Runs the whole check on device `opts.ordinal`. Fails only when the device cannot be opened; a
/// kernel that errors or mismatches is reported as failed in the report.
pub fn gpu_check(opts: &GpuCheckOptions<'_>) -> Result<GpuCheckReport, KernelError> {
    let cuda = CudaBackend::new(opts.ordinal)?;
    let cpu = CpuBackend::new(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(16));
    let kernels = kernel_checks(&cuda, &cpu, opts.seed);
    let mut bandwidth = Vec::new();
    let bandwidth_error = bandwidth_checks(&cuda, opts, &mut bandwidth).err().map(|e| e.to_string());
    let calibration = dynamo_config::Calibration::h200();
    let prefill = match opts.prefill {
        None => Vec::new(),
        Some(timer) => opts
            .prefill_points
            .iter()
            .map(|(model, tokens)| PrefillRow {
                model: model.clone(),
                tokens: *tokens,
                ours_ms: timer.prefill_ms(model, *tokens),
                pytorch_ms: calibration.prefill_ms(model, *tokens as u64),
            })
            .collect(),
    };
    Ok(GpuCheckReport {
        device: cuda.device().clone(),
        attention: cuda.attention_kernel(),
        kernels,
        bandwidth,
        bandwidth_error,
        prefill,
    })
}

// ---------------------------------------------------------------------------------------------
// Kernel comparisons

const TOL_F32: f64 = 1e-4;
const TOL_REDUCE: f64 = 1e-3;
/// bf16 has 8 significant bits: one rounding is within 2⁻⁹ relative; allow a few.
const TOL_BF16: f64 = 1.0 / 128.0;
/// The tensor-core attention against the fp32 reference: Q and the probabilities are rounded to
/// bf16, so logits move by about 2⁻⁸ and every probability by as much, and a row over a few keys
/// carries that whole (row 0 of a prompt attends to one key). Measured on an H200: up to 1.9e-2
/// scaled on a prompt's first rows. A wrong mask, scale or page is off by O(1). The same bound
/// as the start-up check against the fp32 kernel.
pub(crate) const TOL_ATTENTION_BF16: f64 = 1.0 / 32.0;

fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

fn random(rng: &mut SeededRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| ((rng.next_f64() * 2.0 - 1.0) as f32) * scale).collect()
}

fn random_bf16(rng: &mut SeededRng, n: usize, scale: f32) -> Vec<f32> {
    random(rng, n, scale).into_iter().map(bf16_round).collect()
}

/// `(max abs, max scaled)` difference of `got` against `want`; NaN anywhere counts as infinite.
pub fn difference(got: &[f32], want: &[f32]) -> (f64, f64) {
    if got.len() != want.len() {
        return (f64::INFINITY, f64::INFINITY);
    }
    let rms = (want.iter().map(|&w| (w as f64) * (w as f64)).sum::<f64>() / want.len().max(1) as f64).sqrt();
    let mut max_abs = 0.0f64;
    let mut max_rel = 0.0f64;
    for (&g, &w) in got.iter().zip(want) {
        if g.is_nan() != w.is_nan() {
            return (f64::INFINITY, f64::INFINITY);
        }
        let d = (g as f64 - w as f64).abs();
        let scale = (w as f64).abs().max(rms).max(f64::MIN_POSITIVE);
        max_abs = max_abs.max(d);
        max_rel = max_rel.max(d / scale);
    }
    (max_abs, max_rel)
}

fn poisoned<B: Backend>(b: &B, len: usize) -> Result<B::Buf, KernelError> {
    b.upload(&vec![f32::NAN; len])
}

fn fetch<B: Backend>(b: &B, buf: &B::Buf, len: usize) -> Result<Vec<f32>, KernelError> {
    let mut out = vec![0.0; len];
    b.download(buf, &mut out)?;
    Ok(out)
}

/// One comparison case: runs `case` on both backends and compares the host results.
pub fn compare_case<B1: Backend, B2: Backend>(
    name: &str,
    tolerance: f64,
    test: &B1,
    reference: &B2,
    case: impl Fn(&dyn CaseRunner) -> Result<Vec<f32>, KernelError>,
) -> KernelCheck {
    let got = case(&Runner(test));
    let want = case(&Runner(reference));
    match (got, want) {
        (Ok(got), Ok(want)) => {
            let (max_abs, max_rel) = difference(&got, &want);
            KernelCheck { name: name.into(), max_abs, max_rel, tolerance, passed: max_rel <= tolerance, error: None }
        }
        (Err(e), _) => failed(name, tolerance, format!("{}: {e}", test.name())),
        (_, Err(e)) => failed(name, tolerance, format!("{}: {e}", reference.name())),
    }
}

fn failed(name: &str, tolerance: f64, error: String) -> KernelCheck {
    KernelCheck {
        name: name.into(),
        max_abs: f64::NAN,
        max_rel: f64::NAN,
        tolerance,
        passed: false,
        error: Some(error),
    }
}

/// The operations a comparison case runs, over host data, on one backend (object-safe, so one case
/// body serves every backend).
pub trait CaseRunner {
    /// `embed` of `tokens` from a `[vocab, dim]` table.
    fn embed(&self, table: &[f32], vocab: usize, dim: usize, tokens: &[u32]) -> Result<Vec<f32>, KernelError>;
    /// `rmsnorm`.
    fn rmsnorm(&self, x: &[f32], w: &[f32], rows: usize, dim: usize, eps: f32) -> Result<Vec<f32>, KernelError>;
    /// `matmul` of `x: [rows, k]` by `w: [n, k]`.
    fn matmul(&self, x: &[f32], rows: usize, w: &[f32], n: usize, k: usize) -> Result<Vec<f32>, KernelError>;
    /// `rope`.
    fn rope(
        &self,
        x: &[f32],
        rows: usize,
        heads: usize,
        head_dim: usize,
        pos: &[u32],
        theta: f32,
    ) -> Result<Vec<f32>, KernelError>;
    /// `swiglu`.
    fn swiglu(&self, gate: &[f32], up: &[f32]) -> Result<Vec<f32>, KernelError>;
    /// `add_assign`.
    fn add(&self, x: &[f32], y: &[f32]) -> Result<Vec<f32>, KernelError>;
    /// `add_bias` of a `cols`-element bias to `x: [rows, cols]`.
    fn add_bias(&self, x: &[f32], bias: &[f32], rows: usize, cols: usize) -> Result<Vec<f32>, KernelError>;
    /// `kv_write` of `[rows, kv_heads, head_dim]` K and V into `slots` of every layer, then every page
    /// of the pool as f32 (K then V, layer by layer, block by block).
    fn kv_write_pages(
        &self,
        layout: PagedLayout,
        blocks: usize,
        k: &[f32],
        v: &[f32],
        slots: &[u32],
    ) -> Result<Vec<f32>, KernelError>;
    /// Writes K/V for positions `0..ctx` through `table`, then attention of `q` rows at `pos` (layer 1).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        layout: PagedLayout,
        blocks: usize,
        spec: AttentionSpec,
        k: &[f32],
        v: &[f32],
        table: &[u32],
        q: &[f32],
        pos: &[u32],
    ) -> Result<Vec<f32>, KernelError>;
    /// Writes K/V rows into `slots` (every layer), then one batched attention of `q` rows at
    /// `pos` over several sequences' block tables (layer 1).
    #[allow(clippy::too_many_arguments)]
    fn attention_batch(
        &self,
        layout: PagedLayout,
        blocks: usize,
        spec: AttentionSpec,
        k: &[f32],
        v: &[f32],
        slots: &[u32],
        seqs: SeqBatch<'_>,
        q: &[f32],
        pos: &[u32],
    ) -> Result<Vec<f32>, KernelError>;
    /// Writes K/V into every slot, gathers `gather` into payloads, scatters them into `scatter`
    /// of a fresh pool and gathers those back; both payload sets as f32.
    fn gather_scatter(
        &self,
        layout: PagedLayout,
        blocks: usize,
        k: &[f32],
        v: &[f32],
        gather: &[u32],
        scatter: &[u32],
    ) -> Result<Vec<f32>, KernelError>;
}

struct Runner<'a, B: Backend>(&'a B);

fn payload_to_f32(bytes: &[u8], elem_bytes: usize) -> Vec<f32> {
    match elem_bytes {
        2 => bytes.chunks_exact(2).map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect(),
        _ => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
    }
}

impl<B: Backend> Runner<'_, B> {
    fn fill_pool(
        &self,
        layout: PagedLayout,
        blocks: usize,
        k: &[f32],
        v: &[f32],
        slots: &[u32],
    ) -> Result<B::Kv, KernelError> {
        let b = self.0;
        let mut kv = b.kv_pool(PagedLayout { elem_bytes: b.kv_elem_bytes(), ..layout }, blocks)?;
        let (dk, dv) = (b.upload(k)?, b.upload(v)?);
        for layer in 0..layout.layers {
            b.kv_write(&mut kv, layer, &dk, &dv, slots)?;
        }
        Ok(kv)
    }

    fn gather_f32(&self, layout: PagedLayout, kv: &B::Kv, blocks: &[u32]) -> Result<Vec<f32>, KernelError> {
        let eb = self.0.kv_elem_bytes();
        let payload = PagedLayout { elem_bytes: eb, ..layout }.payload_bytes();
        let mut images = vec![vec![0xffu8; payload]; blocks.len()];
        let mut outs: Vec<&mut [u8]> = images.iter_mut().map(|i| i.as_mut_slice()).collect();
        self.0.kv_gather(kv, blocks, &mut outs)?;
        Ok(images.iter().flat_map(|i| payload_to_f32(i, eb)).collect())
    }
}

impl<B: Backend> CaseRunner for Runner<'_, B> {
    fn embed(&self, table: &[f32], vocab: usize, dim: usize, tokens: &[u32]) -> Result<Vec<f32>, KernelError> {
        let b = self.0;
        let w = b.weight(table, vocab, dim)?;
        let mut out = poisoned(b, tokens.len() * dim)?;
        b.embed(&w, tokens, &mut out)?;
        fetch(b, &out, tokens.len() * dim)
    }

    fn rmsnorm(&self, x: &[f32], w: &[f32], rows: usize, dim: usize, eps: f32) -> Result<Vec<f32>, KernelError> {
        let b = self.0;
        let (dx, dw) = (b.upload(x)?, b.weight(w, 1, dim)?);
        let mut out = poisoned(b, rows * dim)?;
        b.rmsnorm(&dx, &dw, rows, dim, eps, &mut out)?;
        fetch(b, &out, rows * dim)
    }

    fn matmul(&self, x: &[f32], rows: usize, w: &[f32], n: usize, k: usize) -> Result<Vec<f32>, KernelError> {
        let b = self.0;
        let (dx, dw) = (b.upload(x)?, b.weight(w, n, k)?);
        let mut out = poisoned(b, rows * n)?;
        b.matmul(&dx, rows, &dw, &mut out)?;
        fetch(b, &out, rows * n)
    }

    fn rope(
        &self,
        x: &[f32],
        rows: usize,
        heads: usize,
        head_dim: usize,
        pos: &[u32],
        theta: f32,
    ) -> Result<Vec<f32>, KernelError> {
        let b = self.0;
        let mut dx = b.upload(x)?;
        b.rope(&mut dx, rows, heads, head_dim, pos, &crate::backend::rope_inv_freq(theta, head_dim))?;
        fetch(b, &dx, x.len())
    }

    fn swiglu(&self, gate: &[f32], up: &[f32]) -> Result<Vec<f32>, KernelError> {
        let b = self.0;
        let (dg, du) = (b.upload(gate)?, b.upload(up)?);
        let mut out = poisoned(b, gate.len())?;
        b.swiglu(&dg, &du, gate.len(), &mut out)?;
        fetch(b, &out, gate.len())
    }

    fn add(&self, x: &[f32], y: &[f32]) -> Result<Vec<f32>, KernelError> {
        let b = self.0;
        let (mut dx, dy) = (b.upload(x)?, b.upload(y)?);
        b.add_assign(&mut dx, &dy, x.len())?;
        fetch(b, &dx, x.len())
    }

    fn add_bias(&self, x: &[f32], bias: &[f32], rows: usize, cols: usize) -> Result<Vec<f32>, KernelError> {
        let b = self.0;
        let (mut dx, w) = (b.upload(x)?, b.weight(bias, 1, cols)?);
        b.add_bias(&mut dx, &w, rows, cols)?;
        fetch(b, &dx, x.len())
    }

    fn kv_write_pages(
        &self,
        layout: PagedLayout,
        blocks: usize,
        k: &[f32],
        v: &[f32],
        slots: &[u32],
    ) -> Result<Vec<f32>, KernelError> {
        let kv = self.fill_pool(layout, blocks, k, v, slots)?;
        let all: Vec<u32> = (0..blocks as u32).collect();
        self.gather_f32(layout, &kv, &all)
    }

    fn attention(
        &self,
        layout: PagedLayout,
        blocks: usize,
        spec: AttentionSpec,
        k: &[f32],
        v: &[f32],
        table: &[u32],
        q: &[f32],
        pos: &[u32],
    ) -> Result<Vec<f32>, KernelError> {
        let b = self.0;
        let ctx = k.len() / (layout.kv_heads * layout.head_dim);
        let slots: Vec<u32> = (0..ctx)
            .map(|p| table[p / layout.block_tokens] * layout.block_tokens as u32 + (p % layout.block_tokens) as u32)
            .collect();
        let kv = self.fill_pool(layout, blocks, k, v, &slots)?;
        let dq = b.upload(q)?;
        let mut out = poisoned(b, q.len())?;
        b.attention(&dq, &kv, layout.layers - 1, spec, table, pos, &mut out)?;
        fetch(b, &out, q.len())
    }

    fn attention_batch(
        &self,
        layout: PagedLayout,
        blocks: usize,
        spec: AttentionSpec,
        k: &[f32],
        v: &[f32],
        slots: &[u32],
        seqs: SeqBatch<'_>,
        q: &[f32],
        pos: &[u32],
    ) -> Result<Vec<f32>, KernelError> {
        let b = self.0;
        let kv = self.fill_pool(layout, blocks, k, v, slots)?;
        let dq = b.upload(q)?;
        let mut out = poisoned(b, q.len())?;
        b.attention_batch(&dq, &kv, layout.layers - 1, spec, seqs, pos, &mut out)?;
        fetch(b, &out, q.len())
    }

    fn gather_scatter(
        &self,
        layout: PagedLayout,
        blocks: usize,
        k: &[f32],
        v: &[f32],
        gather: &[u32],
        scatter: &[u32],
    ) -> Result<Vec<f32>, KernelError> {
        let b = self.0;
        let slots: Vec<u32> = (0..(blocks * layout.block_tokens) as u32).collect();
        let kv = self.fill_pool(layout, blocks, k, v, &slots)?;
        let eb = b.kv_elem_bytes();
        let payload = PagedLayout { elem_bytes: eb, ..layout }.payload_bytes();
        let mut images = vec![vec![0xffu8; payload]; gather.len()];
        {
            let mut outs: Vec<&mut [u8]> = images.iter_mut().map(|i| i.as_mut_slice()).collect();
            b.kv_gather(&kv, gather, &mut outs)?;
        }
        let mut fresh = b.kv_pool(PagedLayout { elem_bytes: eb, ..layout }, blocks)?;
        let ins: Vec<&[u8]> = images.iter().map(|i| i.as_slice()).collect();
        b.kv_scatter(&mut fresh, scatter, &ins)?;
        let mut all: Vec<f32> = images.iter().flat_map(|i| payload_to_f32(i, eb)).collect();
        all.extend(self.gather_f32(layout, &fresh, scatter)?);
        Ok(all)
    }
}

fn permutation(rng: &mut SeededRng, n: usize) -> Vec<u32> {
    let mut p: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

/// Every CUDA kernel against the CPU backend: the [`Backend`] cases, then the CUDA-only entry points
/// (registered-host gather/scatter, argmax, f32 → bf16).
pub fn kernel_checks(cuda: &CudaBackend, cpu: &CpuBackend, seed: u64) -> Vec<KernelCheck> {
    let mut out = compare_backends(cuda, cpu, seed);
    out.extend(attention_checks(cuda, cpu, seed));
    let mut rng = SeededRng::new(seed ^ 0xc0da);
    let layout = PagedLayout { layers: 3, block_tokens: 16, kv_heads: 2, head_dim: 64, elem_bytes: 4 };
    let blocks = 12;
    let n_slots = blocks * layout.block_tokens * layout.kv_heads * layout.head_dim;
    let (k, v) = (random_bf16(&mut rng, n_slots, 2.0), random_bf16(&mut rng, n_slots, 2.0));
    let gather: Vec<u32> = permutation(&mut rng, blocks)[..7].to_vec();
    let scatter: Vec<u32> = permutation(&mut rng, blocks)[..7].to_vec();
    out.push(registered_gather_check(cuda, cpu, layout, blocks, &k, &v, &gather, &scatter));
    let q = random(&mut rng, 5 * 4 * layout.kv_heads * layout.head_dim, 2.0);
    let case = StartedCase { layout, blocks, k: &k, v: &v, gather: &gather, scatter: &scatter, q: &q };
    out.push(started_copies_check(cuda, cpu, &case));
    let (rows, vocab) = (4, 128_256);
    let mut logits = random(&mut rng, rows * vocab, 10.0);
    logits[vocab + 5] = 100.0;
    logits[vocab + 9] = 100.0; // a tie: the lower index wins
    logits[2 * vocab + 3] = f32::NAN;
    out.push(argmax_check(cuda, &logits, rows, vocab));
    out.push(to_bf16_check(cuda, &random(&mut rng, 4099, 1e3)));
    out
}

/// Every [`Backend`] operation of `test` against `reference` on the same random inputs.
pub fn compare_backends<T: Backend, R: Backend>(cuda: &T, cpu: &R, seed: u64) -> Vec<KernelCheck> {
    let mut rng = SeededRng::new(seed);
    let mut out = Vec::new();

    let (vocab, dim) = (1000, 320);
    let table = random_bf16(&mut rng, vocab * dim, 1.0);
    let tokens: Vec<u32> = (0..37).map(|_| (rng.next_u64() % vocab as u64) as u32).collect();
    out.push(compare_case("embed 37 tokens, dim 320", 0.0, cuda, cpu, |r| r.embed(&table, vocab, dim, &tokens)));

    for (rows, dim) in [(7, 4096), (3, 1000)] {
        let x = random(&mut rng, rows * dim, 3.0);
        let w = random_bf16(&mut rng, dim, 1.0);
        out.push(compare_case(&format!("rmsnorm {rows}x{dim}"), TOL_REDUCE, cuda, cpu, |r| {
            r.rmsnorm(&x, &w, rows, dim, 1e-5)
        }));
    }

    for (rows, n, k) in [(1, 1536, 2048), (33, 1536, 2048), (67, 777, 1000)] {
        let x = random(&mut rng, rows * k, 1.0);
        let w = random_bf16(&mut rng, n * k, 0.05);
        out.push(compare_case(&format!("matmul {rows}x{k} · ({n}x{k})ᵀ"), TOL_BF16, cuda, cpu, |r| {
            r.matmul(&x, rows, &w, n, k)
        }));
    }

    for (heads, head_dim) in [(8, 128), (4, 64)] {
        let rows = 9;
        let x = random(&mut rng, rows * heads * head_dim, 2.0);
        let pos: Vec<u32> = (0..rows).map(|i| if i == 0 { 0 } else { (rng.next_u64() % 32768) as u32 }).collect();
        out.push(compare_case(&format!("rope {rows}x{heads}x{head_dim}, pos < 32K"), TOL_REDUCE, cuda, cpu, |r| {
            r.rope(&x, rows, heads, head_dim, &pos, 500_000.0)
        }));
    }

    let n = 100_003;
    let (g, u) = (random(&mut rng, n, 6.0), random(&mut rng, n, 2.0));
    out.push(compare_case("swiglu 100003", TOL_F32, cuda, cpu, |r| r.swiglu(&g, &u)));
    out.push(compare_case("add_assign 100003", TOL_F32, cuda, cpu, |r| r.add(&g, &u)));
    // Qwen2's q/k/v biases: a bf16-exact bias (the CUDA backend keeps weights as bf16).
    let (rows, cols) = (37, 896);
    let x = random(&mut rng, rows * cols, 2.0);
    let bias = random_bf16(&mut rng, cols, 1.0);
    out.push(compare_case("add_bias 37x896", TOL_F32, cuda, cpu, |r| r.add_bias(&x, &bias, rows, cols)));

    let layout = PagedLayout { layers: 2, block_tokens: 16, kv_heads: 4, head_dim: 64, elem_bytes: 4 };
    let blocks = 10;
    let row = layout.kv_heads * layout.head_dim;
    let slots: Vec<u32> = permutation(&mut rng, blocks * layout.block_tokens)[..50].to_vec();
    let (k, v) = (random(&mut rng, 50 * row, 2.0), random(&mut rng, 50 * row, 2.0));
    out.push(compare_case("kv_write 50 slots (f32 -> bf16 pages)", TOL_BF16, cuda, cpu, |r| {
        r.kv_write_pages(layout, blocks, &k, &v, &slots)
    }));

    let layout = PagedLayout { layers: 3, block_tokens: 16, kv_heads: 2, head_dim: 64, elem_bytes: 4 };
    let blocks = 12;
    let row = layout.kv_heads * layout.head_dim;
    let n_slots = blocks * layout.block_tokens;
    let (k, v) = (random_bf16(&mut rng, n_slots * row, 2.0), random_bf16(&mut rng, n_slots * row, 2.0));
    let gather: Vec<u32> = permutation(&mut rng, blocks)[..7].to_vec();
    let scatter: Vec<u32> = permutation(&mut rng, blocks)[..7].to_vec();
    out.push(compare_case("kv gather+scatter 7 blocks (bounce path)", 0.0, cuda, cpu, |r| {
        r.gather_scatter(layout, blocks, &k, &v, &gather, &scatter)
    }));
    out
}

/// The attention cases (prefill, prefill after a resident prefix, decode; grouped and not; pages
/// in random order) of `test` against `reference`, named with `label`.
pub fn attention_cases<T: Backend, R: Backend>(
    test: &T,
    reference: &R,
    seed: u64,
    tolerance: f64,
    label: &str,
) -> Vec<KernelCheck> {
    let mut rng = SeededRng::new(seed ^ 0xa77e);
    let mut out = Vec::new();
    for (heads, kv_heads, head_dim, ctx, chunk) in
        [(8, 2, 128, 200usize, 50usize), (8, 2, 128, 200, 1), (4, 4, 64, 77, 77), (32, 8, 128, 1000, 3)]
    {
        let block_tokens = 16;
        let layout = PagedLayout { layers: 2, block_tokens, kv_heads, head_dim, elem_bytes: 4 };
        let spec = AttentionSpec { heads, kv_heads, head_dim, block_tokens };
        let need = ctx.div_ceil(block_tokens);
        let blocks = need + 5;
        let table: Vec<u32> = permutation(&mut rng, blocks)[..need].to_vec();
        let (k, v) = (
            random_bf16(&mut rng, ctx * kv_heads * head_dim, 2.0),
            random_bf16(&mut rng, ctx * kv_heads * head_dim, 2.0),
        );
        let q = random(&mut rng, chunk * heads * head_dim, 2.0);
        let pos: Vec<u32> = ((ctx - chunk) as u32..ctx as u32).collect();
        let what = if chunk == 1 {
            "decode"
        } else if chunk == ctx {
            "prefill"
        } else {
            "prefill after prefix"
        };
        out.push(compare_case(
            &format!("attention {what} {chunk}/{ctx} h{heads}/{kv_heads}x{head_dim} [{label}]"),
            tolerance,
            test,
            reference,
            |r| r.attention(layout, blocks, spec, &k, &v, &table, &q, &pos),
        ));
    }
    out.push(batched_attention_case(test, reference, &mut rng, tolerance, label));
    out
}

/// One batched attention call over three sequences of one pool, each through its own table: a
/// prefill chunk after a prefix, a decode row and a whole short prompt (what one engine step of
/// continuous batching asks).
fn batched_attention_case<T: Backend, R: Backend>(
    test: &T,
    reference: &R,
    rng: &mut SeededRng,
    tolerance: f64,
    label: &str,
) -> KernelCheck {
    let (heads, kv_heads, head_dim, block_tokens) = (8, 2, 128, 16);
    let layout = PagedLayout { layers: 2, block_tokens, kv_heads, head_dim, elem_bytes: 4 };
    let spec = AttentionSpec { heads, kv_heads, head_dim, block_tokens };
    // (context, rows computed at its end) per sequence.
    let seqs = [(300usize, 40usize), (129, 1), (45, 45)];
    let blocks: usize = seqs.iter().map(|(ctx, _)| ctx.div_ceil(block_tokens)).sum::<usize>() + 7;
    let order = permutation(rng, blocks);
    let (mut tables, mut table_starts, mut row_starts, mut slots, mut pos) =
        (vec![], vec![0u32], vec![0u32], vec![], vec![]);
    let mut next = 0;
    for &(ctx, rows) in &seqs {
        let table: Vec<u32> = order[next..next + ctx.div_ceil(block_tokens)].to_vec();
        next += table.len();
        slots.extend((0..ctx).map(|p| table[p / block_tokens] * block_tokens as u32 + (p % block_tokens) as u32));
        pos.extend((ctx - rows) as u32..ctx as u32);
        tables.extend(&table);
        table_starts.push(tables.len() as u32);
        row_starts.push(pos.len() as u32);
    }
    let tokens = slots.len();
    let (k, v) =
        (random_bf16(rng, tokens * kv_heads * head_dim, 2.0), random_bf16(rng, tokens * kv_heads * head_dim, 2.0));
    let q = random(rng, pos.len() * heads * head_dim, 2.0);
    let batch = SeqBatch { row_starts: &row_starts, table_starts: &table_starts, tables: &tables };
    compare_case(
        &format!(
            "attention batch of 3 sequences (prefill chunk, decode, prompt) h{heads}/{kv_heads}x{head_dim} [{label}]"
        ),
        tolerance,
        test,
        reference,
        |r| r.attention_batch(layout, blocks, spec, &k, &v, &slots, batch, &q, &pos),
    )
}

/// The attention cases on the kernel that serves: the tensor-core one (bf16 Q and P, so a bf16
/// tolerance) where it passed its start-up check, and then the fp32 one (which serves other head
/// dims) with the reduction tolerance.
fn attention_checks(cuda: &CudaBackend, cpu: &CpuBackend, seed: u64) -> Vec<KernelCheck> {
    if cuda.set_mma_attention(true).is_err() {
        return attention_cases(cuda, cpu, seed, TOL_REDUCE, "fp32");
    }
    let mut out = attention_cases(cuda, cpu, seed, TOL_ATTENTION_BF16, "mma");
    let _ = cuda.set_mma_attention(false);
    out.extend(attention_cases(cuda, cpu, seed, TOL_REDUCE, "fp32"));
    let _ = cuda.set_mma_attention(true);
    out
}

/// Gather into / scatter from payloads in registered host memory (the one-kernel G2 path).
#[allow(clippy::too_many_arguments)]
fn registered_gather_check(
    cuda: &CudaBackend,
    cpu: &CpuBackend,
    layout: PagedLayout,
    blocks: usize,
    k: &[f32],
    v: &[f32],
    gather: &[u32],
    scatter: &[u32],
) -> KernelCheck {
    let name = "kv gather+scatter 7 blocks (registered host)";
    let run = || -> Result<(Vec<f32>, Vec<f32>), KernelError> {
        let slots: Vec<u32> = (0..(blocks * layout.block_tokens) as u32).collect();
        let want = Runner(cpu).fill_pool(layout, blocks, k, v, &slots)?;
        let want = Runner(cpu).gather_f32(layout, &want, gather)?;
        let kv = Runner(cuda).fill_pool(layout, blocks, k, v, &slots)?;
        let payload = PagedLayout { elem_bytes: 2, ..layout }.payload_bytes();
        let mut host = HostMapping::new(payload * gather.len())?;
        // SAFETY: the mapping outlives the registration (dropped first, at the end of this closure).
        let reg = unsafe { cuda.register_host(host.ptr, host.len) }?;
        host.bytes_mut().fill(0xff);
        {
            let mut outs: Vec<&mut [u8]> = host.bytes_mut().chunks_exact_mut(payload).collect();
            cuda.kv_gather(&kv, gather, &mut outs)?;
        }
        let mut got = payload_to_f32(host.bytes(), 2);
        let mut fresh = cuda.kv_pool(layout, blocks)?;
        let ins: Vec<&[u8]> = host.bytes().chunks_exact(payload).collect();
        cuda.kv_scatter(&mut fresh, scatter, &ins)?;
        drop(reg);
        got.extend(Runner(cuda).gather_f32(layout, &fresh, scatter)?);
        let mut want2 = want.clone();
        want2.extend(want);
        Ok((got, want2))
    };
    match run() {
        Ok((got, want)) => {
            let (max_abs, max_rel) = difference(&got, &want);
            KernelCheck { name: name.into(), max_abs, max_rel, tolerance: 0.0, passed: max_rel == 0.0, error: None }
        }
        Err(e) => failed(name, 0.0, e.to_string()),
    }
}

fn argmax_check(cuda: &CudaBackend, logits: &[f32], rows: usize, vocab: usize) -> KernelCheck {
    let name = format!("argmax {rows}x{vocab} (ties, NaN)");
    let want: Vec<f32> = logits.chunks_exact(vocab).map(|r| crate::sampling::argmax(r) as f32).collect();
    let got = cuda
        .upload(logits)
        .and_then(|d| cuda.argmax(&d, rows, vocab))
        .map(|v| v.into_iter().map(|i| i as f32).collect::<Vec<_>>());
    match got {
        Ok(got) => {
            let (max_abs, max_rel) = difference(&got, &want);
            KernelCheck { name, max_abs, max_rel, tolerance: 0.0, passed: max_abs == 0.0, error: None }
        }
        Err(e) => failed(&name, 0.0, e.to_string()),
    }
}

fn to_bf16_check(cuda: &CudaBackend, x: &[f32]) -> KernelCheck {
    let name = "f32 -> bf16 (bitwise vs half crate)".to_string();
    let run = || -> Result<f64, KernelError> {
        let d = cuda.upload(x)?;
        let mut out = cuda.stream.alloc_zeros::<u16>(x.len()).map_err(super::driver_err("alloc"))?;
        cuda.to_bf16(&d, x.len(), &mut out)?;
        let got = cuda.stream.clone_dtoh(&out).map_err(super::driver_err("download"))?;
        Ok(got.iter().zip(x).filter(|(g, x)| **g != half::bf16::from_f32(**x).to_bits()).count() as f64)
    };
    match run() {
        Ok(bad) => KernelCheck { name, max_abs: bad, max_rel: bad, tolerance: 0.0, passed: bad == 0.0, error: None },
        Err(e) => failed(&name, 0.0, e.to_string()),
    }
}

/// A pool filled with `k`/`v`, `gather` started into host images, the images started into the
/// `scatter` blocks of a fresh pool, and attention of the 5 rows of `q` queued over those blocks
/// before the scatter is waited for.
struct StartedCase<'a> {
    layout: PagedLayout,
    blocks: usize,
    k: &'a [f32],
    v: &'a [f32],
    gather: &'a [u32],
    scatter: &'a [u32],
    q: &'a [f32],
}

impl StartedCase<'_> {
    fn spec(&self) -> AttentionSpec {
        let l = self.layout;
        AttentionSpec {
            heads: 4 * l.kv_heads,
            kv_heads: l.kv_heads,
            head_dim: l.head_dim,
            block_tokens: l.block_tokens,
        }
    }

    /// Runs the case on `b` with the images in `host`: the gathered images, then the attention
    /// output, then the scattered pages gathered back (all as f32).
    fn run<B: Backend>(&self, b: &B, host: &mut [u8]) -> Result<(Vec<f32>, Vec<f32>), KernelError> {
        let (layout, n) = (self.layout, self.gather.len());
        let eb = b.kv_elem_bytes();
        let payload = PagedLayout { elem_bytes: eb, ..layout }.payload_bytes();
        let host = &mut host[..n * payload];
        let slots: Vec<u32> = (0..(self.blocks * layout.block_tokens) as u32).collect();
        let kv = Runner(b).fill_pool(layout, self.blocks, self.k, self.v, &slots)?;
        host.fill(0xff);
        let mut outs: Vec<&mut [u8]> = host.chunks_exact_mut(payload).collect();
        // SAFETY: `host` is neither read nor written until the copies are waited for, just below,
        // and the gathered blocks are not written.
        let copies = unsafe { b.kv_gather_start(&kv, self.gather, &mut outs) }?;
        drop(outs);
        b.copies_wait(copies)?;
        let mut images = payload_to_f32(host, eb);
        let mut fresh = b.kv_pool(PagedLayout { elem_bytes: eb, ..layout }, self.blocks)?;
        let ins: Vec<&[u8]> = host.chunks_exact(payload).collect();
        // SAFETY: `host` is not written until the copies are waited for.
        let copies = unsafe { b.kv_scatter_start(&mut fresh, self.scatter, &ins) }?;
        let ctx = (self.scatter.len() * layout.block_tokens) as u32;
        let pos: Vec<u32> = (ctx - 5..ctx).collect();
        let (dq, mut out) = (b.upload(self.q)?, poisoned(b, self.q.len())?);
        b.attention(&dq, &fresh, layout.layers - 1, self.spec(), self.scatter, &pos, &mut out)?;
        b.copies_wait(copies)?;
        let attention = fetch(b, &out, self.q.len())?;
        images.extend(Runner(b).gather_f32(layout, &fresh, self.scatter)?);
        Ok((images, attention))
    }
}

/// [`StartedCase`] with registered host images on CUDA (the copy streams' path) against the CPU:
/// images and pages exact, attention within the tolerance of the kernel that serves (the
/// tensor-core one's where it is on).
fn started_copies_check(cuda: &CudaBackend, cpu: &CpuBackend, case: &StartedCase<'_>) -> KernelCheck {
    let name = "kv gather+scatter started on the copy streams, attention queued behind";
    let tolerance = if cuda.mma_attention_on() { TOL_ATTENTION_BF16 } else { TOL_REDUCE };
    let run = || -> Result<KernelCheck, KernelError> {
        let payload = PagedLayout { elem_bytes: 4, ..case.layout }.payload_bytes();
        let (want_pages, want_attention) = case.run(cpu, &mut vec![0u8; payload * case.gather.len()])?;
        let mut host = HostMapping::new(payload * case.gather.len())?;
        // SAFETY: the mapping outlives the registration (dropped first, below).
        let reg = unsafe { cuda.register_host(host.ptr, host.len) }?;
        let got = case.run(cuda, host.bytes_mut());
        drop(reg);
        let (got_pages, got_attention) = got?;
        let (_, pages_rel) = difference(&got_pages, &want_pages);
        let (max_abs, max_rel) = difference(&got_attention, &want_attention);
        Ok(KernelCheck {
            name: name.into(),
            max_abs,
            max_rel: max_rel.max(pages_rel),
            tolerance,
            passed: pages_rel == 0.0 && max_rel <= tolerance,
            error: None,
        })
    };
    run().unwrap_or_else(|e| failed(name, tolerance, e.to_string()))
}

/// Page-aligned anonymous host memory (what the G2 pool is), unmapped on drop.
struct HostMapping {
    ptr: *mut u8,
    len: usize,
}

impl HostMapping {
    fn new(len: usize) -> Result<Self, KernelError> {
        // SAFETY: an anonymous private mapping with no address hint; checked for MAP_FAILED.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(KernelError::OutOfMemory { bytes: len });
        }
        Ok(Self { ptr: ptr.cast(), len })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr..ptr + len` is this mapping, readable and initialised (zero-filled by mmap).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for HostMapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping created in `new`; no borrow of it outlives `self`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

// ---------------------------------------------------------------------------------------------
// Bandwidth

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_case_runs_and_agrees_cpu_against_cpu() {
        let cpu = CpuBackend::new(2);
        let mut checks = compare_backends(&cpu, &cpu, 7);
        checks.extend(attention_cases(&cpu, &cpu, 7, 0.0, "cpu"));
        assert!(checks.len() >= 14);
        for c in &checks {
            assert!(c.error.is_none(), "{}: {:?}", c.name, c.error);
            assert_eq!(c.max_abs, 0.0, "{} is not deterministic on the CPU", c.name);
        }
    }

    #[test]
    fn poisoned_outputs_fail_the_comparison() {
        assert_eq!(difference(&[1.0, f32::NAN], &[1.0, 2.0]).1, f64::INFINITY);
        let (abs, rel) = difference(&[1.0, 2.01], &[1.0, 2.0]);
        assert!((abs - 0.01).abs() < 1e-6 && rel > 0.0 && rel < 0.01);
    }
}

/// The prefill rows of [`gpu_check`] measured with the reference engine itself: [`Llama`] on
/// [`CudaBackend`] with seeded random weights of the named shape (bf16 on the device), one forward
/// over the whole prompt from an empty KV pool, timed after a short warm-up forward. The logits
/// are downloaded at the end of the forward, so the time covers every kernel of the prefill.
///
/// A model stays loaded between rows of the same shape; loading the next one frees the last.
#[derive(Debug)]
pub struct ReferencePrefill {
    ordinal: usize,
    block_tokens: usize,
    loaded: std::sync::Mutex<Option<(String, Llama<CudaBackend>)>>,
}

impl ReferencePrefill {
    /// A timer on device `ordinal` with `block_tokens` tokens per KV block.
    pub fn new(ordinal: usize, block_tokens: usize) -> Self {
        Self { ordinal, block_tokens, loaded: std::sync::Mutex::new(None) }
    }
}

impl PrefillTimer for ReferencePrefill {
    fn prefill_ms(&self, model: &str, tokens: usize) -> Result<f64, String> {
        let shape = ModelShape::named(model).ok_or_else(|| format!("unknown model shape {model:?}"))?;
        let mut loaded = self.loaded.lock().map_err(|_| "prefill timer poisoned".to_string())?;
        if loaded.as_ref().map(|(name, _)| name.as_str()) != Some(model) {
            *loaded = None;
            let weights = HostWeights::random(shape, 0);
            let backend = CudaBackend::new(self.ordinal).map_err(|e| e.to_string())?;
            let llama = Llama::new(backend, &weights).map_err(|e| e.to_string())?;
            *loaded = Some((model.to_string(), llama));
        }
        let (_, llama) = loaded.as_ref().expect("just loaded");
        let b = self.block_tokens;
        let blocks = tokens.div_ceil(b);
        let table: Vec<u32> = (0..blocks as u32).collect();
        let prompt: Vec<u32> = (0..tokens as u32).map(|i| (i.wrapping_mul(7919) + 13) % shape.vocab as u32).collect();
        let mut kv = llama.kv_pool(b, blocks).map_err(|e| e.to_string())?;
        let warm = tokens.min(256);
        llama.forward(&mut kv, &prompt[..warm], 0, &table, b).map_err(|e| e.to_string())?;
        let start = std::time::Instant::now();
        llama.forward(&mut kv, &prompt, 0, &table, b).map_err(|e| e.to_string())?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    }
}
