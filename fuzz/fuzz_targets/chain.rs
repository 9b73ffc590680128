//! Fuzzes the sampler chain through the real plugin ABI: arbitrary typed
//! parameters (the `SamplingParams` → chain path) or an arbitrary explicit
//! chain of the core stages with arbitrary parameter values, run over
//! arbitrary logits and penalty windows for a few stream steps.
//!
//! Oracle: bad parameters and logits are errors, never panics; a chain the
//! registry accepted never fails at run time (a core-stage failure is a
//! bug); the chosen token is in the vocabulary and among the survivors, its
//! post-chain probability is in (0, 1], the distribution sums to 1, and the
//! same (seed, step) gives the same token on a fresh sequence.

#![no_main]

use std::collections::BTreeMap;

use arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use samplerd_sampling::{
    Chain, ChainSpec, DEFAULT_ORDER, ParamValue, SampleError, SamplingParams, StageSpec,
    TokenBuffer,
};

/// Most logits per input (the vocabulary is bounded by the input anyway).
const MAX_VOCAB: usize = 4096;
/// Stream steps run per input.
const MAX_STEPS: u8 = 4;

/// A float that is usually in a useful range, sometimes extreme.
fn float(u: &mut Unstructured<'_>) -> Result<f32> {
    Ok(match u.int_in_range(0u8..=9)? {
        0 => f32::from_bits(u.arbitrary()?),
        1 => *u.choose(&[
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-30,
        ])?,
        _ => f32::from(u.arbitrary::<i8>()?) / 32.0,
    })
}

fn logit(u: &mut Unstructured<'_>) -> Result<f32> {
    Ok(match u.arbitrary::<u8>()? {
        255 => f32::NEG_INFINITY,
        254 => f32::MAX,
        253 => f32::MIN,
        252 => f32::NAN,
        251 => f32::INFINITY,
        250 => 1e30,
        b => (f32::from(b) - 128.0) / 8.0,
    })
}

fn text(u: &mut Unstructured<'_>) -> Result<String> {
    let n = u.int_in_range(0u8..=12)?;
    (0..n).map(|_| u.arbitrary::<char>()).collect()
}

fn typed(u: &mut Unstructured<'_>) -> Result<SamplingParams> {
    let d = SamplingParams::default();
    let mut p = SamplingParams {
        temperature: if u.arbitrary()? {
            float(u)?
        } else {
            d.temperature
        },
        top_k: if u.arbitrary()? {
            u.arbitrary()?
        } else {
            d.top_k
        },
        top_p: if u.arbitrary()? { float(u)? } else { d.top_p },
        min_p: if u.arbitrary()? { float(u)? } else { d.min_p },
        typical_p: if u.arbitrary()? {
            float(u)?
        } else {
            d.typical_p
        },
        repeat_penalty: if u.arbitrary()? {
            float(u)?
        } else {
            d.repeat_penalty
        },
        frequency_penalty: if u.arbitrary()? {
            float(u)?
        } else {
            d.frequency_penalty
        },
        presence_penalty: if u.arbitrary()? {
            float(u)?
        } else {
            d.presence_penalty
        },
        repeat_last_n: if u.arbitrary()? {
            i32::from(u.arbitrary::<i16>()?)
        } else {
            d.repeat_last_n
        },
        top_n_sigma: if u.arbitrary()? {
            float(u)?
        } else {
            d.top_n_sigma
        },
        xtc_probability: if u.arbitrary()? {
            float(u)?
        } else {
            d.xtc_probability
        },
        xtc_threshold: if u.arbitrary()? {
            float(u)?
        } else {
            d.xtc_threshold
        },
        ..d
    };
    let n_bias = u.int_in_range(0u8..=6)?;
    for _ in 0..n_bias {
        p.logit_bias
            .push((u32::from(u.arbitrary::<u16>()?), float(u)?));
    }
    if u.arbitrary()? {
        // Every default stage, the aliases and draws an order may name, and
        // one unknown name.
        let extra = ["temp", "dist", "greedy", "nope"];
        let names: Vec<&str> = DEFAULT_ORDER.iter().chain(&extra).copied().collect();
        let n = u.int_in_range(0u8..=8)?;
        for _ in 0..n {
            p.order.push((*u.choose(&names)?).to_string());
        }
    }
    Ok(p)
}

fn param_value(u: &mut Unstructured<'_>) -> Result<ParamValue> {
    Ok(match u.int_in_range(0u8..=7)? {
        0 => ParamValue::String(text(u)?),
        1 => {
            let n = u.int_in_range(0u8..=6)?;
            ParamValue::TokenMap(
                (0..n)
                    .map(|_| Ok((u32::from(u.arbitrary::<u16>()?), float(u)?)))
                    .collect::<Result<_>>()?,
            )
        }
        2 => {
            let n = u.int_in_range(0u8..=4)?;
            ParamValue::StringList((0..n).map(|_| text(u)).collect::<Result<_>>()?)
        }
        3 => ParamValue::Number(f64::from_bits(u.arbitrary()?)),
        4 => ParamValue::Number(f64::from(u.arbitrary::<i32>()?)),
        _ => ParamValue::Number(f64::from(float(u)?)),
    })
}

fn explicit(u: &mut Unstructured<'_>) -> Result<ChainSpec> {
    let stages = samplerd_fuzz::registry().stages();
    let n = u.int_in_range(0u8..=6)?;
    let mut spec = ChainSpec::default();
    for _ in 0..n {
        let i = u.int_in_range(0..=stages.len())?;
        let (name, params) = match stages.get(i) {
            Some(s) => (s.name.clone(), s.params.as_slice()),
            None => ("no_such_stage".to_string(), &[][..]),
        };
        let mut map = BTreeMap::new();
        let k = u.int_in_range(0u8..=3)?;
        for _ in 0..k {
            let j = u.int_in_range(0..=params.len())?;
            let pname = params
                .get(j)
                .map_or_else(|| "bogus".to_string(), |p| p.name.clone());
            map.insert(pname, param_value(u)?);
        }
        spec.stages.push(StageSpec { name, params: map });
    }
    Ok(spec)
}

fn check_step(chain: &Chain, buf: &mut TokenBuffer, r: std::result::Result<u32, SampleError>) {
    let token = match r {
        Ok(t) => t,
        // The request's doing (bad logits, or a bias that masks every
        // token), answered INVALID_ARGUMENT by the server.
        Err(SampleError::Logits(_) | SampleError::AllMasked { .. }) => return,
        Err(e) => panic!("chain `{}` failed at run time: {e}", chain.describe()),
    };
    let n_vocab = buf.n_vocab();
    assert!(
        (token as usize) < n_vocab,
        "token {token} outside vocabulary {n_vocab}"
    );
    assert!(
        buf.survivors().any(|(id, _)| id == token),
        "chain `{}` chose {token}, which is not a survivor",
        chain.describe()
    );
    let (dist, p) = buf.distribution(usize::MAX, token);
    // `adaptive_p` draws from its reshaped logits but leaves the survivors'
    // own (docs/SAMPLING.md), so with a target of 0 it can pick a token
    // whose probability underflows to 0 beside a huge logit, as llama.cpp's
    // `llama_sampler_adaptive_p_apply` would. Every other selecting stage
    // draws from the survivors' own probabilities and must pick one > 0.
    let reshapes = chain.stage_names().last() == Some(&"adaptive_p");
    assert!(
        (p > 0.0 || (reshapes && p == 0.0)) && p <= 1.0,
        "chain `{}`: probability of the chosen token {token} is {p}; survivors {:?}",
        chain.describe(),
        buf.survivors().take(16).collect::<Vec<_>>()
    );
    let total: f64 = dist.iter().map(|&(_, q)| f64::from(q)).sum();
    assert!(
        (total - 1.0).abs() < 1e-3,
        "post-chain probabilities sum to {total}"
    );
}

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    let registry = samplerd_fuzz::registry();
    let built = if u.arbitrary()? {
        registry.build_typed(&typed(u)?, None)
    } else {
        registry.build_chain(&explicit(u)?, None)
    };
    let Ok(chain) = built else {
        return Ok(());
    };
    let seed: u64 = u.arbitrary()?;
    let first_step: u64 = u.arbitrary()?;
    let steps = u.int_in_range(1..=MAX_STEPS)?;
    let n_window = u.int_in_range(0u8..=32)?;
    let window: Vec<u32> = (0..n_window)
        .map(|_| Ok(u32::from(u.arbitrary::<u8>()?)))
        .collect::<Result<_>>()?;
    let n_vocab = u.int_in_range(0..=MAX_VOCAB)?;
    let mut logits = Vec::with_capacity(n_vocab);
    for _ in 0..n_vocab {
        if u.is_empty() {
            break;
        }
        logits.push(logit(u)?);
    }

    let mut seq = chain.new_sequence().expect("a new sequence");
    seq.accept_history(&window).expect("accept the window");
    let mut buf = TokenBuffer::with_limit(MAX_VOCAB);
    if buf.load(&logits).is_err() {
        return Ok(()); // empty, NaN or +inf logits: rejected, as they must be
    }
    let first = seq.sample(&mut buf, seed, first_step).map(|s| s.token_id);
    check_step(&chain, &mut buf, first.clone());
    let Ok(first) = first else { return Ok(()) };

    // The same step on a fresh sequence gives the same token.
    let mut again = chain.new_sequence().expect("a new sequence");
    again.accept_history(&window).expect("accept the window");
    buf.load(&logits).expect("loaded before");
    let t = again.sample(&mut buf, seed, first_step).map(|s| s.token_id);
    assert_eq!(t, Ok(first), "same seed and step, different token");

    // A few more stream steps with the chosen tokens accepted.
    seq.accept(first).expect("accept");
    for s in 1..u64::from(steps) {
        buf.load(&logits).expect("loaded before");
        let r = seq
            .sample(&mut buf, seed, first_step.wrapping_add(s))
            .map(|s| s.token_id);
        check_step(&chain, &mut buf, r.clone());
        match r {
            Ok(t) => seq.accept(t).expect("accept"),
            Err(_) => break,
        }
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
