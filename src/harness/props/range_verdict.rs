//! What a range limit is made of, shared by the designs' rules (`range_limit.rs` for the
//! emulated designs, `envelope_reach.rs` for an undeclared one): the test of a value past the
//! range, the excused outputs, and the verdict's sentence.

use super::yardstick::Yardstick;
use crate::case::{Case, Outputs};
use ndarray::Array3;

/// Whether `x` lies past the range of a dtype whose largest finite value is `max`.
pub(super) fn past_range(x: f64, max: f64) -> bool {
    !x.is_finite() || x.abs() >= max
}

/// One run's range limit: its outputs with the elements the design's range takes set to the
/// reference, and what overflows from what inputs.
pub(super) struct RangeLimit {
    pub excused: Outputs,
    pub what: String,
}

/// What one design's rule excused, as the verdict names it (`dq at 64 element(s), …`): `None`
/// when nothing was excused or the excused outputs still fail the judge (then the failure is
/// no range limit of that design).
pub(super) fn excused_passing(
    case: &Case,
    y: &Yardstick,
    excused: &Outputs,
    counts: &[(&str, usize)],
) -> Option<String> {
    let named: Vec<String> = counts
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| format!("{name} at {n} element(s)"))
        .collect();
    if named.is_empty() || y.judge(case, excused, true).iter().any(|j| !j.passed()) {
        return None;
    }
    Some(named.join(", "))
}

/// The verdict's sentence: what lies past the range, why a design loses it (`because`: which
/// design's emulation holds it, or which intermediate reaches the edge), and the input
/// magnitudes that took it there, over the tokens the layout holds (padding may carry
/// anything, infinities included).
pub(super) fn describe(case: &Case, what: &str, because: &str) -> String {
    let l = &case.layout;
    let largest = |x: &Array3<f32>, seq: &smallseq_reference::Side| {
        (0..l.slots())
            .flat_map(|s| seq.offset(s)..seq.offset(s) + seq.len(s))
            .map(|t| {
                x.slice(ndarray::s![t, .., ..])
                    .fold(0.0f32, |m, v| m.max(v.abs()))
            })
            .fold(0.0f32, f32::max)
    };
    let mut inputs = vec![
        format!("|q| {}", largest(&case.q, &l.q)),
        format!("|k| {}", largest(&case.k, &l.kv)),
        format!("|v| {}", largest(&case.v, &l.kv)),
    ];
    if let Some(d_o) = &case.d_o {
        inputs.push(format!("|dO| {}", largest(d_o, &l.q)));
    }
    let dt = case.config.dtype;
    format!(
        "range limit of a 16-bit design, not a defect: {what} past the {dt} range where the \
         f64 reference is finite, {because}; inputs up to {}",
        inputs.join(", ")
    )
}
