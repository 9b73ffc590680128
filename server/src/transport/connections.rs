//! Connection hygiene: what a client can hold without sending a request.
//!
//! tonic accepts every connection and keeps it until the peer leaves, so
//! 750 idle connections, or 50 that never finish their handshake, stay
//! forever, and when descriptors run out `accept()` fails in a busy loop.
//! Here:
//!
//! - **A cap on open connections** (`limits.max_connections`): past it a
//!   new connection is closed at once, and the refusals are logged once per
//!   [`LOG_INTERVAL`] with their count.
//! - **A cap per peer** (`limits.max_connections_per_peer`, by IP address;
//!   0: a quarter of `max_connections`): one client cannot hold every
//!   connection and lock the others out. Its connections past the cap are
//!   closed at once, logged the same way.
//! - **A loopback reserve** (`limits.reserved_loopback_connections`): when
//!   either cap refuses a loopback peer, it may still take one of these
//!   few extra slots, so a health check run inside the pod or host
//!   (`grpc_health_probe`, `samplerctl health`) connects while the
//!   ordinary slots are full. (Kubernetes' native gRPC probes come from
//!   the node's address: the per-peer cap is what keeps room for them.)
//! - **Accept errors back off**: EMFILE and friends are logged (once per
//!   interval) and accepting pauses, doubling from 10 ms to 1 s, instead of
//!   spinning.
//! - **A handshake deadline** (`limits.handshake_timeout_ms`): a connection
//!   that has not sent the HTTP/2 preface's 24 bytes by then is closed
//!   (TLS handshakes get the same deadline from rustls, see
//!   `transport::tls`).
//! - **An idle deadline** (`limits.idle_connection_timeout_secs`): a
//!   connection with no RPC in flight for that long is closed. In-flight
//!   RPCs are counted by [`CountActive`] through the connection's
//!   [`ConnInfo`] in the request's extensions, so a SampleStream whose
//!   client thinks for minutes between steps is not idle; HTTP/2 pings do
//!   not count as activity. The close happens only while nothing is left
//!   to read, so a request already received is never cut; one that arrives
//!   at that very moment fails as on any dropped connection (UNAVAILABLE).
//!   The close is announced by an HTTP/2 GOAWAY(NO_ERROR), so clients
//!   reconnect for their next call instead of seeing a broken connection.
//!
//! Connections come from every listener (`transport::listen`): TCP and
//! Unix-domain sockets alike pass these gates. A Unix socket's peer is
//! its user id (SO_PEERCRED): the per-peer cap counts by uid, and such a
//! peer is local, so it may take the loopback reserve.
//!
//! Each connection carries its peer ([`Peer`]) and an id in [`ConnInfo`],
//! and runs the hooks registered with [`ConnInfo::on_close`] when it
//! closes (how shared-memory regions are released with the connection
//! that registered them).
//!
//! Dead peers are found by HTTP/2 keepalive pings
//! (`limits.keepalive_interval_secs`, `limits.keepalive_timeout_secs`),
//! set on the server builder.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use super::listen::Listener;
use super::middleware::{HttpResponse, Middleware, ResponseFuture};

/// How often refusals and accept errors are logged (with their count).
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);
/// The HTTP/2 client preface: what a connection must send in time.
const PREFACE_BYTES: u64 = 24;
/// What an idle connection gets before it is closed: an HTTP/2 GOAWAY
/// frame (length 8, type 0x7, no flags, stream 0) with NO_ERROR, so a
/// gRPC client opens a new connection for its next call instead of
/// finding this one broken. Last-stream-id 2^31-1: nothing is in flight,
/// so "every stream may have been processed" is true and retries nothing.
const GOAWAY_NO_ERROR: [u8; 17] = [
    0, 0, 8, 0x7, 0, 0, 0, 0, 0, 0x7f, 0xff, 0xff, 0xff, 0, 0, 0, 0,
];
/// Accept-error backoff bounds.
const BACKOFF_MIN: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// The connection limits (from `[limits]`).
#[derive(Clone, Copy, Debug)]
pub struct ConnectionPolicy {
    /// Connections open at once, loopback reserve aside.
    pub max_connections: usize,
    /// Connections one IP address may hold (resolved: never 0).
    pub max_connections_per_peer: usize,
    /// Extra slots only loopback peers may take once a cap refuses them.
    pub reserved_loopback_connections: usize,
    pub handshake_timeout: Duration,
    pub idle_timeout: Duration,
}

/// Why a connection was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refusal {
    /// Its peer already holds `max_connections_per_peer`.
    PeerFull,
    /// `max_connections` are open.
    Full,
}

/// Who holds the connection slots: each open connection counts against its
/// peer's address and against either the shared slots or the loopback
/// reserve. One lock, taken by the accept loop and by a closing
/// connection, never while anything else is held.
#[derive(Debug)]
struct Slots {
    policy: ConnectionPolicy,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    shared: usize,
    reserved: usize,
    /// Open connections by peer; a peer with none has no entry, so the map
    /// never outgrows the connections open.
    by_peer: HashMap<PeerKey, usize>,
}

/// What the per-peer cap counts by: the IP address of a TCP peer, the
/// user id of a Unix-socket peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum PeerKey {
    Ip(IpAddr),
    Uid(u32),
}

impl PeerKey {
    /// Whether the peer is on this host (may take the loopback reserve).
    fn is_local(&self) -> bool {
        match self {
            PeerKey::Ip(ip) => ip.is_loopback(),
            PeerKey::Uid(_) => true,
        }
    }
}

impl std::fmt::Display for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerKey::Ip(ip) => write!(f, "{ip}"),
            PeerKey::Uid(uid) => write!(f, "uid {uid}"),
        }
    }
}

/// A connection's place under the caps, given back when it drops.
#[derive(Debug)]
struct Slot {
    slots: Arc<Slots>,
    peer: PeerKey,
    reserved: bool,
}

impl Slots {
    fn new(policy: ConnectionPolicy) -> Arc<Self> {
        Arc::new(Slots {
            policy,
            held: Mutex::new(Held::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A slot for a connection from `peer`, or why not.
    #[cfg(test)]
    fn admit(self: &Arc<Self>, peer: IpAddr) -> Result<Slot, Refusal> {
        self.admit_key(PeerKey::Ip(peer))
    }

    fn admit_key(self: &Arc<Self>, peer: PeerKey) -> Result<Slot, Refusal> {
        // An IPv4 client of a dual-stack listener is `::ffff:a.b.c.d`: the
        // same peer as `a.b.c.d`.
        let peer = match peer {
            PeerKey::Ip(ip) => PeerKey::Ip(ip.to_canonical()),
            uid => uid,
        };
        let p = &self.policy;
        let mut held = self.lock();
        let of_peer = held.by_peer.get(&peer).copied().unwrap_or(0);
        let refusal = if of_peer >= p.max_connections_per_peer {
            Some(Refusal::PeerFull)
        } else if held.shared >= p.max_connections {
            Some(Refusal::Full)
        } else {
            None
        };
        let reserved = match refusal {
            None => false,
            Some(_) if peer.is_local() && held.reserved < p.reserved_loopback_connections => true,
            Some(why) => return Err(why),
        };
        if reserved {
            held.reserved += 1;
        } else {
            held.shared += 1;
        }
        *held.by_peer.entry(peer).or_insert(0) += 1;
        Ok(Slot {
            slots: Arc::clone(self),
            peer,
            reserved,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.slots.lock();
        if self.reserved {
            held.reserved -= 1;
        } else {
            held.shared -= 1;
        }
        if let Some(n) = held.by_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                held.by_peer.remove(&self.peer);
            }
        }
    }
}

/// In-flight RPCs of one connection, and when the last one ended.
#[derive(Debug)]
pub struct Activity {
    active: AtomicUsize,
    /// Milliseconds after `born` at which the connection last went quiet.
    quiet_since_ms: AtomicU64,
    born: Instant,
}

impl Activity {
    fn new() -> Self {
        Activity {
            active: AtomicUsize::new(0),
            quiet_since_ms: AtomicU64::new(0),
            born: Instant::now(),
        }
    }

    fn start(self: &Arc<Self>) -> RpcGuard {
        self.active.fetch_add(1, Ordering::AcqRel);
        RpcGuard(Arc::clone(self))
    }

    /// How long the connection has had no RPC in flight (`None`: one is).
    fn quiet_for(&self) -> Option<Duration> {
        if self.active.load(Ordering::Acquire) > 0 {
            return None;
        }
        let since = Duration::from_millis(self.quiet_since_ms.load(Ordering::Acquire));
        Some(self.born.elapsed().saturating_sub(since))
    }
}

/// Held for an RPC's life (request through the end of its response body).
struct RpcGuard(Arc<Activity>);

impl Drop for RpcGuard {
    fn drop(&mut self) {
        let a = &self.0;
        a.quiet_since_ms
            .store(a.born.elapsed().as_millis() as u64, Ordering::Release);
        a.active.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Who is at the other end of a connection.
#[derive(Clone, Debug)]
pub enum Peer {
    Tcp(TcpConnectInfo),
    /// A Unix-socket peer's credentials (SO_PEERCRED, taken at accept).
    Unix {
        uid: u32,
        gid: u32,
    },
}

/// Work to do when a connection closes.
type CloseHook = Box<dyn FnOnce() + Send>;

/// The hooks of one connection, run once when it closes.
struct CloseHooks(Mutex<Option<Vec<CloseHook>>>);

impl std::fmt::Debug for CloseHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CloseHooks")
    }
}

impl CloseHooks {
    fn new() -> Self {
        CloseHooks(Mutex::new(Some(Vec::new())))
    }

    fn run(&self) {
        let hooks = self.0.lock().unwrap_or_else(PoisonError::into_inner).take();
        for hook in hooks.into_iter().flatten() {
            hook();
        }
    }
}

/// Connection ids, unique for the process' life.
static NEXT_CONN_ID: AtomicU64 = AtomicU64::new(1);

/// What tonic puts in each request's extensions for a connection accepted
/// here.
#[derive(Clone, Debug)]
pub struct ConnInfo {
    pub peer: Peer,
    /// Unique among the process' connections.
    pub id: u64,
    activity: Arc<Activity>,
    hooks: Arc<CloseHooks>,
}

impl ConnInfo {
    /// Runs `hook` when the connection closes (at once if it has).
    pub fn on_close(&self, hook: impl FnOnce() + Send + 'static) {
        let mut hooks = self.hooks.0.lock().unwrap_or_else(PoisonError::into_inner);
        match hooks.as_mut() {
            Some(list) => list.push(Box::new(hook)),
            None => {
                drop(hooks);
                hook();
            }
        }
    }

    /// The connection of a request, from its extensions (TLS or not).
    pub fn of(ext: &http::Extensions) -> Option<&ConnInfo> {
        ext.get::<ConnInfo>().or_else(|| {
            ext.get::<tonic::transport::server::TlsConnectInfo<ConnInfo>>()
                .map(|t| t.get_ref())
        })
    }
}

/// A connection's byte stream.
enum Io {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Io {
    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Io::Tcp(s) => s.try_write(buf),
            Io::Unix(s) => s.try_write(buf),
        }
    }
}

/// Delegates an `AsyncRead`/`AsyncWrite` call to the stream inside [`Io`].
macro_rules! io_call {
    ($self:expr, $s:ident => $call:expr) => {
        match $self {
            Io::Tcp($s) => $call,
            Io::Unix($s) => $call,
        }
    };
}

/// An accepted connection: its stream, its place under the cap and its
/// deadlines.
pub struct Conn {
    io: Io,
    peer: Peer,
    id: u64,
    hooks: Arc<CloseHooks>,
    _slot: Slot,
    activity: Arc<Activity>,
    policy: ConnectionPolicy,
    read_total: u64,
    timer: Pin<Box<tokio::time::Sleep>>,
    /// The last write took all it was given (hyper's buffered frames, in
    /// one vectored write), so no frame is half written and, on a
    /// connection idle for `idle_timeout`, a frame of our own may go in.
    at_frame_boundary: bool,
}

impl Connected for Conn {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        ConnInfo {
            peer: self.peer.clone(),
            id: self.id,
            activity: Arc::clone(&self.activity),
            hooks: Arc::clone(&self.hooks),
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.hooks.run();
    }
}

impl Conn {
    /// Whether a deadline has passed; else arms the timer for the next one.
    fn expired(&mut self, cx: &mut Context<'_>) -> Option<&'static str> {
        let age = self.activity.born.elapsed();
        let next = if self.read_total < PREFACE_BYTES {
            if age >= self.policy.handshake_timeout {
                return Some("no HTTP/2 preface within limits.handshake_timeout_ms");
            }
            self.policy.handshake_timeout - age
        } else {
            match self.activity.quiet_for() {
                Some(q) if q >= self.policy.idle_timeout => {
                    return Some("idle longer than limits.idle_connection_timeout_secs");
                }
                Some(q) => self.policy.idle_timeout - q,
                // Looked at again when the RPC ends and the peer is read.
                None => self.policy.idle_timeout,
            }
        };
        self.timer
            .as_mut()
            .reset(tokio::time::Instant::now() + next);
        // Registers the waker; a timer that fires re-polls the read.
        if self.timer.as_mut().poll(cx).is_ready() {
            cx.waker().wake_by_ref();
        }
        None
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        match io_call!(&mut this.io, s => Pin::new(s).poll_read(cx, buf)) {
            Poll::Ready(r) => {
                this.read_total += (buf.filled().len() - before) as u64;
                Poll::Ready(r)
            }
            Poll::Pending => match this.expired(cx) {
                Some(why) => {
                    if this.read_total >= PREFACE_BYTES && this.at_frame_boundary {
                        // Best effort: the send buffer of an idle
                        // connection is empty, so 17 bytes fit.
                        let _ = this.io.try_write(&GOAWAY_NO_ERROR);
                    }
                    tracing::debug!(why, "closing connection");
                    Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, why)))
                }
                None => Poll::Pending,
            },
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = io_call!(&mut self.io, s => Pin::new(s).poll_write(cx, buf));
        if let Poll::Ready(Ok(n)) = r {
            self.at_frame_boundary = n == buf.len();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        io_call!(&mut self.io, s => Pin::new(s).poll_flush(cx))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        io_call!(&mut self.io, s => Pin::new(s).poll_shutdown(cx))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = io_call!(&mut self.io, s => Pin::new(s).poll_write_vectored(cx, bufs));
        if let Poll::Ready(Ok(n)) = r {
            self.at_frame_boundary = n == bufs.iter().map(|b| b.len()).sum::<usize>();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        io_call!(&self.io, s => s.is_write_vectored())
    }
}

/// Counts events and logs them at most once per [`LOG_INTERVAL`].
struct Throttled {
    what: &'static str,
    count: u64,
    last: Option<Instant>,
}

impl Throttled {
    fn new(what: &'static str) -> Self {
        Throttled {
            what,
            count: 0,
            last: None,
        }
    }

    fn hit(&mut self, detail: &dyn std::fmt::Display) {
        self.count += 1;
        if self.last.is_none_or(|t| t.elapsed() >= LOG_INTERVAL) {
            tracing::warn!(count = self.count, %detail, "{}", self.what);
            self.count = 0;
            self.last = Some(Instant::now());
        }
    }
}

/// Whether an accept error means a resource ran out (back off) rather
/// than one connection failing (go on at once).
fn out_of_resources(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// The connections to serve: accepted from every listener, each on a
/// task of its own, under one policy (caps, backoff), handed over as
/// [`Conn`]s.
pub fn incoming(listeners: Vec<Listener>, policy: ConnectionPolicy) -> Incoming {
    let (tx, rx) = mpsc::channel(16);
    let slots = Slots::new(policy);
    let accepting = listeners
        .into_iter()
        .map(|l| tokio::spawn(accept_loop(l, Arc::clone(&slots), tx.clone())).abort_handle())
        .collect();
    Incoming {
        rx: ReceiverStream::new(rx),
        accepting,
    }
}

/// The accepted connections; dropping it stops the accept loops (and
/// closes the listeners).
pub struct Incoming {
    rx: ReceiverStream<io::Result<Conn>>,
    accepting: Vec<tokio::task::AbortHandle>,
}

impl futures::Stream for Incoming {
    type Item = io::Result<Conn>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.rx).poll_next(cx)
    }
}

impl Drop for Incoming {
    fn drop(&mut self) {
        for a in &self.accepting {
            a.abort();
        }
    }
}

/// The next connection of `listener`, with its peer.
async fn accept(listener: &Listener) -> io::Result<(Io, Peer, PeerKey)> {
    match listener {
        Listener::Tcp(l) => {
            let (tcp, addr) = l.accept().await?;
            let _ = tcp.set_nodelay(true);
            let info = tcp.connect_info();
            Ok((Io::Tcp(tcp), Peer::Tcp(info), PeerKey::Ip(addr.ip())))
        }
        Listener::Unix(l) => {
            let (unix, _) = l.accept().await?;
            let cred = unix.peer_cred()?;
            Ok((
                Io::Unix(unix),
                Peer::Unix {
                    uid: cred.uid(),
                    gid: cred.gid(),
                },
                PeerKey::Uid(cred.uid()),
            ))
        }
    }
}

async fn accept_loop(listener: Listener, slots: Arc<Slots>, tx: mpsc::Sender<io::Result<Conn>>) {
    let policy = slots.policy;
    let mut refused = Throttled::new(
        "connection refused: limits.max_connections reached (refusals since the last report)",
    );
    let mut refused_peer = Throttled::new(
        "connection refused: its peer holds limits.max_connections_per_peer (refusals since the last report)",
    );
    let mut failed = Throttled::new("accept failed (failures since the last report)");
    let mut backoff = BACKOFF_MIN;
    loop {
        let (io, peer, key) = match accept(&listener).await {
            Ok(accepted) => {
                backoff = BACKOFF_MIN;
                accepted
            }
            Err(e) => {
                failed.hit(&e);
                if out_of_resources(&e) {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
                continue;
            }
        };
        let slot = match slots.admit_key(key) {
            Ok(slot) => slot,
            Err(why) => {
                match why {
                    Refusal::Full => {
                        refused.hit(&format_args!("{} open, peer {key}", policy.max_connections,))
                    }
                    Refusal::PeerFull => refused_peer.hit(&format_args!(
                        "peer {key} holds {}",
                        policy.max_connections_per_peer
                    )),
                }
                drop(io);
                continue;
            }
        };
        let conn = Conn {
            io,
            peer,
            id: NEXT_CONN_ID.fetch_add(1, Ordering::Relaxed),
            hooks: Arc::new(CloseHooks::new()),
            _slot: slot,
            activity: Arc::new(Activity::new()),
            policy,
            read_total: 0,
            timer: Box::pin(tokio::time::sleep(policy.handshake_timeout)),
            at_frame_boundary: true,
        };
        if tx.send(Ok(conn)).await.is_err() {
            return; // the server stopped
        }
    }
}

/// Counts each RPC as in flight on its connection, from its request to the
/// end of its response body (see the module docs).
/// (A layer: `WrapLayer(CountActive)`.)
#[derive(Clone, Copy, Debug, Default)]
pub struct CountActive;

impl<S, B> Middleware<S, B> for CountActive
where
    S: tower::Service<http::Request<B>, Response = HttpResponse>,
    S::Future: Send + 'static,
{
    fn call(&self, mut inner: S, req: http::Request<B>) -> ResponseFuture<S::Error> {
        let guard = ConnInfo::of(req.extensions()).map(|c| c.activity.start());
        let fut = inner.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            let Some(guard) = guard else {
                return Ok(resp);
            };
            Ok(resp.map(|body| {
                tonic::body::Body::new(Guarded {
                    body,
                    _guard: guard,
                })
            }))
        })
    }
}

/// A response body that holds its RPC's [`RpcGuard`] until it is dropped.
struct Guarded {
    body: tonic::body::Body,
    _guard: RpcGuard,
}

impl http_body::Body for Guarded {
    type Data = tonic::codegen::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(max: usize, per_peer: usize, reserve: usize) -> ConnectionPolicy {
        ConnectionPolicy {
            max_connections: max,
            max_connections_per_peer: per_peer,
            reserved_loopback_connections: reserve,
            handshake_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn one_peer_stops_at_its_cap_and_others_still_get_in() {
        let slots = Slots::new(policy(8, 2, 0));
        let held: Vec<Slot> = (0..2)
            .map(|_| slots.admit(ip("10.0.0.1")).unwrap())
            .collect();
        assert_eq!(slots.admit(ip("10.0.0.1")).unwrap_err(), Refusal::PeerFull);
        // The same peer through a dual-stack listener is the same peer.
        assert_eq!(
            slots.admit(ip("::ffff:10.0.0.1")).unwrap_err(),
            Refusal::PeerFull
        );
        let other = slots.admit(ip("10.0.0.2")).unwrap();
        drop(held);
        // Its slots come back when its connections close.
        let again = slots.admit(ip("10.0.0.1")).unwrap();
        drop((other, again));
        assert!(
            slots.lock().by_peer.is_empty(),
            "no entry outlives its connections"
        );
        assert_eq!(slots.lock().shared, 0);
    }

    #[test]
    fn the_server_cap_holds_across_peers() {
        let slots = Slots::new(policy(3, 2, 0));
        let _a: Vec<Slot> = (0..2)
            .map(|_| slots.admit(ip("10.0.0.1")).unwrap())
            .collect();
        let _b = slots.admit(ip("10.0.0.2")).unwrap();
        assert_eq!(slots.admit(ip("10.0.0.3")).unwrap_err(), Refusal::Full);
    }

    #[test]
    fn only_loopback_peers_use_the_reserve_and_only_once_refused() {
        let slots = Slots::new(policy(2, 1, 2));
        let lo = slots.admit(ip("127.0.0.1")).unwrap();
        assert!(!lo.reserved, "a free shared slot is taken first");
        let _other = slots.admit(ip("10.0.0.2")).unwrap();
        assert_eq!(slots.admit(ip("10.0.0.3")).unwrap_err(), Refusal::Full);
        // Past both caps, loopback gets the reserve, and no more than it.
        let r1 = slots.admit(ip("127.0.0.1")).unwrap();
        let r2 = slots.admit(ip("::1")).unwrap();
        assert!(r1.reserved && r2.reserved);
        assert_eq!(slots.admit(ip("127.0.0.1")).unwrap_err(), Refusal::PeerFull);
        drop(r1);
        assert_eq!(slots.lock().reserved, 1);
        assert!(slots.admit(ip("127.0.0.5")).unwrap().reserved);
    }
}
