//! Whole-vocabulary helpers over raw logits: validation (finite or −∞),
//! the max and the log-sum-exp for the response's `logprob` (both
//! `samplerd_numerics`'s, shared with the stages and the fused scan), and
//! the top-n raw candidates. Loops are written branch-free over fixed
//! chunks so LLVM vectorises them.

use crate::error::LogitsError;

/// NaN or +∞: not a logit (−∞ is, meaning "removed"). Branch-free.
#[inline(always)]
fn is_bad(x: f32) -> bool {
    x.is_nan() | (x == f32::INFINITY)
}

/// Checks that no logit is NaN or +∞ (−∞ means "removed" and is allowed)
/// and that not all are −∞. One pass; the error names the first bad index.
pub fn validate(logits: &[f32]) -> Result<(), LogitsError> {
    samplerd_numerics::dispatch!(validate_body(logits: &[f32]) -> Result<(), LogitsError>)
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

/// The largest logit (−∞ for an empty slice): `samplerd_numerics`'s max,
/// the one the stages use. Meant for validated logits: a NaN is ignored or
/// returned depending on its position.
pub fn max(logits: &[f32]) -> f32 {
    samplerd_numerics::fold::max_scan(logits)
}

/// libm's `expf`, for the few-candidate softmaxes where exactness matters
/// more than speed.
#[inline]
pub fn exp_f32(x: f32) -> f32 {
    x.exp()
}

/// log Σ exp(logits) (−∞ when all are −∞): `samplerd_numerics::lse`, so
/// bit for bit the `log_sum_exp` of `scan` (what `Sample` reports) over
/// the same logits.
pub fn log_sum_exp(logits: &[f32]) -> f32 {
    samplerd_numerics::lse::log_sum_exp(logits)
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
