//! Building a chain: a [`ChainSpec`] checked against the registry (stage
//! names, parameter names and kinds, a selecting stage last), then one
//! `config_new` per stage. It sits between the registry and the chain so
//! that neither has to know the other.

use std::ffi::c_void;
use std::sync::Arc;

use crate::chain::{Chain, ChainInner, Link, StageMetrics};
use crate::echo::Echo;
use crate::error::ChainError;
use crate::ffi;
use crate::params::{self, SamplingParams};
use crate::registry::StageRegistry;
use crate::spec::{ChainSpec, ParamValue, StageSpec};
use crate::stage::RegisteredStage;
use crate::vocab::Vocabulary;

impl StageRegistry {
    /// Validates `spec` (stage names, parameter names and kinds, each
    /// stage's own range checks, a selecting stage last) and builds it.
    pub fn build_chain(
        &self,
        spec: &ChainSpec,
        vocab: Option<Arc<Vocabulary>>,
    ) -> Result<Chain, ChainError> {
        let stages = validate(self, spec)?;
        let inner = build(&spec.stages, stages, spec, vocab)?;
        Ok(Chain {
            inner: Arc::new(inner),
        })
    }

    /// The chain for typed parameters ([`SamplingParams::plan`]): the
    /// stages it leaves out at unusual no-op values are built first, only
    /// for their checks. A stage's refusal names the typed field
    /// ([`ChainError::Param`]).
    pub fn build_typed(
        &self,
        p: &SamplingParams,
        vocab: Option<Arc<Vocabulary>>,
    ) -> Result<Chain, ChainError> {
        let plan = p.plan();
        if !plan.check_only.is_empty() {
            let stages = plan
                .check_only
                .iter()
                .map(|s| check_stage(self, s))
                .collect::<Result<Vec<_>, _>>()
                .map_err(params::name_typed_field)?;
            // Built and dropped at once: only the stages' verdicts matter.
            build(&plan.check_only, stages, &plan.spec, vocab.clone())
                .map_err(params::name_typed_field)?;
        }
        self.build_chain(&plan.spec, vocab)
            .map_err(params::name_typed_field)
    }
}

/// One `config_new` per stage; `inner` frees the configs built so far if
/// one refuses.
fn build(
    specs: &[StageSpec],
    stages: Vec<Arc<RegisteredStage>>,
    spec: &ChainSpec,
    vocab: Option<Arc<Vocabulary>>,
) -> Result<ChainInner, ChainError> {
    let vocab_ptr = vocab.as_ref().map_or(std::ptr::null(), |v| v.as_abi());
    let mut inner = ChainInner {
        links: Vec::with_capacity(stages.len()),
        spec: spec.clone(),
        _vocab: vocab.clone(),
    };
    for (s, st) in specs.iter().zip(stages) {
        let raw = ffi::raw_params(&s.name, &s.params)?;
        let params = raw.as_slice();
        let mut config: *mut c_void = std::ptr::null_mut();
        let name: Arc<str> = Arc::from(s.name.as_str());
        crate::activity::entering(&name);
        let config_new = st.vtable.config_new.expect("checked at load");
        crate::activity::in_plugin(st.site, || {
            ffi::call_raw(|err| {
                // SAFETY: params/vocab are valid for the call (vocab for the
                // config's life: `inner` holds the Arc); out-pointers are
                // valid.
                unsafe { config_new(params.as_ptr(), params.len(), vocab_ptr, &mut config, err) }
            })
        })
        .map_err(|message| ChainError::Invalid {
            stage: s.name.clone(),
            message,
        })?;
        let metrics = StageMetrics::new(&s.name);
        inner.links.push(Link {
            name,
            deep_checks: crate::chain::deep_checks(&st.info),
            stage: st,
            config,
            metrics,
        });
    }
    Ok(inner)
}

/// Every stage of `spec`, looked up and checked before any config exists.
fn validate(
    registry: &StageRegistry,
    spec: &ChainSpec,
) -> Result<Vec<Arc<RegisteredStage>>, ChainError> {
    if spec.stages.is_empty() {
        return Err(ChainError::Empty);
    }
    let len = spec.stages.len();
    let mut stages = Vec::with_capacity(len);
    for (i, s) in spec.stages.iter().enumerate() {
        let st = check_stage(registry, s)?;
        if st.info.selects && i + 1 != len {
            return Err(ChainError::SelectingNotLast {
                stage: s.name.clone(),
                position: i + 1,
                len,
            });
        }
        if !st.info.selects && i + 1 == len {
            return Err(ChainError::NoSelectingStage {
                stage: s.name.clone(),
            });
        }
        stages.push(st);
    }
    Ok(stages)
}

/// One stage looked up, its parameter names and kinds checked.
fn check_stage(
    registry: &StageRegistry,
    s: &StageSpec,
) -> Result<Arc<RegisteredStage>, ChainError> {
    let st = registry.registered(&s.name)?;
    for (pname, value) in &s.params {
        let Some(pinfo) = st.info.params.iter().find(|p| &p.name == pname) else {
            let accepted: Vec<&str> = st.info.params.iter().map(|p| p.name.as_str()).collect();
            return Err(ChainError::UnknownParam {
                stage: s.name.clone(),
                param: Echo::new(pname),
                accepted: if accepted.is_empty() {
                    "none".into()
                } else {
                    accepted.join(", ")
                },
            });
        };
        if pinfo.kind != value.kind() {
            return Err(ChainError::ParamKind {
                stage: s.name.clone(),
                param: pname.clone(),
                expected: pinfo.kind.describe(),
                got: value.to_string(),
            });
        }
        if let ParamValue::Number(n) = value
            && n.is_nan()
        {
            return Err(ChainError::Invalid {
                stage: s.name.clone(),
                message: format!("{pname} must be a number, got NaN"),
            });
        }
    }
    Ok(st)
}
