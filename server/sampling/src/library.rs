//! Loading one plugin library: `dlopen` with `RTLD_NOW | RTLD_LOCAL |
//! RTLD_NODELETE`, the entry symbol, and every version/layout check of the
//! descriptor before a single stage is trusted. Libraries are never
//! unloaded (unloading a Rust cdylib with thread-locals crashes at thread
//! exit), so their statics live for the process.

use std::ffi::{CStr, c_char};
use std::path::{Path, PathBuf};

use samplerd_plugin_sdk::abi::*;

use crate::error::LoadError;

/// glibc's `RTLD_NODELETE`: keep the library mapped even after dlclose.
#[cfg(target_os = "linux")]
const RTLD_NODELETE: i32 = 0x1000;
#[cfg(not(target_os = "linux"))]
const RTLD_NODELETE: i32 = 0x80;

/// Size of `sd_plugin` / `sd_stage` as of ABI 1.0: a descriptor smaller than
/// this lacks fields the host reads.
const PLUGIN_V1_0_SIZE: usize = size_of::<SdPlugin>();
const STAGE_V1_0_SIZE: usize = size_of::<SdStage>();

/// A loaded library: its descriptor and validated stage vtables.
pub struct Library {
    pub path: PathBuf,
    pub name: String,
    pub version: String,
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

/// An error and its sources as one line (libloading puts dlerror's text in
/// the source).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    msg
}

/// Loads the library at `path` and validates its descriptor.
pub fn load_library(path: &Path) -> Result<Library, LoadError> {
    // dlopen treats a name without a slash as a library to search for in the
    // system paths; a plugin is always a file, so resolve it first.
    let path = &std::fs::canonicalize(path).map_err(|e| LoadError::Open {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL | RTLD_NODELETE;
    // SAFETY: loading runs the library's initialisers. Plugins are trusted
    // native code from the configured directories (see docs/PLUGINS.md), and
    // loading happens once, from one thread, at start-up.
    let lib = unsafe { libloading::os::unix::Library::open(Some(path), flags) }.map_err(|e| {
        LoadError::Open {
            path: path.to_owned(),
            reason: error_chain(&e),
        }
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

    // SAFETY: the entry point takes no arguments and returns a pointer to a
    // static descriptor (or NULL to refuse).
    let desc = unsafe { entry() };
    let abi = |reason: String| LoadError::Abi {
        path: path.to_owned(),
        reason,
    };
    if desc.is_null() {
        return Err(abi("the entry point returned NULL".into()));
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
    let desc: &'static SdPlugin = unsafe { &*desc };
    // SAFETY: descriptor strings are static per the ABI.
    let name = unsafe { static_str(desc.library_name) }
        .ok_or_else(|| abi("library_name is NULL or not UTF-8".into()))?
        .to_string();
    // SAFETY: as above.
    let version = unsafe { static_str(desc.library_version) }
        .unwrap_or("")
        .to_string();
    if desc.n_stages > 0 && desc.stages.is_null() {
        return Err(abi("n_stages > 0 but stages is NULL".into()));
    }
    let mut stages = Vec::with_capacity(desc.n_stages);
    for index in 0..desc.n_stages {
        let bad = |reason: &str| LoadError::Stage {
            path: path.to_owned(),
            index,
            reason: reason.to_string(),
        };
        // SAFETY: `stages` holds n_stages pointers (static).
        let sp = unsafe { *desc.stages.add(index) };
        if sp.is_null() {
            return Err(bad("NULL stage pointer"));
        }
        // SAFETY: non-NULL static vtable; its size is checked next.
        let st: &'static SdStage = unsafe { &*sp };
        if (st.struct_size as usize) < STAGE_V1_0_SIZE {
            return Err(bad(&format!(
                "sd_stage is {} bytes, expected at least {STAGE_V1_0_SIZE}",
                st.struct_size
            )));
        }
        // SAFETY: static strings per the ABI.
        let Some(stage_name) = (unsafe { static_str(st.name) }) else {
            return Err(bad("name is NULL or not UTF-8"));
        };
        if stage_name.is_empty()
            || !stage_name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
        {
            return Err(bad(&format!(
                "stage name {stage_name:?} must be non-empty [A-Za-z0-9_.-]"
            )));
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
            return Err(bad(&format!(
                "stage `{stage_name}`: callback `{f}` is NULL"
            )));
        }
        if st.n_params_spec > 0 && st.params_spec.is_null() {
            return Err(bad(&format!(
                "stage `{stage_name}`: n_params_spec > 0 but params_spec is NULL"
            )));
        }
        stages.push(st);
    }
    Ok(Library {
        path: path.to_owned(),
        name,
        version,
        stages,
    })
}
