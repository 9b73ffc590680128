//! `ListStages`: every loaded stage, the default chain and the loaded
//! vocabularies.

#![forbid(unsafe_code)]

use samplerd_api::v1;

use super::state::AppState;
use crate::request::convert;

/// Builds the ListStages response.
pub fn list(state: &AppState) -> v1::ListStagesResponse {
    v1::ListStagesResponse {
        stages: state
            .registry
            .stages()
            .iter()
            .map(convert::stage_info_to_proto)
            .collect(),
        default_chain: convert::chain_to_proto(&state.defaults.spec),
        default_chain_description: state.defaults.chain.describe(),
        vocabularies: state.vocabularies.to_proto(),
    }
}
