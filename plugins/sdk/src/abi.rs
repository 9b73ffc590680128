//! `#[repr(C)]` mirrors of `include/samplerd_plugin.h`: the only types that
//! cross the plugin boundary. The header is the normative definition (it
//! documents ownership, lifetime and threading of every pointer); a test
//! compiles the header and compares sizes and offsets with these.

use std::ffi::{c_char, c_int, c_void};

pub const SD_ABI_MAJOR: u32 = 1;
/// 1: [`SD_STAGE_OUTPUT_ONLY`]; 2: [`SD_STAGE_SPARSE_LOWERS_ONLY`];
/// 3: [`SdRng::keyed_u64`].
pub const SD_ABI_MINOR: u32 = 3;

pub const SD_OK: c_int = 0;
pub const SD_ERR: c_int = 1;
/// Failed because of the request's input, not the stage (the host answers
/// INVALID_ARGUMENT): see the header's "Errors".
pub const SD_ERR_INPUT: c_int = 2;

pub const SD_ERROR_MESSAGE_LEN: usize = 512;

/// The symbol every plugin exports (the major version is part of the name).
pub const SD_PLUGIN_ENTRY_SYMBOL: &[u8] = b"samplerd_plugin_entry_v1\0";

pub const SD_VIEW_DENSE: u32 = 0;
pub const SD_VIEW_CANDIDATES: u32 = 1;

pub const SD_TOKEN_NORMAL: u32 = 0;
pub const SD_TOKEN_CONTROL: u32 = 1 << 0;
pub const SD_TOKEN_EOG: u32 = 1 << 1;
pub const SD_TOKEN_BYTE: u32 = 1 << 2;
pub const SD_TOKEN_UNUSED: u32 = 1 << 3;

pub const SD_PARAM_NUMBER: u32 = 0;
pub const SD_PARAM_STRING: u32 = 1;
pub const SD_PARAM_TOKEN_MAP: u32 = 2;
pub const SD_PARAM_STRING_LIST: u32 = 3;

pub const SD_STAGE_SELECTS: u32 = 1 << 0;
pub const SD_STAGE_DENSE_OK: u32 = 1 << 1;
pub const SD_STAGE_NEEDS_VOCAB: u32 = 1 << 2;
/// `accept` sees only tokens the sequence generates, never replayed
/// history (a prompt's tail, `previous_tokens`): what a grammar needs.
/// Since ABI 1.1.
pub const SD_STAGE_OUTPUT_ONLY: u32 = 1 << 3;
/// `apply` only lowers logits or removes tokens, one token at a time: a
/// token's result depends only on its id, its own logit, the config and
/// the sequence's state (never on another token's logit) and is never above
/// its logit; removal keeps the candidates' order; nothing is drawn from
/// the RNG; the same in either view. The host may then run the stage over
/// the sent entries of a sparse row alone (see the header). Honoured from
/// plugins built for ABI 1.2 or later.
pub const SD_STAGE_SPARSE_LOWERS_ONLY: u32 = 1 << 4;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SdCandidate {
    pub id: u32,
    pub logit: f32,
}

#[repr(C)]
#[derive(Debug)]
pub struct SdTokens {
    pub struct_size: u32,
    pub n_vocab: u32,
    pub dense: *mut f32,
    pub cand: *mut SdCandidate,
    pub size: usize,
    pub view: u32,
    pub sorted: u32,
    pub selected: i64,
}

#[repr(C)]
pub struct SdRng {
    pub struct_size: u32,
    pub ctx: *mut c_void,
    pub next_u64: Option<unsafe extern "C" fn(ctx: *mut c_void) -> u64>,
    /// Since ABI 1.3: a draw fixed by `(seed, step, key)` alone (see the
    /// header). Present only when `struct_size` covers it.
    pub keyed_u64: Option<unsafe extern "C" fn(ctx: *mut c_void, key: u64) -> u64>,
}

#[repr(C)]
pub struct SdVocab {
    pub struct_size: u32,
    pub n_vocab: u32,
    pub token_bytes: *const *const u8,
    pub token_len: *const u32,
    pub token_attr: *const u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SdTokenValue {
    pub id: u32,
    pub value: f32,
}

#[repr(C)]
pub struct SdParam {
    pub struct_size: u32,
    pub kind: u32,
    pub name: *const c_char,
    pub number: f64,
    pub string: *const c_char,
    pub map: *const SdTokenValue,
    pub map_len: usize,
    pub strings: *const *const c_char,
    pub strings_len: usize,
}

#[repr(C)]
#[derive(Debug)]
pub struct SdParamSpec {
    pub struct_size: u32,
    pub kind: u32,
    pub name: *const c_char,
    pub description: *const c_char,
    pub default_number: f64,
}

// SAFETY: a param spec is immutable static data (pointers to static C strings).
unsafe impl Sync for SdParamSpec {}
// SAFETY: as for `Sync`: the pointers name static, never-freed C strings, so
// moving the spec to another thread cannot leave them dangling.
unsafe impl Send for SdParamSpec {}

#[repr(C)]
pub struct SdError {
    pub message: [c_char; SD_ERROR_MESSAGE_LEN],
}

pub type ConfigNewFn = unsafe extern "C" fn(
    params: *const SdParam,
    n_params: usize,
    vocab: *const SdVocab,
    out_config: *mut *mut c_void,
    err: *mut SdError,
) -> c_int;
pub type ConfigFreeFn = unsafe extern "C" fn(config: *mut c_void);
pub type StateNewFn = unsafe extern "C" fn(
    config: *const c_void,
    out_state: *mut *mut c_void,
    err: *mut SdError,
) -> c_int;
pub type StateCloneFn = unsafe extern "C" fn(
    config: *const c_void,
    state: *const c_void,
    out_state: *mut *mut c_void,
    err: *mut SdError,
) -> c_int;
pub type StateFreeFn = unsafe extern "C" fn(config: *const c_void, state: *mut c_void);
pub type StateResetFn =
    unsafe extern "C" fn(config: *const c_void, state: *mut c_void, err: *mut SdError) -> c_int;
pub type AcceptFn = unsafe extern "C" fn(
    config: *const c_void,
    state: *mut c_void,
    token: u32,
    err: *mut SdError,
) -> c_int;
pub type ApplyFn = unsafe extern "C" fn(
    config: *const c_void,
    state: *mut c_void,
    tokens: *mut SdTokens,
    rng: *mut SdRng,
    err: *mut SdError,
) -> c_int;

/// One stage's vtable. The callbacks are `Option`s because a C plugin may
/// leave one NULL; the host refuses such a stage at load time.
#[repr(C)]
pub struct SdStage {
    pub struct_size: u32,
    pub flags: u32,
    pub name: *const c_char,
    pub description: *const c_char,
    pub params_spec: *const SdParamSpec,
    pub n_params_spec: usize,
    pub config_new: Option<ConfigNewFn>,
    pub config_free: Option<ConfigFreeFn>,
    pub state_new: Option<StateNewFn>,
    pub state_clone: Option<StateCloneFn>,
    pub state_free: Option<StateFreeFn>,
    pub state_reset: Option<StateResetFn>,
    pub accept: Option<AcceptFn>,
    pub apply: Option<ApplyFn>,
}

// SAFETY: a stage vtable is immutable static data: C strings, a static spec
// array and function pointers.
unsafe impl Sync for SdStage {}
// SAFETY: as for `Sync`: everything the vtable points to is static and
// never written, so it may be moved to any thread.
unsafe impl Send for SdStage {}

#[repr(C)]
pub struct SdPlugin {
    pub struct_size: u32,
    pub abi_major: u32,
    pub abi_minor: u32,
    pub candidate_size: u32,
    pub tokens_size: u32,
    pub stage_size: u32,
    pub library_name: *const c_char,
    pub library_version: *const c_char,
    pub stages: *const *const SdStage,
    pub n_stages: usize,
}

// SAFETY: the descriptor is immutable static data.
unsafe impl Sync for SdPlugin {}
// SAFETY: as for `Sync`: the strings and the stage array it points to are
// static and never written, so it may be moved to any thread.
unsafe impl Send for SdPlugin {}

pub type PluginEntryFn = unsafe extern "C" fn() -> *const SdPlugin;
