//! A second f64 implementation in plain loops (slot, head, row, key), sharing nothing with
//! the main one but [`visible`]: no slicing helper, no matrix products, each value read
//! straight from the THD buffers. Slow; it exists to be compared against.

use crate::attention::{Forward, Gradients};
use crate::bias::AttnBias;
use crate::problem::Problem;
use crate::types::visible;
use ndarray::{Array2, Array3, Array4};

/// Forward pass, and the gradients when `p.d_o` is present.
pub fn forward_backward(p: &Problem) -> (Forward, Option<Gradients>) {
    let a = p.params;
    let (nh, nkv, dqk, dv) = (a.num_heads, a.num_kv_heads, a.head_dim_qk, a.head_dim_v);
    let (tq, tk) = (p.layout.q.tokens, p.layout.kv.tokens);
    let g = nh / nkv;
    let mut o = Array3::<f64>::zeros((tq, nh, dv));
    let mut lse = Array2::<f64>::from_elem((tq, nh), f64::NEG_INFINITY);
    let mut grads = p.d_o.map(|_| Gradients {
        dq: Array3::zeros((tq, nh, dqk)),
        dk: Array3::zeros((tk, nkv, dqk)),
        dv: Array3::zeros((tk, nkv, dv)),
        dbias: a.bias.grad_shape().map(Array4::zeros),
    });
    let x = |t: &ndarray::ArrayView3<f32>, i: usize, h: usize, d: usize| f64::from(t[[i, h, d]]);

    for slot in 0..p.layout.slots() {
        let (lq, lk) = (p.layout.q.len(slot), p.layout.kv.len(slot));
        let (oq, ok) = (p.layout.q.offset(slot), p.layout.kv.offset(slot));
        for h in 0..nh {
            let hk = h / g;
            for r in 0..lq {
                let tq_ = oq + r;
                // Logits of the visible keys only, as (key, s).
                let mut logits = Vec::new();
                for c in 0..lk {
                    if visible(a.mask, a.window, r, c, lq, lk) {
                        let mut dot = 0.0;
                        for d in 0..dqk {
                            dot += x(&p.q, tq_, h, d) * x(&p.k, ok + c, hk, d);
                        }
                        let s = a.scale * dot + a.bias.at(slot, h, r, c, lq, lk);
                        // A -inf bias hides the key (docs/semantics.md §1.9).
                        if s != f64::NEG_INFINITY {
                            logits.push((c, s));
                        }
                    }
                }
                if logits.is_empty() {
                    continue;
                }
                let m = logits
                    .iter()
                    .map(|&(_, s)| s)
                    .fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = logits.iter().map(|&(_, s)| (s - m).exp()).sum();
                lse[[tq_, h]] = m + l.ln();
                let probs: Vec<(usize, f64)> = logits
                    .iter()
                    .map(|&(c, s)| (c, (s - m).exp() / l))
                    .collect();
                // Dropout's factor of each visible key: 1 without dropout.
                let z: Vec<f64> = probs
                    .iter()
                    .map(|&(c, _)| a.dropout.factor(slot, nh, h, r, c))
                    .collect();
                for d in 0..dv {
                    o[[tq_, h, d]] = probs
                        .iter()
                        .zip(&z)
                        .map(|(&(c, pc), zc)| pc * zc * x(&p.v, ok + c, hk, d))
                        .sum();
                }

                let (Some(gr), Some(d_o)) = (grads.as_mut(), p.d_o.as_ref()) else {
                    continue;
                };
                let dps: Vec<f64> = probs
                    .iter()
                    .zip(&z)
                    .map(|(&(c, _), zc)| {
                        zc * (0..dv)
                            .map(|d| x(d_o, tq_, h, d) * x(&p.v, ok + c, hk, d))
                            .sum::<f64>()
                    })
                    .collect();
                let big_d: f64 = probs
                    .iter()
                    .zip(&dps)
                    .map(|(&(_, pc), &dpc)| pc * dpc)
                    .sum();
                for ((&(c, pc), &dpc), zc) in probs.iter().zip(&dps).zip(&z) {
                    let ds = pc * (dpc - big_d);
                    if let (Some(db), AttnBias::PostScale(t)) = (gr.dbias.as_mut(), &a.bias) {
                        let (bb, hb) = AttnBias::tensor_index(t, slot, h);
                        db[[bb, hb, r, c]] += ds;
                    }
                    for d in 0..dqk {
                        gr.dq[[tq_, h, d]] += a.scale * ds * x(&p.k, ok + c, hk, d);
                        gr.dk[[ok + c, hk, d]] += a.scale * ds * x(&p.q, tq_, h, d);
                    }
                    for d in 0..dv {
                        gr.dv[[ok + c, hk, d]] += pc * zc * x(d_o, tq_, h, d);
                    }
                }
            }
        }
    }
    (Forward { o, lse }, grads)
}
