#![no_main]
//! Fuzz target `dispatch`: the body is `smallseq::harness::fuzz_input::run`, shared with the
//! corpus replay test and the proptests' oracles.

use libfuzzer_sys::fuzz_target;
use smallseq::harness::fuzz_input::{run, Target};

fuzz_target!(|data: &[u8]| {
    if let Err(violation) = run(Target::Dispatch, data) {
        panic!("dispatch: {violation}");
    }
});
