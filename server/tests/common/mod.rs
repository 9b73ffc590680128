//! Shared test harness: an in-process server on 127.0.0.1:0 with the
//! plugin libraries cargo built next to the test binary, a tonic client,
//! and a bounded wait on the health check (no sleeps).
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use samplerd::app::config::Config;
use samplerd::app::server::{RunningServer, spawn};
use samplerd_api::v1::sampler_client::SamplerClient;
use tonic::transport::Channel;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};

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

    pub fn state(&self) -> &samplerd::service::AppState {
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

    /// Asserts the health check still answers SERVING.
    pub async fn assert_serving(&self) {
        let mut h = HealthClient::new(self.channel.clone());
        let r = h
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .expect("health check")
            .into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32);
    }
}

/// Starts a server with `config` and waits (bounded) for SERVING.
pub async fn start_with(config: Config) -> TestServer {
    let server = spawn(config, None).await.expect("server starts");
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

pub async fn start() -> TestServer {
    start_with(test_config()).await
}

/// Watches the overall health status until SERVING, within HEALTH_TIMEOUT.
pub async fn wait_serving(channel: Channel) {
    let mut h = HealthClient::new(channel);
    tokio::time::timeout(HEALTH_TIMEOUT, async {
        let mut watch = h
            .watch(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .expect("health watch")
            .into_inner();
        while let Some(msg) = watch.message().await.expect("health stream") {
            if msg.status == ServingStatus::Serving as i32 {
                return;
            }
        }
        panic!("health stream ended before SERVING");
    })
    .await
    .expect("server did not become SERVING in time");
}

/// Compiles the C stage `tests/fixtures/<src>` into `dir` with the system
/// C compiler.
pub fn build_fixture_plugin(src: &str, dir: &std::path::Path) -> std::path::PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let stem = src.trim_end_matches(".c");
    let out = dir.join(format!("lib{stem}.{}", std::env::consts::DLL_EXTENSION));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = std::process::Command::new(&cc)
        .args([
            "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-I",
        ])
        .arg(root.join("../plugins/sdk/include"))
        .arg(root.join("tests/fixtures").join(src))
        .arg("-o")
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("cannot run C compiler {cc:?}: {e}"));
    assert!(status.success(), "compiling {src} failed");
    out
}

/// Deterministic pseudo-random logits (a fixed LCG; no RNG dependency).
pub fn logits(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
        })
        .collect()
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

pub fn to_bytes(l: &[f32]) -> Vec<u8> {
    l.iter().flat_map(|f| f.to_le_bytes()).collect()
}

pub fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best as u32
}

/// The device ops of a device-prefix plan for the current window (what a
/// Generate loop on the GPU hands the backend each step): shared by the
/// GPU tests and the CUDA decode benchmark.
#[cfg(feature = "cuda")]
pub fn device_ops<'a>(
    stages: &'a [samplerd_sampling::device_prefix::DeviceStage],
    ids: &'a [u32],
    counts: &'a [u32],
) -> Vec<samplerd_model::cuda::backend::DeviceOp<'a>> {
    use samplerd_model::cuda::backend::DeviceOp;
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
