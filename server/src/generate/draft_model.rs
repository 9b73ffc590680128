//! `DRAFT_SOURCE_MODEL`: a second, smaller GGUF (`model.draft_path`)
//! proposes the drafts that speculative decoding verifies.
//!
//! The draft model is loaded at start-up beside the target, on the same
//! device and with the same numerics, and must share the target's
//! vocabulary token for token (refused otherwise, naming both files): a
//! draft id is a target id. Its decode steps run on their own engine
//! thread (a second [`Batcher`]), batched across the generations that
//! speculate, so drafting never delays the target's steps.
//!
//! Each round a choice's [`ModelDrafter`] brings its draft KV cache up to
//! the committed text (keeping the longest common prefix: what was
//! accepted is already there), then proposes up to `k` tokens by running
//! **the request's own chain** over the draft model's logits — a copy of
//! the choice's [`Sequence`] (penalty window, DRY history, grammar state),
//! the same seed and the same step numbers the target will sample them
//! at. With greedy chains a draft is the draft model's argmax; with a
//! seeded `dist` the two models invert the same uniform, so wherever
//! their distributions are close they pick the same token (the coupling
//! `VERIFY_MODE_COUPLED` makes exact for `coupled` chains). What the
//! target keeps is decided by EXACT verification as for every source, so
//! the text is the one decoding without drafts gives, whatever the draft
//! model proposes.

#![forbid(unsafe_code)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use samplerd_model::{Model, ModelOptions, Session, TokenInfo};
use samplerd_sampling::Sequence;

use super::batcher::{Batcher, SeqHandle};
use super::draft_cache::DraftCache;
use super::draft_record::DraftRecord;
use super::generator::{EndRule, GenerateJob};
use super::kept_sessions::kv_bytes_per_token;
use super::{ModelLoadError, check_model_file, model_failure, sample_token};
use crate::request::errors::RequestError;
use crate::request::memory::MemoryBudget;

/// The loaded draft model, its decode engine and its prompt cache.
pub struct DraftModel {
    model: Arc<Model>,
    batcher: Batcher,
    cache: DraftCache,
    /// Whether it has paid in recent generations (`super::draft_record`).
    record: DraftRecord,
}

impl DraftModel {
    /// Loads `path` with the target's options (device, numerics, threads,
    /// context) and checks that it shares `target`'s vocabulary; keeps up
    /// to `cache_entries` finished draft sessions (`super::draft_cache`).
    pub fn load(
        path: &Path,
        target: &Model,
        opts: &ModelOptions,
        placement: &samplerd_model::Placement,
        (batch_wait, cache_entries): (Duration, usize),
    ) -> Result<Self, ModelLoadError> {
        let failed = |source| ModelLoadError {
            key: "model.draft_path",
            path: path.display().to_string(),
            source,
        };
        check_model_file(path).map_err(|e| failed(e.source))?;
        let model = Model::load_on(path, opts, placement).map_err(failed)?;
        check_vocabulary(
            (target.path(), target.vocabulary()),
            (path, model.vocabulary()),
        )
        .map_err(|why| {
            failed(samplerd_model::ModelError::Backend(format!(
                "the draft model does not share the vocabulary of model.path {}: {why}",
                target.path().display()
            )))
        })?;
        let batcher = Batcher::start(Arc::clone(&model), batch_wait).map_err(|e| {
            failed(samplerd_model::ModelError::Backend(format!(
                "cannot start the draft model's decode thread: {e}"
            )))
        })?;
        tracing::info!(
            path = %path.display(),
            arch = ?model.config().arch,
            backend = %model.backend_name(),
            weights = model.weight_bytes(),
            "draft model loaded"
        );
        let cache = DraftCache::new(&model, cache_entries);
        Ok(DraftModel {
            model,
            batcher,
            cache,
            record: DraftRecord::default(),
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Its record over recent generations (`super::draft_record`).
    pub fn record(&self) -> &DraftRecord {
        &self.record
    }

    /// What one choice's draft KV cache holds at most (`capacity` tokens,
    /// f16 K and V).
    pub fn kv_bytes(&self, capacity: usize) -> usize {
        capacity * kv_bytes_per_token(&self.model)
    }

    /// A drafter for one choice of a generation (its own KV cache, taken
    /// from the draft cache or made on first use with `capacity`
    /// positions, or the draft model's context if that is shorter; put
    /// back into the cache, charged to `memory`, when the drafter ends).
    pub(super) fn drafter(&self, capacity: usize, memory: &Arc<MemoryBudget>) -> ModelDrafter<'_> {
        ModelDrafter {
            draft: self,
            engine: self.batcher.join(),
            session: None,
            capacity: capacity.min(self.model.n_ctx()),
            memory: Arc::clone(memory),
        }
    }
}

/// Why two models' vocabularies differ (the first difference, naming
/// both files), or Ok.
pub fn check_vocabulary(
    (target_path, target): (&Path, &[TokenInfo]),
    (draft_path, draft): (&Path, &[TokenInfo]),
) -> Result<(), String> {
    let (t, d) = (target, draft);
    if t.len() != d.len() {
        return Err(format!(
            "{} has {} tokens, {} has {}",
            draft_path.display(),
            d.len(),
            target_path.display(),
            t.len()
        ));
    }
    match t.iter().zip(d).position(|(a, b)| a.bytes != b.bytes) {
        None => Ok(()),
        Some(id) => Err(format!(
            "token {id} is {:?} in {} and {:?} in {}",
            String::from_utf8_lossy(&d[id].bytes),
            draft_path.display(),
            String::from_utf8_lossy(&t[id].bytes),
            target_path.display()
        )),
    }
}

/// One choice's drafting state: its handle on the draft engine and its
/// draft KV cache.
pub(super) struct ModelDrafter<'a> {
    draft: &'a DraftModel,
    engine: SeqHandle<'a>,
    session: Option<Session>,
    capacity: usize,
    memory: Arc<MemoryBudget>,
}

impl Drop for ModelDrafter<'_> {
    fn drop(&mut self) {
        if let Some(session) = self.session.take() {
            self.draft.cache.put(session, &self.memory);
        }
    }
}

/// What a draft round needs from the generation: the committed text, the
/// choice's chain state after it, where its next step is.
pub(super) struct DraftInput<'s> {
    /// Every committed token (prompt and output), the last one not yet run
    /// by the target.
    pub history: &'s [u32],
    /// The choice's chain, having accepted every output token of `history`.
    pub seq: &'s Sequence,
    /// The step the first draft would be sampled at, and the choice's seed.
    pub step: u64,
    pub seed: u64,
    /// Drafts stop before a token that would end the generation.
    pub end: &'s EndRule,
}

impl ModelDrafter<'_> {
    /// Up to `k` drafts after `input.history`, drawn by the request's chain
    /// from the draft model's logits. A chain error (a grammar that masks
    /// everything on the draft's logits, a plugin failure) ends the drafts
    /// early rather than the request: the target's own step decides.
    pub(super) fn draft(
        &mut self,
        job: &GenerateJob,
        input: DraftInput<'_>,
        k: usize,
    ) -> Result<Vec<u32>, RequestError> {
        let history = input.history;
        // Past the draft cache's end the target decodes alone.
        if k == 0 || history.is_empty() || history.len() >= self.capacity {
            return Ok(Vec::new());
        }
        let mut session = match self.session.take() {
            Some(s) => s,
            None => match self.draft.cache.take(history, self.capacity) {
                Some(s) => s,
                None => self
                    .draft
                    .model
                    .new_session_with_capacity(self.capacity)
                    .map_err(model_failure)?,
            },
        };
        // Keep what the cache shares with the text, but run at least the
        // last token: its logits are the first draft's.
        let keep = session
            .cached_tokens()
            .iter()
            .zip(history)
            .take_while(|(a, b)| a == b)
            .count()
            .min(history.len() - 1);
        session.truncate(keep);
        session = self.run(session, history[keep..].to_vec())?;
        let seq = input.seq.try_clone().map_err(RequestError::Plugin)?;
        let buf = job.buffers.lease(self.draft.model.n_vocab());
        let (model, request_id, seed) = (Arc::clone(&self.draft.model), job.request_id, input.seed);
        let mut moved = (seq, buf, session);
        let mut drafts = Vec::with_capacity(k);
        loop {
            let step = input.step + drafts.len() as u64;
            let (back, token) = job.steps.run_blocking(move || {
                let _serving = samplerd_sampling::activity::serving(request_id);
                let (seq, buf, session) = &mut moved;
                let token =
                    sample_token(seq, buf, session.logits(), seed, step, Default::default())
                        .ok()
                        .map(|out| out.token_id);
                (moved, token)
            })?;
            moved = back;
            let Some(token) = token else { break };
            if input.end.ends(token, |t| model.tokenizer().is_eog(t)) {
                break;
            }
            drafts.push(token);
            // The cache can hold the drafts the target may keep (`k` is
            // bounded by the target's room, and both caches are as large).
            if drafts.len() == k || moved.2.position() + 1 >= moved.2.capacity() {
                break;
            }
            if moved.0.accept(token).is_err() {
                break;
            }
            let (seq, b, session) = moved;
            moved = (seq, b, self.run(session, vec![token])?);
        }
        let (_, _, session) = moved;
        self.session = Some(session);
        Ok(drafts)
    }

    /// One step of the draft model on its engine.
    fn run(&self, session: Session, tokens: Vec<u32>) -> Result<Session, RequestError> {
        self.engine
            .step(session, tokens)
            .map_err(|(_, e)| RequestError::Internal(format!("the draft model failed: {e}")))
    }
}
