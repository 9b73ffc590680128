//! Maximum connection age (gRFC A9 MAX_CONNECTION_AGE and
//! MAX_CONNECTION_AGE_GRACE): how clients that balance over a headless
//! Service's addresses reach replicas added after they connected.
//!
//! gRPC clients keep one HTTP/2 connection per address for as long as it
//! works — hours — and resolve the name again only when one breaks, so a
//! replica added by a scale-up gets no calls from existing clients. Here
//! every connection gets an age, `limits.max_connection_age_secs` times a
//! factor drawn uniformly from [0.9, 1.1] per connection (so connections
//! opened together do not all reconnect together). At that age:
//!
//! 1. **GOAWAY.** hyper's graceful shutdown of the connection sends
//!    GOAWAY(2^31-1) and a PING, then GOAWAY with the last stream it took:
//!    the client opens a new connection — resolving the name again — for
//!    its next call, and a call it sent meanwhile that the server did not
//!    take is retried there transparently (the GOAWAY says it was never
//!    processed). Calls already running go on.
//! 2. **Grace.** After `limits.max_connection_age_grace_secs` more, every
//!    response stream still open on the connection ends with UNAVAILABLE,
//!    reason `SAMPLERD_CONNECTION_AGED` (in the trailers, after the last
//!    whole message): a SampleStream, SampleBatchStream or Generate is
//!    then resumed on a new connection (docs/API.md, "Resuming a stream").
//!    The connection closes once its streams have ended.
//! 3. **Backstop.** A connection still open [`CLOSE_TIMEOUT`] after that
//!    (a client that stopped reading, so the trailers cannot go out; a
//!    handler that has not answered yet) is closed under hyper by failing
//!    its reads and writes.
//!
//! Every connection served here, aged or not, ends with a lingering close
//! ([`linger`]), so that its last frames — a cut stream's trailers — reach
//! the client.
//!
//! tonic has a `max_connection_age` of its own, but one age for every
//! connection and, with a grace set, no GOAWAY before the forced close; so
//! [`serve`] runs tonic's server once per accepted connection instead,
//! which gives each connection its own shutdown signal (tonic's graceful
//! shutdown of a server is hyper's of each of its connections). Server
//! shutdown (SIGTERM) reaches every connection through the same signal.

#![forbid(unsafe_code)]

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::StreamExt;
use http_body::Frame;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};
use tonic::body::Body;
use tonic::codegen::Bytes;
use tonic::service::Routes;
use tonic::transport::server::Connected;

use super::drain::CLOSE_TIMEOUT;
use super::middleware::{HttpResponse, Middleware, ResponseFuture, Wrap};
use crate::status::{Failure, Reason};

/// How far a connection's age strays from `max_connection_age_secs`, each
/// way, as a fraction of it (gRFC A9: ±10 %).
pub const JITTER: f64 = 0.1;

/// The connections' age limits (from `[limits]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgePolicy {
    /// `None`: connections never age.
    pub max_age: Option<Duration>,
    pub grace: Duration,
}

impl AgePolicy {
    /// One connection's age: `max_age` scaled by `1 + JITTER * (2u - 1)`
    /// for `u` uniform in [0, 1).
    pub fn jittered(&self, u: f64) -> Option<Duration> {
        self.max_age
            .map(|age| age.mul_f64(1.0 + JITTER * (2.0 * u.clamp(0.0, 1.0) - 1.0)))
    }
}

/// A uniform draw from [0, 1) (the OS's random source; a failed read
/// gives 0.5, the unjittered age).
fn uniform() -> f64 {
    getrandom::u64().map_or(0.5, |r| (r >> 11) as f64 / (1u64 << 53) as f64)
}

/// One connection's deadlines, fixed when it is accepted.
#[derive(Clone, Copy, Debug)]
struct Deadlines {
    /// GOAWAY.
    goaway: Instant,
    /// Open response streams end (UNAVAILABLE).
    cut: Instant,
    /// Reads and writes fail.
    close: Instant,
}

impl Deadlines {
    fn new(policy: &AgePolicy) -> Option<Deadlines> {
        let goaway = Instant::now() + policy.jittered(uniform())?;
        let cut = goaway + policy.grace;
        Some(Deadlines {
            goaway,
            cut,
            close: cut + CLOSE_TIMEOUT,
        })
    }
}

/// Serves every connection of `incoming` with `server` over `routes`,
/// each under its own age (see the module docs), until `shutdown`
/// resolves; then stops accepting, shuts every connection down gracefully
/// (GOAWAY; running calls go on) and returns once they have all closed.
pub async fn serve<L, ResBody, IO, IE>(
    server: tonic::transport::Server<L>,
    routes: Routes,
    incoming: impl futures::Stream<Item = Result<IO, IE>>,
    policy: AgePolicy,
    shutdown: impl Future<Output = ()>,
) where
    L: tower::Layer<Wrap<CutStreams, Routes>> + Clone + Send + 'static,
    L::Service: tower::Service<http::Request<Body>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    <L::Service as tower::Service<http::Request<Body>>>::Future: Send,
    <L::Service as tower::Service<http::Request<Body>>>::Error:
        Into<tonic::codegen::StdError> + Send,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<tonic::codegen::StdError>,
    IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
    IE: std::fmt::Display,
{
    let routes = routes.prepare();
    let (closing_tx, closing) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut incoming = std::pin::pin!(incoming);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            next = incoming.next() => match next {
                Some(Ok(io)) => {
                    connections.spawn(connection(
                        server.clone(),
                        routes.clone(),
                        io,
                        Deadlines::new(&policy),
                        closing.clone(),
                    ));
                }
                Some(Err(e)) => tracing::debug!(error = %e, "connection not accepted"),
                None => break,
            },
            // Reaps the connections that closed.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    let _ = closing_tx.send(true);
    while connections.join_next().await.is_some() {}
}

/// Serves one connection: tonic's server over a stream of just it, shut
/// down (GOAWAY) at its age or when the server closes.
async fn connection<L, ResBody, IO>(
    server: tonic::transport::Server<L>,
    routes: Routes,
    io: IO,
    deadlines: Option<Deadlines>,
    mut closing: watch::Receiver<bool>,
) where
    L: tower::Layer<Wrap<CutStreams, Routes>> + Clone + Send + 'static,
    L::Service: tower::Service<http::Request<Body>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    <L::Service as tower::Service<http::Request<Body>>>::Future: Send,
    <L::Service as tower::Service<http::Request<Body>>>::Error:
        Into<tonic::codegen::StdError> + Send,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<tonic::codegen::StdError>,
    IO: AsyncRead + AsyncWrite + Connected + Unpin + Send + 'static,
{
    let io = Aged::new(io, deadlines.map(|d| d.close));
    let service = Wrap::new(
        CutStreams {
            at: deadlines.map(|d| d.cut),
        },
        routes,
    );
    // The stream must not end: tonic shuts its connections down when its
    // incoming stream does.
    let incoming =
        futures::stream::once(async { Ok::<_, io::Error>(io) }).chain(futures::stream::pending());
    let signal = async move {
        let aged = async {
            match deadlines {
                Some(d) => tokio::time::sleep_until(d.goaway).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = aged => tracing::debug!("connection reached limits.max_connection_age_secs: GOAWAY"),
            _ = closing.wait_for(|c| *c) => {}
        }
    };
    if let Err(e) = server
        .serve_with_incoming_shutdown(service, incoming, signal)
        .await
    {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

/// The middleware that ends a connection's open response streams at its
/// cut time (UNAVAILABLE, `SAMPLERD_CONNECTION_AGED`); one per connection.
#[derive(Clone, Copy, Debug)]
pub struct CutStreams {
    at: Option<Instant>,
}

impl<S, B> Middleware<S, B> for CutStreams
where
    S: tower::Service<http::Request<B>, Response = HttpResponse>,
    S::Future: Send + 'static,
{
    fn call(&self, mut inner: S, req: http::Request<B>) -> ResponseFuture<S::Error> {
        let fut = inner.call(req);
        let at = self.at;
        Box::pin(async move {
            let resp = fut.await?;
            let Some(at) = at else {
                return Ok(resp);
            };
            Ok(resp.map(|body| {
                Body::new(CutBody {
                    body: Some(body),
                    at,
                    timer: None,
                })
            }))
        })
    }
}

/// The status a stream cut at the end of the grace ends with.
pub fn aged_status() -> tonic::Status {
    Failure::new(
        Reason::ConnectionAged,
        "the connection reached limits.max_connection_age_secs and its grace \
         (limits.max_connection_age_grace_secs) ran out: resume the stream on a new connection",
    )
    .limit("limits.max_connection_age_grace_secs")
    .into_status()
}

/// A response body that ends with [`aged_status`] in its trailers once
/// `at` has passed (between two frames, so after a whole message).
struct CutBody {
    /// `None` once it has ended.
    body: Option<Body>,
    at: Instant,
    /// Armed only when the body waits, so a body that is ready at once (a
    /// unary answer) never registers a timer.
    timer: Option<Pin<Box<Sleep>>>,
}

impl CutBody {
    fn trailers() -> Frame<Bytes> {
        let mut trailers = http::HeaderMap::new();
        if aged_status().add_header(&mut trailers).is_err() {
            // Only a message that is not a valid header value fails, and
            // this one is ASCII.
            trailers.insert("grpc-status", http::HeaderValue::from_static("14"));
        }
        Frame::trailers(trailers)
    }
}

impl http_body::Body for CutBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let this = &mut *self;
        let Some(body) = this.body.as_mut() else {
            return Poll::Ready(None);
        };
        if Instant::now() >= this.at {
            // Dropping the inner body drops the handler's stream (its
            // session, generation slot and permits) at once.
            this.body = None;
            return Poll::Ready(Some(Ok(CutBody::trailers())));
        }
        match Pin::new(body).poll_frame(cx) {
            Poll::Ready(frame) => {
                if frame
                    .as_ref()
                    .is_none_or(|f| matches!(f, Ok(f) if f.is_trailers()))
                {
                    this.body = None;
                }
                Poll::Ready(frame)
            }
            Poll::Pending => {
                let at = this.at;
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
                if timer.as_mut().poll(cx).is_ready() {
                    cx.waker().wake_by_ref();
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.as_ref().is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body
            .as_ref()
            .map_or_else(|| http_body::SizeHint::with_exact(0), |b| b.size_hint())
    }
}

/// A connection's transport that fails its reads and writes from `close`
/// on, which makes hyper drop the connection and every call on it; when
/// dropped, it hands the socket to a lingering close ([`linger`]).
struct Aged<IO: Connected + AsyncRead + AsyncWrite + Unpin + Send + 'static> {
    /// `None` once dropped.
    io: Option<IO>,
    info: IO::ConnectInfo,
    close: Option<Pin<Box<Sleep>>>,
    logged: bool,
}

impl<IO: Connected + AsyncRead + AsyncWrite + Unpin + Send + 'static> Aged<IO> {
    fn new(io: IO, close: Option<Instant>) -> Self {
        Aged {
            info: io.connect_info(),
            io: Some(io),
            close: close.map(|at| Box::pin(tokio::time::sleep_until(at))),
            logged: false,
        }
    }

    /// The transport, unless the close time has passed (registering the
    /// waker if not).
    fn open(&mut self, cx: &mut Context<'_>) -> io::Result<&mut IO> {
        if let Some(timer) = self.close.as_mut()
            && timer.as_mut().poll(cx).is_ready()
        {
            if !self.logged {
                self.logged = true;
                tracing::info!(
                    "closing a connection still open after limits.max_connection_age_secs and its grace"
                );
            }
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "connection still open after limits.max_connection_age_grace_secs",
            ));
        }
        self.io
            .as_mut()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotConnected))
    }
}

// No field is structurally pinned: the transport is `Unpin` and the timer
// is boxed (a connection info that is not `Unpin` changes nothing).
impl<IO: Connected + AsyncRead + AsyncWrite + Unpin + Send + 'static> Unpin for Aged<IO> {}

impl<IO: Connected + AsyncRead + AsyncWrite + Unpin + Send + 'static> Drop for Aged<IO> {
    fn drop(&mut self) {
        if let (Some(io), Ok(runtime)) = (self.io.take(), tokio::runtime::Handle::try_current()) {
            runtime.spawn(linger(io));
        }
    }
}

/// How long a closed connection's socket is kept reading (see [`linger`]).
pub const LINGER: Duration = Duration::from_secs(1);

/// A lingering close: the write side is shut (a FIN after the last frame),
/// then whatever the peer still sends is read and dropped until it closes
/// its side, for at most [`LINGER`], and only then is the socket closed.
/// Closing a socket with unread bytes in it makes the kernel answer with a
/// reset, which also throws away what it had not sent yet — here a
/// connection's last frames, such as the trailers of a stream cut at the
/// end of the grace — and bytes still arrive after the GOAWAY: the client's
/// PINGs, WINDOW_UPDATEs, the reset of a stream it was still sending on.
/// (Go's net/http server closes the same way, for the same reason.)
async fn linger<IO: AsyncRead + AsyncWrite + Unpin>(mut io: IO) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tokio::time::timeout(LINGER, async {
        let _ = io.shutdown().await;
        let mut sink = [0u8; 4096];
        while matches!(io.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
}

impl<IO: Connected + AsyncRead + AsyncWrite + Unpin + Send + 'static> Connected for Aged<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

impl<IO: Connected + AsyncRead + AsyncWrite + Unpin + Send + 'static> AsyncRead for Aged<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.open(cx) {
            Ok(io) => Pin::new(io).poll_read(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }
}

impl<IO: Connected + AsyncRead + AsyncWrite + Unpin + Send + 'static> AsyncWrite for Aged<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.open(cx) {
            Ok(io) => Pin::new(io).poll_write(cx, buf),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.io.as_mut() {
            Some(io) => Pin::new(io).poll_flush(cx),
            None => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.io.as_mut() {
            Some(io) => Pin::new(io).poll_shutdown(cx),
            None => Poll::Ready(Ok(())),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.open(cx) {
            Ok(io) => Pin::new(io).poll_write_vectored(cx, bufs),
            Err(e) => Poll::Ready(Err(e)),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.as_ref().is_some_and(|io| io.is_write_vectored())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_stay_within_ten_percent_and_cover_the_range() {
        let p = AgePolicy {
            max_age: Some(Duration::from_secs(100)),
            grace: Duration::from_secs(5),
        };
        assert_eq!(p.jittered(0.0), Some(Duration::from_secs(90)));
        assert_eq!(p.jittered(0.5), Some(Duration::from_secs(100)));
        assert_eq!(p.jittered(1.0), Some(Duration::from_secs(110)));
        let ages: Vec<Duration> = (0..2000).map(|_| p.jittered(uniform()).unwrap()).collect();
        let (lo, hi) = (ages.iter().min().unwrap(), ages.iter().max().unwrap());
        assert!(*lo >= Duration::from_secs(90) && *hi < Duration::from_secs(110));
        // 2000 uniform draws leave no 5 s gap at either end (chance 2e-45).
        assert!(*lo < Duration::from_secs(95) && *hi > Duration::from_secs(105));
        let none = AgePolicy { max_age: None, ..p };
        assert_eq!(none.jittered(0.3), None);
    }
}
