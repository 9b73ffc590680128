//! Who a request comes from, for what belongs to a client (its
//! shared-memory regions): the bearer token it presented when `[auth]` is
//! on; else, on a Unix socket, the peer's user id (SO_PEERCRED); else, on
//! plain TCP without auth, the peer's IP address (every client behind one
//! address is one identity; turn auth on to tell them apart).

#![forbid(unsafe_code)]

use std::fmt;
use std::net::IpAddr;

use super::connections::{ConnInfo, Peer};

/// What [`super::auth::Authenticate`] leaves in a request's extensions
/// once its token checked out: the token's SHA-256 (never the token).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenDigest(pub [u8; 32]);

/// A request's identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Caller {
    /// The SHA-256 of the bearer token.
    Token([u8; 32]),
    /// A Unix-socket peer's user id.
    Uid(u32),
    /// A TCP peer's address (auth off).
    Addr(IpAddr),
    /// A request that came through no connection of ours (in-process).
    Unknown,
}

impl Caller {
    /// The identity of a request with these extensions.
    pub fn of(ext: &http::Extensions) -> Caller {
        if let Some(TokenDigest(d)) = ext.get::<TokenDigest>() {
            return Caller::Token(*d);
        }
        match ConnInfo::of(ext).map(|c| &c.peer) {
            Some(Peer::Unix { uid, .. }) => Caller::Uid(*uid),
            Some(Peer::Tcp(t)) => t
                .remote_addr
                .map_or(Caller::Unknown, |a| Caller::Addr(a.ip().to_canonical())),
            None => Caller::Unknown,
        }
    }

    /// The user id of a Unix-socket peer, whatever identified the request.
    pub fn peer_uid(ext: &http::Extensions) -> Option<u32> {
        match ConnInfo::of(ext).map(|c| &c.peer) {
            Some(Peer::Unix { uid, .. }) => Some(*uid),
            _ => None,
        }
    }
}

/// For messages: never the token, only that it was one (and 4 bytes of
/// its digest, to tell two apart in a log).
impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Caller::Token(d) => write!(
                f,
                "bearer token sha256:{:02x}{:02x}{:02x}{:02x}…",
                d[0], d[1], d[2], d[3]
            ),
            Caller::Uid(u) => write!(f, "uid {u}"),
            Caller::Addr(a) => write!(f, "peer {a}"),
            Caller::Unknown => f.write_str("an unidentified caller"),
        }
    }
}
