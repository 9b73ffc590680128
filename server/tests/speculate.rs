//! Generate with speculative decoding (`GenerateRequest.speculation`):
//! prompt-lookup drafts against the real default model, and a draft model
//! (`model.draft_path`) on tiny models that always run. The stream is
//! byte-identical to the same request without speculation — every `Token`
//! message (id, text, log-probability, probability, `n_probs`
//! candidates) and the `Finished` (reason, held-back text, usage) — on
//! input-grounded prompts, greedy and seeded, with stop strings, a JSON
//! Schema, penalties and DRY, the prompt cache and `resume`; the draft
//! counts are consistent; bad `speculation` fields are refused, and so is
//! a draft model over another vocabulary (at start-up, naming both files).
//!
//! The real model's path comes from `SAMPLERD_MODEL`; without it those
//! tests print a notice and pass.

mod common;

use std::sync::{Arc, OnceLock};

use common::*;
use samplerd::generate::generator::Generator;
use samplerd::generate::{GenerateConfig, ModelHost};
use samplerd_api::v1;
use samplerd_api::v1::generate_response::Event;
use tonic::Code;

#[path = "../model/tests/support/tiny_formats.rs"]
mod tiny_formats;

/// A host for these tests: every round drafts what its rule says
/// (`pause_slow_drafting` off), so drafting is what they exercise whatever
/// this machine's timings; pacing has its own test.
fn host_with(cfg: GenerateConfig) -> Option<Arc<ModelHost>> {
    Some(Arc::new(
        ModelHost::load(&model_path()?, unpaced(cfg)).expect("model loads"),
    ))
}

fn unpaced(cfg: GenerateConfig) -> GenerateConfig {
    GenerateConfig {
        pause_slow_drafting: false,
        ..cfg
    }
}

fn shared_host() -> Option<Arc<ModelHost>> {
    static HOST: OnceLock<Option<Arc<ModelHost>>> = OnceLock::new();
    HOST.get_or_init(|| host_with(GenerateConfig::default()))
        .clone()
}

macro_rules! require_model {
    ($host:expr) => {
        match $host {
            Some(h) => h,
            None => {
                eprintln!("SAMPLERD_MODEL is not set: skipping the real-model Generate test");
                return;
            }
        }
    };
}

/// A server with the core stages and the `constraint` plugin.
async fn server_with(host: Arc<ModelHost>) -> TestServer {
    let mut c = test_config();
    c.plugins.files = vec![core_plugin(), constraint_plugin()];
    start_serving(c, Some(host as Arc<dyn Generator>)).await
}

/// A whole Generate stream: every Token message and the Finished.
#[derive(Clone, Debug, Default, PartialEq)]
struct Stream {
    tokens: Vec<v1::Token>,
    finished: Option<v1::Finished>,
}

impl Stream {
    fn ids(&self) -> Vec<u32> {
        self.tokens.iter().map(|t| t.token_id).collect()
    }
    fn text(&self) -> String {
        let mut t: String = self.tokens.iter().map(|t| t.text.as_str()).collect();
        t.push_str(&self.finished.as_ref().unwrap().text);
        t
    }
    fn reason(&self) -> v1::FinishReason {
        v1::FinishReason::try_from(self.finished.as_ref().unwrap().finish_reason).unwrap()
    }
    fn usage(&self) -> v1::Usage {
        self.finished.as_ref().unwrap().usage.unwrap()
    }
    /// The Finished without what may differ between runs (timings, the
    /// prompt cache's share of the prompt) or with speculation (its draft
    /// counts).
    fn comparable(&self) -> v1::Finished {
        let mut f = self.finished.clone().unwrap();
        f.timings = None;
        let u = f.usage.as_mut().unwrap();
        u.draft_tokens = 0;
        u.accepted_draft_tokens = 0;
        u.cached_prompt_tokens = 0;
        f
    }
}

async fn stream(s: &TestServer, req: v1::GenerateRequest) -> Result<Stream, tonic::Status> {
    let mut client = s.client.clone();
    tokio::time::timeout(DEADLINE, async move {
        let mut st = client.generate(req).await?.into_inner();
        let mut out = Stream::default();
        while let Some(msg) = st.message().await? {
            match msg.event.expect("event set") {
                Event::Token(t) => out.tokens.push(t),
                Event::Finished(f) => out.finished = Some(f),
                Event::PromptLogprobs(_) => panic!("not asked for"),
            }
        }
        Ok(out)
    })
    .await
    .expect("generate finished within the deadline")
}

fn speculating(req: &v1::GenerateRequest, max_draft_tokens: u32) -> v1::GenerateRequest {
    speculating_from(req, v1::DraftSource::PromptLookup, max_draft_tokens)
}

fn speculating_from(
    req: &v1::GenerateRequest,
    source: v1::DraftSource,
    max_draft_tokens: u32,
) -> v1::GenerateRequest {
    v1::GenerateRequest {
        speculation: Some(v1::Speculation {
            source: source as i32,
            max_draft_tokens,
        }),
        ..req.clone()
    }
}

fn chat(q: &str, max_tokens: u32, params: v1::SamplingParams) -> v1::GenerateRequest {
    v1::GenerateRequest {
        messages: vec![v1::ChatMessage {
            role: "user".into(),
            content: q.into(),
        }],
        max_tokens: Some(max_tokens),
        params: Some(params),
        ..Default::default()
    }
}

fn greedy() -> v1::SamplingParams {
    v1::SamplingParams {
        temperature: Some(0.0),
        repeat_penalty: Some(1.0),
        ..Default::default()
    }
}

fn seeded(seed: u64) -> v1::SamplingParams {
    v1::SamplingParams {
        seed: Some(seed),
        ..Default::default()
    }
}

const PARAGRAPH: &str = "The lighthouse at Point Reyes was built in 1870 and stands on a rocky \
    headland three hundred feet above the Pacific Ocean. Its first-order Fresnel lens, made in \
    France, was lit by an oil lamp until electricity arrived in 1938. Keepers climbed 308 steps \
    down from the cliff top every evening to wind the clockwork that turned the lens.";

/// Input-grounded prompts (copy, extract, edit), each as it is run.
fn grounded(params: impl Fn() -> v1::SamplingParams) -> Vec<(&'static str, v1::GenerateRequest)> {
    vec![
        (
            "copy",
            chat(
                &format!("Copy this paragraph exactly:\n\n{PARAGRAPH}"),
                96,
                params(),
            ),
        ),
        (
            "extract",
            chat(
                &format!(
                    "{PARAGRAPH}\n\nExtract the year built, the lens type and the number of \
                     steps as a JSON object with keys year, lens, steps."
                ),
                64,
                params(),
            ),
        ),
        (
            "edit",
            chat(
                &format!("Rewrite this text replacing 'lighthouse' with 'tower':\n\n{PARAGRAPH}"),
                96,
                params(),
            ),
        ),
    ]
}

/// Speculation on and off stream the same bytes: every Token message
/// (ids, texts, log-probabilities, probabilities, n_probs) and the
/// Finished; the usage's draft counts are consistent.
async fn assert_same_with_and_without(
    s: &TestServer,
    what: &str,
    req: &v1::GenerateRequest,
    max_draft: u32,
) -> v1::Usage {
    assert_same_drafting_from(s, what, req, v1::DraftSource::PromptLookup, max_draft).await
}

/// [`assert_same_with_and_without`] with drafts from `source`.
async fn assert_same_drafting_from(
    s: &TestServer,
    what: &str,
    req: &v1::GenerateRequest,
    source: v1::DraftSource,
    max_draft: u32,
) -> v1::Usage {
    let off = stream(s, req.clone()).await.unwrap();
    let on = stream(s, speculating_from(req, source, max_draft))
        .await
        .unwrap();
    assert_eq!(
        on.ids(),
        off.ids(),
        "{what}: tokens\n on: {:?}\noff: {:?}",
        on.text(),
        off.text()
    );
    assert_eq!(on.tokens, off.tokens, "{what}: Token messages");
    assert_eq!(on.comparable(), off.comparable(), "{what}: Finished");
    let (u, u_off) = (on.usage(), off.usage());
    assert_eq!(u.completion_tokens, u_off.completion_tokens, "{what}");
    assert_eq!(
        (u_off.draft_tokens, u_off.accepted_draft_tokens),
        (0, 0),
        "{what}"
    );
    assert!(
        u.accepted_draft_tokens <= u.draft_tokens,
        "{what}: {} accepted of {} drafted",
        u.accepted_draft_tokens,
        u.draft_tokens
    );
    // Every accepted draft is a token that took no forward pass.
    assert!(
        u.accepted_draft_tokens < u.completion_tokens.max(1),
        "{what}: {u:?}"
    );
    u
}

#[tokio::test]
async fn speculation_streams_the_same_bytes_greedy_and_seeded() {
    let host = require_model!(shared_host());
    let s = server_with(host).await;
    let mut accepted = 0;
    for (name, req) in grounded(greedy) {
        let u = assert_same_with_and_without(&s, &format!("greedy {name}"), &req, 0).await;
        accepted += u.accepted_draft_tokens;
    }
    // Copying a paragraph is what prompt lookup is for.
    assert!(
        accepted > 20,
        "{accepted} drafts accepted over the greedy prompts"
    );
    for (i, (name, req)) in grounded(|| seeded(11)).into_iter().enumerate() {
        let max_draft = [3, 8, 16][i];
        assert_same_with_and_without(&s, &format!("seeded {name}"), &req, max_draft).await;
    }
    s.stop().await;
}

/// The gates cut an accepted run at the token where step-by-step decoding
/// stops: a stop string from the middle of the greedy copy, max_tokens
/// inside a run of accepted drafts, and a chain with penalties, DRY,
/// n_probs candidates and return_logits (full and top-n rows); then a
/// JSON Schema.
#[tokio::test]
async fn speculation_stops_where_decoding_stops_and_keeps_every_chain() {
    let host = require_model!(shared_host());
    let s = server_with(host).await;
    let (_, copy) = grounded(greedy).remove(0);
    let full = stream(&s, copy.clone()).await.unwrap();
    let text = full.text();
    for (at, len) in [(text.len() / 3, 5), (text.len() * 2 / 3, 3)] {
        let start = (at..text.len())
            .find(|&i| text.is_char_boundary(i) && text.is_char_boundary(i + len))
            .unwrap();
        let mut stopped = copy.clone();
        stopped.stop = vec![text[start..start + len].to_string()];
        let u = assert_same_with_and_without(&s, "stop string", &stopped, 8).await;
        assert!(u.completion_tokens < full.tokens.len() as u32, "{u:?}");
    }
    for max_tokens in [1, 2, 7, 23] {
        let req = v1::GenerateRequest {
            max_tokens: Some(max_tokens),
            ..copy.clone()
        };
        let u =
            assert_same_with_and_without(&s, &format!("max_tokens {max_tokens}"), &req, 16).await;
        assert_eq!(u.completion_tokens, max_tokens);
    }
    // Token controls: a stop id from the middle of the copy (a draft never
    // carries the run past it), then min_tokens and a bad word.
    let stop_id = full.ids()[full.ids().len() / 2];
    let stopped = v1::GenerateRequest {
        stop_token_ids: vec![stop_id],
        ..copy.clone()
    };
    let u = assert_same_with_and_without(&s, "stop_token_ids", &stopped, 8).await;
    assert!(u.completion_tokens < full.tokens.len() as u32, "{u:?}");
    let controlled = v1::GenerateRequest {
        min_tokens: 4,
        bad_words: vec!["Pacific".into(), "lens".into()],
        ..copy.clone()
    };
    assert_same_with_and_without(&s, "min_tokens + bad_words", &controlled, 8).await;
    let penalised = v1::SamplingParams {
        seed: Some(5),
        repeat_penalty: Some(1.3),
        frequency_penalty: Some(0.2),
        dry_multiplier: Some(0.8),
        ..Default::default()
    };
    for (name, mut req) in grounded(|| penalised.clone()) {
        req.n_probs = 5;
        req.post_sampling_probs = name == "edit";
        // Each Token's raw logits are the row it was sampled from.
        req.return_logits = Some(v1::ReturnLogits {
            top_n: if name == "copy" { 0 } else { 8 },
            ..Default::default()
        });
        assert_same_with_and_without(&s, &format!("penalties+DRY+n_probs {name}"), &req, 8).await;
    }
    let schema = r#"{"type":"object","properties":{"year":{"type":"integer"},"lens":{"type":"string","maxLength":40},"steps":{"type":"integer"}},"required":["year","lens","steps"],"additionalProperties":false}"#;
    let (_, mut extract) = grounded(|| v1::SamplingParams {
        seed: Some(3),
        constraint: Some(v1::Constraint {
            kind: Some(v1::constraint::Kind::JsonSchema(schema.into())),
            ..Default::default()
        }),
        ..Default::default()
    })
    .remove(1);
    extract.max_tokens = Some(128);
    assert_same_with_and_without(&s, "json schema", &extract, 8).await;
    s.stop().await;
}

/// The prompt cache holds exactly the committed positions: a second
/// request sharing the first's prefix, with speculation and a cache,
/// streams what a server with neither streams; and a speculating run
/// resumed after k tokens streams the rest of the uninterrupted run.
#[tokio::test]
async fn speculation_keeps_the_prompt_cache_and_resume_exact() {
    let cached = require_model!(host_with(GenerateConfig::default()));
    let uncached = require_model!(host_with(GenerateConfig {
        prompt_cache_entries: 0,
        ..GenerateConfig::default()
    }));
    let (a, b) = (server_with(cached).await, server_with(uncached).await);
    let (_, copy) = grounded(greedy).remove(0);
    let first = stream(&a, speculating(&copy, 8)).await.unwrap();
    let next_turn = v1::GenerateRequest {
        messages: vec![
            copy.messages[0].clone(),
            v1::ChatMessage {
                role: "assistant".into(),
                content: first.text(),
            },
            v1::ChatMessage {
                role: "user".into(),
                content: "Now copy its first sentence again.".into(),
            },
        ],
        ..copy.clone()
    };
    for round in 0..2 {
        let with = stream(&a, speculating(&next_turn, 8)).await.unwrap();
        let without = stream(&b, next_turn.clone()).await.unwrap();
        assert_eq!(with.tokens, without.tokens, "round {round}");
        let u = with.usage();
        assert!(u.cached_prompt_tokens > 0, "round {round}: {u:?}");
        assert_eq!(with.comparable(), without.comparable(), "round {round}");
    }
    let full = stream(&a, speculating(&copy, 8)).await.unwrap();
    let n = full.tokens.len();
    for k in [1, 5, n / 2, n - 1] {
        let resumed = v1::GenerateRequest {
            resume: Some(v1::GenerateResume {
                token_ids: full.ids()[..k].to_vec(),
            }),
            ..speculating(&copy, 8)
        };
        for (server, s) in [("cached", &a), ("uncached", &b)] {
            let out = stream(s, resumed.clone()).await.unwrap();
            let why = format!("{server}, resumed after {k} tokens");
            assert_eq!(out.tokens, full.tokens[k..], "{why}");
            let mut f = out.comparable();
            assert_eq!(f.usage.as_ref().unwrap().resumed_tokens, k as u32, "{why}");
            f.usage.as_mut().unwrap().resumed_tokens = 0;
            assert_eq!(f, full.comparable(), "{why}");
        }
    }
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn bad_speculation_is_refused_naming_the_field() {
    let host = require_model!(shared_host());
    let s = server_with(host).await;
    let base = chat("Hi", 4, greedy());
    let with = |source: i32, max_draft_tokens: u32| v1::GenerateRequest {
        speculation: Some(v1::Speculation {
            source,
            max_draft_tokens,
        }),
        ..base.clone()
    };
    let cases = [
        (
            with(v1::DraftSource::Model as i32, 0),
            Code::FailedPrecondition,
            "speculation.source: DRAFT_SOURCE_MODEL needs a draft model",
        ),
        (
            with(v1::DraftSource::PromptLookup as i32, 17),
            Code::InvalidArgument,
            "speculation.max_draft_tokens: 17 exceeds the limit of 16 (limits.max_draft_tokens)",
        ),
        (
            with(9, 0),
            Code::InvalidArgument,
            "speculation.source: unknown DraftSource 9",
        ),
    ];
    for (req, code, want) in cases {
        let e = stream(&s, req).await.unwrap_err();
        assert_eq!(e.code(), code, "{}", e.message());
        assert!(
            e.message().contains(want),
            "{:?} lacks {want:?}",
            e.message()
        );
    }
    // Unspecified is off, and the limit itself is allowed.
    for req in [with(0, 0), with(v1::DraftSource::PromptLookup as i32, 16)] {
        let out = stream(&s, req).await.unwrap();
        assert_eq!(out.tokens.len(), 4);
    }
    s.stop().await;
}

/// The context's end cuts a speculating run at the token where
/// step-by-step decoding meets it (drafts never run past the cache).
#[tokio::test]
async fn speculation_ends_at_the_context_end_like_decoding() {
    let host = require_model!(host_with(GenerateConfig {
        n_ctx: 150,
        ..GenerateConfig::default()
    }));
    let s = server_with(host).await;
    for (name, req) in grounded(greedy) {
        let off = stream(&s, req.clone()).await.unwrap();
        let prompt = off.usage().prompt_tokens;
        if prompt >= 140 {
            continue;
        }
        assert_eq!(off.reason(), v1::FinishReason::ContextFull, "{name}");
        assert_eq!(off.usage().completion_tokens + prompt, 151, "{name}");
        assert_same_with_and_without(&s, &format!("context end, {name}"), &req, 16).await;
    }
    s.stop().await;
}

/// A tiny target (Q8_0) and two draft models over its vocabulary: the
/// same weights in Q4_1 (a draft that mostly agrees, as a model's own
/// smaller quantisation does) and unrelated weights (one that mostly
/// does not). Written once per process.
fn tiny_models() -> &'static (tempfile::TempDir, [std::path::PathBuf; 3]) {
    use candle_core::quantized::GgmlDType;
    static MODELS: OnceLock<(tempfile::TempDir, [std::path::PathBuf; 3])> = OnceLock::new();
    MODELS.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n);
        let paths = [
            p("target.gguf"),
            p("draft-q4_1.gguf"),
            p("draft-other.gguf"),
        ];
        tiny_formats::write_model(&paths[0], "llama", GgmlDType::Q8_0);
        tiny_formats::write_model(&paths[1], "llama", GgmlDType::Q4_1);
        tiny_formats::write_model_seeded(&paths[2], "llama", GgmlDType::Q4_1, 99);
        (dir, paths)
    })
}

fn tiny_host(draft: &std::path::Path, cfg: GenerateConfig) -> Arc<ModelHost> {
    tiny_host_paced(draft, unpaced(cfg))
}

fn tiny_host_paced(draft: &std::path::Path, cfg: GenerateConfig) -> Arc<ModelHost> {
    let (_, paths) = tiny_models();
    let host = ModelHost::load(&paths[0], cfg)
        .expect("target loads")
        .with_draft(draft, &samplerd_model::Placement::Cpu)
        .expect("draft loads");
    Arc::new(host)
}

/// A prompt for the tiny byte-level models (any text tokenizes).
fn tiny_request(prompt: &str, max_tokens: u32, params: v1::SamplingParams) -> v1::GenerateRequest {
    v1::GenerateRequest {
        prompt: prompt.into(),
        max_tokens: Some(max_tokens),
        params: Some(params),
        ..Default::default()
    }
}

/// Drafts from a draft model change nothing in the stream, greedy and
/// seeded, with a penalty/DRY chain and n_probs, stop strings, max_tokens
/// inside an accepted run, the end of generation (not ignored), and the
/// prompt cache's next turn — whatever the draft model: the target itself
/// (its drafts are drawn with the target's seed, steps and chain state, so
/// every one is accepted: the check that drafting is aligned), the same
/// weights in Q4_1, or unrelated weights.
#[tokio::test]
async fn draft_model_speculation_streams_the_same_bytes() {
    let (_, paths) = tiny_models();
    for (name, draft) in [
        ("the target itself", &paths[0]),
        ("same weights in Q4_1", &paths[1]),
        ("other weights", &paths[2]),
    ] {
        let s = server_with(tiny_host(draft, GenerateConfig::default())).await;
        let mut counts = (0, 0);
        let penalised = v1::SamplingParams {
            seed: Some(5),
            repeat_penalty: Some(1.3),
            frequency_penalty: Some(0.2),
            dry_multiplier: Some(0.8),
            ..Default::default()
        };
        let mut cases = vec![
            ("greedy", tiny_request("the cat sat on", 32, greedy())),
            ("seeded", tiny_request("once upon a time", 32, seeded(11))),
            (
                "penalties+DRY",
                tiny_request("the cat sat on", 32, penalised),
            ),
        ];
        for (_, req) in &mut cases {
            req.ignore_eos = true;
        }
        let mut probs = tiny_request("abc abc abc", 24, seeded(3));
        probs.n_probs = 4;
        probs.ignore_eos = true;
        cases.push(("n_probs", probs));
        // Not ignoring the end of generation: wherever the target ends,
        // so does the speculating run.
        cases.push(("eos", tiny_request("the end", 32, seeded(7))));
        for (case, req) in &cases {
            for max_draft in [2, 16] {
                let what = format!("{name}, {case}, K <= {max_draft}");
                let u =
                    assert_same_drafting_from(&s, &what, req, v1::DraftSource::Model, max_draft)
                        .await;
                counts.0 += u.draft_tokens;
                counts.1 += u.accepted_draft_tokens;
            }
        }
        // A stop string and max_tokens cut an accepted run where decoding
        // stops.
        // The stop string: two characters of a token before the last (the
        // tiny model's tokens are of very uneven length, so the text's
        // middle may lie in the last one; and many are bytes of no whole
        // character, streamed as U+FFFD, which the text never holds);
        // decoding stops at that token or before.
        let full = stream(&s, cases[0].1.clone()).await.unwrap();
        let last = full.tokens.len() - 1;
        let texts: Vec<&str> = full.tokens.iter().map(|t| t.text.as_str()).collect();
        let stop: String = texts[..last]
            .iter()
            .find(|t| t.chars().count() >= 2 && !t.contains('\u{FFFD}'))
            .map(|t| t.chars().take(2).collect())
            .unwrap_or_else(|| panic!("a token of two characters before the last: {texts:?}"));
        let mut stopped = cases[0].1.clone();
        stopped.stop = vec![stop];
        let u =
            assert_same_drafting_from(&s, "stop string", &stopped, v1::DraftSource::Model, 8).await;
        assert!(
            u.completion_tokens < full.tokens.len() as u32,
            "{u:?}, stop {:?} in {texts:?}",
            stopped.stop
        );
        for max_tokens in [1, 2, 9] {
            let mut short = cases[0].1.clone();
            short.max_tokens = Some(max_tokens);
            let u = assert_same_drafting_from(&s, "max_tokens", &short, v1::DraftSource::Model, 8)
                .await;
            assert_eq!(u.completion_tokens, max_tokens);
        }
        let (drafted, accepted) = counts;
        eprintln!("{name}: {accepted} of {drafted} drafts accepted");
        assert!(drafted > 100, "{name}: only {drafted} drafts");
        if draft == &paths[0] {
            assert_eq!(
                accepted, drafted,
                "{name}: every draft is the target's token"
            );
        } else {
            assert!(accepted < drafted, "{name}: every draft accepted");
        }
        s.stop().await;
    }
}

/// With pacing on (the default), a drafter as costly as the target (the
/// target itself) loses time per token, so drafting pauses and probes
/// (`generate::draft_pacing`, whose unit tests check when); whatever this
/// machine's timings decide, the text is the same bytes.
#[tokio::test]
async fn paced_draft_model_speculation_streams_the_same_bytes() {
    let (_, paths) = tiny_models();
    let s = server_with(tiny_host_paced(&paths[0], GenerateConfig::default())).await;
    for (name, params) in [("greedy", greedy()), ("seeded", seeded(9))] {
        let mut req = tiny_request("abc abc abc the cat sat on", 96, params);
        req.ignore_eos = true;
        let what = format!("paced, {name}");
        let u = assert_same_drafting_from(&s, &what, &req, v1::DraftSource::Model, 4).await;
        eprintln!(
            "{what}: {} of {} drafts accepted",
            u.accepted_draft_tokens, u.draft_tokens
        );
        assert_eq!(u.completion_tokens, 96, "{what}");
    }
    s.stop().await;
}

/// Prompt lookup with pacing on (the default): the same bytes as decoding
/// without drafts on the input-grounded prompts, however much drafting
/// this machine's timings pause.
#[tokio::test]
async fn paced_prompt_lookup_streams_the_same_bytes() {
    let host = require_model!(model_path().map(|p| {
        Arc::new(ModelHost::load(&p, GenerateConfig::default()).expect("model loads"))
    }));
    let s = server_with(host).await;
    for (name, req) in grounded(greedy) {
        let u = assert_same_with_and_without(&s, &format!("paced {name}"), &req, 0).await;
        eprintln!(
            "paced {name}: {} of {} drafts accepted",
            u.accepted_draft_tokens, u.draft_tokens
        );
    }
    s.stop().await;
}

/// The draft model's prompt cache: a later drafter takes the kept session
/// sharing the longest prefix with its text (cut to it), none without a
/// shared token or with too little room; a session replaces those it
/// extends, the least recently kept leave a full cache, and one the
/// memory budget cannot take is not kept.
#[test]
fn the_draft_cache_keeps_sessions_for_the_longest_shared_prefix() {
    use samplerd::generate::draft_cache::DraftCache;
    use samplerd::request::memory::MemoryBudget;
    let (_, paths) = tiny_models();
    let model = samplerd_model::Model::load(&paths[1], &Default::default()).expect("loads");
    let session = |tokens: &[u32]| {
        let mut s = model.new_session_with_capacity(64).expect("session");
        s.prefill(tokens).expect("prefill");
        s
    };
    let budget = MemoryBudget::new(1 << 30);
    let cache = DraftCache::new(&model, 2);
    cache.put(session(&[1, 2, 3, 4]), &budget);
    cache.put(session(&[1, 2, 9]), &budget);
    let taken = cache.take(&[1, 2, 3, 7, 8], 64).expect("a shared prefix");
    assert_eq!(taken.cached_tokens(), &[1, 2, 3]);
    assert!(cache.take(&[5, 6], 64).is_none(), "nothing shared");
    assert!(cache.take(&[1, 2, 9], 65).is_none(), "too little room");
    // [1, 2, 9] is still there; [1, 2, 9, 10] replaces it.
    cache.put(session(&[1, 2, 9, 10]), &budget);
    cache.put(session(&[7, 7]), &budget);
    let t = cache.take(&[1, 2, 9, 10, 11], 64).expect("the extension");
    assert_eq!(t.cached_tokens(), &[1, 2, 9, 10]);
    assert!(
        cache.take(&[1, 2, 9], 64).is_none(),
        "replaced by its extension"
    );
    // Full (2): the least recently kept leaves.
    cache.put(session(&[3]), &budget);
    cache.put(session(&[4]), &budget);
    assert!(cache.take(&[7, 7], 64).is_none(), "evicted");
    assert!(cache.take(&[3], 64).is_some());
    // A budget too small for one session keeps nothing.
    let small = MemoryBudget::new(1);
    let tight = DraftCache::new(&model, 2);
    tight.put(session(&[1, 2]), &small);
    assert!(tight.take(&[1, 2], 64).is_none());
    // Capacity 0: off.
    let off = DraftCache::new(&model, 0);
    off.put(session(&[1, 2]), &budget);
    assert!(off.take(&[1, 2], 64).is_none());
}

/// The prompt cache and a resumed run see exactly the committed tokens
/// with a draft model too (its own cache is resynchronised each round).
#[tokio::test]
async fn draft_model_speculation_keeps_the_prompt_cache_and_resume_exact() {
    let (_, paths) = tiny_models();
    let a = server_with(tiny_host(&paths[1], GenerateConfig::default())).await;
    let b = server_with(tiny_host(
        &paths[1],
        GenerateConfig {
            prompt_cache_entries: 0,
            ..GenerateConfig::default()
        },
    ))
    .await;
    let mut req = tiny_request("a b c d e f", 40, seeded(21));
    req.ignore_eos = true;
    let spec = speculating_from(&req, v1::DraftSource::Model, 6);
    let full = stream(&b, req.clone()).await.unwrap();
    for round in 0..2 {
        let with = stream(&a, spec.clone()).await.unwrap();
        assert_eq!(with.tokens, full.tokens, "round {round}");
        assert_eq!(with.comparable(), full.comparable(), "round {round}");
    }
    for k in [1, 7, 20] {
        let resumed = v1::GenerateRequest {
            resume: Some(v1::GenerateResume {
                token_ids: full.ids()[..k].to_vec(),
            }),
            ..spec.clone()
        };
        let out = stream(&a, resumed).await.unwrap();
        assert_eq!(out.tokens, full.tokens[k..], "resumed after {k}");
    }
    a.stop().await;
    b.stop().await;
}

/// A draft model must share the target's vocabulary: another one is
/// refused at load, naming the key and both files; so is one that is not
/// a model file.
#[test]
fn a_draft_model_over_another_vocabulary_is_refused_naming_both_files() {
    let (dir, paths) = tiny_models();
    let other = dir.path().join("tiny-qwen3-think.gguf");
    tiny_formats::write_thinking_model(&other);
    let load = |draft: &std::path::Path| {
        ModelHost::load(&paths[0], GenerateConfig::default())
            .unwrap()
            .with_draft(draft, &samplerd_model::Placement::Cpu)
            .err()
            .expect("refused")
            .to_string()
    };
    let e = load(&other);
    for want in [
        "model.draft_path:",
        "does not share the vocabulary",
        &format!("{} has 263 tokens", other.display()),
        &format!("{} has 261", paths[0].display()),
    ] {
        assert!(e.contains(want), "{e:?} lacks {want:?}");
    }
    let e = load(dir.path());
    assert!(
        e.starts_with("model.draft_path:") && e.contains("a directory"),
        "{e}"
    );
}
