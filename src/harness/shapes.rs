//! Production-shaped geometries for the native campaign: the head counts, GQA groups and head
//! dims of real models (H and Hkv up to 128, groups 1–16, D 64/128/256, bf16/f16), with slot
//! counts scaled so that a case's work stays near the rest of the campaign's. With one group
//! (H == Hkv) they run on the small-seq path; GQA groups take the fallback and reach its head
//! indexing at production counts.

use super::geometry::{with_data, Geometry};
use super::rng::Draw;
use crate::case::bshd_layout;
use crate::config::{AttnConfig, LayoutKind};
use smallseq_reference::{Dtype, Layout, Mask, Side, Window};

/// Elements per side (tokens × heads × head dim) a production case may hold: one 16-token
/// slot at H = 32, D = 128 (or 17 tokens at H · D ≤ 3,855), so a case costs about two
/// typical ones of the rest of the campaign.
pub const ELEMENT_BUDGET: usize = 1 << 16;

/// Share of native cases drawn here, in percent.
pub const SHARE_PERCENT: u64 = 15;

/// Draws a production-shaped geometry; with `edges`, slot lengths favour 15, 16, 17.
pub fn draw_production<D: Draw>(d: &mut D, edges: bool) -> Geometry {
    let dtype = d.pick(&[Dtype::Bf16, Dtype::F16]);
    let group = d.weighted(&[(75, 1), (5, 2), (5, 4), (5, 8), (5, 16), (5, 3)]);
    let kv_heads = if group == 1 {
        // 96 and 128 heads (GPT-3, the largest MHA models): the coverage's `65+` for kv heads
        // and for the small-seq path's heads, otherwise never drawn.
        d.weighted(&[
            (15, 8),
            (28, 16),
            (28, 32),
            (10, 40),
            (11, 64),
            (4, 96),
            (4, 128),
        ])
    } else {
        d.weighted(&[(25, 1), (25, 2), (25, 4), (15, 8), (10, 16)])
    };
    let heads = kv_heads * group;
    let head_dim = d.weighted(&[(20, 64), (45, 128), (35, 256)]);
    let mask = d.pick(&Mask::ALL);
    let mut config = AttnConfig::new(dtype, heads, head_dim, mask);
    config.params.num_kv_heads = kv_heads;
    if d.percent(8) {
        config.params.window = Window {
            left: d.range(0, 16) as i64,
            right: d.range(0, 2) as i64 - 1,
        };
    }
    let max_tokens = (ELEMENT_BUDGET / (heads * head_dim)).max(1);
    let layout = if d.percent(10) {
        let s = d.pick(&[15, 16, 17]).min(max_tokens);
        config.layout = LayoutKind::Bshd;
        bshd_layout((max_tokens / s).clamp(1, 3), s, s)
    } else {
        slots_within(d, max_tokens, edges)
    };
    Geometry {
        production: true,
        ..with_data(d, config, layout, None)
    }
}

/// Up to 8 THD slots of at most 17 tokens (half of them on the tile edges 15, 16, 17; with
/// `edges`, 85 %), as many as fit in `max_tokens` per side; padded gaps now and then.
fn slots_within<D: Draw>(d: &mut D, max_tokens: usize, edges: bool) -> Layout {
    let padded = d.percent(35);
    let want = d.range(1, 8);
    let mut sides = [(vec![0i32], vec![0i32]), (vec![0i32], vec![0i32])];
    for _ in 0..want {
        let mut lens = [0usize; 2];
        for l in &mut lens {
            *l = if d.percent(if edges { 85 } else { 50 }) {
                d.pick(&[15, 16, 17])
            } else {
                d.range(1, 17)
            };
        }
        let full = sides
            .iter()
            .zip(lens)
            .any(|((_, off), l)| off[off.len() - 1] as usize + l > max_tokens);
        if full && sides[0].0.len() > 1 {
            break;
        }
        for (side, len) in sides.iter_mut().zip(lens) {
            let len = len.min(max_tokens);
            let gap = if padded { d.range(0, 2) } else { 0 };
            let (cu, off) = side;
            cu.push(cu[cu.len() - 1] + len as i32);
            off.push(off[off.len() - 1] + (len + gap) as i32);
        }
    }
    let [(cq, oq), (ck, ok)] = sides;
    let side = |cu: Vec<i32>, off: Vec<i32>| Side {
        tokens: off[off.len() - 1] as usize,
        cu,
        padded: padded.then_some(off),
    };
    Layout {
        q: side(cq, oq),
        kv: side(ck, ok),
    }
}
