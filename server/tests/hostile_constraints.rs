//! Hostile constraints: the corpus of `hostile/mod.rs` — deep nesting,
//! long rule chains, `$ref` chains and cycles, huge alternations,
//! catastrophic regexes, in GBNF, Lark, JSON Schema and regex — against
//! the real `samplerd serve`, through Sample, SampleBatch and (with
//! `SAMPLERD_MODEL`) Generate. Each is refused before it compiles with
//! INVALID_ARGUMENT naming the field, the measured value, the limit and
//! its config key, or compiles (on the compile pool's sized stack), or is
//! refused by the plugin; the server survives all of it. Then, in process:
//! hostile compiles run off the sampling threads (health, readiness and
//! unconstrained Sample keep answering while they run, a full queue is
//! refused at once, a compile past its budget is refused and stays
//! refused), and a batch or a repeated schema compiles once.
//!
//! Every wait is bounded.

mod common;
mod hostile;
mod process;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use samplerd_api::v1;
use samplerd_api::v1::sampler_client::SamplerClient;
use tonic::Code;
use tonic::transport::Channel;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};

/// Bound on any one answer (the longest legal compile here takes well
/// under a second; a crashed server answers at once, with an error).
const WAIT: Duration = Duration::from_secs(60);

/// A tokenizer.json whose tokens are the printable ASCII characters, the
/// newline and a few words, then `<|endoftext|>` (end of generation): any
/// grammar over ASCII text can be written with it.
fn ascii_tokenizer_json(dir: &Path) -> (PathBuf, usize) {
    let mut tokens: Vec<String> = (0x20u8..0x7f).map(|b| (b as char).to_string()).collect();
    tokens.push("\n".into());
    for w in ["w1", "ab", "{\"", "\":"] {
        tokens.push(w.into());
    }
    tokenizer_json(dir, &tokens)
}

fn constraint(kind: &str, text: String) -> v1::Constraint {
    use v1::constraint::Kind;
    v1::Constraint {
        kind: Some(match kind {
            "json_schema" => Kind::JsonSchema(text),
            "regex" => Kind::Regex(text),
            "lark" => Kind::Lark(text),
            "gbnf" => Kind::Gbnf(text),
            other => panic!("no kind {other}"),
        }),
        ..Default::default()
    }
}

fn params(kind: &str, text: String, vocabulary: &str) -> v1::SamplingParams {
    v1::SamplingParams {
        seed: Some(1),
        temperature: Some(0.0),
        vocabulary: vocabulary.into(),
        constraint: Some(constraint(kind, text)),
        ..Default::default()
    }
}

/// What a case must come to.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// Refused before compiling: over this limit key, measured at least this.
    Limit(&'static str, usize),
    /// Compiled: the request is served.
    Served,
    /// Refused by the constraint plugin (SAMPLERD_INVALID_CONSTRAINT).
    Invalid,
}

/// The corpus: each shape at a size over a default limit, and at a size
/// just inside it (which must compile).
const CORPUS: &[(&str, usize, Expect)] = &[
    // A sampling thread died at 5,000 (its stack); 2,000 compiled.
    (
        "gbnf-nest",
        5000,
        Expect::Limit("limits.max_constraint_depth", 15_000),
    ),
    ("gbnf-nest", 150, Expect::Served),
    // Lark allows 30 nested groups; GBNF's translation nests more.
    ("gbnf-nest-seq", 40, Expect::Invalid),
    (
        "gbnf-chain",
        1000,
        Expect::Limit("limits.max_constraint_depth", 999),
    ),
    ("gbnf-chain", 500, Expect::Served),
    (
        "gbnf-chain-nested",
        100,
        Expect::Limit("limits.max_constraint_depth", 2500),
    ),
    (
        "gbnf-alternation",
        90_000,
        Expect::Limit("limits.max_constraint_rules", 90_001),
    ),
    ("gbnf-alternation", 4000, Expect::Served),
    ("lark-nest", 40, Expect::Invalid),
    (
        "lark-chain",
        700,
        Expect::Limit("limits.max_constraint_depth", 699),
    ),
    ("lark-chain", 500, Expect::Served),
    (
        "lark-terminal-chain",
        700,
        Expect::Limit("limits.max_constraint_depth", 699),
    ),
    (
        "lark-chain-nested",
        60,
        Expect::Limit("limits.max_constraint_depth", 531),
    ),
    ("lark-chain-nested", 50, Expect::Served),
    (
        "lark-alternation",
        90_000,
        Expect::Limit("limits.max_constraint_rules", 90_001),
    ),
    ("lark-alternation", 4000, Expect::Served),
    (
        "json-nest",
        300,
        Expect::Limit("limits.max_constraint_depth", 601),
    ),
    // Nested deeper than serde_json's 128 levels: not valid JSON there.
    ("json-nest", 100, Expect::Invalid),
    ("json-nest", 60, Expect::Served),
    (
        "json-ref-chain",
        700,
        Expect::Limit("limits.max_constraint_depth", 700),
    ),
    ("json-ref-chain", 490, Expect::Served),
    (
        "json-ref-cycle",
        100,
        Expect::Limit("limits.max_constraint_depth", 600),
    ),
    ("json-ref-cycle", 20, Expect::Served),
    (
        "json-properties",
        5000,
        Expect::Limit("limits.max_constraint_rules", 5001),
    ),
    ("json-properties", 200, Expect::Served),
    ("json-enum", 100_000, Expect::Invalid),
    ("json-enum", 10_000, Expect::Served),
    (
        "regex-nest",
        5000,
        Expect::Limit("limits.max_constraint_depth", 5000),
    ),
    // regex-syntax's own nesting limit (250).
    ("regex-nest", 300, Expect::Invalid),
    ("regex-nest", 200, Expect::Served),
    ("regex-alternation", 90_000, Expect::Served),
    ("regex-counted", 1000, Expect::Served),
    ("regex-blowup", 30, Expect::Served),
];

/// The first number in `s` after `after`.
fn number_after(s: &str, after: &str) -> Option<usize> {
    let rest = &s[s.find(after)? + after.len()..];
    let digits: String = rest
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

/// Asserts `r` is what `expect` says for a request whose constraint field
/// is `field`.
fn check<T>(what: &str, r: Result<T, tonic::Status>, expect: Expect, field: &str) {
    match (expect, r) {
        (Expect::Served, Ok(_)) => {}
        (Expect::Limit(key, at_least), Err(e)) => {
            assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e:?}");
            let d = assert_reason(&e, Reason::LimitExceeded);
            assert_eq!(
                d.error_info().unwrap().metadata["limit"],
                key,
                "{what}: {e:?}"
            );
            let bad = d.bad_request().expect("a BadRequest");
            assert_eq!(bad.field_violations[0].field, field, "{what}: {e:?}");
            let m = e.message();
            assert!(m.contains(key), "{what}: {m}");
            let measured = number_after(m, field).unwrap_or(0);
            assert!(measured >= at_least, "{what}: measured {measured}: {m}");
            assert!(m.contains("over the limit of"), "{what}: {m}");
        }
        (Expect::Invalid, Err(e)) => {
            assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e:?}");
            assert_reason(&e, Reason::InvalidConstraint);
        }
        (expect, Err(e)) => panic!("{what}: expected {expect:?}, got {e:?}"),
        (expect, Ok(_)) => panic!("{what}: expected {expect:?}, but it was served"),
    }
}

async fn serving(channel: Channel) -> i32 {
    let mut h = HealthClient::new(channel);
    tokio::time::timeout(WAIT, h.check(HealthCheckRequest::default()))
        .await
        .expect("health answers in time")
        .expect("health answers")
        .into_inner()
        .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hostile_corpus_is_refused_or_compiled_and_the_server_survives() {
    let dir = tempfile::tempdir().unwrap();
    let (vocab_path, n_vocab) = ascii_tokenizer_json(dir.path());
    let model = model_path()
        .map(|m| format!("[model]\npath = {}\n", process::toml_path(&m)))
        .unwrap_or_else(|| {
            eprintln!("Generate not checked: no model (SAMPLERD_MODEL)");
            String::new()
        });
    let mut p = process::start(&format!(
        "[plugins]\nfiles = [{}, {}]\n[vocabularies]\nascii = {}\n{model}",
        process::toml_path(&core_plugin()),
        process::toml_path(&constraint_plugin()),
        process::toml_path(&vocab_path),
    ));
    let channel = p.channel().await;
    let mut client = SamplerClient::new(channel.clone())
        .max_decoding_message_size(CLIENT_MAX_MESSAGE)
        .max_encoding_message_size(CLIENT_MAX_MESSAGE);
    let logits = logits(n_vocab, 7);
    for &(shape, n, expect) in CORPUS {
        let case = hostile::generate(shape, n);
        let what = format!("{shape} n={n}");
        let field = format!("params.constraint.{}", case.kind);
        let sp = params(case.kind, case.text.clone(), "ascii");
        let sample = tokio::time::timeout(
            WAIT,
            client.sample(v1::SampleRequest {
                logits: logits.clone(),
                params: Some(sp.clone()),
                ..Default::default()
            }),
        )
        .await
        .unwrap_or_else(|_| panic!("{what}: Sample answers in time"));
        check(&format!("Sample {what}"), sample, expect, &field);
        // Three rows sharing the parameters: one compile, the same verdict
        // naming the first row.
        let rows = (0..3)
            .map(|_| v1::BatchRow {
                logits: to_bytes(&logits).into(),
                ..Default::default()
            })
            .collect();
        let batch = tokio::time::timeout(
            WAIT,
            client.sample_batch(v1::SampleBatchRequest {
                rows,
                params: Some(sp.clone()),
                ..Default::default()
            }),
        )
        .await
        .unwrap_or_else(|_| panic!("{what}: SampleBatch answers in time"));
        check(
            &format!("SampleBatch {what}"),
            batch,
            expect,
            &format!("rows[0].{field}"),
        );
        if !model.is_empty() && !matches!(expect, Expect::Served) {
            let mut gp = sp;
            gp.vocabulary.clear();
            let generation = tokio::time::timeout(
                WAIT,
                client.generate(v1::GenerateRequest {
                    prompt: "x".into(),
                    max_tokens: Some(1),
                    params: Some(gp),
                    ..Default::default()
                }),
            )
            .await
            .unwrap_or_else(|_| panic!("{what}: Generate answers in time"));
            check(
                &format!("Generate {what}"),
                generation.map(drop),
                expect,
                &field,
            );
        }
        assert!(
            p.child.try_wait().unwrap().is_none(),
            "{what}: samplerd exited"
        );
    }
    assert!(p.child.try_wait().unwrap().is_none(), "samplerd exited");
    assert_eq!(serving(channel).await, ServingStatus::Serving as i32);
    let plain = client
        .sample(v1::SampleRequest {
            logits: logits.clone(),
            params: Some(v1::SamplingParams {
                temperature: Some(0.0),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("a plain Sample is served after the corpus");
    assert_eq!(plain.into_inner().token_id, argmax(&logits));
}

/// An in-process server with the constraint plugin, the ASCII vocabulary
/// as `ascii`, and `tune` applied.
async fn constraint_server(
    dir: &Path,
    tune: impl FnOnce(&mut samplerd::app::config::Config),
) -> (TestServer, usize) {
    let (vocab_path, n_vocab) = ascii_tokenizer_json(dir);
    let mut c = test_config();
    c.plugins.files.push(constraint_plugin());
    c.vocabularies.insert("ascii".into(), vocab_path);
    tune(&mut c);
    (start_with(c).await, n_vocab)
}

/// A legal JSON Schema that takes long to compile (llguidance's
/// sequence of optional properties is quadratic in their number: ~1.5 s
/// for 3,000 on a loaded 2-core machine), distinct per `tag`.
fn slow_schema(tag: usize) -> String {
    let props: Vec<String> = (0..3000)
        .map(|i| format!(r#""t{tag}p{i}":{{"type":"string"}}"#))
        .collect();
    format!(
        r#"{{"type":"object","properties":{{{}}}}}"#,
        props.join(",")
    )
}

fn constrained(n_vocab: usize, kind: &str, text: String) -> v1::SampleRequest {
    v1::SampleRequest {
        logits: logits(n_vocab, 3),
        params: Some(params(kind, text, "ascii")),
        ..Default::default()
    }
}

/// Six hostile compiles at once (each legal, each seconds of work) once
/// held every sampling thread: readiness went NOT_SERVING and every Sample
/// UNAVAILABLE until they ended. Now they queue for the one compile thread
/// (a full queue is refused at once), the one that runs is refused at the
/// compile budget and stays refused, and meanwhile readiness is SERVING
/// and an unconstrained Sample is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_compiles_leave_sampling_and_readiness_alone() {
    let dir = tempfile::tempdir().unwrap();
    let (s, n_vocab) = constraint_server(dir.path(), |c| {
        c.limits.sampling_threads = 2;
        c.limits.max_stuck_workers = 1;
        c.limits.max_step_ms = 500;
        c.limits.constraint_compile_threads = 1;
        c.limits.constraint_compile_queue = 2;
        c.limits.max_constraint_compile_ms = 200;
    })
    .await;
    let hostile: Vec<_> = (0..6)
        .map(|tag| {
            let mut client = s.client.clone();
            let req = constrained(n_vocab, "json_schema", slow_schema(tag));
            tokio::spawn(async move { client.sample(req).await })
        })
        .collect();
    let constraints = &s.state().constraints;
    tokio::time::timeout(WAIT, async {
        while constraints.pool().running() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("a compile starts");

    // While it compiles: readiness and plain sampling.
    assert_eq!(
        serving(s.channel.clone()).await,
        ServingStatus::Serving as i32
    );
    let plain = tokio::time::timeout(
        WAIT,
        s.client.clone().sample(v1::SampleRequest {
            logits: logits(n_vocab, 4),
            params: Some(v1::SamplingParams {
                temperature: Some(0.0),
                ..Default::default()
            }),
            ..Default::default()
        }),
    )
    .await
    .expect("a plain Sample answers in time")
    .expect("a plain Sample is served while grammars compile");
    assert_eq!(plain.into_inner().token_id, argmax(&logits(n_vocab, 4)));

    let mut costly = Vec::new();
    let mut overloaded = 0;
    for (tag, h) in hostile.into_iter().enumerate() {
        let e = tokio::time::timeout(WAIT, h)
            .await
            .expect("each hostile request is answered in time")
            .unwrap()
            .expect_err("no hostile compile is served within 200 ms");
        assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
        match reason_of(&e) {
            Reason::ConstraintTooCostly => {
                costly.push(tag);
                assert!(
                    e.message()
                        .contains("limits.max_constraint_compile_ms = 200")
                        && e.message().contains("params.constraint.json_schema"),
                    "{e:?}"
                );
            }
            Reason::Overloaded => {
                overloaded += 1;
                assert!(
                    e.message().contains("limits.constraint_compile_queue"),
                    "{e:?}"
                );
            }
            other => panic!("{other:?}: {e:?}"),
        }
    }
    // One compiles at a time: only the first to start is too costly; the
    // two queued behind it never got the thread in time, the rest found
    // the queue full.
    assert!(
        !costly.is_empty() && overloaded >= 3,
        "too costly: {costly:?}, {overloaded} overloaded"
    );
    assert!(s.state().steps.healthy());
    assert_eq!(s.state().steps.stuck(), 0);
    // A grammar found too costly (whichever got the compile thread first)
    // is refused again without a new compile.
    let compiled = constraints.compiles();
    let again = s
        .client
        .clone()
        .sample(constrained(n_vocab, "json_schema", slow_schema(costly[0])))
        .await;
    let e = again.expect_err("still too costly");
    assert_eq!(reason_of(&e), Reason::ConstraintTooCostly, "{e:?}");
    assert_eq!(constraints.compiles(), compiled);
}

/// Every row of a batch that shares a 1 MB-class constraint once compiled
/// it again; now the batch, and the requests after it, compile it once,
/// and the compiled grammar is charged to the memory budget while cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_and_a_repeated_schema_compile_once() {
    let dir = tempfile::tempdir().unwrap();
    let (s, n_vocab) = constraint_server(dir.path(), |_| {}).await;
    let schema = r#"{"type":"object","properties":{"a":{"type":"integer"},"b":{"enum":["x","y"]}},"required":["a","b"]}"#;
    let p = params("json_schema", schema.into(), "ascii");
    let row = v1::BatchRow {
        logits: to_bytes(&logits(n_vocab, 5)).into(),
        ..Default::default()
    };
    let before = s.state().memory.charged();
    // Eight rows on the shared parameters, two with an equal copy of their own.
    let mut rows = vec![row.clone(); 8];
    rows[3].params = Some(p.clone());
    rows[6].params = Some(p.clone());
    let batch = s
        .client
        .clone()
        .sample_batch(v1::SampleBatchRequest {
            rows,
            params: Some(p.clone()),
            ..Default::default()
        })
        .await
        .expect("the batch is served")
        .into_inner();
    assert_eq!(batch.rows.len(), 8);
    assert_eq!(s.state().constraints.compiles(), 1);
    for seed in 0..3 {
        s.client
            .clone()
            .sample(v1::SampleRequest {
                logits: logits(n_vocab, seed),
                params: Some(p.clone()),
                ..Default::default()
            })
            .await
            .expect("served");
    }
    assert_eq!(s.state().constraints.compiles(), 1);
    let (entries, bytes) = s.state().constraints.cache().size();
    assert_eq!(entries, 1);
    assert_eq!(
        bytes,
        samplerd::service::constraint::compiled_bytes(schema.len())
    );
    assert_eq!(s.state().memory.charged() - before, bytes);
}

/// A legal schema whose parse outgrows llguidance's row bound partway
/// through (`ParserLimits::max_items_in_row`, 2,000 Earley items; an
/// object of N optional properties reaches ~4 N at its first token). It
/// compiles, and its first mask is computed, but the stage cannot follow
/// it past the opening brace. The grammar is the request's: the client
/// gets INVALID_ARGUMENT `SAMPLERD_STAGE_REFUSED` naming the stage and
/// `params.constraint` (it was INTERNAL `SAMPLERD_STAGE_FAILED`), and the
/// server serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grammar_that_outgrows_its_parser_is_the_requests_fault() {
    let dir = tempfile::tempdir().unwrap();
    let (s, n_vocab) = constraint_server(dir.path(), |_| {}).await;
    let props: Vec<String> = (0..800)
        .map(|i| format!(r#""p{i}":{{"type":"string"}}"#))
        .collect();
    let schema = format!(
        r#"{{"type":"object","properties":{{{}}}}}"#,
        props.join(",")
    );
    let messages: Vec<v1::SampleStreamRequest> = (0..8)
        .map(|i| v1::SampleStreamRequest {
            logits: logits(n_vocab, i),
            params: (i == 0).then(|| params("json_schema", schema.clone(), "ascii")),
            ..Default::default()
        })
        .collect();
    let mut client = s.client.clone();
    let answered = tokio::time::timeout(WAIT, async {
        let mut stream = client
            .sample_stream(tokio_stream::iter(messages))
            .await?
            .into_inner();
        let mut tokens = 0;
        while stream.message().await?.is_some() {
            tokens += 1;
        }
        Ok::<_, tonic::Status>(tokens)
    })
    .await
    .expect("the stream ends in time");
    let err = answered.expect_err("the grammar outgrows its parser within 8 steps");
    let d = assert_reason(&err, Reason::StageRefused);
    assert_eq!(d.error_info().unwrap().metadata["stage"], "constraint");
    let field = &d.bad_request().expect("BadRequest").field_violations[0];
    assert_eq!(field.field, "params.constraint", "{err:?}");
    assert!(
        err.message().contains("the grammar failed"),
        "llguidance's reason is kept: {err:?}"
    );
    assert!(!err.message().contains('\n'), "one line: {err:?}");
    let plain = s
        .client
        .clone()
        .sample(v1::SampleRequest {
            logits: logits(n_vocab, 2),
            params: Some(v1::SamplingParams {
                temperature: Some(0.0),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("the server serves on");
    assert_eq!(plain.into_inner().token_id, argmax(&logits(n_vocab, 2)));
}

/// Limits raised past what a sampling thread's 2 MiB stack could compile
/// (3,000-link chains need ~9–11 MiB): the compile threads' stack grows
/// with them, and the chains compile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raised_limits_get_a_stack_to_match() {
    let dir = tempfile::tempdir().unwrap();
    let (vocab_path, n_vocab) = ascii_tokenizer_json(dir.path());
    let mut p = process::start(&format!(
        "[plugins]\nfiles = [{}, {}]\n[vocabularies]\nascii = {}\n\
         [limits]\nmax_constraint_depth = 4000\n",
        process::toml_path(&core_plugin()),
        process::toml_path(&constraint_plugin()),
        process::toml_path(&vocab_path),
    ));
    let mut client = SamplerClient::new(p.channel().await);
    for shape in ["json-ref-chain", "lark-chain", "gbnf-chain"] {
        let case = hostile::generate(shape, 3000);
        let r = tokio::time::timeout(
            WAIT,
            client.sample(constrained(n_vocab, case.kind, case.text)),
        )
        .await
        .unwrap_or_else(|_| panic!("{shape}: answered in time"));
        check(shape, r, Expect::Served, "");
        assert!(
            p.child.try_wait().unwrap().is_none(),
            "{shape}: samplerd exited"
        );
    }
}
