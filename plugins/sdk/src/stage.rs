//! The safe side of the SDK: the `Stage` trait a Rust plugin implements and
//! the borrowed views (`Tokens`, `Params`, `Vocab`, `HostRng`) it works with.

use std::ffi::{CStr, c_char};

use crate::abi::*;

/// A sampler stage written in Rust. The export macro turns an implementation
/// into an `sd_stage` vtable with every callback guarded by `catch_unwind`.
///
/// `Self` is the immutable per-chain config (shared by threads); `State` is
/// the per-sequence state (penalty window, mirostat μ, scratch buffers).
pub trait Stage: Sized + Send + Sync + 'static {
    /// Stage name as chains refer to it, e.g. `c"top_k"`.
    const NAME: &'static CStr;
    /// One line for ListStages.
    const DESCRIPTION: &'static CStr;
    /// Parameters the stage accepts; any other name is refused by the host.
    const PARAMS: &'static [SdParamSpec];
    /// `SD_STAGE_*` bits.
    const FLAGS: u32;
    /// Per-sequence state.
    type State: Clone + Send + 'static;

    /// Validates parameters and builds the config. The error names the
    /// parameter and the value.
    fn new(params: &Params<'_>, vocab: Option<&Vocab<'_>>) -> Result<Self, String>;
    /// A fresh per-sequence state.
    fn new_state(&self) -> Self::State;
    /// The sequence emitted `token` (also used to seed a fresh state).
    fn accept(&self, _state: &mut Self::State, _token: u32) {}
    /// Like [`Stage::accept`], for a stage that can refuse a token (a
    /// grammar that does not allow it): an `Err` becomes `SD_ERR` from the
    /// `accept` callback. Defaults to `accept`, which never fails.
    fn try_accept(&self, state: &mut Self::State, token: u32) -> Result<(), String> {
        self.accept(state, token);
        Ok(())
    }
    /// Transforms the logits of one step.
    fn apply(
        &self,
        state: &mut Self::State,
        tokens: &mut Tokens<'_>,
        rng: &mut HostRng<'_>,
    ) -> Result<(), String>;
}

/// A stage that keeps no per-sequence state (`greedy`, `logit_bias`, ...):
/// implement this instead of [`Stage`] and the blanket impl below makes it
/// one, with `State = ()`, a no-op `accept` and nothing to spell out for
/// the state it does not have.
pub trait StatelessStage: Sized + Send + Sync + 'static {
    /// As [`Stage::NAME`].
    const NAME: &'static CStr;
    /// As [`Stage::DESCRIPTION`].
    const DESCRIPTION: &'static CStr;
    /// As [`Stage::PARAMS`].
    const PARAMS: &'static [SdParamSpec];
    /// As [`Stage::FLAGS`].
    const FLAGS: u32;

    /// As [`Stage::new`].
    fn new(params: &Params<'_>, vocab: Option<&Vocab<'_>>) -> Result<Self, String>;
    /// As [`Stage::apply`], without a state.
    fn apply(&self, tokens: &mut Tokens<'_>, rng: &mut HostRng<'_>) -> Result<(), String>;
}

impl<S: StatelessStage> Stage for S {
    const NAME: &'static CStr = S::NAME;
    const DESCRIPTION: &'static CStr = S::DESCRIPTION;
    const PARAMS: &'static [SdParamSpec] = S::PARAMS;
    const FLAGS: u32 = S::FLAGS;
    type State = ();

    fn new(params: &Params<'_>, vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        S::new(params, vocab)
    }

    fn new_state(&self) {}

    fn apply(
        &self,
        _: &mut (),
        tokens: &mut Tokens<'_>,
        rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        StatelessStage::apply(self, tokens, rng)
    }
}

/// Builds a parameter spec in a `const` context.
pub const fn param_spec(
    kind: u32,
    name: &'static CStr,
    description: &'static CStr,
    default_number: f64,
) -> SdParamSpec {
    SdParamSpec {
        struct_size: size_of::<SdParamSpec>() as u32,
        kind,
        name: name.as_ptr(),
        description: description.as_ptr(),
        default_number,
    }
}

/// Builds a numeric parameter spec in a `const` context.
pub const fn number_param(
    name: &'static CStr,
    description: &'static CStr,
    default: f64,
) -> SdParamSpec {
    param_spec(SD_PARAM_NUMBER, name, description, default)
}

/// # Safety
/// `p` must be NULL or a valid NUL-terminated string for `'a`.
unsafe fn cstr_or_empty<'a>(p: *const c_char) -> &'a str {
    if p.is_null() {
        return "";
    }
    // SAFETY: caller guarantees a valid C string.
    unsafe { CStr::from_ptr(p) }.to_str().unwrap_or("")
}

/// The parameters handed to `Stage::new`, with the stage's declared defaults.
pub struct Params<'a> {
    given: &'a [SdParam],
    spec: &'static [SdParamSpec],
}

impl<'a> Params<'a> {
    /// # Safety
    /// `given` must hold valid `SdParam`s whose pointers live for `'a`.
    pub unsafe fn from_raw(given: &'a [SdParam], spec: &'static [SdParamSpec]) -> Self {
        Params { given, spec }
    }

    fn find(&self, name: &str) -> Option<&'a SdParam> {
        // SAFETY: names are valid C strings per from_raw's contract.
        self.given
            .iter()
            .find(|p| unsafe { cstr_or_empty(p.name) } == name)
    }

    /// Names given that the stage does not declare (the host refuses these
    /// already; the SDK checks again for plugins used outside the host).
    pub fn unknown_names(&self) -> Vec<String> {
        self.given
            .iter()
            // SAFETY: as in `find`.
            .map(|p| unsafe { cstr_or_empty(p.name) }.to_string())
            .filter(|n| {
                !self
                    .spec
                    .iter()
                    // SAFETY: spec names are static C strings.
                    .any(|s| unsafe { cstr_or_empty(s.name) } == n)
            })
            .collect()
    }

    /// Whether the caller set this parameter explicitly.
    pub fn is_set(&self, name: &str) -> bool {
        self.find(name).is_some()
    }

    /// A numeric parameter, or its declared default.
    pub fn number(&self, name: &str) -> f64 {
        if let Some(p) = self.find(name).filter(|p| p.kind == SD_PARAM_NUMBER) {
            return p.number;
        }
        self.spec
            .iter()
            // SAFETY: spec names are static C strings.
            .find(|s| unsafe { cstr_or_empty(s.name) } == name)
            .map(|s| s.default_number)
            .unwrap_or(f64::NAN)
    }

    /// A string parameter, if given.
    pub fn string(&self, name: &str) -> Option<&'a str> {
        let p = self.find(name).filter(|p| p.kind == SD_PARAM_STRING)?;
        // SAFETY: valid for 'a per from_raw's contract.
        Some(unsafe { cstr_or_empty(p.string) })
    }

    /// A token → value map parameter, if given.
    pub fn token_map(&self, name: &str) -> Option<&'a [SdTokenValue]> {
        let p = self.find(name).filter(|p| p.kind == SD_PARAM_TOKEN_MAP)?;
        if p.map.is_null() || p.map_len == 0 {
            return Some(&[]);
        }
        // SAFETY: the host passes map_len valid entries, alive for 'a.
        Some(unsafe { std::slice::from_raw_parts(p.map, p.map_len) })
    }

    /// A list-of-strings parameter, if given.
    pub fn strings(&self, name: &str) -> Option<Vec<&'a str>> {
        let p = self.find(name).filter(|p| p.kind == SD_PARAM_STRING_LIST)?;
        if p.strings.is_null() {
            return Some(Vec::new());
        }
        // SAFETY: the host passes strings_len valid C strings, alive for 'a.
        let raw = unsafe { std::slice::from_raw_parts(p.strings, p.strings_len) };
        // SAFETY: each entry is a valid C string.
        Some(raw.iter().map(|&s| unsafe { cstr_or_empty(s) }).collect())
    }
}

/// Read-only view of the model vocabulary.
pub struct Vocab<'a> {
    raw: &'a SdVocab,
}

impl<'a> Vocab<'a> {
    /// # Safety
    /// `raw`'s arrays must hold `n_vocab` valid entries for `'a`.
    pub unsafe fn from_raw(raw: &'a SdVocab) -> Self {
        Vocab { raw }
    }

    pub fn n_vocab(&self) -> usize {
        self.raw.n_vocab as usize
    }

    /// The bytes of token `id` (empty for an id outside the vocabulary).
    pub fn token_bytes(&self, id: u32) -> &'a [u8] {
        if id >= self.raw.n_vocab {
            return &[];
        }
        // SAFETY: id < n_vocab and the arrays hold n_vocab entries.
        unsafe {
            let ptr = *self.raw.token_bytes.add(id as usize);
            let len = *self.raw.token_len.add(id as usize) as usize;
            if ptr.is_null() || len == 0 {
                return &[];
            }
            std::slice::from_raw_parts(ptr, len)
        }
    }

    /// `SD_TOKEN_*` attribute bits of token `id`.
    pub fn token_attr(&self, id: u32) -> u32 {
        if id >= self.raw.n_vocab || self.raw.token_attr.is_null() {
            return 0;
        }
        // SAFETY: id < n_vocab.
        unsafe { *self.raw.token_attr.add(id as usize) }
    }
}

/// Randomness handed in by the host for this step.
pub struct HostRng<'a> {
    raw: &'a mut SdRng,
}

impl<'a> HostRng<'a> {
    /// # Safety
    /// `raw.next_u64` must be callable with `raw.ctx` for `'a`.
    pub unsafe fn from_raw(raw: &'a mut SdRng) -> Self {
        HostRng { raw }
    }

    pub fn next_u64(&mut self) -> u64 {
        match self.raw.next_u64 {
            // SAFETY: guaranteed by from_raw's contract.
            Some(f) => unsafe { f(self.raw.ctx) },
            None => 0,
        }
    }

    /// Uniform in [0, 1) with 53 random bits, as the header specifies.
    pub fn uniform_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// The draw fixed by `(seed, step, key)` alone (ABI 1.3's
    /// `keyed_u64`), or `None` from a host that predates it.
    pub fn keyed_u64(&mut self, key: u64) -> Option<u64> {
        let end = std::mem::offset_of!(SdRng, keyed_u64) + size_of::<usize>();
        if (self.raw.struct_size as usize) < end {
            return None;
        }
        // SAFETY: struct_size says the host wrote the field; the function
        // is callable with ctx for 'a (from_raw's contract).
        self.raw.keyed_u64.map(|f| unsafe { f(self.raw.ctx, key) })
    }

    /// Whether the host offers [`HostRng::keyed_u64`].
    pub fn has_keyed(&self) -> bool {
        let end = std::mem::offset_of!(SdRng, keyed_u64) + size_of::<usize>();
        self.raw.struct_size as usize >= end && self.raw.keyed_u64.is_some()
    }
}

/// Which view of the logits is current.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ViewKind {
    Dense,
    Candidates,
}

/// The logits of one step (see `sd_tokens` in the header).
pub struct Tokens<'a> {
    raw: &'a mut SdTokens,
}

impl<'a> Tokens<'a> {
    /// # Safety
    /// `raw.dense` must hold `n_vocab` floats and `raw.cand` room for
    /// `n_vocab` candidates, exclusively borrowed for `'a`.
    pub unsafe fn from_raw(raw: &'a mut SdTokens) -> Self {
        Tokens { raw }
    }

    pub fn n_vocab(&self) -> usize {
        self.raw.n_vocab as usize
    }

    pub fn view(&self) -> ViewKind {
        if self.raw.view == SD_VIEW_DENSE {
            ViewKind::Dense
        } else {
            ViewKind::Candidates
        }
    }

    /// Number of live entries: n_vocab in the dense view, else the candidates.
    pub fn len(&self) -> usize {
        match self.view() {
            ViewKind::Dense => self.n_vocab(),
            ViewKind::Candidates => self.raw.size,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn is_sorted(&self) -> bool {
        self.raw.view == SD_VIEW_CANDIDATES && self.raw.sorted != 0
    }

    pub fn set_sorted(&mut self, sorted: bool) {
        self.raw.sorted = sorted as u32;
    }

    /// The dense logits (meaningful in the dense view).
    pub fn dense(&self) -> &[f32] {
        // SAFETY: dense holds n_vocab floats (from_raw's contract).
        unsafe { std::slice::from_raw_parts(self.raw.dense, self.n_vocab()) }
    }

    pub fn dense_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `dense`, and we hold the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.raw.dense, self.n_vocab()) }
    }

    /// The live candidates (meaningful in the candidate view).
    pub fn candidates(&self) -> &[SdCandidate] {
        // SAFETY: cand holds at least size (<= n_vocab) initialised entries.
        unsafe { std::slice::from_raw_parts(self.raw.cand, self.raw.size.min(self.n_vocab())) }
    }

    pub fn candidates_mut(&mut self) -> &mut [SdCandidate] {
        let n = self.raw.size.min(self.n_vocab());
        // SAFETY: as in `candidates`, exclusive borrow.
        unsafe { std::slice::from_raw_parts_mut(self.raw.cand, n) }
    }

    /// The dense logits and the whole candidate buffer (capacity n_vocab),
    /// for a stage converting dense → candidates. Finish with
    /// [`Tokens::set_candidates`].
    pub fn dense_and_buffer(&mut self) -> (&[f32], &mut [SdCandidate]) {
        let n = self.n_vocab();
        // SAFETY: the two buffers are distinct allocations of n entries each.
        unsafe {
            (
                std::slice::from_raw_parts(self.raw.dense, n),
                std::slice::from_raw_parts_mut(self.raw.cand, n),
            )
        }
    }

    /// Switches to (or stays in) the candidate view with `size` live entries.
    /// `size` may not exceed the current length.
    pub fn set_candidates(&mut self, size: usize, sorted: bool) {
        let size = size.min(self.len());
        self.raw.size = size;
        self.raw.view = SD_VIEW_CANDIDATES;
        self.raw.sorted = sorted as u32;
    }

    /// Keeps the first `n` candidates (candidate view).
    pub fn truncate(&mut self, n: usize) {
        if self.raw.view == SD_VIEW_CANDIDATES && n < self.raw.size {
            self.raw.size = n;
        }
    }

    /// Records the chosen token.
    pub fn select(&mut self, id: u32) {
        self.raw.selected = id as i64;
    }

    pub fn selected(&self) -> Option<u32> {
        u32::try_from(self.raw.selected).ok()
    }
}
