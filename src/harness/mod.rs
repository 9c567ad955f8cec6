//! The harness: case generation, properties, tolerances, capsules, shrinking and reports.

#[cfg(test)]
mod another_order;
pub mod backend_oracle;
pub mod campaign;
pub mod capsule;
pub mod classes;
pub mod conditioning;
pub mod coverage;
pub mod data_class;
mod envelope_weights;
pub mod fit;
pub mod ftz;
pub mod fuzz_input;
pub mod gen;
pub mod geometry;
pub mod histogram;
pub mod in_order;
pub mod merge;
pub mod oracles;
pub mod profile;
pub mod props;
pub mod report_io;
pub mod repro;
pub mod rng;
mod row_dots;
pub mod score_bias;
pub mod shapes;
pub mod shrink;
pub mod subnormal;
pub mod te625;
pub mod text;
pub mod tolerance;
pub mod transform;
pub mod triage;
pub mod triage_keys;
pub mod triage_report;
pub mod triage_script;
pub mod triage_verdict;

/// The two properties that had their own files here before every property moved into
/// `props/`: their paths stay, for the callers and the documentation that name them.
pub use props::{bias, conformance};
