//! `determinism`: a rerun into outputs poisoned with NaN gives the same bits. A kernel that
//! leaves an element unwritten, or sums in a run-dependent order, differs here even when both
//! runs are within tolerance.

use super::checker::{CaseContext, Checker};
use super::relation::bitwise_diff;
use super::verdict::{fail, Outcome, Prop};
use crate::wrapper::RunOptions;

impl Checker<'_> {
    pub(super) fn determinism(&self, cx: &CaseContext<'_>) -> Outcome {
        let opts = RunOptions {
            fill: f32::NAN,
            ..self.opts.clone()
        };
        match self.runner.run_pair(cx.case, &opts) {
            Err(e) => self.run_failed(Prop::Determinism, "rerun failed", &e),
            Ok(p) => match bitwise_diff(cx.actual, &p.outputs()) {
                None => Outcome::Pass,
                Some(d) => fail(
                    Prop::Determinism,
                    format!("rerun into poisoned outputs differs: {d}"),
                ),
            },
        }
    }
}
