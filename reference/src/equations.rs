//! One function per equation of `docs/semantics.md` §1, on one (slot, head) block in f64.
//!
//! Shapes: `q [Lq, Dqk]`, `k [Lk, Dqk]`, `v [Lk, Dv]`, `d_o [Lq, Dv]`, scores and
//! probabilities `[Lq, Lk]`. Inputs are views of the THD buffers in their own element type
//! (upcast to f64 on load, which is exact); each function writes its result into a view
//! the caller owns, so a whole problem runs without a temporary per block, and `o`, `lse`,
//! `dq`, `dk`, `dv` are written straight into the output arrays. The matrix products are
//! [`crate::gemm`]'s: one FMA chain per entry, the summation order ndarray's `dot` had.

use crate::bias::AttnBias;
use crate::dropout::Dropout;
use crate::gemm::{gemm, Epilogue};
use crate::types::{visible, Mask, Window};
use ndarray::{ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2, Zip};

/// `S = scale · Q Kᵀ`: the scale is one multiply of each finished dot product, as the
/// contract requires (never folded into `q`).
///
/// `k_t` is `Kᵀ [Dqk, ≥ Lk]`; `s` is `[Lq, k_t.ncols()]`, and its columns past `Lk` get
/// whatever the extra columns of `k_t` produce.
pub fn scores<T: Copy + Into<f64>>(
    q: ArrayView2<'_, T>,
    k_t: ArrayView2<'_, f64>,
    scale: f64,
    s: ArrayViewMut2<'_, f64>,
) {
    gemm(q, k_t, s, Epilogue::Scaled(scale));
}

/// `S[r, c] += bias[r, c]` of slot `slot`, head `head` (`docs/semantics.md` §1.9): after the
/// scale, before the mask. A `-inf` entry hides its key as the mask does.
pub fn add_bias(mut s: ArrayViewMut2<'_, f64>, bias: &AttnBias, slot: usize, head: usize) {
    if bias.is_none() {
        return;
    }
    let (lq, lk) = s.dim();
    for ((r, c), x) in s.indexed_iter_mut() {
        *x += bias.at(slot, head, r, c, lq, lk);
    }
}

/// `dBias[r, c] += dS[r, c]`: the scores' gradient is the bias's, summed over the slots and
/// heads that share an entry (`dbias` is this block's `[Lq, Lk]` corner of its `[b, h]` plane).
pub fn d_bias(ds: ArrayView2<'_, f64>, mut dbias: ArrayViewMut2<'_, f64>) {
    dbias += &ds;
}

/// `S[r, c] = -inf` where key `c` is not visible to row `r` (mask and window of `docs/semantics.md` §1.5).
///
/// `-inf` rather than a large negative number so that an invisible key carries exactly zero
/// weight and a row without visible keys is recognisable by `m = -inf`.
pub fn apply_mask(mut s: ArrayViewMut2<'_, f64>, mask: Mask, window: Window) {
    let (lq, lk) = s.dim();
    for ((r, c), x) in s.indexed_iter_mut() {
        if !visible(mask, window, r, c, lq, lk) {
            *x = f64::NEG_INFINITY;
        }
    }
}

/// `m[r] = max_c S[r, c]` over visible keys; `-inf` for a row with none.
pub fn row_max(s: ArrayView2<'_, f64>, mut m: ArrayViewMut1<'_, f64>) {
    for (row, mr) in s.rows().into_iter().zip(m.iter_mut()) {
        *mr = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    }
}

/// `P[r, c] = exp(S[r, c] - m[r]) / l[r]` with `l[r] = Σ_c exp(S[r, c] - m[r])`, in place:
/// `s_p` holds `S` on entry and `P` on return. A row with `m = -inf` (no visible key) has
/// `l = 0` and `P = 0`, not `exp(NaN)`.
pub fn softmax(
    mut s_p: ArrayViewMut2<'_, f64>,
    m: ArrayView1<'_, f64>,
    mut l: ArrayViewMut1<'_, f64>,
) {
    for ((mut row, &mr), lr) in s_p.rows_mut().into_iter().zip(m).zip(l.iter_mut()) {
        if mr == f64::NEG_INFINITY {
            row.fill(0.0);
            *lr = 0.0;
            continue;
        }
        row.mapv_inplace(|x| (x - mr).exp());
        *lr = row.sum();
        let inv = *lr;
        row.mapv_inplace(|x| x / inv);
    }
}

/// `lse[r] = m[r] + ln l[r]`; `-inf` for a row with no visible key.
pub fn lse(m: ArrayView1<'_, f64>, l: ArrayView1<'_, f64>, lse: ArrayViewMut1<'_, f64>) {
    Zip::from(lse).and(m).and(l).for_each(|out, &mr, &lr| {
        *out = if lr > 0.0 {
            mr + lr.ln()
        } else {
            f64::NEG_INFINITY
        }
    });
}

/// `Z[r, c]`: the factor dropout multiplies `P[r, c]` by in query head `head` of slot `slot`
/// (`1/(1 − p)` where kept, 0 where dropped; `docs/semantics.md` §1.8).
pub fn dropout_factors(
    d: &Dropout,
    slot: usize,
    heads: usize,
    head: usize,
    mut z: ArrayViewMut2<'_, f64>,
) {
    for ((r, c), x) in z.indexed_iter_mut() {
        *x = d.factor(slot, heads, head, r, c);
    }
}

/// `P̃ = P ∘ Z`: the dropped, rescaled probabilities that multiply V. The row statistics
/// (`m`, `l`, `lse`) stay those of the undropped P, as in FlashAttention and TE.
pub fn apply_dropout(
    p: ArrayView2<'_, f64>,
    z: ArrayView2<'_, f64>,
    mut p_tilde: ArrayViewMut2<'_, f64>,
) {
    Zip::from(&mut p_tilde)
        .and(p)
        .and(z)
        .for_each(|out, &pc, &zc| *out = pc * zc);
}

/// `dP ← dP ∘ Z`, in place: the gradient reaching P through the dropout.
pub fn mask_d_p(mut dp: ArrayViewMut2<'_, f64>, z: ArrayView2<'_, f64>) {
    dp.zip_mut_with(&z, |x, &zc| *x *= zc);
}

/// `O = P V`.
pub fn output<T: Copy + Into<f64>>(
    p: ArrayView2<'_, f64>,
    v: ArrayView2<'_, T>,
    o: ArrayViewMut2<'_, f64>,
) {
    gemm(p, v, o, Epilogue::Store);
}

/// `dP = dO Vᵀ`.
///
/// `v_t` is `Vᵀ [Dv, ≥ Lk]`; `dp` is `[Lq, v_t.ncols()]` (see [`scores`]).
pub fn d_p<T: Copy + Into<f64>>(
    d_o: ArrayView2<'_, T>,
    v_t: ArrayView2<'_, f64>,
    dp: ArrayViewMut2<'_, f64>,
) {
    gemm(d_o, v_t, dp, Epilogue::Store);
}

/// `D[r] = Σ_c P[r, c] dP[r, c]` (equal to `rowsum(dO ∘ O)` in exact arithmetic).
pub fn d_rowsum(p: ArrayView2<'_, f64>, dp: ArrayView2<'_, f64>, d: ArrayViewMut1<'_, f64>) {
    Zip::from(d)
        .and(p.rows())
        .and(dp.rows())
        .for_each(|dr, pr, dpr| *dr = pr.dot(&dpr));
}

/// `dS[r, c] = P[r, c] (dP[r, c] - D[r])`, in place: `dp_ds` holds `dP` on entry and `dS`
/// on return.
///
/// Invisible keys and empty rows have `P = 0`, so they get `dS = 0` and contribute nothing.
pub fn d_s(p: ArrayView2<'_, f64>, mut dp_ds: ArrayViewMut2<'_, f64>, d: ArrayView1<'_, f64>) {
    for ((mut dsr, pr), &dr) in dp_ds.rows_mut().into_iter().zip(p.rows()).zip(d) {
        dsr.zip_mut_with(&pr, |x, &pc| *x = pc * (*x - dr));
    }
}

/// `dQ = scale · dS K`.
pub fn d_q<T: Copy + Into<f64>>(
    ds: ArrayView2<'_, f64>,
    k: ArrayView2<'_, T>,
    scale: f64,
    dq: ArrayViewMut2<'_, f64>,
) {
    gemm(ds, k, dq, Epilogue::Scaled(scale));
}

/// `dK += scale · dSᵀ Q`: this head's share, added to `dk` because the heads of a GQA group
/// share their kv rows.
pub fn d_k<T: Copy + Into<f64>>(
    ds: ArrayView2<'_, f64>,
    q: ArrayView2<'_, T>,
    scale: f64,
    dk: ArrayViewMut2<'_, f64>,
) {
    gemm(ds.t(), q, dk, Epilogue::AddScaled(scale));
}

/// `dV += Pᵀ dO`: this head's share, added to `dv` (see [`d_k`]).
pub fn d_v<T: Copy + Into<f64>>(
    p: ArrayView2<'_, f64>,
    d_o: ArrayView2<'_, T>,
    dv: ArrayViewMut2<'_, f64>,
) {
    gemm(p.t(), d_o, dv, Epilogue::Add);
}
