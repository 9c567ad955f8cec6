//! Case transformations shared by the metamorphic properties and the shrinker.

use crate::case::{Case, Outputs};
use crate::config::Bias;
use ndarray::{Array3, Axis};
use smallseq_reference::{AttnBias, Layout, Side};
use std::sync::Arc;

/// Rebuilds one side's buffer keeping only `rows` (in order), and the new side description.
fn gather(t: &Array3<f32>, rows: &[usize]) -> Array3<f32> {
    t.select(Axis(0), rows)
}

/// Per slot: (start, valid length, span) of one side.
fn spans(s: &Side) -> Vec<(usize, usize, usize)> {
    (0..s.slots())
        .map(|i| (s.offset(i), s.len(i), s.span(i)))
        .collect()
}

/// Keeps the slots `order` (in that order) with their padded spans; tail slack is kept.
/// Returns the new case and, per side, the old token of each new token.
pub fn select_slots(
    case: &Case,
    order: &[usize],
    keep_padding: bool,
) -> (Case, Vec<usize>, Vec<usize>) {
    let mut rows_q = Vec::new();
    let mut rows_k = Vec::new();
    let build = |side: &Side, rows: &mut Vec<usize>| -> Side {
        let sp = spans(side);
        let mut cu = vec![0i32];
        let mut off = vec![0i32];
        for &i in order {
            let (o, l, s) = sp[i];
            let take = if keep_padding { s } else { l };
            rows.extend(o..o + take);
            cu.push(cu.last().unwrap() + l as i32);
            off.push(off.last().unwrap() + take as i32);
        }
        let slack = if keep_padding {
            let end = *side.offsets().last().unwrap() as usize;
            rows.extend(end..side.tokens);
            side.tokens - end
        } else {
            0
        };
        Side {
            tokens: *off.last().unwrap() as usize + slack,
            padded: (keep_padding && side.padded.is_some()).then_some(off),
            cu,
        }
    };
    let q = build(&case.layout.q, &mut rows_q);
    let kv = build(&case.layout.kv, &mut rows_k);
    let mut c = case.clone();
    c.layout = Layout { q, kv };
    c.q = gather(&case.q, &rows_q);
    c.k = gather(&case.k, &rows_k);
    c.v = gather(&case.v, &rows_k);
    c.d_o = case.d_o.as_ref().map(|d| gather(d, &rows_q));
    // A bias with a plane per slot keeps the planes of the slots kept, in their new order.
    if let (AttnBias::PostScale(t), Bias::PostScale(shape)) =
        (&case.config.params.bias, &case.config.bias)
    {
        if shape.per_slot() {
            c.config.params.bias = AttnBias::PostScale(Arc::new(t.select(Axis(0), order)));
        }
    }
    c.outputs = Outputs::default();
    (c, rows_q, rows_k)
}

/// Removes the last valid token of slot `i` on one side (`q_side`), with its buffer row.
pub fn shorten_slot(case: &Case, i: usize, q_side: bool) -> Option<Case> {
    let side = if q_side {
        &case.layout.q
    } else {
        &case.layout.kv
    };
    if side.len(i) == 0 {
        return None;
    }
    let drop = side.offset(i) + side.len(i) - 1;
    let rows: Vec<usize> = (0..side.tokens).filter(|&t| t != drop).collect();
    let fix = |a: &[i32], from: usize| -> Vec<i32> {
        a.iter()
            .enumerate()
            .map(|(j, &x)| if j > from { x - 1 } else { x })
            .collect()
    };
    let mut s = side.clone();
    s.cu = fix(&side.cu, i);
    s.padded = side.padded.as_ref().map(|p| fix(p, i));
    s.tokens -= 1;
    let mut c = case.clone();
    if q_side {
        c.layout.q = s;
        c.q = gather(&case.q, &rows);
        c.d_o = case.d_o.as_ref().map(|d| gather(d, &rows));
    } else {
        c.layout.kv = s;
        c.k = gather(&case.k, &rows);
        c.v = gather(&case.v, &rows);
    }
    c.outputs = Outputs::default();
    Some(c)
}

/// Keeps the first `heads` query heads and the matching kv heads (H/Hkv unchanged).
pub fn reduce_heads(case: &Case, heads: usize) -> Option<Case> {
    let p = &case.config.params;
    let g = p.group_size();
    if heads >= p.num_heads || heads == 0 || !heads.is_multiple_of(g) {
        return None;
    }
    let kv = heads / g;
    let mut c = case.clone();
    c.config.params.num_heads = heads;
    c.config.params.num_kv_heads = kv;
    let cut = |t: &Array3<f32>, n: usize| t.slice(ndarray::s![.., ..n, ..]).to_owned();
    c.q = cut(&case.q, heads);
    c.k = cut(&case.k, kv);
    c.v = cut(&case.v, kv);
    c.d_o = case.d_o.as_ref().map(|d| cut(d, heads));
    // The bias of the heads kept: their planes (a per-head bias) or their slopes.
    c.config.params.bias = match &p.bias {
        AttnBias::PostScale(t) if t.dim().1 > 1 => AttnBias::PostScale(Arc::new(
            t.slice(ndarray::s![.., ..heads, .., ..]).to_owned(),
        )),
        AttnBias::Alibi(s) => AttnBias::Alibi(Arc::new(s[..heads].to_vec())),
        b => b.clone(),
    };
    c.outputs = Outputs::default();
    Some(c)
}

/// The MHA equivalent of a GQA case: K and V repeated over each group.
pub fn repeat_kv(case: &Case) -> Case {
    let p = &case.config.params;
    let g = p.group_size();
    let rows: Vec<usize> = (0..p.num_heads).map(|h| h / g).collect();
    let mut c = case.clone();
    c.config.params.num_kv_heads = p.num_heads;
    c.k = case.k.select(Axis(1), &rows);
    c.v = case.v.select(Axis(1), &rows);
    c.outputs = Outputs::default();
    c
}
