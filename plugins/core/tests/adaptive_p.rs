//! `adaptive_p` against a transcription of llama.cpp's adaptive-p
//! (`llama_sampler_adaptive_p_apply` / `_accept` and the initial state of
//! `llama_sampler_init_adaptive_p`, src/llama-sampling.cpp), computed in
//! f64: over many steps with the same uniforms, the same tokens are drawn
//! and the running average follows the same EMA.

mod common;

use common::*;
use proptest::prelude::*;
use samplerd_core_stages::adaptive_p::AdaptiveP;
use samplerd_plugin_sdk::Stage;

/// llama.cpp's sampler, written out: state (weighted_sum, total_weight).
struct Reference {
    target: f64,
    decay: f64,
    weighted_sum: f64,
    total_weight: f64,
}

impl Reference {
    fn new(target: f64, decay: f64) -> Self {
        let decay = decay.clamp(0.0, 0.99);
        Reference {
            target,
            decay,
            weighted_sum: target / (1.0 - decay),
            total_weight: 1.0 / (1.0 - decay),
        }
    }

    fn softmax(logits: &[f64]) -> Vec<f64> {
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = logits.iter().map(|&l| (l - max).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    /// One step's draw for uniform `u`: the index, how far `u` is from
    /// the nearest cumulative boundary (f32 and f64 sums may disagree
    /// closer than that), and the original probabilities.
    fn choose(&self, logits: &[f64], u: f64) -> (usize, f64, Vec<f64>) {
        let p = Self::softmax(logits);
        let drawn = if self.target < 0.0 {
            p.clone()
        } else {
            let t = self.target.clamp(0.0, 1.0);
            let adapted = (2.0 * t - self.weighted_sum / self.total_weight).clamp(0.0, 1.0);
            let shaped: Vec<f64> = p
                .iter()
                .zip(logits)
                .map(|(&pi, &l)| {
                    if l == f64::NEG_INFINITY {
                        f64::NEG_INFINITY
                    } else {
                        let d = ((pi - adapted) / 0.3).abs();
                        5.0 - 10.0 * d * d / (1.0 + d)
                    }
                })
                .collect();
            Self::softmax(&shaped)
        };
        let mut run = 0.0;
        let margin = drawn
            .iter()
            .map(|&x| {
                run += x;
                (run - u).abs()
            })
            .fold(f64::INFINITY, f64::min);
        (walk(&drawn, u), margin, p)
    }

    /// The accepted token had original probability `p`.
    fn update(&mut self, p: f64) {
        if self.target >= 0.0 {
            self.weighted_sum = p + self.decay * self.weighted_sum;
            self.total_weight = 1.0 + self.decay * self.total_weight;
        }
    }

    fn average(&self) -> f64 {
        self.weighted_sum / self.total_weight
    }
}

fn walk(p: &[f64], u: f64) -> usize {
    let mut run = 0.0;
    let mut last = 0;
    for (i, &x) in p.iter().enumerate() {
        if x > 0.0 {
            run += x;
            last = i;
            if run >= u {
                return i;
            }
        }
    }
    last
}

fn build(target: f64, decay: f64) -> AdaptiveP {
    OwnedParams::new()
        .number("target", target)
        .number("decay", decay)
        .build::<AdaptiveP>()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Each step draws the reference's token (unless the uniform lies
    /// within 1e-6 of a cumulative boundary, where f32 and f64 sums may
    /// round apart: then both follow the stage's draw) and the running
    /// average stays the reference's.
    #[test]
    fn draws_and_average_follow_llama_cpp(
        target in prop_oneof![Just(-1.0f64), 0.05f64..0.95],
        decay in 0.0f64..1.2,
        rows in proptest::collection::vec(
            (proptest::collection::vec(-6.0f64..6.0, 8), 0.0f64..1.0, any::<bool>()),
            1..24,
        ),
    ) {
        let stage = build(target, decay);
        let mut st = stage.new_state();
        let mut reference = Reference::new(target, decay);
        for (logits, u, dense) in rows {
            let f: Vec<f32> = logits.iter().map(|&l| l as f32).collect();
            let (want, margin, p) = reference.choose(&logits, u);
            let mut t = tokens(&f, dense);
            apply(&stage, &mut st, &mut t, &mut TestRng::uniform(u)).unwrap();
            // Both views list id i at position i.
            let got = t.selected().unwrap();
            if margin > 1e-6 {
                prop_assert_eq!(got as usize, want, "u {} logits {:?}", u, logits);
            }
            stage.accept(&mut st, got);
            reference.update(p[got as usize]);
            prop_assert!(
                (st.average() as f64 - reference.average()).abs() < 1e-4,
                "{} vs {}", st.average(), reference.average()
            );
        }
    }
}

#[test]
fn defaults_are_llama_cpps_and_off_is_a_plain_draw() {
    let stage = OwnedParams::new().build::<AdaptiveP>().unwrap();
    let st = stage.new_state();
    // target -1 (off), decay 0.9: the average starts at the target.
    assert_eq!(st.average(), -1.0);
    assert_eq!(
        OwnedParams::new()
            .number("target", 1.5)
            .build::<AdaptiveP>()
            .err()
            .unwrap(),
        "adaptive_p: target must be finite and <= 1, got 1.5"
    );
}

#[test]
fn a_token_other_than_the_drawn_one_leaves_the_average_alone() {
    let stage = build(0.3, 0.5);
    let mut st = stage.new_state();
    let before = st.average();
    let mut t = tokens(&[1.0, 2.0, 3.0], true);
    apply(&stage, &mut st, &mut t, &mut TestRng::uniform(0.5)).unwrap();
    let drawn = t.selected().unwrap();
    stage.accept(&mut st, (drawn + 1) % 3);
    assert_eq!(st.average(), before);
}
