//! The small-seq path on the CPU: one (slot, head) at a time on 16×16 tiles (two per side,
//! 32 rows and 32 columns of capacity), with the roundings of te-smallseq-path.md §4.4:
//! f32 accumulation, the scale applied once after the dot product, P and dS rounded to the
//! input dtype before the second products, outputs rounded at store, D = Σ P·dP.

use super::rows::HeadRows;
use super::sums::{axpy, sum, Losses};
use super::{CpuBackend, SlotBwd, SlotFwd, SlotGeom};
use crate::backend::{BackendInfo, BwdArgs, BwdBufs, FwdArgs, FwdBufs};
use crate::error::{Error, Result};
use crate::mutants::Mutant;
use crate::workspace::names;
use rayon::prelude::*;
use smallseq_reference::{ds_scale, Dtype};

/// Rows (and columns) per tile.
const TILE: usize = 16;
/// Tiles per side.
const TILES: usize = 2;
/// Key columns whose P the backward keeps for dV (TE's `Config::max_seq_kv`).
const P_STORE_COLS: usize = 17;

fn capacity_error(i: usize, g: &SlotGeom) -> Error {
    Error::Backend {
        backend: "cpu".into(),
        detail: format!(
            "small-seq kernel: slot {i} has lq = {}, lk = {} past the {} x {} tile capacity",
            g.lq,
            g.lk,
            TILE * TILES,
            TILE * TILES
        ),
    }
}

/// Scores, softmax statistics and P of one (slot, head), as the forward kernel forms them.
struct Tile {
    /// `s[r][c]`, `None` where masked.
    s: Vec<Vec<Option<f32>>>,
    m: Vec<f32>,
    l: Vec<f32>,
}

fn scores(
    be: &CpuBackend,
    a: &FwdArgs,
    g: &SlotGeom,
    h: usize,
    hk: usize,
) -> Vec<Vec<Option<f32>>> {
    let p = &a.config.params;
    let dt = a.config.dtype;
    let scale = be.scale(p);
    let keys = HeadRows::load(be, dt, &a.k, g.ok, g.lk, hk);
    let mut qk = vec![0f32; g.lk];
    (0..g.lq)
        .map(|r| {
            let q = be.load(dt, &a.q, g.oq + r, h);
            keys.dots(&q, &mut qk);
            (0..g.lk)
                .map(|c| {
                    let dropped = be.has(Mutant::LastTileDropped) && c >= TILE;
                    (be.visible(p, r, c, g.lq, g.lk) && !dropped).then(|| qk[c] * scale)
                })
                .collect()
        })
        .collect()
}

fn softmax_stats(be: &CpuBackend, s: Vec<Vec<Option<f32>>>, loss: &Losses) -> Tile {
    let mut m = Vec::with_capacity(s.len());
    let mut l = Vec::with_capacity(s.len());
    for row in &s {
        let seen = if be.has(Mutant::SoftmaxFirstTileMax)
            && row[..row.len().min(TILE)].iter().any(Option::is_some)
        {
            &row[..row.len().min(TILE)]
        } else {
            &row[..]
        };
        let mx = seen
            .iter()
            .flatten()
            .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mx = if be.has(Mutant::NoMaxSubtraction) && mx > f32::NEG_INFINITY {
            0.0
        } else {
            mx
        };
        // Per-tile partial sums, tile 0 then tile 1, as the kernel's butterflies produce them.
        let total = sum(
            row.chunks(TILE)
                .map(|t| sum(t.iter().flatten().map(|&x| (x - mx).exp()), loss.rowsum)),
            loss.rowsum,
        );
        m.push(mx);
        l.push(total);
    }
    Tile { s, m, l }
}

/// The small-seq kernels compute no dropout, as TE's do not (the gate sends such calls to the
/// fallback); a launch forced onto them is refused rather than answered without the mask.
fn refuse_dropout(p: &smallseq_reference::AttnParams) -> Result<()> {
    if !p.bias.is_none() {
        return Err(crate::error::Error::Unsupported(format!(
            "bias = {}: the small-seq kernels do not compute bias (docs/semantics.md §1.9)",
            p.bias.name()
        )));
    }
    if p.dropout.is_active() {
        return Err(crate::error::Error::Unsupported(format!(
            "dropout = {}: the small-seq kernels do not compute dropout (docs/semantics.md §1.8)",
            p.dropout.p
        )));
    }
    Ok(())
}

pub(super) fn forward(be: &CpuBackend, a: &FwdArgs, out: &mut FwdBufs) -> Result<()> {
    let p = &a.config.params;
    refuse_dropout(p)?;
    let (heads, dv) = (p.num_heads, p.head_dim_v);
    let dt = a.config.dtype;
    let b = a.layout.slots();
    if b == 0 && be.has(Mutant::UninitWorkspaceOnEmpty) {
        let junk = out.workspace.data[out.workspace.base];
        out.o.body_mut().fill(junk);
        out.lse.body_mut().fill(junk);
        return Ok(());
    }
    let slots: Vec<SlotGeom> = (0..b).map(|i| be.slot(a.layout, i)).collect();
    let loss = Losses::small_seq(be, dt);
    if let Some((i, g)) = slots
        .iter()
        .enumerate()
        .find(|(_, g)| g.lq > TILE * TILES || g.lk > TILE * TILES)
    {
        return Err(capacity_error(i, g));
    }
    let results: Vec<SlotFwd> = slots
        .par_iter()
        .map(|g| {
            let mut res = SlotFwd::new(g, heads, dv);
            for h in 0..heads {
                let hk = be.kv_head(p, h);
                let vals: Vec<Vec<f32>> = (0..g.lk)
                    .map(|c| {
                        let row = if be.has(Mutant::NeighbourSlotRead)
                            && c + 1 == g.lk
                            && g.next_ok < a.v.shape()[0]
                        {
                            g.next_ok
                        } else {
                            g.ok + c
                        };
                        be.load(dt, &a.v, row, hk)
                    })
                    .collect();
                let t = softmax_stats(be, scores(be, a, g, h, hk), &loss);
                for r in 0..g.lq {
                    res.lse[r * heads + h] = be.lse_of(t.m[r], t.l[r]);
                    let orow = &mut res.o[(r * heads + h) * dv..(r * heads + h + 1) * dv];
                    if t.l[r] == 0.0 {
                        if be.has(Mutant::NanOnEmptyKv) && g.lk == 0 {
                            orow.fill(f32::NAN);
                        }
                        continue;
                    }
                    let rcp = 1.0 / t.l[r];
                    let mut acc = vec![0f32; dv];
                    for (c, s) in t.s[r].iter().enumerate() {
                        let Some(s) = s else { continue };
                        let pr = (s - t.m[r]).exp() * rcp;
                        let pr = if be.has(Mutant::PNotRounded) {
                            pr
                        } else {
                            dt.round(pr)
                        };
                        axpy(&mut acc, pr, &vals[c], loss.pv);
                    }
                    orow.iter_mut()
                        .zip(acc)
                        .for_each(|(y, x)| *y = be.toward_zero(dt, x));
                    be.store_all(dt, orow);
                }
            }
            res
        })
        .collect();
    let lose_second_tile = be.has(Mutant::LseSecondTileLost);
    for (g, r) in slots.iter().zip(results) {
        r.store(out, g, heads, dv, |t| !(lose_second_tile && t >= TILE));
    }
    Ok(())
}

pub(super) fn backward(be: &CpuBackend, a: &BwdArgs, out: &mut BwdBufs) -> Result<()> {
    let f = &a.fwd;
    let p = &f.config.params;
    refuse_dropout(p)?;
    let (heads, d, dvd) = (p.num_heads, p.head_dim_qk, p.head_dim_v);
    let dt = f.config.dtype;
    let tq = f.layout.q.tokens;
    let scale = be.scale(p);
    if p.num_heads != p.num_kv_heads {
        return Err(Error::Backend {
            backend: be.name().into(),
            detail: format!(
                "small-seq backward needs H == Hkv, got {} and {}",
                p.num_heads, p.num_kv_heads
            ),
        });
    }
    let slots: Vec<SlotGeom> = (0..f.layout.slots())
        .map(|i| be.slot(f.layout, i))
        .collect();
    if let Some((i, g)) = slots
        .iter()
        .enumerate()
        .find(|(_, g)| g.lq > TILE * TILES || g.lk > TILE * TILES)
    {
        return Err(capacity_error(i, g));
    }
    let lse_flat: Vec<f32> = a.lse.iter().copied().collect();
    let loss = Losses::small_seq(be, dt);
    let results: Vec<SlotBwd> = slots
        .par_iter()
        .map(|g| {
            let mut r = SlotBwd::new(g, heads, d, dvd);
            for h in 0..heads {
                let hk = be.kv_head(p, h);
                let q = HeadRows::load(be, dt, &f.q, g.oq, g.lq, h);
                let k = HeadRows::load(be, dt, &f.k, g.ok, g.lk, hk);
                let v = HeadRows::load(be, dt, &f.v, g.ok, g.lk, hk);
                let d_o = HeadRows::load(be, dt, &a.d_o, g.oq, g.lq, h);
                let mut qk = vec![0f32; g.lk];
                let mut dp = vec![0f32; g.lk];
                // P, dP and dS of every row first: the kernel scales each 16 x 16 block of dS
                // into the type's range by a power of two (ds_scale.rs).
                let (lq, lk) = (g.lq, g.lk);
                let mut pr = vec![0f32; lq * lk];
                let mut raw = vec![0f32; lq * lk];
                for i in 0..lq {
                    let lse = lse_flat[be.lse_index(g.oq + i, h, tq, heads)];
                    k.dots(q.row(i), &mut qk);
                    for c in 0..lk {
                        let vis = be.has(Mutant::BwdMaskIgnored) || be.visible(p, i, c, lq, lk);
                        if vis && lse != f32::NEG_INFINITY {
                            pr[i * lk + c] = (qk[c] * scale - lse).exp();
                        }
                    }
                    let pi = &pr[i * lk..(i + 1) * lk];
                    v.dots(d_o.row(i), &mut dp);
                    let delta = sum(pi.iter().zip(&dp).map(|(x, y)| x * y), loss.delta);
                    r.delta[i * heads + h] = delta;
                    for c in 0..lk {
                        raw[i * lk + c] = pi[c] * (dp[c] - delta);
                    }
                }
                let ds_op = if be.has(Mutant::F16DsUnclamped) && dt == Dtype::F16 {
                    raw.iter().map(|&x| dt.round(x)).collect()
                } else {
                    ds_scale::operands(dt, &raw, lq, lk)
                };
                for i in 0..lq {
                    let qscale = if be.has(Mutant::DqScaleMissing) {
                        1.0
                    } else {
                        scale
                    };
                    let mut dq = vec![0f32; d];
                    let d_o16: Vec<f32> = d_o.row(i).iter().map(|&o| dt.round(o)).collect();
                    for c in 0..lk {
                        let ds = ds_op[i * lk + c];
                        axpy(&mut dq, ds, k.row(c), loss.dq);
                        let dk = &mut r.dk[(c * heads + h) * d..(c * heads + h + 1) * d];
                        axpy(dk, ds, q.row(i), loss.dk);
                        if c < P_STORE_COLS {
                            let pv = dt.round(pr[i * lk + c]);
                            let dv = &mut r.dv[(c * heads + h) * dvd..(c * heads + h + 1) * dvd];
                            axpy(dv, pv, &d_o16, loss.dv);
                        }
                    }
                    let dst = &mut r.dq[(i * heads + h) * d..(i * heads + h + 1) * d];
                    // 1.5 ulps: 3 unit roundoffs.
                    let bias = if be.has(Mutant::DqUlpBias) {
                        1.0 + 3.0 * dt.unit_roundoff() as f32
                    } else {
                        1.0
                    };
                    dst.iter_mut()
                        .zip(dq)
                        .for_each(|(y, x)| *y = be.toward_zero(dt, x * qscale * bias));
                    be.store_all(dt, dst);
                }
            }
            r.dk.iter_mut()
                .for_each(|x| *x = be.toward_zero(dt, *x * scale));
            be.store_all(dt, &mut r.dk);
            r.dv.iter_mut().for_each(|x| *x = be.toward_zero(dt, *x));
            be.store_all(dt, &mut r.dv);
            if be.has(Mutant::ZeroedSmallRow) && g.lk >= 2 {
                let at = ((g.lk - 1) * heads + heads - 1) * d;
                r.dk[at..at + d].fill(0.0);
            }
            r
        })
        .collect();
    let delta_at = f.plan.region(names::DELTA).map(|r| r.offset);
    for (g, r) in slots.iter().zip(results) {
        r.store_q_side(out, g, heads, d, delta_at);
        if g.lq == 0 && be.has(Mutant::EmptyQSlotSkipsDkDv) {
            continue;
        }
        for c in 0..g.lk {
            for (j, x) in r.dk[c * heads * d..(c + 1) * heads * d].iter().enumerate() {
                out.dk.put((g.ok + c) * heads * d + j, *x);
            }
            for (j, x) in r.dv[c * heads * dvd..(c + 1) * heads * dvd]
                .iter()
                .enumerate()
            {
                out.dv.put((g.ok + c) * heads * dvd + j, *x);
            }
        }
    }
    Ok(())
}
