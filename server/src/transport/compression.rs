//! When responses are compressed (config `[compression]`).
//!
//! tonic compresses a response whenever the service enables the encoding
//! (`send_compressed`, per service, for every call) and the request's
//! `grpc-accept-encoding` lists it. grpcio and grpc-js list gzip on every
//! call, compressed or not, so every response to them was gzipped — which
//! on loopback costs more than it saves: `Sample` of 151,936 logits with
//! `n_probs = 1024` went from 0.93 to 1.69 ms p50 (docs/PERFORMANCE.md,
//! "Discovery RPCs and response compression").
//!
//! tonic has no per-call switch, so [`ResponseCompression`] decides before
//! tonic sees the request: where the policy says "not compressed", it
//! removes `grpc-accept-encoding` from the request, and tonic then answers
//! uncompressed (exactly as for a client that accepts nothing). The header
//! has no other use on a request. [`ResponsePolicy::Auto`] (the default)
//! mirrors the request: a compressed request (`grpc-encoding` other than
//! `identity`) gets a compressed response, an uncompressed one does not.

#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};

use super::middleware::{HttpResponse, Middleware, ResponseFuture};

const ACCEPT_ENCODING: &str = "grpc-accept-encoding";
const ENCODING: &str = "grpc-encoding";

/// When a response is compressed (with an encoding the client accepts).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResponsePolicy {
    /// When the request itself was compressed.
    #[default]
    Auto,
    /// Whenever the client accepts an encoding (`grpc-accept-encoding`).
    Always,
    /// Never.
    Never,
}

/// Compression settings (config `[compression]`), defaults in one place.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CompressionConfig {
    /// `"auto"`, `"always"` or `"never"` (see [`ResponsePolicy`]).
    pub responses: ResponsePolicy,
}

/// The middleware (a layer: `WrapLayer(ResponseCompression::new(…))`).
#[derive(Clone, Copy, Debug)]
pub struct ResponseCompression {
    policy: ResponsePolicy,
}

impl ResponseCompression {
    pub fn new(config: &CompressionConfig) -> Self {
        ResponseCompression {
            policy: config.responses,
        }
    }

    /// Whether the response to a request with these headers may be
    /// compressed.
    fn compresses(&self, headers: &http::HeaderMap) -> bool {
        match self.policy {
            ResponsePolicy::Always => true,
            ResponsePolicy::Never => false,
            ResponsePolicy::Auto => headers
                .get(ENCODING)
                .is_some_and(|e| e.as_bytes() != b"identity"),
        }
    }
}

impl<S, B> Middleware<S, B> for ResponseCompression
where
    S: tower::Service<http::Request<B>, Response = HttpResponse>,
    S::Future: Send + 'static,
{
    fn call(&self, mut inner: S, mut req: http::Request<B>) -> ResponseFuture<S::Error> {
        if !self.compresses(req.headers()) {
            req.headers_mut().remove(ACCEPT_ENCODING);
        }
        Box::pin(inner.call(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> http::HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| (http::HeaderName::from_static(k), v.parse().unwrap()))
            .collect()
    }

    #[test]
    fn auto_mirrors_the_request() {
        let c = ResponseCompression::new(&CompressionConfig::default());
        assert!(!c.compresses(&headers(&[(ACCEPT_ENCODING, "gzip")])));
        assert!(!c.compresses(&headers(&[(ENCODING, "identity")])));
        assert!(c.compresses(&headers(&[(ENCODING, "gzip")])));
        assert!(c.compresses(&headers(&[(ENCODING, "zstd")])));
    }

    #[test]
    fn the_policy_reads_from_toml() {
        let c: CompressionConfig = toml::from_str(r#"responses = "never""#).unwrap();
        assert_eq!(c.responses, ResponsePolicy::Never);
        let bad = toml::from_str::<CompressionConfig>(r#"responses = "sometimes""#);
        assert!(bad.is_err());
    }
}
