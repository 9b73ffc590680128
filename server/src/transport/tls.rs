//! Transport security: the `[tls]` configuration (server certificate and
//! key, optional client CA for mutual TLS), building tonic's rustls server
//! config from it with errors naming the key and file, and the rule that a
//! non-loopback address is served in plaintext only when explicitly
//! allowed (`tls.allow_insecure = true`). The key must be the certificate's
//! (refused naming both files, by `check-config` as by `serve`); a
//! certificate outside its validity dates is served with a warning naming
//! the file and the date (clients refuse it, but an operator may be
//! replacing it).

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use rustls::InconsistentKeys;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use serde::{Deserialize, Serialize};
use tonic::transport::{Certificate, Identity, ServerTlsConfig};
use x509_parser::time::ASN1Time;

use super::auth::{AuthConfig, AuthError, Authenticate, TokenSet};
use super::listen::Listen;
use super::middleware::WrapLayer;

/// `[tls]`: TLS is on when both `cert_file` and `key_file` are set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain of the server (leaf first).
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file` (PKCS#8, PKCS#1 or SEC1).
    pub key_file: Option<PathBuf>,
    /// PEM CA certificate(s): when set, every client must present a
    /// certificate signed by one of them (mutual TLS).
    pub client_ca_file: Option<PathBuf>,
    /// Serve plaintext on a non-loopback address. Off by default: without
    /// TLS, tokens and logits cross the network readable by anyone on the
    /// path. Set it when TLS terminates elsewhere (a service-mesh sidecar).
    pub allow_insecure: bool,
}

/// Why the TLS configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{key} = {path}: cannot read: {reason}")]
    Read {
        key: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("{key} = {path}: {reason}")]
    Content {
        key: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("{key}: {reason}")]
    Incomplete { key: &'static str, reason: String },
    #[error(
        "tls.key_file = {key} is not the private key of tls.cert_file = {cert}: the certificate \
         was issued for another key ({reason})"
    )]
    Mismatch {
        cert: PathBuf,
        key: PathBuf,
        reason: String,
    },
    #[error("tls.cert_file / tls.key_file: {0}")]
    Build(String),
}

/// The server's TLS as loaded from its files.
#[derive(Debug)]
pub struct ServerTls {
    /// tonic's rustls configuration.
    pub config: ServerTlsConfig,
    /// Set when the server certificate is expired or not yet valid.
    pub validity_warning: Option<String>,
}

impl TlsConfig {
    /// Whether the server speaks TLS.
    pub fn enabled(&self) -> bool {
        self.cert_file.is_some() && self.key_file.is_some()
    }

    /// Configuration mistakes that need no file access: a half-configured
    /// certificate, a client CA without server TLS, plaintext on a
    /// non-loopback `listen` without `allow_insecure`. Returns the key at
    /// fault and the message.
    pub fn check(&self, listen: &Listen) -> Result<(), (&'static str, String)> {
        match (&self.cert_file, &self.key_file) {
            (Some(_), None) => {
                return Err((
                    "tls.key_file",
                    "is not set but tls.cert_file is: set both to enable TLS".into(),
                ));
            }
            (None, Some(_)) => {
                return Err((
                    "tls.cert_file",
                    "is not set but tls.key_file is: set both to enable TLS".into(),
                ));
            }
            _ => {}
        }
        if self.client_ca_file.is_some() && !self.enabled() {
            return Err((
                "tls.client_ca_file",
                "mutual TLS needs server TLS: set tls.cert_file and tls.key_file too".into(),
            ));
        }
        // A Unix socket never leaves the host: plaintext is fine there.
        if let Some(listen) = listen.tcp().find(|a| !a.ip().is_loopback())
            && !self.enabled()
            && !self.allow_insecure
        {
            return Err((
                "listen",
                format!(
                    "{listen} is not a loopback address and TLS is off: set tls.cert_file and \
                     tls.key_file, or accept plaintext explicitly with tls.allow_insecure = true \
                     (env SAMPLERD_TLS__ALLOW_INSECURE=true)"
                ),
            ));
        }
        Ok(())
    }

    /// tonic's rustls server configuration, or `None` when TLS is off.
    /// Files are read and their PEM checked here, so a wrong path, a key
    /// in the certificate slot or a key that is not the certificate's fails
    /// start-up naming the key and file.
    pub fn server_config(&self) -> Result<Option<ServerTls>, TlsError> {
        let (Some(cert), Some(key)) = (&self.cert_file, &self.key_file) else {
            if let Some(ca) = &self.client_ca_file {
                return Err(TlsError::Incomplete {
                    key: "tls.client_ca_file",
                    reason: format!(
                        "{} is set but TLS is off (tls.cert_file and tls.key_file)",
                        ca.display()
                    ),
                });
            }
            return Ok(None);
        };
        let cert_pem = read_pem("tls.cert_file", cert, &["CERTIFICATE"], "a PEM certificate")?;
        let key_pem = read_pem(
            "tls.key_file",
            key,
            &["PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY"],
            "a PEM private key",
        )?;
        let leaf = check_pair(cert, &cert_pem, key, &key_pem)?;
        let validity_warning = validity_warning(cert, &leaf, x509_parser::time::ASN1Time::now());
        let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(cert_pem, key_pem));
        if let Some(ca) = &self.client_ca_file {
            let ca_pem = read_pem(
                "tls.client_ca_file",
                ca,
                &["CERTIFICATE"],
                "PEM CA certificates",
            )?;
            tls = tls.client_ca_root(Certificate::from_pem(ca_pem));
        }
        Ok(Some(ServerTls {
            config: tls,
            validity_warning,
        }))
    }
}

/// Parses the certificate chain and the key and checks that the key is the
/// leaf certificate's (rustls refuses a mismatched pair too, but only once
/// serving starts, so `check-config` would pass it); returns the leaf.
fn check_pair(
    cert: &Path,
    cert_pem: &[u8],
    key: &Path,
    key_pem: &[u8],
) -> Result<CertificateDer<'static>, TlsError> {
    use rustls::pki_types::pem::PemObject as _;
    let content = |key: &'static str, path: &Path, reason: String| TlsError::Content {
        key,
        path: path.to_owned(),
        reason,
    };
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| content("tls.cert_file", cert, format!("cannot parse the PEM: {e}")))?;
    let Some(leaf) = chain.first().cloned() else {
        return Err(content(
            "tls.cert_file",
            cert,
            "holds no certificate".into(),
        ));
    };
    let private = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| content("tls.key_file", key, format!("cannot parse the PEM: {e}")))?;
    let signing = rustls::crypto::ring::default_provider()
        .key_provider
        .load_private_key(private)
        .map_err(|e| content("tls.key_file", key, format!("unusable private key: {e}")))?;
    match CertifiedKey::new(chain, signing).keys_match() {
        // `Unknown`: the key type cannot say (rustls serves it too).
        Ok(()) | Err(rustls::Error::InconsistentKeys(InconsistentKeys::Unknown)) => Ok(leaf),
        Err(e) => Err(TlsError::Mismatch {
            cert: cert.to_owned(),
            key: key.to_owned(),
            reason: e.to_string(),
        }),
    }
}

/// The warning for a certificate (`leaf`, read from `path`) that is not
/// valid at `now`: expired, or not valid yet; `None` while it is valid.
pub fn validity_warning(path: &Path, leaf: &[u8], now: ASN1Time) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(leaf).ok()?;
    let validity = parsed.validity();
    let date = |t: ASN1Time| t.to_rfc2822().unwrap_or_else(|_| t.to_string());
    if now > validity.not_after {
        Some(format!(
            "tls.cert_file = {}: the certificate expired on {} (notAfter): clients will refuse it",
            path.display(),
            date(validity.not_after)
        ))
    } else if now < validity.not_before {
        Some(format!(
            "tls.cert_file = {}: the certificate is not valid before {} (notBefore): clients will refuse it until then",
            path.display(),
            date(validity.not_before)
        ))
    } else {
        None
    }
}

/// Why the server's transport security could not be set up: its TLS
/// files or its bearer-token file.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Auth(#[from] AuthError),
}

/// The server builder with TLS applied (when configured) and the bearer-
/// token layer (a pass-through when `[auth]` is off), both loaded from
/// their files now so a bad file fails start-up. `listen` is where the
/// server will listen (plaintext or no tokens off loopback is warned);
/// a client that has not finished its TLS handshake within
/// `handshake_timeout` is dropped.
pub fn secured_builder(
    tls: &TlsConfig,
    auth: &AuthConfig,
    listen: &Listen,
    handshake_timeout: Duration,
) -> Result<(tonic::transport::Server, WrapLayer<Authenticate>), SecurityError> {
    let mut builder = tonic::transport::Server::builder();
    if let Some(server_tls) = tls.server_config()? {
        if let Some(warning) = &server_tls.validity_warning {
            tracing::warn!("{warning}");
        }
        // A client that stalls mid-handshake is dropped, not kept forever.
        let server_tls = server_tls.config.timeout(handshake_timeout);
        builder = builder
            .tls_config(server_tls)
            .map_err(|e| TlsError::Build(samplerd_sampling::error::error_chain(&e)))?;
        tracing::info!(mutual = tls.client_ca_file.is_some(), "TLS on");
    } else if let Some(listen) = listen.tcp().find(|a| !a.ip().is_loopback()) {
        tracing::warn!(
            listen = %listen,
            "serving PLAINTEXT on a non-loopback address (tls.allow_insecure = true): \
             tokens and data are readable on the network"
        );
    }
    let tokens = match &auth.tokens_file {
        Some(path) => Some(std::sync::Arc::new(TokenSet::load(path)?)),
        None => {
            if let Some(listen) = listen.tcp().find(|a| !a.ip().is_loopback()) {
                tracing::warn!(
                    listen = %listen,
                    "authentication is off (auth.tokens_file unset) on a non-loopback address"
                );
            }
            None
        }
    };
    Ok((builder, WrapLayer(Authenticate::new(tokens))))
}

/// Reads `path` and checks it holds a PEM block with one of `labels`.
fn read_pem(
    key: &'static str,
    path: &Path,
    labels: &[&str],
    what: &str,
) -> Result<Vec<u8>, TlsError> {
    let data = std::fs::read(path).map_err(|e| TlsError::Read {
        key,
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let text = String::from_utf8_lossy(&data);
    let found = labels
        .iter()
        .any(|l| text.contains(&format!("-----BEGIN {l}-----")));
    if !found {
        return Err(TlsError::Content {
            key,
            path: path.to_owned(),
            reason: format!(
                "does not contain {what} (no -----BEGIN {}----- block)",
                labels[0]
            ),
        });
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> Listen {
        s.parse().unwrap()
    }

    #[test]
    fn plaintext_is_refused_off_loopback_unless_allowed() {
        let plain = TlsConfig::default();
        plain.check(&addr("127.0.0.1:1")).unwrap();
        plain.check(&addr("[::1]:1")).unwrap();
        plain.check(&addr("unix:/run/s.sock")).unwrap();
        let (key, msg) = plain.check(&addr("0.0.0.0:1")).unwrap_err();
        assert_eq!(key, "listen");
        assert!(
            msg.contains("0.0.0.0:1") && msg.contains("tls.allow_insecure"),
            "{msg}"
        );
        let allowed = TlsConfig {
            allow_insecure: true,
            ..TlsConfig::default()
        };
        allowed.check(&addr("0.0.0.0:1")).unwrap();
        let tls = TlsConfig {
            cert_file: Some("c".into()),
            key_file: Some("k".into()),
            ..TlsConfig::default()
        };
        tls.check(&addr("0.0.0.0:1")).unwrap();
    }

    #[test]
    fn half_configured_tls_names_the_missing_key() {
        let c = TlsConfig {
            cert_file: Some("c".into()),
            ..TlsConfig::default()
        };
        assert_eq!(c.check(&addr("127.0.0.1:1")).unwrap_err().0, "tls.key_file");
        let ca_only = TlsConfig {
            client_ca_file: Some("ca".into()),
            ..TlsConfig::default()
        };
        assert_eq!(
            ca_only.check(&addr("127.0.0.1:1")).unwrap_err().0,
            "tls.client_ca_file"
        );
    }

    #[test]
    fn unreadable_or_wrong_pem_names_key_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.pem");
        let c = TlsConfig {
            cert_file: Some(missing.clone()),
            key_file: Some(missing.clone()),
            ..TlsConfig::default()
        };
        let msg = c.server_config().unwrap_err().to_string();
        assert!(msg.starts_with("tls.cert_file"), "{msg}");
        assert!(msg.contains("nope.pem"), "{msg}");

        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let cert_path = dir.path().join("cert.pem");
        std::fs::write(&cert_path, cert.cert.pem()).unwrap();
        // The certificate given as the key.
        let swapped = TlsConfig {
            cert_file: Some(cert_path.clone()),
            key_file: Some(cert_path.clone()),
            ..TlsConfig::default()
        };
        let msg = swapped.server_config().unwrap_err().to_string();
        assert!(msg.starts_with("tls.key_file"), "{msg}");
        assert!(msg.contains("private key"), "{msg}");
    }

    #[test]
    fn a_key_that_is_not_the_certificate_s_is_refused_naming_both_files() {
        let dir = tempfile::tempdir().unwrap();
        let ours = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let other = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let cert = dir.path().join("server.crt");
        let key = dir.path().join("server.key");
        let other_key = dir.path().join("other.key");
        std::fs::write(&cert, ours.cert.pem()).unwrap();
        std::fs::write(&key, ours.signing_key.serialize_pem()).unwrap();
        std::fs::write(&other_key, other.signing_key.serialize_pem()).unwrap();
        let config = |key: &Path| TlsConfig {
            cert_file: Some(cert.clone()),
            key_file: Some(key.to_owned()),
            ..TlsConfig::default()
        };
        let msg = config(&other_key).server_config().unwrap_err().to_string();
        assert!(
            msg.contains("tls.key_file = ") && msg.contains("other.key"),
            "{msg}"
        );
        assert!(
            msg.contains("tls.cert_file = ") && msg.contains("server.crt"),
            "{msg}"
        );
        assert!(msg.contains("not the private key"), "{msg}");
        let loaded = config(&key).server_config().unwrap().unwrap();
        assert_eq!(
            loaded.validity_warning, None,
            "a fresh certificate is valid"
        );
    }

    #[test]
    fn a_certificate_outside_its_dates_is_named_with_the_date() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap();
        params.not_before = rcgen::date_time_ymd(2019, 1, 1);
        params.not_after = rcgen::date_time_ymd(2020, 1, 2);
        let leaf = params.self_signed(&key).unwrap();
        let path = Path::new("/etc/samplerd/tls.crt");
        let at = |y, m, d| {
            let t = rcgen::date_time_ymd(y, m, d);
            ASN1Time::from_timestamp(t.unix_timestamp()).unwrap()
        };
        let expired = validity_warning(path, leaf.der(), at(2021, 6, 1)).unwrap();
        assert!(expired.contains("/etc/samplerd/tls.crt"), "{expired}");
        assert!(expired.contains("expired on Thu, 02 Jan 2020"), "{expired}");
        let early = validity_warning(path, leaf.der(), at(2018, 6, 1)).unwrap();
        assert!(
            early.contains("not valid before Tue, 01 Jan 2019"),
            "{early}"
        );
        assert_eq!(validity_warning(path, leaf.der(), at(2019, 6, 1)), None);
    }
}
