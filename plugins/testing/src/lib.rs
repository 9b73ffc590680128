//! Deliberately misbehaving stages for the host's loader and fault tests:
//! a stage that panics, one that selects a token outside the vocabulary and
//! one that writes NaN. Never shipped.

#![forbid(unsafe_code)]

use samplerd_plugin_sdk::prelude::*;

/// Panics inside `apply` when the first candidate's logit is above
/// `threshold` (default: always).
pub struct PanicOnApply {
    threshold: f32,
}

impl Stage for PanicOnApply {
    const NAME: &'static std::ffi::CStr = c"test_panic";
    const DESCRIPTION: &'static std::ffi::CStr = c"panics in apply (test fixture)";
    const PARAMS: &'static [SdParamSpec] = &[number_param(
        c"threshold",
        c"panic when the largest logit exceeds this",
        f64::NEG_INFINITY,
    )];
    const FLAGS: u32 = SD_STAGE_DENSE_OK;
    type State = ();

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        Ok(Self {
            threshold: params.number("threshold") as f32,
        })
    }

    fn new_state(&self) {}

    fn apply(
        &self,
        _: &mut (),
        tokens: &mut Tokens<'_>,
        _: &mut HostRng<'_>,
    ) -> Result<(), String> {
        let max = match tokens.view() {
            ViewKind::Dense => tokens
                .dense()
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max),
            ViewKind::Candidates => tokens
                .candidates()
                .iter()
                .map(|c| c.logit)
                .fold(f32::NEG_INFINITY, f32::max),
        };
        if max > self.threshold {
            panic!("test_panic: logit {max} above threshold {}", self.threshold);
        }
        Ok(())
    }
}

/// Selects a token id outside the vocabulary (what a buggy C plugin could
/// do; the SDK's safe `Tokens` API cannot grow the candidate count).
pub struct SelectOutOfRange;

impl Stage for SelectOutOfRange {
    const NAME: &'static std::ffi::CStr = c"test_bad_select";
    const DESCRIPTION: &'static std::ffi::CStr =
        c"selects a token outside the vocabulary (test fixture)";
    const PARAMS: &'static [SdParamSpec] = &[];
    const FLAGS: u32 = 0;
    type State = ();

    fn new(_: &Params<'_>, _: Option<&Vocab<'_>>) -> Result<Self, String> {
        Ok(Self)
    }

    fn new_state(&self) {}

    fn apply(
        &self,
        _: &mut (),
        tokens: &mut Tokens<'_>,
        _: &mut HostRng<'_>,
    ) -> Result<(), String> {
        tokens.select(tokens.n_vocab() as u32 + 7);
        Ok(())
    }
}

/// Writes NaN into the first candidate.
pub struct WriteNan;

impl Stage for WriteNan {
    const NAME: &'static std::ffi::CStr = c"test_nan";
    const DESCRIPTION: &'static std::ffi::CStr = c"writes NaN into a candidate (test fixture)";
    const PARAMS: &'static [SdParamSpec] = &[];
    const FLAGS: u32 = 0;
    type State = ();

    fn new(_: &Params<'_>, _: Option<&Vocab<'_>>) -> Result<Self, String> {
        Ok(Self)
    }

    fn new_state(&self) {}

    fn apply(
        &self,
        _: &mut (),
        tokens: &mut Tokens<'_>,
        _: &mut HostRng<'_>,
    ) -> Result<(), String> {
        if let Some(c) = tokens.candidates_mut().first_mut() {
            c.logit = f32::NAN;
        }
        Ok(())
    }
}

samplerd_plugin_sdk::export_plugin!(
    name: c"testing",
    version: c"0.1.0",
    stages: [PanicOnApply, SelectOutOfRange, WriteNan]
);
