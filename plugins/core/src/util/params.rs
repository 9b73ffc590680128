//! Parameter validation, with messages that name the stage, the
//! parameter and the value.

#![forbid(unsafe_code)]

use samplerd_plugin_sdk::prelude::*;

/// A numeric parameter (or its default); NaN is an error.
pub fn number(params: &Params<'_>, stage: &str, name: &str) -> Result<f64, String> {
    let v = params.number(name);
    if v.is_nan() {
        return Err(format!("{stage}: {name} must be a number, got NaN"));
    }
    Ok(v)
}

/// `v` as the client most likely wrote it: a whole number as an integer
/// (an i32 field such as `top_k = -2147483648` is exactly an f32 too, and
/// would print as -2147483600); the host widens a request's 32-bit typed
/// fields (`top_p = 1.1`) to the ABI's f64, where they would print as
/// 1.100000023841858, so a value that is exactly an f32 prints as one.
fn shown(v: f64) -> String {
    // Every integer up to 2^53 is exact in an f64, and so in an i64.
    const EXACT: f64 = (1u64 << 53) as f64;
    let narrow = v as f32;
    if v.fract() == 0.0 && v.abs() <= EXACT {
        (v as i64).to_string()
    } else if v.is_finite() && v.abs() > EXACT {
        // `{}` would write all 300 digits of 1e300.
        format!("{v:e}")
    } else if f64::from(narrow) == v {
        narrow.to_string()
    } else {
        v.to_string()
    }
}

/// A numeric parameter that must satisfy `ok`; `what` describes the range.
pub fn number_in(
    params: &Params<'_>,
    stage: &str,
    name: &str,
    what: &str,
    ok: impl Fn(f64) -> bool,
) -> Result<f64, String> {
    let v = number(params, stage, name)?;
    if !ok(v) {
        return Err(format!("{stage}: {name} must be {what}, got {}", shown(v)));
    }
    Ok(v)
}

/// A numeric parameter that must be finite and >= 0 (a rate, a penalty,
/// a temperature).
pub fn non_negative(params: &Params<'_>, stage: &str, name: &str) -> Result<f64, String> {
    number_in(params, stage, name, "finite and >= 0", |v| {
        v.is_finite() && v >= 0.0
    })
}

/// A numeric parameter in [0, 1] (a probability).
pub fn unit_interval(params: &Params<'_>, stage: &str, name: &str) -> Result<f64, String> {
    number_in(params, stage, name, "in [0, 1]", |v| {
        (0.0..=1.0).contains(&v)
    })
}

/// An integer parameter in `[lo, hi]`.
pub fn integer(
    params: &Params<'_>,
    stage: &str,
    name: &str,
    lo: i64,
    hi: i64,
) -> Result<i64, String> {
    let v = number(params, stage, name)?;
    if v.fract() != 0.0 || !v.is_finite() {
        return Err(format!(
            "{stage}: {name} must be an integer, got {}",
            shown(v)
        ));
    }
    if v < lo as f64 || v > hi as f64 {
        return Err(format!(
            "{stage}: {name} must be in [{lo}, {hi}], got {}",
            shown(v)
        ));
    }
    Ok(v as i64)
}

/// The `min_keep` parameter shared by the truncating stages.
pub fn min_keep(params: &Params<'_>, stage: &str) -> Result<usize, String> {
    Ok(integer(params, stage, "min_keep", 0, u32::MAX as i64)? as usize)
}
