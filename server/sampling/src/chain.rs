//! Chains: an ordered list of stage specs, validated once into built
//! configs (`Chain`, shared by threads), and per-sequence plugin states
//! (`Sequence`, one per stream, freed through the ABI on drop). Running a
//! chain hands each stage the token buffer and the step's RNG, then checks
//! what the stage left behind, so a misbehaving plugin fails the request
//! with its name instead of corrupting memory or the answer.
//!
//! This module holds the built chain itself; the specs are in `spec.rs`,
//! running in `sequence.rs`, building in `builder.rs`, the checks after
//! each stage in `check.rs` and the ABI marshalling in `ffi.rs`.

use std::ffi::c_void;
use std::sync::Arc;

use samplerd_plugin_sdk::abi::*;

use crate::spec::{ChainSpec, StageSpec};
use crate::stage::RegisteredStage;
use crate::vocab::Vocabulary;

/// Prometheus histogram of each stage's `apply` time in seconds, label
/// `stage` (recorded only when the server installed a metrics recorder).
pub const STAGE_DURATION_METRIC: &str = "samplerd_stage_duration_seconds";
/// Prometheus counter of plugin failures (an error code or a post-check
/// violation), label `stage`.
pub const PLUGIN_ERRORS_METRIC: &str = "samplerd_plugin_errors_total";

/// A stage's metric handles, registered once per chain build so the hot
/// path neither allocates nor looks up labels.
pub(crate) struct StageMetrics {
    pub(crate) duration: metrics::Histogram,
    pub(crate) errors: metrics::Counter,
}

impl StageMetrics {
    pub(crate) fn new(stage: &str) -> Self {
        StageMetrics {
            duration: metrics::histogram!(STAGE_DURATION_METRIC, "stage" => stage.to_string()),
            errors: metrics::counter!(PLUGIN_ERRORS_METRIC, "stage" => stage.to_string()),
        }
    }
}

/// One `config_new`'s config, freed through the ABI when its last holder
/// (a chain, or a [`BuiltStage`] kept for reuse) drops it.
pub(crate) struct OwnedConfig {
    pub(crate) stage: Arc<RegisteredStage>,
    pub(crate) ptr: *mut c_void,
    // Keeps the vocabulary alive as long as the config that points into it.
    pub(crate) _vocab: Option<Arc<Vocabulary>>,
}

// SAFETY: configs are immutable and documented as thread-safe by the ABI,
// so they may be freed on whichever thread drops the last holder.
unsafe impl Send for OwnedConfig {}
// SAFETY: as for `Send`: threads only read a config, and the ABI lets them
// call a stage with it at once (each with its own state).
unsafe impl Sync for OwnedConfig {}

impl Drop for OwnedConfig {
    fn drop(&mut self) {
        if let Some(free) = self.stage.vtable.config_free {
            crate::activity::in_plugin(self.stage.site, || {
                // SAFETY: ptr was created by this stage's config_new and
                // every Sequence using it (holding its chain, which holds
                // this config) is gone.
                unsafe { free(self.ptr) }
            });
        }
    }
}

/// A stage built on its own (`StageRegistry::build_stage`) for chains to
/// share (`StageRegistry::build_chain_with`): what the server does with a
/// `constraint` stage, whose config is a compiled grammar — built once, off
/// the sampling threads, and cached. Cheap to clone.
#[derive(Clone)]
pub struct BuiltStage {
    pub(crate) spec: StageSpec,
    pub(crate) config: Arc<OwnedConfig>,
}

impl BuiltStage {
    /// The spec it was built from.
    pub fn spec(&self) -> &StageSpec {
        &self.spec
    }

    /// Whether it was built with `vocab` (the same one, not an equal one).
    pub fn has_vocab(&self, vocab: Option<&Arc<Vocabulary>>) -> bool {
        match (&self.config._vocab, vocab) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// One built stage: the registered vtable and its immutable config.
pub(crate) struct Link {
    pub(crate) stage: Arc<RegisteredStage>,
    /// The stage's name, shared with [`crate::activity`] on every call.
    pub(crate) name: Arc<str>,
    /// `owner.ptr`, read on every call.
    pub(crate) config: *mut c_void,
    /// Frees the config when the last chain (or cache) holding it drops.
    pub(crate) _owner: Arc<OwnedConfig>,
    pub(crate) metrics: StageMetrics,
    /// Whether the deep post-checks run after this stage (see
    /// [`deep_checks`]).
    pub(crate) deep_checks: bool,
}

/// The library samplerd ships its core stages in (descriptor name, file).
pub const CORE_LIBRARY: (&str, &str) = ("core", "libsamplerd_core_stages.so");

/// Whether the deep post-checks run after a stage of this library: a whole
/// dense view scanned for NaN/+inf, duplicate candidate ids, a claimed sort
/// order verified. Every stage but the core ones: they cost a full pass
/// over what the stage left (the dense scan +5.8 µs, +54 %, for the
/// default chain at 151,936 logits, where `penalties` leaves the view
/// dense; the duplicate and order checks +47 µs for a whole-vocabulary
/// top_p), and the core stages are our own code, under property tests and
/// the chain fuzzer — which runs with debug assertions, where the deep
/// checks cover them too, so a core stage that lies fails the fuzzer. The
/// cheap checks (view, size, candidate ids in range and logits finite or
/// −inf, the selection, the host's buffer pointers) run after every
/// stage, core ones included.
pub(crate) fn deep_checks(info: &crate::stage::StageInfo) -> bool {
    let file = info.path.file_name().and_then(|f| f.to_str());
    let core = info.library == CORE_LIBRARY.0 && file == Some(CORE_LIBRARY.1);
    cfg!(debug_assertions) || !core
}

impl Link {
    pub(crate) fn vt(&self) -> &'static SdStage {
        self.stage.vtable
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Records the call about to be made for a watchdog (`activity`).
    pub(crate) fn enter(&self) -> &'static SdStage {
        crate::activity::entering(&self.name);
        self.stage.vtable
    }
}

pub(crate) struct ChainInner {
    pub(crate) links: Vec<Link>,
    pub(crate) spec: ChainSpec,
}

// SAFETY: the links' configs are immutable and documented as thread-safe by
// the ABI (see `OwnedConfig`), each freed by its owner.
unsafe impl Send for ChainInner {}
// SAFETY: as for `Send`: threads only read a config, and the ABI lets them
// call a stage with it at once (each with its own state).
unsafe impl Sync for ChainInner {}

/// A validated, built chain. Cheap to clone; shared by threads.
#[derive(Clone)]
pub struct Chain {
    pub(crate) inner: Arc<ChainInner>,
}

impl Chain {
    pub(crate) fn links(&self) -> &[Link] {
        &self.inner.links
    }

    /// The spec this chain was built from.
    pub fn spec(&self) -> &ChainSpec {
        &self.inner.spec
    }

    /// Stage names in order.
    pub fn stage_names(&self) -> Vec<&str> {
        self.inner.links.iter().map(Link::name).collect()
    }

    /// "penalties(repeat_penalty=1.1) → top_k(k=40) → … → dist".
    pub fn describe(&self) -> String {
        self.inner.spec.to_string()
    }
}
