//! Bit-faithful emulation of the few llama.cpp (ggml CPU) reductions whose
//! rounding is visible in greedy decoding: the vectorised `expf` used by
//! softmax and SiLU, the lane layout of the f16 dot products in attention
//! (K·q and V·softmax), and the lane reductions.
//!
//! A 135M-parameter model at 4 bits has many near-ties between its top two
//! logits, so "the same maths in a different order" is not enough for greedy
//! parity with llama.cpp over 32+ tokens. The weight products already match
//! bit for bit (same block formats, one accumulator, same horizontal sum);
//! this module does the same for attention and the feed-forward activation.
//!
//! Two flavours follow the two x86 builds of ggml: [`Flavor::Avx512`]
//! (16-lane vectors; chosen when the CPU has AVX-512F/DQ, as a native
//! llama.cpp build then does) and [`Flavor::Avx2`] (8 lanes). The code is
//! scalar over explicit lanes (the compiler vectorises it) with fused
//! multiply-adds, compiled with FMA enabled when the CPU has it.

use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

/// Which ggml build's arithmetic order to mirror.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    Avx512,
    Avx2,
}

impl Flavor {
    /// The name `check-config` and the `Finished` timings print.
    pub fn name(self) -> &'static str {
        match self {
            Flavor::Avx512 => "avx512",
            Flavor::Avx2 => "avx2",
        }
    }

    /// Vector width in f32 lanes.
    pub fn lanes(self) -> usize {
        match self {
            Flavor::Avx512 => 16,
            Flavor::Avx2 => 8,
        }
    }
}

/// `model.numerics`: whose arithmetic order the forward pass follows.
///
/// llama.cpp's AVX2 and AVX-512 builds round differently (vector width in
/// softmax, SiLU and attention), enough
/// to pick different greedy tokens after a few steps. `Portable` computes
/// the AVX2 build's order on every CPU (and the CUDA backend follows it), so
/// a fleet of mixed nodes answers a request with the same bytes; `Native`
/// mirrors the llama.cpp build native to this CPU (what a side-by-side
/// comparison with a local llama.cpp needs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Numerics {
    #[default]
    Portable,
    Native,
}

impl Numerics {
    pub fn name(self) -> &'static str {
        match self {
            Numerics::Portable => "portable",
            Numerics::Native => "native",
        }
    }

    /// The ggml build this setting mirrors on this CPU.
    pub fn flavor(self) -> Flavor {
        match self {
            Numerics::Portable => Flavor::Avx2,
            Numerics::Native => native_flavor(),
        }
    }

    /// "portable (avx2 order)": the setting and the order it ran.
    pub fn describe(self) -> String {
        format!("{} ({} order)", self.name(), self.flavor().name())
    }
}

/// The flavour of the llama.cpp build native to this CPU: AVX-512 when the
/// CPU has AVX-512F/DQ (as a native ggml build then uses), else AVX2.
/// `SAMPLERD_GGML_FLAVOR=avx2|avx512` overrides the detection (to compare
/// with a llama.cpp built for the other one).
pub fn native_flavor() -> Flavor {
    static F: OnceLock<Flavor> = OnceLock::new();
    *F.get_or_init(|| match std::env::var("SAMPLERD_GGML_FLAVOR").as_deref() {
        Ok("avx2") => Flavor::Avx2,
        Ok("avx512") => Flavor::Avx512,
        _ => {
            #[cfg(target_arch = "x86_64")]
            {
                let f = samplerd_numerics::features();
                if f.avx512f() && f.avx512dq() {
                    return Flavor::Avx512;
                }
            }
            Flavor::Avx2
        }
    })
}

fn has_fma() -> bool {
    static F: OnceLock<bool> = OnceLock::new();
    *F.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let f = samplerd_numerics::features();
            f.fma() && f.avx2()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// `ggml_v_expf`'s constants (shared with the vectorised copy in
/// `crate::cpu::attention`).
pub(crate) mod expf_consts {
    pub(crate) const R: u32 = 0x4b40_0000; // 0x1.8p23
    pub(crate) const LOG2E: u32 = 0x3fb8_aa3b; // 0x1.715476p+0
    pub(crate) const LN2_LO: u32 = 0x35bf_be8e; // 0x1.7f7d1cp-20
    pub(crate) const LN2_HI: u32 = 0x3f31_7200; // 0x1.62e4p-1
    pub(crate) const C5: u32 = 0x3c07_2010; // 0x1.0e4020p-7
    pub(crate) const C4: u32 = 0x3d2b_9f17; // 0x1.573e2ep-5
    pub(crate) const C3: u32 = 0x3e2a_af33; // 0x1.555e66p-3
    pub(crate) const C2: u32 = 0x3eff_fedb; // 0x1.fffdb6p-2
    pub(crate) const C1: u32 = 0x3f7f_fff6; // 0x1.ffffecp-1
}
use expf_consts::*;

#[inline(always)]
fn f(b: u32) -> f32 {
    f32::from_bits(b)
}

/// `2^n` as f64 for an integral `n` in [-1022, 1023].
#[inline(always)]
fn pow2(n: f32) -> f64 {
    f64::from_bits(((n as i64 + 1023) as u64) << 52)
}

/// `j * 2^n` rounded once (AVX-512 `scalef`, and the AVX2 far-range path).
#[inline(always)]
fn scale2(j: f32, n: f32) -> f32 {
    if (-125.0..=127.0).contains(&n) {
        j * f32::from_bits(((n as i32 + 127) as u32) << 23) // exact power of two
    } else {
        (j as f64 * pow2(n)) as f32
    }
}

/// ggml's `ggml_v_expf`, one lane.
#[inline(always)]
pub(crate) fn expf_lane(x: f32, fl: Flavor) -> f32 {
    let r = f(R);
    let z = x.mul_add(f(LOG2E), r);
    let n = z - r;
    let b = (-n).mul_add(f(LN2_LO), (-n).mul_add(f(LN2_HI), x));
    let u = b * b;
    let p = f(C5).mul_add(b, f(C4)).mul_add(u, f(C3).mul_add(b, f(C2)));
    // Out of range (both flavours): overflow, underflow or NaN.
    if n.abs() > 192.0 || n.is_nan() {
        return if x > 0.0 {
            f32::INFINITY
        } else if x.is_nan() {
            x
        } else {
            0.0
        };
    }
    match fl {
        Flavor::Avx512 => {
            let j = p.mul_add(u, f(C1).mul_add(b, 1.0));
            scale2(j, n)
        }
        Flavor::Avx2 => {
            let j = p.mul_add(u, f(C1) * b);
            if n.abs() > 126.0 {
                return ((j as f64 + 1.0) * pow2(n)) as f32;
            }
            let k = f32::from_bits(((n as i32 + 127) as u32) << 23); // exact power of two
            j.mul_add(k, k)
        }
    }
}

/// `ggml_vec_swiglu_f32`: `out = silu(g) * u` (vector lanes; the scalar
/// tail, never hit for multiples of 8/16, uses libm like ggml).
pub fn swiglu(g: &[f32], u: &[f32], out: &mut [f32], fl: Flavor) {
    #[cfg(target_arch = "x86_64")]
    if has_fma() {
        // SAFETY: `has_fma()` checked that the CPU supports avx2 and fma.
        unsafe { swiglu_fma(g, u, out, fl) };
        return;
    }
    swiglu_body(g, u, out, fl)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn swiglu_fma(g: &[f32], u: &[f32], out: &mut [f32], fl: Flavor) {
    // SAFETY: avx2 and fma are enabled in this function.
    unsafe { swiglu_vec(g, u, out, fl) }
}

#[inline(always)]
fn swiglu_body(g: &[f32], u: &[f32], out: &mut [f32], fl: Flavor) {
    let w = fl.lanes();
    let nv = g.len() / w * w;
    for i in 0..nv {
        let x = g[i];
        let e = expf_lane(0.0 - x, fl);
        out[i] = (x / (1.0 + e)) * u[i];
    }
    swiglu_tail(g, u, out, nv);
}

/// The scalar tail of [`swiglu`] from `from` on.
#[inline(always)]
fn swiglu_tail(g: &[f32], u: &[f32], out: &mut [f32], from: usize) {
    for i in from..g.len() {
        let x = g[i];
        out[i] = (x / (1.0 + (-x).exp())) * u[i];
    }
}

/// [`swiglu_body`] eight lanes at a time ([`expf8`]; the same operations,
/// so the same bits: tested below).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn swiglu_vec(g: &[f32], u: &[f32], out: &mut [f32], fl: Flavor) {
    use std::arch::x86_64::*;
    let nv = g.len() / fl.lanes() * fl.lanes();
    assert!(u.len() >= g.len() && out.len() >= g.len());
    let mut i = 0;
    while i < nv {
        // SAFETY: avx2 and fma are enabled by the caller; `i + 8 <= nv`,
        // inside all three slices (asserted above).
        unsafe {
            let x = _mm256_loadu_ps(g.as_ptr().add(i));
            let e = expf8(_mm256_sub_ps(_mm256_setzero_ps(), x), fl);
            let s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e));
            let y = _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i)));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), y);
        }
        i += 8;
    }
    swiglu_tail(g, u, out, nv);
}

/// `ggml::expf_lane` on eight lanes: the common range in vectors, the
/// rare far-range lanes (|n| > 126, overflow, NaN) through the scalar
/// lane function.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn expf8(x: std::arch::x86_64::__m256, fl: Flavor) -> std::arch::x86_64::__m256 {
    use expf_consts as c;
    use std::arch::x86_64::*;
    // SAFETY: avx2 and fma are enabled in every caller.
    unsafe {
        let f = |b: u32| _mm256_set1_ps(f32::from_bits(b));
        let r = f(c::R);
        let z = _mm256_fmadd_ps(x, f(c::LOG2E), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(n, f(c::LN2_LO), _mm256_fnmadd_ps(n, f(c::LN2_HI), x));
        let u = _mm256_mul_ps(b, b);
        let p = _mm256_fmadd_ps(
            _mm256_fmadd_ps(f(c::C5), b, f(c::C4)),
            u,
            _mm256_fmadd_ps(f(c::C3), b, f(c::C2)),
        );
        let k = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)),
            23,
        ));
        let (y, ok) = match fl {
            Flavor::Avx2 => {
                let j = _mm256_fmadd_ps(p, u, _mm256_mul_ps(f(c::C1), b));
                let abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
                (
                    _mm256_fmadd_ps(j, k, k),
                    _mm256_cmp_ps(abs, _mm256_set1_ps(126.0), _CMP_LE_OQ),
                )
            }
            Flavor::Avx512 => {
                let j = _mm256_fmadd_ps(p, u, _mm256_fmadd_ps(f(c::C1), b, _mm256_set1_ps(1.0)));
                let lo = _mm256_cmp_ps(n, _mm256_set1_ps(-125.0), _CMP_GE_OQ);
                let hi = _mm256_cmp_ps(n, _mm256_set1_ps(127.0), _CMP_LE_OQ);
                (_mm256_mul_ps(j, k), _mm256_and_ps(lo, hi))
            }
        };
        if _mm256_movemask_ps(ok) == 0xff {
            return y;
        }
        let (mut xs, mut ys) = ([0f32; 8], [0f32; 8]);
        _mm256_storeu_ps(xs.as_mut_ptr(), x);
        _mm256_storeu_ps(ys.as_mut_ptr(), y);
        let okm = _mm256_movemask_ps(ok);
        for e in 0..8 {
            if okm & (1 << e) == 0 {
                ys[e] = expf_lane(xs[e], fl);
            }
        }
        _mm256_loadu_ps(ys.as_ptr())
    }
}

/// One row of a half-precision weight matrix: 32-value blocks of f16
/// (IEEE, widened by F16C) or bf16 (widened by a shift) values.
pub trait HalfBlock: Sized + Sync {
    /// bf16 rather than f16.
    const BF16: bool;
    /// The block's 32 stored values, as bits.
    fn bits(&self) -> &[u16; 32];
    /// Value `i` widened to f32 (exact).
    fn value(&self, i: usize) -> f32 {
        let b = self.bits()[i];
        if Self::BF16 {
            f32::from_bits((b as u32) << 16)
        } else {
            half::f16::from_bits(b).to_f32()
        }
    }
}

/// One row of an F16 or BF16 matrix (its blocks, read as they are) times
/// activations already rounded to that type, in the order llama.cpp uses:
/// tinyBLAS (`llamafile_sgemm`) for a step of 2+ tokens (`gemm`), else
/// `ggml_vec_dot_f16` / `ggml_vec_dot_bf16` (the sgemm path takes prompt
/// steps only), for the build `fl` mirrors (BF16 in an AVX-512 build on a
/// CPU with AVX-512 BF16: its `vdpbf16ps` pair order, [`dot_bf16_pairs`]).
pub fn dot_half_row<B: HalfBlock>(w: &[B], x: &[f32], gemm: bool, fl: Flavor) -> f32 {
    if B::BF16 && fl == Flavor::Avx512 && has_avx512_bf16() {
        return dot_bf16_pairs(w, x, gemm);
    }
    #[cfg(target_arch = "x86_64")]
    if has_fma() && has_f16c() {
        // SAFETY: the CPU supports avx2, fma and f16c (checked just above).
        return unsafe { dot_half_row_simd(w, x, gemm, fl) };
    }
    dot_half_row_scalar(w, x, gemm, fl)
}

/// [`dot_half_row`] for four activation rows of tinyBLAS steps at once
/// (tinyBLAS itself runs blocks of rows × tokens): each result equals
/// `dot_half_row(w, xs[t], true, fl)` bit for bit.
pub fn dot_half_row_x4<B: HalfBlock>(w: &[B], xs: [&[f32]; 4], fl: Flavor) -> [f32; 4] {
    if B::BF16 && fl == Flavor::Avx512 && has_avx512_bf16() {
        return xs.map(|x| dot_bf16_pairs(w, x, true));
    }
    #[cfg(target_arch = "x86_64")]
    if has_fma() && has_f16c() {
        // SAFETY: the CPU supports avx2, fma and f16c (checked just above).
        return unsafe { gemm_half_rows_simd(w, xs, fl) };
    }
    xs.map(|x| dot_half_row_scalar(w, x, true, fl))
}

/// The vector-dot step (values per accumulator round) of `fl` for `B`:
/// `ggml_vec_dot_f16` runs four vectors, `ggml_vec_dot_bf16` 32 values on
/// both x86 builds (four 8-lane vectors, or two 16-lane ones).
fn vec_dot_step<B: HalfBlock>(fl: Flavor) -> usize {
    if B::BF16 { 32 } else { 4 * fl.lanes() }
}

/// The horizontal sums of [`dot_half_row`]'s vector-dot lanes (`lanes[i %
/// step]` holds positions `i`), in f64 as ggml adds them.
fn reduce_vec_dot_half<B: HalfBlock>(lanes: &[f32; 64], fl: Flavor) -> f64 {
    match (B::BF16, fl) {
        (false, _) => reduce_vec_dot(lanes, fl.lanes()),
        // AVX-512F: two 16-lane accumulators, each reduced, summed in f64.
        (true, Flavor::Avx512) => {
            let (c1, c2) = lanes.split_at(16);
            reduce16(c1.try_into().expect("16 lanes")) as f64
                + reduce16(c2[..16].try_into().expect("16 lanes")) as f64
        }
        // AVX2: (c1 + c3) + (c2 + c4), then hi + lo, movehl, movehdup.
        (true, Flavor::Avx2) => {
            let x: [f32; 8] = std::array::from_fn(|e| {
                (lanes[e] + lanes[16 + e]) + (lanes[8 + e] + lanes[24 + e])
            });
            let t = [x[4] + x[0], x[5] + x[1], x[6] + x[2], x[7] + x[3]];
            ((t[0] + t[2]) + (t[1] + t[3])) as f64
        }
    }
}

/// [`dot_half_row`] without intrinsics (the same lane order, scalar).
pub(crate) fn dot_half_row_scalar<B: HalfBlock>(w: &[B], x: &[f32], gemm: bool, fl: Flavor) -> f32 {
    let n = (w.len() * 32).min(x.len());
    let value = |i: usize| w[i / 32].value(i % 32);
    let step = if gemm {
        fl.lanes()
    } else {
        vec_dot_step::<B>(fl)
    };
    let full = n / step * step;
    let mut lanes = [0f32; 64];
    for i in 0..full {
        lanes[i % step] = value(i).mul_add(x[i], lanes[i % step]);
    }
    if gemm {
        let first: &[f32; 16] = lanes.first_chunk().expect("64 lanes");
        let mut s = if fl == Flavor::Avx512 {
            reduce16(first)
        } else {
            reduce8(first)
        };
        for (i, xi) in x.iter().enumerate().take(n).skip(full) {
            s += value(i) * xi;
        }
        s
    } else {
        let mut s = reduce_vec_dot_half::<B>(&lanes, fl);
        for (i, xi) in x.iter().enumerate().take(n).skip(full) {
            s += (value(i) * xi) as f64;
        }
        s as f32
    }
}

/// Whether this CPU has AVX-512 BF16 (a native llama.cpp build then
/// multiplies BF16 with `vdpbf16ps`).
pub(crate) fn has_avx512_bf16() -> bool {
    samplerd_numerics::features().avx512bf16()
}

/// A BF16 row product as llama.cpp's AVX-512 BF16 build computes it:
/// `vdpbf16ps` lanes, each adding the product of an odd-indexed pair
/// element and then the even one (products exact in f32, each sum rounded;
/// its flushing of subnormals is not reproduced). tinyBLAS (`gemm`, rows
/// of a multiple of 32 values): one 16-lane accumulator over chunks of 32,
/// `_mm512_reduce_add_ps`. `ggml_vec_dot_bf16`: two accumulators over
/// chunks of 64, each reduced, summed in f64, the tail in f64.
pub(crate) fn dot_bf16_pairs<B: HalfBlock>(w: &[B], x: &[f32], gemm: bool) -> f32 {
    let n = (w.len() * 32).min(x.len());
    let value = |i: usize| w[i / 32].value(i % 32);
    let pairs = |lanes: &mut [f32; 16], base: usize| {
        for (j, l) in lanes.iter_mut().enumerate() {
            let (odd, even) = (base + 2 * j + 1, base + 2 * j);
            *l += value(odd) * x[odd];
            *l += value(even) * x[even];
        }
    };
    if gemm && n.is_multiple_of(32) {
        let mut lanes = [0f32; 16];
        for base in (0..n).step_by(32) {
            pairs(&mut lanes, base);
        }
        return reduce16(&lanes);
    }
    let np = n / 64 * 64;
    let (mut c1, mut c2) = ([0f32; 16], [0f32; 16]);
    for base in (0..np).step_by(64) {
        pairs(&mut c1, base);
        pairs(&mut c2, base + 32);
    }
    let mut s = reduce16(&c1) as f64 + reduce16(&c2) as f64;
    for (i, xi) in x.iter().enumerate().take(n).skip(np) {
        s += (value(i) * xi) as f64;
    }
    s as f32
}

#[cfg(target_arch = "x86_64")]
fn has_f16c() -> bool {
    samplerd_numerics::features().f16c()
}

/// The lanes of [`dot_half_row`] in 8-wide vectors, for `T` activation rows
/// at once (independent fma chains, so the loop is not bound by the fma
/// latency of one chain): vector `g` (values `8g..8g+8`) is fma'd into
/// accumulator `g % V`, so lane `i % 8V` accumulates positions `i`,
/// `i + 8V`, … in order — the scalar lane order above. Written with
/// intrinsics because the compiler left the scalar form in 128-bit pieces
/// (F16 decode ran at 0.2x llama.cpp's speed). bf16 × bf16 products are
/// exact in f32, so ggml's multiply-then-add for BF16 equals this fma.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half_lanes<B: HalfBlock, const V: usize, const T: usize>(
    w: &[B],
    xs: [&[f32]; T],
    n_vec: usize,
) -> [[f32; 64]; T] {
    use std::arch::x86_64::*;
    assert!(n_vec <= w.len() * 4, "the row covers the vectors");
    for x in xs {
        assert!(n_vec * 8 <= x.len(), "the activations cover the vectors");
    }
    let mut acc = [[_mm256_setzero_ps(); V]; T];
    for g in 0..n_vec {
        let block = &w[g / 4];
        // SAFETY: values `g % 4 * 8 .. + 8` of a 32-value block (unaligned).
        let raw =
            unsafe { _mm_loadu_si128(block.bits().as_ptr().add(g % 4 * 8) as *const __m128i) };
        let wv = if B::BF16 {
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
        } else {
            _mm256_cvtph_ps(raw)
        };
        for t in 0..T {
            // SAFETY: `8g + 8 <= x.len()` (asserted above); unaligned.
            let xv = unsafe { _mm256_loadu_ps(xs[t].as_ptr().add(8 * g)) };
            acc[t][g % V] = _mm256_fmadd_ps(wv, xv, acc[t][g % V]);
        }
    }
    let mut out = [[0f32; 64]; T];
    for t in 0..T {
        for (v, a) in acc[t].iter().enumerate() {
            // SAFETY: `8v + 8 <= 8V <= 64`.
            unsafe { _mm256_storeu_ps(out[t].as_mut_ptr().add(8 * v), *a) };
        }
    }
    out
}

/// tinyBLAS row products of `T` activation rows at once.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemm_half_rows_simd<B: HalfBlock, const T: usize>(
    w: &[B],
    xs: [&[f32]; T],
    fl: Flavor,
) -> [f32; T] {
    let n = xs.iter().fold(w.len() * 32, |n, x| n.min(x.len()));
    let lanes = fl.lanes();
    let c = n / lanes * lanes;
    // SAFETY: avx2, fma and f16c are enabled in this function.
    let acc = unsafe {
        if fl == Flavor::Avx512 {
            half_lanes::<B, 2, T>(w, xs, c / 8)
        } else {
            half_lanes::<B, 1, T>(w, xs, c / 8)
        }
    };
    std::array::from_fn(|t| {
        let first: &[f32; 16] = acc[t].first_chunk().expect("64 lanes");
        let mut s = if lanes == 16 {
            reduce16(first)
        } else {
            reduce8(first)
        };
        for i in c..n {
            s += w[i / 32].value(i % 32) * xs[t][i];
        }
        s
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_half_row_simd<B: HalfBlock>(w: &[B], x: &[f32], gemm: bool, fl: Flavor) -> f32 {
    if gemm {
        // SAFETY: avx2, fma and f16c are enabled in this function.
        let [s] = unsafe { gemm_half_rows_simd(w, [x], fl) };
        return s;
    }
    let n = (w.len() * 32).min(x.len());
    let step = vec_dot_step::<B>(fl);
    let np = n / step * step;
    // SAFETY: as above.
    let [acc] = unsafe {
        match step {
            64 => half_lanes::<B, 8, 1>(w, [x], np / 8),
            _ => half_lanes::<B, 4, 1>(w, [x], np / 8),
        }
    };
    let mut s = reduce_vec_dot_half::<B>(&acc, fl);
    for (i, xi) in x.iter().enumerate().take(n).skip(np) {
        s += (w[i / 32].value(i % 32) * xi) as f64;
    }
    s as f32
}

/// Horizontal sum of 16 lanes in GCC's `_mm512_reduce_add_ps` order.
#[inline(always)]
fn reduce16(v: &[f32; 16]) -> f32 {
    let mut t3 = [0f32; 8];
    for k in 0..8 {
        t3[k] = v[8 + k] + v[k];
    }
    let mut t6 = [0f32; 4];
    for m in 0..4 {
        t6[m] = t3[4 + m] + t3[m];
    }
    (t6[0] + t6[2]) + (t6[1] + t6[3])
}

/// Horizontal sum of 8 lanes: `hi128 + lo128`, then `(v0+v2) + (v1+v3)`
/// (ggml's `hsum_float_8` / tinyBLAS `hsum`; also the weight products' final
/// sum, `quant`).
#[inline(always)]
pub(crate) fn hsum8(v: &[f32; 8]) -> f32 {
    let t = [v[4] + v[0], v[5] + v[1], v[6] + v[2], v[7] + v[3]];
    (t[0] + t[2]) + (t[1] + t[3])
}

/// [`hsum8`] of the first 8 of 16 lanes.
#[inline(always)]
fn reduce8(v: &[f32; 16]) -> f32 {
    hsum8(v.first_chunk().expect("16 lanes"))
}

/// One attention head's inputs (see [`attention_head`]).
#[derive(Clone, Copy, Debug)]
pub struct Head<'a> {
    /// The query already rounded to f16 (`hd` values).
    pub q16: &'a [f32],
    /// `n_pos × hd` f32 copies of the f16 cache.
    pub kf: &'a [f32],
    pub vf: &'a [f32],
    pub n_pos: usize,
    pub scale: f32,
    /// A one-token batch (llama.cpp then uses `ggml_vec_dot_f16` instead of
    /// tinyBLAS, a different summation order).
    pub decode: bool,
    /// Whose lane order (`model.numerics`).
    pub flavor: Flavor,
}

/// One attention head over `n_pos` cached positions, as llama.cpp's
/// non-flash path computes it: `kq = K·q16` (f16 products in tinyBLAS lane
/// order), `softmax(kq * scale)` with ggml's expf and per-vector sums in
/// f64, probabilities rounded to f16, then `V·p16` in the same lane order.
///
/// `scores`: scratch (≥ n_pos rounded up to 16); `acc`: scratch (≥ 64·hd);
/// `out`: `hd` values.
pub fn attention_head(h: &Head<'_>, scores: &mut [f32], acc: &mut [f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_fma() {
        // SAFETY: `has_fma()` checked that the CPU supports avx2 and fma.
        unsafe { attention_fma(h, scores, acc, out) };
        return;
    }
    attention_body(h, scores, acc, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attention_fma(h: &Head<'_>, scores: &mut [f32], acc: &mut [f32], out: &mut [f32]) {
    attention_body(h, scores, acc, out)
}

#[inline(always)]
fn attention_body(h: &Head<'_>, scores: &mut [f32], acc: &mut [f32], out: &mut [f32]) {
    let Head {
        q16,
        kf,
        vf,
        n_pos,
        scale,
        decode,
        flavor: fl,
    } = *h;
    let w = fl.lanes();
    let hd = q16.len();
    let reduce = |v: &[f32; 16]| if w == 16 { reduce16(v) } else { reduce8(v) };
    // kq: per position, lanes over the head dimension. Prefill (tinyBLAS):
    // one accumulator vector, fma over chunks of `w`, then a horizontal sum.
    // Decode (ggml_vec_dot_f16): four accumulator vectors over chunks of
    // `4w`, added pairwise, then a horizontal sum, leftovers in f64.
    let mut max = f32::NEG_INFINITY;
    for p in 0..n_pos {
        let k = &kf[p * hd..(p + 1) * hd];
        let s = if decode {
            vec_dot_f16(q16, k, w)
        } else {
            tinyblas_dot(q16, k, w)
        };
        let s = s * scale;
        scores[p] = s;
        max = max.max(s);
    }
    // softmax: exp per vector of `w` lanes (masked lanes are 0), each vector
    // summed horizontally, the sums accumulated in f64.
    let padded = n_pos.div_ceil(w) * w;
    let mut sum = 0f64;
    let mut p = 0;
    while p < padded {
        let mut lanes = [0f32; 16];
        for e in 0..w {
            if p + e < n_pos {
                let v = expf_lane(scores[p + e] - max, fl);
                scores[p + e] = v;
                lanes[e] = v;
            }
        }
        // (ggml_vec_soft_max_f32's AVX2 path: hi+lo, then movehl, then
        // movehdup, hsum_float_8's order.)
        sum += reduce(&lanes) as f64;
        p += w;
    }
    let inv = (1.0 / sum) as f32;
    for s in scores[..n_pos].iter_mut() {
        *s = half::f16::from_f32(*s * inv).to_f32();
    }
    // kqv: out[d] = Σ_p p16[p] · v[p][d] with lanes over positions:
    // prefill p mod w (tinyBLAS), decode p mod 4w (four vectors).
    let nl = if decode { 4 * w } else { w };
    let acc = &mut acc[..nl * hd];
    acc.fill(0.0);
    for p in 0..n_pos {
        let e = p % nl;
        let pr = scores[p];
        let v = &vf[p * hd..(p + 1) * hd];
        let a = &mut acc[e * hd..(e + 1) * hd];
        for d in 0..hd {
            a[d] = pr.mul_add(v[d], a[d]);
        }
    }
    for (d, o) in out.iter_mut().enumerate().take(hd) {
        let mut lanes = [0f32; 64];
        for e in 0..nl {
            lanes[e] = acc[e * hd + d];
        }
        *o = if decode {
            reduce_vec_dot(&lanes, w) as f32
        } else {
            reduce(lanes[..16].try_into().unwrap())
        };
    }
}

/// tinyBLAS order: lane `i % w`, fma chain, horizontal sum; tail (never hit
/// for head sizes that are multiples of `w`) added after.
#[inline(always)]
fn tinyblas_dot(a: &[f32], b: &[f32], w: usize) -> f32 {
    let n = a.len();
    let mut lanes = [0f32; 16];
    let mut c = 0;
    while c + w <= n {
        for e in 0..w {
            lanes[e] = a[c + e].mul_add(b[c + e], lanes[e]);
        }
        c += w;
    }
    let mut s = if w == 16 {
        reduce16(&lanes)
    } else {
        reduce8(&lanes)
    };
    for i in c..n {
        s += a[i] * b[i];
    }
    s
}

/// `ggml_vec_dot_f16` order: lanes `i % 4w` over full steps of `4w`, the
/// four vectors reduced pairwise then horizontally, leftovers in f64.
#[inline(always)]
fn vec_dot_f16(a: &[f32], b: &[f32], w: usize) -> f32 {
    let n = a.len();
    let step = 4 * w;
    let np = n / step * step;
    let mut lanes = [0f32; 64];
    let mut c = 0;
    while c < np {
        for e in 0..step {
            lanes[e] = a[c + e].mul_add(b[c + e], lanes[e]);
        }
        c += step;
    }
    let mut s = reduce_vec_dot(&lanes, w);
    for i in np..n {
        s += (a[i] * b[i]) as f64;
    }
    s as f32
}

/// GGML_F16_VEC_REDUCE: `x0+x2`, `x1+x3`, then `x0+x1`, then horizontal.
#[inline(always)]
fn reduce_vec_dot(l: &[f32; 64], w: usize) -> f64 {
    let mut x = [0f32; 16];
    for e in 0..w {
        let x0 = l[e] + l[2 * w + e];
        let x1 = l[w + e] + l[3 * w + e];
        x[e] = x0 + x1;
    }
    if w == 16 {
        reduce16(&x) as f64
    } else {
        // GGML_F32x8_REDUCE: t = lo128 + hi128; hadd(hadd(t, t), t)[0].
        let t = [x[0] + x[4], x[1] + x[5], x[2] + x[6], x[3] + x[7]];
        ((t[0] + t[1]) + (t[2] + t[3])) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expf_is_close_to_libm() {
        for fl in [Flavor::Avx512, Flavor::Avx2] {
            for i in -2000..2000 {
                let x = i as f32 * 0.05;
                let (a, b) = (expf_lane(x, fl), x.exp());
                let ok = if b.is_infinite() {
                    a == b
                } else if b > 1e-30 {
                    ((a - b) / b).abs() < 1e-6
                } else {
                    (a - b).abs() < 1e-36
                };
                assert!(ok, "{fl:?} exp({x}) = {a}, libm {b}");
            }
            assert_eq!(expf_lane(f32::NEG_INFINITY, fl), 0.0);
        }
    }

    #[test]
    fn portable_numerics_is_the_avx2_order_on_every_cpu() {
        assert_eq!(Numerics::default(), Numerics::Portable);
        assert_eq!(Numerics::Portable.flavor(), Flavor::Avx2);
        assert_eq!(Numerics::Native.flavor(), native_flavor());
        assert_eq!(Numerics::Portable.describe(), "portable (avx2 order)");
        let parsed: Numerics = serde_json::from_str("\"native\"").unwrap();
        assert_eq!(parsed, Numerics::Native);
        assert!(serde_json::from_str::<Numerics>("\"fast\"").is_err());
    }

    /// The vectorised SwiGLU equals the lane-by-lane one bit for bit, in
    /// both orders, over the whole range of the exponential (including the
    /// far-range lanes and the scalar tail).
    #[test]
    fn swiglu_vectors_equal_lanes() {
        let mut r = crate::test_rng::Lcg(3);
        for fl in [Flavor::Avx2, Flavor::Avx512] {
            for n in [8usize, 16, 1536, 1541] {
                let g: Vec<f32> = (0..n)
                    .map(|i| r.f() * if i % 7 == 0 { 200.0 } else { 12.0 })
                    .collect();
                let u: Vec<f32> = (0..n).map(|_| r.f() * 3.0).collect();
                let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
                swiglu(&g, &u, &mut a, fl);
                swiglu_body(&g, &u, &mut b, fl);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{fl:?} n {n}");
            }
        }
    }

    #[test]
    fn attention_matches_plain_softmax() {
        let hd = 64;
        let n = 37;
        let q: Vec<f32> = (0..hd)
            .map(|i| half::f16::from_f32((i as f32 * 0.37).sin()).to_f32())
            .collect();
        let k: Vec<f32> = (0..n * hd).map(|i| (i as f32 * 0.11).cos()).collect();
        let v: Vec<f32> = (0..n * hd).map(|i| (i as f32 * 0.07).sin()).collect();
        let (mut sc, mut acc, mut out) = (vec![0f32; 48], vec![0f32; 64 * hd], vec![0f32; hd]);
        for (decode, flavor) in [false, true]
            .into_iter()
            .flat_map(|d| [(d, Flavor::Avx2), (d, Flavor::Avx512)])
        {
            let h = Head {
                q16: &q,
                kf: &k,
                vf: &v,
                n_pos: n,
                scale: 0.125,
                decode,
                flavor,
            };
            attention_head(&h, &mut sc, &mut acc, &mut out);
            let s: Vec<f32> = (0..n)
                .map(|p| (0..hd).map(|d| q[d] * k[p * hd + d]).sum::<f32>() * 0.125)
                .collect();
            let m = s.iter().cloned().fold(f32::MIN, f32::max);
            let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f32 = e.iter().sum();
            for d in 0..hd {
                let want: f32 = (0..n).map(|p| e[p] / z * v[p * hd + d]).sum();
                assert!(
                    (out[d] - want).abs() < 2e-3,
                    "dim {d}: {} vs {want}",
                    out[d]
                );
            }
        }
    }
}
