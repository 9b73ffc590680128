//! llama.cpp's own GBNF grammars (vendored in `grammars/`, see its
//! README), through the stage.

mod common;

use common::{P, State, TestVocab, tiny_config};

fn feed(st: &mut State<'_>, v: &TestVocab, text: &str) -> Result<(), String> {
    text.bytes().try_for_each(|b| st.accept(v.id(&[b])))
}

fn may_stop(st: &mut State<'_>, v: &TestVocab) -> bool {
    st.allowed(v.len()).unwrap().contains(&v.eog_ids()[0])
}

#[test]
fn json_gbnf_accepts_json_and_refuses_what_it_is_not() {
    let (v, cfg) = tiny_config(&[P::Str("gbnf", include_str!("grammars/json.gbnf"))]);
    let mut st = cfg.state();
    feed(
        &mut st,
        &v,
        "{\"a\": [1, -2.5e3, \"x\\u00e9\\n\"], \"b\": {\"c\": null}}",
    )
    .unwrap();
    assert!(may_stop(&mut st, &v));
    // a multi-byte character, as its two byte tokens and as one token
    let mut st = cfg.state();
    feed(&mut st, &v, "{\"").unwrap();
    st.accept(0xC3).unwrap();
    st.accept(0xA9).unwrap();
    st.accept(v.id("é".as_bytes())).unwrap();
    feed(&mut st, &v, "\":true}").unwrap();
    assert!(may_stop(&mut st, &v));
    let mut st = cfg.state();
    assert!(feed(&mut st, &v, "[1]").is_err(), "the root is an object");
    let mut st = cfg.state();
    assert!(feed(&mut st, &v, "{\"a\":01}").is_err(), "no leading zero");
    let mut st = cfg.state();
    feed(&mut st, &v, "{\"a\":1").unwrap();
    assert!(!may_stop(&mut st, &v), "incomplete");
}

/// The Python converter's version of this grammar could never end a line
/// (its greedy `NUM` terminal ate the "\n"): here lines end and stop.
#[test]
fn arithmetic_gbnf_lines_end() {
    let (v, cfg) = tiny_config(&[P::Str("gbnf", include_str!("grammars/arithmetic.gbnf"))]);
    let mut st = cfg.state();
    feed(&mut st, &v, "x=12\n").unwrap();
    assert!(may_stop(&mut st, &v));
    feed(&mut st, &v, "(a1 +b)*3= 7 \n").unwrap();
    assert!(may_stop(&mut st, &v));
    let mut st = cfg.state();
    feed(&mut st, &v, "x=").unwrap();
    assert!(!may_stop(&mut st, &v));
    assert!(feed(&mut st, &v, "=").is_err());
}

/// `\U` escapes (the Python converter's output for them does not compile).
#[test]
fn unicode_escapes_compile_and_match() {
    let g = "root ::= [\\U00000080-\\U0010FFFF] \"\\u0021\"";
    let (v, cfg) = tiny_config(&[P::Str("gbnf", g)]);
    let mut st = cfg.state();
    st.accept(v.id("é".as_bytes())).unwrap();
    assert!(st.accept(v.id(b"a")).is_err());
    st.accept(v.id(b"!")).unwrap();
    assert_eq!(st.allowed(v.len()).unwrap(), v.eog_ids());
    let mut st = cfg.state();
    assert!(st.accept(v.id(b"a")).is_err(), "ASCII is outside the class");
}
