//! Which files a client may register, and opening them: an absolute path
//! with no symlink and no `..` anywhere on it (the canonical path must be
//! the path given, and the descriptor opened must still be that path,
//! checked through /proc/self/fd after `open(O_NOFOLLOW)`, so a symlink
//! swapped in between is caught too), under one of
//! `transport.shared_memory_dirs`, a regular file, owned by the peer's
//! user on a Unix socket (else by the server's own user: over TCP there is
//! no peer uid, and a file of the server's user is one its operator made
//! available), and at least `byte_size` long.

#![forbid(unsafe_code)]

use std::fs::File;
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::{Component, Path, PathBuf};

use crate::request::errors::RequestError;
use crate::status::Reason;

/// Field names as clients see them.
pub const FIELD_PATH: &str = "path";
pub const FIELD_BYTE_SIZE: &str = "byte_size";

/// Longest path echoed in an error.
const ECHO_MAX: usize = 200;

fn echo(path: &str) -> String {
    let mut s: String = path.chars().take(ECHO_MAX).collect();
    if s.len() < path.len() {
        s.push('…');
    }
    format!("{s:?}")
}

fn denied(message: String) -> RequestError {
    RequestError::refused(Reason::SharedMemoryDenied, FIELD_PATH, message)
}

/// The configured directories, canonical (a missing one is left out with
/// a warning: nothing under it can be registered).
pub fn canonical_dirs(dirs: &[PathBuf]) -> Vec<PathBuf> {
    dirs.iter()
        .filter_map(|d| match d.canonicalize() {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!(dir = %d.display(), error = %e, "transport.shared_memory_dirs: not usable");
                None
            }
        })
        .collect()
}

/// Opens `path` for reading if a client whose files are `owner`'s may
/// register it (see the module docs); errors name `path` or `byte_size`.
pub fn open(
    path: &str,
    byte_size: u64,
    dirs: &[PathBuf],
    owner: u32,
) -> Result<File, RequestError> {
    let p = Path::new(path);
    if !p.is_absolute() {
        return Err(RequestError::invalid(
            FIELD_PATH,
            format!("{} is not an absolute path", echo(path)),
        ));
    }
    if p.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(denied(format!("{} contains `..`", echo(path))));
    }
    let canonical = p.canonicalize().map_err(|e| {
        RequestError::invalid(FIELD_PATH, format!("{}: cannot open: {e}", echo(path)))
    })?;
    if canonical != p {
        return Err(denied(format!(
            "{} resolves to {}: symlinks are refused",
            echo(path),
            echo(&canonical.to_string_lossy())
        )));
    }
    if !dirs
        .iter()
        .any(|d| canonical.starts_with(d) && canonical != *d)
    {
        let allowed: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        return Err(denied(format!(
            "{} is not under transport.shared_memory_dirs ({})",
            echo(path),
            allowed.join(", ")
        )));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(&canonical)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                denied(format!("{} is a symlink: refused", echo(path)))
            } else {
                RequestError::invalid(FIELD_PATH, format!("{}: cannot open: {e}", echo(path)))
            }
        })?;
    // What was opened, after the fact: a directory on the path swapped for
    // a symlink between the checks above and the open shows here.
    let opened = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()));
    if opened.as_deref().ok() != Some(canonical.as_path()) {
        return Err(denied(format!(
            "{} changed while it was opened (a symlink on its path?): refused",
            echo(path)
        )));
    }
    let md = file.metadata().map_err(|e| {
        RequestError::invalid(FIELD_PATH, format!("{}: cannot stat: {e}", echo(path)))
    })?;
    if !md.file_type().is_file() {
        return Err(RequestError::invalid(
            FIELD_PATH,
            format!("{} is not a regular file", echo(path)),
        ));
    }
    if md.uid() != owner {
        return Err(denied(format!(
            "{} belongs to uid {}, not to uid {owner} (the caller's on a Unix socket, else the server's)",
            echo(path),
            md.uid()
        )));
    }
    if byte_size == 0 || byte_size > md.len() {
        return Err(RequestError::invalid(
            FIELD_BYTE_SIZE,
            format!(
                "{byte_size} must be > 0 and at most the file's size, {} bytes",
                md.len()
            ),
        ));
    }
    Ok(file)
}
