//! Trampolines that turn a [`Stage`] into an `sd_stage` vtable, and the
//! `export_plugin!` macro that exports a library's descriptor. Every
//! callback runs inside `catch_unwind`: a panic becomes `SD_ERR` with the
//! panic message, and the state it happened in is poisoned.

use std::any::Any;
use std::ffi::{c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::abi::*;
use crate::stage::{HostRng, Params, Stage, Tokens, Vocab};

/// A `*const SdStage` that may live in a static.
#[repr(transparent)]
pub struct StagePtr(pub *const SdStage);
// SAFETY: points to an immutable static vtable.
unsafe impl Sync for StagePtr {}

/// Per-sequence state box: the stage's state plus a poison flag set by a panic.
struct StateCell<T> {
    poisoned: bool,
    state: T,
}

/// Writes `msg` into the host's error buffer (truncated, NUL-terminated).
///
/// # Safety
/// `err` must be NULL or point to a writable `SdError`.
pub unsafe fn write_error(err: *mut SdError, msg: &str) {
    if err.is_null() {
        return;
    }
    // SAFETY: caller guarantees err is writable.
    let buf = unsafe { &mut (*err).message };
    let mut n = msg.len().min(SD_ERROR_MESSAGE_LEN - 1);
    while !msg.is_char_boundary(n) {
        n -= 1;
    }
    for (dst, &b) in buf.iter_mut().zip(&msg.as_bytes()[..n]) {
        *dst = b as _;
    }
    buf[n] = 0;
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".to_string()
    }
}

/// Runs `f`, turning `Err` and panics into `SD_ERR` + message (an `Err`
/// made by [`crate::input_error`] into `SD_ERR_INPUT`).
fn guarded(err: *mut SdError, f: impl FnOnce() -> Result<(), String>) -> (c_int, bool) {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => (SD_OK, false),
        Ok(Err(msg)) => {
            let (input, msg) = crate::error::split_input_error(&msg);
            // SAFETY: the host hands a writable error buffer.
            unsafe { write_error(err, msg) };
            (if input { SD_ERR_INPUT } else { SD_ERR }, false)
        }
        Err(payload) => {
            // SAFETY: as above.
            unsafe { write_error(err, &panic_message(&*payload)) };
            (SD_ERR, true)
        }
    }
}

unsafe extern "C" fn config_new<S: Stage>(
    params: *const SdParam,
    n_params: usize,
    vocab: *const SdVocab,
    out_config: *mut *mut c_void,
    err: *mut SdError,
) -> c_int {
    guarded(err, || {
        let given: &[SdParam] = if params.is_null() || n_params == 0 {
            &[]
        } else {
            // SAFETY: the host passes n_params valid params for this call.
            unsafe { std::slice::from_raw_parts(params, n_params) }
        };
        // SAFETY: params valid during this call.
        let params = unsafe { Params::from_raw(given, S::PARAMS) };
        let unknown = params.unknown_names();
        if !unknown.is_empty() {
            return Err(format!("unknown parameter(s): {}", unknown.join(", ")));
        }
        // SAFETY: the host's vocabulary outlives the config.
        let vocab = (!vocab.is_null()).then(|| unsafe { Vocab::from_raw(&*vocab) });
        if S::FLAGS & SD_STAGE_NEEDS_VOCAB != 0 && vocab.is_none() {
            return Err(format!(
                "{}: needs a vocabulary (the model's tokens), and no model is loaded",
                S::NAME.to_string_lossy()
            ));
        }
        let stage = S::new(&params, vocab.as_ref())?;
        // SAFETY: out_config is a valid out-pointer.
        unsafe { *out_config = Box::into_raw(Box::new(stage)).cast() };
        Ok(())
    })
    .0
}

unsafe extern "C" fn config_free<S: Stage>(config: *mut c_void) {
    if config.is_null() {
        return;
    }
    let _ = catch_unwind(|| {
        // SAFETY: created by config_new::<S> with Box::into_raw.
        drop(unsafe { Box::from_raw(config.cast::<S>()) });
    });
}

unsafe extern "C" fn state_new<S: Stage>(
    config: *const c_void,
    out_state: *mut *mut c_void,
    err: *mut SdError,
) -> c_int {
    guarded(err, || {
        // SAFETY: config comes from config_new::<S>.
        let stage = unsafe { &*config.cast::<S>() };
        let cell = StateCell {
            poisoned: false,
            state: stage.new_state(),
        };
        // SAFETY: out_state is a valid out-pointer.
        unsafe { *out_state = Box::into_raw(Box::new(cell)).cast() };
        Ok(())
    })
    .0
}

unsafe extern "C" fn state_clone<S: Stage>(
    _config: *const c_void,
    state: *const c_void,
    out_state: *mut *mut c_void,
    err: *mut SdError,
) -> c_int {
    guarded(err, || {
        // SAFETY: state comes from state_new::<S>.
        let cell = unsafe { &*state.cast::<StateCell<S::State>>() };
        if cell.poisoned {
            return Err("state is poisoned by an earlier panic".into());
        }
        let copy = StateCell {
            poisoned: false,
            state: cell.state.clone(),
        };
        // SAFETY: out_state is a valid out-pointer.
        unsafe { *out_state = Box::into_raw(Box::new(copy)).cast() };
        Ok(())
    })
    .0
}

unsafe extern "C" fn state_free<S: Stage>(_config: *const c_void, state: *mut c_void) {
    if state.is_null() {
        return;
    }
    let _ = catch_unwind(|| {
        // SAFETY: created by state_new/state_clone::<S> with Box::into_raw.
        drop(unsafe { Box::from_raw(state.cast::<StateCell<S::State>>()) });
    });
}

/// Runs `f` on a live (not poisoned) state; a panic poisons it.
fn with_state<S: Stage>(
    config: *const c_void,
    state: *mut c_void,
    err: *mut SdError,
    f: impl FnOnce(&S, &mut S::State) -> Result<(), String>,
) -> c_int {
    // SAFETY: config/state come from this stage's config_new/state_new, and
    // the host never uses one state from two threads at once.
    let (stage, cell) = unsafe {
        (
            &*config.cast::<S>(),
            &mut *state.cast::<StateCell<S::State>>(),
        )
    };
    if cell.poisoned {
        // SAFETY: writable error buffer from the host.
        unsafe { write_error(err, "state is poisoned by an earlier panic") };
        return SD_ERR;
    }
    let (rc, panicked) = guarded(err, || f(stage, &mut cell.state));
    if panicked {
        cell.poisoned = true;
    }
    rc
}

unsafe extern "C" fn state_reset<S: Stage>(
    config: *const c_void,
    state: *mut c_void,
    err: *mut SdError,
) -> c_int {
    // SAFETY: as in with_state; reset clears the poison too.
    let cell = unsafe { &mut *state.cast::<StateCell<S::State>>() };
    cell.poisoned = false;
    with_state::<S>(config, state, err, |stage, st| {
        *st = stage.new_state();
        Ok(())
    })
}

unsafe extern "C" fn accept<S: Stage>(
    config: *const c_void,
    state: *mut c_void,
    token: u32,
    err: *mut SdError,
) -> c_int {
    with_state::<S>(config, state, err, |stage, st| stage.try_accept(st, token))
}

unsafe extern "C" fn apply<S: Stage>(
    config: *const c_void,
    state: *mut c_void,
    tokens: *mut SdTokens,
    rng: *mut SdRng,
    err: *mut SdError,
) -> c_int {
    with_state::<S>(config, state, err, |stage, st| {
        // SAFETY: the host hands valid, exclusively borrowed buffers.
        let mut tokens = unsafe { Tokens::from_raw(&mut *tokens) };
        // SAFETY: the host's RNG is valid during this call.
        let mut rng = unsafe { HostRng::from_raw(&mut *rng) };
        stage.apply(st, &mut tokens, &mut rng)
    })
}

/// The vtable of a Rust stage, as an associated constant so the export macro
/// can take its address in a static.
pub trait StageVtable {
    const VTABLE: SdStage;
}

impl<S: Stage> StageVtable for S {
    const VTABLE: SdStage = SdStage {
        struct_size: size_of::<SdStage>() as u32,
        flags: S::FLAGS,
        name: S::NAME.as_ptr(),
        description: S::DESCRIPTION.as_ptr(),
        params_spec: S::PARAMS.as_ptr(),
        n_params_spec: S::PARAMS.len(),
        config_new: Some(config_new::<S>),
        config_free: Some(config_free::<S>),
        state_new: Some(state_new::<S>),
        state_clone: Some(state_clone::<S>),
        state_free: Some(state_free::<S>),
        state_reset: Some(state_reset::<S>),
        accept: Some(accept::<S>),
        apply: Some(apply::<S>),
    };
}

/// Exports a plugin library: `export_plugin!(name: c"core", version:
/// c"0.1.0", stages: [TopK, TopP]);` defines `samplerd_plugin_entry_v1`.
#[macro_export]
macro_rules! export_plugin {
    (name: $name:expr, version: $version:expr, stages: [$($stage:ty),+ $(,)?]) => {
        /// The plugin entry point (see `samplerd_plugin.h`).
        #[unsafe(no_mangle)]
        pub extern "C" fn samplerd_plugin_entry_v1() -> *const $crate::abi::SdPlugin {
            static STAGES: &[$crate::export::StagePtr] = &[$(
                $crate::export::StagePtr(&<$stage as $crate::export::StageVtable>::VTABLE)
            ),+];
            static PLUGIN: $crate::abi::SdPlugin = $crate::abi::SdPlugin {
                struct_size: ::core::mem::size_of::<$crate::abi::SdPlugin>() as u32,
                abi_major: $crate::abi::SD_ABI_MAJOR,
                abi_minor: $crate::abi::SD_ABI_MINOR,
                candidate_size: ::core::mem::size_of::<$crate::abi::SdCandidate>() as u32,
                tokens_size: ::core::mem::size_of::<$crate::abi::SdTokens>() as u32,
                stage_size: ::core::mem::size_of::<$crate::abi::SdStage>() as u32,
                library_name: ::core::ffi::CStr::as_ptr($name),
                library_version: ::core::ffi::CStr::as_ptr($version),
                stages: STAGES.as_ptr() as *const *const $crate::abi::SdStage,
                n_stages: STAGES.len(),
            };
            &PLUGIN
        }
    };
}
