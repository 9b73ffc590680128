//! `penalties`' `exclude_tokens` against llama.cpp's former `penalize_nl =
//! false` (`llama_sampler_penalties_apply`, src/llama-sampling.cpp, before
//! the option was removed: penalise, then restore the spared token's logit): over random windows and logits, in
//! both views, the stage with exclusions equals the stage without them
//! with the spared ids' logits put back.

mod common;

use common::*;
use proptest::prelude::*;
use samplerd_core_stages::penalties::Penalties;
use samplerd_plugin_sdk::Stage;

const N: usize = 16;
const NUMS: &[(&str, f64)] = &[
    ("repeat_last_n", 8.0),
    ("repeat_penalty", 1.3),
    ("frequency_penalty", 0.25),
    ("presence_penalty", 0.5),
];

fn with_exclusions(exclude: &[u32]) -> Penalties {
    let ids: Vec<String> = exclude.iter().map(u32::to_string).collect();
    NUMS.iter()
        .fold(OwnedParams::new(), |p, &(n, v)| p.number(n, v))
        .strings(
            "exclude_tokens",
            &ids.iter().map(String::as_str).collect::<Vec<_>>(),
        )
        .build::<Penalties>()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn excluded_tokens_keep_their_logits_and_others_are_penalised_as_before(
        window in proptest::collection::vec(0u32..N as u32, 0..20),
        exclude in proptest::collection::vec(0u32..N as u32 + 4, 0..5),
        logits in proptest::collection::vec(-8.0f32..8.0, N),
    ) {
        let (plain, mut plain_st) = penalties_after(NUMS, &window);
        let spare = with_exclusions(&exclude);
        let mut spare_st = spare.new_state();
        for &t in &window {
            spare.accept(&mut spare_st, t);
        }
        for (mut want, mut got) in both_views(&logits).into_iter().zip(both_views(&logits)) {
            penalise(&plain, &mut plain_st, &mut want);
            penalise(&spare, &mut spare_st, &mut got);
            let mut want = want.entries();
            for (id, l) in want.iter_mut() {
                if exclude.contains(id) {
                    *l = logits[*id as usize];
                }
            }
            want.sort_by_key(|e| e.0);
            let mut got = got.entries();
            got.sort_by_key(|e| e.0);
            prop_assert_eq!(got, want);
        }
    }
}

#[test]
fn a_bad_exclusion_names_the_parameter_and_value() {
    let err = OwnedParams::new()
        .strings("exclude_tokens", &["3", "-1"])
        .build::<Penalties>()
        .err()
        .unwrap();
    assert_eq!(
        err,
        "penalties: exclude_tokens holds \"-1\", which is not a token id (a decimal u32)"
    );
}
