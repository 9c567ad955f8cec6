//! What a GPU launch needs, shared by the CUDA and HIP backends: the kernel family, the
//! launch scalars and the raw device pointers, and how a call's config becomes them.

use crate::config::AttnConfig;
use smallseq_reference::{CausalAlign, Dtype, Layout, Side};

/// Which kernel family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    SmallSeq,
    Fallback,
}

/// Scalars of one launch (shared by forward and backward).
#[derive(Clone, Copy, Debug)]
pub struct LaunchDims {
    pub dtype: Dtype,
    /// Outputs are f32 (values rounded to `dtype`) instead of `dtype`.
    pub out_f32: bool,
    pub b: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub dqk: i32,
    pub dv: i32,
    /// Query / key tokens the kernels can address (`off_q[b]`, `off_kv[b]`).
    pub tq: i64,
    pub tk: i64,
    pub scale: f32,
    /// 0: none/padding, 1: causal top-left, 2: causal bottom-right.
    pub mask: i32,
    pub window: (i32, i32),
}

/// Raw device pointers of one launch; 0 where unused.
#[derive(Clone, Copy, Debug, Default)]
pub struct Ptrs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub d_o: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    /// f32 `[tq, H]` scratch for the fallback backward.
    pub delta: u64,
    /// f32 `[tq, H]` scratch for the fallback backward (row sums of the recomputed P).
    pub rowsum: u64,
    pub cu_q: u64,
    pub cu_kv: u64,
    pub off_q: u64,
    pub off_kv: u64,
}

/// Mask code of the kernels.
pub fn mask_code(cfg: &AttnConfig) -> i32 {
    match cfg.params.mask.causal() {
        None => 0,
        Some(CausalAlign::TopLeft) => 1,
        Some(CausalAlign::BottomRight) => 2,
    }
}

fn window_i32(w: i64) -> i32 {
    if w < 0 {
        -1
    } else {
        w.min(i32::MAX as i64) as i32
    }
}

/// Launch scalars of a call.
pub fn dims_of(cfg: &AttnConfig, layout: &Layout, out_f32: bool) -> LaunchDims {
    let p = &cfg.params;
    let last = |s: &Side| *s.offsets().last().unwrap_or(&0) as i64;
    LaunchDims {
        dtype: cfg.dtype,
        out_f32,
        b: layout.slots() as i32,
        heads: p.num_heads as i32,
        kv_heads: p.num_kv_heads as i32,
        dqk: p.head_dim_qk as i32,
        dv: p.head_dim_v as i32,
        tq: last(&layout.q),
        tk: last(&layout.kv),
        scale: p.scale as f32,
        mask: mask_code(cfg),
        window: (window_i32(p.window.left), window_i32(p.window.right)),
    }
}
