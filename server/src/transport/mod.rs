//! What every request passes before (and after) a handler: TLS, bearer
//! tokens, deadlines, request metrics, per-method size limits read from the
//! message prefix, and the zero-copy decoding of messages that arrive in one
//! HTTP/2 frame.

#![forbid(unsafe_code)]

pub mod auth;
pub mod deadline;
pub mod metrics;
pub mod one_frame;
pub mod request_size;
pub mod tls;
