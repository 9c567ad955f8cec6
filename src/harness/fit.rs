//! Drawing inside an implementation's capabilities: a geometry the generator drew is moved
//! to the nearest one the worker computes (a dtype, mask or head dim it lacks is redrawn
//! from those it has; windows, GQA, `Dv != Dqk`, backward, dropout, bias and gaps between
//! sequences are dropped when it lacks them), so no budget goes to skips. The report lists what was left
//! out ([`crate::runner::Caps::not_covered`]).

use super::gen::Geometry;
use super::rng::{Draw, Rng};
use crate::config::{Bias, LayoutKind};
use crate::error::{Error, Result};
use crate::runner::Caps;
use smallseq_reference::{Dropout, Layout, Side, Window};

/// Moves `g` inside `caps`, drawing replacements from `rng`.
///
/// # Errors
/// [`Error::Config`] when the capabilities leave nothing to draw (no dtype, no mask, no
/// THD layout).
pub fn fit_to_caps(g: &mut Geometry, caps: &Caps, rng: &mut Rng) -> Result<()> {
    let empty = |what: &str| {
        Error::config(format!(
            "the worker's caps.{what} is empty: the campaign has nothing to draw"
        ))
    };
    if caps.dtypes.is_empty() {
        return Err(empty("dtypes"));
    }
    if caps.masks.is_empty() {
        return Err(empty("masks"));
    }
    if !caps.layouts.contains(&LayoutKind::Thd) {
        return Err(Error::config(
            "the worker's caps.layouts lacks thd: the campaign draws packed (THD) cases",
        ));
    }
    let c = &mut g.config;
    if !caps.dtypes.contains(&c.dtype) {
        c.dtype = rng.pick(&caps.dtypes);
    }
    if !caps.masks.contains(&c.params.mask) {
        c.params.mask = rng.pick(&caps.masks);
    }
    if !caps.layouts.contains(&c.layout) {
        c.layout = LayoutKind::Thd;
    }
    let p = &mut c.params;
    if !caps.window {
        p.window = Window::NONE;
    }
    if !caps.gqa {
        p.num_kv_heads = p.num_heads;
    }
    if let Some(dims) = caps.head_dims.as_ref().filter(|d| !d.is_empty()) {
        if !dims.contains(&p.head_dim_qk) {
            p.head_dim_qk = rng.pick(dims);
        }
        if !dims.contains(&p.head_dim_v) {
            p.head_dim_v = rng.pick(dims);
        }
    }
    if !caps.dv_ne_dqk {
        p.head_dim_v = p.head_dim_qk;
    }
    if !caps.backward {
        g.backward = false;
    }
    if !caps.dropout {
        p.dropout = Dropout::NONE;
    }
    // Only the types §1.9 defines need the capability; another stays, to be refused.
    if !caps.bias && matches!(c.bias, Bias::PostScale(_) | Bias::Alibi) {
        c.bias = Bias::None;
    }
    let unpadded = |s: &Side| Side {
        cu: s.cu.clone(),
        padded: None,
        tokens: *s.cu.last().unwrap_or(&0) as usize,
    };
    if !caps.padded_offsets && (g.layout.q.padded.is_some() || g.layout.kv.padded.is_some()) {
        g.layout = Layout::new(unpadded(&g.layout.q), unpadded(&g.layout.kv))?;
    }
    if let Some(max) = caps.max_tokens {
        while g.layout.q.tokens.max(g.layout.kv.tokens) > max && g.layout.slots() > 1 {
            let keep = |s: &Side| {
                let cu = s.cu[..s.cu.len() - 1].to_vec();
                unpadded(&Side {
                    cu,
                    padded: None,
                    tokens: 0,
                })
            };
            g.layout = Layout::new(keep(&g.layout.q), keep(&g.layout.kv))?;
        }
    }
    // Ids drawn for another layout would be dropped at launch anyway; without them the case
    // says what its launch takes.
    if g.segments.as_ref().is_some_and(|s| !s.describes(&g.layout)) {
        g.segments = None;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::Profile;
    use crate::harness::gen::draw_geometry_for;
    use crate::runner::WireCaps;
    use smallseq_reference::{Dtype, Mask};

    #[test]
    fn fitted_geometries_stay_inside_narrow_caps() {
        let w: WireCaps = serde_json::from_str(
            r#"{"dtypes": ["bf16"], "layouts": ["thd"], "masks": ["padding", "padding_causal"],
                "head_dims": [64, 128], "max_tokens": 64}"#,
        )
        .unwrap();
        let caps = Caps::from_wire(&w).unwrap();
        for seed in 0..400 {
            let mut rng = Rng::new(seed);
            let mut g = draw_geometry_for(&mut rng, Profile::Native);
            fit_to_caps(&mut g, &caps, &mut rng).unwrap();
            let p = &g.config.params;
            assert_eq!(g.config.dtype, Dtype::Bf16);
            assert!(matches!(p.mask, Mask::Padding | Mask::PaddingCausal));
            assert_eq!(p.window, Window::NONE);
            assert_eq!(p.dropout, Dropout::NONE, "caps.dropout is false");
            assert!(
                !matches!(g.config.bias, Bias::PostScale(_) | Bias::Alibi),
                "caps.bias is false"
            );
            assert_eq!(p.num_kv_heads, p.num_heads);
            assert!([64, 128].contains(&p.head_dim_qk) && p.head_dim_v == p.head_dim_qk);
            assert!(!g.backward);
            assert!(g.layout.q.padded.is_none() && g.layout.kv.padded.is_none());
            assert!(g.layout.q.tokens <= 64 || g.layout.slots() == 1);
            crate::harness::gen::build(&g, seed).unwrap();
        }
    }

    #[test]
    fn full_caps_change_nothing() {
        let caps = Caps::in_tree("cpu", true, 1, (true, true));
        for seed in 0..100 {
            let mut rng = Rng::new(seed);
            let g0 = draw_geometry_for(&mut rng, Profile::Native);
            let mut g = g0.clone();
            fit_to_caps(&mut g, &caps, &mut rng).unwrap();
            assert_eq!(g.config, g0.config);
            assert_eq!(g.layout, g0.layout);
        }
    }

    #[test]
    fn empty_caps_are_an_error_not_a_panic() {
        let caps = Caps::from_wire(&WireCaps::default()).unwrap();
        let mut rng = Rng::new(1);
        let mut g = draw_geometry_for(&mut rng, Profile::Native);
        let e = fit_to_caps(&mut g, &caps, &mut rng)
            .unwrap_err()
            .to_string();
        assert!(e.contains("caps.dtypes"), "{e}");
    }
}
