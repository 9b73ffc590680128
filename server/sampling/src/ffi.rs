//! Marshalling across the plugin ABI: a spec's parameters as `sd_param`s
//! for `config_new`, and the one way the host calls a vtable function that
//! reports failure through an `sd_error` buffer.

use std::collections::BTreeMap;
use std::ffi::{CString, c_char, c_int};

use samplerd_plugin_sdk::abi::*;

use crate::chain::Link;
use crate::error::{ChainError, SampleError};
use crate::spec::ParamValue;

fn new_error() -> SdError {
    SdError {
        message: [0; SD_ERROR_MESSAGE_LEN],
    }
}

/// The plugin's message: up to the first NUL, or the whole buffer when it
/// wrote no NUL (the read stays inside the host's array).
fn error_text(err: &SdError) -> String {
    let bytes: Vec<u8> = err
        .message
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    let s = String::from_utf8_lossy(&bytes).into_owned();
    if s.is_empty() {
        "failed without a message".into()
    } else {
        s
    }
}

/// A plugin call's failure: the message the plugin left, and whether it
/// said the request's input caused it (`SD_ERR_INPUT`).
#[derive(Debug, PartialEq)]
pub(crate) struct Failed {
    pub message: String,
    pub input: bool,
}

/// Runs `f` with a fresh, zeroed error buffer; a return code other than
/// `SD_OK` becomes the message the plugin left there.
#[inline(always)]
pub(crate) fn call_raw(f: impl FnOnce(&mut SdError) -> c_int) -> Result<(), Failed> {
    let mut err = new_error();
    match f(&mut err) {
        SD_OK => Ok(()),
        rc => Err(Failed {
            message: error_text(&err),
            input: rc == SD_ERR_INPUT,
        }),
    }
}

/// [`call_raw`] for a built stage, recorded as this thread's plugin call
/// for a crash report: a failure counts in the stage's error metric and
/// names the stage.
#[inline(always)]
pub(crate) fn call(link: &Link, f: impl FnOnce(&mut SdError) -> c_int) -> Result<(), SampleError> {
    crate::activity::in_plugin(link.stage.site, || call_raw(f)).map_err(|f| failed(link, f))
}

// Out of line: the success path of every plugin call stays a compare and a
// branch.
#[cold]
#[inline(never)]
fn failed(link: &Link, failed: Failed) -> SampleError {
    link.metrics.errors.increment(1);
    let stage = link.name().to_string();
    let message = failed.message;
    if failed.input {
        SampleError::Refused { stage, message }
    } else {
        SampleError::Plugin { stage, message }
    }
}

/// The C strings and arrays behind one config_new call's `sd_param`s.
pub(crate) struct RawParams {
    _names: Vec<CString>,
    _strings: Vec<CString>,
    _lists: Vec<(Vec<CString>, Vec<*const c_char>)>,
    _maps: Vec<Vec<SdTokenValue>>,
    params: Vec<SdParam>,
}

impl RawParams {
    /// The `sd_param` array, valid while `self` lives.
    pub(crate) fn as_slice(&self) -> &[SdParam] {
        &self.params
    }
}

fn cstring(stage: &str, param: &str, s: &str) -> Result<CString, ChainError> {
    CString::new(s).map_err(|_| ChainError::Invalid {
        stage: stage.to_string(),
        message: format!("parameter `{param}` contains a NUL byte"),
    })
}

/// `params` as the ABI's `sd_param`s; a NUL byte in a name or string is an
/// error naming the stage and parameter.
pub(crate) fn raw_params(
    stage: &str,
    params: &BTreeMap<String, ParamValue>,
) -> Result<RawParams, ChainError> {
    let mut r = RawParams {
        _names: Vec::new(),
        _strings: Vec::new(),
        _lists: Vec::new(),
        _maps: Vec::new(),
        params: Vec::new(),
    };
    for (name, value) in params {
        let cname = cstring(stage, name, name)?;
        let mut p = SdParam {
            struct_size: size_of::<SdParam>() as u32,
            kind: SD_PARAM_NUMBER,
            name: cname.as_ptr(),
            number: 0.0,
            string: std::ptr::null(),
            map: std::ptr::null(),
            map_len: 0,
            strings: std::ptr::null(),
            strings_len: 0,
        };
        r._names.push(cname);
        match value {
            ParamValue::Number(n) => p.number = *n,
            ParamValue::String(s) => {
                let c = cstring(stage, name, s)?;
                p.kind = SD_PARAM_STRING;
                p.string = c.as_ptr();
                r._strings.push(c);
            }
            ParamValue::TokenMap(m) => {
                let v: Vec<SdTokenValue> = m
                    .iter()
                    .map(|&(id, value)| SdTokenValue { id, value })
                    .collect();
                p.kind = SD_PARAM_TOKEN_MAP;
                p.map = v.as_ptr();
                p.map_len = v.len();
                r._maps.push(v);
            }
            ParamValue::StringList(l) => {
                let cs = l
                    .iter()
                    .map(|s| cstring(stage, name, s))
                    .collect::<Result<Vec<_>, _>>()?;
                let ptrs: Vec<*const c_char> = cs.iter().map(|c| c.as_ptr()).collect();
                p.kind = SD_PARAM_STRING_LIST;
                p.strings = ptrs.as_ptr();
                p.strings_len = ptrs.len();
                r._lists.push((cs, ptrs));
            }
        }
        r.params.push(p);
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_text_stops_at_the_nul_and_names_a_silent_failure() {
        let mut err = new_error();
        assert_eq!(error_text(&err), "failed without a message");
        for (d, s) in err.message.iter_mut().zip(b"k must be >= 0\0junk") {
            *d = *s as c_char;
        }
        assert_eq!(error_text(&err), "k must be >= 0");
        // No NUL anywhere: the whole buffer, never past it.
        err.message.fill(b'x' as c_char);
        assert_eq!(error_text(&err).len(), SD_ERROR_MESSAGE_LEN);
    }

    #[test]
    fn call_raw_passes_the_message_only_on_failure() {
        assert_eq!(call_raw(|_| SD_OK), Ok(()));
        for (rc, input) in [(SD_ERR, false), (SD_ERR_INPUT, true), (7, false)] {
            let r = call_raw(|err| {
                err.message[0] = b'n' as c_char;
                err.message[1] = b'o' as c_char;
                rc
            });
            let message = "no".to_string();
            assert_eq!(r, Err(Failed { message, input }), "rc {rc}");
        }
    }
}
