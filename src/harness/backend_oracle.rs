//! The backend oracle of the proptest suites and the cargo-fuzz targets: every property on
//! one case, and on a failure its capsule and repro line. The other oracles
//! ([`super::oracles`]) judge parts below the properties; this one sits above them, since it
//! runs the whole suite and writes what the campaign writes.

use super::campaign::repro_cmd;
use super::oracles::{Verdict, Violation};
use super::props::Checker;
use crate::case::Case;

/// Every harness property on one case against the backend in `checker`. On a failure with
/// `capsule` set, the capsule is written there before the violation (which carries the
/// one-line repro command) is returned.
pub fn backend_properties(
    checker: &Checker,
    case: &Case,
    salt: u64,
    capsule: Option<(&std::path::Path, &str)>,
) -> Result<Verdict, Violation> {
    let run = checker
        .check(case, salt)
        .map_err(|e| format!("the harness could not run the case: {e}"))?;
    let Some(f) = run.failures().first().copied() else {
        return Ok(Verdict::Checked);
    };
    let mut msg = format!("{}: {}", f.prop, f.detail);
    if let Some((path, backend)) = capsule {
        let profile = checker.opts.profile.name();
        match super::capsule::write(path, case, &run, checker, salt, None) {
            Ok(()) => msg.push_str(&format!(
                "\nreproduce: {}",
                repro_cmd(path, backend, profile)
            )),
            Err(e) => msg.push_str(&format!("\n(capsule not written: {e})")),
        }
    }
    Err(msg)
}
