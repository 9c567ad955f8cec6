//! Shrinking a failing case: drop slots, shorten slots, reduce heads keeping H/Hkv, then
//! simplify the data — accepting each step only while the same property still fails with
//! margin >= 2 (exact properties fail with an infinite margin), and as a defect: a range
//! limit is no smaller form of a defect (a CPU flash campaign's dQ off by 65 % of its row
//! shrank into a case whose only failure was dQ past f16's range, and triage then called
//! the group a range limit).

use super::props::{Checker, Failure, Prop};
use super::transform::{reduce_heads, select_slots, shorten_slot};
use crate::case::Case;
use crate::segments::{self, Segmented};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Minimum margin a shrunk case must keep.
pub const MIN_MARGIN: f64 = 2.0;

/// Whether `case` still fails `prop` clearly enough, as a defect (not a range limit).
fn still_fails(checker: &Checker, case: &Case, prop: Prop) -> bool {
    if case.validate().is_err() {
        return false;
    }
    checker
        .check(case, 0)
        .is_ok_and(|run| run.failures().iter().any(|f| keeps(f, prop)))
}

/// Whether failure `f` keeps a shrink step: `prop`, a defect, margin at least [`MIN_MARGIN`].
/// An undefined margin (an infinite error over an infinite threshold) still fails.
fn keeps(f: &Failure, prop: Prop) -> bool {
    f.prop == prop && f.is_defect() && (f.margin >= MIN_MARGIN || f.margin.is_nan())
}

/// Candidate simplifications of `case`, most aggressive first.
fn candidates(case: &Case) -> Vec<Case> {
    let mut out = Vec::new();
    let b = case.layout.slots();
    // Keep only one slot, then drop one slot at a time.
    if b > 1 {
        for i in 0..b {
            out.push(select_slots(case, &[i], true).0);
        }
        for i in 0..b {
            let order: Vec<usize> = (0..b).filter(|&j| j != i).collect();
            out.push(select_slots(case, &order, true).0);
        }
    }
    let p = &case.config.params;
    let g = p.group_size();
    for heads in [g, p.num_heads / 2] {
        out.extend(reduce_heads(case, heads));
    }
    for i in 0..b {
        out.extend(shorten_slot(case, i, true));
        out.extend(shorten_slot(case, i, false));
    }
    // Data: round valid inputs to integers (exact in every dtype), then zero q.
    let mut ints = case.clone();
    let dt = case.config.dtype;
    for t in [&mut ints.q, &mut ints.k, &mut ints.v] {
        t.mapv_inplace(|x| {
            if x.is_finite() {
                dt.round(x.round())
            } else {
                x
            }
        });
    }
    if let Some(d) = ints.d_o.as_mut() {
        d.mapv_inplace(|x| {
            if x.is_finite() {
                dt.round(x.round())
            } else {
                x
            }
        });
    }
    out.push(ints);
    // Ids that no longer describe a candidate's layout are ignored at launch; dropped here,
    // so a shrunk capsule does not claim a conversion its launch did not run.
    for c in &mut out {
        let stale = c
            .meta
            .get(segments::META_KEY)
            .and_then(|t| Segmented::from_meta(t).ok())
            .is_some_and(|s| !s.describes(&c.layout));
        if stale {
            c.meta.remove(segments::META_KEY);
        }
    }
    out
}

/// Shrinks `case` (which fails `prop`) within `budget`, or until `stop` is set (Ctrl-C: the
/// campaign still writes its report). Returns the smallest failing case found and the number
/// of accepted steps.
pub fn shrink(
    checker: &Checker,
    case: &Case,
    prop: Prop,
    budget: Duration,
    stop: &AtomicBool,
) -> (Case, usize) {
    shrink_capped(checker, case, prop, budget, usize::MAX, stop)
}

/// [`shrink`] that also stops after `max_reruns` candidate runs: a worker's case can take
/// seconds, and `smallseq triage` shares one device call between many groups.
pub fn shrink_capped(
    checker: &Checker,
    case: &Case,
    prop: Prop,
    budget: Duration,
    max_reruns: usize,
    stop: &AtomicBool,
) -> (Case, usize) {
    let start = Instant::now();
    let reruns = std::cell::Cell::new(0usize);
    let over =
        || start.elapsed() >= budget || reruns.get() >= max_reruns || stop.load(Ordering::SeqCst);
    let mut best = case.clone();
    let mut steps = 0;
    'outer: while !over() {
        for cand in candidates(&best) {
            if over() {
                break 'outer;
            }
            if size(&cand) <= size(&best) && cand_differs(&cand, &best) && {
                reruns.set(reruns.get() + 1);
                still_fails(checker, &cand, prop)
            } {
                best = cand;
                steps += 1;
                continue 'outer;
            }
        }
        break;
    }
    (best, steps)
}

/// (slots, tokens, heads, non-integer values): smaller is simpler.
fn size(c: &Case) -> (usize, usize, usize, usize) {
    let frac =
        c.q.iter()
            .chain(c.k.iter())
            .chain(c.v.iter())
            .filter(|x| x.fract() != 0.0)
            .count();
    (
        c.layout.slots(),
        c.layout.q.tokens + c.layout.kv.tokens,
        c.config.params.num_heads,
        frac,
    )
}

fn cand_differs(a: &Case, b: &Case) -> bool {
    size(a) != size(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::harness::gen::{build, draw_geometry};
    use crate::harness::rng::Rng;
    use crate::mutants::{Defects, Mutant};

    /// The first generated case of more than one slot that a planted bug fails.
    fn failing_case(checker: &Checker) -> (Case, Prop) {
        for seed in 0..500u64 {
            let g = draw_geometry(&mut Rng::new(seed));
            let case = build(&g, seed).expect("generated case");
            if case.layout.slots() < 2 {
                continue;
            }
            if let Some(f) = checker.check(&case, 0).expect("check").failures().first() {
                return (case, f.prop);
            }
        }
        panic!("the planted bug failed no case of 500");
    }

    /// A defect shrinks only into a defect: the same property's range limit, however large
    /// its margin, is another finding.
    #[test]
    fn a_range_limit_keeps_no_shrink_step_of_a_defect() {
        let failure = |margin: f64, range_limit: Option<&str>| Failure {
            prop: Prop::NumericAgreement,
            detail: "dq: max error inf > threshold 1.976e2".into(),
            worst: None,
            margin,
            range_limit: range_limit.map(String::from),
        };
        let prop = Prop::NumericAgreement;
        assert!(keeps(&failure(f64::INFINITY, None), prop));
        assert!(keeps(&failure(f64::NAN, None), prop));
        assert!(!keeps(&failure(1.5, None), prop));
        assert!(!keeps(&failure(f64::INFINITY, None), Prop::Determinism));
        let limit = Some("range limit of a 16-bit design, not a defect: dq at 35 element(s)");
        assert!(!keeps(&failure(f64::INFINITY, limit), prop));
    }

    #[test]
    fn a_set_stop_flag_ends_shrinking_at_once() {
        let be = CpuBackend::mutant(Defects::of(&[Mutant::ScaleTwice]));
        let checker = Checker::isolated(&be);
        let (case, prop) = failing_case(&checker);
        let long = Duration::from_secs(600);
        let (kept, steps) = shrink(&checker, &case, prop, long, &AtomicBool::new(true));
        assert_eq!(steps, 0);
        assert_eq!(size(&kept), size(&case));
        let (small, steps) = shrink(&checker, &case, prop, long, &AtomicBool::new(false));
        assert!(steps > 0 && size(&small) < size(&case), "nothing shrunk");
    }
}
