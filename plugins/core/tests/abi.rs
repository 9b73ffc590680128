//! The exported descriptor and a round trip through the C ABI vtables.

use std::ffi::{CStr, c_void};

use samplerd_core_stages::samplerd_plugin_entry_v1;
use samplerd_plugin_sdk::abi::*;

fn stages() -> Vec<&'static SdStage> {
    // SAFETY: the entry point returns a pointer to the library's static
    // descriptor, valid for the whole process.
    let plugin = unsafe { &*samplerd_plugin_entry_v1() };
    assert_eq!(plugin.abi_major, SD_ABI_MAJOR);
    // SAFETY: the descriptor's name is a static NUL-terminated string.
    assert_eq!(unsafe { CStr::from_ptr(plugin.library_name) }, c"core");
    // SAFETY: `stages` points to `n_stages` static stage pointers.
    let ptrs = unsafe { std::slice::from_raw_parts(plugin.stages, plugin.n_stages) };
    // SAFETY: each stage pointer is a static, non-null descriptor.
    ptrs.iter().map(|&p| unsafe { &*p }).collect()
}

fn name(s: &SdStage) -> String {
    // SAFETY: a stage's name is a static NUL-terminated string.
    unsafe { CStr::from_ptr(s.name) }
        .to_str()
        .unwrap()
        .to_string()
}

fn params(s: &SdStage) -> Vec<String> {
    // SAFETY: `params_spec` points to `n_params_spec` static specs.
    let spec = unsafe { std::slice::from_raw_parts(s.params_spec, s.n_params_spec) };
    spec.iter()
        .map(|p| {
            // SAFETY: a parameter's name is a static NUL-terminated string.
            unsafe { CStr::from_ptr(p.name) }
                .to_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

#[test]
fn descriptor_lists_the_contracted_stages_and_params() {
    let want: &[(&str, &[&str], u32)] = &[
        ("logit_bias", &["bias"], SD_STAGE_DENSE_OK),
        (
            "penalties",
            &[
                "repeat_last_n",
                "repeat_penalty",
                "frequency_penalty",
                "presence_penalty",
                "exclude_tokens",
            ],
            SD_STAGE_DENSE_OK,
        ),
        (
            "dry",
            &[
                "multiplier",
                "base",
                "allowed_length",
                "penalty_last_n",
                "sequence_breakers",
            ],
            SD_STAGE_DENSE_OK,
        ),
        ("top_n_sigma", &["n"], SD_STAGE_DENSE_OK),
        ("top_k", &["k"], SD_STAGE_DENSE_OK),
        ("typical_p", &["p", "min_keep"], SD_STAGE_DENSE_OK),
        ("top_p", &["p", "min_keep"], SD_STAGE_DENSE_OK),
        ("min_p", &["p", "min_keep"], SD_STAGE_DENSE_OK),
        (
            "xtc",
            &["probability", "threshold", "min_keep"],
            SD_STAGE_DENSE_OK,
        ),
        (
            "temperature",
            &["t", "dynatemp_range", "dynatemp_exponent"],
            SD_STAGE_DENSE_OK,
        ),
        ("dist", &[], SD_STAGE_DENSE_OK | SD_STAGE_SELECTS),
        ("greedy", &[], SD_STAGE_DENSE_OK | SD_STAGE_SELECTS),
        ("coupled", &[], SD_STAGE_DENSE_OK | SD_STAGE_SELECTS),
        (
            "mirostat",
            &["tau", "eta", "m"],
            SD_STAGE_DENSE_OK | SD_STAGE_SELECTS,
        ),
        (
            "mirostat_v2",
            &["tau", "eta"],
            SD_STAGE_DENSE_OK | SD_STAGE_SELECTS,
        ),
        (
            "token_controls",
            &["min_tokens", "end_tokens", "bad_words"],
            SD_STAGE_DENSE_OK | SD_STAGE_OUTPUT_ONLY,
        ),
        (
            "adaptive_p",
            &["target", "decay"],
            SD_STAGE_DENSE_OK | SD_STAGE_SELECTS,
        ),
        (
            "reasoning_budget",
            &["open", "close", "budget", "message"],
            SD_STAGE_DENSE_OK | SD_STAGE_OUTPUT_ONLY,
        ),
    ];
    let got = stages();
    assert_eq!(got.len(), want.len());
    for (s, (n, p, f)) in got.iter().zip(want) {
        assert_eq!(name(s), *n);
        assert_eq!(
            params(s),
            p.iter().map(|x| x.to_string()).collect::<Vec<_>>(),
            "{n}"
        );
        assert_eq!(s.flags, *f, "{n}");
    }
}

unsafe extern "C" fn fixed_rng(_: *mut c_void) -> u64 {
    0
}

#[test]
fn top_k_and_greedy_through_the_abi() {
    let all = stages();
    let top_k = all.iter().find(|s| name(s) == "top_k").unwrap();
    let mut err = SdError {
        message: [0; SD_ERROR_MESSAGE_LEN],
    };
    let mk = |v: f64| SdParam {
        struct_size: size_of::<SdParam>() as u32,
        kind: SD_PARAM_NUMBER,
        name: c"k".as_ptr(),
        number: v,
        string: std::ptr::null(),
        map: std::ptr::null(),
        map_len: 0,
        strings: std::ptr::null(),
        strings_len: 0,
    };
    // invalid k: SD_ERR with a message naming it
    let bad = mk(-3.0);
    let mut cfg: *mut c_void = std::ptr::null_mut();
    // SAFETY: one valid parameter, no vocabulary, live out-pointers.
    let rc = unsafe { (top_k.config_new.unwrap())(&bad, 1, std::ptr::null(), &mut cfg, &mut err) };
    assert_eq!(rc, SD_ERR);
    // SAFETY: on SD_ERR the stage wrote a NUL-terminated message into the
    // buffer.
    let msg = unsafe { CStr::from_ptr(err.message.as_ptr()) }
        .to_str()
        .unwrap();
    assert_eq!(msg, "top_k: k must be in [0, 4294967295], got -3");

    let good = mk(2.0);
    // SAFETY: as above.
    let rc = unsafe { (top_k.config_new.unwrap())(&good, 1, std::ptr::null(), &mut cfg, &mut err) };
    assert_eq!(rc, SD_OK);
    let mut state: *mut c_void = std::ptr::null_mut();
    // SAFETY: `cfg` is the config just made; live out-pointers.
    let rc = unsafe { (top_k.state_new.unwrap())(cfg, &mut state, &mut err) };
    assert_eq!(rc, SD_OK);
    let mut dense = vec![0.5f32, 3.0, -1.0, 2.0];
    let mut cand = vec![SdCandidate { id: 0, logit: 0.0 }; 4];
    let mut tokens = SdTokens {
        struct_size: size_of::<SdTokens>() as u32,
        n_vocab: 4,
        dense: dense.as_mut_ptr(),
        cand: cand.as_mut_ptr(),
        size: 4,
        view: SD_VIEW_DENSE,
        sorted: 0,
        selected: -1,
    };
    let mut rng = SdRng {
        struct_size: size_of::<SdRng>() as u32,
        ctx: std::ptr::null_mut(),
        next_u64: Some(fixed_rng),
        keyed_u64: None,
    };
    // SAFETY: config and state from this stage; `tokens` describes the
    // two live 4-entry arrays above; `rng` has a valid callback.
    let rc = unsafe { (top_k.apply.unwrap())(cfg, state, &mut tokens, &mut rng, &mut err) };
    assert_eq!(rc, SD_OK);
    assert_eq!(tokens.view, SD_VIEW_CANDIDATES);
    assert_eq!(tokens.size, 2);
    assert_eq!(tokens.sorted, 1);
    assert_eq!(
        &cand[..2],
        &[
            SdCandidate { id: 1, logit: 3.0 },
            SdCandidate { id: 3, logit: 2.0 }
        ]
    );

    let greedy = all.iter().find(|s| name(s) == "greedy").unwrap();
    let mut gcfg: *mut c_void = std::ptr::null_mut();
    // SAFETY: no parameters, no vocabulary, live out-pointers.
    let rc = unsafe {
        (greedy.config_new.unwrap())(std::ptr::null(), 0, std::ptr::null(), &mut gcfg, &mut err)
    };
    assert_eq!(rc, SD_OK);
    let mut gst: *mut c_void = std::ptr::null_mut();
    // SAFETY: `gcfg` is greedy's config just made.
    let rc = unsafe { (greedy.state_new.unwrap())(gcfg, &mut gst, &mut err) };
    assert_eq!(rc, SD_OK);
    // SAFETY: greedy's config and state; the same live buffers as above.
    let rc = unsafe { (greedy.apply.unwrap())(gcfg, gst, &mut tokens, &mut rng, &mut err) };
    assert_eq!(rc, SD_OK);
    assert_eq!(tokens.selected, 1);

    // SAFETY: each state and config is freed once, states first, by the
    // stage that made it.
    unsafe {
        (greedy.state_free.unwrap())(gcfg, gst);
        (greedy.config_free.unwrap())(gcfg);
        (top_k.state_free.unwrap())(cfg, state);
        (top_k.config_free.unwrap())(cfg);
    }
}
