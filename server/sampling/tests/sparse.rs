//! Sparse rows against their dense rows through the real core stages: for
//! random rows, chains, windows and seeds, whenever the proof accepts a
//! sparse row, the step answers exactly what it answers for a dense row
//! the sparse one stands for — including rows built to be as unfriendly as
//! the contract allows (every unsent logit tied at the bound, one at the
//! bound and the rest far below, the unsent values shuffled so that a
//! whole-vocabulary f32 sum rounds differently); and the refusals name
//! their stage.

mod common;

use std::sync::OnceLock;

use common::*;
use proptest::prelude::*;
use samplerd_sampling::sparse::oracle::{self, Outcome};
use samplerd_sampling::sparse::{self, SparseRow};
use samplerd_sampling::step::ProbsRequest;
use samplerd_sampling::{
    Chain, ChainSpec, ParamValue, SampleError, SamplingParams, StageRegistry, StageSpec,
    TokenBuffer,
};

fn registry() -> &'static StageRegistry {
    static REG: OnceLock<StageRegistry> = OnceLock::new();
    REG.get_or_init(|| StageRegistry::load(&[], &[core_plugin()]).unwrap())
}

fn build(spec: ChainSpec) -> Chain {
    registry().build_chain(&spec, None).unwrap()
}

fn stages(list: &[StageSpec]) -> Chain {
    build(ChainSpec {
        stages: list.to_vec(),
    })
}

fn s(name: &str) -> StageSpec {
    StageSpec::new(name)
}

/// The chains the property runs: the default one and the shapes docs/
/// SAMPLING.md names, accepted and refused ones alike.
fn chains() -> &'static Vec<(&'static str, Chain)> {
    static CHAINS: OnceLock<Vec<(&'static str, Chain)>> = OnceLock::new();
    CHAINS.get_or_init(|| {
        let typed = |p: SamplingParams| build(p.chain_spec());
        vec![
            ("default", typed(SamplingParams::default())),
            (
                "greedy",
                typed(SamplingParams {
                    temperature: 0.0,
                    ..Default::default()
                }),
            ),
            ("top_k", stages(&[s("top_k").number("k", 20.0), s("dist")])),
            (
                "min_p",
                stages(&[s("min_p").number("p", 0.1), s("temperature"), s("dist")]),
            ),
            (
                "min_p_keep",
                stages(&[
                    s("min_p").number("p", 0.9).number("min_keep", 5.0),
                    s("dist"),
                ]),
            ),
            (
                "top_p_then_top_k",
                stages(&[
                    s("top_p").number("p", 0.9),
                    s("top_k").number("k", 30.0),
                    s("temperature"),
                    s("dist"),
                ]),
            ),
            ("top_p", stages(&[s("top_p").number("p", 0.8), s("dist")])),
            (
                "temperature_top_p",
                stages(&[
                    s("temperature").number("t", 0.6),
                    s("top_p").number("p", 0.7),
                    s("dist"),
                ]),
            ),
            ("top_p_0", stages(&[s("top_p").number("p", 0.0), s("dist")])),
            (
                "penalties_bias",
                typed(SamplingParams {
                    repeat_penalty: 1.3,
                    frequency_penalty: 0.2,
                    presence_penalty: 0.1,
                    logit_bias: vec![(3, -2.0), (7, f32::NEG_INFINITY), (11, -0.5)],
                    ..Default::default()
                }),
            ),
            (
                "dry_top_k",
                stages(&[
                    s("dry")
                        .number("multiplier", 0.8)
                        .number("allowed_length", 1.0)
                        .with(
                            "sequence_breakers",
                            ParamValue::StringList(vec![String::new()]),
                        ),
                    s("top_k").number("k", 10.0),
                    s("dist"),
                ]),
            ),
            (
                "tail_after_top_k",
                stages(&[
                    s("top_k").number("k", 50.0),
                    s("typical_p").number("p", 0.9),
                    s("xtc").number("probability", 0.5),
                    s("top_n_sigma").number("n", 1.5),
                    s("mirostat_v2"),
                ]),
            ),
            (
                "argmax_temp",
                stages(&[s("temperature").number("t", 0.0), s("dist")]),
            ),
            ("dist", stages(&[s("dist")])),
        ]
    })
}

/// A dense row and the sparse row standing for it.
struct Rows {
    dense: Vec<f32>,
    ids: Vec<u32>,
    values: Vec<f32>,
    rest: f64,
}

impl Rows {
    fn sparse(&self) -> SparseRow<'_> {
        SparseRow::new(&self.ids, &self.values, self.rest, self.dense.len()).unwrap()
    }
}

/// xorshift, for shuffles.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// The `n` largest of `base` (ties at the cut taken in a shuffled order)
/// sent, in shuffled order; the others reshaped by `family` below the
/// smallest sent value `m`: 0 as they are, 1 all at `m`, 2 one at `m` and
/// the rest 40 below, 3 all −∞, 4 spread over [m − 6, m]. `rest` is their
/// log-sum-exp in f64.
fn rows(base: &[f32], n: usize, family: u8, seed: u64) -> Rows {
    let mut st = seed | 1;
    let mut order: Vec<usize> = (0..base.len()).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, next(&mut st) as usize % (i + 1));
    }
    order.sort_by(|&a, &b| base[b].total_cmp(&base[a]));
    let mut dense = base.to_vec();
    let sent = &order[..n];
    let m = sent.iter().map(|&i| base[i]).fold(f32::INFINITY, f32::min);
    for (j, &i) in order[n..].iter().enumerate() {
        dense[i] = match family {
            0 => base[i],
            1 => m,
            2 if j == 0 => m,
            2 => m - 40.0,
            3 => f32::NEG_INFINITY,
            _ => m - (next(&mut st) % 600) as f32 / 100.0,
        };
    }
    let mut ids: Vec<u32> = sent.iter().map(|&i| i as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, next(&mut st) as usize % (i + 1));
    }
    let values = ids.iter().map(|&i| dense[i as usize]).collect();
    let rest = lse(order[n..].iter().map(|&i| dense[i]));
    Rows {
        dense,
        ids,
        values,
        rest,
    }
}

fn lse(xs: impl Iterator<Item = f32> + Clone) -> f64 {
    let max = xs.clone().fold(f64::NEG_INFINITY, |m, x| m.max(x as f64));
    if max == f64::NEG_INFINITY {
        return max;
    }
    max + xs.map(|x| (x as f64 - max).exp()).sum::<f64>().ln()
}

/// The same row with its unsent values permuted among the unsent ids: the
/// same sparse row, another f32 summation order over the vocabulary.
fn permuted(r: &Rows, seed: u64) -> Vec<f32> {
    let mut sent = vec![false; r.dense.len()];
    for &id in &r.ids {
        sent[id as usize] = true;
    }
    let unsent: Vec<usize> = (0..r.dense.len()).filter(|&i| !sent[i]).collect();
    let mut vals: Vec<f32> = unsent.iter().map(|&i| r.dense[i]).collect();
    let mut st = seed | 1;
    for i in (1..vals.len()).rev() {
        vals.swap(i, next(&mut st) as usize % (i + 1));
    }
    let mut out = r.dense.clone();
    for (&i, v) in unsent.iter().zip(vals) {
        out[i] = v;
    }
    out
}

fn logits(n: usize, seed: u64, ties: bool) -> Vec<f32> {
    let mut l = samplerd_sampling::bench::random_logits(n, 3.0, seed);
    if ties {
        for x in &mut l {
            *x = (*x * 2.0).round() / 2.0;
        }
    }
    l
}

/// One comparison; panics on a difference.
#[allow(clippy::too_many_arguments)]
fn check(
    name: &str,
    chain: &Chain,
    window: &[u32],
    dense: &[f32],
    row: SparseRow<'_>,
    seed: u64,
    step: u64,
    probs: ProbsRequest,
) -> Outcome {
    oracle::compare(chain, window, dense, row, seed, step, probs).unwrap_or_else(|e| {
        panic!(
            "chain {name} ({}), {} of {} sent, rest {}: {e}",
            chain.describe(),
            row.len(),
            row.n_vocab(),
            row.rest_lse()
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn an_accepted_sparse_row_answers_as_its_dense_row(
        vocab in 2usize..1500,
        frac in 0.0f64..1.0,
        seed in any::<u64>(),
        ties in any::<bool>(),
        family in 0u8..5,
        chain_i in 0usize..64,
        window in proptest::collection::vec(0u32..1500, 0..60),
        step in 0u64..4,
        n_probs in prop_oneof![Just(0usize), 1usize..8, Just(40usize)],
        post in any::<bool>(),
    ) {
        let (name, chain) = &chains()[chain_i % chains().len()];
        let n = ((vocab as f64 * frac * frac) as usize).clamp(1, vocab);
        let base = logits(vocab, seed, ties);
        let r = rows(&base, n, family, seed);
        let probs = ProbsRequest { n: n_probs, post_sampling: post };
        let window: Vec<u32> = window.into_iter().filter(|&t| (t as usize) < vocab).collect();
        check(name, chain, &window, &r.dense, r.sparse(), seed, step, probs);
        check(name, chain, &window, &permuted(&r, seed ^ 0x5eed), r.sparse(), seed, step, probs);
    }
}

/// Over many random cases, each chain that can be accepted is accepted
/// (the property above is not vacuous), the refused ones always are, and
/// nothing differs.
#[test]
fn each_chain_shape_is_accepted_or_refused_as_documented() {
    let mut accepted = std::collections::BTreeMap::<&str, (usize, usize)>::new();
    for case in 0..600u64 {
        let (name, chain) = &chains()[case as usize % chains().len()];
        let vocab = [50usize, 400, 3000][(case / 7 % 3) as usize];
        let n = [vocab / 2, vocab / 8, 64.min(vocab)][(case / 3 % 3) as usize];
        let base = logits(vocab, case, case % 4 == 0);
        let r = rows(&base, n, (case % 5) as u8, case);
        let window: Vec<u32> = (0..40)
            .map(|i| ((i * 37 + case) % vocab as u64) as u32)
            .collect();
        let out = check(
            name,
            chain,
            &window,
            &r.dense,
            r.sparse(),
            case,
            0,
            ProbsRequest::default(),
        );
        let e = accepted.entry(name).or_default();
        e.0 += matches!(out, Outcome::Same(_)) as usize;
        e.1 += 1;
    }
    for (name, (yes, all)) in &accepted {
        eprintln!("{name}: {yes} of {all}");
        match *name {
            // Never cut down before the draw (except rows whose unsent
            // logits are all −∞, which are the dense row).
            "dist" => assert!(*yes < *all / 3, "{name}: {yes} of {all}"),
            _ => assert!(*yes > 0, "{name}: never accepted in {all} cases"),
        }
    }
}

/// The default chain at a real vocabulary with 1,024 entries: always
/// accepted, and the same as dense for every shape of the rest, every
/// candidate report.
#[test]
fn the_default_chain_at_151936_with_1024_entries() {
    let (_, chain) = &chains()[0];
    for (case, family) in (0..5u8).enumerate() {
        let base = logits(151_936, 100 + case as u64, false);
        let r = rows(&base, 1024, family, case as u64);
        for probs in [
            ProbsRequest::default(),
            ProbsRequest {
                n: 10,
                post_sampling: false,
            },
            ProbsRequest {
                n: 10,
                post_sampling: true,
            },
        ] {
            let out = check(
                "default",
                chain,
                &[5, 17, 5],
                &r.dense,
                r.sparse(),
                42,
                3,
                probs,
            );
            assert!(matches!(out, Outcome::Same(_)), "family {family}: {out:?}");
        }
    }
}

/// A top_p with no top_k before it needs its normaliser: accepted on a
/// peaked row where the nucleus closes well inside the sent entries (the
/// whole row laid out dense), refused on a flat one, naming the stage and
/// the mass the sent entries hold.
#[test]
fn top_p_without_top_k_is_proven_or_refused_with_the_mass() {
    let chain = stages(&[s("top_p").number("p", 0.9), s("dist")]);
    let mut peaked = logits(151_936, 7, false);
    for (i, x) in peaked.iter_mut().take(20).enumerate() {
        *x = 25.0 - i as f32 * 0.5;
    }
    let r = rows(&peaked, 256, 0, 1);
    let out = check(
        "top_p",
        &chain,
        &[],
        &r.dense,
        r.sparse(),
        1,
        0,
        ProbsRequest::default(),
    );
    assert!(matches!(out, Outcome::Same(_)), "{out:?}");

    let flat = logits(151_936, 8, false);
    let r = rows(&flat, 1024, 0, 2);
    let Outcome::Refused(refusal) = check(
        "top_p",
        &chain,
        &[],
        &r.dense,
        r.sparse(),
        1,
        0,
        ProbsRequest::default(),
    ) else {
        panic!("a flat row's nucleus cannot close inside 1,024 entries");
    };
    assert_eq!(refusal.stage.as_deref(), Some("top_p"));
    assert!(
        refusal
            .message
            .starts_with("stage `top_p` (p = 0.9): the nucleus does not close inside the 1,02"),
        "{}",
        refusal.message
    );
    assert!(
        refusal.message.contains("of the mass); send more entries"),
        "{}",
        refusal.message
    );
}

fn refusal(chain: &Chain, r: &Rows, window: &[u32], probs: ProbsRequest) -> String {
    let mut seq = chain.new_sequence().unwrap();
    seq.accept_history(window).unwrap();
    let mut buf = TokenBuffer::new();
    match sparse::run(&mut seq, &mut buf, r.sparse(), 1, 0, probs) {
        Err(SampleError::Sparse(x)) => {
            let who = x.stage.as_deref().or(x.field).unwrap_or("?");
            format!("{who}|{:?}|{}", x.entries_needed, x.message)
        }
        other => panic!("{} was not refused: {other:?}", chain.describe()),
    }
}

/// Every kind of refusal, with the stage (or field) it names.
#[test]
fn refusals_name_the_stage_or_field() {
    let base = logits(1000, 3, false);
    let r = rows(&base, 30, 0, 3);
    let none = ProbsRequest::default();
    let cases: Vec<(Chain, ProbsRequest, &str)> = vec![
        (
            stages(&[s("top_k").number("k", 40.0), s("dist")]),
            none,
            "top_k|Some(41)|stage `top_k` (k = 40): only 29 of the 30 sent entries lie above",
        ),
        (
            stages(&[s("dist")]),
            none,
            "dist|None|stage `dist` draws from every live token, and the chain never cuts",
        ),
        (
            stages(&[s("typical_p").number("p", 0.5), s("top_k"), s("dist")]),
            none,
            "typical_p|None|stage `typical_p` (p = 0.5) needs every logit of the row",
        ),
        (
            stages(&[
                s("penalties").number("repeat_penalty", 0.8),
                s("top_k"),
                s("dist"),
            ]),
            none,
            "penalties|None|stage `penalties` (repeat_last_n = 64, repeat_penalty = 0.8, \
             frequency_penalty = 0, presence_penalty = 0): a repeat_penalty below 1",
        ),
        (
            stages(&[
                s("logit_bias").with("bias", ParamValue::TokenMap(vec![(r.unsent_id(), 1.5)])),
                s("top_k"),
                s("dist"),
            ]),
            none,
            "logit_bias|None|stage `logit_bias`: a bias of +1.5 on token",
        ),
        (
            stages(&[
                s("dry").number("multiplier", -1.0).with(
                    "sequence_breakers",
                    ParamValue::StringList(vec![String::new()]),
                ),
                s("top_k"),
                s("dist"),
            ]),
            none,
            "dry|None|stage `dry` (multiplier = -1): a negative multiplier",
        ),
        (
            stages(&[
                s("temperature")
                    .number("t", 0.7)
                    .number("dynatemp_range", 0.2),
                s("dist"),
            ]),
            none,
            "temperature|None|stage `temperature` (t = 0.7): dynamic temperature",
        ),
        (
            stages(&[s("min_p").number("p", 0.001), s("dist")]),
            none,
            "min_p|None|stage `min_p` (p = 0.001): its threshold",
        ),
        (
            stages(&[s("top_k").number("k", 5.0), s("dist")]),
            ProbsRequest {
                n: 31,
                post_sampling: false,
            },
            "n_probs|Some(32)|n_probs = 31: more raw candidates than the 30 entries sent",
        ),
        (
            stages(&[s("top_k").number("k", 5.0), s("dist")]),
            ProbsRequest {
                n: 30,
                post_sampling: false,
            },
            "n_probs|Some(31)|n_probs = 30: the 30th largest sent logit",
        ),
    ];
    for (chain, probs, want) in cases {
        let got = refusal(&chain, &r, &[], probs);
        assert!(
            got.starts_with(want),
            "{}:\n got {got}\nwant {want}",
            chain.describe()
        );
    }
}

impl Rows {
    /// A token that was not sent.
    fn unsent_id(&self) -> u32 {
        (0..self.dense.len() as u32)
            .find(|i| !self.ids.contains(i))
            .unwrap()
    }
}

/// A row with nothing unsent, or with every unsent logit −∞, is the dense
/// row: any chain runs, `dist` included.
#[test]
fn a_row_with_nothing_left_unsent_is_the_dense_row() {
    let chain = stages(&[s("temperature").number("t", 0.9), s("dist")]);
    let base = logits(300, 9, false);
    for (n, family) in [(300, 0u8), (40, 3)] {
        let r = rows(&base, n, family, 9);
        let out = check(
            "dist",
            &chain,
            &[1, 2],
            &r.dense,
            r.sparse(),
            5,
            2,
            ProbsRequest {
                n: 5,
                post_sampling: true,
            },
        );
        assert!(matches!(out, Outcome::Same(_)), "{n}: {out:?}");
    }
}

/// A nucleus whose cut sits on the edge of the f32 rounding of its
/// normaliser: `p` is set to the running sum the walk reaches at one
/// entry for normalisers a few ulps around the exact sum of the row's
/// terms. The dense row's own f32 sum (in id order, over 151,936 terms)
/// lands somewhere in that spread, so for some of these `p` the cut moves
/// with the summation order. The proof must refuse those, or agree.
#[test]
fn a_cut_on_the_edge_of_the_normalisers_rounding_is_not_taken_for_proven() {
    let mut base: Vec<f32> = logits(151_936, 11, false)
        .iter()
        .map(|x| x - 80.0)
        .collect();
    for (i, x) in base.iter_mut().take(1024).enumerate() {
        *x = 12.0 - i as f32 / 100.0;
    }
    // Unsent logits some 80 below the sent ones: their mass is next to
    // nothing, only the rounding of the sum is left uncertain.
    let r = rows(&base, 1024, 0, 11);
    let max = r.values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exact: f64 = r.dense.iter().map(|&l| (l - max).exp() as f64).sum();
    let mut es: Vec<f32> = r.values.iter().map(|&l| (l - max).exp()).collect();
    es.sort_by(|a, b| b.total_cmp(a));
    let cum_at = |z: f32, c: usize| es[..c].iter().fold(0.0f32, |s, &e| s + e / z);
    let (mut same, mut refused) = (0, 0);
    for c in [30usize, 200, 700] {
        let mut z = (exact as f32).next_down().next_down().next_down();
        for _ in 0..7 {
            let p = cum_at(z, c);
            let chain = stages(&[s("top_p").number("p", p as f64), s("dist")]);
            for dense in [r.dense.clone(), permuted(&r, c as u64)] {
                match check(
                    "top_p",
                    &chain,
                    &[],
                    &dense,
                    r.sparse(),
                    3,
                    0,
                    ProbsRequest::default(),
                ) {
                    Outcome::Same(_) => same += 1,
                    Outcome::Refused(x) => {
                        refused += 1;
                        eprintln!("{}", x.message);
                    }
                    Outcome::BothFailed(e) => panic!("{e}"),
                }
            }
            z = z.next_up();
        }
    }
    let zd = r.dense.iter().fold(0.0f32, |s, &l| s + (l - max).exp());
    eprintln!(
        "same {same} refused {refused} exact {exact} dense {zd} f32 {}",
        exact as f32
    );
    assert!(refused > 0, "every edge case was taken ({same})");
}
