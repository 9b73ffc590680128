//! What the RPCs (`service`) and the model host (`generate`) both stand
//! on: a request's errors and the statuses they become ([`errors`]), the
//! protobuf ↔ typed conversions ([`convert`]), the memory budget requests
//! charge ([`memory`]), the token buffers ([`buffer_pool`]) and threads
//! ([`step_pool`]) their steps run on, and the named vocabularies
//! ([`vocabularies`]). Nothing here imports `service` or `generate`.

pub mod buffer_pool;
pub mod convert;
pub mod errors;
pub mod memory;
pub mod step_pool;
pub mod vocabularies;
