//! `compression.responses` on the wire: whether a response carries
//! `grpc-encoding: gzip` for uncompressed and gzip requests from a client
//! that accepts gzip (as grpcio and grpc-js always do), under each policy.

mod common;

use common::*;
use samplerd::transport::compression::ResponsePolicy;
use samplerd_api::v1;
use samplerd_api::v1::sampler_client::SamplerClient;
use tonic::codec::CompressionEncoding::Gzip;

/// The response's `grpc-encoding`, or "identity" when it has none.
fn encoding(m: &tonic::metadata::MetadataMap) -> String {
    m.get("grpc-encoding")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_else(|| "identity".into())
}

/// (response to an uncompressed request, response to a gzip request),
/// both from a client that accepts gzip, for a unary and a streaming RPC.
async fn encodings(policy: ResponsePolicy) -> [(String, String); 2] {
    let s = start_tuned(|c| c.compression.responses = policy).await;
    let accepts = SamplerClient::new(s.channel.clone()).accept_compressed(Gzip);
    let sends = accepts.clone().send_compressed(Gzip);
    let req = || v1::SampleRequest {
        logits: logits(4096, 1),
        n_probs: 64,
        ..Default::default()
    };
    let unary = |mut c: SamplerClient<_>| async move {
        let r = c.sample(req()).await.expect("Sample succeeds");
        assert_eq!(r.get_ref().probs.len(), 64);
        encoding(r.metadata())
    };
    let stream = |mut c: SamplerClient<_>| async move {
        let first = v1::SampleStreamRequest {
            logits: logits(4096, 2),
            ..Default::default()
        };
        let r = c
            .sample_stream(tokio_stream::iter(vec![first]))
            .await
            .expect("SampleStream opens");
        let enc = encoding(r.metadata());
        let mut st = r.into_inner();
        while st.message().await.expect("step succeeds").is_some() {}
        enc
    };
    let out = [
        (unary(accepts.clone()).await, unary(sends.clone()).await),
        (stream(accepts).await, stream(sends).await),
    ];
    s.stop().await;
    out
}

fn pair(a: &str, b: &str) -> (String, String) {
    (a.into(), b.into())
}

#[tokio::test]
async fn auto_mirrors_the_request() {
    let want = pair("identity", "gzip");
    assert_eq!(encodings(ResponsePolicy::Auto).await, [want.clone(), want]);
}

#[tokio::test]
async fn always_compresses_for_a_client_that_accepts_it() {
    let want = pair("gzip", "gzip");
    assert_eq!(
        encodings(ResponsePolicy::Always).await,
        [want.clone(), want]
    );
}

#[tokio::test]
async fn never_compresses() {
    let want = pair("identity", "identity");
    assert_eq!(encodings(ResponsePolicy::Never).await, [want.clone(), want]);
}

#[tokio::test]
async fn the_default_is_auto() {
    assert_eq!(
        samplerd::app::config::Config::default()
            .compression
            .responses,
        ResponsePolicy::Auto
    );
}
