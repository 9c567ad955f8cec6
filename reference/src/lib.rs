//! f64 reference of masked THD attention (`semantics.md` §1), forward and backward, plus a
//! device-faithful emulation of the small-seq kernels' roundings.
//!
//! This crate depends on nothing GPU and nothing of the harness, so the oracle cannot call the
//! code under test.

pub mod layout;
pub mod problem;
pub mod types;

pub use layout::{Layout, LayoutError, Side};
pub use problem::{check_params, Problem};
pub use types::{visible, AttnParams, CausalAlign, Dtype, Mask, Window};
