//! One fused pass over a step's incoming logits: copy them into the token
//! buffer, reject NaN / +∞ (naming the first bad index), find the maximum
//! and accumulate the log-sum-exp behind the response's `logprob` — block
//! by block, while each block is still in L1, instead of one memory pass
//! per job (copy, validate, max, exp-sum). The RPC hot path uses it through
//! `TokenBuffer::load_scan` / `load_f32le_scan`.
//!
//! The log-sum-exp is accumulated per [`CHUNK`] ([`PartialLse`]) and the
//! chunks merged in order, so the same sum can also be split: the request's
//! thread runs [`copy_check_f32le`] (copy + check + max, no exp) while a
//! helper core runs [`chunk_lse_f32le`] over the request bytes, chunk by
//! chunk; merging the chunks in order gives bit for bit the fused scan's
//! result, whichever thread computed which chunk.

use crate::error::LogitsError;

/// Runs `$body::<FMA, …>(args)` compiled for AVX-512 (16 lanes in one
/// register: half the exp work of AVX2) or AVX2+FMA when the CPU has them
/// (checked at run time; std caches the answer), else for the baseline.
/// The bodies are `#[inline(always)]`, so each wrapper gets its own copy.
macro_rules! dispatch {
    ($body:ident::<_ $(, $c:tt)*>($($arg:ident: $ty:ty),*) -> $ret:ty) => {{
        fn select($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")]
                fn avx512($($arg: $ty),*) -> $ret {
                    $body::<true $(, $c)*>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn avx2($($arg: $ty),*) -> $ret {
                    $body::<true $(, $c)*>($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512dq")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU supports every feature `avx512` enables.
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU supports AVX2 and FMA (checked just above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body::<false $(, $c)*>($($arg),*)
        }
        select($($arg),*)
    }};
}

/// Logits per block: 4 KiB, so a block copied from the request is still in
/// L1 when it is checked and exponentiated.
const BLOCK: usize = 1024;
/// Independent accumulator lanes (no loop-carried dependency, so LLVM
/// vectorises: one AVX-512 register, two AVX2 ones).
const LANES: usize = 16;
/// Logits per log-sum-exp chunk (32 KiB of request bytes, ~2 µs of exps):
/// the unit of work shared between the request's thread and a helper, small
/// enough that the two finish close together, large enough that claiming
/// one (an atomic increment) costs nothing next to it.
pub const CHUNK: usize = 8 * BLOCK;

/// What the scan learnt about valid logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scan {
    /// The largest logit.
    pub max: f32,
    /// log Σ exp(logits) (what `logits::log_sum_exp` computes).
    pub log_sum_exp: f32,
}

/// Σ exp(x − max) over some logits, with their max: a log-sum-exp in two
/// parts, so that parts computed apart can be merged.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PartialLse {
    /// The largest logit seen (−∞ if none was finite).
    pub max: f32,
    /// Σ exp(x − max).
    pub sum: f64,
}

impl PartialLse {
    /// No logits yet.
    pub const EMPTY: PartialLse = PartialLse {
        max: f32::NEG_INFINITY,
        sum: 0.0,
    };

    /// The sum over `self`'s logits followed by `next`'s. Merging the same
    /// parts in the same order gives the same bits.
    pub fn merge(self, next: PartialLse) -> PartialLse {
        if next.max > self.max {
            // exp(−∞) = 0 also clears an empty (all −∞) `self`.
            PartialLse {
                max: next.max,
                sum: self.sum * ((self.max - next.max) as f64).exp() + next.sum,
            }
        } else if next.max == f32::NEG_INFINITY {
            self
        } else {
            PartialLse {
                max: self.max,
                sum: self.sum + next.sum * ((next.max - self.max) as f64).exp(),
            }
        }
    }

    /// log Σ exp(x) (−∞ when every logit was −∞).
    pub fn log_sum_exp(self) -> f32 {
        if self.max == f32::NEG_INFINITY {
            return f32::NEG_INFINITY;
        }
        self.max + self.sum.ln() as f32
    }

    /// Adds one block whose max is `bmax` (rescaling the running sum in f64
    /// when the maximum grows). Sums are f32 per lane within the block and
    /// f64 across blocks, as in `logits::log_sum_exp`.
    #[inline(always)]
    fn add_block<const FMA: bool>(&mut self, block: &[f32], bmax: f32) {
        if bmax > self.max {
            self.sum *= ((self.max - bmax) as f64).exp();
            self.max = bmax;
        }
        let m = self.max;
        if m == f32::NEG_INFINITY {
            return;
        }
        let mut sums = [0.0f32; LANES];
        let mut it = block.chunks_exact(LANES);
        for c in &mut it {
            for (s, &x) in sums.iter_mut().zip(c) {
                *s += exp_term::<FMA>(x - m);
            }
        }
        let tail: f32 = it.remainder().iter().map(|&x| exp_term::<FMA>(x - m)).sum();
        self.sum += sums.iter().map(|&v| v as f64).sum::<f64>() + tail as f64;
    }
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
    fused(dst, Source::Floats(src))
}

/// Decodes raw little-endian f32 `src` (4 bytes per logit) into `dst` and
/// scans it.
pub fn copy_scan_f32le(dst: &mut [f32], src: &[u8]) -> Result<Scan, LogitsError> {
    assert_eq!(dst.len() * 4, src.len(), "copy_scan_f32le: length mismatch");
    fused(dst, Source::Bytes(src))
}

/// Scans logits already in place.
pub fn scan(logits: &mut [f32]) -> Result<Scan, LogitsError> {
    fused(logits, Source::InPlace)
}

/// [`copy_scan_f32le`] without the log-sum-exp: decodes, rejects NaN / +∞
/// (same errors) and returns the max — the request thread's share while a
/// helper sums the exps with [`chunk_lse_f32le`].
pub fn copy_check_f32le(dst: &mut [f32], src: &[u8]) -> Result<f32, LogitsError> {
    assert_eq!(
        dst.len() * 4,
        src.len(),
        "copy_check_f32le: length mismatch"
    );
    let src = Source::Bytes(src);
    dispatch!(scan_body::<_, false>(dst: &mut [f32], src: Source<'_>) -> Result<(f32, PartialLse), LogitsError>)
        .map(|(max, _)| max)
}

/// Number of [`CHUNK`]s over `n` logits.
pub fn chunks(n: usize) -> usize {
    n.div_ceil(CHUNK)
}

/// The [`PartialLse`] of chunk `index` of raw little-endian f32 logits
/// `src` (any alignment). Does not validate: a NaN gives a NaN sum, so the
/// caller validates the logits itself (as [`copy_check_f32le`] does).
/// Merging every chunk's part in order gives exactly the log-sum-exp of
/// [`copy_scan_f32le`].
pub fn chunk_lse_f32le(src: &[u8], index: usize) -> PartialLse {
    let start = 4 * CHUNK * index;
    let bytes = &src[start.min(src.len())..(start + 4 * CHUNK).min(src.len())];
    dispatch!(chunk_lse_body::<_>(bytes: &[u8]) -> PartialLse)
}

/// The fused scan, compiled for the best instruction set available.
fn fused(dst: &mut [f32], src: Source<'_>) -> Result<Scan, LogitsError> {
    let (max, total) = dispatch!(scan_body::<_, true>(dst: &mut [f32], src: Source<'_>) -> Result<(f32, PartialLse), LogitsError>)?;
    Ok(Scan {
        max,
        log_sum_exp: total.log_sum_exp(),
    })
}

/// a·b + c: one fused instruction where the CPU has FMA (`FMA` is only set
/// in the AVX-512 and AVX2+FMA builds), else a multiply and an add — `f32::mul_add`
/// without hardware FMA is a slow libm call.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// e^x for x ≤ 0, as a term of a sum: e^x = 2^n · 2^f with
/// n = round(x·log2 e) and f = x·log2 e − n ∈ [−½, ½], 2^f from a degree-5
/// minimax polynomial, 2^n built in the exponent bits. 12 vector
/// operations (Cephes' `logits::fast_exp` needs 15) — the exps are most of
/// the fused scan's time.
///
/// Error (relative, per term): the polynomial's 7.5e−8, plus ~3 ulp of
/// f32 rounding in its evaluation (≤ 1.8e−7), plus the error in f: with FMA
/// f is x·LOG2E − n rounded once, and LOG2E's own rounding (≤ 2^−25
/// relative) shifts the exponent by ≤ |x|·log2 e·2^−25, i.e. a relative
/// error ≤ |x|·3e−8; without FMA the product's rounding adds as much
/// again plus |x|·log2 e·2^−24·ln 2 ≈ |x|·6e−8. So ≤ 2.6e−7 + |x|·3e−8
/// (FMA) or + |x|·1e−7 (baseline): 3e−6 at x = −87, where the term is
/// 1e−38. In a log-sum-exp the terms' errors are averaged with the
/// softmax's weights, and the weighted mean of |x − max| is at most the
/// entropy ≤ ln n (12 for n = 151,936): the sum is off by ≤ 2.6e−7 + 12 ·
/// 1e−7 ≈ 1.5e−6 relative, i.e. the log-sum-exp by ≤ 1.5e−6 absolute,
/// inside the 1e−5 `logprob` tolerance (tests check both bounds). x < −87
/// (and −∞) is clamped to −87: e^−87 ≈ 2e−38 instead of 0, which cannot
/// move a sum whose largest term is 1.
#[inline(always)]
fn exp_term<const FMA: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // 1.5 * 2^23: adding and subtracting rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    // 2^f on [−½, ½], minimax for relative error (7.5e−8).
    const P: [f32; 6] = [
        1.0,
        0.693_146_94,
        0.240_221_2,
        0.055_507_135,
        0.009_675_537,
        0.001_327_644_5,
    ];
    let xc = if x > -87.0 { x } else { -87.0 };
    let k = madd::<FMA>(xc, LOG2E, ROUND);
    let n = k - ROUND;
    let f = madd::<FMA>(xc, LOG2E, -n);
    let mut p = P[5];
    p = madd::<FMA>(p, f, P[4]);
    p = madd::<FMA>(p, f, P[3]);
    p = madd::<FMA>(p, f, P[2]);
    p = madd::<FMA>(p, f, P[1]);
    p = madd::<FMA>(p, f, P[0]);
    // 2^n from the rounding trick's bits (k = 1.5·2^23 + n exactly).
    let scale = f32::from_bits(k.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23);
    p * scale
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

/// (any NaN / +∞, max) of one block: 16 independent lanes, so LLVM
/// vectorises (the exact bad index is searched only once one was seen).
#[inline(always)]
fn block_stats(block: &[f32]) -> (bool, f32) {
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
    (any_bad, bmax)
}

/// Per block: copy, then (bad, max) over the block, then (with `LSE`) the
/// block's exps into its chunk's [`PartialLse`]; chunks are merged in
/// order. Returns the max and the merged sum ([`PartialLse::EMPTY`]
/// without `LSE`).
#[inline(always)]
fn scan_body<const FMA: bool, const LSE: bool>(
    dst: &mut [f32],
    src: Source<'_>,
) -> Result<(f32, PartialLse), LogitsError> {
    if dst.is_empty() {
        return Err(LogitsError::Empty);
    }
    let mut m = f32::NEG_INFINITY;
    let mut total = PartialLse::EMPTY;
    for (c, chunk) in dst.chunks_mut(CHUNK).enumerate() {
        let mut part = PartialLse::EMPTY;
        for (b, block) in chunk.chunks_mut(BLOCK).enumerate() {
            let start = c * CHUNK + b * BLOCK;
            fill_block(block, src, start);
            let (any_bad, bmax) = block_stats(block);
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
            m = if bmax > m { bmax } else { m };
            if LSE {
                part.add_block::<FMA>(block, bmax);
            }
        }
        total = total.merge(part);
    }
    if m == f32::NEG_INFINITY {
        return Err(LogitsError::AllMasked);
    }
    Ok((m, total))
}

/// One chunk's [`PartialLse`] from raw bytes: each block is decoded into a
/// stack buffer (the bytes need not be 4-aligned), then handled exactly as
/// [`scan_body`] handles it.
#[inline(always)]
fn chunk_lse_body<const FMA: bool>(src: &[u8]) -> PartialLse {
    let mut part = PartialLse::EMPTY;
    let mut tmp = [0.0f32; BLOCK];
    for bytes in src.chunks(4 * BLOCK) {
        let block = &mut tmp[..bytes.len() / 4];
        fill_block(block, Source::Bytes(bytes), 0);
        let (_, bmax) = block_stats(block);
        part.add_block::<FMA>(block, bmax);
    }
    part
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

    /// The per-term bound of `exp_term`'s comment, against f64.
    #[test]
    fn exp_term_within_its_error_bound() {
        let mut x = -87.0f32;
        while x <= 0.0 {
            let want = (x as f64).exp();
            for (got, per_unit) in [(exp_term::<true>(x), 3e-8), (exp_term::<false>(x), 1e-7)] {
                let err = ((got as f64 - want) / want).abs();
                let bound = 2.6e-7 + (x as f64).abs() * per_unit;
                assert!(err < bound, "x={x} got={got} want={want} err={err:e}");
            }
            x += 0.001_37;
        }
        assert!(exp_term::<false>(f32::NEG_INFINITY) < 1e-37);
        assert!(exp_term::<true>(f32::NEG_INFINITY) < 1e-37);
        assert_eq!(exp_term::<true>(0.0), 1.0);
        assert_eq!(exp_term::<false>(0.0), 1.0);
    }

    /// The sum-level bound: 1.5e-6 absolute on the log-sum-exp, for
    /// spread-out logits (high entropy: the errors of far-below-max terms
    /// count most), peaked ones and a typical model-like spread.
    #[test]
    fn log_sum_exp_within_documented_bound() {
        let n = 151_936;
        let spread: Vec<f32> = (0..n).map(|i| -((i % 4000) as f32) * 0.02).collect();
        let uniform = vec![-3.0f32; n];
        let mut peaked = varied(n);
        peaked[77] = 60.0;
        for v in [spread, uniform, peaked, varied(n)] {
            let s = scan(&mut v.clone()).unwrap();
            let r = reference_lse(&v);
            assert!(
                (s.log_sum_exp as f64 - r).abs() < 1.5e-6 * r.abs().max(1.0),
                "{} vs {r}",
                s.log_sum_exp
            );
        }
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

    /// The split path (copy + check on one thread, chunk sums on others)
    /// against the fused scan: bit-identical, from unaligned bytes, with
    /// the chunks computed in any order.
    #[test]
    fn split_path_is_bit_identical_to_fused() {
        for n in [1, 1023, CHUNK, CHUNK + 1, 3 * CHUNK - 5, 151_936] {
            let v = varied(n);
            // One byte of offset: request bytes have no alignment.
            let mut raw = vec![0u8];
            raw.extend(v.iter().flat_map(|f| f.to_le_bytes()));
            let bytes = &raw[1..];
            let mut fused_dst = vec![0.0; n];
            let fused = copy_scan_f32le(&mut fused_dst, bytes).unwrap();
            let mut dst = vec![0.0; n];
            let max = copy_check_f32le(&mut dst, bytes).unwrap();
            assert_eq!(dst, v);
            assert_eq!(max, fused.max);
            let mut parts: Vec<(usize, PartialLse)> = (0..chunks(n))
                .rev()
                .map(|c| (c, chunk_lse_f32le(bytes, c)))
                .collect();
            parts.sort_by_key(|&(c, _)| c);
            let lse = parts
                .iter()
                .fold(PartialLse::EMPTY, |a, &(_, p)| a.merge(p))
                .log_sum_exp();
            assert_eq!(lse.to_bits(), fused.log_sum_exp.to_bits(), "n={n}");
            let r = reference_lse(&v);
            assert!((lse as f64 - r).abs() < 1e-5 * r.abs().max(1.0), "n={n}");
        }
    }

    #[test]
    fn split_path_errors_match_fused() {
        let mut v = vec![0.5f32; 3 * CHUNK];
        v[CHUNK + 7] = f32::NAN;
        v[2 * CHUNK] = f32::INFINITY;
        let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
        let mut d = vec![0.0; v.len()];
        assert_eq!(
            copy_check_f32le(&mut d, &bytes).unwrap_err().to_string(),
            copy_scan_f32le(&mut d, &bytes).unwrap_err().to_string()
        );
        let masked: Vec<u8> = [f32::NEG_INFINITY; 40]
            .iter()
            .flat_map(|f| f.to_le_bytes())
            .collect();
        assert_eq!(
            copy_check_f32le(&mut [0.0; 40], &masked),
            Err(LogitsError::AllMasked)
        );
        assert_eq!(chunk_lse_f32le(&masked, 0).log_sum_exp(), f32::NEG_INFINITY);
        // Masked chunks before and after finite ones merge away.
        let parts = [
            PartialLse::EMPTY,
            PartialLse { max: 1.0, sum: 2.0 },
            PartialLse::EMPTY,
        ];
        let merged = parts.iter().fold(PartialLse::EMPTY, |a, &p| a.merge(p));
        assert_eq!(merged, PartialLse { max: 1.0, sum: 2.0 });
    }
}
