//! Shared helpers of the stage tests.
#![allow(dead_code)]

mod normal;

use samplerd_core_stages::penalties::Penalties;
use samplerd_plugin_sdk::Stage;
pub use samplerd_plugin_sdk::testing::{OwnedParams, OwnedTokens, TestRng, apply, apply_once};

/// Builds `S` from `(name, value)` numeric parameters.
pub fn stage<S: Stage>(nums: &[(&str, f64)]) -> S {
    params(nums)
        .build::<S>()
        .unwrap_or_else(|e| panic!("build failed: {e}"))
}

pub fn params(nums: &[(&str, f64)]) -> OwnedParams {
    nums.iter()
        .fold(OwnedParams::new(), |p, &(n, v)| p.number(n, v))
}

/// The error message `S::new` gives for these parameters.
pub fn build_err<S: Stage>(nums: &[(&str, f64)]) -> String {
    match params(nums).build::<S>() {
        Ok(_) => panic!("expected an error for {nums:?}"),
        Err(e) => e,
    }
}

/// Applies `S` (fresh state) to `tokens` with a fixed RNG.
pub fn run<S: Stage>(nums: &[(&str, f64)], tokens: &mut OwnedTokens) {
    let mut rng = TestRng::constant(0);
    apply_once::<S>(&params(nums), tokens, &mut rng).unwrap();
}

/// `logits` in the dense view, or (`dense` false) as unsorted candidates.
pub fn tokens(logits: &[f32], dense: bool) -> OwnedTokens {
    if dense {
        OwnedTokens::dense(logits)
    } else {
        OwnedTokens::dense_as_candidates(logits)
    }
}

/// `logits` in each view: dense, then as unsorted candidates.
pub fn both_views(logits: &[f32]) -> [OwnedTokens; 2] {
    [tokens(logits, true), tokens(logits, false)]
}

/// Runs `S` (fresh state, fixed RNG) on `logits` in the dense view.
pub fn run_dense<S: Stage>(nums: &[(&str, f64)], logits: &[f32]) -> OwnedTokens {
    let mut buf = OwnedTokens::dense(logits);
    run::<S>(nums, &mut buf);
    buf
}

/// The penalties stage of `nums` and a state that has seen `window`.
pub fn penalties_after(
    nums: &[(&str, f64)],
    window: &[u32],
) -> (Penalties, <Penalties as Stage>::State) {
    let pen: Penalties = stage(nums);
    let mut st = pen.new_state();
    for &t in window {
        pen.accept(&mut st, t);
    }
    (pen, st)
}

/// Applies `pen` in state `st` to `tokens` (fixed RNG).
pub fn penalise(pen: &Penalties, st: &mut <Penalties as Stage>::State, tokens: &mut OwnedTokens) {
    apply(pen, st, tokens, &mut TestRng::constant(0)).unwrap();
}

/// `logits` as `(id, logit)` pairs, in id order.
pub fn id_pairs(logits: &[f32]) -> Vec<(u32, f32)> {
    (0u32..).zip(logits.iter().copied()).collect()
}

/// Sorts `(id, logit)` pairs by logit, descending; ties keep the lower id
/// first (the order every stage's sorted output has).
pub fn sort_desc(pairs: &mut [(u32, f32)]) {
    pairs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
}

/// Softmax (f64) of logits.
pub fn softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

/// Deterministic pseudo-normal logits (sum of uniforms), scaled by `sd`.
pub fn normal_logits(n: usize, sd: f32, seed: u64) -> Vec<f32> {
    normal::from_state(n, sd, seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
}

/// Reference nucleus: sort descending (ties lower id), f32 cumsum of f64
/// probabilities, cut at >= p with min_keep. Returns (kept ids sorted,
/// margin = |cum at cut - p| smallest over the walk).
pub fn reference_top_p(logits: &[(u32, f32)], p: f32, min_keep: usize) -> (Vec<u32>, f64) {
    let mut v: Vec<(u32, f32)> = logits.to_vec();
    sort_desc(&mut v);
    let probs = softmax(&v.iter().map(|x| x.1).collect::<Vec<_>>());
    let mut cum = 0.0f64;
    let mut last = v.len();
    let mut margin = f64::INFINITY;
    for (i, &pr) in probs.iter().enumerate() {
        cum += pr;
        margin = margin.min((cum - p as f64).abs());
        if cum >= p as f64 && i + 1 >= min_keep {
            last = i + 1;
            break;
        }
    }
    let mut ids: Vec<u32> = v[..last].iter().map(|x| x.0).collect();
    ids.sort_unstable();
    (ids, margin)
}
