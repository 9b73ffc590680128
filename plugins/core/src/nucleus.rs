//! Bit-exact, vectorised reproduction of llama.cpp's f32 running sums, for
//! `top_p` over large candidate lists.
//!
//! llama.cpp computes `Z = Σ expf(l - max)` as an f32 running sum in list
//! order, then walks the candidates sorted by logit adding `expf(l - max) /
//! Z` to another f32 running sum. With ~10,000 tokens in the nucleus the
//! rounding of those sums decides the cut, so we must produce the very same
//! f32 values, yet a sequential f32 sum of 151,936 values is latency-bound
//! (~200 µs) and libm `expf` is scalar.
//!
//! The trick: while a running sum `s` stays in one binade `[2^k, 2^(k+1))`,
//! every intermediate result is a multiple of `u = ulp(s)`, and
//! `fl(s + v) = s + round_u(v)` (round to nearest multiple of `u`; ties to
//! even depend on `s`). So a block of additions that stays in the binade
//! and contains no tie equals one integer addition of `Σ round_u(v)`, which
//! is order-independent and vectorises. `round_u(v)` needs `v` only to the
//! precision that separates it from the nearest half-multiple of `u`: we use
//! the branch-free polynomial `exp_f32` (within [`EXP_REL_ERR`] of libm's
//! `expf`, tested), and call libm only for the rare lanes that land within
//! that error of a rounding boundary. Ties, binade crossings and those lanes
//! are replayed in order with the real f32 addition, as llama.cpp does it.

use crate::util::exp_f32;

/// Values are processed in blocks of this many (a multiple of 16).
pub const BLOCK: usize = 64;

/// Bound on `|exp_f32(x) - expf(x)| / expf(x)` for `x <= 0` where `expf(x)`
/// is normal (measured: under 2 ulp, i.e. 2^-22; this is twice that; see
/// the `exp_error_bound` test). Below e^-87.3 `exp_f32` returns 0 and libm a
/// value < 2^-126, which is far below every grid unit we use.
pub const EXP_REL_ERR: f32 = 1.0 / 2_097_152.0; // 2^-21

/// 2^23: `q + MAGIC` rounds `q` in [0, 2^23] to an integer, ties to even.
const MAGIC: f32 = 8_388_608.0;
const MAGIC_BITS: u32 = 0x4B00_0000;
/// A running sum on the grid holds `units` in [2^23, 2^24).
const LIMIT: u32 = 1 << 24;
/// Below this the grid unit would leave the normal range: sum exactly.
const GRID_MIN: f32 = 8.673_617e-19; // 2^-60

/// libm's `expf`, the function llama.cpp calls (never inlined into a
/// vectorised loop, so it stays the real libm call).
#[inline(never)]
pub fn libm_exp(x: f32) -> f32 {
    x.exp()
}

/// An f32 running sum, bit-identical to `s += v` in order, that can take a
/// block of additions at once.
#[derive(Clone, Copy, Debug)]
pub struct F32Sum {
    /// The value when off the grid.
    value: f32,
    on_grid: bool,
    /// Exponent of the binade (when on the grid).
    exp: i32,
    /// `ulp` of the binade and its inverse (powers of two).
    unit: f32,
    inv: f32,
    /// The value in units: in [2^23, 2^24).
    units: u32,
}

impl Default for F32Sum {
    fn default() -> Self {
        F32Sum {
            value: 0.0,
            on_grid: false,
            exp: 0,
            unit: 0.0,
            inv: 0.0,
            units: 0,
        }
    }
}

/// Per-block scratch: the rounded lanes and which lanes need the exact
/// value.
pub struct Block {
    r: [u32; BLOCK],
    exact: [f32; BLOCK],
    margin: [f32; BLOCK],
}

impl Default for Block {
    fn default() -> Self {
        Block {
            r: [0; BLOCK],
            exact: [0.0; BLOCK],
            margin: [0.0; BLOCK],
        }
    }
}

impl F32Sum {
    pub fn new() -> Self {
        Self::default()
    }

    /// The current value (exact).
    #[inline]
    pub fn value(&self) -> f32 {
        if self.on_grid {
            // units < 2^24: exact; times a power of two: exact.
            self.units as f32 * self.unit
        } else {
            self.value
        }
    }

    fn set(&mut self, s: f32) {
        if (GRID_MIN..1.0e30).contains(&s) {
            let exp = ((s.to_bits() >> 23) as i32) - 127;
            self.exp = exp;
            self.unit = f32::from_bits(((exp - 23 + 127) as u32) << 23);
            self.inv = f32::from_bits(((127 + 23 - exp) as u32) << 23);
            self.units = (s * self.inv) as u32;
            self.on_grid = true;
        } else {
            self.value = s;
            self.on_grid = false;
        }
    }

    /// `s = fl(s + v)`, the real f32 addition.
    #[inline]
    pub fn add_exact(&mut self, v: f32) {
        let s = self.value() + v;
        self.set(s);
    }

    /// Adds one value given as an approximation `approx` (relative error at
    /// most `rel_err`) and a way to get the exact value.
    #[inline]
    pub fn add_one(&mut self, approx: f32, rel_err: f32, exact: impl FnOnce() -> f32) {
        if self.on_grid {
            let q = (approx * self.inv).min(MAGIC);
            let t = q + MAGIC;
            let r = t.to_bits() - MAGIC_BITS;
            let rf = t - MAGIC;
            let m = 0.5 - q * (2.0 * rel_err) - (q - rf).abs();
            if m > 0.0 && self.units + r < LIMIT {
                self.units += r;
                return;
            }
        }
        self.add_exact(exact());
    }

    /// Prepares a block of additions of `approx[..n]` (the rest must be 0):
    /// fills `b.r` with each lane rounded to the current grid and returns
    /// (sum of the lanes, mask of lanes too close to a rounding boundary).
    /// Only valid on the grid.
    #[inline(always)]
    fn round_block(&self, approx: &[f32; BLOCK], rel_err: f32, b: &mut Block) -> (u32, u64) {
        let inv = self.inv;
        let mut sum = 0u32;
        for (j, &a) in approx.iter().enumerate() {
            let q = (a * inv).min(MAGIC);
            let t = q + MAGIC;
            let r = t.to_bits() - MAGIC_BITS;
            let rf = t - MAGIC;
            b.r[j] = r;
            sum += r;
            // negative (sign bit set) when the exact value may round
            // differently (or is a tie)
            b.margin[j] = 0.5 - q * (2.0 * rel_err) - (q - rf).abs();
        }
        (sum, crate::util::sign_mask(&b.margin))
    }

    /// Adds `approx[..n]` in order (lanes `n..` must be 0), bit-identical to
    /// adding the exact values one by one. `exact(j)` gives lane j's exact
    /// value; it is called only for lanes near a rounding boundary, ties,
    /// binade crossings and while the sum is tiny.
    #[inline(always)]
    pub fn add_block(
        &mut self,
        approx: &[f32; BLOCK],
        n: usize,
        rel_err: f32,
        b: &mut Block,
        mut exact: impl FnMut(usize) -> f32,
    ) {
        if self.on_grid {
            let (sum, bad) = self.round_block(approx, rel_err, b);
            if bad == 0 && self.units + sum < LIMIT {
                self.units += sum;
                return;
            }
            if let Some(sum) = self.resolve(bad, rel_err, b, &mut exact, sum)
                && self.units + sum < LIMIT
            {
                self.units += sum;
                return;
            }
            self.replay(approx, n, rel_err, b, &mut exact, Some(bad), None);
            return;
        }
        for (j, &a) in approx[..n].iter().enumerate() {
            self.add_one(a, rel_err, || exact(j));
        }
    }

    /// For each uncertain lane, gets the exact value; if it is not a tie on
    /// the grid, rounds it and fixes `b.r`. Returns the corrected sum, or
    /// None when some lane still needs an ordered, exact addition (its exact
    /// value is then in `b.exact`).
    #[inline]
    fn resolve(
        &self,
        mut bad: u64,
        _rel_err: f32,
        b: &mut Block,
        exact: &mut impl FnMut(usize) -> f32,
        mut sum: u32,
    ) -> Option<u32> {
        let mut ok = true;
        while bad != 0 {
            let j = bad.trailing_zeros() as usize;
            bad &= bad - 1;
            let e = exact(j);
            b.exact[j] = e;
            let q = e * self.inv;
            if q < MAGIC {
                let t = q + MAGIC;
                let rf = t - MAGIC;
                if (q - rf).abs() != 0.5 {
                    let r = t.to_bits() - MAGIC_BITS;
                    sum = sum - b.r[j] + r;
                    b.r[j] = r;
                    b.margin[j] = 1.0;
                    continue;
                }
            }
            ok = false;
        }
        ok.then_some(sum)
    }

    /// Adds the lanes in order. `b.margin[j] <= 0` marks lanes whose exact
    /// value is needed (already in `b.exact` when `bad` had them). With
    /// `stop`, returns the first lane after which `stop(value)` holds.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn replay(
        &mut self,
        approx: &[f32; BLOCK],
        n: usize,
        rel_err: f32,
        b: &mut Block,
        exact: &mut impl FnMut(usize) -> f32,
        prepared: Option<u64>,
        mut stop: Option<&mut dyn FnMut(usize, f32) -> bool>,
    ) -> Option<usize> {
        // `prepared`: the block was rounded on the grid of exponent `exp0`,
        // with this mask of lanes whose exact value is in `b.exact`.
        let (valid, bad) = match prepared {
            Some(bad) => (true, bad),
            None => (false, 0),
        };
        let exp0 = self.exp;
        for (j, &a) in approx[..n].iter().enumerate() {
            if !valid || !self.on_grid || self.exp != exp0 {
                // the grid moved: the prepared lanes are stale
                self.add_one(a, rel_err, || exact(j));
            } else if b.margin[j] <= 0.0 || self.units + b.r[j] >= LIMIT {
                let e = if bad >> j & 1 == 1 {
                    b.exact[j]
                } else {
                    exact(j)
                };
                self.add_exact(e);
            } else {
                self.units += b.r[j];
            }
            if let Some(f) = stop.as_deref_mut()
                && f(j, self.value())
            {
                return Some(j);
            }
        }
        None
    }

    /// Like [`add_block`](Self::add_block), but stops after the first lane
    /// j for which `stop(j, value)` holds and returns it. `stop` must be
    /// monotone in the value (once true for a value, true for larger ones
    /// at later lanes), as `cum >= p && i + 1 >= min_keep` is.
    #[inline(always)]
    pub fn add_block_until(
        &mut self,
        approx: &[f32; BLOCK],
        n: usize,
        rel_err: f32,
        b: &mut Block,
        mut exact: impl FnMut(usize) -> f32,
        stop: &mut dyn FnMut(usize, f32) -> bool,
    ) -> Option<usize> {
        let mut prepared = None;
        if self.on_grid {
            let (sum, bad) = self.round_block(approx, rel_err, b);
            prepared = Some(bad);
            let fast = if bad == 0 {
                Some(sum)
            } else {
                self.resolve(bad, rel_err, b, &mut exact, sum)
            };
            if let Some(sum) = fast
                && self.units + sum < LIMIT
            {
                let end = (self.units + sum) as f32 * self.unit;
                // the sum only grows: if the block's end does not stop, no
                // lane inside it does
                if !stop(n - 1, end) {
                    self.units += sum;
                    return None;
                }
            }
        }
        self.replay(approx, n, rel_err, b, &mut exact, prepared, Some(stop))
    }
}

/// llama.cpp's normaliser `Σ expf(x[i] - max)`, summed in f32 in index
/// order, bit-exact. Also appends to `idx` the indices i (ascending) with
/// `x[i] >= floor`.
pub fn softmax_sum_and_gather(x: &[f32], max: f32, floor: f32, idx: &mut Vec<u32>) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        return unsafe { softmax_sum_avx512(x, max, floor, idx) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { softmax_sum_avx2(x, max, floor, idx) };
    }
    softmax_sum_impl(x, max, floor, idx)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn softmax_sum_avx2(x: &[f32], max: f32, floor: f32, idx: &mut Vec<u32>) -> f32 {
    softmax_sum_impl(x, max, floor, idx)
}

/// [`softmax_sum_and_gather`] with 16-lane vectors (the same operations
/// in the same order: bit-identical).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_sum_avx512(x: &[f32], max: f32, floor: f32, idx: &mut Vec<u32>) -> f32 {
    softmax_sum_impl(x, max, floor, idx)
}

#[inline(always)]
fn softmax_sum_impl(x: &[f32], max: f32, floor: f32, idx: &mut Vec<u32>) -> f32 {
    idx.clear();
    let mut s = F32Sum::new();
    let mut b = Block::default();
    let mut a = [0.0f32; BLOCK];
    for (ci, c) in x.chunks(BLOCK).enumerate() {
        let n = c.len();
        let base = ci * BLOCK;
        if let Ok(full) = <&[f32; BLOCK]>::try_from(c) {
            for j in 0..BLOCK {
                a[j] = exp_f32(full[j] - max);
            }
            let mut m = crate::util::ge_mask(full, floor);
            while m != 0 {
                idx.push((base + m.trailing_zeros() as usize) as u32);
                m &= m - 1;
            }
        } else {
            a = [0.0; BLOCK];
            for j in 0..n {
                a[j] = exp_f32(c[j] - max);
                if c[j] >= floor {
                    idx.push((base + j) as u32);
                }
            }
        }
        s.add_block(&a, n, EXP_REL_ERR, &mut b, |j| libm_exp(c[j] - max));
    }
    s.value()
}

/// The order-preserving map of f32 to u32, reversed: ascending keys are
/// descending logits.
#[inline(always)]
pub fn desc_key(l: f32) -> u32 {
    let b = l.to_bits();
    let ord = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
    !ord
}

/// The logit of a [`desc_key`].
#[inline(always)]
pub fn key_logit(k: u32) -> f32 {
    let ord = !k;
    f32::from_bits(if ord >> 31 == 1 {
        ord & 0x7fff_ffff
    } else {
        !ord
    })
}

/// Scratch of [`nucleus`], kept in per-sequence state.
#[derive(Clone, Default)]
pub struct Scratch {
    idx: Vec<u32>,
    /// After [`nucleus`]: `(desc_key(l) << 32) | position`, the kept ones
    /// first, sorted.
    pub keys: Vec<u64>,
    counts: Vec<u32>,
    next: Vec<u32>,
    sample: Vec<f32>,
    sample_e: Vec<f32>,
}

/// Buckets of the partial sort of the gathered candidates.
const NBUCKETS: usize = 16_384;
/// Every SAMPLE_STRIDE-th logit estimates where the cut lands.
const SAMPLE_STRIDE: usize = 32;

/// llama.cpp's top-p over `x` (the logits in list order): returns the
/// number kept, with `s.keys[..kept]` holding `(desc_key(l) << 32) | pos`
/// sorted ascending (logit descending, ties by lower position).
pub fn nucleus(x: &[f32], max: f32, p: f32, min_keep: usize, s: &mut Scratch) -> usize {
    let floor = estimate_floor(x, max, p, s);
    let z = softmax_sum_and_gather(x, max, floor, &mut s.idx);
    if let Some(k) = walk(x, max, z, p, min_keep, floor, s) {
        return k;
    }
    // The estimate was too high (or min_keep is larger than the gathered
    // set, or the sum never reaches p): everything.
    s.idx.clear();
    s.idx.extend(0..x.len() as u32);
    walk(x, max, z, p, min_keep, f32::NEG_INFINITY, s).unwrap_or(x.len())
}

/// A logit floor under which the tokens should hold well under `1 - p` of
/// the mass, estimated from every 16th token (the walk checks the result:
/// a floor too high only costs a second gather).
fn estimate_floor(x: &[f32], max: f32, p: f32, s: &mut Scratch) -> f32 {
    s.sample.clear();
    s.sample.extend(x.iter().step_by(SAMPLE_STRIDE).copied());
    s.sample_e.clear();
    s.sample_e
        .extend(s.sample.iter().map(|&v| exp_f32(v - max)));
    let total = masked_sum(&s.sample, &s.sample_e, f32::INFINITY);
    // 70% of the allowed tail mass: sampling error on the tail is a few %.
    let allowed = (1.0 - p) * total * 0.7;
    // bisection on t in [max - 64, max]: the mass below t grows with t
    let (mut lo, mut hi) = (max - 64.0, max);
    if masked_sum(&s.sample, &s.sample_e, hi) <= allowed {
        return hi;
    }
    for _ in 0..9 {
        let mid = 0.5 * (lo + hi);
        if masked_sum(&s.sample, &s.sample_e, mid) <= allowed {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo - 0.125
}

/// Σ e[i] over v[i] < t (16 f32 lanes, so it vectorises).
fn masked_sum(v: &[f32], e: &[f32], t: f32) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut vc = v.chunks_exact(16);
    let mut ec = e.chunks_exact(16);
    for (vv, ee) in (&mut vc).zip(&mut ec) {
        for l in 0..16 {
            // branch-free select, so the loop vectorises
            let keep = ((vv[l] < t) as u32).wrapping_neg();
            acc[l] += f32::from_bits(ee[l].to_bits() & keep);
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (&vv, &ee) in vc.remainder().iter().zip(ec.remainder()) {
        if vv < t {
            sum += ee;
        }
    }
    sum
}

/// `a[j] = exp_f32(v[j]) / z`, vectorised (AVX2 when available).
fn exp_div_block(v: &[f32; BLOCK], z: f32, a: &mut [f32; BLOCK]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { exp_div_block_avx2(v, z, a) };
    }
    exp_div_block_impl(v, z, a)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn exp_div_block_avx2(v: &[f32; BLOCK], z: f32, a: &mut [f32; BLOCK]) {
    exp_div_block_impl(v, z, a)
}

#[inline(always)]
fn exp_div_block_impl(v: &[f32; BLOCK], z: f32, a: &mut [f32; BLOCK]) {
    for (o, &x) in a.iter_mut().zip(v) {
        *o = exp_f32(x) / z;
    }
}

/// Sorts the gathered candidates (all `x[i] >= floor`) lazily, bucket by
/// bucket, and walks them with llama.cpp's f32 running sum of `expf(l -
/// max) / z`. None if the cut is not inside the gathered set.
fn walk(
    x: &[f32],
    max: f32,
    z: f32,
    p: f32,
    min_keep: usize,
    floor: f32,
    s: &mut Scratch,
) -> Option<usize> {
    let n = s.idx.len();
    if n == 0 {
        return None;
    }
    // Counting sort into buckets of equal logit width, then each bucket is
    // sorted when the walk reaches it.
    let lo = if floor == f32::NEG_INFINITY {
        s.idx
            .iter()
            .map(|&i| x[i as usize])
            .filter(|v| v.is_finite())
            .fold(max, f32::min)
    } else {
        floor
    };
    let span = max - lo;
    let scale = if span > 0.0 {
        (NBUCKETS - 1) as f32 / span
    } else {
        0.0
    };
    let bucket = |v: f32| -> usize { (((max - v) * scale) as usize).min(NBUCKETS - 1) };
    s.counts.clear();
    s.counts.resize(NBUCKETS + 1, 0);
    for &i in &s.idx {
        s.counts[bucket(x[i as usize]) + 1] += 1;
    }
    for b in 1..=NBUCKETS {
        s.counts[b] += s.counts[b - 1];
    }
    s.keys.clear();
    s.keys.resize(n, 0);
    {
        // counts[b] = start of bucket b; advance as we place
        let next = &mut s.next;
        next.clear();
        next.extend_from_slice(&s.counts);
        for &i in &s.idx {
            let v = x[i as usize];
            let b = bucket(v);
            s.keys[next[b] as usize] = ((desc_key(v) as u64) << 32) | i as u64;
            next[b] += 1;
        }
    }
    let mut sorted_to = 0usize; // keys[..sorted_to] are final
    let mut next_bucket = 0usize;
    let mut sum = F32Sum::new();
    let mut blk = Block::default();
    let mut a = [0.0f32; BLOCK];
    let mut vals = [0.0f32; BLOCK];
    let mut start = 0usize;
    while start < n {
        let end = (start + BLOCK).min(n);
        while sorted_to < end {
            let b0 = s.counts[next_bucket] as usize;
            let b1 = s.counts[next_bucket + 1] as usize;
            s.keys[b0..b1].sort_unstable();
            sorted_to = b1;
            next_bucket += 1;
        }
        let m = end - start;
        // the logit travels in the key: no random access into x
        for (v, &k) in vals.iter_mut().zip(&s.keys[start..end]) {
            *v = key_logit((k >> 32) as u32) - max;
        }
        vals[m..].fill(f32::NEG_INFINITY);
        exp_div_block(&vals, z, &mut a);
        let mut stop = |j: usize, cum: f32| cum >= p && start + j + 1 >= min_keep;
        // division adds one rounding on each side
        if let Some(j) = sum.add_block_until(
            &a,
            m,
            2.0 * EXP_REL_ERR,
            &mut blk,
            |j| libm_exp(vals[j]) / z,
            &mut stop,
        ) {
            return Some(start + j + 1);
        }
        start = end;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xorshift(seed: u64) -> impl FnMut() -> f64 {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    #[test]
    fn exp_error_bound() {
        // Every 97th f32 in (-87.33, 0]: exp_f32 within EXP_REL_ERR / 2 of
        // libm (the constant carries a factor 2 of margin).
        let mut worst = 0.0f64;
        let top = (-87.33f32).to_bits();
        let mut b = 0x8000_0000u32;
        while b <= top {
            let x = f32::from_bits(b);
            let want = libm_exp(x) as f64;
            let got = exp_f32(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            b += 97;
        }
        assert!(worst <= (EXP_REL_ERR as f64) / 2.0, "worst {worst:e}");
    }

    #[test]
    fn block_sums_are_bit_identical_to_sequential_f32() {
        let mut rnd = xorshift(3);
        for case in 0..200 {
            let n = 1 + (rnd() * 5000.0) as usize;
            let sd = [0.5, 3.0, 10.0, 30.0][case % 4];
            let mut x: Vec<f32> = (0..n)
                .map(|_| ((rnd() + rnd() + rnd() - 1.5) * 2.0 * sd) as f32)
                .collect();
            if case % 7 == 0 {
                // ties and repeated values
                for v in x.iter_mut().step_by(3) {
                    *v = 1.25;
                }
            }
            if case % 11 == 0 {
                x[0] = f32::NEG_INFINITY;
            }
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut want = 0.0f32;
            for &v in &x {
                want += (v - max).exp();
            }
            let mut idx = Vec::new();
            let got = softmax_sum_and_gather(&x, max, max - 2.0, &mut idx);
            assert_eq!(got.to_bits(), want.to_bits(), "case {case} n {n}");
            let gw: Vec<u32> = (0..n as u32)
                .filter(|&i| x[i as usize] >= max - 2.0)
                .collect();
            assert_eq!(idx, gw);
        }
    }

    #[test]
    fn exact_adds_match_plain_f32() {
        let mut rnd = xorshift(5);
        let mut s = F32Sum::new();
        let mut want = 0.0f32;
        for _ in 0..100_000 {
            let v = (rnd() * 1e-3) as f32;
            s.add_exact(v);
            want += v;
            assert_eq!(s.value().to_bits(), want.to_bits());
        }
    }
}
