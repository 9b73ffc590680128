//! Only gRPC is served on the gRPC port: a request whose method is not
//! POST gets HTTP 405, one whose `content-type` does not start with
//! `application/grpc` gets HTTP 415 (what the gRPC over HTTP/2 spec asks
//! of servers; tonic itself would serve anything as gRPC). Such requests
//! never reach a handler.

#![forbid(unsafe_code)]

use http::{HeaderValue, StatusCode, header};
use samplerd_sampling::echo::quote;

use super::middleware::{HttpResponse, Middleware, ResponseFuture};

/// The middleware (no settings; a layer: `WrapLayer(GrpcOnly)`).
#[derive(Clone, Copy, Debug, Default)]
pub struct GrpcOnly;

/// Why a request is not gRPC, as its HTTP status and a plain-text reason.
fn refusal<B>(req: &http::Request<B>) -> Option<(StatusCode, String)> {
    if req.method() != http::Method::POST {
        return Some((
            StatusCode::METHOD_NOT_ALLOWED,
            format!("gRPC requests are POST, not {}", req.method()),
        ));
    }
    let ct = req.headers().get(header::CONTENT_TYPE);
    let grpc = ct.is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    (!grpc).then(|| {
        let got = ct.map_or_else(
            || "none".to_string(),
            |v| quote(&String::from_utf8_lossy(v.as_bytes())).to_string(),
        );
        (
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!(
                "this port serves gRPC only: content-type must be application/grpc (got {got})"
            ),
        )
    })
}

impl<S, B> Middleware<S, B> for GrpcOnly
where
    S: tower::Service<http::Request<B>, Response = HttpResponse>,
    S::Future: Send + 'static,
{
    fn call(&self, mut inner: S, req: http::Request<B>) -> ResponseFuture<S::Error> {
        let Some((status, reason)) = refusal(&req) else {
            return Box::pin(inner.call(req));
        };
        tracing::debug!(%status, %reason, path = %quote(req.uri().path()), "not a gRPC request");
        let mut resp = http::Response::new(tonic::body::Body::new(reason));
        *resp.status_mut() = status;
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        if status == StatusCode::METHOD_NOT_ALLOWED {
            resp.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("POST"));
        }
        Box::pin(async move { Ok(resp) })
    }
}
