//! The device sampling prefix: which leading stages of a chain run on the
//! GPU next to the logits, and the host side that finishes the chain over
//! the few survivors that cross to the CPU.
//!
//! As in llama.cpp's backend sampling, the longest prefix of the chain whose
//! stages have a device implementation runs on the device — here
//! `logit_bias`, `penalties`, `temperature` (without dynamic temperature),
//! `top_k` (k ≤ [`DEVICE_TOP_K_MAX`]) and `greedy` — and it is cut right
//! after its first *truncating* stage (`top_k`, `temperature` ≤ 0 or
//! `greedy`): from there on at most k candidates are left, which the host
//! handles in microseconds, so later stages (including third-party plugins)
//! run unchanged on the CPU over those candidates. A prefix without a
//! truncating stage would still have to copy the whole vocabulary, so it is
//! not used: the chain then runs entirely on the host.
//!
//! The semantics are exactly the CPU stages' (plugins/core): the survivors
//! are the k highest logits sorted descending with ties to the lower id, the
//! order the CPU `top_k` leaves in the dense view, and the host remainder
//! starts from that sorted candidate view with the step's own RNG (no device
//! stage draws random numbers), so the chosen token is the CPU chain's.
//! [`reference`] is the CPU twin of the device kernels, used by the tests
//! here and by the GPU tests to check the kernels.
//!
//! Logits the CPU would reject (NaN, +inf, all -inf) and a maximum that is
//! -inf make the device report a fallback; the caller then copies the dense
//! logits and runs the whole chain on the host, which yields the exact
//! error or outcome.

use std::collections::HashMap;
use std::collections::VecDeque;

pub use samplerd_plugin_sdk::abi::SdCandidate;
use samplerd_plugin_sdk::defaults::MAX_PENALTY_WINDOW;

use crate::buffer::TokenBuffer;
use crate::chain::Chain;
use crate::error::{ChainError, SampleError};
use crate::registry::StageRegistry;
use crate::sequence::{Sampled, Sequence};
use crate::spec::{ChainSpec, ParamValue, StageSpec};

/// Largest `top_k` run on the device: the CPU stage's small-k path
/// (k ≤ 256) compares logits as floats (-0 == +0, ties to the lower id);
/// above it, it sorts with a total order, which the device does not copy.
pub const DEVICE_TOP_K_MAX: usize = 256;

/// One stage of a device prefix with its parsed parameters.
#[derive(Clone, Debug, PartialEq)]
pub enum DeviceStage {
    /// `(id, bias)` entries sorted by id (stable: duplicates in the order
    /// given); `starts` delimits the runs of one id (`len = runs + 1`).
    LogitBias {
        ids: Vec<u32>,
        bias: Vec<f32>,
        starts: Vec<i32>,
    },
    /// Repetition penalties over the last `window` accepted tokens.
    Penalties {
        window: usize,
        repeat: f32,
        frequency: f32,
        presence: f32,
    },
    /// Divides the logits by `t` (> 0, ≠ 1).
    Temperature(f32),
    /// Keeps the k best, sorted descending (truncating).
    TopK(usize),
    /// Keeps the first maximum only (truncating): `temperature` ≤ 0
    /// (`selects = false`) or `greedy` (`selects = true`, ends the chain).
    KeepMax { selects: bool },
}

impl DeviceStage {
    fn truncates(&self) -> bool {
        matches!(self, DeviceStage::TopK(_) | DeviceStage::KeepMax { .. })
    }

    /// The number of survivors the truncating stage leaves.
    fn keep(&self) -> Option<usize> {
        match self {
            DeviceStage::TopK(k) => Some(*k),
            DeviceStage::KeepMax { .. } => Some(1),
            _ => None,
        }
    }
}

/// How a chain splits between the device and the host.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefixPlan {
    /// Device stages; empty when nothing runs on the device. When not
    /// empty, the last one truncates.
    pub device: Vec<DeviceStage>,
    /// How many stages of the spec the device prefix covers.
    pub device_specs: usize,
    /// The host remainder (the spec's stages after the prefix); `None` when
    /// the device prefix ends with `greedy` and selects the token itself.
    pub host: Option<ChainSpec>,
}

impl PrefixPlan {
    /// Most survivors copied to the host per step (0: no device prefix).
    pub fn max_survivors(&self) -> usize {
        self.device.last().and_then(DeviceStage::keep).unwrap_or(0)
    }

    /// True when the device prefix selects the token (ends with greedy).
    pub fn selects_on_device(&self) -> bool {
        matches!(
            self.device.last(),
            Some(DeviceStage::KeepMax { selects: true })
        )
    }

    /// The index of the first chain stage the host runs over the
    /// survivors: the one after the prefix, or — when the prefix ends with
    /// `greedy` — that stage itself, over the single survivor, so the
    /// chain's own selecting stage makes the selection.
    pub fn host_start(&self) -> usize {
        if self.selects_on_device() {
            self.device_specs - 1
        } else {
            self.device_specs
        }
    }

    /// The penalty window the device needs (0: no penalties stage).
    pub fn penalty_window(&self) -> usize {
        self.device
            .iter()
            .map(|s| match s {
                DeviceStage::Penalties { window, .. } => *window,
                _ => 0,
            })
            .max()
            .unwrap_or(0)
    }
}

/// A number parameter or its default; anything the CPU stage would reject
/// (wrong kind, NaN, out of range) returns None so the stage stays on the
/// host, where it reports the error.
fn number(s: &StageSpec, name: &str, default: f64) -> Option<f64> {
    match s.params.get(name) {
        None => Some(default),
        Some(ParamValue::Number(v)) if !v.is_nan() => Some(*v),
        _ => None,
    }
}

fn only_params(s: &StageSpec, allowed: &[&str]) -> bool {
    s.params.keys().all(|k| allowed.contains(&k.as_str()))
}

/// The device version of one spec stage, or None when it has none (or its
/// parameters are ones the device path does not cover). `Some(None)`: a
/// no-op on the device (e.g. `top_k` with k = 0, `temperature` 1).
fn device_stage(s: &StageSpec) -> Option<Option<DeviceStage>> {
    match s.name.as_str() {
        "logit_bias" => {
            if !only_params(s, &["bias"]) {
                return None;
            }
            let entries: &[(u32, f32)] = match s.params.get("bias") {
                None => &[],
                Some(ParamValue::TokenMap(m)) => m,
                Some(_) => return None,
            };
            if entries
                .iter()
                .any(|&(_, b)| b.is_nan() || b == f32::INFINITY)
            {
                return None;
            }
            if entries.is_empty() {
                return Some(None);
            }
            let mut sorted = entries.to_vec();
            sorted.sort_by_key(|&(id, _)| id); // stable, as the CPU stage
            let mut starts = Vec::new();
            for (i, &(id, _)) in sorted.iter().enumerate() {
                if i == 0 || sorted[i - 1].0 != id {
                    starts.push(i as i32);
                }
            }
            starts.push(sorted.len() as i32);
            Some(Some(DeviceStage::LogitBias {
                ids: sorted.iter().map(|e| e.0).collect(),
                bias: sorted.iter().map(|e| e.1).collect(),
                starts,
            }))
        }
        "penalties" => {
            if !only_params(
                s,
                &[
                    "repeat_last_n",
                    "repeat_penalty",
                    "frequency_penalty",
                    "presence_penalty",
                ],
            ) {
                return None;
            }
            let last_n = number(s, "repeat_last_n", 64.0)?;
            let repeat = number(s, "repeat_penalty", 1.1)?;
            let frequency = number(s, "frequency_penalty", 0.0)?;
            let presence = number(s, "presence_penalty", 0.0)?;
            let ok = last_n.fract() == 0.0
                && (-1.0..=MAX_PENALTY_WINDOW as f64).contains(&last_n)
                && repeat.is_finite()
                && repeat > 0.0
                && frequency.is_finite()
                && frequency >= 0.0
                && presence.is_finite()
                && presence >= 0.0;
            if !ok {
                return None;
            }
            let window = if last_n < 0.0 {
                MAX_PENALTY_WINDOW
            } else {
                last_n as usize
            };
            let (repeat, frequency, presence) = (repeat as f32, frequency as f32, presence as f32);
            if window == 0 || (repeat == 1.0 && frequency == 0.0 && presence == 0.0) {
                return Some(None);
            }
            Some(Some(DeviceStage::Penalties {
                window,
                repeat,
                frequency,
                presence,
            }))
        }
        "temperature" => {
            if !only_params(s, &["t", "dynatemp_range", "dynatemp_exponent"]) {
                return None;
            }
            let t = number(s, "t", 0.8)?;
            let range = number(s, "dynatemp_range", 0.0)?;
            let exponent = number(s, "dynatemp_exponent", 1.0)?;
            let valid = |v: f64| v.is_finite() && v >= 0.0;
            if !(valid(t) && valid(range) && valid(exponent)) || range > 0.0 {
                return None;
            }
            let t = t as f32;
            Some(if t <= 0.0 {
                Some(DeviceStage::KeepMax { selects: false })
            } else if t == 1.0 {
                None
            } else {
                Some(DeviceStage::Temperature(t))
            })
        }
        "top_k" => {
            if !only_params(s, &["k"]) {
                return None;
            }
            let k = number(s, "k", 40.0)?;
            if k.fract() != 0.0 || !(0.0..=u32::MAX as f64).contains(&k) {
                return None;
            }
            let k = k as usize;
            if k == 0 {
                Some(None)
            } else if k <= DEVICE_TOP_K_MAX {
                Some(Some(DeviceStage::TopK(k)))
            } else {
                None
            }
        }
        "greedy" => s
            .params
            .is_empty()
            .then_some(Some(DeviceStage::KeepMax { selects: true })),
        _ => None,
    }
}

/// Splits `spec` into the device prefix and the host remainder.
pub fn split(spec: &ChainSpec) -> PrefixPlan {
    let mut device = Vec::new();
    for (i, s) in spec.stages.iter().enumerate() {
        let Some(stage) = device_stage(s) else {
            break;
        };
        let Some(stage) = stage else {
            continue; // a no-op: part of the prefix, nothing to run
        };
        let truncates = stage.truncates();
        let selects = matches!(stage, DeviceStage::KeepMax { selects: true });
        device.push(stage);
        if truncates {
            let rest = &spec.stages[i + 1..];
            return PrefixPlan {
                device,
                device_specs: i + 1,
                host: (!selects || !rest.is_empty()).then(|| ChainSpec {
                    stages: rest.to_vec(),
                }),
            };
        }
    }
    PrefixPlan {
        device: Vec::new(),
        device_specs: 0,
        host: Some(spec.clone()),
    }
}

/// The accepted tokens of the penalty window with per-id counts: the core
/// `penalties` stage's state, mirrored on the host so the device gets the
/// window's distinct ids and counts each step.
#[derive(Clone, Debug, Default)]
pub struct PenaltyWindow {
    cap: usize,
    ring: VecDeque<u32>,
    counts: HashMap<u32, u32>,
}

impl PenaltyWindow {
    pub fn new(cap: usize) -> Self {
        PenaltyWindow {
            cap,
            ring: VecDeque::with_capacity(cap.min(4096)),
            counts: HashMap::new(),
        }
    }

    pub fn accept(&mut self, token: u32) {
        if self.cap == 0 {
            return;
        }
        if self.ring.len() == self.cap
            && let Some(old) = self.ring.pop_front()
            && let Some(c) = self.counts.get_mut(&old)
        {
            *c -= 1;
            if *c == 0 {
                self.counts.remove(&old);
            }
        }
        self.ring.push_back(token);
        *self.counts.entry(token).or_insert(0) += 1;
    }

    pub fn reset(&mut self) {
        self.ring.clear();
        self.counts.clear();
    }

    /// The distinct ids and their counts (any order; each id once).
    pub fn distinct(&self, ids: &mut Vec<u32>, counts: &mut Vec<u32>) {
        ids.clear();
        counts.clear();
        for (&id, &c) in &self.counts {
            ids.push(id);
            counts.push(c);
        }
    }
}

/// What a device prefix left for the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Survivors<'a> {
    /// The survivors, sorted descending, ties by lower id.
    Candidates(&'a [SdCandidate]),
    /// Logits the device could not take (NaN, +inf, all -inf): run the
    /// whole chain on the host with the dense logits.
    Fallback,
}

/// Errors of the host side of a split chain.
#[derive(Debug, thiserror::Error)]
pub enum DevicePrefixError {
    #[error(transparent)]
    Chain(#[from] ChainError),
    #[error(transparent)]
    Sample(#[from] SampleError),
    #[error("device sampling returned candidate id {id} outside the vocabulary of {n_vocab}")]
    BadCandidate { id: u32, n_vocab: usize },
    #[error("device sampling returned {got} candidates, not 1 to {max}")]
    TooMany { got: usize, max: usize },
    #[error("the raw probabilities of the whole row need the dense logits")]
    NeedsDense,
}

/// One sequence's sampling split between the device and the host: the
/// plan, the penalty window mirror, the host remainder's chain state and
/// the full chain (for fallbacks). `accept` every emitted token here.
pub struct SplitSequence {
    plan: PrefixPlan,
    window: PenaltyWindow,
    host: Option<Sequence>,
    full: Sequence,
    buf: TokenBuffer,
    n_vocab: usize,
}

impl SplitSequence {
    /// Splits `full`'s chain; the host remainder is built with `registry`.
    pub fn new(
        registry: &StageRegistry,
        full: &Chain,
        n_vocab: usize,
    ) -> Result<SplitSequence, DevicePrefixError> {
        let plan = split(full.spec());
        let host = match &plan.host {
            Some(spec) if !plan.device.is_empty() => {
                Some(registry.build_chain(spec, None)?.new_sequence()?)
            }
            _ => None,
        };
        Ok(SplitSequence {
            window: PenaltyWindow::new(plan.penalty_window()),
            host,
            full: full.new_sequence()?,
            buf: TokenBuffer::new(),
            plan,
            n_vocab,
        })
    }

    pub fn plan(&self) -> &PrefixPlan {
        &self.plan
    }

    /// The penalty window (its distinct ids/counts feed the device stage).
    pub fn window(&self) -> &PenaltyWindow {
        &self.window
    }

    /// The buffer as the last step's chain left it (for the post-chain
    /// distribution: the same survivors as the whole chain on the host).
    pub fn buffer(&self) -> &TokenBuffer {
        &self.buf
    }

    /// Tells every part that the sequence emitted `token`.
    pub fn accept(&mut self, token: u32) -> Result<(), SampleError> {
        self.window.accept(token);
        if let Some(h) = &mut self.host {
            h.accept(token)?;
        }
        self.full.accept(token)
    }

    /// Finishes a step after the device prefix: the host remainder over the
    /// survivors, or (for [`Survivors::Fallback`]) the whole chain over
    /// `dense()`'s logits, which the caller provides only then.
    pub fn finish<'d>(
        &mut self,
        survivors: Survivors<'_>,
        dense: impl FnOnce() -> &'d [f32],
        seed: u64,
        step: u64,
    ) -> Result<Sampled, DevicePrefixError> {
        let cands = match survivors {
            Survivors::Candidates(c) => c,
            Survivors::Fallback => return self.run_full(dense(), seed, step),
        };
        let max = self.plan.max_survivors();
        if cands.len() > max {
            return Err(DevicePrefixError::TooMany {
                got: cands.len(),
                max,
            });
        }
        if let Some(c) = cands.iter().find(|c| c.id as usize >= self.n_vocab) {
            return Err(DevicePrefixError::BadCandidate {
                id: c.id,
                n_vocab: self.n_vocab,
            });
        }
        if let Some(DeviceStage::KeepMax { .. }) = self.plan.device.last()
            && cands.first().is_none_or(|c| c.logit == f32::NEG_INFINITY)
        {
            // The CPU stage keeps nothing (temperature) or fails (greedy):
            // let the host chain say which.
            return self.run_full(dense(), seed, step);
        }
        if self.plan.selects_on_device() {
            // As the CPU greedy stage leaves it: the winner alone.
            self.buf
                .load_candidates(self.n_vocab, &cands[..1], true)
                .map_err(SampleError::from)?;
            return Ok(Sampled {
                token_id: cands[0].id,
            });
        }
        let host = self
            .host
            .as_mut()
            .expect("a non-selecting device prefix has a host remainder");
        self.buf
            .load_candidates(self.n_vocab, cands, true)
            .map_err(SampleError::from)?;
        Ok(host.sample_prepared(&mut self.buf, seed, step)?)
    }

    fn run_full(
        &mut self,
        dense: &[f32],
        seed: u64,
        step: u64,
    ) -> Result<Sampled, DevicePrefixError> {
        self.buf.load(dense).map_err(SampleError::from)?;
        Ok(self.full.sample(&mut self.buf, seed, step)?)
    }
}

/// One decode step of `seq` (the whole chain, `plan` its split) over the
/// survivors a device prefix left: they are loaded as the sorted candidate
/// view the CPU prefix leaves, the stages from [`PrefixPlan::host_start`]
/// run with the step's RNG, and the output is [`crate::step::run`]'s —
/// `raw(id)` gives a survivor's raw logit and `lse` the raw row's
/// log-sum-exp (both from the device, bit for bit the host's), so the
/// token, `probability`, `logprob` and post-chain `probs` are the CPU
/// step's. Raw `probs` (over the whole row) cannot come from survivors:
/// asking for them is an error (the caller copies the dense logits).
#[allow(clippy::too_many_arguments)]
pub fn run_survivors(
    seq: &mut Sequence,
    buf: &mut TokenBuffer,
    n_vocab: usize,
    plan: &PrefixPlan,
    survivors: &[SdCandidate],
    raw: impl Fn(u32) -> f32,
    lse: f32,
    seed: u64,
    step: u64,
    probs: crate::step::ProbsRequest,
) -> Result<crate::step::StepOutput, DevicePrefixError> {
    if probs.n > 0 && !probs.post_sampling {
        return Err(DevicePrefixError::NeedsDense);
    }
    let max = plan.max_survivors();
    if survivors.is_empty() || survivors.len() > max {
        return Err(DevicePrefixError::TooMany {
            got: survivors.len(),
            max,
        });
    }
    if let Some(c) = survivors.iter().find(|c| c.id as usize >= n_vocab) {
        return Err(DevicePrefixError::BadCandidate { id: c.id, n_vocab });
    }
    buf.load_candidates(n_vocab, survivors, true)
        .map_err(SampleError::from)?;
    let token_id = seq
        .sample_prepared_from(buf, seed, step, plan.host_start())?
        .token_id;
    Ok(crate::step::report(buf, token_id, None, probs, || lse, raw))
}

/// The CPU twin of the device kernels: the same stages with the same
/// semantics over a host copy of the logits.
pub mod reference {
    use super::*;

    /// The core stages' `util::saturate`: arithmetic on a logit stays
    /// finite, a masked (-inf) logit stays masked.
    fn saturate(old: f32, new: f32) -> f32 {
        if old == f32::NEG_INFINITY {
            old
        } else {
            new.clamp(-f32::MAX, f32::MAX)
        }
    }

    /// Order-preserving key of a logit (-0 and +0 equal), as the device.
    fn key(v: f32) -> u32 {
        let u = (v + 0.0).to_bits();
        if u & 0x8000_0000 != 0 {
            !u
        } else {
            u | 0x8000_0000
        }
    }

    /// Runs `stages` (a device prefix: dense stages, then one truncating
    /// stage) over `logits` with the penalty `window`; writes the survivors
    /// into `out` and returns whether the device would report a fallback.
    pub fn run(
        stages: &[DeviceStage],
        window: &PenaltyWindow,
        logits: &[f32],
        out: &mut Vec<SdCandidate>,
    ) -> bool {
        out.clear();
        let bad = logits.iter().any(|&v| v.is_nan() || v == f32::INFINITY);
        let finite = logits.iter().any(|&v| v > f32::NEG_INFINITY);
        if bad || !finite {
            return true;
        }
        let mut x = logits.to_vec();
        let n = x.len();
        let (mut ids, mut counts) = (Vec::new(), Vec::new());
        for st in stages {
            match st {
                DeviceStage::LogitBias { ids, bias, starts } => {
                    for r in starts.windows(2) {
                        let id = ids[r[0] as usize] as usize;
                        if id >= n {
                            continue;
                        }
                        for &b in &bias[r[0] as usize..r[1] as usize] {
                            x[id] = if b == f32::NEG_INFINITY {
                                b
                            } else {
                                saturate(x[id], x[id] + b)
                            };
                        }
                    }
                }
                DeviceStage::Penalties {
                    repeat,
                    frequency,
                    presence,
                    ..
                } => {
                    window.distinct(&mut ids, &mut counts);
                    for (&id, &c) in ids.iter().zip(&counts) {
                        let Some(l) = x.get_mut(id as usize) else {
                            continue;
                        };
                        let logit = *l;
                        let v = if logit <= 0.0 {
                            logit * repeat
                        } else {
                            logit / repeat
                        };
                        let v = saturate(logit, v);
                        let sub = c as f32 * frequency + (c > 0) as u32 as f32 * presence;
                        *l = saturate(logit, v - sub);
                    }
                }
                DeviceStage::Temperature(t) => {
                    for v in &mut x {
                        *v = saturate(*v, *v / t);
                    }
                }
                DeviceStage::TopK(_) | DeviceStage::KeepMax { .. } => {
                    let k = st.keep().unwrap_or(1).min(n);
                    let mut idx: Vec<u32> = (0..n as u32).collect();
                    let order = |a: &u32, b: &u32| {
                        key(x[*b as usize]).cmp(&key(x[*a as usize])).then(a.cmp(b))
                    };
                    idx.select_nth_unstable_by(k - 1, order);
                    idx.truncate(k);
                    idx.sort_by(order);
                    out.extend(idx.iter().map(|&id| SdCandidate {
                        id,
                        logit: x[id as usize],
                    }));
                    return false;
                }
            }
        }
        unreachable!("a device prefix ends with a truncating stage")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(spec: &ChainSpec) -> Vec<&str> {
        spec.stages.iter().map(|s| s.name.as_str()).collect()
    }

    fn spec(stages: Vec<StageSpec>) -> ChainSpec {
        ChainSpec { stages }
    }

    #[test]
    fn default_chain_runs_penalties_and_top_k_on_the_device() {
        let s = crate::SamplingParams::default().chain_spec();
        let plan = split(&s);
        assert_eq!(
            plan.device,
            vec![
                DeviceStage::Penalties {
                    window: 64,
                    repeat: 1.1,
                    frequency: 0.0,
                    presence: 0.0
                },
                DeviceStage::TopK(40)
            ]
        );
        assert_eq!(plan.device_specs, 2);
        assert_eq!(
            names(plan.host.as_ref().unwrap()),
            ["top_p", "temperature", "dist"]
        );
        assert_eq!(plan.max_survivors(), 40);
        assert_eq!(plan.penalty_window(), 64);
    }

    #[test]
    fn greedy_chain_selects_on_the_device() {
        let p = crate::SamplingParams {
            temperature: 0.0,
            logit_bias: vec![(7, 1.0), (3, -2.0), (7, 0.5)],
            ..Default::default()
        };
        let plan = split(&p.chain_spec());
        assert_eq!(plan.device.len(), 3);
        assert_eq!(
            plan.device[0],
            DeviceStage::LogitBias {
                ids: vec![3, 7, 7],
                bias: vec![-2.0, 1.0, 0.5],
                starts: vec![0, 1, 3]
            }
        );
        assert!(plan.selects_on_device());
        assert_eq!(plan.host, None);
        assert_eq!(plan.max_survivors(), 1);
    }

    #[test]
    fn prefix_stops_at_the_first_stage_without_a_device_version() {
        // top_p before top_k: nothing truncates before the host stage, so
        // the whole chain stays on the host.
        let s = spec(vec![
            StageSpec::new("penalties"),
            StageSpec::new("top_p").number("p", 0.9),
            StageSpec::new("top_k").number("k", 10.0),
            StageSpec::new("dist"),
        ]);
        let plan = split(&s);
        assert!(plan.device.is_empty());
        assert_eq!(plan.host.as_ref(), Some(&s));
        assert_eq!(plan.max_survivors(), 0);
        // A third-party stage first: likewise.
        let s = spec(vec![StageSpec::new("my_plugin"), StageSpec::new("greedy")]);
        assert!(split(&s).device.is_empty());
    }

    #[test]
    fn prefix_is_cut_after_the_first_truncation() {
        let s = spec(vec![
            StageSpec::new("temperature").number("t", 0.7),
            StageSpec::new("top_k").number("k", 5.0),
            StageSpec::new("penalties"),
            StageSpec::new("greedy"),
        ]);
        let plan = split(&s);
        assert_eq!(
            plan.device,
            vec![DeviceStage::Temperature(0.7), DeviceStage::TopK(5)]
        );
        assert_eq!(names(plan.host.as_ref().unwrap()), ["penalties", "greedy"]);
    }

    #[test]
    fn unsupported_parameters_keep_the_stage_on_the_host() {
        for s in [
            StageSpec::new("temperature").number("dynatemp_range", 0.5),
            StageSpec::new("top_k").number("k", 257.0),
            StageSpec::new("top_k").number("k", 2.5),
            StageSpec::new("penalties").number("repeat_penalty", -1.0),
            StageSpec::new("penalties").number("unknown", 1.0),
            StageSpec::new("logit_bias")
                .with("bias", ParamValue::TokenMap(vec![(1, f32::INFINITY)])),
            StageSpec::new("top_k").with("k", ParamValue::String("40".into())),
        ] {
            let chain = spec(vec![s.clone(), StageSpec::new("greedy")]);
            assert!(split(&chain).device.is_empty(), "{s:?}");
        }
    }

    #[test]
    fn neutral_stages_are_skipped_not_stopped_at() {
        let s = spec(vec![
            StageSpec::new("top_k").number("k", 0.0),
            StageSpec::new("temperature").number("t", 1.0),
            StageSpec::new("penalties").number("repeat_last_n", 0.0),
            StageSpec::new("temperature").number("t", 0.0),
            StageSpec::new("dist"),
        ]);
        let plan = split(&s);
        assert_eq!(plan.device, vec![DeviceStage::KeepMax { selects: false }]);
        assert_eq!(plan.device_specs, 4);
        assert_eq!(names(plan.host.as_ref().unwrap()), ["dist"]);
    }

    #[test]
    fn penalty_window_matches_the_ring_semantics() {
        let mut w = PenaltyWindow::new(3);
        for t in [1, 2, 1, 3, 1] {
            w.accept(t);
        }
        // window = [1, 3, 1]
        let (mut ids, mut counts) = (Vec::new(), Vec::new());
        w.distinct(&mut ids, &mut counts);
        let mut got: Vec<(u32, u32)> = ids.into_iter().zip(counts).collect();
        got.sort();
        assert_eq!(got, vec![(1, 2), (3, 1)]);
        let mut off = PenaltyWindow::new(0);
        off.accept(5);
        off.distinct(&mut Vec::new(), &mut Vec::new());
        assert!(off.counts.is_empty());
    }

    #[test]
    fn reference_top_k_orders_ties_by_id_and_treats_signed_zeros_as_equal() {
        let x = [0.5, -0.0, 2.0, 0.0, 2.0, f32::NEG_INFINITY, 0.5];
        let mut out = Vec::new();
        assert!(!reference::run(
            &[DeviceStage::TopK(5)],
            &PenaltyWindow::new(0),
            &x,
            &mut out
        ));
        let ids: Vec<u32> = out.iter().map(|c| c.id).collect();
        assert_eq!(ids, [2, 4, 0, 6, 1]);
        assert!(!reference::run(
            &[DeviceStage::TopK(7)],
            &PenaltyWindow::new(0),
            &x,
            &mut out
        ));
        assert_eq!(out.last().unwrap().id, 5);
        assert!(reference::run(
            &[DeviceStage::TopK(2)],
            &PenaltyWindow::new(0),
            &[1.0, f32::NAN],
            &mut out
        ));
        assert!(reference::run(
            &[DeviceStage::TopK(2)],
            &PenaltyWindow::new(0),
            &[f32::NEG_INFINITY; 3],
            &mut out
        ));
    }
}
