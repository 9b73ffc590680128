//! `logit_bias`: adds a per-token bias to the logits (llama.cpp
//! `logit-bias`); a bias of -inf bans a token. Ids at or above `n_vocab` are
//! skipped. Several entries for one id are applied one after the other in
//! the order given. O(entries) in the dense view, O(candidates · log
//! entries) in the candidate view.

#![forbid(unsafe_code)]

use std::ffi::CStr;

use samplerd_plugin_sdk::prelude::*;

use crate::util;

pub struct LogitBias {
    /// (id, bias), sorted by id, duplicates in the order given.
    bias: Vec<(u32, f32)>,
}

impl StatelessStage for LogitBias {
    const NAME: &'static CStr = c"logit_bias";
    const DESCRIPTION: &'static CStr =
        c"adds a bias to the logits of the given tokens (-inf bans a token)";
    const PARAMS: &'static [SdParamSpec] = &[param_spec(
        SD_PARAM_TOKEN_MAP,
        c"bias",
        c"token id -> value added to its logit",
        0.0,
    )];
    const FLAGS: u32 = SD_STAGE_DENSE_OK;

    fn new(params: &Params<'_>, _vocab: Option<&Vocab<'_>>) -> Result<Self, String> {
        let map = params.token_map("bias").unwrap_or(&[]);
        let mut bias = Vec::with_capacity(map.len());
        for e in map {
            if e.value.is_nan() || e.value == f32::INFINITY {
                return Err(format!(
                    "logit_bias: bias for token {} must be finite or -inf, got {}",
                    e.id, e.value
                ));
            }
            bias.push((e.id, e.value));
        }
        bias.sort_by_key(|&(id, _)| id); // stable: duplicates keep their order
        Ok(LogitBias { bias })
    }

    fn apply(&self, tokens: &mut Tokens<'_>, _: &mut HostRng<'_>) -> Result<(), String> {
        if self.bias.is_empty() {
            return Ok(());
        }
        match tokens.view() {
            ViewKind::Dense => {
                let dense = tokens.dense_mut();
                for &(id, b) in &self.bias {
                    if let Some(l) = dense.get_mut(id as usize) {
                        *l = add_bias(*l, b);
                    }
                }
            }
            ViewKind::Candidates => {
                let (lo, hi) = (self.bias[0].0, self.bias[self.bias.len() - 1].0);
                let mut touched = false;
                for c in tokens.candidates_mut() {
                    if c.id < lo || c.id > hi {
                        continue;
                    }
                    let start = self.bias.partition_point(|&(id, _)| id < c.id);
                    for &(id, b) in &self.bias[start..] {
                        if id != c.id {
                            break;
                        }
                        c.logit = add_bias(c.logit, b);
                        touched = true;
                    }
                }
                if touched {
                    tokens.set_sorted(false);
                }
            }
        }
        Ok(())
    }
}

/// `logit + bias`: a -inf bias bans the token; otherwise saturated (see
/// `util::saturate`) so a huge logit plus a bias does not become +inf.
#[inline]
fn add_bias(logit: f32, bias: f32) -> f32 {
    if bias == f32::NEG_INFINITY {
        bias
    } else {
        util::saturate(logit, logit + bias)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use samplerd_plugin_sdk::testing::{OwnedParams, OwnedTokens, TestRng, apply_once};

    /// Fuzz find: a huge logit plus a positive bias overflowed to +inf.
    #[test]
    fn a_huge_biased_logit_saturates() {
        let params = OwnedParams::new().token_map("bias", &[(0, 1e38), (1, 2.0)]);
        for mut tokens in [
            OwnedTokens::dense(&[3e38, 1.0]),
            OwnedTokens::dense_as_candidates(&[3e38, 1.0]),
        ] {
            apply_once::<LogitBias>(&params, &mut tokens, &mut TestRng::constant(0)).unwrap();
            assert_eq!(tokens.logit(0), Some(f32::MAX));
            assert_eq!(tokens.logit(1), Some(3.0));
        }
    }
}
