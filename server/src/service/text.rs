//! `Tokenize` and `Detokenize`: text to token ids and back, with the
//! model's tokenizer or a named vocabulary's (`[vocabularies]`, as
//! `params.vocabulary` names one).
//!
//! Bounds: a text is held to `generate.max_prompt_bytes` (the tokenizer's
//! time and memory grow with it: ~0.5 s and ~40 MB per MB on one core),
//! and its tokenizer's peak is charged to `limits.memory_budget_bytes` as
//! Generate's prompt is; ids to the same number (a token stands for at
//! least one byte of text, so every text Tokenize accepts comes back), and
//! the text they make to `limits.max_message_bytes`.

#![forbid(unsafe_code)]

use std::sync::Arc;

use samplerd_api::v1;
use samplerd_model::{TextCodec, Utf8Streamer, attr};
use samplerd_sampling::echo::{self, MAX_ECHO_BYTES};
use tonic::Status;

use super::state::AppState;
use crate::generate::generator::NO_MODEL_MESSAGE;
use crate::request::errors::{InvalidKind, RequestError};
use crate::request::memory::TOKENIZER_BYTES_PER_PROMPT_BYTE;
use crate::status::{Reason, status};

/// The limit a Tokenize text and a Detokenize id list are held to.
const TEXT_LIMIT_KEY: &str = "generate.max_prompt_bytes";

/// The tokenizer a request names in `vocabulary` (the field at
/// `field`), or the model's when it is empty.
fn tokenizer(state: &AppState, name: &str, field: &str) -> Result<Arc<dyn TextCodec>, Status> {
    if !name.is_empty() {
        return state.vocabularies.tokenizer(name).cloned().ok_or_else(|| {
            RequestError::invalid_as(
                InvalidKind::UnknownVocabulary(echo::excerpt(name, MAX_ECHO_BYTES).into_owned()),
                field,
                format!(
                    "no vocabulary named {:?} is loaded (loaded: {}; config [vocabularies])",
                    echo::excerpt(name, MAX_ECHO_BYTES),
                    state.vocabularies.describe()
                ),
            )
            .into()
        });
    }
    let Some(generator) = state.generator.as_ref() else {
        return Err(status(
            Reason::NoModel,
            format!(
                "{field} is empty, which means the model's tokenizer, but {NO_MODEL_MESSAGE}; \
                 or name a loaded vocabulary (loaded: {})",
                state.vocabularies.describe()
            ),
        ));
    };
    if !generator.ready() {
        return Err(status(Reason::ModelLoading, "the model is still loading"));
    }
    generator
        .tokenizer()
        .ok_or_else(|| Status::internal("the model host has no tokenizer"))
}

/// The `Tokenize` RPC. The tokenizer runs on the sampling pool under its
/// watchdog, as Generate's prompt does: a long text never holds a runtime
/// worker.
pub async fn tokenize(
    state: Arc<AppState>,
    req: v1::TokenizeRequest,
) -> Result<v1::TokenizeResponse, Status> {
    let max = state.generate.max_prompt_bytes;
    if req.text.len() > max {
        return Err(RequestError::limit(
            "text",
            TEXT_LIMIT_KEY,
            format!(
                "{} bytes exceed the limit of {max} ({TEXT_LIMIT_KEY})",
                req.text.len()
            ),
        )
        .into());
    }
    let codec = tokenizer(&state, &req.vocabulary, "vocabulary")?;
    let _charge = state.memory.charge(
        req.text.len() * TOKENIZER_BYTES_PER_PROMPT_BYTE,
        "this Tokenize request",
    )?;
    let tokens = state
        .steps
        .run(move || {
            // Named for the watchdog, as Generate's prompt tokenization.
            static TOKENIZER: std::sync::LazyLock<Arc<str>> =
                std::sync::LazyLock::new(|| Arc::from("(Tokenize)"));
            samplerd_sampling::activity::entering(&TOKENIZER);
            codec
                .encode(&req.text, req.add_special, req.parse_special)
                .map_err(|e| {
                    RequestError::invalid("text", echo::foreign(&e.to_string()).into_owned())
                })
        })
        .await
        .map_err(RequestError::from)??;
    Ok(v1::TokenizeResponse { tokens })
}

/// The `Detokenize` RPC: each id's bytes in order, made text as
/// Generate's streamer makes it (a character cut between tokens is joined;
/// bytes that are no UTF-8 become U+FFFD). Control tokens are their text
/// (`<|im_end|>`) unless `skip_special`, as llama-server's `/detokenize`.
pub fn detokenize(
    state: &AppState,
    req: &v1::DetokenizeRequest,
) -> Result<v1::DetokenizeResponse, Status> {
    let max = state.generate.max_prompt_bytes;
    if req.tokens.len() > max {
        return Err(RequestError::limit(
            "tokens",
            TEXT_LIMIT_KEY,
            format!(
                "{} tokens exceed the limit of {max} ({TEXT_LIMIT_KEY})",
                req.tokens.len()
            ),
        )
        .into());
    }
    let codec = tokenizer(state, &req.vocabulary, "vocabulary")?;
    let vocab = codec.vocabulary();
    let skipped = |t: &samplerd_model::TokenInfo| {
        req.skip_special && t.attrs & (attr::CONTROL | attr::UNUSED) != 0
    };
    let mut len = 0usize;
    for (i, &id) in req.tokens.iter().enumerate() {
        let Some(t) = vocab.get(id as usize) else {
            return Err(RequestError::invalid(
                format!("tokens[{i}]"),
                format!(
                    "token id {id} is outside the vocabulary of {} tokens",
                    vocab.len()
                ),
            )
            .into());
        };
        if !skipped(t) {
            len += t.bytes.len();
        }
    }
    if len > state.limits.max_message_bytes {
        return Err(RequestError::limit(
            "tokens",
            "limits.max_message_bytes",
            format!(
                "the text is {len} bytes, above the limit of {} (limits.max_message_bytes)",
                state.limits.max_message_bytes
            ),
        )
        .into());
    }
    let mut bytes = Vec::with_capacity(len);
    for &id in &req.tokens {
        let t = &vocab[id as usize];
        if !skipped(t) {
            bytes.extend_from_slice(&t.bytes);
        }
    }
    let mut utf8 = Utf8Streamer::new();
    let mut text = utf8.push(&bytes);
    text.push_str(&utf8.finish());
    Ok(v1::DetokenizeResponse { text })
}
