//! What the large path's passes share, importing no sibling: whether the
//! AVX-512 paths can run, llama.cpp's walk order as integer keys, the
//! [`Cut`], the [`Gathered`] tokens, the walk's [`Target`] and the floor
//! estimate's [`Sample`].

#![forbid(unsafe_code)]

/// Whether the AVX-512 paths can run (they also count mask bits with
/// `popcnt`, which every AVX-512 CPU has).
#[cfg(target_arch = "x86_64")]
pub(super) fn has_avx512() -> bool {
    samplerd_numerics::features().avx512f_popcnt()
}

/// The order-preserving map of f32 to u32, reversed: ascending keys are
/// descending logits.
#[inline(always)]
pub(super) fn desc_key(l: f32) -> u32 {
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
pub(super) fn sort_key(l: f32, pos: u32) -> u64 {
    ((desc_key(l) as u64) << 32) | pos as u64
}

/// The logit of a [`desc_key`].
#[inline(always)]
pub(super) fn key_logit(k: u32) -> f32 {
    let ord = !k;
    f32::from_bits(if ord >> 31 == 1 {
        ord & 0x7fff_ffff
    } else {
        !ord
    })
}

/// Where the walk cut: the kept tokens are exactly those whose key
/// `(desc_key(logit) << 32) | position` is `<= last_key`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Cut {
    pub(super) kept: usize,
    pub(super) last_key: u64,
}

impl Cut {
    /// Whether the token at `pos` with logit `l` is kept.
    #[inline(always)]
    pub(super) fn keeps(&self, l: f32, pos: u32) -> bool {
        sort_key(l, pos) <= self.last_key
    }

    /// The cut's `ord_key` and position (the AVX-512 writer compares
    /// those rather than building 64-bit keys).
    #[cfg(target_arch = "x86_64")]
    pub(super) fn ord_and_pos(&self) -> (u32, u32) {
        (!((self.last_key >> 32) as u32), self.last_key as u32)
    }
}

/// Tokens gathered by the normaliser pass: positions and logits of the
/// values at or above the floor, in position order.
#[derive(Clone, Default)]
pub(super) struct Gathered {
    pub(super) idx: Vec<u32>,
    pub(super) val: Vec<f32>,
    /// Approximate probabilities `exp(l - max) / z` of the tokens, when
    /// a pass computed them (then as long as `idx`; cleared with it).
    pub(super) prob: Vec<f32>,
}

impl Gathered {
    pub(super) fn clear(&mut self) {
        self.idx.clear();
        self.val.clear();
        self.prob.clear();
    }

    #[inline]
    pub(super) fn push(&mut self, i: u32, v: f32) {
        self.idx.push(i);
        self.val.push(v);
    }

    pub(super) fn len(&self) -> usize {
        self.idx.len()
    }
}

/// What the walk looks for: llama.cpp's cut at `p` (and `min_keep`) over
/// `expf(l - max) / z`, among gathered tokens all `>= floor`.
#[derive(Clone, Copy)]
pub(super) struct Target {
    pub(super) max: f32,
    pub(super) z: f32,
    pub(super) p: f32,
    pub(super) min_keep: usize,
    pub(super) floor: f32,
}

/// The floor estimate's sample of the logits, which the ladder walk reuses
/// to place its sets.
#[derive(Clone, Default)]
pub(super) struct Sample {
    /// The sampled logits.
    pub(super) val: Vec<f32>,
    /// `exp(l - max)` of each.
    pub(super) e: Vec<f32>,
    /// The share of the logits in `val` (0 when it is not a sample of
    /// the current ones).
    pub(super) rate: f32,
    /// `Σ exp(l - max)` over `val`.
    pub(super) total: f32,
}
