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
//!
//! The walk uses the same fact to avoid sorting the nucleus: the gathered
//! tokens (those above a floor estimated from a sample, checked against
//! their mass) are counting-sorted into logit buckets, and a bucket whose
//! additions stay in one binade, hold no tie or uncertain lane and do not
//! reach p is added as one integer sum, in any order. Only the other
//! buckets (the few largest probabilities, the binade crossings and the
//! cut) are sorted and replayed in order. On AVX-512 a faster walk without
//! the counting sort runs first (`nucleus/ladder.rs`) and hands over to this one
//! when one of its assumptions fails. The result is the cut: the kept
//! tokens are those ordered at or before its key.

use samplerd_plugin_sdk::prelude::SdCandidate;

use crate::util::exp_f32;

#[cfg(target_arch = "x86_64")]
mod ladder;

/// Whether the AVX-512 paths can run (they also count mask bits with
/// `popcnt`, which every AVX-512 CPU has).
#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("popcnt")
}

/// Values are processed in blocks of this many (four registers of 16).
pub const BLOCK: usize = 64;
const _: () = assert!(BLOCK == 4 * 16);

/// Bound on `|exp(x) - expf(x)| / expf(x)` for `x <= 0` where `expf(x)` is
/// normal, for both approximations: `exp_f32` (under 2 ulp, 2^-22, on every
/// 97th f32) and the AVX-512 `exp16x4` (2.1e-7 on every f32 in range, the
/// ignored `exp16_every_float` test); this is more than twice each (the
/// `exp_error_bound` tests), so a 1-ulp difference between libm versions
/// still fits. Below e^-87.3 both return 0 and libm a value < 2^-126, far
/// below every grid unit we use.
pub const EXP_REL_ERR: f32 = 1.0 / 2_097_152.0; // 2^-21

/// 2^23: `q + MAGIC` rounds `q` in [0, 2^23] to an integer, ties to even.
const MAGIC: f32 = 8_388_608.0;
const MAGIC_BITS: u32 = 0x4B00_0000;
/// A running sum on the grid holds `units` in [2^23, 2^24).
const LIMIT: u32 = 1 << 24;
/// Below this the grid unit would leave the normal range: sum exactly.
const GRID_MIN: f32 = 8.673_617e-19; // 2^-60

/// `round(q)` (ties to even) of an exact value `q` in grid units, unless
/// it is a tie (its rounding in a running sum depends on the sum's parity)
/// or off the grid's range (`q >= 2^23`).
#[inline]
fn exact_units(q: f32) -> Option<u32> {
    let t = q + MAGIC;
    (q < MAGIC && (q - (t - MAGIC)).abs() != 0.5).then(|| t.to_bits() - MAGIC_BITS)
}

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
            if let Some(r) = exact_units(e * self.inv) {
                sum = sum - b.r[j] + r;
                b.r[j] = r;
                b.margin[j] = 1.0;
                continue;
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

/// Tokens gathered by the normaliser pass: positions and logits of the
/// values at or above the floor, in position order.
#[derive(Clone, Default)]
pub struct Gathered {
    pub idx: Vec<u32>,
    pub val: Vec<f32>,
    /// Approximate probabilities `exp(l - max) / z` of the tokens, when
    /// a pass computed them (then as long as `idx`; cleared with it).
    prob: Vec<f32>,
}

impl Gathered {
    fn clear(&mut self) {
        self.idx.clear();
        self.val.clear();
        self.prob.clear();
    }

    #[inline]
    fn push(&mut self, i: u32, v: f32) {
        self.idx.push(i);
        self.val.push(v);
    }

    pub fn len(&self) -> usize {
        self.idx.len()
    }

    pub fn is_empty(&self) -> bool {
        self.idx.is_empty()
    }
}

/// llama.cpp's normaliser `Σ expf(x[i] - max)`, summed in f32 in index
/// order, bit-exact. Also replaces `g` with the tokens whose logit is
/// `>= floor` (ascending positions) and returns, second, an estimate of
/// their share of the sum (`Σ exp(x[i] - max)` over them, within a few
/// ulp: it only decides whether the floor is low enough).
pub fn softmax_sum_and_gather(x: &[f32], max: f32, floor: f32, g: &mut Gathered) -> (f32, f32) {
    g.clear();
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports AVX-512F and POPCNT (checked just above).
        return unsafe { avx512::softmax_sum(x, max, floor, g) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { softmax_sum_avx2(x, max, floor, g) };
    }
    softmax_sum_impl(x, max, floor, g)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn softmax_sum_avx2(x: &[f32], max: f32, floor: f32, g: &mut Gathered) -> (f32, f32) {
    softmax_sum_impl(x, max, floor, g)
}

/// The portable normaliser pass (LLVM vectorises the exp and rounding;
/// the gather is scalar).
#[inline(always)]
fn softmax_sum_impl(x: &[f32], max: f32, floor: f32, g: &mut Gathered) -> (f32, f32) {
    let mut s = F32Sum::new();
    let mut b = Block::default();
    let mut a = [0.0f32; BLOCK];
    let mut mass = 0.0f32;
    for (ci, c) in x.chunks(BLOCK).enumerate() {
        let n = c.len();
        let base = ci * BLOCK;
        s.add_block_portable(c, base, max, floor, &mut a, &mut b, g, &mut mass);
        let _ = n;
    }
    (s.value(), mass)
}

impl F32Sum {
    /// One block of the normaliser pass, any length up to BLOCK, portable.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn add_block_portable(
        &mut self,
        c: &[f32],
        base: usize,
        max: f32,
        floor: f32,
        a: &mut [f32; BLOCK],
        b: &mut Block,
        g: &mut Gathered,
        mass: &mut f32,
    ) {
        let n = c.len();
        if let Ok(full) = <&[f32; BLOCK]>::try_from(c) {
            for j in 0..BLOCK {
                a[j] = exp_f32(full[j] - max);
            }
            let mut m = crate::util::ge_mask(full, floor);
            while m != 0 {
                let j = m.trailing_zeros() as usize;
                g.push((base + j) as u32, full[j]);
                *mass += a[j];
                m &= m - 1;
            }
        } else {
            *a = [0.0; BLOCK];
            for j in 0..n {
                a[j] = exp_f32(c[j] - max);
                if c[j] >= floor {
                    g.push((base + j) as u32, c[j]);
                    *mass += a[j];
                }
            }
        }
        self.add_block(a, n, EXP_REL_ERR, b, |j| libm_exp(c[j] - max));
    }
}

/// The normaliser pass with AVX-512 intrinsics: the same `exp_f32`
/// operations in the same order (bit-identical lanes), the grid rounding of
/// [`F32Sum::add_block`] on four registers at a time, and the gather as
/// compress-stores. Blocks that leave the fast path (a lane near a rounding
/// boundary, a binade crossing, a sum off the grid) go through
/// `add_block` with the lanes already computed.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{
        BLOCK, Block, EXP_REL_ERR, F32Sum, Gathered, LIMIT, MAGIC, MAGIC_BITS, exact_units,
        libm_exp,
    };

    /// Coefficients of `exp16x4`'s polynomial, highest degree first (the
    /// constant term is 1, fixed): relative minimax error 9.2e-8 on [-ln2/2,
    /// ln2/2], 1.5e-7 evaluated in f32 with fused multiply-adds.
    const EXP16_P: [f32; 6] = [
        0.008_290_272,
        0.041_898_16,
        0.166_676_39,
        0.499_991_48,
        0.999_999_7,
        1.0,
    ];

    /// `exp(x)` for `x <= 0` on four registers of 16 lanes: `exp_f32`'s
    /// range reduction on fused multiply-adds, a degree-5 polynomial (two
    /// degrees below `exp_f32`'s), scaled by `vscalefps` (within
    /// [`EXP_REL_ERR`] of libm; tested), the four chains interleaved.
    /// Lanes below `LO` (and -inf) give 0; no clamping is needed above, as
    /// `x <= 0`.
    #[inline(always)]
    pub(super) unsafe fn exp16x4(x: [__m512; 4]) -> [__m512; 4] {
        use crate::util::exp_consts::{C1, C2, LO, LOG2E, MAGIC as RMAGIC};
        // SAFETY (whole body): register-only AVX-512F operations; the
        // caller runs with AVX-512F enabled.
        unsafe {
            let lo = _mm512_set1_ps(LO);
            let rmagic = _mm512_set1_ps(RMAGIC);
            // the lanes that do not flush to 0 (below LO the reduction is
            // garbage, and masked off)
            let keep = x.map(|v| _mm512_cmp_ps_mask::<_CMP_GE_OQ>(v, lo));
            let t = x.map(|v| _mm512_fmadd_ps(v, _mm512_set1_ps(LOG2E), rmagic));
            let n = t.map(|t| _mm512_sub_ps(t, rmagic));
            let mut r = [_mm512_setzero_ps(); 4];
            for k in 0..4 {
                r[k] = _mm512_fnmadd_ps(n[k], _mm512_set1_ps(C1), x[k]);
                r[k] = _mm512_fnmadd_ps(n[k], _mm512_set1_ps(C2), r[k]);
            }
            // a degree-5 polynomial with constant term 1 (relative
            // minimax on [-ln2/2, ln2/2], coefficients from the highest)
            let mut y = [_mm512_set1_ps(EXP16_P[0]); 4];
            for &c in &EXP16_P[1..] {
                for k in 0..4 {
                    y[k] = _mm512_fmadd_ps(y[k], r[k], _mm512_set1_ps(c));
                }
            }
            let mut out = [_mm512_setzero_ps(); 4];
            for k in 0..4 {
                // y · 2^n (n is integral; the result is normal for x >= LO)
                out[k] = _mm512_maskz_scalef_ps(keep[k], y[k], n[k]);
            }
            out
        }
    }

    /// A block off the fast path (kept out of line, so that the hot loop
    /// keeps its registers: the libm calls would clobber them all).
    #[cold]
    #[inline(never)]
    fn add_block_slow(s: &mut F32Sum, a: &[f32; BLOCK], c: &[f32], max: f32, b: &mut Block) {
        s.add_block(a, BLOCK, EXP_REL_ERR, b, |j| libm_exp(c[j] - max));
    }

    /// A block sum `sum` of grid units with the `bad` lanes settled by
    /// libm's exact value (`t_bits[j]` holds `MAGIC_BITS + ` lane j's
    /// approximate units), as [`F32Sum::resolve`] does; None if one is a
    /// tie (which needs the order).
    #[cold]
    #[inline(never)]
    fn resolve_lanes(
        inv: f32,
        t_bits: &[u32; BLOCK],
        mut bad: u64,
        c: &[f32],
        max: f32,
        mut sum: u32,
    ) -> Option<u32> {
        while bad != 0 {
            let j = bad.trailing_zeros() as usize;
            bad &= bad - 1;
            let r = exact_units(libm_exp(c[j] - max) * inv)?;
            sum = sum - (t_bits[j] - MAGIC_BITS) + r;
        }
        Some(sum)
    }

    #[target_feature(enable = "avx512f,popcnt")]
    pub(super) unsafe fn softmax_sum(
        x: &[f32],
        max: f32,
        floor: f32,
        g: &mut Gathered,
    ) -> (f32, f32) {
        let n = x.len();
        g.idx.reserve(n + 16);
        g.val.reserve(n + 16);
        let idx_out = g.idx.as_mut_ptr();
        let val_out = g.val.as_mut_ptr();
        let mut got = 0usize;
        let mut s = F32Sum::new();
        let mut b = Block::default();
        let mut a = [0.0f32; BLOCK];
        let full = n / BLOCK;
        let vmax = _mm512_set1_ps(max);
        let vfloor = _mm512_set1_ps(floor);
        let magic = _mm512_set1_ps(MAGIC);
        // 1 ∓ EXP_REL_ERR (exact in f32)
        let below = _mm512_set1_ps(1.0 - EXP_REL_ERR);
        let above = _mm512_set1_ps(1.0 + EXP_REL_ERR);
        // positions of the next 16 lanes
        let mut ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let sixteen = _mm512_set1_epi32(16);
        for blk in 0..full {
            let base = blk * BLOCK;
            // SAFETY: base + BLOCK <= full * BLOCK <= n: the loads are in
            // bounds; the gather writes 16 lanes at `got`, and `got` stays
            // below the number of positions seen (<= n), inside the
            // reserved n + 16.
            let e = unsafe {
                let v: [__m512; 4] =
                    std::array::from_fn(|k| _mm512_loadu_ps(x.as_ptr().add(base + 16 * k)));
                let e = exp16x4(v.map(|v| _mm512_sub_ps(v, vmax)));
                for &vk in &v {
                    let m = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(vk, vfloor);
                    // compress in a register and store all 16 lanes (the
                    // memory form of the compress is several times slower);
                    // the capacity has 16 entries of slack
                    _mm512_storeu_si512(
                        idx_out.add(got).cast(),
                        _mm512_maskz_compress_epi32(m, ids),
                    );
                    _mm512_storeu_ps(val_out.add(got).cast(), _mm512_maskz_compress_ps(m, vk));
                    got += m.count_ones() as usize;
                    ids = _mm512_add_epi32(ids, sixteen);
                }
                e
            };
            if s.on_grid {
                let inv = _mm512_set1_ps(s.inv);
                // the bits of `q + MAGIC` are `MAGIC_BITS + round(q)`: sum
                // them, subtract the 64 offsets once
                let mut tsum = _mm512_setzero_si512();
                let mut ts = [_mm512_setzero_ps(); 4];
                let mut bad = [0u16; 4];
                // from the binade [2, 4) on, q = e·inv < 2^23 as e <= 1
                // (plus a few ulp): the clamp is only needed below
                let clamp = s.exp < 1;
                for k in 0..4 {
                    let q = _mm512_mul_ps(e[k], inv);
                    let q = if clamp { _mm512_min_ps(q, magic) } else { q };
                    // The exact value lies within q·(1 ± err), err =
                    // EXP_REL_ERR (the exp; the scaling is exact): if both
                    // ends of that round to the same integer, so does it,
                    // and it is no tie (a tie inside would send the ends
                    // apart). Each fused add rounds the exact product once:
                    // `MAGIC + round(q·c)`.
                    let t = _mm512_fmadd_ps(q, below, magic);
                    let t_hi = _mm512_fmadd_ps(q, above, magic);
                    bad[k] = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(t, t_hi);
                    tsum = _mm512_add_epi32(tsum, _mm512_castps_si512(t));
                    ts[k] = t;
                }
                let mut sum = Some(
                    (_mm512_reduce_add_epi32(tsum) as u32)
                        .wrapping_sub((BLOCK as u32).wrapping_mul(MAGIC_BITS)),
                );
                if bad != [0; 4] {
                    // a few lanes near a rounding boundary: libm decides
                    let mut tb = [0u32; BLOCK];
                    for (k, t) in ts.iter().enumerate() {
                        // SAFETY: 16 u32 into tb[16k..16k + 16].
                        unsafe { _mm512_storeu_ps(tb.as_mut_ptr().add(16 * k).cast(), *t) };
                    }
                    let bad64 = bad
                        .iter()
                        .enumerate()
                        .fold(0u64, |m, (k, &b)| m | (b as u64) << (16 * k));
                    let c = &x[base..base + BLOCK];
                    sum = sum.and_then(|sum| resolve_lanes(s.inv, &tb, bad64, c, max, sum));
                }
                if let Some(sum) = sum
                    && s.units + sum < LIMIT
                {
                    s.units += sum;
                    continue;
                }
            }
            for (k, &ek) in e.iter().enumerate() {
                // SAFETY: 16 floats into a[16k..16k + 16], k < BLOCK / 16.
                unsafe { _mm512_storeu_ps(a.as_mut_ptr().add(16 * k), ek) };
            }
            add_block_slow(&mut s, &a, &x[base..base + BLOCK], max, &mut b);
        }
        // SAFETY: `got` entries were written into the reserved capacity.
        unsafe {
            g.idx.set_len(got);
            g.val.set_len(got);
        }
        let base = full * BLOCK;
        if base < n {
            let mut unused = 0.0;
            s.add_block_portable(&x[base..], base, max, floor, &mut a, &mut b, g, &mut unused);
        }
        // The gathered share: from the probabilities of the gathered
        // tokens, which the walk needs anyway (cheaper than a masked sum
        // over every block).
        let z = s.value();
        // SAFETY: AVX-512F is enabled in this function.
        let share = unsafe { super::ladder::exp_div(&g.val, max, z, &mut g.prob) };
        (z, share * z)
    }
}

/// The order-preserving map of f32 to u32, reversed: ascending keys are
/// descending logits.
#[inline(always)]
pub fn desc_key(l: f32) -> u32 {
    !ord_key(l)
}

/// The order-preserving map of f32 to u32 (ascending with the value,
/// -0.0 below +0.0), branch-free.
#[inline(always)]
fn ord_key(l: f32) -> u32 {
    let b = l.to_bits();
    b ^ (((b as i32) >> 31) as u32 | 0x8000_0000)
}

/// The key of the token at `pos` with logit `l` in llama.cpp's walk
/// order: descending logit, then ascending position.
#[inline(always)]
pub fn sort_key(l: f32, pos: u32) -> u64 {
    ((desc_key(l) as u64) << 32) | pos as u64
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
    gathered: Gathered,
    #[cfg(target_arch = "x86_64")]
    ladder: ladder::Ladder,
    /// Gathered keys `(desc_key(l) << 32) | position`, in bucket order.
    keys: Vec<u64>,
    bucket: Vec<u32>,
    counts: Vec<u32>,
    next: Vec<u32>,
    sample: Vec<f32>,
    sample_e: Vec<f32>,
    /// The share of the logits in `sample` (0 when it is not a sample of
    /// the current ones).
    sample_rate: f32,
    /// `Σ exp(l - max)` over `sample`.
    sample_total: f32,
}

impl Scratch {
    /// The tokens [`nucleus`] gathered, in position order: a superset of
    /// the kept ones.
    pub fn gathered(&self) -> &Gathered {
        &self.gathered
    }
}

/// Where [`nucleus`] cut: the kept tokens are exactly those whose key
/// `(desc_key(logit) << 32) | position` is `<= last_key`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cut {
    pub kept: usize,
    pub last_key: u64,
}

impl Cut {
    /// Whether the token at `pos` with logit `l` is kept.
    #[inline(always)]
    pub fn keeps(&self, l: f32, pos: u32) -> bool {
        sort_key(l, pos) <= self.last_key
    }
}

impl Cut {
    /// The cut's `ord_key` and position (the AVX-512 writer compares
    /// those rather than building 64-bit keys).
    fn ord_and_pos(&self) -> (u32, u32) {
        (!((self.last_key >> 32) as u32), self.last_key as u32)
    }
}

/// Writes the kept tokens of `g` (a superset, in position order) to
/// `out[..kept]` in position order as candidates; `out` must hold
/// `g.len()` entries. Branch-free (the kept ones are scattered among the
/// gathered ones); AVX-512 compresses 16 at a time.
pub fn write_kept(g: &Gathered, cut: Cut, out: &mut [SdCandidate]) {
    assert!(
        out.len() >= g.len(),
        "write_kept: output shorter than the gathered set"
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports AVX-512F and POPCNT (checked just above).
        return unsafe { write_kept_avx512(g, cut, out) };
    }
    write_kept_from(g, cut, out, 0, 0);
}

/// The portable loop, from gathered index `from` and output index `k`.
fn write_kept_from(g: &Gathered, cut: Cut, out: &mut [SdCandidate], from: usize, mut k: usize) {
    for (&i, &l) in g.idx[from..].iter().zip(&g.val[from..]) {
        out[k] = SdCandidate { id: i, logit: l };
        k += cut.keeps(l, i) as usize;
    }
    debug_assert_eq!(k, cut.kept);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,popcnt")]
unsafe fn write_kept_avx512(g: &Gathered, cut: Cut, out: &mut [SdCandidate]) {
    use std::arch::x86_64::*;
    let (ord_cut, pos_cut) = cut.ord_and_pos();
    let n = g.len();
    let vord = _mm512_set1_epi32(ord_cut as i32);
    let vpos = _mm512_set1_epi32(pos_cut as i32);
    let sign = _mm512_set1_epi32(i32::MIN);
    // (id, logit) pairs: lanes 0..8 and 8..16 of the two compressed rows
    let lo_pairs = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let hi_pairs = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    let mut k = 0usize;
    let mut j = 0usize;
    // 16 pairs are stored whatever the count: keep 16 entries of room
    while j + 16 <= n && k + 16 <= out.len() {
        // SAFETY: j + 16 <= n for the loads; k + 16 <= out.len() for the
        // two 8-pair stores (SdCandidate is two u32, repr(C)).
        unsafe {
            let ids = _mm512_loadu_si512(g.idx.as_ptr().add(j).cast());
            let bits = _mm512_loadu_si512(g.val.as_ptr().add(j).cast());
            let ord = _mm512_xor_si512(bits, _mm512_or_si512(_mm512_srai_epi32::<31>(bits), sign));
            let m = _mm512_cmpgt_epu32_mask(ord, vord)
                | (_mm512_cmpeq_epi32_mask(ord, vord) & _mm512_cmple_epu32_mask(ids, vpos));
            let ci = _mm512_maskz_compress_epi32(m, ids);
            let cv = _mm512_maskz_compress_epi32(m, bits);
            let dst = out.as_mut_ptr().add(k).cast::<__m512i>();
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi32(ci, lo_pairs, cv));
            _mm512_storeu_si512(dst.add(1), _mm512_permutex2var_epi32(ci, hi_pairs, cv));
            k += m.count_ones() as usize;
        }
        j += 16;
    }
    write_kept_from(g, cut, out, j, k);
}

/// Every SAMPLE_STRIDE-th logit estimates where the cut lands.
const SAMPLE_STRIDE: usize = 32;
/// Fraction of the tail mass `(1 - p)` the first floor leaves out: close
/// to 1 keeps the gathered set small; the gathered mass is checked, so a
/// miss only costs one more gather pass.
const TAIL_SHARE: f32 = 0.9;
/// Relative slack on the gathered mass before the walk trusts the floor
/// (the walk's f32 running sum may drift from the exact mass by rounding).
const MASS_SLACK: f32 = 4e-3;
/// The walk's buckets hold about this many gathered tokens on average.
const PER_BUCKET: usize = 64;
/// Interleaved histograms of the bucketing (see `walk_impl`).
const LANES: usize = 4;
/// Bounds on the number of buckets.
const MIN_BUCKETS: usize = 16;
const MAX_BUCKETS: usize = 4096;

/// llama.cpp's top-p over `x` (the logits in list order). The kept tokens
/// are those with `cut.keeps(x[i], i)`.
pub fn nucleus(x: &[f32], max: f32, p: f32, min_keep: usize, s: &mut Scratch) -> Cut {
    let target = gather_nucleus(x, max, p, min_keep, s);
    if let Some(cut) = walk(target, s) {
        return cut;
    }
    // The running sum never reached p inside the gathered set (rounding
    // drift beyond the slack, or the sum never reaches p at all):
    // everything.
    if target.floor > f32::NEG_INFINITY {
        gather_at_least(x, max, f32::NEG_INFINITY, target.floor, &mut s.gathered);
        let everything = Target {
            floor: f32::NEG_INFINITY,
            ..target
        };
        if let Some(cut) = walk(everything, s) {
            return cut;
        }
    }
    Cut {
        kept: x.len(),
        last_key: u64::MAX,
    }
}

/// The normaliser and the gathered set (`s.gathered`): a floor low enough
/// that the gathered tokens hold clearly more than p of the mass.
fn gather_nucleus(x: &[f32], max: f32, p: f32, min_keep: usize, s: &mut Scratch) -> Target {
    let mut floor = estimate_floor(x, max, p, s);
    let (z, mut mass) = softmax_sum_and_gather(x, max, floor, &mut s.gathered);
    // Lower the floor until the gathered tokens hold clearly more than p
    // of the mass (and at least min_keep of them): then the cut is among
    // them, and only they are bucketed.
    let need = p * z * (1.0 + MASS_SLACK);
    let mut step = 2.0f32;
    while floor > f32::NEG_INFINITY && (mass < need || s.gathered.len() < min_keep) {
        let lower = if max - floor > 64.0 {
            f32::NEG_INFINITY
        } else {
            floor - step
        };
        mass += gather_at_least(x, max, lower, floor, &mut s.gathered);
        floor = lower;
        step *= 2.0;
    }
    Target {
        max,
        z,
        p,
        min_keep,
        floor,
    }
}

/// Replaces `g` with the tokens `x[i] >= lo` (position order) and returns
/// `Σ exp(x[i] - max)` over the new ones, those below `hi` (a lower floor
/// after the first one proved too high).
pub fn gather_at_least(x: &[f32], max: f32, lo: f32, hi: f32, g: &mut Gathered) -> f32 {
    g.clear();
    let mut mass = 0.0f32;
    for (i, &v) in x.iter().enumerate() {
        if v >= lo {
            g.push(i as u32, v);
            if v < hi {
                mass += exp_f32(v - max);
            }
        }
    }
    mass
}

/// A logit floor under which the tokens should hold about
/// `TAIL_SHARE · (1 - p)` of the mass, estimated from every
/// SAMPLE_STRIDE-th token.
fn estimate_floor(x: &[f32], max: f32, p: f32, s: &mut Scratch) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        let share = (1.0 - p) * TAIL_SHARE;
        // SAFETY: the CPU supports AVX-512F and POPCNT (checked just above).
        return unsafe {
            ladder::estimate_floor(
                x,
                max,
                share,
                &mut s.sample,
                &mut s.sample_e,
                &mut s.sample_rate,
                &mut s.sample_total,
                s.ladder.filtered_mut(),
            )
        };
    }
    s.sample.clear();
    s.sample.extend(x.iter().step_by(SAMPLE_STRIDE).copied());
    s.sample_e.clear();
    s.sample_e
        .extend(s.sample.iter().map(|&v| exp_f32(v - max)));
    let total = masked_sum(&s.sample, &s.sample_e, f32::INFINITY);
    let allowed = (1.0 - p) * total * TAIL_SHARE;
    // bisection on t in [max - 64, max]: the mass below t grows with t
    let (mut lo, mut hi) = (max - 64.0, max);
    if masked_sum(&s.sample, &s.sample_e, hi) <= allowed {
        return hi;
    }
    for _ in 0..10 {
        let mid = 0.5 * (lo + hi);
        if masked_sum(&s.sample, &s.sample_e, mid) <= allowed {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
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

/// `a[j] = exp_f32(key_logit(k[j]) - max) / z` for `k.len() <= BLOCK`
/// lanes (the rest 0).
#[inline(always)]
fn exp_div_keys_impl(k: &[u64], max: f32, z: f32, a: &mut [f32; BLOCK]) {
    let mut v = [f32::NEG_INFINITY; BLOCK];
    for (v, &k) in v.iter_mut().zip(k) {
        *v = key_logit((k >> 32) as u32) - max;
    }
    for (o, &x) in a.iter_mut().zip(&v) {
        *o = exp_f32(x) / z;
    }
}

/// Walks the gathered tokens (all `>= floor`) in descending logit order
/// with llama.cpp's f32 running sum of `expf(l - max) / z`, a bucket of
/// logits at a time: a bucket whose additions stay in one binade, hold no
/// tie or uncertain lane and do not reach the cut is one integer addition
/// of rounded values, in any order; only the other buckets are sorted and
/// replayed in order. None if the cut is not inside the gathered set.
fn walk(t: Target, s: &mut Scratch) -> Option<Cut> {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports AVX-512F and POPCNT (checked just above).
        if let Some(cut) = unsafe { ladder::walk(t, s) } {
            return Some(cut);
        }
        // SAFETY: as above.
        return unsafe { walk_avx512(t, s) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { walk_avx2(t, s) };
    }
    walk_impl(t, s)
}

/// What the walk looks for: llama.cpp's cut at `p` (and `min_keep`) over
/// `expf(l - max) / z`, among gathered tokens all `>= floor`.
#[derive(Clone, Copy)]
struct Target {
    max: f32,
    z: f32,
    p: f32,
    min_keep: usize,
    floor: f32,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,popcnt")]
unsafe fn walk_avx512(t: Target, s: &mut Scratch) -> Option<Cut> {
    walk_impl(t, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn walk_avx2(t: Target, s: &mut Scratch) -> Option<Cut> {
    walk_impl(t, s)
}

/// The walk, compiled once per instruction set (the exp, the grid
/// rounding and the bucketing all vectorise). Rust never contracts a
/// multiply and an add into a fused multiply-add, so every version
/// computes the same values.
#[inline(always)]
fn walk_impl(t: Target, s: &mut Scratch) -> Option<Cut> {
    let Target {
        max,
        z,
        p,
        min_keep,
        floor,
    } = t;
    let g = &s.gathered;
    let n = g.len();
    if n == 0 {
        return None;
    }
    // Counting sort into buckets of equal logit width (stable: positions
    // ascend inside a bucket).
    let lo = if floor == f32::NEG_INFINITY {
        g.val
            .iter()
            .copied()
            .filter(|v| v.is_finite())
            .fold(max, f32::min)
    } else {
        floor
    };
    let nb = (n / PER_BUCKET).clamp(MIN_BUCKETS, MAX_BUCKETS);
    let span = max - lo;
    let scale = if span > 0.0 {
        (nb - 1) as f32 / span
    } else {
        0.0
    };
    let top = (nb - 1) as u32;
    s.bucket.clear();
    s.bucket.resize(n, 0);
    // clamped in f32 so the loop vectorises: -inf logits land in the last
    // bucket (a NaN from inf * 0, when the span is 0, becomes 0 first)
    let top_f = top as f32;
    for (b, &v) in s.bucket.iter_mut().zip(&g.val) {
        let t = ((max - v) * scale).max(0.0).min(top_f);
        // SAFETY: t is finite and in [0, top] (max/min drop NaN).
        *b = unsafe { t.to_int_unchecked::<u32>() };
    }
    // Four interleaved histograms and cursor sets: consecutive tokens
    // often fall in the same (dense) bucket, and one counter would chain
    // every increment through memory.
    s.counts.clear();
    s.counts.resize(LANES * nb + 1, 0);
    {
        let (c, rest) = s.counts.split_at_mut(1);
        let _ = c;
        for (j, &b) in s.bucket.iter().enumerate() {
            rest[b as usize * LANES + j % LANES] += 1;
        }
    }
    // exclusive prefix: counts[b * LANES + l] = start of (bucket b, lane l)
    for t in 1..=LANES * nb {
        s.counts[t] += s.counts[t - 1];
    }
    s.keys.clear();
    s.keys.resize(n, 0);
    s.next.clear();
    s.next.extend_from_slice(&s.counts[..LANES * nb]);
    for (j, ((&b, &v), &i)) in s.bucket.iter().zip(&g.val).zip(&g.idx).enumerate() {
        let at = &mut s.next[b as usize * LANES + j % LANES];
        s.keys[*at as usize] = sort_key(v, i);
        *at += 1;
    }

    let mut sum = F32Sum::new();
    let mut blk = Block::default();
    let mut a = [0.0f32; BLOCK];
    let rel_err = 2.0 * EXP_REL_ERR; // the division adds one rounding
    for b in 0..nb {
        let (b0, b1) = (
            s.counts[b * LANES] as usize,
            s.counts[(b + 1) * LANES] as usize,
        );
        if b0 == b1 {
            continue;
        }
        // Fast path: the whole bucket as one integer addition.
        if let Some(total) = bucket_units(&sum, &s.keys[b0..b1], max, z, rel_err, &mut a, &mut blk)
        {
            let end = (sum.units + total) as f32 * sum.unit;
            if !(end >= p && b1 >= min_keep) {
                sum.units += total;
                continue;
            }
        }
        // Slow path: sort the bucket, replay it in order.
        let keys = &mut s.keys[b0..b1];
        keys.sort_unstable();
        if let Some(cut) = replay_sorted(&mut sum, keys, b0, t) {
            return Some(cut);
        }
    }
    None
}

/// Adds the tokens of `keys` (sorted, the `offset`-th onwards in
/// llama.cpp's order) to the running sum in order, exactly, and returns
/// the cut if it falls among them.
#[inline(always)]
fn replay_sorted(sum: &mut F32Sum, keys: &[u64], offset: usize, t: Target) -> Option<Cut> {
    let Target {
        max,
        z,
        p,
        min_keep,
        ..
    } = t;
    let rel_err = 2.0 * EXP_REL_ERR; // the division adds one rounding
    let mut blk = Block::default();
    let mut a = [0.0f32; BLOCK];
    for (c, chunk) in keys.chunks(BLOCK).enumerate() {
        let m = chunk.len();
        let first = offset + c * BLOCK;
        exp_div_keys_impl(chunk, max, z, &mut a);
        let mut stop = |j: usize, cum: f32| cum >= p && first + j + 1 >= min_keep;
        let exact = |j: usize| libm_exp(key_logit((chunk[j] >> 32) as u32) - max) / z;
        if let Some(j) = sum.add_block_until(&a, m, rel_err, &mut blk, exact, &mut stop) {
            return Some(Cut {
                kept: first + j + 1,
                last_key: chunk[j],
            });
        }
    }
    None
}

/// `Σ round_u(e/z)` over a bucket's keys on the running sum's grid, when
/// no lane is a tie or within the error bound of a rounding boundary and
/// the sum stays in the binade; None otherwise (or off the grid).
#[inline(always)]
fn bucket_units(
    sum: &F32Sum,
    keys: &[u64],
    max: f32,
    z: f32,
    rel_err: f32,
    a: &mut [f32; BLOCK],
    blk: &mut Block,
) -> Option<u32> {
    if !sum.on_grid {
        return None;
    }
    let mut total = 0u32;
    for chunk in keys.chunks(BLOCK) {
        exp_div_keys_impl(chunk, max, z, a);
        let (mut part, bad) = sum.round_block(a, rel_err, blk);
        if bad != 0 {
            // the few lanes near a rounding boundary: libm's exact value
            // decides, unless one is a tie (which needs the order)
            let mut exact = |j: usize| libm_exp(key_logit((chunk[j] >> 32) as u32) - max) / z;
            part = sum.resolve(bad, rel_err, blk, &mut exact, part)?;
        }
        total += part;
        if sum.units + total >= LIMIT {
            return None;
        }
    }
    Some(total)
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

    /// The largest relative error of `exp16x4` against libm over every
    /// `step`-th f32 in (LO, 0] (None without AVX-512F + FMA).
    #[cfg(target_arch = "x86_64")]
    fn avx512_exp_worst_error(step: u32) -> Option<f64> {
        if !(std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("fma"))
        {
            return None;
        }
        #[target_feature(enable = "avx512f,fma")]
        unsafe fn worst_error(step: u32) -> f64 {
            use std::arch::x86_64::*;
            let mut worst = 0.0f64;
            let top = crate::util::exp_consts::LO.to_bits();
            let mut b = 0x8000_0000u32;
            let mut xs = [0.0f32; 64];
            let mut out = [0.0f32; 64];
            while b <= top {
                for (j, v) in xs.iter_mut().enumerate() {
                    *v = f32::from_bits(b.saturating_add(step * j as u32).min(top));
                }
                // SAFETY: 64 floats in and out, AVX-512F enabled.
                unsafe {
                    let v: [__m512; 4] =
                        std::array::from_fn(|k| _mm512_loadu_ps(xs.as_ptr().add(16 * k)));
                    let e = avx512::exp16x4(v);
                    for (k, ek) in e.iter().enumerate() {
                        _mm512_storeu_ps(out.as_mut_ptr().add(16 * k), *ek);
                    }
                }
                for (&x, &got) in xs.iter().zip(&out) {
                    let want = libm_exp(x) as f64;
                    if want >= f32::MIN_POSITIVE as f64 {
                        worst = worst.max(((got as f64 - want) / want).abs());
                    }
                }
                b = b.saturating_add(step * 64);
            }
            worst
        }
        // SAFETY: the CPU supports AVX-512F and FMA (checked above).
        Some(unsafe { worst_error(step) })
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_exp_error_bound() {
        // The fused multiply-add exp of the normaliser pass, every 97th
        // f32: within half of EXP_REL_ERR (skipped on CPUs without
        // AVX-512F + FMA).
        if let Some(worst) = avx512_exp_worst_error(97) {
            assert!(worst <= EXP_REL_ERR as f64 / 2.0, "worst {worst:e}");
        }
    }

    /// Every f32 in (LO, 0] (about 10^9 values, ~10 s in release):
    /// `cargo test --release -p samplerd-core-stages -- --ignored
    /// exp16_every_float`. Measured 2026-11-30: see [`EXP_REL_ERR`].
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore]
    fn exp16_every_float() {
        if let Some(worst) = avx512_exp_worst_error(1) {
            eprintln!("exp16x4: worst relative error {worst:e}");
            assert!(worst <= EXP_REL_ERR as f64 / 2.0, "worst {worst:e}");
        }
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
            let mut g = Gathered::default();
            let (got, mass) = softmax_sum_and_gather(&x, max, max - 2.0, &mut g);
            assert_eq!(got.to_bits(), want.to_bits(), "case {case} n {n}");
            let want_mass: f32 = x
                .iter()
                .filter(|&&v| v >= max - 2.0)
                .map(|&v| (v - max).exp())
                .sum();
            assert!(
                (mass - want_mass).abs() <= 1e-4 * want_mass,
                "case {case}: gathered mass {mass} vs {want_mass}"
            );
            // the portable pass (what a CPU without AVX-512 runs) agrees
            let mut gp = Gathered::default();
            let (zp, mp) = softmax_sum_impl(&x, max, max - 2.0, &mut gp);
            assert_eq!(zp.to_bits(), got.to_bits(), "case {case}: portable pass");
            assert_eq!(
                (gp.idx.clone(), gp.val.clone()),
                (g.idx.clone(), g.val.clone())
            );
            assert!((mp - mass).abs() <= 1e-4 * mass.max(f32::MIN_POSITIVE));
            let idx = g.idx.clone();
            let gv: Vec<f32> = idx.iter().map(|&i| x[i as usize]).collect();
            assert_eq!(g.val, gv);
            let gw: Vec<u32> = (0..n as u32)
                .filter(|&i| x[i as usize] >= max - 2.0)
                .collect();
            assert_eq!(idx, gw);
        }
    }

    /// llama.cpp's top-p, written plainly: libm expf, f32 running sums,
    /// a full sort. Returns the kept positions in order.
    fn reference(x: &[f32], p: f32, min_keep: usize) -> Vec<u32> {
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0.0f32;
        for &v in x {
            z += libm_exp(v - max);
        }
        let mut order: Vec<u32> = (0..x.len() as u32).collect();
        order.sort_by_key(|&i| (desc_key(x[i as usize]), i));
        let mut cum = 0.0f32;
        for (k, &i) in order.iter().enumerate() {
            cum += libm_exp(x[i as usize] - max) / z;
            if cum >= p && k + 1 >= min_keep {
                order.truncate(k + 1);
                break;
            }
        }
        order
    }

    #[test]
    fn nucleus_equals_the_plain_reference() {
        let mut rnd = xorshift(11);
        let mut s = Scratch::default();
        for case in 0..160 {
            let n = match case % 5 {
                0 => 151_936,
                1 => 1 + (rnd() * 300.0) as usize,
                _ => 1_000 + (rnd() * 60_000.0) as usize,
            };
            let sd = [0.3, 1.0, 3.0, 6.0, 12.0][(case / 5) % 5];
            let mut x: Vec<f32> = (0..n)
                .map(|_| {
                    let g: f64 = (0..4).map(|_| rnd()).sum::<f64>() - 2.0;
                    (g * 1.7 * sd) as f32
                })
                .collect();
            if case % 7 == 3 {
                // ties across the cut, and a plateau at the top
                for v in x.iter_mut().step_by(2) {
                    *v = (*v * 4.0).round() / 4.0;
                }
            }
            if case % 9 == 4 {
                for v in x.iter_mut().step_by(5) {
                    *v = f32::NEG_INFINITY;
                }
                x[0] = 1.0;
            }
            let p = [0.5f32, 0.8, 0.9, 0.95, 0.99, 0.999, 0.3, 1.0 - 1e-6][case % 8];
            let min_keep = if case % 11 == 5 { n / 2 + 1 } else { 1 };
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let cut = nucleus(&x, max, p, min_keep, &mut s);
            let got: Vec<u32> = (0..n as u32)
                .filter(|&i| cut.keeps(x[i as usize], i))
                .collect();
            let in_gathered: Vec<u32> = s
                .gathered()
                .idx
                .iter()
                .copied()
                .filter(|&i| cut.keeps(x[i as usize], i))
                .collect();
            let mut want = reference(&x, p, min_keep);
            want.sort_unstable();
            assert_eq!(cut.kept, want.len(), "case {case}: n {n} sd {sd} p {p}");
            assert_eq!(got, want, "case {case}: n {n} sd {sd} p {p}");
            assert_eq!(
                in_gathered, want,
                "case {case}: the gathered set holds the kept"
            );
            // the candidate writer (AVX-512 where present) and the portable
            // loop write exactly the kept ones, in position order
            let blank = SdCandidate {
                id: u32::MAX,
                logit: 0.0,
            };
            let mut out = vec![blank; s.gathered().len()];
            write_kept(s.gathered(), cut, &mut out);
            let ids: Vec<u32> = out[..cut.kept].iter().map(|c| c.id).collect();
            assert_eq!(ids, want, "case {case}: write_kept");
            assert!(
                out[..cut.kept]
                    .iter()
                    .all(|c| c.logit.to_bits() == x[c.id as usize].to_bits())
            );
            let mut out2 = vec![blank; s.gathered().len()];
            write_kept_from(s.gathered(), cut, &mut out2, 0, 0);
            let ids2: Vec<u32> = out2[..cut.kept].iter().map(|c| c.id).collect();
            assert_eq!(ids2, want, "case {case}: portable write_kept");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn ladder_walk_equals_the_bucket_walk() {
        // The AVX-512 fast path either finds the bucket walk's very cut or
        // declines; on ordinary logits it must decide nearly always.
        if !has_avx512() {
            return;
        }
        let mut rnd = xorshift(23);
        let mut s = Scratch::default();
        let (mut decided, mut ordinary, mut ordinary_decided) = (0, 0, 0);
        let cases = 1200;
        for case in 0..cases {
            let n = match case % 4 {
                0 => 151_936,
                1 => 49_152,
                _ => 4_000 + (rnd() * 120_000.0) as usize,
            };
            let sd = [1.0, 2.0, 3.0, 4.0, 6.0][(case / 4) % 5];
            let mut x: Vec<f32> = (0..n)
                .map(|_| {
                    let g: f64 = (0..4).map(|_| rnd()).sum::<f64>() - 2.0;
                    (g * 1.7 * sd) as f32
                })
                .collect();
            let odd = case % 6 == 5;
            if odd {
                // coarse logits: many equal values, ties in the sums
                for v in x.iter_mut() {
                    *v = (*v * 2.0).round() / 2.0;
                }
            }
            let p = [0.9f32, 0.95, 0.8, 0.99, 0.6, 0.5, 0.3, 0.75][case % 8];
            let min_keep = if case % 13 == 7 { 50 } else { 1 };
            let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let t = gather_nucleus(&x, max, p, min_keep, &mut s);
            // SAFETY: AVX-512F and POPCNT checked above.
            let fast = unsafe { ladder::walk(t, &mut s) };
            let slow = walk_impl(t, &mut s);
            if let Some(cut) = fast {
                assert_eq!(Some(cut), slow, "case {case}: n {n} sd {sd} p {p}");
                decided += 1;
            }
            // ordinary: peaked enough that the top set is small
            if !odd && sd >= 3.0 && s.gathered().len() >= 4096 {
                ordinary += 1;
                ordinary_decided += fast.is_some() as usize;
            }
        }
        assert!(
            ordinary_decided * 10 >= ordinary * 9,
            "the fast path decided {ordinary_decided} of {ordinary} ordinary cases ({decided} of {cases} in all)"
        );
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
