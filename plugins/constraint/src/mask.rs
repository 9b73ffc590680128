//! Applying llguidance's token mask (one bit per token id) to either view
//! of the logits.

use samplerd_plugin_sdk::prelude::*;
use toktrie::SimpleVob;

/// Sets every token the mask does not allow to -inf (dense view), or drops
/// it from the candidates, keeping their order and `sorted` flag
/// (candidate view). Ids beyond the mask are not allowed.
pub fn apply(allowed: &SimpleVob, tokens: &mut Tokens<'_>) {
    let words = allowed.as_slice();
    let n_mask = allowed.len();
    match tokens.view() {
        ViewKind::Dense => {
            let dense = tokens.dense_mut();
            // 32 logits per mask word: a word of zeros (most of the
            // vocabulary under a JSON grammar) is one fill, a word of ones
            // is skipped, a mixed one goes bit by bit.
            for (chunk, &w) in dense.chunks_mut(32).zip(words) {
                match w {
                    u32::MAX => {}
                    0 => chunk.fill(f32::NEG_INFINITY),
                    _ => {
                        // A select per lane, not a branch per bit: the
                        // compiler vectorises it. The branchy loop was ~27%
                        // of a step at 151,936 tokens (perf), since inside a
                        // JSON string most words are mixed.
                        for (bit, l) in chunk.iter_mut().enumerate() {
                            let keep = (w >> bit) & 1 != 0;
                            *l = if keep { *l } else { f32::NEG_INFINITY };
                        }
                    }
                }
            }
            let covered = (words.len() * 32).min(n_mask);
            if dense.len() > covered {
                dense[covered..].fill(f32::NEG_INFINITY);
            }
        }
        ViewKind::Candidates => {
            let sorted = tokens.is_sorted();
            let cands = tokens.candidates_mut();
            let mut kept = 0;
            for i in 0..cands.len() {
                let c = cands[i];
                if (c.id as usize) < n_mask && allowed.is_allowed(c.id) {
                    cands[kept] = c;
                    kept += 1;
                }
            }
            tokens.set_candidates(kept, sorted);
        }
    }
}
