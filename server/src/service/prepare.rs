//! Before validation: a request's constraint stages compiled off the
//! sampling threads (`service/constraint`), against the vocabulary the
//! request names or the model's. Methods of [`AppState`], kept apart from
//! the state itself because they ask validation which stages need a
//! vocabulary (and validation reads the state).

#![forbid(unsafe_code)]

use std::sync::Arc;

use samplerd_api::v1;

use crate::request::errors::RequestError;
use crate::service::constraint;
use crate::service::state::AppState;
use crate::service::validate;

impl AppState {
    /// The compiled constraint stages of parameters `p` (against
    /// `params.vocabulary`'s vocabulary, or `vocab` when given: Generate's
    /// model vocabulary), compiled off the sampling threads: what
    /// validation then builds the chain with.
    pub async fn prepare_constraints(
        &self,
        p: Option<&v1::SamplingParams>,
        vocab: Option<&Arc<samplerd_sampling::Vocabulary>>,
        request: u64,
    ) -> Result<constraint::Prepared, RequestError> {
        let Some(vocab) = self.compile_vocabulary(p, vocab)? else {
            return Ok(constraint::Prepared::default());
        };
        self.constraints
            .prepare(&self.defaults, p, Some(vocab), request)
            .await
    }

    /// [`prepare_constraints`](Self::prepare_constraints) without a
    /// runtime (the protobuf fuzz target).
    pub fn prepare_constraints_blocking(
        &self,
        p: Option<&v1::SamplingParams>,
        vocab: Option<&Arc<samplerd_sampling::Vocabulary>>,
    ) -> Result<constraint::Prepared, RequestError> {
        let Some(vocab) = self.compile_vocabulary(p, vocab)? else {
            return Ok(constraint::Prepared::default());
        };
        self.constraints
            .prepare_blocking(&self.defaults, p, Some(vocab))
    }

    /// The vocabulary a constraint compiles against: `vocab` when given,
    /// else [`named_vocabulary`](Self::named_vocabulary)'s.
    fn compile_vocabulary<'a>(
        &'a self,
        p: Option<&v1::SamplingParams>,
        vocab: Option<&'a Arc<samplerd_sampling::Vocabulary>>,
    ) -> Result<Option<&'a Arc<samplerd_sampling::Vocabulary>>, RequestError> {
        // The constraint's own fields first: a client told to name a
        // vocabulary would otherwise learn of them only on its next try.
        if let Some(c) = p.and_then(|p| p.constraint.as_ref()) {
            validate::check_json_whitespace(c)?;
            validate::check_triggers(c, &self.limits, None)?;
        }
        let vocab = match vocab {
            Some(v) => Some(v),
            None => self.named_vocabulary(p)?,
        };
        // Trigger tokens against the vocabulary, once it is known.
        if let Some(c) = p.and_then(|p| p.constraint.as_ref()) {
            validate::check_triggers(c, &self.limits, vocab.map(|v| v.len()))?;
        }
        Ok(vocab)
    }

    /// The vocabulary a constraint compiles against when the caller has
    /// none of its own: the one `params.vocabulary` names, or `None` when
    /// nothing needs compiling — the name is unknown (validation refuses
    /// it before any chain is built), or no stage needs one. Empty while a
    /// stage needs one is refused here as validation would, naming
    /// `params.vocabulary` (a compile without would only say that the
    /// stage has no vocabulary).
    fn named_vocabulary(
        &self,
        p: Option<&v1::SamplingParams>,
    ) -> Result<Option<&Arc<samplerd_sampling::Vocabulary>>, RequestError> {
        match p.map(|p| p.vocabulary.as_str()).filter(|n| !n.is_empty()) {
            None => validate::vocabulary_needed(self, p).map(|()| None),
            Some(n) => Ok(self.vocabularies.get(n)),
        }
    }
}
