//! Where the server listens: `listen` names one address or a list, each a
//! TCP `HOST:PORT` or a Unix-domain socket `unix:/path/samplerd.sock`,
//! all serving the same services under the same limits, auth and metrics
//! (`transport::connections` accepts from every listener into one stream).
//!
//! A Unix socket is for a client on the same host or in the same pod (an
//! engine container beside samplerd): no TCP/IP stack, and the peer's
//! user id (SO_PEERCRED) identifies it when no bearer token is used
//! (`transport::identity`). Its file:
//!
//! - gets `transport.unix_socket_mode` (default 0660: the service user and
//!   its group may connect) right after bind, before the first accept;
//! - replaces a file left at its path only when it is a socket nobody
//!   listens on (a connect is refused): a crashed server's stale socket is
//!   removed, a running server's is not taken over (start-up fails naming
//!   the path), and a file that is not a socket is never deleted;
//! - is removed when the server stops (the [`UnixSocketFile`] guard is
//!   dropped), only if it is still the socket this server bound (same
//!   inode), so a second server that took the path over keeps its own.

#![forbid(unsafe_code)]

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The prefix of a Unix-domain socket address.
pub const UNIX_PREFIX: &str = "unix:";

/// One address to serve on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListenAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Tcp(a) => write!(f, "{a}"),
            ListenAddr::Unix(p) => write!(f, "{UNIX_PREFIX}{}", p.display()),
        }
    }
}

/// Why a listen address does not parse.
#[derive(Debug, thiserror::Error)]
pub enum ListenParseError {
    #[error("{0:?} is neither HOST:PORT (an IP address and a port) nor unix:/absolute/path")]
    Unknown(String),
    #[error("{0:?}: a Unix socket path must be absolute")]
    Relative(String),
    #[error("listen: give at least one address")]
    Empty,
}

impl FromStr for ListenAddr {
    type Err = ListenParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix(UNIX_PREFIX) {
            let path = PathBuf::from(path);
            if !path.is_absolute() {
                return Err(ListenParseError::Relative(s.to_string()));
            }
            return Ok(ListenAddr::Unix(path));
        }
        s.parse()
            .map(ListenAddr::Tcp)
            .map_err(|_| ListenParseError::Unknown(s.chars().take(200).collect()))
    }
}

/// `listen`: one address (`"127.0.0.1:50051"`, `"unix:/run/samplerd.sock"`)
/// or a list of them (`["127.0.0.1:50051", "unix:/run/samplerd.sock"]`;
/// `--listen` may be given several times). Never empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listen(Vec<ListenAddr>);

impl Listen {
    /// The addresses (at least one).
    pub fn addrs(&self) -> &[ListenAddr] {
        &self.0
    }

    /// The TCP addresses.
    pub fn tcp(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.0.iter().filter_map(|a| match a {
            ListenAddr::Tcp(t) => Some(*t),
            ListenAddr::Unix(_) => None,
        })
    }

    /// From a list of addresses (at least one).
    pub fn new(addrs: Vec<ListenAddr>) -> Result<Self, ListenParseError> {
        if addrs.is_empty() {
            return Err(ListenParseError::Empty);
        }
        Ok(Listen(addrs))
    }
}

impl From<SocketAddr> for Listen {
    fn from(a: SocketAddr) -> Self {
        Listen(vec![ListenAddr::Tcp(a)])
    }
}

impl FromStr for Listen {
    type Err = ListenParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Listen(vec![s.parse()?]))
    }
}

impl fmt::Display for Listen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, a) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{a}")?;
        }
        Ok(())
    }
}

impl Serialize for Listen {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => s.serialize_str(&one.to_string()),
            many => s.collect_seq(many.iter().map(ToString::to_string)),
        }
    }
}

impl<'de> Deserialize<'de> for Listen {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum OneOrMany {
            One(String),
            Many(Vec<String>),
        }
        let list = match OneOrMany::deserialize(d)? {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        };
        let addrs = list
            .iter()
            .map(|s| s.parse::<ListenAddr>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(serde::de::Error::custom)?;
        Listen::new(addrs).map_err(serde::de::Error::custom)
    }
}

/// `[transport]`: the Unix socket's file and what shared-memory regions
/// may be and how long they live (the service's registry takes the last
/// two as values).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransportConfig {
    /// Mode of a `unix:` listener's socket file (TOML `0o660`): who may
    /// connect. 0660: the service user and its group.
    pub unix_socket_mode: u32,
    /// Release a connection's shared-memory regions when it closes (else
    /// they live until `UnregisterSharedMemory` or shutdown).
    pub release_shared_on_disconnect: bool,
    /// Directories whose files may be registered as shared memory (each
    /// canonical; a file must lie under one, with no symlink on its path).
    pub shared_memory_dirs: Vec<PathBuf>,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            unix_socket_mode: 0o660,
            release_shared_on_disconnect: true,
            shared_memory_dirs: vec![PathBuf::from("/dev/shm")],
        }
    }
}

/// A bound listener.
#[derive(Debug)]
pub enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

/// Every configured address, bound.
#[derive(Debug)]
pub struct Bound {
    pub listeners: Vec<Listener>,
    /// The addresses bound, in `listen`'s order (a TCP port 0 resolved).
    pub addrs: Vec<ListenAddr>,
    /// The Unix sockets' files: removed when these are dropped (hold them
    /// until the server stops).
    pub socket_files: Vec<UnixSocketFile>,
}

impl Bound {
    /// The first TCP address bound.
    pub fn tcp(&self) -> Option<SocketAddr> {
        self.addrs.iter().find_map(|a| match a {
            ListenAddr::Tcp(t) => Some(*t),
            ListenAddr::Unix(_) => None,
        })
    }

    /// The first Unix socket bound.
    pub fn unix(&self) -> Option<&Path> {
        self.socket_files.first().map(|f| f.path())
    }
}

/// Why a listener could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr} (config `listen`): {source}")]
pub struct BindError {
    pub addr: ListenAddr,
    #[source]
    pub source: io::Error,
}

/// Binds every address of `listen` (inside a tokio runtime).
pub async fn bind(listen: &Listen, unix_socket_mode: u32) -> Result<Bound, BindError> {
    let mut out = Bound {
        listeners: Vec::with_capacity(listen.0.len()),
        addrs: Vec::with_capacity(listen.0.len()),
        socket_files: Vec::new(),
    };
    for addr in &listen.0 {
        let err = |source| BindError {
            addr: addr.clone(),
            source,
        };
        match addr {
            ListenAddr::Tcp(a) => {
                let l = tokio::net::TcpListener::bind(a).await.map_err(err)?;
                out.addrs
                    .push(ListenAddr::Tcp(l.local_addr().map_err(err)?));
                out.listeners.push(Listener::Tcp(l));
            }
            ListenAddr::Unix(path) => {
                let (l, f) = bind_unix(path, unix_socket_mode).map_err(err)?;
                out.addrs.push(addr.clone());
                out.listeners.push(Listener::Unix(l));
                out.socket_files.push(f);
            }
        }
    }
    Ok(out)
}

/// The socket file of a bound Unix listener, removed on drop if it is
/// still the one bound here.
#[derive(Debug)]
pub struct UnixSocketFile {
    path: PathBuf,
    ino: u64,
    dev: u64,
}

impl UnixSocketFile {
    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for UnixSocketFile {
    fn drop(&mut self) {
        match std::fs::symlink_metadata(&self.path) {
            Ok(md) if md.ino() == self.ino && md.dev() == self.dev => {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    tracing::warn!(path = %self.path.display(), error = %e, "cannot remove the Unix socket");
                }
            }
            _ => {}
        }
    }
}

/// Binds a Unix listener at `path` with file mode `mode`, replacing a
/// stale socket (see the module docs).
fn bind_unix(path: &Path, mode: u32) -> io::Result<(tokio::net::UnixListener, UnixSocketFile)> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
        Ok(md) if !md.file_type().is_socket() => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                "a file that is not a socket is in the way (not removed)",
            ));
        }
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    "another process listens on this socket",
                ));
            }
            Err(_) => {
                tracing::info!(path = %path.display(), "removing a stale Unix socket");
                std::fs::remove_file(path)?;
            }
        },
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode & 0o7777))?;
    let md = std::fs::symlink_metadata(path)?;
    Ok((
        listener,
        UnixSocketFile {
            path: path.to_owned(),
            ino: md.ino(),
            dev: md.dev(),
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_and_print_back() {
        let l: Listen = "127.0.0.1:50051".parse().unwrap();
        assert_eq!(l.to_string(), "127.0.0.1:50051");
        let u: ListenAddr = "unix:/run/s.sock".parse().unwrap();
        assert_eq!(u, ListenAddr::Unix("/run/s.sock".into()));
        assert_eq!(u.to_string(), "unix:/run/s.sock");
        assert!(matches!(
            "unix:run/s.sock".parse::<ListenAddr>(),
            Err(ListenParseError::Relative(_))
        ));
        assert!(matches!(
            "localhost:1".parse::<ListenAddr>(),
            Err(ListenParseError::Unknown(_))
        ));
        assert!(Listen::new(vec![]).is_err());
    }

    #[tokio::test]
    async fn a_stale_socket_is_replaced_a_live_one_and_other_files_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        // Stale: bound, then the listener dropped without removing the file.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let (live, file) = bind_unix(&path, 0o600).unwrap();
        let md = std::fs::metadata(&path).unwrap();
        assert_eq!(md.permissions().mode() & 0o777, 0o600);
        // Live: someone listens, so a second bind must not take it over.
        let e = bind_unix(&path, 0o600).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse, "{e}");
        drop(live);
        drop(file);
        assert!(!path.exists(), "removed when the server stops");
        // A regular file in the way is never deleted.
        std::fs::write(&path, b"data").unwrap();
        let e = bind_unix(&path, 0o600).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists, "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"data");
    }
}
