//! Whole-vocabulary helpers over raw logits: validation (finite or −∞),
//! log-softmax for the response's `logprob`, the top-n raw candidates, and
//! a vectorisable `exp` for the full-vocabulary sums. All loops are written
//! branch-free over fixed chunks so LLVM vectorises them.

use crate::error::LogitsError;

/// Runs `$body(arg)` compiled for AVX2+FMA when the CPU has them (checked
/// at run time; std caches the answer), else for the baseline (SSE2). The
/// body is `#[inline(always)]`, so the wrapper gets its own AVX2 copy.
macro_rules! dispatch {
    ($body:ident($arg:ident: $ty:ty) -> $ret:ty) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx2,fma")]
            fn avx2($arg: $ty) -> $ret {
                $body($arg)
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                // SAFETY: the CPU supports AVX2 and FMA (checked just above).
                return unsafe { avx2($arg) };
            }
        }
        $body($arg)
    }};
}

/// NaN or +∞: not a logit (−∞ is, meaning "removed"). Branch-free.
#[inline(always)]
fn is_bad(x: f32) -> bool {
    x.is_nan() | (x == f32::INFINITY)
}

/// Checks that no logit is NaN or +∞ (−∞ means "removed" and is allowed)
/// and that not all are −∞. One pass; the error names the first bad index.
pub fn validate(logits: &[f32]) -> Result<(), LogitsError> {
    dispatch!(validate_body(logits: &[f32]) -> Result<(), LogitsError>)
}

#[inline(always)]
fn validate_body(logits: &[f32]) -> Result<(), LogitsError> {
    if logits.is_empty() {
        return Err(LogitsError::Empty);
    }
    // 16 independent lanes (no loop-carried dependency) so LLVM vectorises;
    // the exact index is searched only once something bad was seen.
    let mut bad = [false; 16];
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = logits.chunks_exact(16);
    for c in &mut chunks {
        for i in 0..16 {
            let x = c[i];
            bad[i] |= is_bad(x);
            lanes[i] = if x > lanes[i] { x } else { lanes[i] };
        }
    }
    let mut any_bad = bad.iter().any(|&b| b);
    let mut max = lanes.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    for &x in chunks.remainder() {
        any_bad |= is_bad(x);
        max = max.max(x);
    }
    if any_bad {
        let (index, &value) = logits
            .iter()
            .enumerate()
            .find(|&(_, x)| is_bad(*x))
            .expect("a bad value was seen");
        return Err(LogitsError::NotFinite { index, value });
    }
    if max == f32::NEG_INFINITY {
        return Err(LogitsError::AllMasked);
    }
    Ok(())
}

/// The largest logit (−∞ for an empty slice). Meant for validated logits:
/// a NaN is ignored or returned depending on its position.
pub fn max(logits: &[f32]) -> f32 {
    dispatch!(max_body(logits: &[f32]) -> f32)
}

#[inline(always)]
fn max_body(logits: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = logits.chunks_exact(16);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            // A plain compare-select maps to one `maxps`; `f32::max`'s NaN
            // rules cost a blend per element (inputs here are validated).
            *l = if x > *l { x } else { *l };
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    lanes.iter().fold(tail, |m, &x| m.max(x))
}

/// e^x for x ≤ 0 (as in softmax after subtracting the max), within ~2 ulp
/// of libm's `expf`; −∞ and anything below −87 give exactly 0. Branch-free
/// so that loops over it vectorise (libm's `expf` does not).
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.max(-87.0);
    let k = xc * LOG2E + ROUND;
    let n = k - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    // Cephes expf minimax polynomial.
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n from the rounding trick's bits (k = 1.5·2^23 + n exactly):
    // integer ops only, so the loop vectorises (an `as i32` cast does not).
    let scale = f32::from_bits(k.to_bits().wrapping_sub(0x4B40_0000).wrapping_add(127) << 23);
    if x < -87.0 { 0.0 } else { y * scale }
}

/// libm's `expf`, for the few-candidate softmaxes where exactness matters
/// more than speed.
#[inline]
pub fn exp_f32(x: f32) -> f32 {
    x.exp()
}

/// log Σ exp(logits), with the sum accumulated per chunk in f32 and across
/// chunks in f64.
pub fn log_sum_exp(logits: &[f32]) -> f32 {
    dispatch!(log_sum_exp_body(logits: &[f32]) -> f32)
}

#[inline(always)]
fn log_sum_exp_body(logits: &[f32]) -> f32 {
    let m = max_body(logits);
    if m == f32::NEG_INFINITY {
        return f32::NEG_INFINITY;
    }
    let mut total = 0.0f64;
    for chunk in logits.chunks(256) {
        let mut lanes = [0.0f32; 16];
        let mut it = chunk.chunks_exact(16);
        for c in &mut it {
            for (l, &x) in lanes.iter_mut().zip(c) {
                *l += fast_exp(x - m);
            }
        }
        let tail: f32 = it.remainder().iter().map(|&x| fast_exp(x - m)).sum();
        total += lanes.iter().map(|&v| v as f64).sum::<f64>() + tail as f64;
    }
    m + total.ln() as f32
}

/// The `n` largest raw logits as (id, logit), descending, ties by id.
pub fn top_n(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if n > 256 {
        let mut all: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        all.select_nth_unstable_by(n - 1, by_logit);
        all.truncate(n);
        all.sort_by(by_logit);
        return all;
    }
    // Streaming: keep a sorted buffer of n; most entries fail one compare.
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    let mut threshold = f32::NEG_INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        if best.len() == n && l <= threshold {
            continue;
        }
        let pos = best.partition_point(|e| by_logit(e, &(i as u32, l)).is_lt());
        best.insert(pos, (i as u32, l));
        if best.len() > n {
            best.pop();
        }
        if best.len() == n {
            threshold = best[n - 1].1;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_names_first_bad_index() {
        let mut v = vec![0.5f32; 300];
        v[130] = f32::NAN;
        v[200] = f32::INFINITY;
        assert_eq!(
            validate(&v).unwrap_err().to_string(),
            "logits[130] is NaN: logits must be finite or -inf"
        );
        v[130] = f32::NEG_INFINITY;
        assert!(matches!(
            validate(&v),
            Err(LogitsError::NotFinite { index: 200, .. })
        ));
        v[200] = 1.0;
        assert!(validate(&v).is_ok());
        assert_eq!(validate(&[]), Err(LogitsError::Empty));
        assert_eq!(
            validate(&[f32::NEG_INFINITY; 3]),
            Err(LogitsError::AllMasked)
        );
    }

    #[test]
    fn fast_exp_matches_libm() {
        let mut x = -90.0f32;
        while x <= 0.0 {
            let (a, b) = (fast_exp(x), x.exp());
            if x < -87.0 {
                assert_eq!(a, 0.0);
            } else {
                assert!(((a - b) / b).abs() < 5e-7, "x={x} fast={a} libm={b}");
            }
            x += 0.0137;
        }
        assert_eq!(fast_exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(fast_exp(0.0), 1.0);
    }

    #[test]
    fn log_sum_exp_matches_f64_reference() {
        let v: Vec<f32> = (0..10_000)
            .map(|i| ((i * 7919) % 1000) as f32 / 77.0 - 6.0)
            .collect();
        let m = v
            .iter()
            .cloned()
            .fold(f64::NEG_INFINITY, |a, b| a.max(b as f64));
        let reference = m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        assert!((log_sum_exp(&v) as f64 - reference).abs() < 1e-5);
    }

    #[test]
    fn top_n_orders_and_breaks_ties_by_id() {
        let v = [1.0, 3.0, 2.0, 3.0, f32::NEG_INFINITY];
        assert_eq!(top_n(&v, 3), vec![(1, 3.0), (3, 3.0), (2, 2.0)]);
        assert_eq!(top_n(&v, 10).len(), 5);
        let big: Vec<f32> = (0..1000).map(|i| (i % 97) as f32).collect();
        let a = top_n(&big, 300);
        assert_eq!(a.len(), 300);
        assert!(a.windows(2).all(|w| w[0].1 >= w[1].1));
    }
}
