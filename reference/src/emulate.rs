//! Device-faithful emulation of the small-seq kernels' numerics (`te-smallseq-path.md` §4.4):
//! the same-precision yardstick against which a kernel's error is judged.
//!
//! Differences from the kernels that are deliberate: dot products are summed in order over
//! `d` (the MFMA intra-chunk order is hardware-defined), `1/l` is an exact f32 division (the
//! device uses an approximate reciprocal), an empty row gives `o = 0` (the contract, not the
//! device's NaN), and GQA sums dK/dV over the group in f32 before the store.
//!
//! Dropout (`docs/semantics.md` §1.8) runs only on the fallback path, as FlashAttention's
//! kernels apply it: P·V over the kept keys, the f32 factor `fl32(1/(1 − p))` applied to the
//! accumulated O; backward the same factor on the kept dP and on dV's P.

use crate::ds_scale::{self, DsOperand};
use crate::problem::Problem;
use crate::slot::SlotGeom;
use crate::types::{visible, AttnParams, Dtype};
use ndarray::{Array2, Array3, ArrayView3};

/// Forward outputs as the device stores them: `o` rounded to the dtype, `lse` in f32.
#[derive(Clone, Debug, PartialEq)]
pub struct EmuForward {
    /// `[Tq, H, Dv]`, values of the dtype; 0 at don't-care tokens and empty rows.
    pub o: Array3<f32>,
    /// `[Tq, H]`; `-inf` at don't-care tokens and empty rows.
    pub lse: Array2<f32>,
    /// `o` before its rounding to the dtype (the f32 accumulator): how far each output lies from
    /// a rounding boundary of the dtype, which a judge of roundings needs.
    pub o_acc: Array3<f32>,
}

/// Gradients as the device stores them (values of the dtype; 0 at don't-care tokens).
#[derive(Clone, Debug, PartialEq)]
pub struct EmuGradients {
    /// `[Tq, H, Dqk]`
    pub dq: Array3<f32>,
    /// `[Tk, Hkv, Dqk]`
    pub dk: Array3<f32>,
    /// `[Tk, Hkv, Dv]`
    pub dv: Array3<f32>,
    /// `dv` before its rounding to the dtype (as [`EmuForward::o_acc`]).
    pub dv_acc: Array3<f32>,
    /// How many dS values lay past the dtype's largest finite value before their rounding
    /// (their block scaled by a power of two, `ds_scale.rs`; saturated if infinite).
    pub ds_past_range: usize,
}

/// Forward pass, and the gradients when `p.d_o` is present, with the kernels' roundings for
/// inputs of type `dtype`.
pub fn forward_backward(p: &Problem, dtype: Dtype) -> (EmuForward, Option<EmuGradients>) {
    forward_backward_with(p, dtype, DsOperand::BlockScaled)
}

/// [`forward_backward`] with D = rowsum(dO∘O) from the stored (dtype-rounded) O instead of
/// Σ P·dP (docs/semantics.md §1.7, the second form): the roundings of the GPU's tiled
/// fallback backward built with `FTB_D_FROM_O=1` (P and dS as 16-bit operands of its matrix
/// products, dS scaled per block), whose D carries O's rounding into every dS of the row.
pub fn forward_backward_d_from_o(p: &Problem, dtype: Dtype) -> (EmuForward, Option<EmuGradients>) {
    emulate(p, dtype, DsOperand::BlockScaled, true)
}

/// [`forward_backward`] of a design that carries dS as `ds` says (the other designs a range
/// limit may be of).
pub fn forward_backward_with(
    p: &Problem,
    dtype: Dtype,
    ds: DsOperand,
) -> (EmuForward, Option<EmuGradients>) {
    emulate(p, dtype, ds, false)
}

fn emulate(
    p: &Problem,
    dtype: Dtype,
    ds: DsOperand,
    d_from_o: bool,
) -> (EmuForward, Option<EmuGradients>) {
    let a = p.params;
    let (nh, nkv, dqk, dv) = (a.num_heads, a.num_kv_heads, a.head_dim_qk, a.head_dim_v);
    let (tq, tk) = (p.layout.q.tokens, p.layout.kv.tokens);
    let mut fwd = EmuForward {
        o: Array3::zeros((tq, nh, dv)),
        lse: Array2::from_elem((tq, nh), f32::NEG_INFINITY),
        o_acc: Array3::zeros((tq, nh, dv)),
    };
    let mut grads = p.d_o.map(|_| EmuGradients {
        dq: Array3::zeros((tq, nh, dqk)),
        dk: Array3::zeros((tk, nkv, dqk)),
        dv: Array3::zeros((tk, nkv, dv)),
        dv_acc: Array3::zeros((tk, nkv, dv)),
        ds_past_range: 0,
    });
    for i in 0..p.layout.slots() {
        let sg = SlotGeom::of(p.layout, i);
        if sg.is_empty() {
            continue;
        }
        for hk in 0..nkv {
            emulate_group(
                p,
                a,
                (i, sg),
                hk,
                (dtype, ds, d_from_o),
                &mut fwd,
                grads.as_mut(),
            );
        }
    }
    (fwd, grads)
}

/// Row-major `[len, D]` f32 copy of one head's valid rows.
pub(crate) struct Rows {
    d: usize,
    x: Vec<f32>,
}

impl Rows {
    pub(crate) fn of(t: &ArrayView3<'_, f32>, off: usize, len: usize, head: usize) -> Rows {
        let d = t.shape()[2];
        let mut x = Vec::with_capacity(len * d);
        for r in 0..len {
            x.extend(t.slice(ndarray::s![off + r, head, ..]).iter());
        }
        Rows { d, x }
    }
    pub(crate) fn row(&self, r: usize) -> &[f32] {
        &self.x[r * self.d..(r + 1) * self.d]
    }
}

/// f32 accumulation of exact input-dtype products, in order over `d`.
pub(crate) fn dot32(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0f32, |acc, (&x, &y)| acc + x * y)
}

/// `S = fl32(fl32(Σ_d q·k) · scale) + bias` (§1.9, the bias's f32 value), `-inf` where
/// invisible, for query head `h` of slot `slot`.
pub(crate) fn scores32(
    a: &AttnParams,
    (slot, h): (usize, usize),
    q: &Rows,
    k: &Rows,
    lq: usize,
    lk: usize,
) -> Vec<f32> {
    let scale = a.scale as f32;
    let mut s = vec![f32::NEG_INFINITY; lq * lk];
    for r in 0..lq {
        for c in 0..lk {
            if visible(a.mask, a.window, r, c, lq, lk) {
                let b = a.bias.at32(slot, h, r, c, lq, lk);
                s[r * lk + c] = dot32(q.row(r), k.row(c)) * scale + b;
            }
        }
    }
    s
}

#[allow(clippy::too_many_arguments)]
fn emulate_group(
    p: &Problem,
    a: &AttnParams,
    (slot, sg): (usize, SlotGeom),
    hk: usize,
    (dtype, ds_design, d_from_o): (Dtype, DsOperand, bool),
    fwd: &mut EmuForward,
    grads: Option<&mut EmuGradients>,
) {
    let g = a.group_size();
    let (lq, lk) = (sg.lq, sg.lk);
    let (dqk, dv) = (a.head_dim_qk, a.head_dim_v);
    let scale = a.scale as f32;
    let rescale = a.dropout.rescale() as f32;
    // Dropout's factor of (r, c) in head h: 1 without dropout, else the f32 rescale or 0.
    let z = |h: usize, r: usize, c: usize| -> f32 {
        if !a.dropout.is_active() {
            1.0
        } else if a.dropout.keep(slot, a.num_heads, h, r, c) {
            rescale
        } else {
            0.0
        }
    };
    let k = Rows::of(&p.k, sg.off_kv, lk, hk);
    let v = Rows::of(&p.v, sg.off_kv, lk, hk);
    // dK, dV of the group, accumulated in f32 over its heads and rounded once at the store.
    let mut dk_acc = vec![0.0f32; lk * dqk];
    let mut dv_acc = vec![0.0f32; lk * dv];
    let mut grads = grads;

    for h in hk * g..(hk + 1) * g {
        let q = Rows::of(&p.q, sg.off_q, lq, h);
        let s = scores32(a, (slot, h), &q, &k, lq, lk);

        // Forward: max, exp, sum, log in f32; P = e / l; O from dtype-rounded P.
        let mut lse = vec![f32::NEG_INFINITY; lq];
        for r in 0..lq {
            let sr = &s[r * lk..(r + 1) * lk];
            let m = sr.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let e: Vec<f32> = sr.iter().map(|&x| (x - m).exp()).collect();
            let l = e.iter().fold(0.0f32, |acc, &x| acc + x);
            lse[r] = m + l.ln();
            fwd.lse[[sg.off_q + r, h]] = lse[r];
            let pr: Vec<f32> = e.iter().map(|&x| dtype.round(x / l)).collect();
            let mut o = vec![0.0f32; dv];
            for (c, &pc) in pr.iter().enumerate() {
                if z(h, r, c) == 0.0 {
                    continue;
                }
                for (od, &vd) in o.iter_mut().zip(v.row(c)) {
                    *od += pc * vd;
                }
            }
            if a.dropout.is_active() {
                o.iter_mut().for_each(|x| *x *= rescale);
            }
            for (d, &od) in o.iter().enumerate() {
                fwd.o[[sg.off_q + r, h, d]] = dtype.round(od);
                fwd.o_acc[[sg.off_q + r, h, d]] = od;
            }
        }

        let (Some(gr), Some(d_o)) = (grads.as_deref_mut(), p.d_o.as_ref()) else {
            continue;
        };
        let d_o = Rows::of(d_o, sg.off_q, lq, h);
        // Backward recomputes P from the forward lse, as kernels A and B do.
        let mut dq = vec![0.0f32; dqk];
        let mut dk_h = vec![0.0f32; lk * dqk];
        let mut dv_h = vec![0.0f32; lk * dv];
        // P and dS of every row first: dS's 16 × 16 blocks are scaled into the type's range
        // by a power of two each (ds_scale.rs), so a block's rows must all be known.
        let mut pr = vec![0.0f32; lq * lk];
        let mut raw = vec![0.0f32; lq * lk];
        for r in 0..lq {
            if lse[r] == f32::NEG_INFINITY {
                continue;
            }
            for c in 0..lk {
                let x = s[r * lk + c];
                pr[r * lk + c] = if x == f32::NEG_INFINITY {
                    0.0
                } else {
                    (x - lse[r]).exp()
                };
            }
            let dp: Vec<f32> = (0..lk)
                .map(|c| {
                    // A dropped key's dP is exactly 0, not 0 times a product.
                    let zc = z(h, r, c);
                    if zc == 0.0 {
                        0.0
                    } else {
                        dot32(d_o.row(r), v.row(c)) * zc
                    }
                })
                .collect();
            let prr = &pr[r * lk..(r + 1) * lk];
            let big_d = if d_from_o {
                // This head's O as stored, from the forward above (the order of `dot32`, as
                // the fallback emulation and the CPU backend take it).
                let o: Vec<f32> = (0..dv).map(|d| fwd.o[[sg.off_q + r, h, d]]).collect();
                dot32(d_o.row(r), &o)
            } else {
                prr.iter()
                    .zip(&dp)
                    .fold(0.0f32, |acc, (&x, &y)| acc + x * y)
            };
            for c in 0..lk {
                raw[r * lk + c] = prr[c] * (dp[c] - big_d);
            }
        }
        gr.ds_past_range += ds_scale::past_range(dtype, &raw);
        let ds_op = ds_design.operands(dtype, &raw, lq, lk);
        for r in 0..lq {
            if lse[r] == f32::NEG_INFINITY {
                continue;
            }
            dq.fill(0.0);
            for c in 0..lk {
                let ds = ds_op[r * lk + c];
                let pc = dtype.round(pr[r * lk + c]) * z(h, r, c);
                for (x, &kd) in dq.iter_mut().zip(k.row(c)) {
                    *x += ds * kd;
                }
                for (x, &qd) in dk_h[c * dqk..(c + 1) * dqk].iter_mut().zip(q.row(r)) {
                    *x += ds * qd;
                }
                for (x, &od) in dv_h[c * dv..(c + 1) * dv].iter_mut().zip(d_o.row(r)) {
                    *x += pc * od;
                }
            }
            for (d, &x) in dq.iter().enumerate() {
                gr.dq[[sg.off_q + r, h, d]] = dtype.round(x * scale);
            }
        }
        for (acc, &x) in dk_acc.iter_mut().zip(&dk_h) {
            *acc += x * scale;
        }
        for (acc, &x) in dv_acc.iter_mut().zip(&dv_h) {
            *acc += x;
        }
    }

    if let Some(gr) = grads {
        if p.d_o.is_some() {
            for c in 0..lk {
                for d in 0..dqk {
                    gr.dk[[sg.off_kv + c, hk, d]] = dtype.round(dk_acc[c * dqk + d]);
                }
                for d in 0..dv {
                    gr.dv[[sg.off_kv + c, hk, d]] = dtype.round(dv_acc[c * dv + d]);
                    gr.dv_acc[[sg.off_kv + c, hk, d]] = dv_acc[c * dv + d];
                }
            }
        }
    }
}
