//! What every connection and request passes before (and after) a
//! handler: connection limits, deadlines and maximum age, TLS, gRPC only
//! (HTTP 405/415 for anything else), bearer tokens, deadlines, request
//! metrics and the drain on shutdown, unary calls held to one message with
//! per-method size limits read from the message prefix, the zero-copy
//! decoding of messages that arrive in one HTTP/2 frame, samplerd's
//! error details on the statuses tonic writes itself, the request id on
//! every response and log line, and when responses are compressed.

#![forbid(unsafe_code)]

pub mod auth;
pub mod compression;
pub mod connections;
pub mod content_type;
pub mod deadline;
pub mod drain;
pub mod identity;
pub mod listen;
pub mod max_age;
pub mod metrics;
pub mod middleware;
pub mod one_frame;
pub mod request_id;
pub mod status_fixup;
pub mod tls;
pub mod unary;
