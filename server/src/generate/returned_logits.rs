//! `GenerateRequest.return_logits`: each step's raw logits as the client
//! asked for them — the full row in f32, f16 or bf16 (little-endian), or
//! the top `n` and the log-sum-exp of the rest (the sparse row form a
//! client can send back as `SparseLogits`).

#![forbid(unsafe_code)]

use half::{bf16, f16};
use samplerd_api::v1;

/// A validated `return_logits`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReturnLogits {
    /// The full row in this encoding.
    Full(v1::LogitsDtype),
    /// The top `n` (at least 1, at most the vocabulary).
    Top(usize),
}

impl ReturnLogits {
    /// Fills `token`'s `logits` or `sparse_logits` from a step's `logits`.
    pub fn attach(self, logits: &[f32], token: &mut v1::Token) {
        match self {
            ReturnLogits::Full(dtype) => token.logits = encode(logits, dtype),
            ReturnLogits::Top(n) => token.sparse_logits = Some(top_n(logits, n)),
        }
    }
}

/// `logits` as little-endian bytes of `dtype` (f16/bf16 round to nearest
/// even, as `half` converts).
fn encode(logits: &[f32], dtype: v1::LogitsDtype) -> Vec<u8> {
    use v1::LogitsDtype as D;
    match dtype {
        D::Unspecified | D::F32le => logits.iter().flat_map(|x| x.to_le_bytes()).collect(),
        D::F16le => logits
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect(),
        D::Bf16le => logits
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect(),
    }
}

/// The `n` largest logits (ids ascending; ties to the lower id) and the
/// log-sum-exp of every other one, in f64 (−inf when none is left).
fn top_n(logits: &[f32], n: usize) -> v1::SparseLogits {
    let n = n.min(logits.len());
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if n < order.len() && n > 0 {
        order.select_nth_unstable_by(n - 1, by_logit);
    }
    let (top, rest) = order.split_at_mut(n);
    top.sort_unstable();
    let max = rest
        .iter()
        .map(|&i| f64::from(logits[i as usize]))
        .fold(f64::NEG_INFINITY, f64::max);
    let rest_logsumexp = if max == f64::NEG_INFINITY {
        f64::NEG_INFINITY
    } else {
        let sum: f64 = rest
            .iter()
            .map(|&i| (f64::from(logits[i as usize]) - max).exp())
            .sum();
        max + sum.ln()
    };
    v1::SparseLogits {
        ids: top.to_vec(),
        values: top.iter().map(|&i| logits[i as usize]).collect(),
        rest_logsumexp,
        vocab_size: logits.len() as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_rows_round_trip_in_each_encoding() {
        let l = [0.5f32, -1.25, 3.0, f32::NEG_INFINITY];
        let f32s: Vec<f32> = encode(&l, v1::LogitsDtype::F32le)
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(f32s, l);
        let f16s: Vec<f32> = encode(&l, v1::LogitsDtype::F16le)
            .chunks(2)
            .map(|c| f16::from_le_bytes(c.try_into().unwrap()).to_f32())
            .collect();
        assert_eq!(f16s, l, "these values are exact in f16");
        let bf16s = encode(&[1.0f32 / 3.0], v1::LogitsDtype::Bf16le);
        assert_eq!(bf16s, bf16::from_f32(1.0 / 3.0).to_le_bytes());
    }

    #[test]
    fn top_n_keeps_the_largest_and_sums_the_rest() {
        let l = [1.0f32, 5.0, -2.0, 5.0, 0.0, 3.0];
        let s = top_n(&l, 3);
        assert_eq!(s.ids, [1, 3, 5]);
        assert_eq!(s.values, [5.0, 5.0, 3.0]);
        assert_eq!(s.vocab_size, 6);
        let want = [1.0f64, -2.0, 0.0]
            .iter()
            .map(|x| x.exp())
            .sum::<f64>()
            .ln();
        assert!(
            (s.rest_logsumexp - want).abs() < 1e-12,
            "{}",
            s.rest_logsumexp
        );
        // Ties go to the lower id; the whole row leaves nothing to sum.
        assert_eq!(top_n(&l, 1).ids, [1]);
        let all = top_n(&l, 10);
        assert_eq!(all.ids, [0, 1, 2, 3, 4, 5]);
        assert_eq!(all.rest_logsumexp, f64::NEG_INFINITY);
    }
}
