//! Data designed against the kernels' tile structure (16-key, 16-query tiles): extremes placed
//! on tile boundaries, rows whose logits overflow `exp` without the max subtraction, and
//! backward data that drives the 16-bit intermediates (dP, dS) past their range.
//!
//! A class reshapes a few rows of a case whose tensors were already drawn from its
//! [`super::gen::DataDist`]; everything else keeps the distribution's values. Each class is a
//! named coverage tag (`super::classes`), so a campaign says how often it reached each one.

use super::rng::{Draw, Rng};
use crate::case::Case;
use ndarray::Array3;
use smallseq_reference::{visible, Dtype};

/// The tile edge of the kernels: keys (and queries) 15, 16, 17 sit at indices 14, 15, 16.
const TILE: usize = 16;

/// How a case's data is shaped on top of its distribution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataClass {
    /// The distribution's values only.
    Plain,
    /// Every row's maximum logit on one tile-edge key (15, 16, 17, the slot's last key, or the
    /// last key a row's window or causal mask leaves visible), a few units above the rest.
    MaxOnTileEdge,
    /// As [`DataClass::MaxOnTileEdge`], with the maximum 100–400 above the rest: `exp` of the
    /// row overflows f32 unless the true maximum is subtracted.
    ExpOverflowRow,
    /// The two keys across a tile boundary (15|16, 16|17, or the last two) tie for the row
    /// maximum, exactly or one ulp of the dtype apart.
    NearTieOnEdge,
    /// The largest `|dO·V|` at a tile-edge query and key.
    DovMaxOnEdge,
    /// `dS = P·(dP − D)` driven past the dtype's range (f16: 1.05–1.4× 65,504; bf16 and f32:
    /// about 2^64, where f32 accumulations stay finite) through large, aligned dO and V.
    BwdRangeStress,
}

impl DataClass {
    /// Every class that shapes data, in report order.
    pub const SHAPED: [DataClass; 5] = [
        DataClass::MaxOnTileEdge,
        DataClass::ExpOverflowRow,
        DataClass::NearTieOnEdge,
        DataClass::DovMaxOnEdge,
        DataClass::BwdRangeStress,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DataClass::Plain => "plain",
            DataClass::MaxOnTileEdge => "max_on_tile_edge",
            DataClass::ExpOverflowRow => "exp_overflow_row",
            DataClass::NearTieOnEdge => "near_tie_on_edge",
            DataClass::DovMaxOnEdge => "dov_max_on_edge",
            DataClass::BwdRangeStress => "bwd_range_stress",
        }
    }

    /// Whether the class places extremes on tile-edge keys or queries (all but
    /// [`DataClass::Plain`]), so the geometry should reach them.
    pub fn aims_at_tile_edges(self) -> bool {
        self != DataClass::Plain
    }

    /// The class named `name` (as stored in a case's `smallseq.data_class`).
    pub fn parse(name: &str) -> Option<DataClass> {
        std::iter::once(DataClass::Plain)
            .chain(DataClass::SHAPED)
            .find(|c| c.name() == name)
    }

    /// The native campaign's mix: a shaped class in 60 % of the cases, most often the two
    /// whose defects show only past a limit (an overflowing `exp`, an out-of-range dS).
    pub fn draw<D: Draw>(d: &mut D) -> DataClass {
        d.weighted(&[
            (40, DataClass::Plain),
            (7, DataClass::MaxOnTileEdge),
            (20, DataClass::ExpOverflowRow),
            (7, DataClass::NearTieOnEdge),
            (7, DataClass::DovMaxOnEdge),
            (19, DataClass::BwdRangeStress),
        ])
    }
}

/// Reshapes `case`'s inputs for `class` (before don't-care rows are poisoned).
pub fn apply(case: &mut Case, class: DataClass, rng: &mut Rng) {
    if class == DataClass::Plain {
        return;
    }
    let p = case.config.params.clone();
    let g = p.group_size();
    for i in 0..case.layout.slots() {
        let s = SlotRows {
            oq: case.layout.q.offset(i),
            lq: case.layout.q.len(i),
            ok: case.layout.kv.offset(i),
            lk: case.layout.kv.len(i),
        };
        if s.lq == 0 || s.lk == 0 {
            continue;
        }
        for hk in 0..p.num_kv_heads {
            let heads = hk * g..(hk + 1) * g;
            let c = edge_key(case, &s, rng);
            let aim = Aim { hk, heads, c };
            match class {
                DataClass::Plain => {}
                DataClass::MaxOnTileEdge => max_on(case, &s, aim, rng.unit() * 8.0 + 4.0, rng),
                DataClass::ExpOverflowRow => {
                    let c = if s.lk > TILE {
                        rng.range(TILE, s.lk - 1)
                    } else {
                        c
                    };
                    max_on(case, &s, Aim { c, ..aim }, rng.unit() * 300.0 + 100.0, rng);
                }
                DataClass::NearTieOnEdge => near_tie(case, &s, aim, rng),
                DataClass::DovMaxOnEdge => dov_max(case, &s, aim, rng),
                DataClass::BwdRangeStress => range_stress(case, &s, aim, rng),
            }
        }
    }
}

/// One slot's rows: offsets and lengths per side.
struct SlotRows {
    oq: usize,
    lq: usize,
    ok: usize,
    lk: usize,
}

/// What a class aims at in one slot: a kv head, its group's query heads, and a key.
struct Aim {
    hk: usize,
    heads: std::ops::Range<usize>,
    c: usize,
}

/// Sets row `row`, head `head` of `t` to `f(old, w)` per dimension along the signs `w`.
fn along(t: &mut Array3<f32>, row: usize, head: usize, w: &[f32], f: impl Fn(f32, f32) -> f32) {
    t.slice_mut(ndarray::s![row, head, ..])
        .iter_mut()
        .zip(w)
        .for_each(|(x, &w)| *x = f(*x, w));
}

/// A tile-edge index below `len`: 15, 16, 17 (1-based) where they exist, else the last.
fn edge_index<D: Draw>(len: usize, d: &mut D) -> usize {
    let at: Vec<usize> = [TILE - 2, TILE - 1, TILE]
        .into_iter()
        .filter(|&x| x < len)
        .collect();
    if at.is_empty() || d.percent(25) {
        len - 1
    } else {
        d.pick(&at)
    }
}

/// A tile-edge key of the slot; with a causal mask or a window, one time in three the last key
/// a random row sees.
fn edge_key(case: &Case, s: &SlotRows, rng: &mut Rng) -> usize {
    let p = &case.config.params;
    if (p.mask.causal().is_some() || p.window != smallseq_reference::Window::NONE)
        && rng.percent(33)
    {
        let r = rng.range(0, s.lq - 1);
        if let Some(c) = (0..s.lk)
            .rev()
            .find(|&c| visible(p.mask, p.window, r, c, s.lq, s.lk))
        {
            return c;
        }
    }
    edge_index(s.lk, rng)
}

/// A random ±1 per dimension.
fn signs(n: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n)
        .map(|_| if rng.percent(50) { 1.0 } else { -1.0 })
        .collect()
}

fn dot(a: &Array3<f32>, ra: usize, ha: usize, b: &Array3<f32>, rb: usize, hb: usize) -> f64 {
    let (x, y) = (
        a.slice(ndarray::s![ra, ha, ..]),
        b.slice(ndarray::s![rb, hb, ..]),
    );
    x.iter()
        .zip(y)
        .map(|(&x, &y)| f64::from(x) * f64::from(y))
        .sum()
}

/// Aligns the group's query rows with a sign pattern and sets key `c` along it, so every query
/// row's logit at `c` is at least `margin` above its largest other logit.
fn max_on(case: &mut Case, s: &SlotRows, aim: Aim, margin: f64, rng: &mut Rng) {
    let dt = case.config.dtype;
    let scale = case.config.params.scale;
    let w = signs(case.q.shape()[2], rng);
    let mut qmin = f64::INFINITY;
    let mut other = 0.0f64;
    for h in aim.heads {
        for r in s.oq..s.oq + s.lq {
            along(&mut case.q, r, h, &w, |x, w| {
                dt.round(w * x.abs().max(0.25))
            });
            let row = case.q.slice(ndarray::s![r, h, ..]);
            qmin = qmin.min(row.iter().map(|x| f64::from(x.abs())).sum());
            for j in (0..s.lk).filter(|&j| j != aim.c) {
                other = other.max((scale * dot(&case.q, r, h, &case.k, s.ok + j, aim.hk)).abs());
            }
        }
    }
    let m = ((other + margin) / (scale * qmin)).min(f64::from(dt.max_finite()) / 4.0);
    along(&mut case.k, s.ok + aim.c, aim.hk, &w, |_, w| {
        dt.round_f64(f64::from(w) * m)
    });
}

/// Keys `c` and `c + 1` across a tile boundary hold the row maximum, tied or one ulp apart.
fn near_tie(case: &mut Case, s: &SlotRows, aim: Aim, rng: &mut Rng) {
    if s.lk < 2 {
        return;
    }
    let c = edge_index(s.lk - 1, rng).min(s.lk - 2);
    let hk = aim.hk;
    max_on(case, s, Aim { c, ..aim }, rng.unit() * 6.0 + 2.0, rng);
    let dt = case.config.dtype;
    let src = case.k.slice(ndarray::s![s.ok + c, hk, ..]).to_owned();
    let mut dst = case.k.slice_mut(ndarray::s![s.ok + c + 1, hk, ..]);
    dst.assign(&src);
    if rng.percent(50) {
        let j = rng.range(0, src.len() - 1);
        dst[j] = next_down(dt, dst[j]);
    }
}

/// The representable value of `dt` next to `x` towards zero.
fn next_down(dt: Dtype, x: f32) -> f32 {
    let step = 2.0 * dt.unit_roundoff() as f32 * x.abs();
    dt.round(x - x.signum() * step.max(f32::MIN_POSITIVE))
}

/// The largest `|dO·V|` of the slot at a tile-edge query row and key `c`.
fn dov_max(case: &mut Case, s: &SlotRows, aim: Aim, rng: &mut Rng) {
    let dt = case.config.dtype;
    let w = signs(case.v.shape()[2], rng);
    let vmax = case
        .v
        .slice(ndarray::s![s.ok..s.ok + s.lk, aim.hk, ..])
        .iter()
        .fold(1.0f32, |m, x| m.max(x.abs()));
    let a = dt.round((8.0 * vmax).min(dt.max_finite() / 4.0));
    along(&mut case.v, s.ok + aim.c, aim.hk, &w, |_, w| w * a);
    let r = s.oq + edge_index(s.lq, rng);
    if let Some(d_o) = case.d_o.as_mut() {
        for h in aim.heads {
            along(d_o, r, h, &w, |x, w| dt.round(w * x.abs().max(0.25)));
        }
    }
}

/// Sets V at key `c` and every query row's dO along one sign pattern, sized from the row's own
/// P at `c` so that `P·(1 − P)·dP`, about the row's largest |dS|, lands at 1.05–1.4× the range
/// target: past it, but not so far that the saturating kernels' own error hides everything.
fn range_stress(case: &mut Case, s: &SlotRows, aim: Aim, rng: &mut Rng) {
    let dt = case.config.dtype;
    let p = case.config.params.clone();
    let target = f64::from(dt.max_finite()).min(2f64.powi(64));
    let cap = f64::from(dt.max_finite()) / 4.0;
    let dv = case.v.shape()[2];
    let w = signs(dv, rng);
    let a = 64.0f32;
    along(&mut case.v, s.ok + aim.c, aim.hk, &w, |_, w| w * a);
    let Some(d_o) = case.d_o.as_mut() else {
        return;
    };
    for h in aim.heads {
        for r in 0..s.lq {
            let logits: Vec<Option<f64>> = (0..s.lk)
                .map(|j| {
                    visible(p.mask, p.window, r, j, s.lq, s.lk)
                        .then(|| p.scale * dot(&case.q, s.oq + r, h, &case.k, s.ok + j, aim.hk))
                })
                .collect();
            let Some(Some(sc)) = logits.get(aim.c).copied() else {
                continue;
            };
            let m = logits
                .iter()
                .flatten()
                .fold(f64::NEG_INFINITY, |a, &b| a.max(b));
            let l: f64 = logits.iter().flatten().map(|x| (x - m).exp()).sum();
            let pc = (sc - m).exp() / l;
            let spread = (pc * (1.0 - pc)).max(1e-3);
            let b = (target * (1.05 + 0.35 * rng.unit()) / (spread * f64::from(a) * dv as f64))
                .min(cap);
            along(d_o, s.oq + r, h, &w, |_, w| dt.round_f64(f64::from(w) * b));
        }
    }
}
