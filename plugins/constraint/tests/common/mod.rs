//! Drives the `constraint` stage through its C ABI vtable, as the host
//! does: owned vocabularies and parameters, and RAII wrappers for configs
//! and states. Shared by the tests and the benchmark.

#![allow(dead_code)]

use std::ffi::{CStr, c_void};

use samplerd_constraint_stage::samplerd_plugin_entry_v1;
use samplerd_plugin_sdk::abi::*;
use samplerd_plugin_sdk::testing::OwnedParams;

/// An owned `sd_vocab`.
pub struct TestVocab {
    bytes: Vec<Vec<u8>>,
    ptrs: Vec<*const u8>,
    lens: Vec<u32>,
    attrs: Vec<u32>,
    raw: SdVocab,
}

impl TestVocab {
    pub fn new(tokens: Vec<(Vec<u8>, u32)>) -> Self {
        let (bytes, attrs): (Vec<Vec<u8>>, Vec<u32>) = tokens.into_iter().unzip();
        let ptrs: Vec<*const u8> = bytes.iter().map(|b| b.as_ptr()).collect();
        let lens = bytes.iter().map(|b| b.len() as u32).collect::<Vec<_>>();
        let raw = SdVocab {
            struct_size: size_of::<SdVocab>() as u32,
            n_vocab: bytes.len() as u32,
            token_bytes: ptrs.as_ptr(),
            token_len: lens.as_ptr(),
            token_attr: attrs.as_ptr(),
        };
        TestVocab {
            bytes,
            ptrs,
            lens,
            attrs,
            raw,
        }
    }

    /// The tiny test vocabulary: the 256 single bytes (0x80.. as byte
    /// tokens), some multi-byte text tokens, an end-of-generation token, a
    /// second one (a model may have several), a control token and an
    /// unused one.
    pub fn tiny() -> Self {
        let mut t: Vec<(Vec<u8>, u32)> = (0u8..=255)
            .map(|b| (vec![b], if b >= 0x80 { SD_TOKEN_BYTE } else { 0 }))
            .collect();
        for w in [
            "{\"", "\":", "\",\"", "\"}", "true", "false", "null", "ab", "abc", "  ", "\n", "12",
            "yes", "no", "maybe", "é", "x=", "=y\n",
        ] {
            t.push((w.as_bytes().to_vec(), 0));
        }
        t.push((b"<|eos|>".to_vec(), SD_TOKEN_EOG | SD_TOKEN_CONTROL));
        t.push((b"<|eot|>".to_vec(), SD_TOKEN_EOG | SD_TOKEN_CONTROL));
        t.push((b"<|im_start|>".to_vec(), SD_TOKEN_CONTROL));
        t.push((b"unused".to_vec(), SD_TOKEN_UNUSED));
        Self::new(t)
    }

    pub fn raw(&self) -> *const SdVocab {
        &self.raw
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn bytes(&self, id: u32) -> &[u8] {
        &self.bytes[id as usize]
    }

    pub fn attr(&self, id: u32) -> u32 {
        self.attrs[id as usize]
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.attrs[id as usize] & SD_TOKEN_EOG != 0
    }

    pub fn id(&self, bytes: &[u8]) -> u32 {
        self.bytes
            .iter()
            .position(|b| b == bytes)
            .unwrap_or_else(|| panic!("no token {bytes:?}")) as u32
    }

    pub fn eog_ids(&self) -> Vec<u32> {
        (0..self.len() as u32).filter(|&i| self.is_eog(i)).collect()
    }
}

/// One parameter value.
#[derive(Clone, Copy)]
pub enum P<'a> {
    Str(&'a str, &'a str),
    Num(&'a str, f64),
    List(&'a str, &'a [&'a str]),
}

fn error_text(err: &SdError) -> String {
    // SAFETY: the stage wrote a NUL-terminated message on SD_ERR.
    unsafe { CStr::from_ptr(err.message.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

fn new_err() -> SdError {
    SdError {
        message: [0; SD_ERROR_MESSAGE_LEN],
    }
}

/// The library's one stage.
pub fn stage() -> &'static SdStage {
    // SAFETY: the entry point returns the library's static descriptor.
    let plugin = unsafe { &*samplerd_plugin_entry_v1() };
    assert_eq!(plugin.n_stages, 1);
    // SAFETY: `stages` holds `n_stages` static stage pointers.
    unsafe { &**plugin.stages }
}

/// A config made by `config_new`, freed on drop.
pub struct Config {
    stage: &'static SdStage,
    ptr: *mut c_void,
}

// SAFETY: the ABI says a config may be shared by threads.
unsafe impl Sync for Config {}
// SAFETY: as for Sync; the config is immutable after config_new.
unsafe impl Send for Config {}

pub fn config(params: &[P<'_>], vocab: Option<&TestVocab>) -> Result<Config, String> {
    let stage = stage();
    let owned = params.iter().fold(OwnedParams::new(), |o, p| match p {
        P::Str(n, v) => o.string(n, v),
        P::Num(n, v) => o.number(n, *v),
        P::List(n, l) => o.strings(n, l),
    });
    let raw = owned.raw();
    let mut out: *mut c_void = std::ptr::null_mut();
    let mut err = new_err();
    let vocab = vocab.map_or(std::ptr::null(), |v| v.raw());
    // SAFETY: `raw` holds valid params whose strings `owned` keeps alive;
    // the vocabulary outlives the call; live out-pointers.
    let rc =
        unsafe { (stage.config_new.unwrap())(raw.as_ptr(), raw.len(), vocab, &mut out, &mut err) };
    if rc == SD_OK {
        Ok(Config { stage, ptr: out })
    } else {
        Err(error_text(&err))
    }
}

/// The tiny vocabulary and a config over it, which must build.
pub fn tiny_config(params: &[P<'_>]) -> (TestVocab, Config) {
    let v = TestVocab::tiny();
    let cfg = config(params, Some(&v)).unwrap_or_else(|e| panic!("config_new: {e}"));
    (v, cfg)
}

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: made by this stage's config_new; its states are gone
        // (they borrow the config).
        unsafe { (self.stage.config_free.unwrap())(self.ptr) }
    }
}

impl Config {
    pub fn state(&self) -> State<'_> {
        let mut out: *mut c_void = std::ptr::null_mut();
        let mut err = new_err();
        // SAFETY: our config, a live out-pointer.
        let rc = unsafe { (self.stage.state_new.unwrap())(self.ptr, &mut out, &mut err) };
        assert_eq!(rc, SD_OK, "{}", error_text(&err));
        State {
            cfg: self,
            ptr: out,
        }
    }
}

/// A per-sequence state, freed on drop.
pub struct State<'c> {
    cfg: &'c Config,
    ptr: *mut c_void,
}

unsafe extern "C" fn zero_rng(_: *mut c_void) -> u64 {
    0
}

/// Logits in one of the two views, reused across steps.
pub struct Buffer {
    pub dense: Vec<f32>,
    pub cand: Vec<SdCandidate>,
    pub raw: SdTokens,
}

impl Buffer {
    pub fn new(n: usize) -> Self {
        Buffer {
            dense: vec![0.0; n],
            cand: vec![SdCandidate { id: 0, logit: 0.0 }; n],
            raw: SdTokens {
                struct_size: size_of::<SdTokens>() as u32,
                n_vocab: n as u32,
                dense: std::ptr::null_mut(),
                cand: std::ptr::null_mut(),
                size: n,
                view: SD_VIEW_DENSE,
                sorted: 0,
                selected: -1,
            },
        }
    }

    /// Dense view over `logits`.
    pub fn load_dense(&mut self, logits: &[f32]) {
        self.dense.copy_from_slice(logits);
        self.raw.size = self.dense.len();
        self.raw.view = SD_VIEW_DENSE;
        self.raw.sorted = 0;
    }

    /// Candidate view over `cands`.
    pub fn load_candidates(&mut self, cands: &[(u32, f32)], sorted: bool) {
        for (slot, &(id, logit)) in self.cand.iter_mut().zip(cands) {
            *slot = SdCandidate { id, logit };
        }
        self.raw.size = cands.len();
        self.raw.view = SD_VIEW_CANDIDATES;
        self.raw.sorted = sorted as u32;
    }

    /// Ids whose logit is not -inf in the current view, ascending.
    pub fn survivors(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = if self.raw.view == SD_VIEW_DENSE {
            (0..self.dense.len() as u32)
                .filter(|&i| self.dense[i as usize] != f32::NEG_INFINITY)
                .collect()
        } else {
            self.cand[..self.raw.size]
                .iter()
                .filter(|c| c.logit != f32::NEG_INFINITY)
                .map(|c| c.id)
                .collect()
        };
        ids.sort_unstable();
        ids
    }
}

impl State<'_> {
    pub fn apply(&mut self, buf: &mut Buffer) -> Result<(), String> {
        buf.raw.dense = buf.dense.as_mut_ptr();
        buf.raw.cand = buf.cand.as_mut_ptr();
        let mut rng = SdRng {
            struct_size: size_of::<SdRng>() as u32,
            ctx: std::ptr::null_mut(),
            next_u64: Some(zero_rng),
            keyed_u64: None,
        };
        let mut err = new_err();
        // SAFETY: our config and state; `buf` describes its two live
        // n-entry arrays; a valid RNG.
        let rc = unsafe {
            (self.cfg.stage.apply.unwrap())(
                self.cfg.ptr,
                self.ptr,
                &mut buf.raw,
                &mut rng,
                &mut err,
            )
        };
        if rc == SD_OK {
            Ok(())
        } else {
            Err(error_text(&err))
        }
    }

    /// The ids the stage allows next (one dense apply over zeros).
    pub fn allowed(&mut self, n: usize) -> Result<Vec<u32>, String> {
        let mut buf = Buffer::new(n);
        self.apply(&mut buf)?;
        Ok(buf.survivors())
    }

    pub fn accept(&mut self, token: u32) -> Result<(), String> {
        let (rc, err) = self.accept_code(token);
        if rc == SD_OK { Ok(()) } else { Err(err) }
    }

    /// `accept`'s return code (`SD_OK`, `SD_ERR`, `SD_ERR_INPUT`) and its
    /// message.
    pub fn accept_code(&mut self, token: u32) -> (std::ffi::c_int, String) {
        let mut err = new_err();
        // SAFETY: our config and state.
        let rc =
            unsafe { (self.cfg.stage.accept.unwrap())(self.cfg.ptr, self.ptr, token, &mut err) };
        (
            rc,
            if rc == SD_OK {
                String::new()
            } else {
                error_text(&err)
            },
        )
    }

    pub fn reset(&mut self) {
        let mut err = new_err();
        // SAFETY: our config and state.
        let rc = unsafe { (self.cfg.stage.state_reset.unwrap())(self.cfg.ptr, self.ptr, &mut err) };
        assert_eq!(rc, SD_OK, "{}", error_text(&err));
    }

    pub fn fork(&self) -> Self {
        let mut out: *mut c_void = std::ptr::null_mut();
        let mut err = new_err();
        // SAFETY: our config and state, a live out-pointer.
        let rc = unsafe {
            (self.cfg.stage.state_clone.unwrap())(self.cfg.ptr, self.ptr, &mut out, &mut err)
        };
        assert_eq!(rc, SD_OK, "{}", error_text(&err));
        State {
            cfg: self.cfg,
            ptr: out,
        }
    }
}

impl Drop for State<'_> {
    fn drop(&mut self) {
        // SAFETY: made by this config's state_new/state_clone, freed once.
        unsafe { (self.cfg.stage.state_free.unwrap())(self.cfg.ptr, self.ptr) }
    }
}

/// splitmix64, for reproducible walks.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Outcome of a random walk under the mask.
pub struct Walk {
    /// The text bytes emitted (EOG excluded).
    pub text: Vec<u8>,
    /// Whether the walk ended with an end-of-generation token.
    pub ended: bool,
}

/// Samples up to `max_steps` tokens under the mask: each step applies the
/// stage to random logits in the dense view, asserts something survives,
/// takes the best survivor (an end-of-generation token with probability
/// `p_stop` when one is allowed) and accepts it.
pub fn walk(cfg: &Config, vocab: &TestVocab, seed: u64, max_steps: usize, p_stop: f64) -> Walk {
    let mut st = cfg.state();
    let mut rng = Rng(seed);
    let mut buf = Buffer::new(vocab.len());
    let mut text = Vec::new();
    for _ in 0..max_steps {
        let logits: Vec<f32> = (0..vocab.len())
            .map(|_| (rng.next() >> 40) as f32)
            .collect();
        buf.load_dense(&logits);
        st.apply(&mut buf).unwrap();
        let alive = buf.survivors();
        assert!(
            !alive.is_empty(),
            "the mask removed every token after {text:?}"
        );
        let eog: Vec<u32> = alive.iter().copied().filter(|&i| vocab.is_eog(i)).collect();
        let u = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
        let stop = !eog.is_empty() && (eog.len() == alive.len() || u < p_stop);
        let tok = if stop {
            eog[rng.below(eog.len())]
        } else {
            *alive
                .iter()
                .filter(|&&i| !vocab.is_eog(i))
                .max_by(|&&a, &&b| buf.dense[a as usize].total_cmp(&buf.dense[b as usize]))
                .expect("a non-EOG survivor")
        };
        st.accept(tok)
            .unwrap_or_else(|e| panic!("accept {tok} after {text:?}: {e}"));
        if vocab.is_eog(tok) {
            return Walk { text, ended: true };
        }
        text.extend_from_slice(vocab.bytes(tok));
    }
    Walk { text, ended: false }
}
