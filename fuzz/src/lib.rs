//! Shared set-up for the fuzz targets: the core plugin library (loaded
//! through the real C ABI, as the server does), the constraint plugin
//! library, and the server's shared state built from the default
//! configuration.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use samplerd::app::config::Config;
use samplerd::service::state::AppState;
use samplerd_sampling::StageRegistry;

/// The core stages' cdylib: `SAMPLERD_PLUGIN` when set (scripts/ci/fuzz.sh
/// sets it), else the main workspace's release build.
pub fn core_plugin() -> PathBuf {
    match std::env::var_os("SAMPLERD_PLUGIN") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../target/release/libsamplerd_core_stages.so"),
    }
}

/// The registry with the core stages, loaded once per fuzzing process.
pub fn registry() -> &'static StageRegistry {
    static REG: OnceLock<StageRegistry> = OnceLock::new();
    REG.get_or_init(|| {
        let path = core_plugin();
        StageRegistry::load(&[], std::slice::from_ref(&path)).unwrap_or_else(|e| {
            panic!(
                "cannot load the core plugin {} (build it with `cargo build --release -p samplerd-core-stages` or set SAMPLERD_PLUGIN): {e}",
                path.display()
            )
        })
    })
}

/// The server's shared state with the default configuration and the core
/// plugin (no model), built once per fuzzing process.
pub fn app_state() -> &'static Arc<AppState> {
    static STATE: OnceLock<Arc<AppState>> = OnceLock::new();
    STATE.get_or_init(|| {
        let mut config = Config::default();
        config.plugins.files = vec![core_plugin()];
        let registry = samplerd::app::server::load_registry(&config).expect("core plugin loads");
        samplerd::app::server::build_state(&config, registry, None).expect("default chain builds")
    })
}

/// The constraint stage's cdylib: `SAMPLERD_CONSTRAINT_PLUGIN` when set
/// (scripts/ci/fuzz.sh sets it), else the main workspace's release build.
pub fn constraint_plugin() -> PathBuf {
    match std::env::var_os("SAMPLERD_CONSTRAINT_PLUGIN") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../target/release/libsamplerd_constraint_stage.so"),
    }
}

/// [`app_state`] with the constraint plugin loaded too (the default
/// configuration's constraint limits, compile pool and cache).
pub fn app_state_with_constraint() -> &'static Arc<AppState> {
    static STATE: OnceLock<Arc<AppState>> = OnceLock::new();
    STATE.get_or_init(|| {
        let mut config = Config::default();
        config.plugins.files = vec![core_plugin(), constraint_plugin()];
        let registry = samplerd::app::server::load_registry(&config).unwrap_or_else(|e| {
            panic!(
                "cannot load the plugins (build them with `cargo build --release -p samplerd-core-stages -p samplerd-constraint-stage` or set SAMPLERD_PLUGIN and SAMPLERD_CONSTRAINT_PLUGIN): {e}"
            )
        });
        samplerd::app::server::build_state(&config, registry, None).expect("default chain builds")
    })
}
