//! The descriptor, each grammar kind and each refusal, through the C ABI.

mod common;

use std::ffi::CStr;

use common::{Buffer, P, TestVocab, config, stage, tiny_config};
use samplerd_plugin_sdk::abi::*;

fn err(params: &[P<'_>]) -> String {
    match config(params, Some(&TestVocab::tiny())) {
        Ok(_) => panic!("config_new accepted {} params", params.len()),
        Err(e) => e,
    }
}

/// Feeds `text` token by token (single-byte tokens).
fn feed(st: &mut common::State<'_>, v: &TestVocab, text: &str) {
    for b in text.bytes() {
        st.accept(v.id(&[b]))
            .unwrap_or_else(|e| panic!("{text:?} at {b:?}: {e}"));
    }
}

#[test]
fn descriptor_names_the_stage_its_flags_and_params() {
    let s = stage();
    // SAFETY: static NUL-terminated strings and a static spec array.
    let (name, spec) = unsafe {
        (
            CStr::from_ptr(s.name),
            std::slice::from_raw_parts(s.params_spec, s.n_params_spec),
        )
    };
    assert_eq!(name, c"constraint");
    assert_eq!(
        s.flags,
        SD_STAGE_NEEDS_VOCAB
            | SD_STAGE_DENSE_OK
            | SD_STAGE_OUTPUT_ONLY
            | SD_STAGE_SPARSE_LOWERS_ONLY
    );
    let params: Vec<(String, u32)> = spec
        .iter()
        .map(|p| {
            (
                // SAFETY: static NUL-terminated names.
                unsafe { CStr::from_ptr(p.name) }
                    .to_str()
                    .unwrap()
                    .to_string(),
                p.kind,
            )
        })
        .collect();
    let want = [
        ("json_schema", SD_PARAM_STRING),
        ("regex", SD_PARAM_STRING),
        ("lark", SD_PARAM_STRING),
        ("gbnf", SD_PARAM_STRING),
        ("json_object", SD_PARAM_NUMBER),
        ("choice", SD_PARAM_STRING_LIST),
        ("json_whitespace", SD_PARAM_STRING),
        ("max_fuel", SD_PARAM_NUMBER),
        ("ahead_min_us", SD_PARAM_NUMBER),
        ("trigger_strings", SD_PARAM_STRING_LIST),
        ("trigger_tokens", SD_PARAM_STRING_LIST),
    ];
    assert_eq!(params, want.map(|(n, k)| (n.to_string(), k)));
    assert_eq!(spec[7].default_number, 1_000_000.0);
    assert_eq!(spec[8].default_number, 15.0);
}

#[test]
fn regex_masks_to_the_next_bytes_and_allows_stopping_only_at_the_end() {
    let (v, cfg) = tiny_config(&[P::Str("regex", "ab+c")]);
    let mut st = cfg.state();
    let (a, b, c, ab, abc) = (
        v.id(b"a"),
        v.id(b"b"),
        v.id(b"c"),
        v.id(b"ab"),
        v.id(b"abc"),
    );
    assert_eq!(st.allowed(v.len()).unwrap(), vec![a, ab, abc]);
    st.accept(a).unwrap();
    assert_eq!(st.allowed(v.len()).unwrap(), vec![b]);
    st.accept(b).unwrap();
    assert_eq!(st.allowed(v.len()).unwrap(), vec![b, c]);
    st.accept(c).unwrap();
    // complete, nothing can follow: only the two end-of-generation tokens
    assert_eq!(st.allowed(v.len()).unwrap(), v.eog_ids());
    st.accept(v.eog_ids()[1]).unwrap();
    assert_eq!(st.allowed(v.len()).unwrap(), v.eog_ids());
}

#[test]
fn an_accepting_grammar_that_may_go_on_allows_text_and_stop() {
    let (v, cfg) = tiny_config(&[P::Str("regex", "a+")]);
    let mut st = cfg.state();
    st.accept(v.id(b"a")).unwrap();
    let mut want = vec![v.id(b"a")];
    want.extend(v.eog_ids());
    assert_eq!(st.allowed(v.len()).unwrap(), want);
}

#[test]
fn a_refused_token_is_named_with_its_escaped_bytes_and_leaves_the_state_usable() {
    let (v, cfg) = tiny_config(&[P::Str("regex", "ab")]);
    let mut st = cfg.state();
    let nl = v.id(b"\n");
    assert_eq!(
        st.accept(nl).unwrap_err(),
        format!("constraint: token {nl} (\"\\n\") is not allowed by the grammar here")
    );
    let eos = v.eog_ids()[0];
    assert_eq!(
        st.accept(eos).unwrap_err(),
        format!("constraint: token {eos} (special \"<|eos|>\") is not allowed by the grammar here")
    );
    let ctl = v.id(b"<|im_start|>");
    assert!(st.accept(ctl).is_err(), "a control token is never text");
    // The request's fault, not the stage's: the host answers
    // INVALID_ARGUMENT, not INTERNAL.
    assert_eq!(st.accept_code(nl).0, SD_ERR_INPUT);
    assert_eq!(st.accept_code(v.len() as u32 + 5).0, SD_ERR_INPUT);
    let byte = v.id(&[0xC3]);
    assert_eq!(
        st.accept(byte).unwrap_err(),
        format!("constraint: token {byte} (\"\\xc3\") is not allowed by the grammar here")
    );
    feed(&mut st, &v, "ab");
    let a = v.id(b"a");
    assert!(st.accept(a).is_err(), "nothing may follow a complete match");
    st.accept(eos).unwrap();
}

#[test]
fn json_schema_constrains_to_the_schema() {
    let schema = r#"{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"],"additionalProperties":false}"#;
    let (v, cfg) = tiny_config(&[P::Str("json_schema", schema)]);
    let mut st = cfg.state();
    assert!(!st.allowed(v.len()).unwrap().contains(&v.id(b"[")));
    st.accept(v.id(b"{\"")).unwrap();
    feed(&mut st, &v, "ok");
    st.accept(v.id(b"\":")).unwrap();
    assert!(st.accept(v.id(b"null")).is_err(), "ok is a boolean");
    st.accept(v.id(b"true")).unwrap();
    assert!(!st.allowed(v.len()).unwrap().contains(&v.eog_ids()[0]));
    feed(&mut st, &v, "}");
    assert!(st.allowed(v.len()).unwrap().contains(&v.eog_ids()[0]));
}

#[test]
fn json_object_allows_any_object_only() {
    let (v, cfg) = tiny_config(&[P::Num("json_object", 1.0)]);
    let mut st = cfg.state();
    assert!(st.accept(v.id(b"[")).is_err());
    feed(&mut st, &v, "{\"x\":[1,\"y\",null]}");
    assert!(st.allowed(v.len()).unwrap().contains(&v.eog_ids()[0]));
}

/// Whether `ws` may follow `{` under the JSON grammar of `params`, then a key.
fn object_opens_with(params: &[P<'_>], ws: &str) -> bool {
    let (v, cfg) = tiny_config(params);
    let mut st = cfg.state();
    st.accept(v.id(b"{")).unwrap();
    ws.bytes().all(|b| st.accept(v.id(&[b])).is_ok()) && st.accept(v.id(b"\"")).is_ok()
}

#[test]
fn json_whitespace_is_bounded_as_llama_cpp_unless_asked_otherwise() {
    let schema = P::Str("json_schema", r#"{"type":"object"}"#);
    let object = P::Num("json_object", 1.0);
    let long_line = format!("\n\n{}", " ".repeat(20));
    for grammar in [schema, object] {
        for (ws, bounded) in [
            ("", true),
            (" ", true),
            ("\n", true),
            (long_line.as_str(), true),
            ("\n\t \t", true),
            ("  ", false),
            ("\n\n\n", false),
            (&format!("\n{}", " ".repeat(21)), false),
            ("\r\n", false),
        ] {
            assert_eq!(object_opens_with(&[grammar], ws), bounded, "bounded {ws:?}");
            let compact = P::Str("json_whitespace", "compact");
            assert_eq!(
                object_opens_with(&[grammar, compact], ws),
                ws.is_empty(),
                "compact {ws:?}"
            );
            let free = P::Str("json_whitespace", "free");
            assert!(object_opens_with(&[grammar, free], ws), "free {ws:?}");
        }
        let many = "\n".repeat(200);
        assert!(object_opens_with(
            &[grammar, P::Str("json_whitespace", "free")],
            &many
        ));
    }
    // The schema's own llguidance options win over the parameter.
    let own = P::Str(
        "json_schema",
        r#"{"type":"object","x-guidance":{"whitespace_flexible":false}}"#,
    );
    assert!(!object_opens_with(&[own], " "));
    // `true` (any JSON value) is bounded too.
    let (v, cfg) = tiny_config(&[P::Str("json_schema", "true")]);
    let mut st = cfg.state();
    st.accept(v.id(b"[")).unwrap();
    st.accept(v.id(b" ")).unwrap();
    assert!(st.accept(v.id(b" ")).is_err(), "a second space after [");
}

#[test]
fn json_whitespace_refuses_other_values_and_other_grammars() {
    let e = err(&[
        P::Num("json_object", 1.0),
        P::Str("json_whitespace", "pretty"),
    ]);
    assert!(
        e.contains("json_whitespace") && e.contains("\"pretty\""),
        "{e}"
    );
    assert!(e.contains("bounded, compact, free"), "{e}");
    let e = err(&[P::Str("regex", "a"), P::Str("json_whitespace", "free")]);
    assert!(e.contains("json_whitespace") && e.contains("regex"), "{e}");
}

#[test]
fn choice_allows_exactly_one_of_the_strings() {
    let (v, cfg) = tiny_config(&[P::List("choice", &["yes", "no", "maybe \"so\""])]);
    let mut st = cfg.state();
    let first = st.allowed(v.len()).unwrap();
    for t in ["yes", "no", "maybe", "y", "n", "m"] {
        assert!(first.contains(&v.id(t.as_bytes())), "{t}");
    }
    assert!(!first.contains(&v.id(b"ab")));
    let mut fork = st.fork();
    st.accept(v.id(b"no")).unwrap();
    assert_eq!(st.allowed(v.len()).unwrap(), v.eog_ids());
    fork.accept(v.id(b"maybe")).unwrap();
    feed(&mut fork, &v, " \"so\"");
    assert_eq!(fork.allowed(v.len()).unwrap(), v.eog_ids());
}

#[test]
fn lark_grammar_with_rules_and_terminals() {
    let lark = "start: pair (\",\" pair)*\npair: KEY \"=\" VALUE\nKEY: /[a-z]+/\nVALUE: /[0-9]+/";
    let (v, cfg) = tiny_config(&[P::Str("lark", lark)]);
    let mut st = cfg.state();
    feed(&mut st, &v, "ab=12,c=3");
    assert!(st.accept(v.id(b"=")).is_err());
    assert!(st.allowed(v.len()).unwrap().contains(&v.eog_ids()[0]));
}

#[test]
fn candidate_view_drops_disallowed_candidates_keeping_order_and_sortedness() {
    let (v, cfg) = tiny_config(&[P::Str("regex", "[ab]c")]);
    let mut st = cfg.state();
    let mut buf = Buffer::new(v.len());
    let (a, b, c, ab) = (v.id(b"a"), v.id(b"b"), v.id(b"c"), v.id(b"ab"));
    buf.load_candidates(&[(c, 9.0), (b, 5.0), (ab, 4.0), (a, 1.0)], true);
    st.apply(&mut buf).unwrap();
    assert_eq!(buf.raw.view, SD_VIEW_CANDIDATES);
    assert_eq!(buf.raw.size, 2);
    assert_eq!(buf.raw.sorted, 1);
    assert_eq!(
        &buf.cand[..2],
        &[
            SdCandidate { id: b, logit: 5.0 },
            SdCandidate { id: a, logit: 1.0 }
        ]
    );
    // dense view, few tokens allowed: a candidate list of them in id
    // order (not sorted by logit), their logits as they were
    let logits: Vec<f32> = (0..v.len()).map(|i| i as f32).collect();
    buf.load_dense(&logits);
    st.apply(&mut buf).unwrap();
    assert_eq!(buf.raw.view, SD_VIEW_CANDIDATES);
    assert_eq!(buf.raw.sorted, 0);
    let (lo, hi) = (a.min(b), a.max(b));
    assert_eq!(
        &buf.cand[..buf.raw.size],
        &[
            SdCandidate {
                id: lo,
                logit: lo as f32
            },
            SdCandidate {
                id: hi,
                logit: hi as f32
            }
        ]
    );
}

#[test]
fn dense_view_stays_dense_when_most_tokens_are_allowed() {
    let v = TestVocab::tiny();
    // Any text without a quote: nearly every token is allowed.
    let cfg = config(&[P::Str("regex", "[^\"]*")], Some(&v)).unwrap();
    let mut st = cfg.state();
    let mut buf = Buffer::new(v.len());
    let logits: Vec<f32> = (0..v.len()).map(|i| i as f32 - 100.0).collect();
    buf.load_dense(&logits);
    st.apply(&mut buf).unwrap();
    assert_eq!(buf.raw.view, SD_VIEW_DENSE);
    let kept = buf.survivors();
    assert!(
        kept.len() * 8 > v.len(),
        "{} of {} kept",
        kept.len(),
        v.len()
    );
    let quote = v.id(b"\"}");
    assert!(!kept.contains(&quote), "a token with a quote survived");
    assert_eq!(buf.dense[quote as usize], f32::NEG_INFINITY);
    for id in kept {
        assert_eq!(buf.dense[id as usize], logits[id as usize]);
    }
}

#[test]
fn clones_are_independent_and_reset_restarts() {
    let (v, cfg) = tiny_config(&[P::Str("regex", "(ab|ac)d")]);
    let mut st = cfg.state();
    st.accept(v.id(b"a")).unwrap();
    let mut fork = st.fork();
    st.accept(v.id(b"b")).unwrap();
    assert_eq!(st.allowed(v.len()).unwrap(), vec![v.id(b"d")]);
    // the fork is still after "a", unaffected by the original's "b"
    assert_eq!(fork.allowed(v.len()).unwrap(), vec![v.id(b"b"), v.id(b"c")]);
    fork.accept(v.id(b"c")).unwrap();
    assert!(st.accept(v.id(b"c")).is_err());
    st.reset();
    assert_eq!(st.allowed(v.len()).unwrap(), vec![v.id(b"a"), v.id(b"ab")]);
    fork.accept(v.id(b"d")).unwrap();
    assert_eq!(fork.allowed(v.len()).unwrap(), v.eog_ids());
}

#[test]
fn refusals_name_the_parameter_and_llguidance_s_reason() {
    // no or several grammars
    assert_eq!(
        err(&[]),
        "constraint: needs exactly one of json_schema, regex, lark, gbnf, json_object, choice, got none"
    );
    assert_eq!(
        err(&[P::Str("regex", "a"), P::Str("lark", "start: \"a\"")]),
        "constraint: needs exactly one of json_schema, regex, lark, gbnf, json_object, choice, got regex and lark"
    );
    assert_eq!(
        err(&[P::Num("json_object", 0.0)]),
        "constraint: needs exactly one of json_schema, regex, lark, gbnf, json_object, choice, got none"
    );
    assert_eq!(
        err(&[P::Num("json_object", 2.0)]),
        "constraint: json_object: must be 0 (off) or 1 (on), got 2"
    );
    assert_eq!(
        err(&[P::List("choice", &[])]),
        "constraint: choice: needs at least one string, got an empty list"
    );
    // invalid inputs, with llguidance's or serde_json's position
    assert_eq!(
        err(&[P::Str("json_schema", "{\"type\": }")]),
        "constraint: json_schema: not valid JSON: expected value at line 1 column 10"
    );
    assert_eq!(
        err(&[P::Str("json_schema", r#"{"type":"strin"}"#)]),
        "constraint: json_schema: Invalid type: strin"
    );
    assert_eq!(
        err(&[P::Str("regex", "a(b")]),
        "constraint: regex: invalid regex \"a(b\" (in regex): regex parse error: a(b error: unclosed group"
    );
    assert_eq!(
        err(&[P::Str("lark", "start: foo")]),
        "constraint: lark: at 1(8): unknown name: \"foo\""
    );
    // line 2, column 10
    assert_eq!(
        err(&[P::Str("lark", "start: \"a\"\nfoo: (\"b\"")]),
        "constraint: lark: 2(10): Expected token ')', found '\\n' (at \"\\n\" ('\\n'))"
    );
    assert_eq!(
        err(&[P::Str("gbnf", "root ::= [ab")]),
        "constraint: gbnf: unterminated character class at line 1, column 10"
    );
    // strict JSON Schema: an unsupported keyword is refused by name
    let e = err(&[P::Str(
        "json_schema",
        r#"{"type":"array","uniqueItems":true}"#,
    )]);
    assert_eq!(
        e,
        "constraint: json_schema: Unimplemented keys: [\"uniqueItems\"]"
    );
    assert_eq!(
        err(&[P::Str("json_schema", r#"{"not":{"type":"string"}}"#)]),
        "constraint: json_schema: Unimplemented keys: [\"not\"]"
    );
    assert_eq!(
        err(&[P::Str("json_schema", r#"{"if":{"type":"string"}}"#)]),
        "constraint: json_schema: Unimplemented keys: [\"if\"]"
    );
    // ... unless the schema opts into llguidance's lenient mode
    let lenient = r#"{"type":"array","uniqueItems":true,"x-guidance":{"lenient":true}}"#;
    config(&[P::Str("json_schema", lenient)], Some(&TestVocab::tiny())).unwrap();
    // grammars that match nothing
    assert_eq!(
        err(&[P::Str(
            "json_schema",
            r#"{"type":"integer","minimum":5,"maximum":1}"#
        )]),
        "constraint: json_schema: Unsatisfiable schema: minimum (5) is greater than maximum (1)"
    );
    assert_eq!(
        err(&[P::Str("json_schema", "false")]),
        "constraint: json_schema: Unsatisfiable schema: schema is false"
    );
    assert_eq!(
        err(&[P::Str("regex", "[^\\x00-\\x{10FFFF}]")]),
        "constraint: regex: the grammar matches nothing"
    );
    // max_fuel
    assert_eq!(
        err(&[P::Str("regex", "a"), P::Num("max_fuel", 0.0)]),
        "constraint: max_fuel: must be a whole number in [1, 10000000], got 0"
    );
    assert_eq!(
        err(&[P::Str("regex", "a"), P::Num("ahead_min_us", -1.0)]),
        "constraint: ahead_min_us: must be in [0, 1000000] (microseconds), got -1"
    );
}

#[test]
fn refusals_about_the_vocabulary() {
    assert_eq!(
        config(&[P::Str("regex", "a")], None).err().unwrap(),
        "constraint: needs a vocabulary (the model's tokens), and no model is loaded"
    );
    let no_eog = TestVocab::new(vec![(b"a".to_vec(), 0), (b"b".to_vec(), 0)]);
    assert_eq!(
        config(&[P::Str("regex", "a")], Some(&no_eog))
            .err()
            .unwrap(),
        "constraint: needs a vocabulary with an end-of-generation token (SD_TOKEN_EOG), \
         and this one of 2 tokens has none, so a constrained generation could never stop"
    );
    let (v, cfg) = tiny_config(&[P::Str("regex", "a")]);
    let mut st = cfg.state();
    assert_eq!(
        st.accept(v.len() as u32).unwrap_err(),
        format!(
            "constraint: token {} is outside the vocabulary of {} tokens",
            v.len(),
            v.len()
        )
    );
}
