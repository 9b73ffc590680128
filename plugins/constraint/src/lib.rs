//! samplerd's `constraint` stage, exported as the `constraint` plugin
//! library: constrained decoding on llguidance. The stage masks, in the
//! dense view before any truncating stage, every token that the request's
//! grammar (a JSON Schema, a regex, a Lark or GBNF grammar, any JSON object,
//! or a choice of strings) cannot take next, and allows the
//! end-of-generation tokens exactly where the grammar may stop. See
//! docs/SAMPLING.md, "constraint", for parameters, errors and costs.

#![forbid(unsafe_code)]

pub mod ahead;
pub mod gbnf;
pub mod grammar;
pub mod lazy;
pub mod mask;
pub mod stage;
pub mod tokenv;

pub use stage::Constraint;

samplerd_plugin_sdk::export_plugin!(
    name: c"constraint",
    version: c"0.1.0",
    stages: [stage::Constraint]
);
