//! What a GPU launch needs, shared by the CUDA and HIP backends: the kernel family, the
//! launch scalars and the raw device pointers, and how a call's config becomes them. The
//! argument lists built from them are `kernel_args`'s.

pub use super::score_terms::{BiasArgs, BiasKind, DropArgs};
use crate::config::AttnConfig;
use crate::workspace::Plan;
use smallseq_reference::{CausalAlign, Dtype, Layout, Side};

/// Largest head dim the fallback kernels take.
pub const FALLBACK_MAX_HEAD_DIM: usize = 512;
/// Head dims the small-seq kernels are instantiated for.
pub const SMALL_SEQ_HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// Longest side of a slot the small-seq kernels take (their fragments hold 32 query rows and
/// 24 keys, and `docs/semantics.md` §3.1 allows 17).
pub const SMALL_SEQ_MAX_ROWS: i32 = 17;

/// Head dims the tiled (matrix-core) fallback forward is instantiated for on CUDA.
pub const TILED_HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// Head dims the tiled fallback backward is instantiated for on CUDA.
pub const TILED_BWD_HEAD_DIMS: [usize; 3] = [64, 128, 256];
/// Above this head dim the tiled backward's key side splits each work item over two blocks, one
/// accumulating dV and one dK (`FtbParts` in kernels/fallback.cu): their two accumulators would
/// take every register of one thread.
pub const TILED_BWD_SPLIT_ABOVE: i32 = 128;

/// Which GPU backend launches: the tiled kernels each builds differ (kernels/fallback.cu
/// builds the tiled backward and the D = 256 tiled forward for CUDA only, their gfx942 compile
/// taking minutes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gpu {
    Cuda,
    Hip,
}

impl Gpu {
    /// The backend named `name`, if it is one of the two.
    pub fn named(name: &str) -> Option<Gpu> {
        match name {
            "cuda" => Some(Gpu::Cuda),
            "hip" => Some(Gpu::Hip),
            _ => None,
        }
    }

    /// Head dims of its tiled fallback forward.
    pub fn tiled_fwd_dims(self) -> &'static [usize] {
        match self {
            Gpu::Cuda => &TILED_HEAD_DIMS,
            Gpu::Hip => &TILED_HEAD_DIMS[..2],
        }
    }

    /// Head dims of its tiled fallback backward.
    pub fn tiled_bwd_dims(self) -> &'static [usize] {
        match self {
            Gpu::Cuda => &TILED_BWD_HEAD_DIMS,
            Gpu::Hip => &[],
        }
    }
}
/// Query rows per block of the tiled fallback forward (`FT_BM` in kernels/fallback.cu).
pub const TILED_ROWS: i32 = 64;
/// Fewest queries (longest slot) for which the tiled fallback forward is launched. On an H200
/// a block costs about 0.3 µs per (slot, head) whatever its rows, the scalar kernel about
/// 0.018 µs per (query, key) pair (bench/NOTES.md v4: 32768 slots of 1 query and 2–16 keys
/// took 8.4 ms tiled, 5.7 ms scalar; 4096 slots of 16/16, 1.3 ms and 18.9 ms): with up to 17
/// keys the two meet near 2 queries.
pub const TILED_MIN_QUERIES: i32 = 3;

/// Work items (logical warps) per block of the small-seq and scalar fallback kernels, as
/// `SS_WPB` / `FB_WPB` in the kernels.
pub const WARPS_PER_BLOCK: u32 = 4;

/// Which kernel family: one kernel file (`kernels/<stem>.cu`), one module or code object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    SmallSeq,
    Fallback,
}

impl Family {
    /// Both, in module order.
    pub const ALL: [Family; 2] = [Family::SmallSeq, Family::Fallback];

    /// Its kernel file's stem: `small_seq`, `fallback`.
    pub const fn stem(self) -> &'static str {
        match self {
            Family::SmallSeq => "small_seq",
            Family::Fallback => "fallback",
        }
    }
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
    /// Longest query side of a slot. It must bound every slot: the tiled fallback forward sizes
    /// its grid by it, and at most 1 selects the small-seq `_q1` kernels, which leave a longer
    /// slot's outputs unwritten.
    pub max_lq: i32,
    /// Longest key side of a slot.
    pub max_lk: i32,
    pub scale: f32,
    /// 0: none/padding, 1: causal top-left, 2: causal bottom-right.
    pub mask: i32,
    pub window: (i32, i32),
    /// Dropout (`docs/semantics.md` §1.8); only the scalar fallback kernels take it.
    pub drop: DropArgs,
    /// The additive bias (§1.9); only the scalar fallback kernels take it.
    pub bias: BiasArgs,
    /// The fallback backward takes D from the stored O (`FTB_D_FROM_O`): `fallback_bwd_delta`
    /// runs first, on `Ptrs::o` in the input type.
    pub d_from_o: bool,
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
    /// The bias's f32 tensor or slopes ([`BiasArgs`]).
    pub bias: u64,
    /// dBias `[Bb, Hb, Sq, Sk]`, in the output type.
    pub dbias: u64,
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
        max_lq: layout.q.max_len() as i32,
        max_lk: layout.kv.max_len() as i32,
        scale: p.scale as f32,
        mask: mask_code(cfg),
        window: (window_i32(p.window.left), window_i32(p.window.right)),
        drop: DropArgs::of(&p.dropout),
        bias: BiasArgs::of(&p.bias),
        d_from_o: false,
    }
}

impl LaunchDims {
    /// One slot of one head, one token a side, bf16 at D = 64, no mask, window, dropout or
    /// bias: the launch whose argument list stands for a kernel's signature
    /// (`gpu::plan::kernels`), and the base the tests vary.
    pub fn single_token() -> LaunchDims {
        LaunchDims {
            dtype: Dtype::Bf16,
            out_f32: false,
            b: 1,
            heads: 1,
            kv_heads: 1,
            dqk: 64,
            dv: 64,
            tq: 1,
            tk: 1,
            max_lq: 1,
            max_lk: 1,
            scale: 1.0,
            mask: 0,
            window: (-1, -1),
            drop: DropArgs::NONE,
            bias: BiasArgs::NONE,
            d_from_o: false,
        }
    }

    /// Whether every slot holds at most one query (W4's shape, TE's cross-attention of one
    /// token): such a small-seq launch takes the `_q1` kernels (`gpu::plan::small_seq_name`).
    pub fn one_query(&self) -> bool {
        self.max_lq <= 1
    }

    /// Kernel-name suffix of the element types (`bf16`, `f16_o32`, `f32`, …); f32 only where
    /// the family has f32 kernels (`allow_f32`).
    ///
    /// # Errors
    /// f32 where it is not allowed.
    pub fn dtype_suffix(&self, allow_f32: bool) -> Result<&'static str, String> {
        Ok(match (self.dtype, self.out_f32) {
            (Dtype::Bf16, false) => "bf16",
            (Dtype::F16, false) => "f16",
            (Dtype::Bf16, true) => "bf16_o32",
            (Dtype::F16, true) => "f16_o32",
            (Dtype::F32, _) if allow_f32 => "f32",
            (Dtype::F32, _) => return Err("small-seq kernels take bf16 or f16, not f32".into()),
        })
    }

    /// Why the small-seq kernels cannot take this launch, if they cannot.
    pub fn small_seq_unsupported(&self) -> Option<String> {
        let ok = self.heads == self.kv_heads
            && self.dqk == self.dv
            && SMALL_SEQ_HEAD_DIMS.contains(&(self.dqk as usize))
            && self.window.0 < 0
            && self.window.1 < 0
            && self.max_lq <= SMALL_SEQ_MAX_ROWS
            && self.max_lk <= SMALL_SEQ_MAX_ROWS;
        if self.drop.is_active() || self.bias.is_active() {
            return Some(
                "small-seq kernel: computes neither dropout nor bias (docs/semantics.md §1.8, \
                 §1.9)"
                    .into(),
            );
        }
        (!ok).then(|| {
            format!(
                "small-seq kernel: needs H == Hkv, Dqk == Dv in {}, no window and slots of at \
                 most {SMALL_SEQ_MAX_ROWS} tokens per side (got H={} Hkv={} Dqk={} Dv={} \
                 window=({}, {}) longest q {} kv {})",
                SMALL_SEQ_HEAD_DIMS.map(|d| d.to_string()).join(" or "),
                self.heads,
                self.kv_heads,
                self.dqk,
                self.dv,
                self.window.0,
                self.window.1,
                self.max_lq,
                self.max_lk
            )
        })
    }

    /// The tiled fallback forward's kernel name and query tiles per slot, when it takes this
    /// launch: 16-bit inputs, `Dqk == Dv` in [`TILED_HEAD_DIMS`], and some slot with at least
    /// [`TILED_MIN_QUERIES`] queries. Its grid is `heads * b * tiles` blocks of 4 logical warps.
    pub fn tiled_fwd(&self, gpu: Gpu) -> Option<(String, i32)> {
        let suffix = self.dtype_suffix(false).ok()?;
        let fits = self.dqk == self.dv
            && gpu.tiled_fwd_dims().contains(&(self.dqk as usize))
            && self.max_lq >= TILED_MIN_QUERIES
            // The tiled kernels leave dropout and bias to the scalar ones.
            && !self.drop.is_active()
            && !self.bias.is_active();
        fits.then(|| {
            (
                format!("fallback_fwd_tc_{suffix}_d{}", self.dqk),
                self.tiled_tiles(),
            )
        })
    }

    /// The tiled fallback backward's two kernels (query side, key side) and the key tiles per
    /// slot of the key side, where the tiled forward applies ([`LaunchDims::tiled_fwd`]) and
    /// the head dim is in [`TILED_BWD_HEAD_DIMS`]: so the kernel that
    /// [`LaunchDims::fallback_fwd_kernel`] names tells which arithmetic both directions took.
    /// The query side's grid is the forward's; the key side's is `kv_heads * b * key_tiles *
    /// parts` blocks ([`LaunchDims::tiled_bwd_kv_parts`]).
    pub fn tiled_bwd(&self, gpu: Gpu) -> Option<([String; 2], i32)> {
        let (fwd, _) = self.tiled_fwd(gpu)?;
        if !gpu.tiled_bwd_dims().contains(&(self.dqk as usize)) {
            return None;
        }
        let tail = fwd.strip_prefix("fallback_fwd_tc_")?;
        Some((
            [
                format!("fallback_bwd_q_tc_{tail}"),
                format!("fallback_bwd_kv_tc_{tail}"),
            ],
            self.tiled_key_tiles(),
        ))
    }

    /// Blocks per work item of the tiled backward's key side: 2 above
    /// [`TILED_BWD_SPLIT_ABOVE`] (a dV block and a dK block), else 1.
    pub fn tiled_bwd_kv_parts(&self) -> i64 {
        if self.dqk > TILED_BWD_SPLIT_ABOVE {
            2
        } else {
            1
        }
    }

    /// Key tiles per slot of the tiled backward's key side: the longest slot's.
    pub fn tiled_key_tiles(&self) -> i32 {
        (self.max_lk.max(0) + TILED_ROWS - 1) / TILED_ROWS
    }

    /// Dynamic shared memory of the tiled fallback backward (both kernels): two column tiles,
    /// and three f32 values per column (`FtbShape` in kernels/fallback.cu). Sized for rows
    /// padded by 32 elements (the shipped build's at D = 256, and everywhere with
    /// `FTB_SWIZZLE=0`): swizzled rows (D <= 128) take D elements, less.
    pub fn tiled_bwd_smem(&self) -> u32 {
        let d = self.dqk.max(0) as u32;
        let bn = if d > 64 { 32 } else { 64 };
        2 * bn * (d + 32) * 2 + 3 * bn * 4
    }

    /// Name of the fallback forward kernel this launch takes: the tiled one where
    /// [`LaunchDims::tiled_fwd`] applies, else the scalar `fallback_fwd_<dtype>`. The backward
    /// follows the same rule ([`LaunchDims::tiled_bwd`]).
    pub fn fallback_fwd_kernel(&self, gpu: Gpu) -> String {
        match self.tiled_fwd(gpu) {
            Some((name, _)) => name,
            None => format!("fallback_fwd_{}", self.dtype_suffix(true).unwrap_or("?")),
        }
    }

    /// Query tiles per slot of the tiled fallback forward: the longest slot's.
    pub fn tiled_tiles(&self) -> i32 {
        (self.max_lq.max(0) + TILED_ROWS - 1) / TILED_ROWS
    }

    /// Dynamic shared memory of the tiled fallback forward: one key tile of K and one of V, rows
    /// padded (`FtShape` in kernels/fallback.cu). Sized for 64-key tiles up to D = 128, the
    /// most any build of the kernel uses (above D = 64 it takes 32 unless `FT_BN_WIDE_D` says
    /// otherwise), and for 32 at D = 256 (`FT_BN_D256`, at most 32).
    pub fn tiled_fwd_smem(&self) -> u32 {
        let d = self.dqk.max(0) as u32;
        let keys = if d > 128 { 32 } else { 64 };
        keys * ((d + 32) + (d + 8)) * 2
    }

    /// Why the fallback kernels cannot take this launch, if they cannot.
    pub fn fallback_unsupported(&self) -> Option<String> {
        let max = FALLBACK_MAX_HEAD_DIM as i32;
        let ok = self.dqk <= max
            && self.dv <= max
            && self.kv_heads > 0
            && self.heads % self.kv_heads == 0;
        (!ok).then(|| {
            format!(
                "fallback kernel: head dims up to {max} and H % Hkv == 0 (got Dqk={} Dv={} H={} \
                 Hkv={})",
                self.dqk, self.dv, self.heads, self.kv_heads
            )
        })
    }
}

/// Device address of the fallback backward's `[tq, H]` f32 scratch region `name` in a
/// workspace of `ws_len` elements whose body starts at `base`.
///
/// # Errors
/// The plan lacks the region, or it is too small or past the workspace.
pub fn scratch_addr(
    plan: &Plan,
    name: &str,
    d: &LaunchDims,
    base: u64,
    ws_len: usize,
) -> Result<u64, String> {
    let need = (d.tq.max(0) as usize) * d.heads as usize;
    let region = plan
        .region(name)
        .ok_or_else(|| format!("fallback backward: the plan has no {name} region"))?;
    if region.len < need || region.offset + region.len > ws_len {
        return Err(format!(
            "fallback backward: {name} region holds {} of {need} elements (workspace {ws_len})",
            region.len
        ));
    }
    Ok(base + (region.offset * 4) as u64)
}

/// Launch scalars of 3 slots of 4 heads over 2 kv heads, 10 tokens a side, keys up to 17, for
/// the tests of this module and of `kernel_args`.
#[cfg(test)]
pub(crate) fn test_dims(dtype: Dtype, out_f32: bool, dqk: i32, dv: i32, max_lq: i32) -> LaunchDims {
    LaunchDims {
        dtype,
        out_f32,
        b: 3,
        heads: 4,
        kv_heads: 2,
        dqk,
        dv,
        tq: 10,
        tk: 10,
        max_lq,
        max_lk: 17,
        ..LaunchDims::single_token()
    }
}

#[cfg(test)]
mod tests {
    use super::test_dims as dims;
    use super::*;

    #[test]
    fn tiled_forward_takes_16_bit_square_heads_of_64_and_128() {
        let t = |d: LaunchDims| d.tiled_fwd(Gpu::Cuda);
        assert_eq!(
            t(dims(Dtype::Bf16, false, 128, 128, 512)),
            Some(("fallback_fwd_tc_bf16_d128".into(), 8))
        );
        assert_eq!(
            t(dims(Dtype::F16, true, 64, 64, 65)),
            Some(("fallback_fwd_tc_f16_o32_d64".into(), 2))
        );
        // Single-token queries stay on the scalar kernel (a tile would be 63/64 empty).
        assert_eq!(t(dims(Dtype::F16, false, 64, 64, 0)), None);
        assert_eq!(t(dims(Dtype::F16, false, 64, 64, 2)), None);
        assert_eq!(t(dims(Dtype::F16, false, 64, 64, 3)).map(|x| x.1), Some(1));
        assert_eq!(t(dims(Dtype::F32, false, 64, 64, 9)), None);
        assert_eq!(t(dims(Dtype::Bf16, false, 128, 64, 9)), None);
        assert_eq!(
            t(dims(Dtype::Bf16, false, 256, 256, 9)),
            Some(("fallback_fwd_tc_bf16_d256".into(), 1))
        );
        assert_eq!(t(dims(Dtype::Bf16, false, 96, 96, 9)), None);
    }

    #[test]
    fn tiled_backward_follows_the_forward_rule_and_tiles_the_keys() {
        let d = LaunchDims {
            max_lk: 130,
            ..dims(Dtype::F16, true, 64, 64, 65)
        };
        assert_eq!(
            d.tiled_bwd(Gpu::Cuda),
            Some((
                [
                    "fallback_bwd_q_tc_f16_o32_d64".to_string(),
                    "fallback_bwd_kv_tc_f16_o32_d64".to_string()
                ],
                3
            ))
        );
        assert_eq!(d.tiled_bwd_kv_parts(), 1);
        let wide = dims(Dtype::Bf16, false, 256, 256, 9);
        assert_eq!(
            wide.tiled_bwd(Gpu::Cuda).map(|x| x.0[1].clone()),
            Some("fallback_bwd_kv_tc_bf16_d256".to_string())
        );
        assert_eq!(wide.tiled_bwd_kv_parts(), 2);
        for no in [
            dims(Dtype::Bf16, false, 128, 128, 2),
            dims(Dtype::F32, false, 64, 64, 9),
            dims(Dtype::Bf16, false, 128, 64, 9),
        ] {
            assert_eq!(no.tiled_bwd(Gpu::Cuda), None);
        }
        assert_eq!((d.tiled_key_tiles(), d.tiled_tiles()), (3, 2));
    }

    #[test]
    fn hip_launches_the_tiled_forward_at_64_and_128_and_no_tiled_backward() {
        let d = |dim| dims(Dtype::Bf16, false, dim, dim, 100);
        assert!(d(128).tiled_fwd(Gpu::Hip).is_some());
        assert_eq!(d(256).tiled_fwd(Gpu::Hip), None);
        assert!(d(256).tiled_fwd(Gpu::Cuda).is_some());
        assert_eq!(d(128).tiled_bwd(Gpu::Hip), None);
        assert_eq!(d(256).fallback_fwd_kernel(Gpu::Hip), "fallback_fwd_bf16");
        assert_eq!(Gpu::named("hip"), Some(Gpu::Hip));
        assert_eq!(Gpu::named("cpu"), None);
    }

    #[test]
    fn tiled_backward_shared_memory_holds_two_padded_column_tiles() {
        // 64 columns at D = 64, 32 above; rows padded by 32 elements; lse, D, Z per column.
        assert_eq!(
            dims(Dtype::Bf16, false, 64, 64, 9).tiled_bwd_smem(),
            2 * 64 * 96 * 2 + 3 * 64 * 4
        );
        assert_eq!(
            dims(Dtype::Bf16, false, 128, 128, 9).tiled_bwd_smem(),
            2 * 32 * 160 * 2 + 3 * 32 * 4
        );
        assert_eq!(
            dims(Dtype::Bf16, false, 256, 256, 9).tiled_bwd_smem(),
            2 * 32 * 288 * 2 + 3 * 32 * 4
        );
        // Under the 48 KiB a launch gets without raising the limit.
        for d in TILED_BWD_HEAD_DIMS {
            let d = d as i32;
            assert!(dims(Dtype::Bf16, false, d, d, 9).tiled_bwd_smem() <= 48 * 1024);
        }
    }

    #[test]
    fn tiled_forward_shared_memory_holds_64_padded_key_rows_of_k_and_v() {
        // K rows padded by 32 elements, V rows by 8, 2 bytes each (kernels/fallback.cu).
        assert_eq!(
            dims(Dtype::Bf16, false, 128, 128, 1).tiled_fwd_smem(),
            64 * (160 + 136) * 2
        );
        assert_eq!(
            dims(Dtype::Bf16, false, 64, 64, 1).tiled_fwd_smem(),
            64 * (96 + 72) * 2
        );
        assert_eq!(
            dims(Dtype::Bf16, false, 256, 256, 1).tiled_fwd_smem(),
            32 * (288 + 264) * 2
        );
        // Under the 48 KiB a launch gets without raising the limit.
        for d in TILED_HEAD_DIMS {
            let d = d as i32;
            assert!(dims(Dtype::Bf16, false, d, d, 1).tiled_fwd_smem() <= 48 * 1024);
        }
    }

    #[test]
    fn fallback_forward_kernel_follows_the_longest_query_side() {
        let name =
            |max_lq| dims(Dtype::Bf16, false, 128, 128, max_lq).fallback_fwd_kernel(Gpu::Cuda);
        assert_eq!(name(2), "fallback_fwd_bf16");
        assert_eq!(name(3), "fallback_fwd_tc_bf16_d128");
        let f32_dims = dims(Dtype::F32, false, 128, 128, 9);
        assert_eq!(f32_dims.fallback_fwd_kernel(Gpu::Cuda), "fallback_fwd_f32");
    }

    #[test]
    fn small_seq_refuses_slots_longer_than_17() {
        let ok = LaunchDims {
            heads: 2,
            kv_heads: 2,
            ..dims(Dtype::F16, false, 64, 64, 17)
        };
        assert_eq!(ok.small_seq_unsupported(), None);
        let long_kv = LaunchDims { max_lk: 18, ..ok };
        assert!(long_kv.small_seq_unsupported().unwrap().contains("kv 18"));
        let long_q = LaunchDims { max_lq: 18, ..ok };
        assert!(long_q.small_seq_unsupported().unwrap().contains("q 18"));
    }
}
