//! samplerd's built-in sampler stages, exported as the `core` plugin
//! library. Semantics follow llama.cpp's samplers; see `docs/SAMPLING.md`
//! for each stage's parameters, complexity and the documented differences.

pub mod adaptive_p;
pub mod coupled;
pub mod dist;
pub mod dry;
pub mod greedy;
pub mod logit_bias;
pub mod min_p;
pub mod mirostat;
pub mod penalties;
pub mod reasoning_budget;
pub mod temperature;
pub mod token_controls;
pub mod top_k;
pub mod top_n_sigma;
pub mod top_p;
pub mod typical_p;
pub mod util;
pub mod xtc;

samplerd_plugin_sdk::export_plugin!(
    name: c"core",
    version: c"0.1.0",
    stages: [
        logit_bias::LogitBias,
        penalties::Penalties,
        dry::Dry,
        top_n_sigma::TopNSigma,
        top_k::TopK,
        typical_p::TypicalP,
        top_p::TopP,
        min_p::MinP,
        xtc::Xtc,
        temperature::Temperature,
        dist::Dist,
        greedy::Greedy,
        coupled::Coupled,
        mirostat::Mirostat,
        mirostat::MirostatV2,
        token_controls::TokenControls,
        adaptive_p::AdaptiveP,
        reasoning_budget::ReasoningBudget,
    ]
);
