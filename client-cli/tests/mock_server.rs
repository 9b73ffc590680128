//! The client against an in-process mock Sampler service, for what a real
//! samplerd cannot show in CI: Generate (served only with a model) —
//! streaming text and the summary line, `--json`, which parameters are
//! sent, chat messages, the bearer token, Ctrl-C (exit 130, the server sees
//! the stream cancelled) — and a health check answering NOT_SERVING.

use std::io::Read as _;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use samplerd_api::v1;
use samplerd_api::v1::generate_response::Event;
use samplerd_api::v1::sampler_server::{Sampler, SamplerServer};
use samplerd_api::v1::{
    FinishReason, Finished, GenerateRequest, GenerateResponse, ListStagesRequest,
    ListStagesResponse, SampleBatchRequest, SampleBatchResponse, SampleBatchStreamRequest,
    SampleRequest, SampleResponse, SampleStreamRequest, Timings, Token, Usage,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream, UnixListenerStream};
use tonic::{Request, Response, Status, Streaming};

/// The prompt that makes the mock stream forever (until cancelled).
const ENDLESS: &str = "endless";
/// The tokens of a normal mock generation.
const PIECES: [&str; 5] = ["Once", " upon", " a", " time", "."];
/// Text the mock holds back until `Finished`.
const TAIL: &str = " The end";

#[derive(Default)]
struct Seen {
    requests: Mutex<Vec<GenerateRequest>>,
    authorization: Mutex<Vec<Option<String>>>,
    cancelled: AtomicBool,
}

struct Mock(Arc<Seen>);

type Events = ReceiverStream<Result<GenerateResponse, Status>>;

#[tonic::async_trait]
impl Sampler for Mock {
    async fn sample(&self, _: Request<SampleRequest>) -> Result<Response<SampleResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }

    async fn register_shared_memory(
        &self,
        _: Request<samplerd_api::v1::RegisterSharedMemoryRequest>,
    ) -> Result<Response<samplerd_api::v1::RegisterSharedMemoryResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }

    async fn unregister_shared_memory(
        &self,
        _: Request<samplerd_api::v1::UnregisterSharedMemoryRequest>,
    ) -> Result<Response<samplerd_api::v1::UnregisterSharedMemoryResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }

    type SampleStreamStream = ReceiverStream<Result<SampleResponse, Status>>;

    async fn sample_stream(
        &self,
        _: Request<Streaming<SampleStreamRequest>>,
    ) -> Result<Response<Self::SampleStreamStream>, Status> {
        Err(Status::unimplemented("mock"))
    }

    async fn sample_batch(
        &self,
        _: Request<SampleBatchRequest>,
    ) -> Result<Response<SampleBatchResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }

    type SampleBatchStreamStream = ReceiverStream<Result<SampleBatchResponse, Status>>;

    async fn sample_batch_stream(
        &self,
        _: Request<Streaming<SampleBatchStreamRequest>>,
    ) -> Result<Response<Self::SampleBatchStreamStream>, Status> {
        Err(Status::unimplemented("mock"))
    }

    type GenerateStream = Events;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Events>, Status> {
        let auth = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        self.0.authorization.lock().unwrap().push(auth);
        let req = request.into_inner();
        self.0.requests.lock().unwrap().push(req.clone());
        let seed = req.params.as_ref().and_then(|p| p.seed).unwrap_or(42);
        let (tx, rx) = mpsc::channel(4);
        let seen = self.0.clone();
        tokio::spawn(async move {
            let token = |i: usize, text: &str| GenerateResponse {
                event: Some(Event::Token(Token {
                    token_id: i as u32,
                    text: text.into(),
                    logprob: -0.5,
                    probs: vec![],
                    probability: 0.6,
                    ..Default::default()
                })),
            };
            if req.prompt == ENDLESS {
                for i in 0.. {
                    if tx.send(Ok(token(i, "tick "))).await.is_err() {
                        seen.cancelled.store(true, Ordering::SeqCst);
                        return;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                        _ = tx.closed() => {
                            seen.cancelled.store(true, Ordering::SeqCst);
                            return;
                        }
                    }
                }
            }
            for (i, p) in PIECES.iter().enumerate() {
                let _ = tx.send(Ok(token(i, p))).await;
            }
            let _ = tx
                .send(Ok(GenerateResponse {
                    event: Some(Event::Finished(Finished {
                        finish_reason: FinishReason::MaxTokens as i32,
                        usage: Some(Usage {
                            prompt_tokens: 3,
                            completion_tokens: PIECES.len() as u32,
                            cached_prompt_tokens: 0,
                            resumed_tokens: 0,
                            draft_tokens: 0,
                            accepted_draft_tokens: 0,
                        }),
                        seed,
                        text: TAIL.into(),
                        timings: Some(Timings {
                            prefill_ms: 1.0,
                            decode_tokens_per_second: 123.0,
                            sampling_us_per_token: 10.0,
                            numerics: "portable (avx2 order)".into(),
                        }),
                        ..Default::default()
                    })),
                }))
                .await;
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn list_stages(
        &self,
        _: Request<ListStagesRequest>,
    ) -> Result<Response<ListStagesResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }

    async fn tokenize(
        &self,
        _: Request<samplerd_api::v1::TokenizeRequest>,
    ) -> Result<Response<samplerd_api::v1::TokenizeResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }

    async fn detokenize(
        &self,
        _: Request<samplerd_api::v1::DetokenizeRequest>,
    ) -> Result<Response<samplerd_api::v1::DetokenizeResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }

    async fn get_server_info(
        &self,
        _: Request<samplerd_api::v1::GetServerInfoRequest>,
    ) -> Result<Response<samplerd_api::v1::GetServerInfoResponse>, Status> {
        Err(Status::unimplemented("mock"))
    }
}

/// A mock server on its own runtime thread; stops when dropped.
struct MockServer {
    addr: String,
    seen: Arc<Seen>,
    _shutdown: tokio::sync::oneshot::Sender<()>,
    _dir: Option<tempfile::TempDir>,
}

/// Where the mock listens.
enum Bind {
    Tcp(std::net::TcpListener),
    Unix(std::os::unix::net::UnixListener),
}

fn start_mock() -> MockServer {
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    std_listener.set_nonblocking(true).unwrap();
    let addr = format!("http://{}", std_listener.local_addr().unwrap());
    start_mock_on(Bind::Tcp(std_listener), addr, None)
}

/// The mock on a Unix-domain socket (`--addr unix:/path`).
fn start_mock_unix() -> MockServer {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("samplerd.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = format!("unix:{}", path.display());
    start_mock_on(Bind::Unix(listener), addr, Some(dir))
}

fn start_mock_on(bind: Bind, addr: String, dir: Option<tempfile::TempDir>) -> MockServer {
    let seen = Arc::new(Seen::default());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let svc = SamplerServer::new(Mock(seen.clone()));
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            // The mock never reports SERVING.
            let (reporter, health) = tonic_health::server::health_reporter();
            reporter
                .set_service_status("", tonic_health::ServingStatus::NotServing)
                .await;
            let router = tonic::transport::Server::builder()
                .add_service(health)
                .add_service(svc);
            let stop = async {
                let _ = stop_rx.await;
            };
            let _ = match bind {
                Bind::Tcp(l) => {
                    let incoming =
                        TcpListenerStream::new(tokio::net::TcpListener::from_std(l).unwrap());
                    router.serve_with_incoming_shutdown(incoming, stop).await
                }
                Bind::Unix(l) => {
                    let incoming =
                        UnixListenerStream::new(tokio::net::UnixListener::from_std(l).unwrap());
                    router.serve_with_incoming_shutdown(incoming, stop).await
                }
            };
        });
    });
    MockServer {
        addr,
        seen,
        _shutdown: stop_tx,
        _dir: dir,
    }
}

fn ctl(addr: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_samplerctl"));
    c.env_remove("SAMPLERD_ADDR")
        .env_remove("SAMPLERD_TOKEN")
        .env("NO_COLOR", "1")
        .args(["--addr", addr, "--timeout", "10"])
        .stdin(Stdio::null());
    c
}

fn out(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn generate_streams_text_and_prints_a_summary() {
    let mock = start_mock();
    let o = ctl(&mock.addr)
        .args(["generate", "Tell me a story", "-n", "16", "--seed", "1"])
        .output()
        .unwrap();
    let (stdout, stderr) = out(&o);
    assert_eq!(o.status.code(), Some(0), "{stdout}\n{stderr}");
    assert_eq!(stdout, format!("{}{TAIL}\n", PIECES.concat()));
    let summary = stderr.trim();
    assert_eq!(summary.lines().count(), 1, "{summary}");
    assert!(summary.starts_with("5 tokens"), "{summary}");
    assert!(summary.contains("123.0 tokens/s"), "{summary}");
    assert!(
        summary.contains("numerics: portable (avx2 order)"),
        "{summary}"
    );
    assert!(summary.contains("finish: MAX_TOKENS"), "{summary}");
    assert!(summary.contains("seed: 1"), "{summary}");

    let req = mock.seen.requests.lock().unwrap()[0].clone();
    assert_eq!(req.prompt, "Tell me a story");
    assert!(req.messages.is_empty());
    assert_eq!(req.max_tokens, Some(16));
    let p = req.params.unwrap();
    assert_eq!(p.seed, Some(1));
    // Unset flags are not sent (the server's defaults apply).
    assert_eq!(p.temperature, None);
    assert_eq!(p.top_k, None);
    assert_eq!(p.top_p, None);
    assert_eq!(p.repeat_penalty, None);
    assert!(p.samplers.is_empty());
    assert_eq!(mock.seen.authorization.lock().unwrap()[0], None);
}

#[test]
fn generate_over_a_unix_socket() {
    let mock = start_mock_unix();
    let o = ctl(&mock.addr)
        .args([
            "--token",
            "s3cret",
            "generate",
            "Tell me a story",
            "-n",
            "16",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = out(&o);
    assert_eq!(o.status.code(), Some(0), "{stdout}\n{stderr}");
    assert_eq!(stdout, format!("{}{TAIL}\n", PIECES.concat()));
    assert_eq!(
        mock.seen.requests.lock().unwrap()[0].prompt,
        "Tell me a story"
    );
    // A socket nobody listens on: unreachable, named.
    let gone = format!("{}.gone", mock.addr);
    let o = ctl(&gone).args(["stages"]).output().unwrap();
    let (_, stderr) = out(&o);
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr.contains(".gone"), "{stderr}");
}

#[test]
fn generate_sends_the_flags_given_chat_messages_and_the_token() {
    let mock = start_mock();
    let o = ctl(&mock.addr)
        .args([
            "--token",
            "s3cret",
            "generate",
            "What is 2+2?",
            "--system",
            "Be terse.",
            "--greedy",
            "--top-k",
            "5",
            "--top-p",
            "0.9",
            "--min-p",
            "0.1",
            "--repeat-penalty",
            "1.2",
            "--repeat-last-n",
            "-1",
            "--frequency-penalty",
            "0.5",
            "--presence-penalty",
            "-0.5",
            "--stop",
            "\n",
            "--stop",
            "END",
            "--samplers",
            "penalties;top_k;top_p;temperature",
            "-l",
            "7-inf",
            "--speculate",
            "prompt-lookup",
            "--max-draft",
            "6",
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = out(&o);
    assert_eq!(o.status.code(), Some(0), "{stdout}\n{stderr}");

    let req = mock.seen.requests.lock().unwrap()[0].clone();
    assert!(req.prompt.is_empty());
    let msgs: Vec<(&str, &str)> = req
        .messages
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect();
    assert_eq!(msgs, [("system", "Be terse."), ("user", "What is 2+2?")]);
    assert_eq!(req.stop, ["\n", "END"]);
    assert_eq!(req.max_tokens, None, "unset -n = server default");
    let p = req.params.unwrap();
    assert_eq!(p.temperature, Some(0.0));
    assert_eq!(p.top_k, Some(5));
    assert_eq!(p.top_p, Some(0.9));
    assert_eq!(p.min_p, Some(0.1));
    assert_eq!(p.repeat_penalty, Some(1.2));
    assert_eq!(p.repeat_last_n, Some(-1));
    assert_eq!(p.frequency_penalty, Some(0.5));
    assert_eq!(p.presence_penalty, Some(-0.5));
    assert_eq!(p.seed, None);
    assert_eq!(p.samplers, ["penalties", "top_k", "top_p", "temperature"]);
    assert_eq!(p.logit_bias.get(&7), Some(&f32::NEG_INFINITY));
    assert_eq!(
        req.speculation,
        Some(v1::Speculation {
            source: v1::DraftSource::PromptLookup as i32,
            max_draft_tokens: 6,
        })
    );
    assert_eq!(
        mock.seen.authorization.lock().unwrap()[0].as_deref(),
        Some("Bearer s3cret")
    );
}

#[test]
fn generate_json_prints_one_object_per_message() {
    let mock = start_mock();
    let o = ctl(&mock.addr)
        .args(["generate", "Tell me a story", "--json"])
        .output()
        .unwrap();
    let (stdout, stderr) = out(&o);
    assert_eq!(o.status.code(), Some(0), "{stdout}\n{stderr}");
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(lines.len(), PIECES.len() + 1);
    for (v, piece) in lines.iter().zip(PIECES) {
        assert_eq!(v["token"]["text"], piece);
    }
    let fin = &lines[PIECES.len()]["finished"];
    assert_eq!(fin["finish_reason"], "MAX_TOKENS");
    assert_eq!(fin["usage"]["completion_tokens"], PIECES.len());
    assert_eq!(fin["seed"], 42);
    assert_eq!(fin["text"], TAIL);
}

#[cfg(unix)]
#[test]
fn ctrl_c_cancels_the_stream_and_exits_130() {
    let mock = start_mock();
    let mut child = ctl(&mock.addr)
        .args(["generate", ENDLESS])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the first streamed bytes: the stream (and the Ctrl-C
    // handler) is up.
    let mut first = [0u8; 4];
    child
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    assert_eq!(&first, b"tick");
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "samplerctl did not exit after SIGINT"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(130));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !mock.seen.cancelled.load(Ordering::SeqCst) {
        assert!(
            Instant::now() < deadline,
            "the server never saw the stream cancelled"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn health_not_serving_exits_1() {
    let mock = start_mock();
    let o = ctl(&mock.addr).arg("health").output().unwrap();
    let (stdout, stderr) = out(&o);
    assert_eq!(o.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stdout.starts_with("NOT_SERVING"), "{stdout}");
}
