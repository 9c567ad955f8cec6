//! The f64 reference: forward and backward of `semantics.md` §1, block by block.

use crate::equations as eq;
use crate::layout::Layout;
use crate::problem::Problem;
use crate::slot::{block, Block, SlotGeom};
use crate::types::AttnParams;
use ndarray::{s, Array2, Array3, ArrayView3};

/// Forward outputs over the whole buffers.
#[derive(Clone, Debug, PartialEq)]
pub struct Forward {
    /// `[Tq, H, Dv]`; exactly 0 at don't-care tokens and for rows with no visible key.
    pub o: Array3<f64>,
    /// `[Tq, H]`; `-inf` at don't-care tokens and for rows with no visible key.
    pub lse: Array2<f64>,
}

/// Gradients of `L = Σ o ∘ d_o` over the whole buffers; exactly 0 at don't-care tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct Gradients {
    /// `[Tq, H, Dqk]`
    pub dq: Array3<f64>,
    /// `[Tk, Hkv, Dqk]`
    pub dk: Array3<f64>,
    /// `[Tk, Hkv, Dv]`
    pub dv: Array3<f64>,
}

/// Forward pass of `p` in f64.
pub fn forward(p: &Problem) -> Forward {
    forward_backward_views(p.params, p.layout, p.q, p.k, p.v, None).0
}

/// Forward pass, and the gradients when `p.d_o` is present.
pub fn forward_backward(p: &Problem) -> (Forward, Option<Gradients>) {
    forward_backward_views(p.params, p.layout, p.q, p.k, p.v, p.d_o)
}

/// [`forward_backward`] on inputs of any element type that upcasts to f64; f64 inputs let
/// finite differences perturb `q`, `k`, `v` by amounts no f32 can hold.
///
/// # Panics
/// If the shapes disagree with `params` and `layout` (what [`Problem::new`] checks).
pub fn forward_backward_views<T: Copy + Into<f64>>(
    params: &AttnParams,
    layout: &Layout,
    q: ArrayView3<'_, T>,
    k: ArrayView3<'_, T>,
    v: ArrayView3<'_, T>,
    d_o: Option<ArrayView3<'_, T>>,
) -> (Forward, Option<Gradients>) {
    let (h_n, hkv_n) = (params.num_heads, params.num_kv_heads);
    let (dqk, dv_n) = (params.head_dim_qk, params.head_dim_v);
    let (tq, tk) = (layout.q.tokens, layout.kv.tokens);
    assert_eq!(q.shape(), [tq, h_n, dqk], "q shape");
    assert_eq!(k.shape(), [tk, hkv_n, dqk], "k shape");
    assert_eq!(v.shape(), [tk, hkv_n, dv_n], "v shape");
    if let Some(d) = &d_o {
        assert_eq!(d.shape(), [tq, h_n, dv_n], "d_o shape");
    }
    let g = params.group_size();

    // Start from the don't-care values; valid rows are overwritten below.
    let mut fwd = Forward {
        o: Array3::zeros((tq, h_n, dv_n)),
        lse: Array2::from_elem((tq, h_n), f64::NEG_INFINITY),
    };
    let mut grads = d_o.as_ref().map(|_| Gradients {
        dq: Array3::zeros((tq, h_n, dqk)),
        dk: Array3::zeros((tk, hkv_n, dqk)),
        dv: Array3::zeros((tk, hkv_n, dv_n)),
    });

    for i in 0..layout.slots() {
        let sg = SlotGeom::of(layout, i);
        if sg.is_empty() {
            continue;
        }
        for h in 0..h_n {
            let b = block(sg, h, h / g, &q, &k, &v, d_o.as_ref());
            let (qr, kr) = (sg.off_q..sg.off_q + sg.lq, sg.off_kv..sg.off_kv + sg.lk);
            let bf = block_forward(params, &b);
            fwd.o.slice_mut(s![qr.clone(), h, ..]).assign(&bf.o);
            fwd.lse.slice_mut(s![qr.clone(), h]).assign(&bf.lse);
            if let (Some(gr), Some(d_o)) = (grads.as_mut(), b.d_o.as_ref()) {
                let bg = block_backward(params, &b, &bf.p, d_o);
                gr.dq.slice_mut(s![qr, h, ..]).assign(&bg.dq);
                // GQA: the heads of a group share kv rows, their gradients add up.
                let mut dk = gr.dk.slice_mut(s![kr.clone(), h / g, ..]);
                dk += &bg.dk;
                let mut dv = gr.dv.slice_mut(s![kr, h / g, ..]);
                dv += &bg.dv;
            }
        }
    }
    (fwd, grads)
}

/// Forward results of one (slot, head) block; `p` is kept for the backward pass.
struct BlockForward {
    o: Array2<f64>,
    lse: ndarray::Array1<f64>,
    p: Array2<f64>,
}

fn block_forward(params: &AttnParams, b: &Block) -> BlockForward {
    let mut s = eq::scores(&b.q, &b.k, params.scale);
    eq::apply_mask(&mut s, params.mask, params.window);
    let m = eq::row_max(&s);
    let (p, l) = eq::softmax(&s, &m);
    let lse = eq::lse(&m, &l);
    let o = eq::output(&p, &b.v);
    BlockForward { o, lse, p }
}

struct BlockGradients {
    dq: Array2<f64>,
    dk: Array2<f64>,
    dv: Array2<f64>,
}

fn block_backward(
    params: &AttnParams,
    b: &Block,
    p: &Array2<f64>,
    d_o: &Array2<f64>,
) -> BlockGradients {
    let dp = eq::d_p(d_o, &b.v);
    let d = eq::d_rowsum(p, &dp);
    let ds = eq::d_s(p, &dp, &d);
    BlockGradients {
        dq: eq::d_q(&ds, &b.k, params.scale),
        dk: eq::d_k(&ds, &b.q, params.scale),
        dv: eq::d_v(p, d_o),
    }
}
