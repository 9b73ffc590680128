//! Host-free test support: owned token buffers, an owned parameter builder
//! and a deterministic RNG, so a stage can be unit-tested without loading it
//! through the C ABI.
//!
//! ```
//! use samplerd_plugin_sdk::testing::{OwnedParams, OwnedTokens, TestRng};
//! let mut buf = OwnedTokens::dense(&[1.0, 3.0, 2.0]);
//! let mut rng = TestRng::constant(0);
//! assert_eq!(buf.tokens().len(), 3);
//! let _ = (OwnedParams::new().number("k", 2.0), rng.host().next_u64());
//! ```

use std::ffi::{CString, c_void};

use crate::abi::*;
use crate::stage::{HostRng, Params, Stage, Tokens};

/// An owned `sd_tokens`: dense logits plus a candidate buffer of capacity
/// `n_vocab`, exactly like the host's token buffer.
pub struct OwnedTokens {
    dense: Vec<f32>,
    cand: Vec<SdCandidate>,
    raw: SdTokens,
}

impl OwnedTokens {
    fn with(dense: Vec<f32>, cand: Vec<SdCandidate>, size: usize, view: u32, sorted: bool) -> Self {
        let mut t = OwnedTokens {
            dense,
            cand,
            raw: SdTokens {
                struct_size: size_of::<SdTokens>() as u32,
                n_vocab: 0,
                dense: std::ptr::null_mut(),
                cand: std::ptr::null_mut(),
                size,
                view,
                sorted: sorted as u32,
                selected: -1,
            },
        };
        t.raw.n_vocab = t.dense.len() as u32;
        t
    }

    /// Dense view over `logits` (token id = index).
    pub fn dense(logits: &[f32]) -> Self {
        let n = logits.len();
        Self::with(
            logits.to_vec(),
            vec![SdCandidate { id: 0, logit: 0.0 }; n],
            n,
            SD_VIEW_DENSE,
            false,
        )
    }

    /// Reloads dense logits of the same vocabulary size and resets the view
    /// and the selection (reuses the buffers, for benchmarks).
    ///
    /// # Panics
    /// When `logits` has another length than the vocabulary.
    pub fn reload(&mut self, logits: &[f32]) {
        self.dense.copy_from_slice(logits);
        self.raw.size = logits.len();
        self.raw.view = SD_VIEW_DENSE;
        self.raw.sorted = 0;
        self.raw.selected = -1;
    }

    /// Candidate view with `cands` as the live candidates over a vocabulary of
    /// `n_vocab` tokens (the dense view holds -inf except for the candidates).
    ///
    /// # Panics
    /// When there are more candidates than `n_vocab` or an id is out of range.
    pub fn candidates(n_vocab: usize, cands: &[(u32, f32)], sorted: bool) -> Self {
        assert!(
            cands.len() <= n_vocab,
            "more candidates than the vocabulary"
        );
        let mut dense = vec![f32::NEG_INFINITY; n_vocab];
        let mut cand = vec![SdCandidate { id: 0, logit: 0.0 }; n_vocab];
        for (slot, &(id, logit)) in cand.iter_mut().zip(cands) {
            assert!((id as usize) < n_vocab, "candidate id {id} out of range");
            dense[id as usize] = logit;
            *slot = SdCandidate { id, logit };
        }
        Self::with(dense, cand, cands.len(), SD_VIEW_CANDIDATES, sorted)
    }

    /// Candidate view of every token of `logits` in id order, as the host
    /// converts a dense buffer for a stage without `SD_STAGE_DENSE_OK`.
    pub fn dense_as_candidates(logits: &[f32]) -> Self {
        let pairs: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l))
            .collect();
        Self::candidates(logits.len(), &pairs, false)
    }

    /// The SDK view handed to `Stage::apply`; changes made through it stay
    /// in `self`.
    pub fn tokens(&mut self) -> Tokens<'_> {
        self.raw.n_vocab = self.dense.len() as u32;
        self.raw.dense = self.dense.as_mut_ptr();
        self.raw.cand = self.cand.as_mut_ptr();
        // SAFETY: dense and cand hold n_vocab entries each and are borrowed
        // exclusively through `self` for the life of the view.
        unsafe { Tokens::from_raw(&mut self.raw) }
    }

    pub fn n_vocab(&self) -> usize {
        self.dense.len()
    }

    pub fn is_dense(&self) -> bool {
        self.raw.view == SD_VIEW_DENSE
    }

    /// `sorted` flag (only meaningful in the candidate view).
    pub fn is_sorted(&self) -> bool {
        self.raw.view == SD_VIEW_CANDIDATES && self.raw.sorted != 0
    }

    /// Number of live entries (n_vocab in the dense view).
    pub fn len(&self) -> usize {
        if self.is_dense() {
            self.dense.len()
        } else {
            self.raw.size.min(self.dense.len())
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dense logits.
    pub fn dense_logits(&self) -> &[f32] {
        &self.dense
    }

    /// Live entries as (id, logit) in their current order (dense: id order).
    pub fn entries(&self) -> Vec<(u32, f32)> {
        if self.is_dense() {
            self.dense
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, l))
                .collect()
        } else {
            self.cand[..self.len()]
                .iter()
                .map(|c| (c.id, c.logit))
                .collect()
        }
    }

    /// Live entries whose logit is not -inf ("survivors"), in current order.
    pub fn survivors(&self) -> Vec<(u32, f32)> {
        self.entries()
            .into_iter()
            .filter(|&(_, l)| l != f32::NEG_INFINITY)
            .collect()
    }

    /// Ids of the survivors, sorted ascending (order-independent comparisons).
    pub fn survivor_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.survivors().into_iter().map(|(i, _)| i).collect();
        ids.sort_unstable();
        ids
    }

    /// The logit of token `id` among the live entries, if it is one.
    pub fn logit(&self, id: u32) -> Option<f32> {
        self.entries()
            .into_iter()
            .find(|&(i, _)| i == id)
            .map(|(_, l)| l)
    }

    /// The token a selecting stage chose.
    pub fn selected(&self) -> Option<u32> {
        u32::try_from(self.raw.selected).ok()
    }

    /// Clears the selection (to reuse a buffer for another step).
    pub fn clear_selected(&mut self) {
        self.raw.selected = -1;
    }
}

enum RngSource {
    Values { values: Vec<u64>, pos: usize },
    SplitMix(u64),
}

/// A deterministic `sd_rng`: either cycles through fixed values or runs
/// splitmix64 from a seed.
pub struct TestRng {
    src: Box<RngSource>,
    raw: SdRng,
}

unsafe extern "C" fn test_rng_next(ctx: *mut c_void) -> u64 {
    // SAFETY: ctx is the boxed RngSource of a live TestRng.
    let src = unsafe { &mut *ctx.cast::<RngSource>() };
    match src {
        RngSource::Values { values, pos } => {
            let v = values[*pos % values.len()];
            *pos += 1;
            v
        }
        RngSource::SplitMix(state) => {
            *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = *state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
    }
}

/// Keyed draws of the test RNG: splitmix64's finaliser of the key, the same
/// whatever the source (a stand-in for the host's keyed stream).
unsafe extern "C" fn test_rng_keyed(_ctx: *mut c_void, key: u64) -> u64 {
    let mut z = key.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl TestRng {
    fn with(src: RngSource) -> Self {
        let mut src = Box::new(src);
        let ctx = (&mut *src as *mut RngSource).cast::<c_void>();
        TestRng {
            src,
            raw: SdRng {
                struct_size: size_of::<SdRng>() as u32,
                ctx,
                next_u64: Some(test_rng_next),
                keyed_u64: Some(test_rng_keyed),
            },
        }
    }

    /// Cycles through `values` (must not be empty).
    pub fn from_values(values: &[u64]) -> Self {
        assert!(!values.is_empty(), "TestRng needs at least one value");
        Self::with(RngSource::Values {
            values: values.to_vec(),
            pos: 0,
        })
    }

    /// Always returns `v`.
    pub fn constant(v: u64) -> Self {
        Self::from_values(&[v])
    }

    /// Returns values whose uniform double (`(v >> 11) * 2^-53`) is `u`
    /// (rounded down to 53 bits); `u` in [0, 1).
    pub fn uniform(u: f64) -> Self {
        assert!((0.0..1.0).contains(&u), "uniform value must be in [0, 1)");
        Self::constant(((u * (1u64 << 53) as f64) as u64) << 11)
    }

    /// splitmix64 stream from `seed`.
    pub fn seeded(seed: u64) -> Self {
        Self::with(RngSource::SplitMix(seed))
    }

    /// The SDK view handed to `Stage::apply`.
    pub fn host(&mut self) -> HostRng<'_> {
        let _ = &self.src;
        // SAFETY: ctx points into `self.src`, alive as long as `self`.
        unsafe { HostRng::from_raw(&mut self.raw) }
    }
}

/// An owned parameter list for `Stage::new`.
#[derive(Default)]
pub struct OwnedParams {
    items: Vec<OwnedParam>,
}

enum OwnedValue {
    Number(f64),
    String(CString),
    Map(Vec<SdTokenValue>),
    Strings {
        _owned: Vec<CString>,
        ptrs: Vec<*const std::ffi::c_char>,
    },
}

struct OwnedParam {
    name: CString,
    value: OwnedValue,
}

impl OwnedParams {
    pub fn new() -> Self {
        Self::default()
    }

    fn push(mut self, name: &str, value: OwnedValue) -> Self {
        self.items.push(OwnedParam {
            name: CString::new(name).expect("parameter name without NUL"),
            value,
        });
        self
    }

    pub fn number(self, name: &str, v: f64) -> Self {
        self.push(name, OwnedValue::Number(v))
    }

    pub fn string(self, name: &str, v: &str) -> Self {
        self.push(
            name,
            OwnedValue::String(CString::new(v).expect("string without NUL")),
        )
    }

    pub fn token_map(self, name: &str, map: &[(u32, f32)]) -> Self {
        let m = map
            .iter()
            .map(|&(id, value)| SdTokenValue { id, value })
            .collect();
        self.push(name, OwnedValue::Map(m))
    }

    pub fn strings(self, name: &str, list: &[&str]) -> Self {
        let owned: Vec<CString> = list
            .iter()
            .map(|s| CString::new(*s).expect("string without NUL"))
            .collect();
        let ptrs = owned.iter().map(|s| s.as_ptr()).collect();
        self.push(
            name,
            OwnedValue::Strings {
                _owned: owned,
                ptrs,
            },
        )
    }

    /// The parameters as `config_new` takes them (borrowing `self`): for
    /// tests that call a stage through its C descriptor.
    pub fn raw(&self) -> Vec<SdParam> {
        self.items
            .iter()
            .map(|p| {
                let mut raw = SdParam {
                    struct_size: size_of::<SdParam>() as u32,
                    kind: SD_PARAM_NUMBER,
                    name: p.name.as_ptr(),
                    number: 0.0,
                    string: std::ptr::null(),
                    map: std::ptr::null(),
                    map_len: 0,
                    strings: std::ptr::null(),
                    strings_len: 0,
                };
                match &p.value {
                    OwnedValue::Number(v) => raw.number = *v,
                    OwnedValue::String(s) => {
                        raw.kind = SD_PARAM_STRING;
                        raw.string = s.as_ptr();
                    }
                    OwnedValue::Map(m) => {
                        raw.kind = SD_PARAM_TOKEN_MAP;
                        raw.map = m.as_ptr();
                        raw.map_len = m.len();
                    }
                    OwnedValue::Strings { ptrs, .. } => {
                        raw.kind = SD_PARAM_STRING_LIST;
                        raw.strings = ptrs.as_ptr();
                        raw.strings_len = ptrs.len();
                    }
                }
                raw
            })
            .collect()
    }

    /// Builds stage `S` from these parameters the way `config_new` does
    /// (unknown names are refused), without a vocabulary.
    pub fn build<S: Stage>(&self) -> Result<S, String> {
        let raw = self.raw();
        // SAFETY: every pointer in `raw` points into `self`, alive here.
        let params = unsafe { Params::from_raw(&raw, S::PARAMS) };
        let unknown = params.unknown_names();
        if !unknown.is_empty() {
            return Err(format!("unknown parameter(s): {}", unknown.join(", ")));
        }
        S::new(&params, None)
    }
}

/// Runs one `apply` of `stage` on `tokens` with a fresh borrow of each.
pub fn apply<S: Stage>(
    stage: &S,
    state: &mut S::State,
    tokens: &mut OwnedTokens,
    rng: &mut TestRng,
) -> Result<(), String> {
    stage.apply(state, &mut tokens.tokens(), &mut rng.host())
}

/// Builds `S` from `params` and applies it once with a fresh state.
pub fn apply_once<S: Stage>(
    params: &OwnedParams,
    tokens: &mut OwnedTokens,
    rng: &mut TestRng,
) -> Result<(), String> {
    let stage = params.build::<S>()?;
    let mut state = stage.new_state();
    apply(&stage, &mut state, tokens, rng)
}
