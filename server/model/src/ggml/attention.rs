//! One attention head as llama.cpp's non-flash CPU path computes it.
//!
//! The reference: the forward pass's attention (which reads the f16 cache
//! directly) and the CUDA kernels are checked against it bit for bit.

use super::expf::expf_lane;
use super::flavor::{Flavor, has_fma};
use super::reduce::{reduce_vec_dot, reduce8, reduce16};

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

#[cfg(test)]
mod tests {
    use super::*;

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
