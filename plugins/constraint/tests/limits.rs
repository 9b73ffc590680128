//! Hostile inputs are refused or run within bounds: an oversized source,
//! a schema that exceeds llguidance's grammar-size limit, the lexer budget
//! (`max_fuel`), and pathological regexes over long inputs.

mod common;

use std::time::{Duration, Instant};

use common::{P, TestVocab, config, tiny_config};

/// Generous bound for a debug-free build on a loaded 2-core machine; the
/// measured times are printed (`--nocapture`) and far below it.
const BOUND: Duration = Duration::from_secs(10);

fn timed<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let r = f();
    let took = t.elapsed();
    println!("{what}: {took:?}");
    assert!(took < BOUND, "{what} took {took:?}");
    r
}

#[test]
fn a_10_mb_schema_is_refused_by_size_before_parsing() {
    let v = TestVocab::tiny();
    let props: String = (0..400_000)
        .map(|i| format!("\"p{i}\":{{\"type\":\"string\"}},"))
        .collect();
    let schema = format!(
        "{{\"type\":\"object\",\"properties\":{{{}}}}}",
        props.trim_end_matches(',')
    );
    assert!(schema.len() > 10_000_000);
    let e = timed("10 MB schema", || {
        config(&[P::Str("json_schema", &schema)], Some(&v))
            .err()
            .unwrap()
    });
    assert_eq!(
        e,
        format!(
            "constraint: json_schema: {} bytes is over the limit of 1048576 bytes",
            schema.len()
        )
    );
}

#[test]
fn a_large_schema_under_the_size_limit_compiles_or_is_refused_within_bounds() {
    let v = TestVocab::tiny();
    // ~0.9 MB: 20,000 properties, each its own pattern.
    let props: String = (0..20_000)
        .map(|i| format!("\"p{i}\":{{\"type\":\"string\",\"pattern\":\"^x{i}$\"}},"))
        .collect();
    let schema = format!(
        "{{\"type\":\"object\",\"properties\":{{{}}}}}",
        props.trim_end_matches(',')
    );
    assert!(schema.len() < 1 << 20, "{}", schema.len());
    let r = timed("1 MB schema", || {
        config(&[P::Str("json_schema", &schema)], Some(&v)).err()
    });
    if let Some(e) = r {
        assert!(e.starts_with("constraint: json_schema: "), "{e}");
        println!("refused: {e}");
    }
}

#[test]
fn max_fuel_bounds_the_lexer_work_of_building_a_grammar() {
    // A regex whose automaton has 2^k states (the k-th last byte is "a").
    let rx = "[ab]*a[ab]{16}";
    // llguidance builds the automaton lazily, so this compiles; each step
    // then runs under llguidance's per-step lexer budget: 300 steps of
    // "a"/"b" either pass or fail with a lexer-budget error, in bounded time.
    let (v, cfg) = tiny_config(&[P::Str("regex", rx)]);
    let mut st = cfg.state();
    let r: Result<(), String> = timed("300 steps of [ab]*a[ab]{16}", || {
        for i in 0..300u64 {
            st.allowed(v.len())?;
            let t = if (i * 0x9E37_79B9) >> 7 & 1 == 0 {
                b"a"
            } else {
                b"b"
            };
            st.accept(v.id(t))?;
        }
        Ok(())
    });
    if let Err(e) = r {
        assert!(e.contains("lexer"), "{e}");
    }
    let schema = r#"{"type":"object","properties":{"a":{"type":"string","pattern":"^[a-z]{3,9}@[a-z]{2,5}\\.(com|org)$"}}}"#;
    let e = timed("schema at max_fuel 10", || {
        config(
            &[P::Str("json_schema", schema), P::Num("max_fuel", 10.0)],
            Some(&v),
        )
        .err()
    });
    assert_eq!(
        e.as_deref(),
        Some(
            "constraint: json_schema: initial lexer configuration (grammar) too big \
             (limit for this grammar: 10)"
        )
    );
    // the default budget builds it
    timed("schema at the default", || {
        config(&[P::Str("json_schema", schema)], Some(&v)).unwrap()
    });
}

/// Feeds `n` × "a" then a final "b", computing the mask at every step.
fn long_walk(rx: &str, n: usize) -> Result<(), String> {
    let v = TestVocab::tiny();
    let cfg = config(&[P::Str("regex", rx)], Some(&v))?;
    let mut st = cfg.state();
    let (a, b) = (v.id(b"a"), v.id(b"b"));
    for _ in 0..n {
        let allowed = st.allowed(v.len())?;
        assert!(allowed.contains(&a) && allowed.contains(&b));
        st.accept(a)?;
    }
    st.accept(b)?;
    assert_eq!(st.allowed(v.len())?, v.eog_ids());
    Ok(())
}

#[test]
fn pathological_regexes_over_long_inputs_stay_bounded() {
    for rx in [
        "(a|aa)*b",
        "((a*)*)*b",
        "(a|a?)+b",
        "(a{1,10}){0,10}(a|aa)*b",
    ] {
        let r = timed(rx, || long_walk(rx, 2_000));
        r.unwrap_or_else(|e| panic!("{rx}: {e}"));
    }
}
