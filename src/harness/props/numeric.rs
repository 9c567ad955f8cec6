//! `numeric_agreement`: every output within the tolerance rule's threshold of the f64
//! reference (docs/judgement.md). Its judgements are also the yardstick of the properties
//! that compare two runs: each owes a multiple of these thresholds.

use super::verdict::{Failure, Outcome, Prop};
use super::yardstick::Yardstick;
use crate::case::{Case, Outputs};
use crate::harness::tolerance::{Judgement, Worst};

/// Judges outputs against the oracle: the `numeric_agreement` outcome and the judgements.
pub fn numeric(case: &Case, actual: &Outputs, y: &Yardstick) -> (Outcome, Vec<Judgement>) {
    let js = y.judge(case, actual, true);
    let worst = js
        .iter()
        .filter(|j| !j.passed())
        .max_by(|a, b| a.margin.total_cmp(&b.margin));
    let outcome = match worst {
        None => Outcome::Pass,
        Some(j) => Outcome::Fail(Failure {
            prop: Prop::NumericAgreement,
            detail: numeric_detail(j),
            worst: j.worst.clone(),
            margin: j.margin,
        }),
    };
    (outcome, js)
}

/// A failed tensor's line: its error against the threshold and the emulation's error, and
/// where the emulation itself is non-finite (its error leaves those elements out) or holds the
/// kernel's value at the worst element, so a limit of the kernel design does not read as a
/// kernel straying from it.
fn numeric_detail(j: &Judgement) -> String {
    let mut s = format!(
        "{}: max error {:.3e} > threshold {:.3e} (emulation error {:.3e}",
        j.tensor, j.err, j.threshold, j.emu_err
    );
    if j.emu_non_finite > 0 {
        s += &format!(
            " over its finite elements; it is non-finite at {} where the reference is finite",
            j.emu_non_finite
        );
    }
    s.push(')');
    if j.worst.as_ref().is_some_and(Worst::design_shares) {
        s += "; the emulation holds the same value at the worst element: the kernel follows \
              its design, and the design loses the value there";
    }
    s
}
