//! Stage set-up shared by the benchmarks.
#![allow(dead_code)]

use samplerd_core_stages::{
    dist::Dist, dry::Dry, greedy::Greedy, logit_bias::LogitBias, min_p::MinP, penalties::Penalties,
    temperature::Temperature, top_k::TopK, top_n_sigma::TopNSigma, top_p::TopP,
    typical_p::TypicalP, xtc::Xtc,
};
use samplerd_plugin_sdk::Stage;
use samplerd_plugin_sdk::testing::{OwnedParams, OwnedTokens, TestRng};

#[path = "../../tests/common/normal.rs"]
mod normal;

pub const N: usize = 151_936;

/// N(0, 3) logits, the same on every run.
pub fn logits() -> Vec<f32> {
    normal::from_state(N, 3.0, 0x1234_5678_9abc_def1)
}

pub fn p(nums: &[(&str, f64)]) -> OwnedParams {
    nums.iter()
        .fold(OwnedParams::new(), |p, &(n, v)| p.number(n, v))
}

/// A type-erased built stage with its state.
pub trait Dyn {
    fn run(&mut self, buf: &mut OwnedTokens, rng: &mut TestRng);
}

struct Built<S: Stage> {
    stage: S,
    state: S::State,
}

impl<S: Stage> Dyn for Built<S> {
    fn run(&mut self, buf: &mut OwnedTokens, rng: &mut TestRng) {
        self.stage
            .apply(&mut self.state, &mut buf.tokens(), &mut rng.host())
            .unwrap();
    }
}

pub fn build<S: Stage>(params: OwnedParams, window: &[u32]) -> Box<dyn Dyn> {
    let stage = params.build::<S>().unwrap();
    let mut state = stage.new_state();
    for &t in window {
        stage.accept(&mut state, t);
    }
    Box::new(Built { stage, state })
}

/// A text-like history of `n` tokens for DRY: ids from a 2,000-token
/// alphabet, with every 64-token block followed by a copy of itself, so
/// long repeats exist.
pub fn repetitive_history(n: usize) -> Vec<u32> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let block: Vec<u32> = (0..64)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2000) as u32
            })
            .collect();
        out.extend(&block);
        out.extend(&block);
    }
    out.truncate(n);
    out
}

fn dry(window: &[u32]) -> Box<dyn Dyn> {
    build::<Dry>(
        p(&[("multiplier", 0.8)]).strings("sequence_breakers", &[""]),
        window,
    )
}

/// (name, chain) pairs measured by both benchmarks.
pub fn cases(logits: &[f32]) -> Vec<(&'static str, Vec<Box<dyn Dyn>>)> {
    let _ = logits;
    let window: Vec<u32> = (0..64u32).map(|i| (i * 2371) % N as u32).collect();
    let w = &window;
    vec![
        (
            "stage/logit_bias_10",
            vec![build::<LogitBias>(
                OwnedParams::new().token_map(
                    "bias",
                    &(0..10).map(|i| (i * 997, -1.0)).collect::<Vec<_>>(),
                ),
                &[],
            )],
        ),
        ("stage/penalties_64", vec![build::<Penalties>(p(&[]), w)]),
        (
            "stage/dry_window_4096",
            vec![dry(&repetitive_history(4096))],
        ),
        (
            "stage/dry_window_65536",
            vec![dry(&repetitive_history(65536))],
        ),
        ("stage/top_k_40", vec![build::<TopK>(p(&[]), &[])]),
        ("stage/top_p_0.95_dense", vec![build::<TopP>(p(&[]), &[])]),
        ("stage/min_p_0.05_dense", vec![build::<MinP>(p(&[]), &[])]),
        (
            "stage/temperature_0.8_dense",
            vec![build::<Temperature>(p(&[]), &[])],
        ),
        (
            "stage/top_n_sigma_1_dense",
            vec![build::<TopNSigma>(p(&[("n", 1.0)]), &[])],
        ),
        (
            "stage/typical_0.9_after_top_k",
            vec![
                build::<TopK>(p(&[]), &[]),
                build::<TypicalP>(p(&[("p", 0.9)]), &[]),
            ],
        ),
        ("stage/greedy_dense", vec![build::<Greedy>(p(&[]), &[])]),
        ("stage/dist_dense", vec![build::<Dist>(p(&[]), &[])]),
        (
            "chain/default",
            vec![
                build::<LogitBias>(OwnedParams::new(), &[]),
                build::<Penalties>(p(&[]), w),
                build::<TopNSigma>(p(&[]), &[]),
                build::<TopK>(p(&[]), &[]),
                build::<TypicalP>(p(&[]), &[]),
                build::<TopP>(p(&[]), &[]),
                build::<MinP>(p(&[]), &[]),
                build::<Xtc>(p(&[]), &[]),
                build::<Temperature>(p(&[]), &[]),
                build::<Dist>(p(&[]), &[]),
            ],
        ),
        (
            "chain/greedy_penalties",
            vec![build::<Penalties>(p(&[]), w), build::<Greedy>(p(&[]), &[])],
        ),
        (
            "chain/top_k_off_top_p_dist",
            vec![
                build::<Penalties>(p(&[]), w),
                build::<TopP>(p(&[]), &[]),
                build::<MinP>(p(&[]), &[]),
                build::<Temperature>(p(&[]), &[]),
                build::<Dist>(p(&[]), &[]),
            ],
        ),
    ]
}

/// Runs a chain once on freshly reloaded logits.
pub fn run_chain(
    chain: &mut [Box<dyn Dyn>],
    buf: &mut OwnedTokens,
    logits: &[f32],
    rng: &mut TestRng,
) -> Option<u32> {
    buf.reload(logits);
    for s in chain.iter_mut() {
        s.run(buf, rng);
    }
    buf.selected()
}
