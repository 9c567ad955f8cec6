//! f64 reference of masked THD attention (`docs/semantics.md` §1), forward and backward, plus a
//! device-faithful emulation of the small-seq kernels' roundings.
//!
//! This crate depends on nothing GPU and nothing of the harness, so the oracle cannot call the
//! code under test.
//!
//! - [`forward`], [`forward_backward`]: the f64 reference, one function per equation
//!   ([`equations`]) applied to each (slot, head) block sliced out by [`slot`];
//! - [`naive`]: an independent plain-loop f64 implementation to cross-check it;
//! - [`emulate`]: the kernels' f32/dtype roundings, the same-precision yardstick;
//! - [`emulate_fallback`]: the fallback's online softmax in f32, per declared design;
//! - [`ds_scale`]: how dS keeps its value as a 16-bit operand (a power of two per block);
//! - [`dropout`]: which elements of P drop (Philox 4×32-10), shared by all of the above.

mod attention;
pub mod dropout;
pub mod ds_scale;
pub mod emulate;
pub mod emulate_fallback;
pub mod equations;
mod gemm;

// The scores' additive bias (post-scale tensor or ALiBi), shared like `dropout`.
pub mod bias;
pub mod emulate_dbias;

pub mod layout;
pub mod naive;
pub mod problem;
pub mod slot;
pub mod types;

pub use attention::{forward, forward_backward, forward_backward_views, Forward, Gradients};
pub use bias::{AttnBias, BiasError};
pub use dropout::{philox4x32_10, Dropout};
pub use layout::{Layout, LayoutError, Side};
pub use problem::{check_params, Problem};
pub use types::{visible, AttnParams, CausalAlign, Dtype, Mask, Window};
