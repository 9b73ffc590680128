//! What one step reads: a whole row of logits ([`Logits`]), or a sparse
//! row ([`SparseRow`]: the top of the row and the log-sum-exp of the
//! rest), which a step answers exactly as it would the dense row, or
//! refuses. Every RPC's step and every position of a verification takes
//! one of these.

use crate::sparse::SparseRow;
use crate::step::Logits;

/// One step's logits as the sampling core takes them.
#[derive(Clone, Copy, Debug)]
pub enum StepLogits<'a> {
    Dense(Logits<'a>),
    Sparse(SparseRow<'a>),
}
