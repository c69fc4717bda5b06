//! The CPU backend: `f32` everywhere, the KV pool in host memory ([`HostKvPool`]), GEMMs over
//! weights packed once at upload ([`crate::gemm`]), work split across threads by rows or by output
//! columns — never along a reduction — so that every output value is computed by the same sequence
//! of operations however many rows a call holds. That is the determinism contract of [`Backend`], and what makes a prefix
//! loaded from any tier give bitwise the logits of a recomputed one.

use std::time::{Duration, Instant};

use crate::backend::{AttentionSpec, Backend, FinishedCopies, KernelError, SeqBatch};
use crate::gemm::{self, Bf16};
use crate::kv_layout::{HostKvPool, PagedLayout};

/// A weight tensor in host memory, `[rows, cols]`: a vector (one row) as it is, a matrix packed
/// in the GEMM's panels ([`crate::gemm::pack`]) — as bf16 when every value is one (a bf16
/// checkpoint), which halves what a decode step reads and changes no result.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuWeight {
    /// Rows (output features).
    pub rows: usize,
    /// Columns (input features).
    pub cols: usize,
    data: Data,
}

#[derive(Clone, Debug, PartialEq)]
enum Data {
    /// A vector, or a matrix packed as `f32`.
    F32(Vec<f32>),
    /// A matrix of bf16 values, packed as bf16.
    Bf16(Vec<Bf16>),
}

impl CpuWeight {
    /// Row `r`, `cols` values.
    pub fn row(&self, r: usize) -> Vec<f32> {
        let mut out = vec![0.0; self.cols];
        self.row_into(r, &mut out);
        out
    }

    /// Whether a matrix is kept as bf16.
    pub fn is_bf16(&self) -> bool {
        matches!(self.data, Data::Bf16(_))
    }

    /// Bytes its values take in memory.
    pub fn bytes(&self) -> usize {
        match &self.data {
            Data::F32(v) => v.len() * 4,
            Data::Bf16(v) => v.len() * 2,
        }
    }

    fn row_into(&self, r: usize, out: &mut [f32]) {
        match &self.data {
            Data::F32(v) if self.rows == 1 => out[..self.cols].copy_from_slice(&v[..self.cols]),
            Data::F32(v) => gemm::unpack_row(v, self.cols, r, out),
            Data::Bf16(v) => gemm::unpack_row(v, self.cols, r, out),
        }
    }

    /// The values of a vector (`rows == 1`, always kept as `f32`).
    fn vector(&self) -> Option<&[f32]> {
        match &self.data {
            Data::F32(v) if self.rows == 1 => Some(v),
            _ => None,
        }
    }
}

/// The CPU backend.
#[derive(Clone, Debug)]
pub struct CpuBackend {
    threads: usize,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
    }
}

/// Below this many multiply-adds a GEMM runs on one thread: spawning costs more than it saves.
const PARALLEL_MIN_FLOPS: usize = 1 << 20;

impl CpuBackend {
    /// A backend that uses up to `threads` threads per call.
    pub fn new(threads: usize) -> Self {
        Self { threads: threads.max(1) }
    }

    /// Threads per call.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// `out[rows, n] = x[rows, k] · wᵀ` over packed weights, split across the threads.
    fn gemm<W: gemm::Elem>(&self, x: &[f32], rows: usize, k: usize, packed: &[W], n: usize, out: &mut [f32]) {
        let work = rows * k * n;
        let panels = n.div_ceil(gemm::NR);
        let dst = SharedMut(out.as_mut_ptr());
        // Each thread reads its share of what dominates: with more rows than output columns (a
        // prefill through a narrow layer) the rows, otherwise the weights — a decode batch of a
        // few rows through a wide matrix reads every weight once, however many rows it holds.
        if rows >= self.threads && rows > n {
            self.split(rows, work, |range| {
                let (r0, r1) = (range.start, range.end);
                let out = gemm::Out { ptr: dst.at(r0 * n), stride: n };
                // SAFETY: this range writes rows r0..r1 of `out` (rows × n elements, checked by
                // the caller), which no other range touches.
                unsafe { gemm::gemm(&x[r0 * k..r1 * k], r1 - r0, k, packed, n, 0..panels, out) };
            });
        } else {
            self.split(panels, work, |range| {
                let out = gemm::Out { ptr: dst.at(0), stride: n };
                // SAFETY: this range writes the columns of its panels in every row of `out`, which
                // no other range touches.
                unsafe { gemm::gemm(&x[..rows * k], rows, k, packed, n, range, out) };
            });
        }
    }

    /// Runs `f(chunk_index, range)` over `0..n` split into at most `self.threads` contiguous ranges.
    fn split<F>(&self, n: usize, work: usize, f: F)
    where
        F: Fn(std::ops::Range<usize>) + Sync,
    {
        let parts = if work < PARALLEL_MIN_FLOPS { 1 } else { self.threads.min(n).max(1) };
        if parts == 1 {
            f(0..n);
            return;
        }
        let per = n.div_ceil(parts);
        std::thread::scope(|s| {
            for p in 1..parts {
                let range = (p * per).min(n)..((p + 1) * per).min(n);
                let f = &f;
                s.spawn(move || f(range));
            }
            f(0..per.min(n));
        });
    }
}

fn check_len(op: &'static str, what: &str, have: usize, need: usize) -> Result<(), KernelError> {
    if have < need {
        return Err(KernelError::shape(op, format!("{what} has {have} elements, needs {need}")));
    }
    Ok(())
}

/// A raw pointer that may cross into scoped threads which write disjoint parts of its buffer.
#[derive(Clone, Copy)]
struct SharedMut(*mut f32);
// SAFETY: used only inside `std::thread::scope`, where each thread writes a disjoint range of the
// buffer the pointer came from, and the buffer outlives the scope.
unsafe impl Send for SharedMut {}
// SAFETY: as above.
unsafe impl Sync for SharedMut {}

impl SharedMut {
    /// The pointer to element `offset` (inside the buffer: the callers' ranges are checked).
    fn at(&self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }

    /// `len` elements from `offset`, writable.
    ///
    /// # Safety
    /// The range must lie inside the buffer and no other thread may access it meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, offset: usize, len: usize) -> &mut [f32] {
        // SAFETY: the caller guarantees `offset` is inside the buffer.
        let start = unsafe { self.0.add(offset) };
        // SAFETY: the caller guarantees the range is in bounds and exclusively ours.
        unsafe { std::slice::from_raw_parts_mut(start, len) }
    }
}

impl Backend for CpuBackend {
    type Buf = Vec<f32>;
    type Weight = CpuWeight;
    type Kv = HostKvPool;
    type Copies = FinishedCopies;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn kv_elem_bytes(&self) -> usize {
        4
    }

    fn weight(&self, data: &[f32], rows: usize, cols: usize) -> Result<CpuWeight, KernelError> {
        if data.len() != rows * cols {
            return Err(KernelError::shape("weight", format!("{} elements for {rows}×{cols}", data.len())));
        }
        let data = match rows {
            1 => Data::F32(data.to_vec()),
            _ => gemm::pack_bf16(data, rows, cols).map_or_else(|| Data::F32(gemm::pack(data, rows, cols)), Data::Bf16),
        };
        Ok(CpuWeight { rows, cols, data })
    }

    fn zeros(&self, len: usize) -> Result<Vec<f32>, KernelError> {
        Ok(vec![0.0; len])
    }

    fn upload(&self, data: &[f32]) -> Result<Vec<f32>, KernelError> {
        Ok(data.to_vec())
    }

    fn download(&self, buf: &Vec<f32>, out: &mut [f32]) -> Result<(), KernelError> {
        check_len("download", "buffer", buf.len(), out.len())?;
        out.copy_from_slice(&buf[..out.len()]);
        Ok(())
    }

    fn download_owned(&self, mut buf: Vec<f32>, len: usize) -> Result<Vec<f32>, KernelError> {
        check_len("download_owned", "buffer", buf.len(), len)?;
        buf.truncate(len);
        Ok(buf)
    }

    fn embed(&self, table: &CpuWeight, tokens: &[u32], out: &mut Vec<f32>) -> Result<(), KernelError> {
        let dim = table.cols;
        check_len("embed", "out", out.len(), tokens.len() * dim)?;
        for (t, &tok) in tokens.iter().enumerate() {
            let tok = tok as usize;
            if tok >= table.rows {
                return Err(KernelError::index("embed", format!("token {tok} of a {}-token vocabulary", table.rows)));
            }
            table.row_into(tok, &mut out[t * dim..(t + 1) * dim]);
        }
        Ok(())
    }

    fn rmsnorm(
        &self,
        x: &Vec<f32>,
        w: &CpuWeight,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Vec<f32>,
    ) -> Result<(), KernelError> {
        check_len("rmsnorm", "x", x.len(), rows * dim)?;
        check_len("rmsnorm", "out", out.len(), rows * dim)?;
        let Some(gain) = w.vector().filter(|v| v.len() == dim) else {
            let elements = w.rows * w.cols;
            return Err(KernelError::shape("rmsnorm", format!("weight has {elements} elements for dim {dim}")));
        };
        for r in 0..rows {
            let row = &x[r * dim..(r + 1) * dim];
            let ms = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for ((o, v), g) in out[r * dim..(r + 1) * dim].iter_mut().zip(row).zip(gain) {
                *o = v * inv * g;
            }
        }
        Ok(())
    }

    fn matmul(&self, x: &Vec<f32>, rows: usize, w: &CpuWeight, out: &mut Vec<f32>) -> Result<(), KernelError> {
        let (k, n) = (w.cols, w.rows);
        check_len("matmul", "x", x.len(), rows * k)?;
        check_len("matmul", "out", out.len(), rows * n)?;
        // A one-row weight is kept as it is; the GEMM wants it packed (it is small).
        match &w.data {
            Data::F32(v) if w.rows == 1 => self.gemm(x, rows, k, &gemm::pack(v, 1, k), n, out),
            Data::F32(packed) => self.gemm(x, rows, k, packed, n, out),
            Data::Bf16(packed) => self.gemm(x, rows, k, packed, n, out),
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        rows: usize,
        heads: usize,
        head_dim: usize,
        positions: &[u32],
        inv_freq: &[f32],
    ) -> Result<(), KernelError> {
        check_len("rope", "x", x.len(), rows * heads * head_dim)?;
        if positions.len() != rows || !head_dim.is_multiple_of(2) || inv_freq.len() != head_dim / 2 {
            return Err(KernelError::shape(
                "rope",
                format!(
                    "{} positions for {rows} rows, head_dim {head_dim}, {} frequencies",
                    positions.len(),
                    inv_freq.len()
                ),
            ));
        }
        let half = head_dim / 2;
        for (r, &pos) in positions.iter().enumerate() {
            // The angle is an f32 product, as in `transformers`; its sine and cosine are exact.
            let (sin, cos): (Vec<f32>, Vec<f32>) = inv_freq
                .iter()
                .map(|&f| {
                    let a = f64::from(pos as f32 * f);
                    (a.sin() as f32, a.cos() as f32)
                })
                .unzip();
            for h in 0..heads {
                let base = (r * heads + h) * head_dim;
                for i in 0..half {
                    let (x0, x1) = (x[base + i], x[base + i + half]);
                    x[base + i] = x0 * cos[i] - x1 * sin[i];
                    x[base + i + half] = x1 * cos[i] + x0 * sin[i];
                }
            }
        }
        Ok(())
    }

    fn swiglu(&self, gate: &Vec<f32>, up: &Vec<f32>, len: usize, out: &mut Vec<f32>) -> Result<(), KernelError> {
        check_len("swiglu", "gate", gate.len(), len)?;
        check_len("swiglu", "up", up.len(), len)?;
        check_len("swiglu", "out", out.len(), len)?;
        for ((o, g), u) in out[..len].iter_mut().zip(&gate[..len]).zip(&up[..len]) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
        Ok(())
    }

    fn add_bias(&self, x: &mut Vec<f32>, bias: &CpuWeight, rows: usize, cols: usize) -> Result<(), KernelError> {
        check_len("add_bias", "x", x.len(), rows * cols)?;
        let Some(bias) = bias.vector().filter(|v| v.len() == cols) else {
            let elements = bias.rows * bias.cols;
            return Err(KernelError::shape("add_bias", format!("bias has {elements} elements for {cols} columns")));
        };
        for row in x[..rows * cols].chunks_exact_mut(cols.max(1)) {
            for (a, b) in row.iter_mut().zip(bias) {
                *a += b;
            }
        }
        Ok(())
    }

    fn add_assign(&self, x: &mut Vec<f32>, y: &Vec<f32>, len: usize) -> Result<(), KernelError> {
        check_len("add_assign", "x", x.len(), len)?;
        check_len("add_assign", "y", y.len(), len)?;
        for (a, b) in x[..len].iter_mut().zip(&y[..len]) {
            *a += b;
        }
        Ok(())
    }

    fn kv_pool(&self, layout: PagedLayout, num_blocks: usize) -> Result<HostKvPool, KernelError> {
        if layout.elem_bytes != 4 {
            return Err(KernelError::shape(
                "kv_pool",
                format!("the CPU pool holds f32, not {}-byte elements", layout.elem_bytes),
            ));
        }
        Ok(HostKvPool::new(layout, num_blocks))
    }

    fn kv_write(
        &self,
        kv: &mut HostKvPool,
        layer: usize,
        k: &Vec<f32>,
        v: &Vec<f32>,
        slots: &[u32],
    ) -> Result<(), KernelError> {
        let layout = kv.layout();
        let width = layout.kv_heads * layout.head_dim;
        check_len("kv_write", "k", k.len(), slots.len() * width)?;
        check_len("kv_write", "v", v.len(), slots.len() * width)?;
        if layer >= layout.layers {
            return Err(KernelError::index("kv_write", format!("layer {layer} of {}", layout.layers)));
        }
        let b = layout.block_tokens;
        for (r, &slot) in slots.iter().enumerate() {
            let (block, off) = (slot as usize / b, slot as usize % b);
            if block >= kv.num_blocks() {
                return Err(KernelError::index(
                    "kv_write",
                    format!("slot {slot} in a pool of {} blocks", kv.num_blocks()),
                ));
            }
            for (is_v, src) in [(false, k), (true, v)] {
                kv.page_f32_mut(layer, is_v, block as u32)[off * width..(off + 1) * width]
                    .copy_from_slice(&src[r * width..(r + 1) * width]);
            }
        }
        Ok(())
    }

    fn attention_batch(
        &self,
        q: &Vec<f32>,
        kv: &HostKvPool,
        layer: usize,
        spec: AttentionSpec,
        seqs: SeqBatch<'_>,
        positions: &[u32],
        out: &mut Vec<f32>,
    ) -> Result<(), KernelError> {
        let AttentionSpec { heads, kv_heads, head_dim, block_tokens } = spec;
        let rows = positions.len();
        check_len("attention", "q", q.len(), rows * heads * head_dim)?;
        check_len("attention", "out", out.len(), rows * heads * head_dim)?;
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(KernelError::shape("attention", format!("{heads} heads over {kv_heads} kv heads")));
        }
        let layout = kv.layout();
        if layout.block_tokens != block_tokens || layout.kv_heads != kv_heads || layout.head_dim != head_dim {
            return Err(KernelError::shape("attention", "spec does not match the pool's layout"));
        }
        if layer >= layout.layers {
            return Err(KernelError::index("attention", format!("layer {layer} of {}", layout.layers)));
        }
        seqs.check("attention", positions, block_tokens, kv.num_blocks())?;
        // The block table of every row.
        let mut row_tables: Vec<&[u32]> = Vec::with_capacity(rows);
        for s in 0..seqs.len() {
            let table = seqs.table(s);
            row_tables.extend(seqs.rows(s).map(|_| table));
        }
        let group = heads / kv_heads;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let width = kv_heads * head_dim;
        let dst = SharedMut(out.as_mut_ptr());
        let longest = positions.iter().map(|&p| p as usize + 1).max().unwrap_or(0);
        let work = rows * heads * longest * head_dim * 2;
        self.split(rows * heads, work, |range| {
            let mut scores = Vec::with_capacity(longest);
            let mut acc = vec![0.0f32; head_dim];
            for item in range {
                let (r, h) = (item / heads, item % heads);
                let g = h / group;
                let qv = &q[(r * heads + h) * head_dim..(r * heads + h + 1) * head_dim];
                let len = positions[r] as usize + 1;
                scores.clear();
                let mut max = f32::NEG_INFINITY;
                let block_table = row_tables[r];
                for p in 0..len {
                    let page = kv.page_f32(layer, false, block_table[p / block_tokens]);
                    let at = (p % block_tokens) * width + g * head_dim;
                    let s = qv.iter().zip(&page[at..at + head_dim]).map(|(a, b)| a * b).sum::<f32>() * scale;
                    max = max.max(s);
                    scores.push(s);
                }
                let mut total = 0.0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    total += *s;
                }
                acc.fill(0.0);
                for (p, s) in scores.iter().enumerate() {
                    let page = kv.page_f32(layer, true, block_table[p / block_tokens]);
                    let at = (p % block_tokens) * width + g * head_dim;
                    let w = s / total;
                    for (a, v) in acc.iter_mut().zip(&page[at..at + head_dim]) {
                        *a += w * v;
                    }
                }
                // SAFETY: item (r, h) owns out[(r*heads+h)*head_dim ..][..head_dim]; items are
                // disjoint across ranges, and `out` holds rows × heads × head_dim (checked above).
                let o = unsafe { dst.slice((r * heads + h) * head_dim, head_dim) };
                o.copy_from_slice(&acc);
            }
        });
        Ok(())
    }

    fn kv_gather(&self, kv: &HostKvPool, blocks: &[u32], out: &mut [&mut [u8]]) -> Result<(), KernelError> {
        Ok(kv.gather(blocks, out)?)
    }

    fn kv_scatter(&self, kv: &mut HostKvPool, blocks: &[u32], payloads: &[&[u8]]) -> Result<(), KernelError> {
        Ok(kv.scatter(blocks, payloads)?)
    }

    /// The CPU has no copy engine: the gather runs before this returns.
    unsafe fn kv_gather_start(
        &self,
        kv: &HostKvPool,
        blocks: &[u32],
        out: &mut [&mut [u8]],
    ) -> Result<FinishedCopies, KernelError> {
        let started = Instant::now();
        self.kv_gather(kv, blocks, out)?;
        Ok(FinishedCopies(started.elapsed()))
    }

    /// The CPU has no copy engine: the scatter runs before this returns.
    unsafe fn kv_scatter_start(
        &self,
        kv: &mut HostKvPool,
        blocks: &[u32],
        payloads: &[&[u8]],
    ) -> Result<FinishedCopies, KernelError> {
        let started = Instant::now();
        self.kv_scatter(kv, blocks, payloads)?;
        Ok(FinishedCopies(started.elapsed()))
    }

    fn copies_done(&self, _: &FinishedCopies) -> Result<bool, KernelError> {
        Ok(true)
    }

    fn copies_wait(&self, copies: FinishedCopies) -> Result<Duration, KernelError> {
        Ok(copies.0)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    use crate::test_data::rand_vec;

    #[test]
    fn matmul_matches_naive_dot_products() {
        let cpu = CpuBackend::new(2);
        let (rows, k, n) = (5, 33, 7);
        let x = rand_vec(1, rows * k);
        let w = cpu.weight(&rand_vec(2, n * k), n, k).expect("weight");
        let mut out = vec![0.0; rows * n];
        cpu.matmul(&x, rows, &w, &mut out).expect("matmul");
        for r in 0..rows {
            for c in 0..n {
                let row = w.row(c);
                let want: f32 = (0..k).map(|i| x[r * k + i] * row[i]).sum();
                assert!((out[r * n + c] - want).abs() < 1e-4, "({r},{c}): {} vs {want}", out[r * n + c]);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// The determinism contract: a row's result does not depend on the other rows in the call
        /// or on the thread split (the whole batch, one row alone, any sub-batch — bitwise equal).
        #[test]
        fn matmul_rows_are_bitwise_independent_of_the_batch(
            rows in 1usize..40, k in 1usize..300, n in 1usize..300, start in 0usize..40, seed in any::<u64>(),
        ) {
            let start = start % rows;
            let cpu1 = CpuBackend::new(1);
            let cpu4 = CpuBackend::new(4);
            let x = rand_vec(seed, rows * k);
            let w = cpu1.weight(&rand_vec(seed ^ 7, n * k), n, k).expect("weight");
            let mut whole = vec![0.0; rows * n];
            cpu4.matmul(&x, rows, &w, &mut whole).expect("matmul");
            let tail = x[start * k..].to_vec();
            let mut part = vec![0.0; (rows - start) * n];
            cpu1.matmul(&tail, rows - start, &w, &mut part).expect("matmul");
            prop_assert!(whole[start * n..].iter().zip(&part).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn big_matmuls_split_by_rows_and_columns_bitwise_alike() {
        let (k, n) = (512, 1024);
        let w = CpuBackend::new(1).weight(&rand_vec(3, n * k), n, k).expect("weight");
        let x = rand_vec(4, 8 * k);
        let mut single = vec![0.0; 8 * n];
        CpuBackend::new(1).matmul(&x, 8, &w, &mut single).expect("matmul");
        for threads in [2, 3, 8, 16] {
            let mut multi = vec![0.0; 8 * n];
            CpuBackend::new(threads).matmul(&x, 8, &w, &mut multi).expect("matmul");
            assert!(single.iter().zip(&multi).all(|(a, b)| a.to_bits() == b.to_bits()), "{threads} threads");
            let mut one = vec![0.0; n];
            CpuBackend::new(threads).matmul(&x[3 * k..4 * k].to_vec(), 1, &w, &mut one).expect("decode row");
            assert!(single[3 * n..4 * n].iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn rmsnorm_rope_swiglu_reference_values() {
        let cpu = CpuBackend::new(1);
        let w = cpu.weight(&[1.0, 2.0], 1, 2).expect("w");
        let mut out = vec![0.0; 2];
        cpu.rmsnorm(&vec![3.0, 4.0], &w, 1, 2, 0.0, &mut out).expect("rmsnorm");
        let inv = 1.0 / (12.5f32).sqrt();
        assert_eq!(out, vec![3.0 * inv, 8.0 * inv]);

        // Position 0 is the identity; position p rotates pair (i, i+half) by p·θ^(-2i/d).
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        cpu.rope(&mut x, 1, 1, 4, &[0], &crate::backend::rope_inv_freq(10000.0, 4)).expect("rope");
        assert_eq!(x, vec![1.0, 2.0, 3.0, 4.0]);
        let mut x = vec![1.0, 0.0, 0.0, 0.0];
        cpu.rope(&mut x, 1, 1, 4, &[1], &crate::backend::rope_inv_freq(10000.0, 4)).expect("rope");
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[2] - 1f32.sin()).abs() < 1e-6);

        let mut o = vec![0.0; 1];
        cpu.swiglu(&vec![1.0], &vec![2.0], 1, &mut o).expect("swiglu");
        assert!((o[0] - 2.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn attention_attends_causally_over_the_block_table() {
        let cpu = CpuBackend::new(2);
        let spec = AttentionSpec { heads: 4, kv_heads: 2, head_dim: 8, block_tokens: 4 };
        let layout = PagedLayout { layers: 1, block_tokens: 4, kv_heads: 2, head_dim: 8, elem_bytes: 4 };
        let mut kv = cpu.kv_pool(layout, 8).expect("pool");
        let tokens = 10;
        let table = [6u32, 1, 3];
        let slots: Vec<u32> = (0..tokens).map(|p| table[p / 4] * 4 + (p % 4) as u32).collect();
        let k = rand_vec(5, tokens * 16);
        let v = rand_vec(6, tokens * 16);
        cpu.kv_write(&mut kv, 0, &k, &v, &slots).expect("write");
        let q = rand_vec(7, tokens * 32);
        let positions: Vec<u32> = (0..tokens as u32).collect();
        let mut out = vec![0.0; tokens * 32];
        cpu.attention(&q, &kv, 0, spec, &table, &positions, &mut out).expect("attention");
        // Naive reference over contiguous K/V.
        for r in 0..tokens {
            for h in 0..4 {
                let g = h / 2;
                let qv = &q[(r * 4 + h) * 8..][..8];
                let s: Vec<f32> = (0..=r)
                    .map(|p| qv.iter().zip(&k[p * 16 + g * 8..][..8]).map(|(a, b)| a * b).sum::<f32>() / 8f32.sqrt())
                    .collect();
                let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for d in 0..8 {
                    let want: f32 = (0..=r).map(|p| e[p] / z * v[p * 16 + g * 8 + d]).sum();
                    assert!((out[(r * 4 + h) * 8 + d] - want).abs() < 1e-5);
                }
            }
        }
        // A decode step of the last row alone is bitwise the same as within the batch.
        let mut one = vec![0.0; 32];
        cpu.attention(&q[9 * 32..].to_vec(), &kv, 0, spec, &table, &[9], &mut one).expect("decode");
        assert!(one.iter().zip(&out[9 * 32..]).all(|(a, b)| a.to_bits() == b.to_bits()));
        // Out-of-range positions and blocks are errors, not reads.
        assert_eq!(cpu.attention(&q, &kv, 0, spec, &table[..2], &positions, &mut out).unwrap_err().kind(), "index");
        assert_eq!(cpu.attention(&q, &kv, 0, spec, &[6, 1, 99], &positions, &mut out).unwrap_err().kind(), "index");
    }

    #[test]
    fn batched_attention_reads_each_sequence_through_its_own_table_bitwise_as_alone() {
        let cpu = CpuBackend::new(2);
        let spec = AttentionSpec { heads: 4, kv_heads: 2, head_dim: 8, block_tokens: 4 };
        let layout = PagedLayout { layers: 1, block_tokens: 4, kv_heads: 2, head_dim: 8, elem_bytes: 4 };
        let mut kv = cpu.kv_pool(layout, 12).expect("pool");
        // Sequence a: 10 tokens in blocks [6, 1, 3]; sequence b: 7 tokens in blocks [0, 9].
        let (ta, tb) = ([6u32, 1, 3], [0u32, 9]);
        for (table, tokens, seed) in [(&ta[..], 10usize, 5u64), (&tb[..], 7, 8)] {
            let slots: Vec<u32> = (0..tokens).map(|p| table[p / 4] * 4 + (p % 4) as u32).collect();
            let (k, v) = (rand_vec(seed, tokens * 16), rand_vec(seed + 1, tokens * 16));
            cpu.kv_write(&mut kv, 0, &k, &v, &slots).expect("write");
        }
        // One batch: a prefill chunk of a (rows at 6..10) and a decode row of b (at 6).
        let qa = rand_vec(20, 4 * 32);
        let qb = rand_vec(21, 32);
        let q: Vec<f32> = qa.iter().chain(&qb).copied().collect();
        let positions = [6u32, 7, 8, 9, 6];
        let tables: Vec<u32> = ta.iter().chain(&tb).copied().collect();
        let seqs = SeqBatch { row_starts: &[0, 4, 5], table_starts: &[0, 3, 5], tables: &tables };
        let mut out = vec![0.0; 5 * 32];
        cpu.attention_batch(&q, &kv, 0, spec, seqs, &positions, &mut out).expect("batch");
        let mut alone_a = vec![0.0; 4 * 32];
        cpu.attention(&qa, &kv, 0, spec, &ta, &positions[..4], &mut alone_a).expect("a");
        let mut alone_b = vec![0.0; 32];
        cpu.attention(&qb, &kv, 0, spec, &tb, &positions[4..], &mut alone_b).expect("b");
        let alone: Vec<u32> = alone_a.iter().chain(&alone_b).map(|x| x.to_bits()).collect();
        assert_eq!(out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), alone);
        // Malformed batches are errors.
        let bad = SeqBatch { row_starts: &[0, 4, 4], table_starts: &[0, 3, 5], tables: &tables };
        assert_eq!(cpu.attention_batch(&q, &kv, 0, spec, bad, &positions, &mut out).unwrap_err().kind(), "shape");
        let short = SeqBatch { row_starts: &[0, 4, 5], table_starts: &[0, 3, 4], tables: &tables };
        assert_eq!(cpu.attention_batch(&q, &kv, 0, spec, short, &positions, &mut out).unwrap_err().kind(), "index");
    }
}
