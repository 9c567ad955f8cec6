//! The Python the adapter tests run under, shared by the integration tests that start one.

use std::process::Command;

/// The Python the adapters run under (`SMALLSEQ_PYTHON`, else python3), if it has numpy and
/// safetensors. Where `SMALLSEQ_PYTHON` names one (as `.ci/run` does, from ci/python-kit.sh),
/// it must have them: a test then fails instead of skipping.
pub fn python_kit() -> Option<String> {
    let py = smallseq::harness::triage_script::python();
    let ok = Command::new(&py)
        .args(["-c", "import numpy, safetensors"])
        .output()
        .is_ok_and(|o| o.status.success());
    let configured = std::env::var("SMALLSEQ_PYTHON").is_ok_and(|p| !p.trim().is_empty());
    assert!(
        ok || !configured,
        "SMALLSEQ_PYTHON={py} lacks numpy or safetensors"
    );
    ok.then_some(py)
}
