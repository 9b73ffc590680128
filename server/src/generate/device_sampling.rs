//! Device sampling in Generate: on a backend that runs a sampling prefix
//! where the logits are (the CUDA backend), each decode step runs the
//! longest device-capable prefix of the request's chain there — logit bias,
//! penalties, temperature, cut after its top-k (or greedy / temperature ≤
//! 0) — and copies back only the survivors, their raw logits and the raw
//! row's log-sum-exp; the rest of the chain (top-p, min-p, DRY, plugins, a
//! constraint after the cut, the draw) runs here over the survivors with
//! the step's RNG (`samplerd_sampling::device_prefix::run_survivors`), so
//! the token, `probability`, `logprob` and post-chain `probs` are the CPU
//! chain's bit for bit.
//!
//! The choice is made once per request ([`DeviceSampling::plan`]): a chain
//! whose first stage needs the dense view (a constraint or plugin before
//! the cut, top-p first…) or a request that needs the dense row
//! (`return_logits`, raw `n_probs`, speculation's verify rows) copies the
//! logits every step. The first step after the prompt takes the prefill's
//! row, which is dense. A row the device cannot judge (NaN / +inf, nothing
//! finite, nothing finite left after the prefix) comes back dense, so the
//! CPU chain gives the exact error or outcome. Each sampled step counts
//! one `samplerd_device_sampling_steps_total{path}`.

#![forbid(unsafe_code)]

use samplerd_model::{DevicePrefix, Model, PrefixStage, RowOutcome, Session};
use samplerd_sampling::device_prefix::{
    self, DevicePrefixError, DeviceStage, PenaltyWindow, PrefixPlan, SdCandidate,
};
use samplerd_sampling::{SampleError, Sequence, TokenBuffer, step};

use crate::generate::generator::ValidGenerate;
use crate::request::errors::{InvalidKind, RequestError};

/// Counter: Generate's sampled decode steps by how their row came back,
/// label `path`: `device` (the survivors of the device prefix), `dense`
/// (the whole row: the request needs it, or the step after the prompt),
/// `fallback` (a device prefix ran but the row had to be copied: logits
/// only the CPU chain may judge). Counted only on a backend that runs a
/// device prefix.
pub const DEVICE_SAMPLING_STEPS_METRIC: &str = "samplerd_device_sampling_steps_total";

pub(super) fn describe() {
    metrics::describe_counter!(
        DEVICE_SAMPLING_STEPS_METRIC,
        "Generate decode steps by where their sampling prefix ran (path: device, dense, fallback)"
    );
}

/// One generation's device sampling: present on a backend that runs a
/// device prefix; `split` is None when the request's steps stay dense.
pub(super) struct DeviceSampling {
    split: Option<Split>,
    n_vocab: usize,
}

/// The device prefix of a request's chain and what feeds it each step.
struct Split {
    plan: PrefixPlan,
    prefix: DevicePrefix,
    /// The penalties stage's window, mirrored (its distinct ids and
    /// counts go to the device each step).
    window: PenaltyWindow,
    cands: Vec<SdCandidate>,
}

impl DeviceSampling {
    /// Decides the request's path once: None on a backend without a device
    /// prefix. `history` is what the chain's windows start from: the
    /// prompt's tail (when penalised) and a resumed run's tokens.
    pub(super) fn plan(
        model: &Model,
        req: &ValidGenerate,
        history: &[u32],
        resumed: &[u32],
    ) -> Option<DeviceSampling> {
        if !model.runs_device_prefix() {
            return None;
        }
        let dense = if req.return_logits.is_some() {
            Some("return_logits needs each step's whole row")
        } else if req.probs.n > 0 && !req.probs.post_sampling {
            Some("raw n_probs rank the whole row")
        } else if req.speculation.is_some() {
            Some("speculation verifies on whole rows")
        } else {
            None
        };
        let plan = device_prefix::split(req.chain.spec());
        let split = match dense {
            Some(why) => {
                tracing::debug!(reason = why, "device sampling off for this request");
                None
            }
            None if plan.device.is_empty() => {
                tracing::debug!(
                    chain = %req.chain.describe(),
                    "device sampling off: the chain's first stages need the whole row"
                );
                None
            }
            None => {
                let mut window = PenaltyWindow::new(plan.penalty_window());
                for &t in history.iter().chain(resumed) {
                    window.accept(t);
                }
                Some(Split {
                    prefix: DevicePrefix {
                        stages: plan.device.iter().map(stage).collect(),
                        ..Default::default()
                    },
                    plan,
                    window,
                    cands: Vec::new(),
                })
            }
        };
        Some(DeviceSampling {
            split,
            n_vocab: model.n_vocab(),
        })
    }

    /// Asks the session's next decode step for the device prefix (with
    /// the penalty window as it stands).
    pub(super) fn prepare(&mut self, session: &mut Session) {
        if let Some(s) = &mut self.split {
            let p = &mut s.prefix;
            s.window.distinct(&mut p.window_ids, &mut p.window_counts);
            session.prefix_next_step(p.clone());
        }
    }

    /// Tells the mirror that the sequence emitted `token`.
    pub(super) fn accept(&mut self, token: u32) {
        if let Some(s) = &mut self.split {
            s.window.accept(token);
        }
    }

    /// Counts the step and, when its row came back as survivors, samples
    /// it over them (None: the caller samples the dense logits).
    pub(super) fn sample(
        &mut self,
        seq: &mut Sequence,
        buf: &mut TokenBuffer,
        session: &Session,
        seed: u64,
        step_index: u64,
        probs: step::ProbsRequest,
    ) -> Option<Result<step::StepOutput, RequestError>> {
        let out = session.prefixed();
        let path = match out.outcome {
            RowOutcome::Survivors => "device",
            RowOutcome::Dense => "dense",
            RowOutcome::Fallback => "fallback",
        };
        metrics::counter!(DEVICE_SAMPLING_STEPS_METRIC, "path" => path).increment(1);
        if out.outcome != RowOutcome::Survivors {
            return None;
        }
        let Some(s) = &mut self.split else {
            return Some(Err(RequestError::Internal(
                "device survivors for a request without a device prefix".into(),
            )));
        };
        s.cands.clear();
        s.cands.extend(out.survivors.iter().map(|c| SdCandidate {
            id: c.id,
            logit: c.logit,
        }));
        let raw = |id: u32| {
            out.survivors
                .iter()
                .find(|c| c.id == id)
                .map_or(f32::NAN, |c| c.raw)
        };
        let sampled = device_prefix::run_survivors(
            seq,
            buf,
            self.n_vocab,
            &s.plan,
            &s.cands,
            raw,
            out.raw_lse,
            seed,
            step_index,
            probs,
        );
        Some(sampled.map_err(|e| match e {
            DevicePrefixError::Sample(e @ SampleError::AllMasked { .. }) => {
                RequestError::invalid_as(InvalidKind::AllMasked, "params", e.to_string())
            }
            DevicePrefixError::Sample(e) => RequestError::Plugin(e),
            other => RequestError::Internal(format!("device sampling: {other}")),
        }))
    }
}

/// A planned device stage as the model host's prefix stage (greedy and
/// temperature ≤ 0 keep the first maximum: top-k with k = 1).
fn stage(s: &DeviceStage) -> PrefixStage {
    match s {
        DeviceStage::LogitBias { ids, bias, starts } => PrefixStage::LogitBias {
            ids: ids.clone(),
            bias: bias.clone(),
            starts: starts.clone(),
        },
        DeviceStage::Penalties {
            repeat,
            frequency,
            presence,
            ..
        } => PrefixStage::Penalties {
            repeat: *repeat,
            frequency: *frequency,
            presence: *presence,
        },
        DeviceStage::Temperature(t) => PrefixStage::Temperature(*t),
        DeviceStage::TopK(k) => PrefixStage::TopK(*k),
        DeviceStage::KeepMax { .. } => PrefixStage::TopK(1),
    }
}
