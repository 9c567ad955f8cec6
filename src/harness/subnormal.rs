//! Whether a case's f32 intermediates can reach the subnormal range, where scaling an input by
//! a power of two stops commuting with rounding.
//!
//! Below 2^-126 an f32 has a fixed absolute quantum, so a product that lands there rounds
//! differently once one of its factors is doubled, and one such term can break a later sum's
//! tie the other way. CUDA fuzz seed 2030, case 13007 (f32, fallback backward): P = 1.6e-45
//! made the f32 term P·(dP − D) 5 quanta in the base run and 21 (not 20) with V and dO
//! doubled; added into an FMA whose product sat on a tie, it moved dQ by one ulp, so "dQ
//! scales by exactly 4" failed on a correct kernel.
//!
//! The bound is over the products the relation's outputs are sums of: P, P·V (O), dO·V (dP),
//! P·dO (dV), dS = P·(dP − D), dS·K (dQ), dS·Q (dK) and dO·O (D, for kernels that take it
//! from O), each bounded below by the smallest nonzero magnitude of its vector factor.

use super::row_dots::{dots, Columns};
use crate::case::Case;
use ndarray::{s, Array2, Array3, ArrayView1};

/// The smallest normal f32, 2^-126.
pub const F32_MIN_NORMAL: f64 = f32::MIN_POSITIVE as f64;

/// Probabilities below this count as zero: f32 `exp` underflows to 0 below 2^-150, and the
/// margin covers the kernels' few-ulp `exp` and their LSE's rounding.
const P_ZERO: f64 = 6.842_277_657_836_021e-49; // 2^-160

/// Whether some f32 intermediate of `case` can be nonzero and below 4 · 2^-126 (the slack
/// covers the difference between the f64 values here and the kernels' f32 ones). `lse` is the
/// f64 reference's `[Tq, H]`, `o` the outputs' O if any (for the dO·O products).
pub fn may_go_subnormal(case: &Case, lse: &Array2<f64>, o: Option<&Array3<f64>>) -> bool {
    smallest_scaled_term(case, lse, o) < 4.0 * F32_MIN_NORMAL
}

/// A lower bound on the smallest nonzero magnitude among the products of the module doc, over
/// every visible (query, key) pair; infinity when there is none.
pub fn smallest_scaled_term(case: &Case, lse: &Array2<f64>, o: Option<&Array3<f64>>) -> f64 {
    let mut least = f64::INFINITY;
    let mut keep = |x: f64| {
        if x > 0.0 && x < least {
            least = x;
        }
    };
    // Once per key row, not once per pair: each row's smallest nonzero magnitude, and the keys
    // and values transposed, so that a row's dot products with its slot's keys run side by
    // side (the same sums as `dot64`, row_dots.rs).
    let min_rows = |a: &Array3<f32>| a.map_axis(ndarray::Axis(2), min_nonzero);
    let (min_k, min_v) = (min_rows(&case.k), min_rows(&case.v));
    let k_cols = Columns::of(&case.k, f64::from);
    let v_cols = case.d_o.as_ref().map(|_| Columns::of(&case.v, f64::from));
    let (mut qk, mut dps) = (Vec::new(), Vec::new());
    for (row, lse_r) in case.live_rows(lse) {
        let (t, h, hk) = (row.token, row.head, row.kv_head);
        let first_key = case.layout.kv.offset(row.slot);
        let slot_keys = first_key..first_key + case.layout.kv.len(row.slot);
        let q = case.q.slice(s![t, h, ..]);
        let d_o = case.d_o.as_ref().map(|d| d.slice(s![t, h, ..]));
        let min_q = min_nonzero(q);
        let min_do = d_o.map_or(f64::INFINITY, min_nonzero);
        if let Some(o) = o {
            keep(min_do * min_nonzero(o.slice(s![t, h, ..])));
        }
        let q64: Vec<f64> = q.iter().map(|&x| x.into()).collect();
        dots(&q64, &k_cols, hk, slot_keys.clone(), -0.0, &mut qk);
        if let (Some(d), Some(v_cols)) = (d_o, v_cols.as_ref()) {
            let d64: Vec<f64> = d.iter().map(|&x| x.into()).collect();
            dots(&d64, v_cols, hk, slot_keys, -0.0, &mut dps);
        }
        // (key, P, dP) of the keys whose P can be nonzero in f32.
        let mut live = Vec::with_capacity(row.keys.len());
        for &c in &row.keys {
            // P as `Case::probability` forms it.
            let scale = case.config.params.scale;
            let prob = (qk[c - first_key] * scale + case.bias_at(&row, c) - lse_r).exp();
            if prob < P_ZERO {
                continue;
            }
            let min_v = min_v[(c, hk)];
            keep(prob);
            keep(prob * min_v);
            let dp = d_o.map(|_| {
                keep(min_do * min_v);
                keep(prob * min_do);
                dps[c - first_key]
            });
            live.push((c, prob, dp));
        }
        let big_d: f64 = live
            .iter()
            .filter_map(|&(_, pr, dp)| dp.map(|x| pr * x))
            .sum();
        for &(c, prob, dp) in &live {
            let Some(dp) = dp else { continue };
            // An f32 dP − D that cancels beyond f32's precision is 0 or at least about one
            // ulp of the larger term: bound the nonzero value by that.
            let scale_of = dp.abs().max(big_d.abs());
            if scale_of == 0.0 {
                continue;
            }
            let diff = (dp - big_d)
                .abs()
                .max(scale_of * f64::from(f32::EPSILON) / 4.0);
            let ds = prob * diff / 2.0;
            keep(ds);
            keep(ds * min_k[(c, hk)]);
            keep(ds * min_q);
        }
    }
    least
}

/// The smallest nonzero magnitude of `x`; infinity when all are zero (a zero factor makes an
/// exactly zero product, which rounds the same at any scale). Non-finite values are skipped:
/// they are handled by the properties that see them.
pub(crate) fn min_nonzero<T: Copy + Into<f64>>(x: ArrayView1<'_, T>) -> f64 {
    x.iter()
        .map(|&e| e.into().abs())
        .filter(|a| *a > 0.0 && a.is_finite())
        .fold(f64::INFINITY, f64::min)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::case::samples::one_query_two_keys as case;
    use smallseq_reference::forward_backward;

    fn smallest(c: &Case) -> f64 {
        let (f, _) = forward_backward(&c.problem().unwrap());
        smallest_scaled_term(c, &f.lse, Some(&f.o))
    }

    #[test]
    fn ordinary_values_stay_far_from_the_subnormal_range() {
        let c = case(1.0, [2.0, -1.0], [3.0, -5.0], 1.0);
        let (f, _) = forward_backward(&c.problem().unwrap());
        // P_1 = 1/(1 + e^3) ≈ 0.047 is the smallest factor; dS and the products stay near it.
        let least = smallest(&c);
        assert!(least > 1e-3 && least < 0.1, "{least}");
        assert!(!may_go_subnormal(&c, &f.lse, Some(&f.o)));
    }

    #[test]
    fn a_subnormal_probability_is_found() {
        // Scores 0 and -103: P_1 = e^-103 ≈ 1.4e-45, one f32 quantum.
        let c = case(1.0, [0.0, -103.0], [1.0, 1.0], 1.0);
        let (f, _) = forward_backward(&c.problem().unwrap());
        let least = smallest(&c);
        assert!(least < 1e-44, "{least}");
        assert!(may_go_subnormal(&c, &f.lse, Some(&f.o)));
    }

    #[test]
    fn probabilities_below_f32_underflow_are_zero_in_both_runs() {
        // P_1 = e^-200 is 0 in f32 at any scale of V: nothing to round differently.
        // What remains smallest is key 0's dS = P·(dP − D), which cancels to 0 in exact
        // arithmetic and is bounded by one f32 ulp of dP there.
        let c = case(1.0, [0.0, -200.0], [1.0, 1.0], 1.0);
        let least = smallest(&c);
        assert!(least > 1e-9 && least < 1e-7, "{least}");
    }

    #[test]
    fn a_tiny_product_of_normal_inputs_is_found() {
        // dO·V = 2^-70 · 2^-70 = 2^-140: both factors normal, their product subnormal.
        let tiny = 2f32.powi(-70);
        let c = case(1.0, [0.0, 0.0], [tiny, tiny], tiny);
        assert!(smallest(&c) <= 2f64.powi(-140));
    }
}
