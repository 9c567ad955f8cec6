//! The harness: case generation, properties, tolerances, capsules, shrinking and reports.

pub mod classes;
pub mod gen;
pub mod props;
pub mod rng;
pub mod tolerance;
pub mod transform;
pub mod campaign;
pub mod capsule;
pub mod shrink;
pub mod repro;
