//! `dont_care`: outputs on padding tokens are exactly 0 (lse -inf), and valid outputs do not
//! move when the don't-care inputs are poisoned again with other values. A kernel that reads
//! past a slot's valid tokens shows here before its error is large enough for the tolerance.

use super::checker::{CaseContext, Checker};
use super::relation::mask_dont_care;
use super::verdict::{fail, skip, Outcome, Prop};
use crate::case::{Case, Outputs};
use crate::harness::gen::{dont_care_rows, poison};
use crate::harness::rng::Rng;

impl Checker<'_> {
    pub(super) fn dont_care(&self, cx: &CaseContext<'_>) -> Outcome {
        let (case, actual) = (cx.case, cx.actual);
        let (rq, rk) = dont_care_rows(case);
        if let Some(msg) = dont_care_outputs(case, actual) {
            return fail(Prop::DontCare, msg);
        }
        if rq.is_empty() && rk.is_empty() {
            return skip("no don't-care tokens");
        }
        let mut repoisoned = case.clone();
        poison(&mut repoisoned, &mut Rng::new(cx.salt ^ 0xd0_c0de));
        match self.runner.run_pair(&repoisoned, &self.opts) {
            Err(e) => self.run_failed(Prop::DontCare, "re-poisoned run failed", &e),
            Ok(p) => {
                let mut other = p.outputs();
                // Only valid outputs must be unchanged; don't-care outputs were checked above.
                // Outputs declared nondeterministic repeat no bits to compare: numeric_agreement
                // judges them on the poisoned base run, determinism on its rerun.
                mask_dont_care(case, &mut other, actual);
                match self.repeat_diff(actual, &other) {
                    None => Outcome::Pass,
                    Some(d) => self.blame_dont_care(case, actual, d),
                }
            }
        }
    }
}

impl Checker<'_> {
    /// The re-poisoned rerun differed (`diff`). That rerun is also just the next call: a
    /// backend whose reruns differ in the last bit would be named here first, with a cause
    /// (don't-care inputs) it does not have. So the same inputs run once more; when that
    /// plain rerun differs too, the failure is determinism's, which judges it next.
    fn blame_dont_care(&self, case: &Case, actual: &Outputs, diff: String) -> Outcome {
        match self.runner.run_pair(case, &self.opts) {
            Err(e) => self.run_failed(Prop::DontCare, "plain rerun failed", &e),
            Ok(p) => {
                let mut again = p.outputs();
                mask_dont_care(case, &mut again, actual);
                if self.repeat_diff(actual, &again).is_some() {
                    skip(
                        "reruns of the same inputs differ: non-determinism, judged by \
                         determinism",
                    )
                } else {
                    fail(
                        Prop::DontCare,
                        format!("valid output changed when don't-care inputs changed: {diff}"),
                    )
                }
            }
        }
    }
}

/// Don't-care outputs must be exactly 0 (lse -inf). (A NaN among valid outputs is
/// numeric_agreement's: it counts as an infinite error.)
pub fn dont_care_outputs(case: &Case, actual: &Outputs) -> Option<String> {
    let vq = case.layout.q.valid_tokens();
    let vk = case.layout.kv.valid_tokens();
    let check3 = |name: &str, t: &Option<ndarray::Array3<f64>>, valid: &[bool]| -> Option<String> {
        let t = t.as_ref()?;
        t.indexed_iter().find_map(|((tok, h, d), &x)| {
            (!valid[tok] && x.to_bits() != 0f64.to_bits()).then(|| {
                format!("{name}[{tok}, {h}, {d}] = {x} on a don't-care token (expected 0)")
            })
        })
    };
    check3("o", &actual.o, &vq)
        .or_else(|| {
            actual.lse.as_ref().and_then(|t| {
                t.indexed_iter().find_map(|((tok, h), &x)| {
                    (!vq[tok] && x != f64::NEG_INFINITY).then(|| {
                        format!("lse[{tok}, {h}] = {x} on a don't-care token (expected -inf)")
                    })
                })
            })
        })
        .or_else(|| check3("dq", &actual.dq, &vq))
        .or_else(|| check3("dk", &actual.dk, &vk))
        .or_else(|| check3("dv", &actual.dv, &vk))
}

#[cfg(test)]
mod tests {
    use super::super::test_backends::{bf16_case, HookedCpu};
    use super::*;
    use crate::config::AttnConfig;
    use crate::dispatch::Path;
    use smallseq_reference::{Dtype, Layout, Mask};
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A backend whose every call moves one output by one more bf16 ulp (a run-dependent sum
    /// order) is non-deterministic, and must not be named as reading don't-care tokens.
    #[test]
    fn reruns_that_differ_by_themselves_are_determinisms_not_dont_cares() {
        // 20 tokens: the fallback path, whose outputs the stand-in edits; 3 tail tokens of
        // each buffer are don't-care.
        let mut layout = Layout::packed(&[(20, 20)]);
        layout.q.tokens = 23;
        layout.kv.tokens = 23;
        let case = bf16_case(
            AttnConfig::new(Dtype::Bf16, 1, 64, Mask::Padding),
            layout,
            5,
        );
        let mut be = HookedCpu::new();
        let calls = AtomicU32::new(0);
        be.after_fwd = Box::new(move |_, out| {
            let n = calls.fetch_add(1, Ordering::Relaxed) + 1;
            let x = &mut out.o.body_mut()[0];
            *x = f32::from_bits(x.to_bits() + (n << 16));
        });
        let checker = Checker::isolated(&be);
        let run = checker.check(&case, 0).unwrap();
        assert_eq!(run.path_fwd, Some(Path::Fallback));
        let outcome = |p: Prop| run.outcomes.iter().find(|(q, _)| *q == p).map(|(_, o)| o);
        assert!(
            !matches!(outcome(Prop::DontCare), Some(Outcome::Fail(_))),
            "{:?}",
            outcome(Prop::DontCare)
        );
        assert!(
            matches!(outcome(Prop::Determinism), Some(Outcome::Fail(_))),
            "{:?}",
            run.outcomes
        );
    }
}
