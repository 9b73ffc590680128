//! The discovery RPCs on a real server on loopback: Tokenize and
//! Detokenize (round trips, llama.cpp's ids for the default model, named
//! vocabularies, every bad input with its code and field), GetServerInfo
//! against the running configuration, and the request id on every
//! response (unary, streaming, errors) and on the request's log lines.
//!
//! The model-backed tests need `SAMPLERD_MODEL` (scripts/test.sh sets it);
//! without it they print a notice and pass. The rest need no model.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use common::*;
use samplerd::generate::generator::Generator;
use samplerd::generate::{GenerateConfig, ModelHost};
use samplerd::transport::request_id::{MAX_ID_BYTES, REQUEST_ID_HEADER};
use samplerd_api::v1;
use tonic::Code;
use tonic_types::StatusExt as _;

fn host() -> Option<Arc<ModelHost>> {
    static HOST: OnceLock<Option<Arc<ModelHost>>> = OnceLock::new();
    HOST.get_or_init(|| {
        Some(Arc::new(
            ModelHost::load(&model_path()?, GenerateConfig::default()).expect("model loads"),
        ))
    })
    .clone()
}

macro_rules! require_model {
    () => {
        match host() {
            Some(h) => h,
            None => {
                eprintln!("SAMPLERD_MODEL is not set: skipping the real-model test");
                return;
            }
        }
    };
}

async fn with_model(config: samplerd::app::config::Config) -> TestServer {
    let h = require_model_or_panic();
    start_serving(config, Some(h as Arc<dyn Generator>)).await
}

fn require_model_or_panic() -> Arc<ModelHost> {
    host().expect("checked by require_model!")
}

async fn tokenize(s: &TestServer, req: v1::TokenizeRequest) -> Result<Vec<u32>, tonic::Status> {
    let mut c = s.client.clone();
    c.tokenize(req).await.map(|r| r.into_inner().tokens)
}

async fn detokenize(s: &TestServer, req: v1::DetokenizeRequest) -> Result<String, tonic::Status> {
    let mut c = s.client.clone();
    c.detokenize(req).await.map(|r| r.into_inner().text)
}

fn text(t: &str, parse_special: bool) -> v1::TokenizeRequest {
    v1::TokenizeRequest {
        text: t.into(),
        parse_special,
        ..Default::default()
    }
}

fn ids(tokens: Vec<u32>) -> v1::DetokenizeRequest {
    v1::DetokenizeRequest {
        tokens,
        ..Default::default()
    }
}

/// The field the error's BadRequest names (there must be exactly one).
fn field_of(err: &tonic::Status) -> String {
    let d = err.get_error_details();
    let v = &d.bad_request().expect("BadRequest").field_violations;
    assert_eq!(v.len(), 1, "{err:?}");
    v[0].field.clone()
}

/// Ids llama.cpp gives for the default model (SmolLM2-135M-Instruct
/// Q4_1), from llama-cpp-python:
/// `Llama(path, vocab_only=True).tokenize(text.encode(), add_bos=B, special=S)`.
/// (text, add_bos, special, ids)
const LLAMA_CPP_IDS: &[(&str, bool, bool, &[u32])] = &[
    ("Hello world", false, true, &[19556, 905]),
    // SmolLM2 does not ask for BOS (`tokenizer.ggml.add_bos_token`
    // false), so add_special changes nothing, in llama.cpp as here.
    ("Hello world", true, true, &[19556, 905]),
    (
        "naïve café 日本語 😀👍🏽",
        false,
        true,
        &[
            3546, 46494, 37366, 17097, 241, 115, 40993, 179, 120, 248, 40303, 218, 10813, 235, 231,
            10813, 233, 138,
        ],
    ),
    (
        "<|im_start|>user\nHi!<|im_end|>\n",
        false,
        true,
        &[1, 4093, 198, 26843, 17, 2, 198],
    ),
    (
        "<|im_start|>user\nHi!<|im_end|>\n",
        false,
        false,
        &[
            44, 108, 306, 79, 3738, 108, 46, 4093, 198, 26843, 17, 44, 108, 306, 79, 486, 108, 46,
            198,
        ],
    ),
    (
        "  leading and trailing  ",
        false,
        true,
        &[216, 2899, 284, 35079, 256],
    ),
    (
        "code: fn main() { println!(\"hi\"); }",
        false,
        true,
        &[
            4635, 42, 24526, 1085, 1000, 1662, 1628, 34115, 17, 1470, 6004, 21646, 4029,
        ],
    ),
];

#[tokio::test]
async fn tokenize_gives_llama_cpps_ids_and_detokenize_gives_the_text_back() {
    let _ = require_model!();
    let s = with_model(test_config()).await;
    for &(t, add_special, parse_special, want) in LLAMA_CPP_IDS {
        let got = tokenize(
            &s,
            v1::TokenizeRequest {
                text: t.into(),
                add_special,
                parse_special,
                ..Default::default()
            },
        )
        .await
        .expect("Tokenize succeeds");
        assert_eq!(
            got, want,
            "{t:?} add_special={add_special} parse_special={parse_special}"
        );
        let back = detokenize(&s, ids(got)).await.expect("Detokenize succeeds");
        assert_eq!(back, t, "round trip of {t:?}");
    }
    // Control tokens are their text unless skipped.
    let chat = tokenize(&s, text("<|im_start|>user\nHi!<|im_end|>", true))
        .await
        .unwrap();
    let skipped = detokenize(
        &s,
        v1::DetokenizeRequest {
            tokens: chat,
            skip_special: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(skipped, "user\nHi!");
    s.stop().await;
}

#[tokio::test]
async fn detokenize_joins_characters_cut_between_tokens_and_marks_a_cut_end() {
    let _ = require_model!();
    let s = with_model(test_config()).await;
    // 😀 is two byte tokens here (10813, 235, …): each alone is no UTF-8.
    let emoji = tokenize(&s, text("😀", false)).await.unwrap();
    assert!(emoji.len() > 1, "{emoji:?}");
    assert_eq!(detokenize(&s, ids(emoji.clone())).await.unwrap(), "😀");
    let cut = detokenize(&s, ids(emoji[..emoji.len() - 1].to_vec()))
        .await
        .unwrap();
    assert_eq!(cut, "\u{FFFD}", "an unfinished character becomes U+FFFD");
    s.stop().await;
}

#[tokio::test]
async fn a_named_vocabulary_tokenizes_without_a_model() {
    let Some(path) = model_path() else {
        eprintln!("SAMPLERD_MODEL is not set: skipping the real-model test");
        return;
    };
    let s = start_tuned(|c| {
        c.vocabularies.insert("smollm2".into(), path);
    })
    .await;
    let got = tokenize(
        &s,
        v1::TokenizeRequest {
            text: "Hello world".into(),
            vocabulary: "smollm2".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(got, [19556, 905]);
    let back = detokenize(
        &s,
        v1::DetokenizeRequest {
            tokens: got,
            vocabulary: "smollm2".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(back, "Hello world");
    s.stop().await;
}

#[tokio::test]
async fn a_tokenizer_json_vocabulary_parses_special_tokens_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<String> = ["a", "b", "<", "|", ">", "e", "n", "d", "o", "f", "t", "x"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let (path, n) = tokenizer_json(dir.path(), &tokens);
    let eot = (n - 1) as u32;
    let s = start_tuned(|c| {
        c.vocabularies.insert("json".into(), path);
    })
    .await;
    let ask = |parse_special| v1::TokenizeRequest {
        text: "a<|endoftext|>b".into(),
        parse_special,
        vocabulary: "json".into(),
        ..Default::default()
    };
    let parsed = tokenize(&s, ask(true)).await.unwrap();
    assert_eq!(parsed, [0, eot, 1]);
    let literal = tokenize(&s, ask(false)).await.unwrap();
    assert!(!literal.contains(&eot), "{literal:?}");
    assert_eq!(literal.len(), 2 + "<|endoftext|>".len(), "{literal:?}");
    s.stop().await;
}

#[tokio::test]
async fn bad_inputs_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let json = plain_tokenizer_json(dir.path(), 8);
    let s = start_tuned(|c| {
        c.vocabularies.insert("tiny".into(), json);
        c.generate.max_prompt_bytes = 64;
    })
    .await;
    // No model and no vocabulary named.
    let e = tokenize(&s, text("hi", false)).await.unwrap_err();
    assert_status(&e, Code::FailedPrecondition, &["no model", "tiny"]);
    assert_reason(&e, Reason::NoModel);
    let e = detokenize(&s, ids(vec![1])).await.unwrap_err();
    assert_reason(&e, Reason::NoModel);
    // An unknown vocabulary, its name bounded in the message.
    let long = "v".repeat(10_000);
    let e = tokenize(
        &s,
        v1::TokenizeRequest {
            text: "hi".into(),
            vocabulary: long.clone(),
            ..Default::default()
        },
    )
    .await
    .unwrap_err();
    assert_status(&e, Code::InvalidArgument, &["no vocabulary named", "tiny"]);
    assert_reason(&e, Reason::UnknownVocabulary);
    assert_eq!(field_of(&e), "vocabulary");
    assert!(e.message().len() < 1000, "{}", e.message().len());
    // A text over generate.max_prompt_bytes: its length, never its text.
    let e = tokenize(
        &s,
        v1::TokenizeRequest {
            text: "secret".repeat(20),
            vocabulary: "tiny".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap_err();
    assert_status(
        &e,
        Code::InvalidArgument,
        &["120 bytes", "generate.max_prompt_bytes"],
    );
    assert_reason(&e, Reason::LimitExceeded);
    assert_eq!(field_of(&e), "text");
    assert!(!e.message().contains("secret"), "{}", e.message());
    // An id outside the vocabulary: its index and value.
    let e = detokenize(
        &s,
        v1::DetokenizeRequest {
            tokens: vec![1, 2, 8],
            vocabulary: "tiny".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap_err();
    assert_status(&e, Code::InvalidArgument, &["token id 8", "8 tokens"]);
    assert_eq!(field_of(&e), "tokens[2]");
    // Too many ids.
    let e = detokenize(
        &s,
        v1::DetokenizeRequest {
            tokens: vec![0; 65],
            vocabulary: "tiny".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap_err();
    assert_status(
        &e,
        Code::InvalidArgument,
        &["65 tokens", "generate.max_prompt_bytes"],
    );
    assert_eq!(field_of(&e), "tokens");
    s.assert_serving().await;
    s.stop().await;
}

#[tokio::test]
async fn server_info_reports_the_running_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let json = plain_tokenizer_json(dir.path(), 8);
    let s = start_tuned(|c| {
        c.vocabularies.insert("tiny".into(), json);
        c.limits.max_batch_rows = 17;
        c.limits.max_draft_tokens = 9;
        c.limits.max_n_probs = 33;
        c.limits.max_message_bytes = 12 << 20;
        c.generate.max_tokens_cap = 777;
        c.generate.max_prompt_bytes = 4321;
        c.generate.max_bad_words = 11;
        c.generate.max_prompt_logprobs = 7;
        c.limits.max_constraint_triggers = 5;
        c.limits.max_constraint_trigger_bytes = 66;
    })
    .await;
    let mut c = s.client.clone();
    let info = c
        .get_server_info(v1::GetServerInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.version, env!("CARGO_PKG_VERSION"));
    let build = info.build.unwrap();
    assert_eq!(
        build.profile,
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );
    assert!(info.model.is_none(), "no model configured");
    assert_eq!((info.device.as_str(), info.numerics.as_str()), ("cpu", ""));
    assert_eq!(info.vocabularies.len(), 1);
    assert_eq!(
        (
            info.vocabularies[0].name.as_str(),
            info.vocabularies[0].n_vocab
        ),
        ("tiny", 8)
    );
    let l = info.limits.unwrap();
    assert_eq!(l.max_batch_rows, 17);
    assert_eq!(l.max_draft_tokens, 9);
    assert_eq!(l.max_n_probs, 33);
    assert_eq!(l.max_message_bytes, 12 << 20);
    assert_eq!(l.max_tokens, 777);
    assert_eq!(l.max_prompt_bytes, 4321);
    assert_eq!(l.max_bad_words, 11);
    assert_eq!(l.max_prompt_logprobs, 7);
    assert_eq!(l.max_constraint_triggers, 5);
    assert_eq!(l.max_constraint_trigger_bytes, 66);
    let d = samplerd::app::config::Config::default();
    assert_eq!(l.max_vocab as usize, d.limits.max_vocab);
    assert_eq!(l.max_window_tokens as usize, d.limits.max_window_tokens);
    assert_eq!(l.max_prompt_tokens as usize, d.generate.max_prompt_tokens);
    assert_eq!(l.max_stop_token_ids as usize, d.generate.max_stop_token_ids);
    assert_eq!(l.max_bad_word_bytes as usize, d.generate.max_bad_word_bytes);
    assert_eq!(
        l.max_reasoning_message_bytes as usize,
        d.generate.max_reasoning_message_bytes
    );
    assert_eq!(info.request_id_header, REQUEST_ID_HEADER);
    s.stop().await;
}

#[tokio::test]
async fn server_info_describes_the_model() {
    let h = require_model!();
    let s = with_model(test_config()).await;
    let mut c = s.client.clone();
    let info = c
        .get_server_info(v1::GetServerInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    let m = info.model.expect("model described");
    assert_eq!(m.file_name, "SmolLM2-135M-Instruct.Q4_1.gguf");
    assert_eq!(m.architecture, "llama");
    assert_eq!(m.n_vocab, 49152);
    let summary = h.describe().unwrap();
    assert_eq!(m.n_ctx as usize, summary.n_ctx);
    assert!(m.weight_types.contains_key("q4_1"), "{:?}", m.weight_types);
    assert_eq!(info.numerics, summary.numerics);
    assert!(info.numerics.starts_with("portable"), "{}", info.numerics);
    assert_eq!(info.device, summary.device);
    s.stop().await;
}

/// A log sink for this test binary: every line the server's tracing writes.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn log_lines() -> &'static Lines {
    static LINES: OnceLock<Lines> = OnceLock::new();
    LINES.get_or_init(|| {
        let lines = Lines::default();
        let writer = lines.clone();
        tracing_subscriber::fmt()
            .with_env_filter("samplerd=debug")
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .init();
        lines
    })
}

fn with_id<T>(msg: T, id: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut()
        .insert(REQUEST_ID_HEADER, id.parse().unwrap());
    r
}

fn id_of(m: &tonic::metadata::MetadataMap) -> String {
    m.get(REQUEST_ID_HEADER)
        .unwrap_or_else(|| panic!("no {REQUEST_ID_HEADER} in {m:?}"))
        .to_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn every_response_carries_the_request_id_and_the_log_lines_too() {
    let lines = log_lines();
    let s = start().await;
    let mut c = s.client.clone();
    // Unary, the client's id echoed.
    let r = c
        .get_server_info(with_id(v1::GetServerInfoRequest {}, "client-id-1"))
        .await
        .unwrap();
    assert_eq!(id_of(r.metadata()), "client-id-1");
    // Unary, none sent: one generated, a new one each call.
    let a = id_of(
        c.list_stages(v1::ListStagesRequest {})
            .await
            .unwrap()
            .metadata(),
    );
    let b = id_of(
        c.list_stages(v1::ListStagesRequest {})
            .await
            .unwrap()
            .metadata(),
    );
    assert_ne!(a, b);
    assert!(a.len() <= MAX_ID_BYTES && a.bytes().all(|c| c.is_ascii_graphic()));
    // An error.
    let e = c
        .tokenize(with_id(text("x", false), "client-id-2"))
        .await
        .unwrap_err();
    assert_eq!(id_of(e.metadata()), "client-id-2");
    // Streaming.
    let first = v1::SampleStreamRequest {
        logits: logits(16, 1),
        ..Default::default()
    };
    let r = c
        .sample_stream(with_id(tokio_stream::iter(vec![first]), "client-id-3"))
        .await
        .unwrap();
    assert_eq!(id_of(r.metadata()), "client-id-3");
    let mut st = r.into_inner();
    while st.message().await.unwrap().is_some() {}
    // An id that is too long, or not visible ASCII, is replaced.
    for bad in ["x".repeat(MAX_ID_BYTES + 1), "has space".to_string()] {
        let r = c
            .get_server_info(with_id(v1::GetServerInfoRequest {}, &bad))
            .await
            .unwrap();
        let got = id_of(r.metadata());
        assert_ne!(got, bad);
        assert!(got.bytes().all(|c| c.is_ascii_graphic()), "{got:?}");
    }
    // The request's log lines carry it: a Sample's "sampled" line.
    let req = v1::SampleRequest {
        logits: logits(16, 2),
        ..Default::default()
    };
    c.sample(with_id(req, "trace-me-42")).await.unwrap();
    let log = String::from_utf8_lossy(&lines.0.lock().unwrap()).into_owned();
    let line = log
        .lines()
        .find(|l| l.contains("sampled") && l.contains("trace-me-42"))
        .unwrap_or_else(|| panic!("no `sampled` line with the id in:\n{log}"));
    assert!(line.contains("rpc{request_id=\"trace-me-42\"}"), "{line}");
    s.stop().await;
}
