//! A sparse row as the proof takes it: the sent entries (ids inside the
//! vocabulary, each once, their logits finite or −∞) and the log-sum-exp
//! of every logit that was not sent, checked to be a log-sum-exp such
//! logits can have. [`SparseRow::new`] is the only way to make one.

/// One step's sparse logits: `ids[i]` has logit `values[i]`; every other
/// token of the `n_vocab` is at most `min(values)` and their log-sum-exp is
/// `rest_lse`.
#[derive(Clone, Copy, Debug)]
pub struct SparseRow<'a> {
    ids: &'a [u32],
    values: &'a [f32],
    rest_lse: f64,
    n_vocab: usize,
    /// min(values).
    min: f32,
    /// `ids` strictly ascending (no sort needed to lay them out by id).
    ascending: bool,
}

/// Why entries cannot form a sparse row. [`SparseRowError::field`] names the
/// field (relative to the `SparseLogits` message), the message says the
/// rest.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SparseRowError {
    #[error("is 0: a row has at least one token")]
    NoVocabulary,
    #[error("is empty: send at least one entry")]
    Empty,
    #[error("has {ids} ids but {values} values: one value per id")]
    LengthMismatch { ids: usize, values: usize },
    #[error("{n} entries for a vocabulary of {n_vocab} tokens")]
    TooMany { n: usize, n_vocab: usize },
    #[error("token id {id} is outside the vocabulary of {n_vocab} tokens (vocab_size)")]
    IdOutOfRange {
        index: usize,
        id: u32,
        n_vocab: usize,
    },
    #[error("token id {id} is sent twice (also ids[{first}])")]
    DuplicateId { index: usize, id: u32, first: usize },
    #[error("is {value}: logits must be finite or -inf")]
    NotFinite { index: usize, value: f32 },
    #[error("every sent logit is -inf, and so is every other: nothing can be sampled")]
    AllMasked,
    #[error("is {value}: the log-sum-exp of the unsent logits is finite or -inf")]
    RestNotFinite { value: f64 },
    #[error(
        "is {rest}, but {unsent} unsent logits each at most min(values) = {min} sum to at most \
         {bound} (min(values) + ln {unsent}): every unsent logit must be at most the smallest sent one"
    )]
    RestTooLarge {
        rest: f64,
        min: f32,
        unsent: usize,
        bound: f64,
    },
    #[error("is {rest}, but every token is sent: nothing is left, so it must be -inf")]
    NothingUnsent { rest: f64 },
}

impl SparseRowError {
    /// The field at fault, relative to the `SparseLogits` message
    /// (`ids[3]`, `values`, `rest_logsumexp`, `vocab_size`).
    pub fn field(&self) -> String {
        match self {
            Self::NoVocabulary => "vocab_size".into(),
            Self::Empty | Self::LengthMismatch { .. } | Self::TooMany { .. } => "ids".into(),
            Self::IdOutOfRange { index, .. } | Self::DuplicateId { index, .. } => {
                format!("ids[{index}]")
            }
            Self::NotFinite { index, .. } => format!("values[{index}]"),
            Self::AllMasked => "values".into(),
            Self::RestNotFinite { .. } | Self::RestTooLarge { .. } | Self::NothingUnsent { .. } => {
                "rest_logsumexp".into()
            }
        }
    }
}

/// How far above `min(values) + ln(unsent)` a client's log-sum-exp may
/// come and still be taken (relative to the magnitudes involved): a sum in
/// f32 over logits all equal to the minimum rounds to about 1e-7 of it; the
/// proof then widens its interval by the same amount.
pub(crate) const REST_SLACK: f64 = 1e-6;

impl<'a> SparseRow<'a> {
    /// Checks the entries: `ids` and `values` of one length, at least one
    /// and at most `n_vocab`, every id below `n_vocab` and sent once, every
    /// value finite or −∞ and not all −∞ with nothing else left,
    /// `rest_lse` finite or −∞ and no larger than `min(values) + ln
    /// (n_vocab − ids.len())` allows (−∞ when every token is sent). O(n)
    /// for ids sent in ascending order, else O(n log n); nothing the size
    /// of the vocabulary is allocated.
    pub fn new(
        ids: &'a [u32],
        values: &'a [f32],
        rest_lse: f64,
        n_vocab: usize,
    ) -> Result<Self, SparseRowError> {
        if n_vocab == 0 {
            return Err(SparseRowError::NoVocabulary);
        }
        if ids.len() != values.len() {
            return Err(SparseRowError::LengthMismatch {
                ids: ids.len(),
                values: values.len(),
            });
        }
        if ids.is_empty() {
            return Err(SparseRowError::Empty);
        }
        if ids.len() > n_vocab {
            return Err(SparseRowError::TooMany {
                n: ids.len(),
                n_vocab,
            });
        }
        if let Some(index) = ids.iter().position(|&id| id as usize >= n_vocab) {
            return Err(SparseRowError::IdOutOfRange {
                index,
                id: ids[index],
                n_vocab,
            });
        }
        let ascending = ids.windows(2).all(|w| w[0] < w[1]);
        if !ascending && let Some((index, first)) = first_duplicate(ids) {
            return Err(SparseRowError::DuplicateId {
                index,
                id: ids[index],
                first,
            });
        }
        if let Some(index) = values
            .iter()
            .position(|v| v.is_nan() || *v == f32::INFINITY)
        {
            return Err(SparseRowError::NotFinite {
                index,
                value: values[index],
            });
        }
        let min = values.iter().copied().fold(f32::INFINITY, f32::min);
        let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if rest_lse.is_nan() || rest_lse == f64::INFINITY {
            return Err(SparseRowError::RestNotFinite { value: rest_lse });
        }
        let unsent = n_vocab - ids.len();
        if unsent == 0 && rest_lse != f64::NEG_INFINITY {
            return Err(SparseRowError::NothingUnsent { rest: rest_lse });
        }
        if unsent > 0 && rest_lse > f64::NEG_INFINITY {
            let ln_c = (unsent as f64).ln();
            let bound = min as f64 + ln_c;
            let slack = REST_SLACK * (1.0 + (min as f64).abs() + ln_c);
            // A −∞ minimum leaves every unsent logit at −∞: no finite rest.
            if min == f32::NEG_INFINITY || rest_lse > bound + slack {
                return Err(SparseRowError::RestTooLarge {
                    rest: rest_lse,
                    min,
                    unsent,
                    bound,
                });
            }
        }
        if max == f32::NEG_INFINITY && rest_lse == f64::NEG_INFINITY {
            return Err(SparseRowError::AllMasked);
        }
        Ok(SparseRow {
            ids,
            values,
            rest_lse,
            n_vocab,
            min,
            ascending,
        })
    }

    pub fn ids(&self) -> &'a [u32] {
        self.ids
    }

    pub fn values(&self) -> &'a [f32] {
        self.values
    }

    /// The log-sum-exp of the logits that were not sent (−∞: none, or all
    /// −∞).
    pub fn rest_lse(&self) -> f64 {
        self.rest_lse
    }

    /// The whole row's length.
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// Entries sent.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Tokens not sent.
    pub fn unsent(&self) -> usize {
        self.n_vocab - self.ids.len()
    }

    /// Whether the ids came in ascending order.
    pub(crate) fn ascending(&self) -> bool {
        self.ascending
    }

    /// The bound on every unsent logit the row itself gives: `min(values)`,
    /// and no more than the rest's log-sum-exp (one term never exceeds the
    /// log of the sum), rounded up to an f32; −∞ when nothing is unsent or
    /// the rest is −∞.
    pub fn unsent_bound(&self) -> f32 {
        if self.unsent() == 0 || self.rest_lse == f64::NEG_INFINITY {
            return f32::NEG_INFINITY;
        }
        self.min.min(f32_at_least(self.rest_lse))
    }

    /// The whole row's log-sum-exp: `logaddexp(lse(values), rest_lse)` in
    /// f64.
    pub fn log_sum_exp(&self) -> f64 {
        let max = self
            .values
            .iter()
            .fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64))
            .max(self.rest_lse);
        if max == f64::NEG_INFINITY {
            return max;
        }
        let sum: f64 = self
            .values
            .iter()
            .map(|&v| (v as f64 - max).exp())
            .sum::<f64>()
            + (self.rest_lse - max).exp();
        max + sum.ln()
    }
}

/// The smallest f32 at or above `x` (finite `x`).
pub(crate) fn f32_at_least(x: f64) -> f32 {
    let f = x as f32;
    if (f as f64) < x { f.next_up() } else { f }
}

/// The largest f32 at or below `x` (finite `x`).
pub(crate) fn f32_at_most(x: f64) -> f32 {
    let f = x as f32;
    if (f as f64) > x { f.next_down() } else { f }
}

/// The first index whose id appeared before, and that earlier index (cold:
/// ids not in ascending order).
#[cold]
fn first_duplicate(ids: &[u32]) -> Option<(usize, usize)> {
    let mut order: Vec<u32> = (0..ids.len() as u32).collect();
    order.sort_unstable_by_key(|&i| (ids[i as usize], i));
    // Within one id the earliest index sorts first; the repeat reported is
    // the smallest index that is a repeat.
    order
        .windows(2)
        .filter(|w| ids[w[0] as usize] == ids[w[1] as usize])
        .map(|w| (w[1] as usize, w[0] as usize))
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_malformed_row_names_its_field() {
        let e = |ids: &[u32], v: &[f32], r: f64, n| SparseRow::new(ids, v, r, n).unwrap_err();
        let cases = [
            (e(&[0], &[1.0], -1.0, 0), "vocab_size"),
            (e(&[], &[], -1.0, 4), "ids"),
            (e(&[0, 1], &[1.0], -1.0, 4), "ids"),
            (e(&[0, 1, 2], &[1.0; 3], -1.0, 2), "ids"),
            (e(&[0, 9], &[1.0, 2.0], -1.0, 4), "ids[1]"),
            (e(&[3, 1, 3, 1], &[1.0; 4], -1.0, 8), "ids[2]"),
            (e(&[0, 1], &[1.0, f32::NAN], -1.0, 4), "values[1]"),
            (e(&[0, 1], &[f32::INFINITY, 1.0], -1.0, 4), "values[0]"),
            (
                e(&[0], &[f32::NEG_INFINITY], f64::NEG_INFINITY, 4),
                "values",
            ),
            (e(&[0], &[1.0], f64::NAN, 4), "rest_logsumexp"),
            (e(&[0], &[1.0], f64::INFINITY, 4), "rest_logsumexp"),
            (e(&[0], &[1.0], 1.0 + 3f64.ln() + 1e-3, 4), "rest_logsumexp"),
            (e(&[0], &[f32::NEG_INFINITY], 0.0, 4), "rest_logsumexp"),
            (e(&[0, 1], &[1.0, 2.0], 0.0, 2), "rest_logsumexp"),
        ];
        for (err, field) in cases {
            assert_eq!(err.field(), field, "{err}");
        }
        assert_eq!(
            e(&[3, 1, 3, 1], &[1.0; 4], -1.0, 8).to_string(),
            "token id 3 is sent twice (also ids[0])"
        );
    }

    #[test]
    fn the_bound_on_unsent_logits_is_the_tighter_of_min_and_the_rest() {
        let r = SparseRow::new(&[2, 0], &[1.0, -2.0], -5.0, 10).unwrap();
        assert!(!r.ascending());
        assert_eq!(r.unsent_bound(), -5.0);
        let r = SparseRow::new(&[0, 2], &[1.0, -2.0], 0.0, 10).unwrap();
        assert!(r.ascending());
        assert_eq!(r.unsent_bound(), -2.0);
        // Nothing left, or all of it -inf: no unsent logit is finite.
        let r = SparseRow::new(&[0, 1], &[1.0, -2.0], f64::NEG_INFINITY, 10).unwrap();
        assert_eq!(r.unsent_bound(), f32::NEG_INFINITY);
        let r = SparseRow::new(&[0, 1], &[1.0, -2.0], f64::NEG_INFINITY, 2).unwrap();
        assert_eq!(r.unsent_bound(), f32::NEG_INFINITY);
        // Every unsent logit at the minimum: the largest rest allowed.
        let full = -2.0 + 8f64.ln();
        assert!(SparseRow::new(&[0, 1], &[1.0, -2.0], full, 10).is_ok());
        let lse = SparseRow::new(&[0, 1], &[1.0, -2.0], full, 10)
            .unwrap()
            .log_sum_exp();
        let want = (1f64.exp() + (-2f64).exp() + 8.0 * (-2f64).exp()).ln();
        assert!((lse - want).abs() < 1e-12, "{lse} {want}");
    }

    #[test]
    fn rounding_to_f32_goes_the_asked_way() {
        for x in [0.1f64, -0.1, 1e-30, -123.456789, 3.0] {
            assert!(f32_at_least(x) as f64 >= x && f32_at_most(x) as f64 <= x);
            assert!(f32_at_least(x).next_down() as f64 <= x || f32_at_least(x) as f64 == x);
        }
    }
}
