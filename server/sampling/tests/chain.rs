//! Running chains through the plugin ABI with the core stages: seeds and
//! steps, stream/stateless equivalence, greedy, the post-chain distribution,
//! and property tests over random logits.

mod common;

use common::*;
use proptest::prelude::*;
use samplerd_sampling::{Chain, SamplingParams, StageRegistry, TokenBuffer};
use std::sync::OnceLock;

fn registry() -> &'static StageRegistry {
    static REG: OnceLock<StageRegistry> = OnceLock::new();
    REG.get_or_init(|| StageRegistry::load(&[], &[core_plugin()]).unwrap())
}

fn chain(p: &SamplingParams) -> Chain {
    registry().build_chain(&p.chain_spec(), None).unwrap()
}

fn logits(n: usize, seed: u64) -> Vec<f32> {
    samplerd_sampling::bench::random_logits(n, 3.0, seed)
}

/// One stateless step: fresh state, window accepted, sample at (seed, step).
fn sample_once(c: &Chain, l: &[f32], window: &[u32], seed: u64, step: u64) -> u32 {
    let mut seq = c.new_sequence().unwrap();
    seq.accept_history(window).unwrap();
    let mut buf = TokenBuffer::new();
    buf.load(l).unwrap();
    seq.sample(&mut buf, seed, step).unwrap().token_id
}

#[test]
fn same_seed_and_step_give_the_same_token() {
    let c = chain(&SamplingParams::default());
    let l = logits(5000, 1);
    let a = sample_once(&c, &l, &[1, 2, 3], 42, 7);
    for _ in 0..5 {
        assert_eq!(sample_once(&c, &l, &[1, 2, 3], 42, 7), a);
    }
}

#[test]
fn seeds_and_steps_change_the_draw() {
    // A flat distribution over 1000 tokens: different seeds must disagree
    // somewhere across 20 tries.
    let p = SamplingParams {
        top_k: 0,
        top_p: 1.0,
        repeat_penalty: 1.0,
        temperature: 1.0,
        ..Default::default()
    };
    let c = chain(&p);
    let l = vec![0.0f32; 1000];
    let by_seed: Vec<u32> = (0..20).map(|s| sample_once(&c, &l, &[], s, 0)).collect();
    assert!(by_seed.iter().any(|&t| t != by_seed[0]), "{by_seed:?}");
    let by_step: Vec<u32> = (0..20).map(|t| sample_once(&c, &l, &[], 42, t)).collect();
    assert!(by_step.iter().any(|&t| t != by_step[0]), "{by_step:?}");
}

#[test]
fn a_stream_equals_stateless_calls_with_the_same_steps() {
    let c = chain(&SamplingParams {
        repeat_penalty: 1.3,
        frequency_penalty: 0.2,
        repeat_last_n: 8,
        ..Default::default()
    });
    let initial = vec![5u32, 6, 7];
    let mut stream = c.new_sequence().unwrap();
    stream.accept_history(&initial).unwrap();
    let mut history = initial.clone();
    let mut buf = TokenBuffer::new();
    for step in 0..30u64 {
        // Peaked logits so the window matters: the same few tokens win.
        let mut l = logits(300, 100 + step);
        for v in &mut l[..10] {
            *v += 8.0;
        }
        buf.load(&l).unwrap();
        let streamed = stream.sample(&mut buf, 9, step).unwrap().token_id;
        stream.accept(streamed).unwrap();
        let stateless = sample_once(&c, &l, &history, 9, step);
        assert_eq!(streamed, stateless, "step {step}");
        history.push(streamed);
    }
}

#[test]
fn greedy_ignores_the_seed_but_pays_the_penalty() {
    let c = chain(&SamplingParams {
        temperature: 0.0,
        ..Default::default()
    });
    assert_eq!(c.stage_names(), ["penalties", "greedy"]);
    // "the" (0) leads "cat" (1) until it is in the window (SAMPLING.md, penalties).
    let l = [8.5f32, 7.9, 4.0, -2.0];
    for seed in 0..10 {
        assert_eq!(sample_once(&c, &l, &[], seed, seed), 0);
        assert_eq!(sample_once(&c, &l, &[0, 0, 0], seed, seed), 1);
    }
}

#[test]
fn window_ids_outside_the_vocabulary_are_skipped() {
    let c = chain(&SamplingParams {
        temperature: 0.0,
        ..Default::default()
    });
    assert_eq!(sample_once(&c, &[1.0, 2.0], &[7, 1_000_000], 1, 0), 1);
}

#[test]
fn sequences_clone_and_reset() {
    let c = chain(&SamplingParams {
        temperature: 0.0,
        ..Default::default()
    });
    let l = [8.5f32, 7.9, 4.0];
    let mut seq = c.new_sequence().unwrap();
    seq.accept_history(&[0, 0, 0]).unwrap();
    let mut fork = seq.try_clone().unwrap();
    let mut buf = TokenBuffer::new();
    buf.load(&l).unwrap();
    assert_eq!(fork.sample(&mut buf, 0, 0).unwrap().token_id, 1);
    seq.reset().unwrap();
    buf.load(&l).unwrap();
    assert_eq!(seq.sample(&mut buf, 0, 0).unwrap().token_id, 0);
}

#[test]
fn bad_logits_are_errors_not_panics() {
    let mut buf = TokenBuffer::new();
    assert!(buf.load(&[]).is_err());
    assert!(buf.load(&[1.0, f32::NAN]).is_err());
    assert!(buf.load(&[f32::INFINITY]).is_err());
    assert!(buf.load_f32le(&[0, 0, 0]).is_err());
    let mut small = TokenBuffer::with_limit(4);
    assert!(small.load(&[0.0; 5]).is_err());
    // A buffer that never loaded anything cannot be sampled.
    let c = chain(&SamplingParams::default());
    let mut seq = c.new_sequence().unwrap();
    assert!(seq.sample(&mut TokenBuffer::new(), 1, 0).is_err());
}

fn arb_params() -> impl Strategy<Value = SamplingParams> {
    (
        0.0f32..2.0,
        0i32..60,
        0.05f32..=1.0,
        prop_oneof![Just(0.0f32), 0.0f32..0.3],
        prop_oneof![Just(1.0f32), 0.2f32..=1.0],
        0.5f32..2.0,
        0.0f32..1.0,
        0.0f32..1.0,
    )
        .prop_map(
            |(temperature, top_k, top_p, min_p, typical_p, repeat_penalty, f, pres)| {
                SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    typical_p,
                    repeat_penalty,
                    frequency_penalty: f,
                    presence_penalty: pres,
                    ..Default::default()
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn chosen_token_survives_and_probabilities_sum_to_one(
        p in arb_params(),
        vocab in 2usize..3000,
        seed in any::<u64>(),
        step in 0u64..1000,
        window in proptest::collection::vec(0u32..3000, 0..80),
        masked in 0usize..4,
    ) {
        let c = chain(&p);
        let mut l = logits(vocab, seed ^ 0x5eed);
        for i in 0..masked.min(vocab - 1) {
            l[i * 7 % vocab] = f32::NEG_INFINITY;
        }
        let mut seq = c.new_sequence().unwrap();
        seq.accept_history(&window).unwrap();
        let mut buf = TokenBuffer::new();
        buf.load(&l).unwrap();
        let tok = seq.sample(&mut buf, seed, step).unwrap().token_id;
        let survivors: Vec<(u32, f32)> = buf.survivors().collect();
        prop_assert!(survivors.iter().any(|&(id, _)| id == tok));
        prop_assert!(survivors.len() <= vocab);
        let (dist, p_tok) = buf.distribution(usize::MAX, tok);
        let total: f64 = dist.iter().map(|&(_, p)| p as f64).sum();
        prop_assert!((total - 1.0).abs() < 1e-6, "sum {}", total);
        prop_assert!(p_tok > 0.0);
        // Same inputs, same token.
        let mut again = c.new_sequence().unwrap();
        again.accept_history(&window).unwrap();
        buf.load(&l).unwrap();
        prop_assert_eq!(again.sample(&mut buf, seed, step).unwrap().token_id, tok);
    }

    #[test]
    fn greedy_picks_the_max_whatever_the_seed(vocab in 2usize..5000, seed in any::<u64>()) {
        let c = chain(&SamplingParams { temperature: 0.0, repeat_penalty: 1.0, ..Default::default() });
        let l = logits(vocab, seed);
        let best = l.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
        prop_assert_eq!(sample_once(&c, &l, &[], seed, 0), best);
        prop_assert_eq!(sample_once(&c, &l, &[], seed.wrapping_add(1), 5), best);
    }
}
