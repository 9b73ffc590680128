//! Loading one plugin library: `dlopen` with `RTLD_NOW | RTLD_LOCAL |
//! RTLD_NODELETE` of the descriptor the trust checks opened (through
//! `/proc/self/fd/N`, so the checked file is the loaded file), the entry
//! symbol, and every version/layout check of the descriptor before a single
//! stage is trusted: a malformed descriptor is a [`LoadError`] naming the
//! file, never a crash of the host. Libraries are never unloaded (unloading
//! a Rust cdylib with thread-locals crashes at thread exit), so their
//! statics live for the process.

use std::ffi::{CStr, CString, c_char};
use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};

use samplerd_plugin_sdk::abi::*;

use crate::error::LoadError;
use crate::trust::TrustedLibrary;

/// glibc's `RTLD_NODELETE`: keep the library mapped even after dlclose.
#[cfg(target_os = "linux")]
const RTLD_NODELETE: i32 = 0x1000;
#[cfg(not(target_os = "linux"))]
const RTLD_NODELETE: i32 = 0x80;

/// Size of `sd_plugin` / `sd_stage` as of ABI 1.0: a descriptor smaller than
/// this lacks fields the host reads.
const PLUGIN_V1_0_SIZE: usize = size_of::<SdPlugin>();
const STAGE_V1_0_SIZE: usize = size_of::<SdStage>();
/// Most stages (and parameters per stage) a descriptor may declare: far
/// above any real library, low enough that a garbage count (2^40) is
/// refused before the host reads or reserves anything for it.
pub const MAX_STAGES: usize = 4096;
pub const MAX_PARAMS: usize = 4096;

/// A loaded library: its descriptor and validated stage vtables.
pub struct Library {
    pub path: PathBuf,
    /// The file name, NUL-terminated and never freed: the fatal-signal
    /// report reads it from [`crate::activity`] without allocating.
    pub file_name: &'static CStr,
    pub name: String,
    pub version: String,
    /// The ABI minor version the library was built against (flags added
    /// later are honoured only from libraries that know them).
    pub abi_minor: u32,
    pub stages: Vec<&'static SdStage>,
}

/// # Safety
/// `p` must be NULL or a NUL-terminated string that lives forever.
unsafe fn static_str(p: *const c_char) -> Option<&'static str> {
    if p.is_null() {
        return None;
    }
    // SAFETY: caller guarantees a valid static C string.
    unsafe { CStr::from_ptr(p) }.to_str().ok()
}

/// Whether `p` is non-NULL and aligned for a `T`: the least the host
/// checks before reading through a pointer a plugin handed it.
fn readable<T>(p: *const T) -> bool {
    !p.is_null() && p.is_aligned()
}

/// Loads the library `lib` (checked and still open) and validates its
/// descriptor.
pub fn load_library(lib: TrustedLibrary) -> Result<Library, LoadError> {
    let path = lib.path.clone();
    let (entry, site) = open_entry(lib)?;
    let desc = descriptor(entry, site, &path)?;
    let abi = |reason: String| LoadError::Abi {
        path: path.clone(),
        reason,
    };
    // SAFETY: descriptor strings are static per the ABI.
    let name = unsafe { static_str(desc.library_name) }
        .ok_or_else(|| abi("library_name is NULL or not UTF-8".into()))?
        .to_string();
    // SAFETY: as above.
    let version = unsafe { static_str(desc.library_version) }
        .unwrap_or("")
        .to_string();
    let stages = stage_vtables(desc, &path)?;
    let file_name = path
        .file_name()
        .and_then(|n| CString::new(n.as_encoded_bytes()).ok())
        .unwrap_or_else(|| c"?".to_owned());
    Ok(Library {
        path,
        // Leaked once per library, which is never unloaded either.
        file_name: Box::leak(file_name.into_boxed_c_str()),
        name,
        version,
        abi_minor: desc.abi_minor,
        stages,
    })
}

/// `dlopen`s the checked descriptor of `lib` and finds its entry point,
/// with the call site a crash while loading is reported under; neither the
/// library nor the descriptor is ever closed.
fn open_entry(
    lib: TrustedLibrary,
) -> Result<(PluginEntryFn, &'static crate::activity::CallSite), LoadError> {
    let path = &lib.path;
    // The descriptor, not the path: whatever is at the path now, the
    // dynamic loader opens the inode that was checked (and hashed).
    let by_fd = format!("/proc/self/fd/{}", lib.file.as_raw_fd());
    let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL | RTLD_NODELETE;
    // A crash in the library's initialisers or entry point is reported
    // naming this file (the path is leaked once per library, which is
    // never unloaded either).
    let site = crate::activity::CallSite::loading(Box::leak(
        CString::new(path.as_os_str().as_encoded_bytes())
            .unwrap_or_else(|_| c"?".to_owned())
            .into_boxed_c_str(),
    ));
    // SAFETY: loading runs the library's initialisers. Plugins are trusted
    // native code from the configured directories (see docs/PLUGINS.md), and
    // loading happens once, from one thread, at start-up.
    let opened = crate::activity::in_plugin(site, || unsafe {
        libloading::os::unix::Library::open(Some(&by_fd), flags)
    });
    // Never closed: glibc recognises an already-loaded library by the name
    // it was opened under before it compares files, so a later plugin
    // opened through a reused descriptor number would be taken for this
    // one. Keeping the descriptor open keeps its number (and name) unique.
    std::mem::forget(lib.file);
    let lib = opened.map_err(|e| LoadError::Open {
        path: path.to_owned(),
        reason: crate::error::error_chain(&e),
    })?;
    // SAFETY: the symbol, when present, has the documented entry signature.
    let entry: PluginEntryFn = match unsafe { lib.get::<PluginEntryFn>(SD_PLUGIN_ENTRY_SYMBOL) } {
        Ok(sym) => *sym,
        Err(_) => {
            return Err(LoadError::NoEntry {
                path: path.to_owned(),
            });
        }
    };
    // Never unload: the descriptor and vtables must stay mapped.
    std::mem::forget(lib);
    Ok((entry, site))
}

/// Calls the entry point and checks the descriptor it returns before any
/// field past the fixed head is read: non-NULL and aligned, the ABI
/// version, and the sizes of the structs the host and plugin exchange.
fn descriptor(
    entry: PluginEntryFn,
    site: &'static crate::activity::CallSite,
    path: &Path,
) -> Result<&'static SdPlugin, LoadError> {
    // SAFETY: the entry point takes no arguments and returns a pointer to a
    // static descriptor (or NULL to refuse).
    let desc = crate::activity::in_plugin(site, || unsafe { entry() });
    let abi = |reason: String| LoadError::Abi {
        path: path.to_owned(),
        reason,
    };
    if desc.is_null() {
        return Err(abi("the entry point returned NULL".into()));
    }
    if !desc.is_aligned() {
        return Err(abi(format!(
            "the entry point returned a misaligned descriptor {desc:p}"
        )));
    }
    // The first six u32 fields exist in every version; read them before
    // trusting the rest of the struct.
    // SAFETY: non-NULL pointer to a static descriptor.
    let head = unsafe { std::slice::from_raw_parts(desc.cast::<u32>(), 6) };
    let (struct_size, major, minor, cand_size, tokens_size, stage_size) =
        (head[0], head[1], head[2], head[3], head[4], head[5]);
    if major != SD_ABI_MAJOR || minor > SD_ABI_MINOR {
        return Err(abi(format!(
            "built for ABI {major}.{minor}, this host speaks {SD_ABI_MAJOR}.{SD_ABI_MINOR}"
        )));
    }
    if (struct_size as usize) < PLUGIN_V1_0_SIZE {
        return Err(abi(format!(
            "sd_plugin is {struct_size} bytes, expected at least {PLUGIN_V1_0_SIZE}"
        )));
    }
    if cand_size as usize != size_of::<SdCandidate>() {
        return Err(abi(format!(
            "sd_candidate is {cand_size} bytes in the plugin, {} in the host (mismatched header)",
            size_of::<SdCandidate>()
        )));
    }
    if tokens_size as usize > size_of::<SdTokens>() || (stage_size as usize) < STAGE_V1_0_SIZE {
        return Err(abi(format!(
            "layout mismatch: sd_tokens {tokens_size} bytes (host {}), sd_stage {stage_size} bytes (host {})",
            size_of::<SdTokens>(),
            size_of::<SdStage>()
        )));
    }
    // SAFETY: size and version checked: every v1.0 field is present.
    Ok(unsafe { &*desc })
}

/// The descriptor's stage vtables, each checked ([`stage_vtable`]) after
/// the count and the array pointer.
fn stage_vtables(desc: &'static SdPlugin, path: &Path) -> Result<Vec<&'static SdStage>, LoadError> {
    let abi = |reason: String| LoadError::Abi {
        path: path.to_owned(),
        reason,
    };
    if desc.n_stages > MAX_STAGES {
        return Err(abi(format!(
            "n_stages is {}, more than the {MAX_STAGES} a library may declare (a corrupt descriptor?)",
            desc.n_stages
        )));
    }
    if desc.n_stages > 0 && !readable(desc.stages) {
        return Err(abi(format!(
            "n_stages is {} but stages is {:p} (NULL or misaligned)",
            desc.n_stages, desc.stages
        )));
    }
    (0..desc.n_stages)
        .map(|index| {
            // SAFETY: `stages` holds n_stages pointers (static).
            let sp = unsafe { *desc.stages.add(index) };
            stage_vtable(sp).map_err(|reason| LoadError::Stage {
                path: path.to_owned(),
                index,
                reason,
            })
        })
        .collect()
}

/// Checks one stage vtable of a descriptor: readable, large enough, a
/// valid name, every callback present, a bounded and well-formed
/// parameter list. The reason it is refused otherwise.
fn stage_vtable(sp: *const SdStage) -> Result<&'static SdStage, String> {
    if !readable(sp) {
        return Err(format!("stage pointer {sp:p} is NULL or misaligned"));
    }
    // SAFETY: non-NULL static vtable; its size is checked next.
    let st: &'static SdStage = unsafe { &*sp };
    if (st.struct_size as usize) < STAGE_V1_0_SIZE {
        return Err(format!(
            "sd_stage is {} bytes, expected at least {STAGE_V1_0_SIZE}",
            st.struct_size
        ));
    }
    // SAFETY: static strings per the ABI.
    let Some(stage_name) = (unsafe { static_str(st.name) }) else {
        return Err("name is NULL or not UTF-8".into());
    };
    if stage_name.is_empty()
        || !stage_name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
    {
        return Err(format!(
            "stage name {stage_name:?} must be non-empty [A-Za-z0-9_.-]"
        ));
    }
    let missing = [
        ("config_new", st.config_new.is_none()),
        ("config_free", st.config_free.is_none()),
        ("state_new", st.state_new.is_none()),
        ("state_clone", st.state_clone.is_none()),
        ("state_free", st.state_free.is_none()),
        ("state_reset", st.state_reset.is_none()),
        ("accept", st.accept.is_none()),
        ("apply", st.apply.is_none()),
    ];
    if let Some((f, _)) = missing.iter().find(|(_, m)| *m) {
        return Err(format!("stage `{stage_name}`: callback `{f}` is NULL"));
    }
    check_param_specs(st).map_err(|reason| format!("stage `{stage_name}`: {reason}"))?;
    Ok(st)
}

/// Checks a stage's parameter list: at most `MAX_PARAMS`, a readable
/// array, and every spec large enough and named.
fn check_param_specs(st: &'static SdStage) -> Result<(), String> {
    if st.n_params_spec > MAX_PARAMS {
        return Err(format!(
            "n_params_spec is {}, more than {MAX_PARAMS}",
            st.n_params_spec
        ));
    }
    if st.n_params_spec > 0 && !readable(st.params_spec) {
        return Err(format!(
            "n_params_spec is {} but params_spec is {:p} (NULL or misaligned)",
            st.n_params_spec, st.params_spec
        ));
    }
    let specs: &[SdParamSpec] = if st.n_params_spec == 0 {
        &[]
    } else {
        // SAFETY: non-NULL, aligned array of n_params_spec (bounded)
        // static specs per the ABI.
        unsafe { std::slice::from_raw_parts(st.params_spec, st.n_params_spec) }
    };
    if let Some((i, s)) = specs
        .iter()
        .enumerate()
        .find(|(_, s)| (s.struct_size as usize) < size_of::<SdParamSpec>() || s.name.is_null())
    {
        return Err(format!(
            "parameter #{i} is malformed (struct_size {}, name {:p})",
            s.struct_size, s.name
        ));
    }
    Ok(())
}
