//! Fuzzes sparse rows (`SparseLogits`) through the real core stages: a
//! random dense row, a random number of its top entries sent, the unsent
//! ones reshaped below the smallest sent value (left as they are, tied at
//! it, one at it and the rest far below, all -inf, or spread) with their
//! log-sum-exp computed in f64, and a random chain (typed parameters or an
//! explicit chain of core stages), window, seed and candidate report.
//! Also arbitrary `SparseLogits` fields straight into the checks.
//!
//! Oracle: nothing panics; a malformed row is refused by `SparseRow::new`;
//! whenever the proof accepts a row, the step answers what it answers for
//! the dense row (`sparse::oracle::compare`: the token, the post-chain
//! probability and candidates bit for bit, log-probabilities within a few
//! ulps of the log-sum-exp).

#![no_main]

use std::collections::BTreeMap;

use arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use samplerd_sampling::sparse::oracle;
use samplerd_sampling::sparse::{self, SparseRow};
use samplerd_sampling::step::ProbsRequest;
use samplerd_sampling::{ChainSpec, ParamValue, SamplingParams, StageSpec, TokenBuffer};

/// Most logits per input.
const MAX_VOCAB: usize = 2048;

fn logit(u: &mut Unstructured<'_>) -> Result<f32> {
    Ok(match u.arbitrary::<u8>()? {
        255 => f32::NEG_INFINITY,
        254 => 60.0,
        253 => -60.0,
        b => (f32::from(b) - 128.0) / 16.0,
    })
}

/// A number parameter in the stages' useful ranges, sometimes an edge.
fn number(u: &mut Unstructured<'_>) -> Result<f64> {
    Ok(match u.int_in_range(0u8..=5)? {
        0 => *u.choose(&[0.0, 1.0, -1.0, 0.5, 2.0, 40.0])?,
        _ => f64::from(u.arbitrary::<i8>()?) / 32.0,
    })
}

fn typed(u: &mut Unstructured<'_>) -> Result<SamplingParams> {
    let d = SamplingParams::default();
    let pick = |u: &mut Unstructured<'_>, dflt: f32| -> Result<f32> {
        Ok(if u.arbitrary()? {
            number(u)? as f32
        } else {
            dflt
        })
    };
    let mut p = SamplingParams {
        temperature: pick(u, d.temperature)?,
        top_k: if u.arbitrary()? {
            i32::from(u.arbitrary::<u8>()?)
        } else {
            d.top_k
        },
        top_p: pick(u, d.top_p)?,
        min_p: pick(u, d.min_p)?,
        repeat_penalty: pick(u, d.repeat_penalty)?,
        frequency_penalty: pick(u, d.frequency_penalty)?,
        presence_penalty: pick(u, d.presence_penalty)?,
        typical_p: pick(u, d.typical_p)?,
        ..d
    };
    for _ in 0..u.int_in_range(0u8..=4)? {
        let bias = if u.arbitrary()? {
            f32::NEG_INFINITY
        } else {
            number(u)? as f32
        };
        p.logit_bias.push((u32::from(u.arbitrary::<u8>()?), bias));
    }
    Ok(p)
}

fn explicit(u: &mut Unstructured<'_>) -> Result<ChainSpec> {
    let stages = samplerd_fuzz::registry().stages();
    let mut spec = ChainSpec::default();
    for _ in 0..u.int_in_range(1u8..=5)? {
        let s = u.choose(stages)?;
        let mut params = BTreeMap::new();
        for _ in 0..u.int_in_range(0u8..=2)? {
            if let Ok(p) = u.choose(&s.params) {
                params.insert(p.name.clone(), ParamValue::Number(number(u)?));
            }
        }
        spec.stages.push(StageSpec {
            name: s.name.clone(),
            params,
        });
    }
    Ok(spec)
}

/// The dense row and its sparse form: the top `n` sent (ties at the cut
/// in position order), the unsent ones reshaped below the smallest sent
/// value `m` by `family`.
fn rows(
    u: &mut Unstructured<'_>,
    base: &[f32],
    n: usize,
) -> Result<(Vec<f32>, Vec<u32>, Vec<f32>, f64)> {
    let mut order: Vec<usize> = (0..base.len()).collect();
    order.sort_by(|&a, &b| base[b].total_cmp(&base[a]));
    let m = order[..n]
        .iter()
        .map(|&i| base[i])
        .fold(f32::INFINITY, f32::min);
    let family = u.int_in_range(0u8..=4)?;
    let mut dense = base.to_vec();
    for (j, &i) in order[n..].iter().enumerate() {
        dense[i] = match family {
            0 => base[i],
            1 => m,
            2 if j == 0 => m,
            2 => m - 40.0,
            3 => f32::NEG_INFINITY,
            _ => m - f32::from(u.arbitrary::<u8>()?) / 32.0,
        };
    }
    let mut ids: Vec<u32> = order[..n].iter().map(|&i| i as u32).collect();
    if u.arbitrary()? {
        ids.reverse();
    }
    let values = ids.iter().map(|&i| dense[i as usize]).collect();
    let rest: Vec<f64> = order[n..].iter().map(|&i| f64::from(dense[i])).collect();
    let max = rest.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let lse = if max == f64::NEG_INFINITY {
        max
    } else {
        max + rest.iter().map(|x| (x - max).exp()).sum::<f64>().ln()
    };
    Ok((dense, ids, values, lse))
}

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    let registry = samplerd_fuzz::registry();
    let n_vocab = u.int_in_range(1..=MAX_VOCAB)?;
    let mut base = Vec::with_capacity(n_vocab);
    for _ in 0..n_vocab {
        base.push(if u.is_empty() { 0.0 } else { logit(u)? });
    }
    let n = u.int_in_range(1..=n_vocab)?;
    if u.arbitrary::<u8>()? < 16 {
        // Arbitrary fields: refused or taken, never a panic.
        let ids: Vec<u32> = (0..n.min(64))
            .map(|_| Ok(u32::from(u.arbitrary::<u16>()?)))
            .collect::<Result<_>>()?;
        let values: Vec<f32> = ids
            .iter()
            .map(|_| Ok(f32::from_bits(u.arbitrary()?)))
            .collect::<Result<_>>()?;
        let rest = f64::from_bits(u.arbitrary()?);
        if let Ok(row) = SparseRow::new(&ids, &values, rest, n_vocab) {
            if let Ok(chain) = registry.build_typed(&typed(u)?, None) {
                let mut seq = chain.new_sequence().expect("a new sequence");
                let mut buf = TokenBuffer::with_limit(MAX_VOCAB);
                let _ = sparse::run(&mut seq, &mut buf, row, 1, 0, ProbsRequest::default());
            }
        }
        return Ok(());
    }
    let built = if u.arbitrary()? {
        registry.build_typed(&typed(u)?, None)
    } else {
        registry.build_chain(&explicit(u)?, None)
    };
    let Ok(chain) = built else {
        return Ok(());
    };
    let (dense, ids, values, rest) = rows(u, &base, n)?;
    let Ok(row) = SparseRow::new(&ids, &values, rest, n_vocab) else {
        // Only a row whose every logit is -inf is refused.
        assert!(dense.iter().all(|&l| l == f32::NEG_INFINITY));
        return Ok(());
    };
    let window: Vec<u32> = (0..u.int_in_range(0u8..=24)?)
        .map(|_| Ok(u32::from(u.arbitrary::<u8>()?)))
        .collect::<Result<_>>()?;
    let probs = ProbsRequest {
        n: usize::from(u.int_in_range(0u8..=8)?),
        post_sampling: u.arbitrary()?,
    };
    let (seed, step) = (u.arbitrary()?, u64::from(u.arbitrary::<u8>()?));
    if let Err(diff) = oracle::compare(&chain, &window, &dense, row, seed, step, probs) {
        panic!(
            "chain `{}`, {n} of {n_vocab} sent, rest {rest}: {diff}",
            chain.describe()
        );
    }
    Ok(())
}

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});
