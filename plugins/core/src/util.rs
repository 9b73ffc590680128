//! Shared helpers of the built-in stages: parameter validation with
//! messages that name the parameter and the value, vectorisable scans over
//! the dense logits (chunked max, exp), candidate ordering and the
//! dense → candidate conversion.

use std::cmp::Ordering;

use samplerd_plugin_sdk::prelude::*;

/// Scan granularity of the dense helpers: 64 floats = 4 cache lines.
pub const CHUNK: usize = 64;

/// Candidate lists at most this long are sorted outright by the stages that
/// would otherwise leave a large result unsorted (top_p, top_n_sigma).
pub const SORT_LIMIT: usize = 1024;

// ---------------------------------------------------------------------------
// Parameters
// ---------------------------------------------------------------------------

/// A numeric parameter (or its default); NaN is an error.
pub fn number(params: &Params<'_>, stage: &str, name: &str) -> Result<f64, String> {
    let v = params.number(name);
    if v.is_nan() {
        return Err(format!("{stage}: {name} must be a number, got NaN"));
    }
    Ok(v)
}

/// A numeric parameter that must satisfy `ok`; `what` describes the range.
pub fn number_in(
    params: &Params<'_>,
    stage: &str,
    name: &str,
    what: &str,
    ok: impl Fn(f64) -> bool,
) -> Result<f64, String> {
    let v = number(params, stage, name)?;
    if !ok(v) {
        return Err(format!("{stage}: {name} must be {what}, got {v}"));
    }
    Ok(v)
}

/// An integer parameter in `[lo, hi]`.
pub fn integer(
    params: &Params<'_>,
    stage: &str,
    name: &str,
    lo: i64,
    hi: i64,
) -> Result<i64, String> {
    let v = number(params, stage, name)?;
    if v.fract() != 0.0 || !v.is_finite() {
        return Err(format!("{stage}: {name} must be an integer, got {v}"));
    }
    if v < lo as f64 || v > hi as f64 {
        return Err(format!("{stage}: {name} must be in [{lo}, {hi}], got {v}"));
    }
    Ok(v as i64)
}

/// The `min_keep` parameter shared by the truncating stages.
pub fn min_keep(params: &Params<'_>, stage: &str) -> Result<usize, String> {
    Ok(integer(params, stage, "min_keep", 0, u32::MAX as i64)? as usize)
}

// ---------------------------------------------------------------------------
// Vectorisable scans
// ---------------------------------------------------------------------------

#[inline(always)]
fn fmax(a: f32, b: f32) -> f32 {
    // `select(b > a, b, a)`: compiles to a plain `maxps` (no NaN fix-up;
    // the host refuses NaN logits).
    if b > a { b } else { a }
}

/// Max of one full chunk. On x86_64 this is hand-written SSE2 (baseline
/// on every x86_64 CPU): LLVM's SLP vectoriser turns the per-chunk
/// horizontal reduction of the portable version into 2-wide code that is 4x
/// slower than a plain max-scan (measured: 40 µs vs 10 µs for the 2,374
/// chunks of 151,936 logits).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn chunk_max(c: &[f32; CHUNK]) -> f32 {
    use std::arch::x86_64::*;
    let p = c.as_ptr();
    // SAFETY: SSE2 is part of the x86_64 baseline; every load reads 4
    // floats at offsets 0..64 of a 64-float array.
    unsafe {
        let mut a0 = _mm_loadu_ps(p);
        let mut a1 = _mm_loadu_ps(p.add(4));
        let mut a2 = _mm_loadu_ps(p.add(8));
        let mut a3 = _mm_loadu_ps(p.add(12));
        for r in 1..CHUNK / 16 {
            let q = p.add(r * 16);
            a0 = _mm_max_ps(a0, _mm_loadu_ps(q));
            a1 = _mm_max_ps(a1, _mm_loadu_ps(q.add(4)));
            a2 = _mm_max_ps(a2, _mm_loadu_ps(q.add(8)));
            a3 = _mm_max_ps(a3, _mm_loadu_ps(q.add(12)));
        }
        let m = _mm_max_ps(_mm_max_ps(a0, a1), _mm_max_ps(a2, a3));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps::<0b01>(m, m));
        _mm_cvtss_f32(m)
    }
}

/// Max of one full chunk (portable version).
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
pub fn chunk_max(c: &[f32; CHUNK]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    for r in 0..CHUNK / 16 {
        for l in 0..16 {
            acc[l] = fmax(acc[l], c[r * 16 + l]);
        }
    }
    acc.iter().copied().fold(f32::NEG_INFINITY, fmax)
}

/// Max of any slice (-inf when empty), 32 lanes. This is also the
/// benchmark baseline.
pub fn max_scan(x: &[f32]) -> f32 {
    let mut chunks = x.chunks_exact(CHUNK);
    let mut acc = [f32::NEG_INFINITY; 32];
    for c in &mut chunks {
        let c: &[f32; CHUNK] = c.try_into().expect("chunk");
        for row in c.chunks_exact(32) {
            for l in 0..32 {
                acc[l] = fmax(acc[l], row[l]);
            }
        }
    }
    let mut m = acc.iter().copied().fold(f32::NEG_INFINITY, fmax);
    for &v in chunks.remainder() {
        m = fmax(m, v);
    }
    m
}

/// Fills `out` with the max of every CHUNK-sized chunk of `x` (the last one
/// may be partial) and returns the overall max.
pub fn chunk_maxima(x: &[f32], out: &mut Vec<f32>) -> f32 {
    out.clear();
    let mut chunks = x.chunks_exact(CHUNK);
    let mut m = f32::NEG_INFINITY;
    for c in &mut chunks {
        let cm = chunk_max(c.try_into().expect("chunk"));
        out.push(cm);
        m = fmax(m, cm);
    }
    let rem = chunks.remainder();
    if !rem.is_empty() {
        let cm = rem.iter().copied().fold(f32::NEG_INFINITY, fmax);
        out.push(cm);
        m = fmax(m, cm);
    }
    m
}

/// The constants of [`exp_f32`] (Cephes `expf`), shared with the AVX-512
/// version in `nucleus`.
pub mod exp_consts {
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    /// 1.5 * 2^23: round-to-nearest trick.
    pub const MAGIC: f32 = 12_582_912.0;
    /// ln 2 split in two for the range reduction.
    pub const C1: f32 = 0.693_359_4;
    pub const C2: f32 = -2.121_944_4e-4;
    /// Input range: below LO the result flushes to 0.
    pub const LO: f32 = -87.336_55;
    pub const HI: f32 = 88.376_26;
    /// Polynomial coefficients, highest degree first.
    pub const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ];
}

/// `exp(x)` for f32, branch-free so loops over it vectorise (Cephes
/// polynomial, ~1 ulp on [-87, 88]). `exp(-inf) = 0`, and results below
/// e^-87.3 (~1e-38) flush to 0 instead of becoming subnormal.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    use exp_consts::*;
    let under = x < LO;
    let xc = if x > HI {
        HI
    } else if under {
        LO
    } else {
        x
    };
    let t = xc * LOG2E + MAGIC;
    let n_bits = t.to_bits() as i32 - MAGIC.to_bits() as i32; // round(x*log2e)
    let n = t - MAGIC;
    let r = xc - n * C1 - n * C2;
    let mut y = P[0];
    for c in &P[1..] {
        y = y * r + c;
    }
    y = y * r * r + r + 1.0;
    let scale = f32::from_bits(((n_bits + 127) as u32) << 23);
    if under { 0.0 } else { y * scale }
}

/// `out = exp(x - max)` over one chunk (a plain map: LLVM vectorises it).
#[inline(always)]
fn exp_chunk(x: &[f32; CHUNK], max: f32, out: &mut [f32; CHUNK]) {
    for (o, &v) in out.iter_mut().zip(x.iter()) {
        *o = exp_f32(v - max);
    }
}

/// Sum of one chunk: 16 independent f32 lanes, then a fixed reduction tree
/// (SSE2 on x86_64 for the same reason as [`chunk_max`]; both versions add
/// in the same order, so the result is identical).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn sum_chunk(c: &[f32; CHUNK]) -> f32 {
    use std::arch::x86_64::*;
    let p = c.as_ptr();
    // SAFETY: SSE2 is baseline; loads stay within the 64-float array.
    unsafe {
        let mut a0 = _mm_loadu_ps(p);
        let mut a1 = _mm_loadu_ps(p.add(4));
        let mut a2 = _mm_loadu_ps(p.add(8));
        let mut a3 = _mm_loadu_ps(p.add(12));
        for r in 1..CHUNK / 16 {
            let q = p.add(r * 16);
            a0 = _mm_add_ps(a0, _mm_loadu_ps(q));
            a1 = _mm_add_ps(a1, _mm_loadu_ps(q.add(4)));
            a2 = _mm_add_ps(a2, _mm_loadu_ps(q.add(8)));
            a3 = _mm_add_ps(a3, _mm_loadu_ps(q.add(12)));
        }
        // lanes l: (a0+a2)[l] + (a1+a3)[l], then lanes (0+2) + (1+3)
        let m = _mm_add_ps(_mm_add_ps(a0, a2), _mm_add_ps(a1, a3));
        let h = _mm_add_ps(m, _mm_movehl_ps(m, m)); // [0+2, 1+3, ..]
        let s = _mm_add_ss(h, _mm_shuffle_ps::<0b01>(h, h));
        _mm_cvtss_f32(s)
    }
}

/// Sum of one chunk (portable version, same addition order as the SSE2 one).
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
pub fn sum_chunk(c: &[f32; CHUNK]) -> f32 {
    let mut acc = [0.0f32; 16];
    for r in 0..CHUNK / 16 {
        for l in 0..16 {
            acc[l] += c[r * 16 + l];
        }
    }
    let mut m = [0.0f32; 4];
    for l in 0..4 {
        m[l] = (acc[l] + acc[8 + l]) + (acc[4 + l] + acc[12 + l]);
    }
    (m[0] + m[2]) + (m[1] + m[3])
}

/// `out[i] = exp(x[i] - max)`; returns the sum (8 f32 lanes per chunk of 64,
/// accumulated in f64 across chunks). When `chunk_sums` is given it receives
/// the sum of every chunk (the last one may be partial).
pub fn exp_shifted(x: &[f32], max: f32, out: &mut [f32], chunk_sums: Option<&mut Vec<f64>>) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        return unsafe { exp_shifted_avx512(x, max, out, chunk_sums) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { exp_shifted_avx2(x, max, out, chunk_sums) };
    }
    exp_shifted_impl(x, max, out, chunk_sums)
}

/// [`exp_shifted`] compiled for AVX2 (8 lanes). Bit-identical to the SSE2
/// build: the same operations in the same order (Rust never contracts
/// mul + add into FMA).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn exp_shifted_avx2(
    x: &[f32],
    max: f32,
    out: &mut [f32],
    chunk_sums: Option<&mut Vec<f64>>,
) -> f64 {
    exp_shifted_impl(x, max, out, chunk_sums)
}

/// [`exp_shifted`] on 16 lanes with intrinsics: [`exp_f32`]'s operations
/// one for one (separate multiplies and adds, no fused ones) and
/// [`sum_chunk`]'s addition order, so every value and sum is bit-identical
/// to the portable build (a seed draws the same token on every CPU).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_shifted_avx512(
    x: &[f32],
    max: f32,
    out: &mut [f32],
    chunk_sums: Option<&mut Vec<f64>>,
) -> f64 {
    use std::arch::x86_64::*;
    assert_eq!(x.len(), out.len(), "exp_shifted: lengths differ");
    let src = x.as_ptr();
    // SAFETY: `exp_shifted_avx512_from` loads 16 logits at i only when
    // i + 16 <= x.len().
    let load = |i: usize| unsafe { _mm512_loadu_ps(src.add(i)) };
    // SAFETY: AVX-512F is enabled in this function.
    unsafe { exp_shifted_avx512_from(load, |i| x[i], max, out, chunk_sums) }
}

/// [`exp_shifted`] of the logits of `cands` (in list order), without a
/// copy of them: the pairs are split in registers. The same values and
/// sums as `exp_shifted` over the copied logits.
pub fn exp_shifted_candidates(
    cands: &[SdCandidate],
    max: f32,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
    chunk_sums: Option<&mut Vec<f64>>,
) -> f64 {
    assert_eq!(
        cands.len(),
        out.len(),
        "exp_shifted_candidates: lengths differ"
    );
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        return unsafe { exp_shifted_candidates_avx512(cands, max, out, chunk_sums) };
    }
    scratch.clear();
    scratch.extend(cands.iter().map(|c| c.logit));
    exp_shifted(scratch, max, out, chunk_sums)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_shifted_candidates_avx512(
    cands: &[SdCandidate],
    max: f32,
    out: &mut [f32],
    chunk_sums: Option<&mut Vec<f64>>,
) -> f64 {
    use std::arch::x86_64::*;
    const _: () = assert!(std::mem::size_of::<SdCandidate>() == 8);
    let src = cands.as_ptr().cast::<f32>();
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    // SAFETY: `exp_shifted_avx512_from` loads at i only when i + 16 <=
    // cands.len(): 32 f32 of 16 pairs in bounds.
    let load = |i: usize| unsafe {
        let a = _mm512_loadu_ps(src.add(2 * i));
        let b = _mm512_loadu_ps(src.add(2 * i + 16));
        _mm512_permutex2var_ps(a, odd, b)
    };
    // SAFETY: AVX-512F is enabled in this function.
    unsafe { exp_shifted_avx512_from(load, |i| cands[i].logit, max, out, chunk_sums) }
}

/// The body of the AVX-512 `exp_shifted`s: `load(i)` gives the 16 logits
/// from i (called with i + 16 <= out.len()), `get(i)` one logit.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn exp_shifted_avx512_from(
    load: impl Fn(usize) -> std::arch::x86_64::__m512,
    get: impl Fn(usize) -> f32,
    max: f32,
    out: &mut [f32],
    mut chunk_sums: Option<&mut Vec<f64>>,
) -> f64 {
    use exp_consts::*;
    use std::arch::x86_64::*;
    if let Some(cs) = chunk_sums.as_deref_mut() {
        cs.clear();
    }
    // SAFETY (whole body): register-only AVX-512F operations (the caller
    // runs with AVX-512F enabled), and stores checked below.
    unsafe {
        let vmax = _mm512_set1_ps(max);
        let lo = _mm512_set1_ps(LO);
        let magic = _mm512_set1_ps(MAGIC);
        let magic_bits = _mm512_set1_epi32(MAGIC.to_bits() as i32);
        let exp16 = |v: __m512| -> __m512 {
            let x = _mm512_sub_ps(v, vmax);
            // x <= 0 (max is the maximum): only the lower clamp applies
            let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, lo);
            let xc = _mm512_max_ps(x, lo);
            let t = _mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)), magic);
            let n_bits = _mm512_sub_epi32(_mm512_castps_si512(t), magic_bits);
            let n = _mm512_sub_ps(t, magic);
            let r = _mm512_sub_ps(
                _mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(C1))),
                _mm512_mul_ps(n, _mm512_set1_ps(C2)),
            );
            let mut y = _mm512_set1_ps(P[0]);
            for &c in &P[1..] {
                y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(c));
            }
            y = _mm512_add_ps(
                _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(y, r), r), r),
                _mm512_set1_ps(1.0),
            );
            let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
                n_bits,
                _mm512_set1_epi32(127),
            )));
            _mm512_maskz_mul_ps(!under, y, scale)
        };
        let n = out.len();
        let mut total = 0.0f64;
        let full = n / CHUNK;
        for ci in 0..full {
            let base = ci * CHUNK;
            let mut acc = _mm512_setzero_ps();
            for k in 0..CHUNK / 16 {
                let e = exp16(load(base + 16 * k));
                // base + 16k + 16 <= n: in bounds
                _mm512_storeu_ps(out.as_mut_ptr().add(base + 16 * k), e);
                acc = if k == 0 { e } else { _mm512_add_ps(acc, e) };
            }
            // sum_chunk's tree: quarters (0 + 2) + (1 + 3), then lanes
            let q0 = _mm512_castps512_ps128(acc);
            let q1 = _mm512_extractf32x4_ps::<1>(acc);
            let q2 = _mm512_extractf32x4_ps::<2>(acc);
            let q3 = _mm512_extractf32x4_ps::<3>(acc);
            let m = _mm_add_ps(_mm_add_ps(q0, q2), _mm_add_ps(q1, q3));
            let h = _mm_add_ps(m, _mm_movehl_ps(m, m));
            let cs = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps::<0b01>(h, h))) as f64;
            if let Some(v) = chunk_sums.as_deref_mut() {
                v.push(cs);
            }
            total += cs;
        }
        let base = full * CHUNK;
        let mut cs = 0.0f64;
        for (i, o) in out.iter_mut().enumerate().skip(base) {
            let e = exp_f32(get(i) - max);
            *o = e;
            cs += e as f64;
        }
        if base < n {
            if let Some(v) = chunk_sums {
                v.push(cs);
            }
            total += cs;
        }
        total
    }
}

#[inline(always)]
fn exp_shifted_impl(
    x: &[f32],
    max: f32,
    out: &mut [f32],
    mut chunk_sums: Option<&mut Vec<f64>>,
) -> f64 {
    debug_assert_eq!(x.len(), out.len());
    if let Some(cs) = chunk_sums.as_deref_mut() {
        cs.clear();
    }
    let mut total = 0.0f64;
    let mut xs = x.chunks_exact(CHUNK);
    let mut os = out.chunks_exact_mut(CHUNK);
    for (xc, oc) in (&mut xs).zip(&mut os) {
        let xc: &[f32; CHUNK] = xc.try_into().expect("chunk");
        let oc: &mut [f32; CHUNK] = oc.try_into().expect("chunk");
        exp_chunk(xc, max, oc);
        let cs = sum_chunk(oc) as f64;
        if let Some(v) = chunk_sums.as_deref_mut() {
            v.push(cs);
        }
        total += cs;
    }
    let mut cs = 0.0f64;
    let rem = xs.remainder();
    for (&v, o) in rem.iter().zip(os.into_remainder()) {
        let e = exp_f32(v - max);
        *o = e;
        cs += e as f64;
    }
    if !rem.is_empty() {
        if let Some(v) = chunk_sums {
            v.push(cs);
        }
        total += cs;
    }
    total
}

/// Bit j of the result is set when `c[j] >= t` (hand-written SSE2 on
/// x86_64: compare + movemask, 4 lanes at a time).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn ge_mask(c: &[f32; CHUNK], t: f32) -> u64 {
    use std::arch::x86_64::*;
    let p = c.as_ptr();
    let mut m = 0u64;
    // SAFETY: SSE2 is baseline; loads stay within the 64-float array.
    unsafe {
        let tv = _mm_set1_ps(t);
        for q in 0..CHUNK / 4 {
            let v = _mm_loadu_ps(p.add(q * 4));
            m |= (_mm_movemask_ps(_mm_cmpge_ps(v, tv)) as u64) << (q * 4);
        }
    }
    m
}

/// Bit j of the result is set when `c[j] >= t` (portable version).
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
pub fn ge_mask(c: &[f32; CHUNK], t: f32) -> u64 {
    let mut m = 0u64;
    for (j, &v) in c.iter().enumerate() {
        m |= ((v >= t) as u64) << j;
    }
    m
}

/// Bit j of the result is the sign bit of `c[j]` (SSE2 movemask on
/// x86_64).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn sign_mask(c: &[f32; CHUNK]) -> u64 {
    use std::arch::x86_64::*;
    let p = c.as_ptr();
    let mut m = 0u64;
    // SAFETY: SSE2 is baseline; loads stay within the 64-float array.
    unsafe {
        for q in 0..CHUNK / 4 {
            m |= (_mm_movemask_ps(_mm_loadu_ps(p.add(q * 4))) as u64) << (q * 4);
        }
    }
    m
}

/// Bit j of the result is the sign bit of `c[j]` (portable version).
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
pub fn sign_mask(c: &[f32; CHUNK]) -> u64 {
    let mut m = 0u64;
    for (j, &v) in c.iter().enumerate() {
        m |= ((v.to_bits() >> 31) as u64) << j;
    }
    m
}

/// Replaces `out` with the indices i of `x` where `x[i] >= t`, ascending.
/// Cost: one vectorised compare pass plus O(hits).
pub fn indices_at_least(x: &[f32], t: f32, out: &mut Vec<u32>) {
    out.clear();
    let mut chunks = x.chunks_exact(CHUNK);
    for (ci, c) in (&mut chunks).enumerate() {
        let mut m = ge_mask(c.try_into().expect("chunk"), t);
        let base = (ci * CHUNK) as u32;
        while m != 0 {
            out.push(base + m.trailing_zeros());
            m &= m - 1;
        }
    }
    let tail = x.len() - chunks.remainder().len();
    for (j, &v) in chunks.remainder().iter().enumerate() {
        if v >= t {
            out.push((tail + j) as u32);
        }
    }
}

/// Sum of the values of `x` that are `>= t` (f32 lanes per chunk, f64
/// across chunks).
pub fn sum_at_least(x: &[f32], t: f32) -> f64 {
    let mut total = 0.0f64;
    let mut chunks = x.chunks_exact(CHUNK);
    for c in &mut chunks {
        let c: &[f32; CHUNK] = c.try_into().expect("chunk");
        let mut m = [0.0f32; CHUNK];
        for (d, &v) in m.iter_mut().zip(c) {
            *d = if v >= t { v } else { 0.0 };
        }
        total += sum_chunk(&m) as f64;
    }
    for &v in chunks.remainder() {
        if v >= t {
            total += v as f64;
        }
    }
    total
}

// ---------------------------------------------------------------------------
// Candidates
// ---------------------------------------------------------------------------

/// Descending by logit, ties by ascending id (a total, deterministic order).
#[inline]
pub fn desc(a: &SdCandidate, b: &SdCandidate) -> Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// Sorts the live candidates descending (ties: lower id first) unless the
/// buffer says they already are.
pub fn sort_candidates(tokens: &mut Tokens<'_>) {
    if !tokens.is_sorted() {
        tokens.candidates_mut().sort_unstable_by(desc);
        let n = tokens.len();
        tokens.set_candidates(n, true);
    }
}

/// Switches a dense buffer to the candidate view holding every token in id
/// order (what the host does for a stage without DENSE_OK). No-op in the
/// candidate view.
pub fn to_candidates(tokens: &mut Tokens<'_>) {
    if tokens.view() == ViewKind::Dense {
        let (dense, cand) = tokens.dense_and_buffer();
        for (i, (c, &l)) in cand.iter_mut().zip(dense).enumerate() {
            *c = SdCandidate {
                id: i as u32,
                logit: l,
            };
        }
        let n = dense.len();
        tokens.set_candidates(n, false);
    }
}

/// Max logit of the live entries (either view); -inf when empty.
pub fn max_logit(tokens: &Tokens<'_>) -> f32 {
    match tokens.view() {
        ViewKind::Dense => max_scan(tokens.dense()),
        ViewKind::Candidates => {
            if tokens.is_sorted() {
                tokens
                    .candidates()
                    .first()
                    .map_or(f32::NEG_INFINITY, |c| c.logit)
            } else {
                candidates_max(tokens.candidates())
            }
        }
    }
}

/// The largest logit of `cands` (AVX-512: the pairs split in registers).
pub fn candidates_max(cands: &[SdCandidate]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        return unsafe { candidates_max_avx512(cands) };
    }
    cands
        .iter()
        .fold(f32::NEG_INFINITY, |m, c| fmax(m, c.logit))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn candidates_max_avx512(cands: &[SdCandidate]) -> f32 {
    use std::arch::x86_64::*;
    let src = cands.as_ptr().cast::<f32>();
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
    let full = cands.len() / 16 * 16;
    let mut i = 0;
    while i < full {
        // SAFETY: pairs i..i + 16 are in bounds (32 f32).
        let l = unsafe {
            _mm512_permutex2var_ps(
                _mm512_loadu_ps(src.add(2 * i)),
                odd,
                _mm512_loadu_ps(src.add(2 * i + 16)),
            )
        };
        m = _mm512_max_ps(m, l);
        i += 16;
    }
    cands[full..]
        .iter()
        .fold(_mm512_reduce_max_ps(m), |m, c| fmax(m, c.logit))
}

/// Softmax of a candidate list in its current order: `probs[i]` (f32) and
/// the f64 normaliser. `probs` is cleared and refilled (no allocation once
/// its capacity suffices).
pub fn softmax_into(cands: &[SdCandidate], probs: &mut Vec<f32>) -> f64 {
    probs.clear();
    let max = cands
        .iter()
        .fold(f32::NEG_INFINITY, |m, c| fmax(m, c.logit));
    if max == f32::NEG_INFINITY {
        probs.resize(cands.len(), 0.0);
        return 0.0;
    }
    let mut sum = 0.0f64;
    for c in cands {
        let e = exp_f32(c.logit - max);
        probs.push(e);
        sum += e as f64;
    }
    if sum > 0.0 {
        for p in probs.iter_mut() {
            *p = (*p as f64 / sum) as f32;
        }
    }
    sum
}

/// `new`, the result of arithmetic on the logit `old`, kept finite: a finite
/// logit must not overflow to +inf (which poisons every later softmax: inf -
/// inf = NaN) nor to -inf (which would mask the token); a masked logit
/// (`old` = -inf) stays masked. Found by fuzzing (fuzz/fuzz_targets/chain.rs).
#[inline(always)]
pub fn saturate(old: f32, new: f32) -> f32 {
    if old == f32::NEG_INFINITY {
        old
    } else {
        new.clamp(-f32::MAX, f32::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std_within_a_few_ulp() {
        let mut x = -90.0f32;
        while x < 88.0 {
            let want = x.exp();
            let got = exp_f32(x);
            if want > 1.2e-38 {
                let rel = ((got - want) / want).abs();
                assert!(rel < 4e-7, "exp({x}) = {got}, std {want}");
            } else {
                assert!(got <= 1.2e-38);
            }
            x += 0.01731;
        }
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
    }

    #[test]
    fn max_scan_and_chunk_maxima_agree() {
        let x: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919) % 1009) as f32 - 500.0)
            .collect();
        let mut cm = Vec::new();
        assert_eq!(max_scan(&x), 508.0);
        assert_eq!(chunk_maxima(&x, &mut cm), 508.0);
        assert_eq!(cm.len(), 1000usize.div_ceil(CHUNK));
        assert_eq!(max_scan(&[]), f32::NEG_INFINITY);
    }

    #[test]
    fn masks_and_masked_sums() {
        let x: Vec<f32> = (0..200).map(|i| ((i * 37) % 101) as f32).collect();
        let mut idx = Vec::new();
        indices_at_least(&x, 90.0, &mut idx);
        let want: Vec<u32> = (0..200u32).filter(|&i| x[i as usize] >= 90.0).collect();
        assert_eq!(idx, want);
        let s: f64 = x.iter().filter(|&&v| v >= 90.0).map(|&v| v as f64).sum();
        assert_eq!(sum_at_least(&x, 90.0), s);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp_shifted_avx512_is_bit_identical() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        for case in 0..60 {
            let n = [1usize, 63, 64, 65, 1000, 4097, 151_936][case % 7];
            let sd = [0.5, 3.0, 20.0, 60.0][case % 4];
            let mut x: Vec<f32> = (0..n).map(|_| ((rnd() - 0.5) * 2.0 * sd) as f32).collect();
            for v in x.iter_mut().step_by(7 + case) {
                *v = f32::NEG_INFINITY;
            }
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let max = if max == f32::NEG_INFINITY { 0.0 } else { max };
            let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
            let (mut ca, mut cb) = (Vec::new(), Vec::new());
            let ta = exp_shifted_impl(&x, max, &mut a, Some(&mut ca));
            // SAFETY: AVX-512F checked above.
            let tb = unsafe { exp_shifted_avx512(&x, max, &mut b, Some(&mut cb)) };
            assert_eq!(ta.to_bits(), tb.to_bits(), "case {case}: total");
            assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()));
            assert!(ca.iter().zip(&cb).all(|(p, q)| p.to_bits() == q.to_bits()));
            assert_eq!(ca.len(), cb.len());
        }
    }

    #[test]
    fn candidate_exp_matches_the_copied_logits() {
        for n in [0usize, 5, 64, 100, 1000, 20_000] {
            let cands: Vec<SdCandidate> = (0..n as u32)
                .map(|i| SdCandidate {
                    id: i * 3,
                    logit: ((i * 7919) % 1000) as f32 * 0.013 - 6.0,
                })
                .collect();
            let mut scratch = Vec::new();
            let max = candidates_max(&cands);
            let want_max = cands.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.logit));
            assert_eq!(max, want_max, "n {n}");
            let logits: Vec<f32> = cands.iter().map(|c| c.logit).collect();
            let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
            let (mut ca, mut cb) = (Vec::new(), Vec::new());
            let ta = exp_shifted(&logits, max, &mut a, Some(&mut ca));
            let tb = exp_shifted_candidates(&cands, max, &mut b, &mut scratch, Some(&mut cb));
            assert_eq!(ta.to_bits(), tb.to_bits(), "n {n}");
            assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()));
            assert_eq!(ca, cb);
        }
    }

    #[test]
    fn exp_shifted_sums() {
        let x: Vec<f32> = (0..200).map(|i| (i as f32) * 0.01).collect();
        let mut out = vec![0.0; 200];
        let mut cs = Vec::new();
        let s = exp_shifted(&x, 1.99, &mut out, Some(&mut cs));
        assert_eq!(cs.len(), 4);
        assert!((cs.iter().sum::<f64>() - s).abs() < 1e-9);
        let want: f64 = x.iter().map(|&v| ((v - 1.99) as f64).exp()).sum();
        assert!((s - want).abs() / want < 1e-6);
        assert!((out[199] - 1.0).abs() < 1e-6);
    }
}
