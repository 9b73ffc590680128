//! Values the built-in stages and the host share, each written once here:
//! the bound on a windowed stage's window, and the sampling defaults that
//! both the core stages' parameter specs (what a chain that leaves a
//! parameter out gets) and the host's typed parameters
//! (`samplerd_sampling::SamplingParams::default()`, the server's
//! `[sampling]`) start from. They are llama.cpp's (`common/common.h`,
//! `common_params_sampling`) except [`REPEAT_PENALTY`].
//!
//! Integers have the host's type, fractions the ABI's `f64` (a stage's
//! declared default; the host narrows them to its `f32` fields).

/// The longest token window a windowed stage keeps: `penalties`'
/// `repeat_last_n` and `dry`'s `penalty_last_n` are at most this, and `-1`
/// (the whole history; llama.cpp: the context size) keeps this many, so
/// per-sequence memory and the O(window) work of a step stay bounded.
/// Also the server's default cap on a request's `previous_tokens`
/// (`limits.max_window_tokens`): the built-in stages look at no more.
pub const MAX_PENALTY_WINDOW: usize = 65_536;

/// `temperature`'s `t`.
pub const TEMPERATURE: f64 = 0.8;
/// `top_k`'s `k`.
pub const TOP_K: i32 = 40;
/// `top_p`'s `p`.
pub const TOP_P: f64 = 0.95;
/// `typical_p`'s `p` (1 = off).
pub const TYPICAL_P: f64 = 1.0;
/// `penalties`' `repeat_last_n`.
pub const REPEAT_LAST_N: i32 = 64;
/// `penalties`' `repeat_penalty`: 1.1, where llama.cpp's is 1.0 (off).
pub const REPEAT_PENALTY: f64 = 1.1;
/// `penalties`' `frequency_penalty` (0 = off).
pub const FREQUENCY_PENALTY: f64 = 0.0;
/// `penalties`' `presence_penalty` (0 = off).
pub const PRESENCE_PENALTY: f64 = 0.0;
/// `top_n_sigma`'s `n` (<= 0 = off).
pub const TOP_N_SIGMA: f64 = -1.0;
/// `xtc`'s `probability` (0 = off).
pub const XTC_PROBABILITY: f64 = 0.0;
/// `xtc`'s `threshold`.
pub const XTC_THRESHOLD: f64 = 0.1;
/// `adaptive_p`'s `target` (negative = off; llama.cpp's
/// `common_params_sampling::adaptive_target`).
pub const ADAPTIVE_TARGET: f64 = -1.0;
/// `adaptive_p`'s `decay` (llama.cpp's `adaptive_decay`).
pub const ADAPTIVE_DECAY: f64 = 0.9;
/// `dry`'s `multiplier` (0 = off).
pub const DRY_MULTIPLIER: f64 = 0.0;
/// `dry`'s `base`.
pub const DRY_BASE: f64 = 1.75;
/// `dry`'s `allowed_length`.
pub const DRY_ALLOWED_LENGTH: i32 = 2;
/// `dry`'s `penalty_last_n` (-1 = the whole history, up to
/// [`MAX_PENALTY_WINDOW`]).
pub const DRY_PENALTY_LAST_N: i32 = -1;
/// `dry`'s `sequence_breakers` (llama.cpp's `dry_sequence_breakers`).
pub const DRY_SEQUENCE_BREAKERS: &[&str] = &["\n", ":", "\"", "*"];
