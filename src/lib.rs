//! smallseq: small-sequence fused attention, its reference and its fuzz harness.
pub use smallseq_reference as reference;
