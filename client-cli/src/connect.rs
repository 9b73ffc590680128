//! Connecting to samplerd: one eager connection (so an unreachable server is
//! reported once, naming the address), the per-RPC timeout, and the
//! `authorization: Bearer …` interceptor. TLS (`--ca-cert`) plugs in here
//! via `Endpoint::tls_config` once the server speaks it.

use std::time::Duration;

use samplerd_api::v1::sampler_client::SamplerClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::health_client::HealthClient;

use crate::cli::ConnArgs;

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
pub type Health = HealthClient<InterceptedService<Channel, Auth>>;

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
    pub fn health(&self) -> Health {
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
    // `--addr` was validated by clap; this cannot fail in practice.
    let endpoint = Endpoint::from_shared(args.addr.clone())
        .map_err(|e| unreachable(e.to_string()))?
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
