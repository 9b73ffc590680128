//! The registry of every stage of every loaded plugin library, by name;
//! `load` scans the configured directories at start-up. Turning a chain
//! spec into a chain (`StageRegistry::build_chain`) is in
//! `builder.rs`, which keeps the registry and the chain apart.

use std::collections::HashMap;
use std::ffi::{CStr, c_char};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use samplerd_plugin_sdk::abi::*;

use crate::echo::Echo;
use crate::error::{ChainError, LoadError};
use crate::library::{Library, load_library};
use crate::stage::{ParamInfo, ParamKind, RegisteredStage, StageInfo};
use crate::trust::TrustPolicy;

/// Every loaded stage by name. Cheap to share (`Arc`) between requests.
pub struct StageRegistry {
    stages: Vec<Arc<RegisteredStage>>,
    by_name: HashMap<String, usize>,
    infos: Vec<StageInfo>,
}

/// # Safety
/// `p` must be NULL or a NUL-terminated string that lives forever.
unsafe fn text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: per the caller.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Shared-library files directly inside `dir`, sorted by name. Every
/// `*.so` entry must be a regular file once symlinks are followed: a
/// dangling link (a plugin that was meant to be there) or a FIFO is a
/// broken deployment, refused naming the entry and the link's target,
/// never skipped (its stages would be missing without a word).
fn libraries_in(dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let entries = std::fs::read_dir(dir).map_err(|e| LoadError::Directory {
        path: dir.to_owned(),
        reason: e.to_string(),
    })?;
    let mut files = Vec::new();
    for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
        if path
            .extension()
            .is_none_or(|x| x != std::env::consts::DLL_EXTENSION)
        {
            continue;
        }
        let refuse = |reason: String| LoadError::Open {
            path: path.clone(),
            reason,
        };
        match std::fs::metadata(&path) {
            Ok(md) if md.is_file() => files.push(path),
            Ok(_) => return Err(refuse("not a regular file".into())),
            Err(e) => {
                return Err(refuse(match std::fs::read_link(&path) {
                    Ok(target) => format!(
                        "a symbolic link to {}, which cannot be opened: {e}",
                        target.display()
                    ),
                    Err(_) => e.to_string(),
                }));
            }
        }
    }
    files.sort();
    Ok(files)
}

impl StageRegistry {
    /// Loads every library in `dirs` (each `*.so` directly inside) and each
    /// of `files`. Any library that fails to load fails the whole start-up,
    /// with the file and the reason.
    /// Every path passes the default (strict) [`TrustPolicy`] first.
    pub fn load(dirs: &[PathBuf], files: &[PathBuf]) -> Result<Self, LoadError> {
        Self::load_trusted(dirs, files, &TrustPolicy::default())
    }

    /// [`load`](Self::load) under `policy`: each directory, each library and
    /// the directory holding it are checked before anything is opened.
    pub fn load_trusted(
        dirs: &[PathBuf],
        files: &[PathBuf],
        policy: &TrustPolicy,
    ) -> Result<Self, LoadError> {
        policy.validate_pins()?;
        let mut paths = Vec::new();
        for dir in dirs {
            // Listed first so a missing directory reports as such.
            let libraries = libraries_in(dir)?;
            policy.check_directory(dir)?;
            paths.extend(libraries);
        }
        paths.extend(files.iter().cloned());
        // Checked on the canonical path: a symlink is judged by its target
        // (and dlopen would search the system paths for a bare name). Each
        // file is opened once, checked on that descriptor and loaded from it.
        let mut opened = Vec::with_capacity(paths.len());
        for path in &paths {
            let c = std::fs::canonicalize(path).map_err(|e| LoadError::Open {
                path: path.clone(),
                reason: e.to_string(),
            })?;
            opened.push(policy.open_library(&c)?);
        }
        let canonical: Vec<PathBuf> = opened.iter().map(|l| l.path.clone()).collect();
        policy.check_pins_used(&canonical)?;
        let mut reg = StageRegistry {
            stages: Vec::new(),
            by_name: HashMap::new(),
            infos: Vec::new(),
        };
        for lib in opened {
            reg.add_library(load_library(lib)?)?;
        }
        if reg.stages.is_empty() {
            let searched: Vec<String> = dirs
                .iter()
                .chain(files)
                .map(|p| p.display().to_string())
                .collect();
            return Err(LoadError::Empty {
                searched: if searched.is_empty() {
                    "nothing configured".into()
                } else {
                    searched.join(", ")
                },
            });
        }
        Ok(reg)
    }

    fn add_library(&mut self, lib: Library) -> Result<(), LoadError> {
        for st in &lib.stages {
            // SAFETY: validated static strings (library.rs).
            let name = unsafe { text(st.name) };
            if let Some(&i) = self.by_name.get(&name) {
                return Err(LoadError::Duplicate {
                    path: lib.path.clone(),
                    name,
                    other: self.stages[i].info.path.clone(),
                });
            }
            let specs: &[SdParamSpec] = if st.n_params_spec == 0 {
                &[]
            } else {
                // SAFETY: validated non-NULL static array of n_params_spec.
                unsafe { std::slice::from_raw_parts(st.params_spec, st.n_params_spec) }
            };
            let mut params = Vec::with_capacity(specs.len());
            for (i, s) in specs.iter().enumerate() {
                let kind = ParamKind::from_abi(s.kind).ok_or_else(|| LoadError::Stage {
                    path: lib.path.clone(),
                    index: i,
                    reason: format!("stage `{name}`: parameter #{i} has unknown kind {}", s.kind),
                })?;
                params.push(ParamInfo {
                    // SAFETY: static strings per the ABI.
                    name: unsafe { text(s.name) },
                    kind,
                    default: s.default_number,
                    // SAFETY: as above.
                    description: unsafe { text(s.description) },
                });
            }
            let info = StageInfo {
                name: name.clone(),
                library: lib.name.clone(),
                library_version: lib.version.clone(),
                path: lib.path.clone(),
                // SAFETY: static string per the ABI.
                description: unsafe { text(st.description) },
                params,
                selects: st.flags & SD_STAGE_SELECTS != 0,
                dense_ok: st.flags & SD_STAGE_DENSE_OK != 0,
                needs_vocab: st.flags & SD_STAGE_NEEDS_VOCAB != 0,
                // A bit a 1.0/1.1 library sets means nothing.
                sparse_lowers_only: lib.abi_minor >= 2
                    && st.flags & SD_STAGE_SPARSE_LOWERS_ONLY != 0,
            };
            tracing::debug!(stage = %name, library = %lib.name, path = %lib.path.display(), "registered stage");
            self.by_name.insert(name, self.stages.len());
            self.infos.push(info.clone());
            // SAFETY: validated non-NULL, NUL-terminated static string.
            let stage_name = unsafe { CStr::from_ptr(st.name) };
            let site = crate::activity::CallSite::leak(stage_name, lib.file_name);
            self.stages.push(Arc::new(RegisteredStage {
                info,
                vtable: st,
                site,
            }));
        }
        Ok(())
    }

    /// Every registered stage, in load order.
    pub fn stages(&self) -> &[StageInfo] {
        &self.infos
    }

    pub fn get(&self, name: &str) -> Option<&StageInfo> {
        self.by_name.get(name).map(|&i| &self.infos[i])
    }

    pub(crate) fn registered(&self, name: &str) -> Result<Arc<RegisteredStage>, ChainError> {
        self.by_name
            .get(name)
            .map(|&i| self.stages[i].clone())
            .ok_or_else(|| ChainError::UnknownStage {
                name: Echo::new(name),
                known: self.names().join(", "),
            })
    }

    /// Names of every registered stage.
    pub fn names(&self) -> Vec<String> {
        self.infos.iter().map(|s| s.name.clone()).collect()
    }
}
