//! Transport security: the `[tls]` configuration (server certificate and
//! key, optional client CA for mutual TLS), building tonic's rustls server
//! config from it with errors naming the key and file, and the rule that a
//! non-loopback address is served in plaintext only when explicitly
//! allowed (`tls.allow_insecure = true`).

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

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
    #[error("tls.cert_file / tls.key_file: {0}")]
    Build(String),
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
    pub fn check(&self, listen: SocketAddr) -> Result<(), (&'static str, String)> {
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
        if !self.enabled() && !listen.ip().is_loopback() && !self.allow_insecure {
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
    /// Files are read and their PEM checked here, so a wrong path or a key
    /// in the certificate slot fails start-up naming the key and file.
    pub fn server_config(&self) -> Result<Option<ServerTlsConfig>, TlsError> {
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
        Ok(Some(tls))
    }
}

/// The server builder with TLS applied (when configured) and the bearer-
/// token layer (a pass-through when `[auth]` is off), both loaded from
/// their files now so a bad file fails start-up.
pub fn secured_builder(
    config: &crate::app::config::Config,
) -> Result<
    (
        tonic::transport::Server,
        crate::transport::middleware::WrapLayer<crate::transport::auth::Authenticate>,
    ),
    crate::app::server::StartError,
> {
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = config.tls.server_config()? {
        // A client that stalls mid-handshake is dropped, not kept forever.
        let tls = tls.timeout(Duration::from_millis(config.limits.handshake_timeout_ms));
        builder = builder
            .tls_config(tls)
            .map_err(|e| TlsError::Build(samplerd_sampling::error::error_chain(&e)))?;
        tracing::info!(mutual = config.tls.client_ca_file.is_some(), "TLS on");
    } else if !config.listen.ip().is_loopback() {
        tracing::warn!(
            listen = %config.listen,
            "serving PLAINTEXT on a non-loopback address (tls.allow_insecure = true): \
             tokens and data are readable on the network"
        );
    }
    let tokens = match &config.auth.tokens_file {
        Some(path) => Some(std::sync::Arc::new(crate::transport::auth::TokenSet::load(
            path,
        )?)),
        None => {
            if !config.listen.ip().is_loopback() {
                tracing::warn!(
                    listen = %config.listen,
                    "authentication is off (auth.tokens_file unset) on a non-loopback address"
                );
            }
            None
        }
    };
    Ok((
        builder,
        crate::transport::middleware::WrapLayer(crate::transport::auth::Authenticate::new(tokens)),
    ))
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

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn plaintext_is_refused_off_loopback_unless_allowed() {
        let plain = TlsConfig::default();
        plain.check(addr("127.0.0.1:1")).unwrap();
        plain.check(addr("[::1]:1")).unwrap();
        let (key, msg) = plain.check(addr("0.0.0.0:1")).unwrap_err();
        assert_eq!(key, "listen");
        assert!(
            msg.contains("0.0.0.0:1") && msg.contains("tls.allow_insecure"),
            "{msg}"
        );
        let allowed = TlsConfig {
            allow_insecure: true,
            ..TlsConfig::default()
        };
        allowed.check(addr("0.0.0.0:1")).unwrap();
        let tls = TlsConfig {
            cert_file: Some("c".into()),
            key_file: Some("k".into()),
            ..TlsConfig::default()
        };
        tls.check(addr("0.0.0.0:1")).unwrap();
    }

    #[test]
    fn half_configured_tls_names_the_missing_key() {
        let c = TlsConfig {
            cert_file: Some("c".into()),
            ..TlsConfig::default()
        };
        assert_eq!(c.check(addr("127.0.0.1:1")).unwrap_err().0, "tls.key_file");
        let ca_only = TlsConfig {
            client_ca_file: Some("ca".into()),
            ..TlsConfig::default()
        };
        assert_eq!(
            ca_only.check(addr("127.0.0.1:1")).unwrap_err().0,
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
}
