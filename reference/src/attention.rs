//! The f64 reference: forward and backward of `docs/semantics.md` §1, block by block.

use crate::bias::AttnBias;
use crate::equations as eq;
use crate::layout::Layout;
use crate::problem::Problem;
use crate::slot::{block, transpose_into, Block, SlotGeom};
use crate::types::AttnParams;
use ndarray::{
    s, Array2, Array3, Array4, ArrayView1, ArrayView2, ArrayView3, ArrayViewMut1, ArrayViewMut2,
};
use std::cell::RefCell;

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
    /// The post-scale bias's `[Bb, Hb, Sq, Sk]` (`docs/semantics.md` §1.9): `dS` summed over
    /// the slots and heads sharing each entry, 0 where no slot reads one. `None` without such
    /// a bias.
    pub dbias: Option<Array4<f64>>,
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
        dbias: params.bias.grad_shape().map(Array4::zeros),
    });

    // The slot's index in the layout, not among the non-empty ones: the dropout mask is keyed
    // by it (§1.8).
    let slots: Vec<(usize, SlotGeom)> = (0..layout.slots())
        .map(|i| (i, SlotGeom::of(layout, i)))
        .filter(|(_, sg)| !sg.is_empty())
        .collect();
    let dropout = params.dropout.is_active().then_some(&params.dropout);
    WORKSPACE.with_borrow_mut(|w| {
        w.fit(params, slots.iter().map(|(_, sg)| sg));
        // Every scratch value read below is first written in the same block, so nothing
        // carries over from an earlier call.
        for &(slot, sg) in &slots {
            let (qr, kr) = (sg.off_q..sg.off_q + sg.lq, sg.off_kv..sg.off_kv + sg.lk);
            for hkv in 0..hkv_n {
                // The heads of a group share K and V: transpose them once.
                let b = block(sg, hkv * g, hkv, &q, &k, &v, d_o.as_ref());
                let ld = w.ld(sg.lk);
                transpose_into(&b.k, w.k_t(dqk, ld));
                if grads.is_some() {
                    transpose_into(&b.v, w.v_t(dv_n, ld));
                }
                // Heads in increasing order, so GQA sums accumulate in the same order as ever.
                for h in hkv * g..(hkv + 1) * g {
                    let b = block(sg, h, hkv, &q, &k, &v, d_o.as_ref());
                    w.dropped = dropout.is_some();
                    if let Some(d) = dropout {
                        let z = mat_mut(&mut w.z, sg.lq, w.ld).slice_move(s![.., ..sg.lk]);
                        eq::dropout_factors(d, slot, h_n, h, z);
                    }
                    block_forward(
                        params,
                        (slot, h),
                        &b,
                        w,
                        fwd.o.slice_mut(s![qr.clone(), h, ..]),
                        fwd.lse.slice_mut(s![qr.clone(), h]),
                    );
                    if let (Some(gr), Some(d_o)) = (grads.as_mut(), b.d_o) {
                        let dbias = gr.dbias.as_mut().map(|db| {
                            let bi = match &params.bias {
                                AttnBias::PostScale(t) => AttnBias::tensor_index(t, slot, h),
                                _ => (0, 0),
                            };
                            db.slice_mut(s![bi.0, bi.1, ..sg.lq, ..sg.lk])
                        });
                        block_backward(
                            params,
                            &b,
                            d_o,
                            w,
                            BlockGradients {
                                dq: gr.dq.slice_mut(s![qr.clone(), h, ..]),
                                dk: gr.dk.slice_mut(s![kr.clone(), hkv, ..]),
                                dv: gr.dv.slice_mut(s![kr.clone(), hkv, ..]),
                                dbias,
                            },
                        );
                    }
                }
            }
        }
        w.release_if_large();
    });
    (fwd, grads)
}

thread_local! {
    /// This thread's scratch, kept between calls so that a call allocates nothing but its
    /// outputs (per-call scratch showed up as page faults and allocator time).
    static WORKSPACE: RefCell<Workspace> = RefCell::new(Workspace::default());
}

/// Scratch sized for the largest slot seen and reused by every block: `Kᵀ`, `Vᵀ`, `S`/`P`,
/// `dP`/`dS` and the row vectors.
#[derive(Default)]
struct Workspace {
    k_t: Vec<f64>,
    v_t: Vec<f64>,
    p: Vec<f64>,
    ds: Vec<f64>,
    m: Vec<f64>,
    l: Vec<f64>,
    d: Vec<f64>,
    /// Dropout's factors `Z` and the dropped `P̃ = P ∘ Z`, sized only for a call with dropout.
    z: Vec<f64>,
    p_tilde: Vec<f64>,
    /// Row stride of the current block's `Kᵀ`, `Vᵀ`, `P` and `dS`.
    ld: usize,
    /// Whether the current block's `Z` is in `z` (a call with dropout).
    dropped: bool,
}

impl Workspace {
    /// Above this many f64s a call's scratch is freed when it returns, so that one long
    /// sequence does not pin megabytes in every thread that ever ran it.
    const KEEP: usize = 1 << 17;

    fn release_if_large(&mut self) {
        let n = [
            &self.k_t,
            &self.v_t,
            &self.p,
            &self.ds,
            &self.m,
            &self.l,
            &self.d,
            &self.z,
            &self.p_tilde,
        ]
        .iter()
        .map(|v| v.len())
        .sum::<usize>();
        if n > Workspace::KEEP {
            *self = Workspace::default();
        }
    }

    /// Grows the buffers to fit every block of `slots`.
    fn fit<'a>(&mut self, params: &AttnParams, slots: impl Iterator<Item = &'a SlotGeom> + Clone) {
        let lq = slots.clone().map(|s| s.lq).max().unwrap_or(0);
        let ld = Workspace::padded(slots.map(|s| s.lk).max().unwrap_or(0));
        let grow = |v: &mut Vec<f64>, n: usize| {
            if v.len() < n {
                v.resize(n, 0.0);
            }
        };
        grow(&mut self.k_t, params.head_dim_qk * ld);
        grow(&mut self.v_t, params.head_dim_v * ld);
        grow(&mut self.p, lq * ld);
        grow(&mut self.ds, lq * ld);
        grow(&mut self.m, lq);
        grow(&mut self.l, lq);
        grow(&mut self.d, lq);
        if params.dropout.is_active() {
            grow(&mut self.z, lq * ld);
            grow(&mut self.p_tilde, lq * ld);
        }
    }

    /// `Lk` rounded up to whole 4-wide vectors, so the score products need no column tail.
    fn padded(lk: usize) -> usize {
        lk.next_multiple_of(4)
    }

    /// Sets the row stride for a block of `lk` keys and returns it.
    fn ld(&mut self, lk: usize) -> usize {
        self.ld = Workspace::padded(lk);
        self.ld
    }

    fn k_t(&mut self, d: usize, ld: usize) -> ArrayViewMut2<'_, f64> {
        ArrayViewMut2::from_shape((d, ld), &mut self.k_t[..d * ld]).expect("k_t fits")
    }

    fn v_t(&mut self, d: usize, ld: usize) -> ArrayViewMut2<'_, f64> {
        ArrayViewMut2::from_shape((d, ld), &mut self.v_t[..d * ld]).expect("v_t fits")
    }
}

/// `[rows, ld]` matrix at the start of `buf`.
fn mat(buf: &[f64], rows: usize, ld: usize) -> ArrayView2<'_, f64> {
    ArrayView2::from_shape((rows, ld), &buf[..rows * ld]).expect("scratch fits")
}

fn mat_mut(buf: &mut [f64], rows: usize, ld: usize) -> ArrayViewMut2<'_, f64> {
    ArrayViewMut2::from_shape((rows, ld), &mut buf[..rows * ld]).expect("scratch fits")
}

/// Forward of one (slot, head) block: `o` and `lse` into the outputs, `P` left in `w.p`
/// for the backward pass.
fn block_forward<T: Copy + Into<f64>>(
    params: &AttnParams,
    (slot, head): (usize, usize),
    b: &Block<'_, T>,
    w: &mut Workspace,
    o: ArrayViewMut2<'_, f64>,
    lse: ArrayViewMut1<'_, f64>,
) {
    let (lq, lk, ld) = (b.q.nrows(), b.k.nrows(), w.ld);
    let k_t = mat(&w.k_t, b.k.ncols(), ld);
    let mut s = mat_mut(&mut w.p, lq, ld);
    eq::scores(b.q.view(), k_t, params.scale, s.view_mut());
    // The columns past `Lk` are padding of the transposed keys, not scores.
    let mut s = s.slice_move(s![.., ..lk]);
    eq::add_bias(s.view_mut(), &params.bias, slot, head);
    eq::apply_mask(s.view_mut(), params.mask, params.window);
    let m = ArrayViewMut1::from(&mut w.m[..lq]);
    eq::row_max(s.view(), m);
    let (m, l) = (
        ArrayView1::from(&w.m[..lq]),
        ArrayViewMut1::from(&mut w.l[..lq]),
    );
    eq::softmax(s.view_mut(), m, l);
    eq::lse(m, ArrayView1::from(&w.l[..lq]), lse);
    if w.dropped {
        let z = mat(&w.z, lq, ld).slice_move(s![.., ..lk]);
        let mut pt = mat_mut(&mut w.p_tilde, lq, ld).slice_move(s![.., ..lk]);
        eq::apply_dropout(s.view(), z, pt.view_mut());
        eq::output(pt.view(), b.v.view(), o);
    } else {
        eq::output(s.view(), b.v.view(), o);
    }
}

/// Where one block's gradients go: `dq` is this head's, `dk` and `dv` are shared by the
/// heads of a GQA group and accumulate.
struct BlockGradients<'a> {
    dq: ArrayViewMut2<'a, f64>,
    dk: ArrayViewMut2<'a, f64>,
    dv: ArrayViewMut2<'a, f64>,
    /// This block's corner of dBias, shared by the slots and heads its bias broadcasts over.
    dbias: Option<ArrayViewMut2<'a, f64>>,
}

/// Backward of one (slot, head) block, from the `P` that [`block_forward`] left in `w.p`.
fn block_backward<T: Copy + Into<f64>>(
    params: &AttnParams,
    b: &Block<'_, T>,
    d_o: ArrayView2<'_, T>,
    w: &mut Workspace,
    out: BlockGradients<'_>,
) {
    let (lq, lk, ld) = (b.q.nrows(), b.k.nrows(), w.ld);
    let p = mat(&w.p, lq, ld).slice_move(s![.., ..lk]);
    let mut ds = mat_mut(&mut w.ds, lq, ld);
    eq::d_p(d_o.view(), mat(&w.v_t, d_o.ncols(), ld), ds.view_mut());
    let mut ds = ds.slice_move(s![.., ..lk]);
    // With dropout, dV takes the dropped P̃ and dP is masked and rescaled; D = Σ P·dP is then
    // still rowsum(dO ∘ O), and dS = P·(dP − D) takes the undropped P.
    let p_v = if w.dropped {
        eq::mask_d_p(ds.view_mut(), mat(&w.z, lq, ld).slice_move(s![.., ..lk]));
        mat(&w.p_tilde, lq, ld).slice_move(s![.., ..lk])
    } else {
        p
    };
    eq::d_rowsum(p, ds.view(), ArrayViewMut1::from(&mut w.d[..lq]));
    eq::d_s(p, ds.view_mut(), ArrayView1::from(&w.d[..lq]));
    if let Some(db) = out.dbias {
        eq::d_bias(ds.view(), db);
    }
    eq::d_q(ds.view(), b.k.view(), params.scale, out.dq);
    eq::d_k(ds.view(), b.q.view(), params.scale, out.dk);
    eq::d_v(p_v, d_o, out.dv);
}
