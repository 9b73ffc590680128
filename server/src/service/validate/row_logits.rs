//! A step's logits as sent: which of a message's encodings holds them
//! (inline f32, f32le bytes, f16 or bf16 bytes, a sparse row, a
//! shared-memory row) and their decoding, each error naming the field.
//! Below the message checks (`batch`, `verify`, the `Sample` and stream
//! ones) and `service::shared_memory`, which all hand rows around as
//! [`RowLogits`].

#![forbid(unsafe_code)]

use half::{bf16, f16};
use samplerd_api::v1;
use samplerd_sampling::step::Logits;

use samplerd_sampling::sparse::SparseRow;

use super::sparse::{self, row};
use crate::request::convert::{FIELD_LOGITS, FIELD_SHARED, FIELD_SPARSE, LogitsInput};
use crate::request::errors::{InvalidKind, RequestError};

/// The encoding of a batch's logits bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32le,
    F16le,
    Bf16le,
}

impl Dtype {
    /// The request's `dtype` (unset is f32).
    pub fn from_proto(value: i32) -> Result<Self, RequestError> {
        use v1::LogitsDtype as D;
        match D::try_from(value) {
            Ok(D::Unspecified | D::F32le) => Ok(Dtype::F32le),
            Ok(D::F16le) => Ok(Dtype::F16le),
            Ok(D::Bf16le) => Ok(Dtype::Bf16le),
            Err(_) => Err(RequestError::invalid(
                "dtype",
                format!("unknown LogitsDtype {value} (F32LE, F16LE or BF16LE)"),
            )),
        }
    }

    /// Bytes per logit.
    pub const fn width(self) -> usize {
        match self {
            Dtype::F32le => 4,
            Dtype::F16le | Dtype::Bf16le => 2,
        }
    }

    const fn name(self) -> &'static str {
        match self {
            Dtype::F32le => "f32le",
            Dtype::F16le => "f16le",
            Dtype::Bf16le => "bf16le",
        }
    }
}

/// A row's logits as decoded from the wire: f32 bytes are sampled where
/// they lie; half-width ones are first widened to f32, exactly (every f16
/// and bf16 value is an f32 value), so a row gives what `Sample` gives for
/// the same values sent as f32.
/// A row's `sparse` is taken as it is (the dtype does not apply to it).
/// A row read from shared memory is one of the first two, in `Shared`.
pub enum RowLogits<'a> {
    F32le(&'a [u8]),
    Widened(Vec<f32>),
    Sparse(SparseRow<'a>),
    /// A row in a shared-memory region (field `shared`).
    Shared(Box<RowLogits<'a>>),
}

impl<'a> RowLogits<'a> {
    /// A row's logits: its `sparse` row ([`sparse::row`]) when set (with
    /// `logits` set too, INVALID_ARGUMENT), else `bytes` (field `logits`)
    /// decoded as `dtype`: a byte length that is not a whole number of
    /// logits is INVALID_ARGUMENT, and so is a row over `limits.max_vocab`
    /// (checked before widening allocates).
    pub fn decode(
        dtype: Dtype,
        bytes: &'a [u8],
        sparse: Option<&'a v1::SparseLogits>,
        max_vocab: usize,
    ) -> Result<Self, RequestError> {
        if let Some(e) = sparse::conflicts_with_bytes(bytes, sparse) {
            return Err(e);
        }
        if let Some(msg) = sparse {
            return sparse::row(msg, max_vocab).map(RowLogits::Sparse);
        }
        let width = dtype.width();
        if !bytes.len().is_multiple_of(width) {
            return Err(RequestError::invalid_as(
                InvalidKind::Logits,
                FIELD_LOGITS,
                format!(
                    "length {} bytes is not a multiple of {width} (dtype {})",
                    bytes.len(),
                    dtype.name()
                ),
            ));
        }
        let n = bytes.len() / width;
        if n > max_vocab {
            return Err(RequestError::limit(
                FIELD_LOGITS,
                "limits.max_vocab",
                format!(
                    "vocabulary of {n} logits exceeds the limit of {max_vocab} (limits.max_vocab)"
                ),
            ));
        }
        let pairs = bytes.chunks_exact(2).map(|c| [c[0], c[1]]);
        Ok(match dtype {
            Dtype::F32le => RowLogits::F32le(bytes),
            Dtype::F16le => {
                RowLogits::Widened(pairs.map(|b| f16::from_le_bytes(b).to_f32()).collect())
            }
            Dtype::Bf16le => {
                RowLogits::Widened(pairs.map(|b| bf16::from_le_bytes(b).to_f32()).collect())
            }
        })
    }

    /// The logits as a step's input (field `logits`, or `shared`).
    pub fn input(&self, max_vocab: usize) -> Result<LogitsInput<'_>, RequestError> {
        self.input_as(FIELD_LOGITS, max_vocab)
    }

    fn input_as(
        &self,
        field: &'static str,
        max_vocab: usize,
    ) -> Result<LogitsInput<'_>, RequestError> {
        let logits = match self {
            RowLogits::F32le(b) => Logits::F32le(b),
            RowLogits::Widened(f) => Logits::Floats(f),
            RowLogits::Sparse(r) => return Ok(LogitsInput::sparse(*r)),
            RowLogits::Shared(inner) => return inner.input_as(FIELD_SHARED, max_vocab),
        };
        LogitsInput::from_field(logits, field, max_vocab)
    }

    /// Number of logits.
    pub fn len(&self) -> usize {
        match self {
            RowLogits::F32le(b) => b.len() / 4,
            RowLogits::Widened(f) => f.len(),
            RowLogits::Sparse(r) => r.n_vocab(),
            RowLogits::Shared(inner) => inner.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The step's logits of a message with the inline encodings `floats` and
/// `bytes` and the sparse one: exactly one of the three.
/// A row from shared memory (`shared`, already resolved and checked
/// against the others by `service::shared_memory`) wins.
pub fn step_logits<'a>(
    floats: &'a [f32],
    bytes: &'a [u8],
    sparse: Option<&'a v1::SparseLogits>,
    shared: Option<&'a RowLogits<'a>>,
    max_vocab: usize,
) -> Result<LogitsInput<'a>, RequestError> {
    if let Some(row) = shared {
        return row.input(max_vocab);
    }
    let Some(msg) = sparse else {
        return LogitsInput::from_request(floats, bytes, max_vocab);
    };
    let also = [
        (
            !floats.is_empty(),
            format!("`logits` ({} floats)", floats.len()),
        ),
        (
            !bytes.is_empty(),
            format!("`logits_f32le` ({} bytes)", bytes.len()),
        ),
    ];
    if let Some((_, other)) = also.iter().find(|(set, _)| *set) {
        return Err(RequestError::invalid(
            FIELD_SPARSE,
            format!(
                "set exactly one of `logits`, `logits_f32le` and `sparse`, got `sparse` and {other}"
            ),
        ));
    }
    Ok(LogitsInput::sparse(row(msg, max_vocab)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(e: RequestError) -> (String, String) {
        match e {
            RequestError::Invalid { field, message, .. } => (field, message),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_sparse_step_refuses_inline_logits_beside_it() {
        let ok = v1::SparseLogits {
            ids: vec![1],
            values: vec![1.0],
            rest_logsumexp: -1.0,
            vocab_size: 10,
        };
        let (f, message) = field(step_logits(&[0.5], &[], Some(&ok), None, 100).unwrap_err());
        assert_eq!(f, "sparse");
        assert!(
            message.contains("got `sparse` and `logits` (1 floats)"),
            "{message}"
        );
        let (f, _) = field(step_logits(&[], &[0; 4], Some(&ok), None, 100).unwrap_err());
        assert_eq!(f, "sparse");
        assert_eq!(
            step_logits(&[], &[], Some(&ok), None, 100).unwrap().len(),
            10
        );
    }
}
