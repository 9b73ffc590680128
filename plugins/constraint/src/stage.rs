//! The `constraint` stage: masks every token the grammar cannot take next.

use std::ffi::CStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use llguidance::Matcher;
use llguidance::api::{ParserLimits, StopReason};
use samplerd_plugin_sdk::prelude::*;

use crate::ahead::grammar_failed;
use crate::grammar::{self, GrammarError};
use crate::lazy::{LazyState, Triggers};
use crate::tokenv::{self, TokenEnv, describe};

/// Default of `max_fuel`: llguidance's own default lexer budget for
/// building a grammar (`ParserLimits::initial_lexer_fuel`, sized by its
/// authors for the largest real schema they know, FHIR, at ~500k). The
/// hostile inputs of `tests/limits.rs` are refused or compiled in under
/// 0.1 s with it, inside the host's 2 s step budget.
pub const DEFAULT_MAX_FUEL: f64 = 1_000_000.0;
/// `max_fuel` may not exceed this (10× the default).
pub const MAX_MAX_FUEL: f64 = 10_000_000.0;
/// Default of `ahead_min_us`. Handing the parser to a mask thread and back
/// costs ~22 µs on a 2-core VM; a sweep of the threshold there (0, 15, 18,
/// 21, 25 µs; docs/PERFORMANCE.md, "constraint stage") put 15 where
/// SmolLM2's 49,152-token masks (mostly cheaper) stay as fast as inline and
/// Qwen's 151,936 (mostly costlier) go as fast as always ahead.
pub const DEFAULT_AHEAD_MIN_US: f64 = 15.0;

pub struct Constraint {
    env: Arc<TokenEnv>,
    /// A matcher at the start of the grammar; each sequence clones it.
    /// Behind a mutex because llguidance's matcher is `Send`, not `Sync`;
    /// the lock is held only for the clone.
    start: Mutex<Matcher>,
    /// Compute the next mask ahead when the sequence's masks lately cost
    /// this much.
    ahead_min: Duration,
    /// `Some`: a lazy constraint, free text until one of these.
    triggers: Option<Triggers>,
}

fn ahead_min(params: &Params<'_>) -> Result<Duration, String> {
    let us = params.number("ahead_min_us");
    if !(0.0..=1e6).contains(&us) {
        return Err(format!(
            "constraint: ahead_min_us: must be in [0, 1000000] (microseconds), got {us}"
        ));
    }
    Ok(Duration::from_secs_f64(us / 1e6))
}

fn fuel(params: &Params<'_>) -> Result<u64, String> {
    let f = params.number("max_fuel");
    if !(1.0..=MAX_MAX_FUEL).contains(&f) || f.fract() != 0.0 {
        return Err(format!(
            "constraint: max_fuel: must be a whole number in [1, {MAX_MAX_FUEL}], got {f}"
        ));
    }
    Ok(f as u64)
}

/// llguidance's message on one line: its source excerpts (`  2 | …`) and
/// caret lines are dropped (the position stays in the text, e.g. `2(10)`:
/// line 2, column 10), and for a regex the position in llguidance's Lark
/// wrapping of it (`start: /…/`) is dropped, since the regex crate's own
/// message locates the fault in the regex.
fn one_line(param: &str, msg: &str) -> String {
    let is_excerpt = |l: &str| {
        let t = l.trim();
        t.is_empty()
            || t.chars().all(|c| c == '^' || c == ' ')
            || t.split_once(" | ")
                .is_some_and(|(n, _)| n.chars().all(|c| c.is_ascii_digit()))
    };
    let mut out = msg
        .lines()
        .filter(|l| !is_excerpt(l))
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ");
    if param == "regex"
        && let Some((_, rest)) = out.strip_prefix("at ").and_then(|r| r.split_once("): "))
    {
        out = rest.to_string();
    }
    out
}

impl Constraint {
    fn is_eog(&self, token: u32) -> bool {
        self.env.eog.binary_search(&token).is_ok()
    }

    fn refuse(&self, matcher: &Matcher, token: u32) -> String {
        let bytes = matcher
            .tok_env()
            .map(|e| e.tok_trie().token(token).to_vec())
            .unwrap_or_default();
        let shown = match bytes.split_first() {
            Some((&0xff, name)) => format!("special {}", describe(name)),
            _ => describe(&bytes),
        };
        input_error(format!(
            "constraint: token {token} ({shown}) is not allowed by the grammar here"
        ))
    }
}

impl Stage for Constraint {
    const NAME: &'static CStr = c"constraint";
    const DESCRIPTION: &'static CStr = c"allows only tokens that keep the output valid under a \
        grammar (JSON Schema, regex, Lark, GBNF, JSON object or a choice), via llguidance";
    const PARAMS: &'static [SdParamSpec] = &[
        param_spec(
            SD_PARAM_STRING,
            c"json_schema",
            c"one JSON value valid under this JSON Schema",
            0.0,
        ),
        param_spec(
            SD_PARAM_STRING,
            c"regex",
            c"the whole output matches this regex",
            0.0,
        ),
        param_spec(SD_PARAM_STRING, c"lark", c"an llguidance Lark grammar", 0.0),
        param_spec(SD_PARAM_STRING, c"gbnf", c"a llama.cpp GBNF grammar", 0.0),
        number_param(c"json_object", c"1: any JSON object", 0.0),
        param_spec(
            SD_PARAM_STRING_LIST,
            c"choice",
            c"exactly one of these strings",
            0.0,
        ),
        param_spec(
            SD_PARAM_STRING,
            c"json_whitespace",
            c"whitespace between JSON tokens: bounded (default: one space, or 1-2 newlines \
              then at most 20 spaces or tabs, as llama.cpp), compact (none) or free (any)",
            0.0,
        ),
        number_param(
            c"max_fuel",
            c"lexer budget for building the grammar (llguidance initial_lexer_fuel)",
            DEFAULT_MAX_FUEL,
        ),
        number_param(
            c"ahead_min_us",
            c"compute the next mask on a helper thread during the forward pass when the \
              sequence's masks have lately cost at least this many microseconds (0: always)",
            DEFAULT_AHEAD_MIN_US,
        ),
        param_spec(
            SD_PARAM_STRING_LIST,
            c"trigger_strings",
            c"lazy: free text until one of these strings appears, then the grammar holds from \
              right after it (the rest of the token that completes it included)",
            0.0,
        ),
        param_spec(
            SD_PARAM_STRING_LIST,
            c"trigger_tokens",
            c"lazy: free text until one of these token ids (decimal strings) is accepted, then \
              the grammar holds from the next token",
            0.0,
        ),
    ];
    // Output-only: the host never replays a prompt or previous_tokens into
    // the grammar, whose state starts where the output starts. Sparse
    // lowers-only: the mask removes a token by its id and the grammar's
    // state alone (stable in the candidate view), so a sparse row's sent
    // entries can be masked without the others.
    const FLAGS: u32 = SD_STAGE_DENSE_OK
        | SD_STAGE_NEEDS_VOCAB
        | SD_STAGE_OUTPUT_ONLY
        | SD_STAGE_SPARSE_LOWERS_ONLY;
    type State = LazyState;

    fn new(params: &Params<'_>, vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        let Some(vocab) = vocab else {
            return Err(
                "constraint: needs a vocabulary (the model's tokens), and none was given".into(),
            );
        };
        let fuel = fuel(params)?;
        let ahead_min = ahead_min(params)?;
        let source =
            grammar::from_params(params).map_err(|e: GrammarError| format!("constraint: {e}"))?;
        let param = source.param;
        let env = tokenv::token_env(vocab).map_err(|e| format!("constraint: {e}"))?;
        let triggers = Triggers::new(
            &params.strings("trigger_strings").unwrap_or_default(),
            &params.strings("trigger_tokens").unwrap_or_default(),
            env.n_vocab,
        )
        .map_err(|e| format!("constraint: {e}"))?;
        let limits = ParserLimits {
            initial_lexer_fuel: fuel,
            // Errors go back to the client as one line; llguidance's
            // verbose form adds excerpts of its own state.
            verbose_errors: false,
            ..ParserLimits::default()
        };
        let parser = env
            .factory
            .create_parser_from_init_ext(
                llguidance::api::GrammarInit::Serialized(source.grammar),
                llguidance::Logger::new(0, 0),
                toktrie::InferenceCapabilities::default(),
                limits,
            )
            .map_err(|e| format!("constraint: {param}: {}", one_line(param, &e.to_string())))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(format!("constraint: {param}: {}", one_line(param, &e)));
        }
        // The first mask, computed once here: a grammar that matches
        // nothing is refused now rather than on the first step, and the
        // lexer states it builds are shared with every sequence.
        // (llguidance's error here is a dump of its parser state; the
        // stop reason says it all.)
        let mut probe = matcher.clone();
        if let Err(e) = probe.compute_mask() {
            let e = e.to_string();
            return Err(if e.starts_with(&StopReason::NoExtensionBias.to_string()) {
                format!("constraint: {param}: the grammar matches nothing")
            } else {
                format!(
                    "constraint: {param}: the grammar failed at its start: {}",
                    e.lines().next().unwrap_or_default()
                )
            });
        }
        Ok(Constraint {
            env,
            start: Mutex::new(matcher),
            ahead_min,
            triggers,
        })
    }

    fn new_state(&self) -> LazyState {
        LazyState::new(
            self.start.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            self.triggers.as_ref(),
        )
    }

    fn try_accept(&self, st: &mut LazyState, token: u32) -> Result<(), String> {
        if token as usize >= self.env.n_vocab {
            return Err(input_error(format!(
                "constraint: token {token} is outside the vocabulary of {} tokens",
                self.env.n_vocab
            )));
        }
        if let Some(triggers) = &self.triggers
            && st.take_waiting(&self.env, self.ahead_min, triggers, token)?
        {
            return Ok(());
        }
        st.grammar.advance(&self.env, self.ahead_min, |m| {
            if m.is_stopped() {
                // Done (or failed): only stopping is allowed.
                if self.is_eog(token) && m.stop_reason().is_ok() {
                    return Ok(false);
                }
                return Err(self.refuse(m, token));
            }
            let valid = m
                .validate_tokens(&[token])
                .map_err(|e| grammar_failed(&e.to_string()))?;
            let eog_ok = self.is_eog(token)
                && m.is_accepting()
                    .map_err(|e| grammar_failed(&e.to_string()))?;
            if valid == 0 && !eog_ok {
                return Err(self.refuse(m, token));
            }
            m.consume_token(token)
                .map_err(|e| grammar_failed(&e.to_string()))?;
            Ok(true)
        })
    }

    fn apply(
        &self,
        st: &mut LazyState,
        tokens: &mut Tokens<'_>,
        _: &mut HostRng<'_>,
    ) -> Result<(), String> {
        if !st.active() {
            // Waiting for a trigger: free text, untouched.
            return Ok(());
        }
        let allowed = st.grammar.mask(&self.env)?;
        crate::mask::apply(&allowed, tokens);
        Ok(())
    }
}
