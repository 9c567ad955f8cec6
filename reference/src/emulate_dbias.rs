//! The emulation's dBias (`docs/semantics.md` §1.9): the f32 dS of [`crate::emulate`]'s
//! scores and LSE, summed in f32 over the slots and heads that share an entry (slot, then
//! head order) and rounded to the input type once, as the CPU fallback stores it. Kept apart
//! from the emulation's backward so that the rounding points of its dQ and dK stay its own.

use crate::bias::AttnBias;
use crate::emulate::{dot32, scores32, Rows};
use crate::problem::Problem;
use crate::slot::SlotGeom;
use crate::types::Dtype;
use ndarray::{Array3, Array4};

/// dBias `[Bb, Hb, Sq, Sk]` of a case with a post-scale bias and `d_o`; `None` otherwise.
pub fn dbias(p: &Problem, dtype: Dtype) -> Option<Array4<f32>> {
    dbias_with(p, dtype, None)
}

/// [`dbias`] with D = rowsum(dO∘O) from `o`, the stored `[Tq, H, Dv]` output
/// (docs/semantics.md §1.7, the second form), in `dot32`'s order.
pub fn dbias_d_from_o(p: &Problem, dtype: Dtype, o: &Array3<f32>) -> Option<Array4<f32>> {
    dbias_with(p, dtype, Some(o))
}

fn dbias_with(p: &Problem, dtype: Dtype, o: Option<&Array3<f32>>) -> Option<Array4<f32>> {
    let a = p.params;
    let (AttnBias::PostScale(t), Some(d_o)) = (&a.bias, p.d_o.as_ref()) else {
        return None;
    };
    let mut acc = Array4::<f32>::zeros(t.dim());
    let g = a.group_size();
    let rescale = a.dropout.rescale() as f32;
    for slot in 0..p.layout.slots() {
        let sg = SlotGeom::of(p.layout, slot);
        if sg.is_empty() {
            continue;
        }
        let (lq, lk) = (sg.lq, sg.lk);
        for h in 0..a.num_heads {
            let hk = h / g;
            let (q, k) = (
                Rows::of(&p.q, sg.off_q, lq, h),
                Rows::of(&p.k, sg.off_kv, lk, hk),
            );
            let (v, dor) = (
                Rows::of(&p.v, sg.off_kv, lk, hk),
                Rows::of(d_o, sg.off_q, lq, h),
            );
            let s = scores32(a, (slot, h), &q, &k, lq, lk);
            let (bb, hb) = AttnBias::tensor_index(t, slot, h);
            for r in 0..lq {
                let sr = &s[r * lk..(r + 1) * lk];
                let m = sr.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                if m == f32::NEG_INFINITY {
                    continue;
                }
                let l = sr.iter().fold(0.0f32, |acc, &x| acc + (x - m).exp());
                let lse = m + l.ln();
                let pr: Vec<f32> = sr
                    .iter()
                    .map(|&x| {
                        if x == f32::NEG_INFINITY {
                            0.0
                        } else {
                            (x - lse).exp()
                        }
                    })
                    .collect();
                let dp: Vec<f32> = (0..lk)
                    .map(|c| {
                        let kept =
                            !a.dropout.is_active() || a.dropout.keep(slot, a.num_heads, h, r, c);
                        match (kept, a.dropout.is_active()) {
                            (false, _) => 0.0,
                            (true, true) => dot32(dor.row(r), v.row(c)) * rescale,
                            (true, false) => dot32(dor.row(r), v.row(c)),
                        }
                    })
                    .collect();
                let big_d = match o {
                    Some(o) => {
                        let row: Vec<f32> = o.slice(ndarray::s![sg.off_q + r, h, ..]).to_vec();
                        dot32(dor.row(r), &row)
                    }
                    None => pr.iter().zip(&dp).fold(0.0f32, |acc, (&x, &y)| acc + x * y),
                };
                for c in 0..lk {
                    acc[[bb, hb, r, c]] += pr[c] * (dp[c] - big_d);
                }
            }
        }
    }
    Some(acc.mapv(|x| dtype.round(x)))
}
