//! Conformance of the small-seq path's outputs to the device-faithful emulation (the
//! `emulation_conformance` property, `smallseq calibrate`, and the re-judging of a capsule's
//! stored outputs).
//!
//! Error bounds cannot tell a kernel that skips a rounding of the spec (P to the input dtype
//! before P·V) from one that performs it: the skipping kernel is more accurate. What gives it
//! away is how often its outputs land on a different representable value than the
//! emulation's, by more than the one ulp a summation-order difference can cause.
//!
//! A legitimate difference is granular: where the device's `exp` and the emulation's differ by
//! an f32 ulp, a P near a rounding boundary of the input dtype rounds the other way, and that
//! one P moves a whole row of O (and of dV) by `ulp(P)·|V|`, which is many ulps of an output
//! that cancels. So the count allowed is the backend's rate budget of the elements, but never
//! less than one row: a small case with one flipped P passes, a kernel that skips the rounding
//! (most elements off) does not.

use super::props::{Failure, Outcome, Prop};
use crate::case::{Case, Outputs};

/// Fewest valid elements of a tensor for the conformance rate to be judged.
pub const MIN_CONFORMANCE_ELEMENTS: usize = 256;
/// Fewest rows of a tensor for the conformance rate to be judged: the allowance is at least one
/// row, so with fewer rows it would forgive a quarter of the tensor or more.
pub const MIN_CONFORMANCE_ROWS: usize = 4;
/// The outputs whose conformance to the emulation is counted, each with its own budget
/// ([`crate::backend::Backend::rounding_budget`]).
pub const CONFORMANCE_TENSORS: [&str; 4] = ["o", "dq", "dk", "dv"];

/// One output tensor's count: valid elements, those more than one ulp of the dtype from the
/// emulation's value, and its row length (the elements one flipped P can move).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Count {
    pub tensor: &'static str,
    pub elements: usize,
    pub off: usize,
    pub row: usize,
}

impl Count {
    /// The off-by-more-than-an-ulp elements allowed at rate budget `budget`; None where the
    /// tensor is too small for a rate to mean anything.
    pub fn allowance(&self, budget: f64) -> Option<f64> {
        self.judged()
            .then(|| (budget * self.elements as f64).max(self.row as f64))
    }

    /// `off` over the [`Count::allowance`] at `budget` (above 1 fails the property); None
    /// where the tensor is not judged.
    pub fn margin(&self, budget: f64) -> Option<f64> {
        self.allowance(budget).map(|a| self.off as f64 / a)
    }

    /// Whether the tensor has enough elements and rows for a rate.
    pub fn judged(&self) -> bool {
        self.elements >= MIN_CONFORMANCE_ELEMENTS
            && self.elements >= MIN_CONFORMANCE_ROWS * self.row
    }

    /// The fraction of elements off.
    pub fn rate(&self) -> f64 {
        self.off as f64 / self.elements.max(1) as f64
    }
}

/// One output tensor of the small-seq path beside its emulation: the kernel's and the
/// emulation's values, which tokens are valid, and the row length.
pub struct Paired<'a> {
    pub tensor: &'static str,
    pub actual: &'a ndarray::Array3<f64>,
    pub emulated: &'a ndarray::Array3<f64>,
    pub valid: Vec<bool>,
    pub row: usize,
}

impl Paired<'_> {
    /// `(actual, emulated)` of every valid element, in storage order (rows contiguous).
    pub fn pairs(&self) -> impl Iterator<Item = (f64, f64)> + '_ {
        self.actual
            .outer_iter()
            .zip(self.emulated.outer_iter())
            .zip(&self.valid)
            .filter(|(_, v)| **v)
            .flat_map(|((a, e), _)| a.into_iter().copied().zip(e.into_iter().copied()))
    }
}

/// The output tensors the small-seq path computed (`fwd_small`: o; `bwd_small`: dq, dk, dv),
/// each paired with the emulation's.
pub fn paired<'a>(
    case: &Case,
    (fwd_small, bwd_small): (bool, bool),
    actual: &'a Outputs,
    emulated: &'a Outputs,
) -> Vec<Paired<'a>> {
    let vq = case.layout.q.valid_tokens();
    let vk = case.layout.kv.valid_tokens();
    let (dqk, dv) = (
        case.config.params.head_dim_qk,
        case.config.params.head_dim_v,
    );
    let tensors = [
        ("o", &actual.o, &emulated.o, &vq, fwd_small, dv),
        ("dq", &actual.dq, &emulated.dq, &vq, bwd_small, dqk),
        ("dk", &actual.dk, &emulated.dk, &vk, bwd_small, dqk),
        ("dv", &actual.dv, &emulated.dv, &vk, bwd_small, dv),
    ];
    tensors
        .into_iter()
        .filter_map(|(tensor, a, e, valid, on_path, row)| {
            let (Some(actual), Some(emulated), true) = (a.as_ref(), e.as_ref(), on_path) else {
                return None;
            };
            Some(Paired {
                tensor,
                actual,
                emulated,
                valid: valid.clone(),
                row,
            })
        })
        .collect()
}

/// Per output tensor the small-seq path computed, the [`Count`] of `actual` against
/// `emulated`.
pub fn counts(
    case: &Case,
    small: (bool, bool),
    actual: &Outputs,
    emulated: &Outputs,
) -> Vec<Count> {
    let u = case.config.dtype.unit_roundoff();
    paired(case, small, actual, emulated)
        .iter()
        .map(|t| {
            let (elements, off) = t.pairs().fold((0usize, 0usize), |(n, off), (x, y)| {
                let ulp = 2.0 * u * y.abs();
                let differs = if x.is_finite() && y.is_finite() {
                    (x - y).abs() > ulp * 1.01
                } else {
                    x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan())
                };
                (n + 1, off + usize::from(differs))
            });
            Count {
                tensor: t.tensor,
                elements,
                off,
                row: t.row,
            }
        })
        .collect()
}

/// The property's verdict on `counts` under the per-tensor rate budgets `budget` (None: that
/// tensor is not judged).
pub fn judge(counts: &[Count], budget: impl Fn(&str) -> Option<f64>) -> Outcome {
    let (mut budgeted, mut judged) = (false, false);
    let mut worst: Option<(f64, String)> = None;
    for c in counts {
        let Some(b) = budget(c.tensor) else {
            continue;
        };
        budgeted = true;
        let Some(allowed) = c.allowance(b) else {
            continue;
        };
        judged = true;
        let margin = c.off as f64 / allowed;
        if margin > 1.0 && worst.as_ref().is_none_or(|(m, _)| margin > *m) {
            worst = Some((
                margin,
                format!(
                    "{}: {} of {} elements ({:.1}%) differ from the emulation by more than one \
                     ulp (allowed {allowed:.0}: budget {:.1}%, at least one row of {})",
                    c.tensor,
                    c.off,
                    c.elements,
                    100.0 * c.rate(),
                    100.0 * b,
                    c.row
                ),
            ));
        }
    }
    match worst {
        Some((margin, detail)) => Outcome::Fail(Failure {
            prop: Prop::EmulationConformance,
            detail,
            worst: None,
            margin,
        }),
        None if judged => Outcome::Pass,
        None => Outcome::Skip {
            reason: if counts.is_empty() {
                "no outputs of the small-seq path to judge"
            } else if budgeted {
                "too few elements or rows for a rate"
            } else {
                "no rounding budget for these tensors on this backend"
            }
            .into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(elements: usize, off: usize, row: usize) -> Count {
        Count {
            tensor: "o",
            elements,
            off,
            row,
        }
    }

    #[test]
    fn one_flipped_row_is_allowed_in_a_small_case_and_a_skipped_rounding_is_not() {
        let budget = |_: &str| Some(0.02);
        // H200 fuzz seed 2027, case 13145: 5 rows of 64, one P flipped, 10 elements off.
        assert_eq!(judge(&[count(320, 10, 64)], budget), Outcome::Pass);
        // A kernel that skips the rounding moves most elements.
        assert!(matches!(
            judge(&[count(320, 150, 64)], budget),
            Outcome::Fail(f) if f.margin > 2.0 && f.detail.contains("allowed 64")
        ));
        // Large cases are held to the rate.
        assert_eq!(judge(&[count(100_000, 2_000, 64)], budget), Outcome::Pass);
        assert!(matches!(
            judge(&[count(100_000, 2_100, 64)], budget),
            Outcome::Fail(_)
        ));
    }

    #[test]
    fn too_few_elements_or_rows_and_unjudged_tensors_skip() {
        let budget = |_: &str| Some(0.02);
        assert!(matches!(
            judge(&[count(255, 200, 1)], budget),
            Outcome::Skip { .. }
        ));
        assert!(matches!(
            judge(&[count(768, 700, 256)], budget),
            Outcome::Skip { .. }
        ));
        assert!(matches!(
            judge(&[count(100_000, 90_000, 64)], |_| None),
            Outcome::Skip { reason } if reason.contains("no rounding budget")
        ));
        assert!(matches!(
            judge(&[], budget),
            Outcome::Skip { reason } if reason.contains("no outputs")
        ));
        assert_eq!(count(1024, 0, 256).allowance(0.02), Some(256.0));
    }
}
