//! Plugin trust: a plugin is native code running inside the server, so
//! before a library is opened its file and the directory holding it must be
//! writable only by their owner, and owned by the service user or root
//! (the rule sshd applies with `StrictModes`); optionally its SHA-256 must
//! match a pinned digest. Checks run once, at start-up, on the configured
//! paths only — no request can name a file.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

/// Group- or world-writable permission bits.
const WRITABLE_BY_OTHERS: u32 = 0o022;
/// Read buffer for hashing a library.
const HASH_CHUNK: usize = 64 * 1024;

/// What the loader demands of a plugin before opening it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrustPolicy {
    /// Skip the ownership and permission checks (config
    /// `plugins.allow_untrusted_permissions`).
    pub allow_untrusted_permissions: bool,
    /// The user that may own plugins besides root (the service user).
    pub owner_uid: u32,
    /// Pinned SHA-256 digests (lowercase hex) by library file name
    /// (config `plugins.sha256`).
    pub sha256: BTreeMap<String, String>,
}

impl Default for TrustPolicy {
    /// Strict: permissions checked against the effective user, nothing pinned.
    fn default() -> Self {
        TrustPolicy {
            allow_untrusted_permissions: false,
            owner_uid: effective_uid(),
            sha256: BTreeMap::new(),
        }
    }
}

/// Why a plugin path is refused.
#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error(
        "refusing plugin {kind} {path}: {reason} (fix the permissions, or set plugins.allow_untrusted_permissions = true to accept it)"
    )]
    Permissions {
        kind: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("refusing plugin {path}: cannot inspect it: {reason}")]
    Inspect { path: PathBuf, reason: String },
    #[error(
        "refusing plugin {path}: SHA-256 mismatch for {name} (plugins.sha256): expected {expected}, actual {actual}"
    )]
    Digest {
        path: PathBuf,
        name: String,
        expected: String,
        actual: String,
    },
    #[error("plugins.sha256.{key:?}: {message}")]
    Pin { key: String, message: String },
}

/// The process's effective user id (the service user).
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

impl TrustPolicy {
    /// Checks the pinned digests are well-formed (64 hex digits); run
    /// before anything is loaded so a typo fails start-up by itself.
    pub fn validate_pins(&self) -> Result<(), TrustError> {
        for (key, hex) in &self.sha256 {
            if key.is_empty() || key.contains('/') {
                return Err(TrustError::Pin {
                    key: key.clone(),
                    message: "the key must be a library file name (e.g. \"libfoo.so\"), not a path"
                        .into(),
                });
            }
            if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(TrustError::Pin {
                    key: key.clone(),
                    message: format!("{hex:?} is not a SHA-256 digest (64 hex digits)"),
                });
            }
        }
        Ok(())
    }

    /// Checks a configured plugin directory (before listing it).
    pub fn check_directory(&self, dir: &Path) -> Result<(), TrustError> {
        if self.allow_untrusted_permissions {
            return Ok(());
        }
        check_owner_and_mode(dir, "directory", self.owner_uid)
    }

    /// Checks a plugin library (already canonical) and the directory
    /// holding it, then its pinned digest if any.
    pub fn check_library(&self, path: &Path) -> Result<(), TrustError> {
        if !self.allow_untrusted_permissions {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                check_owner_and_mode(dir, "directory", self.owner_uid)?;
            }
            check_owner_and_mode(path, "file", self.owner_uid)?;
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if let Some(expected) = self.sha256.get(&name) {
            let actual = sha256_hex(path)?;
            if !actual.eq_ignore_ascii_case(expected) {
                return Err(TrustError::Digest {
                    path: path.to_owned(),
                    name,
                    expected: expected.to_ascii_lowercase(),
                    actual,
                });
            }
        }
        Ok(())
    }

    /// Every pin must name a library that was loaded: a pin for a file
    /// that is not there is a configuration mistake, not a pass.
    pub fn check_pins_used(&self, loaded: &[PathBuf]) -> Result<(), TrustError> {
        for key in self.sha256.keys() {
            let found = loaded
                .iter()
                .any(|p| p.file_name().is_some_and(|n| n.to_string_lossy() == *key));
            if !found {
                return Err(TrustError::Pin {
                    key: key.clone(),
                    message: "pinned, but no plugin with this file name was loaded".into(),
                });
            }
        }
        Ok(())
    }
}

/// Refuses `path` when it is group/world-writable or owned by anyone but
/// `owner_uid` or root.
pub fn check_owner_and_mode(
    path: &Path,
    kind: &'static str,
    owner_uid: u32,
) -> Result<(), TrustError> {
    let md = std::fs::metadata(path).map_err(|e| TrustError::Inspect {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    judge(md.mode() & 0o7777, md.uid(), owner_uid).map_err(|reason| TrustError::Permissions {
        kind,
        path: path.to_owned(),
        reason,
    })
}

/// The StrictModes rule on a mode and owner: `Err(reason)` when refused.
fn judge(mode: u32, uid: u32, owner_uid: u32) -> Result<(), String> {
    if mode & WRITABLE_BY_OTHERS != 0 {
        let who = if mode & 0o002 != 0 { "world" } else { "group" };
        return Err(format!(
            "it is {who}-writable (mode {mode:04o}); other users could replace the code the server runs"
        ));
    }
    if uid != 0 && uid != owner_uid {
        return Err(format!(
            "it is owned by uid {uid}, not by the service user (uid {owner_uid}) or root"
        ));
    }
    Ok(())
}

/// The SHA-256 of the file at `path`, lowercase hex.
pub fn sha256_hex(path: &Path) -> Result<String, TrustError> {
    let inspect = |e: std::io::Error| TrustError::Inspect {
        path: path.to_owned(),
        reason: e.to_string(),
    };
    let mut file = std::fs::File::open(path).map_err(inspect)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; HASH_CHUNK];
    loop {
        let n = file.read(&mut buf).map_err(inspect)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    fn set_mode(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    fn owned_uid(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().uid()
    }

    #[test]
    fn foreign_owned_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("libx.so");
        std::fs::write(&f, b"x").unwrap();
        set_mode(&f, 0o644);
        let actual = owned_uid(&f);
        let service = actual.wrapping_add(4242);
        let r = check_owner_and_mode(&f, "file", service);
        // Root-owned files are always accepted (as by sshd); anything else
        // must belong to the service user.
        assert_eq!(r.is_ok(), actual == 0, "{r:?}");
    }

    #[test]
    fn owner_only_writable_is_accepted() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("libx.so");
        std::fs::write(&f, b"x").unwrap();
        set_mode(&f, 0o755);
        check_owner_and_mode(&f, "file", owned_uid(&f)).unwrap();
    }

    #[test]
    fn world_and_group_writable_are_refused_naming_path_and_mode() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("libx.so");
        std::fs::write(&f, b"x").unwrap();
        for (mode, who) in [(0o757, "world"), (0o775, "group")] {
            set_mode(&f, mode);
            let msg = check_owner_and_mode(&f, "file", owned_uid(&f))
                .unwrap_err()
                .to_string();
            assert!(msg.contains(&f.display().to_string()), "{msg}");
            assert!(msg.contains(&format!("{who}-writable")), "{msg}");
            assert!(msg.contains(&format!("{mode:04o}")), "{msg}");
        }
    }

    #[test]
    fn owner_must_be_the_service_user_or_root() {
        // Injected uids: the tests run as root, whose files always pass.
        assert_eq!(judge(0o755, 1000, 1000), Ok(()));
        assert_eq!(judge(0o755, 0, 1000), Ok(()));
        let msg = judge(0o755, 1001, 1000).unwrap_err();
        assert!(msg.contains("owned by uid 1001"), "{msg}");
        assert!(msg.contains("service user (uid 1000)"), "{msg}");
        // Group-writable by root's group is still refused.
        assert!(judge(0o775, 0, 0).unwrap_err().contains("group-writable"));
    }

    #[test]
    fn writable_directory_refuses_its_libraries() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("libx.so");
        std::fs::write(&f, b"x").unwrap();
        set_mode(&f, 0o644);
        set_mode(dir.path(), 0o777);
        let policy = TrustPolicy::default();
        let msg = policy.check_library(&f).unwrap_err().to_string();
        assert!(msg.contains("plugin directory"), "{msg}");
        assert!(msg.contains("world-writable"), "{msg}");
        let lenient = TrustPolicy {
            allow_untrusted_permissions: true,
            ..TrustPolicy::default()
        };
        lenient.check_library(&f).unwrap();
    }

    #[test]
    fn digest_is_sha256_of_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("libx.so");
        std::fs::write(&f, b"abc").unwrap();
        // FIPS 180-2 test vector for "abc".
        assert_eq!(
            sha256_hex(&f).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn pin_mismatch_names_file_expected_and_actual() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("libx.so");
        std::fs::write(&f, b"abc").unwrap();
        set_mode(&f, 0o644);
        let wrong = "00".repeat(32);
        let policy = TrustPolicy {
            sha256: [("libx.so".to_string(), wrong.clone())].into(),
            ..TrustPolicy::default()
        };
        let msg = policy.check_library(&f).unwrap_err().to_string();
        assert!(msg.contains("libx.so"), "{msg}");
        assert!(msg.contains(&wrong), "{msg}");
        assert!(msg.contains("ba7816bf"), "{msg}");
    }

    #[test]
    fn malformed_and_unused_pins_are_refused() {
        let bad = TrustPolicy {
            sha256: [("libx.so".to_string(), "xyz".to_string())].into(),
            ..TrustPolicy::default()
        };
        assert!(bad.validate_pins().unwrap_err().to_string().contains("xyz"));
        let path_key = TrustPolicy {
            sha256: [("/a/libx.so".to_string(), "0".repeat(64))].into(),
            ..TrustPolicy::default()
        };
        assert!(path_key.validate_pins().is_err());
        let unused = TrustPolicy {
            sha256: [("libmissing.so".to_string(), "0".repeat(64))].into(),
            ..TrustPolicy::default()
        };
        let msg = unused
            .check_pins_used(&[PathBuf::from("/p/libx.so")])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("libmissing.so"), "{msg}");
    }
}
