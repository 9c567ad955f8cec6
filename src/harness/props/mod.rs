//! The properties, each named, each returning pass, fail (with the worst element) or skip
//! (with a reason).
//!
//! One file per property, beside the machinery they share:
//!
//! | property | file |
//! |---|---|
//! | `eligibility` (the path: dispatch against the surface's rule table) | `eligibility.rs` |
//! | `numeric_agreement` | `numeric.rs` |
//! | `emulation_conformance` | `conformance.rs` |
//! | `rounding_bias` | `bias.rs` |
//! | `workspace` | `workspace.rs` |
//! | `dont_care` | `dont_care.rs` |
//! | `determinism` (and `reruns.rs`: triage's replay of a determinism failure, rerun until one differs) | `determinism.rs` |
//! | `fallback_equivalence` | `fallback.rs` |
//! | `metamorphic` (slot order, batch split, GQA; the scale relation in `scale.rs`, dropout's in `dropout.rs`) | `metamorphic.rs` |
//! | `crash`, `hang` | `fault.rs` |
//!
//! Shared: `verdict.rs` (what a property returns and a case's run records), `yardstick.rs`
//! (the reference, emulation and allowances a case is judged by), `relation.rs` (comparing
//! two runs: bitwise over valid rows, or to a multiple of the thresholds) and `checker.rs`
//! (the suite in its fixed order, over a [`crate::runner::Runner`], and the context the
//! properties after the main run receive). The types of one run ([`Pair`], [`run_pair`])
//! belong to the runner, below, because workers return them too.

pub mod bias;
mod checker;
pub mod conformance;
mod determinism;
mod dont_care;
mod dropout;
mod eligibility;
mod envelope_reach;
mod fallback;
mod fault;
mod metamorphic;
mod numeric;
mod range_limit;
mod range_verdict;
mod relation;
mod reruns;
mod scale;
mod score_bias;
#[cfg(test)]
mod test_backends;
mod verdict;
mod workspace;
mod yardstick;

pub use checker::{CaseContext, Checker};
pub use dont_care::dont_care_outputs;
pub use metamorphic::METAMORPHIC_PER_CASE;
pub use numeric::numeric;
pub use relation::paths_agree;
pub use reruns::{tensor_diffs, Difference, Reruns, TensorDiff};
pub use verdict::{CaseRun, Failure, Outcome, Prop};
pub use yardstick::{numeric_regimes, oracle, oracle_for, Yardstick};

/// Where callers found them before they moved to the runner.
pub use crate::runner::{run_pair, Pair};
