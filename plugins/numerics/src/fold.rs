//! Max and sum folds over f32 slices and fixed 64-float chunks, in a fixed
//! order (so every build gives the same bits).

/// Granularity of the chunked folds: 64 floats = 4 cache lines.
pub const CHUNK: usize = 64;

/// `max(a, b)` as a compare-select: compiles to a plain `maxps` (no NaN
/// fix-up; the host refuses NaN logits). Keeps `a` when they compare
/// equal.
#[inline(always)]
pub fn fmax(a: f32, b: f32) -> f32 {
    // `select(b > a, b, a)`
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
    // SAFETY: SSE2 is part of the x86_64 baseline.
    let [a0, a1, a2, a3] = lanes4_sse2(c, |a, b| unsafe { _mm_max_ps(a, b) });
    // SAFETY: as above.
    unsafe {
        let m = _mm_max_ps(_mm_max_ps(a0, a1), _mm_max_ps(a2, a3));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps::<0b01>(m, m));
        _mm_cvtss_f32(m)
    }
}

/// The lane-wise half of the SSE2 chunk folds ([`chunk_max`], [`sum_chunk`]):
/// four 4-float accumulators start from floats 0..16 of the chunk and `op`
/// folds every further 16 into them, in order (so the bits are fixed).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn lanes4_sse2(
    c: &[f32; CHUNK],
    op: impl Fn(std::arch::x86_64::__m128, std::arch::x86_64::__m128) -> std::arch::x86_64::__m128,
) -> [std::arch::x86_64::__m128; 4] {
    use std::arch::x86_64::*;
    let p = c.as_ptr();
    // SAFETY: SSE2 is part of the x86_64 baseline; every load reads 4
    // floats at offsets 0..64 of a 64-float array.
    unsafe {
        let mut a = [
            _mm_loadu_ps(p),
            _mm_loadu_ps(p.add(4)),
            _mm_loadu_ps(p.add(8)),
            _mm_loadu_ps(p.add(12)),
        ];
        for r in 1..CHUNK / 16 {
            let q = p.add(r * 16);
            a[0] = op(a[0], _mm_loadu_ps(q));
            a[1] = op(a[1], _mm_loadu_ps(q.add(4)));
            a[2] = op(a[2], _mm_loadu_ps(q.add(8)));
            a[3] = op(a[3], _mm_loadu_ps(q.add(12)));
        }
        a
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

/// Max of any slice (-inf when empty), 32 lanes, compiled for the best
/// [`Isa`](crate::Isa) (the value is the same on every one: a max is
/// exact). This is also the benchmark baseline. Meant for validated
/// logits: with a NaN the result depends on its position.
pub fn max_scan(x: &[f32]) -> f32 {
    crate::dispatch!(max_scan_body(x: &[f32]) -> f32)
}

#[inline(always)]
fn max_scan_body(x: &[f32]) -> f32 {
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

/// Sum of one chunk: 16 independent f32 lanes, then a fixed reduction tree
/// (SSE2 on x86_64 for the same reason as [`chunk_max`]; both versions add
/// in the same order, so the result is identical).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn sum_chunk(c: &[f32; CHUNK]) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: SSE2 is part of the x86_64 baseline.
    let [a0, a1, a2, a3] = lanes4_sse2(c, |a, b| unsafe { _mm_add_ps(a, b) });
    // SAFETY: as above.
    unsafe {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
