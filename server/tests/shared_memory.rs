//! The Unix-socket listener and shared-memory rows, in process: rows read
//! from a registered region give the same answers as the same values sent
//! inline (all four sampling RPCs, f32/f16/bf16), every refusal has its
//! code and names its field, regions go with their connection, identities
//! (uid, bearer token, TCP peer) own their regions, and the socket file
//! is removed at shutdown. The truncation attack runs against the real
//! binary in `shared_memory_attack.rs`.

mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{assert_status, logits, test_config, to_bytes};
use half::{bf16, f16};
use samplerd::app::config::Config;
use samplerd::app::server::{RunningServer, spawn};
use samplerd::transport::listen::{Listen, ListenAddr};
use samplerd_api::v1::sampler_client::SamplerClient;
use samplerd_api::v1::{self, LogitsDtype};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Request};

const VOCAB: usize = 1000;
/// Bound on waiting for the server to notice a closed connection.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);

/// A directory under /dev/shm of this test's own, removed on drop.
struct ShmDir(PathBuf);

impl ShmDir {
    fn new(tag: &str) -> Self {
        let p = PathBuf::from(format!(
            "/dev/shm/samplerd-test-{}-{tag}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        ShmDir(p)
    }

    /// A file of `bytes` in it.
    fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

impl Drop for ShmDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn socket_path(dir: &ShmDir) -> PathBuf {
    dir.0.join("samplerd.sock")
}

/// The test config listening on TCP and on a Unix socket in `dir`, with
/// `dir` as the one shared-memory directory.
fn config(dir: &ShmDir) -> Config {
    let mut c = test_config();
    c.listen = Listen::new(vec![
        ListenAddr::Tcp("127.0.0.1:0".parse().unwrap()),
        ListenAddr::Unix(socket_path(dir)),
    ])
    .unwrap();
    c.transport.shared_memory_dirs = vec![dir.0.clone()];
    c
}

async fn unix_channel(path: &Path) -> Channel {
    let path = path.to_path_buf();
    let ch = Endpoint::try_from("http://localhost")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_| {
            let p = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(p).await?,
                ))
            }
        }))
        .await
        .expect("connect to the Unix socket");
    common::wait_serving(ch.clone()).await;
    ch
}

async fn tcp_channel(server: &RunningServer) -> Channel {
    let ch = Channel::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    common::wait_serving(ch.clone()).await;
    ch
}

fn client(ch: &Channel) -> SamplerClient<Channel> {
    SamplerClient::new(ch.clone()).max_decoding_message_size(64 << 20)
}

fn register(name: &str, path: &Path, byte_size: u64) -> v1::RegisterSharedMemoryRequest {
    v1::RegisterSharedMemoryRequest {
        name: name.into(),
        path: path.display().to_string(),
        byte_size,
    }
}

fn shared(region: &str, offset: u64, count: usize, dtype: LogitsDtype) -> v1::SharedLogits {
    v1::SharedLogits {
        region: region.into(),
        offset,
        count: count as u32,
        dtype: dtype as i32,
    }
}

/// `rows` in `dtype`, as bytes, and the f32 values they stand for.
fn encode(rows: &[Vec<f32>], dtype: LogitsDtype) -> Vec<u8> {
    rows.iter()
        .flat_map(|r| match dtype {
            LogitsDtype::F16le => r
                .iter()
                .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                .collect::<Vec<u8>>(),
            LogitsDtype::Bf16le => r
                .iter()
                .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                .collect(),
            _ => to_bytes(r),
        })
        .collect()
}

fn params() -> v1::SamplingParams {
    v1::SamplingParams {
        temperature: Some(0.9),
        top_k: Some(50),
        seed: Some(7),
        ..Default::default()
    }
}

#[tokio::test]
async fn shared_rows_answer_as_inline_rows_on_every_rpc_and_dtype() {
    let dir = ShmDir::new("identity");
    let server = spawn(config(&dir), None).await.unwrap();
    let mut c = client(&unix_channel(&socket_path(&dir)).await);
    let rows: Vec<Vec<f32>> = (0..4).map(|i| logits(VOCAB, 100 + i)).collect();
    for dtype in [LogitsDtype::F32le, LogitsDtype::F16le, LogitsDtype::Bf16le] {
        let bytes = encode(&rows, dtype);
        let width = bytes.len() / (rows.len() * VOCAB);
        let region = format!("r-{}", dtype.as_str_name());
        let file = dir.file(&region, &bytes);
        c.register_shared_memory(register(&region, &file, bytes.len() as u64))
            .await
            .unwrap();
        let row_bytes = |i: usize| bytes[i * VOCAB * width..(i + 1) * VOCAB * width].to_vec();
        let at = |i: usize| shared(&region, (i * VOCAB * width) as u64, VOCAB, dtype);

        // SampleBatch: inline rows in `dtype` against shared ones.
        let batch = |shared_rows: bool| v1::SampleBatchRequest {
            rows: (0..rows.len())
                .map(|i| v1::BatchRow {
                    logits: if shared_rows { vec![] } else { row_bytes(i) }.into(),
                    shared: shared_rows.then(|| at(i)),
                    step: i as u64,
                    ..Default::default()
                })
                .collect(),
            dtype: dtype as i32,
            params: Some(params()),
            n_probs: 3,
            ..Default::default()
        };
        let inline = c.sample_batch(batch(false)).await.unwrap().into_inner();
        let from_shm = c.sample_batch(batch(true)).await.unwrap().into_inner();
        assert_eq!(inline, from_shm, "SampleBatch {dtype:?}");

        // Sample (f32 inline is the widened values as f32 bytes).
        for (i, row) in rows.iter().enumerate() {
            let widened: Vec<f32> = match dtype {
                LogitsDtype::F32le => row.clone(),
                LogitsDtype::F16le => row.iter().map(|&x| f16::from_f32(x).to_f32()).collect(),
                _ => row.iter().map(|&x| bf16::from_f32(x).to_f32()).collect(),
            };
            let req = |s: bool| v1::SampleRequest {
                logits_f32le: if s { vec![] } else { to_bytes(&widened) }.into(),
                shared: s.then(|| at(i)),
                params: Some(params()),
                step: i as u64,
                n_probs: 3,
                ..Default::default()
            };
            let a = c.sample(req(false)).await.unwrap().into_inner();
            let b = c.sample(req(true)).await.unwrap().into_inner();
            assert_eq!(a, b, "Sample row {i} {dtype:?}");
            assert_eq!(inline.rows[i], b, "Sample as the batch row {i} {dtype:?}");
        }

        // SampleStream: four steps, inline against shared.
        let stream = |s: bool| {
            (0..rows.len())
                .map(|i| v1::SampleStreamRequest {
                    logits_f32le: if s || dtype != LogitsDtype::F32le {
                        vec![]
                    } else {
                        row_bytes(i)
                    }
                    .into(),
                    logits: if !s && dtype != LogitsDtype::F32le {
                        match dtype {
                            LogitsDtype::F16le => {
                                rows[i].iter().map(|&x| f16::from_f32(x).to_f32()).collect()
                            }
                            _ => rows[i]
                                .iter()
                                .map(|&x| bf16::from_f32(x).to_f32())
                                .collect(),
                        }
                    } else {
                        vec![]
                    },
                    shared: s.then(|| at(i)),
                    params: (i == 0).then(params),
                    ..Default::default()
                })
                .collect::<Vec<_>>()
        };
        let mut outs = Vec::new();
        for s in [false, true] {
            let mut st = c
                .sample_stream(tokio_stream::iter(stream(s)))
                .await
                .unwrap()
                .into_inner();
            let mut out = Vec::new();
            while let Some(r) = st.message().await.unwrap() {
                out.push(r);
            }
            outs.push(out);
        }
        assert_eq!(outs[0].len(), rows.len());
        assert_eq!(outs[0], outs[1], "SampleStream {dtype:?}");

        // SampleBatchStream: two sequences, two steps.
        let bstream = |s: bool| {
            (0..2)
                .map(|step| v1::SampleBatchStreamRequest {
                    rows: (0..2)
                        .map(|seq| {
                            let i = step * 2 + seq;
                            v1::BatchStreamRow {
                                sequence_id: seq as u64,
                                logits: if s { vec![] } else { row_bytes(i) }.into(),
                                shared: s.then(|| at(i)),
                                ..Default::default()
                            }
                        })
                        .collect(),
                    dtype: dtype as i32,
                    params: Some(params()),
                    ..Default::default()
                })
                .collect::<Vec<_>>()
        };
        let mut outs = Vec::new();
        for s in [false, true] {
            let mut st = c
                .sample_batch_stream(tokio_stream::iter(bstream(s)))
                .await
                .unwrap()
                .into_inner();
            let mut out = Vec::new();
            while let Some(r) = st.message().await.unwrap() {
                out.push(r);
            }
            outs.push(out);
        }
        assert_eq!(outs[0].len(), 2);
        assert_eq!(outs[0], outs[1], "SampleBatchStream {dtype:?}");
    }
    server.stop().await.unwrap();
}

#[tokio::test]
async fn every_refusal_has_its_code_and_names_its_field() {
    let dir = ShmDir::new("refusals");
    let mut cfg = config(&dir);
    cfg.limits.max_shared_regions = 2;
    cfg.limits.max_shared_bytes = 3 * 4 * VOCAB as u64;
    let server = spawn(cfg, None).await.unwrap();
    let mut uds = client(&unix_channel(&socket_path(&dir)).await);
    let mut tcp = client(&tcp_channel(&server).await);
    let bytes = to_bytes(&logits(VOCAB, 1));
    let file = dir.file("a", &bytes);
    uds.register_shared_memory(register("a", &file, bytes.len() as u64))
        .await
        .unwrap();
    let sample = |s: v1::SharedLogits| v1::SampleRequest {
        shared: Some(s),
        ..Default::default()
    };
    let f32 = LogitsDtype::F32le;
    let cases: Vec<(v1::SampleRequest, Code, &[&str])> = vec![
        (
            sample(shared("a", 4, VOCAB, f32)),
            Code::InvalidArgument,
            &["shared.offset", "runs past the end of region \"a\""],
        ),
        (
            sample(shared("a", 2, 10, f32)),
            Code::InvalidArgument,
            &["shared.offset", "not a multiple of 4"],
        ),
        (
            sample(shared("nope", 0, 10, f32)),
            Code::NotFound,
            &["shared.region", "\"nope\""],
        ),
        (
            sample(shared("a", 0, 0, f32)),
            Code::InvalidArgument,
            &["shared.count"],
        ),
        (
            v1::SampleRequest {
                logits: vec![1.0],
                shared: Some(shared("a", 0, 10, f32)),
                ..Default::default()
            },
            Code::InvalidArgument,
            &["shared", "got `shared` and `logits`"],
        ),
    ];
    for (req, code, needles) in cases {
        let e = uds.sample(req).await.unwrap_err();
        assert_status(&e, code, needles);
    }
    // Another identity: the TCP peer (127.0.0.1), not uid 0.
    let e = tcp
        .sample(sample(shared("a", 0, 10, f32)))
        .await
        .unwrap_err();
    assert_status(
        &e,
        Code::PermissionDenied,
        &["shared.region", "another identity"],
    );
    let e = tcp
        .unregister_shared_memory(v1::UnregisterSharedMemoryRequest { name: "a".into() })
        .await
        .unwrap_err();
    assert_status(&e, Code::PermissionDenied, &["name"]);
    // A batch row's error names its row.
    let e = uds
        .sample_batch(v1::SampleBatchRequest {
            rows: vec![
                v1::BatchRow {
                    shared: Some(shared("a", 0, VOCAB, f32)),
                    ..Default::default()
                },
                v1::BatchRow {
                    shared: Some(shared("a", 0, VOCAB + 1, f32)),
                    ..Default::default()
                },
            ],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_status(&e, Code::InvalidArgument, &["rows[1].shared.offset"]);

    // Registration refusals.
    let outside = std::env::temp_dir().join(format!("samplerd-outside-{}", std::process::id()));
    std::fs::write(&outside, &bytes).unwrap();
    let link = dir.0.join("link");
    std::os::unix::fs::symlink(&file, &link).unwrap();
    let foreign = dir.file("foreign", &bytes);
    std::os::unix::fs::chown(&foreign, Some(54321), None).unwrap();
    let n = bytes.len() as u64;
    let cases: Vec<(v1::RegisterSharedMemoryRequest, Code, &[&str])> = vec![
        (
            register("b", &outside, n),
            Code::PermissionDenied,
            &["path", "not under transport.shared_memory_dirs"],
        ),
        (
            register("b", &link, n),
            Code::PermissionDenied,
            &["path", "symlinks are refused"],
        ),
        (
            register("b", &foreign, n),
            Code::PermissionDenied,
            &["path", "belongs to uid 54321"],
        ),
        (
            register("b", &file, n + 1),
            Code::InvalidArgument,
            &["byte_size", "at most the file's size"],
        ),
        (
            register("a", &file, n),
            Code::AlreadyExists,
            &["name", "already registered"],
        ),
        (
            register("bad/name", &file, n),
            Code::InvalidArgument,
            &["name"],
        ),
        (
            register("b", Path::new("relative"), n),
            Code::InvalidArgument,
            &["path", "absolute"],
        ),
    ];
    for (req, code, needles) in cases {
        let e = uds.register_shared_memory(req).await.unwrap_err();
        assert_status(&e, code, needles);
    }
    // Over the limits: bytes, then regions.
    let big = dir.file("big", &vec![0u8; 3 * 4 * VOCAB]);
    let e = uds
        .register_shared_memory(register("b", &big, 3 * 4 * VOCAB as u64))
        .await
        .unwrap_err();
    assert_status(&e, Code::ResourceExhausted, &["limits.max_shared_bytes"]);
    uds.register_shared_memory(register("b", &file, 4))
        .await
        .unwrap();
    let e = uds
        .register_shared_memory(register("c", &file, 4))
        .await
        .unwrap_err();
    assert_status(&e, Code::ResourceExhausted, &["limits.max_shared_regions"]);
    // Unregistered, a region is gone.
    uds.unregister_shared_memory(v1::UnregisterSharedMemoryRequest { name: "a".into() })
        .await
        .unwrap();
    let e = uds
        .sample(sample(shared("a", 0, 10, f32)))
        .await
        .unwrap_err();
    assert_status(&e, Code::NotFound, &["shared.region"]);
    let _ = std::fs::remove_file(outside);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn regions_go_with_their_connection_and_the_socket_with_the_server() {
    let dir = ShmDir::new("release");
    let server = spawn(config(&dir), None).await.unwrap();
    let sock = socket_path(&dir);
    assert!(std::fs::metadata(&sock).is_ok());
    assert_eq!(
        std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777,
        0o660,
        "transport.unix_socket_mode's default"
    );
    let bytes = to_bytes(&logits(VOCAB, 2));
    let file = dir.file("r", &bytes);
    {
        let ch = unix_channel(&sock).await;
        client(&ch)
            .register_shared_memory(register("r", &file, bytes.len() as u64))
            .await
            .unwrap();
        assert_eq!(server.state.shared.len(), 1);
    }
    // The channel is dropped: its connection closes, the region goes.
    tokio::time::timeout(RELEASE_TIMEOUT, async {
        while !server.state.shared.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the region is released when its connection closes");
    server.stop().await.unwrap();
    assert!(
        std::fs::symlink_metadata(&sock).is_err(),
        "the socket file is removed at shutdown"
    );
}

#[tokio::test]
async fn with_auth_a_unix_client_needs_a_token_and_tokens_own_their_regions() {
    let dir = ShmDir::new("auth");
    let tokens = dir.0.join("tokens");
    std::fs::write(&tokens, "alpha\nbeta\n").unwrap();
    let mut cfg = config(&dir);
    cfg.auth.tokens_file = Some(tokens);
    let server = spawn(cfg, None).await.unwrap();
    let ch = unix_channel(&socket_path(&dir)).await;
    let mut c = client(&ch);
    let bytes = to_bytes(&logits(VOCAB, 3));
    let file = dir.file("r", &bytes);
    let e = c
        .register_shared_memory(register("r", &file, bytes.len() as u64))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    fn with<T>(token: &str, msg: T) -> Request<T> {
        let mut r = Request::new(msg);
        r.metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        r
    }
    c.register_shared_memory(with("alpha", register("r", &file, bytes.len() as u64)))
        .await
        .unwrap();
    let req = v1::SampleRequest {
        shared: Some(shared("r", 0, VOCAB, LogitsDtype::F32le)),
        ..Default::default()
    };
    c.sample(with("alpha", req.clone())).await.unwrap();
    // Same uid, another token: another identity.
    let e = c.sample(with("beta", req)).await.unwrap_err();
    assert_status(
        &e,
        Code::PermissionDenied,
        &["shared.region", "bearer token"],
    );
    server.stop().await.unwrap();
}

/// All of a SampleStream's responses (bounded wait).
async fn stream_all(
    c: &mut SamplerClient<Channel>,
    msgs: Vec<v1::SampleStreamRequest>,
) -> Result<Vec<v1::SampleResponse>, tonic::Status> {
    let wait = Duration::from_secs(20);
    let mut st = tokio::time::timeout(wait, c.sample_stream(tokio_stream::iter(msgs)))
        .await
        .expect("opens in time")?
        .into_inner();
    let mut out = Vec::new();
    while let Some(r) = tokio::time::timeout(wait, st.message())
        .await
        .expect("answers in time")?
    {
        out.push(r);
    }
    Ok(out)
}

#[tokio::test]
async fn verify_reads_shared_rows_as_inline_rows() {
    let dir = ShmDir::new("verify");
    let server = spawn(config(&dir), None).await.unwrap();
    let mut uds = client(&unix_channel(&socket_path(&dir)).await);
    let mut tcp = client(&tcp_channel(&server).await);
    let rows: Vec<Vec<f32>> = (0..5).map(|i| logits(VOCAB, 300 + i)).collect();
    for dtype in [LogitsDtype::F32le, LogitsDtype::Bf16le] {
        let bytes = encode(&rows, dtype);
        let width = bytes.len() / (rows.len() * VOCAB);
        let region = format!("v-{}", dtype.as_str_name());
        let file = dir.file(&region, &bytes);
        uds.register_shared_memory(register(&region, &file, bytes.len() as u64))
            .await
            .unwrap();
        let at = |i: usize| shared(&region, (i * VOCAB * width) as u64, VOCAB, dtype);
        // The values the shared rows stand for, as inline f32.
        let widened = |i: usize| -> Vec<f32> {
            match dtype {
                LogitsDtype::Bf16le => rows[i]
                    .iter()
                    .map(|&x| bf16::from_f32(x).to_f32())
                    .collect(),
                _ => rows[i].clone(),
            }
        };
        let first = v1::SampleStreamRequest {
            logits_f32le: to_bytes(&widened(0)).into(),
            params: Some(params()),
            n_probs: 2,
            ..Default::default()
        };
        // The reference: one message per row, inline.
        let mut msgs = vec![first.clone()];
        msgs.extend((1..5).map(|i| v1::SampleStreamRequest {
            logits_f32le: to_bytes(&widened(i)).into(),
            n_probs: 2,
            ..Default::default()
        }));
        let reference = stream_all(&mut uds, msgs).await.unwrap();
        // Rows 1-4 verified with three right drafts (all accepted + the
        // bonus), once with the rows inline and once in shared memory.
        let drafts: Vec<u32> = reference[1..4].iter().map(|r| r.token_id).collect();
        let verify = |shared_rows: bool| v1::SampleStreamRequest {
            verify: Some(v1::Verify {
                draft_tokens: drafts.clone(),
                target_rows: (1..5)
                    .map(|i| v1::VerifyRow {
                        logits: if shared_rows {
                            vec![]
                        } else {
                            to_bytes(&widened(i))
                        }
                        .into(),
                        shared: shared_rows.then(|| at(i)),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }),
            n_probs: 2,
            ..Default::default()
        };
        let inline = stream_all(&mut uds, vec![first.clone(), verify(false)])
            .await
            .unwrap();
        let from_shm = stream_all(&mut uds, vec![first.clone(), verify(true)])
            .await
            .unwrap();
        assert_eq!(inline, from_shm, "{dtype:?}");
        let v = from_shm[1].verify.as_ref().unwrap();
        assert_eq!(v.accepted, 3, "{dtype:?}");
        assert_eq!(v.tokens, reference[1..5], "{dtype:?}");

        // The same through a SampleBatchStream row.
        let batch = |verify: Option<v1::Verify>, i: usize| v1::SampleBatchStreamRequest {
            rows: vec![v1::BatchStreamRow {
                sequence_id: 9,
                logits: if verify.is_some() {
                    vec![]
                } else {
                    to_bytes(&widened(i))
                }
                .into(),
                verify,
                ..Default::default()
            }],
            params: Some(params()),
            n_probs: 2,
            ..Default::default()
        };
        let msgs = vec![batch(None, 0), batch(verify(true).verify, 0)];
        let mut st = uds
            .sample_batch_stream(tokio_stream::iter(msgs))
            .await
            .unwrap()
            .into_inner();
        let mut out = Vec::new();
        while let Some(r) = st.message().await.unwrap() {
            out.push(r);
        }
        let v = out[1].rows[0].verify.as_ref().expect("a verify answer");
        assert_eq!(v.tokens, reference[1..5], "SampleBatchStream {dtype:?}");

        // Another identity cannot read the region through a Verify either.
        let e = stream_all(&mut tcp, vec![first.clone(), verify(true)])
            .await
            .unwrap_err();
        assert_status(
            &e,
            Code::PermissionDenied,
            &["verify.target_rows[0].shared.region", "another identity"],
        );
        // A row with both forms, and a row with none, are refused naming it.
        let mut both = verify(true);
        both.verify.as_mut().unwrap().target_rows[2].logits = to_bytes(&widened(3)).into();
        let e = stream_all(&mut uds, vec![first.clone(), both])
            .await
            .unwrap_err();
        assert_status(
            &e,
            Code::InvalidArgument,
            &["verify.target_rows[2].shared", "got `shared` and `logits`"],
        );
        let mut none = verify(true);
        none.verify.as_mut().unwrap().target_rows[1].shared = None;
        let e = stream_all(&mut uds, vec![first.clone(), none])
            .await
            .unwrap_err();
        assert_status(
            &e,
            Code::InvalidArgument,
            &["verify.target_rows[1]", "got none"],
        );
        // A shared row of the wrong length names its count.
        let mut short = verify(true);
        short.verify.as_mut().unwrap().target_rows[3].shared =
            Some(shared(&region, 0, VOCAB - 1, dtype));
        let e = stream_all(&mut uds, vec![first.clone(), short])
            .await
            .unwrap_err();
        assert_status(
            &e,
            Code::InvalidArgument,
            &["verify.target_rows[3].shared.count", "999 logits"],
        );
    }
    server.stop().await.unwrap();
}
