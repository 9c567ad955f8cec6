//! Dropout's relations of `metamorphic` (`docs/semantics.md` §1.8). The mask is keyed by the
//! slot's index, so reversing the slots moves it and is not a relation; a batch split is one
//! once each launch's offset advances by the slots before it (`offset + first · H`, as a
//! framework advances its Philox offset per launch). And `p = 0` is no dropout whatever the
//! seed and offset: bit for bit the run with neither.

use super::checker::{CaseContext, Checker};
use super::relation::bitwise_diff;
use super::verdict::{fail, Outcome, Prop};
use crate::case::Case;
use smallseq_reference::Dropout;

/// Whether the case carries a dropout's seed or offset at `p = 0`: the case of the
/// "`p = 0` is no dropout" relation.
pub(super) fn zero_p_with_seed(case: &Case) -> bool {
    let d = case.config.params.dropout;
    d.p == 0.0 && (d.seed, d.offset) != (0, 0)
}

/// Whether reordering the case's slots changes its mask (every case with an active dropout).
pub(super) fn mask_follows_slots(case: &Case) -> bool {
    case.config.params.dropout.is_active()
}

/// `sub`, the launch of the slots `order` of `case` (contiguous and increasing), given the
/// offset that keeps each slot's mask: the base offset plus `order[0] · H`. `None` where the
/// order is not such a run, whose masks no offset keeps.
pub(super) fn keep_mask(case: &Case, order: &[usize], mut sub: Case) -> Option<Case> {
    if !mask_follows_slots(case) {
        return Some(sub);
    }
    let first = *order.first().unwrap_or(&0);
    if order.iter().enumerate().any(|(j, &i)| i != first + j) {
        return None;
    }
    let p = &mut sub.config.params;
    let shift = (first as u64).wrapping_mul(p.num_heads as u64);
    p.dropout.offset = p.dropout.offset.wrapping_add(shift);
    Some(sub)
}

impl Checker<'_> {
    /// `p = 0` with a seed and an offset against the same case with neither: equal bitwise.
    pub(super) fn dropout_zero_relation(&self, cx: &CaseContext<'_>) -> Outcome {
        let mut plain = cx.case.clone();
        plain.config.params.dropout = Dropout::NONE;
        let p = match self.runner.run_pair(&plain, &self.opts) {
            Ok(p) => p,
            Err(e) => {
                return self.run_failed(Prop::Metamorphic, "the run without dropout failed", &e)
            }
        };
        match bitwise_diff(cx.actual, &p.outputs()) {
            None => Outcome::Pass,
            Some(d) => fail(
                Prop::Metamorphic,
                format!(
                    "dropout p = 0 (seed {}, offset {}) differs from no dropout: {d}",
                    cx.case.config.params.dropout.seed, cx.case.config.params.dropout.offset
                ),
            ),
        }
    }
}
