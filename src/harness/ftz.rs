//! What flush-to-zero of f32 intermediates can lose: the envelope's allowance for kernels built
//! with fast math (`-ftz=true`; FlashAttention's, cuDNN's and XLA's GPU builds), which flush
//! every subnormal f32 operand and result to zero (docs/judgement.md, "Declared designs").
//!
//! With `τ = 2^-126`, an f32 operation loses to flushing only a result (or operand) below `τ`,
//! so less than `τ` of it, and the loss reaches an output multiplied by the factors it meets
//! afterwards. A sum of f32 terms that are all at least `2^-103` (an ulp of `τ` or more) is a
//! multiple of `τ`, so it cancels to zero or stays normal; an FMA's exact product keeps about 48
//! bits, so with every term above `G = 2^-76` no result of a dot product lands below `τ`.
//! Each (query, key) pair is therefore charged only for the values of it that lie below `G`
//! (each bounded below as in [`super::subnormal`], by the smallest nonzero magnitude of its
//! vector factor), `τ` per operation that can flush and `min(P, τ)` for a flushed P:
//!
//! ```text
//! ΔP_ij  = min(P_ij, τ) where P_ij < 2τ, else 0
//! ΔdP_ij = 2·Dv·τ where min|dO_i|·min|V_j| < G             (Dv products, Dv partial sums)
//! ΔO_id  = Σ_j ΔP_ij·|V_jd| + 3τ·[P_ij·min|V_j| < G]
//! ΔD_i   = 2·Dv·τ·[min|dO_i|·min|O_i| < G] + Σ_d |dO_id|·ΔO_id
//!          + Σ_j ΔP_ij·|dP_ij| + P_ij·ΔdP_ij + 2τ·[P_ij·|dP_ij| < G]      (D from O or Σ P·dP)
//! ΔdS_ij = ΔP_ij·(|dP_ij| + |D_i|) + P_ij·(ΔdP_ij + ΔD_i) + 3τ·[P·|dP|, P·|D| or |dS| < G]
//! dq[i, h, x] += scale·ΔdS_ij·|K_jx| + τ·(2 + |K_jx|)·[scale·|dS_ij|·min|K_j| < G]
//! dk[j, g, x] += scale·ΔdS_ij·|Q_ix| + τ·(2 + |Q_ix|)·[scale·|dS_ij|·min|Q_i| < G]
//! dv[j, g, d] += ΔP_ij·|dO_id| + 2τ·[P_ij·min|dO_i| < G]
//! dbias       += ΔdS_ij + 2τ·[|dS_ij| < G]
//! ```
//!
//! (dropout's factor multiplies P where O and dV take it, as in [`super::conditioning`]). A
//! case whose values all stay above `G` gets nothing; a row 10^-30 below its tensor, whose P
//! lies under `τ`, may lose all of itself.

use super::row_dots::{dots, Columns};
use super::subnormal::{min_nonzero, F32_MIN_NORMAL as TAU};
use crate::case::Case;
use ndarray::{s, Array2, Array3};
use std::collections::BTreeMap;

/// Below this magnitude an f32 value, or a sum it enters, can come out subnormal (module doc).
pub const GATE: f64 = 1.323_488_980_084_844e-23; // 2^-76

/// The f32 spacing below `τ`, as slack on a flushed P's f32 value.
const SPACING: f64 = 1.401_298_464_324_817e-45;

/// Per-element bounds of what flush-to-zero can take from each output, in its units, by
/// tensor name (`o`, `dq`, `dk`, `dv`, and `dbias` laid out as [`crate::case::dbias_rows`]).
#[derive(Clone, Debug)]
pub struct FtzAllowance {
    by_tensor: BTreeMap<&'static str, Array3<f64>>,
}

impl FtzAllowance {
    /// The bounds of tensor `name`, if the case has it.
    pub fn of(&self, name: &str) -> Option<&Array3<f64>> {
        self.by_tensor.get(name)
    }

    /// The largest bound of row `(token, head)` of `name`; 0 where there is none.
    pub fn row_max(&self, name: &str, token: usize, head: usize) -> f64 {
        self.of(name)
            .and_then(|a| {
                a.get((token, head, 0))
                    .map(|_| a.slice(s![token, head, ..]))
            })
            .map_or(0.0, |r| r.iter().fold(0.0f64, |m, x| m.max(*x)))
    }
}

/// `1` where `x` is nonzero and below [`GATE`]: a value that may flush (a zero is exact).
fn may_flush(x: f64) -> f64 {
    f64::from(u8::from(x > 0.0 && x < GATE))
}

/// The bounds of the module doc for `case`, from the f64 reference's `o` (`[Tq, H, Dv]`) and
/// LSE (`[Tq, H]`); `None` where no value of the case lies below [`GATE`], so nothing flushes.
pub fn ftz_allowance(case: &Case, o: &Array3<f64>, lse: &Array2<f64>) -> Option<FtzAllowance> {
    let p = &case.config.params;
    let scale = p.scale.abs();
    let dv_len = p.head_dim_v as f64;
    let min_rows = |a: &Array3<f32>| a.map_axis(ndarray::Axis(2), min_nonzero);
    let (min_k, min_v) = (min_rows(&case.k), min_rows(&case.v));
    let k_cols = Columns::of(&case.k, f64::from);
    let d_o = case.d_o.as_ref();
    let v_cols = d_o.map(|_| Columns::of(&case.v, f64::from));
    let mut f_o = Array3::<f64>::zeros(o.dim());
    let mut grads = d_o.map(|_| {
        (
            Array3::<f64>::zeros(case.q.dim()),
            Array3::<f64>::zeros(case.k.dim()),
            Array3::<f64>::zeros(case.v.dim()),
        )
    });
    let mut f_db = d_o
        .and(p.bias.grad_shape())
        .map(|[b, h, q, k]| Array3::<f64>::zeros((b * q, h, k)));
    let mut any = false;
    let (mut qk, mut dps) = (Vec::new(), Vec::new());
    for (row, lse_r) in case.live_rows(lse) {
        let slot_keys = case.slot_keys(&row);
        let (t, h, hk, first_key) = (row.token, row.head, row.kv_head, slot_keys.start);
        let q = case.q.slice(s![t, h, ..]);
        let q64: Vec<f64> = q.iter().map(|&x| x.into()).collect();
        dots(&q64, &k_cols, hk, slot_keys.clone(), -0.0, &mut qk);
        // (key, P, ΔP, Z) of the row's visible keys, P as `Case::probability` forms it.
        let pairs: Vec<(usize, f64, f64, f64)> = row
            .keys
            .iter()
            .map(|&c| {
                let prob = (qk[c - first_key] * p.scale + case.bias_at(&row, c) - lse_r).exp();
                let lost = if prob < 2.0 * TAU {
                    (prob + 2.0 * SPACING).min(TAU)
                } else {
                    0.0
                };
                (c, prob, lost, case.dropout_factor(&row, c))
            })
            .collect();
        for &(c, prob, lost, z) in &pairs {
            let (pz, lost) = (prob * z, lost * z);
            let ops = 3.0 * TAU * may_flush(pz * min_v[(c, hk)]);
            if lost == 0.0 && ops == 0.0 {
                continue;
            }
            any = true;
            let v = case.v.slice(s![c, hk, ..]);
            for (x, v) in f_o.slice_mut(s![t, h, ..]).iter_mut().zip(v) {
                *x += lost * f64::from(*v).abs() + ops;
            }
        }
        let (Some(d_o), Some(v_cols), Some((f_dq, f_dk, f_dv))) =
            (d_o, v_cols.as_ref(), grads.as_mut())
        else {
            continue;
        };
        let d_o_r = d_o.slice(s![t, h, ..]);
        let min_do = min_nonzero(d_o_r);
        let min_q = min_nonzero(q);
        let d64: Vec<f64> = d_o_r.iter().map(|&x| x.into()).collect();
        dots(&d64, v_cols, hk, slot_keys, -0.0, &mut dps);
        // (dP, ΔdP) per visible key, dropout's factor on both.
        let dp: Vec<(f64, f64)> = pairs
            .iter()
            .map(|&(c, _, _, z)| {
                let lost = 2.0 * dv_len * TAU * may_flush(min_do * min_v[(c, hk)]);
                (z * dps[c - first_key], z * lost)
            })
            .collect();
        let big_d: f64 = pairs.iter().zip(&dp).map(|(pr, (d, _))| pr.1 * d).sum();
        let o_row = o.slice(s![t, h, ..]);
        let mut lost_d = 2.0 * dv_len * TAU * may_flush(min_do * min_nonzero(o_row));
        lost_d += d_o_r
            .iter()
            .zip(f_o.slice(s![t, h, ..]))
            .map(|(x, l)| f64::from(*x).abs() * l)
            .sum::<f64>();
        for (&(_, pr, lp, _), &(dpv, ldp)) in pairs.iter().zip(&dp) {
            lost_d += lp * dpv.abs() + pr * ldp + 2.0 * TAU * may_flush(pr * dpv.abs());
        }
        for (&(c, pr, lp, z), &(dpv, ldp)) in pairs.iter().zip(&dp) {
            let (pz, lost_pz) = (pr * z, lp * z);
            // An f32 dP − D that cancels is 0 or about an ulp of the larger term at least
            // (subnormal.rs): the smallest nonzero dS it can make.
            let larger = dpv.abs().max(big_d.abs());
            let ds = pr
                * (dpv - big_d)
                    .abs()
                    .max(larger * f64::from(f32::EPSILON) / 4.0);
            let ds_ops = may_flush(pr * dpv.abs())
                .max(may_flush(pr * big_d.abs()))
                .max(may_flush(ds));
            let lost_ds = lp * (dpv.abs() + big_d.abs()) + pr * (ldp + lost_d) + 3.0 * TAU * ds_ops;
            let q_ops = may_flush(scale * ds * min_k[(c, hk)]).max(may_flush(scale * ds));
            let k_ops = may_flush(scale * ds * min_q).max(may_flush(scale * ds));
            let v_ops = 2.0 * TAU * may_flush(pz * min_do);
            if lost_ds == 0.0 && q_ops == 0.0 && k_ops == 0.0 && v_ops == 0.0 && lost_pz == 0.0 {
                continue;
            }
            any = true;
            let k = case.k.slice(s![c, hk, ..]);
            for (x, k) in f_dq.slice_mut(s![t, h, ..]).iter_mut().zip(k) {
                let k = f64::from(*k).abs();
                *x += scale * lost_ds * k + TAU * (2.0 + k) * q_ops;
            }
            for (x, q) in f_dk.slice_mut(s![c, hk, ..]).iter_mut().zip(q) {
                let q = f64::from(*q).abs();
                *x += scale * lost_ds * q + TAU * (2.0 + q) * k_ops;
            }
            for (x, y) in f_dv.slice_mut(s![c, hk, ..]).iter_mut().zip(d_o_r) {
                *x += lost_pz * f64::from(*y).abs() + v_ops;
            }
            if let (Some(db), Some((at, hb))) = (f_db.as_mut(), case.dbias_row(&row)) {
                db[(at, hb, c - first_key)] += lost_ds + 2.0 * TAU * may_flush(ds);
            }
        }
    }
    any.then(|| {
        let mut by_tensor = BTreeMap::from([("o", f_o)]);
        if let Some((dq, dk, dv)) = grads {
            by_tensor.extend([("dq", dq), ("dk", dk), ("dv", dv)]);
        }
        by_tensor.extend(f_db.map(|d| ("dbias", d)));
        FtzAllowance { by_tensor }
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::case::samples::one_query_two_keys as case;

    /// Scores 0 and -90: P_1 = e^-90 ≈ 8.2e-40 lies below 2^-126, and with V = (1, 1000) its
    /// dS_1 = P_1·(dP_1 − D) ≈ 8.2e-37 makes key 1's dK row and the query's dQ (k_1 = -90);
    /// key 1's dV row is P_1·dO itself.
    pub(crate) fn flushing_case() -> Case {
        case(1.0, [0.0, -90.0], [1.0, 1000.0], 1.0)
    }

    #[test]
    fn the_bound_covers_the_flushed_terms_and_nothing_far_from_the_subnormal_range() {
        let c = flushing_case();
        let (f, g) = smallseq_reference::forward_backward(&c.problem().unwrap());
        let g = g.unwrap();
        let a = ftz_allowance(&c, &f.o, &f.lse).unwrap();
        for (name, at, want) in [
            ("dk", (1, 0, 0), g.dk[(1, 0, 0)]),
            ("dv", (1, 0, 0), g.dv[(1, 0, 0)]),
            ("dq", (0, 0, 0), g.dq[(0, 0, 0)]),
        ] {
            let bound = a.of(name).unwrap()[at];
            // At least what flushing P_1 loses, and not a thousandfold more.
            assert!(
                bound >= want.abs() && bound < 1e3 * want.abs(),
                "{name}: {bound:e} vs {want:e}"
            );
        }
        // Scores of order one: nothing below 2^-76, nothing allowed.
        let plain = case(1.0, [2.0, -1.0], [3.0, -5.0], 1.0);
        let (f, _) = smallseq_reference::forward_backward(&plain.problem().unwrap());
        assert!(ftz_allowance(&plain, &f.o, &f.lse).is_none());
    }
}
