//! Generate's token controls — `min_tokens`, `stop_token_ids`,
//! `bad_words` — checked under their `generate.*` limits and turned into
//! what enforces them: the ids that end a generation (for the decode
//! loop's stop check) and the `token_controls` stage the chain runs first
//! (the masking, with per-sequence state, so a decode step, a resumed run
//! and each verified position of a speculative step mask alike).

#![forbid(unsafe_code)]

use samplerd_api::v1;
use samplerd_model::TextCodec;
use samplerd_sampling::echo::quote;
use samplerd_sampling::spec::{ChainSpec, ParamValue, StageSpec};
use samplerd_sampling::{Vocabulary, vocab::token_attr};

use crate::generate::GenerateConfig;
use crate::request::errors::{InvalidKind, RequestError};

/// The registered name of the stage that masks for the controls.
pub const STAGE: &str = "token_controls";

/// A request's token controls, checked.
#[derive(Debug, Default)]
pub struct Controls {
    /// `min_tokens` (0: off).
    pub min_tokens: u32,
    /// `stop_token_ids`, inside the vocabulary.
    pub stop_token_ids: Vec<u32>,
    /// The `token_controls` stage, when anything must be masked.
    pub stage: Option<StageSpec>,
}

impl Controls {
    /// `chain` with the controls' stage first (unchanged without one).
    pub fn prepend_to(&self, chain: &ChainSpec) -> Option<ChainSpec> {
        let stage = self.stage.clone()?;
        let mut stages = Vec::with_capacity(chain.stages.len() + 1);
        stages.push(stage);
        stages.extend(chain.stages.iter().cloned());
        Some(ChainSpec { stages })
    }
}

/// Checks the controls of `req` (whose `max_tokens` resolved to
/// `max_tokens`); `vocab` gives the end-of-generation ids, `tokenizer`
/// the tokens of the bad words.
pub fn controls(
    cfg: &GenerateConfig,
    req: &v1::GenerateRequest,
    max_tokens: u32,
    vocab: Option<&Vocabulary>,
    tokenizer: Option<&dyn TextCodec>,
) -> Result<Controls, RequestError> {
    if req.min_tokens > max_tokens {
        return Err(RequestError::invalid_as(
            InvalidKind::OutOfRange,
            "min_tokens",
            format!(
                "{} exceeds max_tokens ({max_tokens}): a generation cannot make more than \
                 max_tokens tokens",
                req.min_tokens
            ),
        ));
    }
    let stop_token_ids = stop_token_ids(cfg, req, vocab)?;
    let bad_words = bad_words(cfg, req, tokenizer)?;
    let mut params = std::collections::BTreeMap::new();
    if req.min_tokens > 0 {
        // vLLM masks every id that would end the generation: the model's
        // end-of-generation tokens (which `ignore_eos` turns into text) and
        // the stop ids.
        let mut end: Vec<u32> = stop_token_ids.clone();
        if !req.ignore_eos
            && let Some(v) = vocab
        {
            end.extend((0..v.len() as u32).filter(|&t| v.token_attr(t) & token_attr::EOG != 0));
        }
        end.sort_unstable();
        end.dedup();
        params.insert(
            "min_tokens".to_string(),
            ParamValue::Number(f64::from(req.min_tokens)),
        );
        params.insert(
            "end_tokens".to_string(),
            ParamValue::StringList(end.iter().map(u32::to_string).collect()),
        );
    }
    if !bad_words.is_empty() {
        params.insert(
            "bad_words".to_string(),
            ParamValue::StringList(
                bad_words
                    .iter()
                    .map(|w| w.iter().map(u32::to_string).collect::<Vec<_>>().join(" "))
                    .collect(),
            ),
        );
    }
    Ok(Controls {
        min_tokens: req.min_tokens,
        stop_token_ids,
        stage: (!params.is_empty()).then(|| StageSpec {
            name: STAGE.to_string(),
            params,
        }),
    })
}

fn stop_token_ids(
    cfg: &GenerateConfig,
    req: &v1::GenerateRequest,
    vocab: Option<&Vocabulary>,
) -> Result<Vec<u32>, RequestError> {
    let ids = &req.stop_token_ids;
    if ids.len() > cfg.max_stop_token_ids {
        return Err(RequestError::limit(
            "stop_token_ids",
            "generate.max_stop_token_ids",
            format!(
                "{} ids exceed the limit of {} (generate.max_stop_token_ids)",
                ids.len(),
                cfg.max_stop_token_ids
            ),
        ));
    }
    if let Some(v) = vocab
        && let Some((i, id)) = ids
            .iter()
            .enumerate()
            .find(|&(_, &id)| id as usize >= v.len())
    {
        return Err(RequestError::invalid(
            format!("stop_token_ids[{i}]"),
            format!(
                "token id {id} is outside the model's vocabulary of {} tokens",
                v.len()
            ),
        ));
    }
    let mut ids = ids.clone();
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

/// The token sequences of the bad words, as vLLM's
/// `SamplingParams.update_from_tokenizer` (vllm/sampling_params.py) makes
/// them: each word with its leading whitespace dropped, tokenized without
/// special tokens; then with one leading space, kept when that gives as
/// many tokens, starting with another one (a word-initial token).
fn bad_words(
    cfg: &GenerateConfig,
    req: &v1::GenerateRequest,
    tokenizer: Option<&dyn TextCodec>,
) -> Result<Vec<Vec<u32>>, RequestError> {
    let words = &req.bad_words;
    if words.is_empty() {
        return Ok(Vec::new());
    }
    if words.len() > cfg.max_bad_words {
        return Err(RequestError::limit(
            "bad_words",
            "generate.max_bad_words",
            format!(
                "{} words exceed the limit of {} (generate.max_bad_words)",
                words.len(),
                cfg.max_bad_words
            ),
        ));
    }
    for (i, w) in words.iter().enumerate() {
        if w.len() > cfg.max_bad_word_bytes {
            return Err(RequestError::limit(
                format!("bad_words[{i}]"),
                "generate.max_bad_word_bytes",
                format!(
                    "is {} bytes, longer than the limit of {} (generate.max_bad_word_bytes)",
                    w.len(),
                    cfg.max_bad_word_bytes
                ),
            ));
        }
        if w.trim_start().is_empty() {
            return Err(RequestError::invalid(
                format!("bad_words[{i}]"),
                format!("is {}: a bad word needs a non-blank character", quote(w)),
            ));
        }
    }
    let Some(tok) = tokenizer else {
        return Err(RequestError::invalid(
            "bad_words",
            "the model has no tokenizer to turn them into tokens",
        ));
    };
    let encode = |i: usize, text: &str| {
        tok.encode(text, false, false).map_err(|e| {
            RequestError::invalid(
                format!("bad_words[{i}]"),
                samplerd_sampling::echo::foreign(&e.to_string()).into_owned(),
            )
        })
    };
    let mut out: Vec<Vec<u32>> = Vec::with_capacity(words.len() * 2);
    for (i, w) in words.iter().enumerate() {
        let word = w.trim_start();
        let plain = encode(i, word)?;
        if plain.is_empty() {
            return Err(RequestError::invalid(
                format!("bad_words[{i}]"),
                format!("{} tokenizes to no tokens", quote(w)),
            ));
        }
        let spaced = encode(i, &format!(" {word}"))?;
        let keep = spaced.first() != plain.first() && spaced.len() == plain.len();
        out.push(plain);
        if keep {
            out.push(spaced);
        }
    }
    Ok(out)
}
