//! Strategies and runners for the property suites in `tests/`.
//!
//! Strategies build dependent structure the way the inputs are: geometry first (slot count,
//! then per-slot lengths and gaps sized from it; heads and dims), then tensors sized from the
//! geometry. Nothing is filtered, so no case is thrown away.
//!
//! The checks themselves are `smallseq::harness::oracles` (and, for a backend's whole property
//! suite, `smallseq::harness::backend_oracle`), the same functions the cargo-fuzz targets call:
//! a failure found by either tool is judged by one oracle.

pub mod backend;
pub mod strategies;

use proptest::test_runner::{Config, FileFailurePersistence};

/// The suites' runner config: `PROPTEST_CASES` (default 256) scales every suite, and failures
/// persist to the committed `*.proptest-regressions` file next to the suite, which is replayed
/// first on every run.
pub fn config(source_file: &'static str) -> Config {
    Config {
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        source_file: Some(source_file),
        ..Config::default()
    }
}
