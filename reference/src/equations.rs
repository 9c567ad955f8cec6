//! One function per equation of `semantics.md` §1, on one (slot, head) block in f64.
//!
//! Shapes: `q [Lq, Dqk]`, `k [Lk, Dqk]`, `v [Lk, Dv]`, `d_o [Lq, Dv]`, scores and
//! probabilities `[Lq, Lk]`. The matrix products go through ndarray's `dot`
//! (matrixmultiply), which is what makes the reference fast enough to run on every fuzz case.

use crate::types::{visible, Mask, Window};
use ndarray::{Array1, Array2, Axis, Zip};

/// `S = scale · Q Kᵀ`: the scale is one multiply of each finished dot product, as the
/// contract requires (never folded into `q`).
pub fn scores(q: &Array2<f64>, k: &Array2<f64>, scale: f64) -> Array2<f64> {
    let mut s = q.dot(&k.t());
    s.mapv_inplace(|x| x * scale);
    s
}

/// `S[r, c] = -inf` where key `c` is not visible to row `r` (mask and window of §1).
///
/// `-inf` rather than a large negative number so that an invisible key carries exactly zero
/// weight and a row without visible keys is recognisable by `m = -inf`.
pub fn apply_mask(s: &mut Array2<f64>, mask: Mask, window: Window) {
    let (lq, lk) = s.dim();
    for ((r, c), x) in s.indexed_iter_mut() {
        if !visible(mask, window, r, c, lq, lk) {
            *x = f64::NEG_INFINITY;
        }
    }
}

/// `m[r] = max_c S[r, c]` over visible keys; `-inf` for a row with none.
pub fn row_max(s: &Array2<f64>) -> Array1<f64> {
    s.map_axis(Axis(1), |row| {
        row.iter().copied().fold(f64::NEG_INFINITY, f64::max)
    })
}

/// `P[r, c] = exp(S[r, c] - m[r]) / l[r]` with `l[r] = Σ_c exp(S[r, c] - m[r])`; returns
/// `(P, l)`. A row with `m = -inf` (no visible key) has `l = 0` and `P = 0`, not
/// `exp(NaN)`.
pub fn softmax(s: &Array2<f64>, m: &Array1<f64>) -> (Array2<f64>, Array1<f64>) {
    let mut p = s.clone();
    let mut l = Array1::zeros(m.len());
    for ((mut row, &mr), lr) in p.rows_mut().into_iter().zip(m).zip(l.iter_mut()) {
        if mr == f64::NEG_INFINITY {
            row.fill(0.0);
            continue;
        }
        row.mapv_inplace(|x| (x - mr).exp());
        *lr = row.sum();
        let inv = *lr;
        row.mapv_inplace(|x| x / inv);
    }
    (p, l)
}

/// `lse[r] = m[r] + ln l[r]`; `-inf` for a row with no visible key.
pub fn lse(m: &Array1<f64>, l: &Array1<f64>) -> Array1<f64> {
    Zip::from(m).and(l).map_collect(|&mr, &lr| {
        if lr > 0.0 {
            mr + lr.ln()
        } else {
            f64::NEG_INFINITY
        }
    })
}

/// `O = P V`.
pub fn output(p: &Array2<f64>, v: &Array2<f64>) -> Array2<f64> {
    p.dot(v)
}

/// `dP = dO Vᵀ`.
pub fn d_p(d_o: &Array2<f64>, v: &Array2<f64>) -> Array2<f64> {
    d_o.dot(&v.t())
}

/// `D[r] = Σ_c P[r, c] dP[r, c]` (equal to `rowsum(dO ∘ O)` in exact arithmetic).
pub fn d_rowsum(p: &Array2<f64>, dp: &Array2<f64>) -> Array1<f64> {
    Zip::from(p.rows())
        .and(dp.rows())
        .map_collect(|pr, dpr| pr.dot(&dpr))
}

/// `dS[r, c] = P[r, c] (dP[r, c] - D[r])`.
///
/// Invisible keys and empty rows have `P = 0`, so they get `dS = 0` and contribute nothing.
pub fn d_s(p: &Array2<f64>, dp: &Array2<f64>, d: &Array1<f64>) -> Array2<f64> {
    let mut ds = dp.clone();
    for ((mut dsr, pr), &dr) in ds.rows_mut().into_iter().zip(p.rows()).zip(d) {
        dsr.zip_mut_with(&pr, |x, &pc| *x = pc * (*x - dr));
    }
    ds
}

/// `dQ = scale · dS K`.
pub fn d_q(ds: &Array2<f64>, k: &Array2<f64>, scale: f64) -> Array2<f64> {
    let mut dq = ds.dot(k);
    dq.mapv_inplace(|x| x * scale);
    dq
}

/// `dK = scale · dSᵀ Q` (this head's share; the caller sums over the heads of a group).
pub fn d_k(ds: &Array2<f64>, q: &Array2<f64>, scale: f64) -> Array2<f64> {
    let mut dk = ds.t().dot(q);
    dk.mapv_inplace(|x| x * scale);
    dk
}

/// `dV = Pᵀ dO` (this head's share; the caller sums over the heads of a group).
pub fn d_v(p: &Array2<f64>, d_o: &Array2<f64>) -> Array2<f64> {
    p.t().dot(d_o)
}
