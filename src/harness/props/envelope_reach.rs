//! Range limits of an undeclared design (issue 31): with no design declared, the judge cannot
//! emulate the implementation's 16-bit intermediates, but it can tell which output rows a
//! common design may lose to the dtype's range. FlashAttention-style designs round dS (or
//! scale·dS) to 16 bits for the dQ and dK products, and with GQA they store each query head's dK and dV in 16
//! bits before the group is summed; a framework's decomposition (XLA's, PyTorch's math path in
//! 16 bits) stores dP = dO·Vᵀ, and may store D, in the input type. Where the f64 value of
//! such an intermediate, widened by twice its rounding noise, reaches the largest finite value, a correct design may overflow
//! there (to either sign, or to NaN through inf − inf), wherever smallseq's own emulation stayed
//! inside. Outputs past the range only in such rows, which pass once those elements are set to
//! the reference, are that design's range limit.

use super::range_verdict::{describe, excused_passing, past_range, RangeLimit};
use super::yardstick::Yardstick;
use crate::case::{Case, Outputs};
use crate::harness::envelope_weights::envelope_ds_weight;
use crate::harness::tolerance::both_past_limit;
use ndarray::{s, Array3};
use std::collections::HashSet;

/// Rows `(token, head)` of each gradient that an intermediate at the range's edge feeds, and
/// each such intermediate by name with its largest f64 magnitude, in the order first seen.
#[derive(Default)]
struct Reach {
    dq: HashSet<(usize, usize)>,
    dk: HashSet<(usize, usize)>,
    dv: HashSet<(usize, usize)>,
    /// As `dbias_rows` views dBias: (plane row `b·Sq + r`, head plane).
    dbias: HashSet<(usize, usize)>,
    intermediates: Vec<(&'static str, f64)>,
}

impl Reach {
    fn note(&mut self, value: f64, intermediate: &'static str) {
        match self
            .intermediates
            .iter_mut()
            .find(|(n, _)| *n == intermediate)
        {
            Some((_, largest)) => *largest = largest.max(value),
            None => self.intermediates.push((intermediate, value)),
        }
    }

    /// `dS reaches 7.5e4, dP = dO·Vᵀ reaches 6.7e4`: what the verdict names.
    fn named(&self) -> String {
        let named: Vec<String> = self
            .intermediates
            .iter()
            .map(|(n, v)| format!("{n} reaches {v:.6e}"))
            .collect();
        named.join(", ")
    }
}

fn row(x: &Array3<f32>, t: usize, h: usize) -> Vec<f64> {
    x.slice(s![t, h, ..])
        .iter()
        .map(|&v| f64::from(v))
        .collect()
}

/// One query head's 16-bit partial of a grouped dK or dV row: its f64 value and the sum of
/// the magnitudes of its terms (the scale of its rounding noise).
struct Partials {
    value: Array3<f64>,
    magnitude: Array3<f64>,
}

impl Partials {
    fn new(tokens: usize, heads: usize, dim: usize) -> Self {
        Partials {
            value: Array3::zeros((tokens, heads, dim)),
            magnitude: Array3::zeros((tokens, heads, dim)),
        }
    }

    fn add(&mut self, key: usize, head: usize, weight: f64, noise: f64, x: &[f64]) {
        for (c, &xc) in x.iter().enumerate() {
            self.value[[key, head, c]] += weight * xc;
            self.magnitude[[key, head, c]] += (weight.abs() + noise) * xc.abs();
        }
    }

    /// Per key row and query head, the largest |partial| among those at the range's edge.
    fn at_edge(&self, u: f64, max: f64) -> Vec<(usize, usize, f64)> {
        let (tokens, heads, _) = self.value.dim();
        let mut out = Vec::new();
        for j in 0..tokens {
            for h in 0..heads {
                let edge = self
                    .value
                    .slice(s![j, h, ..])
                    .iter()
                    .zip(self.magnitude.slice(s![j, h, ..]))
                    .map(|(v, m)| v.abs() + 2.0 * u * m)
                    .fold(0.0f64, f64::max);
                if edge >= max {
                    out.push((j, h, edge));
                }
            }
        }
        out
    }
}

/// Which gradient rows a common design may lose to the dtype's range. None without a backward
/// or with dropout (whose dS this does not follow), or when no intermediate reaches the edge.
fn reach(case: &Case, y: &Yardstick) -> Option<Reach> {
    let p = &case.config.params;
    let (d_o, lse, o) = (
        case.d_o.as_ref()?,
        y.reference.lse.as_ref()?,
        y.reference.o.as_ref()?,
    );
    if p.dropout.p > 0.0 {
        return None;
    }
    let dt = case.config.dtype;
    let (max, u) = (f64::from(dt.max_finite()), dt.unit_roundoff());
    let grouped = p.group_size() > 1;
    let (kv_tokens, heads) = (case.k.dim().0, p.num_heads);
    let mut dk_part = grouped.then(|| Partials::new(kv_tokens, heads, p.head_dim_qk));
    let mut dv_part = grouped.then(|| Partials::new(kv_tokens, heads, p.head_dim_v));
    let mut reach = Reach::default();
    for r in case.visible_rows().filter(|r| !r.keys.is_empty()) {
        let (q, g) = (row(&case.q, r.token, r.head), row(d_o, r.token, r.head));
        let d_o_r = d_o.slice(s![r.token, r.head, ..]);
        let o_r = o.slice(s![r.token, r.head, ..]);
        let terms = d_o_r.iter().zip(o_r).map(|(a, b)| f64::from(*a) * b);
        let (d, d_from_o) = terms.fold((0.0, 0.0), |(s, m), t| (s + t, m + t.abs()));
        let m = lse[[r.token, r.head]];
        // dP = dO·V of key `j` and the sum of its terms' magnitudes, summed in order as D's.
        let dp_of = |j: usize| {
            let terms = d_o_r
                .iter()
                .zip(case.v.slice(s![j, r.kv_head, ..]))
                .map(|(a, b)| f64::from(*a) * f64::from(*b));
            terms.fold((0.0, 0.0), |(s, m), t| (s + t, m + t.abs()))
        };
        // D held in 16 bits feeds every dS of the row.
        let d_at_edge = d.abs() + 2.0 * u * d_from_o >= max;
        if d_at_edge {
            reach.dq.insert((r.token, r.head));
            reach.note(d.abs(), "D = rowsum(dO∘O)");
        }
        // A decomposition that forms dP over the slot's every key (XLA's autodiff of a
        // masked softmax) and D = Σ P·dP multiplies a masked key's P = 0 by its 16-bit dP:
        // past the range that is 0·inf = NaN, in D and so in every dS of the row (JAX XLA,
        // f16: dQ and dK NaN where they are 0, a hidden key's dP = 1.5e5, seed 71 group 21).
        let hidden_dp = case
            .slot_keys(&r)
            .filter(|j| !r.keys.contains(j))
            .map(dp_of)
            .filter(|(dp, m): &(f64, f64)| dp.abs() + 2.0 * u * m >= max)
            .map(|(dp, _)| dp.abs())
            .max_by(f64::total_cmp);
        if let Some(dp) = hidden_dp {
            reach.dq.insert((r.token, r.head));
            reach.note(dp, "dP = dO·Vᵀ of a masked key");
        }
        let d_at_edge = d_at_edge || hidden_dp.is_some();
        for &j in &r.keys {
            let pij = case.probability(&r, j, m);
            let (dp, dp_magnitude) = dp_of(j);
            let ds = pij * (dp - d);
            let w = envelope_ds_weight(ds, pij, dp, d, d_from_o);
            let ds_reach = ds.abs() + 2.0 * u * w;
            // A design may fold the softmax scale into dS before its 16-bit rounding
            // (PyTorch's memory-efficient backward: f16, scale 3, ±inf in exactly the dK rows
            // whose scale·dS passes 65,504 while dS does not, seed 71 group 29).
            let scaled_at_edge = p.scale.abs() > 1.0 && p.scale.abs() * ds_reach >= max;
            let ds_at_edge = ds_reach >= max || scaled_at_edge;
            // dP held in 16 bits (the output type of a framework's dO·Vᵀ, as XLA's
            // decomposition stores it) overflows to inf, and dS = P(dP − D) with it.
            let dp_at_edge = dp.abs() + 2.0 * u * dp_magnitude >= max;
            if ds_at_edge || dp_at_edge || d_at_edge {
                reach.dq.insert((r.token, r.head));
                reach.dk.insert((j, r.kv_head));
                // A broadcast bias's dBias sums the 16-bit dS of every slot and head that
                // reads it (PyTorch's math path: the gradient of the expanded mask).
                if let Some(at) = case.dbias_row(&r) {
                    reach.dbias.insert(at);
                }
            }
            if ds_reach >= max {
                reach.note(ds.abs(), "dS");
            } else if scaled_at_edge {
                reach.note(p.scale.abs() * ds.abs(), "scale·dS");
            }
            if dp_at_edge {
                reach.note(dp.abs(), "dP = dO·Vᵀ");
            }
            if let (Some(dk), Some(dv)) = (dk_part.as_mut(), dv_part.as_mut()) {
                dk.add(j, r.head, p.scale * ds, p.scale * 2.0 * u * w, &q);
                dv.add(j, r.head, pij, u * pij, &g);
            }
        }
    }
    let group = p.group_size();
    for (part, dk, name) in [
        (&dk_part, true, "one query head's dK"),
        (&dv_part, false, "one query head's dV"),
    ] {
        for (j, h, edge) in part.iter().flat_map(|x| x.at_edge(u, max)) {
            let rows = if dk { &mut reach.dk } else { &mut reach.dv };
            rows.insert((j, h / group));
            reach.note(edge, name);
        }
    }
    (!reach.intermediates.is_empty()).then_some(reach)
}

/// Whether an output `value` past the range needs the design's excuse: the reference `want`
/// is finite, and `value` is not what the judge takes for it anyway ([`both_past_limit`]: the
/// reference's own value at the edge, the saturated value or the infinity of its sign past
/// it). A finite reference past the range counts where the value is not that: the design's
/// inf − inf gives NaN where the answer rounds to inf.
fn excusable(value: f64, want: f64, max: f64) -> bool {
    past_range(value, max) && want.is_finite() && !both_past_limit(value, want, max)
}

/// An undeclared design's range limit: the elements past the range where the reference is
/// finite (and not merely rounded to inf) that lie in a row [`reach`] names are set to the
/// reference, and then the outputs pass. Any other element is left to the judge, which
/// passes only what it passes anywhere: the reference's own value at the edge, the
/// saturated value or the right infinity past it, an infinity within a threshold of the
/// limit (a CPU flash dK of 65,493.6 stored as +inf), and fails the rest.
pub(super) fn excused(case: &Case, actual: &Outputs, y: &Yardstick) -> Option<RangeLimit> {
    let reach = reach(case, y)?;
    let max = f64::from(case.config.dtype.max_finite());
    let mut excused = actual.clone();
    let mut counts = Vec::new();
    for (name, a, r, rows) in [
        ("dq", excused.dq.as_mut(), &y.reference.dq, &reach.dq),
        ("dk", excused.dk.as_mut(), &y.reference.dk, &reach.dk),
        ("dv", excused.dv.as_mut(), &y.reference.dv, &reach.dv),
    ] {
        let (Some(a), Some(r)) = (a, r) else { continue };
        let mut n = 0;
        for ((t, h, x), v) in a.indexed_iter_mut() {
            let want = r[[t, h, x]];
            if excusable(*v, want, max) && rows.contains(&(t, h)) {
                *v = want;
                n += 1;
            }
        }
        counts.push((name, n));
    }
    if let (Some(a), Some(r)) = (excused.dbias.as_mut(), y.reference.dbias.as_ref()) {
        let sq = a.dim().2;
        let mut n = 0;
        for ((b, h, row, c), v) in a.indexed_iter_mut() {
            let want = r[[b, h, row, c]];
            if excusable(*v, want, max) && reach.dbias.contains(&(b * sq + row, h)) {
                *v = want;
                n += 1;
            }
        }
        counts.push(("dbias", n));
    }
    let what = excused_passing(case, y, &excused, &counts)?;
    let dt = case.config.dtype;
    let because = format!(
        "all in rows fed by an intermediate that a common design stores in {dt}: {} in f64 \
         against the {dt} limit {max} (no design is declared, so any design of the envelope \
         may overflow there)",
        reach.named()
    );
    let what = describe(case, &what, &because);
    Some(RangeLimit { excused, what })
}
