//! Building a chain: a [`ChainSpec`] checked against the registry (stage
//! names, parameter names and kinds, a selecting stage last), then one
//! `config_new` per stage. It sits between the registry and the chain so
//! that neither has to know the other.

use std::ffi::c_void;
use std::sync::Arc;

use crate::chain::{BuiltStage, Chain, ChainInner, Link, OwnedConfig, StageMetrics};
use crate::echo::Echo;
use crate::error::ChainError;
use crate::ffi;
use crate::params::{self, SamplingParams};
use crate::registry::StageRegistry;
use crate::spec::{ChainSpec, ParamValue, StageSpec};
use crate::stage::RegisteredStage;
use crate::vocab::Vocabulary;

/// Stages built beforehand ([`StageRegistry::build_stage`]) that a chain
/// build takes instead of calling `config_new` — matched by spec and
/// vocabulary — and the stage names that may only come that way (a
/// `required` stage missing here is [`ChainError::NotPrebuilt`], so a
/// caller that compiles grammars elsewhere never compiles one by accident
/// on the thread that builds the chain).
#[derive(Clone, Default)]
pub struct Prebuilt {
    stages: Vec<BuiltStage>,
    required: &'static [&'static str],
}

impl Prebuilt {
    /// Nothing prebuilt yet; stages named in `required` must be.
    pub fn requiring(required: &'static [&'static str]) -> Self {
        Prebuilt {
            stages: Vec::new(),
            required,
        }
    }

    /// Adds `stage` for the chains built with this.
    pub fn add(&mut self, stage: BuiltStage) {
        self.stages.push(stage);
    }

    fn find(&self, spec: &StageSpec, vocab: Option<&Arc<Vocabulary>>) -> Option<&BuiltStage> {
        self.stages
            .iter()
            .find(|b| b.spec == *spec && b.has_vocab(vocab))
    }
}

impl StageRegistry {
    /// Validates `spec` (stage names, parameter names and kinds, each
    /// stage's own range checks, a selecting stage last) and builds it.
    pub fn build_chain(
        &self,
        spec: &ChainSpec,
        vocab: Option<Arc<Vocabulary>>,
    ) -> Result<Chain, ChainError> {
        self.build_chain_with(spec, vocab, &Prebuilt::default())
    }

    /// [`build_chain`](Self::build_chain), taking the stages `prebuilt`
    /// holds instead of building them.
    pub fn build_chain_with(
        &self,
        spec: &ChainSpec,
        vocab: Option<Arc<Vocabulary>>,
        prebuilt: &Prebuilt,
    ) -> Result<Chain, ChainError> {
        let stages = validate(self, spec)?;
        let inner = build(&spec.stages, stages, spec, vocab, prebuilt)?;
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
        self.build_typed_with(p, vocab, &Prebuilt::default())
    }

    /// [`build_typed`](Self::build_typed), taking the stages `prebuilt`
    /// holds instead of building them.
    pub fn build_typed_with(
        &self,
        p: &SamplingParams,
        vocab: Option<Arc<Vocabulary>>,
        prebuilt: &Prebuilt,
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
            build(
                &plan.check_only,
                stages,
                &plan.spec,
                vocab.clone(),
                prebuilt,
            )
            .map_err(params::name_typed_field)?;
        }
        self.build_chain_with(&plan.spec, vocab, prebuilt)
            .map_err(params::name_typed_field)
    }

    /// One stage on its own (its name, parameter names and kinds checked,
    /// then its `config_new`), for chains to share through [`Prebuilt`].
    pub fn build_stage(
        &self,
        spec: &StageSpec,
        vocab: Option<Arc<Vocabulary>>,
    ) -> Result<BuiltStage, ChainError> {
        let st = check_stage(self, spec)?;
        Ok(BuiltStage {
            spec: spec.clone(),
            config: Arc::new(new_config(spec, st, vocab)?),
        })
    }
}

/// One stage's `config_new`.
fn new_config(
    s: &StageSpec,
    st: Arc<RegisteredStage>,
    vocab: Option<Arc<Vocabulary>>,
) -> Result<OwnedConfig, ChainError> {
    let raw = ffi::raw_params(&s.name, &s.params)?;
    let params = raw.as_slice();
    let vocab_ptr = vocab.as_ref().map_or(std::ptr::null(), |v| v.as_abi());
    let mut config: *mut c_void = std::ptr::null_mut();
    crate::activity::entering(&Arc::from(s.name.as_str()));
    let config_new = st.vtable.config_new.expect("checked at load");
    crate::activity::in_plugin(st.site, || {
        ffi::call_raw(|err| {
            // SAFETY: params/vocab are valid for the call (vocab for the
            // config's life: the config holds the Arc); out-pointers are
            // valid.
            unsafe { config_new(params.as_ptr(), params.len(), vocab_ptr, &mut config, err) }
        })
    })
    .map_err(|failed| ChainError::Invalid {
        stage: s.name.clone(),
        message: failed.message,
    })?;
    Ok(OwnedConfig {
        stage: st,
        ptr: config,
        _vocab: vocab,
    })
}

/// One config per stage, built (`config_new`) or taken from `prebuilt`;
/// the configs built so far are freed if one refuses.
fn build(
    specs: &[StageSpec],
    stages: Vec<Arc<RegisteredStage>>,
    spec: &ChainSpec,
    vocab: Option<Arc<Vocabulary>>,
    prebuilt: &Prebuilt,
) -> Result<ChainInner, ChainError> {
    let mut inner = ChainInner {
        links: Vec::with_capacity(stages.len()),
        spec: spec.clone(),
    };
    for (s, st) in specs.iter().zip(stages) {
        let owner = match prebuilt.find(s, vocab.as_ref()) {
            Some(b) => Arc::clone(&b.config),
            None if prebuilt.required.contains(&s.name.as_str()) => {
                return Err(ChainError::NotPrebuilt {
                    stage: s.name.clone(),
                });
            }
            None => Arc::new(new_config(s, Arc::clone(&st), vocab.clone())?),
        };
        inner.links.push(Link {
            name: Arc::from(s.name.as_str()),
            deep_checks: crate::chain::deep_checks(&st.info),
            stage: st,
            config: owner.ptr,
            _owner: owner,
            metrics: StageMetrics::new(&s.name),
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
