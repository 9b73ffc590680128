//! Running a chain: a [`Sequence`] holds one plugin state per stage (created
//! through the ABI, freed on drop) and runs a step — every stage's `apply`
//! over the token buffer with the step's RNG, each followed by the host's
//! post-checks — or feeds the stages an emitted token.

use std::ffi::c_void;
use std::time::Instant;

use samplerd_plugin_sdk::abi::*;

use crate::buffer::TokenBuffer;
use crate::chain::Chain;
use crate::check::{check_after_stage, check_selection};
use crate::error::SampleError;
use crate::ffi;
use crate::rng::StepRng;

/// The chosen token of one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampled {
    pub token_id: u32,
}

/// Consulted before each stage's `apply` with the buffer as the stages
/// before left it (the sparse-row proof, [`crate::sparse`]): an error ends
/// the step there, before the stage runs.
pub(crate) trait StageGate {
    fn before(&mut self, stage: usize, buf: &TokenBuffer) -> Result<(), SampleError>;
}

/// Per-sequence state of every stage of a chain. Not shared between threads
/// at once (`Send`, not `Sync`); freed through the ABI on drop.
pub struct Sequence {
    chain: Chain,
    states: Vec<*mut c_void>,
}

// SAFETY: a state may move between threads; it is never used by two at once
// because Sequence is !Sync and every call takes &mut self.
unsafe impl Send for Sequence {}

impl Drop for Sequence {
    fn drop(&mut self) {
        for (link, &state) in self.chain.links().iter().zip(&self.states) {
            if let Some(free) = link.vt().state_free {
                crate::activity::in_plugin(link.stage.site, || {
                    // SAFETY: state from this stage's state_new/clone, freed
                    // once.
                    unsafe { free(link.config, state) }
                });
            }
        }
    }
}

impl Chain {
    /// Fresh per-sequence states for every stage.
    pub fn new_sequence(&self) -> Result<Sequence, SampleError> {
        let mut seq = Sequence {
            chain: self.clone(),
            states: Vec::with_capacity(self.links().len()),
        };
        for link in self.links() {
            let mut state: *mut c_void = std::ptr::null_mut();
            let state_new = link.enter().state_new.expect("checked at load");
            // On failure `seq` frees the states created so far.
            ffi::call(link, |err| {
                // SAFETY: config from this stage's config_new; out-pointers
                // valid.
                unsafe { state_new(link.config, &mut state, err) }
            })?;
            seq.states.push(state);
        }
        Ok(seq)
    }
}

impl Sequence {
    pub fn chain(&self) -> &Chain {
        &self.chain
    }

    /// Tells every stage the sequence emitted `token`.
    pub fn accept(&mut self, token: u32) -> Result<(), SampleError> {
        self.accept_into(&[token], |_| true)
    }

    /// Replays history into a fresh sequence, oldest first — a prompt's
    /// tail, a request's `previous_tokens` (seeds a penalty window) — for
    /// every stage but the output-only ones ([`SD_STAGE_OUTPUT_ONLY`]: a
    /// grammar starts where the output starts).
    pub fn accept_history(&mut self, tokens: &[u32]) -> Result<(), SampleError> {
        self.accept_into(tokens, |flags| flags & SD_STAGE_OUTPUT_ONLY == 0)
    }

    /// Replays output already generated into the output-only stages alone
    /// (a stateless Sample's `constraint_tokens`; the other stages got it
    /// as history).
    pub fn accept_output(&mut self, tokens: &[u32]) -> Result<(), SampleError> {
        self.accept_into(tokens, |flags| flags & SD_STAGE_OUTPUT_ONLY != 0)
    }

    /// `accept` of each token, oldest first, for the stages whose flags
    /// `to` selects.
    fn accept_into(&mut self, tokens: &[u32], to: impl Fn(u32) -> bool) -> Result<(), SampleError> {
        for &token in tokens {
            for (link, &state) in self.chain.links().iter().zip(&self.states) {
                if !to(link.vt().flags) {
                    continue;
                }
                let accept = link.enter().accept.expect("checked at load");
                ffi::call(link, |err| {
                    // SAFETY: config/state belong to this stage; &mut self
                    // serialises.
                    unsafe { accept(link.config, state, token, err) }
                })?;
            }
        }
        Ok(())
    }

    /// Back to fresh states (as after `new_sequence`).
    pub fn reset(&mut self) -> Result<(), SampleError> {
        for (link, &state) in self.chain.links().iter().zip(&self.states) {
            let reset = link.enter().state_reset.expect("checked at load");
            ffi::call(link, |err| {
                // SAFETY: as in accept.
                unsafe { reset(link.config, state, err) }
            })?;
        }
        Ok(())
    }

    /// Deep copy (forks the sequence).
    pub fn try_clone(&self) -> Result<Sequence, SampleError> {
        let mut copy = Sequence {
            chain: self.chain.clone(),
            states: Vec::with_capacity(self.states.len()),
        };
        for (link, &state) in self.chain.links().iter().zip(&self.states) {
            let mut out: *mut c_void = std::ptr::null_mut();
            let clone = link.enter().state_clone.expect("checked at load");
            ffi::call(link, |err| {
                // SAFETY: as in accept (&self: no other call runs on these
                // states); `out` is a valid out-pointer.
                unsafe { clone(link.config, state, &mut out, err) }
            })?;
            copy.states.push(out);
        }
        Ok(copy)
    }

    /// Runs the chain over the logits loaded in `buf` with the randomness
    /// of `(seed, step)`. Does not accept the token: call `accept` for that.
    pub fn sample(
        &mut self,
        buf: &mut TokenBuffer,
        seed: u64,
        step: u64,
    ) -> Result<Sampled, SampleError> {
        self.run(buf, seed, step, None, true, None)
    }

    /// As `sample_prepared`, asking `gate` before each stage.
    pub(crate) fn sample_gated(
        &mut self,
        buf: &mut TokenBuffer,
        seed: u64,
        step: u64,
        gate: &mut dyn StageGate,
    ) -> Result<Sampled, SampleError> {
        self.run(buf, seed, step, None, false, Some(gate))
    }

    /// As `sample`, over the view already in `buf` (e.g. the survivors of a
    /// device sampling prefix loaded with `TokenBuffer::load_candidates`)
    /// instead of resetting it to the dense logits.
    pub fn sample_prepared(
        &mut self,
        buf: &mut TokenBuffer,
        seed: u64,
        step: u64,
    ) -> Result<Sampled, SampleError> {
        self.run(buf, seed, step, None, false, None)
    }

    /// As `sample_prepared`, running only the stages from index `first` on:
    /// the host remainder of a chain whose leading stages ran elsewhere
    /// (a device sampling prefix, which draws no random numbers, so the
    /// remainder sees the step's RNG as the whole chain would). The
    /// skipped stages' states still `accept` every token.
    pub fn sample_prepared_from(
        &mut self,
        buf: &mut TokenBuffer,
        seed: u64,
        step: u64,
        first: usize,
    ) -> Result<Sampled, SampleError> {
        self.run_from(buf, seed, step, None, false, None, first)
    }

    /// As `sample`, adding each stage's wall time (ns) to `stage_ns`.
    pub fn sample_timed(
        &mut self,
        buf: &mut TokenBuffer,
        seed: u64,
        step: u64,
        stage_ns: &mut [u64],
    ) -> Result<Sampled, SampleError> {
        self.run(buf, seed, step, Some(stage_ns), true, None)
    }

    fn run(
        &mut self,
        buf: &mut TokenBuffer,
        seed: u64,
        step: u64,
        stage_ns: Option<&mut [u64]>,
        reset_view: bool,
        gate: Option<&mut dyn StageGate>,
    ) -> Result<Sampled, SampleError> {
        self.run_from(buf, seed, step, stage_ns, reset_view, gate, 0)
    }

    #[allow(clippy::too_many_arguments)]
    fn run_from(
        &mut self,
        buf: &mut TokenBuffer,
        seed: u64,
        step: u64,
        mut stage_ns: Option<&mut [u64]>,
        reset_view: bool,
        mut gate: Option<&mut dyn StageGate>,
        first: usize,
    ) -> Result<Sampled, SampleError> {
        if buf.n_vocab() == 0 {
            return Err(SampleError::NotLoaded);
        }
        if reset_view {
            buf.reset_view();
        } else {
            buf.clear_selection();
        }
        let mut rng = StepRng::new(seed, step);
        let n_vocab = buf.n_vocab();
        let links = self.chain.links();
        for (i, (link, &state)) in links.iter().zip(&self.states).enumerate().skip(first) {
            if let Some(g) = gate.as_deref_mut() {
                g.before(i, buf)?;
            }
            let vt = link.enter();
            if buf.is_dense() && vt.flags & SD_STAGE_DENSE_OK == 0 {
                buf.materialize();
            }
            let before = buf.len();
            let was_dense = buf.is_dense();
            let mut sd_rng = rng.as_abi();
            let apply = vt.apply.expect("checked at load");
            ffi::call(link, |err| {
                buf.with_abi(|tokens| {
                    let t0 = Instant::now();
                    // SAFETY: `tokens` points into `buf`, valid for n_vocab
                    // entries and exclusively borrowed for the call; rng and
                    // err live across it.
                    let rc = unsafe { apply(link.config, state, tokens, &mut sd_rng, err) };
                    let took = t0.elapsed();
                    link.metrics.duration.record(took.as_secs_f64());
                    if let Some(ns) = stage_ns.as_deref_mut() {
                        ns[i] += took.as_nanos() as u64;
                    }
                    rc
                })
            })
            .map_err(|e| {
                // A selecting stage that finds nothing left to choose from
                // (core `dist`: "no candidate with a finite logit") is not
                // the stage's fault: every token was masked before it.
                if link.stage.info.selects && buf.survivors().next().is_none() {
                    SampleError::AllMasked {
                        stage: link.name().to_string(),
                    }
                } else {
                    e
                }
            })?;
            check_after_stage(
                link.name(),
                buf,
                before,
                was_dense,
                link.deep_checks,
                n_vocab,
            )
            .inspect_err(|_| link.metrics.errors.increment(1))?;
        }
        let last = links.last().expect("chains are never empty");
        let token_id =
            check_selection(last.name(), buf).inspect_err(|_| last.metrics.errors.increment(1))?;
        Ok(Sampled { token_id })
    }
}
