//! The AVX2 build of the cached attention: one head, or one group's heads, from the f16 cache.
//!
//! Operation for operation the arithmetic of `ggml::attention::attention_head`
//! (the tests of `cpu::attention` compare them bit for bit). Used only when
//! the CPU has AVX2, FMA and F16C.

use std::arch::x86_64::*;

use super::cached::CachedHead;
use crate::ggml::Flavor;
use crate::ggml::expf::expf8;
use crate::ggml::reduce::hsum;

pub(crate) fn usable() -> bool {
    static U: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *U.get_or_init(|| {
        let f = samplerd_numerics::features();
        f.avx2() && f.fma() && f.f16c()
    })
}

fn avx512() -> bool {
    samplerd_numerics::features().isa() == samplerd_numerics::Isa::Avx512
}

/// Picks the build: the AVX-512 order's sixteen lane accumulators need
/// more than AVX2's sixteen registers, so that order runs with AVX-512VL
/// enabled (32 registers, the same 256-bit arithmetic) where the CPU has
/// it.
///
/// # Safety
/// avx2, fma and f16c are present; slices as asserted by the caller.
pub(crate) unsafe fn head(
    h: &CachedHead<'_>,
    scores: &mut [f32],
    acc: &mut [f32],
    out: &mut [f32],
) {
    // SAFETY: the features each build enables were checked.
    unsafe {
        match h.flavor {
            Flavor::Avx2 => head_avx2::<1>(h, scores, acc, out),
            Flavor::Avx512 if avx512() => head_avx512::<2>(h, scores, acc, out),
            Flavor::Avx512 => head_avx2::<2>(h, scores, acc, out),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn head_avx2<const V: usize>(
    h: &CachedHead<'_>,
    s: &mut [f32],
    a: &mut [f32],
    o: &mut [f32],
) {
    // SAFETY: the caller's contract.
    unsafe { body::<V>(h, s, a, o) }
}

#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
unsafe fn head_avx512<const V: usize>(
    h: &CachedHead<'_>,
    s: &mut [f32],
    a: &mut [f32],
    o: &mut [f32],
) {
    // SAFETY: the caller's contract.
    unsafe { body::<V>(h, s, a, o) }
}

/// `attention_group` of a prompt row whose group has `R` heads
/// (1..=4), picking the build as [`head`] does.
///
/// # Safety
/// As [`head`]; `g.decode` is false.
pub(crate) unsafe fn group(
    g: &CachedHead<'_>,
    heads: usize,
    scores: &mut [f32],
    acc: &mut [f32],
    out: &mut [f32],
) {
    macro_rules! by_heads {
        ($f:ident, $v:literal) => {
            match heads {
                1 => $f::<$v, 1>(g, scores, acc, out),
                2 => $f::<$v, 2>(g, scores, acc, out),
                3 => $f::<$v, 3>(g, scores, acc, out),
                _ => $f::<$v, 4>(g, scores, acc, out),
            }
        };
    }
    // SAFETY: the features each build enables were checked.
    unsafe {
        match g.flavor {
            Flavor::Avx2 => by_heads!(group_avx2, 1),
            Flavor::Avx512 if avx512() => by_heads!(group_avx512, 2),
            Flavor::Avx512 => by_heads!(group_avx2, 2),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_avx2<const V: usize, const R: usize>(
    g: &CachedHead<'_>,
    s: &mut [f32],
    a: &mut [f32],
    o: &mut [f32],
) {
    // SAFETY: the caller's contract.
    unsafe { group_body::<V, R>(g, s, a, o) }
}

#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
unsafe fn group_avx512<const V: usize, const R: usize>(
    g: &CachedHead<'_>,
    s: &mut [f32],
    a: &mut [f32],
    o: &mut [f32],
) {
    // SAFETY: the caller's contract.
    unsafe { group_body::<V, R>(g, s, a, o) }
}

/// The `R` heads' prompt scores in one pass over K, then each head's
/// softmax and V sum.
#[inline(always)]
unsafe fn group_body<const V: usize, const R: usize>(
    g: &CachedHead<'_>,
    scores: &mut [f32],
    acc: &mut [f32],
    out: &mut [f32],
) {
    let hd = g.q16.len() / R;
    let stride = g.n_pos.div_ceil(16) * 16;
    // SAFETY: the callers' contract (features; `q16` R·hd, `scores`
    // R·stride, `out` R·hd, asserted by the public entry point).
    unsafe {
        let max = kq_prompt::<V, R>(g, scores, stride);
        for (r, max) in max.into_iter().enumerate() {
            let head = CachedHead {
                q16: &g.q16[r * hd..(r + 1) * hd],
                ..*g
            };
            let sc = &mut scores[r * stride..(r + 1) * stride];
            softmax_kqv::<V>(&head, sc, acc, &mut out[r * hd..(r + 1) * hd], max);
        }
    }
}

/// The prompt scores (`kq · scale`, tinyBLAS's order: one `W = 8V`-lane
/// accumulator per position, fma over chunks of `W`, a horizontal sum,
/// then the tail) of the `R` heads whose queries follow one another in
/// `g.q16`, into `scores[r·stride + p]`; returns each head's maximum. One
/// pass over K: each key is loaded and widened once for all `R` heads,
/// and the chains of up to four positions are interleaved. (Index loops:
/// each walks several arrays and pointers in step.)
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn kq_prompt<const V: usize, const R: usize>(
    g: &CachedHead<'_>,
    scores: &mut [f32],
    stride: usize,
) -> [f32; R] {
    let (hd, n_pos) = (g.q16.len() / R, g.n_pos);
    let w = 8 * V;
    // Positions per pass: at most 12 accumulators (AVX2's 16 registers).
    let pp = (12 / (R * V)).clamp(1, 4);
    let nc = hd / w * w;
    let kp = g.k.as_ptr();
    let mut max = [f32::NEG_INFINITY; R];
    // SAFETY: (the whole body) avx2, fma and f16c are enabled in every
    // caller; `k` holds `n_pos × hd` values, `q16` R·hd and `scores`
    // R·stride; `hd` is a multiple of 8.
    unsafe {
        let mut p = 0;
        while p < n_pos {
            let np = (n_pos - p).min(pp);
            let mut l = [[[_mm256_setzero_ps(); V]; R]; 4];
            let mut c = 0;
            while c < nc {
                for j in 0..V {
                    let mut qv = [_mm256_setzero_ps(); R];
                    for r in 0..R {
                        qv[r] = _mm256_loadu_ps(g.q16.as_ptr().add(r * hd + c + 8 * j));
                    }
                    for (i, li) in l.iter_mut().enumerate().take(np) {
                        let kv = load_f16(kp.add((p + i) * hd + c + 8 * j));
                        for r in 0..R {
                            li[r][j] = _mm256_fmadd_ps(qv[r], kv, li[r][j]);
                        }
                    }
                }
                c += w;
            }
            for (i, li) in l.iter().enumerate().take(np) {
                let k = kp.add((p + i) * hd);
                for r in 0..R {
                    let q = &g.q16[r * hd..(r + 1) * hd];
                    let mut s = reduce::<V>(li[r]);
                    for x in nc..hd {
                        s += q[x] * (*k.add(x)).to_f32();
                    }
                    let s = s * g.scale;
                    scores[r * stride + p + i] = s;
                    max[r] = max[r].max(s);
                }
            }
            p += np;
        }
    }
    max
}

/// A decode row's scores (`ggml_vec_dot_f16`'s order: lanes `i % 4W` over
/// full steps of `4W`, reduced pairwise, then horizontally; leftovers in
/// f64) into `scores`; returns their maximum.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn kq_decode<const V: usize>(h: &CachedHead<'_>, scores: &mut [f32]) -> f32 {
    let (q, n_pos) = (h.q16, h.n_pos);
    let hd = q.len();
    let step = 4 * 8 * V;
    let np = hd / step * step;
    let kp = h.k.as_ptr();
    let mut max = f32::NEG_INFINITY;
    // SAFETY: (the whole body) avx2, fma and f16c are enabled in every
    // caller; `k` holds `n_pos × hd` values and `scores` n_pos; every
    // vector load lies below `np ≤ hd`.
    unsafe {
        for p in 0..n_pos {
            let k = kp.add(p * hd);
            let mut l = [_mm256_setzero_ps(); 8];
            let mut c = 0;
            while c < np {
                for m in 0..4 * V {
                    let qv = _mm256_loadu_ps(q.as_ptr().add(c + 8 * m));
                    l[m] = _mm256_fmadd_ps(qv, load_f16(k.add(c + 8 * m)), l[m]);
                }
                c += step;
            }
            let mut x = [_mm256_setzero_ps(); V];
            for j in 0..V {
                x[j] = _mm256_add_ps(
                    _mm256_add_ps(l[j], l[2 * V + j]),
                    _mm256_add_ps(l[V + j], l[3 * V + j]),
                );
            }
            let mut s = if V == 2 {
                reduce::<V>(x) as f64
            } else {
                // GGML_F32x8_REDUCE: lo128 + hi128, then two hadds.
                let t = _mm_add_ps(_mm256_castps256_ps128(x[0]), _mm256_extractf128_ps(x[0], 1));
                let t = _mm_hadd_ps(t, t);
                _mm_cvtss_f32(_mm_hadd_ps(t, t)) as f64
            };
            for i in np..hd {
                s += (q[i] * (*k.add(i)).to_f32()) as f64;
            }
            let s = s as f32 * h.scale;
            scores[p] = s;
            max = max.max(s);
        }
    }
    max
}

/// Eight f16 values at `p` widened to f32 (exact).
#[inline(always)]
unsafe fn load_f16(p: *const half::f16) -> __m256 {
    // SAFETY: the caller guarantees 8 readable values at `p`.
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
}

/// The reference's horizontal sum of one `W = 8V`-lane vector held as
/// `V` registers: ggml's `hsum_float_8`, or GCC's `_mm512_reduce_add_ps`
/// (`hi256 + lo256`, then the same steps).
#[inline(always)]
unsafe fn reduce<const V: usize>(v: [__m256; V]) -> f32 {
    // SAFETY: avx2 is enabled in every caller (register-only intrinsics).
    unsafe {
        if V == 2 {
            hsum(_mm256_add_ps(v[1], v[0]))
        } else {
            hsum(v[0])
        }
    }
}

/// The reference's per-lane reduction of `W` lane registers (lane `e`
/// in `l[e]`, one value of the output per register lane): `reduce8` /
/// `reduce16` done vertically.
#[inline(always)]
unsafe fn reduce_lanes<const W: usize>(l: &[__m256; W]) -> __m256 {
    // SAFETY: as for `reduce`.
    unsafe {
        // (Loops, not closures: a closure would not inherit the
        // caller's target features, and the intrinsics in it stayed
        // calls.)
        let mut t = [_mm256_setzero_ps(); 8];
        for k in 0..8 {
            t[k] = if W == 16 {
                _mm256_add_ps(l[8 + k], l[k])
            } else {
                l[k.min(W - 1)]
            };
        }
        let mut t6 = [_mm256_setzero_ps(); 4];
        for m in 0..4 {
            t6[m] = _mm256_add_ps(t[4 + m], t[m]);
        }
        _mm256_add_ps(_mm256_add_ps(t6[0], t6[2]), _mm256_add_ps(t6[1], t6[3]))
    }
}

/// The head, `W = 8V` lanes (8: AVX2's order, 16: AVX-512's).
#[inline(always)]
unsafe fn body<const V: usize>(
    h: &CachedHead<'_>,
    scores: &mut [f32],
    acc: &mut [f32],
    out: &mut [f32],
) {
    // SAFETY: the callers' contract (features; slices asserted by the
    // public entry point).
    unsafe {
        let max = if h.decode {
            kq_decode::<V>(h, scores)
        } else {
            let [max] = kq_prompt::<V, 1>(h, scores, 0);
            max
        };
        softmax_kqv::<V>(h, scores, acc, out, max);
    }
}

/// The head's softmax over its scores (maximum `max`) and the
/// probability-weighted sum of V into `out`. (Index loops: each walks
/// several arrays and pointers in step.)
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn softmax_kqv<const V: usize>(
    h: &CachedHead<'_>,
    scores: &mut [f32],
    acc: &mut [f32],
    out: &mut [f32],
    max: f32,
) {
    let (hd, n_pos) = (h.q16.len(), h.n_pos);
    let w = 8 * V;
    let vp = h.v.as_ptr();
    // SAFETY: (the whole body) avx2, fma and f16c are enabled in every
    // caller; `v` holds `n_pos × hd` values, `scores` n_pos rounded up to
    // 16, `acc` 64·hd, `out` hd (asserted by the public entry point);
    // `hd` is a multiple of 8, so every 8-value load below stays inside
    // its row.
    unsafe {
        // softmax: exp per vector of `W` lanes (masked lanes 0), each
        // vector's horizontal sum accumulated in f64.
        let maxv = _mm256_set1_ps(max);
        let mut sum = 0f64;
        let mut p = 0;
        while p < n_pos {
            let mut e = [_mm256_setzero_ps(); V];
            for (j, ej) in e.iter_mut().enumerate() {
                let at = p + 8 * j;
                let live = (n_pos.saturating_sub(at)).min(8) as i32;
                let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let mask = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(live), idx));
                // Dead lanes (past n_pos) hold scratch: exp(0) there,
                // then 0, as the reference's unused lanes.
                let x = _mm256_sub_ps(_mm256_loadu_ps(scores.as_ptr().add(at)), maxv);
                let y = expf8(_mm256_and_ps(x, mask), h.flavor);
                let y = _mm256_and_ps(y, mask);
                _mm256_storeu_ps(scores.as_mut_ptr().add(at), y);
                *ej = y;
            }
            sum += reduce::<V>(e) as f64;
            p += w;
        }
        let inv = _mm256_set1_ps((1.0 / sum) as f32);
        let mut p = 0;
        while p < n_pos {
            let at = scores.as_mut_ptr().add(p);
            let r = _mm256_mul_ps(_mm256_loadu_ps(at), inv);
            let r16 = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r);
            _mm256_storeu_ps(at, _mm256_cvtph_ps(r16));
            p += 8;
        }
        // kqv: out[d] = Σ_p p16[p]·v[p][d], lane `p % W` (prefill) or
        // `p % 4W` (decode), then the lanes reduced in the reference's
        // order — vertically, eight values of `d` at a time.
        if h.decode {
            let nl = 4 * w;
            let acc = &mut acc[..nl * hd];
            acc.fill(0.0);
            for p in 0..n_pos {
                let pr = _mm256_set1_ps(scores[p]);
                let a = acc.as_mut_ptr().add(p % nl * hd);
                let v = vp.add(p * hd);
                for d in (0..hd).step_by(8) {
                    let y = _mm256_fmadd_ps(pr, load_f16(v.add(d)), _mm256_loadu_ps(a.add(d)));
                    _mm256_storeu_ps(a.add(d), y);
                }
            }
            for d in (0..hd).step_by(8) {
                let mut l = [_mm256_setzero_ps(); 64];
                for (e, le) in l.iter_mut().enumerate().take(nl) {
                    *le = _mm256_loadu_ps(acc.as_ptr().add(e * hd + d));
                }
                // GGML_F16_VEC_REDUCE: `x0+x2`, `x1+x3`, `x0+x1`, then
                // horizontally (lane `e` of the 4W is register `e`).
                let mut x = [_mm256_setzero_ps(); 16];
                for e in 0..w {
                    x[e] = _mm256_add_ps(
                        _mm256_add_ps(l[e], l[2 * w + e]),
                        _mm256_add_ps(l[w + e], l[3 * w + e]),
                    );
                }
                let r = if V == 2 {
                    reduce_lanes::<16>(&x)
                } else {
                    // GGML_F32x8_REDUCE: t = lo128 + hi128, then
                    // (t0+t1) + (t2+t3).
                    let mut t = [_mm256_setzero_ps(); 4];
                    for i in 0..4 {
                        t[i] = _mm256_add_ps(x[i], x[4 + i]);
                    }
                    _mm256_add_ps(_mm256_add_ps(t[0], t[1]), _mm256_add_ps(t[2], t[3]))
                };
                _mm256_storeu_ps(out.as_mut_ptr().add(d), r);
            }
        } else {
            for d in (0..hd).step_by(8) {
                let mut l = [_mm256_setzero_ps(); 16];
                let mut p = 0;
                while p + w <= n_pos {
                    for (e, le) in l.iter_mut().enumerate().take(w) {
                        let pr = _mm256_set1_ps(*scores.get_unchecked(p + e));
                        *le = _mm256_fmadd_ps(pr, load_f16(vp.add((p + e) * hd + d)), *le);
                    }
                    p += w;
                }
                for (e, le) in l.iter_mut().enumerate().take(n_pos - p) {
                    let pr = _mm256_set1_ps(scores[p + e]);
                    *le = _mm256_fmadd_ps(pr, load_f16(vp.add((p + e) * hd + d)), *le);
                }
                let r = if V == 2 {
                    reduce_lanes::<16>(&l)
                } else {
                    reduce_lanes::<8>(l.first_chunk().expect("16 lanes"))
                };
                _mm256_storeu_ps(out.as_mut_ptr().add(d), r);
            }
        }
    }
}
