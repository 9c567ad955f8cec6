//! `dont_care`: outputs on padding tokens are exactly 0 (lse -inf), and valid outputs do not
//! move when the don't-care inputs are poisoned again with other values. A kernel that reads
//! past a slot's valid tokens shows here before its error is large enough for the tolerance.

use super::checker::{CaseContext, Checker};
use super::relation::{bitwise_diff, mask_dont_care};
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
                mask_dont_care(case, &mut other, actual);
                match bitwise_diff(actual, &other) {
                    None => Outcome::Pass,
                    Some(d) => fail(
                        Prop::DontCare,
                        format!("valid output changed when don't-care inputs changed: {d}"),
                    ),
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
