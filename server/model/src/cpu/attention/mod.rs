//! Attention of one head, or of one grouped-query group's heads, straight from the f16 KV cache.
//!
//! Heads of a group share a K and V head. Computes exactly what the
//! reference [`ggml::attention::attention_head`](reference::attention_head) computes
//! (llama.cpp's non-flash path) operation for operation, so the results are
//! bit-equal (tested below against the reference on random heads of both
//! arithmetic orders). The AVX2 build is `avx2`; without AVX2,
//! F16C and FMA, the reference runs on f32 copies.
//!
//! Why a second implementation: the reference takes f32 copies of the
//! cache, and a prompt's every token converted its whole prefix again (the
//! conversion alone was 8 % of a 557-token prefill), and its per-position
//! dot product is one fma chain bound by the fma latency, with the lane
//! loops over a run-time vector width left to the compiler. The AVX2 build
//! widens the f16 values in registers (`vcvtph2ps`, exact), interleaves
//! four positions' chains, scores a prompt row's group of heads in one
//! pass over K, computes the exponentials eight lanes at a time, and keeps
//! the probability-weighted sum of V in registers (the reference's
//! lane-per-position accumulators become one register per lane, reduced
//! vertically in the same order).

#[cfg(target_arch = "x86_64")]
mod avx2;
mod cached;

pub use cached::CachedHead;

use crate::ggml::attention::{self as reference, Head};
#[cfg(target_arch = "x86_64")]
use avx2 as simd;

/// [`reference::attention_head`] of `h`, bit for bit. `scores`: scratch
/// (≥ n_pos rounded up to 16); `acc`: scratch (≥ 64·hd); `out`: `hd` values.
pub fn attention_head(h: &CachedHead<'_>, scores: &mut [f32], acc: &mut [f32], out: &mut [f32]) {
    let hd = h.q16.len();
    assert!(h.k.len() >= h.n_pos * hd && h.v.len() >= h.n_pos * hd);
    assert!(scores.len() >= h.n_pos.div_ceil(16) * 16 && acc.len() >= 64 * hd);
    assert!(out.len() >= hd);
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(8) && simd::usable() {
        // SAFETY: `usable()` checked avx2, fma and f16c (and AVX-512 before
        // the AVX-512 build is chosen); the lengths are asserted above.
        unsafe { simd::head(h, scores, acc, out) };
        return;
    }
    // No AVX2/F16C, or a head size that is no multiple of 8: f32 copies and
    // the reference.
    let n = h.n_pos * hd;
    let kf: Vec<f32> = h.k[..n].iter().map(|x| x.to_f32()).collect();
    let vf: Vec<f32> = h.v[..n].iter().map(|x| x.to_f32()).collect();
    let head = Head {
        q16: h.q16,
        kf: &kf,
        vf: &vf,
        n_pos: h.n_pos,
        scale: h.scale,
        decode: h.decode,
        flavor: h.flavor,
    };
    reference::attention_head(&head, scores, acc, out);
}

/// [`attention_head`] of each of the `heads` heads of one grouped-query
/// group (they share one K and V head) for one row, bit for bit: `g.q16`
/// holds their queries and `out` their outputs, one after another. A
/// prompt row's group of up to four heads computes its scores in one pass
/// over K. `scores`: scratch (heads × n_pos rounded up to 16); `acc`:
/// scratch (≥ 64·hd).
pub fn attention_group(
    g: &CachedHead<'_>,
    heads: usize,
    scores: &mut [f32],
    acc: &mut [f32],
    out: &mut [f32],
) {
    let hd = g.q16.len() / heads;
    let stride = g.n_pos.div_ceil(16) * 16;
    assert!(heads > 0 && g.q16.len() == heads * hd && out.len() >= heads * hd);
    assert!(g.k.len() >= g.n_pos * hd && g.v.len() >= g.n_pos * hd);
    assert!(scores.len() >= heads * stride && acc.len() >= 64 * hd);
    #[cfg(target_arch = "x86_64")]
    if !g.decode && heads <= 4 && hd.is_multiple_of(8) && simd::usable() {
        // SAFETY: `usable()` checked avx2, fma and f16c; the lengths are
        // asserted above.
        unsafe { simd::group(g, heads, scores, acc, out) };
        return;
    }
    for r in 0..heads {
        let head = CachedHead {
            q16: &g.q16[r * hd..(r + 1) * hd],
            ..*g
        };
        attention_head(&head, scores, acc, &mut out[r * hd..(r + 1) * hd]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ggml::Flavor;
    use crate::test_rng::Lcg;
    use half::f16;

    /// `n` random f16 values in [-scale, scale).
    fn halves(r: &mut Lcg, n: usize, scale: f32) -> Vec<f16> {
        (0..n).map(|_| f16::from_f32(r.f() * scale)).collect()
    }

    fn bits(o: &[f32]) -> Vec<u32> {
        o.iter().map(|x| x.to_bits()).collect()
    }

    /// A group's heads (1 to 5 of them, prompt and decode rows, both
    /// orders) equal each head computed alone, bit for bit.
    #[test]
    fn groups_equal_their_heads_alone() {
        let mut r = Lcg(9);
        for fl in [Flavor::Avx2, Flavor::Avx512] {
            for heads in 1usize..=5 {
                for (hd, n_pos) in [(64usize, 1usize), (64, 5), (64, 37), (72, 9), (128, 130)] {
                    for decode in [false, true] {
                        let q16: Vec<f32> = halves(&mut r, heads * hd, 3.0)
                            .iter()
                            .map(|x| x.to_f32())
                            .collect();
                        let k = halves(&mut r, n_pos * hd, 2.0);
                        let v = halves(&mut r, n_pos * hd, 2.0);
                        let scale = 1.0 / (hd as f32).sqrt();
                        let stride = n_pos.div_ceil(16) * 16;
                        let g = CachedHead {
                            q16: &q16,
                            k: &k,
                            v: &v,
                            n_pos,
                            scale,
                            decode,
                            flavor: fl,
                        };
                        let (mut sc, mut acc) =
                            (vec![f32::NAN; heads * stride], vec![0f32; 64 * hd]);
                        let mut got = vec![0f32; heads * hd];
                        attention_group(&g, heads, &mut sc, &mut acc, &mut got);
                        let mut want = vec![0f32; heads * hd];
                        for h in 0..heads {
                            let one = CachedHead {
                                q16: &q16[h * hd..(h + 1) * hd],
                                k: &k,
                                v: &v,
                                n_pos,
                                scale,
                                decode,
                                flavor: fl,
                            };
                            attention_head(
                                &one,
                                &mut sc,
                                &mut acc,
                                &mut want[h * hd..(h + 1) * hd],
                            );
                        }
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{fl:?} heads {heads} hd {hd} n_pos {n_pos} decode {decode}"
                        );
                    }
                }
            }
        }
    }

    /// Random heads of several head sizes and lengths (both orders, decode
    /// and prefill, including scores far below the maximum so the scalar
    /// far-range exponential runs): bit-equal to the reference.
    #[test]
    fn equals_the_reference_bit_for_bit() {
        let mut r = Lcg(7);
        for fl in [Flavor::Avx2, Flavor::Avx512] {
            for hd in [64usize, 128, 72, 8] {
                for n_pos in [1usize, 3, 7, 8, 16, 17, 63, 130] {
                    for decode in [false, true] {
                        for spread in [1.0f32, 40.0] {
                            let q16: Vec<f32> = halves(&mut r, hd, 2.0 * spread)
                                .iter()
                                .map(|x| x.to_f32())
                                .collect();
                            let k = halves(&mut r, n_pos * hd, 2.0);
                            let v = halves(&mut r, n_pos * hd, 2.0);
                            let kf: Vec<f32> = k.iter().map(|x| x.to_f32()).collect();
                            let vf: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
                            let scale = 1.0 / (hd as f32).sqrt();
                            let n_sc = n_pos.div_ceil(16) * 16;
                            let (mut s1, mut a1, mut o1) =
                                (vec![0f32; n_sc], vec![0f32; 64 * hd], vec![0f32; hd]);
                            let (mut s2, mut a2, mut o2) =
                                (vec![f32::NAN; n_sc], vec![0f32; 64 * hd], vec![0f32; hd]);
                            let want = Head {
                                q16: &q16,
                                kf: &kf,
                                vf: &vf,
                                n_pos,
                                scale,
                                decode,
                                flavor: fl,
                            };
                            reference::attention_head(&want, &mut s1, &mut a1, &mut o1);
                            let cached = CachedHead {
                                q16: &q16,
                                k: &k,
                                v: &v,
                                n_pos,
                                scale,
                                decode,
                                flavor: fl,
                            };
                            attention_head(&cached, &mut s2, &mut a2, &mut o2);
                            assert_eq!(
                                bits(&o1),
                                bits(&o2),
                                "{fl:?} hd {hd} n_pos {n_pos} decode {decode} spread {spread}"
                            );
                        }
                    }
                }
            }
        }
    }
}
