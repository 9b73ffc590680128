//! Plugin trust: a plugin is native code running inside the server, so
//! before a library is loaded its file, the directory holding it and every
//! directory above that up to `/` must be safe from other users (the rule
//! sshd applies with `StrictModes`); optionally its SHA-256 must match a
//! pinned digest. Checks run once, at start-up, on the configured paths only
//! — no request can name a file. `plugins.allow_untrusted_permissions`
//! turns a failed permission check into a warning naming the path and its
//! mode (pins still apply).
//!
//! The file is opened once ([`TrustPolicy::open_library`]): its mode, owner
//! and digest are read from that descriptor, and the loader maps the same
//! descriptor (through `/proc/self/fd/N`), so nobody can swap the file
//! between the check and the load. The directories are judged by path: once
//! every one of them is writable only by root or the service user, no other
//! user can rename anything along the way either.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};

/// Group- or world-writable permission bits.
const WRITABLE_BY_OTHERS: u32 = 0o022;
/// The sticky bit: in such a directory only a file's owner (or the
/// directory's owner, or root) may rename or delete it, so a shared,
/// root-owned sticky directory such as /tmp cannot have our entries swapped.
const STICKY: u32 = 0o1000;
/// The config key that turns the permission checks off.
const ESCAPE_KEY: &str = "plugins.allow_untrusted_permissions";
/// Read buffer for hashing a library.
const HASH_CHUNK: usize = 64 * 1024;

/// What the loader demands of a plugin before opening it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrustPolicy {
    /// Load despite failed ownership and permission checks, each logged as
    /// a warning (config `plugins.allow_untrusted_permissions`); pins still
    /// apply.
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
        "refusing plugin {plugin}: plugin {kind} {path} {reason} (fix the permissions, or set {ESCAPE_KEY} = true to accept it)"
    )]
    Permissions {
        /// The plugin file or configured directory being checked.
        plugin: PathBuf,
        /// "file", "directory" or "ancestor directory".
        kind: &'static str,
        /// The offending path (the plugin itself or one above it).
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

/// A plugin library that passed the checks, still open: load it through
/// [`TrustedLibrary::file`], never by its path again.
#[derive(Debug)]
pub struct TrustedLibrary {
    /// The canonical path (for messages and ListStages).
    pub path: PathBuf,
    /// The descriptor that was checked (and hashed, when pinned).
    pub file: File,
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

    /// Checks a configured plugin directory (before its libraries are
    /// listed): the directory itself strictly (anyone who may write it may
    /// add a library), every directory above it up to `/` as an ancestor.
    pub fn check_directory(&self, dir: &Path) -> Result<(), TrustError> {
        self.enforce(self.directory_modes(dir))
    }

    /// The permission walk of [`check_directory`](Self::check_directory).
    fn directory_modes(&self, dir: &Path) -> Result<(), TrustError> {
        let canonical = std::fs::canonicalize(dir).map_err(|e| TrustError::Inspect {
            path: dir.to_owned(),
            reason: e.to_string(),
        })?;
        check_path_mode(&canonical, &canonical, "directory", judge, self.owner_uid)?;
        self.check_ancestors(&canonical, canonical.parent())
    }

    /// A permission check's verdict as this policy applies it: the refusal
    /// itself, or — with `plugins.allow_untrusted_permissions` — a warning
    /// naming the path and its mode (one line) and a pass, so the escape
    /// hatch never loads an unsafe plugin without a word.
    fn enforce(&self, verdict: Result<(), TrustError>) -> Result<(), TrustError> {
        match verdict {
            Err(e) if self.allow_untrusted_permissions => {
                match e {
                    TrustError::Permissions {
                        plugin,
                        kind,
                        path,
                        reason,
                    } => tracing::warn!(
                        "plugin {}: its {kind} {} {reason}; loaded anyway ({ESCAPE_KEY} = true)",
                        plugin.display(),
                        path.display()
                    ),
                    other => tracing::warn!(
                        "plugin permissions not checked: {other}; loaded anyway ({ESCAPE_KEY} = true)"
                    ),
                }
                Ok(())
            }
            verdict => verdict,
        }
    }

    /// Opens a plugin library (`path` canonical) once and checks it: every
    /// directory above it, then the open file's mode and owner, then its
    /// pinned digest if any, all on that one descriptor.
    pub fn open_library(&self, path: &Path) -> Result<TrustedLibrary, TrustError> {
        let inspect = |e: std::io::Error| TrustError::Inspect {
            path: path.to_owned(),
            reason: e.to_string(),
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // The directory holding the library is held to the strict
            // rule, as a configured directory is.
            self.enforce(
                check_path_mode(path, dir, "directory", judge, self.owner_uid)
                    .and_then(|()| self.check_ancestors(path, dir.parent())),
            )?;
        }
        // O_NOFOLLOW: the path is canonical, so a symlink here appeared
        // after canonicalisation. O_NONBLOCK: opening a FIFO would wait for
        // a writer (start-up hanging); it has no effect on a regular file,
        // and anything else is refused just below. std adds O_CLOEXEC.
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .map_err(inspect)?;
        let md = file.metadata().map_err(inspect)?;
        if !md.is_file() {
            return Err(TrustError::Inspect {
                path: path.to_owned(),
                reason: "not a regular file".into(),
            });
        }
        self.enforce(
            judge(md.mode() & 0o7777, md.uid(), self.owner_uid).map_err(|reason| {
                TrustError::Permissions {
                    plugin: path.to_owned(),
                    kind: "file",
                    path: path.to_owned(),
                    reason,
                }
            }),
        )?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if let Some(expected) = self.sha256.get(&name) {
            let actual = sha256_of(&mut file).map_err(inspect)?;
            if !actual.eq_ignore_ascii_case(expected) {
                return Err(TrustError::Digest {
                    path: path.to_owned(),
                    name,
                    expected: expected.to_ascii_lowercase(),
                    actual,
                });
            }
        }
        Ok(TrustedLibrary {
            path: path.to_owned(),
            file,
        })
    }

    /// Judges `first` and every directory above it up to `/` with the
    /// ancestor rule (see [`judge_ancestor`]).
    fn check_ancestors(&self, plugin: &Path, first: Option<&Path>) -> Result<(), TrustError> {
        let Some(first) = first else {
            return Ok(());
        };
        for dir in first.ancestors().filter(|d| !d.as_os_str().is_empty()) {
            check_path_mode(
                plugin,
                dir,
                "ancestor directory",
                judge_ancestor,
                self.owner_uid,
            )?;
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

/// A rule on (mode, owner uid, service uid): `Err(reason)` when refused.
type Rule = fn(u32, u32, u32) -> Result<(), String>;

/// Refuses `path` (a directory on the way to `plugin`) when `rule` does.
fn check_path_mode(
    plugin: &Path,
    path: &Path,
    kind: &'static str,
    rule: Rule,
    owner_uid: u32,
) -> Result<(), TrustError> {
    let md = std::fs::metadata(path).map_err(|e| TrustError::Inspect {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    rule(md.mode() & 0o7777, md.uid(), owner_uid).map_err(|reason| TrustError::Permissions {
        plugin: plugin.to_owned(),
        kind,
        path: path.to_owned(),
        reason,
    })
}

/// Refuses `path` when it is group/world-writable or owned by anyone but
/// `owner_uid` or root (the rule for a plugin file and its directory).
pub fn check_owner_and_mode(
    path: &Path,
    kind: &'static str,
    owner_uid: u32,
) -> Result<(), TrustError> {
    check_path_mode(path, path, kind, judge, owner_uid)
}

/// Who, besides the owner, may write: `None` when nobody.
fn writable_by(mode: u32) -> Option<&'static str> {
    if mode & 0o002 != 0 {
        Some("world")
    } else if mode & 0o020 != 0 {
        Some("group")
    } else {
        None
    }
}

/// The owner must be root or the service user.
fn judge_owner(mode: u32, uid: u32, owner_uid: u32) -> Result<(), String> {
    if uid != 0 && uid != owner_uid {
        return Err(format!(
            "is owned by uid {uid} (mode {mode:04o}), not by the service user (uid {owner_uid}) or root"
        ));
    }
    Ok(())
}

/// The StrictModes rule for a plugin file and the directory holding it:
/// writable by its owner only, owned by root or the service user.
fn judge(mode: u32, uid: u32, owner_uid: u32) -> Result<(), String> {
    if let Some(who) = writable_by(mode & WRITABLE_BY_OTHERS) {
        return Err(format!(
            "is {who}-writable (mode {mode:04o}, owner uid {uid}); other users could replace the code the server runs"
        ));
    }
    judge_owner(mode, uid, owner_uid)
}

/// The rule for the directories above: as [`judge`], except that a
/// group/world-writable directory passes when it is sticky and owned by
/// root (like /tmp): others may add entries there but not rename or
/// remove ours.
fn judge_ancestor(mode: u32, uid: u32, owner_uid: u32) -> Result<(), String> {
    if let Some(who) = writable_by(mode & WRITABLE_BY_OTHERS)
        && (mode & STICKY == 0 || uid != 0)
    {
        let missing = if mode & STICKY == 0 {
            "not sticky"
        } else {
            "sticky but not owned by root"
        };
        return Err(format!(
            "is {who}-writable and {missing} (mode {mode:04o}, owner uid {uid}); other users could swap the plugin beneath it"
        ));
    }
    judge_owner(mode, uid, owner_uid)
}

/// The SHA-256 of everything `reader` yields, lowercase hex.
pub fn sha256_of(reader: &mut impl std::io::Read) -> std::io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; HASH_CHUNK];
    loop {
        let n = reader.read(&mut buf)?;
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

/// The SHA-256 of the file at `path`, lowercase hex.
pub fn sha256_hex(path: &Path) -> Result<String, TrustError> {
    let inspect = |e: std::io::Error| TrustError::Inspect {
        path: path.to_owned(),
        reason: e.to_string(),
    };
    let mut file = File::open(path).map_err(inspect)?;
    sha256_of(&mut file).map_err(inspect)
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

    /// A tempdir (0700, in the system temp dir) holding `sub/libx.so`
    /// (0644, contents "abc"); returns the canonical library path.
    fn library_in(tmp: &tempfile::TempDir, sub: &str) -> PathBuf {
        let dir = tmp.path().join(sub);
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("libx.so");
        std::fs::write(&f, b"abc").unwrap();
        set_mode(&f, 0o644);
        std::fs::canonicalize(f).unwrap()
    }

    /// Whether the system temp dir is itself acceptable as an ancestor (a
    /// sticky root-owned /tmp or a private one): tests that build their
    /// tree there say so and stop when it is not.
    fn temp_dir_is_trusted() -> bool {
        let policy = TrustPolicy::default();
        let probe = tempfile::tempdir().unwrap();
        let ok = policy.check_directory(probe.path()).is_ok();
        if !ok {
            eprintln!("the system temp dir's ancestors are not trusted here: skipping");
        }
        ok
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
            assert!(msg.contains(ESCAPE_KEY), "{msg}");
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
        // The directory holding a plugin gets no sticky exception: others
        // could add libraries to a listed directory.
        assert!(judge(0o1777, 0, 0).unwrap_err().contains("world-writable"));
    }

    #[test]
    fn the_ancestor_rule_accepts_only_sticky_root_owned_shared_directories() {
        // Injected owners, so the non-root cases are covered as root too.
        assert_eq!(judge_ancestor(0o755, 0, 1000), Ok(()));
        assert_eq!(judge_ancestor(0o755, 1000, 1000), Ok(()));
        assert_eq!(judge_ancestor(0o1777, 0, 1000), Ok(()));
        let msg = judge_ancestor(0o777, 0, 1000).unwrap_err();
        assert!(msg.contains("world-writable and not sticky"), "{msg}");
        assert!(msg.contains("mode 0777, owner uid 0"), "{msg}");
        let msg = judge_ancestor(0o1777, 1000, 1000).unwrap_err();
        assert!(msg.contains("sticky but not owned by root"), "{msg}");
        let msg = judge_ancestor(0o1770, 1000, 1000).unwrap_err();
        assert!(msg.contains("group-writable"), "{msg}");
        let msg = judge_ancestor(0o755, 1001, 1000).unwrap_err();
        assert!(msg.contains("owned by uid 1001"), "{msg}");
    }

    #[test]
    fn a_plugin_dir_inside_a_world_writable_parent_is_refused() {
        if !temp_dir_is_trusted() {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let lib = library_in(&tmp, "shared/plugins");
        let shared = tmp.path().join("shared");
        let plugins = shared.join("plugins");
        set_mode(&plugins, 0o755);
        set_mode(&shared, 0o777);
        let policy = TrustPolicy::default();
        let msg = policy.open_library(&lib).unwrap_err().to_string();
        let shared = std::fs::canonicalize(&shared).unwrap();
        assert!(msg.contains(&lib.display().to_string()), "{msg}");
        assert!(
            msg.contains(&format!("ancestor directory {} is", shared.display())),
            "{msg}"
        );
        assert!(msg.contains("world-writable and not sticky"), "{msg}");
        assert!(msg.contains("mode 0777"), "{msg}");
        assert!(msg.contains(ESCAPE_KEY), "{msg}");
        // The configured directory is refused the same way.
        let msg = policy.check_directory(&plugins).unwrap_err().to_string();
        assert!(msg.contains("ancestor directory"), "{msg}");
        // Sticky: accepted only when root owns it (as /tmp).
        set_mode(&shared, 0o1777);
        let r = policy.open_library(&lib);
        assert_eq!(r.is_ok(), owned_uid(&shared) == 0, "{r:?}");
        // The escape hatch skips the walk.
        set_mode(&shared, 0o777);
        let lenient = TrustPolicy {
            allow_untrusted_permissions: true,
            ..TrustPolicy::default()
        };
        lenient.open_library(&lib).unwrap();
        set_mode(&shared, 0o755);
        policy.open_library(&lib).unwrap();
    }

    #[test]
    fn a_sticky_root_owned_parent_like_tmp_is_accepted() {
        let tmp = Path::new("/tmp");
        let Ok(md) = std::fs::metadata(tmp) else {
            eprintln!("no /tmp: skipping");
            return;
        };
        if md.mode() & 0o1777 != 0o1777 || md.uid() != 0 {
            eprintln!("/tmp is not sticky, world-writable and root-owned here: skipping");
            return;
        }
        let inside = tempfile::tempdir_in(tmp).unwrap();
        let lib = library_in(&inside, "plugins");
        set_mode(lib.parent().unwrap(), 0o755);
        let opened = TrustPolicy::default().open_library(&lib).unwrap();
        assert_eq!(opened.path, lib);
    }

    #[test]
    fn writable_directory_refuses_its_libraries() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("libx.so");
        std::fs::write(&f, b"x").unwrap();
        set_mode(&f, 0o644);
        set_mode(dir.path(), 0o777);
        let f = std::fs::canonicalize(f).unwrap();
        let policy = TrustPolicy::default();
        let msg = policy.open_library(&f).unwrap_err().to_string();
        assert!(msg.contains("plugin directory"), "{msg}");
        assert!(msg.contains("world-writable"), "{msg}");
        let lenient = TrustPolicy {
            allow_untrusted_permissions: true,
            ..TrustPolicy::default()
        };
        lenient.open_library(&f).unwrap();
    }

    #[test]
    fn the_checked_descriptor_is_the_file_that_stays_open() {
        let tmp = tempfile::tempdir().unwrap();
        let lib = library_in(&tmp, "p");
        let opened = TrustPolicy {
            allow_untrusted_permissions: true,
            ..TrustPolicy::default()
        }
        .open_library(&lib)
        .unwrap();
        // Replacing the path afterwards does not change what was opened.
        std::fs::remove_file(&lib).unwrap();
        std::fs::write(&lib, b"evil").unwrap();
        let mut file = &opened.file;
        let mut seen = Vec::new();
        std::io::Read::read_to_end(&mut file, &mut seen).unwrap();
        assert_eq!(seen, b"abc");
        // A symlink where the canonical path had a file is not followed.
        std::fs::remove_file(&lib).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", &lib).unwrap();
        let lenient = TrustPolicy {
            allow_untrusted_permissions: true,
            ..TrustPolicy::default()
        };
        assert!(lenient.open_library(&lib).is_err());
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
        let tmp = tempfile::tempdir().unwrap();
        let f = library_in(&tmp, "p");
        let wrong = "00".repeat(32);
        let policy = TrustPolicy {
            sha256: [("libx.so".to_string(), wrong.clone())].into(),
            // Pins apply with the permission checks off too.
            allow_untrusted_permissions: true,
            ..TrustPolicy::default()
        };
        let msg = policy.open_library(&f).unwrap_err().to_string();
        assert!(msg.contains("libx.so"), "{msg}");
        assert!(msg.contains(&wrong), "{msg}");
        assert!(msg.contains("ba7816bf"), "{msg}");
        let right = TrustPolicy {
            sha256: [(
                "libx.so".to_string(),
                "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad".to_string(),
            )]
            .into(),
            ..policy
        };
        right.open_library(&f).unwrap();
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
