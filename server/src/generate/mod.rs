//! The model host behind `Generate`: validates a request, renders and
//! tokenizes the prompt, then runs the decode loop — forward pass, the
//! request's sampler chain over the logits, stop gates (end-of-generation
//! token, stop strings with hold-back, `max_tokens`, context) — streaming one
//! `Token` per step and one `Finished` at the end. A bounded admission queue
//! limits concurrent generations; a client that goes away stops its
//! generation within one step and frees its KV cache.

#![forbid(unsafe_code)]

mod admission;
mod batcher;
pub mod config;
mod device_sampling;
pub mod draft_cache;
pub mod draft_length;
pub mod draft_model;
pub mod draft_pacing;
pub mod draft_record;
pub mod generator;
mod kept_sessions;
mod prompt;
pub mod prompt_cache;
pub mod prompt_logprobs;
mod resume;
pub mod returned_logits;
pub mod speculate;
pub mod stop_filter;

use std::sync::Arc;
use std::time::{Duration, Instant};

use samplerd_api::v1;
use samplerd_model::{Model, ModelOptions, Session, Utf8Streamer};
use samplerd_sampling::{SampleError, Sequence, TokenBuffer, Vocabulary, step};
use stop_filter::StopFilter;
use tonic::Status;

use crate::generate::generator::{GenerateJob, GenerateSink, Generator, Prompt, ValidGenerate};
use crate::request::errors::{InvalidKind, RequestError};
use crate::status::Reason;
pub use admission::GENERATE_QUEUE_DEPTH_METRIC;
use admission::Slots;
pub use config::GenerateConfig;
use prompt::prompt_tokens;

/// Counter: tokens Generate produced.
pub const GENERATED_TOKENS_METRIC: &str = "samplerd_generated_tokens_total";
/// Gauge (seconds): how long loading the model took.
pub const MODEL_LOAD_METRIC: &str = "samplerd_model_load_seconds";

/// Describes the model host's metrics (the prompt cache's included) to the
/// recorder the process installed; the queue depth exists from the start
/// (a scrape shows 0, not nothing).
pub fn describe_metrics() {
    use metrics::{Unit, describe_counter, describe_gauge};
    describe_counter!(GENERATED_TOKENS_METRIC, "tokens produced by Generate");
    describe_gauge!(
        GENERATE_QUEUE_DEPTH_METRIC,
        "Generate requests waiting for a generation slot"
    );
    describe_gauge!(
        MODEL_LOAD_METRIC,
        Unit::Seconds,
        "time taken to load the model"
    );
    prompt_cache::describe();
    draft_cache::describe();
    speculate::describe();
    device_sampling::describe();
    metrics::gauge!(GENERATE_QUEUE_DEPTH_METRIC).set(0.0);
}

/// A loaded model serving Generate.
pub struct ModelHost {
    model: Arc<Model>,
    config: GenerateConfig,
    slots: Slots,
    batcher: batcher::Batcher,
    /// The model's tokens for sampler stages (built once at load).
    vocab: Arc<Vocabulary>,
    prompt_cache: prompt_cache::PromptCache,
    /// `model.draft_path`'s model, for `DRAFT_SOURCE_MODEL` speculation.
    draft: Option<draft_model::DraftModel>,
}

/// Why a model could not be loaded (names its config key and path).
#[derive(Debug, thiserror::Error)]
#[error("{key}: {source}")]
pub struct ModelLoadError {
    /// `model.path` or `model.draft_path`.
    pub key: &'static str,
    pub path: String,
    #[source]
    pub source: samplerd_model::ModelError,
}

/// Refuses a `model.path` that is not a regular file (symlinks followed)
/// before anything opens it: opening a FIFO blocks until some process
/// writes to it, so start-up would hang with the port closed, and a
/// device, socket or directory is no model either. A path that cannot be
/// inspected is left to the loader, whose error names it.
pub fn check_model_file(path: &std::path::Path) -> Result<(), ModelLoadError> {
    use std::os::unix::fs::FileTypeExt as _;
    let Ok(md) = std::fs::metadata(path) else {
        return Ok(());
    };
    let t = md.file_type();
    let kind = if t.is_file() {
        return Ok(());
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else {
        "not a file"
    };
    Err(ModelLoadError {
        key: "model.path",
        path: path.display().to_string(),
        source: samplerd_model::ModelError::Io {
            path: path.to_owned(),
            source: std::io::Error::other(format!("is {kind}, not a regular file")),
        },
    })
}

impl ModelHost {
    /// Loads the GGUF at `path` for the CPU backend.
    pub fn load(path: &std::path::Path, config: GenerateConfig) -> Result<Self, ModelLoadError> {
        Self::load_on(
            path,
            config,
            &samplerd_model::Placement::Cpu,
            samplerd_model::Numerics::default(),
        )
    }

    /// Loads the GGUF at `path` for the backend of `placement` (`model.device`
    /// as resolved by [`crate::generate::generator::resolve_device`]),
    /// computing in the arithmetic order of `numerics` (`model.numerics`).
    pub fn load_on(
        path: &std::path::Path,
        config: GenerateConfig,
        placement: &samplerd_model::Placement,
        numerics: samplerd_model::Numerics,
    ) -> Result<Self, ModelLoadError> {
        check_model_file(path)?;
        let opts = ModelOptions {
            n_threads: config.n_threads,
            n_ctx: config.n_ctx,
            numerics,
        };
        let model = Model::load_on(path, &opts, placement).map_err(|source| ModelLoadError {
            key: "model.path",
            path: path.display().to_string(),
            source,
        })?;
        tracing::info!(
            path = %path.display(),
            arch = ?model.config().arch,
            vocab = model.n_vocab(),
            n_ctx = model.n_ctx(),
            backend = %model.backend_name(),
            numerics = %model.numerics().describe(),
            "model loaded"
        );
        let batcher = batcher::Batcher::start(
            Arc::clone(&model),
            Duration::from_micros(config.batch_wait_us),
        )
        .map_err(|e| ModelLoadError {
            key: "model.path",
            path: path.display().to_string(),
            source: samplerd_model::ModelError::Backend(format!(
                "cannot start the decode thread: {e}"
            )),
        })?;
        let vocab = Arc::new(crate::request::vocabularies::plugin_vocabulary(
            model.vocabulary(),
        ));
        Ok(ModelHost {
            vocab,
            batcher,
            prompt_cache: prompt_cache::PromptCache::new(&model, config.prompt_cache_entries),
            slots: Slots::new(
                config.max_concurrent_generations,
                config.max_queued_generations,
            ),
            model,
            config,
            draft: None,
        })
    }

    /// Loads `model.draft_path` (`path`) for `DRAFT_SOURCE_MODEL`
    /// speculation: on the target's device, with its numerics, sharing its
    /// vocabulary (refused otherwise, naming both files).
    pub fn with_draft(
        mut self,
        path: &std::path::Path,
        placement: &samplerd_model::Placement,
    ) -> Result<Self, ModelLoadError> {
        let opts = ModelOptions {
            n_threads: self.config.n_threads,
            n_ctx: self.config.n_ctx,
            numerics: self.model.numerics(),
        };
        self.draft = Some(draft_model::DraftModel::load(
            path,
            &self.model,
            &opts,
            placement,
            (
                Duration::from_micros(self.config.batch_wait_us),
                self.config.prompt_cache_entries,
            ),
        )?);
        Ok(self)
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The draft model, when `model.draft_path` is set.
    pub fn draft_model(&self) -> Option<&Arc<Model>> {
        self.draft.as_ref().map(draft_model::DraftModel::model)
    }

    /// The most generations one decode step has batched so far.
    pub fn largest_decode_batch(&self) -> usize {
        self.batcher.largest_batch()
    }

    /// What one generation holds at its peak: the tokenizer's work on its
    /// prompt and a session's f16 K/V cache per choice (and the draft
    /// model's, when it drafts).
    fn generation_bytes(&self, req: &ValidGenerate) -> usize {
        let mut kv = self.model.n_ctx() * kept_sessions::kv_bytes_per_token(&self.model);
        if let (Some(draft), Some(spec)) = (&self.draft, &req.speculation)
            && spec.source == generator::DraftSource::Model
        {
            kv += draft.kv_bytes(self.model.n_ctx());
        }
        req.prompt.bytes() * crate::request::memory::TOKENIZER_BYTES_PER_PROMPT_BYTE
            + kv * req.choices as usize
    }

    /// A validated prompt's tokens: the chat template applied, tokenized,
    /// the count under `generate.max_prompt_tokens` and the context (public
    /// for the protobuf fuzz target).
    pub fn prompt_tokens(&self, prompt: &Prompt) -> Result<Vec<u32>, RequestError> {
        prompt_tokens(&self.model, &self.config, prompt)
    }

    /// One admitted generation over its prompt's tokens: the sequence
    /// opened (a resumed run's tokens replayed), the prompt prefilled, the
    /// decode loop, then `Finished`.
    fn run(
        &self,
        job: &GenerateJob,
        prompt: Vec<u32>,
        sink: &GenerateSink,
    ) -> Result<(), RequestError> {
        let req = &job.request;
        let start = Instant::now();
        let tok = self.model.tokenizer();
        let resumed = &req.resume;
        let seq = self.open_sequence(job, &prompt)?;
        if let Some(n) = req.prompt_logprobs {
            // Before any Token, once for every choice (the prompt is theirs
            // in common); a resumed run gets them again.
            let logprobs = prompt_logprobs::compute(&self.model, &prompt, n)
                .map_err(|e| RequestError::Internal(e.to_string()))?;
            let event = v1::generate_response::Event::PromptLogprobs(logprobs);
            if sink
                .blocking_send(Ok(v1::GenerateResponse { event: Some(event) }))
                .is_err()
            {
                return Ok(());
            }
        }
        let mut decoded = Decoded::new(&req.stop, req.min_tokens);
        decoded.generated = resumed.len() as u32;
        let mut usage = v1::Usage {
            prompt_tokens: prompt.len() as u32,
            resumed_tokens: decoded.generated,
            ..Default::default()
        };
        let ended = resume::replay_text(
            resumed,
            |t| tok.token_bytes(t),
            &mut decoded.filter,
            &mut decoded.utf8,
            req.max_tokens,
            prompt.len(),
            self.model.n_ctx(),
        )?;
        if let Some(reason) = ended {
            // The resumed tokens already end the generation: only its
            // Finished was missing.
            usage.completion_tokens = decoded.generated;
            let finished = self.finished(
                0,
                reason,
                &mut decoded.filter,
                &mut decoded.utf8,
                req.seed,
                usage,
                Timings::default(),
            );
            let _ = sink.blocking_send(Ok(finished));
            return Ok(());
        }
        // Forward passes run on the decode engine, batched with the other
        // generations' steps; dropping `engine` (any return) leaves the batch.
        let engine = self.batcher.join();
        let forward = |session: Session, tokens: Vec<u32>| {
            engine
                .step(session, tokens)
                .map_err(|(_, e)| RequestError::Internal(e.to_string()))
        };
        let prefill_start = Instant::now();
        let (session, cached) = self.prefill(&prompt, resumed, &forward)?;
        usage.cached_prompt_tokens = cached.min(prompt.len()) as u32;
        // The other choices start from copies of this prefill (or, where
        // the backend cannot copy a cache, their own: the same bits).
        let mut choices = vec![Choice {
            seq,
            session,
            decoded,
            device: self.device_sampling(job, &prompt),
        }];
        for _ in 1..req.choices {
            let session = match choices[0].session.fork() {
                Ok(Some(fork)) => fork,
                Ok(None) => self.prefill(&prompt, &[], &forward)?.0,
                Err(e) => return Err(model_failure(e)),
            };
            choices.push(Choice {
                seq: self.open_sequence(job, &prompt)?,
                session,
                decoded: Decoded::new(&req.stop, req.min_tokens),
                device: self.device_sampling(job, &prompt),
            });
        }
        drop(engine);
        let started = ChoiceStart {
            usage,
            cached,
            prefill_ms: prefill_start.elapsed().as_secs_f64() * 1e3,
            start,
            prompt_len: prompt.len(),
        };
        // Each choice decodes on its own thread, its steps batched with the
        // others' by the engine; the first error ends the stream for all
        // (the others then see the client gone).
        std::thread::scope(|scope| {
            let mut all = choices.into_iter().enumerate();
            let (_, first) = all.next().expect("at least one choice");
            let others: Vec<_> = all
                .map(|(i, c)| {
                    let started = &started;
                    scope.spawn(move || self.finish_choice(job, i as u32, c, started, sink))
                })
                .collect();
            let mut result = self.finish_choice(job, 0, first, &started, sink);
            for h in others {
                let r = h.join().unwrap_or_else(|_| {
                    Err(RequestError::Internal("a choice's thread panicked".into()))
                });
                result = result.and(r);
            }
            result
        })
    }

    /// One choice from its prefilled session to its `Finished`: the decode
    /// loop with seed `seed + choice`, then its usage and timings.
    fn finish_choice(
        &self,
        job: &GenerateJob,
        choice: u32,
        c: Choice,
        started: &ChoiceStart,
        sink: &GenerateSink,
    ) -> Result<(), RequestError> {
        let req = &job.request;
        let Choice {
            seq,
            session,
            mut decoded,
            device,
        } = c;
        let mut usage = started.usage;
        let engine = self.batcher.join();
        let forward = |session: Session, tokens: Vec<u32>| {
            engine
                .step(session, tokens)
                .map_err(|(_, e)| RequestError::Internal(e.to_string()))
        };
        let verify_pass = |session: Session, tokens: Vec<u32>| {
            engine
                .verify(session, tokens)
                .map_err(|(_, e)| RequestError::Internal(e.to_string()))
        };
        let seed = req.seed.wrapping_add(u64::from(choice));
        let decode_start = Instant::now();
        let outcome = match req.speculation {
            Some(spec) if self.takes_turn(spec) => self.decode_speculative(
                job,
                (choice, seed),
                spec,
                seq,
                session,
                &forward,
                &verify_pass,
                sink,
                &mut decoded,
                &mut usage,
            )?,
            _ => self.decode(
                job,
                (choice, seed),
                (seq, device),
                session,
                &forward,
                sink,
                &mut decoded,
            )?,
        };
        let Some((reason, session)) = outcome else {
            return Ok(());
        };
        let decode_s = decode_start.elapsed().as_secs_f64();
        let generated = decoded.generated;
        let new_tokens = generated - usage.resumed_tokens;
        usage.completion_tokens = generated;
        let timings = Timings {
            prefill_ms: started.prefill_ms,
            decode_tokens_per_second: if decode_s > 0.0 {
                f64::from(new_tokens) / decode_s
            } else {
                0.0
            },
            sampling_us_per_token: if new_tokens > 0 {
                decoded.sampling_ns as f64 / 1e3 / f64::from(new_tokens)
            } else {
                0.0
            },
        };
        let finished = self.finished(
            choice,
            reason,
            &mut decoded.filter,
            &mut decoded.utf8,
            seed,
            usage,
            timings,
        );
        self.prompt_cache.put(session, &job.memory);
        tracing::info!(
            choice,
            prompt_tokens = started.prompt_len,
            cached_prompt_tokens = started.cached,
            resumed_tokens = usage.resumed_tokens,
            completion_tokens = generated,
            reason = ?reason,
            ms = started.start.elapsed().as_millis() as u64,
            "generation finished"
        );
        let _ = sink.blocking_send(Ok(finished));
        Ok(())
    }

    /// The request's device sampling, decided once (None on a backend
    /// without a device prefix); its windows start as `open_sequence`'s.
    fn device_sampling(
        &self,
        job: &GenerateJob,
        prompt: &[u32],
    ) -> Option<device_sampling::DeviceSampling> {
        let req = &job.request;
        let history = if req.penalize_prompt { prompt } else { &[] };
        let window: Vec<u32> = step::in_vocab(history, self.model.n_vocab()).collect();
        device_sampling::DeviceSampling::plan(&self.model, req, &window, &req.resume)
    }

    /// A fresh sequence of the request's chain. Every call into the chain's
    /// plugins runs on the sampling pool, under its watchdog. The penalty
    /// window starts with the prompt's tail (the stage keeps only its last
    /// repeat_last_n ids; none with `penalize_prompt = false`), then takes
    /// the tokens of a resumed run as its decode loop did.
    fn open_sequence(&self, job: &GenerateJob, prompt: &[u32]) -> Result<Sequence, RequestError> {
        let req = &job.request;
        let request_id = job.request_id;
        let chain = req.chain.clone();
        // `penalize_prompt = false`: the windows start empty, with the
        // generation.
        let history = if req.penalize_prompt { prompt } else { &[] };
        let window: Vec<u32> = step::in_vocab(history, self.model.n_vocab()).collect();
        let (model, replay, end) = (Arc::clone(&self.model), req.resume.clone(), req.end_rule());
        job.steps.run_blocking(move || {
            let _serving = samplerd_sampling::activity::serving(request_id);
            let mut seq = chain.new_sequence().map_err(RequestError::Plugin)?;
            seq.accept_history(&window).map_err(RequestError::Plugin)?;
            resume::accept(&mut seq, &replay, |t| {
                end.ends(t, |t| model.tokenizer().is_eog(t))
            })?;
            Ok::<_, RequestError>(seq)
        })?
    }

    /// The session at the end of the prompt and a resumed run's tokens,
    /// and how many of them a cached session stood for. The longest prefix
    /// a cached session can stand for bit for bit is not run again: of the
    /// prompt (a fresh prefill's order), and of a resumed run's tokens
    /// (each decoded on its own, as they were).
    fn prefill(
        &self,
        prompt: &[u32],
        resumed: &[u32],
        forward: &impl Fn(Session, Vec<u32>) -> Result<Session, RequestError>,
    ) -> Result<(Session, usize), RequestError> {
        let (session, cached) = match self.prompt_cache.take(prompt, resumed) {
            Some(found) => found,
            None => (self.model.new_session().map_err(model_failure)?, 0),
        };
        let mut session = if cached < prompt.len() {
            forward(session, prompt[cached..].to_vec())?
        } else {
            session
        };
        for &t in &resumed[cached.saturating_sub(prompt.len())..] {
            session = forward(session, vec![t])?;
        }
        Ok((session, cached))
    }

    /// The decode loop: a sampling step over the session's logits, the
    /// token streamed, the stop gates, the next forward pass. Ends with the
    /// reason and the session, or `None` once the client went away (what
    /// it computed then kept for a resume of this generation).
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &self,
        job: &GenerateJob,
        (choice, seed): (u32, u64),
        (mut seq, mut device): (Sequence, Option<device_sampling::DeviceSampling>),
        mut session: Session,
        forward: &impl Fn(Session, Vec<u32>) -> Result<Session, RequestError>,
        sink: &GenerateSink,
        decoded: &mut Decoded,
    ) -> Result<Option<(v1::FinishReason, Session)>, RequestError> {
        let req = &job.request;
        let request_id = job.request_id;
        let tok = self.model.tokenizer();
        let mut buf = job.buffers.lease(self.model.n_vocab());
        let (probs, end) = (req.probs, req.end_rule());
        loop {
            if sink.is_closed() {
                tracing::debug!(
                    generated = decoded.generated,
                    "client went away; generation stopped"
                );
                // What it computed serves a resume of this generation.
                self.prompt_cache.put(session, &job.memory);
                return Ok(None);
            }
            let t0 = Instant::now();
            // The step that Sample runs, over the model's logits; the token
            // is accepted unless it ends the generation.
            let at = u64::from(decoded.generated);
            let (model, end) = (Arc::clone(&self.model), end.clone());
            let mut moved = (seq, buf, session, device);
            let (back, out) = job.steps.run_blocking(move || {
                // For the crash report, should a plugin kill the process.
                let _serving = samplerd_sampling::activity::serving(request_id);
                let (seq, buf, session, device) = &mut moved;
                // Over the device prefix's survivors when the row came back
                // that way, else over the dense logits.
                let sampled = device
                    .as_mut()
                    .and_then(|d| d.sample(seq, buf, session, seed, at, probs))
                    .unwrap_or_else(|| sample_token(seq, buf, session.logits(), seed, at, probs));
                let out = sampled.and_then(|out| {
                    let ends = end.ends(out.token_id, |t| model.tokenizer().is_eog(t));
                    if !ends {
                        seq.accept(out.token_id).map_err(RequestError::Plugin)?;
                        if let Some(d) = device {
                            d.accept(out.token_id);
                        }
                    }
                    Ok((out, ends))
                });
                (moved, out)
            })?;
            (seq, buf, session, device) = back;
            let (out, ends) = out?;
            decoded.sampling_ns += t0.elapsed().as_nanos();
            if ends {
                return Ok(Some((v1::FinishReason::StopToken, session)));
            }
            let token = out.token_id;
            let (event, stopped) =
                decoded.emit(tok, &out, choice, req.return_logits, session.logits());
            if sink
                .blocking_send(Ok(v1::GenerateResponse { event: Some(event) }))
                .is_err()
            {
                tracing::debug!(
                    generated = decoded.generated,
                    "client went away; generation stopped"
                );
                self.prompt_cache.put(session, &job.memory);
                return Ok(None);
            }
            if let Some(reason) = resume::ends_after(
                stopped,
                decoded.generated,
                req.max_tokens,
                session.position(),
                session.capacity(),
            ) {
                return Ok(Some((reason, session)));
            }
            if let Some(d) = &mut device {
                d.prepare(&mut session);
            }
            session = forward(session, vec![token])?;
        }
    }

    /// The `Finished` event: the reason, what was held back (a partial
    /// stop-string candidate — not a stop, since none matched — and any
    /// incomplete character), usage, seed and timings.
    #[allow(clippy::too_many_arguments)]
    fn finished(
        &self,
        choice: u32,
        reason: v1::FinishReason,
        filter: &mut StopFilter,
        utf8: &mut Utf8Streamer,
        seed: u64,
        usage: v1::Usage,
        timings: Timings,
    ) -> v1::GenerateResponse {
        let mut rest = String::new();
        if reason != v1::FinishReason::StopString {
            rest.push_str(&utf8.push(&filter.finish()));
        }
        rest.push_str(&utf8.finish());
        let finished = v1::Finished {
            finish_reason: reason as i32,
            usage: Some(usage),
            seed,
            timings: Some(v1::Timings {
                prefill_ms: timings.prefill_ms,
                decode_tokens_per_second: timings.decode_tokens_per_second,
                sampling_us_per_token: timings.sampling_us_per_token,
                numerics: self.model.numerics().describe(),
            }),
            text: rest,
            choice,
        };
        v1::GenerateResponse {
            event: Some(v1::generate_response::Event::Finished(finished)),
        }
    }
}

/// One choice before its decode loop: its sequence (the chain's state),
/// its session at the end of the prompt, its text gates.
struct Choice {
    seq: Sequence,
    session: Session,
    decoded: Decoded,
    /// Where its decode steps sample (None: the CPU backend).
    device: Option<device_sampling::DeviceSampling>,
}

/// What every choice shares from the prefill.
struct ChoiceStart {
    usage: v1::Usage,
    cached: usize,
    prefill_ms: f64,
    start: Instant,
    prompt_len: usize,
}

impl Decoded {
    fn new(stop: &[String], min_tokens: u32) -> Self {
        Decoded {
            filter: StopFilter::new(stop).after(min_tokens),
            utf8: Utf8Streamer::new(),
            generated: 0,
            sampling_ns: 0,
        }
    }

    /// One sampled token, counted and through the text gates: its `Token`
    /// event (with `row`, the logits it was sampled from, when the request
    /// returns them) and whether a stop string ended in it.
    fn emit(
        &mut self,
        tok: &samplerd_model::Tokenizer,
        out: &step::StepOutput,
        choice: u32,
        return_logits: Option<returned_logits::ReturnLogits>,
        row: &[f32],
    ) -> (v1::generate_response::Event, bool) {
        self.generated += 1;
        metrics::counter!(GENERATED_TOKENS_METRIC).increment(1);
        let step = self.filter.push(tok.token_bytes(out.token_id));
        let text = self.utf8.push(&step.emit);
        let mut message = v1::Token {
            token_id: out.token_id,
            text,
            logprob: out.logprob,
            probs: crate::request::convert::token_probabilities(&out.probs),
            probability: out.probability,
            choice,
            ..Default::default()
        };
        if let Some(r) = return_logits {
            r.attach(row, &mut message);
        }
        (v1::generate_response::Event::Token(message), step.stopped)
    }
}

/// What a decode loop has produced so far: the text gates (stop strings,
/// UTF-8) and the counts its usage and timings come from (a resumed run's
/// tokens included).
struct Decoded {
    filter: StopFilter,
    utf8: Utf8Streamer,
    generated: u32,
    sampling_ns: u128,
}

/// A generation's measured times (`v1::Timings` without the numerics).
#[derive(Clone, Copy, Debug, Default)]
struct Timings {
    /// The prompt's prefill and a resumed run's replay.
    prefill_ms: f64,
    decode_tokens_per_second: f64,
    sampling_us_per_token: f64,
}

/// A model error during a generation: INTERNAL, except the device running
/// out of memory for the sequence (RESOURCE_EXHAUSTED: retryable once other
/// generations end).
fn model_failure(e: samplerd_model::ModelError) -> RequestError {
    match e {
        samplerd_model::ModelError::DeviceMemory(_) => RequestError::exhausted(
            Reason::BudgetExceeded,
            "model.device",
            format!("{e}; try again later"),
        ),
        e => RequestError::Internal(e.to_string()),
    }
}

/// One decode step's sampling: [`samplerd_sampling::step`] over the model's
/// logits (bad logits are the model's fault: INTERNAL).
fn sample_token(
    seq: &mut Sequence,
    buf: &mut TokenBuffer,
    logits: &[f32],
    seed: u64,
    step_index: u64,
    probs: step::ProbsRequest,
) -> Result<step::StepOutput, RequestError> {
    let logits = step::Logits::Floats(logits);
    let lse = step::load::<step::NoDeferral>(buf, logits, None)
        .map_err(|e| RequestError::Internal(format!("the model produced bad logits: {e}")))?;
    step::run(seq, buf, logits, lse, seed, step_index, probs).map_err(|e| match e {
        e @ SampleError::AllMasked { .. } => {
            RequestError::invalid_as(InvalidKind::AllMasked, "params", e.to_string())
        }
        other => RequestError::Plugin(other),
    })
}

impl Generator for ModelHost {
    fn ready(&self) -> bool {
        true
    }

    fn vocabulary(&self) -> Option<Arc<Vocabulary>> {
        Some(Arc::clone(&self.vocab))
    }

    fn tokenizer(&self) -> Option<Arc<dyn samplerd_model::TextCodec>> {
        Some(Arc::clone(&self.model) as Arc<dyn samplerd_model::TextCodec>)
    }

    fn describe(&self) -> Option<generator::ModelSummary> {
        let m = &self.model;
        Some(generator::ModelSummary {
            file_name: m
                .path()
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            architecture: m.config().arch.name().to_string(),
            weight_types: m
                .weight_formats()
                .iter()
                .map(|(k, v)| ((*k).to_string(), *v as u32))
                .collect(),
            n_vocab: m.n_vocab(),
            n_ctx: m.n_ctx(),
            numerics: m.numerics().describe(),
            device: m.backend_name(),
        })
    }

    fn generate(&self, job: GenerateJob, sink: GenerateSink) {
        let result = (|| {
            if let Some(spec) = &job.request.speculation {
                self.check_speculation(spec)?;
            }
            // Admission first: tokenizing is work of the request's size,
            // so it happens inside a generation slot.
            let Some(_slot) = self.slots.acquire(|| sink.is_closed())? else {
                return Ok(());
            };
            // Then the memory it will hold: the tokenizer's peak and the
            // KV cache, for the whole generation.
            let _charge = job
                .memory
                .charge(self.generation_bytes(&job.request), "this Generate request")?;
            // On the sampling pool, under the step budget, like a step.
            let (model, config) = (Arc::clone(&self.model), self.config.clone());
            let prompt = job.request.prompt.clone();
            let tokens = job.steps.run_blocking(move || {
                // Named for the watchdog: a prompt that takes longer than
                // the step budget is reported as what it is.
                static TOKENIZER: std::sync::LazyLock<Arc<str>> =
                    std::sync::LazyLock::new(|| Arc::from("(prompt tokenization)"));
                samplerd_sampling::activity::entering(&TOKENIZER);
                prompt_tokens(&model, &config, &prompt)
            })??;
            self.run(&job, tokens, &sink)
        })();
        if let Err(e) = result {
            let status: Status = e.into();
            let _ = sink.blocking_send(Err(status));
        }
    }
}
