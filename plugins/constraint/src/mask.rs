//! Applying llguidance's token mask (one bit per token id) to either view
//! of the logits.

use samplerd_plugin_sdk::abi::SdCandidate;
use samplerd_plugin_sdk::prelude::*;
use toktrie::SimpleVob;

/// In the dense view, a mask that allows at most one token in this many
/// becomes a candidate list of the allowed tokens instead of -inf writes.
///
/// Why: at a JSON document's structure (after `{`, `:`, `,`) a grammar
/// allows a few dozen tokens, and writing -inf over the other 151,900
/// logits (608 KB) was ~22 % of a constrained step at Qwen's vocabulary
/// (perf); listing the survivors writes 8 bytes each, and every later
/// stage then walks the short list instead of the whole vocabulary. Inside
/// a JSON string most tokens are allowed and the dense path stays cheaper.
const SPARSE_FRACTION: usize = 8;

/// In the dense view, a mask word (32 ids) that bans at most this many
/// has just those logits written, not all 32 selected.
///
/// Why: inside a JSON string nearly every word is mixed but bans only the
/// few tokens that hold a quote, a backslash or a control byte; the
/// per-lane select still read and wrote all 600 KB of logits at Qwen's
/// 151,936 (~21 µs of a ~85 µs constrained step, timed around the call),
/// where writing only the banned ones touches a few cache lines.
const FEW_BANNED: u32 = 4;

/// Sets every token the mask does not allow to -inf (dense view) — or,
/// when the mask allows few, switches to a candidate view of the allowed
/// tokens in id order — or drops it from the candidates, keeping their
/// order and `sorted` flag (candidate view). Ids beyond the mask are not
/// allowed. Either way the surviving tokens and their logits are the same.
pub fn apply(allowed: &SimpleVob, tokens: &mut Tokens<'_>) {
    let words = allowed.as_slice();
    let n_mask = allowed.len();
    // Ids the mask speaks for (any beyond it are not allowed).
    let n = tokens.n_vocab().min(n_mask);
    match tokens.view() {
        ViewKind::Dense if sparse(words, n, tokens.n_vocab()) => {
            let (dense, cands) = tokens.dense_and_buffer();
            let mut kept = 0;
            for (i, &w) in words.iter().enumerate() {
                let mut w = w;
                while w != 0 {
                    let id = i * 32 + w.trailing_zeros() as usize;
                    if id >= n {
                        break;
                    }
                    cands[kept] = SdCandidate {
                        id: id as u32,
                        logit: dense[id],
                    };
                    kept += 1;
                    w &= w - 1;
                }
            }
            tokens.set_candidates(kept, false);
        }
        ViewKind::Dense => {
            let dense = tokens.dense_mut();
            // 32 logits per mask word: a word of zeros (most of the
            // vocabulary under a JSON grammar) is one fill, a word of ones
            // is skipped, a mixed one goes bit by bit.
            for (chunk, &w) in dense.chunks_mut(32).zip(words) {
                match w {
                    u32::MAX => {}
                    0 => chunk.fill(f32::NEG_INFINITY),
                    _ if w.count_zeros() <= FEW_BANNED => {
                        let mut banned = !w;
                        while banned != 0 {
                            let bit = banned.trailing_zeros() as usize;
                            if let Some(l) = chunk.get_mut(bit) {
                                *l = f32::NEG_INFINITY;
                            }
                            banned &= banned - 1;
                        }
                    }
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

/// Whether the mask allows at most one in [`SPARSE_FRACTION`] of the
/// `n_vocab` logits (counting ids below `n`; a popcount per 32 ids).
fn sparse(words: &[u32], n: usize, n_vocab: usize) -> bool {
    let full = n / 32;
    let mut count: usize = words[..full.min(words.len())]
        .iter()
        .map(|w| w.count_ones() as usize)
        .sum();
    if let Some(&last) = words.get(full)
        && !n.is_multiple_of(32)
    {
        count += (last & ((1u32 << (n % 32)) - 1)).count_ones() as usize;
    }
    count * SPARSE_FRACTION <= n_vocab
}
