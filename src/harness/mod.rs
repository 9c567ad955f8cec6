//! The harness: case generation, properties, tolerances, capsules, shrinking and reports.

#[cfg(test)]
mod another_order;
pub mod bias;
pub mod campaign;
pub mod capsule;
pub mod classes;
pub mod conditioning;
pub mod conformance;
pub mod coverage;
pub mod data_class;
pub mod fit;
pub mod fuzz_input;
pub mod gen;
pub mod merge;
pub mod oracles;
pub mod props;
pub mod report_io;
pub mod repro;
pub mod rng;
pub mod shapes;
pub mod shrink;
pub mod subnormal;
pub mod te625;
pub mod tolerance;
pub mod transform;
