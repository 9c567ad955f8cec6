//! Range limits apart from defects (issue 31): a `numeric_agreement` failure that is wholly an
//! output past the dtype's range (non-finite, or saturated at the largest finite value) where
//! the f64 reference is finite and inside it, at elements where smallseq's emulation of a
//! 16-bit design holds the very same value, is the limit of that design, not a defect of the
//! implementation. Re-judged with those elements set to the reference, the outputs pass; the
//! failure is then kept, characterised (which tensor, how many elements, which intermediate
//! overflows, from what input magnitude), and counted apart: the campaign's exit status counts
//! defects, and `--fail-on-range-limit` makes range limits fail too. The relations compare
//! runs with these elements excused the same way (`relation::relation_verdict`).

use super::envelope_reach;
use super::range_verdict::{describe, excused_passing, past_range, RangeLimit};
use super::yardstick::{emulated_outputs, Yardstick};
use crate::case::{Case, Outputs};
use crate::harness::conditioning::Design;
use crate::harness::tolerance::same_stored;
use ndarray::{Array3, Zip};
use smallseq_reference::ds_scale::DsOperand;
use smallseq_reference::emulate;

/// Elements of one output past the range where the reference is finite and inside it and the
/// emulation holds the same value, set to the reference in place; returns how many.
fn excuse(
    actual: &mut Array3<f64>,
    reference: &Array3<f64>,
    emulated: &Array3<f64>,
    max: f64,
) -> usize {
    let mut n = 0;
    Zip::from(actual)
        .and(reference)
        .and(emulated)
        .for_each(|a, &r, &e| {
            if past_range(*a, max) && r.is_finite() && r.abs() < max && same_stored(*a, e) {
                *a = r;
                n += 1;
            }
        });
    n
}

/// The characterisation of a range limit, when every failing tensor of `actual` is one: the
/// outputs, with the out-of-range elements that an emulation of one design holds too set to the
/// reference, pass the same judge. The designs tried are smallseq's own (the yardstick's
/// emulation) and the common ones that carry dS to 16 bits otherwise (saturated, or rounded
/// plainly: `ds_scale::DsOperand`). None for any other failure (a value no design shares is a
/// defect, whatever its size).
pub fn range_limit(case: &Case, actual: &Outputs, y: &Yardstick) -> Option<String> {
    excused(case, actual, y).map(|l| l.what)
}

/// [`range_limit`] with the excused outputs, which the relations compare in place of the run's
/// own (`relation::relation_verdict`).
pub(super) fn excused(case: &Case, actual: &Outputs, y: &Yardstick) -> Option<RangeLimit> {
    let dt = case.config.dtype;
    let max = f64::from(dt.max_finite());
    if let Some((excused, what)) = excused_by(case, actual, y, &y.emulated) {
        let intermediate = format!("a {dt} intermediate or store passes {max}");
        let because = format!(
            "and smallseq's emulation of its design holds the same values ({intermediate})"
        );
        let what = describe(case, &what, &because);
        return Some(RangeLimit { excused, what });
    }
    let problem = case.problem().ok()?;
    for (design, intermediate) in [
        (
            DsOperand::Saturated,
            format!("dS rounded to {dt} saturates at {max}"),
        ),
        (
            DsOperand::Rounded,
            format!("dS rounded to {dt} overflows past {max}"),
        ),
    ] {
        let (ef, eg) = emulate::forward_backward_with(&problem, dt, design);
        let emulated = emulated_outputs(&ef, eg.as_ref());
        if let Some((excused, what)) = excused_by(case, actual, y, &emulated) {
            let because = format!(
                "and smallseq's emulation of a design that rounds P and dS to {dt} holds the \
                 same values ({intermediate})"
            );
            let what = describe(case, &what, &because);
            return Some(RangeLimit { excused, what });
        }
    }
    if y.design == Design::Envelope {
        return envelope_reach::excused(case, actual, y);
    }
    None
}

/// `actual` with its out-of-range elements that `emulated` holds too set to the reference, and
/// their tensors and counts, when so excused the outputs pass; None otherwise.
fn excused_by(
    case: &Case,
    actual: &Outputs,
    y: &Yardstick,
    emulated: &Outputs,
) -> Option<(Outputs, String)> {
    let max = f64::from(case.config.dtype.max_finite());
    let mut excused = actual.clone();
    let mut counts = Vec::new();
    for (name, a, r, e) in [
        ("o", excused.o.as_mut(), &y.reference.o, &emulated.o),
        ("dq", excused.dq.as_mut(), &y.reference.dq, &emulated.dq),
        ("dk", excused.dk.as_mut(), &y.reference.dk, &emulated.dk),
        ("dv", excused.dv.as_mut(), &y.reference.dv, &emulated.dv),
    ] {
        if let (Some(a), Some(r), Some(e)) = (a, r, e) {
            counts.push((name, excuse(a, r, e, max)));
        }
    }
    let what = excused_passing(case, y, &excused, &counts)?;
    Some((excused, what))
}
