//! Bearer-token authentication: the `[auth]` configuration, the token file
//! (one token per line; blank lines and `#` comments ignored) and a tower
//! layer that answers UNAUTHENTICATED to any request without a valid
//! `authorization: Bearer <token>` — except the health service, which stays
//! open for load-balancer and kubelet probes.
//!
//! Only SHA-256 digests of the tokens are kept, and a presented token is
//! compared against every one of them in constant time (`subtle`), so
//! neither timing nor token length leaks; tokens are never logged.

#![forbid(unsafe_code)]

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;

use super::identity::TokenDigest;
use super::middleware::{HttpResponse, Middleware, ResponseFuture};
use crate::status::{Reason, status};

/// Path prefix of the gRPC health service, which needs no token.
const HEALTH_PATH_PREFIX: &str = "/grpc.health.v1.Health/";
/// The authentication scheme accepted (case-insensitive, RFC 6750).
const BEARER: &str = "bearer ";

/// `[auth]`: authentication is on when `tokens_file` is set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthConfig {
    /// File of accepted bearer tokens, one per line (flag
    /// `--auth-tokens-file`, env `SAMPLERD_AUTH__TOKENS_FILE`).
    pub tokens_file: Option<PathBuf>,
}

/// Why the token file cannot be used. Never includes a token.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("auth.tokens_file = {path}: cannot read: {reason}")]
    Read { path: PathBuf, reason: String },
    #[error("auth.tokens_file = {path}: line {line}: {reason}")]
    Line {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("auth.tokens_file = {path}: contains no tokens (only blank or # comment lines)")]
    Empty { path: PathBuf },
}

/// The accepted tokens, as SHA-256 digests.
pub struct TokenSet {
    digests: Vec<[u8; 32]>,
}

impl std::fmt::Debug for TokenSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenSet({} tokens)", self.digests.len())
    }
}

fn digest(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

impl TokenSet {
    /// Parses token-file text: one token per line, surrounding whitespace
    /// trimmed, blank lines and lines starting with `#` ignored. A token
    /// must be visible ASCII without spaces (it travels in a header).
    pub fn parse(path: &Path, text: &str) -> Result<Self, AuthError> {
        let mut digests = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let token = line.trim();
            if token.is_empty() || token.starts_with('#') {
                continue;
            }
            if !token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(AuthError::Line {
                    path: path.to_owned(),
                    line: i + 1,
                    reason: "a token must be visible ASCII without spaces".into(),
                });
            }
            digests.push(digest(token.as_bytes()));
        }
        if digests.is_empty() {
            return Err(AuthError::Empty {
                path: path.to_owned(),
            });
        }
        Ok(TokenSet { digests })
    }

    /// Reads the token file. A file others can read is accepted with a
    /// warning (the tokens are secrets; mode 0600 or 0640 is expected).
    pub fn load(path: &Path) -> Result<Self, AuthError> {
        let read = |e: std::io::Error| AuthError::Read {
            path: path.to_owned(),
            reason: e.to_string(),
        };
        let text = std::fs::read_to_string(path).map_err(read)?;
        let set = Self::parse(path, &text)?;
        if let Ok(md) = std::fs::metadata(path)
            && md.permissions().mode() & 0o004 != 0
        {
            tracing::warn!(
                path = %path.display(),
                mode = format!("{:04o}", md.permissions().mode() & 0o7777),
                "auth.tokens_file is world-readable; restrict it (chmod 600)"
            );
        }
        tracing::info!(path = %path.display(), tokens = set.len(), "bearer-token authentication on");
        Ok(set)
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.digests.len()
    }

    /// Whether the set is empty (never, once loaded).
    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    /// Whether `token` is one of the set. Compares against every digest
    /// without short-circuiting, so the time does not depend on which (or
    /// whether one) matched.
    pub fn contains(&self, token: &[u8]) -> bool {
        let d = digest(token);
        let mut found = subtle::Choice::from(0);
        for known in &self.digests {
            found |= known.ct_eq(&d);
        }
        found.into()
    }

    /// Checks a request's `authorization` header value.
    pub fn check(&self, header: Option<&http::HeaderValue>) -> Result<(), tonic::Status> {
        self.verify(header).map(|_| ())
    }

    /// Checks a request's `authorization` header value; the accepted
    /// token's digest (the request's identity).
    pub fn verify(&self, header: Option<&http::HeaderValue>) -> Result<TokenDigest, tonic::Status> {
        let Some(value) = header else {
            return Err(status(
                Reason::Unauthenticated,
                "missing `authorization: Bearer <token>` metadata",
            ));
        };
        let bytes = value.as_bytes();
        let scheme_ok = bytes.len() > BEARER.len()
            && bytes[..BEARER.len()].eq_ignore_ascii_case(BEARER.as_bytes());
        if !scheme_ok {
            return Err(status(
                Reason::Unauthenticated,
                "the `authorization` metadata must be `Bearer <token>`",
            ));
        }
        let token = bytes[BEARER.len()..].trim_ascii();
        if self.contains(token) {
            Ok(TokenDigest(digest(token)))
        } else {
            Err(status(Reason::Unauthenticated, "invalid bearer token"))
        }
    }
}

/// The middleware enforcing [`TokenSet`] on every request but health
/// checks (a layer: `WrapLayer(Authenticate::new(tokens))`).
#[derive(Clone, Debug)]
pub struct Authenticate {
    tokens: Option<Arc<TokenSet>>,
}

impl Authenticate {
    /// `None` = authentication off (every request passes).
    pub fn new(tokens: Option<Arc<TokenSet>>) -> Self {
        Authenticate { tokens }
    }
}

impl<S, B> Middleware<S, B> for Authenticate
where
    S: tower::Service<http::Request<B>, Response = HttpResponse> + Send + 'static,
    S::Future: Send + 'static,
{
    fn call(&self, mut inner: S, mut req: http::Request<B>) -> ResponseFuture<S::Error> {
        if let Some(tokens) = &self.tokens
            && !req.uri().path().starts_with(HEALTH_PATH_PREFIX)
        {
            match tokens.verify(req.headers().get(http::header::AUTHORIZATION)) {
                Ok(digest) => {
                    // The request's identity (`transport::identity`).
                    req.extensions_mut().insert(digest);
                }
                Err(status) => return Box::pin(async move { Ok(status.into_http()) }),
            }
        }
        Box::pin(inner.call(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(text: &str) -> TokenSet {
        TokenSet::parse(Path::new("tokens"), text).unwrap()
    }

    fn header(v: &str) -> http::HeaderValue {
        http::HeaderValue::from_str(v).unwrap()
    }

    #[test]
    fn comments_and_blank_lines_are_skipped() {
        let s = set("# ops\n\n  alpha  \n#beta\nbeta2\n");
        assert_eq!(s.len(), 2);
        assert!(s.contains(b"alpha"));
        assert!(s.contains(b"beta2"));
        assert!(!s.contains(b"#beta"));
        assert!(!s.contains(b"alph"));
        assert!(!s.contains(b""));
    }

    #[test]
    fn bad_files_are_refused_without_echoing_tokens() {
        let e = TokenSet::parse(Path::new("/t"), "# only\n\n").unwrap_err();
        assert!(matches!(e, AuthError::Empty { .. }), "{e}");
        let e = TokenSet::parse(Path::new("/t"), "ok\nse cret\n").unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("line 2"), "{msg}");
        assert!(!msg.contains("cret"), "{msg}");
    }

    #[test]
    fn header_check_codes_and_messages() {
        let s = set("s3cret\n");
        s.check(Some(&header("Bearer s3cret"))).unwrap();
        s.check(Some(&header("bearer s3cret"))).unwrap();
        for (h, want) in [
            (None, "missing"),
            (Some(header("Basic s3cret")), "must be `Bearer"),
            (Some(header("Bearer ")), "must be `Bearer"),
            (Some(header("Bearer s3cre")), "invalid bearer token"),
            (Some(header("Bearer s3cret2")), "invalid bearer token"),
        ] {
            let st = s.check(h.as_ref()).unwrap_err();
            assert_eq!(st.code(), tonic::Code::Unauthenticated);
            assert!(st.message().contains(want), "{want}: {}", st.message());
            assert!(!st.message().contains("s3cre"), "{}", st.message());
        }
    }
}
