//! Chains: an ordered list of stage specs, validated once into built
//! configs (`Chain`, shared by threads), and per-sequence plugin states
//! (`Sequence`, one per stream, freed through the ABI on drop). Running a
//! chain hands each stage the token buffer and the step's RNG, then checks
//! what the stage left behind, so a misbehaving plugin fails the request
//! with its name instead of corrupting memory or the answer.

use std::collections::BTreeMap;
use std::ffi::{CString, c_char, c_void};
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use samplerd_plugin_sdk::abi::*;
use serde::{Deserialize, Serialize};

use crate::buffer::TokenBuffer;
use crate::error::{ChainError, SampleError};
use crate::registry::{ParamKind, RegisteredStage, StageRegistry};
use crate::rng::StepRng;
use crate::vocab::Vocabulary;

/// A parameter value in a chain spec.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ParamValue {
    Number(f64),
    String(String),
    TokenMap(Vec<(u32, f32)>),
    StringList(Vec<String>),
}

impl ParamValue {
    fn kind(&self) -> ParamKind {
        match self {
            Self::Number(_) => ParamKind::Number,
            Self::String(_) => ParamKind::String,
            Self::TokenMap(_) => ParamKind::TokenMap,
            Self::StringList(_) => ParamKind::StringList,
        }
    }
}

impl fmt::Display for ParamValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // Request values are f32; print them as the f32 they were.
            Self::Number(n) if (*n as f32) as f64 == *n => write!(f, "{}", *n as f32),
            Self::Number(n) => write!(f, "{n}"),
            Self::String(s) => write!(f, "{s:?}"),
            Self::TokenMap(m) => write!(f, "{{{} entries}}", m.len()),
            Self::StringList(l) => write!(f, "{l:?}"),
        }
    }
}

/// One stage of a chain spec: a registered stage name and its parameters.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StageSpec {
    pub name: String,
    #[serde(default)]
    pub params: BTreeMap<String, ParamValue>,
}

impl StageSpec {
    pub fn new(name: &str) -> Self {
        StageSpec {
            name: name.to_string(),
            params: BTreeMap::new(),
        }
    }

    pub fn number(mut self, param: &str, value: f64) -> Self {
        self.params
            .insert(param.to_string(), ParamValue::Number(value));
        self
    }

    pub fn with(mut self, param: &str, value: ParamValue) -> Self {
        self.params.insert(param.to_string(), value);
        self
    }
}

/// An ordered list of stages; the last one must select a token.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChainSpec {
    pub stages: Vec<StageSpec>,
}

impl fmt::Display for ChainSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.stages.iter().enumerate() {
            if i > 0 {
                f.write_str(" → ")?;
            }
            f.write_str(&s.name)?;
            if !s.params.is_empty() {
                let ps: Vec<String> = s.params.iter().map(|(k, v)| format!("{k}={v}")).collect();
                write!(f, "({})", ps.join(", "))?;
            }
        }
        Ok(())
    }
}

/// Prometheus histogram of each stage's `apply` time in seconds, label
/// `stage` (recorded only when the server installed a metrics recorder).
pub const STAGE_DURATION_METRIC: &str = "samplerd_stage_duration_seconds";
/// Prometheus counter of plugin failures (an error code or a post-check
/// violation), label `stage`.
pub const PLUGIN_ERRORS_METRIC: &str = "samplerd_plugin_errors_total";

/// A stage's metric handles, registered once per chain build so the hot
/// path neither allocates nor looks up labels.
struct StageMetrics {
    duration: metrics::Histogram,
    errors: metrics::Counter,
}

impl StageMetrics {
    fn new(stage: &str) -> Self {
        StageMetrics {
            duration: metrics::histogram!(STAGE_DURATION_METRIC, "stage" => stage.to_string()),
            errors: metrics::counter!(PLUGIN_ERRORS_METRIC, "stage" => stage.to_string()),
        }
    }
}

/// One built stage: the registered vtable and its immutable config.
struct Link {
    stage: Arc<RegisteredStage>,
    /// The stage's name, shared with [`crate::activity`] on every call.
    name: Arc<str>,
    config: *mut c_void,
    metrics: StageMetrics,
}

impl Link {
    fn vt(&self) -> &'static SdStage {
        self.stage.vtable
    }

    fn name(&self) -> &str {
        &self.name
    }

    /// Records the call about to be made for a watchdog (`activity`).
    fn enter(&self) -> &'static SdStage {
        crate::activity::entering(&self.name);
        self.stage.vtable
    }
}

struct ChainInner {
    links: Vec<Link>,
    spec: ChainSpec,
    // Keeps the vocabulary alive as long as the configs that point into it.
    _vocab: Option<Arc<Vocabulary>>,
}

// SAFETY: configs are immutable and documented as thread-safe by the ABI.
unsafe impl Send for ChainInner {}
unsafe impl Sync for ChainInner {}

impl Drop for ChainInner {
    fn drop(&mut self) {
        for link in self.links.drain(..).rev() {
            if let Some(free) = link.vt().config_free {
                // SAFETY: config was created by this stage's config_new and
                // every Sequence using it (holding an Arc) is gone.
                unsafe { free(link.config) };
            }
        }
    }
}

/// A validated, built chain. Cheap to clone; shared by threads.
#[derive(Clone)]
pub struct Chain {
    inner: Arc<ChainInner>,
}

fn new_error() -> SdError {
    SdError {
        message: [0; SD_ERROR_MESSAGE_LEN],
    }
}

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

/// The C strings and arrays behind one config_new call's `sd_param`s.
struct RawParams {
    _names: Vec<CString>,
    _strings: Vec<CString>,
    _lists: Vec<(Vec<CString>, Vec<*const c_char>)>,
    _maps: Vec<Vec<SdTokenValue>>,
    params: Vec<SdParam>,
}

fn cstring(stage: &str, param: &str, s: &str) -> Result<CString, ChainError> {
    CString::new(s).map_err(|_| ChainError::Invalid {
        stage: stage.to_string(),
        message: format!("parameter `{param}` contains a NUL byte"),
    })
}

fn raw_params(stage: &str, params: &BTreeMap<String, ParamValue>) -> Result<RawParams, ChainError> {
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

impl Chain {
    pub(crate) fn build(
        registry: &StageRegistry,
        spec: &ChainSpec,
        vocab: Option<Arc<Vocabulary>>,
    ) -> Result<Chain, ChainError> {
        if spec.stages.is_empty() {
            return Err(ChainError::Empty);
        }
        // Validate everything before creating any config.
        let mut stages = Vec::with_capacity(spec.stages.len());
        let len = spec.stages.len();
        for (i, s) in spec.stages.iter().enumerate() {
            let st = registry.registered(&s.name)?;
            for (pname, value) in &s.params {
                let Some(pinfo) = st.info.params.iter().find(|p| &p.name == pname) else {
                    let accepted: Vec<&str> =
                        st.info.params.iter().map(|p| p.name.as_str()).collect();
                    return Err(ChainError::UnknownParam {
                        stage: s.name.clone(),
                        param: pname.clone(),
                        accepted: if accepted.is_empty() {
                            "none".into()
                        } else {
                            accepted.join(", ")
                        },
                    });
                };
                if pinfo.kind != value.kind() {
                    return Err(ChainError::ParamKind {
                        stage: s.name.clone(),
                        param: pname.clone(),
                        expected: pinfo.kind.describe(),
                        got: value.to_string(),
                    });
                }
                if let ParamValue::Number(n) = value
                    && n.is_nan()
                {
                    return Err(ChainError::Invalid {
                        stage: s.name.clone(),
                        message: format!("parameter `{pname}` is NaN"),
                    });
                }
            }
            if st.info.selects && i + 1 != len {
                return Err(ChainError::SelectingNotLast {
                    stage: s.name.clone(),
                    position: i + 1,
                    len,
                });
            }
            if !st.info.selects && i + 1 == len {
                return Err(ChainError::NoSelectingStage {
                    stage: s.name.clone(),
                });
            }
            stages.push(st);
        }
        let vocab_ptr = vocab.as_ref().map_or(std::ptr::null(), |v| v.as_abi());
        let mut inner = ChainInner {
            links: Vec::with_capacity(len),
            spec: spec.clone(),
            _vocab: vocab.clone(),
        };
        for (s, st) in spec.stages.iter().zip(stages) {
            let raw = raw_params(&s.name, &s.params)?;
            let mut config: *mut c_void = std::ptr::null_mut();
            let mut err = new_error();
            let name: Arc<str> = Arc::from(s.name.as_str());
            crate::activity::entering(&name);
            let config_new = st.vtable.config_new.expect("checked at load");
            // SAFETY: params/vocab are valid for the call (vocab for the
            // config's life: `inner` holds the Arc); out-pointers are valid.
            let rc = unsafe {
                config_new(
                    raw.params.as_ptr(),
                    raw.params.len(),
                    vocab_ptr,
                    &mut config,
                    &mut err,
                )
            };
            if rc != SD_OK {
                // `inner` drops the configs built so far.
                return Err(ChainError::Invalid {
                    stage: s.name.clone(),
                    message: error_text(&err),
                });
            }
            let metrics = StageMetrics::new(&s.name);
            inner.links.push(Link {
                name,
                stage: st,
                config,
                metrics,
            });
        }
        Ok(Chain {
            inner: Arc::new(inner),
        })
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

    /// Fresh per-sequence states for every stage.
    pub fn new_sequence(&self) -> Result<Sequence, SampleError> {
        let mut seq = Sequence {
            chain: self.clone(),
            states: Vec::with_capacity(self.inner.links.len()),
        };
        for link in &self.inner.links {
            let mut state: *mut c_void = std::ptr::null_mut();
            let mut err = new_error();
            let state_new = link.enter().state_new.expect("checked at load");
            // SAFETY: config from this stage's config_new; out-pointers valid.
            let rc = unsafe { state_new(link.config, &mut state, &mut err) };
            if rc != SD_OK {
                link.metrics.errors.increment(1);
                // `seq` frees the states created so far.
                return Err(SampleError::Plugin {
                    stage: link.name().to_string(),
                    message: error_text(&err),
                });
            }
            seq.states.push(state);
        }
        Ok(seq)
    }
}

/// The chosen token of one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampled {
    pub token_id: u32,
}

/// Per-sequence state of every stage of a chain. Not shared between threads
/// at once (`Send`, not `Sync`); freed through the ABI on drop.
pub struct Sequence {
    chain: Chain,
    states: Vec<*mut c_void>,
}

// SAFETY: a state may move between threads; it is never used by two at once
// because Sequence is !Sync and every call takes &mut self.
unsafe impl Send for Sequence {}

impl Drop for Sequence {
    fn drop(&mut self) {
        for (link, &state) in self.chain.inner.links.iter().zip(&self.states) {
            if let Some(free) = link.vt().state_free {
                // SAFETY: state from this stage's state_new/clone, freed once.
                unsafe { free(link.config, state) };
            }
        }
    }
}

impl Sequence {
    pub fn chain(&self) -> &Chain {
        &self.chain
    }

    /// Tells every stage the sequence emitted `token`.
    pub fn accept(&mut self, token: u32) -> Result<(), SampleError> {
        for (link, &state) in self.chain.inner.links.iter().zip(&self.states) {
            let mut err = new_error();
            let accept = link.enter().accept.expect("checked at load");
            // SAFETY: config/state belong to this stage; &mut self serialises.
            let rc = unsafe { accept(link.config, state, token, &mut err) };
            if rc != SD_OK {
                link.metrics.errors.increment(1);
                return Err(SampleError::Plugin {
                    stage: link.name().to_string(),
                    message: error_text(&err),
                });
            }
        }
        Ok(())
    }

    /// Accepts each of `tokens`, oldest first (seeds a penalty window).
    pub fn accept_all(&mut self, tokens: &[u32]) -> Result<(), SampleError> {
        tokens.iter().try_for_each(|&t| self.accept(t))
    }

    /// Back to fresh states (as after `new_sequence`).
    pub fn reset(&mut self) -> Result<(), SampleError> {
        for (link, &state) in self.chain.inner.links.iter().zip(&self.states) {
            let mut err = new_error();
            let reset = link.enter().state_reset.expect("checked at load");
            // SAFETY: as in accept.
            if unsafe { reset(link.config, state, &mut err) } != SD_OK {
                return Err(SampleError::Plugin {
                    stage: link.name().to_string(),
                    message: error_text(&err),
                });
            }
        }
        Ok(())
    }

    /// Deep copy (forks the sequence).
    pub fn try_clone(&self) -> Result<Sequence, SampleError> {
        let mut copy = Sequence {
            chain: self.chain.clone(),
            states: Vec::with_capacity(self.states.len()),
        };
        for (link, &state) in self.chain.inner.links.iter().zip(&self.states) {
            let mut out: *mut c_void = std::ptr::null_mut();
            let mut err = new_error();
            let clone = link.enter().state_clone.expect("checked at load");
            // SAFETY: as in accept; `out` is a valid out-pointer.
            if unsafe { clone(link.config, state, &mut out, &mut err) } != SD_OK {
                return Err(SampleError::Plugin {
                    stage: link.name().to_string(),
                    message: error_text(&err),
                });
            }
            copy.states.push(out);
        }
        Ok(copy)
    }

    /// Runs the chain over the logits loaded in `buf` with the randomness
    /// of `(seed, step)`. Does not accept the token: call `accept` for that.
    pub fn sample(
        &mut self,
        buf: &mut TokenBuffer,
        seed: u64,
        step: u64,
    ) -> Result<Sampled, SampleError> {
        self.run(buf, seed, step, None, true)
    }

    /// As `sample`, over the view already in `buf` (e.g. the survivors of a
    /// device sampling prefix loaded with `TokenBuffer::load_candidates`)
    /// instead of resetting it to the dense logits.
    pub fn sample_prepared(
        &mut self,
        buf: &mut TokenBuffer,
        seed: u64,
        step: u64,
    ) -> Result<Sampled, SampleError> {
        self.run(buf, seed, step, None, false)
    }

    /// As `sample`, adding each stage's wall time (ns) to `stage_ns`.
    pub fn sample_timed(
        &mut self,
        buf: &mut TokenBuffer,
        seed: u64,
        step: u64,
        stage_ns: &mut [u64],
    ) -> Result<Sampled, SampleError> {
        self.run(buf, seed, step, Some(stage_ns), true)
    }

    fn run(
        &mut self,
        buf: &mut TokenBuffer,
        seed: u64,
        step: u64,
        mut stage_ns: Option<&mut [u64]>,
        reset_view: bool,
    ) -> Result<Sampled, SampleError> {
        if buf.n_vocab() == 0 {
            return Err(SampleError::NotLoaded);
        }
        if reset_view {
            buf.reset_view();
        } else {
            buf.raw.selected = -1;
        }
        let mut rng = StepRng::new(seed, step);
        let n_vocab = buf.n_vocab();
        let links = &self.chain.inner.links;
        for (i, (link, &state)) in links.iter().zip(&self.states).enumerate() {
            let vt = link.enter();
            if buf.is_dense() && vt.flags & SD_STAGE_DENSE_OK == 0 {
                buf.materialize();
            }
            let before = buf.len();
            let was_dense = buf.is_dense();
            let mut sd_rng = rng.as_abi();
            let mut err = new_error();
            let apply = vt.apply.expect("checked at load");
            let t0 = Instant::now();
            // SAFETY: the buffer's pointers are valid for n_vocab entries and
            // exclusively borrowed; rng and err live across the call.
            let rc = unsafe { apply(link.config, state, &mut buf.raw, &mut sd_rng, &mut err) };
            let took = t0.elapsed();
            link.metrics.duration.record(took.as_secs_f64());
            if let Some(ns) = stage_ns.as_deref_mut() {
                ns[i] += took.as_nanos() as u64;
            }
            if rc != SD_OK {
                link.metrics.errors.increment(1);
                return Err(SampleError::Plugin {
                    stage: link.name().to_string(),
                    message: error_text(&err),
                });
            }
            check_after_stage(link.name(), buf, before, was_dense, n_vocab)
                .inspect_err(|_| link.metrics.errors.increment(1))?;
        }
        let last = links.last().expect("chains are never empty");
        let selected = buf.raw.selected;
        let Ok(id) = u32::try_from(selected) else {
            last.metrics.errors.increment(1);
            return Err(SampleError::NoSelection {
                stage: last.name().to_string(),
            });
        };
        let survived = if buf.is_dense() {
            buf.dense()
                .get(id as usize)
                .is_some_and(|&l| l > f32::NEG_INFINITY)
        } else {
            is_live_candidate(buf.candidates(), id)
        };
        if !survived {
            last.metrics.errors.increment(1);
            return Err(SampleError::Misbehaved {
                stage: last.name().to_string(),
                what: format!("selected token {id}, which is not a surviving candidate"),
            });
        }
        Ok(Sampled { token_id: id })
    }
}

/// Whether every candidate has an id below `n_vocab` and a logit that is
/// not NaN: one branch-free pass, on AVX-512 or AVX2 where the CPU has it
/// (this runs after every stage, over up to a whole vocabulary).
fn candidates_ok(cands: &[SdCandidate], n_vocab: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        return unsafe { candidates_ok_avx512(cands, n_vocab) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { candidates_ok_avx2(cands, n_vocab) };
    }
    candidates_ok_impl(cands, n_vocab)
}

/// [`candidates_ok_impl`] with intrinsics: eight (id, logit) pairs per
/// register, ids compared in the even lanes, NaN tested in the odd ones.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn candidates_ok_avx512(cands: &[SdCandidate], n_vocab: usize) -> bool {
    use std::arch::x86_64::*;
    const _: () = assert!(std::mem::size_of::<SdCandidate>() == 8);
    let limit = _mm512_set1_epi32(u32::try_from(n_vocab).unwrap_or(u32::MAX) as i32);
    let mut bad: __mmask16 = 0;
    let pairs = cands.len() / 8 * 8;
    let base = cands.as_ptr().cast::<f32>();
    let mut i = 0;
    while i < pairs {
        // SAFETY: candidates i..i + 8 are in bounds (16 f32 of 8 pairs).
        let v = unsafe { _mm512_loadu_ps(base.add(2 * i)) };
        let ids = _mm512_castps_si512(v);
        bad |= _mm512_cmpge_epu32_mask(ids, limit) & 0x5555;
        bad |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v) & 0xAAAA;
        i += 8;
    }
    bad == 0 && candidates_ok_impl(&cands[pairs..], n_vocab)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn candidates_ok_avx2(cands: &[SdCandidate], n_vocab: usize) -> bool {
    candidates_ok_impl(cands, n_vocab)
}

#[inline(always)]
fn candidates_ok_impl(cands: &[SdCandidate], n_vocab: usize) -> bool {
    let limit = u32::try_from(n_vocab).unwrap_or(u32::MAX);
    !cands
        .iter()
        .fold(false, |acc, c| acc | (c.id >= limit) | c.logit.is_nan())
}

/// Whether `id` is among the candidates with a logit above -inf (chunks
/// of 64 checked branch-free, so the scan vectorises and stops early).
fn is_live_candidate(cands: &[SdCandidate], id: u32) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        return unsafe { is_live_candidate_avx512(cands, id) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { is_live_candidate_avx2(cands, id) };
    }
    is_live_candidate_impl(cands, id)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn is_live_candidate_avx512(cands: &[SdCandidate], id: u32) -> bool {
    is_live_candidate_impl(cands, id)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn is_live_candidate_avx2(cands: &[SdCandidate], id: u32) -> bool {
    is_live_candidate_impl(cands, id)
}

#[inline(always)]
fn is_live_candidate_impl(cands: &[SdCandidate], id: u32) -> bool {
    cands.chunks(64).any(|chunk| {
        chunk.iter().fold(false, |acc, c| {
            acc | ((c.id == id) & (c.logit > f32::NEG_INFINITY))
        })
    })
}

/// Cheap post-checks after each stage: the view is known, the candidate
/// count did not grow, ids are in range and no NaN appeared (O(size), in the
/// candidate view only).
fn check_after_stage(
    stage: &str,
    buf: &TokenBuffer,
    before: usize,
    was_dense: bool,
    n_vocab: usize,
) -> Result<(), SampleError> {
    let bad = |what: String| SampleError::Misbehaved {
        stage: stage.to_string(),
        what,
    };
    let raw = &buf.raw;
    if raw.view != SD_VIEW_DENSE && raw.view != SD_VIEW_CANDIDATES {
        return Err(bad(format!("set an unknown view {}", raw.view)));
    }
    if raw.view == SD_VIEW_DENSE && !was_dense {
        return Err(bad("switched back from candidates to the dense view".into()));
    }
    if raw.view == SD_VIEW_CANDIDATES {
        if raw.size > before || raw.size > n_vocab {
            return Err(bad(format!(
                "grew the candidates from {before} to {}",
                raw.size
            )));
        }
        // A branch-free pass first (it vectorises: this runs after every
        // stage, over up to a whole vocabulary); the search for the
        // message only when something is wrong.
        let cands = buf.candidates();
        let any_bad = !candidates_ok(cands, n_vocab);
        if let Some(c) = any_bad
            .then(|| {
                cands
                    .iter()
                    .find(|c| c.id as usize >= n_vocab || c.logit.is_nan())
            })
            .flatten()
        {
            return Err(bad(format!(
                "left candidate id {} with logit {} (vocabulary {n_vocab})",
                c.id, c.logit
            )));
        }
    }
    if raw.selected >= n_vocab as i64 || raw.selected < -1 {
        return Err(bad(format!(
            "selected token {} outside the vocabulary of {n_vocab}",
            raw.selected
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cands(n: usize) -> Vec<SdCandidate> {
        (0..n as u32)
            .map(|i| SdCandidate {
                id: i,
                logit: i as f32 * 0.5 - 3.0,
            })
            .collect()
    }

    #[test]
    fn candidate_checks_find_every_bad_entry() {
        // every length around the 8- and 64-wide blocks, a bad id or a NaN
        // at every position: the vectorised checks agree with the plain one
        for n in [0usize, 1, 7, 8, 9, 63, 64, 65, 130] {
            let good = cands(n);
            assert!(candidates_ok(&good, n));
            assert!(candidates_ok_impl(&good, n));
            for at in 0..n {
                let mut c = good.clone();
                c[at].id = n as u32;
                assert!(!candidates_ok(&c, n), "n {n}: id at {at}");
                let mut c = good.clone();
                c[at].logit = f32::NAN;
                assert!(!candidates_ok(&c, n), "n {n}: NaN at {at}");
                let id = good[at].id;
                assert!(is_live_candidate(&good, id));
                let mut c = good.clone();
                c[at].logit = f32::NEG_INFINITY;
                assert!(!is_live_candidate(&c, id), "n {n}: -inf at {at}");
            }
            assert!(!is_live_candidate(&good, n as u32));
        }
    }
}
