//! The CPU backend's GEMM, `out[rows, n] = x[rows, k] · w[n, k]ᵀ`, over weights packed once when
//! they are uploaded: panels of [`NR`] output features, interleaved along `k`, so that a decode
//! step streams every weight once and repacks nothing (a general GEMM library packs its operands
//! on every call, which costs a decode step more than the multiply itself).
//!
//! Every output is one chain of fused multiply-adds over `k` in order, from zero, whatever the
//! number of rows, the blocking or the thread that computes it: a row's result does not depend on
//! its batch mates, bitwise (the determinism contract of [`crate::Backend`]). Blocking along `k`
//! stores the partial sums and resumes from them, which changes nothing either: an `f32` in
//! memory is the `f32` that was in the register.
//!
//! The loops are plain Rust that the compiler vectorises; they are compiled three times — for
//! AVX-512, for AVX2 with FMA, and portable — and the best the CPU supports is picked once. All
//! three compute the same bits (`mul_add` is exactly rounded on every path).
//!
//! A matrix whose every value is a bf16 (a bf16 checkpoint, widened to `f32` when it was read) is
//! packed as bf16 ([`pack_bf16`]) and widened back in registers as it streams by: the values,
//! and so every output bit, are those of the `f32` panels, and a decode step, which reads every
//! weight once and is bound by memory, reads half the bytes.

use std::ops::Range;
use std::sync::OnceLock;

/// Output features per panel.
pub(crate) const NR: usize = 32;
/// Rows per register tile at most (each kernel says how many it keeps in registers).
const MR: usize = 6;
/// `k` per block: a panel's block (32 KiB) stays in L1.
const KC: usize = 256;
/// Rows per block: their `k` block (up to 128 KiB) stays in L2 while the panels stream by.
const MC: usize = 128;

/// An element of packed panels: an `f32`, or a [`Bf16`] (widened exactly).
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    /// Whether it is a [`Bf16`] (the vector kernels load and widen it so).
    const BF16: bool;
    /// Zero, the padding of a last panel.
    const ZERO: Self;
    /// Its value.
    fn widen(self) -> f32;
}

impl Elem for f32 {
    const BF16: bool = false;
    const ZERO: Self = 0.0;

    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

/// A bfloat16: the upper half of an `f32`'s bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct Bf16(u16);

impl Bf16 {
    /// `v` as a bf16 if that is exact (its lower 16 bits are zero).
    pub(crate) fn exact(v: f32) -> Option<Self> {
        let bits = v.to_bits();
        (bits & 0xffff == 0).then_some(Bf16((bits >> 16) as u16))
    }
}

impl Elem for Bf16 {
    const BF16: bool = true;
    const ZERO: Self = Bf16(0);

    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
}

/// Packs row-major `w[n, k]` into panels: element `(c, kk)` at `(c / NR) * NR * k + kk * NR + c % NR`,
/// the last panel padded with zeros.
pub(crate) fn pack(w: &[f32], n: usize, k: usize) -> Vec<f32> {
    pack_as(w, n, k, |v| v)
}

/// [`pack`] as bf16, if every value of `w` is one exactly; `None` otherwise.
pub(crate) fn pack_bf16(w: &[f32], n: usize, k: usize) -> Option<Vec<Bf16>> {
    w[..n * k].iter().all(|&v| Bf16::exact(v).is_some()).then(|| pack_as(w, n, k, |v| Bf16((v.to_bits() >> 16) as u16)))
}

fn pack_as<W: Elem>(w: &[f32], n: usize, k: usize, elem: impl Fn(f32) -> W) -> Vec<W> {
    let mut packed = huge_vec(n.div_ceil(NR) * NR * k);
    for (c, row) in w.chunks_exact(k.max(1)).take(n).enumerate() {
        let panel = &mut packed[(c / NR) * NR * k..];
        for (kk, &v) in row.iter().enumerate() {
            panel[kk * NR + c % NR] = elem(v);
        }
    }
    packed
}

/// `len` zeros, in transparent huge pages where the kernel gives them: a decode step streams
/// every weight once, and with 4 KiB pages it waits on a TLB miss every 4 KiB.
fn huge_vec<W: Elem>(len: usize) -> Vec<W> {
    const HUGE: usize = 2 << 20;
    let mut v: Vec<W> = Vec::with_capacity(len);
    let bytes = len * std::mem::size_of::<W>();
    #[cfg(target_os = "linux")]
    if bytes >= 2 * HUGE {
        let start = (v.as_ptr() as usize).next_multiple_of(HUGE);
        let end = (v.as_ptr() as usize + bytes) & !(HUGE - 1);
        // SAFETY: `start..end` lies inside the vector's allocation (rounded inwards to whole huge
        // pages), which nothing has touched yet; MADV_HUGEPAGE only changes how it is backed.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
    v.resize(len, W::ZERO);
    v
}

/// Row `c` of a packed `[n, k]` matrix into `out[..k]`.
pub(crate) fn unpack_row<W: Elem>(packed: &[W], k: usize, c: usize, out: &mut [f32]) {
    let panel = &packed[(c / NR) * NR * k..];
    for (kk, o) in out[..k].iter_mut().enumerate() {
        *o = panel[kk * NR + c % NR].widen();
    }
}

/// Where a GEMM writes: row `r`, column `c` of the call's output at `ptr + r * stride + c`.
#[derive(Clone, Copy)]
pub(crate) struct Out {
    pub ptr: *mut f32,
    pub stride: usize,
}

/// Computes the output columns of `panels` for `rows` rows of `x` (`[rows, k]`, row-major) against
/// the packed `[n, k]` weights.
///
/// # Safety
/// `out` must be valid for writes of every `(r, c)` with `r < rows` and `c` a column of `panels`
/// below `n`, and nothing else may access those elements during the call.
pub(crate) unsafe fn gemm<W: Elem>(
    x: &[f32],
    rows: usize,
    k: usize,
    packed: &[W],
    n: usize,
    panels: Range<usize>,
    out: Out,
) {
    assert!(x.len() >= rows * k && packed.len() >= n.div_ceil(NR) * NR * k && panels.end <= n.div_ceil(NR));
    match *level() {
        // SAFETY: the CPU has AVX-512F (checked once in `level`); the caller's guarantee is passed on.
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => unsafe { gemm_avx512(x, rows, k, packed, n, panels, out) },
        // SAFETY: the CPU has AVX2 and FMA (checked once in `level`); as above.
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => unsafe { gemm_avx2(x, rows, k, packed, n, panels, out) },
        // SAFETY: the caller's guarantee is passed on; the portable tiles run anywhere.
        Level::Portable => unsafe { gemm_body(x, rows, k, packed, n, panels, out, Portable) },
    }
}

enum Level {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

fn level() -> &'static Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    LEVEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Level::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                return Level::Avx2;
            }
        }
        Level::Portable
    })
}

/// # Safety
/// As [`gemm`], on a CPU with AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gemm_avx512<W: Elem>(
    x: &[f32],
    rows: usize,
    k: usize,
    packed: &[W],
    n: usize,
    panels: Range<usize>,
    out: Out,
) {
    // SAFETY: as this function's; the tiles run on AVX-512F, which the CPU has.
    unsafe { gemm_body(x, rows, k, packed, n, panels, out, simd::Avx512) }
}

/// # Safety
/// As [`gemm`], on a CPU with AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemm_avx2<W: Elem>(x: &[f32], rows: usize, k: usize, packed: &[W], n: usize, panels: Range<usize>, out: Out) {
    // SAFETY: as this function's; the tiles run on AVX2 and FMA, which the CPU has.
    unsafe { gemm_body(x, rows, k, packed, n, panels, out, simd::Avx2) }
}

/// Runs tile `t` with `m` rows, at most the kernel's [`Kernel::ROWS`], through `kernel`; answers
/// the rows it ran.
#[inline(always)]
fn tiles<K: Kernel, W: Elem>(t: Tile<'_, W>, m: usize, kernel: K) -> usize {
    match m.min(K::ROWS) {
        6 => t.run::<6>(kernel),
        5 => t.run::<5>(kernel),
        4 => t.run::<4>(kernel),
        3 => t.run::<3>(kernel),
        2 => t.run::<2>(kernel),
        _ => t.run::<1>(kernel),
    }
}

/// # Safety
/// As [`gemm`]; `kernel` must be able to run on this CPU.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_body<W: Elem>(
    x: &[f32],
    rows: usize,
    k: usize,
    packed: &[W],
    n: usize,
    panels: Range<usize>,
    out: Out,
    kernel: impl Kernel,
) {
    let block = |k0: usize, r0: usize, p: usize| {
        let (kc, mc) = (KC.min(k - k0), MC.min(rows - r0));
        let panel = &packed[p * NR * k + k0 * NR..p * NR * k + (k0 + kc) * NR];
        let (col, cols) = (p * NR, NR.min(n - p * NR));
        let mut m = r0;
        while m < r0 + mc {
            let t = Tile { x, k, k0, kc, panel, row: m, col, cols, first: k0 == 0, out };
            m += tiles(t, r0 + mc - m, kernel);
        }
    };
    if rows <= MC {
        // Few rows (a decode batch): each panel streams whole, from memory once, while the rows
        // (at most `MC × k`) stay in L2.
        for p in panels {
            for k0 in (0..k).step_by(KC) {
                block(k0, 0, p);
            }
        }
    } else {
        // Many rows (a prefill): a `k` block of `MC` rows stays in L2 while the panels stream by.
        for k0 in (0..k).step_by(KC) {
            for r0 in (0..rows).step_by(MC) {
                for p in panels.clone() {
                    block(k0, r0, p);
                }
            }
        }
    }
}

/// One register tile: rows `row..row + M` and the panel's `cols` columns from `col`, over the
/// `k` block `k0..k0 + kc`.
#[derive(Clone, Copy)]
struct Tile<'a, W> {
    x: &'a [f32],
    k: usize,
    k0: usize,
    kc: usize,
    panel: &'a [W],
    row: usize,
    col: usize,
    cols: usize,
    /// The first `k` block: the sums start from zero, not from what the output holds.
    first: bool,
    out: Out,
}

/// The inner loop of a tile: `acc[r][j] += x[row + r][k0 + kk] · panel[kk][j]` for every `kk` of
/// the block, in order, one fused multiply-add at a time.
trait Kernel: Copy {
    /// Rows of a tile it keeps in registers (at most [`MR`]).
    const ROWS: usize;
    fn run<const M: usize, W: Elem>(self, t: &Tile<'_, W>, acc: &mut [[f32; NR]; M]);
}

/// The portable inner loop.
#[derive(Clone, Copy)]
struct Portable;

impl Kernel for Portable {
    const ROWS: usize = MR;

    #[inline(always)]
    fn run<const M: usize, W: Elem>(self, t: &Tile<'_, W>, acc: &mut [[f32; NR]; M]) {
        for (r, acc) in acc.iter_mut().enumerate() {
            let x = t.x_row(r);
            for (kk, w) in t.panel.chunks_exact(NR).enumerate() {
                let v = x[kk];
                for (a, &w) in acc.iter_mut().zip(w) {
                    *a = v.mul_add(w.widen(), *a);
                }
            }
        }
    }
}

impl<W: Elem> Tile<'_, W> {
    /// Row `r` of the tile's `x`, over the `k` block.
    #[inline(always)]
    fn x_row(&self, r: usize) -> &[f32] {
        let start = (self.row + r) * self.k + self.k0;
        &self.x[start..start + self.kc]
    }

    /// Runs the tile with `kernel`; answers its rows.
    #[inline(always)]
    fn run<const M: usize>(self, kernel: impl Kernel) -> usize {
        let mut acc = [[0.0f32; NR]; M];
        let at = |r: usize, j: usize| (self.row + r) * self.out.stride + self.col + j;
        if !self.first {
            for (r, acc) in acc.iter_mut().enumerate() {
                for (j, a) in acc.iter_mut().enumerate().take(self.cols) {
                    // SAFETY: the element is the tile's: inside the call's rows and columns, which
                    // `gemm`'s caller vouches for.
                    *a = unsafe { *self.out.ptr.wrapping_add(at(r, j)) };
                }
            }
        }
        kernel.run::<M, W>(&self, &mut acc);
        for (r, acc) in acc.iter().enumerate() {
            for (j, &a) in acc.iter().enumerate().take(self.cols) {
                // SAFETY: as above.
                unsafe { *self.out.ptr.wrapping_add(at(r, j)) = a };
            }
        }
        M
    }
}

/// The inner loops in explicit vector instructions (the compiler does not keep a tile of several
/// rows in registers on its own).
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{Elem, Kernel, NR, Tile};

    /// 16 lanes of a panel row from `w[..16]`, widened to `f32`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn load16<W: Elem>(w: &[W]) -> __m512 {
        assert!(w.len() >= 16);
        if W::BF16 {
            // SAFETY: 16 bf16s (32 bytes) are in bounds (asserted).
            let half = unsafe { _mm256_loadu_si256(w.as_ptr().cast()) };
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(half)))
        } else {
            // SAFETY: 16 f32s are in bounds (asserted).
            unsafe { _mm512_loadu_ps(w.as_ptr().cast()) }
        }
    }

    /// 8 lanes of a panel row from `w[..8]`, widened to `f32`.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn load8<W: Elem>(w: &[W]) -> __m256 {
        assert!(w.len() >= 8);
        if W::BF16 {
            // SAFETY: 8 bf16s (16 bytes) are in bounds (asserted).
            let half = unsafe { _mm_loadu_si128(w.as_ptr().cast()) };
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(half)))
        } else {
            // SAFETY: 8 f32s are in bounds (asserted).
            unsafe { _mm256_loadu_ps(w.as_ptr().cast()) }
        }
    }

    /// How far ahead of its loads a tile asks for the panel's bytes. The hardware prefetcher stops
    /// at each 4 KiB page and a decode row's few multiply-adds per byte leave the loads waiting
    /// on memory; asking a page ahead doubles what one core streams (7 → 13 GB/s here; the
    /// kernels bench prints the decode GEMV against a plain read).
    const PREFETCH_BYTES: usize = 4096;

    /// Asks for the cache lines of the panel row at `w` [`PREFETCH_BYTES`] ahead. A hint: it
    /// never faults, so the address may run past the panel.
    #[inline(always)]
    fn prefetch<W: Elem>(w: &[W]) {
        let at = w.as_ptr().cast::<i8>().wrapping_add(PREFETCH_BYTES);
        for line in (0..NR * size_of::<W>()).step_by(64) {
            // SAFETY: a prefetch reads nothing architecturally and cannot fault, whatever the
            // address; SSE is part of x86_64.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(line)) };
        }
    }

    /// A panel row's 32 lanes in two AVX-512 registers per row: 6 rows keep 12 accumulators.
    #[derive(Clone, Copy)]
    pub(super) struct Avx512;

    impl Kernel for Avx512 {
        const ROWS: usize = 6;

        #[inline(always)]
        fn run<const M: usize, W: Elem>(self, t: &Tile<'_, W>, acc: &mut [[f32; NR]; M]) {
            // SAFETY: `Avx512` is only handed to the tiles by `gemm_avx512`, which runs only on a
            // CPU with AVX-512F.
            unsafe { avx512(t, acc) }
        }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn avx512<const M: usize, W: Elem>(t: &Tile<'_, W>, acc: &mut [[f32; NR]; M]) {
        const { assert!(NR == 32) };
        let rows: [&[f32]; M] = std::array::from_fn(|r| t.x_row(r));
        // SAFETY: each row of `acc` holds 32 floats: two loads of 16.
        let mut lo: [__m512; M] = std::array::from_fn(|r| unsafe { _mm512_loadu_ps(acc[r].as_ptr()) });
        // SAFETY: as above.
        let mut hi: [__m512; M] = std::array::from_fn(|r| unsafe { _mm512_loadu_ps(acc[r][16..].as_ptr()) });
        for (kk, w) in t.panel.chunks_exact(NR).enumerate() {
            prefetch(w);
            // A panel row holds 32 elements: two loads of 16.
            let (wl, wh) = (load16(w), load16(&w[16..]));
            for ((l, h), x) in lo.iter_mut().zip(hi.iter_mut()).zip(&rows) {
                let v = _mm512_set1_ps(x[kk]);
                *l = _mm512_fmadd_ps(v, wl, *l);
                *h = _mm512_fmadd_ps(v, wh, *h);
            }
        }
        for ((l, h), acc) in lo.iter().zip(&hi).zip(acc.iter_mut()) {
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(acc.as_mut_ptr(), *l) };
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(acc[16..].as_mut_ptr(), *h) };
        }
    }

    /// A panel row's 32 lanes in four AVX2 registers per row: 3 rows keep 12 accumulators (of
    /// the 16 registers).
    #[derive(Clone, Copy)]
    pub(super) struct Avx2;

    impl Kernel for Avx2 {
        const ROWS: usize = 3;

        #[inline(always)]
        fn run<const M: usize, W: Elem>(self, t: &Tile<'_, W>, acc: &mut [[f32; NR]; M]) {
            // SAFETY: `Avx2` is only handed to the tiles by `gemm_avx2`, which runs only on a CPU
            // with AVX2 and FMA.
            unsafe { avx2(t, acc) }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn avx2<const M: usize, W: Elem>(t: &Tile<'_, W>, acc: &mut [[f32; NR]; M]) {
        const { assert!(NR == 32) };
        let rows: [&[f32]; M] = std::array::from_fn(|r| t.x_row(r));
        // SAFETY: each row of `acc` holds 32 floats: four loads of 8.
        let mut regs: [[__m256; 4]; M] =
            std::array::from_fn(|r| std::array::from_fn(|q| unsafe { _mm256_loadu_ps(acc[r][8 * q..].as_ptr()) }));
        for (kk, w) in t.panel.chunks_exact(NR).enumerate() {
            prefetch(w);
            // A panel row holds 32 elements: four loads of 8.
            let w = [load8(w), load8(&w[8..]), load8(&w[16..]), load8(&w[24..])];
            for (regs, x) in regs.iter_mut().zip(&rows) {
                let v = _mm256_set1_ps(x[kk]);
                for (reg, w) in regs.iter_mut().zip(&w) {
                    *reg = _mm256_fmadd_ps(v, *w, *reg);
                }
            }
        }
        for (regs, acc) in regs.iter().zip(acc.iter_mut()) {
            for (q, reg) in regs.iter().enumerate() {
                // SAFETY: as above.
                unsafe { _mm256_storeu_ps(acc[8 * q..].as_mut_ptr(), *reg) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_data::rand_vec as rand;

    /// Every instruction set the CPU has computes the bits of the portable loop, across `k`
    /// blocks, row tiles and a padded last panel, in both loop orders (few rows and many).
    #[test]
    fn every_instruction_set_computes_the_same_bits() {
        for rows in [13, MC + 7] {
            same_bits_at(rows);
        }
    }

    fn same_bits_at(rows: usize) {
        let (k, n) = (2 * KC + 37, 3 * NR + 5);
        let (x, w) = (rand(1, rows * k), rand(2, n * k));
        let packed = pack(&w, n, k);
        let panels = 0..n.div_ceil(NR);
        let run = |level: &dyn Fn(Out)| {
            let mut out = vec![f32::NAN; rows * n];
            level(Out { ptr: out.as_mut_ptr(), stride: n });
            out
        };
        // SAFETY: `out` holds rows × n elements, all of them this call's.
        let want = run(&|out| unsafe { gemm_body(&x, rows, k, &packed, n, panels.clone(), out, Portable) });
        for r in 0..rows {
            for c in 0..n {
                let naive: f32 = (0..k).map(|i| x[r * k + i] * w[c * k + i]).sum();
                assert!((want[r * n + c] - naive).abs() < 1e-3, "({r},{c})");
            }
        }
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has AVX2 and FMA; `out` as above.
                let got = run(&|out| unsafe { gemm_avx2(&x, rows, k, &packed, n, panels.clone(), out) });
                assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "avx2");
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F; `out` as above.
                let got = run(&|out| unsafe { gemm_avx512(&x, rows, k, &packed, n, panels.clone(), out) });
                assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "avx512");
            }
        }
    }

    /// Weights that are all bf16 values, packed as bf16, give every instruction set bitwise the
    /// output of the same weights packed as `f32`; one value that is not a bf16 keeps `f32`.
    #[test]
    fn bf16_panels_compute_the_bits_of_their_f32_values() {
        let (rows, k, n) = (7, 2 * KC + 19, 2 * NR + 9);
        let x = rand(3, rows * k);
        // Random values cut to bf16, as a bf16 checkpoint read into `f32` holds them.
        let mut w: Vec<f32> = rand(4, n * k).iter().map(|v| f32::from_bits(v.to_bits() & 0xffff_0000)).collect();
        let (f32s, bf16s) = (pack(&w, n, k), pack_bf16(&w, n, k).expect("every value is a bf16"));
        let panels = 0..n.div_ceil(NR);
        type Level<'a> = &'a dyn Fn(Out);
        let run = |level: Level<'_>| {
            let mut out = vec![f32::NAN; rows * n];
            level(Out { ptr: out.as_mut_ptr(), stride: n });
            out
        };
        // SAFETY: `out` holds rows × n elements, all of them this call's.
        let want = run(&|out| unsafe { gemm_body(&x, rows, k, &f32s, n, panels.clone(), out, Portable) });
        // SAFETY: as above.
        let got = run(&|out| unsafe { gemm_body(&x, rows, k, &bf16s, n, panels.clone(), out, Portable) });
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "portable");
        // SAFETY: as above; `gemm` picks the best level this CPU has.
        let got = run(&|out| unsafe { gemm(&x, rows, k, &bf16s, n, panels.clone(), out) });
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "the CPU's best");
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has AVX2 and FMA; `out` as above.
                let got = run(&|out| unsafe { gemm_avx2(&x, rows, k, &bf16s, n, panels.clone(), out) });
                assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "avx2");
            }
        }
        let mut row = vec![0.0; k];
        unpack_row(&bf16s, k, n - 1, &mut row);
        assert_eq!(row, w[(n - 1) * k..]);

        w[17] = 1.0 + f32::EPSILON;
        assert!(pack_bf16(&w, n, k).is_none(), "not every value is a bf16");
    }

    #[test]
    fn packing_round_trips_and_pads_the_last_panel() {
        let (n, k) = (NR + 3, 5);
        let w: Vec<f32> = (0..n * k).map(|i| i as f32).collect();
        let packed = pack(&w, n, k);
        assert_eq!(packed.len(), 2 * NR * k);
        let mut row = vec![0.0; k];
        for c in 0..n {
            unpack_row(&packed, k, c, &mut row);
            assert_eq!(row, w[c * k..(c + 1) * k]);
        }
        unpack_row(&packed, k, n + 1, &mut row);
        assert_eq!(row, vec![0.0; k], "padding");
    }
}
