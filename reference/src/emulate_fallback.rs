//! f32 emulation of the fallback path's numerics, parameterised by a [`FallbackDesign`]: the
//! same-precision yardstick of the fallback, as [`crate::emulate`] is of the small-seq kernels.
//!
//! The design follows a flash-style fallback: an online softmax over key blocks (running max
//! `m` and sum `l` rescaled by `exp(m_old − m_new)` at each block, the P·V accumulator with
//! them), `o = acc / l` (times the dropout factor), backward recomputing P from the LSE in two
//! passes over the keys (D first, then dS), dK/dV per query head summed over the GQA group in
//! head order in f32. Where P is rounded to 16 bits before P·V or dV, and whether D is
//! rowsum(dO∘O) from the stored O, are the design's to say ([`FallbackDesign`]), so a
//! declared design of another implementation can be emulated by the same code.
//!
//! Dropout and bias as `docs/semantics.md` §1.8 and §1.9 give them: the row sum takes every
//! key, P·V only the kept ones, the factor `fl32(1/(1 − p))` on the kept dP and dV's P; the
//! bias's f32 value is added to each scaled score, a −∞ bias hides its key in the forward.

use crate::emulate::{dot32, EmuForward, EmuGradients, Rows};
use crate::problem::Problem;
use crate::slot::SlotGeom;
use crate::types::{visible, AttnParams, Dtype};
use ndarray::{s, Array2, Array3};

/// The numerics of a fallback implementation that its emulation follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FallbackDesign {
    /// Keys per block of the online softmax (the running max and sum are rescaled at each).
    pub key_block: usize,
    /// Whether the unnormalised `exp(s − m)` is rounded to the input dtype before P·V.
    pub p16_for_pv: bool,
    /// Whether P is rounded to the input dtype before dV = Pᵀ·dO.
    pub p16_for_dv: bool,
    /// Whether D = rowsum(dO∘O) is taken from the stored (dtype-rounded) O instead of Σ P·dP.
    pub delta_from_stored_o: bool,
}

impl FallbackDesign {
    /// The CPU backend's fallback (`src/backend/cpu/fallback.rs`): blocks of 64 keys, P kept in
    /// f32 for P·V and dV, D = Σ P·dP in f32.
    pub const CPU: FallbackDesign = FallbackDesign {
        key_block: 64,
        p16_for_pv: false,
        p16_for_dv: false,
        delta_from_stored_o: false,
    };
}

/// Dropout's factor of (slot, head, row, key): 1 without dropout, else the f32 rescale or 0.
fn factor(a: &AttnParams, slot: usize, h: usize, r: usize, c: usize) -> f32 {
    if !a.dropout.is_active() {
        1.0
    } else if a.dropout.keep(slot, a.num_heads, h, r, c) {
        a.dropout.rescale() as f32
    } else {
        0.0
    }
}

fn lane(t: &ndarray::ArrayView3<'_, f32>, row: usize, h: usize) -> Vec<f32> {
    t.slice(s![row, h, ..]).to_vec()
}

/// The keys and values of kv head `hk` of one slot, each row contiguous (read once per head,
/// not once per query row).
fn kv_rows(p: &Problem, sg: &SlotGeom, hk: usize) -> (Rows, Rows) {
    (
        Rows::of(&p.k, sg.off_kv, sg.lk, hk),
        Rows::of(&p.v, sg.off_kv, sg.lk, hk),
    )
}

/// The fallback's forward and, when `p.d_o` is present, backward, with the roundings of
/// `design` for inputs of type `dtype`. The backward recomputes P from this forward's LSE.
pub fn forward_backward(
    p: &Problem,
    dtype: Dtype,
    design: &FallbackDesign,
) -> (EmuForward, Option<EmuGradients>) {
    let a = &p.params;
    let (nh, nkv, dqk, dv) = (a.num_heads, a.num_kv_heads, a.head_dim_qk, a.head_dim_v);
    let (tq, tk) = (p.layout.q.tokens, p.layout.kv.tokens);
    let mut fwd = EmuForward {
        o: Array3::zeros((tq, nh, dv)),
        lse: Array2::from_elem((tq, nh), f32::NEG_INFINITY),
        o_acc: Array3::zeros((tq, nh, dv)),
    };
    let slots: Vec<SlotGeom> = (0..p.layout.slots())
        .map(|i| SlotGeom::of(p.layout, i))
        .collect();
    for (slot, sg) in slots.iter().enumerate() {
        for h in 0..nh {
            forward_head(p, dtype, design, (slot, sg), h, &mut fwd);
        }
    }
    let Some(d_o) = p.d_o.as_ref() else {
        return (fwd, None);
    };
    let mut grads = EmuGradients {
        dq: Array3::zeros((tq, nh, dqk)),
        dk: Array3::zeros((tk, nkv, dqk)),
        dv: Array3::zeros((tk, nkv, dv)),
        dv_acc: Array3::zeros((tk, nkv, dv)),
        ds_past_range: 0,
    };
    let g = a.group_size();
    for (slot, sg) in slots.iter().enumerate() {
        // Per query head partials of dK and dV, `[lk, H, D]`, summed over each group at the end.
        let mut dk = vec![0f32; sg.lk * nh * dqk];
        let mut dvv = vec![0f32; sg.lk * nh * dv];
        for h in 0..nh {
            let hk = h / g;
            let (kr, vr) = kv_rows(p, sg, hk);
            for i in 0..sg.lq {
                let t = sg.off_q + i;
                let lse = fwd.lse[[t, h]];
                if lse == f32::NEG_INFINITY {
                    continue;
                }
                let q = lane(&p.q, t, h);
                let dor = lane(d_o, t, h);
                let mut keys = Vec::new();
                for c in 0..sg.lk {
                    if !visible(a.mask, a.window, i, c, sg.lq, sg.lk) {
                        continue;
                    }
                    let b = a.bias.at32(slot, h, i, c, sg.lq, sg.lk);
                    let pr = (dot32(&q, kr.row(c)) * a.scale as f32 + b - lse).exp();
                    let z = factor(a, slot, h, i, c);
                    let dp = if z == 0.0 {
                        0.0
                    } else {
                        dot32(&dor, vr.row(c)) * z
                    };
                    keys.push((c, pr, dp, z));
                }
                let delta: f32 = if design.delta_from_stored_o {
                    dot32(&dor, &fwd.o.slice(s![t, h, ..]).to_vec())
                } else {
                    keys.iter().map(|(_, pr, dp, _)| pr * dp).sum()
                };
                let scale = a.scale as f32;
                let mut dq = vec![0f32; dqk];
                for (c, pr, dp, z) in keys {
                    let ds = pr * (dp - delta);
                    dq.iter_mut()
                        .zip(kr.row(c))
                        .for_each(|(x, kk)| *x += ds * kk);
                    let at = (c * nh + h) * dqk;
                    dk[at..at + dqk]
                        .iter_mut()
                        .zip(&q)
                        .for_each(|(x, qq)| *x += scale * ds * qq);
                    let pv = if design.p16_for_dv {
                        dtype.round(pr)
                    } else {
                        pr
                    };
                    let at = (c * nh + h) * dv;
                    dvv[at..at + dv]
                        .iter_mut()
                        .zip(&dor)
                        .for_each(|(x, o)| *x += pv * z * o);
                }
                for (j, x) in dq.into_iter().enumerate() {
                    grads.dq[[t, h, j]] = dtype.round(x * scale);
                }
            }
        }
        for c in 0..sg.lk {
            for hk in 0..nkv {
                let group = hk * g..(hk + 1) * g;
                for j in 0..dqk {
                    let sum: f32 = group.clone().map(|h| dk[(c * nh + h) * dqk + j]).sum();
                    grads.dk[[sg.off_kv + c, hk, j]] = dtype.round(sum);
                }
                for j in 0..dv {
                    let sum: f32 = group.clone().map(|h| dvv[(c * nh + h) * dv + j]).sum();
                    grads.dv[[sg.off_kv + c, hk, j]] = dtype.round(sum);
                    grads.dv_acc[[sg.off_kv + c, hk, j]] = sum;
                }
            }
        }
    }
    (fwd, Some(grads))
}

/// The online softmax of query head `h` of one slot: `o`, its accumulator and the LSE.
fn forward_head(
    p: &Problem,
    dtype: Dtype,
    design: &FallbackDesign,
    (slot, sg): (usize, &SlotGeom),
    h: usize,
    fwd: &mut EmuForward,
) {
    let a = &p.params;
    let hk = h / a.group_size();
    let dv = a.head_dim_v;
    let block = design.key_block.max(1);
    let (kr, vr) = kv_rows(p, sg, hk);
    for i in 0..sg.lq {
        let t = sg.off_q + i;
        let q = lane(&p.q, t, h);
        let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
        let mut acc = vec![0f32; dv];
        for start in (0..sg.lk).step_by(block) {
            let s: Vec<(usize, f32)> = (start..(start + block).min(sg.lk))
                .filter(|&c| visible(a.mask, a.window, i, c, sg.lq, sg.lk))
                .map(|c| {
                    let sc = dot32(&q, kr.row(c)) * a.scale as f32;
                    (c, sc + a.bias.at32(slot, h, i, c, sg.lq, sg.lk))
                })
                .filter(|&(_, x)| x != f32::NEG_INFINITY)
                .collect();
            if s.is_empty() {
                continue;
            }
            let m_new = s.iter().fold(m, |x, &(_, y)| x.max(y));
            let alpha = if m == f32::NEG_INFINITY {
                0.0
            } else {
                (m - m_new).exp()
            };
            l *= alpha;
            acc.iter_mut().for_each(|x| *x *= alpha);
            for (c, sc) in s {
                let e = (sc - m_new).exp();
                l += e;
                if factor(a, slot, h, i, c) == 0.0 {
                    continue;
                }
                let e = if design.p16_for_pv { dtype.round(e) } else { e };
                acc.iter_mut()
                    .zip(vr.row(c))
                    .for_each(|(x, vv)| *x += e * vv);
            }
            m = m_new;
        }
        if l > 0.0 {
            for (j, x) in acc.iter().enumerate() {
                let o = if a.dropout.is_active() {
                    x / l * a.dropout.rescale() as f32
                } else {
                    x / l
                };
                fwd.o[[t, h, j]] = dtype.round(o);
                fwd.o_acc[[t, h, j]] = o;
            }
            fwd.lse[[t, h]] = m + l.ln();
        }
    }
}
