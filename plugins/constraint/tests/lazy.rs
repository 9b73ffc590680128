//! Lazy constraints through the C ABI: free text until a trigger, then the
//! grammar from right after it.

mod common;

use common::{P, TestVocab, config, tiny_config};

const DIGITS: P<'static> = P::Str("regex", "y\n[0-9]+");

#[test]
fn before_a_trigger_string_nothing_is_masked_after_it_the_grammar_holds() {
    let (v, cfg) = tiny_config(&[DIGITS, P::List("trigger_strings", &["x="])]);
    let mut st = cfg.state();
    let all: Vec<u32> = (0..v.len() as u32).collect();
    assert_eq!(st.allowed(v.len()).unwrap(), all, "free text before");
    for b in *b"no! [x" {
        st.accept(v.id(&[b])).unwrap();
        assert_eq!(st.allowed(v.len()).unwrap(), all);
    }
    // `=y\n` ends the trigger `x=` (begun by the previous token) and its
    // rest `y\n` goes to the grammar: digits next.
    st.accept(v.id(b"=y\n")).unwrap();
    let mut digits: Vec<u32> = (b'0'..=b'9').map(|d| v.id(&[d])).collect();
    digits.push(v.id(b"12"));
    assert_eq!(st.allowed(v.len()).unwrap(), digits);
    assert!(st.accept(v.id(b"a")).is_err());
    st.accept(v.id(b"12")).unwrap();
    assert!(st.allowed(v.len()).unwrap().contains(&v.eog_ids()[0]));
}

#[test]
fn the_rest_of_the_triggering_token_must_suit_the_grammar() {
    let (v, cfg) = tiny_config(&[
        P::Str("regex", "[0-9]+"),
        P::List("trigger_strings", &["x"]),
    ]);
    let mut st = cfg.state();
    // `x=` triggers at its `x`, and `=` is not a digit.
    let e = st.accept(v.id(b"x=")).unwrap_err();
    assert_eq!(
        e,
        format!(
            "constraint: the text \"=\" after the trigger in token {} is not allowed by the grammar",
            v.id(b"x=")
        )
    );
}

#[test]
fn a_trigger_token_starts_the_grammar_at_the_next_token_and_fork_and_reset_keep_the_wait() {
    let v = TestVocab::tiny();
    let think = v.id(b"<|im_start|>");
    let cfg = config(
        &[
            P::Str("regex", "ab"),
            P::List("trigger_tokens", &[&think.to_string()]),
        ],
        Some(&v),
    )
    .unwrap();
    let mut st = cfg.state();
    st.accept(v.id(b"abc")).unwrap();
    let waiting = st.fork();
    st.accept(think).unwrap();
    assert_eq!(st.allowed(v.len()).unwrap(), vec![v.id(b"a"), v.id(b"ab")]);
    let mut w = waiting;
    assert_eq!(
        w.allowed(v.len()).unwrap().len(),
        v.len(),
        "the fork still waits"
    );
    st.reset();
    assert_eq!(
        st.allowed(v.len()).unwrap().len(),
        v.len(),
        "reset waits again"
    );
}

#[test]
fn a_special_tokens_text_matches_a_trigger_string() {
    let (v, cfg) = tiny_config(&[
        P::Str("regex", "ab"),
        P::List("trigger_strings", &["<|im_start|>"]),
    ]);
    let mut st = cfg.state();
    st.accept(v.id(b"<|im_start|>")).unwrap();
    assert_eq!(st.allowed(v.len()).unwrap(), vec![v.id(b"a"), v.id(b"ab")]);
}

#[test]
fn bad_triggers_are_refused_naming_the_parameter_and_value() {
    let v = TestVocab::tiny();
    let n = v.len();
    for (params, want) in [
        (
            vec![P::Str("regex", "a"), P::List("trigger_strings", &["x", ""])],
            "constraint: trigger_strings[1]: must not be empty (an empty trigger is always there)"
                .to_string(),
        ),
        (
            vec![P::Str("regex", "a"), P::List("trigger_tokens", &["99999"])],
            format!(
                "constraint: trigger_tokens[0]: token 99999 is outside the vocabulary of {n} tokens"
            ),
        ),
    ] {
        assert_eq!(config(&params, Some(&v)).err().unwrap(), want);
    }
}
