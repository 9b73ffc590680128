//! `reasoning_budget`: bounds a thinking model's reasoning, as llama.cpp's
//! `--reasoning-budget` / `--reasoning-budget-message` do: once the output
//! has opened a reasoning block (`open`, a token sequence such as
//! `<think>`) and `budget` tokens followed without the block closing
//! (`close`), the stage forces `message` and then `close`, one token per
//! step, by masking every other token (−inf). A block the model closes
//! itself ends the count; after a block (closed or forced) nothing more is
//! forced.
//!
//! Per-sequence state fed by `accept` (output-only: the prompt is not
//! history), so the same forcing happens in a decode step, a resumed run
//! and each verified position of a speculative step; a replayed token
//! other than the forced one is refused. Token sequences are given as
//! space-separated decimal ids.

#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::ffi::CStr;

use samplerd_plugin_sdk::prelude::*;

use crate::util;

const S: &str = "reasoning_budget";
/// Most ids in `open`, `close` or `message`.
pub const MAX_SEQUENCE_TOKENS: usize = 256;

pub struct ReasoningBudget {
    open: Vec<u32>,
    close: Vec<u32>,
    budget: u64,
    /// `message` then `close`: what a spent budget forces.
    forced: Vec<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
enum Phase {
    /// No reasoning block open yet.
    #[default]
    Outside,
    /// Inside a block, this many tokens after `open`.
    Thinking(u64),
    /// Forcing `forced[i]` next.
    Forcing(usize),
    /// The block was closed.
    Done,
}

/// One sequence's position relative to its reasoning block.
#[derive(Clone, Default)]
pub struct Progress {
    phase: Phase,
    /// The last tokens accepted (as many as the longer marker).
    recent: VecDeque<u32>,
}

fn ends_with(recent: &VecDeque<u32>, seq: &[u32]) -> bool {
    !seq.is_empty()
        && seq.len() <= recent.len()
        && recent.iter().skip(recent.len() - seq.len()).eq(seq.iter())
}

fn sequence(params: &Params<'_>, name: &str) -> Result<Vec<u32>, String> {
    let text = params.string(name).unwrap_or("");
    let ids = text
        .split_ascii_whitespace()
        .take(MAX_SEQUENCE_TOKENS + 1)
        .map(|s| {
            s.parse::<u32>().map_err(|_| {
                let shown: String = s.chars().take(24).collect();
                format!("{S}: {name} holds {shown:?}, which is not a token id (a decimal u32)")
            })
        })
        .collect::<Result<Vec<u32>, String>>()?;
    if ids.len() > MAX_SEQUENCE_TOKENS {
        return Err(format!(
            "{S}: {name} must be at most {MAX_SEQUENCE_TOKENS} ids"
        ));
    }
    Ok(ids)
}

impl ReasoningBudget {
    /// The token to force next, if any.
    fn forcing(&self, st: &Progress) -> Option<u32> {
        match st.phase {
            Phase::Forcing(i) => self.forced.get(i).copied(),
            _ => None,
        }
    }
}

impl Stage for ReasoningBudget {
    const NAME: &'static CStr = c"reasoning_budget";
    const DESCRIPTION: &'static CStr = c"after budget tokens of an open reasoning block, forces message then the close marker (llama.cpp --reasoning-budget)";
    const PARAMS: &'static [SdParamSpec] = &[
        param_spec(
            SD_PARAM_STRING,
            c"open",
            c"the marker that opens reasoning: space-separated token ids",
            0.0,
        ),
        param_spec(
            SD_PARAM_STRING,
            c"close",
            c"the marker that closes it: space-separated token ids",
            0.0,
        ),
        number_param(
            c"budget",
            c"tokens allowed after open before message and close are forced",
            0.0,
        ),
        param_spec(
            SD_PARAM_STRING,
            c"message",
            c"token ids forced before close when the budget is spent (may be empty)",
            0.0,
        ),
    ];
    const FLAGS: u32 = SD_STAGE_DENSE_OK | SD_STAGE_OUTPUT_ONLY;
    type State = Progress;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        let open = sequence(params, "open")?;
        let close = sequence(params, "close")?;
        if open.is_empty() || close.is_empty() {
            return Err(format!(
                "{S}: open and close must each hold at least one token id"
            ));
        }
        let budget = util::integer(params, S, "budget", 0, u32::MAX as i64)? as u64;
        let mut forced = sequence(params, "message")?;
        forced.extend_from_slice(&close);
        Ok(ReasoningBudget {
            open,
            close,
            budget,
            forced,
        })
    }

    fn new_state(&self) -> Progress {
        Progress::default()
    }

    fn try_accept(&self, st: &mut Progress, token: u32) -> Result<(), String> {
        if let Some(want) = self.forcing(st)
            && token != want
        {
            return Err(format!(
                "{S}: the budget is spent and token {want} is forced here, got {token}"
            ));
        }
        let keep = self.open.len().max(self.close.len());
        if st.recent.len() == keep {
            st.recent.pop_front();
        }
        st.recent.push_back(token);
        st.phase = match st.phase {
            Phase::Outside if ends_with(&st.recent, &self.open) => {
                if self.budget == 0 {
                    Phase::Forcing(0)
                } else {
                    Phase::Thinking(0)
                }
            }
            Phase::Outside => Phase::Outside,
            Phase::Thinking(_) if ends_with(&st.recent, &self.close) => Phase::Done,
            Phase::Thinking(n) if n + 1 >= self.budget => Phase::Forcing(0),
            Phase::Thinking(n) => Phase::Thinking(n + 1),
            Phase::Forcing(i) if i + 1 >= self.forced.len() => Phase::Done,
            Phase::Forcing(i) => Phase::Forcing(i + 1),
            Phase::Done => Phase::Done,
        };
        Ok(())
    }

    fn apply(
        &self,
        st: &mut Progress,
        tokens: &mut Tokens<'_>,
        _rng: &mut HostRng<'_>,
    ) -> Result<(), String> {
        let Some(want) = self.forcing(st) else {
            return Ok(());
        };
        match tokens.view() {
            ViewKind::Dense => {
                for (id, l) in tokens.dense_mut().iter_mut().enumerate() {
                    if id as u32 != want {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            ViewKind::Candidates => {
                for c in tokens.candidates_mut() {
                    if c.id != want {
                        c.logit = f32::NEG_INFINITY;
                    }
                }
                tokens.set_sorted(false);
            }
        }
        Ok(())
    }
}
