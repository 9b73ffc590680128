//! `top_p` (nucleus): keeps the shortest prefix of the candidates sorted by
//! descending probability whose cumulative probability is >= p, and at
//! least `min_keep` (llama.cpp `top-p`). Survivors keep their raw logits;
//! probabilities are only computed internally. p >= 1: no-op.
//!
//! The arithmetic is llama.cpp's, since the f32 rounding of its sums
//! decides the cut: softmax in the list's current order (libm `expf`, f32
//! running sum Z), then in descending order an f32 running sum of `e / Z`,
//! cut at the first `cum >= p` with at least `min_keep` kept. Output sorted.
//!
//! Small candidate lists (<= 4096, e.g. after top_k) or sorted ones: Z,
//! sort if needed, walk.
//!
//! Dense view or large lists (top_k off): no sort of the vocabulary. One
//! scalar pass gives `expf(l - max)` and Z. A floor under the cut is
//! estimated from every 16th token (a 2,048-bucket histogram, one octave of
//! margin) and checked with a vectorised masked sum (the mass at or above it
//! must reach p·Z with 0.1% to spare; otherwise the floor is lowered). Only
//! the tokens at or above the floor are gathered, sorted and walked; if the
//! walk does not reach p inside them, every token is.

use std::ffi::CStr;

use samplerd_plugin_sdk::prelude::*;

use crate::util;

/// Candidate lists up to this size use the sort-then-cut path.
pub const SMALL_PATH: usize = 4096;
const NBUCKETS: usize = 2048;
const SHIFT: u32 = 19;

pub struct TopP {
    p: f32,
    min_keep: usize,
}

#[derive(Clone, Default)]
pub struct TopPState {
    probs: Vec<f32>,
    vals: Vec<f32>,
    sums: Vec<f64>,
    idx: Vec<u32>,
    keys: Vec<u64>,
    out: Vec<SdCandidate>,
}

#[inline(always)]
fn bucket(e: f32) -> usize {
    (e.to_bits() >> SHIFT) as usize
}

impl TopP {
    fn small(&self, st: &mut TopPState, tokens: &mut Tokens<'_>) {
        // llama.cpp: softmax in the list's current order (max, libm expf,
        // f32 running sum), then sort, then an f32 running sum of the f32
        // probabilities.
        let max = util::max_logit(tokens);
        if max == f32::NEG_INFINITY {
            return; // nothing finite left
        }
        let mut z = 0.0f32;
        for c in tokens.candidates() {
            z += (c.logit - max).exp();
        }
        util::sort_candidates(tokens);
        let mut cum = 0.0f32;
        let mut last = tokens.len();
        for (i, c) in tokens.candidates().iter().enumerate() {
            cum += (c.logit - max).exp() / z;
            if cum >= self.p && i + 1 >= self.min_keep {
                last = i + 1;
                break;
            }
        }
        st.probs.clear();
        tokens.truncate(last);
    }

    fn large(&self, st: &mut TopPState, tokens: &mut Tokens<'_>) {
        let dense = tokens.view() == ViewKind::Dense;
        let mut vals = std::mem::take(&mut st.vals);
        if !dense {
            vals.clear();
            vals.extend(tokens.candidates().iter().map(|c| c.logit));
        }
        let x: &[f32] = if dense { tokens.dense() } else { &vals };
        let n = x.len();
        let max = util::max_scan(x);
        if max == f32::NEG_INFINITY {
            st.vals = vals;
            return;
        }
        // llama.cpp's softmax: libm expf and an f32 running sum in list
        // order (not vectorisable: the rounding of that sum decides the cut).
        let e = &mut st.probs;
        e.resize(n, 0.0);
        let mut z = 0.0f32;
        for (o, &v) in e.iter_mut().zip(x) {
            let ev = (v - max).exp();
            *o = ev;
            z += ev;
        }
        let target = self.p as f64 * z as f64;

        // A floor under the cut: estimated from every 16th token, one
        // octave of margin, then checked (the mass at or above it must
        // reach p, with 0.1% to spare for the f32 walk); else lowered, down
        // to 0 (= every token).
        let sums = &mut st.sums;
        sums.clear();
        sums.resize(NBUCKETS, 0.0);
        let hist: &mut [f64; NBUCKETS] = sums.as_mut_slice().try_into().expect("buckets");
        let mut zs = 0.0f64;
        for &v in e.iter().step_by(16) {
            hist[bucket(v) & (NBUCKETS - 1)] += v as f64;
            zs += v as f64;
        }
        let mut fb = 0usize;
        let mut cum = 0.0f64;
        for k in (0..NBUCKETS).rev() {
            cum += hist[k];
            if cum >= self.p as f64 * zs {
                fb = k.saturating_sub(16);
                break;
            }
        }
        let mut floor = f32::from_bits((fb as u32) << SHIFT);
        while floor > 0.0 && util::sum_at_least(e, floor) < target * (1.0 + 1e-3) {
            floor = if floor > 1e-30 {
                floor * (1.0 / 65536.0)
            } else {
                0.0
            };
        }
        let cands = (!dense).then(|| tokens.candidates());
        // Sort keys: the logit mapped to an order-preserving u32 (high
        // half), then the position (ties: lower position first), sorted
        // descending as plain integers.
        let key = |i: usize| -> u64 {
            let b = x[i].to_bits();
            let ord = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
            ((ord as u64) << 32) | (u32::MAX - i as u32) as u64
        };
        let pos = |k: u64| (u32::MAX - k as u32) as usize;
        let last = loop {
            util::indices_at_least(e, floor, &mut st.idx);
            let keys = &mut st.keys;
            keys.clear();
            keys.extend(st.idx.iter().map(|&i| key(i as usize)));
            keys.sort_unstable_by(|a, b| b.cmp(a));
            // llama.cpp's walk: f32 running sum of the f32 probabilities
            let mut cum = 0.0f32;
            let mut found = None;
            for (i, &k) in keys.iter().enumerate() {
                cum += e[pos(k)] / z;
                if cum >= self.p && i + 1 >= self.min_keep {
                    found = Some(i + 1);
                    break;
                }
            }
            match found {
                Some(k) => break k,
                None if floor == 0.0 => break keys.len(),
                None => floor = 0.0,
            }
        };
        if st.out.len() < last {
            st.out.resize(last, SdCandidate { id: 0, logit: 0.0 });
        }
        let out = &mut st.out[..last];
        for (o, &k) in out.iter_mut().zip(&st.keys[..last]) {
            let i = pos(k);
            *o = match cands {
                Some(c) => c[i],
                None => SdCandidate {
                    id: i as u32,
                    logit: x[i],
                },
            };
        }
        st.vals = vals;
        let (_, cand) = tokens.dense_and_buffer();
        cand[..last].copy_from_slice(out);
        tokens.set_candidates(last, true);
    }
}

impl Stage for TopP {
    const NAME: &'static CStr = c"top_p";
    const DESCRIPTION: &'static CStr =
        c"nucleus: keeps the smallest top set whose probability sums to >= p (p = 1: off)";
    const PARAMS: &'static [SdParamSpec] = &[
        number_param(
            c"p",
            c"cumulative probability to keep, in (0, 1]; 1 = off",
            0.95,
        ),
        number_param(c"min_keep", c"keep at least this many candidates", 1.0),
    ];
    const FLAGS: u32 = SD_STAGE_DENSE_OK;
    type State = TopPState;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        let p = util::number_in(params, "top_p", "p", "in (0, 1]", |v| v > 0.0 && v <= 1.0)?;
        let min_keep = util::min_keep(params, "top_p")?;
        Ok(TopP {
            p: p as f32,
            min_keep,
        })
    }

    fn new_state(&self) -> TopPState {
        TopPState::default()
    }

    fn apply(
        &self,
        st: &mut TopPState,
        tokens: &mut Tokens<'_>,
        _rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        if self.p >= 1.0 || tokens.is_empty() {
            return Ok(());
        }
        if tokens.view() == ViewKind::Candidates
            && (tokens.len() <= SMALL_PATH || tokens.is_sorted())
        {
            self.small(st, tokens);
        } else {
            self.large(st, tokens);
        }
        Ok(())
    }
}
