//! Range limits apart from defects (issue 31): a `numeric_agreement` failure that is wholly an
//! output past the dtype's range (non-finite, or saturated at the largest finite value) where
//! the f64 reference is finite and inside it, at elements where smallseq's emulation of a
//! 16-bit design holds the very same value, is the limit of that design, not a defect of the
//! implementation. Re-judged with those elements set to the reference, the outputs pass; the
//! failure is then kept, characterised (which tensor, how many elements, which intermediate
//! overflows, from what input magnitude), and counted apart: the campaign's exit status counts
//! defects, and `--fail-on-range-limit` makes range limits fail too. The relations compare
//! runs with these elements excused the same way (`relation::relation_verdict`).

use super::yardstick::{emulated_outputs, Yardstick};
use crate::case::{Case, Outputs};
use crate::harness::conditioning::Design;
use crate::harness::tolerance::same_stored;
use ndarray::{Array3, Zip};
use std::collections::HashSet;
use smallseq_reference::ds_scale::DsOperand;
use smallseq_reference::emulate;

/// Whether `x` lies past the range of a dtype whose largest finite value is `max`.
fn past_range(x: f64, max: f64) -> bool {
    !x.is_finite() || x.abs() >= max
}

/// Elements of one output past the range where the reference is finite and inside it and the
/// emulation holds the same value, set to the reference in place; returns how many.
fn excuse(
    actual: &mut Array3<f64>,
    reference: &Array3<f64>,
    emulated: &Array3<f64>,
    max: f64,
) -> usize {
    let mut n = 0;
    Zip::from(actual)
        .and(reference)
        .and(emulated)
        .for_each(|a, &r, &e| {
            if past_range(*a, max) && r.is_finite() && r.abs() < max && same_stored(*a, e) {
                *a = r;
                n += 1;
            }
        });
    n
}

/// One run's range limit: its outputs with the elements the design's range takes set to the
/// reference, and what overflows from what inputs.
pub(super) struct RangeLimit {
    pub excused: Outputs,
    pub what: String,
}

/// The characterisation of a range limit, when every failing tensor of `actual` is one: the
/// outputs, with the out-of-range elements that an emulation of one design holds too set to the
/// reference, pass the same judge. The designs tried are smallseq's own (the yardstick's
/// emulation) and the common ones that carry dS to 16 bits otherwise (saturated, or rounded
/// plainly: `ds_scale::DsOperand`). None for any other failure (a value no design shares is a
/// defect, whatever its size).
pub fn range_limit(case: &Case, actual: &Outputs, y: &Yardstick) -> Option<String> {
    excused(case, actual, y).map(|l| l.what)
}

/// [`range_limit`] with the excused outputs, which the relations compare in place of the run's
/// own (`relation::relation_verdict`).
pub(super) fn excused(case: &Case, actual: &Outputs, y: &Yardstick) -> Option<RangeLimit> {
    eprintln!("DBG excused design {}", y.design.name());
    let dt = case.config.dtype;
    let max = f64::from(dt.max_finite());
    if let Some((excused, what)) = excused_by(case, actual, y, &y.emulated) {
        let intermediate = format!("a {dt} intermediate or store passes {max}");
        let what = describe(case, &what, "smallseq's design", &intermediate);
        return Some(RangeLimit { excused, what });
    }
    let problem = case.problem();
    eprintln!("DBG problem ok {}", problem.is_ok());
    let problem = problem.ok()?;
    for (design, intermediate) in [
        (
            DsOperand::Saturated,
            format!("dS rounded to {dt} saturates at {max}"),
        ),
        (
            DsOperand::Rounded,
            format!("dS rounded to {dt} overflows past {max}"),
        ),
    ] {
        let (ef, eg) = emulate::forward_backward_with(&problem, dt, design);
        let emulated = emulated_outputs(&ef, eg.as_ref());
        if let Some((excused, what)) = excused_by(case, actual, y, &emulated) {
            let name = format!("a design that rounds P and dS to {dt}");
            let what = describe(case, &what, &name, &intermediate);
            return Some(RangeLimit { excused, what });
        }
    }
    if y.design == Design::Envelope {
        return reached_by_ds(case, actual, y);
    }
    None
}

/// Query rows `(token, head)` and key rows `(token, kv head)` that a dS near or past the
/// dtype's range feeds, and the largest such |dS| (f64).
struct DsReach {
    dq_rows: HashSet<(usize, usize)>,
    dk_rows: HashSet<(usize, usize)>,
    largest: f64,
}

/// Which dQ and dK rows an undeclared design may lose to dS's 16-bit range: the f64 dS of a
/// visible pair, widened by twice the envelope's rounding noise of it (`u·W`, docs/judgement.md
/// §2: P, dP and D rounded to the dtype, D from the stored O), reaches the largest finite
/// value. Such a design's dS there may overflow or not, to +inf or -inf, and an overflowed dS
/// gives its rows infinities or NaN (inf − inf, inf · 0), wherever the emulation's own dS
/// happened to stay inside. None without a backward or with dropout (whose dS this does
/// not follow).
fn ds_reach(case: &Case, y: &Yardstick) -> Option<DsReach> {
    let p = &case.config.params;
    let d_o = case.d_o.as_ref()?;
    let lse = y.reference.lse.as_ref()?;
    let o = y.reference.o.as_ref()?;
    if p.dropout.p > 0.0 {
        return None;
    }
    let dt = case.config.dtype;
    let (max, u) = (f64::from(dt.max_finite()), dt.unit_roundoff());
    let mut reach = DsReach {
        dq_rows: HashSet::new(),
        dk_rows: HashSet::new(),
        largest: 0.0,
    };
    let row_of = |x: &Array3<f32>, t: usize, h: usize| -> Vec<f64> {
        x.slice(ndarray::s![t, h, ..]).iter().map(|&v| f64::from(v)).collect()
    };
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    for r in case.visible_rows().filter(|r| !r.keys.is_empty()) {
        let (q, g) = (row_of(&case.q, r.token, r.head), row_of(d_o, r.token, r.head));
        let o_row: Vec<f64> = o.slice(ndarray::s![r.token, r.head, ..]).to_vec();
        let d: f64 = dot(&g, &o_row);
        let d_abs: f64 = g.iter().zip(&o_row).map(|(a, b)| (a * b).abs()).sum();
        let m = lse[[r.token, r.head]];
        let (lq, lk) = (case.layout.q.len(r.slot), case.layout.kv.len(r.slot));
        let ok = case.layout.kv.offset(r.slot);
        for &j in &r.keys {
            let k = row_of(&case.k, j, r.kv_head);
            let v = row_of(&case.v, j, r.kv_head);
            let bias = p.bias.at(r.slot, r.head, r.row, j - ok, lq, lk);
            let pij = (p.scale * dot(&q, &k) + bias - m).exp();
            let dp = dot(&g, &v);
            let ds = pij * (dp - d);
            let w = ds.abs() + pij * (dp.abs() + d.abs() + d_abs);
            if ds.abs() + 2.0 * u * w >= max {
                reach.dq_rows.insert((r.token, r.head));
                reach.dk_rows.insert((j, r.kv_head));
                reach.largest = reach.largest.max(ds.abs());
            }
        }
    }
    (!reach.dq_rows.is_empty()).then_some(reach)
}

/// An undeclared design's range limit ([`ds_reach`]): every element past the range where the
/// reference is finite and inside it lies in a dQ or dK row that a dS at the range's edge
/// feeds, and with those elements set to the reference the outputs pass.
fn reached_by_ds(case: &Case, actual: &Outputs, y: &Yardstick) -> Option<RangeLimit> {
    let reach = ds_reach(case, y);
    eprintln!("DBG reach {}", reach.is_some());
    let reach = reach?;
    let max = f64::from(case.config.dtype.max_finite());
    let mut excused = actual.clone();
    let mut counts = Vec::new();
    for (name, a, r, rows) in [
        ("dq", excused.dq.as_mut(), &y.reference.dq, &reach.dq_rows),
        ("dk", excused.dk.as_mut(), &y.reference.dk, &reach.dk_rows),
    ] {
        let (Some(a), Some(r)) = (a, r) else { continue };
        let mut n = 0;
        for ((t, h, x), v) in a.indexed_iter_mut() {
            let want = r[[t, h, x]];
            if past_range(*v, max) && want.is_finite() && want.abs() < max {
                if !rows.contains(&(t, h)) {
                    eprintln!("DBG {name} ({t},{h},{x}) not reached; rows {:?}", rows);
                    return None;
                }
                *v = want;
                n += 1;
            }
        }
        if n > 0 {
            counts.push(format!("{name} at {n} element(s)"));
        }
    }
    if counts.is_empty() || y.judge(case, &excused, true).iter().any(|j| !j.passed()) {
        eprintln!("DBG judged {:?} {:?}", counts, y.judge(case, &excused, true).iter().filter(|j| !j.passed()).map(|j| (j.tensor.clone(), j.err, j.threshold, j.margin)).collect::<Vec<_>>());
        return None;
    }
    let dt = case.config.dtype;
    let what = describe(
        case,
        &counts.join(", "),
        "no design (none declared); every such element lies in a row that a dS at the range's \
         edge feeds",
        &format!(
            "dS reaches {:.6e} in f64 against the {dt} limit {max}, so a design rounding dS to \
             {dt} loses these rows",
            reach.largest
        ),
    );
    Some(RangeLimit { excused, what })
}

/// `actual` with its out-of-range elements that `emulated` holds too set to the reference, and
/// their tensors and counts, when so excused the outputs pass; None otherwise.
fn excused_by(
    case: &Case,
    actual: &Outputs,
    y: &Yardstick,
    emulated: &Outputs,
) -> Option<(Outputs, String)> {
    let max = f64::from(case.config.dtype.max_finite());
    let mut excused = actual.clone();
    let mut counts = Vec::new();
    for (name, a, r, e) in [
        ("o", excused.o.as_mut(), &y.reference.o, &emulated.o),
        ("dq", excused.dq.as_mut(), &y.reference.dq, &emulated.dq),
        ("dk", excused.dk.as_mut(), &y.reference.dk, &emulated.dk),
        ("dv", excused.dv.as_mut(), &y.reference.dv, &emulated.dv),
    ] {
        if let (Some(a), Some(r), Some(e)) = (a, r, e) {
            let n = excuse(a, r, e, max);
            if n > 0 {
                counts.push(format!("{name} at {n} element(s)"));
            }
        }
    }
    if counts.is_empty() || y.judge(case, &excused, true).iter().any(|j| !j.passed()) {
        return None;
    }
    Some((excused, counts.join(", ")))
}

/// The verdict's sentence: what lies past the range, which design's emulation holds it, what
/// overflows there, and the input magnitudes that took it there.
fn describe(case: &Case, what: &str, design: &str, intermediate: &str) -> String {
    let largest = |x: &Array3<f32>| x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let mut inputs = vec![
        format!("|q| {}", largest(&case.q)),
        format!("|k| {}", largest(&case.k)),
        format!("|v| {}", largest(&case.v)),
    ];
    if let Some(d_o) = &case.d_o {
        inputs.push(format!("|dO| {}", largest(d_o)));
    }
    let dt = case.config.dtype;
    format!(
        "range limit of a 16-bit design, not a defect: {what} past the {dt} range where the \
         f64 reference is finite, and smallseq's emulation of {design} holds the same values \
         ({intermediate}); inputs up to {}",
        inputs.join(", ")
    )
}
