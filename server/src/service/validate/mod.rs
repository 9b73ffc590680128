//! Request validation, in one place: each sampling request becomes a typed
//! value here and nothing downstream checks it again.
//!
//! - [`sample`] — a `Sample` request → [`ValidStart`]: the step
//!   ([`ValidStep`]: one encoding of the logits under `limits.max_vocab`,
//!   the step index, which probabilities to report under
//!   `limits.max_n_probs`), the built chain and seed, and the window
//!   (`previous_tokens` under `limits.max_window_tokens`, ids outside the
//!   vocabulary dropped as llama.cpp does).
//! - [`stream_start`] / [`stream_step`] — the first message of a
//!   `SampleStream` (as `Sample`, the step counter starting at
//!   `first_step`) and every later one (no window; the vocabulary of the
//!   first).
//! - [`stream_verify`] — a later `SampleStream` message that carries a
//!   `Verify` (speculative verification, [`verify`]); a first message
//!   with one is refused by [`stream_start`].
//! - [`generate`] — a `Generate` request → [`ValidGenerate`]: the prompt
//!   (text, or chat messages with known roles) under
//!   `generate.max_prompt_bytes`, `max_tokens` under
//!   `generate.max_tokens_cap`, the stop strings under their limits,
//!   `resume.token_ids` (at most `max_tokens`, inside the vocabulary), the
//!   token controls ([`controls`]: `min_tokens`, `stop_token_ids`,
//!   `bad_words`, enforced by a `token_controls` stage put first in the
//!   chain), `speculation` (a known source, `max_draft_tokens` under
//!   `limits.max_draft_tokens`), `n` and `return_logits`, and the sampling
//!   side as above. What needs the model (the chat template, the
//!   token count against `generate.max_prompt_tokens` and the context) is
//!   the model host's, after admission.
//!
//! Every error names the request field path, the value and, for a limit,
//! its configuration key. A stage parameter's range is the stage's to
//! check: its message comes back through the chain build, naming the field.
//! Chain builds call into plugins, so these run on the sampling pool.

#![forbid(unsafe_code)]

use std::sync::Arc;

use samplerd_api::v1;
use samplerd_sampling::echo::{self, MAX_ECHO_BYTES, quote};
use samplerd_sampling::params::{CONSTRAINT_STAGE, canonical_stage_name};
use samplerd_sampling::{Chain, ChainError, Prebuilt, Sequence, Vocabulary, step};

use samplerd_model::ChatMessage;

use crate::generate::GenerateConfig;
use crate::generate::generator::{DraftSource, Prompt, Speculation, ValidGenerate};
use crate::generate::returned_logits::ReturnLogits;
use crate::request::convert::{self, LogitsInput};
use crate::request::errors::{InvalidKind, RequestError, chain_error_kind};
use crate::service::state::AppState;
use row_logits::RowLogits;

pub mod batch;
pub mod controls;
pub mod row_logits;
pub mod sparse;
pub mod verify;

/// One step's inputs.
#[derive(Clone, Copy, Debug)]
pub struct ValidStep<'a> {
    pub logits: LogitsInput<'a>,
    /// The step index (the RNG's stream).
    pub step: u64,
    pub probs: step::ProbsRequest,
}

/// A `Sample` request, or the first message of a `SampleStream`.
pub struct ValidStart<'a> {
    pub step: ValidStep<'a>,
    pub chain: Chain,
    pub seed: u64,
    /// `previous_tokens` inside the vocabulary, oldest first.
    pub window: Vec<u32>,
    /// `constraint_tokens`: the output so far, replayed into the
    /// output-only stages (the constraint's grammar).
    pub output: Vec<u32>,
}

impl ValidStart<'_> {
    /// A fresh sequence of the chain with the window accepted.
    pub fn open_sequence(&self) -> Result<Sequence, RequestError> {
        let field = self.step.logits.field();
        let mut seq = self
            .chain
            .new_sequence()
            .map_err(|e| RequestError::from_sample(e, field))?;
        seq.accept_history(&self.window)
            .map_err(|e| RequestError::from_sample(e, field))?;
        seq.accept_output(&self.output)
            .map_err(|e| RequestError::invalid("constraint_tokens", e.to_string()))?;
        Ok(seq)
    }
}

/// A `Sample` request, its constraint compiled beforehand (`prebuilt`:
/// `AppState::prepare_constraints`).
pub fn sample<'a>(
    state: &AppState,
    req: &'a v1::SampleRequest,
    prebuilt: &'a Prebuilt,
    shared: Option<&'a RowLogits<'a>>,
) -> Result<ValidStart<'a>, RequestError> {
    start(
        state,
        Fields {
            logits: row_logits::step_logits(
                &req.logits,
                &req.logits_f32le,
                req.sparse.as_ref(),
                shared,
                state.limits.max_vocab,
            )?,
            previous_tokens: &req.previous_tokens,
            params: req.params.as_ref(),
            step: req.step,
            n_probs: req.n_probs,
            post_sampling_probs: req.post_sampling_probs,
            constraint_tokens: &req.constraint_tokens,
            prebuilt,
        },
    )
}

/// The first message of a `SampleStream`.
pub fn stream_start<'a>(
    state: &AppState,
    msg: &'a v1::SampleStreamRequest,
    prebuilt: &'a Prebuilt,
    shared: Option<&'a RowLogits<'a>>,
) -> Result<ValidStart<'a>, RequestError> {
    if let Some(v) = &msg.verify {
        return Err(RequestError::invalid(
            "verify",
            format!(
                "is set on the stream's first message ({} draft tokens): the first message \
                 opens the sequence with one step; send verify from the second message on",
                v.draft_tokens.len()
            ),
        ));
    }
    start(
        state,
        Fields {
            logits: row_logits::step_logits(
                &msg.logits,
                &msg.logits_f32le,
                msg.sparse.as_ref(),
                shared,
                state.limits.max_vocab,
            )?,
            previous_tokens: &msg.previous_tokens,
            params: msg.params.as_ref(),
            step: msg.first_step,
            n_probs: msg.n_probs,
            post_sampling_probs: msg.post_sampling_probs,
            constraint_tokens: &msg.constraint_tokens,
            prebuilt,
        },
    )
}

/// A later message of a `SampleStream` whose first message had `n_vocab`
/// logits; `step` is the stream's counter.
pub fn stream_step<'a>(
    state: &AppState,
    msg: &'a v1::SampleStreamRequest,
    n_vocab: usize,
    step: u64,
    shared: Option<&'a RowLogits<'a>>,
) -> Result<ValidStep<'a>, RequestError> {
    let logits = row_logits::step_logits(
        &msg.logits,
        &msg.logits_f32le,
        msg.sparse.as_ref(),
        shared,
        state.limits.max_vocab,
    )?;
    for (field, tokens, what) in [
        ("previous_tokens", &msg.previous_tokens, "the window"),
        (
            "constraint_tokens",
            &msg.constraint_tokens,
            "the constraint's output",
        ),
    ] {
        if !tokens.is_empty() {
            return Err(RequestError::invalid(
                field,
                format!(
                    "only the first message of a stream may set {what} (got {} tokens at step {step})",
                    tokens.len(),
                ),
            ));
        }
    }
    if logits.len() != n_vocab {
        return Err(RequestError::invalid(
            logits.len_field(),
            format!(
                "vocabulary changed within the stream: {} logits, the first message had {n_vocab}",
                logits.len(),
            ),
        ));
    }
    Ok(ValidStep {
        logits,
        step,
        probs: probs(state, msg.n_probs, msg.post_sampling_probs)?,
    })
}

/// A later message of a `SampleStream` that carries a `Verify`, for a
/// stream of `n_vocab` logits running `seq`.
pub fn stream_verify<'a>(
    state: &AppState,
    msg: &'a v1::SampleStreamRequest,
    v: &'a v1::Verify,
    n_vocab: usize,
    seq: &Sequence,
    shared: verify::SharedRows<'a>,
) -> Result<verify::ValidVerify<'a>, RequestError> {
    verify::no_step_logits(&[
        (!msg.logits.is_empty(), "logits"),
        (!msg.logits_f32le.is_empty(), "logits_f32le"),
        (msg.sparse.is_some(), "sparse"),
        (msg.shared.is_some(), "shared"),
        (!msg.previous_tokens.is_empty(), "previous_tokens"),
        (!msg.constraint_tokens.is_empty(), "constraint_tokens"),
    ])?;
    let probs = probs(state, msg.n_probs, msg.post_sampling_probs)?;
    verify::verify(
        state,
        v,
        row_logits::Dtype::F32le,
        n_vocab,
        seq,
        probs,
        shared,
    )
}

/// A `Generate` request, the chain built with the model's vocabulary (for
/// stages that need it). The cheap size checks come first, so an
/// oversized prompt is refused before any chain is built.
pub fn generate(
    state: &AppState,
    req: &v1::GenerateRequest,
    vocab: Option<Arc<Vocabulary>>,
    tokenizer: Option<Arc<dyn samplerd_model::TextCodec>>,
    prebuilt: &Prebuilt,
) -> Result<ValidGenerate, RequestError> {
    let cfg = &state.generate;
    let prompt = prompt(cfg, req)?;
    let max_tokens = match req.max_tokens {
        None => cfg.default_max_tokens,
        Some(0) => {
            return Err(RequestError::invalid_as(
                InvalidKind::OutOfRange,
                "max_tokens",
                "must be at least 1, got 0",
            ));
        }
        Some(n) if n > cfg.max_tokens_cap => {
            return Err(RequestError::limit(
                "max_tokens",
                "generate.max_tokens_cap",
                format!(
                    "{n} exceeds the cap of {} (generate.max_tokens_cap)",
                    cfg.max_tokens_cap
                ),
            ));
        }
        Some(n) => n,
    };
    if req.stop.len() > cfg.max_stop_strings {
        return Err(RequestError::limit(
            "stop",
            "generate.max_stop_strings",
            format!(
                "{} stop strings exceed the limit of {} (generate.max_stop_strings)",
                req.stop.len(),
                cfg.max_stop_strings
            ),
        ));
    }
    for (i, s) in req.stop.iter().enumerate() {
        if s.is_empty() {
            return Err(RequestError::invalid(format!("stop[{i}]"), "is empty"));
        }
        if s.len() > cfg.max_stop_bytes {
            return Err(RequestError::limit(
                format!("stop[{i}]"),
                "generate.max_stop_bytes",
                format!(
                    "is {} bytes, longer than the limit of {} (generate.max_stop_bytes)",
                    s.len(),
                    cfg.max_stop_bytes
                ),
            ));
        }
    }
    let probs = probs(state, req.n_probs, req.post_sampling_probs)?;
    if let Some(name) = req
        .params
        .as_ref()
        .map(|p| p.vocabulary.as_str())
        .filter(|n| !n.is_empty())
    {
        return Err(RequestError::invalid(
            "params.vocabulary",
            format!(
                "is {}, but Generate always uses the model's vocabulary: leave it empty",
                quote(name)
            ),
        ));
    }
    let n_vocab = vocab.as_ref().map(|v| v.len());
    let resume = resume(req, max_tokens, n_vocab)?;
    let choices = choices(state, req)?;
    let return_logits = return_logits(req, n_vocab)?;
    let speculation = speculation(state, req.speculation.as_ref())?;
    let controls =
        controls::controls(cfg, req, max_tokens, vocab.as_deref(), tokenizer.as_deref())?;
    let (mut chain, seed) = sampling(state, req.params.as_ref(), vocab.clone(), n_vocab, prebuilt)?;
    if let Some(spec) = controls.prepend_to(chain.spec()) {
        chain = state
            .registry
            .build_chain_with(&spec, vocab, prebuilt)
            .map_err(|e| RequestError::from_chain(e, true))?;
    }
    Ok(ValidGenerate {
        choices,
        return_logits,
        chain,
        seed,
        probs,
        prompt,
        max_tokens,
        stop: req.stop.clone(),
        ignore_eos: req.ignore_eos,
        penalize_prompt: req.penalize_prompt.unwrap_or(true),
        min_tokens: controls.min_tokens,
        stop_token_ids: controls.stop_token_ids,
        resume,
        speculation,
        prompt_logprobs: prompt_logprobs(cfg, req)?,
    })
}

/// `prompt_logprobs`: at most `generate.max_prompt_logprobs`.
fn prompt_logprobs(
    cfg: &GenerateConfig,
    req: &v1::GenerateRequest,
) -> Result<Option<u32>, RequestError> {
    match req.prompt_logprobs {
        Some(n) if n > cfg.max_prompt_logprobs => Err(RequestError::limit(
            "prompt_logprobs",
            "generate.max_prompt_logprobs",
            format!(
                "{n} exceeds the limit of {} (generate.max_prompt_logprobs)",
                cfg.max_prompt_logprobs
            ),
        )),
        n => Ok(n),
    }
}

/// `return_logits`: a listed `dtype`; `top_n` at most the vocabulary.
fn return_logits(
    req: &v1::GenerateRequest,
    n_vocab: Option<usize>,
) -> Result<Option<ReturnLogits>, RequestError> {
    let Some(r) = &req.return_logits else {
        return Ok(None);
    };
    let Ok(dtype) = v1::LogitsDtype::try_from(r.dtype) else {
        return Err(RequestError::invalid(
            "return_logits.dtype",
            format!(
                "is {}, not a LogitsDtype (F32LE 1, F16LE 2, BF16LE 3)",
                r.dtype
            ),
        ));
    };
    let top = r.top_n as usize;
    match n_vocab {
        Some(n) if top > n => Err(RequestError::invalid(
            "return_logits.top_n",
            format!("{top} is more than the vocabulary's {n} tokens"),
        )),
        _ if top > 0 && dtype != v1::LogitsDtype::Unspecified => Err(RequestError::invalid(
            "return_logits.dtype",
            "is for the full row; with top_n the values are f32 (leave dtype unset)",
        )),
        _ if top > 0 => Ok(Some(ReturnLogits::Top(top))),
        _ => Ok(Some(ReturnLogits::Full(dtype))),
    }
}

/// `n`: 1 (unset) to `limits.max_choices`, and 1 with `resume` (whose
/// tokens are one choice's).
fn choices(state: &AppState, req: &v1::GenerateRequest) -> Result<u32, RequestError> {
    let max = state.limits.max_choices;
    match req.n {
        0 | 1 => Ok(1),
        n if n as usize > max => Err(RequestError::limit(
            "n",
            "limits.max_choices",
            format!("{n} choices exceed the limit of {max} (limits.max_choices)"),
        )),
        n if req.resume.is_some() => Err(RequestError::invalid(
            "resume",
            format!(
                "resumes one choice, but n is {n}: resume each choice as its own n = 1 request with seed + i"
            ),
        )),
        n => Ok(n),
    }
}

/// `speculation`: a known source (unset: off), `max_draft_tokens` within
/// `limits.max_draft_tokens` (0: that limit). Whether a draft model is
/// configured is the model host's to say.
fn speculation(
    state: &AppState,
    spec: Option<&v1::Speculation>,
) -> Result<Option<Speculation>, RequestError> {
    let Some(spec) = spec else { return Ok(None) };
    let source = match v1::DraftSource::try_from(spec.source) {
        Ok(v1::DraftSource::Unspecified) => return Ok(None),
        Ok(v1::DraftSource::PromptLookup) => DraftSource::PromptLookup,
        Ok(v1::DraftSource::Model) => DraftSource::Model,
        Err(_) => {
            return Err(RequestError::invalid(
                "speculation.source",
                format!("unknown DraftSource {}", spec.source),
            ));
        }
    };
    let max = state.limits.max_draft_tokens;
    let max_draft_tokens = match spec.max_draft_tokens as usize {
        0 => max,
        n if n > max => {
            return Err(RequestError::limit(
                "speculation.max_draft_tokens",
                "limits.max_draft_tokens",
                format!("{n} exceeds the limit of {max} (limits.max_draft_tokens)"),
            ));
        }
        n => n,
    };
    Ok(Some(Speculation {
        source,
        max_draft_tokens,
    }))
}

/// `resume.token_ids`: no more than `max_tokens` (the uninterrupted run
/// sent at most that many), each inside the model's vocabulary.
fn resume(
    req: &v1::GenerateRequest,
    max_tokens: u32,
    n_vocab: Option<usize>,
) -> Result<Vec<u32>, RequestError> {
    let Some(resume) = &req.resume else {
        return Ok(Vec::new());
    };
    let ids = &resume.token_ids;
    if ids.len() > max_tokens as usize {
        return Err(RequestError::invalid(
            "resume.token_ids",
            format!(
                "{} tokens, but max_tokens is {max_tokens}: a generation sends at most max_tokens \
                 (resend the interrupted request's max_tokens)",
                ids.len()
            ),
        ));
    }
    if let Some(n) = n_vocab
        && let Some((i, id)) = ids.iter().enumerate().find(|&(_, &id)| id as usize >= n)
    {
        return Err(RequestError::invalid(
            format!("resume.token_ids[{i}]"),
            format!("token id {id} is outside the model's vocabulary of {n} tokens"),
        ));
    }
    Ok(ids.clone())
}

/// Exactly one of `prompt` and `messages` (known roles), its text under
/// `generate.max_prompt_bytes`: the bound on the tokenizer's work and
/// memory, checked before any of it (the copy made here is bounded by
/// `generate.max_request_bytes`).
fn prompt(cfg: &GenerateConfig, req: &v1::GenerateRequest) -> Result<Prompt, RequestError> {
    let prompt = match (req.prompt.is_empty(), req.messages.is_empty()) {
        (true, true) => {
            return Err(RequestError::invalid(
                "prompt",
                "is empty and no messages were given: set one of prompt or messages",
            ));
        }
        (false, false) => {
            return Err(RequestError::invalid(
                "messages",
                "both prompt and messages are set: set exactly one",
            ));
        }
        (false, true) => Prompt::Text(req.prompt.clone()),
        (true, false) => {
            let mut msgs = Vec::with_capacity(req.messages.len());
            for (i, m) in req.messages.iter().enumerate() {
                if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "tool") {
                    return Err(RequestError::invalid(
                        format!("messages[{i}].role"),
                        format!(
                            "unknown role {} (system, user, assistant or tool)",
                            quote(&m.role)
                        ),
                    ));
                }
                msgs.push(ChatMessage::new(m.role.clone(), m.content.clone()));
            }
            Prompt::Chat(msgs)
        }
    };
    let bytes = prompt.bytes();
    if bytes > cfg.max_prompt_bytes {
        let field = match prompt {
            Prompt::Text(_) => "prompt",
            Prompt::Chat(_) => "messages",
        };
        return Err(RequestError::limit(
            field,
            "generate.max_prompt_bytes",
            format!(
                "{bytes} bytes exceed the limit of {} (generate.max_prompt_bytes)",
                cfg.max_prompt_bytes
            ),
        ));
    }
    Ok(prompt)
}

/// The chain and seed for a request's parameters: `chain` when given,
/// else the typed fields over the configured defaults, else the default
/// chain (prebuilt); the seed is the request's or the configured one.
/// A `constraint` stage comes compiled in `prebuilt` (never compiled here,
/// on a sampling thread: `service/constraint`).
/// Token maps (`logit_bias`, a stage's token_map) hold at most `n_vocab`
/// entries, each id inside it, when the vocabulary is known (`None`: at
/// most `limits.max_vocab` entries).
pub fn sampling(
    state: &AppState,
    p: Option<&v1::SamplingParams>,
    vocab: Option<Arc<Vocabulary>>,
    n_vocab: Option<usize>,
    prebuilt: &Prebuilt,
) -> Result<(Chain, u64), RequestError> {
    let defaults = &state.defaults;
    let seed = p
        .and_then(|p| p.seed)
        .unwrap_or_else(|| defaults.default_seed());
    let Some(p) = p else {
        return Ok((defaults.chain.clone(), seed));
    };
    if p.constraint.as_ref().is_some_and(|c| c.kind.is_none()) {
        // An empty oneof is not "no constraint": the client meant one and
        // would otherwise get unconstrained output.
        return Err(RequestError::invalid(
            "params.constraint",
            "is set but has no kind: set one of json_schema, regex, lark, gbnf, json_object \
             or choice, or leave params.constraint unset",
        ));
    }
    if let Some(c) = &p.constraint {
        check_json_whitespace(c)?;
        check_triggers(c, &state.limits, n_vocab)?;
    }
    for (field, n) in [
        ("params.chain", p.chain.len()),
        ("params.samplers", p.samplers.len()),
    ] {
        if n > defaults.max_chain_stages {
            return Err(RequestError::limit(
                field,
                "limits.max_chain_stages",
                format!(
                    "{n} stages exceed the limit of {} (limits.max_chain_stages)",
                    defaults.max_chain_stages
                ),
            ));
        }
    }
    let constraint = p
        .constraint
        .as_ref()
        .and_then(convert::constraint_from_proto);
    if let Some(c) = &constraint {
        if !p.chain.is_empty() {
            return Err(RequestError::invalid(
                "params.constraint",
                "is set with an explicit params.chain: name the `constraint` stage in the chain instead",
            ));
        }
        let (bytes, max) = (c.text_bytes(), state.limits.max_constraint_bytes);
        if bytes > max {
            return Err(RequestError::limit(
                format!("params.constraint.{}", c.kind()),
                "limits.max_constraint_bytes",
                format!("{bytes} bytes exceed the limit of {max} (limits.max_constraint_bytes)"),
            ));
        }
    }
    let map_limit = TokenMapLimit {
        n_vocab,
        max_vocab: state.limits.max_vocab,
    };
    map_limit.check(
        "params.logit_bias",
        p.logit_bias.keys().copied(),
        p.logit_bias.len(),
    )?;
    map_limit.check(
        "params.penalty_exclude_tokens",
        p.penalty_exclude_tokens.iter().copied(),
        p.penalty_exclude_tokens.len(),
    )?;
    for (i, stage) in p.chain.iter().enumerate() {
        for (k, v) in &stage.params {
            if let Some(v1::param_value::Kind::TokenMap(m)) = &v.kind {
                map_limit.check(
                    &format!("params.chain[{i}].params[{}]", quote(k)),
                    m.entries.iter().map(|e| e.token_id),
                    m.entries.len(),
                )?;
            }
        }
    }
    let chain = if !p.chain.is_empty() {
        let spec = convert::chain_from_proto(&p.chain)?;
        state
            .registry
            .build_chain_with(&spec, vocab, prebuilt)
            .map_err(|e| RequestError::from_chain(e, true))?
    } else if let Some(merged) = convert::typed_params(&defaults.params, p, constraint) {
        state
            .registry
            .build_typed_with(&merged, vocab, prebuilt)
            .map_err(|e| match e {
                ChainError::Param { .. } => RequestError::from_chain(e, false),
                other if p.samplers.is_empty() => RequestError::from_chain(other, false),
                other => RequestError::invalid_as(
                    chain_error_kind(&other),
                    "params.samplers",
                    other.to_string(),
                ),
            })?
    } else {
        defaults.chain.clone()
    };
    Ok((chain, seed))
}

/// The bound on a request's token maps: no more entries than the
/// vocabulary has tokens, and every id inside it. Checked before the map is
/// copied anywhere (a map of millions of entries would otherwise be sorted
/// and handed to a stage).
struct TokenMapLimit {
    n_vocab: Option<usize>,
    max_vocab: usize,
}

impl TokenMapLimit {
    fn check(
        &self,
        field: &str,
        mut ids: impl Iterator<Item = u32>,
        len: usize,
    ) -> Result<(), RequestError> {
        let (bound, what) = match self.n_vocab {
            Some(n) => (n, format!("the vocabulary of {n} tokens")),
            None => (
                self.max_vocab,
                format!("the limit of {} (limits.max_vocab)", self.max_vocab),
            ),
        };
        if len > bound {
            let message = format!("{len} entries exceed {what}");
            return Err(match self.n_vocab {
                Some(_) => RequestError::invalid(field, message),
                None => RequestError::limit(field, "limits.max_vocab", message),
            });
        }
        if let Some(n) = self.n_vocab
            && let Some(id) = ids.find(|&id| id as usize >= n)
        {
            return Err(RequestError::invalid(
                field,
                format!("token id {id} is outside the vocabulary of {n} tokens"),
            ));
        }
        Ok(())
    }
}

/// The fields a `Sample` request, a stream's first message and a batch
/// row share (the logits already in one encoding, under
/// `limits.max_vocab`).
struct Fields<'a> {
    logits: LogitsInput<'a>,
    previous_tokens: &'a [u32],
    params: Option<&'a v1::SamplingParams>,
    step: u64,
    n_probs: u32,
    post_sampling_probs: bool,
    constraint_tokens: &'a [u32],
    /// The request's compiled constraint stages.
    prebuilt: &'a Prebuilt,
}

fn start<'a>(state: &AppState, f: Fields<'a>) -> Result<ValidStart<'a>, RequestError> {
    let limits = &state.limits;
    let logits = f.logits;
    for (field, tokens) in [
        ("previous_tokens", f.previous_tokens),
        ("constraint_tokens", f.constraint_tokens),
    ] {
        if tokens.len() > limits.max_window_tokens {
            return Err(RequestError::limit(
                field,
                "limits.max_window_tokens",
                format!(
                    "{} tokens exceed the limit of {} (limits.max_window_tokens)",
                    tokens.len(),
                    limits.max_window_tokens
                ),
            ));
        }
    }
    let constrained = f.params.is_some_and(|p| {
        p.constraint
            .as_ref()
            .is_some_and(convert::constraint_is_set)
            || p.chain.iter().any(|s| s.name == CONSTRAINT_STAGE)
    });
    if !f.constraint_tokens.is_empty() && !constrained {
        return Err(RequestError::invalid(
            "constraint_tokens",
            format!(
                "{} tokens given without a constraint (set params.constraint, or a `constraint` stage in params.chain)",
                f.constraint_tokens.len()
            ),
        ));
    }
    if let Some(&id) = f
        .constraint_tokens
        .iter()
        .find(|&&id| id as usize >= logits.len())
    {
        return Err(RequestError::invalid(
            "constraint_tokens",
            format!(
                "token id {id} is outside the vocabulary of {} logits",
                logits.len()
            ),
        ));
    }
    let probs = probs(state, f.n_probs, f.post_sampling_probs)?;
    let vocab = named_vocabulary(state, f.params, logits.len(), logits.len_field())?;
    if vocab.is_none() {
        vocabulary_needed(state, f.params)?;
    }
    let (chain, seed) = sampling(state, f.params, vocab, Some(logits.len()), f.prebuilt)?;
    Ok(ValidStart {
        step: ValidStep {
            logits,
            step: f.step,
            probs,
        },
        chain,
        seed,
        window: step::in_vocab(f.previous_tokens, logits.len()).collect(),
        output: f.constraint_tokens.to_vec(),
    })
}

/// The first stage the request asks for that cannot be built without a
/// vocabulary (`SD_STAGE_NEEDS_VOCAB`: the constraint's grammar), by the
/// constraint, the chain or the typed order.
/// Refuses parameters whose chain has a stage that needs a vocabulary
/// (the constraint), for logits that come without one: said here, where
/// the fix is known — the stage's own refusal can only say that it has no
/// vocabulary. Also checked before a constraint would compile
/// (`AppState::prepare_constraints`), so the answer is the same there.
pub(crate) fn vocabulary_needed(
    state: &AppState,
    p: Option<&v1::SamplingParams>,
) -> Result<(), RequestError> {
    let Some(stage) = stage_needing_vocabulary(state, p) else {
        return Ok(());
    };
    Err(RequestError::invalid(
        "params.vocabulary",
        format!(
            "is empty, but stage `{stage}` needs a vocabulary (the text of each token), \
             which these logits have only through params.vocabulary: name one \
             (loaded: {}; config [vocabularies])",
            state.vocabularies.describe()
        ),
    ))
}

fn stage_needing_vocabulary<'a>(
    state: &AppState,
    p: Option<&'a v1::SamplingParams>,
) -> Option<&'a str> {
    let p = p?;
    let constraint = p
        .constraint
        .as_ref()
        .is_some_and(convert::constraint_is_set)
        .then_some(CONSTRAINT_STAGE);
    // Past the stage limit the request is refused anyway (`sampling`).
    let max = state.defaults.max_chain_stages;
    let chain = p.chain.iter().take(max).map(|s| s.name.as_str());
    let order = p.samplers.iter().take(max).map(|s| canonical_stage_name(s));
    constraint
        .into_iter()
        .chain(chain)
        .chain(order)
        .find(|name| state.registry.get(name).is_some_and(|s| s.needs_vocab))
}

/// The vocabulary `params.vocabulary` names (one loaded at start-up from
/// `[vocabularies]`), which must have one token per logit; `None` when
/// the field is empty.
fn named_vocabulary(
    state: &AppState,
    p: Option<&v1::SamplingParams>,
    n_logits: usize,
    logits_field: &str,
) -> Result<Option<Arc<Vocabulary>>, RequestError> {
    let Some(name) = p.map(|p| p.vocabulary.as_str()).filter(|n| !n.is_empty()) else {
        return Ok(None);
    };
    let Some(vocab) = state.vocabularies.get(name) else {
        return Err(RequestError::invalid_as(
            InvalidKind::UnknownVocabulary(echo::excerpt(name, MAX_ECHO_BYTES).into_owned()),
            "params.vocabulary",
            format!(
                "no vocabulary named {} is loaded (loaded: {}; config [vocabularies])",
                quote(name),
                state.vocabularies.describe()
            ),
        ));
    };
    if vocab.len() != n_logits {
        return Err(RequestError::invalid(
            logits_field,
            format!(
                "{n_logits} logits, but vocabulary {name:?} has {} tokens",
                vocab.len()
            ),
        ));
    }
    Ok(Some(Arc::clone(vocab)))
}

/// `n_probs` under `limits.max_n_probs` (one limit for every RPC).
fn probs(
    state: &AppState,
    n_probs: u32,
    post_sampling: bool,
) -> Result<step::ProbsRequest, RequestError> {
    let max = state.limits.max_n_probs;
    if n_probs > max {
        return Err(RequestError::limit(
            "n_probs",
            "limits.max_n_probs",
            format!("{n_probs} exceeds the limit of {max} (limits.max_n_probs)"),
        ));
    }
    Ok(step::ProbsRequest {
        n: n_probs as usize,
        post_sampling,
    })
}

/// `params.constraint`'s triggers: on a constraint, within
/// `limits.max_constraint_triggers` and `limits.max_constraint_trigger_bytes`,
/// no empty string, every token inside the vocabulary when it is known.
pub(crate) fn check_triggers(
    c: &v1::Constraint,
    limits: &crate::service::limits::LimitsConfig,
    n_vocab: Option<usize>,
) -> Result<(), RequestError> {
    let (strings, tokens) = (&c.trigger_strings, &c.trigger_tokens);
    if strings.is_empty() && tokens.is_empty() {
        return Ok(());
    }
    if !convert::constraint_is_set(c) {
        let field = if strings.is_empty() {
            "params.constraint.trigger_tokens"
        } else {
            "params.constraint.trigger_strings"
        };
        return Err(RequestError::invalid(
            field,
            "is set without a constraint kind: a trigger starts a constraint, so set one of \
             json_schema, regex, lark, gbnf, json_object or choice",
        ));
    }
    let n = strings.len() + tokens.len();
    if n > limits.max_constraint_triggers {
        return Err(RequestError::limit(
            if strings.is_empty() {
                "params.constraint.trigger_tokens"
            } else {
                "params.constraint.trigger_strings"
            },
            "limits.max_constraint_triggers",
            format!(
                "{n} triggers (trigger_strings and trigger_tokens together) exceed the limit of \
                 {} (limits.max_constraint_triggers)",
                limits.max_constraint_triggers
            ),
        ));
    }
    for (i, s) in strings.iter().enumerate() {
        let field = format!("params.constraint.trigger_strings[{i}]");
        if s.is_empty() {
            return Err(RequestError::invalid(
                field,
                "is empty: an empty trigger would be there before any output; leave it out",
            ));
        }
        if s.len() > limits.max_constraint_trigger_bytes {
            return Err(RequestError::limit(
                field,
                "limits.max_constraint_trigger_bytes",
                format!(
                    "{} ({} bytes) is longer than the limit of {} (limits.max_constraint_trigger_bytes)",
                    quote(s),
                    s.len(),
                    limits.max_constraint_trigger_bytes
                ),
            ));
        }
    }
    if let Some(n) = n_vocab
        && let Some((i, id)) = tokens.iter().enumerate().find(|&(_, &id)| id as usize >= n)
    {
        return Err(RequestError::invalid(
            format!("params.constraint.trigger_tokens[{i}]"),
            format!("token id {id} is outside the vocabulary of {n} tokens"),
        ));
    }
    Ok(())
}

/// `params.constraint.json_whitespace`: a listed value, on a JSON kind.
pub(crate) fn check_json_whitespace(c: &v1::Constraint) -> Result<(), RequestError> {
    use v1::constraint::Kind;
    const FIELD: &str = "params.constraint.json_whitespace";
    if convert::json_whitespace_from_proto(c.json_whitespace).is_none() {
        return Err(RequestError::invalid(
            FIELD,
            format!(
                "is {}, not one of JSON_WHITESPACE_UNSPECIFIED (0), BOUNDED (1), COMPACT (2), FREE (3)",
                c.json_whitespace
            ),
        ));
    }
    let json = matches!(c.kind, Some(Kind::JsonSchema(_) | Kind::JsonObject(_)));
    if c.json_whitespace != v1::JsonWhitespace::Unspecified as i32 && !json {
        return Err(RequestError::invalid(
            FIELD,
            "applies to a json_schema or json_object constraint only; leave it unset for this kind",
        ));
    }
    Ok(())
}
