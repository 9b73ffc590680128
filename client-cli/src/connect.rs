//! Connecting to samplerd: one eager connection (so an unreachable server is
//! reported once, naming the address), the per-RPC timeout, and the
//! `authorization: Bearer …` interceptor, and TLS (`--tls`, `--ca-cert`,
//! `--client-cert`/`--client-key` for mutual TLS).

use std::time::Duration;

use samplerd_api::v1::sampler_client::SamplerClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic_health::pb::health_client::HealthClient;

use crate::cli::{ConnArgs, unix_path};

/// Largest message accepted from the server (top-n tables are small, but
/// leave room).
const MAX_DECODE: usize = 64 << 20;

/// The server could not be reached (or the flags could not form a request).
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// Nothing answered at the address.
    #[error("cannot reach samplerd at {addr}: {reason}")]
    Unreachable { addr: String, reason: String },
    /// The bearer token is not valid header text.
    #[error("--token / SAMPLERD_TOKEN is not valid header text (visible ASCII only)")]
    BadToken,
    /// A TLS file could not be read.
    #[error("{flag} {path}: cannot read: {reason}")]
    TlsFile {
        flag: &'static str,
        path: String,
        reason: String,
    },
    /// The TLS settings were refused.
    #[error("TLS: {0}")]
    Tls(String),
}

/// Whether the flags ask for TLS.
fn wants_tls(args: &ConnArgs) -> bool {
    args.tls
        || args.ca_cert.is_some()
        || args.client_cert.is_some()
        || args.addr.starts_with("https://")
}

fn read_tls_file(flag: &'static str, path: &std::path::Path) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(path).map_err(|e| ConnectError::TlsFile {
        flag,
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// The client TLS configuration from the flags.
fn tls_config(args: &ConnArgs) -> Result<ClientTlsConfig, ConnectError> {
    let mut tls = ClientTlsConfig::new();
    tls = match &args.ca_cert {
        Some(ca) => tls.ca_certificate(Certificate::from_pem(read_tls_file("--ca-cert", ca)?)),
        None => tls.with_native_roots(),
    };
    if let (Some(cert), Some(key)) = (&args.client_cert, &args.client_key) {
        tls = tls.identity(Identity::from_pem(
            read_tls_file("--client-cert", cert)?,
            read_tls_file("--client-key", key)?,
        ));
    }
    if let Some(name) = &args.tls_server_name {
        tls = tls.domain_name(name.clone());
    }
    Ok(tls)
}

/// Adds `authorization: Bearer TOKEN` when a token is configured.
#[derive(Clone, Default)]
pub struct Auth(Option<MetadataValue<Ascii>>);

impl Interceptor for Auth {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// The Sampler client type used everywhere.
pub type Sampler = SamplerClient<InterceptedService<Channel, Auth>>;
/// The health client type.
pub type HealthService = HealthClient<InterceptedService<Channel, Auth>>;

/// A connected channel plus what every client needs.
#[derive(Clone)]
pub struct Conn {
    /// The server URL, as printed in errors.
    pub addr: String,
    channel: Channel,
    auth: Auth,
}

impl Conn {
    /// A Sampler client on the shared channel.
    pub fn sampler(&self) -> Sampler {
        SamplerClient::with_interceptor(self.channel.clone(), self.auth.clone())
            .max_decoding_message_size(MAX_DECODE)
    }

    /// A health client on the shared channel.
    pub fn health(&self) -> HealthService {
        HealthClient::with_interceptor(self.channel.clone(), self.auth.clone())
    }
}

/// Connects to `args.addr` within `args.timeout`.
pub async fn connect(args: &ConnArgs) -> Result<Conn, ConnectError> {
    let auth = match &args.token {
        Some(t) if !t.is_empty() => Auth(Some(
            MetadataValue::try_from(format!("Bearer {t}")).map_err(|_| ConnectError::BadToken)?,
        )),
        _ => Auth(None),
    };
    let timeout = Duration::from_secs_f64(args.timeout);
    let unreachable = |reason: String| ConnectError::Unreachable {
        addr: args.addr.clone(),
        reason,
    };
    if let Some(path) = unix_path(&args.addr) {
        let channel = tokio::time::timeout(timeout, unix_channel(path, timeout))
            .await
            .map_err(|_| unreachable(format!("timed out after {}s", args.timeout)))?
            .map_err(|e| unreachable(root_cause(&e)))?;
        return Ok(Conn {
            addr: args.addr.clone(),
            channel,
            auth,
        });
    }
    let tls = wants_tls(args);
    // tonic only speaks TLS to an https:// URI.
    let url = match args.addr.strip_prefix("http://") {
        Some(rest) if tls => format!("https://{rest}"),
        _ => args.addr.clone(),
    };
    // `--addr` was validated by clap; this cannot fail in practice.
    let mut endpoint = Endpoint::from_shared(url).map_err(|e| unreachable(e.to_string()))?;
    if tls {
        endpoint = endpoint
            .tls_config(tls_config(args)?)
            .map_err(|e| ConnectError::Tls(root_cause(&e)))?;
    }
    let endpoint = endpoint
        .connect_timeout(timeout)
        .timeout(timeout)
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(32 << 20)
        .tcp_nodelay(true);
    let channel = match tokio::time::timeout(timeout, endpoint.connect()).await {
        Ok(Ok(ch)) => ch,
        Ok(Err(e)) => return Err(unreachable(root_cause(&e))),
        Err(_) => return Err(unreachable(format!("timed out after {}s", args.timeout))),
    };
    Ok(Conn {
        addr: args.addr.clone(),
        channel,
        auth,
    })
}

/// A channel over the Unix-domain socket at `path` (the server's
/// `--listen unix:/path`). The URI only names the `:authority`; `localhost`
/// is what the server's HTTP/2 layer accepts.
async fn unix_channel(path: &str, timeout: Duration) -> Result<Channel, tonic::transport::Error> {
    let path = std::path::PathBuf::from(path);
    Endpoint::from_static("http://localhost")
        .timeout(timeout)
        .initial_stream_window_size(8 << 20)
        .initial_connection_window_size(32 << 20)
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
}

/// The most useful text of an error chain: an I/O error's kind ("connection
/// refused"), else the innermost message.
pub fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    let mut last = e.to_string();
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return match io.kind() {
                std::io::ErrorKind::Other => io.to_string(),
                kind => kind.to_string(),
            };
        }
        let text = err.to_string();
        if !text.is_empty() {
            last = text;
        }
        cur = err.source();
    }
    if last.contains("timed out") || last.contains("elapsed") {
        return "timed out".into();
    }
    last
}
