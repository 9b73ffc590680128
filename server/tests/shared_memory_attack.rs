//! A client that truncates and rewrites its shared-memory file while the
//! real `samplerd serve` reads it: the server stays up, the attacked
//! request fails naming the region (ABORTED, SAMPLERD_SHARED_REGION_LOST),
//! and another client's requests all succeed with their usual answer.

mod common;
mod process;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Reason, logits, reason_of, to_bytes};
use samplerd_api::v1::sampler_client::SamplerClient;
use samplerd_api::v1::{self, LogitsDtype};
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

const VOCAB: usize = 151_936;
/// How long the attack runs (a bound on the test, not a timing).
const ATTACK: Duration = Duration::from_secs(3);

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

fn shared_sample(region: &str) -> v1::SampleRequest {
    v1::SampleRequest {
        shared: Some(v1::SharedLogits {
            region: region.into(),
            offset: 0,
            count: VOCAB as u32,
            dtype: LogitsDtype::F32le as i32,
        }),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncating_a_region_while_it_is_read_fails_only_that_request() {
    let dir = PathBuf::from(format!("/dev/shm/samplerd-attack-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("samplerd.sock");
    let mut p = process::start(&format!(
        "listen = [\"127.0.0.1:0\", \"unix:{}\"]\n[transport]\nshared_memory_dirs = [{}]\n",
        sock.display(),
        process::toml_path(&dir)
    ));
    let mut attacker = SamplerClient::new(unix_channel(&sock).await);
    let mut other = SamplerClient::new(p.channel().await);
    let row = to_bytes(&logits(VOCAB, 11));
    let file = dir.join("row");
    std::fs::write(&file, &row).unwrap();
    let register = |name: &str| v1::RegisterSharedMemoryRequest {
        name: name.into(),
        path: file.display().to_string(),
        byte_size: row.len() as u64,
    };

    // Deterministic: truncated before the read, the read faults.
    attacker
        .register_shared_memory(register("r0"))
        .await
        .unwrap();
    // /metrics shows the region and its bytes.
    let metrics = p.scrape();
    for want in [
        "samplerd_shared_memory_regions 1".to_string(),
        format!("samplerd_shared_memory_bytes {}", row.len()),
    ] {
        assert!(
            metrics.lines().any(|l| l == want),
            "{want:?} not in /metrics:\n{metrics}"
        );
    }
    attacker.sample(shared_sample("r0")).await.unwrap();
    std::fs::File::options()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(0)
        .unwrap();
    let e = attacker.sample(shared_sample("r0")).await.unwrap_err();
    assert_eq!(e.code(), Code::Aborted, "{e:?}");
    assert_eq!(reason_of(&e), Reason::RegionLost);
    assert!(
        e.message().contains("shared.region") && e.message().contains("\"r0\""),
        "{e:?}"
    );
    // The region is gone with it.
    let e = attacker.sample(shared_sample("r0")).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");

    // The same through a stream and a batch: the step that read the
    // truncated row fails naming its region.
    let truncate = || {
        std::fs::File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_len(0)
            .unwrap()
    };
    std::fs::write(&file, &row).unwrap();
    attacker
        .register_shared_memory(register("s"))
        .await
        .unwrap();
    let step = v1::SampleStreamRequest {
        shared: shared_sample("s").shared,
        ..Default::default()
    };
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    let mut responses = attacker
        .sample_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    tx.send(step.clone()).await.unwrap();
    responses.message().await.unwrap().expect("the first step");
    truncate();
    tx.send(step).await.unwrap();
    let e = responses.message().await.unwrap_err();
    assert_eq!(reason_of(&e), Reason::RegionLost, "{e:?}");
    assert!(e.message().contains("\"s\""), "{e:?}");
    std::fs::write(&file, &row).unwrap();
    attacker
        .register_shared_memory(register("b"))
        .await
        .unwrap();
    truncate();
    let e = attacker
        .sample_batch(v1::SampleBatchRequest {
            rows: vec![v1::BatchRow {
                shared: shared_sample("b").shared,
                ..Default::default()
            }],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(reason_of(&e), Reason::RegionLost, "{e:?}");
    assert!(e.message().contains("rows[0].shared.region"), "{e:?}");

    // Racing: truncate, regrow, rewrite with NaN, while the attacker
    // samples and re-registers, and another client samples inline.
    std::fs::write(&file, &row).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let vandal = {
        let (stop, file, row) = (Arc::clone(&stop), file.clone(), row.clone());
        std::thread::spawn(move || {
            let f = std::fs::File::options().write(true).open(&file).unwrap();
            let nan = to_bytes(&vec![f32::NAN; 1024]);
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let _ = f.set_len(0);
                let _ = f.set_len(row.len() as u64);
                if i.is_multiple_of(3) {
                    let _ = std::os::unix::fs::FileExt::write_all_at(&f, &nan, 0);
                } else {
                    let _ = std::os::unix::fs::FileExt::write_all_at(&f, &row, 0);
                }
                i += 1;
            }
        })
    };
    let inline = v1::SampleRequest {
        logits_f32le: row.clone().into(),
        ..Default::default()
    };
    let expected = other.sample(inline.clone()).await.unwrap().into_inner();
    let innocent = tokio::spawn({
        let mut other = other.clone();
        let stop = Arc::clone(&stop);
        async move {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let r = other.sample(inline.clone()).await.expect("unaffected");
                assert_eq!(r.into_inner(), expected, "another client's answer changed");
                n += 1;
            }
            n
        }
    });
    let (mut ok, mut lost, mut invalid, mut gone) = (0, 0, 0, 0);
    let end = Instant::now() + ATTACK;
    let mut k = 1;
    let mut name = format!("r{k}");
    let _ = attacker.register_shared_memory(register(&name)).await;
    while Instant::now() < end {
        let dropped = match attacker.sample(shared_sample(&name)).await {
            Ok(_) => {
                ok += 1;
                false
            }
            Err(e) => match e.code() {
                Code::Aborted => {
                    assert!(e.message().contains(&format!("{name:?}")), "{e:?}");
                    lost += 1;
                    true
                }
                Code::InvalidArgument => {
                    invalid += 1;
                    false
                }
                Code::NotFound => {
                    gone += 1;
                    true
                }
                c => panic!("unexpected {c:?}: {e:?}"),
            },
        };
        if dropped {
            // Register again under a new name (refused while the file is
            // short: then the next request finds no region either).
            k += 1;
            name = format!("r{k}");
            let _ = attacker.register_shared_memory(register(&name)).await;
        }
    }
    stop.store(true, Ordering::Relaxed);
    vandal.join().unwrap();
    let n_other = innocent.await.unwrap();
    assert!(n_other > 0, "the other client got answers");
    assert!(
        ok + lost + invalid + gone > 0,
        "the attacker's requests were answered"
    );
    eprintln!(
        "attack: ok {ok}, lost {lost}, invalid {invalid}, gone {gone}; other client {n_other}"
    );
    // Still up and serving.
    common::assert_health(
        &p.channel().await,
        "",
        tonic_health::pb::health_check_response::ServingStatus::Serving,
    )
    .await;
    assert!(
        p.child.try_wait().unwrap().is_none(),
        "samplerd is still running"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
