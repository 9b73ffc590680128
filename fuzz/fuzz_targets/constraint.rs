//! Fuzzes constraint compilation the way the server does it: arbitrary
//! grammar text of each kind (the first byte picks JSON Schema, regex,
//! Lark or GBNF) through `AppState::prepare_constraints_blocking` — the
//! byte, depth and rule limits measured first (`service/constraint/
//! measure.rs`), then the constraint plugin's compile on the compile pool's
//! thread, whose stack is sized for those limits — over a small vocabulary.
//!
//! Oracle: the process survives (no stack overflow, no panic, no abort in
//! the plugin or the host); the grammar compiles or is refused with
//! INVALID_ARGUMENT (it does not compile, or is over a limit) or
//! RESOURCE_EXHAUSTED (the compile budget or the memory budget), never
//! anything else. The fuzzer's own `-timeout` bounds each compile.

#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use samplerd_api::v1;
use samplerd_sampling::Vocabulary;
use samplerd_sampling::vocab::token_attr;
use tonic::Code;

const KINDS: [&str; 4] = ["json_schema", "regex", "lark", "gbnf"];

/// The 256 byte tokens, some words and an end-of-generation token.
fn vocabulary() -> &'static Arc<Vocabulary> {
    static VOCAB: OnceLock<Arc<Vocabulary>> = OnceLock::new();
    VOCAB.get_or_init(|| {
        let mut tokens: Vec<Vec<u8>> = (0u8..=255).map(|b| vec![b]).collect();
        for w in ["{\"", "\":", "true", "null", "ab", "  "] {
            tokens.push(w.as_bytes().to_vec());
        }
        let mut attrs = vec![token_attr::NORMAL; tokens.len()];
        tokens.push(b"<eos>".to_vec());
        attrs.push(token_attr::EOG | token_attr::CONTROL);
        Arc::new(Vocabulary::new(tokens, attrs))
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, text)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(text) else {
        return;
    };
    let kind = KINDS[kind as usize % KINDS.len()];
    let constraint = match kind {
        "json_schema" => v1::constraint::Kind::JsonSchema(text.into()),
        "regex" => v1::constraint::Kind::Regex(text.into()),
        "lark" => v1::constraint::Kind::Lark(text.into()),
        _ => v1::constraint::Kind::Gbnf(text.into()),
    };
    let params = v1::SamplingParams {
        constraint: Some(v1::Constraint {
            kind: Some(constraint),
            ..Default::default()
        }),
        ..Default::default()
    };
    let state = samplerd_fuzz::app_state_with_constraint();
    if let Err(e) = state.prepare_constraints_blocking(Some(&params), Some(vocabulary())) {
        let described = e.to_string();
        let status: tonic::Status = e.into();
        assert!(
            matches!(
                status.code(),
                Code::InvalidArgument | Code::ResourceExhausted
            ),
            "{kind} refused with {:?}: {described}",
            status.code()
        );
    }
});
