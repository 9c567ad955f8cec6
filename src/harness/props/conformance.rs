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
//!
//! dQ and dK where dS = P·(dP − D) cancels are not about roundings: a one-ulp change of dS
//! moves a near-zero sum by many of its ulps, and two correct kernels differ there however
//! they round. Nor are o and dV where P's own f32 noise can round it either way and the
//! output cancels (near-tied keys of large logits). Such elements are left out of the count
//! one by one: an element whose noise ([`Undecided`]: the conditioning allowance of dQ and
//! dK, P's rounding noise of o and dV, [`crate::harness::conditioning`]) exceeds half an ulp of its
//! dtype at the emulation's value, or for o and dV reaches a rounding boundary from the
//! emulation's value before its rounding, is not counted (`Count::excluded`), so the rate of
//! the rest, the elements the kernel's roundings decide, is judged on every backend.
use super::checker::{CaseContext, Checker};
use super::verdict::{skip, Failure, Outcome, Prop};
use super::yardstick::Yardstick;
use crate::backend::fallback_rounding_budget_of;
use crate::case::{Case, Outputs};
use crate::harness::conditioning::noise_decides;
use std::borrow::Cow;

/// One tensor's per-element noise, and where known the emulation's value before its rounding
/// to the dtype.
#[derive(Clone, Copy, Debug)]
pub struct Noise<'a> {
    pub noise: &'a ndarray::Array3<f64>,
    pub acc: Option<&'a ndarray::Array3<f64>>,
}

/// Per output tensor, the per-element noise that can decide its roundings (None: nothing left
/// out of that tensor).
#[derive(Clone, Copy, Debug, Default)]
pub struct Undecided<'a> {
    pub o: Option<Noise<'a>>,
    pub dq: Option<Noise<'a>>,
    pub dk: Option<Noise<'a>>,
    pub dv: Option<Noise<'a>>,
}

impl<'a> Undecided<'a> {
    /// The noise of `tensor` (`o`, `dq`, `dk`, `dv`).
    pub fn of(&self, tensor: &str) -> Option<Noise<'a>> {
        match tensor {
            "o" => self.o,
            "dq" => self.dq,
            "dk" => self.dk,
            "dv" => self.dv,
            _ => None,
        }
    }

    /// Whether noise decides the rounding of each element of `tensor`, by its index in
    /// storage order ([`Paired::flat`]); None where the tensor has no noise.
    pub fn decider(&self, tensor: &str, dtype: smallseq_reference::Dtype) -> Option<Decider<'a>> {
        self.of(tensor).map(|n| Decider {
            noise: flat(n.noise),
            acc: n.acc.map(flat),
            dtype,
        })
    }
}

/// One tensor's noise in storage order, to ask element by element whether it decides a
/// rounding ([`noise_decides`]).
pub struct Decider<'a> {
    noise: Cow<'a, [f64]>,
    acc: Option<Cow<'a, [f64]>>,
    dtype: smallseq_reference::Dtype,
}

impl Decider<'_> {
    /// Whether noise decides the rounding of element `i`, whose emulated value is `y`.
    pub fn decides(&self, i: usize, y: f64) -> bool {
        let acc = self.acc.as_ref().and_then(|a| a.get(i).copied());
        self.noise
            .get(i)
            .is_some_and(|&n| noise_decides(n, acc, y, self.dtype))
    }
}

/// `x`'s elements in storage order: borrowed where `x` is in standard layout (the outputs
/// and yardsticks are), else copied.
fn flat(x: &ndarray::Array3<f64>) -> Cow<'_, [f64]> {
    x.as_slice()
        .map_or_else(|| Cow::Owned(x.iter().copied().collect()), Cow::Borrowed)
}

impl Yardstick {
    /// The elements whose rounding f32 noise decides, per tensor, for conformance and bias.
    pub fn undecided(&self) -> Undecided<'_> {
        Undecided {
            o: Some(Noise {
                noise: &self.p_noise.o,
                acc: Some(&self.emulated_acc.0),
            }),
            dq: self.grads.as_ref().map(|g| Noise {
                noise: &g.dq,
                acc: None,
            }),
            dk: self.grads.as_ref().map(|g| Noise {
                noise: &g.dk,
                acc: None,
            }),
            dv: self.p_noise.dv.as_ref().map(|n| Noise {
                noise: n,
                acc: self.emulated_acc.1.as_ref(),
            }),
        }
    }
}

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
    /// Elements left out because noise decides their rounding ([`Undecided`]).
    pub excluded: usize,
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
        self.over_valid(self.actual)
            .zip(self.over_valid(self.emulated))
    }

    /// The elements of `x` (shaped as this tensor) at valid tokens, in storage order.
    pub fn over_valid<'b>(&'b self, x: &'b ndarray::Array3<f64>) -> impl Iterator<Item = f64> + 'b {
        x.outer_iter()
            .zip(&self.valid)
            .filter(|(_, v)| **v)
            .flat_map(|(a, _)| a.into_iter().copied())
    }

    /// The actual and emulated values in storage order, and per valid token the range of its
    /// elements ([`Flat`]): the counting loops index plain slices rather than walk nested iterators
    /// (fallback tensors run to hundreds of thousands of elements a case).
    pub fn flat(&self) -> Flat<'_> {
        let per_token = self.actual.len() / self.actual.shape()[0].max(1);
        let tokens = self
            .valid
            .iter()
            .enumerate()
            .filter(|(_, v)| **v)
            .map(|(t, _)| t * per_token..(t + 1) * per_token)
            .collect();
        (flat(self.actual), flat(self.emulated), tokens)
    }
}

/// A tensor pair's actual and emulated values in storage order, and the element ranges of its
/// valid tokens.
pub type Flat<'a> = (Cow<'a, [f64]>, Cow<'a, [f64]>, Vec<std::ops::Range<usize>>);

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
/// `emulated`, without the elements whose rounding the noise in `undecided` decides (see the
/// module's doc).
pub fn counts(
    case: &Case,
    small: (bool, bool),
    actual: &Outputs,
    emulated: &Outputs,
    undecided: Undecided<'_>,
) -> Vec<Count> {
    let u = case.config.dtype.unit_roundoff();
    // Below the normal range the dtype's spacing is its smallest subnormal, not 2u|y|.
    let tiny = case.config.dtype.smallest_subnormal();
    paired(case, small, actual, emulated)
        .iter()
        .map(|t| {
            let noise = undecided.decider(t.tensor, case.config.dtype);
            let mut c = Count {
                tensor: t.tensor,
                elements: 0,
                off: 0,
                row: t.row,
                excluded: 0,
            };
            let (actual, emulated, tokens) = t.flat();
            for i in tokens.into_iter().flatten() {
                let (x, y) = (actual[i], emulated[i]);
                if noise.as_ref().is_some_and(|n| n.decides(i, y)) {
                    c.excluded += 1;
                    continue;
                }
                let ulp = (2.0 * u * y.abs()).max(tiny);
                let differs = if x.is_finite() && y.is_finite() {
                    (x - y).abs() > ulp * 1.01
                } else {
                    x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan())
                };
                c.elements += 1;
                c.off += usize::from(differs);
            }
            c
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
            range_limit: None,
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

impl Yardstick {
    /// The noise that decides roundings of the fallback emulation's outputs: the gradients'
    /// conditioning allowance (cancelling dS); o and dv keep P in f32 in
    /// [`smallseq_reference::emulate_fallback::FallbackDesign::CPU`], so no P rounding
    /// noise is left out of them.
    pub fn fallback_undecided(&self) -> Undecided<'_> {
        let u = self.undecided();
        Undecided {
            o: None,
            dv: None,
            ..u
        }
    }
}

impl Checker<'_> {
    /// The property: outputs off their path's emulation by more than an ulp, counted against
    /// the backend's rate budgets (small-seq outputs against the kernels' emulation, fallback
    /// outputs against the fallback's where the backend's fallback design is emulated).
    pub(super) fn emulation_conformance(&self, cx: &CaseContext<'_>) -> Outcome {
        let (case, base) = (cx.case, cx.base);
        let name = self.runner.name();
        let small = base.small_seq();
        let small_outcome = if CONFORMANCE_TENSORS
            .iter()
            .all(|t| self.runner.rounding_budget(t).is_none())
        {
            skip("backend roundings not calibrated against the emulation")
        } else if !small.0 {
            skip("not on the small-seq path")
        } else {
            let counts = counts(case, small, cx.actual, &cx.y.emulated, cx.y.undecided());
            judge(&counts, |t| self.runner.rounding_budget(t))
        };
        let on = base.fallback();
        let fallback_outcome = if CONFORMANCE_TENSORS
            .iter()
            .all(|t| fallback_rounding_budget_of(name, t).is_none())
        {
            skip("backend's fallback design not emulated")
        } else if !(on.0 || on.1) {
            skip("not on the fallback path")
        } else {
            match cx.y.fallback(case) {
                Ok(y) => {
                    let counts = counts(case, on, cx.actual, y, cx.y.fallback_undecided());
                    judge(&counts, |t| fallback_rounding_budget_of(name, t))
                }
                Err(e) => skip(format!("fallback emulation not computed: {e}")),
            }
        };
        either_path(small_outcome, fallback_outcome)
    }
}

/// One verdict of a property judged on each path a case took: the worse failure, else a
/// pass where either path was judged, else the small-seq path's reason to skip (the fallback's
/// where the case never reached small-seq).
pub(super) fn either_path(small: Outcome, fallback: Outcome) -> Outcome {
    match (small, fallback) {
        (Outcome::Fail(a), Outcome::Fail(b)) => {
            Outcome::Fail(if b.margin > a.margin { b } else { a })
        }
        (Outcome::Fail(f), _) | (_, Outcome::Fail(f)) => Outcome::Fail(f),
        (Outcome::Pass, _) | (_, Outcome::Pass) => Outcome::Pass,
        (s @ Outcome::Skip { .. }, f @ Outcome::Skip { .. }) => {
            if let Outcome::Skip { reason } = &s {
                if reason == "not on the small-seq path" {
                    return f;
                }
            }
            s
        }
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
            excluded: 0,
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

    #[test]
    fn one_subnormal_spacing_is_one_ulp_and_two_are_more() {
        use crate::case::samples::one_query_two_keys as case;
        let mut c = case(1.0, [0.5, 0.5], [1.0, 2.0], 1.0);
        c.config.dtype = smallseq_reference::Dtype::F16;
        let tiny = c.config.dtype.smallest_subnormal();
        let o = |x: f64| Outputs {
            o: Some(ndarray::Array3::from_elem((1, 1, 1), x)),
            ..Outputs::default()
        };
        let off = |got: f64, emulated: f64| {
            counts(
                &c,
                (true, false),
                &o(got),
                &o(emulated),
                Undecided::default(),
            )[0]
            .off
        };
        assert_eq!(off(tiny, 0.0), 0);
        assert_eq!(off(3.0 * tiny, 2.0 * tiny), 0);
        assert_eq!(off(2.0 * tiny, 0.0), 1);
        assert_eq!(off(1.0 + 4.0 * c.config.dtype.unit_roundoff(), 1.0), 1);
    }

    #[test]
    fn cancelling_gradient_elements_are_left_out_one_by_one_and_the_rest_counted() {
        use crate::case::samples::one_query_two_keys as case;
        let off = |o: &Outputs| Outputs {
            dq: o.dq.as_ref().map(|t| t.mapv(|x| x * 1.5 + 1.0)),
            dk: o.dk.as_ref().map(|t| t.mapv(|x| x * 1.5 + 1.0)),
            ..o.clone()
        };
        let find = |cs: &[Count], t: &str| *cs.iter().find(|c| c.tensor == t).unwrap();
        // dS = ±2^-12 from terms of 1000: every dQ and dK element sits in its f32 noise.
        let c = case(1.0, [0.5, 0.5], [1000.0, 1000.0 + 1.0 / 1024.0], 1.0);
        let y = super::super::yardstick::oracle(&c).unwrap();
        let cs = counts(
            &c,
            (true, true),
            &off(&y.emulated),
            &y.emulated,
            y.undecided(),
        );
        assert_eq!((find(&cs, "dk").excluded, find(&cs, "dk").off), (2, 0));
        assert_eq!((find(&cs, "dq").excluded, find(&cs, "dq").elements), (1, 0));
        // Without the allowances they would count as off.
        let cs = counts(
            &c,
            (true, true),
            &off(&y.emulated),
            &y.emulated,
            Undecided::default(),
        );
        assert_eq!(find(&cs, "dk").off, 2);
        // No cancellation, bf16 (in f32 the f32 noise of any order exceeds half an ulp, so
        // every gradient element is left out): every element counted, the wrong ones off.
        let mut c = case(1.0, [2.0, -1.0], [3.0, -5.0], 1.0);
        c.config.dtype = smallseq_reference::Dtype::Bf16;
        let y = super::super::yardstick::oracle(&c).unwrap();
        let cs = counts(
            &c,
            (true, true),
            &off(&y.emulated),
            &y.emulated,
            y.undecided(),
        );
        for t in ["dq", "dk"] {
            let n = find(&cs, t);
            assert_eq!((n.excluded, n.off), (0, n.elements), "{t}: {n:?}");
        }
        let cs = counts(&c, (true, true), &y.emulated, &y.emulated, y.undecided());
        assert!(cs.iter().all(|c| c.off == 0), "{cs:?}");
    }
}
