//! The case model: a geometry (drawn from any [`Draw`]) plus a separate data seed. Weighted
//! towards the places bugs live: slot boundaries 16/17/18, empty and trailing slots, padded
//! spans, GQA, causal masks, windows, unsupported dims and dtypes, poison in don't-care tokens.

use super::data_class::{self, DataClass};
use super::geometry::with_data;
pub use super::geometry::{DataDist, Geometry};
use super::rng::{Draw, Rng};
use super::score_bias;
use super::shapes;
use crate::case::{bshd_layout, Case};
use crate::config::{AttnConfig, LayoutKind};
use crate::dispatch::Profile;
use crate::error::Result;
use crate::segments::{self, Segmented};
use ndarray::Array3;
use smallseq_reference::{AttnBias, AttnParams, Dropout, Dtype, Layout, Mask, Side, Window};

/// Upper bound on tokens per side, to keep CPU cases fast.
const MAX_TOKENS: usize = 1024;

/// Share of [`draw_geometry`]'s cases with a dropout (`docs/semantics.md` §1.8): of those
/// shaped for the small-seq path few (the gate's `dropout` rule is reached there, and a dropout
/// sends the case to the fallback), of the rest more. And the probabilities drawn: both
/// extremes (`0` with a nonzero seed is no dropout, `1` drops every element) and three between.
pub const DROPOUT_PERCENT: (u64, u64) = (3, 12);
pub const DROPOUT_P: [f64; 5] = [0.0, 0.1, 0.5, 0.9, 1.0];

/// A slot length; with `edges` (data shaped against the tiles) mostly one of the tile edges.
fn draw_len<D: Draw>(d: &mut D, edges: bool) -> usize {
    let weights = if edges {
        [
            (10, LenKind::Uniform),
            (60, LenKind::Edge),
            (3, LenKind::Long),
            (3, LenKind::Zero),
        ]
    } else {
        [
            (30, LenKind::Uniform),
            (30, LenKind::Boundary),
            (6, LenKind::Long),
            (6, LenKind::Zero),
        ]
    };
    d.weighted(&weights).draw(d)
}

/// Slot lengths on the fallback kernels' tile edges (a multiple of 32, and one either side).
pub const FALLBACK_TILE_EDGES: [usize; 9] = [31, 32, 33, 63, 64, 65, 127, 128, 129];

#[derive(Clone, Copy)]
enum LenKind {
    Uniform,
    Boundary,
    /// The tile edges, 17 most often (for data aimed at them).
    Edge,
    Long,
    Zero,
}

impl LenKind {
    fn draw<D: Draw>(self, d: &mut D) -> usize {
        match self {
            LenKind::Uniform => d.range(1, 17),
            LenKind::Boundary => d.pick(&[1, 2, 15, 16, 17, 18, 17, 16]),
            LenKind::Edge => d.pick(&[15, 16, 17, 17, 17, 16, 1, 18]),
            // Half of the long sides on the fallback's own tile edges (32- and 64-row query
            // tiles, 32- and 64-key blocks): a slot that fills a tile exactly, or spills one
            // row into the next, is where a block loop's bound goes wrong.
            LenKind::Long if d.percent(50) => d.pick(&FALLBACK_TILE_EDGES),
            LenKind::Long => d.range(18, 80),
            LenKind::Zero => 0,
        }
    }
}

/// Draws a geometry.
pub fn draw_geometry<D: Draw>(d: &mut D) -> Geometry {
    draw_geometry_with(d, false)
}

/// Draws a geometry; with `edges`, THD slot lengths favour the tile edges 15, 16, 17.
pub fn draw_geometry_with<D: Draw>(d: &mut D, edges: bool) -> Geometry {
    // A third of the cases are shaped for the small-seq path, so its properties
    // (fallback equivalence above all) run often; the rest roam the whole input space.
    let eligible = d.percent(35);
    let dtype = if eligible {
        d.pick(&[Dtype::Bf16, Dtype::F16])
    } else {
        d.weighted(&[(45, Dtype::Bf16), (40, Dtype::F16), (15, Dtype::F32)])
    };
    let mut kv_heads = d.weighted(&[(40, 1), (30, 2), (15, 3), (15, 4)]);
    // Groups past 4 (5 and 6 are not powers of two; 8 and 16 are Llama's and GPT-NeoX's)
    // here too, not only among the production shapes (0.75 % of cases): a group loop unrolled
    // or indexed for small groups breaks there. At most 2 kv heads with them, so a case
    // stays near the others' cost.
    let group = if !eligible && d.percent(25) {
        d.weighted(&[(30, 2), (25, 3), (25, 4), (5, 5), (5, 6), (5, 8), (5, 16)])
    } else {
        1
    };
    if group > 4 {
        kv_heads = kv_heads.min(2);
    }
    let heads = kv_heads * group;
    let head_dim = if eligible {
        d.pick(&[64, 128, 256])
    } else {
        d.weighted(&[
            (30, 64),
            (30, 128),
            (15, 256),
            (10, 32),
            (8, 192),
            (2, 512),
            (5, 16),
            // Head dims of real models outside the powers of two (80: Phi-2; 96: GPT-2
            // small-scale variants), so the coverage's `other` is reached.
            (3, 80),
            (2, 96),
        ])
    };
    let head_dim_v = if !eligible && d.percent(5) {
        d.pick(&[32, 64, 128])
    } else {
        head_dim
    };
    let mask = d.pick(&Mask::ALL);
    let window = if !eligible && d.percent(20) {
        Window {
            left: d.range(0, 6) as i64 - 1,
            right: d.range(0, 6) as i64 - 1,
        }
    } else {
        Window::NONE
    };
    let scale = match d.below(10) {
        0 => 1.0,
        1 => 0.01,
        2 => 3.0,
        _ => 1.0 / (head_dim as f64).sqrt(),
    };
    let bias = score_bias::draw_kind(d, eligible);
    let share = if eligible {
        DROPOUT_PERCENT.0
    } else {
        DROPOUT_PERCENT.1
    };
    let dropout = if d.percent(share) {
        Dropout {
            p: d.pick(&DROPOUT_P),
            seed: d.below(u64::MAX),
            offset: d.below(1 << 40),
        }
    } else {
        Dropout::NONE
    };
    let layout_kind = if d.percent(8) {
        LayoutKind::Bshd
    } else {
        LayoutKind::Thd
    };
    let mut segments = None;
    let layout = match layout_kind {
        LayoutKind::Bshd => {
            let s = d.pick(&[1, 2, 8, 16, 17, 18]);
            let s_kv = if d.percent(80) { s } else { d.range(1, 18) };
            bshd_layout(d.range(0, 6), s, s_kv)
        }
        LayoutKind::Thd if d.percent(12) => match segment_layout(d) {
            Some((layout, ids)) => {
                segments = Some(ids);
                layout
            }
            None => thd_layout(d, edges),
        },
        LayoutKind::Thd => thd_layout(d, edges),
    };
    let config = AttnConfig {
        dtype,
        params: AttnParams {
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim_qk: head_dim,
            head_dim_v,
            mask,
            window,
            scale,
            dropout,
            bias: AttnBias::None,
        },
        bias,
        layout: layout_kind,
    };
    with_data(d, config, layout, segments)
}

/// A geometry for the campaign's profile. Under `te625` most cases are shaped for TE's
/// small-seq gate (bf16, H == Hkv in {16, 32}, D in {128, 256}, padding-class masks, padded
/// spans around 17), so the small-seq path and its defects are reached at all; the rest
/// roam like the native campaign. The native profile draws production-shaped geometries
/// ([`shapes`]) in [`shapes::SHARE_PERCENT`] of its cases and [`draw_geometry`] in the rest,
/// and shapes the data of either against the tile structure ([`DataClass::draw`]).
pub fn draw_geometry_for<D: Draw>(d: &mut D, profile: Profile) -> Geometry {
    if profile == Profile::Native {
        // The class first: data aimed at the tile edges needs slots that reach them.
        let data = DataClass::draw(d);
        let edges = data.aims_at_tile_edges();
        let g = if d.percent(shapes::SHARE_PERCENT) {
            shapes::draw_production(d, edges)
        } else {
            draw_geometry_with(d, edges)
        };
        return Geometry { data, ..g };
    }
    if d.percent(30) {
        return draw_geometry(d);
    }
    let heads = d.weighted(&[(45, 16), (35, 32), (10, 8), (10, 4)]);
    let head_dim = d.weighted(&[(55, 128), (35, 256), (10, 64)]);
    let mask = d.weighted(&[
        (20, Mask::NoMask),
        (25, Mask::Padding),
        (25, Mask::PaddingCausal),
        (25, Mask::PaddingCausalBottomRight),
        (5, Mask::Causal),
    ]);
    let window = if d.percent(25) {
        Window {
            left: d.range(0, 4) as i64,
            right: d.range(0, 2) as i64,
        }
    } else {
        Window::NONE
    };
    let bshd = d.percent(10);
    let layout = if bshd {
        let s = d.pick(&[2, 8, 16, 17]);
        bshd_layout(d.range(1, 3), s, s)
    } else {
        te_layout(d)
    };
    let dtype = if d.percent(90) {
        Dtype::Bf16
    } else {
        Dtype::F16
    };
    let mut config = AttnConfig::new(dtype, heads, head_dim, mask);
    config.params.window = window;
    if bshd {
        config.layout = LayoutKind::Bshd;
    }
    with_data(d, config, layout, None)
}

/// A few THD slots of at most 17 tokens, padded gaps that sometimes push a span past 17,
/// and now and then an empty kv slot with queries.
fn te_layout<D: Draw>(d: &mut D) -> Layout {
    let b = d.range(1, 4);
    let padded = d.percent(60);
    let mut sides = [(vec![0i32], vec![0i32]), (vec![0i32], vec![0i32])];
    for _ in 0..b {
        let lq = d.range(1, 17);
        let lk = if d.percent(10) { 0 } else { d.range(1, 17) };
        for (side, len) in sides.iter_mut().zip([lq, lk]) {
            let gap = if padded {
                d.weighted(&[(60, 0usize), (30, 1), (10, 18usize.saturating_sub(len))])
            } else {
                0
            };
            let (cu, off) = side;
            cu.push(cu[cu.len() - 1] + len as i32);
            off.push(off[off.len() - 1] + (len + gap) as i32);
        }
    }
    let [(cq, oq), (ck, ok)] = sides;
    let side = |cu: Vec<i32>, off: Vec<i32>, slack: usize| Side {
        tokens: off[off.len() - 1] as usize + slack,
        cu,
        padded: padded.then_some(off),
    };
    let slack_q = d.range(0, 2);
    let slack_kv = d.range(0, 2);
    Layout {
        q: side(cq, oq, slack_q),
        kv: side(ck, ok, slack_kv),
    }
}

fn thd_layout<D: Draw>(d: &mut D, edges: bool) -> Layout {
    let b = match d.weighted(&[(4, 0u8), (40, 1), (45, 2), (11, 3)]) {
        0 => 0,
        1 => d.range(1, 4),
        2 => d.range(5, 16),
        _ => d.range(17, 40),
    };
    let padded = d.percent(45);
    let trailing = if d.percent(15) {
        d.range(1, 3).min(b)
    } else {
        0
    };
    let mut sides = [(vec![0i32], vec![0i32]), (vec![0i32], vec![0i32])];
    for i in 0..b {
        let unused = i >= b - trailing;
        let mut lens = [draw_len(d, edges), draw_len(d, edges)];
        if d.percent(10) {
            lens[0] = lens[0].min(1); // cross-attention with one query
        }
        if unused {
            lens = [0, 0];
        }
        for (side, len) in sides.iter_mut().zip(lens) {
            let gap = if padded && !unused {
                match d.weighted(&[(50, 0u8), (30, 1), (20, 2)]) {
                    0 => 0,
                    1 => d.range(1, 3),
                    _ => 18usize.saturating_sub(len),
                }
            } else {
                0
            };
            let (cu, off) = side;
            cu.push(cu.last().unwrap() + len as i32);
            off.push(off.last().unwrap() + (len + gap) as i32);
        }
    }
    let side = |(cu, off): (Vec<i32>, Vec<i32>), slack: usize| {
        let tokens = *off.last().unwrap() as usize + slack;
        Side {
            cu,
            padded: padded.then_some(off),
            tokens,
        }
    };
    let [q, kv] = sides;
    let slack_q = if d.percent(40) { d.range(1, 4) } else { 0 };
    let slack_kv = if d.percent(40) { d.range(1, 4) } else { 0 };
    let layout = Layout {
        q: side(q, slack_q),
        kv: side(kv, slack_kv),
    };
    if layout.q.tokens > MAX_TOKENS || layout.kv.tokens > MAX_TOKENS {
        return Layout::packed(&[(3, 5), (17, 17)]);
    }
    layout
}

/// A layout that JAX-style segment ids express, with those ids: `batch` rows of `seq_q` /
/// `seq_kv` tokens, up to `max_segments` segments a row (half of the rows full, where TE's
/// `bincount(ids)[1..=max_segments]` bound matters), padding before, between and after
/// them, and TE's compact slot order (`batch * max_segments` slots, the unused ones empty at
/// the end of the buffers). The layout is drawn first and the ids derived from it, so the
/// conversion the launch runs is checked against offsets it did not compute.
fn segment_layout<D: Draw>(d: &mut D) -> Option<(Layout, Segmented)> {
    let batch = d.range(1, 4);
    let seq_q = d.range(2, 18);
    let seq_kv = if d.percent(70) { seq_q } else { d.range(1, 18) };
    let max_segments = d.range(1, 4);
    let (mut lq, mut oq, mut lk, mut ok) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in 0..batch {
        let room = max_segments.min(seq_q).min(seq_kv);
        let n = if d.percent(50) {
            room
        } else {
            d.range(0, room)
        };
        for (seq, lens, offs) in [(seq_q, &mut lq, &mut oq), (seq_kv, &mut lk, &mut ok)] {
            // Each segment starts one token long; every spare token then lengthens a
            // segment (two in three) or widens a gap: before segment i, or the row's tail.
            let mut len = vec![1usize; n];
            let mut gap = vec![0usize; n + 1];
            for _ in 0..seq - n {
                if n > 0 && d.percent(65) {
                    len[d.below(n as u64) as usize] += 1;
                } else {
                    gap[d.below(n as u64 + 1) as usize] += 1;
                }
            }
            let mut at = r * seq;
            for i in 0..n {
                at += gap[i];
                offs.push(at as i32);
                lens.push(len[i] as i32);
                at += len[i];
            }
        }
    }
    let slots = batch * max_segments;
    let side = |lens: Vec<i32>, mut offs: Vec<i32>, tokens: usize| {
        let mut cu = vec![0i32];
        for l in lens.iter().chain(std::iter::repeat(&0)).take(slots) {
            cu.push(cu[cu.len() - 1] + l);
        }
        offs.resize(slots + 1, tokens as i32);
        Side {
            cu,
            padded: Some(offs),
            tokens,
        }
    };
    let layout = Layout::new(side(lq, oq, batch * seq_q), side(lk, ok, batch * seq_kv)).ok()?;
    let ids = Segmented::of_layout(&layout, batch, seq_q, seq_kv, max_segments).ok()?;
    Some((layout, ids))
}

/// Fills the tensors of a geometry from a data seed.
///
/// # Errors
/// Only if the geometry itself is invalid.
pub fn build(g: &Geometry, data_seed: u64) -> Result<Case> {
    let mut rng = Rng::new(data_seed);
    let p = &g.config.params;
    let (tq, tk) = (g.layout.q.tokens, g.layout.kv.tokens);
    let dt = g.config.dtype;
    let fill = |shape: [usize; 3], role: Role, rng: &mut Rng| -> Array3<f32> {
        Array3::from_shape_simple_fn(shape, || dt.round(sample(g.dist, role, rng) as f32))
    };
    let q = fill([tq, p.num_heads, p.head_dim_qk], Role::Q, &mut rng);
    let k = fill([tk, p.num_kv_heads, p.head_dim_qk], Role::K, &mut rng);
    let v = fill([tk, p.num_kv_heads, p.head_dim_v], Role::V, &mut rng);
    let d_o = g
        .backward
        .then(|| fill([tq, p.num_heads, p.head_dim_v], Role::DO, &mut rng));
    // Its own stream, so that the cases without a bias draw what they drew before.
    let mut config = g.config.clone();
    config.params.bias = score_bias::draw_values(&config, &g.layout, &mut rng.fork(13), g.poison);
    let mut case = Case::new(config, g.layout.clone(), q, k, v, d_o)?;
    if g.poison {
        poison(&mut case, &mut rng.fork(7));
    }
    // Shaping touches valid rows only, poisoning don't-care rows only: the order is free, and
    // plain cases draw exactly what they drew before the classes existed.
    if g.data != DataClass::Plain {
        data_class::apply(&mut case, g.data, &mut rng.fork(11));
        case.meta
            .insert("smallseq.data_class".into(), g.data.name().into());
    }
    if let Some(ids) = &g.segments {
        case.meta.insert(segments::META_KEY.into(), ids.to_meta());
    }
    case.meta
        .insert("smallseq.seed".into(), data_seed.to_string());
    case.meta
        .insert("smallseq.dist".into(), g.dist.name().into());
    Ok(case)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Q,
    K,
    V,
    DO,
}

fn sample(dist: DataDist, role: Role, rng: &mut Rng) -> f64 {
    match dist {
        DataDist::Randn => rng.normal(),
        DataDist::SmallInts => {
            if rng.unit() < 0.6 {
                0.0
            } else {
                (rng.below(5) as f64) - 2.0
            }
        }
        DataDist::Spiky => {
            if role == Role::Q && rng.unit() < 0.05 {
                rng.normal() * 12.0
            } else {
                rng.normal() * 0.5
            }
        }
        DataDist::NearTie => match role {
            Role::Q => rng.normal() * 1e-3,
            _ => rng.normal(),
        },
        DataDist::Large => match role {
            Role::Q | Role::K => rng.normal() * 40.0,
            _ => rng.normal() * 100.0,
        },
    }
}

/// Don't-care rows of each input, as (tensor, token) pairs.
pub fn dont_care_rows(case: &Case) -> (Vec<usize>, Vec<usize>) {
    let pick = |valid: Vec<bool>| {
        valid
            .iter()
            .enumerate()
            .filter(|(_, v)| !**v)
            .map(|(t, _)| t)
            .collect()
    };
    (
        pick(case.layout.q.valid_tokens()),
        pick(case.layout.kv.valid_tokens()),
    )
}

/// Overwrites every don't-care input row with NaN, ±Inf or huge values.
pub fn poison(case: &mut Case, rng: &mut Rng) {
    let (rq, rk) = dont_care_rows(case);
    let max = case.config.dtype.max_finite();
    let values = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, max, -max];
    let put = |t: &mut Array3<f32>, rows: &[usize], rng: &mut Rng| {
        for &r in rows {
            t.slice_mut(ndarray::s![r, .., ..])
                .map_inplace(|x| *x = values[rng.below(values.len() as u64) as usize]);
        }
    };
    put(&mut case.q, &rq, rng);
    put(&mut case.k, &rk, rng);
    put(&mut case.v, &rk, rng);
    if let Some(d) = case.d_o.as_mut() {
        put(d, &rq, rng);
    }
}

/// Whether any don't-care row exists.
pub fn has_dont_care(case: &Case) -> bool {
    let (a, b) = dont_care_rows(case);
    !a.is_empty() || !b.is_empty()
}
