//! Proves `include/samplerd_plugin.h` and `src/abi.rs` describe the same ABI:
//! a C program built from the header prints sizes, offsets and constants,
//! and each must equal what Rust computes for its mirror type.

use std::collections::HashMap;
use std::mem::{offset_of, size_of};
use std::path::Path;
use std::process::Command;

use samplerd_plugin_sdk::abi::*;

const PROBE: &str = r#"
#include <stdio.h>
#include "samplerd_plugin.h"
#define S(t) printf("size %s %zu\n", #t, sizeof(t));
#define O(t, f) printf("off %s.%s %zu\n", #t, #f, offsetof(t, f));
#define C(c) printf("const %s %lld\n", #c, (long long)(c));
int main(void) {
  S(sd_candidate) O(sd_candidate, id) O(sd_candidate, logit)
  S(sd_tokens) O(sd_tokens, n_vocab) O(sd_tokens, dense) O(sd_tokens, cand) O(sd_tokens, size)
  O(sd_tokens, view) O(sd_tokens, sorted) O(sd_tokens, selected)
  S(sd_rng) O(sd_rng, ctx) O(sd_rng, next_u64) O(sd_rng, keyed_u64)
  S(sd_vocab) O(sd_vocab, token_bytes) O(sd_vocab, token_len) O(sd_vocab, token_attr)
  S(sd_token_value) S(sd_param) O(sd_param, kind) O(sd_param, name) O(sd_param, number)
  O(sd_param, string) O(sd_param, map) O(sd_param, map_len) O(sd_param, strings) O(sd_param, strings_len)
  S(sd_param_spec) O(sd_param_spec, name) O(sd_param_spec, description) O(sd_param_spec, default_number)
  S(sd_error)
  S(sd_stage) O(sd_stage, flags) O(sd_stage, name) O(sd_stage, description) O(sd_stage, params_spec)
  O(sd_stage, n_params_spec) O(sd_stage, config_new) O(sd_stage, config_free) O(sd_stage, state_new)
  O(sd_stage, state_clone) O(sd_stage, state_free) O(sd_stage, state_reset) O(sd_stage, accept)
  O(sd_stage, apply)
  S(sd_plugin) O(sd_plugin, abi_major) O(sd_plugin, abi_minor) O(sd_plugin, candidate_size)
  O(sd_plugin, tokens_size) O(sd_plugin, stage_size) O(sd_plugin, library_name)
  O(sd_plugin, library_version) O(sd_plugin, stages) O(sd_plugin, n_stages)
  C(SD_ABI_MAJOR) C(SD_ABI_MINOR) C(SD_OK) C(SD_ERR) C(SD_ERR_INPUT) C(SD_ERROR_MESSAGE_LEN)
  C(SD_VIEW_DENSE) C(SD_VIEW_CANDIDATES) C(SD_TOKEN_CONTROL) C(SD_TOKEN_EOG) C(SD_TOKEN_BYTE)
  C(SD_TOKEN_UNUSED) C(SD_PARAM_NUMBER) C(SD_PARAM_STRING) C(SD_PARAM_TOKEN_MAP)
  C(SD_PARAM_STRING_LIST) C(SD_STAGE_SELECTS) C(SD_STAGE_DENSE_OK) C(SD_STAGE_NEEDS_VOCAB) C(SD_STAGE_OUTPUT_ONLY)
  C(SD_STAGE_SPARSE_LOWERS_ONLY)
  printf("symbol entry %s\n", SD_PLUGIN_ENTRY_SYMBOL);
  return 0;
}
"#;

fn c_layout() -> HashMap<String, String> {
    let dir = tempfile_dir();
    let src = dir.join("probe.c");
    let exe = dir.join("probe");
    std::fs::write(&src, PROBE).unwrap();
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Werror", "-I"])
        .arg(&include)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .status()
        .unwrap_or_else(|e| panic!("cannot run C compiler {cc:?}: {e}"));
    assert!(status.success(), "the header does not compile as C11");
    let out = Command::new(&exe).output().unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let mut it = l.splitn(3, ' ');
            let (kind, key, value) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
            (format!("{kind} {key}"), value.to_string())
        })
        .collect()
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sd-header-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn header_and_rust_agree() {
    let c = c_layout();
    let mut checked = 0;
    let mut check = |key: &str, rust: u64| {
        let got = c
            .get(key)
            .unwrap_or_else(|| panic!("probe printed no {key}"));
        assert_eq!(
            got,
            &rust.to_string(),
            "{key}: C says {got}, Rust says {rust}"
        );
        checked += 1;
    };
    macro_rules! size {
        ($c:literal, $t:ty) => {
            check(concat!("size ", $c), size_of::<$t>() as u64)
        };
    }
    macro_rules! off {
        ($c:literal, $t:ty, $f:ident) => {
            check(
                concat!("off ", $c, ".", stringify!($f)),
                offset_of!($t, $f) as u64,
            )
        };
    }
    macro_rules! constant {
        ($c:ident) => {
            check(concat!("const ", stringify!($c)), $c as u64)
        };
    }

    size!("sd_candidate", SdCandidate);
    off!("sd_candidate", SdCandidate, id);
    off!("sd_candidate", SdCandidate, logit);
    size!("sd_tokens", SdTokens);
    for (f, o) in [
        ("n_vocab", offset_of!(SdTokens, n_vocab)),
        ("dense", offset_of!(SdTokens, dense)),
        ("cand", offset_of!(SdTokens, cand)),
        ("size", offset_of!(SdTokens, size)),
        ("view", offset_of!(SdTokens, view)),
        ("sorted", offset_of!(SdTokens, sorted)),
        ("selected", offset_of!(SdTokens, selected)),
    ] {
        check(&format!("off sd_tokens.{f}"), o as u64);
    }
    size!("sd_rng", SdRng);
    off!("sd_rng", SdRng, ctx);
    off!("sd_rng", SdRng, next_u64);
    off!("sd_rng", SdRng, keyed_u64);
    size!("sd_vocab", SdVocab);
    off!("sd_vocab", SdVocab, token_bytes);
    off!("sd_vocab", SdVocab, token_len);
    off!("sd_vocab", SdVocab, token_attr);
    size!("sd_token_value", SdTokenValue);
    size!("sd_param", SdParam);
    off!("sd_param", SdParam, kind);
    off!("sd_param", SdParam, name);
    off!("sd_param", SdParam, number);
    off!("sd_param", SdParam, string);
    off!("sd_param", SdParam, map);
    off!("sd_param", SdParam, map_len);
    off!("sd_param", SdParam, strings);
    off!("sd_param", SdParam, strings_len);
    size!("sd_param_spec", SdParamSpec);
    off!("sd_param_spec", SdParamSpec, name);
    off!("sd_param_spec", SdParamSpec, description);
    off!("sd_param_spec", SdParamSpec, default_number);
    size!("sd_error", SdError);
    size!("sd_stage", SdStage);
    off!("sd_stage", SdStage, flags);
    off!("sd_stage", SdStage, name);
    off!("sd_stage", SdStage, description);
    off!("sd_stage", SdStage, params_spec);
    off!("sd_stage", SdStage, n_params_spec);
    off!("sd_stage", SdStage, config_new);
    off!("sd_stage", SdStage, config_free);
    off!("sd_stage", SdStage, state_new);
    off!("sd_stage", SdStage, state_clone);
    off!("sd_stage", SdStage, state_free);
    off!("sd_stage", SdStage, state_reset);
    off!("sd_stage", SdStage, accept);
    off!("sd_stage", SdStage, apply);
    size!("sd_plugin", SdPlugin);
    off!("sd_plugin", SdPlugin, abi_major);
    off!("sd_plugin", SdPlugin, abi_minor);
    off!("sd_plugin", SdPlugin, candidate_size);
    off!("sd_plugin", SdPlugin, tokens_size);
    off!("sd_plugin", SdPlugin, stage_size);
    off!("sd_plugin", SdPlugin, library_name);
    off!("sd_plugin", SdPlugin, library_version);
    off!("sd_plugin", SdPlugin, stages);
    off!("sd_plugin", SdPlugin, n_stages);
    constant!(SD_ABI_MAJOR);
    constant!(SD_ABI_MINOR);
    constant!(SD_OK);
    constant!(SD_ERR);
    constant!(SD_ERR_INPUT);
    constant!(SD_ERROR_MESSAGE_LEN);
    constant!(SD_VIEW_DENSE);
    constant!(SD_VIEW_CANDIDATES);
    constant!(SD_TOKEN_CONTROL);
    constant!(SD_TOKEN_EOG);
    constant!(SD_TOKEN_BYTE);
    constant!(SD_TOKEN_UNUSED);
    constant!(SD_PARAM_NUMBER);
    constant!(SD_PARAM_STRING);
    constant!(SD_PARAM_TOKEN_MAP);
    constant!(SD_PARAM_STRING_LIST);
    constant!(SD_STAGE_SELECTS);
    constant!(SD_STAGE_OUTPUT_ONLY);
    constant!(SD_STAGE_SPARSE_LOWERS_ONLY);
    constant!(SD_STAGE_DENSE_OK);
    constant!(SD_STAGE_NEEDS_VOCAB);
    let sym =
        std::str::from_utf8(&SD_PLUGIN_ENTRY_SYMBOL[..SD_PLUGIN_ENTRY_SYMBOL.len() - 1]).unwrap();
    assert_eq!(
        c.get("symbol entry").map(String::as_str),
        Some(sym),
        "entry symbol differs"
    );
    assert!(checked > 60);
}
