//! Property: every sequence sampled under the mask is accepted token by
//! token, the mask never removes every token while the grammar is
//! incomplete, and a sequence that ends (with an end-of-generation token,
//! allowed only where the grammar may stop) is valid under an independent
//! check of the grammar.

mod common;

use common::{P, tiny_config, walk};
use proptest::prelude::*;

const MAX_STEPS: usize = 120;

/// `t` as JSON, or `None` for valid JSON text with a number beyond f64
/// (JSON and the grammars allow exponents serde_json cannot hold).
fn json(t: &str) -> Option<serde_json::Value> {
    match serde_json::from_str(t) {
        Ok(v) => Some(v),
        Err(e) if e.to_string().starts_with("number out of range") => None,
        Err(e) => panic!("{t:?}: {e}"),
    }
}

fn walks(params: &[P<'_>], seed: u64, check: impl Fn(&str)) {
    let (v, cfg) = tiny_config(params);
    let w = walk(&cfg, &v, seed, MAX_STEPS, 0.3);
    if w.ended {
        let text = String::from_utf8(w.text).expect("UTF-8 output");
        check(&text);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn regex_walks(seed: u64) {
        let rx = "[a-c]{1,3}(x=|=y\n)?[0-9]{0,4}(é|no)?";
        let full = regex::Regex::new(&format!("^(?:{rx})$")).unwrap();
        walks(&[P::Str("regex", rx)], seed, |t| assert!(full.is_match(t), "{t:?}"));
    }

    #[test]
    fn json_schema_walks(seed: u64) {
        let schema = r#"{"type":"object","properties":{
            "n":{"type":"integer","minimum":-5,"maximum":500},
            "s":{"type":"string","maxLength":4},
            "b":{"type":"boolean"},
            "e":{"enum":["yes","no",null]}},
            "required":["n","b"],"additionalProperties":false}"#;
        walks(&[P::Str("json_schema", schema)], seed, |t| {
            let v: serde_json::Value = serde_json::from_str(t).unwrap_or_else(|e| panic!("{t:?}: {e}"));
            let o = v.as_object().unwrap_or_else(|| panic!("not an object: {t:?}"));
            // "-0" is an integer under JSON Schema; serde_json reads it as -0.0
            let n = o["n"]
                .as_i64()
                .or_else(|| (o["n"].as_f64() == Some(0.0)).then_some(0))
                .unwrap_or_else(|| panic!("n is not an integer: {t:?}"));
            assert!((-5..=500).contains(&n), "{t}");
            assert!(o["b"].is_boolean(), "{t}");
            if let Some(s) = o.get("s") {
                assert!(s.as_str().unwrap().chars().count() <= 4, "{t}");
            }
            if let Some(e) = o.get("e") {
                assert!(e.is_null() || e == "yes" || e == "no", "{t}");
            }
            assert!(o.keys().all(|k| ["n", "s", "b", "e"].contains(&k.as_str())), "{t}");
        });
    }

    #[test]
    fn json_object_walks(seed: u64) {
        walks(&[P::Num("json_object", 1.0)], seed, |t| {
            assert!(t.trim_start().starts_with('{'), "{t:?}");
            if let Some(v) = json(t) {
                assert!(v.is_object(), "{t}");
            }
        });
    }

    #[test]
    fn choice_walks(seed: u64) {
        let list = ["yes", "no", "maybe", "ab", "abc", "a"];
        walks(&[P::List("choice", &list)], seed, |t| assert!(list.contains(&t), "{t:?}"));
    }

    #[test]
    fn lark_walks(seed: u64) {
        let lark = "start: pair (\",\" pair)*\npair: KEY \"=\" VALUE\nKEY: /[a-z]{1,3}/\nVALUE: /[0-9]{1,3}/";
        let full = regex::Regex::new("^[a-z]{1,3}=[0-9]{1,3}(,[a-z]{1,3}=[0-9]{1,3})*$").unwrap();
        walks(&[P::Str("lark", lark)], seed, |t| assert!(full.is_match(t), "{t:?}"));
    }

    #[test]
    fn llama_cpp_json_gbnf_walks(seed: u64) {
        let g = include_str!("grammars/json.gbnf");
        walks(&[P::Str("gbnf", g)], seed, |t| {
            assert!(t.starts_with('{'), "{t:?}");
            if let Some(v) = json(t) {
                assert!(v.is_object(), "{t}");
            }
        });
    }

    #[test]
    fn llama_cpp_arithmetic_gbnf_walks(seed: u64) {
        let g = include_str!("grammars/arithmetic.gbnf");
        // Each line: expr "=" ws term "\n", with ws = [ \t\n]*.
        walks(&[P::Str("gbnf", g)], seed, |t| {
            assert!(t.ends_with('\n') && t.contains('='), "{t:?}");
        });
    }
}
