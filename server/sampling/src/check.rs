//! The host's checks of what each stage left in the token buffer, so that a
//! misbehaving plugin fails the request with its name instead of handing
//! out a wrong or out-of-range token. They run after every stage, over up
//! to a whole vocabulary, hence the branch-free, vectorised passes.

use samplerd_plugin_sdk::abi::*;

use crate::buffer::TokenBuffer;
use crate::error::SampleError;

/// Post-checks after each stage: the host's header fields are untouched,
/// the view is known, the candidate count did not grow, candidate ids are
/// in range with logits finite or -inf; and with `deep` (every stage but
/// the core ones, see `chain::deep_checks`) ids are unique, no NaN or +inf
/// is left in a dense view and a claimed sort order holds. Each is one
/// O(size) branch-free pass over the view the stage left; the search for
/// the offending entry runs only once a pass found one.
pub(crate) fn check_after_stage(
    stage: &str,
    buf: &mut TokenBuffer,
    before: usize,
    was_dense: bool,
    deep: bool,
    n_vocab: usize,
) -> Result<(), SampleError> {
    let bad = |what: String| SampleError::Misbehaved {
        stage: stage.to_string(),
        what,
    };
    if let Some(field) = buf.header_changed() {
        return Err(bad(format!(
            "overwrote the host's sd_tokens.{field} (the host owns the buffer; a stage may change only view, size, sorted and selected)"
        )));
    }
    let (view, size, selected) = (buf.view(), buf.size(), buf.selected());
    if view != SD_VIEW_DENSE && view != SD_VIEW_CANDIDATES {
        return Err(bad(format!("set an unknown view {view}")));
    }
    if view == SD_VIEW_DENSE && !was_dense {
        return Err(bad("switched back from candidates to the dense view".into()));
    }
    if view == SD_VIEW_DENSE && deep && !dense_ok(buf.dense()) {
        let (i, l) = buf
            .dense()
            .iter()
            .enumerate()
            .find(|(_, l)| !logit_ok(**l))
            .expect("dense_ok found one");
        return Err(bad(format!(
            "left logit {l} for token {i} in the dense view (logits must be finite or -inf)"
        )));
    }
    if view == SD_VIEW_CANDIDATES {
        if size > before || size > n_vocab {
            return Err(bad(format!("grew the candidates from {before} to {size}")));
        }
        let cands = buf.candidates();
        if !candidates_ok(cands, n_vocab) {
            let c = cands
                .iter()
                .find(|c| c.id as usize >= n_vocab || !logit_ok(c.logit))
                .expect("candidates_ok found one");
            return Err(bad(format!(
                "left candidate id {} with logit {} (vocabulary {n_vocab}; logits must be finite or -inf)",
                c.id, c.logit
            )));
        }
        if deep
            && buf.sorted_flag() != 0
            && let Some(at) = out_of_order(cands)
        {
            return Err(bad(format!(
                "set sorted = 1, but candidate #{at} (id {}, logit {}) is above a live candidate before it",
                cands[at].id, cands[at].logit
            )));
        }
        if deep && let Some(id) = buf.duplicate_candidate() {
            return Err(bad(format!(
                "left token id {id} twice in the candidates (a stage may drop or reorder candidates, never copy them)"
            )));
        }
    }
    if selected >= n_vocab as i64 || selected < -1 {
        return Err(bad(format!(
            "selected token {selected} outside the vocabulary of {n_vocab}"
        )));
    }
    Ok(())
}

/// A logit the host accepts from a stage: finite or -inf.
#[inline(always)]
fn logit_ok(l: f32) -> bool {
    !(l.is_nan() | (l == f32::INFINITY))
}

/// Whether the live candidates (logit above -inf) are in descending logit
/// order, ties allowed: a stage may set a logit of a sorted list to -inf
/// (removing it) without re-sorting, so removed entries are skipped. One
/// branch-free pass carrying the last live logit.
#[cfg(test)]
fn sorted_descending(cands: &[SdCandidate]) -> bool {
    out_of_order(cands).is_none()
}

/// The first live candidate whose logit is above the live one before it.
fn out_of_order(cands: &[SdCandidate]) -> Option<usize> {
    // Fast path, one pass over neighbours with no carried value (it
    // vectorises): a list that never rises is sorted, whatever -inf
    // entries it holds. A rise may be a removed entry followed by a live
    // one, so only then walk the live entries exactly.
    let n = cands.len();
    let rises = n >= 2
        && cands[..n - 1]
            .iter()
            .zip(&cands[1..])
            .fold(false, |acc, (a, b)| acc | (a.logit < b.logit));
    if !rises {
        return None;
    }
    let mut prev = f32::INFINITY;
    let mut bad = false;
    for c in cands {
        let live = c.logit > f32::NEG_INFINITY;
        bad |= live & (c.logit > prev);
        prev = if live { c.logit } else { prev };
    }
    if !bad {
        return None;
    }
    // Cold: the same walk again, stopping at the culprit.
    let mut prev = f32::INFINITY;
    cands.iter().position(|c| {
        let late = c.logit > prev;
        if c.logit > f32::NEG_INFINITY {
            prev = c.logit;
        }
        late
    })
}

/// Whether no dense logit is NaN or +inf: one branch-free pass in blocks
/// (so it vectorises and stops at the first bad block), on AVX-512 or AVX2
/// where the CPU has it.
fn dense_ok(dense: &[f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if samplerd_numerics::features().avx512f() {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        return unsafe { dense_ok_avx512(dense) };
    }
    #[cfg(target_arch = "x86_64")]
    if samplerd_numerics::features().avx2() {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { dense_ok_avx2(dense) };
    }
    dense_ok_impl(dense)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dense_ok_avx512(dense: &[f32]) -> bool {
    dense_ok_impl(dense)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dense_ok_avx2(dense: &[f32]) -> bool {
    dense_ok_impl(dense)
}

#[inline(always)]
fn dense_ok_impl(dense: &[f32]) -> bool {
    dense
        .chunks(1024)
        .all(|block| block.iter().fold(true, |ok, &l| ok & logit_ok(l)))
}

/// The token the chain's last stage (`stage`) chose, once it is known to
/// be one that survived every stage.
pub(crate) fn check_selection(stage: &str, buf: &TokenBuffer) -> Result<u32, SampleError> {
    let Ok(id) = u32::try_from(buf.selected()) else {
        // Nothing left to choose from is the request's doing (a logit_bias
        // of -inf on every token), as all -inf logits are; a selecting
        // stage that chose nothing among live tokens is the stage's.
        if buf.survivors().next().is_none() {
            return Err(SampleError::AllMasked {
                stage: stage.to_string(),
            });
        }
        return Err(SampleError::NoSelection {
            stage: stage.to_string(),
        });
    };
    let survived = if buf.is_dense() {
        buf.dense()
            .get(id as usize)
            .is_some_and(|&l| l > f32::NEG_INFINITY)
    } else {
        is_live_candidate(buf.candidates(), id)
    };
    if !survived {
        return Err(SampleError::Misbehaved {
            stage: stage.to_string(),
            what: format!("selected token {id}, which is not a surviving candidate"),
        });
    }
    Ok(id)
}

/// Whether every candidate has an id below `n_vocab` and a logit that is
/// neither NaN nor +inf: one branch-free pass, on AVX-512 or AVX2 where the CPU has it
/// (this runs after every stage, over up to a whole vocabulary).
fn candidates_ok(cands: &[SdCandidate], n_vocab: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if samplerd_numerics::features().avx512f() {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        return unsafe { candidates_ok_avx512(cands, n_vocab) };
    }
    #[cfg(target_arch = "x86_64")]
    if samplerd_numerics::features().avx2() {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { candidates_ok_avx2(cands, n_vocab) };
    }
    candidates_ok_impl(cands, n_vocab)
}

/// [`candidates_ok_impl`] with intrinsics: eight (id, logit) pairs per
/// register, ids compared in the even lanes, NaN and +inf tested in the odd
/// ones.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn candidates_ok_avx512(cands: &[SdCandidate], n_vocab: usize) -> bool {
    use std::arch::x86_64::*;
    const _: () = assert!(std::mem::size_of::<SdCandidate>() == 8);
    let limit = _mm512_set1_epi32(u32::try_from(n_vocab).unwrap_or(u32::MAX) as i32);
    let inf = _mm512_set1_ps(f32::INFINITY);
    let mut bad: __mmask16 = 0;
    let pairs = cands.len() / 8 * 8;
    let base = cands.as_ptr().cast::<f32>();
    let mut i = 0;
    while i < pairs {
        // SAFETY: candidates i..i + 8 are in bounds (16 f32 of 8 pairs).
        let v = unsafe { _mm512_loadu_ps(base.add(2 * i)) };
        let ids = _mm512_castps_si512(v);
        bad |= _mm512_cmpge_epu32_mask(ids, limit) & 0x5555;
        bad |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v) & 0xAAAA;
        bad |= _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(v, inf) & 0xAAAA;
        i += 8;
    }
    bad == 0 && candidates_ok_impl(&cands[pairs..], n_vocab)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn candidates_ok_avx2(cands: &[SdCandidate], n_vocab: usize) -> bool {
    candidates_ok_impl(cands, n_vocab)
}

#[inline(always)]
fn candidates_ok_impl(cands: &[SdCandidate], n_vocab: usize) -> bool {
    let limit = u32::try_from(n_vocab).unwrap_or(u32::MAX);
    !cands
        .iter()
        .fold(false, |acc, c| acc | (c.id >= limit) | !logit_ok(c.logit))
}

/// Whether `id` is among the candidates with a logit above -inf (chunks
/// of 64 checked branch-free, so the scan vectorises and stops early).
fn is_live_candidate(cands: &[SdCandidate], id: u32) -> bool {
    #[cfg(target_arch = "x86_64")]
    if samplerd_numerics::features().avx512f() {
        // SAFETY: the CPU supports AVX-512F (checked just above).
        return unsafe { is_live_candidate_avx512(cands, id) };
    }
    #[cfg(target_arch = "x86_64")]
    if samplerd_numerics::features().avx2() {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { is_live_candidate_avx2(cands, id) };
    }
    is_live_candidate_impl(cands, id)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn is_live_candidate_avx512(cands: &[SdCandidate], id: u32) -> bool {
    is_live_candidate_impl(cands, id)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn is_live_candidate_avx2(cands: &[SdCandidate], id: u32) -> bool {
    is_live_candidate_impl(cands, id)
}

#[inline(always)]
fn is_live_candidate_impl(cands: &[SdCandidate], id: u32) -> bool {
    cands.chunks(64).any(|chunk| {
        chunk.iter().fold(false, |acc, c| {
            acc | ((c.id == id) & (c.logit > f32::NEG_INFINITY))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cands(n: usize) -> Vec<SdCandidate> {
        (0..n as u32)
            .map(|i| SdCandidate {
                id: i,
                logit: i as f32 * 0.5 - 3.0,
            })
            .collect()
    }

    #[test]
    fn candidate_checks_find_every_bad_entry() {
        // every length around the 8- and 64-wide blocks, a bad id or a NaN
        // at every position: the vectorised checks agree with the plain one
        for n in [0usize, 1, 7, 8, 9, 63, 64, 65, 130] {
            let good = cands(n);
            assert!(candidates_ok(&good, n));
            assert!(candidates_ok_impl(&good, n));
            for at in 0..n {
                let mut c = good.clone();
                c[at].id = n as u32;
                assert!(!candidates_ok(&c, n), "n {n}: id at {at}");
                let mut c = good.clone();
                c[at].logit = f32::NAN;
                assert!(!candidates_ok(&c, n), "n {n}: NaN at {at}");
                c[at].logit = f32::INFINITY;
                assert!(!candidates_ok(&c, n), "n {n}: +inf at {at}");
                c[at].logit = f32::NEG_INFINITY;
                assert!(candidates_ok(&c, n), "n {n}: -inf at {at}");
                let id = good[at].id;
                assert!(is_live_candidate(&good, id));
                let mut c = good.clone();
                c[at].logit = f32::NEG_INFINITY;
                assert!(!is_live_candidate(&c, id), "n {n}: -inf at {at}");
            }
            assert!(!is_live_candidate(&good, n as u32));
        }
    }

    #[test]
    fn dense_and_order_checks_find_every_bad_entry() {
        for n in [0usize, 1, 2, 15, 16, 17, 1023, 1024, 1025, 3000] {
            let good: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
            assert!(dense_ok(&good));
            let mut desc = cands(n);
            desc.reverse();
            assert!(sorted_descending(&desc));
            for at in 0..n {
                for (l, ok) in [
                    (f32::NAN, false),
                    (f32::INFINITY, false),
                    (f32::NEG_INFINITY, true),
                    (f32::MAX, true),
                ] {
                    let mut d = good.clone();
                    d[at] = l;
                    assert_eq!(dense_ok(&d), ok, "n {n}: {l} at {at}");
                }
                if at + 1 < n {
                    let mut c = desc.clone();
                    c.swap(at, at + 1);
                    assert!(!sorted_descending(&c), "n {n}: swap at {at}");
                    c[at].logit = c[at + 1].logit;
                    assert!(sorted_descending(&c), "n {n}: tie at {at}");
                    // A removed (-inf) entry is skipped, in both directions.
                    let mut c = desc.clone();
                    c[at].logit = f32::NEG_INFINITY;
                    assert!(sorted_descending(&c), "n {n}: -inf at {at}");
                    if at + 2 < n {
                        c[at + 1].logit = c[at + 2].logit - 1.0;
                        assert_eq!(out_of_order(&c), Some(at + 2), "n {n}: hidden at {at}");
                    }
                }
            }
        }
    }
}
