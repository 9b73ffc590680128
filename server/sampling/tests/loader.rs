//! Loader tests with real shared libraries: the core plugin, the C example,
//! a plugin that panics, a plugin built for another ABI version, and files
//! that are not plugins at all.

mod common;

use common::*;
use samplerd_sampling::params::TYPED_FIELDS;
use samplerd_sampling::{
    ChainError, ChainSpec, LoadError, MAX_PENALTY_WINDOW, SampleError, SamplingParams,
    StageRegistry, StageSpec, TokenBuffer,
};

fn spec(stages: &[StageSpec]) -> ChainSpec {
    ChainSpec {
        stages: stages.to_vec(),
    }
}

#[test]
fn core_library_registers_its_stages() {
    let reg = StageRegistry::load(&[], &[core_plugin()]).unwrap();
    let names = reg.names();
    for want in [
        "logit_bias",
        "penalties",
        "top_k",
        "top_p",
        "min_p",
        "typical_p",
        "temperature",
        "greedy",
        "dist",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "core lacks {want}: {names:?}"
        );
    }
    let top_k = reg.get("top_k").unwrap();
    assert_eq!(top_k.library, "core");
    assert!(
        top_k
            .params
            .iter()
            .any(|p| p.name == "k" && p.default == 40.0)
    );
    assert!(reg.get("dist").unwrap().selects);
    assert!(!top_k.selects);
}

#[test]
fn typed_defaults_are_the_stages_declared_defaults() {
    // Each default has one home (samplerd_plugin_sdk::defaults): a chain
    // that leaves a parameter out gets what a typed request gets. Except
    // min_p: the host's default is off, the stage's llama.cpp's 0.05.
    let reg = StageRegistry::load(&[], &[core_plugin()]).unwrap();
    let host = serde_json::to_value(SamplingParams::default()).unwrap();
    let mut compared = 0;
    for f in TYPED_FIELDS.iter().filter(|f| f.field != "min_p") {
        let Some(want) = host.get(f.field).and_then(|v| v.as_f64()) else {
            continue; // not a number (token maps, breakers, grammars)
        };
        let stage = reg.get(f.stage).unwrap();
        let param = stage.params.iter().find(|p| p.name == f.param).unwrap();
        assert_eq!(
            param.default as f32, want as f32,
            "{}.{} declares {}, the typed {} defaults to {want}",
            f.stage, f.param, param.default, f.field
        );
        compared += 1;
    }
    assert_eq!(compared, 17, "every numeric typed field but min_p");
    assert_eq!(
        described_breakers(&reg),
        SamplingParams::default().dry_sequence_breakers
    );
}

/// `dry`'s default breakers, as its description states them.
fn described_breakers(reg: &StageRegistry) -> Vec<String> {
    let dry = reg.get("dry").unwrap();
    let d = &dry
        .params
        .iter()
        .find(|p| p.name == "sequence_breakers")
        .unwrap()
        .description;
    let list = &d[d.find("default [").unwrap() + "default ".len()..];
    serde_json::from_str(&list[..=list.find(']').unwrap()]).unwrap()
}

#[test]
fn window_parameters_state_the_shared_bound() {
    // The descriptions are C string literals; the bound is the SDK's.
    let reg = StageRegistry::load(&[], &[core_plugin()]).unwrap();
    for (stage, param) in [("penalties", "repeat_last_n"), ("dry", "penalty_last_n")] {
        let p = reg.get(stage).unwrap();
        let p = p.params.iter().find(|p| p.name == param).unwrap();
        assert!(
            p.description
                .contains(&format!("at most {MAX_PENALTY_WINDOW})")),
            "{stage}.{param}: {}",
            p.description
        );
    }
}

#[test]
fn c_plugin_loads_from_a_directory_and_bans_ids() {
    let dir = scratch("c-plugin");
    build_c_plugin("ban_tokens.c", &dir, "ban_tokens", &[]);
    let reg = StageRegistry::load(std::slice::from_ref(&dir), &[core_plugin()]).unwrap();
    let info = reg.get("ban_tokens").expect("C stage registered");
    assert_eq!(info.library, "ban_tokens_example");
    assert!(info.path.starts_with(&dir));

    // `ban_tokens` with `ids`, after `before`, then greedy.
    let ban = |before: Option<StageSpec>, ids: &str| {
        let ban = StageSpec::new("ban_tokens")
            .with("ids", samplerd_sampling::ParamValue::String(ids.into()));
        let stages: Vec<StageSpec> = before
            .into_iter()
            .chain([ban, StageSpec::new("greedy")])
            .collect();
        reg.build_chain(&spec(&stages), None)
    };
    let chain = ban(None, "3, 1").unwrap();
    let mut seq = chain.new_sequence().unwrap();
    let mut buf = TokenBuffer::new();
    // Token 3 is the best and token 1 second: both banned, so 0 wins.
    buf.load(&[2.0, 4.0, 1.0, 9.0]).unwrap();
    assert_eq!(seq.sample(&mut buf, 42, 0).unwrap().token_id, 0);

    // The C stage also works in the candidate view (after top_k).
    let chain = ban(Some(StageSpec::new("top_k").number("k", 3.0)), "3").unwrap();
    let mut seq = chain.new_sequence().unwrap();
    buf.load(&[2.0, 4.0, 1.0, 9.0]).unwrap();
    assert_eq!(seq.sample(&mut buf, 42, 0).unwrap().token_id, 1);

    // Its own parameter validation reaches the caller with the stage named.
    let err = ban(None, "x").err().unwrap();
    assert!(
        err.to_string()
            .starts_with("stage `ban_tokens`: ids must be a comma-separated list"),
        "{err}"
    );
}

#[test]
fn wrong_abi_version_is_refused_naming_the_file() {
    let dir = scratch("wrong-abi");
    let lib = build_c_plugin("ban_tokens.c", &dir, "wrong_abi", &["SD_TEST_WRONG_ABI"]);
    let err = StageRegistry::load(&[dir], &[]).err().unwrap();
    assert!(matches!(err, LoadError::Abi { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&lib.display().to_string()), "{msg}");
    assert!(
        msg.contains("built for ABI 2.0, this host speaks 1.3"),
        "{msg}"
    );
}

#[test]
fn a_file_that_is_not_a_library_is_refused() {
    let dir = scratch("not-a-lib");
    let fake = dir.join("libfake.so");
    std::fs::write(&fake, b"definitely not ELF").unwrap();
    let err = StageRegistry::load(&[dir], &[]).err().unwrap();
    assert!(matches!(err, LoadError::Open { .. }), "{err:?}");
    assert!(err.to_string().contains("libfake.so"), "{err}");
}

#[test]
fn a_library_without_the_entry_symbol_is_refused() {
    // libm is a real shared library that is not a samplerd plugin.
    let libm = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
        "/lib64/libm.so.6",
    ]
    .into_iter()
    .map(std::path::PathBuf::from)
    .find(|p| p.exists());
    let Some(libm) = libm else {
        eprintln!("no libm found; skipping");
        return;
    };
    let err = StageRegistry::load(&[], &[libm]).err().unwrap();
    assert!(matches!(err, LoadError::NoEntry { .. }), "{err:?}");
}

#[test]
fn missing_directory_and_empty_config_are_errors() {
    let err = StageRegistry::load(&["/nonexistent/plugins".into()], &[])
        .err()
        .unwrap();
    assert!(
        err.to_string()
            .starts_with("plugin directory /nonexistent/plugins"),
        "{err}"
    );
    let err = StageRegistry::load(&[], &[]).err().unwrap();
    assert!(matches!(err, LoadError::Empty { .. }));
}

#[test]
fn duplicate_stage_names_are_refused() {
    let err = StageRegistry::load(&[], &[core_plugin(), core_plugin()])
        .err()
        .unwrap();
    assert!(matches!(err, LoadError::Duplicate { .. }), "{err:?}");
}

#[test]
fn a_panicking_plugin_fails_only_that_call() {
    let reg = StageRegistry::load(&[], &[core_plugin(), test_plugin()]).unwrap();
    let chain = reg
        .build_chain(
            &spec(&[
                StageSpec::new("test_panic").number("threshold", 5.0),
                StageSpec::new("greedy"),
            ]),
            None,
        )
        .unwrap();
    let mut buf = TokenBuffer::new();
    // Below the threshold: works.
    let mut seq = chain.new_sequence().unwrap();
    buf.load(&[1.0, 2.0]).unwrap();
    assert_eq!(seq.sample(&mut buf, 1, 0).unwrap().token_id, 1);
    // Above: the panic becomes an error naming the stage; the process lives.
    buf.load(&[1.0, 7.0]).unwrap();
    let err = seq.sample(&mut buf, 1, 1).unwrap_err();
    match &err {
        SampleError::Plugin { stage, message } => {
            assert_eq!(stage, "test_panic");
            assert!(message.contains("panicked"), "{message}");
        }
        other => panic!("unexpected {other:?}"),
    }
    // The poisoned state keeps failing; a fresh sequence works again.
    buf.load(&[1.0, 2.0]).unwrap();
    assert!(seq.sample(&mut buf, 1, 2).is_err());
    let mut fresh = chain.new_sequence().unwrap();
    assert_eq!(fresh.sample(&mut buf, 1, 2).unwrap().token_id, 1);
}

#[test]
fn misbehaving_plugins_are_caught_by_the_post_checks() {
    let reg = StageRegistry::load(&[], &[core_plugin(), test_plugin()]).unwrap();
    let mut buf = TokenBuffer::new();
    for (stage, want) in [
        ("test_nan", "NaN"),
        ("test_bad_select", "outside the vocabulary"),
    ] {
        let chain = reg
            .build_chain(
                &spec(&[StageSpec::new(stage), StageSpec::new("greedy")]),
                None,
            )
            .unwrap();
        let mut seq = chain.new_sequence().unwrap();
        buf.load(&[1.0, 2.0, 3.0]).unwrap();
        let err = seq.sample(&mut buf, 1, 0).unwrap_err();
        assert!(
            matches!(&err, SampleError::Misbehaved { stage: s, what } if s == stage && what.contains(want)),
            "{stage}: {err:?}"
        );
    }
}

#[test]
fn chain_validation_names_stage_param_and_value() {
    let reg = StageRegistry::load(&[], &[core_plugin()]).unwrap();
    let cases: Vec<(ChainSpec, &str)> = vec![
        (spec(&[]), "chain is empty"),
        (
            spec(&[StageSpec::new("nope"), StageSpec::new("dist")]),
            "unknown stage \"nope\"",
        ),
        (
            spec(&[
                StageSpec::new("top_k").number("kk", 1.0),
                StageSpec::new("dist"),
            ]),
            "stage `top_k`: unknown parameter \"kk\" (accepted: k",
        ),
        (
            spec(&[
                StageSpec::new("top_p").number("p", 1.5),
                StageSpec::new("dist"),
            ]),
            "stage `top_p`:",
        ),
        (
            spec(&[
                StageSpec::new("temperature").number("t", f64::NAN),
                StageSpec::new("dist"),
            ]),
            "stage `temperature`: t must be a number, got NaN",
        ),
        (
            spec(&[StageSpec::new("top_k")]),
            "the last stage `top_k` does not select a token",
        ),
        (
            spec(&[StageSpec::new("greedy"), StageSpec::new("dist")]),
            "stage `greedy` selects a token, so it must be the last stage",
        ),
        (
            spec(&[
                StageSpec::new("top_k")
                    .with("k", samplerd_sampling::ParamValue::String("x".into())),
                StageSpec::new("dist"),
            ]),
            "stage `top_k`: parameter `k` must be a number",
        ),
    ];
    for (s, want) in cases {
        let err: ChainError = reg.build_chain(&s, None).err().expect("must fail");
        assert!(
            err.to_string().starts_with(want),
            "{err} should start with {want}"
        );
    }
}
