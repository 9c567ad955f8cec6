//! The fallback path on the CPU: flash-style online softmax over key blocks of 64 in f32 for
//! any lengths, GQA/MQA, every mask and window and every dtype. Backward recomputes P from
//! the LSE in two passes over the keys (D = Σ P·dP first, then dS; or, with `d_from_o`,
//! D = rowsum(dO∘O) from the O passed in, `docs/semantics.md` §1.7), and sums dK/dV over a
//! GQA group deterministically through per-query-head accumulators in the workspace.
//!
//! Dropout (`docs/semantics.md` §1.8) as FlashAttention applies it: the row sum `l` takes
//! every key, P·V only the kept ones, and `1/(1 − p)` multiplies the finished O; backward
//! masks and rescales dP and dV's P, and D = Σ P·dP stays rowsum(dO ∘ O).
//!
//! A bias (`docs/semantics.md` §1.9) is added to each f32 score after the scale; dBias sums
//! the f32 dS of the slots and heads sharing an entry.

use super::rows::HeadRows;
use super::sums::{add, axpy, sum, Losses};
use super::{CpuBackend, SlotBwd, SlotFwd, SlotGeom};
use crate::backend::{BwdArgs, BwdBufs, DevBuf, FwdArgs, FwdBufs};
use crate::error::Result;
use crate::mutants::Mutant;
use crate::workspace::names;
use ndarray::Array4;
use rayon::prelude::*;
use smallseq_reference::{AttnBias, Dtype};

/// Keys per block of the online softmax.
const BLOCK: usize = 64;

pub(super) fn forward(be: &CpuBackend, a: &FwdArgs, out: &mut FwdBufs) -> Result<()> {
    let p = &a.config.params;
    let (heads, dv) = (p.num_heads, p.head_dim_v);
    let dt = a.config.dtype;
    let scale = be.scale(p);
    let slots: Vec<SlotGeom> = (0..a.layout.slots())
        .map(|i| be.slot(a.layout, i))
        .collect();
    let rescale = p.dropout.rescale() as f32;
    let loss = Losses::fallback(be, dt);
    let results: Vec<SlotFwd> = slots
        .par_iter()
        .enumerate()
        .map(|(slot, g)| {
            let mut r = SlotFwd::new(g, heads, dv);
            // Buffers of one slot, reused by every head and row.
            let mut qk = vec![0f32; g.lk];
            let mut s: Vec<(usize, f32)> = Vec::with_capacity(BLOCK);
            let mut acc = vec![0f32; dv];
            for h in 0..heads {
                if g.lq == 0 {
                    break;
                }
                let hk = be.kv_head(p, h);
                let keys = HeadRows::load(be, dt, &a.k, g.ok, g.lk, hk);
                let vals = HeadRows::load(be, dt, &a.v, g.ok, g.lk, hk);
                for i in 0..g.lq {
                    let q = be.load(dt, &a.q, g.oq + i, h);
                    keys.dots(&q, &mut qk);
                    let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
                    acc.fill(0.0);
                    for start in (0..g.lk).step_by(BLOCK) {
                        let keys = start..(start + BLOCK).min(g.lk);
                        // A -inf bias hides its key as the mask does (§1.9).
                        s.clear();
                        s.extend(
                            keys.filter(|&c| be.visible(p, i, c, g.lq, g.lk))
                                .map(|c| (c, qk[c] * scale + be.bias(p, slot, h, i, c, g)))
                                .filter(|&(_, s)| s != f32::NEG_INFINITY),
                        );
                        if s.is_empty() {
                            continue;
                        }
                        let bmax = s.iter().fold(f32::NEG_INFINITY, |x, &(_, y)| x.max(y));
                        let m_new = if be.has(Mutant::NoMaxSubtraction) {
                            0.0
                        } else {
                            m.max(bmax)
                        };
                        let alpha = if m == f32::NEG_INFINITY {
                            0.0
                        } else {
                            (m - m_new).exp()
                        };
                        l *= alpha;
                        acc.iter_mut().for_each(|x| *x *= alpha);
                        for &(c, sc) in &s {
                            let e = (sc - m_new).exp();
                            l = add(l, e, loss.rowsum);
                            if be.dropout_factor(p, slot, h, i, c) == 0.0 {
                                continue;
                            }
                            axpy(&mut acc, e, vals.row(c), loss.pv);
                        }
                        m = m_new;
                    }
                    let base = (i * heads + h) * dv;
                    if l > 0.0 {
                        let off = if be.has(Mutant::FallbackSmallShapes2x) && g.lk <= 17 {
                            2.0
                        } else {
                            1.0
                        };
                        let orow = &mut r.o[base..base + dv];
                        for (y, &x) in orow.iter_mut().zip(&acc) {
                            let o = if p.dropout.is_active() {
                                x / l * rescale
                            } else {
                                x / l
                            };
                            *y = off * o;
                        }
                        be.store_all(dt, orow);
                    } else if be.has(Mutant::NanOnEmptyKv) && g.lk == 0 {
                        r.o[base..base + dv].fill(f32::NAN);
                    }
                    r.lse[i * heads + h] = be.lse_of(m, l);
                }
            }
            r
        })
        .collect();
    for (g, r) in slots.iter().zip(results) {
        r.store(out, g, heads, dv, |_| true);
    }
    Ok(())
}

pub(super) fn backward(be: &CpuBackend, a: &BwdArgs, out: &mut BwdBufs) -> Result<()> {
    let f = &a.fwd;
    let p = &f.config.params;
    let (heads, kv_heads, d, dvd) = (p.num_heads, p.num_kv_heads, p.head_dim_qk, p.head_dim_v);
    let dt = f.config.dtype;
    let tq = f.layout.q.tokens;
    let scale = be.scale(p);
    let qscale = if be.has(Mutant::DqScaleMissing) {
        1.0
    } else {
        scale
    };
    let lse_flat: Vec<f32> = a.lse.iter().copied().collect();
    let slots: Vec<SlotGeom> = (0..f.layout.slots())
        .map(|i| be.slot(f.layout, i))
        .collect();
    let loss = Losses::fallback(be, dt);
    let results: Vec<SlotBwd> = slots
        .par_iter()
        .enumerate()
        .map(|(slot, g)| {
            let mut r = SlotBwd::new(g, heads, d, dvd);
            // dS of every (head, row, key), for dBias (§1.9).
            r.ds = p.bias.grad_shape().map(|_| vec![0f32; heads * g.lq * g.lk]);
            // Buffers of one slot, reused by every head and row.
            let (mut qk, mut dov) = (vec![0f32; g.lk], vec![0f32; g.lk]);
            let mut keys: Vec<(usize, f32, f32, f32)> = Vec::with_capacity(g.lk);
            let mut dq = vec![0f32; d];
            for h in 0..heads {
                if g.lq == 0 {
                    break;
                }
                let hk = be.kv_head(p, h);
                let k_rows = HeadRows::load(be, dt, &f.k, g.ok, g.lk, hk);
                let v_rows = HeadRows::load(be, dt, &f.v, g.ok, g.lk, hk);
                for i in 0..g.lq {
                    let t = g.oq + i;
                    let lse = lse_flat[be.lse_index(t, h, tq, heads)];
                    if lse == f32::NEG_INFINITY {
                        continue;
                    }
                    let q = be.load(dt, &f.q, t, h);
                    let d_o = be.load(dt, &a.d_o, t, h);
                    k_rows.dots(&q, &mut qk);
                    v_rows.dots(&d_o, &mut dov);
                    // First pass: P and dP per visible key, and D = Σ P·dP in f32 (rowsum(dO∘O)
                    // from the bf16-rounded O costs the gradients several bits: that form only
                    // under `d_from_o`, as the GPU kernels' FTB_D_FROM_O).
                    keys.clear();
                    for c in 0..g.lk {
                        if !(be.has(Mutant::BwdMaskIgnored) || be.visible(p, i, c, g.lq, g.lk)) {
                            continue;
                        }
                        let pr = (qk[c] * scale + be.bias(p, slot, h, i, c, g) - lse).exp();
                        let z = be.dropout_factor(p, slot, h, i, c);
                        let dp = if z == 0.0 { 0.0 } else { dov[c] * z };
                        keys.push((c, pr, dp, z));
                    }
                    let delta = if be.d_from_o {
                        // The second form of docs/semantics.md §1.7, in the emulation's order
                        // (`dot32`: from +0, products rounded before each add).
                        let o = be.load(dt, &a.o, t, h);
                        d_o.iter()
                            .zip(&o)
                            .fold(0.0, |acc, (x, y)| add(acc, x * y, loss.delta))
                    } else {
                        sum(keys.iter().map(|(_, pr, dp, _)| pr * dp), loss.delta)
                    };
                    r.delta[i * heads + h] = delta;
                    dq.fill(0.0);
                    for &(c, pr, dp, z) in &keys {
                        let ds = pr * (dp - delta);
                        if let Some(db) = r.ds.as_mut() {
                            db[(h * g.lq + i) * g.lk + c] = ds;
                        }
                        axpy(&mut dq, ds, k_rows.row(c), loss.dq);
                        let at = (c * heads + h) * d;
                        axpy(&mut r.dk[at..at + d], scale * ds, &q, loss.dk);
                        let at = (c * heads + h) * dvd;
                        axpy(&mut r.dv[at..at + dvd], pr * z, &d_o, loss.dv);
                    }
                    let at = (i * heads + h) * d;
                    let dst = &mut r.dq[at..at + d];
                    dst.iter_mut().zip(&dq).for_each(|(y, &x)| *y = x * qscale);
                    be.store_all(dt, dst);
                }
            }
            r
        })
        .collect();
    if let (Some(buf), AttnBias::PostScale(t)) = (out.dbias.as_mut(), &p.bias) {
        store_dbias(be, t, dt, &slots, &results, buf);
    }
    let region = |name| f.plan.region(name).map(|r| r.offset);
    let (delta_at, dk_at, dv_at) = (
        region(names::DELTA),
        region(names::DK_ACC),
        region(names::DV_ACC),
    );
    let g_size = p.group_size();
    // The query heads each kv head sums, in head order.
    let members: Vec<Vec<usize>> = (0..kv_heads)
        .map(|hk| {
            let group = hk * g_size..(hk + 1) * g_size;
            if be.has(Mutant::GqaNoSum) {
                vec![group.end - 1]
            } else {
                group.collect()
            }
        })
        .collect();
    let mut sums = Vec::with_capacity(d.max(dvd));
    for (g, r) in slots.iter().zip(&results) {
        r.store_q_side(out, g, heads, d, delta_at);
        if g.lq == 0 && be.has(Mutant::EmptyQSlotSkipsDkDv) {
            continue;
        }
        for c in 0..g.lk {
            let tk = g.ok + c;
            // Per-query-head partials go through the workspace, then each kv head sums its
            // group in head order: deterministic whatever the thread schedule.
            if let (Some(dk_base), Some(dv_base)) = (dk_at, dv_at) {
                for h in 0..heads {
                    for j in 0..d {
                        out.workspace.put(
                            dk_base + (tk * heads + h) * d + j,
                            r.dk[(c * heads + h) * d + j],
                        );
                    }
                    for j in 0..dvd {
                        out.workspace.put(
                            dv_base + (tk * heads + h) * dvd + j,
                            r.dv[(c * heads + h) * dvd + j],
                        );
                    }
                }
            }
            for (hk, members) in members.iter().enumerate() {
                sums.clear();
                sums.extend((0..d).map(|j| -> f32 {
                    members
                        .iter()
                        .map(|&h| match dk_at {
                            Some(base) => out.workspace.at(base + (tk * heads + h) * d + j),
                            None => r.dk[(c * heads + h) * d + j],
                        })
                        .sum()
                }));
                be.store_all(dt, &mut sums);
                for (j, &x) in sums.iter().enumerate() {
                    out.dk.put((tk * kv_heads + hk) * d + j, x);
                }
                sums.clear();
                sums.extend((0..dvd).map(|j| -> f32 {
                    members
                        .iter()
                        .map(|&h| match dv_at {
                            Some(base) => out.workspace.at(base + (tk * heads + h) * dvd + j),
                            None => r.dv[(c * heads + h) * dvd + j],
                        })
                        .sum()
                }));
                be.store_all(dt, &mut sums);
                for (j, &x) in sums.iter().enumerate() {
                    out.dv.put((tk * kv_heads + hk) * dvd + j, x);
                }
            }
        }
    }
    Ok(())
}

/// dBias: each slot's dS summed in f32 into the entries it reads, in slot then head order
/// (deterministic), rounded to the input type once; entries no slot reads are 0.
fn store_dbias(
    be: &CpuBackend,
    t: &Array4<f32>,
    dt: Dtype,
    slots: &[SlotGeom],
    results: &[SlotBwd],
    out: &mut DevBuf,
) {
    let (bb, hb, sq, sk) = t.dim();
    let mut acc = vec![0f32; bb * hb * sq * sk];
    for (slot, (g, r)) in slots.iter().zip(results).enumerate() {
        let Some(ds) = &r.ds else { continue };
        for h in 0..ds.len() / (g.lq * g.lk).max(1) {
            let (b, hh) = AttnBias::tensor_index(t, slot, h);
            for i in 0..g.lq {
                for c in 0..g.lk {
                    acc[((b * hb + hh) * sq + i) * sk + c] += ds[(h * g.lq + i) * g.lk + c];
                }
            }
        }
    }
    let body = out.body_mut();
    let n = body.len().min(acc.len());
    body[..n].copy_from_slice(&acc[..n]);
    be.store_all(dt, &mut body[..n]);
}
