//! Property tests over random logits and parameters: no stage grows the
//! candidate list or invents ids, selecting stages pick valid tokens, and
//! the RNG alone decides the draw.

mod common;

use common::*;
use proptest::prelude::*;
use samplerd_core_stages::{
    dist::Dist, greedy::Greedy, logit_bias::LogitBias, min_p::MinP, mirostat::MirostatV2,
    penalties::Penalties, temperature::Temperature, top_k::TopK, top_n_sigma::TopNSigma,
    top_p::TopP, typical_p::TypicalP, xtc::Xtc,
};
use samplerd_plugin_sdk::Stage;

/// Logits with occasional -inf and ties.
fn logits_strategy(max_len: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(
        prop_oneof![
            8 => -20.0f32..20.0,
            1 => Just(f32::NEG_INFINITY),
            1 => Just(1.0f32),
        ],
        1..max_len,
    )
    .prop_filter("at least one finite logit", |v| {
        v.iter().any(|l| l.is_finite())
    })
}

#[derive(Debug, Clone)]
enum AnyStage {
    TopK(f64),
    TopP(f64, f64),
    MinP(f64, f64),
    Typical(f64, f64),
    Temp(f64),
    Sigma(f64),
    Xtc(f64, f64),
    Penalties(Vec<u32>, f64, f64, f64),
    Bias(Vec<(u32, f32)>),
}

fn stage_strategy() -> impl Strategy<Value = AnyStage> {
    prop_oneof![
        (0.0f64..300.0).prop_map(|k| AnyStage::TopK(k.floor())),
        (0.01f64..1.0, 0.0f64..5.0).prop_map(|(p, m)| AnyStage::TopP(p, m.floor())),
        (0.0f64..1.0, 0.0f64..5.0).prop_map(|(p, m)| AnyStage::MinP(p, m.floor())),
        (0.0f64..1.0, 0.0f64..5.0).prop_map(|(p, m)| AnyStage::Typical(p, m.floor())),
        (0.0f64..3.0).prop_map(AnyStage::Temp),
        (-1.0f64..3.0).prop_map(AnyStage::Sigma),
        (0.0f64..1.0, 0.0f64..0.6).prop_map(|(p, t)| AnyStage::Xtc(p, t)),
        (
            prop::collection::vec(0u32..400, 0..80),
            0.5f64..2.0,
            0.0f64..1.0,
            0.0f64..1.0
        )
            .prop_map(|(w, r, f, p)| AnyStage::Penalties(w, r, f, p)),
        prop::collection::vec((0u32..400, -5.0f32..5.0), 0..10).prop_map(AnyStage::Bias),
    ]
}

fn apply_any(s: &AnyStage, buf: &mut OwnedTokens, rng: &mut TestRng) {
    match s {
        AnyStage::TopK(k) => apply_once::<TopK>(&params(&[("k", *k)]), buf, rng),
        AnyStage::TopP(p, m) => {
            apply_once::<TopP>(&params(&[("p", *p), ("min_keep", *m)]), buf, rng)
        }
        AnyStage::MinP(p, m) => {
            apply_once::<MinP>(&params(&[("p", *p), ("min_keep", *m)]), buf, rng)
        }
        AnyStage::Typical(p, m) => {
            apply_once::<TypicalP>(&params(&[("p", *p), ("min_keep", *m)]), buf, rng)
        }
        AnyStage::Temp(t) => apply_once::<Temperature>(&params(&[("t", *t)]), buf, rng),
        AnyStage::Sigma(n) => apply_once::<TopNSigma>(&params(&[("n", *n)]), buf, rng),
        AnyStage::Xtc(p, t) => {
            apply_once::<Xtc>(&params(&[("probability", *p), ("threshold", *t)]), buf, rng)
        }
        AnyStage::Penalties(w, r, f, p) => {
            let pen: Penalties = stage(&[
                ("repeat_penalty", *r),
                ("frequency_penalty", *f),
                ("presence_penalty", *p),
            ]);
            let mut st = pen.new_state();
            for &t in w {
                pen.accept(&mut st, t);
            }
            apply(&pen, &mut st, buf, rng)
        }
        AnyStage::Bias(b) => {
            let lb = OwnedParams::new()
                .token_map("bias", b)
                .build::<LogitBias>()
                .unwrap();
            apply(&lb, &mut (), buf, rng)
        }
    }
    .unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, .. ProptestConfig::default() })]

    #[test]
    fn stages_never_grow_and_never_invent(
        logits in logits_strategy(400),
        chain in prop::collection::vec(stage_strategy(), 1..5),
        dense in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut buf = tokens(&logits, dense);
        let mut rng = TestRng::seeded(seed);
        let mut before_len = buf.len();
        let mut before_ids = buf.survivor_ids();
        for s in &chain {
            let live: Vec<u32> = buf.entries().iter().map(|e| e.0).collect();
            apply_any(s, &mut buf, &mut rng);
            prop_assert!(buf.len() <= before_len, "{s:?} grew {} -> {}", before_len, buf.len());
            let after: Vec<u32> = buf.entries().iter().map(|e| e.0).collect();
            for id in &after {
                prop_assert!(live.contains(id), "{s:?} invented id {id}");
            }
            // no duplicate ids
            let mut d = after.clone();
            d.sort_unstable();
            d.dedup();
            prop_assert_eq!(d.len(), after.len());
            // survivors are a subset (logit bias/penalties can only lower or shift)
            for id in buf.survivor_ids() {
                prop_assert!(before_ids.contains(&id) || matches!(s, AnyStage::Bias(_)), "{s:?}: {id}");
            }
            // the sorted flag tells the truth
            if buf.is_sorted() {
                let e = buf.entries();
                prop_assert!(e.windows(2).all(|w| w[0].1 >= w[1].1), "{s:?} claims sorted");
            }
            before_len = buf.len();
            before_ids = buf.survivor_ids();
        }
    }

    #[test]
    fn dist_picks_a_finite_survivor(
        logits in logits_strategy(500),
        pre in prop::collection::vec(stage_strategy(), 0..3),
        dense in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut buf = tokens(&logits, dense);
        let mut rng = TestRng::seeded(seed);
        for s in &pre {
            apply_any(s, &mut buf, &mut rng);
        }
        let survivors = buf.survivors();
        prop_assume!(!survivors.is_empty());
        let before = buf.entries();
        apply_once::<Dist>(&OwnedParams::new(), &mut buf, &mut rng).unwrap();
        let id = buf.selected().unwrap();
        prop_assert!(survivors.iter().any(|&(i, l)| i == id && l.is_finite()), "picked {id}");
        prop_assert_eq!(buf.entries(), before, "dist modified the candidates");
    }

    #[test]
    fn greedy_picks_the_max(logits in logits_strategy(1000), dense in any::<bool>()) {
        let mut buf = tokens(&logits, dense);
        run::<Greedy>(&[], &mut buf);
        let id = buf.selected().unwrap() as usize;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        prop_assert_eq!(logits[id], max);
        prop_assert_eq!(logits.iter().position(|&l| l == max).unwrap(), id, "first maximum");
    }

    #[test]
    fn same_rng_same_token(logits in logits_strategy(600), seed in any::<u64>(), v2 in any::<bool>()) {
        let pick = |s: u64| {
            let mut buf = OwnedTokens::dense(&logits);
            let mut rng = TestRng::seeded(s);
            if v2 {
                apply_once::<MirostatV2>(&OwnedParams::new(), &mut buf, &mut rng).unwrap();
            } else {
                apply_once::<Xtc>(&params(&[("probability", 0.5)]), &mut buf, &mut rng).unwrap();
                apply_once::<Dist>(&OwnedParams::new(), &mut buf, &mut rng).unwrap();
            }
            buf.selected().unwrap()
        };
        prop_assert_eq!(pick(seed), pick(seed));
    }

    #[test]
    fn dense_and_candidate_views_agree(
        logits in logits_strategy(3000),
        s in stage_strategy(),
    ) {
        let mut a = OwnedTokens::dense(&logits);
        let mut b = OwnedTokens::dense_as_candidates(&logits);
        apply_any(&s, &mut a, &mut TestRng::constant(1 << 62));
        apply_any(&s, &mut b, &mut TestRng::constant(1 << 62));
        if let AnyStage::TopP(p, m) = &s {
            // the two paths may differ only within float rounding of p
            let pairs: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
            let (_, margin) = reference_top_p(&pairs, *p as f32, *m as usize);
            prop_assume!(margin > 1e-5);
        }
        prop_assert_eq!(a.survivor_ids(), b.survivor_ids(), "{:?}", s);
        let la: Vec<(u32, f32)> = { let mut v = a.survivors(); v.sort_by_key(|e| e.0); v };
        let lb: Vec<(u32, f32)> = { let mut v = b.survivors(); v.sort_by_key(|e| e.0); v };
        prop_assert_eq!(la, lb);
    }

    #[test]
    fn penalty_counts_match_a_recount(
        tokens in prop::collection::vec(0u32..50, 0..300),
        last_n in 0i64..40,
    ) {
        let pen: Penalties = stage(&[("repeat_last_n", last_n as f64)]);
        let mut st = pen.new_state();
        for &t in &tokens {
            pen.accept(&mut st, t);
        }
        let window = &tokens[tokens.len().saturating_sub(last_n as usize)..];
        for id in 0..50u32 {
            let want = window.iter().filter(|&&t| t == id).count() as u32;
            prop_assert_eq!(st.count(id), want, "id {}", id);
        }
        prop_assert_eq!(st.counts().len(), {
            let mut w = window.to_vec(); w.sort_unstable(); w.dedup(); w.len()
        });
    }

    #[test]
    fn top_k_matches_sort(logits in logits_strategy(2000), k in 1usize..400, dense in any::<bool>()) {
        let mut buf = tokens(&logits, dense);
        run::<TopK>(&[("k", k as f64)], &mut buf);
        let mut want: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        want.truncate(k);
        prop_assert_eq!(buf.entries(), want);
    }
}
