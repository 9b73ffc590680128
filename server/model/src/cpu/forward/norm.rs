//! RMSNorm as ggml computes it (f64 sums): of whole rows, and in place per head.

/// `out = x / rms(x) * w` per row of `w.len()` values (f64 sum like ggml).
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let sum: f64 = xr.iter().map(|&v| (v * v) as f64).sum();
        let scale = 1.0 / ((sum / d as f64) as f32 + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = (v * scale) * g;
        }
    }
}

/// `x = x / rms(x) * w` in place per row of `w.len()` values, with
/// [`rms_norm`]'s arithmetic (the per-head q/k norm of qwen3).
pub(super) fn rms_norm_rows(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for xr in x.chunks_exact_mut(d) {
        let sum: f64 = xr.iter().map(|&v| (v * v) as f64).sum();
        let scale = 1.0 / ((sum / d as f64) as f32 + eps).sqrt();
        for (v, &g) in xr.iter_mut().zip(w) {
            *v = (*v * scale) * g;
        }
    }
}
