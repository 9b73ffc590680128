//! A raw HTTP/2 gRPC call (the `h2` crate), for tests that control what a
//! client sends — how a message is cut into frames, its bytes, its
//! headers — and read every byte of the answer.

use prost::Message;
use prost::bytes::Bytes;

use super::HEALTH_TIMEOUT;

/// The gRPC length prefix + message.
pub fn framed(m: &impl Message) -> Vec<u8> {
    let body = m.encode_to_vec();
    let mut out = vec![0u8];
    out.extend((body.len() as u32).to_be_bytes());
    out.extend(body);
    out
}

/// What a raw call got back: the HTTP status, and the gRPC status code and
/// message (from a trailers-only response's headers, or the trailers).
pub struct RawOutcome {
    pub http: http::StatusCode,
    pub body: Vec<u8>,
    pub grpc_status: Option<String>,
    pub grpc_message: String,
    /// The status (with its details) the headers or trailers carried.
    pub status: Option<tonic::Status>,
    /// The bytes `grpc-message` and `grpc-status-details-bin` took on the
    /// wire, as sent.
    pub status_bytes: usize,
    /// `grpc-accept-encoding` of the answer, if any.
    pub accept_encoding: Option<String>,
}

/// Sends `frames` (none: the headers end the stream) to `path` with the
/// given method and content-type, reads the response to its end.
pub async fn raw_outcome(
    addr: std::net::SocketAddr,
    method: &str,
    content_type: Option<&str>,
    path: &str,
    frames: Vec<Vec<u8>>,
) -> RawOutcome {
    raw_outcome_with(addr, method, content_type, path, &[], frames).await
}

/// [`raw_outcome`] with more request `headers`.
pub async fn raw_outcome_with(
    addr: std::net::SocketAddr,
    method: &str,
    content_type: Option<&str>,
    path: &str,
    headers: &[(&str, &str)],
    frames: Vec<Vec<u8>>,
) -> RawOutcome {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(conn);
    let mut h2 = h2.ready().await.expect("h2 ready");
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("te", "trailers");
    if let Some(ct) = content_type {
        req = req.header("content-type", ct);
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let (response, mut send) = h2
        .send_request(req.body(()).unwrap(), frames.is_empty())
        .expect("send headers");
    let n = frames.len();
    for (i, f) in frames.into_iter().enumerate() {
        // A refusal may answer (and reset the stream) before the body is
        // sent: what counts is the response read below.
        if send.send_data(Bytes::from(f), i + 1 == n).is_err() {
            break;
        }
    }
    let resp = tokio::time::timeout(HEALTH_TIMEOUT, response)
        .await
        .expect("response in time")
        .expect("response");
    let http = resp.status();
    let header = |h: &http::HeaderMap, k: &str| h.get(k).map(|v| v.to_str().unwrap().to_string());
    let status_bytes = |h: &http::HeaderMap| {
        ["grpc-message", "grpc-status-details-bin"]
            .iter()
            .filter_map(|k| h.get(*k))
            .map(|v| v.len())
            .sum::<usize>()
    };
    let mut grpc_status = header(resp.headers(), "grpc-status");
    let mut grpc_message = header(resp.headers(), "grpc-message").unwrap_or_default();
    let mut status = tonic::Status::from_header_map(resp.headers());
    let mut sent = status_bytes(resp.headers());
    let accept_encoding = header(resp.headers(), "grpc-accept-encoding");
    let mut body = resp.into_body();
    let mut bytes = Vec::new();
    while let Some(chunk) = tokio::time::timeout(HEALTH_TIMEOUT, body.data())
        .await
        .expect("body in time")
    {
        let chunk = chunk.expect("response body");
        let _ = body.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    if let Some(t) = tokio::time::timeout(HEALTH_TIMEOUT, body.trailers())
        .await
        .expect("trailers in time")
        .expect("trailers")
    {
        grpc_status = grpc_status.or(header(&t, "grpc-status"));
        status = status.or(tonic::Status::from_header_map(&t));
        sent += status_bytes(&t);
        if let Some(m) = header(&t, "grpc-message") {
            grpc_message = m;
        }
    }
    RawOutcome {
        http,
        body: bytes,
        grpc_status,
        // grpc-message is percent-encoded; spaces are all these tests read.
        grpc_message: grpc_message.replace("%20", " "),
        status,
        status_bytes: sent,
        accept_encoding,
    }
}
