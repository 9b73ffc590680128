//! The configured defaults: `[sampling]` (the typed parameters and the
//! seed setting), `[chain]` (the stage order, or an explicit chain) and
//! the default chain built from them once at start-up ([`Defaults`]),
//! which every request that sets no parameter shares.

#![forbid(unsafe_code)]

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use samplerd_sampling::{Chain, ChainError, ChainSpec, SamplingParams, StageRegistry, StageSpec};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Default seed when neither the config nor the request sets one.
pub const DEFAULT_SEED: u64 = 42;

/// The default chain.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ChainConfig {
    /// Stage order by name (llama.cpp `--samplers` style); parameters come
    /// from `[sampling]`. Empty = llama.cpp's order.
    pub order: Vec<String>,
    /// An explicit chain (names + parameters) replacing the one derived
    /// from `[sampling]`; empty = derive it.
    pub stages: Vec<StageSpec>,
}

/// The seed setting: a fixed number or `"random"` (a fresh seed per
/// request, reported in the response).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeedSetting {
    Fixed(u64),
    Random,
}

impl Default for SeedSetting {
    fn default() -> Self {
        SeedSetting::Fixed(DEFAULT_SEED)
    }
}

impl fmt::Display for SeedSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SeedSetting::Fixed(s) => write!(f, "{s}"),
            SeedSetting::Random => f.write_str("random"),
        }
    }
}

impl Serialize for SeedSetting {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            SeedSetting::Fixed(v) => s.serialize_u64(*v),
            SeedSetting::Random => s.serialize_str("random"),
        }
    }
}

impl<'de> Deserialize<'de> for SeedSetting {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Num(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Num(n) => Ok(SeedSetting::Fixed(n)),
            Raw::Text(t) if t.eq_ignore_ascii_case("random") => Ok(SeedSetting::Random),
            // Environment variables arrive as strings only when they fail
            // to parse as numbers; accept decimal text too.
            Raw::Text(t) => t.parse().map(SeedSetting::Fixed).map_err(|_| {
                serde::de::Error::custom(format!(
                    "seed must be a non-negative integer or \"random\", got {t:?}"
                ))
            }),
        }
    }
}

/// Default sampling parameters (`[sampling]`): what a request's unset
/// fields take. The typed fields are the sampling crate's own
/// [`SamplingParams`] (its defaults are llama.cpp's CLI defaults), beside
/// the seed setting; `logit_bias` and `order` are not configurable here
/// (the stage order is `chain.order`).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct SamplingDefaults {
    pub seed: SeedSetting,
    pub params: SamplingParams,
}

/// `[sampling]` keys that `SamplingParams` has but the configuration
/// takes elsewhere (or not at all), with where to set them instead.
const SAMPLING_KEYS_ELSEWHERE: &[(&str, &str)] = &[
    ("order", "set the stage order with chain.order"),
    (
        "logit_bias",
        "a logit bias is set per request (params.logit_bias)",
    ),
];

impl Serialize for SamplingDefaults {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct View<'a> {
            seed: SeedSetting,
            #[serde(flatten)]
            params: &'a SamplingParams,
        }
        View {
            seed: self.seed,
            params: &self.params,
        }
        .serialize(s)
    }
}

// By hand rather than `#[serde(flatten)]`: flatten would silently accept
// misspelt keys (it cannot be combined with `deny_unknown_fields`), while
// `SamplingParams` refuses them itself once `seed` is taken out.
impl<'de> Deserialize<'de> for SamplingDefaults {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let mut table = figment::value::Dict::deserialize(d)?;
        for (key, instead) in SAMPLING_KEYS_ELSEWHERE {
            if table.contains_key(*key) {
                return Err(D::Error::custom(format!(
                    "`{key}` is not a [sampling] key: {instead}"
                )));
            }
        }
        let seed = match table.remove("seed") {
            Some(v) => SeedSetting::deserialize(&v).map_err(D::Error::custom)?,
            None => SeedSetting::default(),
        };
        let params = SamplingParams::deserialize(&figment::value::Value::from(table))
            .map_err(D::Error::custom)?;
        Ok(SamplingDefaults { seed, params })
    }
}

impl SamplingDefaults {
    /// The typed parameters (without a logit bias) in `order`.
    pub fn params(&self, order: &[String]) -> SamplingParams {
        SamplingParams {
            order: order.to_vec(),
            ..self.params.clone()
        }
    }
}

/// The configured defaults: typed parameters, seed setting and the
/// default chain (built once at start-up).
pub struct Defaults {
    /// Typed defaults (config `[sampling]` + `chain.order`).
    pub params: SamplingParams,
    /// Config `sampling.seed`.
    pub seed: SeedSetting,
    /// The default chain's spec.
    pub spec: ChainSpec,
    /// The default chain, shared by every request that sets no parameter.
    pub chain: Chain,
    /// Config `limits.max_chain_stages`: longest chain a request may ask for.
    pub max_chain_stages: usize,
}

/// Which part of the configuration a default-chain error comes from.
#[derive(Debug, thiserror::Error)]
#[error("{key}: {error}")]
pub struct DefaultChainError {
    /// The config key: `sampling.<field>` for a stage's refusal of a typed
    /// default, else `chain.stages`, `chain.order` or `sampling`.
    pub key: String,
    pub error: ChainError,
}

impl Defaults {
    /// Builds the default chain from `[chain]` and `[sampling]`:
    /// `chain.stages` when set, else `[sampling]` in `chain.order`;
    /// `max_chain_stages` (`limits.max_chain_stages`) is kept for requests.
    pub fn build(
        chain_config: &ChainConfig,
        sampling: &SamplingDefaults,
        max_chain_stages: usize,
        registry: &StageRegistry,
    ) -> Result<Self, DefaultChainError> {
        let params = sampling.params(&chain_config.order);
        let chain = if chain_config.stages.is_empty() {
            registry.build_typed(&params, None).map_err(|error| {
                let key = match &error {
                    ChainError::Param { field, .. } => format!("sampling.{field}"),
                    _ if chain_config.order.is_empty() => "sampling".to_string(),
                    _ => "chain.order".to_string(),
                };
                DefaultChainError { key, error }
            })?
        } else {
            let spec = ChainSpec {
                stages: chain_config.stages.clone(),
            };
            registry
                .build_chain(&spec, None)
                .map_err(|error| DefaultChainError {
                    key: "chain.stages".to_string(),
                    error,
                })?
        };
        Ok(Defaults {
            params,
            seed: sampling.seed,
            spec: chain.spec().clone(),
            chain,
            max_chain_stages,
        })
    }

    /// The configured seed, or a fresh one for `seed = "random"`.
    pub fn default_seed(&self) -> u64 {
        match self.seed {
            SeedSetting::Fixed(s) => s,
            SeedSetting::Random => random_seed(),
        }
    }
}

/// A fresh, unpredictable seed (std's per-process random hasher keys,
/// mixed with a counter).
fn random_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
}
