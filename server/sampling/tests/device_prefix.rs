//! The device/host split of a sampler chain, checked on the CPU: the device
//! prefix (its CPU twin, `device_prefix::reference`) followed by the host
//! remainder over the survivors must choose the same token — and leave the
//! same post-chain distribution — as the whole chain on the host, for the
//! same logits, seed and step. The GPU tests compare the CUDA kernels with
//! the same reference.

mod common;

use common::*;
use samplerd_sampling::device_prefix::{self, Survivors};
use samplerd_sampling::{
    ChainSpec, SampleError, SamplingParams, StageRegistry, StageSpec, TokenBuffer,
};
use std::sync::OnceLock;

fn registry() -> &'static StageRegistry {
    static REG: OnceLock<StageRegistry> = OnceLock::new();
    REG.get_or_init(|| StageRegistry::load(&[], &[core_plugin()]).unwrap())
}

/// A small deterministic generator (the test must not depend on `rand`'s
/// stream stability).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 11
    }
    fn unit(&mut self) -> f64 {
        self.next() as f64 / (1u64 << 53) as f64
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Logits with the hard cases: coarse values (many ties), signed zeros,
/// -inf entries.
fn logits(n: usize, rng: &mut Lcg, coarse: bool) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let r = rng.unit();
            if r < 0.002 {
                // Huge logits: the stages saturate instead of overflowing.
                if rng.below(2) == 0 { 3e38 } else { -3e38 }
            } else if r < 0.01 {
                f32::NEG_INFINITY
            } else if r < 0.02 {
                if rng.below(2) == 0 { 0.0 } else { -0.0 }
            } else {
                let v = (rng.unit() * 2.0 - 1.0) * 8.0;
                if coarse {
                    ((v * 2.0).round() / 2.0) as f32
                } else {
                    v as f32
                }
            }
        })
        .collect()
}

fn param_cases(rng: &mut Lcg, n_vocab: usize) -> SamplingParams {
    let pick = |rng: &mut Lcg, xs: &[f32]| xs[rng.below(xs.len() as u64) as usize];
    let mut p = SamplingParams {
        temperature: pick(rng, &[0.0, 0.5, 0.8, 1.0, 1.5]),
        top_k: pick(rng, &[0.0, 1.0, 5.0, 40.0, 256.0, 300.0]) as i32,
        top_p: pick(rng, &[1.0, 0.95, 0.5]),
        min_p: pick(rng, &[0.0, 0.05]),
        typical_p: pick(rng, &[1.0, 1.0, 0.9]),
        repeat_penalty: pick(rng, &[1.0, 1.1, 1.3]),
        frequency_penalty: pick(rng, &[0.0, 0.2]),
        presence_penalty: pick(rng, &[0.0, 0.5]),
        repeat_last_n: pick(rng, &[0.0, 8.0, 64.0, -1.0]) as i32,
        xtc_probability: pick(rng, &[0.0, 0.0, 0.5]),
        ..Default::default()
    };
    if rng.below(3) == 0 {
        p.logit_bias = (0..rng.below(6))
            .map(|_| {
                let id = rng.below(n_vocab as u64 + 5) as u32; // some out of range
                let b = pick(rng, &[-1.5, 2.0, f32::NEG_INFINITY, 0.25]);
                (id, b)
            })
            .collect();
    }
    if rng.below(4) == 0 {
        // A custom order: llama.cpp's --samplers with the temperature first.
        p.order = ["temperature", "logit_bias", "penalties", "top_k", "top_p"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    }
    p
}

/// Runs one case both ways; returns whether the device prefix was used.
fn check_case(spec: &ChainSpec, l: &[f32], window: &[u32], seed: u64, step: u64) -> bool {
    let reg = registry();
    let chain = reg.build_chain(spec, None).unwrap();
    // The whole chain on the host.
    let mut full = chain.new_sequence().unwrap();
    full.accept_history(window).unwrap();
    let mut buf = TokenBuffer::new();
    let want = buf
        .load(l)
        .map_err(SampleError::from)
        .and_then(|()| full.sample(&mut buf, seed, step));
    // Device prefix (CPU twin) + host remainder.
    let mut split = device_prefix::SplitSequence::new(reg, &chain, l.len()).unwrap();
    for &t in window {
        split.accept(t).unwrap();
    }
    let plan = split.plan().clone();
    let mut survivors = Vec::new();
    let got = if plan.device.is_empty() {
        split.finish(Survivors::Fallback, || l, seed, step)
    } else {
        let fallback =
            device_prefix::reference::run(&plan.device, split.window(), l, &mut survivors);
        let s = if fallback {
            Survivors::Fallback
        } else {
            Survivors::Candidates(&survivors)
        };
        split.finish(s, || l, seed, step)
    };
    match (&want, &got) {
        (Ok(w), Ok(g)) => {
            assert_eq!(w, g, "{spec}: seed {seed} step {step}");
            assert_eq!(
                buf.distribution(8, w.token_id),
                split.buffer().distribution(8, g.token_id),
                "{spec}: post-chain distribution"
            );
        }
        // The same error, word for word (the fallback runs the same chain).
        (Err(w), Err(g)) => assert_eq!(w.to_string(), g.to_string(), "{spec}"),
        _ => panic!("{spec}: host {want:?} vs split {got:?}"),
    }
    if !plan.device.is_empty() {
        assert!(survivors.len() <= plan.max_survivors());
    }
    !plan.device.is_empty()
}

#[test]
fn split_chain_chooses_the_cpu_chains_token() {
    let mut rng = Lcg(0x5eed);
    let (mut cases, mut on_device) = (0, 0);
    for case in 0..400 {
        let n = if case % 40 == 0 { 151_936 } else { 2_000 };
        let p = param_cases(&mut rng, n);
        let spec = p.chain_spec();
        let l = logits(n, &mut rng, case % 2 == 0);
        let window: Vec<u32> = (0..rng.below(100))
            .map(|_| rng.below(n as u64 / 10) as u32)
            .collect();
        let seed = rng.next();
        let step = rng.below(1000);
        cases += 1;
        on_device += check_case(&spec, &l, &window, seed, step) as usize;
    }
    // The mix must exercise the device path most of the time.
    assert!(
        on_device * 2 > cases,
        "{on_device} of {cases} used the device prefix"
    );
}

#[test]
fn hand_built_chains_with_host_tails_and_plugins_in_the_remainder() {
    let mut rng = Lcg(7);
    let specs = [
        ChainSpec {
            stages: vec![
                StageSpec::new("top_k").number("k", 3.0),
                StageSpec::new("penalties").number("repeat_penalty", 1.5),
                StageSpec::new("temperature").number("t", 0.0),
                StageSpec::new("dist"),
            ],
        },
        ChainSpec {
            stages: vec![
                StageSpec::new("temperature").number("t", 2.0),
                StageSpec::new("top_k").number("k", 1.0),
                StageSpec::new("dist"),
            ],
        },
        ChainSpec {
            stages: vec![
                StageSpec::new("temperature").number("t", 0.0),
                StageSpec::new("dist"),
            ],
        },
        ChainSpec {
            stages: vec![StageSpec::new("greedy")],
        },
    ];
    for spec in &specs {
        for _ in 0..20 {
            let l = logits(5_000, &mut rng, true);
            assert!(check_case(spec, &l, &[1, 2, 2, 3], rng.next(), 3));
        }
    }
}

#[test]
fn bad_and_masked_logits_fall_back_to_the_host_for_the_exact_outcome() {
    let spec = SamplingParams::default().chain_spec();
    let mut l = vec![0.5f32; 1000];
    l[17] = f32::NAN;
    check_case(&spec, &l, &[], 1, 0);
    let masked = vec![f32::NEG_INFINITY; 1000];
    check_case(&spec, &masked, &[], 1, 0);
    // Everything banned by the bias before greedy: the CPU fails; so must
    // the split (through the fallback), not pick a -inf token.
    let p = SamplingParams {
        temperature: 0.0,
        logit_bias: (0..4).map(|i| (i, f32::NEG_INFINITY)).collect(),
        ..Default::default()
    };
    check_case(&p.chain_spec(), &[1.0, 2.0, 3.0, 4.0], &[], 1, 0);
}

/// A decode step over a device prefix's survivors
/// (`device_prefix::run_survivors`, what Generate does on the GPU) reports
/// what `step::run` over the dense logits reports — token, probability,
/// logprob and post-chain probs — given the survivors' raw logits and the
/// raw row's log-sum-exp.
#[test]
fn a_step_over_the_survivors_reports_the_dense_steps_output() {
    use samplerd_sampling::step::{self, NoDeferral, ProbsRequest, RawLse};
    let mut rng = Lcg(0xde71ce);
    let mut on_device = 0;
    for case in 0..300u64 {
        let n = if case % 50 == 0 { 151_936 } else { 1_500 };
        let p = param_cases(&mut rng, n);
        let chain = registry().build_chain(&p.chain_spec(), None).unwrap();
        let plan = device_prefix::split(chain.spec());
        if plan.device.is_empty() {
            continue;
        }
        let l = logits(n, &mut rng, case % 2 == 0);
        let window: Vec<u32> = (0..rng.below(80))
            .map(|_| rng.below(n as u64 / 10) as u32)
            .collect();
        let (seed, at) = (rng.next(), rng.below(1000));
        let probs = ProbsRequest {
            n: [0, 3][(case % 2) as usize],
            post_sampling: true,
        };
        // The dense step, as on the CPU.
        let mut dense_seq = chain.new_sequence().unwrap();
        dense_seq.accept_history(&window).unwrap();
        let mut buf = TokenBuffer::new();
        let want = match step::load::<NoDeferral>(&mut buf, step::Logits::Floats(&l), None) {
            Ok(lse) => step::run(
                &mut dense_seq,
                &mut buf,
                step::Logits::Floats(&l),
                lse,
                seed,
                at,
                probs,
            ),
            Err(_) => continue,
        };
        // The survivors (the kernels' CPU twin), then the host remainder.
        let mut w = device_prefix::PenaltyWindow::new(plan.penalty_window());
        window.iter().for_each(|&t| w.accept(t));
        let mut survivors = Vec::new();
        if device_prefix::reference::run(&plan.device, &w, &l, &mut survivors)
            || survivors[0].logit == f32::NEG_INFINITY
        {
            continue; // the device hands these rows back dense
        }
        let lse =
            match step::load::<NoDeferral>(&mut TokenBuffer::new(), step::Logits::Floats(&l), None)
            {
                Ok(RawLse::Known(v)) => v,
                _ => unreachable!("loaded above"),
            };
        let mut seq = chain.new_sequence().unwrap();
        seq.accept_history(&window).unwrap();
        let mut buf2 = TokenBuffer::new();
        let got = device_prefix::run_survivors(
            &mut seq,
            &mut buf2,
            n,
            &plan,
            &survivors,
            |id| l[id as usize],
            lse,
            seed,
            at,
            probs,
        );
        match (&want, &got) {
            (Ok(w), Ok(g)) => assert_eq!(w, g, "{}: seed {seed} step {at}", chain.describe()),
            (Err(w), Err(g)) => assert_eq!(w.to_string(), g.to_string()),
            _ => panic!("{}: dense {want:?} vs survivors {got:?}", chain.describe()),
        }
        on_device += 1;
    }
    assert!(
        on_device > 100,
        "only {on_device} cases took the device path"
    );
    // Raw probs rank the whole row: not from survivors.
    let chain = registry()
        .build_chain(&SamplingParams::default().chain_spec(), None)
        .unwrap();
    let plan = device_prefix::split(chain.spec());
    let err = device_prefix::run_survivors(
        &mut chain.new_sequence().unwrap(),
        &mut TokenBuffer::new(),
        10,
        &plan,
        &[device_prefix::SdCandidate { id: 1, logit: 0.0 }],
        |_| 0.0,
        0.0,
        1,
        0,
        ProbsRequest {
            n: 2,
            post_sampling: false,
        },
    )
    .unwrap_err();
    assert!(
        matches!(err, device_prefix::DevicePrefixError::NeedsDense),
        "{err}"
    );
}
