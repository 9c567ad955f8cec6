//! smallseq: small-sequence fused attention, its reference and its fuzz harness.
//!
//! Layers, bottom up: [`reference`] (the f64 oracle, its own crate), [`config`] and [`case`]
//! (typed inputs), [`case_file`] (capsules), [`segments`] (JAX segment ids), [`dispatch`]
//! (eligibility surfaces and decisions), [`workspace`] (the planner), [`backend`] (CPU, CUDA,
//! HIP), [`wrapper`] (plan, decide, zero, launch) and [`harness`] (generators, properties,
//! tolerances, capsules, shrinking, reports); [`report`] draws the reports.

pub use smallseq_reference as reference;

pub mod backend;
pub mod case;
pub mod case_file;
pub mod config;
pub mod design;
pub mod dispatch;
pub mod error;
pub mod files;
pub mod harness;
pub mod mutants;
pub mod report;
pub mod runner;
pub mod segments;
pub mod stages;
pub mod worker;
pub mod workspace;
pub mod wrapper;

pub use case::{Case, Outputs};
pub use config::{AttnConfig, Bias, LayoutKind};
pub use error::{Error, Result};

/// Prints `SKIP <what>` for a test that cannot run here (no GPU, no clang). It writes to the
/// process's stderr directly: libtest captures `println!`/`eprintln!` of a passing test, and a
/// skip must show in a plain `cargo test` log such as CI's.
pub fn print_skip(what: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIP {what}");
}

/// The commit this build was made from (`git rev-parse HEAD` when it was built), with `+dirty`
/// when the sources it compiled differed from that commit (build.rs); `None` for a build from
/// outside a git checkout. At the crate's root because capsules, reports and the worker
/// handshake all name it.
pub fn build_commit() -> Option<&'static str> {
    Some(env!("SMALLSEQ_GIT_COMMIT")).filter(|c| !c.is_empty())
}
