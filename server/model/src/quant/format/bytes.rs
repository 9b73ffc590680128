//! Reading GGUF block bytes: f16 fields, fixed runs of bytes, whole blocks and whole rows.

use half::f16;

/// An f16 stored little-endian at the start of `b`, widened (exact).
pub(crate) fn f16_le(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// The `M` bytes of `c` from `at`.
#[inline(always)]
pub(crate) fn bytes_at<const M: usize>(c: &[u8], at: usize) -> [u8; M] {
    c[at..at + M].try_into().expect("inside the block")
}

/// Blocks of `N` stored bytes each, decoded by `f`, or `None` when `raw`
/// ends in a partial block.
pub(crate) fn blocks_from_bytes<T, const N: usize>(
    raw: &[u8],
    f: impl Fn(&[u8; N]) -> T,
) -> Option<Vec<T>> {
    let (blocks, rest) = raw.as_chunks::<N>();
    rest.is_empty().then(|| blocks.iter().map(f).collect())
}

/// Whether `raw` holds exactly `rows × cols` values in blocks of `values`
/// values and `bytes` bytes, with whole blocks per row.
pub(crate) fn whole_rows(
    rows: usize,
    cols: usize,
    values: usize,
    bytes: usize,
    raw: &[u8],
) -> bool {
    cols.is_multiple_of(values) && raw.len() == rows * cols / values * bytes
}
