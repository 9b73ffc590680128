//! The backend's error for a failed CUDA driver call: what failed, and the driver's reason.

use crate::error::ModelError;

/// `ModelError::Backend("cuda: {what}: {e}")`.
pub(super) fn err(what: &str, e: impl std::fmt::Display) -> ModelError {
    ModelError::Backend(format!("cuda: {what}: {e}"))
}
