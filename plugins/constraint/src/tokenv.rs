//! llguidance's view of the model vocabulary (token trie, `TokEnv`, and the
//! `ParserFactory` with its sliced bias computer), built once per distinct
//! vocabulary and shared by every config through a small process-wide cache.
//!
//! Why a cache: a config is built per request, and building the factory
//! means sorting and inserting every token into the trie and then building
//! the slicer's per-slice tries: 200 ms at SmolLM2's 49,152 tokens and
//! 1.4 s at 151,936 (`benches/mask.rs`, "token env build", on the loaded
//! 2-core machine), against a config_new of 4.7 / 7.2 ms with the cache
//! (hash plus grammar compile; docs/PERFORMANCE.md).

use std::sync::{Arc, Mutex};

use llguidance::ParserFactory;
use samplerd_plugin_sdk::abi::SD_TOKEN_UNUSED;
use samplerd_plugin_sdk::prelude::*;
use toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie, TokenId};

/// Distinct vocabularies kept: a server has one model, tests a few.
const CACHE_ENTRIES: usize = 4;

/// The end-of-generation and unusable tokens of one vocabulary, and the
/// factory that compiles grammars against it.
pub struct TokenEnv {
    pub factory: ParserFactory,
    /// Every `SD_TOKEN_EOG` id, ascending.
    pub eog: Vec<TokenId>,
    pub n_vocab: usize,
}

/// A token's bytes for an error message: its text quoted and escaped (a
/// special token's name, without its 0xff marker, the same way).
pub(crate) fn describe(vocab_bytes: &[u8]) -> String {
    match std::str::from_utf8(vocab_bytes) {
        Ok(s) => format!("{:?}", s),
        Err(_) => format!("\"{}\"", vocab_bytes.escape_ascii()),
    }
}

struct Entry {
    key: (u64, u64, usize),
    env: Arc<TokenEnv>,
}

static CACHE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

/// Why a vocabulary cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum VocabError {
    #[error(
        "needs a vocabulary with an end-of-generation token (SD_TOKEN_EOG), \
         and this one of {0} tokens has none, so a constrained generation could never stop"
    )]
    NoEog(usize),
    #[error("needs a vocabulary of at least one token")]
    Empty,
    #[error("building llguidance's token environment failed: {0}")]
    Factory(String),
}

/// The bytes llguidance sees for token `id`: a control or end-of-generation
/// token becomes a special token (0xFF + its text, llguidance's convention,
/// so no grammar matches it as text); an unused one has no bytes (never
/// allowed); a normal or byte token is its raw bytes.
fn trie_bytes(vocab: &Vocab<'_>, id: u32) -> Vec<u8> {
    let attr = vocab.token_attr(id);
    let bytes = vocab.token_bytes(id);
    if attr & SD_TOKEN_UNUSED != 0 {
        Vec::new()
    } else if attr & (SD_TOKEN_CONTROL | SD_TOKEN_EOG) != 0 {
        let mut v = Vec::with_capacity(bytes.len() + 1);
        v.push(TokTrie::SPECIAL_TOKEN_MARKER);
        v.extend_from_slice(bytes);
        v
    } else {
        bytes.to_vec()
    }
}

/// Two independent 64-bit hashes of every token's bytes and attributes
/// (a multiply-rotate over 8-byte words, one pass, no per-byte rounds; it
/// is part of the 7.2 ms cached config_new at 151,936 tokens, not measured
/// apart). Vocabularies come from the model host, not from requests, so
/// collisions need not be adversarially hard.
fn vocab_key(vocab: &Vocab<'_>) -> (u64, u64, usize) {
    const M1: u64 = 0x9E37_79B9_7F4A_7C15;
    const M2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    let (mut a, mut b) = (0x243F_6A88_85A3_08D3u64, 0x1319_8A2E_0370_7344u64);
    let mut mix = |w: u64| {
        a = (a ^ w).wrapping_mul(M1).rotate_left(29);
        b = (b.rotate_left(17) ^ w).wrapping_mul(M2);
    };
    for id in 0..vocab.n_vocab() as u32 {
        let bytes = vocab.token_bytes(id);
        mix(((bytes.len() as u64) << 32) | vocab.token_attr(id) as u64);
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            mix(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            mix(u64::from_le_bytes(w));
        }
    }
    (a, b, vocab.n_vocab())
}

fn build(vocab: &Vocab<'_>) -> Result<TokenEnv, VocabError> {
    let n = vocab.n_vocab();
    if n == 0 {
        return Err(VocabError::Empty);
    }
    let eog: Vec<TokenId> = (0..n as u32)
        .filter(|&id| vocab.token_attr(id) & SD_TOKEN_EOG != 0)
        .collect();
    let Some(&first_eog) = eog.first() else {
        return Err(VocabError::NoEog(n));
    };
    let words: Vec<Vec<u8>> = (0..n as u32).map(|id| trie_bytes(vocab, id)).collect();
    let info = TokRxInfo::new(n as u32, first_eog);
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&eog);
    let env: toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
    let mut factory =
        ParserFactory::new_simple(&env).map_err(|e| VocabError::Factory(e.to_string()))?;
    // llguidance logs grammar warnings to stderr by default; a server's
    // stderr is not the place for a request's grammar.
    factory.quiet();
    Ok(TokenEnv {
        factory,
        eog,
        n_vocab: n,
    })
}

/// The token environment of `vocab`, from the cache or built and cached
/// (the oldest entry leaves when the cache is full).
pub fn token_env(vocab: &Vocab<'_>) -> Result<Arc<TokenEnv>, VocabError> {
    let key = vocab_key(vocab);
    {
        let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = cache.iter().position(|e| e.key == key) {
            let e = cache.remove(i);
            let env = e.env.clone();
            cache.push(e); // most recently used last
            return Ok(env);
        }
    }
    // Built outside the lock: another config for another vocabulary need
    // not wait. Two racing builds of one vocabulary both succeed; the
    // second replaces nothing (same key), it is simply dropped.
    let env = Arc::new(build(vocab)?);
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if !cache.iter().any(|e| e.key == key) {
        if cache.len() >= CACHE_ENTRIES {
            cache.remove(0);
        }
        cache.push(Entry {
            key,
            env: env.clone(),
        });
    }
    Ok(env)
}

/// Builds the environment without the cache (for measuring what it saves).
pub fn token_env_uncached(vocab: &Vocab<'_>) -> Result<Arc<TokenEnv>, VocabError> {
    build(vocab).map(Arc::new)
}
