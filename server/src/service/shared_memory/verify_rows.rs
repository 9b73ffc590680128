//! The shared-memory rows of a `Verify` (`VerifyRow.shared`): resolved —
//! region owned by the caller, bounds checked — before the Verify's rows
//! are decoded, and checked again after the verification read them, as a
//! step's one shared row is.

#![forbid(unsafe_code)]

use samplerd_api::v1;

use super::{SharedRegions, SharedRow};
use crate::request::convert::{FIELD_LOGITS, FIELD_SPARSE};
use crate::request::errors::RequestError;
use crate::service::validate::row_logits::RowLogits;
use crate::transport::identity::Caller;

/// A Verify's shared rows, by position (`None`: the row is inline or
/// sparse).
#[derive(Default)]
pub struct VerifyShared {
    target: Vec<Option<SharedRow>>,
    drafter: Vec<Option<SharedRow>>,
}

impl VerifyShared {
    /// Resolves every `shared` row of `v` (errors name
    /// `verify.target_rows[j].shared…`). A Verify with more rows than
    /// `max_draft_tokens` allows resolves none: its validation refuses
    /// the row count first.
    pub fn resolve(
        regions: &SharedRegions,
        v: &v1::Verify,
        caller: &Caller,
        max_draft_tokens: usize,
        max_vocab: usize,
    ) -> Result<Self, RequestError> {
        if v.target_rows.len() > max_draft_tokens + 1 || v.drafter_rows.len() > max_draft_tokens {
            return Ok(VerifyShared::default());
        }
        let resolve = |rows: &[v1::VerifyRow], name: &str| {
            rows.iter()
                .enumerate()
                .map(|(j, r)| {
                    regions
                        .resolve_in(
                            r.shared.as_ref(),
                            &[
                                (!r.logits.is_empty(), FIELD_LOGITS),
                                (r.sparse.is_some(), FIELD_SPARSE),
                            ],
                            caller,
                            max_vocab,
                        )
                        .map_err(|e| e.under(&format!("verify.{name}[{j}]")))
                })
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(VerifyShared {
            target: resolve(&v.target_rows, "target_rows")?,
            drafter: resolve(&v.drafter_rows, "drafter_rows")?,
        })
    }

    /// The rows as the Verify's validation takes them: target, drafter.
    pub fn logits(&self) -> (Vec<Option<RowLogits<'_>>>, Vec<Option<RowLogits<'_>>>) {
        (logits_of(&self.target), logits_of(&self.drafter))
    }

    /// After the verification read the rows: an error naming the first
    /// region a truncation lost meanwhile ([`SharedRegions::check_read`]).
    pub fn check_read(&self, regions: &SharedRegions) -> Result<(), RequestError> {
        for (name, rows) in [
            ("target_rows", &self.target),
            ("drafter_rows", &self.drafter),
        ] {
            for (j, row) in rows.iter().enumerate() {
                if let Some(row) = row {
                    regions
                        .check_read(row)
                        .map_err(|e| e.under(&format!("verify.{name}[{j}]")))?;
                }
            }
        }
        Ok(())
    }
}

fn logits_of(rows: &[Option<SharedRow>]) -> Vec<Option<RowLogits<'_>>> {
    rows.iter()
        .map(|r| r.as_ref().map(SharedRow::logits))
        .collect()
}
