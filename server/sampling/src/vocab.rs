//! The model vocabulary in the shape the plugin ABI hands to stages: per
//! token id its raw bytes and `SD_TOKEN_*` attribute bits.

use samplerd_plugin_sdk::abi::SdVocab;

/// The `SD_TOKEN_*` attribute bits of [`Vocabulary::new`]'s `attrs`.
pub mod token_attr {
    pub use samplerd_plugin_sdk::abi::{
        SD_TOKEN_BYTE as BYTE, SD_TOKEN_CONTROL as CONTROL, SD_TOKEN_EOG as EOG,
        SD_TOKEN_NORMAL as NORMAL, SD_TOKEN_UNUSED as UNUSED,
    };
}

/// Owned vocabulary; `as_abi` borrows it as an `sd_vocab`.
pub struct Vocabulary {
    bytes: Vec<Vec<u8>>,
    ptrs: Vec<*const u8>,
    lens: Vec<u32>,
    attrs: Vec<u32>,
    raw: SdVocab,
}

// SAFETY: immutable after construction; the raw pointers point into `bytes`,
// which is never mutated or moved-from while the Vocabulary lives.
unsafe impl Send for Vocabulary {}
// SAFETY: as for Send: nothing writes through the pointers after
// construction, so shared references from several threads only read.
unsafe impl Sync for Vocabulary {}

impl Vocabulary {
    /// `tokens[i]` are token i's bytes, `attrs[i]` its attribute bits
    /// (missing attributes count as normal).
    pub fn new(tokens: Vec<Vec<u8>>, mut attrs: Vec<u32>) -> Self {
        attrs.resize(tokens.len(), 0);
        let ptrs: Vec<*const u8> = tokens.iter().map(|t| t.as_ptr()).collect();
        let lens: Vec<u32> = tokens.iter().map(|t| t.len() as u32).collect();
        let raw = SdVocab {
            struct_size: size_of::<SdVocab>() as u32,
            n_vocab: tokens.len() as u32,
            token_bytes: ptrs.as_ptr(),
            token_len: lens.as_ptr(),
            token_attr: attrs.as_ptr(),
        };
        Vocabulary {
            bytes: tokens,
            ptrs,
            lens,
            attrs,
            raw,
        }
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.bytes.get(id as usize).map(Vec::as_slice)
    }

    pub fn token_attr(&self, id: u32) -> u32 {
        self.attrs.get(id as usize).copied().unwrap_or(0)
    }

    /// The ABI view; valid while `self` lives (the Vec buffers never move
    /// because they are never mutated after `new`).
    pub fn as_abi(&self) -> *const SdVocab {
        debug_assert_eq!(self.ptrs.len(), self.lens.len());
        &self.raw
    }
}
