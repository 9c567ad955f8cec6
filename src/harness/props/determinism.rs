//! `determinism`: a rerun into outputs poisoned with NaN gives the same bits. A kernel that
//! leaves an element unwritten, or sums in a run-dependent order, differs here even when both
//! runs are within tolerance.
//!
//! An implementation may declare outputs not bitwise deterministic (`caps.nondeterministic`):
//! PyTorch's memory-efficient backward splits the keys over thread blocks and adds their
//! partial dQ into one f32 accumulator in the order the blocks take its lock
//! (`aten/src/ATen/native/transformers/cuda/attention_backward.cu`, `num_splits_key`; it warns
//! "Memory Efficient attention defaults to a non-deterministic algorithm" under
//! `torch.use_deterministic_algorithms(True, warn_only=True)`, pytorch/pytorch#101847, and is
//! kept out of the strict deterministic mode since pytorch/pytorch#91979). Its dQ differs in
//! the last bits from run to run by design, which a bitwise rule would report on every such
//! case. A declared output's rerun is held to `numeric_agreement`'s tolerance instead (no
//! worse than the first run where that one already failed it); the undeclared outputs keep
//! the bitwise rule, and an implementation that declares nothing is judged exactly as before.

use super::checker::{CaseContext, Checker};
use super::relation::bitwise_diff;
use super::verdict::{fail, Failure, Outcome, Prop};
use crate::case::Outputs;
use crate::wrapper::RunOptions;

impl Checker<'_> {
    pub(super) fn determinism(&self, cx: &CaseContext<'_>) -> Outcome {
        match self.runner.run_pair(cx.case, &self.poisoned()) {
            Err(e) => self.run_failed(Prop::Determinism, "rerun failed", &e),
            Ok(p) => self.rerun_verdict(cx, &p.outputs()),
        }
    }

    /// The options of a determinism rerun: every output element NaN before the launch.
    pub(super) fn poisoned(&self) -> RunOptions {
        RunOptions {
            fill: f32::NAN,
            ..self.opts.clone()
        }
    }

    /// `determinism`'s verdict on `again`, a rerun of `cx`'s case: bitwise equal to the first
    /// run, except for the outputs the runner declares nondeterministic, which must stay
    /// within tolerance.
    pub(super) fn rerun_verdict(&self, cx: &CaseContext<'_>, again: &Outputs) -> Outcome {
        let caps = self.runner.caps();
        if caps.nondeterministic.is_empty() {
            return match bitwise_diff(cx.actual, again) {
                None => Outcome::Pass,
                Some(d) => fail(
                    Prop::Determinism,
                    format!("rerun into poisoned outputs differs: {d}"),
                ),
            };
        }
        let declared = |t: &str| caps.declares_nondeterministic(t);
        let named = caps.nondeterministic.join(", ");
        if let Some(d) = self.repeat_diff(cx.actual, again) {
            return fail(
                Prop::Determinism,
                format!(
                    "rerun into poisoned outputs differs: {d} (not declared nondeterministic; \
                     the declared {named} held to tolerance instead)"
                ),
            );
        }
        let loose = |o: &Outputs| keep(o, declared);
        if bitwise_diff(&loose(cx.actual), &loose(again)).is_none() {
            return Outcome::Pass;
        }
        self.declared_within_tolerance(cx, again, &named)
    }

    /// [`bitwise_diff`] over the outputs the runner does not declare nondeterministic: the
    /// comparison of two runs that should repeat their bits. `dont_care` uses it too, else a
    /// declared dQ that moved between its re-poisoned run and its plain rerun would be blamed
    /// on don't-care tokens (the H200 efficient-kernel campaigns' `dont_care` failures beside
    /// their `determinism` ones).
    pub(super) fn repeat_diff(&self, a: &Outputs, b: &Outputs) -> Option<String> {
        let caps = self.runner.caps();
        if caps.nondeterministic.is_empty() {
            return bitwise_diff(a, b);
        }
        let exact = |o: &Outputs| keep(o, |t| !caps.declares_nondeterministic(t));
        bitwise_diff(&exact(a), &exact(b))
    }

    /// The declared outputs of `again` judged by `numeric_agreement`: each within its
    /// threshold, or, where the first run already failed it (a failure reported there), no
    /// farther out than that run.
    fn declared_within_tolerance(
        &self,
        cx: &CaseContext<'_>,
        again: &Outputs,
        named: &str,
    ) -> Outcome {
        let caps = self.runner.caps();
        let as_declared = self.no_key_rows_as_declared(cx.case, again);
        let js =
            cx.y.judge(cx.case, as_declared.as_ref().unwrap_or(again), true);
        for j in js
            .iter()
            .filter(|j| caps.declares_nondeterministic(&j.tensor))
        {
            // Not judged in the first run (rows without keys declared other than zeros):
            // nothing to hold the rerun to.
            let Some(first) = cx.judgements.iter().find(|f| f.tensor == j.tensor) else {
                continue;
            };
            let allowed = first.margin.max(1.0);
            if j.margin > allowed {
                return Outcome::Fail(Failure {
                    prop: Prop::Determinism,
                    detail: format!(
                        "rerun into poisoned outputs: {t}, declared nondeterministic ({named}), \
                         leaves the tolerance: margin {m:.3} > {allowed:.3} (max error {e:.3e}, \
                         threshold {th:.3e}; the first run's margin {f:.3})",
                        t = j.tensor,
                        m = j.margin,
                        e = j.err,
                        th = j.threshold,
                        f = first.margin,
                    ),
                    worst: j.worst.clone(),
                    margin: j.margin / allowed,
                    range_limit: None,
                });
            }
        }
        Outcome::Pass
    }
}

/// `out` with only the tensors `pick` names; the others absent, so comparisons skip them.
pub(super) fn keep(out: &Outputs, pick: impl Fn(&str) -> bool) -> Outputs {
    let take3 = |name: &str, t: &Option<ndarray::Array3<f64>>| t.clone().filter(|_| pick(name));
    Outputs {
        o: take3("o", &out.o),
        lse: out.lse.clone().filter(|_| pick("lse")),
        dq: take3("dq", &out.dq),
        dk: take3("dk", &out.dk),
        dv: take3("dv", &out.dv),
        dbias: out.dbias.clone().filter(|_| pick("dbias")),
    }
}
