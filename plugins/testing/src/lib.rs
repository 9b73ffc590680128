//! Deliberately misbehaving stages for the host's loader and fault tests:
//! a stage that panics, one that selects a token outside the vocabulary and
//! one that writes NaN. Never shipped.

#![forbid(unsafe_code)]

use std::ffi::CStr;

use samplerd_plugin_sdk::prelude::*;

/// What tells the fixture stages apart. None keeps per-sequence state or
/// reports an error, so the rest of a [`Stage`] is the same for all of them
/// and written once, in [`Fixture`].
pub trait Misbehaviour: Default + Send + Sync + 'static {
    const NAME: &'static CStr;
    const DESCRIPTION: &'static CStr;
    const PARAMS: &'static [SdParamSpec] = &[];
    const FLAGS: u32 = 0;

    /// The fixture for `params` (those without parameters: the default).
    fn new(_params: &Params<'_>) -> Self {
        Self::default()
    }

    fn misbehave(&self, tokens: &mut Tokens<'_>);
}

/// A [`Misbehaviour`] as a stage (a stateless one).
pub struct Fixture<M>(M);

impl<M: Misbehaviour> StatelessStage for Fixture<M> {
    const NAME: &'static CStr = M::NAME;
    const DESCRIPTION: &'static CStr = M::DESCRIPTION;
    const PARAMS: &'static [SdParamSpec] = M::PARAMS;
    const FLAGS: u32 = M::FLAGS;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        Ok(Fixture(M::new(params)))
    }

    fn apply(&self, tokens: &mut Tokens<'_>, _: &mut HostRng<'_>) -> Result<(), String> {
        self.0.misbehave(tokens);
        Ok(())
    }
}

/// Panics inside `apply` when the first candidate's logit is above
/// `threshold` (default: always).
pub struct PanicOnApply {
    threshold: f32,
}

impl Default for PanicOnApply {
    fn default() -> Self {
        Self {
            threshold: f32::NEG_INFINITY,
        }
    }
}

impl Misbehaviour for PanicOnApply {
    const NAME: &'static CStr = c"test_panic";
    const DESCRIPTION: &'static CStr = c"panics in apply (test fixture)";
    const PARAMS: &'static [SdParamSpec] = &[number_param(
        c"threshold",
        c"panic when the largest logit exceeds this",
        f64::NEG_INFINITY,
    )];
    const FLAGS: u32 = SD_STAGE_DENSE_OK;

    fn new(params: &Params<'_>) -> Self {
        Self {
            threshold: params.number("threshold") as f32,
        }
    }

    fn misbehave(&self, tokens: &mut Tokens<'_>) {
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
    }
}

/// Selects a token id outside the vocabulary (what a buggy C plugin could
/// do; the SDK's safe `Tokens` API cannot grow the candidate count).
#[derive(Default)]
pub struct SelectOutOfRange;

impl Misbehaviour for SelectOutOfRange {
    const NAME: &'static CStr = c"test_bad_select";
    const DESCRIPTION: &'static CStr = c"selects a token outside the vocabulary (test fixture)";

    fn misbehave(&self, tokens: &mut Tokens<'_>) {
        tokens.select(tokens.n_vocab() as u32 + 7);
    }
}

/// Writes NaN into the first candidate.
#[derive(Default)]
pub struct WriteNan;

impl Misbehaviour for WriteNan {
    const NAME: &'static CStr = c"test_nan";
    const DESCRIPTION: &'static CStr = c"writes NaN into a candidate (test fixture)";

    fn misbehave(&self, tokens: &mut Tokens<'_>) {
        if let Some(c) = tokens.candidates_mut().first_mut() {
            c.logit = f32::NAN;
        }
    }
}

samplerd_plugin_sdk::export_plugin!(
    name: c"testing",
    version: c"0.1.0",
    stages: [
        Fixture<PanicOnApply>,
        Fixture<SelectOutOfRange>,
        Fixture<WriteNan>,
    ]
);
