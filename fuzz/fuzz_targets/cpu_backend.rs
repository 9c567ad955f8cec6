#![no_main]
//! Fuzz target `cpu_backend`: the body is `smallseq::harness::fuzz_input::run`, shared with the
//! corpus replay test and the proptests' oracles.

use libfuzzer_sys::fuzz_target;
use smallseq::harness::fuzz_input::{run, Target};

fuzz_target!(|data: &[u8]| {
    if let Err(violation) = run(Target::CpuBackend, data) {
        panic!("cpu_backend: {violation}");
    }
});
