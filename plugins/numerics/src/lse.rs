//! The log-sum-exp behind every reported `logprob`: `log Σ exp(x)` over a
//! whole vocabulary, computed in [`BLOCK`]s whose exps are summed in f32
//! lanes, blocks added in f64 (rescaled when the running max grows), and
//! [`CHUNK`]s merged in order as [`PartialLse`] parts, so that the same
//! sum can be computed in one fused pass (the host's logit scan), over a
//! slice ([`log_sum_exp`]) or chunk by chunk on several threads, with the
//! same bits every way.
//!
//! The bits depend on the instruction set only through fused
//! multiply-adds in [`exp_term`]: the AVX-512 and AVX2+FMA builds agree,
//! the baseline build may differ in the last bits.

/// Logits per block: 4 KiB, so a block copied from a request is still in
/// L1 when it is checked and exponentiated.
pub const BLOCK: usize = 1024;
/// Independent accumulator lanes (no loop-carried dependency, so LLVM
/// vectorises: one AVX-512 register, two AVX2 ones).
pub const LANES: usize = 16;
/// Logits per log-sum-exp chunk (32 KiB of request bytes, ~2 µs of exps):
/// the unit of work a request's thread and a helper share, small enough
/// that the two finish close together, large enough that claiming one (an
/// atomic increment) costs nothing next to it.
pub const CHUNK: usize = 8 * BLOCK;

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

    /// Adds one block (at most [`BLOCK`] logits of a chunk, in order) whose
    /// max is `bmax`, rescaling the running sum in f64 when the maximum
    /// grows. Sums are f32 per lane within the block and f64 across
    /// blocks. `FMA`: compiled where the CPU has fused multiply-adds (see
    /// [`crate::dispatch!`]).
    #[inline(always)]
    pub fn add_block<const FMA: bool>(&mut self, block: &[f32], bmax: f32) {
        // The loop stays in this function's body, not in a closure handed
        // to `add_block_with`: a closure does not inherit the caller's
        // `#[target_feature]`s, so `exp_term::<true>`'s `mul_add` became a
        // call into libm's `fmaf` per logit — 75 % of a `Sample`'s server
        // time at 151,936 logits (2.0 ms p50 instead of 0.4 ms).
        let Some(m) = self.raise(bmax) else {
            return;
        };
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

    /// [`Self::add_block`] with the block's terms summed elsewhere:
    /// `terms(m)` is the block's Σ exp_term(x − m) in `add_block`'s order,
    /// `m` the running max once `bmax` is in (a block whose running max is
    /// still −∞ adds nothing and `terms` is not called). The CUDA backend
    /// sums each block's terms on the device and merges them here, so the
    /// f64 rescaling and the final log are this code's.
    #[inline(always)]
    pub fn add_block_with(&mut self, bmax: f32, terms: impl FnOnce(f32) -> f64) {
        if let Some(m) = self.raise(bmax) {
            self.sum += terms(m);
        }
    }

    /// Takes a block's max `bmax` into the running max, rescaling the
    /// running sum in f64 when it grows; the max the block's terms are
    /// taken against, or None while it is still −∞.
    #[inline(always)]
    fn raise(&mut self, bmax: f32) -> Option<f32> {
        if bmax > self.max {
            self.sum *= ((self.max - bmax) as f64).exp();
            self.max = bmax;
        }
        (self.max != f32::NEG_INFINITY).then_some(self.max)
    }
}

/// The max of one block (−∞ when empty) as [`PartialLse::add_block`]'s
/// callers compute it: 16 lanes, then a fold (NaN-free input).
#[inline(always)]
pub fn block_max(block: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut it = block.chunks_exact(LANES);
    for c in &mut it {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l = if x > *l { x } else { *l };
        }
    }
    let mut bmax = lanes.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
    for &x in it.remainder() {
        bmax = bmax.max(x);
    }
    bmax
}

/// log Σ exp(logits) (−∞ when empty or all −∞), bit for bit the
/// log-sum-exp of the host's fused scan over the same logits. Meant for
/// validated logits (NaN gives NaN).
pub fn log_sum_exp(logits: &[f32]) -> f32 {
    crate::dispatch!(log_sum_exp_body::<_>(logits: &[f32]) -> f32)
}

#[inline(always)]
fn log_sum_exp_body<const FMA: bool>(logits: &[f32]) -> f32 {
    let mut total = PartialLse::EMPTY;
    for chunk in logits.chunks(CHUNK) {
        let mut part = PartialLse::EMPTY;
        for block in chunk.chunks(BLOCK) {
            part.add_block::<FMA>(block, block_max(block));
        }
        total = total.merge(part);
    }
    total.log_sum_exp()
}

/// a·b + c: one fused instruction where the CPU has FMA (`FMA` is only set
/// in the AVX-512 and AVX2+FMA builds), else a multiply and an add —
/// `f32::mul_add` without hardware FMA is a slow libm call.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA { a.mul_add(b, c) } else { a * b + c }
}

/// e^x for x ≤ 0, as a term of a sum: e^x = 2^n · 2^f with
/// n = round(x·log2 e) and f = x·log2 e − n ∈ [−½, ½], 2^f from a degree-5
/// minimax polynomial, 2^n built in the exponent bits. 12 vector
/// operations (the Cephes [`crate::exp::exp`] needs 15) — the exps are
/// most of the fused scan's time, and its bits are what the RPCs report,
/// so this kernel stays the log-sum-exp's own.
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
pub fn exp_term<const FMA: bool>(x: f32) -> f32 {
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

#[cfg(test)]
mod tests {
    use super::*;

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

    fn reference_lse(v: &[f32]) -> f64 {
        let m = v.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
        m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
    }

    #[test]
    fn slice_lse_equals_merged_chunks_and_the_reference() {
        for n in [0usize, 1, 15, BLOCK + 3, CHUNK, 2 * CHUNK + 77, 151_936] {
            // rising maxima across blocks exercise the rescaling
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 1000) as f32 / 77.0 - 6.0 + (i / 1000) as f32 * 0.5)
                .collect();
            let got = log_sum_exp(&v);
            if n == 0 {
                assert_eq!(got, f32::NEG_INFINITY);
                continue;
            }
            let merged = v
                .chunks(CHUNK)
                .map(|c| {
                    let mut p = PartialLse::EMPTY;
                    for b in c.chunks(BLOCK) {
                        let part = &mut p;
                        crate::dispatch!(add::<_>(part: &mut PartialLse, b: &[f32]) -> ());
                    }
                    p
                })
                .fold(PartialLse::EMPTY, PartialLse::merge)
                .log_sum_exp();
            assert_eq!(got.to_bits(), merged.to_bits(), "n = {n}");
            let r = reference_lse(&v);
            assert!(
                (got as f64 - r).abs() < 1.5e-6 * r.abs().max(1.0),
                "n = {n}"
            );
        }
        assert_eq!(log_sum_exp(&[f32::NEG_INFINITY; 40]), f32::NEG_INFINITY);
    }

    #[inline(always)]
    fn add<const FMA: bool>(p: &mut PartialLse, b: &[f32]) {
        p.add_block::<FMA>(b, block_max(b));
    }
}
