//! Shared test harness: an in-process server on 127.0.0.1:0 with the
//! plugin libraries cargo built next to the test binary, a tonic client,
//! and a bounded wait on the health check (no sleeps).
#![allow(dead_code)]

mod generation;
mod logits;
pub mod raw;
// Not every test binary uses them (as with the rest of this module).
#[allow(unused_imports)]
pub use generation::{DEADLINE, Output, generate, generate_choices, without_run_details};
#[allow(unused_imports)]
pub use logits::{argmax, logits, to_bytes};

use std::path::PathBuf;
use std::time::Duration;

use samplerd::app::config::Config;
use samplerd::app::server::{RunningServer, spawn};
pub use samplerd::status::Reason;
use samplerd_api::v1::sampler_client::SamplerClient;
use tonic::transport::Channel;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{
    HealthCheckRequest, HealthCheckResponse, health_check_response::ServingStatus,
};

/// Upper bound on waiting for the server to report SERVING.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(10);
/// Client-side message limit (above every server limit used in tests).
pub const CLIENT_MAX_MESSAGE: usize = 256 << 20;

/// `target/<profile>/`, where cargo puts the plugin libraries built as
/// dev-dependencies (the test binary lives in `target/<profile>/deps/`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("deps dir");
    deps.parent().expect("profile dir").to_path_buf()
}

/// A plugin library built by cargo: `target/<profile>/deps/NAME` first
/// (cargo refreshes a dev-dependency's cdylib there and does not copy it
/// up), else `target/<profile>/NAME` (only updated by a build of that
/// package, so possibly stale).
pub fn plugin_lib(name: &str) -> PathBuf {
    let dir = profile_dir();
    let candidates = [dir.join("deps").join(name), dir.join(name)];
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| panic!("{name} not built in {} or its deps/", dir.display()))
}

pub fn core_plugin() -> PathBuf {
    plugin_lib("libsamplerd_core_stages.so")
}

pub fn constraint_plugin() -> PathBuf {
    plugin_lib("libsamplerd_constraint_stage.so")
}

pub fn test_plugin() -> PathBuf {
    plugin_lib("libsamplerd_test_plugins.so")
}

/// A config for tests: ephemeral port, the core plugin only.
pub fn test_config() -> Config {
    let mut c = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    };
    c.plugins.files = vec![core_plugin()];
    c
}

pub struct TestServer {
    pub server: Option<RunningServer>,
    pub client: SamplerClient<Channel>,
    pub channel: Channel,
}

impl TestServer {
    pub async fn stop(mut self) {
        if let Some(s) = self.server.take() {
            s.stop().await.expect("clean shutdown");
        }
    }

    pub fn state(&self) -> &samplerd::service::state::AppState {
        &self.server.as_ref().unwrap().state
    }

    /// Runs `msgs` as one `SampleStream` through tonic's client and returns
    /// every response (each step must succeed).
    pub async fn stream_all(
        &self,
        msgs: Vec<samplerd_api::v1::SampleStreamRequest>,
    ) -> Vec<samplerd_api::v1::SampleResponse> {
        let mut st = self
            .client
            .clone()
            .sample_stream(tokio_stream::iter(msgs))
            .await
            .expect("SampleStream opens")
            .into_inner();
        let mut out = Vec::new();
        while let Some(r) = st.message().await.expect("SampleStream step succeeds") {
            out.push(r);
        }
        out
    }

    /// One Sample call that must succeed.
    pub async fn sample_ok(
        &self,
        req: samplerd_api::v1::SampleRequest,
    ) -> samplerd_api::v1::SampleResponse {
        let mut client = self.client.clone();
        client
            .sample(req)
            .await
            .expect("Sample succeeds")
            .into_inner()
    }

    /// One Sample call that must fail: its status.
    pub async fn sample_err(&self, req: samplerd_api::v1::SampleRequest) -> tonic::Status {
        let mut client = self.client.clone();
        client.sample(req).await.expect_err("Sample must fail")
    }

    /// One Sample call that must fail with `code` and a message naming
    /// every one of `needles` (as [`assert_status`] checks), after which
    /// the server still answers SERVING.
    pub async fn assert_sample_refused(
        &self,
        req: samplerd_api::v1::SampleRequest,
        code: tonic::Code,
        needles: &[&str],
    ) {
        let err = self.sample_err(req).await;
        assert_status(&err, code, needles);
        self.assert_serving().await;
    }

    pub fn addr(&self) -> std::net::SocketAddr {
        self.server.as_ref().unwrap().addr
    }

    /// Asserts the health check still answers SERVING.
    pub async fn assert_serving(&self) {
        assert_health(&self.channel, "", ServingStatus::Serving).await;
    }
}

/// Starts a server with `config` and waits (bounded) for SERVING.
pub async fn start_with(config: Config) -> TestServer {
    start_serving(config, None).await
}

/// Starts a server with the test config as `tune` changes it (most tests
/// differ from it in one limit or switch).
pub async fn start_tuned(tune: impl FnOnce(&mut Config)) -> TestServer {
    let mut config = test_config();
    tune(&mut config);
    start_with(config).await
}

/// Starts a server with `config` and a model host for Generate, and
/// waits (bounded) for SERVING.
pub async fn start_serving(
    config: Config,
    generator: Option<std::sync::Arc<dyn samplerd::generate::generator::Generator>>,
) -> TestServer {
    let server = spawn(config, generator).await.expect("server starts");
    let channel = Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(32 << 20)
        .connect()
        .await
        .expect("connect");
    wait_serving(channel.clone()).await;
    let client = SamplerClient::new(channel.clone())
        .max_decoding_message_size(CLIENT_MAX_MESSAGE)
        .max_encoding_message_size(CLIENT_MAX_MESSAGE);
    TestServer {
        server: Some(server),
        client,
        channel,
    }
}

/// A chain stage with `params` of any kind.
pub fn stage_spec<'a>(
    name: &str,
    params: impl IntoIterator<Item = (&'a str, samplerd_api::v1::param_value::Kind)>,
) -> samplerd_api::v1::StageSpec {
    use samplerd_api::v1;
    v1::StageSpec {
        name: name.into(),
        params: params
            .into_iter()
            .map(|(k, kind)| (k.to_string(), v1::ParamValue { kind: Some(kind) }))
            .collect(),
    }
}

/// A chain stage with numeric parameters.
pub fn number_stage(name: &str, params: &[(&str, f64)]) -> samplerd_api::v1::StageSpec {
    use samplerd_api::v1::param_value::Kind;
    stage_spec(name, params.iter().map(|&(k, v)| (k, Kind::Number(v))))
}

/// A chain stage with text parameters.
pub fn text_stage(name: &str, params: &[(&str, &str)]) -> samplerd_api::v1::StageSpec {
    use samplerd_api::v1::param_value::Kind;
    stage_spec(name, params.iter().map(|&(k, v)| (k, Kind::Text(v.into()))))
}

/// A Generate of exactly `max_tokens` tokens of `prompt` (the end of
/// sequence does not stop it).
pub fn exact_generate(prompt: &str, max_tokens: u32) -> samplerd_api::v1::GenerateRequest {
    samplerd_api::v1::GenerateRequest {
        prompt: prompt.into(),
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..Default::default()
    }
}

/// Asserts that `err` has `code`, a message naming every one of `needles`,
/// and the details every samplerd error carries: an `ErrorInfo` in the
/// `samplerd.v1` domain whose reason has this code.
pub fn assert_status(err: &tonic::Status, code: tonic::Code, needles: &[&str]) {
    assert_eq!(err.code(), code, "{err:?}");
    for n in needles {
        assert!(
            err.message().contains(n),
            "{:?} should contain {n:?}",
            err.message()
        );
    }
    let reason = reason_of(err);
    assert_eq!(reason.code(), code, "{reason:?} in {err:?}");
}

/// The [`Reason`] in `err`'s `ErrorInfo` (which must be there, in the
/// samplerd domain).
pub fn reason_of(err: &tonic::Status) -> Reason {
    use tonic_types::StatusExt as _;
    let info = err
        .get_details_error_info()
        .unwrap_or_else(|| panic!("no ErrorInfo in {err:?}"));
    assert_eq!(info.domain, samplerd::status::ERROR_DOMAIN, "{err:?}");
    *Reason::ALL
        .iter()
        .find(|r| r.as_str() == info.reason)
        .unwrap_or_else(|| panic!("unknown reason {:?} in {err:?}", info.reason))
}

/// Asserts that `err` carries `reason` (and its code); returns the details
/// for the caller's further checks.
pub fn assert_reason(err: &tonic::Status, reason: Reason) -> tonic_types::ErrorDetails {
    use tonic_types::StatusExt as _;
    assert_eq!(reason_of(err), reason, "{err:?}");
    assert_eq!(err.code(), reason.code(), "{err:?}");
    err.get_error_details()
}

/// A tokenizer.json of `n` tokens: `n - 1` plain ones and, last, the
/// special `<|endoftext|>` (an end-of-generation token, which constrained
/// sampling needs).
pub fn plain_tokenizer_json(dir: &std::path::Path, n: usize) -> std::path::PathBuf {
    let tokens: Vec<String> = (0..n - 1).map(|i| format!("t{i}")).collect();
    tokenizer_json(dir, &tokens).0
}

/// A tokenizer.json (BPE, no merges) of `tokens` in order, then
/// `<|endoftext|>` (end of generation), written into `dir`: its path and
/// the vocabulary's size.
pub fn tokenizer_json(dir: &std::path::Path, tokens: &[String]) -> (std::path::PathBuf, usize) {
    let vocab: Vec<String> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| format!("{}:{i}", serde_json::to_string(t).unwrap()))
        .collect();
    let json = format!(
        r#"{{"version":"1.0","truncation":null,"padding":null,
        "added_tokens":[{{"id":{eog},"content":"<|endoftext|>","single_word":false,
          "lstrip":false,"rstrip":false,"normalized":false,"special":true}}],
        "normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,
        "model":{{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,
        "end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,
        "vocab":{{{vocab}}},"merges":[]}}}}"#,
        eog = tokens.len(),
        vocab = vocab.join(",")
    );
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json).unwrap();
    (path, tokens.len() + 1)
}

/// The real-model path from `SAMPLERD_MODEL`, if set (it must name a file).
pub fn model_path() -> Option<PathBuf> {
    let p = PathBuf::from(std::env::var_os("SAMPLERD_MODEL")?);
    assert!(p.is_file(), "SAMPLERD_MODEL={} is not a file", p.display());
    Some(p)
}

pub async fn start() -> TestServer {
    start_with(test_config()).await
}

/// A fresh HTTP/2 connection (its own TCP socket) to `addr`.
pub async fn connect(addr: std::net::SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect")
}

/// Bound on opening a held stream and on its first answer.
pub const STREAM_OPEN_TIMEOUT: Duration = Duration::from_secs(60);

/// The sending half of a SampleStream the test feeds by hand; dropping it
/// half-closes the request stream.
pub type StreamSender = tokio::sync::mpsc::Sender<samplerd_api::v1::SampleStreamRequest>;

/// A request stream fed through the returned sender, with `first` already
/// queued (so the server answers as soon as the stream opens).
pub async fn held_requests(
    first: samplerd_api::v1::SampleStreamRequest,
) -> (
    StreamSender,
    tokio_stream::wrappers::ReceiverStream<samplerd_api::v1::SampleStreamRequest>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(first).await.unwrap();
    (tx, tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// A SampleStream held open by the test: the sender of its requests, its
/// responses, and the answer to its first message.
pub type HeldStream = (
    StreamSender,
    tonic::Streaming<samplerd_api::v1::SampleResponse>,
    samplerd_api::v1::SampleResponse,
);

/// Opens a SampleStream with `first` as its first message, waits (bounded)
/// for that message's answer and keeps the stream open.
pub async fn open_stream(
    client: &mut SamplerClient<Channel>,
    first: samplerd_api::v1::SampleStreamRequest,
) -> HeldStream {
    let (tx, requests) = held_requests(first).await;
    let mut stream = tokio::time::timeout(STREAM_OPEN_TIMEOUT, client.sample_stream(requests))
        .await
        .expect("stream opens in time")
        .expect("stream opens")
        .into_inner();
    let first = next_message(&mut stream, STREAM_OPEN_TIMEOUT).await;
    (tx, stream, first)
}

/// Waits (bounded) until every SampleStream session has been released.
pub async fn wait_sessions_closed(s: &TestServer) {
    wait_sessions_closed_to(s, 0).await;
}

/// Waits (bounded) until at most `n` SampleStream sessions are open.
pub async fn wait_sessions_closed_to(s: &TestServer, n: usize) {
    tokio::time::timeout(HEALTH_TIMEOUT, async {
        while s.state().open_sessions() > n {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("sessions released in time");
}

/// Defines `$name(channel)`: the service names that reflection (protocol
/// `$version`) lists. The two versions are separate generated types with
/// no trait in common, hence one body for both through a macro.
macro_rules! reflection_list_services {
    ($name:ident, $version:ident) => {
        pub async fn $name(channel: Channel) -> Result<Vec<String>, tonic::Status> {
            use tonic_reflection::pb::$version::ServerReflectionRequest;
            use tonic_reflection::pb::$version::server_reflection_client::ServerReflectionClient;
            use tonic_reflection::pb::$version::server_reflection_request::MessageRequest;
            use tonic_reflection::pb::$version::server_reflection_response::MessageResponse;
            let mut c = ServerReflectionClient::new(channel);
            let req = ServerReflectionRequest {
                host: String::new(),
                message_request: Some(MessageRequest::ListServices(String::new())),
            };
            let mut resp = tokio::time::timeout(
                HEALTH_TIMEOUT,
                c.server_reflection_info(tokio_stream::iter(vec![req])),
            )
            .await
            .expect("reflection answers in time")?
            .into_inner();
            let msg = resp.message().await?.expect("one answer");
            match msg.message_response {
                Some(MessageResponse::ListServicesResponse(list)) => {
                    Ok(list.service.into_iter().map(|s| s.name).collect())
                }
                other => panic!(
                    "unexpected {} reflection answer: {other:?}",
                    stringify!($version)
                ),
            }
        }
    };
}
reflection_list_services!(list_services_v1, v1);
reflection_list_services!(list_services_v1alpha, v1alpha);

/// Asserts that the health check of `service` ("" for the overall
/// status) answers `want`.
pub async fn assert_health(channel: &Channel, service: &str, want: ServingStatus) {
    let r = HealthClient::new(channel.clone())
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .expect("health check")
        .into_inner();
    assert_eq!(r.status, want as i32, "health of {service:?}");
}

/// A Watch on the overall health status.
pub async fn health_watch(channel: &Channel) -> tonic::Streaming<HealthCheckResponse> {
    HealthClient::new(channel.clone())
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health watch")
        .into_inner()
}

/// Reads `watch` until it reports `want`, within `timeout`.
pub async fn wait_health(
    watch: &mut tonic::Streaming<HealthCheckResponse>,
    want: ServingStatus,
    timeout: Duration,
) {
    tokio::time::timeout(timeout, async {
        while let Some(msg) = watch.message().await.expect("health stream") {
            if msg.status == want as i32 {
                return;
            }
        }
        panic!("health stream ended before {want:?}");
    })
    .await
    .unwrap_or_else(|_| panic!("health did not turn {want:?} within {timeout:?}"));
}

/// Watches the overall health status until SERVING, within HEALTH_TIMEOUT.
pub async fn wait_serving(channel: Channel) {
    let mut watch = tokio::time::timeout(HEALTH_TIMEOUT, health_watch(&channel))
        .await
        .expect("health watch opens in time");
    wait_health(&mut watch, ServingStatus::Serving, HEALTH_TIMEOUT).await;
}

/// The next message of `stream`, which must come, and within `timeout`.
pub async fn next_message<T>(stream: &mut tonic::Streaming<T>, timeout: Duration) -> T {
    tokio::time::timeout(timeout, stream.message())
        .await
        .expect("next message in time")
        .expect("next message")
        .expect("a message, not the end of the stream")
}

/// Asserts that `stream` ends cleanly (no error), within `timeout`.
pub async fn assert_clean_end<T: std::fmt::Debug>(
    stream: &mut tonic::Streaming<T>,
    timeout: Duration,
) {
    let end = tokio::time::timeout(timeout, stream.message())
        .await
        .expect("stream end in time");
    assert!(matches!(end, Ok(None)), "stream ends cleanly: {end:?}");
}

/// Compiles the C stage `tests/fixtures/<src>` into `dir` with the system
/// C compiler.
pub fn build_fixture_plugin(src: &str, dir: &std::path::Path) -> std::path::PathBuf {
    build_fixture_plugin_with(src, dir, src.trim_end_matches(".c"), &[])
}

/// As [`build_fixture_plugin`], into `lib<lib>.so` with `-D` `defines`.
pub fn build_fixture_plugin_with(
    src: &str,
    dir: &std::path::Path,
    lib: &str,
    defines: &[&str],
) -> std::path::PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = dir.join(format!("lib{lib}.{}", std::env::consts::DLL_EXTENSION));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = std::process::Command::new(&cc)
        .args([
            "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-I",
        ])
        .arg(root.join("../plugins/sdk/include"))
        .args(defines.iter().map(|d| format!("-D{d}")))
        .arg(root.join("tests/fixtures").join(src))
        .arg("-o")
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("cannot run C compiler {cc:?}: {e}"));
    assert!(status.success(), "compiling {src} failed");
    out
}

/// The headers of a gRPC call to `path` for a raw HTTP/2 client (tests
/// that control the framing themselves).
pub fn raw_grpc_request(addr: std::net::SocketAddr, path: &str) -> http::Request<()> {
    http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

/// The device ops of a device-prefix plan for the current window (what a
/// Generate loop on the GPU hands the backend each step): shared by the
/// GPU tests and the CUDA decode benchmark.
#[cfg(feature = "cuda")]
pub fn device_ops<'a>(
    stages: &'a [samplerd_sampling::device_prefix::DeviceStage],
    ids: &'a [u32],
    counts: &'a [u32],
) -> Vec<samplerd_model::cuda::DeviceOp<'a>> {
    use samplerd_model::cuda::DeviceOp;
    use samplerd_sampling::device_prefix::DeviceStage;
    stages
        .iter()
        .map(|s| match s {
            DeviceStage::LogitBias { ids, bias, starts } => {
                DeviceOp::LogitBias { ids, bias, starts }
            }
            DeviceStage::Penalties {
                repeat,
                frequency,
                presence,
                ..
            } => DeviceOp::Penalties {
                ids,
                counts,
                repeat: *repeat,
                frequency: *frequency,
                presence: *presence,
            },
            DeviceStage::Temperature(t) => DeviceOp::Temperature(*t),
            DeviceStage::TopK(k) => DeviceOp::TopK(*k),
            DeviceStage::KeepMax { .. } => DeviceOp::TopK(1),
        })
        .collect()
}
