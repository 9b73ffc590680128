//! `typical_p` (locally typical sampling, llama.cpp `typical`): sorts the
//! candidates by |-ln p - H| (H the entropy), keeps the shortest prefix of
//! that order whose probability sum is > p, and at least `min_keep`.
//! p >= 1: no-op. Output is in typicality order (`sorted = 0`). Softmax of
//! the whole candidate list plus two sorts: O(n log n); the dense view is
//! converted to candidates first. The softmax and entropy are llama.cpp's
//! f32 arithmetic; a zero probability makes the entropy NaN there, and the
//! resulting order (libstdc++'s `std::sort` on all-equal keys) is
//! reproduced, see [`libstdcxx_sort_all_equal`].

#![forbid(unsafe_code)]

use std::ffi::CStr;

use samplerd_plugin_sdk::defaults;
use samplerd_plugin_sdk::prelude::*;

use crate::util;

pub struct TypicalP {
    p: f32,
    min_keep: usize,
}

#[derive(Clone, Default)]
pub struct TypicalState {
    probs: Vec<f32>,
    scores: Vec<f32>,
    order: Vec<u32>,
    out: Vec<SdCandidate>,
}

impl Stage for TypicalP {
    const NAME: &'static CStr = c"typical_p";
    const DESCRIPTION: &'static CStr =
        c"locally typical sampling: keeps the most typical tokens up to mass p (p = 1: off)";
    const PARAMS: &'static [SdParamSpec] = &[
        number_param(
            c"p",
            c"typical mass to keep, in [0, 1]; 1 = off",
            defaults::TYPICAL_P,
        ),
        number_param(c"min_keep", c"keep at least this many candidates", 1.0),
    ];
    const FLAGS: u32 = SD_STAGE_DENSE_OK;
    type State = TypicalState;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        let p = util::unit_interval(params, "typical_p", "p")?;
        let min_keep = util::min_keep(params, "typical_p")?;
        Ok(TypicalP {
            p: p as f32,
            min_keep,
        })
    }

    fn new_state(&self) -> TypicalState {
        TypicalState::default()
    }

    fn apply(
        &self,
        st: &mut TypicalState,
        tokens: &mut Tokens<'_>,
        _rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        if self.p >= 1.0 || tokens.is_empty() {
            return Ok(());
        }
        util::to_candidates(tokens);
        util::sort_candidates(tokens);
        // llama.cpp's softmax, bit for bit: libm expf, f32 running sum in
        // the sorted order, f32 division.
        let cands = tokens.candidates();
        let max = cands[0].logit;
        if max == f32::NEG_INFINITY {
            return Ok(());
        }
        st.probs.clear();
        let mut sum = 0.0f32;
        for c in cands {
            let e = (c.logit - max).exp();
            st.probs.push(e);
            sum += e;
        }
        for p in st.probs.iter_mut() {
            *p /= sum;
        }
        // f32 entropy as llama.cpp. A zero probability (a -inf candidate,
        // or an expf underflow) makes it NaN there, and with it every
        // score: the sort then sees all indices as equal.
        let mut entropy = 0.0f32;
        for &p in &st.probs {
            entropy += -p * p.ln();
        }
        st.order.clear();
        st.order.extend(0..st.probs.len() as u32);
        if entropy.is_nan() {
            libstdcxx_sort_all_equal(&mut st.order);
        } else {
            st.scores.clear();
            st.scores
                .extend(st.probs.iter().map(|&p| (-p.ln() - entropy).abs()));
            let scores = &st.scores;
            st.order.sort_unstable_by(|&a, &b| {
                scores[a as usize]
                    .total_cmp(&scores[b as usize])
                    .then(a.cmp(&b))
            });
        }
        let mut cum = 0.0f32;
        let mut last = st.order.len();
        for (i, &idx) in st.order.iter().enumerate() {
            cum += st.probs[idx as usize];
            if cum > self.p && (self.min_keep == 0 || i + 1 >= self.min_keep) {
                last = i + 1;
                break;
            }
        }
        let cands = tokens.candidates_mut();
        st.out.clear();
        st.out
            .extend(st.order[..last].iter().map(|&i| cands[i as usize]));
        cands[..last].copy_from_slice(&st.out);
        tokens.set_candidates(last, false);
        Ok(())
    }
}

/// The permutation libstdc++'s `std::sort` (introsort, then insertion
/// sort) applies to a range whose elements all compare equal, which is
/// what llama.cpp's typical sampler sorts when its entropy is NaN. The
/// final insertion sort moves nothing; each partition step swaps the first
/// element with the middle one (median of three) and then swaps pairs from
/// both ends inwards. The heap-sort fallback (depth limit 2·log2 n) is never
/// reached: every partition halves the range.
pub fn libstdcxx_sort_all_equal(v: &mut [u32]) {
    fn introsort_loop(v: &mut [u32], first: usize, mut last: usize) {
        while last - first > 16 {
            let mid = first + (last - first) / 2;
            v.swap(first, mid);
            let mut lo = first + 1;
            let mut hi = last;
            loop {
                hi -= 1;
                if lo >= hi {
                    break;
                }
                v.swap(lo, hi);
                lo += 1;
            }
            introsort_loop(v, lo, last);
            last = lo;
        }
    }
    let n = v.len();
    if n > 1 {
        introsort_loop(v, 0, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_equal_sort_permutation_matches_libstdcxx() {
        // Up to 16 elements std::sort is a plain insertion sort: no move.
        let mut v: Vec<u32> = (0..16).collect();
        libstdcxx_sort_all_equal(&mut v);
        assert_eq!(v, (0..16).collect::<Vec<_>>());
        // 17: swap(0, 8), then [1, 17) reversed pairwise around the middle.
        let mut v: Vec<u32> = (0..17).collect();
        libstdcxx_sort_all_equal(&mut v);
        assert_eq!(
            v,
            [8, 16, 15, 14, 13, 12, 11, 10, 9, 0, 7, 6, 5, 4, 3, 2, 1]
        );
    }
}
