//! One fused pass over a step's incoming logits: copy them into the token
//! buffer, reject NaN / +∞ (naming the first bad index), find the maximum
//! and accumulate the log-sum-exp behind the response's `logprob` — block
//! by block, while each block is still in L1, instead of one memory pass
//! per job (copy, validate, max, exp-sum). The RPC hot path uses it through
//! `TokenBuffer::load_scan` / `load_f32le_scan`.
//!
//! The log-sum-exp is `samplerd_numerics::lse`'s (the same bits as
//! `logits::log_sum_exp`), accumulated per [`CHUNK`] ([`PartialLse`]) and
//! the chunks merged in order, so the same sum can also be split: the
//! request's thread runs [`copy_check_f32le`] (copy + check + max, no
//! exp) while a helper core runs [`chunk_lse_f32le`] over the request
//! bytes, chunk by chunk; merging the chunks in order gives bit for bit
//! the fused scan's result, whichever thread computed which chunk.

use samplerd_numerics::dispatch;
use samplerd_numerics::lse::BLOCK;
pub use samplerd_numerics::lse::{CHUNK, PartialLse};

use crate::error::LogitsError;

/// Independent lanes of the check and max (no loop-carried dependency, so
/// LLVM vectorises: one AVX-512 register, two AVX2 ones).
const LANES: usize = 16;

/// What the scan learnt about valid logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scan {
    /// The largest logit.
    pub max: f32,
    /// log Σ exp(logits) (bit for bit what `logits::log_sum_exp` computes:
    /// both are `samplerd_numerics::lse`).
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

    /// The RPCs' log-sum-exp (the scan's) and `logits::log_sum_exp` are
    /// one computation: the same bits.
    #[test]
    fn scan_and_logits_lse_agree_bit_for_bit() {
        for n in [1, 15, 1023, 1025, CHUNK + 1, 3 * CHUNK - 5, 49_152, 151_936] {
            let mut v = varied(n);
            if n > 40 {
                v[n / 3] = f32::NEG_INFINITY;
                v[n - 2] = 25.0;
            }
            let s = scan(&mut v.clone()).unwrap();
            assert_eq!(
                s.log_sum_exp.to_bits(),
                logits::log_sum_exp(&v).to_bits(),
                "n={n}"
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
