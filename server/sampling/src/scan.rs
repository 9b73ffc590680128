//! One fused pass over a step's incoming logits: copy them into the token
//! buffer, reject NaN / +∞ (naming the first bad index), find the maximum
//! and accumulate the log-sum-exp behind the response's `logprob` — block
//! by block, while each block is still in L1, instead of one memory pass
//! per job (copy, validate, max, exp-sum). The RPC hot path uses it through
//! `TokenBuffer::load_scan` / `load_f32le_scan`.

use crate::error::LogitsError;

/// Logits per block: 4 KiB, so a block copied from the request is still in
/// L1 when it is checked and exponentiated.
const BLOCK: usize = 1024;
/// Independent accumulator lanes (no loop-carried dependency, so LLVM
/// vectorises: two AVX2 registers, four SSE ones).
const LANES: usize = 16;

/// What the scan learnt about valid logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scan {
    /// The largest logit.
    pub max: f32,
    /// log Σ exp(logits) (what `logits::log_sum_exp` computes).
    pub log_sum_exp: f32,
}

/// Where the logits come from.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// Already in place (the destination holds them).
    InPlace,
    Floats(&'a [f32]),
    /// Raw little-endian f32.
    Bytes(&'a [u8]),
}

/// Copies `src` into `dst` (same length) and scans it.
pub fn copy_scan(dst: &mut [f32], src: &[f32]) -> Result<Scan, LogitsError> {
    assert_eq!(dst.len(), src.len(), "copy_scan: length mismatch");
    dispatch(dst, Source::Floats(src))
}

/// Decodes raw little-endian f32 `src` (4 bytes per logit) into `dst` and
/// scans it.
pub fn copy_scan_f32le(dst: &mut [f32], src: &[u8]) -> Result<Scan, LogitsError> {
    assert_eq!(dst.len() * 4, src.len(), "copy_scan_f32le: length mismatch");
    dispatch(dst, Source::Bytes(src))
}

/// Scans logits already in place.
pub fn scan(logits: &mut [f32]) -> Result<Scan, LogitsError> {
    dispatch(logits, Source::InPlace)
}

/// Runs [`scan_body`] compiled for AVX-512 (16 lanes in one register: half
/// the exp work of AVX2) or AVX2+FMA when the CPU has them (checked at run
/// time; std caches the answer), else for the baseline.
fn dispatch(dst: &mut [f32], src: Source<'_>) -> Result<Scan, LogitsError> {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
        fn avx512(dst: &mut [f32], src: Source<'_>) -> Result<Scan, LogitsError> {
            scan_body::<true>(dst, src)
        }
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU supports every feature enabled above.
            return unsafe { avx512(dst, src) };
        }
        #[target_feature(enable = "avx2,fma")]
        fn avx2(dst: &mut [f32], src: Source<'_>) -> Result<Scan, LogitsError> {
            scan_body::<true>(dst, src)
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            return unsafe { avx2(dst, src) };
        }
    }
    scan_body::<false>(dst, src)
}

/// a·b + c: one fused instruction where the CPU has FMA (`FMA` is only set
/// in the AVX2+FMA build), else a multiply and an add — `f32::mul_add`
/// without hardware FMA is a slow libm call.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// e^x for x ≤ 0, as a term of a sum: `logits::fast_exp`'s range reduction
/// and Cephes polynomial (within ~2 ulp of libm), in Horner form on FMAs,
/// and without its exact-zero select: x < −87 (and −∞) gives e^−87 ≈ 2e−38
/// instead of 0, which cannot move a sum whose largest term is 1.
#[inline(always)]
fn exp_term<const FMA: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let xc = if x > -87.0 { x } else { -87.0 };
    let k = madd::<FMA>(xc, LOG2E, ROUND);
    let n = k - ROUND;
    let r = madd::<FMA>(n, -LN2_HI, xc);
    let r = madd::<FMA>(n, -LN2_LO, r);
    let mut p = 1.987_569_1e-4_f32;
    p = madd::<FMA>(p, r, 1.398_199_9e-3);
    p = madd::<FMA>(p, r, 8.333_452e-3);
    p = madd::<FMA>(p, r, 4.166_579_6e-2);
    p = madd::<FMA>(p, r, 0.166_666_65);
    p = madd::<FMA>(p, r, 0.5);
    p = madd::<FMA>(p, r, 1.0);
    let y = madd::<FMA>(p, r, 1.0);
    // 2^n from the rounding trick's bits (k = 1.5·2^23 + n exactly).
    let scale = f32::from_bits(k.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23);
    y * scale
}

/// NaN or +∞: not a logit (−∞ is, meaning "removed").
#[inline(always)]
fn is_bad(x: f32) -> bool {
    x.is_nan() | (x == f32::INFINITY)
}

#[inline(always)]
fn fill_block(dst: &mut [f32], src: Source<'_>, start: usize) {
    match src {
        Source::InPlace => {}
        Source::Floats(f) => dst.copy_from_slice(&f[start..start + dst.len()]),
        Source::Bytes(b) => {
            let bytes = &b[4 * start..4 * (start + dst.len())];
            if cfg!(target_endian = "little") {
                // The wire format is the memory format: a memcpy.
                bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(bytes);
            } else {
                for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                    *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        }
    }
}

/// Per block: copy, then (bad, max) over the block, then the block's
/// Σ exp(x − m) against the running maximum m (the running sum is rescaled
/// by exp(m_old − m) in f64 when the maximum grows). Sums are f32 per
/// lane within a block and f64 across blocks, as in `logits::log_sum_exp`.
#[inline(always)]
fn scan_body<const FMA: bool>(dst: &mut [f32], src: Source<'_>) -> Result<Scan, LogitsError> {
    if dst.is_empty() {
        return Err(LogitsError::Empty);
    }
    let mut m = f32::NEG_INFINITY;
    let mut total = 0.0f64;
    for (b, block) in dst.chunks_mut(BLOCK).enumerate() {
        let start = b * BLOCK;
        fill_block(block, src, start);
        let mut bad = [false; LANES];
        let mut lanes = [f32::NEG_INFINITY; LANES];
        let mut it = block.chunks_exact(LANES);
        for c in &mut it {
            for i in 0..LANES {
                let x = c[i];
                bad[i] |= is_bad(x);
                lanes[i] = if x > lanes[i] { x } else { lanes[i] };
            }
        }
        let mut any_bad = bad.iter().any(|&b| b);
        let mut bmax = lanes.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
        for &x in it.remainder() {
            any_bad |= is_bad(x);
            bmax = bmax.max(x);
        }
        if any_bad {
            let (i, &value) = block
                .iter()
                .enumerate()
                .find(|&(_, x)| is_bad(*x))
                .expect("a bad value was seen");
            return Err(LogitsError::NotFinite {
                index: start + i,
                value,
            });
        }
        if bmax > m {
            // exp(−∞) = 0 clears the (empty) sum of an all-−∞ prefix.
            total *= ((m - bmax) as f64).exp();
            m = bmax;
        }
        if m == f32::NEG_INFINITY {
            continue;
        }
        let mut sums = [0.0f32; LANES];
        let mut it = block.chunks_exact(LANES);
        for c in &mut it {
            for (s, &x) in sums.iter_mut().zip(c) {
                *s += exp_term::<FMA>(x - m);
            }
        }
        let tail: f32 = it.remainder().iter().map(|&x| exp_term::<FMA>(x - m)).sum();
        total += sums.iter().map(|&v| v as f64).sum::<f64>() + tail as f64;
    }
    if m == f32::NEG_INFINITY {
        return Err(LogitsError::AllMasked);
    }
    Ok(Scan {
        max: m,
        log_sum_exp: m + total.ln() as f32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logits;

    fn reference_lse(v: &[f32]) -> f64 {
        let m = v.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
        m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
    }

    fn varied(n: usize) -> Vec<f32> {
        // Increasing maxima across blocks exercise the rescaling.
        (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 77.0 - 6.0 + (i / 1000) as f32 * 0.5)
            .collect()
    }

    #[test]
    fn exp_term_matches_libm() {
        let mut x = -87.0f32;
        while x <= 0.0 {
            let want = x.exp();
            for got in [exp_term::<true>(x), exp_term::<false>(x)] {
                assert!(
                    ((got - want) / want).abs() < 5e-7,
                    "x={x} got={got} libm={want}"
                );
            }
            x += 0.0137;
        }
        assert!(exp_term::<false>(f32::NEG_INFINITY) < 1e-37);
        assert_eq!(exp_term::<false>(0.0), 1.0);
    }

    #[test]
    fn matches_f64_reference_and_copies() {
        for n in [1, 15, 16, 255, 256, 257, 10_000, 151_936] {
            let v = varied(n);
            let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
            let mut a = vec![0.0; n];
            let mut b = vec![0.0; n];
            let sa = copy_scan(&mut a, &v).unwrap();
            let sb = copy_scan_f32le(&mut b, &bytes).unwrap();
            assert_eq!(a, v);
            assert_eq!(b, v);
            assert_eq!(sa, sb);
            assert_eq!(sa.max, logits::max(&v));
            let r = reference_lse(&v);
            assert!(
                (sa.log_sum_exp as f64 - r).abs() < 1e-5 * r.abs().max(1.0),
                "n={n}: {} vs {r}",
                sa.log_sum_exp
            );
            assert_eq!(scan(&mut a).unwrap(), sa);
        }
    }

    #[test]
    fn max_first_then_small_and_masked_prefix() {
        // A large maximum in the first block, then a long tail; and a
        // prefix of masked blocks before the first finite logit.
        let mut v = vec![-3.0f32; 5000];
        v[3] = 40.0;
        let r = reference_lse(&v);
        let s = scan(&mut v.clone()).unwrap();
        assert!(
            (s.log_sum_exp as f64 - r).abs() < 1e-5 * r.abs(),
            "{s:?} vs {r}"
        );
        let mut w = vec![f32::NEG_INFINITY; 1000];
        w[900] = 2.0;
        w[950] = 1.0;
        let s = scan(&mut w.clone()).unwrap();
        let r = reference_lse(&w);
        assert!((s.log_sum_exp as f64 - r).abs() < 1e-6, "{s:?} vs {r}");
    }

    #[test]
    fn errors_match_validate() {
        let mut v = vec![0.5f32; 3000];
        v[1300] = f32::NAN;
        v[2000] = f32::INFINITY;
        let mut d = vec![0.0; 3000];
        // (Compared as text: the error carries the NaN, and NaN != NaN.)
        assert_eq!(
            copy_scan(&mut d, &v).unwrap_err().to_string(),
            logits::validate(&v).unwrap_err().to_string()
        );
        v[1300] = f32::NEG_INFINITY;
        assert!(matches!(
            copy_scan(&mut d, &v),
            Err(LogitsError::NotFinite { index: 2000, .. })
        ));
        assert_eq!(scan(&mut []), Err(LogitsError::Empty));
        assert_eq!(
            scan(&mut [f32::NEG_INFINITY; 300]),
            Err(LogitsError::AllMasked)
        );
    }
}
