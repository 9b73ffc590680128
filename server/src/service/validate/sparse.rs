//! The one check of a `SparseLogits` message (`sparse` in SampleRequest,
//! SampleStreamRequest, BatchRow and BatchStreamRow): `vocab_size` under
//! `limits.max_vocab`, then the row itself ([`SparseRow::new`]: ids and
//! values of one length, each id inside the vocabulary and sent once,
//! values finite or -inf, a `rest_logsumexp` such logits can have) — each
//! error naming its field (`sparse.ids[3]`) and the value — and that it is
//! the only encoding the message sets.

#![forbid(unsafe_code)]

use samplerd_api::v1;
use samplerd_sampling::sparse::{SparseRow, SparseRowError};

use crate::request::convert::FIELD_SPARSE;
use crate::request::errors::{InvalidKind, RequestError};

/// A sparse row whose `vocab_size` is at most `max_vocab`.
pub fn row(msg: &v1::SparseLogits, max_vocab: usize) -> Result<SparseRow<'_>, RequestError> {
    let n_vocab = msg.vocab_size as usize;
    if n_vocab > max_vocab {
        return Err(RequestError::limit(
            "sparse.vocab_size",
            "limits.max_vocab",
            format!("{n_vocab} exceeds the limit of {max_vocab} (limits.max_vocab)"),
        ));
    }
    SparseRow::new(&msg.ids, &msg.values, msg.rest_logsumexp, n_vocab).map_err(|e| {
        // Values a row cannot hold are bad logits; the rest is the
        // message's shape.
        let kind = match e {
            SparseRowError::NotFinite { .. }
            | SparseRowError::AllMasked
            | SparseRowError::RestNotFinite { .. }
            | SparseRowError::RestTooLarge { .. }
            | SparseRowError::NothingUnsent { .. } => InvalidKind::Logits,
            _ => InvalidKind::Field,
        };
        RequestError::invalid_as(kind, format!("{FIELD_SPARSE}.{}", e.field()), e.to_string())
    })
}

/// A batch row's logits: its `logits` bytes (decoded by the caller) or
/// its `sparse` row, not both.
pub fn conflicts_with_bytes(
    bytes: &[u8],
    sparse: Option<&v1::SparseLogits>,
) -> Option<RequestError> {
    (sparse.is_some() && !bytes.is_empty()).then(|| {
        RequestError::invalid(
            FIELD_SPARSE,
            format!(
                "set exactly one of `logits` and `sparse`, got both (`logits` has {} bytes)",
                bytes.len()
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(ids: &[u32], values: &[f32], rest: f64, vocab: u32) -> v1::SparseLogits {
        v1::SparseLogits {
            ids: ids.to_vec(),
            values: values.to_vec(),
            rest_logsumexp: rest,
            vocab_size: vocab,
        }
    }

    fn field(e: RequestError) -> (String, String) {
        match e {
            RequestError::Invalid { field, message, .. } => (field, message),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn each_bad_row_names_its_field_and_value() {
        let cases = [
            (
                msg(&[0, 1], &[1.0], -1.0, 10),
                "sparse.ids",
                "2 ids but 1 values",
            ),
            (
                msg(&[4, 4], &[1.0, 2.0], -1.0, 10),
                "sparse.ids[1]",
                "token id 4 is sent twice",
            ),
            (
                msg(&[10], &[1.0], -1.0, 10),
                "sparse.ids[0]",
                "token id 10 is outside",
            ),
            (
                msg(&[1], &[f32::NAN], -1.0, 10),
                "sparse.values[0]",
                "is NaN",
            ),
            (
                msg(&[1], &[f32::INFINITY], -1.0, 10),
                "sparse.values[0]",
                "is inf",
            ),
            (
                msg(&[1], &[1.0], f64::NAN, 10),
                "sparse.rest_logsumexp",
                "is NaN",
            ),
            (
                msg(&[1], &[1.0], f64::INFINITY, 10),
                "sparse.rest_logsumexp",
                "is inf",
            ),
            (msg(&[1], &[1.0], 9.0, 10), "sparse.rest_logsumexp", "is 9"),
            (
                msg(&[1], &[1.0], -1.0, 2_000_000),
                "sparse.vocab_size",
                "limits.max_vocab",
            ),
        ];
        for (m, want_field, want_text) in cases {
            let (f, message) = field(row(&m, 1 << 20).unwrap_err());
            assert_eq!(f, want_field, "{message}");
            assert!(message.contains(want_text), "{f}: {message}");
        }
        let ok = msg(&[1], &[1.0], -1.0, 10);
        assert!(conflicts_with_bytes(&[0; 4], Some(&ok)).is_some());
        assert!(conflicts_with_bytes(&[], Some(&ok)).is_none());
    }
}
