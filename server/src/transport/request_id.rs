//! The request id: every response carries one in [`REQUEST_ID_HEADER`]
//! (unary, streaming and error responses alike, and requests refused
//! before a handler), and every log line of the request carries the same
//! id in its `rpc` span's `request_id` field, so a client's report and the
//! server's log meet on it.
//!
//! A client's own id is echoed when it is sane: 1 to [`MAX_ID_BYTES`]
//! visible ASCII characters (what a log line and a header can carry
//! verbatim). Any other value is replaced, never echoed: the id is the
//! server's to trust in its logs.

#![forbid(unsafe_code)]

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};

use http::HeaderValue;
use tracing::Instrument;

use super::middleware::{HttpResponse, Middleware, ResponseFuture};

/// The header that carries the request id, both ways.
pub const REQUEST_ID_HEADER: &str = "x-request-id";
/// The longest client id echoed.
pub const MAX_ID_BYTES: usize = 128;

/// A request's id, in its extensions for handlers that want it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestId(pub HeaderValue);

/// The middleware (no settings; a layer: `WrapLayer(AssignRequestId)`).
#[derive(Clone, Copy, Debug, Default)]
pub struct AssignRequestId;

/// Whether a client's id may be echoed (see the module docs).
fn sane(v: &HeaderValue) -> bool {
    let b = v.as_bytes();
    (1..=MAX_ID_BYTES).contains(&b.len()) && b.iter().all(|c| c.is_ascii_graphic())
}

/// A new id: this process's random prefix and a counter. Unique across
/// processes and restarts (the prefix) without a random draw per request.
fn generate() -> HeaderValue {
    static PREFIX: LazyLock<u32> = LazyLock::new(|| getrandom::u32().unwrap_or(0));
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    HeaderValue::from_str(&format!("{:08x}-{n:x}", *PREFIX)).expect("hex is a valid header value")
}

impl<S, B> Middleware<S, B> for AssignRequestId
where
    S: tower::Service<http::Request<B>, Response = HttpResponse>,
    S::Future: Send + 'static,
{
    fn call(&self, mut inner: S, mut req: http::Request<B>) -> ResponseFuture<S::Error> {
        let id = req
            .headers()
            .get(REQUEST_ID_HEADER)
            .filter(|v| sane(v))
            .cloned()
            .unwrap_or_else(generate);
        // Visible ASCII: as text without a check.
        let span = tracing::info_span!("rpc", request_id = id.to_str().unwrap_or_default());
        req.extensions_mut().insert(RequestId(id.clone()));
        let call = inner.call(req);
        Box::pin(
            async move {
                let mut resp = call.await?;
                resp.headers_mut().insert(REQUEST_ID_HEADER, id);
                Ok(resp)
            }
            .instrument(span),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_short_visible_ascii_ids_are_echoed() {
        let ok = |s: &str| sane(&HeaderValue::from_str(s).unwrap());
        assert!(ok("abc-123_XYZ.~"));
        assert!(ok(&"a".repeat(MAX_ID_BYTES)));
        assert!(!ok(&"a".repeat(MAX_ID_BYTES + 1)));
        assert!(!ok(""));
        assert!(!ok("two words"));
        assert!(!sane(&HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap()));
    }

    #[test]
    fn generated_ids_differ_and_are_sane() {
        let (a, b) = (generate(), generate());
        assert_ne!(a, b);
        assert!(sane(&a) && sane(&b));
    }
}
