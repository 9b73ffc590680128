//! What every request passes before (and after) a handler: TLS, bearer
//! tokens, deadlines, request metrics, and the zero-copy decoding of
//! messages that arrive in one HTTP/2 frame.

#![forbid(unsafe_code)]

pub mod auth;
pub mod deadline;
pub mod metrics;
pub mod one_frame;
pub mod tls;
