//! An f32 running sum that takes blocks of additions at once on the grid
//! of its binade (see the parent module): bit-identical to adding the
//! values one by one in order. Imports no sibling.

#![forbid(unsafe_code)]

/// Values are processed in blocks of this many (four registers of 16).
pub(super) const BLOCK: usize = 64;
const _: () = assert!(BLOCK == 4 * 16);

/// 2^23: `q + MAGIC` rounds `q` in [0, 2^23] to an integer, ties to even.
pub(super) const MAGIC: f32 = 8_388_608.0;
pub(super) const MAGIC_BITS: u32 = 0x4B00_0000;
/// A running sum on the grid holds `units` in [2^23, 2^24).
pub(super) const LIMIT: u32 = 1 << 24;
/// Below this the grid unit would leave the normal range: sum exactly.
pub(super) const GRID_MIN: f32 = 8.673_617e-19; // 2^-60

/// `round(q)` (ties to even) of an exact value `q` in grid units, unless
/// it is a tie (its rounding in a running sum depends on the sum's parity)
/// or off the grid's range (`q >= 2^23`).
#[inline]
pub(super) fn exact_units(q: f32) -> Option<u32> {
    let t = q + MAGIC;
    (q < MAGIC && (q - (t - MAGIC)).abs() != 0.5).then(|| t.to_bits() - MAGIC_BITS)
}

/// An f32 running sum, bit-identical to `s += v` in order, that can take a
/// block of additions at once.
#[derive(Clone, Copy, Debug)]
pub(super) struct F32Sum {
    /// The value when off the grid.
    pub(super) value: f32,
    pub(super) on_grid: bool,
    /// Exponent of the binade (when on the grid).
    pub(super) exp: i32,
    /// `ulp` of the binade and its inverse (powers of two).
    pub(super) unit: f32,
    pub(super) inv: f32,
    /// The value in units: in [2^23, 2^24).
    pub(super) units: u32,
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
pub(super) struct Block {
    pub(super) r: [u32; BLOCK],
    pub(super) exact: [f32; BLOCK],
    pub(super) margin: [f32; BLOCK],
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
    pub(super) fn new() -> Self {
        Self::default()
    }

    /// The current value (exact).
    #[inline]
    pub(super) fn value(&self) -> f32 {
        if self.on_grid {
            // units < 2^24: exact; times a power of two: exact.
            self.units as f32 * self.unit
        } else {
            self.value
        }
    }

    pub(super) fn set(&mut self, s: f32) {
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
    pub(super) fn add_exact(&mut self, v: f32) {
        let s = self.value() + v;
        self.set(s);
    }

    /// Adds one value given as an approximation `approx` (relative error at
    /// most `rel_err`) and a way to get the exact value.
    #[inline]
    pub(super) fn add_one(&mut self, approx: f32, rel_err: f32, exact: impl FnOnce() -> f32) {
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
    pub(super) fn round_block(
        &self,
        approx: &[f32; BLOCK],
        rel_err: f32,
        b: &mut Block,
    ) -> (u32, u64) {
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
    pub(super) fn add_block(
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
    pub(super) fn resolve(
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
    pub(super) fn replay(
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
    pub(super) fn add_block_until(
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
