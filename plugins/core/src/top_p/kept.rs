//! Writing the kept tokens: from the gathered set (a superset, in
//! position order) into the candidate view, portable and AVX-512, and the
//! in-place compaction of a candidate list.

use samplerd_plugin_sdk::prelude::SdCandidate;

#[cfg(target_arch = "x86_64")]
use super::shared::has_avx512;
use super::shared::{Cut, Gathered};

/// Writes the kept tokens of `g` (a superset, in position order) to
/// `out[..kept]` in position order as candidates; `out` must hold
/// `g.len()` entries. Branch-free (the kept ones are scattered among the
/// gathered ones); AVX-512 compresses 16 at a time.
pub(super) fn write_kept(g: &Gathered, cut: Cut, out: &mut [SdCandidate]) {
    assert!(
        out.len() >= g.len(),
        "write_kept: output shorter than the gathered set"
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports AVX-512F and POPCNT (checked just above).
        return unsafe { write_kept_avx512(g, cut, out) };
    }
    write_kept_from(g, cut, out, 0, 0);
}

/// The portable loop, from gathered index `from` and output index `k`.
pub(super) fn write_kept_from(
    g: &Gathered,
    cut: Cut,
    out: &mut [SdCandidate],
    from: usize,
    mut k: usize,
) {
    for (&i, &l) in g.idx[from..].iter().zip(&g.val[from..]) {
        out[k] = SdCandidate { id: i, logit: l };
        k += cut.keeps(l, i) as usize;
    }
    debug_assert_eq!(k, cut.kept);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,popcnt")]
unsafe fn write_kept_avx512(g: &Gathered, cut: Cut, out: &mut [SdCandidate]) {
    use std::arch::x86_64::*;
    let (ord_cut, pos_cut) = cut.ord_and_pos();
    let n = g.len();
    let vord = _mm512_set1_epi32(ord_cut as i32);
    let vpos = _mm512_set1_epi32(pos_cut as i32);
    let sign = _mm512_set1_epi32(i32::MIN);
    // (id, logit) pairs: lanes 0..8 and 8..16 of the two compressed rows
    let lo_pairs = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let hi_pairs = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    let mut k = 0usize;
    let mut j = 0usize;
    // 16 pairs are stored whatever the count: keep 16 entries of room
    while j + 16 <= n && k + 16 <= out.len() {
        // SAFETY: j + 16 <= n for the loads; k + 16 <= out.len() for the
        // two 8-pair stores (SdCandidate is two u32, repr(C)).
        unsafe {
            let ids = _mm512_loadu_si512(g.idx.as_ptr().add(j).cast());
            let bits = _mm512_loadu_si512(g.val.as_ptr().add(j).cast());
            let ord = _mm512_xor_si512(bits, _mm512_or_si512(_mm512_srai_epi32::<31>(bits), sign));
            let m = _mm512_cmpgt_epu32_mask(ord, vord)
                | (_mm512_cmpeq_epi32_mask(ord, vord) & _mm512_cmple_epu32_mask(ids, vpos));
            let ci = _mm512_maskz_compress_epi32(m, ids);
            let cv = _mm512_maskz_compress_epi32(m, bits);
            let dst = out.as_mut_ptr().add(k).cast::<__m512i>();
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi32(ci, lo_pairs, cv));
            _mm512_storeu_si512(dst.add(1), _mm512_permutex2var_epi32(ci, hi_pairs, cv));
            k += m.count_ones() as usize;
        }
        j += 16;
    }
    write_kept_from(g, cut, out, j, k);
}

/// Compacts the candidate list `cand` (whose logits and positions `g`
/// gathered) in place to the kept tokens, in position order: the write
/// index never passes the read index.
pub(super) fn compact_kept(g: &Gathered, cut: Cut, cand: &mut [SdCandidate]) {
    // in place: position i is read before any write at k <= i
    let mut w = 0usize;
    for (&i, &l) in g.idx.iter().zip(&g.val) {
        cand[w] = cand[i as usize];
        w += cut.keeps(l, i) as usize;
    }
    debug_assert_eq!(w, cut.kept);
}
