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
    /// The stages that enforce them (`token_controls`, `reasoning_budget`),
    /// empty when nothing must be masked.
    pub stages: Vec<StageSpec>,
}

impl Controls {
    /// `chain` with the controls' stage first (unchanged without one).
    pub fn prepend_to(&self, chain: &ChainSpec) -> Option<ChainSpec> {
        if self.stages.is_empty() {
            return None;
        }
        let mut stages = self.stages.clone();
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
    let mut stages = Vec::new();
    if !params.is_empty() {
        stages.push(StageSpec {
            name: STAGE.to_string(),
            params,
        });
    }
    stages.extend(reasoning(cfg, req, vocab, tokenizer)?);
    Ok(Controls {
        min_tokens: req.min_tokens,
        stop_token_ids,
        stages,
    })
}

/// The `reasoning_budget` stage of `reasoning_budget` /
/// `reasoning_budget_message`, with the model's markers: the vocabulary's
/// `<think>` and `</think>` tokens, else `generate.reasoning_markers`.
fn reasoning(
    cfg: &GenerateConfig,
    req: &v1::GenerateRequest,
    vocab: Option<&Vocabulary>,
    tokenizer: Option<&dyn TextCodec>,
) -> Result<Option<StageSpec>, RequestError> {
    let Some(budget) = req.reasoning_budget else {
        if !req.reasoning_budget_message.is_empty() {
            return Err(RequestError::invalid(
                "reasoning_budget_message",
                "is set without reasoning_budget: set the budget it is forced at",
            ));
        }
        return Ok(None);
    };
    let message = &req.reasoning_budget_message;
    if message.len() > cfg.max_reasoning_message_bytes {
        return Err(RequestError::limit(
            "reasoning_budget_message",
            "generate.max_reasoning_message_bytes",
            format!(
                "is {} bytes, longer than the limit of {} (generate.max_reasoning_message_bytes)",
                message.len(),
                cfg.max_reasoning_message_bytes
            ),
        ));
    }
    let no_markers = || {
        RequestError::invalid(
            "reasoning_budget",
            format!(
                "is {budget}, but the model has no reasoning markers: its vocabulary has no \
                 <think> / </think> tokens and generate.reasoning_markers is not set"
            ),
        )
    };
    let special = |text: &[u8]| {
        vocab.and_then(|v| (0..v.len() as u32).find(|&t| v.token_bytes(t) == Some(text)))
    };
    let encode = |field: &str, text: &str, parse_special: bool| {
        let tok = tokenizer.ok_or_else(no_markers)?;
        tok.encode(text, false, parse_special).map_err(|e| {
            RequestError::invalid(
                field,
                samplerd_sampling::echo::foreign(&e.to_string()).into_owned(),
            )
        })
    };
    let (open, close) = match (special(b"<think>"), special(b"</think>")) {
        (Some(o), Some(c)) => (vec![o], vec![c]),
        _ => match cfg.reasoning_markers.as_slice() {
            [o, c] => (
                encode("reasoning_budget", o, true)?,
                encode("reasoning_budget", c, true)?,
            ),
            _ => return Err(no_markers()),
        },
    };
    if open.is_empty() || close.is_empty() {
        return Err(no_markers());
    }
    let message = encode("reasoning_budget_message", message, false)?;
    let ids = |s: &[u32]| s.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
    let mut params = std::collections::BTreeMap::new();
    params.insert("open".to_string(), ParamValue::String(ids(&open)));
    params.insert("close".to_string(), ParamValue::String(ids(&close)));
    params.insert("budget".to_string(), ParamValue::Number(f64::from(budget)));
    params.insert("message".to_string(), ParamValue::String(ids(&message)));
    Ok(Some(StageSpec {
        name: "reasoning_budget".to_string(),
        params,
    }))
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
