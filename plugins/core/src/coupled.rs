//! `coupled`: draws the token with a Gumbel race keyed by token id —
//! token = argmax over the candidates of `logit_i − ln(−ln U_i)`, where
//! `U_i` is the host's keyed draw for key `i` (ABI 1.3
//! `sd_rng.keyed_u64`), mapped to the open interval (0, 1) ([`gumbel`]). The winner
//! follows the softmax of the candidates exactly (the Gumbel-max trick),
//! like `dist`; what differs is the coupling: `U_i` depends only on
//! `(seed, step, i)`, so two distributions drawn with the same seed and
//! step pick the same token as often as they can (Daliri et al., "Coupling
//! without communication and drafter-invariant speculative decoding",
//! arXiv 2408.07978). A drafter and a target that both end their chains
//! with `coupled` agree whenever the race's winner is the same under both,
//! and the target's token never depends on what the drafter proposed.
//!
//! A selecting stage; it never modifies the logits. Ties (probability
//! ~2⁻⁵³) go to the lowest id. One keyed draw and two logarithms per live
//! candidate: meant after a truncation (top_k, min_p, …); over a whole
//! 151,936-entry dense row it costs milliseconds (docs/PERFORMANCE.md).
//! Needs a host with keyed draws (ABI ≥ 1.3) and says so otherwise.

#![forbid(unsafe_code)]

use std::ffi::CStr;

use samplerd_plugin_sdk::prelude::*;

pub struct Coupled;

/// `−ln(−ln U)` for the keyed word `x`, `U = (⌊x / 2¹²⌋ + ½) · 2⁻⁵²` in
/// (0, 1): 52 bits, so that the largest value, 1 − 2⁻⁵³, is an f64 below
/// 1 (with 53 bits it would round to 1) and the result always finite.
pub fn gumbel(x: u64) -> f64 {
    let u = ((x >> 12) as f64 + 0.5) * (1.0 / (1u64 << 52) as f64);
    -(-u.ln()).ln()
}

/// The race over `(id, logit)` pairs: the highest `logit + gumbel(id)`,
/// the lowest id on a tie; -inf logits never win.
pub fn race(
    cands: impl Iterator<Item = (u32, f32)>,
    mut draw: impl FnMut(u32) -> Option<u64>,
) -> Result<Option<u32>, String> {
    let mut best: Option<(f64, u32)> = None;
    for (id, logit) in cands {
        if logit == f32::NEG_INFINITY {
            continue;
        }
        let x = draw(id).ok_or_else(|| {
            "coupled: the host offers no keyed draws (needs samplerd with plugin ABI 1.3 or later)"
                .to_string()
        })?;
        let score = logit as f64 + gumbel(x);
        match best {
            Some((s, b)) if s > score || (s == score && b < id) => {}
            _ => best = Some((score, id)),
        }
    }
    Ok(best.map(|(_, id)| id))
}

impl StatelessStage for Coupled {
    const NAME: &'static CStr = c"coupled";
    const DESCRIPTION: &'static CStr = c"draws a token from the softmax of the candidates by a race keyed by (seed, step, token): drafter-invariant speculation";
    const PARAMS: &'static [SdParamSpec] = &[];
    const FLAGS: u32 = SD_STAGE_SELECTS | SD_STAGE_DENSE_OK;

    fn new(_: &Params<'_>, _: Option<&Vocab<'_>>) -> Result<Self, String> {
        Ok(Coupled)
    }

    fn apply(&self, tokens: &mut Tokens<'_>, rng: &mut HostRng<'_>) -> Result<(), String> {
        let id = match tokens.view() {
            // Ascending ids: the host reads its keyed stream in order.
            ViewKind::Dense => race(
                tokens
                    .dense()
                    .iter()
                    .enumerate()
                    .map(|(i, &l)| (i as u32, l)),
                |id| rng.keyed_u64(id as u64),
            )?,
            ViewKind::Candidates => {
                race(tokens.candidates().iter().map(|c| (c.id, c.logit)), |id| {
                    rng.keyed_u64(id as u64)
                })?
            }
        };
        match id {
            Some(id) => {
                tokens.select(id);
                Ok(())
            }
            None => Err("coupled: no candidate with a finite logit is left".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gumbel_is_finite_at_the_ends() {
        assert!(gumbel(0).is_finite());
        assert!(gumbel(u64::MAX).is_finite());
        assert!(gumbel(0) < gumbel(u64::MAX));
    }

    #[test]
    fn the_race_depends_on_the_keys_not_the_order() {
        let draw = |id: u32| Some((id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let c = [(3u32, 0.5f32), (9, 0.1), (1, 0.7), (4, f32::NEG_INFINITY)];
        let a = race(c.iter().copied(), draw).unwrap();
        let b = race(c.iter().rev().copied(), draw).unwrap();
        assert_eq!(a, b);
        assert!(a.is_some_and(|id| id != 4));
        assert_eq!(
            race([(4u32, f32::NEG_INFINITY)].into_iter(), draw),
            Ok(None)
        );
        assert!(race(c.iter().copied(), |_| None).is_err());
    }
}
