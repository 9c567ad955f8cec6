//! A validated attention problem: parameters, layout and input tensors.

use crate::layout::{Layout, LayoutError};
use crate::types::AttnParams;
use ndarray::ArrayView3;

/// Inputs of one case, borrowed. Tensors hold f32 values exactly representable in the case's
/// dtype; don't-care rows may hold anything (NaN, ±Inf, huge values).
#[derive(Clone, Debug)]
pub struct Problem<'a> {
    pub params: &'a AttnParams,
    pub layout: &'a Layout,
    /// `[Tq, H, Dqk]`
    pub q: ArrayView3<'a, f32>,
    /// `[Tk, Hkv, Dqk]`
    pub k: ArrayView3<'a, f32>,
    /// `[Tk, Hkv, Dv]`
    pub v: ArrayView3<'a, f32>,
    /// `[Tq, H, Dv]`, present for forward+backward cases.
    pub d_o: Option<ArrayView3<'a, f32>>,
}

impl<'a> Problem<'a> {
    /// Checks that parameters, layout and tensor shapes agree.
    ///
    /// # Errors
    /// [`LayoutError::Shape`], [`LayoutError::Gqa`], [`LayoutError::Zero`] or
    /// [`LayoutError::Scale`] naming the offending tensor or field; [`LayoutError::Bias`] for a
    /// bias that does not fit the layout.
    pub fn new(
        params: &'a AttnParams,
        layout: &'a Layout,
        q: ArrayView3<'a, f32>,
        k: ArrayView3<'a, f32>,
        v: ArrayView3<'a, f32>,
        d_o: Option<ArrayView3<'a, f32>>,
    ) -> Result<Self, LayoutError> {
        check_params(params)?;
        let (h, hkv, dqk, dv) = (
            params.num_heads,
            params.num_kv_heads,
            params.head_dim_qk,
            params.head_dim_v,
        );
        let (tq, tk) = (layout.q.tokens, layout.kv.tokens);
        check_shape("q", q.shape(), &[tq, h, dqk])?;
        check_shape("k", k.shape(), &[tk, hkv, dqk])?;
        check_shape("v", v.shape(), &[tk, hkv, dv])?;
        if let Some(d) = &d_o {
            check_shape("d_o", d.shape(), &[tq, h, dv])?;
        }
        params.bias.check(layout, h, params.mask, params.window)?;
        Ok(Problem {
            params,
            layout,
            q,
            k,
            v,
            d_o,
        })
    }
}

/// Checks the parameters on their own.
///
/// # Errors
/// The first parameter that is zero, a GQA ratio that does not divide, or a non-finite scale.
pub fn check_params(p: &AttnParams) -> Result<(), LayoutError> {
    for (field, value) in [
        ("num_heads", p.num_heads),
        ("num_gqa_groups", p.num_kv_heads),
        ("head_dim_qk", p.head_dim_qk),
        ("head_dim_v", p.head_dim_v),
    ] {
        if value == 0 {
            return Err(LayoutError::Zero { field, value });
        }
    }
    if !p.num_heads.is_multiple_of(p.num_kv_heads) {
        return Err(LayoutError::Gqa {
            num_heads: p.num_heads,
            num_kv_heads: p.num_kv_heads,
        });
    }
    if !p.scale.is_finite() {
        return Err(LayoutError::Scale { value: p.scale });
    }
    Ok(())
}

fn check_shape(tensor: &'static str, got: &[usize], expected: &[usize]) -> Result<(), LayoutError> {
    if got != expected {
        return Err(LayoutError::Shape {
            tensor,
            got: got.to_vec(),
            expected: expected.to_vec(),
        });
    }
    Ok(())
}
