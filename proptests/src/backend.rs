//! Opening a backend for a suite, and the suite every backend × dtype instance runs.

use crate::strategies::tiny_case;
use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestRunner};
use smallseq::backend::{self, Backend};
use smallseq::harness::backend_oracle;
use smallseq::harness::props::Checker;
use smallseq::mutants::Mutant;
use smallseq::Error;
use smallseq_reference::Dtype;
use std::path::PathBuf;

/// Opens `name`. A missing device prints a visible `SKIP` line and returns `None`, unless
/// `SMALLSEQ_REQUIRE_GPU=1`, which turns it into a failure.
///
/// `SMALLSEQ_PROPTEST_MUTANT=NAME` swaps the CPU backend for a planted-bug mutant: how the
/// committed regression files were seeded with inputs that kill mutants.
pub fn open_or_skip(name: &str, suite: &str) -> Option<Box<dyn Backend>> {
    if name == "cpu" {
        if let Ok(m) = std::env::var("SMALLSEQ_PROPTEST_MUTANT") {
            let m: Mutant = m
                .parse()
                .unwrap_or_else(|e| panic!("SMALLSEQ_PROPTEST_MUTANT: {e}"));
            println!("{suite}: running against mutant {m}");
            return Some(
                backend::open_planted("cpu", &[m]).expect("the CPU backend carries every mutant"),
            );
        }
    }
    match backend::open(name) {
        Ok(b) => Some(b),
        Err(e @ (Error::NoDevice { .. } | Error::NotCompiledWith { .. })) => {
            if std::env::var("SMALLSEQ_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("{suite}: SMALLSEQ_REQUIRE_GPU=1 and backend {name} is unavailable: {e}");
            }
            smallseq::print_skip(format_args!("{suite}: backend {name} unavailable: {e}"));
            None
        }
        Err(e) => panic!("{suite}: opening backend {name}: {e}"),
    }
}

/// Every harness property against the reference, on tiny cases of one dtype. A failing case
/// is shrunk by proptest; the last (smallest) failing case is left as a capsule in
/// `target/proptest-capsules/` with its `smallseq repro` command in the failure message.
pub fn run_suite(name: &str, dtype: Dtype, source_file: &'static str) {
    let suite = format!("{name}/{dtype}");
    let Some(be) = open_or_skip(name, &suite) else {
        return;
    };
    let checker = Checker::isolated(be.as_ref());
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/proptest-capsules");
    std::fs::create_dir_all(&dir).expect("capsule directory");
    let capsule = dir.join(format!("{name}-{dtype}.safetensors"));
    let mut runner = TestRunner::new(crate::config(source_file));
    let result = runner.run(&(tiny_case(dtype), any::<u64>()), |(case, salt)| {
        backend_oracle::backend_properties(&checker, &case, salt, Some((&capsule, name)))
            .map(|_| ())
            .map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{suite}: {e}");
    }
}

/// One test per backend × dtype; GPU instances sit behind their features.
#[macro_export]
macro_rules! backend_suite {
    ($($test:ident: $backend:literal, $dtype:expr;)*) => {$(
        #[test]
        fn $test() {
            $crate::backend::run_suite($backend, $dtype, file!());
        }
    )*};
}
