//! Drawing the scores' additive bias (`docs/semantics.md` §1.9): the type with the geometry,
//! the values with the data. Post-scale biases of every broadcast shape, with `-inf` entries
//! (single keys, and now and then a whole row, which then has no visible key) and, in poisoned
//! cases, `+inf` and NaN where no slot reads (the spare rows and columns past the lengths,
//! which must be ignored); ALiBi with the standard geometric slopes or FlashAttention's test
//! draw; and TE's `pre_scale_bias`, which §1.9 does not define, so its refusal stays covered.

use super::rng::{Draw, Rng};
use crate::config::{AttnConfig, Bias, BiasShape};
use smallseq_reference::{AttnBias, Layout};
use std::sync::Arc;

/// Share of geometries with a bias: of those shaped for the small-seq path few (the gate's
/// `bias` rule is reached there, and a bias sends the case to the fallback), of the rest more.
pub const BIAS_PERCENT: (u64, u64) = (3, 12);

/// The bias type of a geometry (`eligible`: shaped for the small-seq path).
pub fn draw_kind<D: Draw>(d: &mut D, eligible: bool) -> Bias {
    let share = if eligible {
        BIAS_PERCENT.0
    } else {
        BIAS_PERCENT.1
    };
    if !d.percent(share) {
        return Bias::None;
    }
    match d.weighted(&[(60, 0u8), (30, 1), (10, 2)]) {
        0 => Bias::PostScale(d.pick(&BiasShape::ALL)),
        1 => Bias::Alibi,
        _ => Bias::Other("pre_scale_bias".into()),
    }
}

/// The bias values of `config`'s type for `layout` (none for a type without values).
pub fn draw_values(config: &AttnConfig, layout: &Layout, rng: &mut Rng, poison: bool) -> AttnBias {
    let heads = config.params.num_heads;
    match config.bias {
        Bias::PostScale(shape) => {
            AttnBias::PostScale(Arc::new(post_scale(config, shape, layout, rng, poison)))
        }
        Bias::Alibi => {
            let slopes = if rng.unit() < 0.5 {
                // The slopes of the ALiBi paper: 2^(−8(h+1)/H).
                (0..heads)
                    .map(|h| 2f64.powf(-8.0 * (h + 1) as f64 / heads as f64) as f32)
                    .collect()
            } else {
                (0..heads).map(|_| (rng.unit() * 0.3) as f32).collect()
            };
            AttnBias::Alibi(Arc::new(slopes))
        }
        _ => AttnBias::None,
    }
}

fn post_scale(
    config: &AttnConfig,
    shape: BiasShape,
    layout: &Layout,
    rng: &mut Rng,
    poison: bool,
) -> ndarray::Array4<f32> {
    let slots = layout.slots();
    let bb = if shape.per_slot() { slots } else { 1 };
    let hb = if shape.per_head() {
        config.params.num_heads
    } else {
        1
    };
    // TE's max_seqlen may exceed the longest sequence: spare rows and columns, unread.
    let spare = |rng: &mut Rng| {
        if rng.unit() < 0.3 {
            1 + rng.below(2) as usize
        } else {
            0
        }
    };
    let sq = layout.q.max_len() + spare(rng);
    let sk = layout.kv.max_len() + spare(rng);
    let sigma = [0.5, 1.0, 4.0][rng.below(3) as usize];
    let neg_inf = [0.0, 0.05, 0.3][rng.below(3) as usize];
    let dt = config.dtype;
    let mut t = ndarray::Array4::from_shape_simple_fn((bb, hb, sq, sk), || {
        if rng.unit() < neg_inf {
            f32::NEG_INFINITY
        } else {
            dt.round((rng.normal() * sigma) as f32)
        }
    });
    if bb * hb * sq > 0 && rng.unit() < 0.2 {
        let (b, h, r) = (
            rng.below(bb as u64) as usize,
            rng.below(hb as u64) as usize,
            rng.below(sq as u64) as usize,
        );
        t.slice_mut(ndarray::s![b, h, r, ..])
            .fill(f32::NEG_INFINITY);
    }
    if poison {
        // Entries no slot reads may hold anything (§1.9): the largest length a plane's
        // slots have on each side bounds what it reads.
        for b in 0..bb {
            let covered = |len: &dyn Fn(usize) -> usize| {
                (0..slots)
                    .filter(|&i| bb == 1 || i == b)
                    .map(len)
                    .max()
                    .unwrap_or(0)
            };
            let (mq, mk) = (
                covered(&|i| layout.q.len(i)),
                covered(&|i| layout.kv.len(i)),
            );
            for ((_, r, c), x) in t.slice_mut(ndarray::s![b, .., .., ..]).indexed_iter_mut() {
                if r >= mq || c >= mk {
                    *x = if (r + c) % 2 == 0 {
                        f32::INFINITY
                    } else {
                        f32::NAN
                    };
                }
            }
        }
    }
    t
}
