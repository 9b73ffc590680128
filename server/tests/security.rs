//! Security tests over real gRPC on loopback: TLS and mutual TLS with
//! certificates made at test time (rcgen), bearer-token authentication
//! (health stays open, reflection can be turned off), plugin trust
//! (permissions, SHA-256 pins) and the request limits this area added
//! (chain length, streams per connection, deadlines). Every wait is bounded.

mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use samplerd::app::config::Config;
use samplerd::app::server::{RunningServer, spawn};
use samplerd::generate::generator::{GenerateJob, GenerateSink, Generator};
use samplerd_api::v1;
use samplerd_api::v1::sampler_client::SamplerClient;
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

/// Bound on any single wait in these tests.
const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------- certs --

/// A test CA that can issue server and client certificates.
struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl TestCa {
    fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        TestCa { issuer }
    }

    fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// (certificate PEM, key PEM) for `names`, signed by this CA.
    fn issue(&self, names: &[&str]) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let cert = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &self.issuer)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// A TLS server config (server cert for localhost/127.0.0.1 from `ca`).
fn tls_config(dir: &Path, ca: &TestCa, client_ca: Option<&TestCa>) -> Config {
    let (cert, key) = ca.issue(&["localhost", "127.0.0.1"]);
    let mut c = test_config();
    c.tls.cert_file = Some(write(dir, "server.pem", &cert));
    c.tls.key_file = Some(write(dir, "server.key", &key));
    c.tls.client_ca_file = client_ca.map(|ca| write(dir, "client-ca.pem", &ca.pem()));
    c
}

async fn tls_channel(
    server: &RunningServer,
    trust: &TestCa,
    identity: Option<(String, String)>,
) -> Result<Channel, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(trust.pem()))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let endpoint = Channel::from_shared(format!("https://{}", server.addr))
        .unwrap()
        .tls_config(tls)
        .unwrap();
    // A failed handshake can surface at connect or at the first call.
    let channel = tokio::time::timeout(WAIT, endpoint.connect())
        .await
        .map_err(|_| "connect timed out".to_string())?
        .map_err(|e| format!("{e:?}"))?;
    let mut h = HealthClient::new(channel.clone());
    tokio::time::timeout(
        WAIT,
        h.check(HealthCheckRequest {
            service: String::new(),
        }),
    )
    .await
    .map_err(|_| "health timed out".to_string())?
    .map_err(|e| format!("{e:?}"))?;
    Ok(channel)
}

async fn list_stages(channel: Channel) -> Result<usize, tonic::Status> {
    let mut c = SamplerClient::new(channel);
    let r = tokio::time::timeout(WAIT, c.list_stages(v1::ListStagesRequest::default()))
        .await
        .expect("ListStages answers in time")?;
    Ok(r.into_inner().stages.len())
}

#[tokio::test]
async fn tls_serves_verified_clients_and_refuses_plaintext() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("samplerd test CA");
    let server = spawn(tls_config(dir.path(), &ca, None), None)
        .await
        .unwrap();

    let channel = tls_channel(&server, &ca, None).await.expect("TLS client");
    assert!(list_stages(channel).await.unwrap() > 0);

    // A client that trusts another CA refuses the server's certificate.
    let other = TestCa::new("other CA");
    let err = tls_channel(&server, &other, None).await.unwrap_err();
    assert!(
        err.contains("UnknownIssuer") || err.contains("certificate"),
        "{err}"
    );

    // Plaintext HTTP/2 to the TLS port gets no gRPC answer.
    let plain = Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect_timeout(WAIT)
        .timeout(WAIT)
        .connect_lazy();
    assert!(list_stages(plain).await.is_err());

    server.stop().await.unwrap();
}

#[tokio::test]
async fn mutual_tls_requires_a_client_certificate_from_the_client_ca() {
    let dir = tempfile::tempdir().unwrap();
    let server_ca = TestCa::new("server CA");
    let client_ca = TestCa::new("client CA");
    let server = spawn(tls_config(dir.path(), &server_ca, Some(&client_ca)), None)
        .await
        .unwrap();

    let good = client_ca.issue(&["client.test"]);
    let channel = tls_channel(&server, &server_ca, Some(good))
        .await
        .expect("client with a certificate from the client CA");
    assert!(list_stages(channel).await.unwrap() > 0);

    assert!(
        tls_channel(&server, &server_ca, None).await.is_err(),
        "no client certificate must be refused"
    );
    let rogue = TestCa::new("rogue CA").issue(&["client.test"]);
    assert!(
        tls_channel(&server, &server_ca, Some(rogue)).await.is_err(),
        "a certificate from another CA must be refused"
    );
    server.stop().await.unwrap();
}

/// The error a server with `cfg` ends with: it starts, and its task ends
/// (bounded) with the error once serving begins.
async fn serve_error(cfg: Config) -> String {
    let server = spawn(cfg, None).await.unwrap();
    tokio::time::timeout(WAIT, server.stop())
        .await
        .expect("server task ends")
        .unwrap_err()
        .to_string()
}

#[tokio::test]
async fn bad_tls_files_fail_start_up_naming_key_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = test_config();
    let missing = dir.path().join("missing.pem");
    c.tls.cert_file = Some(missing.clone());
    c.tls.key_file = Some(dir.path().join("missing.key"));
    // The files are read when serving starts.
    let err = serve_error(c).await;
    assert!(err.contains("tls.cert_file"), "{err}");
    assert!(err.contains(&missing.display().to_string()), "{err}");
}

// ----------------------------------------------------------------- auth --

fn with_token(token: &str) -> impl tonic::service::Interceptor + Clone {
    let value: tonic::metadata::MetadataValue<_> = format!("Bearer {token}").parse().unwrap();
    move |mut req: tonic::Request<()>| {
        req.metadata_mut().insert("authorization", value.clone());
        Ok(req)
    }
}

#[tokio::test]
async fn bearer_tokens_guard_everything_but_health() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = write(
        dir.path(),
        "tokens",
        "# deploy tokens\n\n  alpha-123  \nbeta-456\n",
    );
    // start_tuned waits on health: open without a token.
    let s = start_tuned(|c| c.auth.tokens_file = Some(tokens)).await;

    let err = list_stages(s.channel.clone()).await.unwrap_err();
    assert_status(&err, Code::Unauthenticated, &["authorization"]);

    for bad in ["alpha-12", "alpha-1234", "ALPHA-123", "# deploy tokens", ""] {
        let mut c = SamplerClient::with_interceptor(s.channel.clone(), with_token(bad));
        let err = c
            .list_stages(v1::ListStagesRequest::default())
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated, "{bad:?}: {err:?}");
        assert!(!err.message().contains("alpha"), "{err:?}");
    }
    for good in ["alpha-123", "beta-456"] {
        let mut c = SamplerClient::with_interceptor(s.channel.clone(), with_token(good));
        let r = c.list_stages(v1::ListStagesRequest::default()).await;
        assert!(r.is_ok(), "{good}: {r:?}");
        let r = c
            .sample(v1::SampleRequest {
                logits: logits(32, 1),
                ..Default::default()
            })
            .await;
        assert!(r.is_ok(), "{good}: {r:?}");
    }
    // Reflection is behind the token too.
    let err = list_services_v1(s.channel.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    s.assert_serving().await;
    s.stop().await;
}

#[tokio::test]
async fn token_file_problems_fail_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let empty = write(dir.path(), "empty", "# nothing\n\n");
    let mut cfg = test_config();
    cfg.auth.tokens_file = Some(empty.clone());
    // The token file is read when serving starts.
    let err = serve_error(cfg).await;
    assert!(
        err.contains("auth.tokens_file") && err.contains("no tokens"),
        "{err}"
    );
    assert!(err.contains(&empty.display().to_string()), "{err}");
}

#[tokio::test]
async fn reflection_can_be_disabled() {
    let s = start_tuned(|c| c.reflection = false).await;
    let err = list_services_v1(s.channel.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented, "{err:?}");
    assert!(list_stages(s.channel.clone()).await.unwrap() > 0);
    s.stop().await;

    let s = start().await;
    let names = list_services_v1(s.channel.clone()).await.unwrap();
    assert!(
        names.iter().any(|n| n == "samplerd.v1.Sampler"),
        "{names:?}"
    );
    s.stop().await;
}

// --------------------------------------------------------- plugin trust --

/// A private copy of the core plugin in its own directory.
fn plugin_copy() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("libsamplerd_core_stages.so");
    std::fs::copy(core_plugin(), &lib).unwrap();
    std::fs::set_permissions(&lib, std::fs::Permissions::from_mode(0o755)).unwrap();
    (dir, lib)
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

async fn start_error(cfg: Config) -> String {
    match spawn(cfg, None).await {
        Ok(s) => {
            s.stop().await.unwrap();
            panic!("the server must refuse to start");
        }
        Err(e) => e.to_string(),
    }
}

#[tokio::test]
async fn writable_plugin_files_and_directories_are_refused() {
    let (dir, lib) = plugin_copy();

    chmod(&lib, 0o757);
    let mut cfg = test_config();
    cfg.plugins.files = vec![lib.clone()];
    let err = start_error(cfg.clone()).await;
    assert!(err.contains(&lib.display().to_string()), "{err}");
    assert!(
        err.contains("world-writable") && err.contains("0757"),
        "{err}"
    );
    assert!(err.contains("plugins.allow_untrusted_permissions"), "{err}");

    chmod(&lib, 0o775);
    let err = start_error(cfg.clone()).await;
    assert!(err.contains("group-writable"), "{err}");

    // The directory a library sits in counts too (someone could swap it).
    chmod(&lib, 0o755);
    chmod(dir.path(), 0o777);
    let mut by_dir = test_config();
    by_dir.plugins.files = Vec::new();
    by_dir.plugins.dirs = vec![dir.path().to_path_buf()];
    let err = start_error(by_dir.clone()).await;
    assert!(err.contains("plugin directory"), "{err}");
    assert!(err.contains(&dir.path().display().to_string()), "{err}");
    let err = start_error(cfg.clone()).await;
    assert!(err.contains("plugin directory"), "{err}");

    // Explicitly allowed: it loads.
    by_dir.plugins.allow_untrusted_permissions = true;
    let s = start_with(by_dir).await;
    assert!(list_stages(s.channel.clone()).await.unwrap() > 0);
    s.stop().await;
    chmod(dir.path(), 0o700);
}

/// A directory above the plugin's counts too: a 0755 plugin directory in
/// a world-writable, non-sticky parent is refused naming that parent, its
/// mode and the key to change; the config key lets it load.
#[tokio::test]
async fn a_writable_ancestor_directory_is_refused() {
    let (dir, _) = plugin_copy();
    let shared = dir.path().join("shared");
    let plugins = shared.join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let lib = plugins.join("libsamplerd_core_stages.so");
    std::fs::copy(core_plugin(), &lib).unwrap();
    chmod(&lib, 0o755);
    chmod(&plugins, 0o755);
    chmod(&shared, 0o777);
    let mut cfg = test_config();
    cfg.plugins.files = vec![lib.clone()];
    let err = start_error(cfg.clone()).await;
    let shared_path = std::fs::canonicalize(&shared).unwrap();
    assert!(
        err.contains(&std::fs::canonicalize(&lib).unwrap().display().to_string()),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "ancestor directory {} is world-writable and not sticky",
            shared_path.display()
        )),
        "{err}"
    );
    assert!(err.contains("mode 0777"), "{err}");
    assert!(err.contains("plugins.allow_untrusted_permissions"), "{err}");
    cfg.plugins.allow_untrusted_permissions = true;
    let s = start_with(cfg).await;
    assert!(list_stages(s.channel.clone()).await.unwrap() > 0);
    s.stop().await;
    chmod(&shared, 0o700);
}

fn sha256_of(p: &Path) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(std::fs::read(p).unwrap())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[tokio::test]
async fn sha256_pins_are_enforced() {
    let (_dir, lib) = plugin_copy();
    let name = "libsamplerd_core_stages.so".to_string();
    let actual = sha256_of(&lib);

    let mut cfg = test_config();
    cfg.plugins.files = vec![lib.clone()];
    let wrong = "ab".repeat(32);
    cfg.plugins.sha256 = [(name.clone(), wrong.clone())].into();
    let err = start_error(cfg.clone()).await;
    assert!(err.contains(&lib.display().to_string()), "{err}");
    assert!(err.contains(&wrong) && err.contains(&actual), "{err}");

    cfg.plugins.sha256 = [("libnot_loaded.so".to_string(), actual.clone())].into();
    let err = start_error(cfg.clone()).await;
    assert!(err.contains("libnot_loaded.so"), "{err}");

    cfg.plugins.sha256 = [(name, actual.to_uppercase())].into();
    let s = start_with(cfg).await;
    assert!(list_stages(s.channel.clone()).await.unwrap() > 0);
    s.stop().await;
}

// --------------------------------------------------------------- limits --

#[tokio::test]
async fn chain_length_is_limited() {
    let mut s = start_tuned(|c| c.limits.max_chain_stages = 3).await;
    let stage = |name: &str| v1::StageSpec {
        name: name.into(),
        ..Default::default()
    };
    let ok = v1::SamplingParams {
        chain: vec![stage("top_k"), stage("temperature"), stage("dist")],
        ..Default::default()
    };
    let long = v1::SamplingParams {
        chain: vec![stage("top_k"); 3]
            .into_iter()
            .chain([stage("dist")])
            .collect(),
        ..Default::default()
    };
    let samplers = v1::SamplingParams {
        samplers: vec!["top_k".into(); 4],
        ..Default::default()
    };
    let req = |p: v1::SamplingParams| v1::SampleRequest {
        logits: logits(64, 3),
        params: Some(p),
        ..Default::default()
    };
    s.client
        .sample(req(ok))
        .await
        .expect("3 stages are allowed");
    for (p, field) in [(long, "params.chain"), (samplers, "params.samplers")] {
        let err = s.client.sample(req(p)).await.unwrap_err();
        assert_status(
            &err,
            Code::InvalidArgument,
            &[field, "4 stages", "limits.max_chain_stages"],
        );
    }
    s.stop().await;
}

/// The first message of every held session in these tests.
fn first_message() -> v1::SampleStreamRequest {
    v1::SampleStreamRequest {
        logits: logits(16, 5),
        ..Default::default()
    }
}

/// Opens a SampleStream session, gets its first answer, keeps it open.
async fn open_session(client: &mut SamplerClient<Channel>) -> HeldStream {
    open_stream(client, first_message()).await
}

/// Opens a SampleStream session whose client sets `timeout` as its
/// deadline, and gets its first answer.
async fn open_session_with_deadline(
    client: &mut SamplerClient<Channel>,
    timeout: Duration,
) -> (StreamSender, tonic::Streaming<v1::SampleResponse>) {
    let (tx, requests) = held_requests(first_message()).await;
    let mut req = tonic::Request::new(requests);
    req.set_timeout(timeout);
    let mut stream = client.sample_stream(req).await.unwrap().into_inner();
    assert!(stream.message().await.unwrap().is_some());
    (tx, stream)
}

#[tokio::test]
async fn streams_per_connection_are_limited_by_http2_settings() {
    let mut s = start_tuned(|c| c.limits.max_streams_per_connection = 2).await;
    let (tx1, mut st1, _) = open_session(&mut s.client).await;
    let (tx2, st2, _) = open_session(&mut s.client).await;

    // A third stream on the same connection waits for a free slot...
    let mut third_client = s.client.clone();
    let third = tokio::spawn(async move { open_session(&mut third_client).await });
    // ...while another connection is not affected.
    let other = connect(s.addr()).await;
    let other_session = open_session(&mut SamplerClient::new(other)).await;
    assert!(!third.is_finished(), "the third stream must wait");

    // Closing one session frees the slot.
    drop(tx1);
    assert!(
        tokio::time::timeout(WAIT, st1.message())
            .await
            .unwrap()
            .unwrap()
            .is_none()
    );
    let third_session = tokio::time::timeout(WAIT, third)
        .await
        .expect("the third stream opens once a slot is free")
        .unwrap();
    // Open sessions would hold the shutdown for its grace period.
    drop((tx2, st2, other_session, third_session));
    wait_sessions_closed(&s).await;
    s.stop().await;
}

#[tokio::test]
async fn client_deadline_ends_a_stream_with_deadline_exceeded() {
    let mut s = start().await;
    let (tx, mut stream) =
        open_session_with_deadline(&mut s.client, Duration::from_millis(300)).await;
    // The client stays silent; the server ends the stream at the deadline.
    let err = tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("the server ends the stream")
        .unwrap_err();
    assert_status(&err, Code::DeadlineExceeded, &["grpc-timeout"]);
    wait_sessions_closed(&s).await;
    drop(tx);
    s.stop().await;
}

#[tokio::test]
async fn server_cap_bounds_requests_without_a_client_deadline() {
    let mut s = start_tuned(|c| c.limits.max_request_duration_secs = 1).await;
    let (_tx, mut stream, _) = open_session(&mut s.client).await;
    let err = tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("the server ends the stream")
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    assert!(
        err.message().contains("limits.max_request_duration_secs"),
        "{err:?}"
    );
    wait_sessions_closed(&s).await;
    // A longer client deadline does not lift the cap.
    let (_tx, mut stream) =
        open_session_with_deadline(&mut s.client, Duration::from_secs(3600)).await;
    let err = tokio::time::timeout(WAIT, stream.message())
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        err.message().contains("limits.max_request_duration_secs"),
        "{err:?}"
    );
    s.assert_serving().await;
    s.stop().await;
}

/// A generator that streams a token every few milliseconds until its
/// client goes away, and records that it stopped.
struct EndlessGenerator {
    stopped: Arc<AtomicBool>,
}

/// Upper bound on the fake generation (it must be cut long before).
const ENDLESS_MAX_TOKENS: usize = 20_000;

impl Generator for EndlessGenerator {
    fn ready(&self) -> bool {
        true
    }

    fn generate(&self, _job: GenerateJob, sink: GenerateSink) {
        for i in 0..ENDLESS_MAX_TOKENS {
            let token = v1::GenerateResponse {
                event: Some(v1::generate_response::Event::Token(v1::Token {
                    token_id: i as u32,
                    ..Default::default()
                })),
            };
            if sink.blocking_send(Ok(token)).is_err() {
                self.stopped.store(true, Ordering::SeqCst);
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

#[tokio::test]
async fn generate_past_its_deadline_ends_and_stops_generating() {
    let stopped = Arc::new(AtomicBool::new(false));
    let generator = Arc::new(EndlessGenerator {
        stopped: stopped.clone(),
    });
    let s = start_serving(test_config(), Some(generator)).await;
    let mut client = s.client.clone();
    let mut req = tonic::Request::new(v1::GenerateRequest {
        prompt: "hi".into(),
        ..Default::default()
    });
    req.set_timeout(Duration::from_millis(400));
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let mut tokens = 0;
    let err = tokio::time::timeout(WAIT, async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => tokens += 1,
                Ok(None) => panic!("stream ended without an error after {tokens} tokens"),
                Err(e) => return e,
            }
        }
    })
    .await
    .expect("the deadline ends the stream");
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    assert!(tokens > 0, "tokens streamed before the deadline");
    tokio::time::timeout(WAIT, async {
        while !stopped.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the generation stops once its deadline passed");
    s.stop().await;
}

/// The prompt limit needs the real model (tokenizer); skipped without
/// `SAMPLERD_MODEL` (scripts/test.sh sets it).
#[tokio::test]
async fn prompt_tokens_are_limited() {
    let Some(path) = std::env::var_os("SAMPLERD_MODEL").map(PathBuf::from) else {
        eprintln!("SAMPLERD_MODEL is not set: skipping the prompt-limit test");
        return;
    };
    let cfg = samplerd::generate::GenerateConfig {
        max_prompt_tokens: 8,
        ..Default::default()
    };
    let host: Arc<dyn Generator> =
        Arc::new(samplerd::generate::ModelHost::load(&path, cfg).expect("model loads"));
    let s = start_serving(test_config(), Some(host)).await;
    let mut client = s.client.clone();
    let long = "one two three four five six seven eight nine ten eleven twelve";
    // The model host validates on its worker: the error may come with the
    // response headers or as the stream's first message.
    let err = match client
        .generate(v1::GenerateRequest {
            prompt: long.into(),
            max_tokens: Some(1),
            ..Default::default()
        })
        .await
    {
        Err(e) => e,
        Ok(resp) => {
            let mut stream = resp.into_inner();
            tokio::time::timeout(WAIT, stream.message())
                .await
                .expect("an answer in time")
                .expect_err("an over-long prompt must fail")
        }
    };
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().starts_with("prompt:")
            && err.message().contains("generate.max_prompt_tokens"),
        "{err:?}"
    );
    // A short prompt still works.
    let mut ok = client
        .generate(v1::GenerateRequest {
            prompt: "Hi".into(),
            max_tokens: Some(1),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    while let Some(msg) = tokio::time::timeout(WAIT, ok.message())
        .await
        .unwrap()
        .unwrap()
    {
        let _ = msg;
    }
    s.stop().await;
}
