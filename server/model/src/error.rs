//! The crate's error type: every variant names the file, tensor, key or value at fault.

#![forbid(unsafe_code)]

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model file {path}: not found")]
    NotFound { path: PathBuf },
    #[error("model file {path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("model file {path}: not a valid GGUF file (bad magic or header): {reason}")]
    NotGguf { path: PathBuf, reason: String },
    #[error("model file {path}: truncated or corrupt: {reason}")]
    Truncated { path: PathBuf, reason: String },
    #[error("model file {path}: unsupported architecture {arch:?} (supported: {supported})")]
    UnsupportedArchitecture {
        path: PathBuf,
        arch: String,
        /// Every supported architecture (`Arch::SUPPORTED`).
        supported: &'static str,
    },
    #[error("model file {path}: metadata key {key}: {problem}")]
    Metadata {
        path: PathBuf,
        key: String,
        problem: String,
    },
    #[error("model file {path}: tensor {tensor}: {problem}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        problem: String,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("token id {id} is out of range (vocabulary has {n_vocab} tokens)")]
    TokenOutOfRange { id: u32, n_vocab: usize },
    #[error(
        "context full: position {position} + {n_tokens} tokens exceeds the session's {capacity}-token context"
    )]
    ContextFull {
        position: usize,
        n_tokens: usize,
        capacity: usize,
    },
    #[error("empty token list given to prefill")]
    EmptyInput,
    #[error("backend: {0}")]
    Backend(String),
    /// The device has too little free memory for an allocation (a
    /// sequence's KV cache or scratch): retryable once others finish.
    #[error("device memory: {0}")]
    DeviceMemory(String),
}
