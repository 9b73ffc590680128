//! `ListStages`: every loaded stage, the default chain and the loaded
//! vocabularies.

#![forbid(unsafe_code)]

use samplerd_api::v1;

use super::state::AppState;
use crate::request::convert;

/// Builds the ListStages response.
pub fn list(state: &AppState) -> v1::ListStagesResponse {
    let mut default_chain = convert::chain_to_proto(&state.defaults.spec);
    for stage in &mut default_chain {
        for value in stage.params.values_mut() {
            if let Some(v1::param_value::Kind::Number(n)) = &mut value.kind {
                *n = as_written(*n);
            }
        }
    }
    v1::ListStagesResponse {
        stages: state
            .registry
            .stages()
            .iter()
            .map(convert::stage_info_to_proto)
            .collect(),
        default_chain,
        default_chain_description: state.defaults.chain.describe(),
        vocabularies: state.vocabularies.to_proto(),
    }
}

/// `n` as the configuration wrote it. The typed defaults are `f32` (as
/// llama.cpp's), so `top_p = 0.95` reaches the chain as
/// 0.949999988079071; a value an `f32` holds exactly is shown as the
/// shortest decimal that reads back to that `f32` (0.95). The chain itself
/// keeps the exact value: stages read it as `f32` either way.
fn as_written(n: f64) -> f64 {
    let single = n as f32;
    if f64::from(single) != n {
        return n;
    }
    single.to_string().parse().unwrap_or(n)
}

#[cfg(test)]
mod tests {
    use super::as_written;

    #[test]
    fn f32_defaults_show_as_written() {
        assert_eq!(as_written(f64::from(0.95f32)), 0.95);
        assert_eq!(as_written(f64::from(1.1f32)), 1.1);
        assert_eq!(as_written(f64::from(0.05f32)), 0.05);
        assert_eq!(as_written(40.0), 40.0);
        assert_eq!(as_written(-1.0), -1.0);
        // An f64 no f32 holds is left alone.
        assert_eq!(as_written(0.1), 0.1);
        assert_eq!(as_written(1e300), 1e300);
        assert!(as_written(f64::NAN).is_nan());
    }
}
