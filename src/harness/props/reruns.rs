//! A determinism failure replayed as triage needs it: one run, then reruns into NaN-filled
//! outputs until one differs or the budget is spent. A run-order race shows on some reruns
//! and not on others (an H200 campaign of PyTorch's memory-efficient kernel failed
//! `determinism` on dQ in 10 cases, and one replay of its representative passed), so a
//! single passing replay proves nothing; how many reruns differed, and where, is the evidence.

use super::checker::{CaseContext, Checker};
use super::verdict::Outcome;
use crate::case::{Case, Outputs};
use crate::error::Result;

/// Where one rerun's tensor differs bitwise from the first run's.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorDiff {
    pub tensor: &'static str,
    /// Elements whose bits differ.
    pub elements: usize,
    /// The first of them, in logical order: `dq[1, 0, 3]: 0.5 vs 0.50390625`.
    pub first: String,
}

/// The first rerun that differed from the first run.
#[derive(Clone, Debug)]
pub struct Difference {
    /// Its tensors that differ, in output order.
    pub tensors: Vec<TensorDiff>,
    /// `determinism`'s verdict on it: a failure, or a pass where only outputs the
    /// implementation declares nondeterministic differ, within tolerance.
    pub verdict: Outcome,
}

/// What [`Checker::rerun_determinism`] saw.
#[derive(Clone, Debug)]
pub struct Reruns {
    /// Reruns made; the last is the one that differed, where one did.
    pub made: usize,
    /// The most it would have made.
    pub limit: usize,
    pub difference: Option<Difference>,
}

impl Reruns {
    /// How many reruns differed: reruns stop at the first difference, so 0 or 1.
    pub fn differed(&self) -> usize {
        usize::from(self.difference.is_some())
    }
}

impl Checker<'_> {
    /// Runs `case` once, then reruns it into NaN-filled outputs, as `determinism` does, up to
    /// `limit` times, stopping at the first rerun whose bits differ from the first run.
    ///
    /// # Errors
    /// A run that fails, or a case the reference cannot judge: nothing to compare.
    pub fn rerun_determinism(&self, case: &Case, limit: usize) -> Result<Reruns> {
        let base = self.runner.run_pair(case, &self.opts)?;
        let actual = base.outputs();
        let (y, _, judgements) = self.judge_base(case, &base, &actual)?;
        let cx = CaseContext {
            case,
            base: &base,
            actual: &actual,
            y: &y,
            judgements: &judgements,
            salt: 0,
        };
        let opts = self.poisoned();
        for made in 1..=limit {
            let again = self.runner.run_pair(case, &opts)?.outputs();
            let tensors = tensor_diffs(&actual, &again);
            if !tensors.is_empty() {
                let verdict = self.rerun_verdict(&cx, &again);
                return Ok(Reruns {
                    made,
                    limit,
                    difference: Some(Difference { tensors, verdict }),
                });
            }
        }
        Ok(Reruns {
            made: limit,
            limit,
            difference: None,
        })
    }
}

/// Every output tensor (`o`, `lse`, `dq`, `dk`, `dv`) whose bits differ between `a` and `b`,
/// with how many elements differ and the first of them.
pub fn tensor_diffs(a: &Outputs, b: &Outputs) -> Vec<TensorDiff> {
    fn diff<D: ndarray::Dimension>(
        tensor: &'static str,
        x: &Option<ndarray::Array<f64, D>>,
        y: &Option<ndarray::Array<f64, D>>,
    ) -> Option<TensorDiff> {
        // Dynamic views: one walk for 2-D lse and the 3-D tensors, with printable indices.
        let (x, y) = (x.as_ref()?.view().into_dyn(), y.as_ref()?.view().into_dyn());
        let bits = |i: &ndarray::IxDyn| y.get(i.clone()).map(|w| w.to_bits());
        let mut differ = x
            .indexed_iter()
            .filter(|(i, v)| bits(i) != Some(v.to_bits()));
        let (i, v) = differ.next()?;
        let w = y.get(i.clone()).copied().unwrap_or(f64::NAN);
        let at: Vec<String> = (ndarray::Dimension::slice(&i).iter())
            .map(usize::to_string)
            .collect();
        Some(TensorDiff {
            tensor,
            elements: 1 + differ.count(),
            first: format!("{tensor}[{}]: {v} vs {w}", at.join(", ")),
        })
    }
    [
        diff("o", &a.o, &b.o),
        diff("lse", &a.lse, &b.lse),
        diff("dq", &a.dq, &b.dq),
        diff("dk", &a.dk, &b.dk),
        diff("dv", &a.dv, &b.dv),
    ]
    .into_iter()
    .flatten()
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array2, Array3};

    #[test]
    fn every_differing_tensor_is_counted_in_output_order() {
        let t = || {
            Some(Array3::from_shape_fn((2, 1, 3), |(a, _, c)| {
                (a * 3 + c) as f64
            }))
        };
        let a = Outputs {
            o: t(),
            lse: Some(Array2::zeros((2, 1))),
            dq: t(),
            dv: t(),
            ..Outputs::default()
        };
        assert!(tensor_diffs(&a, &a).is_empty());
        let mut b = a.clone();
        b.dv.as_mut().unwrap()[(1, 0, 2)] = -0.0 * 5.0;
        b.dv.as_mut().unwrap()[(0, 0, 1)] = f64::NAN;
        b.lse.as_mut().unwrap()[(1, 0)] = -0.0;
        let d = tensor_diffs(&a, &b);
        let names: Vec<_> = d.iter().map(|d| (d.tensor, d.elements)).collect();
        assert_eq!(names, [("lse", 1), ("dv", 2)]);
        assert_eq!(d[1].first, "dv[0, 0, 1]: 1 vs NaN");
        assert_eq!(d[0].first, "lse[1, 0]: 0 vs -0");
    }
}
